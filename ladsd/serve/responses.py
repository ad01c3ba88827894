"""JSON and SSE responses: bodies, and stream writes bounded by a timeout.

Every JSON body is orjson's (enums as their values, dataclasses as dicts). A
stream write that the reader takes none of within its timeout drops the
connection (:class:`StalledReader`): a client that stops reading holds no
slot, subscription or buffer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from enum import Enum
from typing import Any

import orjson
from aiohttp import web

from ladsd.serve.errors import ApiError


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


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event (``data: [DONE]`` when ``data`` is that string)."""
    body = data.encode() if isinstance(data, str) else dumps(data)
    head = b"event: %s\n" % event.encode() if event else b""
    return head + b"data: " + body + b"\n\n"


WRITE_TIMEOUT_S = 30.0  # ServeConfig.write_timeout_s's default


class StalledReader(ConnectionResetError):
    """A stream's reader took nothing for the write timeout: dropped as if it had gone."""


async def write_within(
    request: web.Request,
    resp: web.StreamResponse,
    data: bytes,
    timeout: float = WRITE_TIMEOUT_S,
    *,
    eof: bool = False,
) -> None:
    """One write of a stream (or its end, ``eof``), bounded by ``timeout`` seconds.

    A reader that takes none of it in time is dropped (its connection aborted, with
    what it never read) and :class:`StalledReader` raised: a client that stops reading
    must not hold its slot, its subscription or its buffers forever.
    """
    try:
        async with asyncio.timeout(timeout):
            await (resp.write_eof(data) if eof else resp.write(data))
    except TimeoutError:
        if (t := request.transport) is not None:
            t.abort()
        raise StalledReader(f"the client read nothing for {timeout:g} s") from None


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
