"""The holds manager alone (ladsd.engine.lease_holds) on vLLM's real KV cache manager.

No model and no lease book: a plain vLLM ``Scheduler`` runs one request so its
blocks stay cached, then each test takes holds on them and drives one verb
(acquire, release, bind/handoff, due/expire, strip, drop), checking the
references on the pool, the counters, the ``ended`` callbacks and
``check_integrity()``; the integrity tests break one invariant each and expect
the check to say so. The last two do the same for the book's other new parts
(publication, grants) on a lease scheduler.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from ladsd import testing
from ladsd.clock import ManualClock
from ladsd.config import LeaseConfig
from ladsd.engine.lease_holds import LEASES, PINS, HoldNames, Holds
from ladsd.engine.lease_pool import LeaseIntegrityError
from ladsd.engine.lease_resident import Prefix, lookup, make_hasher, prefix_hashes
from ladsd.engine.lease_table import Lease
from ladsd.engine.sched_leases import LeaseScheduler
from ladsd.records import ContinuationId, DenialEvent, HistoryNotice, LeaseKind, LeaseStatus
from tests.rigs.leases import BS, toks

CID = ContinuationId("w", 1)


@dataclass
class HoldsRig:
    """A plain vLLM scheduler with cached histories, and holds of both kinds on its pool
    (the holds manager alone: no lease book, so not the lease rig)."""

    s: Any
    counters: Counter[str] = field(default_factory=Counter)
    ended: list[tuple[LeaseKind, ContinuationId, LeaseStatus, int]] = field(default_factory=list)
    n_req: int = 0

    def holds(self, kind: LeaseKind = LeaseKind.LADS) -> Holds:
        names: HoldNames = LEASES if kind is LeaseKind.LADS else PINS
        return Holds(
            self.s.kv_cache_manager,
            0.0,
            lambda: (),
            kind=kind,
            names=names,
            counters=self.counters,
            ended=self._ended,
        )

    def _ended(self, kind: LeaseKind, x: Lease, status: LeaseStatus, n: int, now: float) -> None:
        self.ended.append((kind, x.cid, status, n))

    def cached(self, history: list[int]) -> tuple[list[Any], ...]:
        """Run ``history`` to completion; its resident prefix per group (all cached)."""
        self.n_req += 1
        req = testing.make_request(f"r{self.n_req}", history, max_tokens=1)
        self.s.add_request(req)
        for _ in range(50):
            if req.is_finished():
                break
            testing.step(self.s)
        assert req.is_finished()
        kv = self.s.kv_cache_manager
        return lookup(kv, prefix_hashes(history, make_hasher(BS)), len(history))

    def acquire(
        self, h: Holds, cid: ContinuationId, history: list[int], deadline: float = 10.0
    ) -> Lease:
        resident = self.cached(history)
        notice = HistoryNotice(cid, tuple(history), "p", "d", 0.0, 100)
        return h.acquire(
            notice,
            Prefix.of(resident),
            granted_at=0.0,
            deadline=deadline,
            committed=False,
            generation=1,
            now=0.0,
        )

    @property
    def pool(self) -> Any:
        return self.s.kv_cache_manager.block_pool


def rig() -> HoldsRig:
    return HoldsRig(testing.make_scheduler(Scheduler, num_blocks=64, block_size=BS))


def test_acquire_takes_one_reference_per_block_and_release_gives_them_back_once() -> None:
    r = rig()
    h = r.holds()
    x = r.acquire(h, CID, toks(1, 4))
    assert len(x.blocks) == 4 and all(b.ref_cnt == 1 for b in x.blocks)
    assert CID in h and h.get(CID) is x and h.table.used == 4
    h.check_integrity()
    blocks = list(x.blocks)
    assert h.release(x, LeaseStatus.CANCELLED, "cancellations", 1.0)
    assert all(b.ref_cnt == 0 for b in blocks) and CID not in h
    assert x.status is LeaseStatus.CANCELLED
    assert r.counters == Counter(cancellations=1)
    assert r.ended == [(LeaseKind.LADS, CID, LeaseStatus.CANCELLED, 4)]
    # A second release finds nothing: no reference, no count, no callback.
    assert not h.release(x, LeaseStatus.EXPIRED, "expiries", 2.0)
    assert r.counters == Counter(cancellations=1) and len(r.ended) == 1
    assert h.balance() == 0
    h.check_integrity()


def test_handoff_ends_a_covered_hold_and_counts_a_mismatch_once() -> None:
    r = rig()
    h = r.holds()
    x = r.acquire(h, CID, toks(2, 3))
    assert h.bind(CID, "req-a") and not h.bind(ContinuationId("nobody", 1), "req-b")
    assert h.bound == {"req-a": CID} and x.reqs == ["req-a"]
    h.handoff("req-unbound", lambda rid: ([],), 1.0)  # not bound: nothing happens
    for _ in range(2):  # a table that does not cover the hold: counted once
        h.handoff("req-a", lambda rid: ([],), 1.0)
    assert r.counters == Counter(handoff_mismatches=1) and CID in h
    covering = [list(x.blocks)]
    h.handoff("req-a", lambda rid: covering, 2.0)
    assert CID not in h and h.bound == {}
    assert r.counters["handoffs"] == 1
    assert r.ended == [(LeaseKind.LADS, CID, LeaseStatus.HANDED_OFF, 3)]
    h.check_integrity()


def test_expire_ends_only_holds_at_their_deadline() -> None:
    r = rig()
    h = r.holds(LeaseKind.PIN)
    early, late = ContinuationId("a", 1), ContinuationId("b", 1)
    r.acquire(h, early, toks(3, 2), deadline=5.0)
    r.acquire(h, late, toks(4, 2), deadline=9.0)
    h.expire(4.9)
    assert set(h.held) == {early, late} and not r.ended
    assert [x.cid for x in h.due(5.0)] == [early]
    h.expire(5.0)
    assert set(h.held) == {late}
    assert r.counters == Counter(pin_expiries=1)
    assert r.ended == [(LeaseKind.PIN, early, LeaseStatus.EXPIRED, 2)]
    h.check_integrity()


def test_strip_cuts_the_tail_or_ends_a_hold_whose_head_broke() -> None:
    r = rig()
    h = r.holds()
    tail, head = ContinuationId("t", 1), ContinuationId("h", 1)
    xt = r.acquire(h, tail, toks(5, 4))
    xh = r.acquire(h, head, toks(6, 3))
    r.pool._remove_cached_block_hashes(xt.blocks[2])  # third of four: blocks 3 and 4 leave
    r.pool._remove_cached_block_hashes(xh.blocks[0])  # the head: nothing would remain
    assert h.strip(1.0)
    assert len(xt.blocks) == 2 and tail in h and head not in h
    assert r.counters == Counter(stripped_blocks=2, stripped_leases=1)
    assert r.ended == [(LeaseKind.LADS, head, LeaseStatus.CANCELLED, 3)]
    assert not h.strip(2.0)  # nothing stripped since
    h.check_integrity()


def test_drop_ends_every_hold_under_the_kinds_counter_name() -> None:
    r = rig()
    leases, pins = r.holds(), r.holds(LeaseKind.PIN)
    r.acquire(leases, ContinuationId("a", 1), toks(7, 2))
    r.acquire(pins, ContinuationId("b", 1), toks(8, 2))
    leases.drop("reset_drops", 1.0)
    pins.drop("reset_drops", 1.0)
    assert not leases.held and not pins.held
    assert r.counters == Counter(reset_drops=1, pin_reset_drops=1)
    assert r.pool.refs_added == r.pool.refs_released == 4


def test_two_kinds_share_blocks_and_keep_their_own_ledgers_and_names() -> None:
    r = rig()
    leases, pins = r.holds(), r.holds(LeaseKind.PIN)
    history = toks(9, 3)
    x = r.acquire(leases, CID, history)
    p = r.acquire(pins, ContinuationId("w", 2), history)  # the same three blocks
    assert all(b.ref_cnt == 2 for b in x.blocks) and [b.block_id for b in p.blocks] == [
        b.block_id for b in x.blocks
    ]
    assert leases.table.used == pins.table.used == 3
    leases.bind(CID, "req")
    assert leases.sizes() == {"leases": 1, "holders": 3, "bound": 1}
    assert pins.sizes() == {"pins": 1, "pin_holders": 3, "pin_bound": 0}
    leases.check_integrity()  # the whole pool: both kinds' references counted
    pins.check_integrity(with_pool=False)
    assert leases.balance() == pins.balance() == 3


def test_check_integrity_catches_a_binding_without_a_hold() -> None:
    r = rig()
    pins = r.holds(LeaseKind.PIN)
    r.acquire(pins, CID, toks(10, 2))
    pins.bound["ghost-req"] = CID  # bound, but the pin never listed the request
    with pytest.raises(LeaseIntegrityError, match="without a pin"):
        pins.check_integrity()
    del pins.bound["ghost-req"]
    pins.check_integrity()


def test_check_integrity_catches_a_hold_dropped_behind_the_ledgers_back() -> None:
    r = rig()
    h = r.holds()
    x = r.acquire(h, CID, toks(11, 2))
    del h.table.leases[CID]  # its references are still on the pool and in the ledger
    with pytest.raises(LeaseIntegrityError, match="ledger disagrees"):
        h.check_integrity(with_pool=False)
    h.table.leases[CID] = x
    h.check_integrity()


# -- the book's other parts keep their own checks ----------------------------------


def book() -> Any:
    s = testing.make_scheduler(LeaseScheduler, num_blocks=64, block_size=BS)
    s.lease_setup(LeaseConfig(headroom_blocks=2), 0.0, ManualClock(1000.0))
    return s.lease_book


def test_publication_check_catches_counters_out_of_line() -> None:
    b = book()
    b.pub.check_integrity()
    b.counters["grants"] -= 1  # a negative count
    with pytest.raises(LeaseIntegrityError, match="negative counters: grants"):
        b.check()
    b.counters["grants"] = 1
    b.counters["ended_expired"] = 2  # more ends than grants
    with pytest.raises(LeaseIntegrityError, match="2 lease ends counted for 1 grants"):
        b.check()
    b.counters["ended_expired"] = 1
    b.check()


def test_grants_check_catches_a_denial_of_an_earlier_generation() -> None:
    b = book()
    b.tick()  # generation 1
    b.grants.denials.append(DenialEvent(CID, 1000.0, b.grants.generation - 1, 1, 0, 0))
    with pytest.raises(LeaseIntegrityError, match="earlier generation"):
        b.check()
    b.tick()  # a new evaluation replaces the denials
    b.check()
    b.grants.refused[CID] = {"denials"}  # refused, but no candidate
    with pytest.raises(LeaseIntegrityError, match="no candidate"):
        b.grants.check_integrity()
