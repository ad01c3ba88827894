"""Per-run figures and cross-policy reductions (spec section 6), as pure functions.

Definitions used everywhere in ladsd:

* workflow latency = termination - arrival (every model call and tool wait);
* P95 is the *nearest-rank* percentile: the ceil(0.95 n)-th smallest of the
  n workflow latencies (an observed value, never interpolated);
* makespan = last termination - first arrival;
* stage means are taken over continuations (non-cold calls) that have both
  stamps of the stage: s-r, c-s, n-c, f-n;
* a reduction is ``100 (T_base - T_cand) / T_base`` per matched seed, then
  averaged over seeds (positive = the candidate is faster).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ladsd.audit import LeaseIntegrityError, check_refs
from ladsd.clock import STAGES
from ladsd.delivery.registry import ordered
from ladsd.metrics.events import CallRecord, LeaseSample, RunRecord


def latencies(run: RunRecord) -> dict[str, float]:
    """Complete-workflow latency per workflow id."""
    return {w.workflow: w.termination - w.arrival for w in run.workflows}


def mean(values: Iterable[float]) -> float:
    v = list(values)
    if not v:
        raise ValueError("mean of no values")
    return math.fsum(v) / len(v)


def nearest_rank(values: Iterable[float], q: int) -> float:
    """The ceil(q n / 100)-th smallest value (1-based), for an integer percent 0 < q <= 100.

    Integer arithmetic, so e.g. q=95, n=20 is exactly rank 19 (no float rounding).
    """
    if not (isinstance(q, int) and 0 < q <= 100):
        raise ValueError(f"percent must be an integer in 1..100, got {q!r}")
    v = sorted(values)
    if not v:
        raise ValueError("percentile of no values")
    rank = -(-q * len(v) // 100)  # ceil(q n / 100) >= 1
    return v[rank - 1]


def p95(values: Iterable[float]) -> float:
    return nearest_rank(values, 95)


def mean_latency(run: RunRecord) -> float:
    return mean(latencies(run).values())


def p95_latency(run: RunRecord) -> float:
    return p95(latencies(run).values())


def makespan(run: RunRecord) -> float:
    if not run.workflows:
        raise ValueError("makespan of a run without workflows")
    return max(w.termination for w in run.workflows) - min(w.arrival for w in run.workflows)


def continuations(run: RunRecord) -> list[CallRecord]:
    return [c for w in run.workflows for c in w.calls if not c.is_cold]


def stage_means(calls: Iterable[CallRecord]) -> dict[str, float | None]:
    """Mean of each stage over the non-cold calls that have both of its stamps (None: none)."""
    out: dict[str, float | None] = {}
    stages = [c.stamps.stages() for c in calls if not c.is_cold]
    for name in STAGES:
        d = [x for st in stages if (x := st[name]) is not None]
        out[name] = math.fsum(d) / len(d) if d else None
    return out


def cached_prompt_tokens(run: RunRecord) -> int:
    """Prompt tokens the engine served from its prefix cache, summed over all calls."""
    return sum(c.cached_tokens for w in run.workflows for c in w.calls)


def block_seconds(samples: Sequence[LeaseSample]) -> float:
    """Time integral of U over the timeline; U holds its value until the next sample."""
    s = sorted(samples, key=lambda x: x.t)
    return math.fsum(a.U * (b.t - a.t) for a, b in zip(s, s[1:], strict=False))


def audit(run: RunRecord) -> None:
    """Raise :class:`LeaseIntegrityError` unless added lease references equal released ones."""
    where = f"run {run.policy}/{run.workload}/seed {run.seed}"
    missing = [k for k in ("refs_added", "refs_released") if k not in run.counters]
    if missing:
        raise LeaseIntegrityError(
            f"{where}: counters lack {', '.join(missing)}; cannot audit leases"
        )
    added, released = run.counters["refs_added"], run.counters["refs_released"]
    check_refs(added, released, what=f"{where}: lease references")


@dataclass(frozen=True)
class Summary:
    """The figures of one run."""

    policy: str
    workload: str
    profile: str
    seed: int
    workflows: int
    continuations: int
    mean_s: float
    p95_s: float
    makespan_s: float
    stages: dict[str, float | None]
    cached_prompt_tokens: int
    counters: dict[str, float]


def summarize(run: RunRecord) -> Summary:
    lat = list(latencies(run).values())
    return Summary(
        policy=run.policy,
        workload=run.workload,
        profile=run.profile,
        seed=run.seed,
        workflows=len(lat),
        continuations=len(continuations(run)),
        mean_s=mean(lat),
        p95_s=p95(lat),
        makespan_s=makespan(run),
        stages=stage_means(c for w in run.workflows for c in w.calls),
        cached_prompt_tokens=cached_prompt_tokens(run),
        counters=dict(run.counters),
    )


# ---------------------------------------------------------------- reductions


def reduction(t_base: float, t_cand: float) -> float:
    """``100 (T_base - T_cand) / T_base``: percent by which the candidate is faster."""
    if not (t_base > 0 and math.isfinite(t_base)):
        raise ValueError(f"baseline value must be positive and finite, got {t_base!r}")
    return 100.0 * (t_base - t_cand) / t_base


@dataclass(frozen=True)
class Reduction:
    candidate: str
    baseline: str
    per_seed: dict[int, float]  # seed -> percent
    mean: float  # average of per_seed
    pairs_faster: int = 0  # matched (seed, workflow) pairs where the candidate finished sooner
    pairs: int = 0  # matched (seed, workflow) pairs compared


def repeat_of(run: RunRecord) -> int:
    """Which repeat of its (policy, seed) a run is (``meta.repeat``; 1 for older files)."""
    return int(run.meta.get("repeat", 1))


def by_seed(policy: str, runs: Sequence[RunRecord]) -> dict[int, list[RunRecord]]:
    """Index one policy's runs by seed (repeats in repeat order).

    A duplicate (seed, repeat) or a foreign run is an error.
    """
    out: dict[int, list[RunRecord]] = {}
    for r in runs:
        if r.policy != policy:
            raise ValueError(f"run of policy {r.policy!r} listed under {policy!r}")
        reps = out.setdefault(r.seed, [])
        if any(repeat_of(x) == repeat_of(r) for x in reps):
            raise ValueError(
                f"policy {policy!r} has two runs with seed {r.seed} (repeat {repeat_of(r)})"
            )
        reps.append(r)
    return {s: sorted(rs, key=repeat_of) for s, rs in out.items()}


def seed_metric(reps: Sequence[RunRecord], metric: Callable[[RunRecord], float]) -> float:
    """A seed's figure: the mean over its repeats (the value itself without repeats)."""
    return mean(metric(r) for r in reps)


def repeat_spread(reps: Sequence[RunRecord], metric: Callable[[RunRecord], float]) -> float:
    """(max - min) / mean of a seed's repeats, in percent (0 with one run)."""
    v = [metric(r) for r in reps]
    return 100.0 * (max(v) - min(v)) / mean(v)


def group(runs: Iterable[RunRecord]) -> dict[str, list[RunRecord]]:
    """policy -> its runs (sorted by seed), the shape :func:`reductions` and tables take."""
    out: dict[str, list[RunRecord]] = {}
    for r in runs:
        out.setdefault(r.policy, []).append(r)
    return {p: sorted(out[p], key=lambda r: r.seed) for p in ordered(out)}


def reductions(
    runs: Mapping[str, Sequence[RunRecord]],
    candidate: str = "lads",
    baselines: Sequence[str] | None = None,
    metric: Callable[[RunRecord], float] = mean_latency,
) -> dict[str, Reduction]:
    """Reductions of ``candidate`` vs each baseline, per matched seed and averaged.

    ``baselines=None`` compares against every other policy in ``runs``. The
    candidate and each baseline must have exactly the same seeds, and all runs
    the same workload; anything else raises ``ValueError``.
    """
    if candidate not in runs:
        raise ValueError(f"no runs for candidate policy {candidate!r}")
    names = [p for p in ordered(runs) if p != candidate] if baselines is None else baselines
    cand = by_seed(candidate, runs[candidate])
    if not cand:
        raise ValueError(f"candidate {candidate!r} has no runs")
    workloads = {r.workload for rs in cand.values() for r in rs}
    out: dict[str, Reduction] = {}
    for b in names:
        if b not in runs:
            raise ValueError(f"no runs for baseline policy {b!r}")
        base = by_seed(b, runs[b])
        if set(base) != set(cand):
            raise ValueError(
                f"seeds differ: {candidate} has {sorted(cand)}, {b} has {sorted(base)}; "
                "reductions need matched seeds"
            )
        workloads |= {r.workload for rs in base.values() for r in rs}
        if len(workloads) > 1:
            raise ValueError(f"runs of different workloads compared: {sorted(workloads)}")
        per = {
            s: reduction(seed_metric(base[s], metric), seed_metric(cand[s], metric))
            for s in sorted(cand)
        }
        faster, total = workflow_pairs(base, cand)
        out[b] = Reduction(candidate, b, per, mean(per.values()), faster, total)
    return out


def workflow_pairs(
    base: Mapping[int, Sequence[RunRecord]], cand: Mapping[int, Sequence[RunRecord]]
) -> tuple[int, int]:
    """(pairs where the candidate's workflow latency is lower, pairs compared).

    A pair is one workflow id of one seed present in both policies' runs, its
    latency averaged over the seed's repeats; the spec's captured-path claim
    "all 48 pairs better" is this count.
    """
    faster = total = 0
    for s in sorted(set(base) & set(cand)):
        lb, lc = _mean_latencies(base[s]), _mean_latencies(cand[s])
        for w in lb.keys() & lc.keys():
            total += 1
            faster += lc[w] < lb[w]
    return faster, total


def _mean_latencies(reps: Sequence[RunRecord]) -> dict[str, float]:
    per = [latencies(r) for r in reps]
    return {w: mean(x[w] for x in per if w in x) for w in per[0]}


def noise_floor(
    runs: Mapping[str, Sequence[RunRecord]], metric: Callable[[RunRecord], float] = mean_latency
) -> dict[str, dict[int, float]]:
    """A/A pairs: policy -> seed -> |reduction| of repeat 2 vs repeat 1 (same configuration).

    Only policies with at least two repeats of a seed appear. A difference between
    policies smaller than these is not a result.
    """
    out: dict[str, dict[int, float]] = {}
    for p in ordered(runs):
        for seed, reps in by_seed(p, runs[p]).items():
            if len(reps) >= 2:
                d = abs(reduction(metric(reps[0]), metric(reps[1])))
                out.setdefault(p, {})[seed] = d
    return out
