"""One policy against every other, per matched seed, raw and normalised, with verdicts.

Reads a results folder (run files or their ``runs.tar.xz`` pack) and prints, for
the subject (default: LADS adaptive) against each policy that ran:

- the reduction per seed and its mean, raw (mean workflow latency) and
  normalised (divided by the run's own link dilation: ``run_dilation``, its own
  kappa / kappa_ref, where a pass used one dilation for all its runs, else the
  run's ``dilation``); in a one-dilation pass the pass's dilation divides every
  run alike, so the raw reductions are also the calibrated-seconds ones;
- the pair's A/A floor in each view (``peer_compare.pair_floor``: per seed the
  larger |repeat 2 vs 1| of the two, averaged); a policy that ran once per seed
  has no pair of its own, so it carries the mean of the seed's A/A pairs in
  the pass (:func:`single_run_noise`: a single run is as noisy as a typical
  repeat; not the largest, which one bimodal policy sets: the paper's LADS
  differed by 18.5 % within a pair on captured-scaled at 80a20e4), not none
  (before 2026-12-05 the subject's own pair alone set its floor);
- a verdict per view: ``ahead`` (mean reduction above the floor), ``tie``
  (within it) or ``behind``; and whether the subject was faster on every seed.

Seeds listed in ``--held-out`` are marked ``*`` in the headers. It measures
nothing; ``--md`` and ``--json`` write what it prints.

    .venv/bin/python bench/versus.py bench/results/issue23-pass/captured --workload captured \
        --seeds 1,2,3,4,5 --held-out 4,5
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from ladsd.delivery.registry import label, ordered
from ladsd.metrics.events import RunRecord
from ladsd.metrics.peer_compare import pair_floor
from ladsd.metrics.summary import mean_latency, noise_floor, reductions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dilation import runs_by_policy  # noqa: E402

Metric = Callable[[RunRecord], float]


def per_run(run: RunRecord) -> float:
    """Mean latency divided by the run's own dilation (its kappa / kappa_ref)."""
    d = run.meta.get("run_dilation", run.meta["dilation"])
    return mean_latency(run) / float(d)


VIEWS: dict[str, Metric] = {"raw": mean_latency, "normalised": per_run}
TITLES = {
    "raw": "raw (in a one-dilation pass also normalised by the pass dilation)",
    "normalised": "normalised by each run's own kappa (the per-run check)",
}


def verdict(red: float, floor: float | None) -> str:
    """``ahead`` / ``tie`` / ``behind`` of a mean reduction against its A/A floor."""
    if floor is None:
        return "ahead" if red > 0 else "behind"  # no repeats: no floor to hold it against
    return "ahead" if red > floor else "tie" if red >= -floor else "behind"


def single_run_noise(
    noise: dict[str, dict[int, float]], policies: Sequence[str], seeds: Sequence[int]
) -> dict[str, dict[int, float]]:
    """``noise`` plus, for each policy without its own A/A pair on a seed, the mean of
    the seed's pairs in the pass (every policy that ran twice)."""
    out = {p: dict(v) for p, v in noise.items()}
    for s in seeds:
        pairs = [v[s] for v in noise.values() if s in v]
        if not pairs:
            continue
        for p in policies:
            out.setdefault(p, {}).setdefault(s, sum(pairs) / len(pairs))
    return out


def compare(
    runs: dict[str, dict[int, list[RunRecord]]], subject: str, seeds: Sequence[int]
) -> list[dict[str, Any]]:
    """The subject vs every other policy in ``runs``, in the tables' order, each pair on
    the seeds both ran (``summary.reductions`` and ``noise_floor`` do the arithmetic)."""
    if subject not in runs:
        raise SystemExit(f"no runs of {subject!r} (have: {', '.join(sorted(runs))})")
    rows = []
    everything = {q: [r for s in seeds for r in runs[q].get(s, [])] for q in runs}
    noise = {
        view: single_run_noise(noise_floor(everything, m), list(runs), seeds)
        for view, m in VIEWS.items()
    }
    for p in ordered(runs):
        shared = [s for s in seeds if s in runs[p] and s in runs[subject]]
        if p == subject or not shared:
            continue
        pair = {q: [r for s in shared for r in runs[q][s]] for q in (p, subject)}
        row: dict[str, Any] = {"policy": p, "label": label(p), "seeds": shared}
        for view, m in VIEWS.items():
            red = reductions(pair, subject, [p], m)[p]
            on_shared = {q: {s: d[s] for s in shared if s in d} for q, d in noise[view].items()}
            floor = pair_floor(on_shared, subject, p)
            row[view] = {
                "per_seed": red.per_seed,
                "mean": red.mean,
                "aa_floor": floor,
                "verdict": verdict(red.mean, floor),
                "every_seed": all(v > 0 for v in red.per_seed.values()),
            }
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], subject: str, seeds: Sequence[int], held: set[int]) -> str:
    heads = [f"s{s}{'*' if s in held else ''}" for s in seeds]
    out = []
    for view in VIEWS:
        out += [
            f"**{label(subject)} mean-latency reduction vs each policy, {TITLES[view]} "
            f"(%; positive: {label(subject)} faster; * held-out seed)**",
            "",
            f"| vs | {' | '.join(heads)} | mean | A/A floor | verdict | every seed |",
            "|---|" + "---:|" * (len(seeds) + 3) + "---|",
        ]
        for r in rows:
            v = r[view]
            cells = [f"{v['per_seed'][s]:.1f}" if s in v["per_seed"] else "" for s in seeds]
            floor = "n/a" if v["aa_floor"] is None else f"{v['aa_floor']:.1f}"
            every = "yes" if v["every_seed"] else "no"
            out.append(
                f"| {r['label']} | {' | '.join(cells)} | {v['mean']:.1f} | {floor} | "
                f"{v['verdict']} | {every} |"
            )
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--workload", required=True, help="file prefix, e.g. captured, controlled-c8")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--subject", default="lads-adaptive", help="the policy held against the rest")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    ap.add_argument("--held-out", default="", help="seeds the tuning never saw (marked *)")
    ap.add_argument("--md", type=Path, default=None, help="write the tables here")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    held = {int(s) for s in a.held_out.split(",") if s}
    runs = runs_by_policy(a.folder, f"{a.workload}-{a.profile}", max(seeds))
    rows = compare(runs, a.subject, seeds)
    text = markdown(rows, a.subject, seeds, held)
    print(text)
    if a.md:
        a.md.write_text(text)
    if a.json:
        doc = {
            "subject": a.subject,
            "workload": a.workload,
            "seeds": seeds,
            "held_out": sorted(held),
        }
        a.json.write_bytes(
            orjson.dumps(
                {**doc, "rows": rows}, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
            )
        )


if __name__ == "__main__":
    main()
