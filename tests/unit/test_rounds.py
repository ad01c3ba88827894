"""bench/rounds.py: a cohort round ends with the frame sent last, read back from committed runs.

Model-free: the committed cohort-16 pack of the d05db4d pass is read, nothing is run.
"""

from __future__ import annotations

from pathlib import Path

from ladsd.clock import Stamps
from ladsd.metrics.events import CallRecord, RunRecord, WorkflowRecord, load
from tests.helpers import bench_script

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "bench/results/issue23-pass-aaca061/controlled-c16"


def call(wf: str, turn: int, r: float, f: float, prompt: int, cached: int) -> CallRecord:
    st = Stamps(r=r, s=r + 0.1, c=r + 0.2, a=r + 0.2, n=r + 0.3, f=f)
    return CallRecord(wf, turn, 0, False, st, prompt, cached, 8, 100, 128)


def test_a_round_ends_with_its_last_call_and_counts_its_recompute() -> None:
    rd = bench_script("rounds")
    wa = WorkflowRecord(
        "a", 0.0, 9.0, (call("a", 1, 1.0, 3.0, 500, 480), call("a", 2, 5.0, 6.0, 600, 0))
    )
    wb = WorkflowRecord(
        "b", 0.0, 9.0, (call("b", 1, 1.0, 4.5, 400, 100), call("b", 2, 5.0, 9.0, 700, 650))
    )
    run = RunRecord("lads", "controlled-c16", "cpu", 1, (wa, wb))
    # Round 1 ends at 4.5 (b, 300 tokens to recompute), round 2 at 9.0 (b, 50).
    assert rd.rounds(run) == [(3.5, 300), (4.0, 50)]


def test_the_pass_cohort16_rounds_ended_with_a_near_evicted_history() -> None:
    rd = bench_script("rounds")
    runs = bench_script("rerender").run_dir(FOLDER)
    ada = load(runs / "controlled-c16-cpu-lads-adaptive-s1.json")
    cf = load(runs / "controlled-c16-cpu-cache-first-s1.json")
    # The figures bench/results/issue23-smith/README.md gives: under the d05db4d rule 2
    # (|P_i| first) every round ended with a 4.6-6.8K-token recompute; under
    # Cache-first with 0.2-6.3K, and earlier.
    assert [u for _, u in rd.rounds(ada)] == [4614, 6070, 6337, 6486, 6764]
    assert [u for _, u in rd.rounds(cf)] == [236, 3533, 6297, 2952, 3082]
    assert all(a > c for (a, _), (c, _) in zip(rd.rounds(ada), rd.rounds(cf), strict=True))
    assert "progress 62" in rd.line(ada, "ada")
