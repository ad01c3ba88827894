"""``lads-adaptive`` (ours, issue 23): the paper's LADS plus three rules, each on its own case.

Model-free where the rule is the sender's (hand-built EngineStates); on vLLM's real
Scheduler / KVCacheManager (no model) where the engine publishes or orders; one smoke
replay end to end on the real engine.
"""

from __future__ import annotations

import pytest

from ladsd.clock import ManualClock
from ladsd.config import FRAME_OVERHEAD as H
from ladsd.config import PROFILES
from ladsd.delivery import make_policy
from ladsd.delivery.cache_first import cache_first
from ladsd.delivery.lads import override_active
from ladsd.delivery.lads_adaptive import (
    FrameMeans,
    LadsAdaptive,
    failed_grants,
    progress_first,
    regime_override,
)
from ladsd.delivery.policy import Pending, SenderView
from ladsd.delivery.registry import BY_NAME, CANDIDATE, CORE, Group, RunName, label
from ladsd.metrics import summary
from ladsd.modes import Retention
from ladsd.records import (
    ContinuationId,
    DenialEvent,
    EngineState,
    LeaseRecord,
    RefusalEvent,
)
from tests.rigs.leases import BS, cont, rig, toks

RATE = 4000.0
GEN = 7


def item(wf: str, *, p: int = 1000, r: float = 0.0, arrival: float | None = None,
         prompt: int = 100, turn: int = 1) -> Pending:  # fmt: skip
    return Pending(
        cid=ContinuationId(wf, turn),
        ready_time=r,
        payload_bytes=p,
        frame_bytes=H + p,
        prefix_digest=f"pre-{wf}-{turn}",
        payload_digest=f"pay-{wf}-{turn}",
        workflow_arrival=r if arrival is None else arrival,
        prompt_tokens=prompt,
    )


def lease(it: Pending, exclusive: int, g: float = 5.0) -> LeaseRecord:
    return LeaseRecord(
        it.cid, it.prefix_digest, it.payload_digest, tuple(range(exclusive)), exclusive,
        g, g + 8.0, GEN,
    )  # fmt: skip


def state(t: float, **kw: object) -> EngineState:
    return EngineState(time=t, seq=3, generation=GEN, **kw)  # type: ignore[arg-type]


def view(st: EngineState | None) -> SenderView:
    return SenderView(q_b=0, rate=RATE, overhead=H, state=st, state_seq_before=2)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(10.0)


# -- rule 1: the regime-aware override -----------------------------------------------


def capped(clock: ManualClock, **kw: object) -> tuple[list[Pending], EngineState]:
    """Spec 4's motivating case: A and B leased, C resident but unprotected, U at the cap."""
    A, B, C = item("A", p=1000, r=1.0), item("B", p=3000, r=2.0), item("C", p=6000, r=3.0)
    res = ((A.cid, 30), (B.cid, 50), (C.cid, 60))
    st = state(clock(), U=100, B=100, C=100, leases=(lease(A, 2), lease(B, 40)), resident=res, **kw)
    return [A, B, C], st


def test_override_stands_down_on_headroom_refusals_and_acts_on_budget_denials(
    clock: ManualClock,
) -> None:
    t = clock()
    refused = RefusalEvent(ContinuationId("C", 1), t - 0.3, GEN, free=5, taken=60)
    pending, st = capped(clock, refusals=(refused,))
    A, B, _ = pending
    # The spec's condition holds (U >= theta * C): the paper's LADS promotes B ...
    assert override_active(st, t, 0.75, 1.0)
    assert make_policy("lads").choose(pending, view(st), t) == B
    # ... but C was refused by the headroom rule: B's handoff returns quota, frees no
    # block, so the adaptive override stands down and the base order's choice goes
    # (rule 2: A, the smallest frame, as every frame has done one call).
    assert failed_grants(st, t, 1.0) == (0, 1)
    assert not regime_override(st, t, 0.75, 1.0)
    ada = make_policy("lads-adaptive")
    assert ada.choose(pending, view(st), t) == A
    ada.on_commit(A, t)
    assert ada.stats()["stood_down"] == 1 and ada.stats()["promotions"] == 0

    denied = DenialEvent(ContinuationId("C", 1), t - 0.3, GEN, delta=60, budget=100, used=100)
    pending, st = capped(clock, denials=(denied,))
    assert regime_override(st, t, 0.75, 1.0)
    assert make_policy("lads-adaptive").choose(pending, view(st), t) == B  # budget: it acts

    # Mixed: the majority of the recent failed grants decides.
    two = (refused, RefusalEvent(ContinuationId("D", 1), t - 0.2, GEN, 5, 60))
    assert not regime_override(capped(clock, denials=(denied,), refusals=two)[1], t, 0.75, 1.0)
    assert regime_override(
        capped(clock, denials=(denied, denied), refusals=two[:1])[1], t, 0.75, 1.0
    )
    # Not recent (older than the record age, or of an earlier generation): the spec's rule.
    old = RefusalEvent(ContinuationId("C", 1), t - 1.5, GEN, 5, 60)
    earlier = RefusalEvent(ContinuationId("C", 1), t - 0.3, GEN - 1, 5, 60)
    for ev in (old, earlier):
        pending, st = capped(clock, refusals=(ev,))
        assert failed_grants(st, t, 1.0) == (0, 0)
        assert make_policy("lads-adaptive").choose(pending, view(st), t) == B


def test_the_engine_publishes_headroom_refusals_of_the_current_generation() -> None:
    r = rig(num_blocks=64, headroom=60)  # leasing 8 of 63 free blocks leaves 55 < H
    ha = toks(1, 8)
    r.run(ha)
    a = ContinuationId("wa", 1)
    r.notice(a, ha)
    st = r.s.lease_state()
    assert not r.leased(a) and st.denials == ()
    assert [(e.cid, e.generation) for e in st.refusals] == [(a, st.generation)]
    assert st.refusals[0].free - st.refusals[0].taken < 60
    assert failed_grants(st, r.clk(), 1.0) == (0, 1)
    r.tick_at(r.clk() + 0.1)  # a new generation refuses it again, and only then
    st2 = r.s.lease_state()
    assert st2.generation > st.generation
    assert [(e.cid, e.generation) for e in st2.refusals] == [(a, st2.generation)]
    assert st2.counters["headroom_refusals"] == 2
    r.s.lease_release_all()
    assert r.s.lease_state().refusals == ()
    assert r.s.lease_audit()["refs_added"] == 0


# -- rule 2: progress in the base order -------------------------------------------------


def test_progress_tie_break_within_the_residency_class(clock: ManualClock) -> None:
    t = clock()
    X = item("X", p=300, r=1.0, arrival=5.0)  # smallest frame, one call done
    Z = item("Z", p=400, r=2.0, arrival=1.0, turn=3)  # larger frame, three calls done
    res = {X.cid: 4, Z.cid: 20}
    assert cache_first([X, Z], res) == X
    # Smith's rule: Z's frame per call done (~467 B) is below X's (~1300 B): Z passes X.
    assert progress_first([X, Z], res) == Z
    # ... but a much larger frame does not pass a small one for one call more.
    W = item("W", p=4000, r=0.5, arrival=0.5, turn=2)
    assert progress_first([X, W], res | {W.cid: 40}) == X
    # One round of a cohort (as many calls done): Cache-first's smaller-frames-first,
    # however many blocks each has resident (a half-evicted history is not behind).
    Y = item("Y", p=500, r=1.0, arrival=0.2)
    assert progress_first([X, Y], {X.cid: 2, Y.cid: 60}) == X
    # Equal frames and calls: the older workflow.
    V = item("V", p=300, r=0.5, arrival=9.0)
    assert progress_first([V, X], {X.cid: 20, V.cid: 20}) == X
    # A cold frame (the state says |P_i| == 0) never goes before a resident one,
    # however far along ...
    assert progress_first([X, Z], {X.cid: 4, Z.cid: 0}) == X
    # ... but a result no state lists yet is presumed resident (it has just finished
    # its model call), where Cache-first puts it with the cold ones.
    assert cache_first([X, Z], {X.cid: 4}) == X
    assert progress_first([X, Z], {X.cid: 4}) == Z
    assert progress_first([X, Z], {}) == Z
    # Among cold frames (nothing to protect): Cache-first, the smaller frame.
    assert progress_first([X, Z], {X.cid: 0, Z.cid: 0}) == X

    # The policy: the same order with and without a headroom regime (rule 1's
    # signal); with no engine state yet, Cache-first itself.
    ada = make_policy("lads-adaptive")
    assert isinstance(ada, LadsAdaptive)
    st = state(t, resident=tuple(res.items()), block_size=BS)
    assert ada.choose([X, Z], view(st), t) == Z
    ada.on_commit(Z, t)
    assert ada.stats()["progress"] == 1
    refused = RefusalEvent(ContinuationId("Q", 1), t - 0.3, GEN, free=5, taken=60)
    hr = state(t, resident=tuple(res.items()), block_size=BS, refusals=(refused,))
    assert ada.choose([X, Z], view(hr), t) == Z
    assert ada.choose([X, Z], view(None), t) == X  # no state: Cache-first
    assert make_policy("lads").choose([X, Z], view(st), t) == X  # the paper's LADS: unchanged


def test_progress_ranks_a_workflow_by_its_mean_frame_not_this_frames_jitter(
    clock: ManualClock,
) -> None:
    """Alike workflows at one turn: the frame-by-frame order flips with each frame's
    few-percent jitter; the workflow's mean frame keeps one order across rounds."""
    t = clock()
    a1, b1 = item("A", p=900, arrival=0.0), item("B", p=1000, arrival=1.0)
    a2, b2 = item("A", p=1050, turn=2), item("B", p=1000, turn=2, arrival=1.0)
    res = {a2.cid: 30, b2.cid: 30}
    means = FrameMeans()
    for it in (a1, b1):
        means.add(it)
    assert means.mean(a2) == (H + 900 + H + 1050) / 2 < means.mean(b2) == H + 1000
    assert progress_first([a2, b2], res) == b2  # this frame's bytes: B, 50 B smaller
    assert progress_first([a2, b2], res, means) == a2  # the mean: A stays ahead

    # Bounded: the least recently sent workflow is forgotten, and sized by its own frame.
    small = FrameMeans(cap=2)
    for it in (a1, b1, item("C", p=5000)):
        small.add(it)
    assert len(small) == 2 and small.mean(a2) == a2.frame_bytes
    assert small.mean(b2) == (b1.frame_bytes + b2.frame_bytes) / 2

    # The policy learns the means from its own commits.
    ada = make_policy("lads-adaptive")
    st = state(t, resident=((a1.cid, 20), (b1.cid, 20)), block_size=BS)
    assert ada.choose([a1, b1], view(st), t) == a1
    ada.on_commit(a1, t)
    assert ada.choose([b1], view(st), t) == b1
    ada.on_commit(b1, t)
    st2 = state(t, resident=tuple(res.items()), block_size=BS)
    assert ada.choose([a2, b2], view(st2), t) == a2
    ada.on_commit(a2, t)
    assert ada.stats()["progress"] == 1  # Cache-first would have sent B's smaller frame


# -- rule 3: soft protection on vLLM's real free queue ----------------------------------


def soft_protection(retention: Retention) -> dict[str, object]:
    """A leased (A), a waiting history no lease holds (B, its frame too slow for the
    near-use set), a foreign history freed last (F); then a flood of 46 blocks."""
    r = rig(num_blocks=64, headroom=4, retention=retention)
    ha, hb, hf = toks(1, 8), toks(2, 8), toks(3, 8)
    a, b = ContinuationId("wa", 1), ContinuationId("wb", 1)
    for h in (ha, hb, hf):  # LRU would evict B's blocks before F's
        r.run(h)
    r.notice(a, ha)
    r.notice(b, hb, payload=10**7)  # T_B = 10 s > l: not near-use, no lease
    assert r.leased(a) and not r.leased(b)
    r.step()  # schedule() entry: the free-queue order is imposed here
    flood = r.add(toks(9, 45), max_tokens=2)
    r.until(flood.is_finished)
    out = {
        "a": r.s.lease_resident(ha),
        "b": r.s.lease_resident(hb),
        "f": r.s.lease_resident(hf),
        "U": r.s.lease_state().U,
    }
    ca, cb = r.add(cont(ha)), r.add(cont(hb))
    r.s.lease_bind(a, ca.request_id)
    r.s.lease_bind(b, cb.request_id)
    step = r.step()
    out["cached"] = {
        {ca.request_id: "a", cb.request_id: "b"}[d.req_id]: d.num_computed_tokens
        for d in step.scheduled_new_reqs
    }
    r.until(lambda: ca.is_finished() and cb.is_finished())
    c = r.counters()
    out.update(grants=c["grants"], handoffs=c["handoffs"], sessions=c["sessions"])
    r.s.lease_release_all()
    audit = r.s.lease_audit()
    assert audit["refs_added"] == audit["refs_released"] > 0
    return out


def test_soft_protection_orders_the_free_queue_on_top_of_leases() -> None:
    got = soft_protection(Retention.LADS_SESSION)
    # B holds no lease, yet the foreign history went before it; A's lease held.
    assert got["b"] == 8 and got["f"] < 8 and got["a"] == 8 and got["U"] == 8
    assert got["cached"] == {"a": 8 * BS, "b": 8 * BS}
    assert got["sessions"] == 2  # both waited in the order; only B's blocks were free
    # The control, plain LADS retention: vLLM's LRU evicts B first; leases the same.
    lru = soft_protection(Retention.LADS)
    assert lru["b"] < 8 and lru["f"] > 0 and lru["a"] == 8
    assert lru["cached"]["b"] < 8 * BS
    assert (lru["grants"], lru["handoffs"]) == (got["grants"], got["handoffs"]) == (1, 1)


# -- the name and one replay end to end -------------------------------------------------


def test_the_name_is_registered_after_the_paper_lads() -> None:
    e = BY_NAME["lads-adaptive"]
    assert (e.group, e.label, e.core, e.paper) == (Group.OURS, "LADS adaptive", True, False)
    assert CANDIDATE == "lads" and "lads-adaptive" in CORE
    assert e.retention is Retention.LADS_SESSION and e.uses_leases
    run = RunName.parse("lads-adaptive")
    assert str(run) == "lads-adaptive" and label(str(run)) == "LADS adaptive"
    assert make_policy("lads").retention is Retention.LADS  # the paper's: unchanged


@pytest.mark.engine
async def test_smoke_replay_end_to_end_with_a_balanced_audit(model_ready: None) -> None:
    from ladsd.workloads.factory import make
    from ladsd.workloads.runner import run

    prof = PROFILES["smoke"]
    wl = make("controlled", prof, 1)
    rec = await run(wl, prof, "lads-adaptive")
    summary.audit(rec)
    assert rec.policy == "lads-adaptive"
    assert rec.counters["refs_added"] == rec.counters["refs_released"] > 0
    assert rec.counters["sessions"] > 0  # the soft protection ran beside the leases
    assert rec.counters["grants"] > 0
    assert len(rec.workflows) == len(wl.workflows)
    assert rec.counters["cached_prompt_tokens"] > 0
