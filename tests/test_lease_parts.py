"""The lease book's parts on vLLM's real scheduler (no model): bounded memory,
lease status, each part's integrity check, and the one grant order.

After every path a continuation can take (handoff, cancel, expiry after its
request is done, expiry while a candidate, never listed, superseded, refused)
the book keeps nothing about it: ``sizes()`` is back to 0 on every part.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from ladsd import testing
from ladsd.clock import ManualClock
from ladsd.config import LeaseConfig
from ladsd.engine.budget import fifo_key
from ladsd.engine.lease_pool import LeaseIntegrityError
from ladsd.engine.sched_leases import LeaseScheduler
from ladsd.records import (
    ContinuationId,
    HistoryNotice,
    InventoryItem,
    LeaseStatus,
    Phase,
    SenderInventory,
)

BS = 16
LIFE = 8.0
N = 12  # workflows per path


def toks(seed: int, n_blocks: int) -> list[int]:
    return [1000 + seed * 7919 + i for i in range(n_blocks * BS)]


@dataclass
class Rig:
    s: Any
    clk: ManualClock
    items: dict[ContinuationId, InventoryItem] = field(default_factory=dict)
    n_req: int = 0

    @property
    def book(self) -> Any:
        return self.s.lease_book

    def add(self, tokens: list[int], max_tokens: int = 2) -> Any:
        self.n_req += 1
        req = testing.make_request(f"r{self.n_req}", tokens, max_tokens=max_tokens)
        self.s.add_request(req)
        return req

    def until(self, done: Any, limit: int = 200) -> None:
        for _ in range(limit):
            if done():
                return
            testing.step(self.s)
            self.s.check_integrity()
        raise AssertionError(f"not reached in {limit} steps")

    def run(self, tokens: list[int]) -> None:
        req = self.add(tokens)
        self.until(req.is_finished)

    def notice(self, cid: ContinuationId, history: list[int], listed: bool = True) -> None:
        n = HistoryNotice(cid, tuple(history), "p", "d", self.clk(), 300)
        self.s.lease_notice(n)
        if listed:
            self.items[cid] = InventoryItem(cid, Phase.PENDING, 300, n.ready_time)
            self.publish()
        self.s.check_integrity()

    def publish(self) -> None:
        items = tuple(sorted(self.items.values(), key=lambda i: (i.ready_time, i.cid)))
        self.s.lease_inventory(SenderInventory(self.clk(), items, 0, 1e6))
        self.s.check_integrity()

    def receive(self, cid: ContinuationId) -> None:
        """Committed, then completely received: the sender stops listing it."""
        self.items[cid] = replace(self.items[cid], phase=Phase.COMMITTED)
        self.publish()
        del self.items[cid]
        self.publish()

    def leased(self, cid: ContinuationId) -> bool:
        return self.s.lease_state().lease_for(cid) is not None

    def empty(self) -> None:
        sizes = self.book.sizes()
        parts = {"pending", "latest", "phases", "leases", "holders", "bound", "refused"}
        assert set(sizes) == parts
        assert {k: v for k, v in sizes.items() if v} == {}
        assert self.s.lease_state().U == 0


def rig(num_blocks: int = 96, headroom: int = 4) -> Rig:
    s = testing.make_scheduler(LeaseScheduler, num_blocks=num_blocks, block_size=BS)
    clk = ManualClock(1000.0)
    s.lease_setup(LeaseConfig(headroom_blocks=headroom, lease_lifetime_s=LIFE), 0.0, clk)
    return Rig(s, clk)


def cid_(k: int, version: int = 0) -> ContinuationId:
    return ContinuationId(f"w{k}", 1, version)


# -- bounded memory ----------------------------------------------------------


def test_sizes_back_to_zero_after_handoff_and_completion() -> None:
    r = rig()
    r.empty()
    for k in range(N):
        cid, hist = cid_(k), toks(k, 4)
        r.run(hist)
        r.notice(cid, hist)
        assert r.leased(cid)
        r.receive(cid)
        req = r.add(hist + toks(500 + k, 2))
        r.s.lease_bind(cid, req.request_id)
        testing.step(r.s)  # allocation: the lease is handed off, nothing is left
        assert r.book.counters["handoffs"] == k + 1
        r.empty()
        r.until(req.is_finished)
        r.empty()
    r.s.lease_audit()


@pytest.mark.parametrize("via", ["lease_cancel", "inventory"])
def test_sizes_back_to_zero_after_cancel(via: str) -> None:
    r = rig()
    for k in range(N):
        cid, hist = cid_(k), toks(k, 4)
        r.run(hist)
        r.notice(cid, hist)
        assert r.leased(cid)
        if via == "lease_cancel":
            r.s.lease_cancel(cid)
            del r.items[cid]
        else:
            r.items[cid] = replace(r.items[cid], phase=Phase.CANCELLED)
            r.publish()
            del r.items[cid]
        r.publish()
        r.empty()
    assert r.book.counters["cancellations"] == N


def test_sizes_back_to_zero_after_expiry_once_the_request_is_done() -> None:
    # The registered request never covers the lease (its prompt diverges), finishes,
    # and the lease stays until d_i: then nothing is left.
    r = rig()
    for k in range(N):
        cid, hist = cid_(k), toks(k, 4)
        r.run(hist)
        r.notice(cid, hist)
        r.receive(cid)
        req = r.add(hist[:BS] + toks(700 + k, 3))
        r.s.lease_bind(cid, req.request_id)
        r.until(req.is_finished)
        assert r.leased(cid) and r.book.sizes()["bound"] == 1
        r.clk.advance(LIFE)
        r.s.lease_tick()
        r.empty()
    c = r.book.counters
    assert c["expiries"] == c["handoff_mismatches"] == N and c["handoffs"] == 0


def test_sizes_back_to_zero_after_expiry_while_a_candidate() -> None:
    r = rig()
    for k in range(N):
        cid, hist = cid_(k), toks(k, 4)
        r.run(hist)
        r.notice(cid, hist)
        r.clk.advance(LIFE)
        r.s.lease_tick()
        assert not r.leased(cid) and r.book.sizes()["pending"] == 1  # still on its way
        r.receive(cid)
        r.empty()
    assert r.book.counters["expiries"] == N


def test_sizes_back_to_zero_when_the_sender_never_lists_a_result() -> None:
    r = rig()
    r.publish()  # the link rate is known: an unlisted result joins the FIFO tail
    for k in range(N):
        cid, hist = cid_(k), toks(k, 4)
        r.run(hist)
        r.notice(cid, hist, listed=False)
        assert r.leased(cid)
        r.clk.advance(LIFE + 0.5)  # the lease expires, then the candidate is dropped
        r.s.lease_tick()
        r.empty()


def test_sizes_back_to_zero_after_supersession_and_handoff() -> None:
    r = rig()
    for k in range(N):
        old, new, hist = cid_(k, 0), cid_(k, 1), toks(k, 4)
        r.run(hist)
        r.notice(old, hist)
        r.notice(new, hist)  # invalidates the older version and its lease
        del r.items[old]
        r.publish()
        assert not r.leased(old) and r.leased(new)
        r.notice(old, hist, listed=False)  # stale while the newer version is live
        r.receive(new)
        req = r.add(hist + toks(600 + k, 1))
        r.s.lease_bind(new, req.request_id)
        r.until(req.is_finished)
        r.empty()
    c = r.book.counters
    assert c["invalidations"] == c["stale_notices"] == c["handoffs"] == N


def test_refusals_are_forgotten_with_their_candidate() -> None:
    # H leaves room for no lease at all: every candidate is refused, then received.
    r = rig(num_blocks=32, headroom=30)
    for k in range(N):
        cid, hist = cid_(k), toks(k, 4)
        r.run(hist)
        r.notice(cid, hist)
        assert not r.leased(cid) and r.book.sizes()["refused"] == 1
        r.receive(cid)
        r.empty()
    assert r.book.counters["headroom_refusals"] >= N


def test_release_all_leaves_nothing() -> None:
    r = rig()
    for k in range(4):
        r.run(toks(k, 4))
        r.notice(cid_(k), toks(k, 4))
    r.s.lease_release_all()
    r.empty()
    assert r.s.lease_audit()["refs_held"] == 0


# -- lease status ----------------------------------------------------------------


def test_a_lease_records_how_it_ended() -> None:
    r = rig(num_blocks=64, headroom=20)
    ended: dict[str, Any] = {}
    hs = [toks(k, 4) for k in range(5)]
    for k, h in enumerate(hs):
        r.run(h)
        r.notice(cid_(k), h)
    leases = dict(r.book.table.leases)
    assert all(x.status is LeaseStatus.GRANTED for x in leases.values())
    assert all(rec.status is LeaseStatus.GRANTED for rec in r.s.lease_state().leases)
    # handoff
    r.receive(cid_(0))
    req = r.add(hs[0] + toks(99, 1))
    r.s.lease_bind(cid_(0), req.request_id)
    testing.step(r.s)
    ended["handoff"] = leases[cid_(0)].status
    # cancellation
    r.s.lease_cancel(cid_(1))
    ended["cancel"] = leases[cid_(1)].status
    # revocation: a flood below H takes the latest deadline first
    r.clk.advance(1.0)
    big = r.add(toks(50, 40), max_tokens=30)
    r.until(lambda: r.book.counters["revocations"] > 0)
    revoked = [x for x in leases.values() if x.status is LeaseStatus.REVOKED]
    assert revoked and all(x.cid not in r.book.table.leases for x in revoked)
    r.s.finish_requests(big.request_id, RequestStatus.FINISHED_ABORTED)
    # expiry
    r.clk.advance(LIFE)
    r.s.lease_tick()
    assert ended == {"handoff": LeaseStatus.HANDED_OFF, "cancel": LeaseStatus.CANCELLED}
    rest = [x.status for x in leases.values() if x.status is not LeaseStatus.REVOKED]
    assert rest.count(LeaseStatus.EXPIRED) == 5 - 2 - len(revoked)
    c = r.book.counters
    assert (c["ended_handed_off"], c["ended_cancelled"]) == (1, 1)
    assert c["ended_revoked"] == len(revoked) and c["ended_expired"] == rest.count(
        LeaseStatus.EXPIRED
    )
    # An ended lease cannot be released again, whatever status is asked for.
    assert not r.book.table.release(leases[cid_(0)], LeaseStatus.CANCELLED, r.clk())
    assert leases[cid_(0)].status is LeaseStatus.HANDED_OFF


# -- each part's integrity check ---------------------------------------------------


def leased_rig() -> tuple[Rig, ContinuationId]:
    r = rig()
    h = toks(1, 4)
    r.run(h)
    r.notice(cid_(1), h)
    assert r.leased(cid_(1))
    return r, cid_(1)


def test_table_check_catches_a_holder_index_or_status_out_of_line() -> None:
    r, cid = leased_rig()
    table = r.book.table
    table.holders[10_000] = {cid}
    with pytest.raises(LeaseIntegrityError, match="holder index"):
        table.check_integrity()
    del table.holders[10_000]
    table.leases[cid].status = LeaseStatus.EXPIRED
    with pytest.raises(LeaseIntegrityError, match="filed as"):
        table.check_integrity()
    table.leases[cid].status = LeaseStatus.GRANTED
    table.check_integrity()


def test_candidates_check_catches_a_turn_or_phase_out_of_line() -> None:
    r, cid = leased_rig()
    cands = r.book.cands
    cands.latest[(cid.workflow, cid.turn)] = 5
    with pytest.raises(LeaseIntegrityError, match="turn is not live"):
        cands.check_integrity()
    cands.latest[(cid.workflow, cid.turn)] = cid.version
    cands.phases[ContinuationId("ghost", 1)] = Phase.PENDING
    with pytest.raises(LeaseIntegrityError, match="phases"):
        cands.check_integrity()
    del cands.phases[ContinuationId("ghost", 1)]
    cands.check_integrity()


def test_book_check_catches_parts_that_disagree() -> None:
    r, cid = leased_rig()
    book = r.book
    book.cands.latest[("ghost", 1)] = 0  # a turn with nothing live
    with pytest.raises(LeaseIntegrityError, match="turn versions"):
        book.check()
    del book.cands.latest[("ghost", 1)]
    book.bound["nobody"] = ContinuationId("ghost", 1)
    with pytest.raises(LeaseIntegrityError, match="without a lease"):
        book.check()
    del book.bound["nobody"]
    book.check()


# -- one grant order -------------------------------------------------------------


def test_fifo_key_is_ready_time_then_continuation_order() -> None:
    ids = [
        ContinuationId("b", 1, 0),
        ContinuationId("a", 2, 0),
        ContinuationId("a", 1, 1),
        ContinuationId("a", 1, 0),
        ContinuationId("a", 10, 0),
    ]
    entries = [(t, c) for t in (2.0, 1.0) for c in ids]
    spelled = sorted(entries, key=lambda e: (e[0], e[1].workflow, e[1].turn, e[1].version))
    assert sorted(entries, key=lambda e: fifo_key(*e)) == spelled
