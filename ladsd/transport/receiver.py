"""The receiving end of the return link (spec 2).

Decodes the stream, verifies each frame, binds it to (workflow, turn,
prefix digest, payload digest) and awaits the registration callback at
once, in receipt order (stamp ``c``: the read that completed the frame).
It answers every frame on the same connection: an ack (``c`` included,
which frees a window slot) or a nack (the sender re-queues the result).
Deliveries are deduplicated by identity + payload digest, so a frame resent
after a lost ack is acknowledged again but registered once.

The dedup memory is per continuation and trimmed by :meth:`Receiver.forget`
once the continuation's resumed call is complete (a long-lived daemon stays
bounded). A frame that arrives later for a forgotten continuation is no
longer recognised as a duplicate: it is a stale frame, handed to the
registration callback like any other, which refuses it (nack, ``binding``)
because nothing waits for it; the sender's ``max_rejects`` rule then ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ladsd.clock import Clock, now
from ladsd.config import LinkConfig
from ladsd.records import ContinuationId
from ladsd.transport.control import Control, Kind, Reason, encode_control, nodelay
from ladsd.transport.errors import Rejected
from ladsd.transport.frame import (
    Codec,
    DigestMismatch,
    Frame,
    FrameDecoder,
    FrameError,
    decode_payload,
)

RECEIVER_COUNTERS = (
    "connections",
    "superseded",  # connections replaced by a re-dial
    "aborted",  # abort_connection calls
    "bytes_in",
    "frames_in",  # complete frames read (valid or not)
    "delivered",  # registered with the callback
    "duplicates",  # frames already delivered (acked again, not registered)
    "nacks",
    "refused",  # the callback raised Rejected
    "register_errors",  # the callback failed otherwise
    "stream_errors",  # unrecoverable frame errors: connection dropped
    "connection_errors",
    "answers_lost",  # acks/nacks not sent because the connection was gone
    "control_bytes",  # ack/nack bytes sent
    "forgotten",  # continuations whose dedup memory forget() dropped
)


@dataclass(frozen=True)
class Delivery:
    """A verified frame as handed to the registration callback."""

    cid: ContinuationId
    prefix_digest: str
    payload_digest: str
    observation: bytes  # decoded payload
    payload_bytes: int  # p_i as sent
    codec: Codec
    ready_time: float  # r_i
    c: float  # complete receipt
    decode_s: float  # codec time at the receiver (inside workflow time)

    @property
    def binding(self) -> tuple[str, int, str, str]:
        """(workflow, turn, prefix digest, payload digest)."""
        return (self.cid.workflow, self.cid.turn, self.prefix_digest, self.payload_digest)


Register = Callable[[Delivery], Awaitable[None]]


class Receiver:
    """The receiving end: a TCP server on ``config.host`` taking one sender connection.

    ``register(delivery)`` is awaited for each verified, new frame in receipt
    order; raising :class:`Rejected` refuses the binding (the sender re-queues
    the result). ``on_bytes(n, t)`` observes every read (benchmarks).
    The owner calls :meth:`forget` once a continuation's resumed call is
    complete; the receiver keeps nothing else per continuation.
    """

    def __init__(
        self,
        register: Register,
        *,
        config: LinkConfig = LinkConfig(),
        clock: Clock = now,
        on_bytes: Callable[[int, float], None] | None = None,
    ) -> None:
        self.register = register
        self.config = config
        self.on_bytes = on_bytes
        self._clock = clock
        self._server: asyncio.Server | None = None
        self._conn: asyncio.StreamWriter | None = None
        self._handlers: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()  # one frame at a time, across connections
        # cid -> payload digest -> first complete receipt c (dedup; trimmed by forget)
        self._delivered: dict[ContinuationId, dict[str, float]] = {}
        self.counters: Counter[str] = Counter(dict.fromkeys(RECEIVER_COUNTERS, 0))
        self.last_error: BaseException | None = None
        self.host = config.host
        self.port: int | None = None

    async def start(self, port: int = 0) -> int:
        """Listen on ``config.host``; returns the port (0: any free one)."""
        self._server = await asyncio.start_server(self._handle, self.config.host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def abort_connection(self) -> bool:
        """Drop the current connection at once (fault injection); True if there was one."""
        if self._conn is None or self._conn.is_closing():
            return False
        self._conn.transport.abort()
        self.counters["aborted"] += 1
        return True

    async def close(self, *, grace_s: float = 1.0) -> None:
        """Stop listening, end the connection (its handler sees EOF), wait for the handler."""
        if self._server is not None:
            self._server.close()
        if self._conn is not None:
            self._conn.close()
        if self._handlers:
            _, late = await asyncio.wait(set(self._handlers), timeout=grace_s)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def forget(self, cid: ContinuationId) -> bool:
        """Drop the dedup memory of ``cid`` (call once its resumed call is complete).

        Later frames for ``cid`` are stale frames (see the module docstring).
        Returns False if nothing was remembered for it.
        """
        if self._delivered.pop(cid, None) is None:
            return False
        self.counters["forgotten"] += 1
        return True

    def stats(self) -> dict[str, float]:
        return dict(self.counters)

    def sizes(self) -> dict[str, int]:
        """Per-result structures and their lengths (0 once every continuation is forgotten)."""
        return {"delivered": len(self._delivered)}

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        if self._conn is not None and not self._conn.is_closing():
            self._conn.transport.abort()  # the sender re-dialled: the old connection is dead
            self.counters["superseded"] += 1
        self._conn = writer
        nodelay(writer)
        self.counters["connections"] += 1
        decoder = FrameDecoder(max_payload=self.config.max_payload_bytes)
        try:
            while not writer.is_closing():
                data = await reader.read(1 << 16)
                if not data:
                    decoder.close()  # Truncated if the stream ends inside a frame
                    break
                t = self._clock()
                self.counters["bytes_in"] += len(data)
                if self.on_bytes is not None:
                    self.on_bytes(len(data), t)
                decoder.feed(data)
                while not writer.is_closing():
                    try:
                        frame = decoder.next()
                    except FrameError as exc:
                        if not exc.recoverable:
                            raise
                        await self._refuse(writer, exc, t)
                        continue
                    if frame is None:
                        break
                    await self._receive(writer, frame, t)
        except FrameError as exc:
            # Misaligned or forged stream: drop it; the sender resends whole frames.
            self.counters["stream_errors"] += 1
            self.last_error = exc
        except (ConnectionError, OSError):
            self.counters["connection_errors"] += 1
        except asyncio.CancelledError:
            # Only close() cancels a handler (one stuck in the callback). Ending normally
            # keeps asyncio's stream callback (3.11) from logging the cancelled task.
            pass
        finally:
            if self._conn is writer:
                self._conn = None
            writer.close()
            self._handlers.discard(task)

    async def _refuse(self, writer: asyncio.StreamWriter, exc: FrameError, t: float) -> None:
        assert exc.cid is not None and exc.payload_digest is not None
        self.counters["frames_in"] += 1
        reason = Reason.DIGEST if isinstance(exc, DigestMismatch) else Reason.CODEC
        self.last_error = exc
        await self._answer(writer, Control(Kind.NACK, reason, exc.cid, exc.payload_digest, t))

    async def _receive(self, writer: asyncio.StreamWriter, frame: Frame, t: float) -> None:
        h = frame.header
        self.counters["frames_in"] += 1
        async with self._lock:
            first = self._delivered.get(h.cid, {}).get(h.payload_digest)
            if first is not None:
                self.counters["duplicates"] += 1
                msg = Control(Kind.ACK, Reason.DUPLICATE, h.cid, h.payload_digest, first)
                await self._answer(writer, msg)
                return
            try:
                observation, decode_s = decode_payload(
                    frame.payload, h.codec, self.config.max_payload_bytes
                )
            except FrameError as exc:
                self.last_error = exc
                await self._answer(
                    writer, Control(Kind.NACK, Reason.CODEC, h.cid, h.payload_digest, t)
                )
                return
            delivery = Delivery(
                cid=h.cid,
                prefix_digest=h.prefix_digest,
                payload_digest=h.payload_digest,
                observation=observation,
                payload_bytes=h.payload_length,
                codec=h.codec,
                ready_time=h.ready_time,
                c=t,
                decode_s=decode_s,
            )
            try:
                await self.register(delivery)
            except Rejected as exc:
                self.counters["refused"] += 1
                self.last_error = exc
                await self._answer(
                    writer, Control(Kind.NACK, Reason.BINDING, h.cid, h.payload_digest, t)
                )
                return
            except Exception as exc:  # a failing callback must not lose the frame
                self.counters["register_errors"] += 1
                self.last_error = exc
                await self._answer(
                    writer, Control(Kind.NACK, Reason.ERROR, h.cid, h.payload_digest, t)
                )
                return
            self._delivered.setdefault(h.cid, {})[h.payload_digest] = t
            self.counters["delivered"] += 1
            await self._answer(writer, Control(Kind.ACK, Reason.OK, h.cid, h.payload_digest, t))

    async def _answer(self, writer: asyncio.StreamWriter, msg: Control) -> None:
        if msg.kind is Kind.NACK:
            self.counters["nacks"] += 1
        if writer.is_closing():
            self.counters["answers_lost"] += 1  # the sender resends; dedup keeps it once
            return
        data = encode_control(msg)
        self.counters["control_bytes"] += len(data)
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
