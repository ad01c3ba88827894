"""Contested sends: how often a run sent a younger workflow's frame while an older one's waited.

A send is *contested* when another call's result was ready and not yet
committed at its commit time ``s`` (``r_j <= s_i < s_j``). It is
*younger-first* when one of those waiting results belongs to a workflow that
arrived earlier. Where workflows are alike (the captured paths: 16 workflows
of 7 calls, frames within a few percent) the mean latency is mostly the order of
completions, and a strict oldest-first order (Tail-aware) sends almost no frame
younger-first; the count says how far a delivery order is from it. Also
printed per run: the mean workflow latency, the contested sends whose waiting
frames span two turns or more (where progress can differ), and the
``progress`` counter (moves of ``lads-adaptive``'s rule 2). Reads a results
folder (run files or their ``runs.tar.xz``); measures nothing.

    .venv/bin/python bench/contested.py bench/results/issue23-pass-a2f8380/captured \
        --workload captured
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from ladsd.metrics.events import RunRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rerender import print_runs  # noqa: E402


@dataclass(frozen=True)
class Send:
    arrival: float  # the workflow's arrival
    turn: int
    r: float
    s: float


@dataclass(frozen=True)
class Contest:
    contested: int  # sends with another result waiting
    younger_first: int  # ... of which an older workflow's result was among the waiting
    mixed_turns: int  # ... of which the sent and waiting results span two turns or more


def sends(run: RunRecord) -> list[Send]:
    """Every committed send of the run (cold calls have none)."""
    return [
        Send(w.arrival, c.turn, c.stamps.r, c.stamps.s)
        for w in run.workflows
        for c in w.calls
        if c.stamps.r is not None and c.stamps.s is not None
    ]


def contest(run: RunRecord) -> Contest:
    """Count the run's contested, younger-first and mixed-turn sends."""
    all_sends = sends(run)
    contested = younger = mixed = 0
    for x in all_sends:
        waiting = [j for j in all_sends if j is not x and j.r <= x.s < j.s]
        if not waiting:
            continue
        contested += 1
        younger += any(j.arrival < x.arrival for j in waiting)
        mixed += any(j.turn != x.turn for j in waiting)
    return Contest(contested, younger, mixed)


def line(run: RunRecord, name: str) -> str:
    c = contest(run)
    lat = statistics.mean(w.termination - w.arrival for w in run.workflows)
    moves = run.counters.get("progress", "-")
    return (
        f"{name:44s} mean {lat:6.2f} s  contested {c.contested:4d}  "
        f"younger-first {c.younger_first:4d}  mixed turns {c.mixed_turns:4d}  progress {moves}"
    )


def main() -> None:
    print_runs(__doc__ or "", line, "captured")


if __name__ == "__main__":
    main()
