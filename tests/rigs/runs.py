"""Run records on plain data (no engine): a cold call, a continuation, a whole run."""

from __future__ import annotations

from ladsd.clock import Stamps
from ladsd.metrics import events
from ladsd.metrics.events import CallRecord, LeaseSample, RunRecord, WorkflowRecord


def cold(wf: str, a: float, f: float) -> CallRecord:
    return CallRecord(wf, 0, 0, True, Stamps(a=a, n=a + 0.1, f=f), 100, 0, 8, 0, 0)


def cont(wf: str, turn: int, r: float, s: float, c: float, n: float, f: float) -> CallRecord:
    return CallRecord(wf, turn, 0, False, Stamps(r, s, c, c, n, f), 300, 96, 8, 500, 1528)


def run(
    policy: str, seed: int, lat: list[float], workload: str = "controlled", **counters: float
) -> RunRecord:
    """A run whose i-th workflow arrives at i and takes ``lat[i]`` seconds."""
    wfs = []
    for i, x in enumerate(lat):
        wf, t = f"w{i}", float(i)
        calls = (cold(wf, t, t + 1), cont(wf, 1, t + 1, t + 2, t + 4, t + 7, t + x))
        wfs.append(WorkflowRecord(wf, t, t + x, calls))
    c = events.new_counters() | counters
    samples = (LeaseSample(0.0, 0, 0, 0, 50), LeaseSample(1.0, 10, 12, 12, 40))
    samples += (LeaseSample(3.0, 4, 12, 12, 44), LeaseSample(4.0, 0, 0, 4, 50))
    meta = {"machine": "test", "versions": {"vllm": "0.32.0"}, "profile": {"name": "smoke"}}
    return RunRecord(policy, workload, "smoke", seed, tuple(wfs), samples, c, meta)
