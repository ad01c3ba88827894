"""The aiohttp application: error and API-key middlewares, JSON and SSE helpers.

Every refusal leaves as OpenAI's error body (:mod:`.errors`), whatever raised
it: an :class:`ApiError`, aiohttp's own HTTP exceptions (404 route, 405, 413
body too large), a dead engine (503) or a bug (500, logged). With an API key
every route but ``/health`` needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

import orjson
from aiohttp import web

from ladsd.engine.thread import EngineDead
from ladsd.serve.errors import ApiError

log = logging.getLogger("ladsd.serve")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
DAEMON: web.AppKey[Any] = web.AppKey("ladsd.daemon", object)  # the Daemon, for handlers
OPEN_PATHS = frozenset({"/health"})  # answered without the API key (liveness probes)


def _default(o: Any) -> Any:
    if isinstance(o, Enum):
        return o.value
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    raise TypeError(type(o).__name__)


def dumps(data: Any) -> bytes:
    return orjson.dumps(data, default=_default)


def json_response(
    data: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=dumps(data), status=status, content_type="application/json", headers=headers
    )


def error_response(e: ApiError) -> web.Response:
    return json_response(e.body(), e.status, e.headers or None)


async def read_json(request: web.Request) -> Any:
    """The request body as JSON (413 above the body limit, 400 if not JSON)."""
    raw = await request.read()  # raises HTTPRequestEntityTooLarge above client_max_size
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event (``data: [DONE]`` when ``data`` is that string)."""
    body = data.encode() if isinstance(data, str) else dumps(data)
    head = b"event: %s\n" % event.encode() if event else b""
    return head + b"data: " + body + b"\n\n"


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not buffer a stream
        }
    )
    await resp.prepare(request)
    return resp


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
    except (ConnectionResetError, ConnectionError):
        raise  # the client went away: nothing to answer
    except Exception as e:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))


def api_key(key: str | None) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Bearer-token check (constant-time) on every route but :data:`OPEN_PATHS`."""
    expect = f"Bearer {key}".encode() if key else b""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if key and request.path not in OPEN_PATHS:
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, expect):
                raise ApiError(
                    401,
                    "missing or wrong API key (send Authorization: Bearer <key>)",
                    code="invalid_api_key",
                )
        return await handler(request)

    return check


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: may resolve anywhere
        return False


def check_bind(host: str, key: str | None) -> None:
    """Refuse a non-loopback address without an API key (ValueError says why)."""
    if not is_loopback(host) and not key:
        raise ValueError(
            f"binding {host} (not loopback) needs an API key: pass --api-key "
            "(or set LADSD_API_KEY); clients then send Authorization: Bearer <key>"
        )


def make_app(*, max_body_bytes: int, key: str | None) -> web.Application:
    # errors outermost, so a refused key gets OpenAI's error body too
    return web.Application(client_max_size=max_body_bytes, middlewares=[errors, api_key(key)])
