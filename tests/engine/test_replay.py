"""Smoke replays on the real engine and link: every policy, each workload, audit passing."""

from __future__ import annotations

import pytest

from ladsd.config import PROFILES
from ladsd.metrics import summary
from ladsd.workloads.factory import DEFAULT_TRACE, make
from ladsd.workloads.runner import REPLAY_POLICIES, run

pytestmark = [pytest.mark.engine]
SMOKE = PROFILES["smoke"]


def check(rec, wl, prof=SMOKE) -> None:
    summary.audit(rec)  # refs added == released
    assert rec.counters["refs_added"] == rec.counters["refs_released"]
    assert len(rec.workflows) == len(wl.workflows)
    by_id = {w.wid: w for w in wl.workflows}
    for f in rec.workflows:
        spec = by_id[f.workflow]
        assert [c.turn for c in f.calls] == list(range(len(spec.calls) + 1))
        for c in f.calls[1:]:
            st = c.stamps
            assert st.r <= st.s <= st.c <= st.a <= st.n <= st.f
            assert c.frame_bytes == c.payload_bytes + 1028
        assert f.calls[0].output_tokens == spec.first_output_tokens
        # Forced output length, except where the prompt leaves less room in the
        # context: the engine then stops at max_model_len (at the cpu profile's
        # 1/8 scale the longest histories reach 4,096 tokens on their last call).
        room = [prof.engine.max_model_len - c.prompt_tokens for c in f.calls[1:]]
        want = [min(c.output_tokens, r) for c, r in zip(spec.calls, room, strict=True)]
        assert [c.output_tokens for c in f.calls[1:]] == want
        assert f.arrival <= f.calls[0].stamps.a and f.calls[-1].stamps.f <= f.termination


@pytest.mark.parametrize("policy", REPLAY_POLICIES)
async def test_smoke_controlled_every_policy(policy, model_ready):
    wl = make("controlled", SMOKE, 1)
    rec = await run(wl, SMOKE, policy)
    check(rec, wl)
    assert rec.policy == policy and rec.workload == "controlled"
    inputs = rec.meta["inputs"]  # what was run, not the profile's defaults
    assert inputs["workload"] == "controlled" and inputs["seed"] == 1
    assert inputs["workflows"] == len(wl.workflows) and inputs["continuations"] == wl.continuations
    assert sum(inputs["cohort_sizes"]) == len(wl.workflows)
    # continuations extend their own history: the engine reuses cached blocks
    assert rec.counters["cached_prompt_tokens"] > 0


def test_controlled_inputs_identical_across_policies():
    assert make("controlled", SMOKE, 2) == make("controlled", SMOKE, 2)


@pytest.mark.parametrize("workload", ["web-burst", "captured"])
@pytest.mark.parametrize("policy", REPLAY_POLICIES)
async def test_smoke_trace_workloads(workload, policy, model_ready):
    if not DEFAULT_TRACE.exists():
        pytest.fail(f"committed trace {DEFAULT_TRACE} is missing")
    wl = make(workload, SMOKE, 1)
    rec = await run(wl, SMOKE, policy)
    check(rec, wl)


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["controlled", "web-burst", "captured"])
@pytest.mark.parametrize("policy", ["fifo", "lads"])
async def test_cpu_profile_replay(workload, policy, model_ready):
    """The full cpu-profile replay (minutes per run): `./scripts/test.sh -m slow`."""
    prof = PROFILES["cpu"]
    wl = make(workload, prof, 1, cohort=8 if workload == "controlled" else None)
    rec = await run(wl, prof, policy)
    check(rec, wl, prof)
