"""The comparison plan: rotated order, core repeats, file names, configuration checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from ladsd.config import PROFILES
from ladsd.workloads import plan


def test_order_rotates_per_block_and_core_policies_repeat() -> None:
    slots = plan.plan(["fifo", "size-first", "lads"], [1, 2], 2, Path("o"), "t")
    blocks = [
        [(s.policy, s.position) for s in slots if (s.seed, s.repeat) == key]
        for key in ((1, 1), (1, 2), (2, 1), (2, 2))
    ]
    assert blocks[0] == [("fifo", 0), ("size-first", 1), ("lads", 2)]
    assert blocks[1] == [("lads", 0), ("fifo", 1)]  # size-first is not core: once per seed
    assert blocks[2] == [("lads", 0), ("fifo", 1), ("size-first", 2)]
    assert blocks[3] == [("lads", 0), ("fifo", 1)]  # rotated by 3 places of 2
    names = {s.path.name for s in slots}
    assert "t-fifo-s1.json" in names and "t-fifo-s1-r2.json" in names
    assert "t-size-first-s1-r2.json" not in names


def test_repeat_all_repeats_the_peers_too() -> None:
    pols = ["fifo", "augserve-order+lads-adaptive", "hear-session"]
    slots = plan.plan(pols, [1], 2, Path("o"), "t", repeat_all=True)
    assert sorted((s.policy, s.repeat) for s in slots) == sorted(
        (p, r) for p in pols for r in (1, 2)
    )
    assert "t-hear-session-s1-r2.json" in {s.path.name for s in slots}


def test_every_policy_comes_first_in_some_block() -> None:
    pols = ["fifo", "cache-first", "lads", "infinite-cache"]
    slots = plan.plan(pols, [1, 2], 2, Path("o"), "t")
    assert {s.policy for s in slots if s.position == 0} == set(pols)


def test_config_check_names_the_differing_field() -> None:
    prof = PROFILES["smoke"]
    want = plan.config(prof, "controlled", 1, {"kv_blocks": 200})
    plan.check(want, want, Path("f.json"))
    stored = plan.config(prof, "controlled", 1, {})
    with pytest.raises(plan.ConfigMismatch, match=r"flags\.kv_blocks = None"):
        plan.check(stored, want, Path("f.json"))
    other = plan.config(PROFILES["cpu"], "controlled", 1, {})
    with pytest.raises(plan.ConfigMismatch, match="profile"):
        plan.check(other, stored, Path("f.json"))
    with pytest.raises(ValueError):
        plan.plan(["fifo"], [1], 0, Path("o"), "t")
