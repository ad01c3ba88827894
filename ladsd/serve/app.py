"""The aiohttp application: the HTTP edge (middlewares, limits), reading a JSON body.

Every refusal leaves as OpenAI's error body (:mod:`.errors`), whatever raised
it: an :class:`ApiError`, aiohttp's own HTTP exceptions (404 route, 405, 413
body too large), a dead engine (503) or a bug (500: logged with a short id,
the body says only "internal error" and the id). A client that went away is
logged at debug, never as an error.

Security model:

* **Tenants.** Every API key belongs to a tenant (``--api-key``: the tenant
  ``default``; ``--api-keys FILE``: ``tenant key`` lines, a tenant may have
  several keys). Without a key (loopback only) every client is the tenant
  ``local``. Every route but ``/health`` needs ``Authorization: Bearer <key>``
  (the scheme in any case, RFC 9110) once a key is configured.
* **Browsers.** On a loopback bind a ``Host`` that is not a loopback name or
  address with the server's port (DNS rebinding) and an ``Origin`` that is
  not this server are refused (403), as Jupyter and Docker do; POST bodies
  must be ``application/json`` (415), which no page can send without a CORS
  preflight that this server never grants.
* **Limits.** Idle keep-alive connections and unfinished request heads are
  closed after ``keepalive_s``; a body must arrive within ``body_timeout_s``
  (408); past ``max_connections`` open connections a new one is answered 503
  and closed (refused, not queued).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from yarl import URL

from ladsd.engine.thread import EngineDead
from ladsd.serve.errors import ApiError
from ladsd.serve.responses import dumps, error_response

log = logging.getLogger("ladsd.serve")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/health"})  # answered without the API key (liveness probes)
LOCAL = "local"  # the one tenant of a daemon without keys (reserved in key files)
DEFAULT_TENANT = "default"  # the tenant of --api-key
_TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # no "/": it separates engine workflow ids
_KEY = re.compile(r"^[!-~]{1,512}$")  # visible ASCII: a bearer token
TENANT: web.RequestKey[str] = web.RequestKey("ladsd.tenant", str)
# The tenant of the request being handled (each aiohttp request runs in its own task,
# hence its own context): events published while handling it belong to it.
REQUEST_TENANT: ContextVar[str | None] = ContextVar("ladsd_request_tenant", default=None)
JSON_TYPES = frozenset({"application/json"})


@dataclass(frozen=True)
class Limits:
    """Connection limits of the HTTP server (slow or idle clients cannot hold it)."""

    keepalive_s: float = 30.0  # idle keep-alive connection or unfinished request head: closed
    body_timeout_s: float = 30.0  # a request body must arrive within this (408)
    # open connections; more are answered 503 and closed (below a 1,024-fd soft limit)
    max_connections: int = 512
    max_event_streams: int = 64  # GET /v1/events subscribers; more get 429

    def __post_init__(self) -> None:
        if min(self.keepalive_s, self.body_timeout_s) <= 0:
            raise ValueError("keepalive_s and body_timeout_s must be > 0")
        if min(self.max_connections, self.max_event_streams) < 1:
            raise ValueError("max_connections and max_event_streams must be >= 1")


LIMITS: web.AppKey[Limits] = web.AppKey("ladsd.limits", Limits)


async def read_json(request: web.Request) -> Any:
    """The request body as JSON: 415 unless ``application/json``, 408 if it does not
    arrive within the body timeout, 413 above the body limit, 400 if not JSON."""
    if request.content_type not in JSON_TYPES:
        raise ApiError(
            415,
            f"the body must be JSON sent as Content-Type: application/json, not "
            f"{request.content_type!r} (curl: --json, or -H 'content-type: application/json')",
            code="unsupported_media_type",
        )
    limits = request.app.get(LIMITS) or Limits()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            raw = await request.read()  # raises HTTPRequestEntityTooLarge above client_max_size
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {limits.body_timeout_s:g} s",
            code="request_timeout",
        ) from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e)
    except EngineDead as e:
        return error_response(ApiError(503, f"the engine is down: {e}", code="engine_dead"))
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(ApiError(413, e.text or "request body too large", code="too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = e.reason if e.status != 404 else f"no route {request.method} {request.path}"
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return error_response(ApiError(e.status, msg, headers=allow))
    except ConnectionError as e:
        if _gone(request):  # the client went away mid-answer: normal, nothing to answer
            log.debug("%s %s: the client went away (%s)", request.method, request.path, e)
            return web.Response(status=204)  # never sent: aiohttp sees the closed transport
        return _internal(request, e)
    except Exception as e:
        return _internal(request, e)


def _gone(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


def _internal(request: web.Request, e: Exception) -> web.Response:
    """A bug: logged with a short id; the body says only that (never the exception's text)."""
    ref = secrets.token_hex(4)
    log.error("internal error %s in %s %s", ref, request.method, request.path, exc_info=e)
    return error_response(ApiError(500, f"internal error (id {ref}, in the daemon's log)"))


# ---- who is asking: keys and tenants ------------------------------------------------------


def key_table(api_key: str | None, pairs: Iterable[tuple[str, str]] = ()) -> dict[str, str]:
    """API key -> tenant: ``api_key`` is the tenant ``default``'s, ``pairs`` are
    ``(tenant, key)``. ValueError for a bad tenant name or key, or a key given twice."""
    out: dict[str, str] = {}
    given = [(DEFAULT_TENANT, api_key)] if api_key else []
    for tenant, key in [*given, *pairs]:
        if not _TENANT_NAME.match(tenant) or tenant == LOCAL:
            raise ValueError(f"tenant {tenant!r}: 1-64 of A-Z a-z 0-9 _ . - and not {LOCAL!r}")
        if not _KEY.match(key):
            raise ValueError(f"tenant {tenant!r}: a key is 1-512 visible ASCII characters")
        if key in out:
            raise ValueError(f"tenants {out[key]!r} and {tenant!r} have the same key")
        out[key] = tenant
    return out


def read_key_file(path: str | Path) -> tuple[tuple[str, str], ...]:
    """``tenant key`` per line (``#`` comments and blank lines skipped) -> (tenant, key) pairs."""
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2:
            raise ValueError(f"{path}:{n}: expected 'tenant key'")
        pairs.append((words[0], words[1]))
    key_table(None, pairs)  # the checks, with the line's file for context
    if not pairs:
        raise ValueError(f"{path}: no 'tenant key' line")
    return tuple(pairs)


def bearer(value: str) -> bytes | None:
    """The token of ``Authorization: Bearer <token>`` (scheme in any case), else None."""
    if not value.isascii():
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    return token.encode() if scheme.lower() == "bearer" and token else None


def tenant_of(request: web.Request) -> str:
    """The tenant the request's key belongs to (set by the :func:`auth` middleware)."""
    return request[TENANT]


def auth(keys: Mapping[str, str]) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The bearer-key check on every route but :data:`OPEN_PATHS`: sets the request's
    tenant (:data:`LOCAL` without keys). Every key is compared, in constant time each."""
    table = [(k.encode(), t) for k, t in keys.items()]

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        tenant = LOCAL
        if table and request.path not in OPEN_PATHS:
            got = bearer(request.headers.get("Authorization", "")) or b""
            found = None
            for key, name in table:
                if hmac.compare_digest(got, key):
                    found = name
            if found is None:
                raise ApiError(
                    401,
                    "missing or wrong API key (send Authorization: Bearer <key>)",
                    code="invalid_api_key",
                )
            tenant = found
        request[TENANT] = tenant
        REQUEST_TENANT.set(tenant)
        return await handler(request)

    return check


# ---- browsers: Host and Origin on a loopback bind ------------------------------------------


def _names_this_server(url: URL, port: int | None) -> bool:
    """``url`` (an ``http://`` Host or an Origin) names a loopback host (on ``port`` if given)."""
    host = url.host
    if host is None or url.user or url.query_string or url.fragment or url.path not in ("", "/"):
        return False
    return is_loopback(host) and (port is None or url.port == port)


def _bad_host(request: web.Request) -> bool:
    host = request.headers.get("Host")
    if host is None:
        return False  # HTTP/1.0 without Host: no browser sends that
    try:
        # Any port: a forwarded port (ssh -L, kubectl port-forward) names another one, and
        # the host name alone tells a rebinding attacker's domain apart.
        return not _names_this_server(URL(f"http://{host}"), None)
    except ValueError:
        return True


def _bad_origin(request: web.Request, port: int | None) -> bool:
    origin = request.headers.get("Origin")
    if origin is None:
        return False  # not a browser's cross-origin request (curl, SDKs)
    try:
        url = URL(origin)
    except ValueError:
        return True
    return url.scheme not in ("http", "https") or not _names_this_server(url, port)


@web.middleware
async def loopback_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """403 for a foreign ``Host`` (DNS rebinding) or ``Origin`` (a web page)."""
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    port = sock[1] if sock else None
    if _bad_host(request):
        raise ApiError(
            403,
            "the Host header must name a loopback host (e.g. 127.0.0.1:<port>)",
            code="foreign_host",
        )
    if _bad_origin(request, port):
        raise ApiError(
            403, "requests from a web page of another origin are refused", code="foreign_origin"
        )
    return await handler(request)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: may resolve anywhere
        return False


def check_bind(host: str, key: str | None, keys: Iterable[tuple[str, str]] = ()) -> None:
    """Refuse a non-loopback address without an API key (ValueError says why)."""
    if not is_loopback(host) and not key and not tuple(keys):
        raise ValueError(
            f"binding {host} (not loopback) needs an API key: pass --api-key "
            "(or set LADSD_API_KEY) or --api-keys FILE; clients then send "
            "Authorization: Bearer <key>"
        )


def make_app(
    *,
    max_body_bytes: int,
    keys: Mapping[str, str],
    loopback: bool,
    limits: Limits | None = None,
) -> web.Application:
    """The app with its middlewares: ``keys`` maps each API key to its tenant (none:
    one local tenant); ``loopback`` adds the Host/Origin guard."""
    # errors outermost, so a refused Host or key gets OpenAI's error body too
    guard = [loopback_guard] if loopback else []
    app = web.Application(client_max_size=max_body_bytes, middlewares=[errors, *guard, auth(keys)])
    app[LIMITS] = limits or Limits()
    return app


# ---- the server: runner and a site with a connection cap ------------------------------------


def make_runner(app: web.Application, drain_s: float) -> web.AppRunner:
    """aiohttp's runner with the app's :class:`Limits` (aiohttp keeps an idle connection
    3,630 s by default; its keep-alive timer also cuts a request head that never ends)."""
    return web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        handler_cancellation=True,  # a client that goes away cancels its handler
        shutdown_timeout=drain_s,
        keepalive_timeout=app[LIMITS].keepalive_s,
    )


def _full_response() -> bytes:
    body = dumps(
        ApiError(503, "too many open connections; retry later", code="too_many_connections").body()
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Refused(asyncio.Protocol):
    """A connection past the cap: 503, half-close, drop what it sends, gone within 2 s."""

    def __init__(self) -> None:
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_full_response())
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(2.0, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # its request is not read: the answer is already out

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class CappedSite(web.BaseSite):
    """A TCP site whose runner serves at most ``cap`` connections at once; a new one past
    that is refused (503 and closed), not queued. The count is the runner's open
    connections when the new one is accepted."""

    __slots__ = ("_host", "_port", "_cap", "refused")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, cap: int) -> None:
        super().__init__(runner)
        self._host, self._port, self._cap = host, port, cap
        self.refused = 0

    @property
    def name(self) -> str:
        return str(URL.build(scheme="http", host=self._host, port=self.port))

    @property
    def port(self) -> int:
        """The bound port (the asked one before :meth:`start`)."""
        if self._server is not None and self._server.sockets:
            return int(self._server.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None

        def protocol() -> asyncio.BaseProtocol:
            if len(server.connections) >= self._cap:
                self.refused += 1
                return _Refused()
            return server()

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            protocol, self._host, self._port, backlog=self._backlog
        )
