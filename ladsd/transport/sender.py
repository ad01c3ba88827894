"""The sending end of the return link (spec 2).

* ``F(t)``, the uncommitted inventory: ready, uncommitted results (FIFO order);
* the committed queue: transport order is fixed once committed;
* at most ``window`` committed frames not yet completely received;
* ``Q_B``: committed bytes not yet on the wire.

Whenever the window has room and results are pending the sender asks the
delivery policy which one to commit (stamp ``s``). One writer task sends the
committed queue in order, paced by a token bucket at ``R`` bytes/s; a reader
task takes acks (stamp ``c``, a window slot frees) and nacks (the result goes
back into ``F(t)``). A dropped connection is re-dialled and the committed
frames not yet acknowledged are resent whole, in their order. Nothing is lost
silently: a result the receiver keeps rejecting, or that cannot be sent,
fails its ticket with a clear error.

All methods run on the event loop's thread (the engine thread hands states
over with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ladsd.clock import Clock, now
from ladsd.config import FRAME_OVERHEAD, LinkConfig
from ladsd.delivery.policy import Pending, Policy, SenderView
from ladsd.records import (
    ContinuationId,
    EngineState,
    InventoryItem,
    Phase,
    SenderInventory,
)
from ladsd.transport.control import Control, Kind, Reason, nodelay, read_control
from ladsd.transport.errors import (
    Cancelled,
    ControlError,
    FrameRejected,
    LinkClosed,
    LinkError,
    OfferError,
    PolicyError,
    SendFailed,
)
from ladsd.transport.frame import (
    Codec,
    Frame,
    FrameError,
    digest,
    encode,
    encode_payload,
    make_frame,
)
from ladsd.transport.pacer import TokenBucket


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
    drops: int = 0  # dropped connections charged to it (oldest unacknowledged)

    def order(self) -> tuple[float, int]:
        return (self.ticket.item.ready_time, self.seq)


def _consume(fut: asyncio.Future) -> None:
    # The failure is also kept on the ticket and counted; don't log it as unretrieved.
    if not fut.cancelled():
        fut.exception()


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


class Sender:
    """The sending end: inventory, committed queue, window, pacing, resends.

    ``on_inventory(SenderInventory)`` is called at readiness and on every
    change (offer, commit, each chunk on the wire, ack, re-queue, cancel).
    A result the receiver rejects more than ``max_rejects`` times fails with
    :class:`FrameRejected`; one on which the connection drops ``max_drops``
    times fails with :class:`SendFailed`. ``fault(cid, send_no, frame_bytes)
    -> bytes`` (tests only) may alter a transmission; it must keep the length.
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
        max_drops: int = 8,
        fault: Fault | None = None,
    ) -> None:
        if config.window < 1:
            raise ValueError(f"window must be >= 1, got {config.window}")
        if max_rejects < 0 or max_drops < 1:
            raise ValueError(
                f"need max_rejects >= 0 and max_drops >= 1, got {max_rejects}, {max_drops}"
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
        self.max_drops = max_drops
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
        e.phase, e.sent, e.tx, e.drops = Phase.COMMITTED, 0, 0, 0
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
            nodelay(writer)
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
        """Committed frames not yet acknowledged go on the wire again, whole, in order.

        The receiver handles frames in order, so the drop is charged to the
        oldest unacknowledged frame if it had started; after ``max_drops``
        charges it fails (a frame the receiver keeps choking on).
        """
        self.counters["drops"] += 1
        head = self._committed[0] if self._committed else None
        started = head is not None and head.sent > 0
        for e in self._committed:
            e.sent = 0
        if head is not None and started:
            head.drops += 1
            if head.drops >= self.max_drops:
                self._committed.popleft()
                cid = head.ticket.cid.key()
                self._fail(head, SendFailed(f"{cid}: connection dropped {head.drops} times on it"))
        self._changed()
        self._pump()

    def _next_unsent(self) -> _Entry | None:
        for e in self._committed:
            if e.sent < len(e.data):
                return e
        return None

    def _begin(self, e: _Entry) -> None:
        """Start a transmission of ``e``."""
        e.tx += 1
        e.ticket.sends += 1
        if e.tx > 1:
            self.counters["resends"] += 1
        e.wire = e.data
        if self.fault is not None:
            e.wire = self.fault(e.ticket.cid, e.ticket.sends, e.data)
            if len(e.wire) != len(e.data):
                raise LinkError("a fault must keep the frame length")

    async def _write(self, writer: asyncio.StreamWriter) -> None:
        while True:
            e = self._next_unsent()
            if e is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if e.sent == 0:
                self._begin(e)
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
            msg, size = await read_control(reader)
            self.counters["control_bytes"] += size
            self._on_control(msg)

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
