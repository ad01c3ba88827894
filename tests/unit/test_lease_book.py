"""The lease book on vLLM's real Scheduler / KVCacheManager (no model, no workers):
grants, handoff, expiry, revocation, integrity; then the book's parts (bounded memory).

Every scenario runs ``check_integrity()`` after every operation: each block's
``ref_cnt`` must equal its native holders plus its lease references.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import RequestStatus

from ladsd import testing
from ladsd.clock import ManualClock
from ladsd.config import LeaseConfig
from ladsd.engine.budget import fifo_key
from ladsd.engine.lease_pool import LeaseBlockPool, LeaseIntegrityError
from ladsd.engine.sched_leases import AsyncLeaseScheduler, LeaseScheduler
from ladsd.records import (
    ContinuationId,
    HistoryNotice,
    InventoryItem,
    LeaseStatus,
    Phase,
    SenderInventory,
)
from tests.rigs.leases import BS, Rig, cont, rig, toks

A = ContinuationId("wa", 1)
B = ContinuationId("wb", 1)
C = ContinuationId("wc", 1)


# -- scenarios ---------------------------------------------------------------


def test_before_setup_the_scheduler_is_plain_vllm() -> None:
    s = testing.make_scheduler(LeaseScheduler, num_blocks=32)
    assert type(s.kv_cache_manager.block_pool) is BlockPool
    req = testing.make_request("x", toks(0, 3))
    s.add_request(req)
    for _ in range(10):
        testing.step(s)
        s.check_integrity()
    assert req.is_finished()
    with pytest.raises(RuntimeError, match="lease_setup"):
        s.lease_notice(HistoryNotice(A, (1,), "p", "d", 0.0, 1))
    s.lease_setup(LeaseConfig(headroom_blocks=2), 0.0, ManualClock())
    assert isinstance(s.kv_cache_manager.block_pool, LeaseBlockPool)
    with pytest.raises(RuntimeError, match="already"):
        s.lease_setup(LeaseConfig(), 0.0)


@pytest.mark.parametrize("cls", [LeaseScheduler, AsyncLeaseScheduler])
def test_leased_prefix_survives_a_flood_that_evicts_its_unleased_twin(cls: type) -> None:
    r = rig(cls, num_blocks=64)
    ha, hb = toks(1, 10), toks(2, 10)
    r.run(ha)
    r.run(hb)
    assert r.s.lease_resident(ha) == 10 and r.s.lease_resident(hb) == 10
    r.notice(A, ha)
    assert r.lease(A) is not None and r.s.lease_state().U == 10
    for k in range(4):  # each flood request needs 30 of the 63 usable blocks
        r.run(toks(10 + k, 30))
    assert r.s.lease_resident(hb) == 0  # the twin was evicted
    assert r.s.lease_resident(ha) == 10  # the leased prefix was not
    # The continuation of the leased history reuses it; the twin's recomputes.
    ca = r.add(cont(ha))
    r.s.lease_bind(A, ca.request_id)
    cb = r.add(cont(hb))
    out = r.step()
    cached = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
    assert cached == {ca.request_id: 10 * BS, cb.request_id: 0}


@pytest.mark.parametrize("cls", [LeaseScheduler, AsyncLeaseScheduler])
def test_handoff_returns_exclusive_quota_while_the_request_runs(cls: type) -> None:
    r = rig(cls)
    ha = toks(1, 8)
    r.run(ha)
    r.notice(A, ha)
    rec = r.lease(A)
    assert rec.exclusive_blocks == 8 and len(rec.protected_blocks) == 8
    r.phase(A, Phase.COMMITTED)
    del r.items[A]  # received: leaves the inventory, lease stays until handoff
    r.publish()
    req = r.add(cont(ha), max_tokens=6)
    r.s.lease_bind(A, req.request_id)
    assert r.lease(A) is not None
    out = r.step()
    assert out.num_scheduled_tokens[req.request_id] > 0
    st = r.s.lease_state()
    assert st.lease_for(A) is None and st.U == 0
    assert st.counters["handoffs"] == 1 and st.counters["handoff_mismatches"] == 0
    assert req.status == RequestStatus.RUNNING
    table = r.s.kv_cache_manager.coordinator.get_blocks(req.request_id)[0]
    assert [b.block_id for b in table[:8]] == list(rec.protected_blocks)  # same physical blocks
    assert all(b.ref_cnt == 1 for b in table[:8])  # only the request holds them now
    r.until(req.is_finished)


def test_handoff_waits_until_the_block_table_covers_the_lease() -> None:
    r = rig()
    ha = toks(1, 8)
    r.run(ha)
    r.notice(A, ha)
    other = ha[: 4 * BS] + toks(5, 6)  # shares only 4 of the 8 protected blocks
    req = r.add(other)
    r.s.lease_bind(A, req.request_id)
    r.step()
    st = r.s.lease_state()
    assert st.lease_for(A) is not None  # not natively covered: no handoff
    assert st.counters["handoff_mismatches"] == 1
    r.step()
    assert r.s.lease_state().counters["handoff_mismatches"] == 1  # counted once per lease


def test_expiry_at_the_deadline_from_tick_schedule_and_lease_operations() -> None:
    r = rig(lifetime=8.0)
    ha, hb, hc = toks(1, 4), toks(2, 4), toks(3, 4)
    for h in (ha, hb, hc):
        r.run(h)
    t0 = r.clk()
    r.notice(A, ha)
    rec = r.lease(A)
    assert rec.granted_at == t0 and rec.deadline == t0 + 8.0
    r.clk.advance(7.999)
    r.s.lease_tick()
    assert r.lease(A) is not None
    r.clk.advance(0.001)  # exactly d_i
    r.s.lease_tick()
    r.ok()
    assert r.lease(A) is None and r.s.lease_state().counters["expiries"] == 1
    assert r.s.lease_resident(ha) == 4  # expired, not evicted: still cached
    # schedule() entry expires too, without a tick ...
    r.notice(B, hb)
    r.clk.advance(8.0)
    r.s.schedule()
    r.ok()
    assert r.lease(B) is None
    # ... and so does any lease operation.
    r.notice(C, hc)
    r.clk.advance(8.5)
    r.s.lease_cancel(ContinuationId("nobody", 0))
    assert r.lease(C) is None and r.s.lease_state().counters["expiries"] == 3


def test_regrant_keeps_the_first_grant_time_and_deadline() -> None:
    r = rig(num_blocks=64, headroom=20)
    ha = toks(1, 10)
    r.run(ha)
    r.notice(A, ha)
    first = r.lease(A)
    r.clk.advance(3.0)
    big = r.add(toks(9, 31), max_tokens=50)  # F = 63 - 10 - 31 = 22 >= 20 after prefill
    r.step()
    assert r.lease(A) is not None
    r.until(lambda: r.pool.get_num_free_blocks() < 20)
    r.step()  # schedule() entry revokes to restore H
    assert r.lease(A) is None and r.s.lease_state().counters["revocations"] == 1
    r.s.finish_requests(big.request_id, RequestStatus.FINISHED_ABORTED)
    r.ok()
    r.phase(A, Phase.COMMITTED)
    r.clk.advance(1.0)
    r.s.lease_tick()
    again = r.lease(A)
    assert again is not None and again.granted_at == first.granted_at
    assert again.deadline == first.deadline  # no extension on regrant
    assert again.committed_before_grant is True
    c = r.s.lease_state().counters
    assert c["grants_before_commit"] == 1 and c["grants_after_commit"] == 1


def test_revocation_keeps_headroom_latest_deadline_first() -> None:
    r = rig(num_blocks=64, headroom=20)
    ha, hb = toks(1, 10), toks(2, 10)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha)
    r.clk.advance(1.0)
    r.notice(B, hb)  # later grant -> later deadline
    assert r.s.lease_state().U == 20
    big = r.add(toks(9, 29), max_tokens=40)  # 30 blocks once decoding: F = 43 - 30 = 13
    r.step()
    r.until(lambda: r.pool.get_num_free_blocks() < 20)
    r.step()  # entry: revoke B (latest deadline) -> F = 23 >= 20; A survives
    st = r.s.lease_state()
    assert st.lease_for(A) is not None and st.lease_for(B) is None
    assert st.counters["revocations"] == 1 and st.F >= 20
    r.s.finish_requests(big.request_id, RequestStatus.FINISHED_ABORTED)
    r.ok()


def test_revocation_takes_untimely_handoffs_before_later_deadlines() -> None:
    r = rig(num_blocks=64, headroom=20)
    ha, hb = toks(1, 10), toks(2, 10)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha)
    r.clk.advance(1.0)
    r.notice(B, hb)
    r.phase(B, Phase.COMMITTED)  # B's frame is on its way; A's still waits in the queue
    r.rate = 1.0  # the link collapses: A's frame can no longer arrive before d_A
    r.publish()
    big = r.add(toks(9, 29), max_tokens=40)
    r.step()
    r.until(lambda: r.pool.get_num_free_blocks() < 20)
    r.step()
    st = r.s.lease_state()
    assert st.lease_for(A) is None and st.lease_for(B) is not None
    r.s.finish_requests(big.request_id, RequestStatus.FINISHED_ABORTED)
    r.ok()


def test_revocation_passes_again_once_a_release_raises_an_earlier_leases_gain() -> None:
    """B (the later deadline, revoked first) holds only blocks A's lease shares: its gain
    is 0 until A is revoked. A alone leaves F below H, so B's turn comes again."""
    r = rig(num_blocks=64, headroom=20)
    hb = toks(1, 5)
    ha = hb + toks(2, 3)
    r.run(ha)
    r.notice(A, ha)
    r.clk.advance(1.0)
    r.notice(B, hb)  # the later deadline; every block of it is A's too
    assert r.s.lease_state().U == 8
    big = r.add(toks(9, 39), max_tokens=4)  # 40 blocks: F = 55 - 40 = 15
    r.until(lambda: r.pool.get_num_free_blocks() < 20)
    r.step()  # entry: A frees 3 (F 18 < H), then B's 5 are its own (F 23)
    st = r.s.lease_state()
    assert st.lease_for(A) is None and st.lease_for(B) is None
    assert st.counters["revocations"] == 2 and st.F >= 20
    r.s.finish_requests(big.request_id, RequestStatus.FINISHED_ABORTED)
    r.ok()


def test_double_release_is_harmless() -> None:
    r = rig()
    ha = toks(1, 6)
    r.run(ha)
    r.notice(A, ha)
    lease = r.book.table.leases[A]
    blocks = list(lease.blocks)
    req = r.add(cont(ha), max_tokens=8)  # a running request shares the blocks
    r.step()
    assert all(b.ref_cnt == 2 for b in blocks)
    r.s.lease_cancel(A)
    r.s.lease_cancel(A)
    assert r.book.table.release(lease, LeaseStatus.CANCELLED, r.clk()) is False
    assert r.pool.lease_free(blocks) == 0  # no lease reference left: nothing freed
    r.ok()
    assert all(b.ref_cnt == 1 for b in blocks)  # the request's references are intact
    r.s.lease_release_all()
    r.s.lease_release_all()
    r.until(req.is_finished)
    audit = r.s.lease_audit()
    assert audit["refs_added"] == audit["refs_released"] == 6


def test_shared_blocks_between_two_leases_and_a_running_request() -> None:
    r = rig(num_blocks=96)
    shared = toks(1, 5)
    ha, hb = shared + toks(2, 3), shared + toks(3, 3)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha)
    r.notice(B, hb)
    st = r.s.lease_state()
    assert st.U == 11  # 5 shared + 3 + 3
    assert st.lease_for(A).exclusive_blocks == 3 and st.lease_for(B).exclusive_blocks == 3
    sblocks = r.book.table.leases[A].blocks[:5]
    assert [r.pool.lease_ref(b.block_id) for b in sblocks] == [2] * 5
    req = r.add(shared + toks(4, 4), max_tokens=6)
    r.step()
    assert [b.ref_cnt for b in sblocks] == [3] * 5  # two leases + one request
    r.s.lease_cancel(A)
    r.ok()
    assert [b.ref_cnt for b in sblocks] == [2] * 5
    assert r.lease(B).exclusive_blocks == 8  # the shared blocks are B's alone now
    r.until(req.is_finished)
    assert [b.ref_cnt for b in sblocks] == [1] * 5
    r.s.lease_cancel(B)
    r.ok()
    assert all(b.ref_cnt == 0 for b in sblocks)
    assert r.s.lease_resident(ha) == 8  # back in the free queue, still cached


def test_grant_rule_budget_target_and_denial_events() -> None:
    # 63 usable blocks, H = 20. A is leased and then received (bound): its 10
    # blocks count in U but no longer in the near-use demand D.
    r = rig(num_blocks=64, headroom=20)
    ha, hb = toks(1, 10), toks(2, 10)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha)
    r.s.lease_bind(A, "ra")
    del r.items[A]
    r.publish()
    # N = {B}: D = 10, C_safe = 10 + 53 - 20 = 43, fit, B = 10; U + Delta = 20 > 10.
    r.notice(B, hb)
    st = r.s.lease_state()
    assert (st.U, st.B, st.C) == (10, 10, 10)
    assert st.lease_for(B) is None
    assert [(d.cid, d.delta, d.budget, d.used) for d in st.denials] == [(B, 10, 10, 10)]
    assert all(d.generation == st.generation for d in st.denials)
    n = st.counters["denials"]
    r.s.lease_tick()  # a new generation carries its own denial
    st2 = r.s.lease_state()
    assert st2.generation == st.generation + 1
    assert [d.generation for d in st2.denials] == [st2.generation]
    assert st2.counters["denials"] == n + 1
    r.s.lease_cancel(A)  # the release returns quota: replenishment grants B
    assert r.lease(B) is not None


def test_no_fit_means_target_zero_and_no_denial() -> None:
    # C_safe = 0 + 63 - 58 = 5 < |P_a| = 10: nothing fits, B = 0, no denial event.
    r = rig(num_blocks=64, headroom=58)
    ha = toks(1, 10)
    r.run(ha)
    r.notice(A, ha)
    st = r.s.lease_state()
    assert st.B == 0 and st.lease_for(A) is None and not st.denials
    assert st.counters["headroom_refusals"] >= 1


def test_headroom_refusal_guards_a_stale_target() -> None:
    # B was set while the pool was emptier; F then dropped. F_after >= H holds the line.
    r = rig(num_blocks=64, headroom=20)
    ha = toks(1, 10)
    r.run(ha)
    r.rate = 1.0  # A is not near use yet: no grant at readiness
    r.notice(A, ha)
    assert r.lease(A) is None
    r.book.budget = replace(r.book.budget, B=100)  # the stale target
    big = r.add(toks(9, 32), max_tokens=4)
    small = r.add(toks(8, 2), max_tokens=4)
    r.step()
    r.step()  # big and small hold ~36 blocks; A's 10 are free, cached, counted in F
    assert r.s.lease_resident(ha) == 10 and 20 <= r.pool.get_num_free_blocks() < 30
    r.rate = 1e6
    r.publish()  # a plain inventory (Q_B moved) neither evaluates nor replenishes
    assert r.s.lease_state().counters["headroom_refusals"] == 0
    refill(r)  # replenishment without evaluation: F - 10 free blocks taken < 20
    st = r.s.lease_state()
    assert st.lease_for(A) is None and not st.denials
    assert st.counters["headroom_refusals"] == 1
    r.s.finish_requests([big.request_id, small.request_id], RequestStatus.FINISHED_ABORTED)
    r.ok()
    refill(r)  # F = 63 again: the same stale target now grants
    assert r.lease(A) is not None


def refill(r: Any) -> None:
    """Replenish as after a release (spec 3.2): the view's FIFO grants, no new budget."""
    r.book.grants.released = True
    r.book.grants.refill(r.clk())
    r.ok()


def test_near_use_needs_a_timely_fifo_estimate() -> None:
    r = rig()
    ha, hb = toks(1, 4), toks(2, 4)
    r.run(ha)
    r.run(hb)
    r.rate = 4000.0
    r.q_b = 40_000  # 10 s of committed bytes ahead: T_B > l = 8 s
    r.publish()
    r.notice(A, ha)
    assert r.lease(A) is None and r.s.lease_state().resident == ((A, 4),)
    r.q_b = 0
    evaluations = r.s.lease_state().counters["evaluations"]
    r.publish()  # a plain inventory (Q_B moved): no evaluation, no replenishment ...
    st = r.s.lease_state()
    assert r.lease(A) is None and st.counters["evaluations"] == evaluations
    r.s.lease_tick()  # ... the next evaluation (spec 3.1: every 100 ms) grants it
    assert r.lease(A) is not None


def test_disabled_leases_publish_resident_sizes_but_take_no_references() -> None:
    r = rig(enabled=False)
    ha = toks(1, 6)
    r.run(ha)
    r.notice(A, ha)
    r.notice(B, toks(2, 6))  # cold
    r.s.lease_tick()
    st = r.s.lease_state()
    assert dict(st.resident) == {A: 6, B: 0}
    assert st.U == st.B == st.C == 0 and st.leases == ()
    assert r.pool.refs_added == 0


def test_version_invalidation_and_repeated_notices() -> None:
    r = rig()
    ha = toks(1, 5)
    r.run(ha)
    r.notice(A, ha)
    r.notice(A, ha)  # a repeat leaves the lease unchanged
    assert r.s.lease_state().counters["repeat_notices"] == 1
    newer = replace(A, version=1)
    r.notice(newer, ha)
    st = r.s.lease_state()
    assert st.lease_for(A) is None and st.lease_for(newer) is not None
    assert st.counters["invalidations"] == 1
    r.notice(A, ha)  # the superseded version is refused
    assert r.s.lease_state().counters["stale_notices"] == 1


def test_cancel_via_inventory_and_reset_prefix_cache_drops_leases_first() -> None:
    r = rig()
    ha, hb = toks(1, 5), toks(2, 5)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha)
    r.notice(B, hb)
    r.phase(A, Phase.CANCELLED)
    assert r.lease(A) is None and r.s.lease_state().counters["cancellations"] == 1
    assert r.s.reset_prefix_cache() is True
    r.ok()
    st = r.s.lease_state()
    assert st.leases == () and st.counters["reset_drops"] == 1
    assert r.s.lease_resident(hb) == 0


def test_a_stripped_hash_cuts_the_lease_at_that_block() -> None:
    r = rig()
    ha = toks(1, 8)
    r.run(ha)
    r.notice(A, ha)
    blocks = list(r.book.table.leases[A].blocks)
    r.s.kv_cache_manager.evict_blocks({blocks[5].block_id})  # e.g. a KV connector
    r.ok()  # tolerated until the next lease operation drains it
    r.s.lease_tick()
    r.ok()
    lease = r.book.table.leases[A]
    assert [b.block_id for b in lease.blocks] == [b.block_id for b in blocks[:5]]
    assert r.s.lease_state().counters["stripped_blocks"] == 3
    assert all(b.ref_cnt == 0 for b in blocks[5:])


def test_integrity_check_and_audit_fail_loudly() -> None:
    r = rig()
    ha = toks(1, 4)
    r.run(ha)
    r.notice(A, ha)
    block = r.book.table.leases[A].blocks[0]
    r.pool.touch([block])  # a reference nobody owns
    with pytest.raises(LeaseIntegrityError, match=f"block {block.block_id}"):
        r.s.check_integrity()
    r.pool.free_blocks([block])
    r.ok()
    r.pool.refs_added += 1  # a reference the ledger never saw released
    with pytest.raises(LeaseIntegrityError, match="added"):
        r.s.lease_audit()
    r.pool.refs_added -= 1
    r.s.lease_release_all()
    audit = r.s.lease_audit()
    assert audit["refs_added"] == audit["refs_released"] == 4 and audit["refs_held"] == 0


def test_published_state_is_version_bound_and_sequenced() -> None:
    r = rig(kappa=0.5)
    ha = toks(1, 4)
    r.run(ha)
    r.notice(A, ha)
    s1, s2 = r.s.lease_state(), r.s.lease_state()
    assert s2.seq == s1.seq + 1
    rec = s1.lease_for(A)
    assert (rec.prefix_digest, rec.payload_digest) == (f"p-{A.key()}", f"d-{A.key()}")
    assert rec.generation == s1.generation and rec.exclusive_blocks == 4
    assert (s1.m, s1.kappa, s1.total_blocks) == (8, 0.5, 63)
    r.clk.advance(2.0)
    st = r.s.lease_state()
    assert st.counters["protection_block_seconds"] == pytest.approx(4 * 2.0)
    assert st.counters["grants"] == 1 and st.counters["grants_before_commit"] == 1


def test_cache_salt_is_part_of_the_resident_prefix() -> None:
    r = rig()
    ha = toks(1, 4)
    req = testing.make_request("salted", ha, cache_salt="tenant-1")
    r.s.add_request(req)
    r.until(req.is_finished)
    assert r.s.lease_resident(ha) == 0
    assert r.s.lease_resident(ha, cache_salt="tenant-1") == 4
    n = HistoryNotice(A, tuple(ha), "p", "d", r.clk(), 10, cache_salt="tenant-1")
    r.s.lease_notice(n)
    r.items[A] = InventoryItem(A, Phase.PENDING, 10, n.ready_time)
    r.publish()
    assert r.lease(A) is not None and len(r.lease(A).protected_blocks) == 4


def test_inventory_before_notice_counts_the_frame_once() -> None:
    r = rig()
    ha = toks(1, 4)
    r.run(ha)
    r.rate = 4000.0
    r.items[A] = InventoryItem(A, Phase.PENDING, 500, r.clk())
    r.publish()  # the sender lists A before the engine hears of it
    r.s.lease_notice(HistoryNotice(A, tuple(ha), "p", "d", r.clk(), 500))
    assert r.book.cands.link_times() == {A: pytest.approx((1028 + 500) / 4000.0)}
    assert r.lease(A) is not None
    r.phase(A, Phase.RECEIVED)
    r.s.lease_notice(HistoryNotice(B, tuple(ha), "p", "d", r.clk(), 5))
    late = ContinuationId("late", 1)
    r.items[late] = InventoryItem(late, Phase.RECEIVED, 5, r.clk())
    r.publish()
    r.s.lease_notice(HistoryNotice(late, tuple(ha), "p", "d", r.clk(), 5))
    assert r.s.lease_state().counters["late_notices"] == 1
    assert late not in r.book.cands.pending


# -- issue 10: the grant check counts the engine's pending allocation -----------


def waiting_book(headroom: int, max_num_seqs: int = 8, aware: bool = True) -> tuple[Any, Any]:
    """A plain vLLM scheduler and a lease book that sees its waiting queue (or not)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from ladsd.engine.lease_book import LeaseBook

    s = testing.make_scheduler(Scheduler, num_blocks=64, block_size=BS, max_num_seqs=max_num_seqs)
    book = LeaseBook(
        s.kv_cache_manager,
        LeaseConfig(headroom_blocks=headroom),
        0.0,
        ManualClock(1000.0),
        load=lambda: (len(s.waiting), len(s.running), s.max_num_running_reqs),
        hash_block_size=BS,
        waiting=(lambda: s.waiting) if aware else (lambda: ()),
    )
    return s, book


def offer(s: Any, book: Any, cid: ContinuationId, history: list[int]) -> bool:
    """Announce ``cid`` on a fast link; True if it was granted."""
    n = HistoryNotice(cid, tuple(history), "p", "d", book.clock(), 100)
    book.inventory(SenderInventory(book.clock(), (), 0, 1e6))
    book.notice(n)
    book.check()
    return cid in book.table.leases


def warm(s: Any, tokens: list[int]) -> None:
    req = testing.make_request(f"warm{len(tokens)}-{tokens[0]}", tokens)
    s.add_request(req)
    while not req.is_finished():
        testing.step(s)


@pytest.mark.parametrize("aware", [True, False])
def test_a_waiting_request_s_pending_allocation_refuses_a_grant(aware: bool) -> None:
    # 63 usable blocks, H = 20, A's history (10 blocks) cached and free: F = 63.
    # A 40-block request waits for admission. Without it the grant leaves
    # F = 53 >= H; with it, F_after = 63 - 10 - 40 = 13 < H: refused, and no
    # revocation follows when vLLM admits the request.
    s, book = waiting_book(headroom=20, aware=aware)
    ha = toks(1, 10)
    warm(s, ha)
    big = testing.make_request("big", toks(9, 40), max_tokens=4)
    s.add_request(big)
    assert len(s.waiting) == 1 and book.pool.get_num_free_blocks() == 63
    granted = offer(s, book, A, ha)
    assert granted is not aware
    assert book.counters["headroom_refusals"] == int(aware)
    while big.num_computed_tokens < 40 * BS:  # vLLM admits it (in 512-token chunks)
        testing.step(s)
    assert book.pool.get_num_free_blocks() == 63 - 40 - 10 * granted
    book.before_schedule()  # the next schedule() entry: revoke below H
    book.check()
    assert book.counters["revocations"] == int(not aware)


def test_pending_allocation_counts_a_shared_cached_block_once() -> None:
    # A's continuation (history + 3 new blocks) waits; its history is A's P_i.
    # Counted twice, 63 - 10 - (10 + 3) = 40 < H = 45 would refuse; counted once,
    # F_after = 63 - 10 - 3 = 50 >= 45: granted.
    s, book = waiting_book(headroom=45)
    ha = toks(1, 10)
    warm(s, ha)
    s.add_request(testing.make_request("cont", cont(ha)[: 13 * BS], max_tokens=4))
    assert offer(s, book, A, ha)
    testing.step(s)
    book.check()


def test_pending_allocation_counts_only_requests_with_a_free_running_slot() -> None:
    # max_num_seqs = 1 and one request running: the waiting one cannot be admitted
    # before the running one finishes (and frees its own blocks): not counted.
    s, book = waiting_book(headroom=20, max_num_seqs=1)
    ha = toks(1, 10)
    warm(s, ha)
    s.add_request(testing.make_request("runs", toks(8, 2), max_tokens=50))
    testing.step(s)
    s.add_request(testing.make_request("big", toks(9, 40), max_tokens=4))
    assert (len(s.running), len(s.waiting)) == (1, 1)
    assert offer(s, book, A, ha)  # F = 61: 61 - 10 >= 20


# == the book's parts: bounded memory, lease status, each part's integrity check, the grant order
#
# After every path a continuation can take (handoff, cancel, expiry after its request is
# done, expiry while a candidate, never listed, superseded, refused) the book keeps nothing
# about it: ``sizes()`` is back to 0 on every part.

LIFE = 8.0
N = 12  # workflows per path


def parts_rig(num_blocks: int = 96, headroom: int = 4) -> Rig:
    s = testing.make_scheduler(LeaseScheduler, num_blocks=num_blocks, block_size=BS)
    clk = ManualClock(1000.0)
    s.lease_setup(LeaseConfig(headroom_blocks=headroom, lease_lifetime_s=LIFE), 0.0, clk)
    return Rig(s, clk, payload=300)


def cid_(k: int, version: int = 0) -> ContinuationId:
    return ContinuationId(f"w{k}", 1, version)


# -- bounded memory ----------------------------------------------------------


def test_sizes_back_to_zero_after_handoff_and_completion() -> None:
    r = parts_rig()
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
    r = parts_rig()
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
    r = parts_rig()
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
    r = parts_rig()
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
    r = parts_rig()
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
    r = parts_rig()
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
    r = parts_rig(num_blocks=32, headroom=30)
    for k in range(N):
        cid, hist = cid_(k), toks(k, 4)
        r.run(hist)
        r.notice(cid, hist)
        assert not r.leased(cid) and r.book.sizes()["refused"] == 1
        r.receive(cid)
        r.empty()
    assert r.book.counters["headroom_refusals"] >= N


def test_release_all_leaves_nothing() -> None:
    r = parts_rig()
    for k in range(4):
        r.run(toks(k, 4))
        r.notice(cid_(k), toks(k, 4))
    r.s.lease_release_all()
    r.empty()
    assert r.s.lease_audit()["refs_held"] == 0


# -- lease status ----------------------------------------------------------------


def test_a_lease_records_how_it_ended() -> None:
    r = parts_rig(num_blocks=64, headroom=20)
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
    r = parts_rig()
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


# -- stop 48: a state is published only when it can differ from the last ------------


def bare(st: Any) -> Any:
    """A state without what moves with the clock alone (time, seq, the integrals) and
    without the events it took (the next state starts a new list)."""
    counters = {k: v for k, v in st.counters.items() if not k.endswith("_block_seconds")}
    return replace(st, time=0.0, seq=0, events=(), counters=counters)


def test_equal_marks_give_equal_states() -> None:
    """The engine loop skips the publication after an inventory that left the book's
    mark where the last publication saw it; that is sound only if such a state
    equals the last one but for its time. Each step here takes a state (as a
    publication does), runs one operation and compares."""
    r = rig()
    ha, hb = toks(1, 4), toks(2, 4)
    r.run(ha)
    r.run(hb)
    r.rate = 4000.0

    def inventory(q_b: int) -> Any:
        def op() -> None:
            r.q_b = q_b
            r.publish()

        return op

    ops = [
        inventory(10_000),  # the first inventory ever: an evaluation (spec 3.1)
        inventory(9_000),  # nothing listed yet: Q_B alone moved
        lambda: r.notice(A, ha),
        inventory(6_000),  # a chunk written
        lambda: r.phase(A, Phase.COMMITTED),
        lambda: r.tick_at(r.clk() + 0.1),
        inventory(0),
        lambda: r.notice(B, hb),
        lambda: r.receive(A),  # A leaves the candidates (its lease stays)
        inventory(0),
        lambda: r.phase(B, Phase.CANCELLED),  # a cancellation through the inventory
        inventory(0),
    ]
    same = moved = 0
    for op in ops:
        before = r.s.lease_state()
        m0 = r.s.lease_mark()
        op()
        m1 = r.s.lease_mark()
        after = r.s.lease_state()
        if m0 == m1:
            same += 1
            assert bare(after) == bare(before) and after.events == ()
            assert bare(after).counters == bare(before).counters  # compare=False in ==
        else:
            moved += 1
    assert same >= 3 and moved >= 4  # both kinds happened


def test_the_mark_moves_with_the_load_and_stays_through_a_decode_inside_a_block() -> None:
    """The engine loop also skips a step's publication when the mark stayed (and the last
    state is younger than a tick), so the mark must cover what a step changes in a
    state: the load (``w``, ``a``) and the free blocks. On vLLM's real scheduler: a
    request added (``w``), admitted (``a``, ``F``), decoding inside its last block (the
    mark stays and the states are equal but for time), and finished."""
    r = rig()
    before, m0 = r.s.lease_state(), r.s.lease_mark()
    req = r.add(toks(1, 2) + [7], max_tokens=2 * BS)  # one token into its third block
    after = r.s.lease_state()
    assert r.s.lease_mark() != m0  # waiting only: no block, lease or counter moved
    assert (after.w, after.F) == (before.w + 1, before.F) and bare(after) != bare(before)
    kinds = {"same": 0, "moved": 0}
    before, m0 = r.s.lease_state(), r.s.lease_mark()
    while not req.is_finished():
        r.step()
        after, m1 = r.s.lease_state(), r.s.lease_mark()
        moved = (after.w, after.a, after.F) != (before.w, before.a, before.F)
        if m0 == m1:
            kinds["same"] += 1
            assert bare(after) == bare(before) and not moved
            assert bare(after).counters == bare(before).counters
        else:
            kinds["moved"] += 1
        before, m0 = after, m1
    assert kinds["same"] >= BS // 2 and kinds["moved"] >= 2  # decode steps, and the rest
    assert r.s.lease_state().a == 0


def test_a_cancellation_in_an_inventory_refills() -> None:
    """A plain inventory does not replenish, but one that cancels a leased result
    releases its blocks, and the release refills (spec 3.2): B, refused for headroom
    while A held its blocks, is granted under the same budget, with no new evaluation."""
    r = rig(num_blocks=64, headroom=56)  # F = 63: A's grant leaves 59, B's would leave 55
    ha, hb = toks(1, 4), toks(2, 4)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha)
    assert r.lease(A) is not None
    r.notice(B, hb)
    assert r.lease(B) is None and r.s.lease_state().counters["headroom_refusals"] >= 1
    evaluations = r.s.lease_state().counters["evaluations"]
    r.phase(A, Phase.CANCELLED)  # the sender withdraws A: its lease ends
    st = r.s.lease_state()
    assert st.lease_for(A) is None and st.lease_for(B) is not None
    assert st.counters["evaluations"] == evaluations
