"""HEAR session-aware retention on vLLM's real Scheduler / KVCacheManager (no model).

The eviction order ``r = p * exp(-idle / 400 s)`` is imposed on vLLM's free
queue with no references; ``p`` comes from completed workflows only.
"""

from __future__ import annotations

import dataclasses
import math
import random
from types import SimpleNamespace

import pytest
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    make_block_hash_with_group_id,
)
from vllm.v1.request import RequestStatus

from ladsd import testing
from ladsd.clock import ManualClock
from ladsd.config import LeaseConfig
from ladsd.continuation import ContinuationEstimate
from ladsd.engine import sched_leases
from ladsd.engine.lease_sessions import (
    SessionCounts,
    Sessions,
    WaitingSession,
    retention_priority,
)
from ladsd.engine.sched_leases import LeaseScheduler
from ladsd.modes import Retention
from ladsd.records import SESSION_AUDIT, ContinuationId
from ladsd.workloads import runner
from tests.rigs.leases import BS, Rig, cont, toks

A = ContinuationId("wa", 1)
B = ContinuationId("wb", 1)
A2 = ContinuationId("wa", 2)  # A's next turn


def session_rig(num_blocks: int = 64) -> Rig:
    s = testing.make_scheduler(LeaseScheduler, num_blocks=num_blocks, block_size=BS)
    clk = ManualClock(1000.0)
    s.lease_setup(LeaseConfig(enabled=False), 0.0, clk, retention=Retention.SESSION)
    return Rig(s, clk, payload=300)


def ids(blocks: list) -> list[int]:
    return [b.block_id for b in blocks]


def test_eviction_order_follows_r_and_foreign_blocks_go_first() -> None:
    r = session_rig()
    ha, hb, hf = toks(1, 8), toks(2, 8), toks(3, 8)
    r.run(ha)  # wa's last request ends at 1000
    r.clk.t = 1100.0
    r.run(hb)  # wb's at 1100
    r.clk.t = 1150.0
    r.run(hf)  # no session waits for this history (foreign), freed last: LRU would keep it
    r.clk.t = 1200.0
    r.notice(A, ha, continuation_p=0.9)  # r = 0.9 * exp(-200 / 400) = 0.546
    r.notice(B, hb, continuation_p=0.5)  # r = 0.5 * exp(-100 / 400) = 0.389: evicted first
    sa, sb = r.book.sessions.entries["wa"], r.book.sessions.entries["wb"]
    assert r.book.sizes()["sessions"] == 2
    assert (sa.ended_at, sb.ended_at) == (1000.0, 1100.0)  # engine-side: the free stamps
    assert sa.r(1200.0) == pytest.approx(0.9 * math.exp(-0.5))
    assert sb.r(1200.0) == pytest.approx(0.5 * math.exp(-0.25))
    a_blocks, b_blocks = list(sa.blocks), list(sb.blocks)
    r.step()  # schedule() entry reorders the free queue
    r.ok()
    queue = ids(r.pool.free_block_queue.get_all_free_blocks())
    # Front = evicted first: every other free block, then B tail -> head, then A tail -> head.
    assert queue[-16:] == ids(b_blocks[::-1]) + ids(a_blocks[::-1])
    n = r.book.counters["session_reorders"]
    r.step()  # nothing freed, nobody entered: no reorder
    assert r.book.counters["session_reorders"] == n
    # A flood that needs all but 6 free blocks: foreign ones go, then B, then A's tail.
    assert r.pool.get_num_free_blocks() == 63
    flood = r.add(toks(9, 56), max_tokens=2)  # 56 + 1 blocks
    r.until(flood.is_finished)
    assert r.s.lease_resident(hf) == 0 and r.s.lease_resident(hb) == 0
    assert 0 < r.s.lease_resident(ha) < 8  # A's head survives (its tail went first)
    # The resumed requests: a prefix hit for the high-r session, a miss for the low-r one.
    kept = r.s.lease_resident(ha)
    ca, cb = r.add(cont(ha)), r.add(cont(hb))
    r.s.lease_bind(A, ca.request_id)
    r.s.lease_bind(B, cb.request_id)
    out = r.step()
    cached = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
    assert cached == {ca.request_id: kept * BS, cb.request_id: 0}
    assert "sessions" not in r.book.sizes() and "session_reqs" not in r.book.sizes()
    r.until(lambda: ca.is_finished() and cb.is_finished())
    r.s.lease_release_all()
    audit = r.s.lease_audit()
    assert audit["refs_added"] == audit["refs_released"] == 0  # no references at all


def test_plain_lru_would_evict_the_oldest_session_first() -> None:
    # The control: the same history under NONE keeps vLLM's LRU (A, freed first, goes first).
    s = testing.make_scheduler(LeaseScheduler, num_blocks=64, block_size=BS)
    clk = ManualClock(1000.0)
    s.lease_setup(LeaseConfig(enabled=False), 0.0, clk, retention=Retention.NONE)
    r = Rig(s, clk)
    ha, hb = toks(1, 8), toks(2, 8)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha)
    r.notice(B, hb)
    r.step()
    queue = ids(r.pool.free_block_queue.get_all_free_blocks())
    a_pos = [queue.index(b.block_id) for b in s.lease_book.cands.pending[A].resident[0]]
    b_pos = [queue.index(b.block_id) for b in s.lease_book.cands.pending[B].resident[0]]
    assert max(a_pos) < min(b_pos)
    assert "sessions" not in s.lease_book.sizes()


def test_sessions_leave_on_cancel_and_a_shared_block_takes_the_highest_r() -> None:
    r = session_rig()
    shared = toks(1, 3)
    ha, hb = shared + toks(2, 3), shared + toks(3, 3)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, continuation_p=0.2)
    r.notice(B, hb, continuation_p=0.8)  # same idle: B's r is higher
    order = r.book.sessions.order(r.clk())
    sa, sb = r.book.sessions.entries["wa"], r.book.sessions.entries["wb"]
    # A's own tail, then B's tail, then the shared head (B's, the highest r), head last.
    assert ids(order) == ids(sa.blocks[3:][::-1]) + ids(sb.blocks[::-1])
    r.s.lease_cancel(B)
    r.ok()
    assert list(r.book.sessions.entries) == ["wa"]
    assert ids(r.book.sessions.order(r.clk())) == ids(sa.blocks[::-1])
    r.s.lease_release_all()
    assert "sessions" not in r.book.sizes()
    assert r.s.lease_audit()["refs_added"] == 0


def test_continuation_probability_from_completed_workflows_only() -> None:
    est = ContinuationEstimate()
    assert est.p(1) == est.p(5) == 0.5  # the prior: nothing completed yet
    for calls in (2, 3, 3):  # three completed workflows (model calls, the cold one included)
        est.end(calls)
    assert est.p(1) == pytest.approx(4 / 5)  # all 3 made more than 1 call
    assert est.p(2) == pytest.approx(3 / 5)  # 2 of the 3 that made 2 calls made more
    assert est.p(3) == pytest.approx(1 / 4)  # none of the 2 that made 3 made more
    assert est.p(4) == 0.5  # nobody made 4: the prior
    with pytest.raises(ValueError):
        est.end(0)
    assert retention_priority(1.0, 400.0) == pytest.approx(math.exp(-1))
    with pytest.raises(ValueError):
        retention_priority(1.5, 0.0)


def sorted_order(sessions: Sessions, now: float) -> list[KVCacheBlock]:
    """The order as first written: every free block keyed by ``(r, cid, -end)``, a shared
    block by its highest-r session (the last writer), then one sort."""
    keyed: dict[int, tuple[tuple[float, ContinuationId, int], KVCacheBlock]] = {}
    for s in sorted(sessions.entries.values(), key=lambda s: (s.r(now), s.cid)):
        for b, end in s.valid():
            if b.ref_cnt == 0:
                keyed[b.block_id] = ((s.r(now), s.cid, -end), b)
    return [b for _, b in sorted(keyed.values(), key=lambda e: e[0])]


@pytest.mark.parametrize("seed", range(20))
def test_the_linear_order_is_the_sorted_one(seed: int) -> None:
    """Random sessions over shared prefixes of one KV group (forks of a few roots, some
    blocks referenced, some hashes changed since the notice, ties in r): the same
    blocks in the same order as the one sort over every block."""
    rng = random.Random(seed)
    pool = [KVCacheBlock(i) for i in range(200)]
    for b in pool:
        b.set_block_hash(make_block_hash_with_group_id(BlockHash(b"h%d" % b.block_id), 0))
    roots = [rng.sample(pool, 12) for _ in range(3)]
    # order() reads the entries and the pool's lost blocks only
    sessions = Sessions(SimpleNamespace(watched_lost=set()), [BS])  # type: ignore[arg-type]
    for w in range(rng.randint(1, 12)):
        shared = rng.choice(roots)[: rng.randint(0, 12)]
        blocks = shared + rng.sample(pool, rng.randint(0, 8))
        blocks = list({b.block_id: b for b in blocks}.values())  # a history holds a block once
        hashes = [b.block_hash for b in blocks]
        if blocks and rng.random() < 0.3:  # a block re-hashed since the notice
            hashes[rng.randrange(len(blocks))] = make_block_hash_with_group_id(BlockHash(b"x"), 0)
        spans = [(k * BS, (k + 1) * BS) for k in range(len(blocks))]
        cid = ContinuationId(f"w{w}", 1)
        p = rng.choice((0.2, 0.5, 0.5, 0.9))  # repeats: ties in r broken by cid
        ended = rng.choice((900.0, 1000.0, 1000.0))
        sessions.entries[cid.workflow] = WaitingSession(cid, p, ended, blocks, hashes, spans)
    for b in rng.sample(pool, 40):
        b.ref_cnt = 1  # referenced (a lease or a running request): not in the order
    got = sessions.order(1200.0)
    assert ids(got) == ids(sorted_order(sessions, 1200.0))
    assert len(set(ids(got))) == len(got) and all(b.ref_cnt == 0 for b in got)


def test_the_lease_work_around_vllms_schedule_is_counted_and_vllms_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ctrl CPU s's fourth part: ``LeaseMixin.schedule`` reads the thread's CPU clock
    around the book and the hooks (entry: expiry, refill, the session order; exit:
    handoff), not across vLLM's own schedule. A fake clock gives each of the four reads
    of a call its own jump, the widest across vLLM's part."""
    r = session_rig()
    r.run(toks(1, 4))
    r.notice(A, toks(1, 4), continuation_p=0.9)
    jumps = iter([1.0, 2.0, 100.0, 4.0] * 1000)  # before entry, entry, vLLM's, exit
    reads: list[float] = []

    def thread_time() -> float:
        reads.append((reads[-1] if reads else 0.0) + next(jumps))
        return reads[-1]

    monkeypatch.setattr(sched_leases, "time", SimpleNamespace(thread_time=thread_time))
    before = r.s.lease_schedule_cpu_s
    for _ in range(3):
        r.step()
    assert len(reads) == 12  # four reads a schedule() call
    assert r.s.lease_schedule_cpu_s - before == pytest.approx(3 * (2.0 + 4.0))


def check_queue(r: Rig) -> None:
    """After a reorder (as the next ``schedule()`` entry does it; frees inside a step
    wait behind the sessions till then) the free queue is every free block no session
    orders (in its order), then the session order: what a full reorder gives, whichever
    way this one went."""
    r.book.sessions.reorder(r.clk())
    order = ids(sorted_order(r.book.sessions, r.clk()))  # every hash read again
    queue = ids(r.pool.free_block_queue.get_all_free_blocks())
    placed = set(order)
    assert queue == [b for b in queue if b not in placed] + order


@pytest.mark.parametrize("seed", range(6))
def test_a_splice_leaves_the_queue_as_the_full_order_would(seed: int) -> None:
    """Waiting sessions over a shared head while foreign requests come and go (freeing
    blocks behind the sessions, evicting, sharing a session's head, a resumed session
    leaving): after every step the queue is the contract's order, and most reorders
    were splices."""
    rng = random.Random(seed)
    r = session_rig(num_blocks=96)
    head = toks(50, 2)
    hist = {w: head + toks(60 + k, rng.randint(2, 6)) for k, w in enumerate("abcd")}
    for h in hist.values():
        r.run(h)
    cids = {w: ContinuationId(f"w{w}", 1) for w in hist}
    for w, h in hist.items():
        r.clk.t += rng.random()
        r.notice(cids[w], h, continuation_p=rng.choice((0.3, 0.6, 0.9)))
    r.step()
    check_queue(r)
    resumed = 0
    for i in range(40):
        r.clk.t += 0.5
        kind = rng.random()
        if kind < 0.6:  # a foreign request: its blocks are freed behind the sessions
            r.add(toks(100 + i, rng.randint(1, 8)), max_tokens=rng.randint(1, 3))
        elif kind < 0.8:  # one sharing the sessions' head: a session block freed again
            r.add(head + toks(300 + i, 2))
        elif resumed < 2:  # a session resumes: it leaves the order
            w = "abcd"[resumed]
            resumed += 1
            if rng.random() < 0.5:  # its result received first: kept until the bind
                r.receive(cids[w])
                r.step()
                check_queue(r)
            req = r.add(cont(hist[w]))
            r.s.lease_bind(cids[w], req.request_id)
        for _ in range(rng.randint(1, 3)):
            r.step()
            check_queue(r)
    r.until(lambda: not r.s.requests)
    check_queue(r)
    sessions = r.book.sessions
    assert sessions.counts.splices > 0 and sessions.counts.computed > 1  # both ways ran
    assert sessions.counts.put_back > 0  # and splices put freed session blocks back in place
    r.s.lease_release_all()


def test_a_shared_head_freed_again_goes_back_to_its_place_without_the_full_order() -> None:
    """Two waiting sessions share a head; a foreign request that hits the head runs
    and ends, freeing the head behind every other block. The next reorder puts the
    head back at its rank (after the lower-r session's own blocks, with the higher-r
    session that owns it) by a splice, and the queue is what the full order gives."""
    r = session_rig(num_blocks=64)
    head = toks(50, 2)
    ha, hb = head + toks(60, 3), head + toks(61, 3)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, continuation_p=0.3)
    r.notice(B, hb, continuation_p=0.9)  # the higher r: it owns the shared head
    r.step()
    check_queue(r)
    sessions = r.book.sessions
    c = sessions.counts
    before = (c.computed, c.splices, c.put_back)
    r.add(head + toks(70, 2), max_tokens=1)  # hits the head: referenced, out of the queue
    r.until(lambda: not r.s.requests)  # ends: the head is freed at the tail
    check_queue(r)
    order = ids(sessions.order(r.clk()))
    assert order[-2:] == ids(r.book.sessions.entries["wb"].blocks[1::-1])  # head last
    c = sessions.counts
    computed, splices, put_back = c.computed, c.splices, c.put_back
    assert computed == before[0] and splices > before[1] and put_back - before[2] == 2
    r.s.lease_release_all()
    audit = r.book.audit()  # the run file's counters carry how the order was kept
    assert audit["session_order_spliced"] == sessions.counts.splices > 0
    assert audit["session_blocks_put_back"] == sessions.counts.put_back
    # Every count reaches the audit and the run files under its one name.
    assert set(SESSION_AUDIT) == {f.name for f in dataclasses.fields(SessionCounts)}
    counts = sessions.counts
    assert {n: audit[n] for n in SESSION_AUDIT.values()} == {
        n: float(getattr(counts, k)) for k, n in SESSION_AUDIT.items()
    }
    assert set(SESSION_AUDIT.values()) <= set(runner.AUDIT_EXTRAS)


def test_a_kept_session_order_is_read_again_once_its_blocks_are_evicted() -> None:
    """A session's valid prefix is kept between full orders while it is whole. A
    foreign request that evicts the lower-r session's tail and ends (its blocks free
    again, with other contents) must not leave those blocks ordered as the session's:
    the queue is the order read from every hash again, the tail is out of it, and a
    broken prefix is not kept (it is read again at each full order)."""
    r = session_rig(num_blocks=40)
    ha, hb = toks(50, 6), toks(60, 6)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, continuation_p=0.3)  # the lower r: evicted first, tail first
    r.notice(B, hb, continuation_p=0.9)
    r.step()
    check_queue(r)
    sessions = r.book.sessions
    sa = sessions.entries["wa"]
    assert sa.tail is not None and len(sa.tail) == 6  # kept whole
    placed = set(ids(sessions.order(r.clk())))
    others = r.pool.get_num_free_blocks() - len(placed)
    r.run(toks(70, others + 2), max_tokens=1)  # every other free block, then A's tail
    check_queue(r)
    valid = ids([b for b, _ in sa.valid()])
    assert 0 < len(valid) < 6 and sa.tail is None
    order = ids(sessions.order(r.clk()))
    assert not set(ids(sa.blocks)) - set(valid) & set(order)  # the evicted tail is out
    r.s.lease_release_all()


def waiting_then_resumed(
    ha: list[int], pa: float, hb: list[int], pb: float, resume: str
) -> tuple[Rig, int]:
    """Sessions A (``ha``, ``p`` = ``pa``) and B wait in an order checked once; then
    ``resume``'s continuation is registered and allocated in one step (checked again).
    Returns the rig and the full orders computed before the resume."""
    r = session_rig(num_blocks=64)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, continuation_p=pa)
    r.notice(B, hb, continuation_p=pb)
    r.step()
    check_queue(r)
    computed = r.book.sessions.counts.computed
    cid, hist = (A, ha) if resume == "wa" else (B, hb)
    req = r.add(cont(hist), max_tokens=2)
    r.s.lease_bind(cid, req.request_id)
    r.step()  # allocated: it leaves
    check_queue(r)
    assert resume not in r.book.sessions.entries
    return r, computed


def test_a_resumed_session_that_owns_only_its_own_blocks_leaves_by_the_splice() -> None:
    """Two waiting sessions with their own histories; the higher-r one resumes. Its
    blocks are referenced by the resumed request and in no other prefix, so the order
    is spliced, not computed; once that request ends its blocks are foreign frees and
    go ahead of the session still waiting."""
    # A has the higher r: its run ends the order.
    r, computed = waiting_then_resumed(toks(50, 4), 0.9, toks(60, 4), 0.3, resume="wa")
    sessions = r.book.sessions
    assert sessions.counts.computed == computed and sessions.counts.let_go == 1
    r.until(lambda: not r.s.requests)  # A's blocks are freed at the tail
    check_queue(r)
    order = ids(sessions.order(r.clk()))
    queue = ids(r.pool.free_block_queue.get_all_free_blocks())
    assert order == ids(sessions.entries["wb"].blocks[::-1]) and queue[-len(order) :] == order
    assert sessions.counts.computed == computed  # the frees were spliced too
    r.s.lease_release_all()
    assert r.book.audit()["sessions_let_go"] == 1  # the run file's counters carry it


def test_a_resumed_session_that_owned_a_shared_head_gives_it_to_the_next_by_the_full_order() -> (
    None
):
    """The higher-r session owns the head both waiting sessions share; it resumes. The
    head's rank passes to the lower-r session, so the order is computed again, and
    once the resumed request ends the head goes back with the session still waiting."""
    head = toks(50, 2)  # B has the higher r: it owns the head
    r, computed = waiting_then_resumed(
        head + toks(60, 3), 0.3, head + toks(61, 3), 0.9, resume="wb"
    )
    sessions = r.book.sessions
    assert sessions.counts.computed == computed + 1 and sessions.counts.let_go == 0
    r.until(lambda: not r.s.requests)
    check_queue(r)
    order = ids(sessions.order(r.clk()))
    assert set(ids(sessions.entries["wa"].blocks[:2])) <= set(order)  # the head, A's now
    r.s.lease_release_all()


def two_waiting() -> tuple[Rig, list[int], list[KVCacheBlock], list[KVCacheBlock]]:
    """A (the higher r, evicted last) and B waiting, ordered once: the rig, A's history,
    A's and B's session blocks."""
    r = session_rig(num_blocks=64)
    ha, hb = toks(50, 4), toks(60, 4)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, continuation_p=0.9)
    r.notice(B, hb, continuation_p=0.3)
    r.step()
    entries = r.book.sessions.entries
    return r, ha, list(entries["wa"].blocks), list(entries["wb"].blocks)


def test_a_session_received_before_its_bind_keeps_its_place_until_its_allocation() -> None:
    """A's result reaches the agent before its resumed request is registered (60-80 of 96
    sessions on captured-scaled seed 16). A stays in the order at its rank (evicted after B),
    is bound, and leaves by its allocation, which the splice lets go; until stop 55 the
    receipt dropped it and its blocks fell in front of B's."""
    r, ha, a_blocks, b_blocks = two_waiting()
    sessions = r.book.sessions
    r.receive(A)  # received, not yet bound
    assert "wa" in sessions.entries and sessions.kept
    assert (sessions.counts.kept, sessions.counts.unbound) == (1, 0)
    r.step()
    check_queue(r)
    queue = ids(r.pool.free_block_queue.get_all_free_blocks())
    assert queue[-8:] == ids(b_blocks[::-1]) + ids(a_blocks[::-1])
    computed = sessions.counts.computed
    req = r.add(cont(ha), max_tokens=2)
    r.s.lease_bind(A, req.request_id)
    assert not sessions.kept  # bound: it waits for its allocation
    r.step()
    check_queue(r)
    assert "wa" not in sessions.entries and sessions.counts.allocated == 1
    assert sessions.counts.computed == computed and sessions.counts.let_go == 1
    r.until(lambda: not r.s.requests)
    r.s.lease_release_all()
    audit = r.book.audit()
    assert (audit["sessions_kept"], audit["sessions_allocated"]) == (1, 1)
    assert audit["sessions_expired"] == audit["sessions_unbound"] == 0


def test_a_kept_session_whose_bind_never_comes_leaves_l_after_its_receipt() -> None:
    """Kept at its receipt, A waits for its bind at most ``l`` (8 s) after it; a session
    whose candidate is dropped unreceived (never listed within ``l``) still leaves at once."""
    r = session_rig()
    ha, hb = toks(50, 4), toks(60, 4)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha)
    r.notice(B, hb, listed=False)  # the sender never lists it: unlisted after l
    t0 = r.clk()
    r.receive(A)
    r.tick_at(t0 + 7.9)
    assert set(r.book.sessions.entries) == {"wa", "wb"}
    r.tick_at(t0 + 8.1)
    counts = r.book.sessions.counts
    assert not r.book.sessions.entries and not r.book.sessions.kept
    assert (counts.expired, counts.unbound) == (1, 1)
    assert "sessions" not in r.book.sizes() and "sessions_kept" not in r.book.sizes()
    r.s.lease_release_all()


def test_a_session_whose_bound_requests_are_all_aborted_leaves() -> None:
    """A client that gives up (a disconnect aborts its request) before the resumed request
    is allocated: its session leaves when the last request bound to it is freed, and its
    blocks fall in front of the sessions still waiting; while another request binds it, it
    waits on and leaves by that one's allocation. Until stop 56 it waited for the
    workflow's next notice or the end of the run."""
    r, ha, a_blocks, b_blocks = two_waiting()
    sessions = r.book.sessions
    r.receive(A)
    first, second = r.add(cont(ha), max_tokens=2), r.add(cont(ha, seed=98), max_tokens=2)
    r.s.lease_bind(A, first.request_id)
    r.s.lease_bind(A, second.request_id)
    r.s.finish_requests(first.request_id, RequestStatus.FINISHED_ABORTED)
    assert "wa" in sessions.entries and sessions.counts.aborted == 0  # the second binds it
    r.s.finish_requests(second.request_id, RequestStatus.FINISHED_ABORTED)
    assert "wa" not in sessions.entries and not sessions.by_req
    assert sessions.counts.aborted == 1 and sessions.counts.allocated == 0
    check_queue(r)
    queue = ids(r.pool.free_block_queue.get_all_free_blocks())
    assert queue[-4:] == ids(b_blocks[::-1])  # B alone at the back now
    assert set(ids(a_blocks)).isdisjoint(queue[-4:])
    # A bound request that is allocated still takes its session out by the allocation.
    r.notice(A2, ha, continuation_p=0.9)
    third = r.add(cont(ha, seed=97), max_tokens=2)
    r.s.lease_bind(A2, third.request_id)
    r.step()
    assert "wa" not in sessions.entries and sessions.counts.allocated == 1
    r.until(lambda: not r.s.requests)  # its free after it finished leaves nothing to do
    assert sessions.counts.aborted == 1
    r.s.lease_release_all()
    audit = r.book.audit()
    assert (audit["sessions_aborted"], audit["sessions_allocated"]) == (1, 1)
