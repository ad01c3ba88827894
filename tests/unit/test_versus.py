"""bench/versus.py: the subject against every policy, checked against the tables
`ladsd compare` committed for the same runs (bench/results/issue23-amd)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import bench_script

versus = bench_script("versus")
dilation = bench_script("dilation")
RUNS = Path(__file__).resolve().parents[2] / "bench" / "results" / "issue23-amd"


def test_the_verdict_holds_a_mean_against_its_floor() -> None:
    assert versus.verdict(5.0, 3.0) == "ahead"
    assert versus.verdict(2.0, 3.0) == "tie"
    assert versus.verdict(-3.0, 3.0) == "tie"
    assert versus.verdict(-4.0, 3.0) == "behind"
    assert versus.verdict(1.0, None) == "ahead" and versus.verdict(-1.0, None) == "behind"


@pytest.fixture(scope="module")
def captured() -> dict:
    return dilation.runs_by_policy(RUNS, "captured-cpu", 3)


def test_lads_rows_match_the_committed_tables(captured: dict) -> None:
    rows = {r["policy"]: r for r in versus.compare(captured, "lads", [1, 2, 3])}
    assert "lads" not in rows and len(rows) == len(captured) - 1
    # captured-cpu-table.md: LADS vs FIFO 14.1 / 15.2 / 18.9, mean 16.1
    fifo = rows["fifo"]["raw"]
    assert [round(fifo["per_seed"][s], 1) for s in (1, 2, 3)] == [14.1, 15.2, 18.9]
    assert round(fifo["mean"], 1) == 16.1 and fifo["verdict"] == "ahead"
    # captured-cpu-peers.md: vs HEAR cache-aware -9.7 % against a 1.4 % floor
    hear = rows["hear-cache-aware"]["raw"]
    assert round(hear["mean"], 1) == -9.7 and round(hear["aa_floor"], 1) == 1.4
    assert hear["verdict"] == "behind" and not hear["every_seed"]


def test_an_unknown_subject_is_a_clear_error(captured: dict) -> None:
    with pytest.raises(SystemExit, match="no runs of 'nope'"):
        versus.compare(captured, "nope", [1])
