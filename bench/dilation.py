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
import json
import statistics
from pathlib import Path

CORE = ("fifo", "cache-first", "lads", "infinite-cache")
VERSUS = (
    "fifo", "size-first", "tail-release", "cache-first", "cache-first-noleases", "turnover-off",
    "infinite-cache", "augserve", "hear-cache-aware", "hear-guard", "hear-session", "ttl-pin",
    "augserve+lads",
)


def _mean_latency(run: dict) -> float:
    return statistics.mean(w["termination"] - w["arrival"] for w in run["workflows"])


def _load(folder: Path, workload: str, policy: str, seed: int, repeat: int) -> dict | None:
    tail = "" if repeat == 1 else f"-r{repeat}"
    path = folder / f"{workload}-cpu-{policy}-s{seed}{tail}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _views(folder: Path, workload: str, policy: str, seed: int) -> tuple[float, float] | None:
    """(raw, normalised) mean latency over the repeats found for ``policy`` on ``seed``."""
    runs = [r for k in (1, 2, 3) if (r := _load(folder, workload, policy, seed, k))]
    if not runs:
        return None
    raw = statistics.mean(_mean_latency(r) for r in runs)
    norm = statistics.mean(_mean_latency(r) / r["meta"]["dilation"] for r in runs)
    return raw, norm


def _pct(base: float, cand: float) -> float:
    return 100.0 * (base - cand) / base


def _row(name: str, raw: list[float], norm: list[float]) -> None:
    if not raw:
        return
    cells = " ".join(f"{x:.1f}/{y:.1f}" for x, y in zip(raw, norm, strict=True))
    means = f"{statistics.mean(raw):.1f}/{statistics.mean(norm):.1f}"
    print(f"  {name:20s} {cells}   mean {means}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--workload", required=True, help="file prefix, e.g. controlled-c8")
    ap.add_argument("--seeds", type=int, default=5)
    a = ap.parse_args()
    seeds = range(1, a.seeds + 1)
    print(f"{a.workload}: |repeat 2 - repeat 1| % (raw / normalised by dilation)")
    for p in CORE:
        raw, norm = [], []
        for s in seeds:
            r1, r2 = _load(a.folder, a.workload, p, s, 1), _load(a.folder, a.workload, p, s, 2)
            if r1 is None or r2 is None:
                continue
            l1, l2 = _mean_latency(r1), _mean_latency(r2)
            d1, d2 = r1["meta"]["dilation"], r2["meta"]["dilation"]
            raw.append(abs(_pct(l1, l2)))
            norm.append(abs(_pct(l1 / d1, l2 / d2)))
        _row(p, raw, norm)
    print("LADS reduction vs ... % per seed (raw / normalised)")
    for p in VERSUS:
        raw, norm = [], []
        for s in seeds:
            lads, base = _views(a.folder, a.workload, "lads", s), _views(a.folder, a.workload, p, s)
            if lads is None or base is None:
                continue
            raw.append(_pct(base[0], lads[0]))
            norm.append(_pct(base[1], lads[1]))
        _row(p, raw, norm)


if __name__ == "__main__":
    main()
