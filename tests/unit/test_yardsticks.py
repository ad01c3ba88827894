"""The peers' yardsticks (TTFT, batch completion, reuse, goodput) on hand-built run records."""

from __future__ import annotations

import pytest

from ladsd.clock import Stamps
from ladsd.metrics import events
from ladsd.metrics.events import CallRecord, RunRecord, WorkflowRecord
from ladsd.metrics.yardsticks import COLUMNS, goodput, prefix_reuse, ttft, ttfts, yardsticks


def cold(wf: str, a: float, n: float | None, f: float | None, prompt: int = 100) -> CallRecord:
    return CallRecord(wf, 0, 0, True, Stamps(a=a, n=n, f=f), prompt, 0, 8, 0, 0)


def cont(
    wf: str, turn: int, r: float, n: float | None, f: float | None, prompt: int, cached: int
) -> CallRecord:
    # s, c and a between r and n: only r and n define TTFT.
    st = Stamps(r=r, s=r + 0.1, c=r + 0.2, a=r + 0.2, n=n, f=f)
    return CallRecord(wf, turn, 0, False, st, prompt, cached, 8, 500, 1528)


def run_of(*workflows: WorkflowRecord) -> RunRecord:
    return RunRecord("fifo", "controlled", "smoke", 1, workflows, (), events.new_counters(), {})


def two_workflows() -> RunRecord:
    # w0: cold TTFT 0.5, continuation TTFT 2.0 (n - r; not n - c)
    w0 = WorkflowRecord(
        "w0", 0.0, 10.0, (cold("w0", 0.0, 0.5, 1.0), cont("w0", 1, 4.0, 6.0, 10.0, 300, 200))
    )
    # w1: cold TTFT 1.0, continuation TTFT 7.0 (misses a 5 s SLO)
    w1 = WorkflowRecord(
        "w1", 2.0, 20.0, (cold("w1", 2.0, 3.0, 4.0), cont("w1", 1, 10.0, 17.0, 20.0, 300, 100))
    )
    return run_of(w0, w1)


def test_ttft_is_first_scheduled_token_after_ready_or_arrival() -> None:
    run = two_workflows()
    assert [ttft(c) for w in run.workflows for c in w.calls] == [0.5, 2.0, 1.0, 7.0]
    assert ttft(cont("w", 1, 4.0, None, None, 300, 0)) is None  # never scheduled: no TTFT
    assert ttft(cold("w", 1.0, None, None)) is None


def test_yardsticks_of_a_hand_built_run() -> None:
    y = yardsticks(two_workflows(), ttft_slo_s=5.0)
    assert set(y) == set(COLUMNS)
    assert y["ttft_p50_s"] == 1.0  # nearest rank: 2nd of [0.5, 1.0, 2.0, 7.0]
    assert y["ttft_max_s"] == 7.0
    assert y["batch_completion_s"] == 20.0  # last termination 20 - first arrival 0
    assert y["prefix_reuse"] == pytest.approx(300 / 800)  # (200 + 100) / (100 + 300 + 100 + 300)
    assert y["slo_attainment"] == 0.75
    assert y["goodput_calls_per_s"] == pytest.approx(3 / 20)
    assert y["goodput_wf_per_s"] == pytest.approx(1 / 20)  # w1 has a call out of the SLO


def test_slo_threshold_is_inclusive_and_moves_goodput() -> None:
    run = two_workflows()
    assert goodput(run, ttft_slo_s=7.0) == (2 / 20, 4 / 20)  # exactly at the SLO meets it
    assert goodput(run, ttft_slo_s=6.99) == (1 / 20, 3 / 20)
    assert goodput(run, ttft_slo_s=0.4) == (0.0, 0.0)
    with pytest.raises(ValueError, match="ttft_slo_s"):
        yardsticks(run, ttft_slo_s=0.0)


def test_a_call_without_a_first_token_misses_the_slo_and_has_no_ttft() -> None:
    w = WorkflowRecord(
        "w0", 0.0, 5.0, (cold("w0", 0.0, 0.2, 1.0), cont("w0", 1, 2.0, None, None, 300, 0))
    )
    run = run_of(w)
    assert ttfts(run) == [pytest.approx(0.2)]
    y = yardsticks(run)
    assert y["slo_attainment"] == 0.5 and y["goodput_wf_per_s"] == 0.0
    assert y["goodput_calls_per_s"] == pytest.approx(1 / 5)


def test_empty_figures_are_none_and_a_zero_makespan_is_refused() -> None:
    nothing = run_of(WorkflowRecord("w0", 0.0, 3.0, (cold("w0", 0.0, None, None, prompt=0),)))
    y = yardsticks(nothing)
    assert y["ttft_p50_s"] is None and y["ttft_max_s"] is None
    assert prefix_reuse(nothing) is None
    instant = run_of(WorkflowRecord("w0", 1.0, 1.0, (cold("w0", 1.0, 1.0, 1.0),)))
    with pytest.raises(ValueError, match="makespan"):
        yardsticks(instant)


def test_read_back_from_a_run_file_gives_the_same_yardsticks(tmp_path) -> None:
    run = two_workflows()
    path = events.save(run, tmp_path / "run.json")
    assert yardsticks(events.load(path)) == yardsticks(run)
