"""bench/reach.py: a policy at the profile's pool and on the infinite cache's, read back.

Model-free: the committed issue23-reach pack is read, nothing is run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ladsd.metrics.events import LeaseSample, RunRecord
from tests.helpers import bench_script

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "bench/results/issue23-reach"


def cells(lines: list[str]) -> dict[str, dict[str, str]]:
    """Each table row by its policy, each cell by its column's title."""
    rows = [[c.strip() for c in x.strip("| ").split(" | ")] for x in lines if x.startswith("| ")]
    head = rows[0]
    return {r[0]: dict(zip(head, r, strict=True)) for r in rows[1:] if not r[0].startswith("-")}


def test_a_pair_gives_every_policy_and_the_big_pool() -> None:
    reach = bench_script("reach")
    rows = cells(reach.table("c8", reach.run_dir(FOLDER), "lads-adaptive"))
    big = "lads-adaptive on the infinite pool"
    assert set(rows) == {"fifo", "infinite-cache", "lads-adaptive", big}
    # The figures the folder's README gives: 40.0 % at the pool, 44.8 % on the big one,
    # which held more blocks referenced at once than the whole pool has.
    assert rows["lads-adaptive"]["below FIFO %"] == "40.0"
    assert rows[big]["below FIFO %"] == "44.8" and rows[big]["pool"] == "15872"
    assert int(rows[big]["most referenced"]) > int(rows["lads-adaptive"]["pool"])
    assert rows["fifo"]["below FIFO %"] == "0.0" and rows["fifo"]["normalised %"] == "0.0"


def test_the_reading_of_one_run() -> None:
    """Most referenced = pool - fewest free; repeats: seed means and spreads; a repeat
    listed twice is refused."""
    reach = bench_script("reach")
    meta = {"profile": {"engine": {"num_gpu_blocks_override": 100}}, "dilation": 1.0}

    def run(seed: int, repeat: int, free: list[int]) -> RunRecord:
        samples = tuple(LeaseSample(t=0.1 * i, U=0, B=0, C=0, F=f) for i, f in enumerate(free))
        return RunRecord("fifo", "w", "p", seed, (), samples, {}, {**meta, "repeat": repeat})

    assert reach.referenced(run(1, 1, [90, 40, 70])) == 60
    assert reach.referenced(run(1, 1, [])) is None
    runs = [run(1, 1, [50]), run(1, 2, [50])]
    times = iter([10.0, 12.0])
    by = reach.by_seed(runs, lambda r: next(times))
    assert by == {1: {1: 10.0, 2: 12.0}}
    with pytest.raises(SystemExit, match="seed 1 repeat 1 twice"):
        reach.by_seed([run(1, 1, [50]), run(1, 1, [50])], lambda r: 1.0)


def test_a_missing_big_pool_folder_is_named(tmp_path: Path) -> None:
    reach = bench_script("reach")
    shutil.copytree(reach.run_dir(FOLDER) / "cs", tmp_path / "cs")
    (tmp_path / "cs-inf").mkdir()
    with pytest.raises(SystemExit, match="needs FIFO in cs/ and lads-adaptive in cs-inf/"):
        reach.table("cs", tmp_path, "lads-adaptive")
