"""Read committed run files and ask: how much of the spread is the link dilation?

Each run sets its link rate from kappa measured at engine start (dilation =
kappa / kappa_ref), so a run that measured a slow machine also gets a slower
link. If the measurement is right, the whole run is stretched by ``dilation``
and ``mean latency / dilation`` (calibrated seconds) is the machine-independent
figure. This script prints, per workload, both views side by side: the A/A
pairs (repeat 2 vs 1) and LADS's reductions per seed, raw and normalised. It
measures nothing new and never changes the committed tables; it shows whether
normalising would shrink the noise floor (it does for some pairs and not for
others, see the README).

    .venv/bin/python bench/dilation.py bench/results/cpu-quarter --workload web-burst
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from ladsd.delivery.registry import CANDIDATE, CORE, LABELS
from ladsd.metrics.events import RunRecord, load
from ladsd.metrics.summary import by_seed, mean_latency, reduction, seed_metric

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rerender import run_files  # noqa: E402

VERSUS = tuple(p for p in LABELS if p != CANDIDATE)  # every policy, in the tables' order
Metric = Callable[[RunRecord], float]


def normalised(run: RunRecord) -> float:
    """Mean latency in calibrated seconds: divided by the run's link dilation."""
    return mean_latency(run) / float(run.meta["dilation"])


VIEWS: tuple[Metric, ...] = (mean_latency, normalised)


def runs_by_policy(folder: Path, tag: str, seeds: int) -> dict[str, dict[int, list[RunRecord]]]:
    """``{policy: {seed: repeats}}`` of the run files named ``TAG-POLICY-sSEED[-rN].json``."""
    runs: dict[str, list[RunRecord]] = {}
    for path in run_files(folder, f"{tag}-"):
        r = load(path)
        if r.seed <= seeds:
            runs.setdefault(r.policy, []).append(r)
    return {p: by_seed(p, rs) for p, rs in runs.items()}


def _row(name: str, pairs: list[tuple[float, ...]]) -> None:
    if not pairs:
        return
    cells = " ".join(f"{x:.1f}/{y:.1f}" for x, y in pairs)
    means = "/".join(f"{statistics.mean(v):.1f}" for v in zip(*pairs, strict=True))
    print(f"  {name:20s} {cells}   mean {means}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--workload", required=True, help="file prefix, e.g. controlled-c8")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--seeds", type=int, default=5, help="seeds 1..N")
    a = ap.parse_args()
    runs = runs_by_policy(a.folder, f"{a.workload}-{a.profile}", a.seeds)
    print(f"{a.workload}: |repeat 2 - repeat 1| % (raw / normalised by dilation)")
    for p in CORE:
        pairs = [r for _, r in sorted(runs.get(p, {}).items()) if len(r) >= 2]
        _row(p, [tuple(abs(reduction(m(r[0]), m(r[1]))) for m in VIEWS) for r in pairs])
    print("LADS reduction vs ... % per seed (raw / normalised)")
    lads = runs.get(CANDIDATE, {})
    for p in VERSUS:
        base = runs.get(p, {})
        rows = []
        for s in sorted(base.keys() & lads.keys()):
            pair = (reduction(seed_metric(base[s], m), seed_metric(lads[s], m)) for m in VIEWS)
            rows.append(tuple(pair))
        _row(p, rows)


if __name__ == "__main__":
    main()
