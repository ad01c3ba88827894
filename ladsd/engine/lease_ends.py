"""What ends holds and candidates in the lease book, and what the book keeps after.

:class:`Ends` is the book's maintenance and its end-of-life rules, apart from
the operations that start things (notices, grants, pins, binds).
"""

from __future__ import annotations

from collections.abc import Callable

from ladsd.clock import Clock
from ladsd.engine.lease_candidates import Candidates
from ladsd.engine.lease_grants import Grants
from ladsd.engine.lease_holds import Holds
from ladsd.engine.lease_pool import LeaseIntegrityError
from ladsd.engine.lease_publish import Publication
from ladsd.engine.lease_sessions import Sessions
from ladsd.engine.lease_table import Lease
from ladsd.records import ContinuationId, LeaseKind, LeaseStatus


class Ends:
    """The rules that end holds and candidates, joining the book's parts.

    Owns only the end-of-run mark (the grant and pin counts at
    :meth:`release_all`); the parts own the rest; this is the one place that
    says what an end does to each of them. Only
    :class:`~ladsd.engine.lease_book.LeaseBook` calls it, on the engine thread.

    * :meth:`maintain` (before every public operation of the book): stripped
      blocks leave their holds, holds at their deadline expire, leases are
      revoked while fewer than ``H`` blocks are free, candidates never listed
      within ``l`` are dropped, sessions kept past their bind's wait leave.
    * :meth:`ended`: every end of a hold (``Holds.release``) comes back here:
      a lease's end is published, the grants may refill, the continuation settles.
    * :meth:`supersede` cancels the older live version of a turn,
      :meth:`cancel` ends its lease, pin, session and candidacy,
      :meth:`forget` ends a candidacy (its refusals and unbound session go),
      :meth:`receive` ends it at the receipt (an unbound session is kept),
      and :meth:`settle` keeps nothing about a continuation once none holds it.
    * :meth:`drop_all` releases every lease and pin; :meth:`release_all` (end
      of run) forgets everything else too; :meth:`check_released` raises if
      anything is still held after it (while nothing was granted or pinned since).
    """

    def __init__(
        self,
        cands: Candidates,
        leases: Holds,
        pins: Holds,
        sessions: Sessions,
        grants: Grants,
        pub: Publication,
        clock: Clock,
        engine_delay: Callable[[], float],
    ) -> None:
        self.cands = cands
        self.leases = leases
        self.pins = pins
        self.sessions = sessions
        self.grants = grants
        self.pub = pub
        self.clock = clock
        self.engine_delay = engine_delay
        self._end_mark: tuple[int, int] | None = None  # (grants, pins) at release_all

    def maintain(self, now: float) -> bool:
        """Strip, expire, revoke, drop unlisted; True if any lease reference was released."""
        pool = self.leases.table.pool
        before = pool.refs_released
        self.strip(now)
        self.leases.expire(now)
        self.pins.expire(now)
        self.grants.revoke(now, self.engine_delay)  # LADS leases only: never a pin
        for cid in self.cands.unlisted(now):  # never offered within l (bounded memory)
            self.forget(cid)
        self.sessions.expire(now)  # kept at their receipt, no bind within l_i
        return pool.refs_released != before

    def strip(self, now: float) -> None:
        """Held blocks whose hash was stripped leave their holds (prefix cut there)."""
        for holds in (self.leases, self.pins):
            if holds.strip(now):
                self.grants.released = True

    def ended(
        self, kind: LeaseKind, x: Lease, status: LeaseStatus, blocks: int, now: float
    ) -> None:
        """A hold ended (``Holds.release``): publish a lease's end, refill, settle."""
        if kind is LeaseKind.LADS:
            self.pub.lease_ended(x.cid, status, blocks, now)
        self.grants.released = True
        self.settle(x.cid)

    def supersede(self, cid: ContinuationId) -> bool:
        """Invalidate the older live version of ``cid``'s turn; False if ``cid`` itself is old."""
        if self.cands.stale(cid):
            return False
        old = self.cands.older(cid)
        if old is not None:
            self.cancel(old, "invalidations")
        return True

    def cancel(self, cid: ContinuationId, counter: str) -> None:
        """End ``cid``'s lease (counted as ``counter``), pin, session and candidacy."""
        lease = self.leases.get(cid)
        if lease is not None:
            self.leases.release(lease, LeaseStatus.CANCELLED, counter, self.clock())
        elif cid in self.cands.pending:
            self.pub.counters[counter] += 1
        pin = self.pins.get(cid)
        if pin is not None:  # cancelled or superseded
            self.pins.release(pin, LeaseStatus.CANCELLED, "pin_cancels", self.clock())
        self.sessions.end(cid)
        self.forget(cid)

    def forget(self, cid: ContinuationId) -> None:
        """No longer a grant candidate (received, cancelled, unlisted); a lease stays."""
        if self.cands.forget(cid):
            # Only candidates are refused, and a new candidate comes with a notice,
            # which starts a new generation: its refusals can never be counted again.
            self.grants.refused.pop(cid, None)
            self.sessions.end_unbound(cid)  # dropped before any request was bound
            self.settle(cid)

    def receive(self, cid: ContinuationId, now: float) -> None:
        """``cid``'s result reached the agent: no longer a candidate; an unbound session
        waits on for its bind up to ``l_i`` (``Sessions.received``)."""
        p = self.cands.pending.get(cid)
        if p is not None:
            self.sessions.received(cid, now + self.cands.lifetime_of(p.notice))
        self.forget(cid)

    def settle(self, cid: ContinuationId) -> None:
        """Keep nothing about ``cid`` once it is neither a candidate nor held."""
        if cid not in self.cands.pending and cid not in self.leases and cid not in self.pins:
            self.cands.settle(cid)

    def drop_all(self, counter: str) -> None:
        """Release every lease and pin (prefix-cache reset, end of run)."""
        now = self.clock()
        self.strip(now)
        self.leases.drop(counter, now)
        self.pins.drop(counter, now)

    def release_all(self) -> None:
        """End of run: release every lease and pin and forget all candidates."""
        self.drop_all("released_at_end")
        self.cands.clear()
        self.leases.bound.clear()
        self.sessions.clear()
        self.grants.clear()
        self._end_mark = self._marks()

    def check_released(self, held_refs: int) -> None:
        """After :meth:`release_all`, with no grant or pin since, nothing may be held."""
        leases, pins = self.leases.held, self.pins.held
        if self._end_mark == self._marks() and (leases or pins or held_refs):
            n = len(leases) + len(pins)
            raise LeaseIntegrityError(f"{n} leases and pins remain after release_all")

    def _marks(self) -> tuple[int, int]:
        return (self.pub.counters["grants"], self.pub.counters["pins"])
