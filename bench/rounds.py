"""A cohort run's rounds: when each round ended, and what its last model call had to recompute.

On a cohort workload a round's results become ready together and the next
round's tool results wait for its last member, so a round costs every workflow
of the cohort the time from "ready" to its *last* model call's end. That end is
the link's drain (the same for every order of equal work) plus the resumed call
of the frame sent last: a delivery order that sends a half-evicted history last
pays its recompute at the end of every round. This prints, per run file, the mean
workflow latency, the mean delivery wait ``s - r``, each round's end (s after
the round was ready), the uncached prompt tokens of the call that ended it, and
the ``progress`` counter (moves of ``lads-adaptive``'s rule 2). It measures
nothing; it reads a results folder (run files or their ``runs.tar.xz``).

    .venv/bin/python bench/rounds.py bench/results/issue23-smith/c16 --workload controlled-c16
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from ladsd.metrics.events import CallRecord, RunRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rerender import print_runs  # noqa: E402


def rounds(run: RunRecord) -> list[tuple[float, int]]:
    """Per round (turn >= 1): (end after ready, uncached tokens of the call that ended it)."""
    by_turn: dict[int, list[CallRecord]] = {}
    for w in run.workflows:
        for c in w.calls:
            if c.stamps.r is not None and c.stamps.f is not None:
                by_turn.setdefault(c.turn, []).append(c)
    out = []
    for _, calls in sorted(by_turn.items()):
        ready = min(c.stamps.r for c in calls if c.stamps.r is not None)
        last = max(calls, key=lambda c: c.stamps.f or 0.0)
        out.append(((last.stamps.f or 0.0) - ready, last.prompt_tokens - last.cached_tokens))
    return out


def line(run: RunRecord, name: str) -> str:
    waits = [
        c.stamps.s - c.stamps.r
        for w in run.workflows
        for c in w.calls
        if c.stamps.s is not None and c.stamps.r is not None
    ]
    lat = statistics.mean(w.termination - w.arrival for w in run.workflows)
    rs = rounds(run)
    ends = " ".join(f"{e:4.1f}" for e, _ in rs)
    unc = " ".join(str(u) for _, u in rs)
    moves = run.counters.get("progress", "-")
    return (
        f"{name:44s} mean {lat:6.2f} s  s-r {statistics.mean(waits):.3f} s  "
        f"round ends {ends}  last call uncached {unc}  progress {moves}"
    )


def main() -> None:
    print_runs(__doc__ or "", line, "controlled-c16")


if __name__ == "__main__":
    main()
