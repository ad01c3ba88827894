"""Where every live result of the outbox is: F(t), the committed queue, and their index.

:class:`Queues` is one resource of :class:`~ladsd.transport.outbox.Outbox`
(the mini-sglang shape: a small manager with a contract and an integrity check).
"""

from __future__ import annotations

import asyncio
import bisect
from collections import deque
from collections.abc import Sequence

from ladsd.config import FRAME_OVERHEAD
from ladsd.delivery.policy import Pending
from ladsd.records import ContinuationId, InventoryItem, Phase, SenderInventory
from ladsd.transport.outbox_entries import Entry, Ticket


class Queues:
    """F(t), the committed queue, the index of both and the two events on them.

    Owns: F(t) (ready, uncommitted entries in FIFO order: ready time, then
    offer order), the committed queue (transport order, fixed once committed),
    ``by_cid`` (every live entry), the offer sequence, and the events the
    socket part waits on, ``idle`` (nothing pending or committed) and
    ``unsent`` (a committed frame has bytes not yet on the wire), brought up to
    date by :meth:`refresh`.

    Moves entries between the queues and sets their phase and wire progress;
    never settles a ticket and never calls the policy (the outbox does both).
    The outbox calls it on the event loop's thread only.

    Invariants (:meth:`check_integrity`): every live entry is in exactly one
    queue and in ``by_cid``, nothing else is; F(t) holds pending entries in
    FIFO order; at most ``window`` committed; committed frames go on the wire
    in order (fully sent ones, at most one partly sent, then unsent ones), so
    Q_B is the unsent bytes of the committed queue; no live entry's ticket is
    settled, and a committed one's is stamped.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._pending: list[Entry] = []  # F(t), FIFO order
        self._committed: deque[Entry] = deque()  # transport order
        self._by_cid: dict[ContinuationId, Entry] = {}  # pending + committed
        self._seq = 0
        self.idle = asyncio.Event()  # nothing pending, nothing committed
        self.idle.set()
        self.unsent = asyncio.Event()  # a committed frame has bytes not yet on the wire

    # ---- reading

    def get(self, cid: ContinuationId) -> Entry | None:
        return self._by_cid.get(cid)

    def __contains__(self, cid: ContinuationId) -> bool:
        return cid in self._by_cid

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

    def live(self) -> list[Entry]:
        """Every live entry: F(t), then the committed queue."""
        return [*self._pending, *self._committed]

    def inventory(self, time: float, rate: float) -> SenderInventory:
        """The causal inventory: pending and committed results, FIFO order."""
        items = tuple(
            InventoryItem(e.ticket.cid, e.phase, e.ticket.item.payload_bytes, e.order()[0])
            for e in sorted(self.live(), key=Entry.order)
        )
        q_b, h = self.q_b, FRAME_OVERHEAD
        return SenderInventory(time=time, items=items, q_b=q_b, rate=rate, overhead=h)

    def has_room(self) -> bool:
        """Results are pending and the window has room for one more commitment."""
        return bool(self._pending) and len(self._committed) < self.window

    def next_unsent(self) -> Entry | None:
        """The committed frame to put on the wire next (transport order)."""
        for e in self._committed:
            if e.sent < len(e.data):
                return e
        return None

    # ---- moving entries

    def add(self, offered: Sequence[tuple[Ticket, bytes]]) -> list[Entry]:
        """New pending entries (ticket, encoded frame), numbered in offer order."""
        batch = [Entry(tk, self._seq + i, data) for i, (tk, data) in enumerate(offered)]
        self._seq += len(batch)
        for e in batch:
            bisect.insort(self._pending, e, key=Entry.order)
            self._by_cid[e.ticket.cid] = e
        return batch

    def commit(self, e: Entry) -> None:
        """``e`` leaves F(t) for the end of the committed queue, nothing of it on the wire."""
        self._pending.remove(e)
        e.phase, e.sent, e.tx, e.drops = Phase.COMMITTED, 0, 0, 0
        self._committed.append(e)

    def requeue(self, e: Entry) -> None:
        """A committed ``e`` goes back into F(t) (at its FIFO place)."""
        self._committed.remove(e)
        e.phase = Phase.PENDING
        bisect.insort(self._pending, e, key=Entry.order)

    def remove(self, e: Entry) -> None:
        """``e`` leaves its queue and the index (received, cancelled or failed)."""
        (self._pending if e.phase is Phase.PENDING else self._committed).remove(e)
        del self._by_cid[e.ticket.cid]

    def drain(self) -> list[Entry]:
        """Empty both queues; returns what they held (F(t), then committed)."""
        out = self.live()
        self._pending.clear()
        self._committed.clear()
        self._by_cid.clear()
        return out

    def rewind(self) -> Entry | None:
        """Every committed frame goes on the wire again, whole; the head if it had started."""
        head = self._committed[0] if self._committed else None
        started = head is not None and head.sent > 0
        for e in self._committed:
            e.sent = 0
        return head if started else None

    def refresh(self) -> None:
        """Bring ``idle`` and ``unsent`` up to date (after every change)."""
        if self._pending or self._committed:
            self.idle.clear()
        else:
            self.idle.set()
        if self.next_unsent() is None:
            self.unsent.clear()
        else:
            self.unsent.set()

    # ---- introspection

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
            assert e.phase is Phase.PENDING or tk.committed.done(), f"{tk.cid.key()} not stamped"
            assert tk.commits == 0 or tk.s is not None
        assert self.idle.is_set() == (not live), "idle event disagrees"
        assert self.unsent.is_set() == (self.next_unsent() is not None), "unsent event disagrees"
