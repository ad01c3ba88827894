"""The paper-style comparison of policies on one workload, and its grids.

:func:`compare` computes the figures (latency per policy, LADS's reductions
vs the baselines, the ablation and the infinite-cache reference, the A/A noise
floor); :func:`comparison_grids`, :func:`drivers_grid` and :func:`run_grid`
turn figures into :class:`~ladsd.metrics.grid.Grid` s (rendered by
``ladsd.metrics.grid``). The peers' comparison is ``ladsd.metrics.peer_compare``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ladsd.delivery.registry import ABLATION, BASELINES, CANDIDATE, REFERENCE, label, ordered
from ladsd.metrics.events import RunRecord
from ladsd.metrics.grid import Grid, fmt, fmt_count
from ladsd.metrics.summary import (
    STAGES,
    Reduction,
    Summary,
    by_seed,
    makespan,
    mean,
    mean_latency,
    noise_floor,
    p95_latency,
    reductions,
    repeat_spread,
    seed_metric,
    summarize,
)


def latency_cells(r: Any) -> tuple[str, ...]:
    """The cells every latency row starts with: policy, seeds, mean, P95, makespan."""
    return (label(r.policy), str(len(r.seeds)), fmt(r.mean_s), fmt(r.p95_s), fmt(r.makespan_s))


def mean_present(xs: Sequence[float | None]) -> float | None:
    """Mean of the values that exist (None: none does)."""
    v = [x for x in xs if x is not None]
    return mean(v) if v else None


# ---------------------------------------------------------------- per run

_RUN_COUNTERS = {
    "grants": "grants",
    "handoffs": "handoffs",
    "expiries": "expiries",
    "revocations": "revoked",
    "promotions": "promoted",
    "preemptions": "preempted",
    "protection_block_seconds": "U·s",
    "controller_cpu_s": "ctrl CPU s",
}


def run_grid(summaries: Sequence[Summary], title: str = "Runs") -> Grid:
    """One row per run: latency figures, stage means, cached tokens, main counters."""
    headers = (
        "policy",
        "seed",
        "wf",
        "mean s",
        "P95 s",
        "makespan s",
        "s-r",
        "c-s",
        "n-c",
        "f-n",
        "cached tok",
        *_RUN_COUNTERS.values(),
    )
    rows = []
    for s in summaries:
        st = s.stages
        rows.append(
            (
                s.policy,
                str(s.seed),
                str(s.workflows),
                fmt(s.mean_s),
                fmt(s.p95_s),
                fmt(s.makespan_s),
                fmt(st["sender_wait"], 3),
                fmt(st["queue_transfer"], 3),
                fmt(st["receipt_to_alloc"], 3),
                fmt(st["resumed_inference"], 3),
                str(s.cached_prompt_tokens),
                *(fmt_count(s.counters.get(k)) for k in _RUN_COUNTERS),
            )
        )
    return Grid(title, headers, tuple(rows), keys=2)


_DRIVER_COUNTERS = {
    **{k: _RUN_COUNTERS[k] for k in ("grants", "handoffs", "expiries", "revocations")},
    "denials": "budget denials",
    "headroom_refusals": "headroom refusals",
    "promotions": _RUN_COUNTERS["promotions"],
    "fallbacks": "fallbacks",
    "controller_cpu_s": _RUN_COUNTERS["controller_cpu_s"],
}



def drivers_grid(runs: Mapping[str, Sequence[RunRecord]]) -> Grid:
    """Per policy, averaged over its runs: stage means, cached tokens, lease counters, kappa.

    The figures that explain a latency gap (spec section 6), one row per policy;
    kappa (the engine's measured 512-token step) shows how fast the machine was.
    """
    headers = (
        "policy",
        "s-r",
        "c-s",
        "n-c",
        "f-n",
        "cached tok",
        *_DRIVER_COUNTERS.values(),
        "kappa s",
    )
    rows = []
    for p in ordered(runs):
        sums = [summarize(r) for r in runs[p]]
        if not sums:
            continue
        avg = mean_present
        stages = [avg([s.stages[k] for s in sums]) for k in STAGES]
        kappas = [r.meta.get("kappa_s") for r in runs[p]]
        rows.append(
            (
                label(p),
                *(fmt(x, 3) for x in stages),
                fmt(avg([float(s.cached_prompt_tokens) for s in sums]), 0),
                *(fmt_count(avg([s.counters.get(k) for s in sums])) for k in _DRIVER_COUNTERS),
                fmt(avg([float(k) for k in kappas if isinstance(k, int | float)]), 3),
            )
        )
    title = "What drives it (per policy, averaged over seeds; stage means in s)"
    return Grid(title, headers, tuple(rows))


# ---------------------------------------------------------------- comparison


@dataclass(frozen=True)
class PolicyRow:
    policy: str
    seeds: tuple[int, ...]
    mean_s: float  # per-seed figures (mean of the seed's repeats) averaged over seeds
    p95_s: float
    makespan_s: float
    repeats: int = 1  # most runs of one seed
    spread_pct: float = 0.0  # (max - min) / mean of a seed's repeats, averaged over seeds


@dataclass(frozen=True)
class Comparison:
    workload: str
    rows: tuple[PolicyRow, ...]
    baselines: dict[str, Reduction]  # LADS vs FIFO, Size-first, Tail-aware (those run)
    ablation: dict[str, Reduction]  # LADS vs Cache-first, Cache-first-noleases, Turnover-off
    reference: Reduction | None  # LADS vs infinite cache (negative: gap to the ideal)
    noise: dict[str, dict[int, float]] = field(default_factory=dict)  # A/A: |r2 vs r1| %


def compare(runs: Mapping[str, Sequence[RunRecord]]) -> Comparison:
    """The paper-style comparison of whichever policies ``runs`` holds (policy -> runs)."""
    rows = []
    for p in ordered(runs):
        idx = by_seed(p, runs[p])
        if not idx:
            raise ValueError(f"policy {p!r} has no runs")
        reps = [idx[s] for s in sorted(idx)]
        rows.append(
            PolicyRow(
                p,
                tuple(sorted(idx)),
                mean(seed_metric(r, mean_latency) for r in reps),
                mean(seed_metric(r, p95_latency) for r in reps),
                mean(seed_metric(r, makespan) for r in reps),
                max(len(r) for r in reps),
                mean(repeat_spread(r, mean_latency) for r in reps),
            )
        )
    workloads = sorted({r.workload for rs in runs.values() for r in rs})
    if len(workloads) != 1:
        raise ValueError(f"a comparison needs runs of one workload, got {workloads}")
    have = CANDIDATE in runs

    def red(names: Sequence[str]) -> dict[str, Reduction]:
        present = [b for b in names if b in runs]
        return reductions(runs, CANDIDATE, present) if have and present else {}

    ref = red([REFERENCE]).get(REFERENCE)
    noise = noise_floor(runs)
    return Comparison(workloads[0], tuple(rows), red(BASELINES), red(ABLATION), ref, noise)


def _red_grid(title: str, reds: Mapping[str, Reduction]) -> Grid:
    """Per-seed and mean reductions, plus the workflow pairs the candidate won."""
    seeds = sorted({s for r in reds.values() for s in r.per_seed})
    rows = tuple(
        (
            f"{label(r.candidate)} vs {label(b)}",
            *(fmt(r.per_seed.get(s), 1) for s in seeds),
            fmt(r.mean, 1),
            f"{r.pairs_faster}/{r.pairs}",
        )
        for b, r in reds.items()
    )
    headers = ("reduction %", *(f"seed {s}" for s in seeds), "mean", "workflows faster")
    return Grid(title, headers, rows)


def _noise_grid(noise: Mapping[str, Mapping[int, float]]) -> Grid:
    """A/A pairs: two runs of one configuration; smaller differences are not results."""
    seeds = sorted({s for d in noise.values() for s in d})
    rows = tuple(
        (
            f"{label(p)} repeat 2 vs 1",
            *(fmt(d.get(s), 1) for s in seeds),
            fmt(sum(d.values()) / len(d), 1),
        )
        for p, d in noise.items()
    )
    headers = ("|difference| %", *(f"seed {s}" for s in seeds), "mean")
    return Grid("Noise floor: A/A pairs (same configuration, run twice)", headers, rows)


def comparison_grids(comp: Comparison) -> list[Grid]:
    """Latency per policy, LADS reductions vs baselines, ablation, infinite-cache gap."""
    reps = any(r.repeats > 1 for r in comp.rows)
    # Repeat columns only when there are repeats (older single-run tables stay as they were).
    extra = ("runs/seed", "repeat spread %") if reps else ()
    grids = [
        Grid(
            f"Complete-workflow latency ({comp.workload}; averaged over seeds)",
            ("policy", "seeds", "mean s", "P95 s", "makespan s", *extra),
            tuple(
                (
                    *latency_cells(r),
                    *((str(r.repeats), fmt(r.spread_pct, 1)) if reps else ()),
                )
                for r in comp.rows
            ),
        )
    ]
    if comp.noise:
        grids.append(_noise_grid(comp.noise))
    if comp.baselines:
        grids.append(_red_grid("LADS mean-latency reduction vs baselines", comp.baselines))
    if comp.ablation:
        grids.append(_red_grid("Ablation: LADS mean-latency reduction vs its parts", comp.ablation))
    if comp.reference is not None:
        grids.append(
            _red_grid(
                "LADS vs infinite-cache reference (negative: gap)", {REFERENCE: comp.reference}
            )
        )
    return grids
