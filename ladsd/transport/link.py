"""The return link: a paced sender and a verifying receiver over localhost TCP (spec 2).

Sender
  * ``F(t)``, the uncommitted inventory: ready, uncommitted results (FIFO order);
  * the committed queue: transport order is fixed once committed;
  * at most ``window`` committed frames not yet completely received;
  * ``Q_B``: committed bytes not yet on the wire.
  Whenever the window has room and results are pending it asks the delivery
  policy which one to commit (stamp ``s``). One writer task sends the
  committed queue in order, paced by a token bucket at ``R`` bytes/s.

Receiver
  Decodes the stream, verifies each frame, binds it to (workflow, turn,
  prefix digest, payload digest) and awaits the registration callback at
  once, in receipt order (stamp ``c``: the read that completed the frame).
  It answers every frame on the same connection: an ack (``c`` included,
  which frees a window slot) or a nack (the sender re-queues the result).
  Deliveries are deduplicated by identity + payload digest, so a frame resent
  after a lost ack is acknowledged again but registered once.

A dropped connection is re-dialled; committed frames not yet acknowledged are
resent whole, in their order. Nothing is lost silently: a result the receiver
keeps rejecting, or that cannot be sent, fails its ticket with a clear error.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import socket
import struct
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum

from ladsd.clock import Clock, now
from ladsd.config import FRAME_OVERHEAD, LinkConfig
from ladsd.delivery.policy import Pending, Policy, SenderView
from ladsd.engine.records import (
    ContinuationId,
    EngineState,
    InventoryItem,
    Phase,
    SenderInventory,
)
from ladsd.transport.frame import (
    Codec,
    DigestMismatch,
    Frame,
    FrameDecoder,
    FrameError,
    decode_payload,
    digest,
    encode,
    encode_payload,
    make_frame,
)
from ladsd.transport.pacer import TokenBucket

# ---------------------------------------------------------------- errors


class LinkError(Exception):
    """Base of the link's own errors."""


class OfferError(LinkError, ValueError):
    """An offered result that cannot be framed or contradicts its Pending record."""


class FrameRejected(LinkError):
    """The receiver rejected a result more often than ``max_rejects`` allows."""


class SendFailed(LinkError):
    """A committed frame could not be delivered within ``max_sends`` transmissions."""


class LinkClosed(LinkError):
    """The link closed before the result was received."""


class Cancelled(LinkError):
    """The result was cancelled before commitment."""


class PolicyError(LinkError):
    """The policy chose something that is not a pending result."""


class Rejected(Exception):
    """Raised by the receiver's registration callback to refuse a binding."""


# ---------------------------------------------------------------- control messages


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


_CTRL_LEN = struct.Struct(">H")
_CTRL = struct.Struct(">BBIId32sH")  # kind, reason, turn, version, c, payload digest, wf length


class ControlError(LinkError):
    """A malformed control message (the connection is then re-dialled)."""


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
    return _CTRL_LEN.pack(len(body)) + body


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


# ---------------------------------------------------------------- records


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


@dataclass(frozen=True)
class Prepared:
    """An observation made ready for :meth:`Sender.offer`."""

    item: Pending
    payload: bytes
    codec: Codec
    encode_s: float  # codec time at the sender (inside workflow time)


def prepare(
    cid: ContinuationId,
    observation: bytes,
    *,
    prefix_digest: str,
    ready_time: float,
    workflow_arrival: float,
    prompt_tokens: int,
    codec: Codec | str = Codec.IDENTITY,
) -> Prepared:
    """Encode ``observation`` with ``codec`` and describe it as a :class:`Pending`."""
    c = Codec.parse(codec)
    payload, encode_s = encode_payload(observation, c)
    item = Pending(
        cid=cid,
        ready_time=ready_time,
        payload_bytes=len(payload),
        frame_bytes=FRAME_OVERHEAD + len(payload),
        prefix_digest=prefix_digest,
        payload_digest=digest(payload),
        workflow_arrival=workflow_arrival,
        prompt_tokens=prompt_tokens,
    )
    return Prepared(item, payload, c, encode_s)


@dataclass(eq=False)
class Ticket:
    """One offered result's progress. Futures fail with a LinkError if it is not delivered.

    ``s`` is the latest commitment (the delivered one, once ``c`` is known);
    ``committed`` resolves at the first commitment.
    """

    item: Pending
    committed: asyncio.Future[float]
    received: asyncio.Future[float]
    s: float | None = None
    c: float | None = None
    commits: int = 0
    sends: int = 0  # transmissions, resends included
    rejects: int = 0
    reasons: list[str] = field(default_factory=list)  # one per reject
    error: LinkError | None = None

    @property
    def cid(self) -> ContinuationId:
        return self.item.cid


@dataclass(eq=False)
class _Entry:
    ticket: Ticket
    seq: int  # offer order: FIFO tie-break
    data: bytes  # the encoded frame
    phase: Phase = Phase.PENDING
    wire: bytes = b""  # this transmission (``data`` unless a fault altered it)
    sent: int = 0  # bytes of this transmission on the wire
    tx: int = 0  # transmissions of the current commitment

    def order(self) -> tuple[float, int]:
        return (self.ticket.item.ready_time, self.seq)


def _consume(fut: asyncio.Future) -> None:
    # The failure is also kept on the ticket and counted; don't log it as unretrieved.
    if not fut.cancelled():
        fut.exception()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


_DROPS = (ConnectionError, asyncio.IncompleteReadError, ControlError, OSError)

Fault = Callable[[ContinuationId, int, bytes], bytes]

SENDER_COUNTERS = (
    "offers",  # results offered
    "decisions",  # policy.choose calls
    "holds",  # choose returned None
    "commits",  # commitments (a re-queued result commits again)
    "frames",  # complete transmissions, resends included
    "bytes",  # bytes put on the wire, resends included
    "resends",  # transmissions repeated after a dropped connection
    "acks",
    "duplicate_acks",  # acks for frames the receiver already had (first ack lost)
    "rejects",  # nacks received
    "requeues",  # rejected results put back into F(t)
    "failed",  # tickets failed (rejected too often, unsendable, closed, cancelled)
    "cancelled",
    "control_bytes",  # ack/nack bytes received
    "stray_control",  # acks/nacks matching nothing in flight
    "connects",
    "connect_failures",
    "drops",
    "states",
    "states_out_of_order",
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
)

# ---------------------------------------------------------------- sender


class Sender:
    """The sending end: inventory, committed queue, window, pacing, resends.

    ``fault(cid, send_no, frame_bytes) -> bytes`` (tests only) may alter a
    transmission; it must keep the length.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        config: LinkConfig = LinkConfig(),
        on_inventory: Callable[[SenderInventory], None] | None = None,
        clock: Clock = now,
        bucket: TokenBucket | None = None,
        max_rejects: int = 3,
        max_sends: int = 8,
        fault: Fault | None = None,
    ) -> None:
        if config.window < 1:
            raise ValueError(f"window must be >= 1, got {config.window}")
        if max_rejects < 0 or max_sends < 1:
            raise ValueError(
                f"need max_rejects >= 0 and max_sends >= 1, got {max_rejects}, {max_sends}"
            )
        self.policy = policy
        self.config = config
        self.rate = float(config.rate_bytes_per_s)
        self.window = config.window
        self.codec = Codec.parse(config.codec)
        self.bucket = bucket or TokenBucket(self.rate, config.bucket_bytes)
        self.chunk = self.bucket.depth  # a write is at most one chunk = bucket depth
        self.on_inventory = on_inventory
        self.max_rejects = max_rejects
        self.max_sends = max_sends
        self.fault = fault
        self._clock = clock
        self._pending: list[_Entry] = []  # F(t), FIFO order
        self._committed: deque[_Entry] = deque()  # transport order
        self._by_cid: dict[ContinuationId, _Entry] = {}  # pending + committed
        self._seq = 0
        self._state: EngineState | None = None
        self._seq_before = -1
        self._wake = asyncio.Event()  # the writer has something to send
        self._idle = asyncio.Event()  # nothing pending, nothing committed
        self._idle.set()
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._error: BaseException | None = None
        self.host: str = config.host
        self.port: int | None = None
        self.counters: Counter[str] = Counter(dict.fromkeys(SENDER_COUNTERS, 0))
        self.decision_s = 0.0  # wall time spent inside policy.choose

    # ---- state the policies see

    @property
    def q_b(self) -> int:
        """Committed bytes not yet on the wire."""
        return sum(len(e.data) - e.sent for e in self._committed)

    @property
    def in_flight(self) -> int:
        """Committed frames not yet completely received (acknowledged)."""
        return len(self._committed)

    @property
    def pending(self) -> tuple[Pending, ...]:
        """F(t) in FIFO order."""
        return tuple(e.ticket.item for e in self._pending)

    @property
    def committed(self) -> tuple[ContinuationId, ...]:
        """The committed queue, in transport order."""
        return tuple(e.ticket.cid for e in self._committed)

    def view(self) -> SenderView:
        return SenderView(
            q_b=self.q_b,
            rate=self.rate,
            overhead=FRAME_OVERHEAD,
            state=self._state,
            state_seq_before=self._seq_before,
        )

    def inventory(self) -> SenderInventory:
        """The causal inventory: pending and committed results, FIFO order."""
        entries = sorted([*self._pending, *self._committed], key=_Entry.order)
        return SenderInventory(
            time=self._clock(),
            items=tuple(
                InventoryItem(e.ticket.cid, e.phase, e.ticket.item.payload_bytes, e.order()[0])
                for e in entries
            ),
            q_b=self.q_b,
            rate=self.rate,
            overhead=FRAME_OVERHEAD,
        )

    # ---- inputs

    async def offer(
        self, item: Pending, payload: bytes, *, codec: Codec | str | None = None
    ) -> Ticket:
        """Make one ready result (payload already encoded with ``codec``) available."""
        (ticket,) = await self.offer_many([(item, payload)], codec=codec)
        return ticket

    async def offer_many(
        self, items: Iterable[tuple[Pending, bytes]], *, codec: Codec | str | None = None
    ) -> list[Ticket]:
        """Make several results ready at once, so the policy sees them together.

        All or nothing: a bad item raises :class:`OfferError` and none is added.
        """
        self._check_open()
        c = self.codec if codec is None else Codec.parse(codec)
        loop = asyncio.get_running_loop()
        batch: list[_Entry] = []
        seen: set[ContinuationId] = set()
        for item, payload in items:
            if item.cid in self._by_cid or item.cid in seen:
                raise OfferError(f"{item.cid.key()} is already pending or in flight")
            seen.add(item.cid)
            data = self._frame(item, payload, c)
            ticket = Ticket(item, loop.create_future(), loop.create_future())
            batch.append(_Entry(ticket, self._seq + len(batch), data))
        self._seq += len(batch)
        for e in batch:
            bisect.insort(self._pending, e, key=_Entry.order)
            self._by_cid[e.ticket.cid] = e
        self.counters["offers"] += len(batch)
        self._changed()
        self._pump()
        self._check_open()
        return [e.ticket for e in batch]

    def set_state(self, state: EngineState) -> None:
        """The latest engine state: passed to the policy in SenderView, unfiltered.

        The previous state's seq becomes ``state_seq_before``, so the policy's
        record checks (duplicate, order) see exactly what arrived.
        """
        self._seq_before = self._state.seq if self._state is not None else -1
        if state.seq <= self._seq_before:
            self.counters["states_out_of_order"] += 1
        self._state = state
        self.counters["states"] += 1
        on_state = getattr(self.policy, "on_state", None)
        if on_state is not None:
            on_state(state, self._clock())
        self._pump()

    def complete(self, cid: ContinuationId, output_tokens: int) -> None:
        """The continuation's model call ended: tell the policy, then decide again."""
        self.policy.on_complete(cid, output_tokens, self._clock())
        self._pump()

    def cancel(self, cid: ContinuationId) -> bool:
        """Withdraw a pending (uncommitted) result; committed frames keep their place."""
        e = self._by_cid.get(cid)
        if e is None or e.phase is not Phase.PENDING:
            return False
        self._pending.remove(e)
        self._fail(e, Cancelled(f"{cid.key()} cancelled before commitment"))
        self.counters["cancelled"] += 1
        self._changed()
        return True

    # ---- lifecycle

    async def start(self, host: str, port: int, *, connect_timeout: float = 10.0) -> None:
        """Dial the receiver and keep the connection (re-dialling after drops)."""
        if self._task is not None:
            raise LinkError("sender already started")
        self.host, self.port = host, port
        self._task = asyncio.create_task(self._run(), name="ladsd-sender")
        try:
            await asyncio.wait_for(self._connected.wait(), connect_timeout)
        except TimeoutError:
            await self.close()
            raise LinkError(f"could not connect to {host}:{port} in {connect_timeout} s") from None

    async def drain(self) -> None:
        """Wait until every offered result is received (or failed)."""
        await self._idle.wait()
        if self._error is not None:
            raise self._error

    async def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop; with ``drain``, first wait (up to ``timeout``) for everything offered.

        Results not yet received fail with :class:`LinkClosed`.
        """
        try:
            if drain and self._error is None and not self._closing:
                await asyncio.wait_for(self.drain(), timeout)
        finally:
            self._closing = True
            if self._task is not None and not self._task.done():
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            for e in [*self._pending, *self._committed]:
                self._fail(e, LinkClosed(f"link closed before {e.ticket.cid.key()} was received"))
            self._pending.clear()
            self._committed.clear()
            self._changed()

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.counters)
        out["decision_s"] = self.decision_s
        out["q_b"] = self.q_b
        out["in_flight"] = self.in_flight
        out["pending"] = len(self._pending)
        return out

    # ---- decisions

    def _pump(self) -> None:
        """Commit while the window has room and results are pending."""
        try:
            while (
                not self._closing
                and self._error is None
                and self._pending
                and len(self._committed) < self.window
            ):
                items = tuple(e.ticket.item for e in self._pending)
                view = self.view()
                t = self._clock()
                t0 = time.perf_counter()
                choice = self.policy.choose(items, view, t)
                self.decision_s += time.perf_counter() - t0
                self.counters["decisions"] += 1
                if choice is None:
                    self.counters["holds"] += 1  # asked again after the next event
                    return
                e = self._by_cid.get(choice.cid)
                if e is None or e.phase is not Phase.PENDING or e.ticket.item != choice:
                    raise PolicyError(
                        f"policy {getattr(self.policy, 'name', '?')} chose {choice.cid.key()}, "
                        "which is not a pending result"
                    )
                self._commit(e)
                self.policy.on_commit(choice, e.ticket.s)  # type: ignore[arg-type]
        except Exception as exc:  # a broken policy stops the link loudly
            self._fatal(exc)

    def _commit(self, e: _Entry) -> None:
        self._pending.remove(e)
        t = self._clock()
        tk = e.ticket
        e.phase, e.sent, e.tx = Phase.COMMITTED, 0, 0
        tk.s = t
        tk.commits += 1
        if not tk.committed.done():
            tk.committed.set_result(t)
        self._committed.append(e)
        self.counters["commits"] += 1
        self._wake.set()
        self._changed()

    def _frame(self, item: Pending, payload: bytes, codec: Codec) -> bytes:
        cid = item.cid
        if len(payload) != item.payload_bytes:
            raise OfferError(
                f"{cid.key()}: payload is {len(payload)} bytes, item says {item.payload_bytes}"
            )
        if item.frame_bytes != FRAME_OVERHEAD + item.payload_bytes:
            raise OfferError(
                f"{cid.key()}: frame_bytes {item.frame_bytes} != h + p = "
                f"{FRAME_OVERHEAD + item.payload_bytes}"
            )
        if len(payload) > self.config.max_payload_bytes:
            raise OfferError(
                f"{cid.key()}: payload of {len(payload)} bytes exceeds the link maximum "
                f"{self.config.max_payload_bytes}"
            )
        try:
            frame: Frame = make_frame(
                cid,
                payload,
                prefix_digest=item.prefix_digest,
                ready_time=item.ready_time,
                codec=codec,
            )
            data = encode(frame)
        except FrameError as exc:
            raise OfferError(f"{cid.key()}: {exc}") from None
        if frame.header.payload_digest != item.payload_digest:
            raise OfferError(
                f"{cid.key()}: payload digest does not match the item's payload_digest"
            )
        return data

    # ---- bookkeeping

    def _changed(self) -> None:
        if self._pending or self._committed:
            self._idle.clear()
        else:
            self._idle.set()
        if self.on_inventory is not None:
            self.on_inventory(self.inventory())

    def _fail(self, e: _Entry, err: LinkError) -> None:
        tk = e.ticket
        tk.error = err
        for fut in (tk.committed, tk.received):
            if not fut.done():
                fut.set_exception(err)
                fut.add_done_callback(_consume)
        self._by_cid.pop(tk.cid, None)
        self.counters["failed"] += 1

    def _fatal(self, exc: BaseException) -> None:
        self._error = exc
        err = exc if isinstance(exc, LinkError) else LinkError(f"sender stopped: {exc!r}")
        for e in [*self._pending, *self._committed]:
            self._fail(e, err)
        self._pending.clear()
        self._committed.clear()
        self._changed()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closing:
            raise LinkClosed("sender is closed")

    # ---- connection

    async def _run(self) -> None:
        try:
            await self._dial()
        except Exception as exc:  # not a dropped connection: stop loudly
            self._fatal(exc)

    async def _dial(self) -> None:
        backoff = 0.02
        while not self._closing and self._error is None:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                self.counters["connect_failures"] += 1
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 1.0)
                continue
            backoff = 0.02
            _nodelay(writer)
            self.counters["connects"] += 1
            self._connected.set()
            tasks = [
                asyncio.create_task(self._read_control(reader)),
                asyncio.create_task(self._write(writer)),
            ]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    exc = None if t.cancelled() else t.exception()
                    if exc is not None and not isinstance(exc, _DROPS):
                        raise exc
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                writer.close()
                with contextlib.suppress(*_DROPS):
                    await writer.wait_closed()
            if not self._closing:
                self._dropped()

    def _dropped(self) -> None:
        """Committed frames not yet acknowledged go on the wire again, whole, in order."""
        self.counters["drops"] += 1
        for e in self._committed:
            e.sent = 0
        self._changed()

    def _next_unsent(self) -> _Entry | None:
        for e in self._committed:
            if e.sent < len(e.data):
                return e
        return None

    def _begin(self, e: _Entry) -> bool:
        """Start a transmission of ``e``; False if it has used up its transmissions."""
        e.tx += 1
        e.ticket.sends += 1
        if e.tx > 1:
            self.counters["resends"] += 1
        if e.tx > self.max_sends:
            self._committed.remove(e)
            self._fail(
                e, SendFailed(f"{e.ticket.cid.key()} not received after {self.max_sends} sends")
            )
            self._changed()
            self._pump()
            return False
        e.wire = e.data
        if self.fault is not None:
            e.wire = self.fault(e.ticket.cid, e.ticket.sends, e.data)
            if len(e.wire) != len(e.data):
                raise LinkError("a fault must keep the frame length")
        return True

    async def _write(self, writer: asyncio.StreamWriter) -> None:
        while True:
            e = self._next_unsent()
            if e is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if e.sent == 0 and not self._begin(e):
                continue
            left = len(e.wire) - e.sent
            n = await self.bucket.take(
                min(self.chunk, left), least=min(max(1, self.chunk // 2), left)
            )
            writer.write(e.wire[e.sent : e.sent + n])
            e.sent += n
            self.counters["bytes"] += n
            if e.sent == len(e.wire):
                self.counters["frames"] += 1
            self._changed()  # Q_B moved
            await writer.drain()

    async def _read_control(self, reader: asyncio.StreamReader) -> None:
        while True:
            (n,) = _CTRL_LEN.unpack(await reader.readexactly(_CTRL_LEN.size))
            body = await reader.readexactly(n)
            self.counters["control_bytes"] += _CTRL_LEN.size + n
            self._on_control(decode_control(body))

    def _on_control(self, msg: Control) -> None:
        e = self._by_cid.get(msg.cid)
        if e is None or e.phase is not Phase.COMMITTED or e.sent < len(e.data):
            self.counters["stray_control"] += 1
            return
        if e.ticket.item.payload_digest != msg.payload_digest:
            self.counters["stray_control"] += 1
            return
        self._committed.remove(e)
        tk = e.ticket
        if msg.kind is Kind.ACK:
            self._by_cid.pop(tk.cid)
            e.phase = Phase.RECEIVED
            tk.c = msg.c
            if not tk.received.done():
                tk.received.set_result(msg.c)
            self.counters["acks"] += 1
            if msg.reason is Reason.DUPLICATE:
                self.counters["duplicate_acks"] += 1
        else:
            self.counters["rejects"] += 1
            tk.rejects += 1
            tk.reasons.append(msg.reason.name.lower())
            if tk.rejects > self.max_rejects:
                self._fail(
                    e,
                    FrameRejected(
                        f"{tk.cid.key()} rejected {tk.rejects} times ({', '.join(tk.reasons)})"
                    ),
                )
            else:
                e.phase = Phase.PENDING
                bisect.insort(self._pending, e, key=_Entry.order)
                self.counters["requeues"] += 1
        self._changed()
        self._pump()


# ---------------------------------------------------------------- receiver

Register = Callable[[Delivery], Awaitable[None]]


class Receiver:
    """The receiving end: a TCP server on ``config.host`` taking one sender connection.

    ``register(delivery)`` is awaited for each verified, new frame in receipt
    order; raising :class:`Rejected` refuses the binding (the sender re-queues
    the result). ``on_bytes(n, t)`` observes every read (benchmarks).
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
        self._delivered: dict[tuple[ContinuationId, str], float] = {}  # -> first c
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

    def stats(self) -> dict[str, float]:
        return dict(self.counters)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        if self._conn is not None and not self._conn.is_closing():
            self._conn.transport.abort()  # the sender re-dialled: the old connection is dead
            self.counters["superseded"] += 1
        self._conn = writer
        _nodelay(writer)
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
            key = (h.cid, h.payload_digest)
            first = self._delivered.get(key)
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
            self._delivered[key] = t
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


# ---------------------------------------------------------------- the pair


class Link:
    """Sender and receiver of one return link on ``config.host`` (127.0.0.1)."""

    def __init__(
        self,
        policy: Policy,
        register: Register,
        *,
        config: LinkConfig = LinkConfig(),
        on_inventory: Callable[[SenderInventory], None] | None = None,
        on_bytes: Callable[[int, float], None] | None = None,
        clock: Clock = now,
        bucket: TokenBucket | None = None,
        max_rejects: int = 3,
        max_sends: int = 8,
        fault: Fault | None = None,
    ) -> None:
        self.config = config
        self.receiver = Receiver(register, config=config, clock=clock, on_bytes=on_bytes)
        self.sender = Sender(
            policy,
            config=config,
            on_inventory=on_inventory,
            clock=clock,
            bucket=bucket,
            max_rejects=max_rejects,
            max_sends=max_sends,
            fault=fault,
        )

    async def start(self) -> None:
        port = await self.receiver.start()
        await self.sender.start(self.config.host, port)

    async def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        try:
            await self.sender.close(drain=drain, timeout=timeout)
        finally:
            await self.receiver.close()

    def stats(self) -> dict[str, float]:
        """Sender counters, then the receiver's prefixed ``rx_``."""
        out = self.sender.stats()
        out.update({f"rx_{k}": v for k, v in self.receiver.stats().items()})
        return out

    async def __aenter__(self) -> Link:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
