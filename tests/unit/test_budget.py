"""Spec 3.1 budget formulas, checked against hand-computed cases."""

from __future__ import annotations

import math

import pytest

from ladsd.engine import budget as bud


def cand(key: str, blocks: range | list[int], tau: float = 8.0, t_b: float = 1.0) -> bud.Candidate:
    return bud.Candidate(key, frozenset(blocks), tau, t_b)


def test_remaining_horizon_before_and_after_first_grant() -> None:
    assert bud.remaining_horizon(8.0, None, now=123.0) == 8.0
    assert bud.remaining_horizon(8.0, 100.0, now=103.5) == 4.5
    assert bud.remaining_horizon(8.0, 100.0, now=109.0) == -1.0  # past d_i
    with pytest.raises(ValueError, match="lifetime"):
        bud.remaining_horizon(0.0, None, now=0.0)


def test_engine_delay_counts_requests_beyond_the_running_slots() -> None:
    # w + a + 1 - m = 3 + 6 + 1 - 8 = 2 steps of kappa = 0.25 s
    assert bud.engine_delay(0.25, waiting=3, running=6, max_seqs=8) == 0.5
    assert bud.engine_delay(0.25, waiting=0, running=7, max_seqs=8) == 0.0  # a free slot
    assert bud.engine_delay(0.25, waiting=0, running=0, max_seqs=8) == 0.0
    with pytest.raises(ValueError):
        bud.engine_delay(-1.0, 0, 0, 8)
    with pytest.raises(ValueError):
        bud.engine_delay(0.1, 0, 0, 0)


def test_fifo_wait_times_accumulate_frames_up_to_and_including_i() -> None:
    # Q_B = 972, h = 1028, R = 4000 B/s; payloads 1000, 3000, 0:
    # (972 + 2028) / 4000 = 0.75; (3000 + 4028) / 4000 = 1.757; (7028 + 1028) / 4000 = 2.014
    got = bud.fifo_wait_times(972, [1000, 3000, 0], overhead=1028, rate=4000.0)
    assert got == pytest.approx([0.75, 1.757, 2.014])
    assert bud.fifo_wait_times(0, [], 1028, 4000.0) == []
    with pytest.raises(ValueError, match="rate"):
        bud.fifo_wait_times(0, [1], 1028, 0.0)
    with pytest.raises(ValueError, match="non-negative"):
        bud.fifo_wait_times(0, [-1], 1028, 4000.0)


def test_time_to_allocation_adds_link_and_engine_terms() -> None:
    link = bud.fifo_wait_times(0, [2972], 1028, 4000.0)[0]  # 1.0 s
    assert bud.time_to_allocation(link, bud.engine_delay(0.5, 1, 8, 8)) == pytest.approx(2.0)


def test_near_use_set_needs_resident_prefix_horizon_and_timeliness() -> None:
    cs = [
        cand("warm", [1, 2], tau=8.0, t_b=2.0),
        cand("cold", [], tau=8.0, t_b=0.1),
        cand("late", [3], tau=1.0, t_b=2.0),  # T_B > tau
        cand("spent", [4], tau=0.0, t_b=0.0),  # tau must be > 0
        cand("edge", [5], tau=2.0, t_b=2.0),  # T_B == tau is in
    ]
    assert [c.key for c in bud.near_use_set(cs)] == ["warm", "edge"]


def test_demand_counts_distinct_blocks_of_the_union() -> None:
    # {1..10} u {6..15} u {100} = 16 blocks
    assert bud.demand([cand("a", range(1, 11)), cand("b", range(6, 16)), cand("c", [100])]) == 16
    assert bud.demand([]) == 0


def test_safe_ceiling_fit_target_and_committed_capacity() -> None:
    assert bud.safe_ceiling(used=10, free=100, headroom=50) == 60
    assert bud.safe_ceiling(used=0, free=30, headroom=50) == 0
    near = [cand("a", range(40)), cand("b", range(100, 170))]
    assert bud.fits(near, c_safe=40) is True  # |P_a| = 40 <= 40
    assert bud.fits(near, c_safe=39) is False
    assert bud.budget_target(d=110, c_safe=60, fit=True) == 60
    assert bud.budget_target(d=30, c_safe=60, fit=True) == 30
    assert bud.budget_target(d=110, c_safe=60, fit=False) == 0
    assert bud.committed_capacity(target=0, used=25) == 25  # a lower target never revokes
    assert bud.committed_capacity(target=60, used=25) == 60


def test_evaluate_end_to_end_hand_computed() -> None:
    # U = 20, F = 200, H = 150 -> C_safe = 70. N = {a, b} (c is late, d is cold).
    # D = |{0..49} u {40..79}| = 80; fit (|P_a| = 50 <= 70); B = min(80, 70) = 70; C = 70.
    cs = [
        cand("a", range(0, 50)),
        cand("b", range(40, 80)),
        cand("c", range(200, 205), tau=1.0, t_b=5.0),
        cand("d", []),
    ]
    b = bud.evaluate(cs, used=20, free=200, headroom=150)
    assert b == bud.Budget(near=("a", "b"), D=80, C_safe=70, fit=True, B=70, C=70)


def test_evaluate_without_fit_targets_zero_but_keeps_committed_capacity() -> None:
    # C_safe = max(0, 30 + 10 - 20) = 20 < |P| = 25 for the only near-use candidate.
    b = bud.evaluate([cand("a", range(25))], used=30, free=10, headroom=20)
    assert (b.D, b.C_safe, b.fit, b.B, b.C) == (25, 20, False, 0, 30)


def test_infinite_link_time_keeps_a_candidate_out_of_n() -> None:
    c = cand("a", [1], tau=8.0, t_b=math.inf)
    assert bud.near_use_set([c]) == []
