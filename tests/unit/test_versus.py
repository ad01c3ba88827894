"""bench/versus.py: the subject against every policy, checked against the tables
`ladsd compare` committed for the same runs (bench/results/issue23-amd)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from ladsd.metrics.summary import noise_floor
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
    # captured-cpu-peers.md: vs HEAR cache-aware -9.7 % (its floor there, 1.4 %, was
    # LADS's own pair alone: HEAR ran once per seed)
    hear = rows["hear-cache-aware"]["raw"]
    assert round(hear["mean"], 1) == -9.7
    assert hear["verdict"] == "behind" and not hear["every_seed"]
    # Here a single run carries the mean of the seed's A/A pairs in the pass.
    pairs = noise_floor({q: [r for s in (1, 2, 3) for r in captured[q][s]] for q in captured})
    lads = pairs["lads"]
    typical = [statistics.mean(v[s] for v in pairs.values() if s in v) for s in (1, 2, 3)]
    floor = statistics.mean(max(lads[s], t) for s, t in zip((1, 2, 3), typical, strict=True))
    assert hear["aa_floor"] == pytest.approx(floor)
    assert hear["aa_floor"] != pytest.approx(1.4)


def test_a_single_run_carries_the_seeds_mean_pair() -> None:
    noise = {"lads": {1: 0.5, 2: 1.0}, "fifo": {1: 2.0, 2: 0.2}}
    got = versus.single_run_noise(noise, ["lads", "fifo", "hear"], [1, 2, 3])
    assert got["hear"] == {1: 1.25, 2: 0.6}  # seed 3: no pair at all, nothing made up
    assert got["lads"] == noise["lads"] and got["fifo"] == noise["fifo"]


def test_an_unknown_subject_is_a_clear_error(captured: dict) -> None:
    with pytest.raises(SystemExit, match="no runs of 'nope'"):
        versus.compare(captured, "nope", [1])
