"""The sender's queues and decisions, without a socket (spec 2 and 4).

:class:`Outbox` is pure state plus asyncio futures: the sender's socket part
(:class:`ladsd.transport.sender.Sender`) feeds it what happened on the wire,
and unit tests drive it directly.
"""

from __future__ import annotations

import asyncio
import bisect
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
from ladsd.transport.control import Control, Kind, Reason
from ladsd.transport.errors import (
    Cancelled,
    FrameRejected,
    LinkClosed,
    LinkError,
    OfferError,
    PolicyError,
    SendFailed,
)
from ladsd.transport.frame import Codec, Frame, FrameError, encode, make_frame


@dataclass(eq=False)
class Ticket:
    """One offered result's progress, from offer to complete receipt.

    ``committed`` resolves with ``s`` at the first commitment; ``received``
    with ``c`` at complete receipt. If the result is not delivered both fail
    with a :class:`LinkError`: :class:`FrameRejected` (nacked more than
    ``max_rejects`` times), :class:`SendFailed` (the connection dropped
    ``max_drops`` times on it), :class:`Cancelled`, :class:`LinkClosed`, or the
    sender's fatal error (:class:`PolicyError`, :class:`LinkDown`, ...).
    A caller waiting for something the receipt causes (e.g. registration)
    should wait on ``received`` beside it, so a dead link never leaves it
    hanging (every ticket fails when the sender stops).

    ``s`` is the latest commitment (the delivered one, once ``c`` is known).
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
class Entry:
    """A result in F(t) or in the committed queue (the socket part reads ``data``/``sent``)."""

    ticket: Ticket
    seq: int  # offer order: FIFO tie-break
    data: bytes  # the encoded frame
    phase: Phase = Phase.PENDING
    sent: int = 0  # bytes of the current transmission on the wire
    tx: int = 0  # transmissions of the current commitment
    drops: int = 0  # dropped connections charged to it (oldest unacknowledged)

    def order(self) -> tuple[float, int]:
        return (self.ticket.item.ready_time, self.seq)


OUTBOX_COUNTERS = (
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
    "stray_control",  # acks/nacks matching nothing in flight
    "states",
    "states_out_of_order",
)


def _consume(fut: asyncio.Future) -> None:
    # The failure is also kept on the ticket and counted; don't log it as unretrieved.
    if not fut.cancelled():
        fut.exception()


def build_frame(item: Pending, payload: bytes, codec: Codec, max_payload: int) -> bytes:
    """The encoded frame of ``item``; :class:`OfferError` if the item contradicts it."""
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
    if len(payload) > max_payload:
        raise OfferError(
            f"{cid.key()}: payload of {len(payload)} bytes exceeds the link maximum {max_payload}"
        )
    try:
        frame: Frame = make_frame(
            cid, payload, prefix_digest=item.prefix_digest, ready_time=item.ready_time, codec=codec
        )
        data = encode(frame)
    except FrameError as exc:
        raise OfferError(f"{cid.key()}: {exc}") from None
    if frame.header.payload_digest != item.payload_digest:
        raise OfferError(f"{cid.key()}: payload digest does not match the item's payload_digest")
    return data


class Outbox:
    """F(t), the committed queue, Q_B, the window, the policy and the tickets.

    Owns: ``F(t)`` (ready, uncommitted results, FIFO order), the committed
    queue (transport order, fixed once committed), per-result progress on
    the wire, the engine state passed to the policy, every policy call and
    its timing, the tickets, the counters, and inventory publication
    (``on_inventory`` at readiness and on every change).

    Callers: the owner of the results (through the Sender) calls
    :meth:`offer_many`, :meth:`set_state`, :meth:`complete`, :meth:`cancel`;
    the socket part alone calls :meth:`next_unsent`, :meth:`begin`,
    :meth:`wrote`, :meth:`answer`, :meth:`rewind`, :meth:`stop`,
    :meth:`close`. All on the event loop's thread; nothing here awaits.

    Invariants (:meth:`check_integrity`): every live ticket's entry is in
    exactly one of F(t) / committed and in ``by_cid``, nothing else is;
    at most ``window`` committed; committed frames go on the wire in order
    (fully sent ones, at most one partly sent, then unsent ones), so Q_B is
    the unsent bytes of the committed queue; after a fatal error or close,
    both queues are empty and ``error`` (or ``closed``) says why. Nothing is
    kept per result once its ticket is settled (received, failed,
    cancelled): counters only.

    Fail fast: a policy hook that raises, or a choice that is not pending,
    stops the outbox with :class:`PolicyError`; :meth:`stop` fails every
    outstanding ticket with its error, keeps it as :attr:`error` and makes
    every later offer raise it.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        config: LinkConfig = LinkConfig(),
        on_inventory: Callable[[SenderInventory], None] | None = None,
        on_stop: Callable[[LinkError], None] | None = None,
        clock: Clock = now,
        max_rejects: int = 3,
    ) -> None:
        if config.window < 1:
            raise ValueError(f"window must be >= 1, got {config.window}")
        if max_rejects < 0:
            raise ValueError(f"need max_rejects >= 0, got {max_rejects}")
        self.policy = policy
        self.config = config
        self.rate = float(config.rate_bytes_per_s)
        self.window = config.window
        self.codec = Codec.parse(config.codec)
        self.max_rejects = max_rejects
        self.on_inventory = on_inventory
        self.on_stop = on_stop
        self._clock = clock
        self._pending: list[Entry] = []  # F(t), FIFO order
        self._committed: deque[Entry] = deque()  # transport order
        self._by_cid: dict[ContinuationId, Entry] = {}  # pending + committed
        self._seq = 0
        self._state: EngineState | None = None
        self._seq_before = -1
        self.idle = asyncio.Event()  # nothing pending, nothing committed
        self.idle.set()
        self.unsent = asyncio.Event()  # a committed frame has bytes not yet on the wire
        self.closed = False
        self.error: LinkError | None = None  # the fatal error, once stopped
        self.counters: Counter[str] = Counter(dict.fromkeys(OUTBOX_COUNTERS, 0))
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
        entries = sorted([*self._pending, *self._committed], key=Entry.order)
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

    def offer_many(
        self, items: Iterable[tuple[Pending, bytes]], *, codec: Codec | str | None = None
    ) -> list[Ticket]:
        """Make several results ready at once, then decide: the policy sees them together.

        All or nothing: a bad item raises :class:`OfferError` and none is added.
        """
        self.check_open()
        c = self.codec if codec is None else Codec.parse(codec)
        loop = asyncio.get_running_loop()
        batch: list[Entry] = []
        seen: set[ContinuationId] = set()
        for item, payload in items:
            if item.cid in self._by_cid or item.cid in seen:
                raise OfferError(f"{item.cid.key()} is already pending or in flight")
            seen.add(item.cid)
            data = build_frame(item, payload, c, self.config.max_payload_bytes)
            ticket = Ticket(item, loop.create_future(), loop.create_future())
            batch.append(Entry(ticket, self._seq + len(batch), data))
        self._seq += len(batch)
        for e in batch:
            bisect.insort(self._pending, e, key=Entry.order)
            self._by_cid[e.ticket.cid] = e
        self.counters["offers"] += len(batch)
        self._changed()
        self._pump()
        self.check_open()  # a policy that failed on this batch fails the offer too
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
        if on_state is None or self._call("on_state", on_state, state, self._clock()):
            self._pump()

    def complete(self, cid: ContinuationId, output_tokens: int) -> None:
        """The continuation's model call ended: tell the policy, then decide again."""
        if self._call("on_complete", self.policy.on_complete, cid, output_tokens, self._clock()):
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

    # ---- decisions

    def _pump(self) -> None:
        """Commit while the window has room and results are pending."""
        while (
            not self.closed
            and self.error is None
            and self._pending
            and len(self._committed) < self.window
        ):
            items = tuple(e.ticket.item for e in self._pending)
            view = self.view()
            t = self._clock()
            t0 = time.perf_counter()
            try:
                choice = self.policy.choose(items, view, t)
            except Exception as exc:
                self._broken("choose", exc)
                return
            finally:
                self.decision_s += time.perf_counter() - t0
            self.counters["decisions"] += 1
            if choice is None:
                self.counters["holds"] += 1  # asked again after the next event
                return
            e = self._by_cid.get(choice.cid)
            if e is None or e.phase is not Phase.PENDING or e.ticket.item != choice:
                self.stop(
                    PolicyError(
                        f"policy {self._name()} chose {choice.cid.key()}, "
                        "which is not a pending result"
                    )
                )
                return
            self._commit(e)
            if not self._call("on_commit", self.policy.on_commit, choice, e.ticket.s):
                return

    def _commit(self, e: Entry) -> None:
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
        self._changed()

    def _call(self, hook: str, fn: Callable[..., object], *args: object) -> bool:
        """Call a policy hook; a raise stops the outbox (False) instead of escaping."""
        if self.error is not None:
            return False  # a broken policy is not asked again
        try:
            fn(*args)
        except Exception as exc:
            self._broken(hook, exc)
            return False
        return True

    def _broken(self, hook: str, exc: Exception) -> None:
        err = PolicyError(f"policy {self._name()} failed in {hook}(): {exc!r}")
        err.__cause__ = exc
        self.stop(err)

    def _name(self) -> str:
        return str(getattr(self.policy, "name", type(self.policy).__name__))

    # ---- the wire (socket part only)

    def next_unsent(self) -> Entry | None:
        """The committed frame to put on the wire next (transport order)."""
        for e in self._committed:
            if e.sent < len(e.data):
                return e
        return None

    def begin(self, e: Entry) -> int:
        """A transmission of ``e`` starts; returns the ticket's send number (1 = first)."""
        e.tx += 1
        e.ticket.sends += 1
        if e.tx > 1:
            self.counters["resends"] += 1
        return e.ticket.sends

    def wrote(self, e: Entry, n: int) -> None:
        """``n`` more bytes of ``e`` are on the wire (Q_B moves)."""
        e.sent += n
        self.counters["bytes"] += n
        if e.sent == len(e.data):
            self.counters["frames"] += 1
        self._changed()

    def answer(self, msg: Control) -> bool:
        """The receiver's ack (window slot frees) or nack (back into F(t)); False if stray."""
        e = self._by_cid.get(msg.cid)
        if (
            e is None
            or e.phase is not Phase.COMMITTED
            or e.sent < len(e.data)
            or e.ticket.item.payload_digest != msg.payload_digest
        ):
            self.counters["stray_control"] += 1
            return False
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
                why = ", ".join(tk.reasons)
                self._fail(e, FrameRejected(f"{tk.cid.key()} rejected {tk.rejects} times ({why})"))
            else:
                e.phase = Phase.PENDING
                bisect.insort(self._pending, e, key=Entry.order)
                self.counters["requeues"] += 1
        self._changed()
        self._pump()
        return True

    def rewind(self, max_drops: int) -> Entry | None:
        """The connection dropped: committed frames go on the wire again, whole, in order.

        The receiver handles frames in order, so the drop is charged to the
        oldest unacknowledged frame if it had started; one charged
        ``max_drops`` times fails with :class:`SendFailed` and is returned.
        """
        head = self._committed[0] if self._committed else None
        started = head is not None and head.sent > 0
        for e in self._committed:
            e.sent = 0
        failed = None
        if head is not None and started:
            head.drops += 1
            if head.drops >= max_drops:
                self._committed.popleft()
                cid = head.ticket.cid.key()
                self._fail(head, SendFailed(f"{cid}: connection dropped {head.drops} times on it"))
                failed = head
        self._changed()
        self._pump()
        return failed

    # ---- the end

    def stop(self, err: LinkError) -> None:
        """Fatal: fail every outstanding ticket with ``err``, decide nothing more."""
        if self.error is not None:
            return
        self.error = err
        self._fail_all(err)
        if self.on_stop is not None:
            self.on_stop(err)

    def close(self) -> None:
        """No more commitments; results not yet received fail with :class:`LinkClosed`."""
        self.closed = True
        for e in [*self._pending, *self._committed]:
            self._fail(e, LinkClosed(f"link closed before {e.ticket.cid.key()} was received"))
        self._pending.clear()
        self._committed.clear()
        self._changed()

    def check_open(self) -> None:
        if self.error is not None:
            raise self.error
        if self.closed:
            raise LinkClosed("sender is closed")

    def _fail_all(self, err: LinkError) -> None:
        for e in [*self._pending, *self._committed]:
            self._fail(e, err)
        self._pending.clear()
        self._committed.clear()
        self._changed()

    def _fail(self, e: Entry, err: LinkError) -> None:
        tk = e.ticket
        tk.error = err
        for fut in (tk.committed, tk.received):
            if not fut.done():
                fut.set_exception(err)
                fut.add_done_callback(_consume)
        self._by_cid.pop(tk.cid, None)
        self.counters["failed"] += 1

    def _changed(self) -> None:
        if self._pending or self._committed:
            self.idle.clear()
        else:
            self.idle.set()
        if self.next_unsent() is None:
            self.unsent.clear()
        else:
            self.unsent.set()
        if self.on_inventory is not None:
            self.on_inventory(self.inventory())

    # ---- introspection

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.counters)
        out["decision_s"] = self.decision_s
        out["q_b"] = self.q_b
        out["in_flight"] = self.in_flight
        out["pending"] = len(self._pending)
        return out

    def sizes(self) -> dict[str, int]:
        """Per-result structures and their lengths (all 0 once every result is settled)."""
        return {
            "pending": len(self._pending),
            "committed": len(self._committed),
            "by_cid": len(self._by_cid),
        }

    def check_integrity(self) -> None:
        """Assert the invariants of the class docstring."""
        pend, comm = self._pending, list(self._committed)
        assert all(e.phase is Phase.PENDING for e in pend), "F(t) holds a non-pending entry"
        assert all(e.phase is Phase.COMMITTED for e in comm), "committed holds a non-committed"
        live = [*pend, *comm]
        assert len({id(e) for e in live}) == len(live), "an entry is in both queues"
        assert {e.ticket.cid: e for e in live} == self._by_cid, "by_cid != pending + committed"
        assert all(self._by_cid[cid].ticket.cid == cid for cid in self._by_cid)
        assert pend == sorted(pend, key=Entry.order), "F(t) is not in FIFO order"
        assert len(comm) <= self.window, f"{len(comm)} in flight > window {self.window}"
        assert all(0 <= e.sent <= len(e.data) for e in comm)
        # Transport order: fully sent frames, at most one partly sent, then unsent ones.
        stage = [0 if e.sent == len(e.data) else 1 if e.sent > 0 else 2 for e in comm]
        assert stage == sorted(stage) and stage.count(1) <= 1, f"wire order broken: {stage}"
        assert self.q_b == sum(len(e.data) - e.sent for e in comm) >= 0
        for e in live:
            tk = e.ticket
            assert not tk.received.done() and tk.error is None, f"{tk.cid.key()} settled, kept"
            assert (e in comm) <= tk.committed.done(), f"{tk.cid.key()} committed, not stamped"
            assert tk.commits == 0 or tk.s is not None
        assert self.idle.is_set() == (not live), "idle event disagrees"
        assert self.unsent.is_set() == (self.next_unsent() is not None), "unsent event disagrees"
        if self.error is not None or self.closed:
            assert not live, "a stopped outbox still holds results"
        assert self.counters["commits"] >= len(comm)
