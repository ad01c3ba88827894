"""The sender's queues and decisions, without a socket (spec 2 and 4).

:class:`Outbox` is pure state plus asyncio futures: the sender's socket part
(:class:`ladsd.transport.sender.Sender`) feeds it what happened on the wire,
and unit tests drive it directly. Its parts: ``outbox_queues.py`` (F(t), the
committed queue), ``outbox_policy.py`` (the policy's side), ``outbox_entries.py``
(a result's ticket, entry and frame).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable

from ladsd.clock import Clock, now
from ladsd.config import LinkConfig
from ladsd.delivery.policy import Pending, Policy, SenderView
from ladsd.records import ContinuationId, EngineState, Phase, SenderInventory
from ladsd.transport.control import Control, Kind, Reason
from ladsd.transport.errors import (
    Cancelled,
    FrameRejected,
    LinkClosed,
    LinkError,
    OfferError,
    SendFailed,
)
from ladsd.transport.frame import Codec
from ladsd.transport.outbox_entries import (
    Entry,
    Ticket,
    build_frame,
    settle_failed,
    settle_received,
    stamp_commit,
)
from ladsd.transport.outbox_policy import PolicyCalls
from ladsd.transport.outbox_queues import Queues

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


class Outbox:
    """F(t), the committed queue, Q_B, the window, the policy and the tickets.

    Composes (one resource each): :class:`Queues` (F(t) in FIFO order, the
    committed queue in transport order, per-result progress on the wire, the
    ``idle`` / ``unsent`` events) and :class:`PolicyCalls` (the policy, the
    engine state passed to it, the time inside ``choose``). Owns itself the
    rules that join them (when to ask the policy, what an ack, nack, drop,
    cancel or close does to a ticket), the tickets' settlement, the counters,
    and inventory publication (``on_inventory`` at readiness and on every
    change).

    Callers: the owner of the results (through the Sender) calls
    :meth:`offer_many`, :meth:`set_state`, :meth:`complete`, :meth:`cancel`;
    the socket part alone calls :meth:`next_unsent`, :meth:`begin`,
    :meth:`wrote`, :meth:`answer`, :meth:`rewind`, :meth:`stop`,
    :meth:`close`. All on the event loop's thread; nothing here awaits.

    Invariants (:meth:`check_integrity`): the queues' and the policy calls';
    after a fatal error or close, both queues are empty and ``error`` (or
    ``closed``) says why. Nothing is kept per result once its ticket is
    settled (received, failed, cancelled): counters only.

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
        self.config = config
        self.codec = Codec.parse(config.codec)
        self.max_rejects = max_rejects
        self.on_inventory = on_inventory
        self.on_stop = on_stop
        self._clock = clock
        self._queues = Queues(config.window)
        self._calls = PolicyCalls(policy)
        self.closed = False
        self.error: LinkError | None = None  # the fatal error, once stopped
        self.counters: Counter[str] = Counter(dict.fromkeys(OUTBOX_COUNTERS, 0))

    # ---- state the policies see

    @property
    def policy(self) -> Policy:
        return self._calls.policy

    @property
    def rate(self) -> float:
        return float(self.config.rate_bytes_per_s)

    @property
    def decision_s(self) -> float:
        """CPU time (this thread's) inside ``policy.choose`` and the policy's hooks."""
        return self._calls.decision_s

    @property
    def idle(self) -> asyncio.Event:
        """Set while nothing is pending and nothing committed."""
        return self._queues.idle

    @property
    def unsent(self) -> asyncio.Event:
        """Set while a committed frame has bytes not yet on the wire."""
        return self._queues.unsent

    @property
    def q_b(self) -> int:
        """Committed bytes not yet on the wire."""
        return self._queues.q_b

    @property
    def in_flight(self) -> int:
        """Committed frames not yet completely received (acknowledged)."""
        return self._queues.in_flight

    @property
    def pending(self) -> tuple[Pending, ...]:
        """F(t) in FIFO order."""
        return self._queues.pending

    @property
    def committed(self) -> tuple[ContinuationId, ...]:
        """The committed queue, in transport order."""
        return self._queues.committed

    def view(self) -> SenderView:
        return self._calls.view(self.q_b, self.rate)

    def inventory(self) -> SenderInventory:
        """The causal inventory: pending and committed results, FIFO order."""
        return self._queues.inventory(self._clock(), self.rate)

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
        offered: list[tuple[Ticket, bytes]] = []
        seen: set[ContinuationId] = set()
        for item, payload in items:
            if item.cid in self._queues or item.cid in seen:
                raise OfferError(f"{item.cid.key()} is already pending or in flight")
            seen.add(item.cid)
            data = build_frame(item, payload, c, self.config.max_payload_bytes)
            offered.append((Ticket(item, loop.create_future(), loop.create_future()), data))
        batch = self._queues.add(offered)
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
        if not self._calls.new_state(state):
            self.counters["states_out_of_order"] += 1
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
        e = self._queues.get(cid)
        if e is None or e.phase is not Phase.PENDING:
            return False
        self._queues.remove(e)
        self._fail(e, Cancelled(f"{cid.key()} cancelled before commitment"))
        self.counters["cancelled"] += 1
        self._changed()
        return True

    # ---- decisions

    def _pump(self) -> None:
        """Commit while the window has room and results are pending."""
        while not self.closed and self.error is None and self._queues.has_room():
            items = self._queues.pending
            view = self.view()
            t = self._clock()
            try:
                choice = self._calls.choose(items, view, t)
            except Exception as exc:
                self.stop(self._calls.broken("choose", exc))
                return
            self.counters["decisions"] += 1
            if choice is None:
                self.counters["holds"] += 1  # asked again after the next event
                return
            e = self._queues.get(choice.cid)
            if e is None or e.phase is not Phase.PENDING or e.ticket.item != choice:
                self.stop(self._calls.not_pending(choice))
                return
            self._commit(e)
            if not self._call("on_commit", self.policy.on_commit, choice, e.ticket.s):
                return

    def _commit(self, e: Entry) -> None:
        self._queues.commit(e)
        stamp_commit(e.ticket, self._clock())
        self.counters["commits"] += 1
        self._changed()

    def _call(self, hook: str, fn: Callable[..., object], *args: object) -> bool:
        """Call a policy hook; a raise stops the outbox (False) instead of escaping."""
        if self.error is not None:
            return False  # a broken policy is not asked again
        try:
            self._calls.hook(fn, *args)
        except Exception as exc:
            self.stop(self._calls.broken(hook, exc))
            return False
        return True

    # ---- the wire (socket part only)

    def next_unsent(self) -> Entry | None:
        """The committed frame to put on the wire next (transport order)."""
        return self._queues.next_unsent()

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
        e = self._queues.get(msg.cid)
        if (
            e is None
            or e.phase is not Phase.COMMITTED
            or e.sent < len(e.data)
            or e.ticket.item.payload_digest != msg.payload_digest
        ):
            self.counters["stray_control"] += 1
            return False
        tk = e.ticket
        if msg.kind is Kind.ACK:
            self._queues.remove(e)
            e.phase = Phase.RECEIVED
            settle_received(tk, msg.c)
            self.counters["acks"] += 1
            if msg.reason is Reason.DUPLICATE:
                self.counters["duplicate_acks"] += 1
        else:
            self.counters["rejects"] += 1
            tk.rejects += 1
            tk.reasons.append(msg.reason.name.lower())
            if tk.rejects > self.max_rejects:
                self._queues.remove(e)
                why = ", ".join(tk.reasons)
                self._fail(e, FrameRejected(f"{tk.cid.key()} rejected {tk.rejects} times ({why})"))
            else:
                self._queues.requeue(e)
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
        head = self._queues.rewind()
        failed = None
        if head is not None:
            head.drops += 1
            if head.drops >= max_drops:
                self._queues.remove(head)
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
        for e in self._queues.drain():
            self._fail(e, err)
        self._changed()
        if self.on_stop is not None:
            self.on_stop(err)

    def close(self) -> None:
        """No more commitments; results not yet received fail with :class:`LinkClosed`."""
        self.closed = True
        for e in self._queues.drain():
            self._fail(e, LinkClosed(f"link closed before {e.ticket.cid.key()} was received"))
        self._changed()

    def check_open(self) -> None:
        if self.error is not None:
            raise self.error
        if self.closed:
            raise LinkClosed("sender is closed")

    def _fail(self, e: Entry, err: LinkError) -> None:
        """Settle ``e``'s ticket with ``err`` (``e`` has already left the queues)."""
        settle_failed(e.ticket, err)
        self.counters["failed"] += 1

    def _changed(self) -> None:
        self._queues.refresh()
        if self.on_inventory is not None:
            self.on_inventory(self.inventory())

    # ---- introspection

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.counters)
        out["decision_s"] = self.decision_s
        out["q_b"] = self.q_b
        out["in_flight"] = self.in_flight
        out["pending"] = len(self.pending)
        return out

    def sizes(self) -> dict[str, int]:
        """Per-result structures and their lengths (all 0 once every result is settled)."""
        return self._queues.sizes()

    def check_integrity(self) -> None:
        """Assert the invariants of the class docstring."""
        self._queues.check_integrity()
        self._calls.check_integrity()
        if self.error is not None or self.closed:
            assert not self._queues.live(), "a stopped outbox still holds results"
        assert self.counters["commits"] >= self.in_flight
