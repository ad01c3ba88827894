"""Receiver -> sender control messages on the link's TCP connection: acks and nacks.

Wire format: a 2-byte big-endian body length, then ``>BBIId32sH`` (kind,
reason, turn, version, c, payload digest, workflow-id length) and the
workflow id (utf-8). ``c`` is the complete-receipt time on ``ladsd.clock``
(sender and receiver share one process, so one clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass
from enum import IntEnum

from ladsd.records import ContinuationId
from ladsd.transport.errors import ControlError


class Kind(IntEnum):
    ACK = 1
    NACK = 2


class Reason(IntEnum):
    OK = 0
    DUPLICATE = 1  # ack: already registered (the first ack was lost)
    DIGEST = 2  # nack: payload digest mismatch
    CODEC = 3  # nack: unknown codec, or payload does not decode
    BINDING = 4  # nack: the registration callback refused the binding
    ERROR = 5  # nack: the registration callback failed


@dataclass(frozen=True)
class Control:
    """One ack/nack, receiver -> sender. ``c``: complete receipt (first one, for a duplicate)."""

    kind: Kind
    reason: Reason
    cid: ContinuationId
    payload_digest: str
    c: float


_LEN = struct.Struct(">H")
_CTRL = struct.Struct(">BBIId32sH")  # kind, reason, turn, version, c, payload digest, wf length


def encode_control(msg: Control) -> bytes:
    wf = msg.cid.workflow.encode("utf-8")
    body = (
        _CTRL.pack(
            msg.kind,
            msg.reason,
            msg.cid.turn,
            msg.cid.version,
            msg.c,
            bytes.fromhex(msg.payload_digest),
            len(wf),
        )
        + wf
    )
    return _LEN.pack(len(body)) + body


def decode_control(body: bytes) -> Control:
    """One control message body (without its 2-byte length)."""
    if len(body) < _CTRL.size:
        raise ControlError(f"control message of {len(body)} bytes is too short")
    kind, reason, turn, version, c, pd, wf_len = _CTRL.unpack_from(body)
    if len(body) != _CTRL.size + wf_len:
        raise ControlError("control message length does not match its workflow id")
    try:
        return Control(
            Kind(kind),
            Reason(reason),
            ContinuationId(body[_CTRL.size :].decode("utf-8"), turn, version),
            pd.hex(),
            c,
        )
    except (ValueError, UnicodeDecodeError) as e:
        raise ControlError(f"malformed control message: {e}") from None


def nodelay(writer: asyncio.StreamWriter) -> None:
    """Small writes go out at once (no Nagle delay on 512 B chunks and acks)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def read_control(reader: asyncio.StreamReader) -> tuple[Control, int]:
    """The next control message and its size in bytes (IncompleteReadError at EOF)."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    body = await reader.readexactly(n)
    return decode_control(body), _LEN.size + n
