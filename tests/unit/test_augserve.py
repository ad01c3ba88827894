"""AugServe's engine policy: formulas by hand, then vLLM's real Scheduler without a model.

Hand-computed cases use ``kappa = 0.512`` s over ``n_kappa = 512`` tokens
(``tau_fwd(n) = n / 1000`` s), block size 16, and a decode step of ``kappa``
(the prior: no decode step has been measured). The tiny-engine run is in
tests/engine/test_kv_retention.py.
"""

from __future__ import annotations

import pytest
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.request import Request, RequestStatus

from ladsd import testing
from ladsd.clock import ManualClock
from ladsd.config import LeaseConfig
from ladsd.engine import augserve as aug
from ladsd.engine.lease_resident import make_hasher
from ladsd.engine.sched_augserve import AsyncAugServeScheduler, AugServeScheduler
from ladsd.engine.schedulers import scheduler_class
from ladsd.modes import EnginePolicy, Retention
from ladsd.records import ContinuationId
from tests.rigs.leases import BS, Rig, toks

KAPPA = 0.512
CFG = aug.AugServeConfig(prior_output_tokens=8)


def aug_rig(
    cls: type = AugServeScheduler,
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 512,
    retention: Retention = Retention.NONE,
    order_only: bool = False,
) -> Rig:
    s = testing.make_scheduler(
        cls,
        num_blocks=num_blocks,
        block_size=BS,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    clk = ManualClock(1000.0)
    lease = LeaseConfig(enabled=retention is Retention.LADS, headroom_blocks=2)
    s.lease_setup(lease, KAPPA, clk, retention=retention, augserve=CFG, order_only=order_only)
    return Rig(s, clk, payload=100, lists=False)


# -- formulas ------------------------------------------------------------------


def test_scheduler_class_picks_augserve():
    for ep in (EnginePolicy.AUGSERVE, EnginePolicy.AUGSERVE_ORDER):  # one class for both
        assert scheduler_class(ep, False) is AugServeScheduler
        assert scheduler_class(ep, True) is AsyncAugServeScheduler


def test_engine_policies_say_what_they_imply():
    """The one table the scheduler class, its setup (order_only) and the step buffer read."""
    implied = {ep: (ep.augserve, ep.dynamic_budget) for ep in EnginePolicy}
    assert implied == {
        EnginePolicy.VLLM: (False, False),
        EnginePolicy.AUGSERVE: (True, True),
        EnginePolicy.AUGSERVE_ORDER: (True, False),
    }


def test_token_budget_formula_and_both_clips():
    c = aug.AugServeConfig()  # T_max 512, [0.5, 2.0] -> [256, 1024]
    assert aug.token_budget(40, 0, 16, c, ceiling=4096) == 640  # floor(40 * 16 / 1)
    assert aug.token_budget(30, 10, 16, c, ceiling=4096) == 640  # G_preempt counts too
    assert aug.token_budget(100, 0, 16, c, ceiling=4096) == 1024  # beta_high * T_max
    assert aug.token_budget(3, 0, 16, c, ceiling=4096) == 256  # beta_low * T_max
    assert aug.token_budget(100, 0, 16, c, ceiling=512) == 512  # the engine's maximum
    assert aug.token_budget(3, 0, 16, c, ceiling=200) == 200  # the lower clip never exceeds it
    half = aug.AugServeConfig(mu=2.0)
    assert aug.token_budget(41, 0, 16, half, ceiling=4096) == 328  # floor(656 / 2)


def test_preserve_or_discard_by_hand():
    # L~ = 1024 tokens (64 blocks), tau_fwd(1024) = 1.024 s, L_other = 976 slots:
    # Discard wastes 1.024 * 1024 + 1.024 * 976 = 2048 slot-seconds.
    assert aug.discard_waste(1024, 976, KAPPA, 512, 16) == pytest.approx(2048.0)
    assert aug.preserve_waste(1.5, 1024, 16) == pytest.approx(1536.0)
    assert aug.choose(1536.0, 2048.0) is aug.Context.PRESERVE
    assert aug.preserve_waste(2.5, 1024, 16) == pytest.approx(2560.0)
    assert aug.choose(2560.0, 2048.0) is aug.Context.DISCARD
    assert aug.choose(2048.0, 2048.0) is aug.Context.DISCARD  # a tie discards
    assert aug.preserve_waste(1.0, 1000, 16) == 1008.0  # whole blocks: 63 of 16


def test_segment_cost_by_hand():
    # L = 64, nothing cached, o = 8, call 8 s, L_other = 32 slots:
    # prefill 64 * 0.064 = 4.096; decode mem(72) = 80 slots * 8 * 0.512 = 327.68;
    # Preserve would waste 8 * 80 = 640 > Discard 0.072 * (80 + 32) = 8.064: no call cost.
    seg = aug.Segment(tokens=64, hit=0, output=8, call_s=8.0, other=32)
    cost, policy = aug.segment_cost(seg, kappa=KAPPA, n_kappa=512, step_s=KAPPA, block_size=16)
    assert policy is aug.Context.DISCARD
    assert cost == pytest.approx(331.776)
    # After a call: 48 of the 64 tokens resident (realised feedback) and a 0.01 s wait,
    # so Preserve (0.01 * 80 = 0.8) beats Discard and its cost counts.
    seg = aug.Segment(tokens=64, hit=48, output=8, call_s=0.01, other=32)
    cost, policy = aug.segment_cost(seg, kappa=KAPPA, n_kappa=512, step_s=KAPPA, block_size=16)
    assert policy is aug.Context.PRESERVE
    assert cost == pytest.approx(64 * 0.016 + 327.68 + 0.8)
    assert aug.theta(2.0, 331.776, aging=1.0) == pytest.approx(3 / 331.776)


def test_predictor_priors_then_step_then_global():
    p = aug.Predictor(prior_output_tokens=8, prior_wait_s=8.0, prior_step_s=KAPPA)
    assert (p.output_tokens(1), p.wait_s(1), p.step_s()) == (8, 8.0, KAPPA)
    p.output.add(1, 10)
    p.output.add(1, 20)
    p.output.add(2, 60)
    assert p.output_tokens(1) == 15  # its step's mean
    assert p.output_tokens(3) == 30  # no sample for step 3: the global mean


# -- vLLM's scheduler ------------------------------------------------------------


def test_theta_order_by_hand_and_order_changes():
    r = aug_rig(max_num_seqs=1)
    a = r.add(toks(1, 4))  # 64 tokens, registered first
    b = r.add(toks(2, 2))  # 32 tokens
    # Nobody has waited: theta = 1 / C. C_A = 331.776 (test_segment_cost_by_hand);
    # C_B = 32 * 0.032 + mem(40) = 48 * 8 * 0.512 = 197.632 (Discard: 4.48 < 384).
    assert r.s.augserve_priorities() == [
        (b.request_id, pytest.approx(1 / 197.632)),
        (a.request_id, pytest.approx(1 / 331.776)),
    ]
    out = r.step()
    assert [x.req_id for x in out.scheduled_new_reqs] == [b.request_id]  # one slot: B
    assert r.s.lease_state().counters["augserve_order_changes"] == 1


def test_aging_keeps_a_long_waiter_first():
    r = aug_rig(max_num_seqs=1)
    a = r.add(toks(1, 4))
    r.clk.advance(2.0)  # A has waited 2 s: theta_A = 3 / 331.776 > theta_B = 1 / 197.632
    b = r.add(toks(2, 2))
    assert r.s.augserve_priorities() == [
        (a.request_id, pytest.approx(3 / 331.776)),
        (b.request_id, pytest.approx(1 / 197.632)),
    ]
    out = r.step()
    assert [x.req_id for x in out.scheduled_new_reqs] == [a.request_id]
    assert r.s.lease_state().counters["augserve_order_changes"] == 0  # FCFS order as well


def test_a_resident_history_ranks_before_a_cold_one():
    r = aug_rig(max_num_seqs=1)
    hist = toks(3, 8)
    r.run(hist, max_tokens=1)  # its blocks stay cached
    cold = r.add(toks(4, 8) + [5] * 16)
    warm = r.add(hist + [6] * 16)  # the history came back: only 16 new tokens to prefill
    ranked = [rid for rid, _ in r.s.augserve_priorities()]
    assert ranked == [warm.request_id, cold.request_id]
    out = r.step()
    assert [x.req_id for x in out.scheduled_new_reqs] == [warm.request_id]


def test_budget_is_set_per_step_and_clipped_at_beta_high():
    r = aug_rig(num_blocks=256, max_num_batched_tokens=2048)
    r.add(toks(5, 188), max_tokens=1)  # 3,008 tokens: chunked by the step budget
    out = r.step()
    assert out.total_num_scheduled_tokens == 1024  # 255 free blocks * 16 > 2 * 512
    c = r.s.lease_state().counters
    assert (c["augserve_steps"], c["augserve_budget_sum"]) == (1, 1024)
    assert c["augserve_budget_ceiling"] == 1024


def test_budget_drops_to_beta_low_when_memory_is_short():
    r = aug_rig(num_blocks=40, max_num_batched_tokens=2048)
    r.add(toks(6, 35), max_tokens=8)  # 560 tokens: 35 of the 39 usable blocks
    out = r.step()
    assert out.total_num_scheduled_tokens == 560  # budget floor(39 * 16) = 624
    r.step()
    assert r.s.max_num_scheduled_tokens == 256  # ~3 free blocks: 48 slots, clipped up
    c = r.s.lease_state().counters
    assert (c["augserve_budget_min"], c["augserve_budget_max"]) == (256, 624)
    assert c["augserve_budget_sum"] == 624 + 256


def test_budget_never_exceeds_the_engine_maximum():
    r = aug_rig(num_blocks=256)  # max_num_batched_tokens 512: the runner's buffers
    r.add(toks(7, 100), max_tokens=1)
    assert r.step().total_num_scheduled_tokens == 512
    assert r.s.lease_state().counters["augserve_budget_ceiling"] == 512


@pytest.mark.parametrize("cls", [AugServeScheduler, AsyncAugServeScheduler])
def test_preempted_requests_still_finish(cls):
    r = aug_rig(cls, num_blocks=16)  # 15 usable blocks; four requests grow to 6 each
    reqs = [r.add(toks(10 + i, 3), max_tokens=40) for i in range(4)]
    r.until(lambda: all(q.is_finished() for q in reqs), limit=400)
    assert r.s.preemptions > 0
    assert all(q.num_output_tokens == 40 for q in reqs)
    assert r.s.augserve_sizes() == {"since": 0, "waited": 0, "cids": 0, "ready": 0}


def test_a_request_waiting_for_its_grammar_is_skipped_not_lost():
    r = aug_rig()
    params = SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(json={"type": "object"})
    )
    params.update_from_generation_config({}, testing.EOS)
    blocked = Request("g", [9] * 16, params, None, block_hasher=make_hasher(BS))
    r.s.add_request(blocked)  # no grammar is compiled without an engine: it stays blocked
    other = r.add(toks(8, 4))
    assert [rid for rid, _ in r.s.augserve_priorities()][0] == "g"  # the shorter one first
    out = r.step()
    assert [x.req_id for x in out.scheduled_new_reqs] == [other.request_id]
    assert blocked.status is RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert blocked in r.s.waiting and blocked in r.s.deferred_waiting
    r.until(other.is_finished)
    r.s.finish_requests("g", RequestStatus.FINISHED_ABORTED)
    r.ok()
    assert not r.s.waiting and r.s.augserve_sizes()["since"] == 0


def test_predictions_come_from_completed_calls_only():
    r = aug_rig()
    pred = r.s.augserve.predictor
    big = r.add(toks(20, 2), max_tokens=1000)  # its limit is no prediction
    assert pred.output_tokens(None) == 8  # the prior
    r.step()
    r.s.finish_requests(big.request_id, RequestStatus.FINISHED_ABORTED)
    assert pred.output.all.n == 0  # an abort is no completed call
    cid = ContinuationId("w", 1)
    done = r.add(toks(21, 2), max_tokens=3)
    r.s.lease_bind(cid, done.request_id)  # a registered continuation of step 1
    r.until(done.is_finished)
    assert (pred.output_tokens(1), pred.output_tokens(None)) == (3, 3)
    waiting = ContinuationId("w", 2)
    r.notice(waiting, toks(21, 2))
    r.clk.advance(0.5)
    assert pred.wait_s(2) == 8.0  # not registered yet: still the prior (l)
    r.s.lease_cancel(waiting)  # a cancelled wait never completes
    assert pred.wait.all.n == 0
    r.notice(ContinuationId("v", 2), toks(22, 2))
    r.clk.advance(0.25)
    r.s.lease_bind(ContinuationId("v", 2), "v-req")
    assert pred.wait_s(2) == pytest.approx(0.25)
    assert r.s.lease_state().counters["augserve_wait_samples"] == 1


def test_discard_on_the_prior_wait_then_preserve_for_a_short_one():
    r = aug_rig(num_blocks=128)
    hist = toks(30, 64)  # 1,024 tokens; nothing else runnable: L_other = 0
    r.run(hist, max_tokens=1)
    # Prior wait l = 8 s: Preserve 8 * 1024 = 8192 > Discard 1.024 * 1024 = 1048.6.
    r.notice(ContinuationId("a", 1), hist)
    c = r.s.lease_state().counters
    assert (c["augserve_discards"], c["augserve_preserves"]) == (1, 0)
    r.clk.advance(0.5)
    r.s.lease_bind(ContinuationId("a", 1), "a-req")  # a completed wait of 0.5 s
    assert r.s.augserve_context(1024, 0.5) is aug.Context.PRESERVE  # 512 < 1048.6
    assert r.s.augserve_context(1024, 1.1) is aug.Context.DISCARD  # 1126.4 > 1048.6
    r.notice(ContinuationId("b", 1), hist)  # predicted wait 0.5 s: Preserve
    c = r.s.lease_state().counters
    assert (c["augserve_discards"], c["augserve_preserves"]) == (1, 1)
    assert c["augserve_preserve_refusals"] == 0
    r.s.lease_release_all()
    audit = r.s.lease_audit()
    assert audit["refs_added"] == audit["refs_released"] > 0  # the preserve held blocks


def test_augserve_order_keeps_the_order_only():
    """The case above under ``augserve-order``: the short wait that was pinned is not,
    and the step budget stays vLLM's; the theta order and its wait samples stay."""
    r = aug_rig(num_blocks=128, retention=Retention.LADS, order_only=True)
    hist = toks(30, 64)
    r.run(hist, max_tokens=1)
    r.notice(ContinuationId("a", 1), hist)
    r.clk.advance(0.5)
    r.s.lease_bind(ContinuationId("a", 1), "a-req")
    r.notice(ContinuationId("b", 1), hist)  # augserve would Preserve this one
    c = r.s.lease_state().counters
    assert (c["augserve_discards"], c["augserve_preserves"]) == (0, 0)
    assert c["augserve_wait_samples"] == 1  # theta's wait prediction still learns
    assert c["pins"] == 0  # no pin outside the budget
    long, short = r.add(toks(40, 6)), r.add(toks(41, 1))
    assert [rid for rid, _ in r.s.augserve_priorities()] == [short.request_id, long.request_id]
    r.s.max_num_scheduled_tokens = 300  # a mark no budget of augserve's would keep
    r.step()
    assert r.s.max_num_scheduled_tokens == 300  # never touched: vLLM's fixed budget
    c = r.s.lease_state().counters
    assert c["augserve_steps"] == 0
    assert c["augserve_order_changes"] == 1  # the queue was reordered (short before long)
    r.s.lease_release_all()
    audit = r.s.lease_audit()
    assert audit["refs_added"] == audit["refs_released"]


def test_setup_refuses_an_engine_it_cannot_run():
    s = testing.make_scheduler(AugServeScheduler, num_blocks=16, block_size=BS)
    s.scheduler_config.enable_chunked_prefill = False
    with pytest.raises(ValueError, match="chunked prefill"):
        s.lease_setup(LeaseConfig(), KAPPA, ManualClock(), retention=Retention.NONE)
    # the order alone sets no budget, so it needs none
    s.lease_setup(LeaseConfig(), KAPPA, ManualClock(), retention=Retention.NONE, order_only=True)
