"""bench/reach.py: a policy at the profile's pool and on the infinite cache's, read back.

Model-free: the committed issue23-reach pack is read, nothing is run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import bench_script

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "bench/results/issue23-reach"


def test_a_pair_gives_every_policy_and_the_big_pool() -> None:
    reach = bench_script("reach")
    lines = reach.table("c8", reach.run_dir(FOLDER), "lads-adaptive")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert set(rows) == {
        "policy",
        "fifo",
        "infinite-cache",
        "lads-adaptive",
        "lads-adaptive on the infinite pool",
    }
    # The figures the folder's README gives: 40.0 % at the pool, 44.8 % on the big one,
    # which held more blocks at once than the whole pool has.
    assert "| 40.0 |" in rows["lads-adaptive"]
    big = rows["lads-adaptive on the infinite pool"]
    assert "| 15872 |" in big and "| 44.8 |" in big
    most = int(big.rstrip(" |").rsplit("| ", 1)[1])
    assert most > reach.pool(reach.load(reach.run_dir(FOLDER) / "c8")["lads-adaptive"][0])


def test_a_missing_big_pool_folder_is_named(tmp_path: Path) -> None:
    reach = bench_script("reach")
    shutil.copytree(reach.run_dir(FOLDER) / "cs", tmp_path / "cs")
    (tmp_path / "cs-inf").mkdir()
    with pytest.raises(SystemExit, match="needs FIFO in cs/ and lads-adaptive in cs-inf/"):
        reach.table("cs", tmp_path, "lads-adaptive")
