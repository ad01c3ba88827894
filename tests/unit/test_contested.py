"""bench/contested.py: younger-first sends, synthetic and from the committed captured pass.

Model-free: nothing is run.
"""

from __future__ import annotations

from pathlib import Path

from ladsd.clock import Stamps
from ladsd.metrics.events import CallRecord, RunRecord, WorkflowRecord, load
from tests.helpers import bench_script

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "bench/results/issue23-pass-a2f8380/captured"


def call(wf: str, turn: int, r: float, s: float) -> CallRecord:
    st = Stamps(r=r, s=s, c=s + 0.1, a=s + 0.1, n=s + 0.2, f=s + 0.3)
    return CallRecord(wf, turn, 0, False, st, 500, 400, 8, 100, 128)


def test_a_younger_send_past_an_older_waiting_frame_is_counted() -> None:
    ct = bench_script("contested")
    old = WorkflowRecord("old", 0.0, 9.0, (call("old", 1, 1.0, 2.0), call("old", 2, 5.0, 5.5)))
    young = WorkflowRecord(
        "young", 0.5, 9.0, (call("young", 1, 1.0, 1.5), call("young", 3, 5.2, 6.0))
    )
    run = RunRecord("x", "captured", "cpu", 1, (old, young))
    # young/1 at 1.5 passes old/1 (ready 1.0, sent 2.0): contested, younger-first.
    # old/1 at 2.0: nothing waits. old/2 at 5.5 passes young/3 (ready 5.2): contested,
    # older first, mixed turns. young/3 at 6.0: nothing waits.
    assert ct.contest(run) == ct.Contest(contested=2, younger_first=1, mixed_turns=1)


def test_the_pass_tail_aware_sends_oldest_first_and_smith_does_not() -> None:
    ct = bench_script("contested")
    runs = bench_script("rerender").run_dir(FOLDER)
    tail = [ct.contest(load(runs / f"captured-cpu-tail-release-s{s}.json")) for s in (8, 9)]
    ada = [ct.contest(load(runs / f"captured-cpu-lads-adaptive-s{s}.json")) for s in (8, 9)]
    # The figures of the a2f8380 pass README: Tail-aware 1 of 145, Smith's rule 76 of 149.
    assert sum(c.younger_first for c in tail) == 1
    assert sum(c.contested for c in tail) == 145
    assert sum(c.younger_first for c in ada) == 76
    assert sum(c.contested for c in ada) == 149
