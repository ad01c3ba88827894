"""The pool/H rule: as many final histories as the paper's pool, H the same fraction."""

from __future__ import annotations

import pytest

from ladsd import sizing
from ladsd.config import PROFILES
from ladsd.workloads.spec import CallSpec, WorkflowSpec, Workload


def wl(*flows: tuple[int, list[tuple[int, int]]]) -> Workload:
    specs = tuple(
        WorkflowSpec(
            wid=f"w{i}",
            arrival=0.0,
            prompt_ids=tuple(range(p)),
            first_output_tokens=8,
            calls=tuple(CallSpec(b"x" * obs, 0.0, out) for obs, out in calls),
        )
        for i, (p, calls) in enumerate(flows)
    )
    return Workload("t", 1, specs)


def test_final_history_is_prompt_outputs_and_tool_messages() -> None:
    w = wl((100, [(10, 8), (20, 8)]), (300, [(10, 8)]))
    # tool message = observation bytes + 5 template tokens here
    assert (
        sizing.final_history(w, lambda o: len(o) + 5)
        == ((100 + 8 + 15 + 8 + 25 + 8) + (300 + 8 + 15 + 8)) / 2
    )


def test_pool_and_headroom_follow_the_paper_ratios() -> None:
    pool, h = sizing.pool_for(17_090.0, 16)  # the paper's own mean final history
    assert pool == pytest.approx(sizing.PAPER_BLOCKS, rel=0.002)
    assert h == pytest.approx(sizing.PAPER_HEADROOM, rel=0.002)
    pool, h = sizing.pool_for(4_000.0, 32)
    assert pool == -(-int(11.53 * 4_000) // 32) and h == round(pool * 2048 / 12315)


def test_sized_sets_pool_and_h_only() -> None:
    prof = PROFILES["cpu"]
    out = sizing.sized(prof, wl((1000, [(10, 64)] * 6)), lambda o: len(o) + 5)
    assert out.engine.num_gpu_blocks_override == sizing.pool_for(1000 + 8 + 6 * 79, 32)[0]
    assert out.lease.headroom_blocks == sizing.pool_for(1000 + 8 + 6 * 79, 32)[1]
    assert out.workload == prof.workload and out.link == prof.link


def test_an_explicit_pool_keeps_h_at_the_rules_fraction() -> None:
    from cli.replay import _profile

    out = _profile("cpu", 3000)
    assert out.engine.num_gpu_blocks_override == 3000 and not out.pool_rule
    assert out.lease.headroom_blocks == round(3000 * 2048 / 12315) == 499
    # A profile without the rule keeps its own H.
    eighth = _profile("cpu-eighth", 3000)
    assert eighth.lease.headroom_blocks == PROFILES["cpu-eighth"].lease.headroom_blocks
