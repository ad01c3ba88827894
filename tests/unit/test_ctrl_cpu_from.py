"""bench/ctrl_cpu.py --from: controller CPU of a pass's committed run files, read back.

Model-free: the committed captured-scaled pack is read, nothing is run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import bench_script

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "bench/results/issue23-pass/captured-scaled"
POLICIES = ("fifo", "lads", "lads-adaptive")


def test_a_pass_folder_gives_its_runs_and_the_published_ratios(capsys) -> None:
    cc = bench_script("ctrl_cpu")
    rows = cc.read(FOLDER, "captured-scaled-cpu", POLICIES)
    # Five seeds, two repeats each, of every core policy; other policies left out.
    assert sorted({r["policy"] for r in rows}) == sorted(POLICIES)
    assert all(sum(r["policy"] == p for r in rows) == 10 for p in POLICIES)
    res = cc.report(rows, POLICIES)
    # The figures the pass README gives (1.68x and 1.61x FIFO's).
    assert round(res["lads-adaptive_over_fifo"], 2) == 1.68
    assert round(res["lads_over_fifo"], 2) == 1.61
    cc.summary(rows, POLICIES)
    # Run files from before the published states were counted: no publish part, nor
    # the lease work inside schedule().
    assert "engine 0.304, publish -, schedule -) / FIFO 1.68x" in capsys.readouterr().out


def test_a_policy_without_runs_is_named() -> None:
    cc = bench_script("ctrl_cpu")
    rows = cc.read(FOLDER, "captured-scaled-cpu", ("fifo",))
    with pytest.raises(SystemExit, match="no runs of 'lads'"):
        cc.summary(rows, ("fifo", "lads"))
