"""LADS beside the neighbouring designs of peers.md on one workload, and its grids.

:func:`peer_comparison` computes the figures (latency, cached tokens and
preemptions per peer, LADS's reduction vs each with the pair's A/A floor, the
peers' own yardsticks); :func:`peer_grids` turns them into
:class:`~ladsd.metrics.grid.Grid` s and :func:`peer_dict` into JSON-ready data
(``-peers.md`` / ``-peers.json`` of ``ladsd compare --peers``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ladsd.delivery.registry import CANDIDATE, PEERS, label, ordered
from ladsd.metrics import yardsticks as yard
from ladsd.metrics.comparison import latency_cells, mean_present
from ladsd.metrics.events import RunRecord
from ladsd.metrics.grid import Grid, fmt, fmt_count
from ladsd.metrics.summary import (
    Reduction,
    by_seed,
    cached_prompt_tokens,
    makespan,
    mean,
    mean_latency,
    noise_floor,
    p95_latency,
    reductions,
    seed_metric,
)


@dataclass(frozen=True)
class PeerRow:
    """One policy's figures per run, each the mean of a seed's repeats averaged over seeds."""

    policy: str
    seeds: tuple[int, ...]
    mean_s: float
    p95_s: float
    makespan_s: float
    cached_tokens: float  # prompt tokens served from the prefix cache
    preemptions: float


@dataclass(frozen=True)
class PeerComparison:
    """LADS beside the neighbouring designs of peers.md, on one workload."""

    workload: str
    rows: tuple[PeerRow, ...]  # the peers that ran (PEERS order), then LADS
    reductions: dict[str, Reduction]  # LADS vs each peer (empty without LADS runs)
    floor: dict[str, float | None]  # peer -> A/A noise floor % of its pair (None: no repeats)
    # every policy compared -> the peers' own yardsticks (yardsticks.COLUMNS keys)
    yardsticks: dict[str, dict[str, float | None]] = field(default_factory=dict)


def _seed_avg(
    idx: Mapping[int, Sequence[RunRecord]], metric: Callable[[RunRecord], float]
) -> float:
    return mean(seed_metric(idx[s], metric) for s in sorted(idx))


def _peer_row(policy: str, runs: Sequence[RunRecord]) -> PeerRow:
    idx = by_seed(policy, runs)
    if not idx:
        raise ValueError(f"policy {policy!r} has no runs")
    return PeerRow(
        policy,
        tuple(sorted(idx)),
        _seed_avg(idx, mean_latency),
        _seed_avg(idx, p95_latency),
        _seed_avg(idx, makespan),
        _seed_avg(idx, lambda r: float(cached_prompt_tokens(r))),
        _seed_avg(idx, lambda r: float(r.counters.get("preemptions", 0))),
    )


def pair_floor(noise: Mapping[str, Mapping[int, float]], a: str, b: str) -> float | None:
    """The A/A noise floor of comparing ``a`` with ``b`` (percent; None: no repeats).

    Per seed, the larger |repeat 2 vs 1| of the two policies (of those that ran
    twice), averaged over seeds. A reduction smaller than it is not a result.
    """
    per = [
        max(v)
        for s in sorted({*noise.get(a, {}), *noise.get(b, {})})
        if (v := [d[s] for d in (noise.get(a, {}), noise.get(b, {})) if s in d])
    ]
    return mean(per) if per else None


def yardstick_figures(policy: str, runs: Sequence[RunRecord]) -> dict[str, float | None]:
    """One policy's yardsticks: each the mean of a seed's repeats, averaged over seeds.

    A yardstick a run does not define (None) is left out of its means.
    """
    seeds = []
    for reps in by_seed(policy, runs).values():
        ys = [yard.yardsticks(r) for r in reps]
        seeds.append({k: mean_present([y[k] for y in ys]) for k in yard.COLUMNS})
    return {k: mean_present([d[k] for d in seeds]) for k in yard.COLUMNS}


def peer_comparison(runs: Mapping[str, Sequence[RunRecord]]) -> PeerComparison | None:
    """LADS vs each peer in ``runs`` (policy -> runs); None when no peer ran.

    The yardsticks cover every policy in ``runs``, peers or not.
    """
    peers = [p for p in PEERS if p in runs]
    if not peers:
        return None
    names = [*peers, *([CANDIDATE] if CANDIDATE in runs else [])]
    workloads = sorted({r.workload for p in names for r in runs[p]})
    if len(workloads) != 1:
        raise ValueError(f"a comparison needs runs of one workload, got {workloads}")
    rows = tuple(_peer_row(p, runs[p]) for p in names)
    reds = reductions(runs, CANDIDATE, peers) if CANDIDATE in runs else {}
    noise = noise_floor({p: runs[p] for p in names})
    floor = {p: pair_floor(noise, CANDIDATE, p) for p in reds}
    ys = {p: yardstick_figures(p, runs[p]) for p in ordered(runs)}
    return PeerComparison(workloads[0], rows, reds, floor, ys)


def peer_grids(peer: PeerComparison) -> list[Grid]:
    """The peers and LADS side by side, then LADS's reduction vs each with its A/A floor."""
    grids = [
        Grid(
            f"Neighbouring designs on the same engine ({peer.workload}; averaged over seeds)",
            ("policy", "seeds", "mean s", "P95 s", "makespan s", "cached tok", "preempted"),
            tuple(
                (
                    *latency_cells(r),
                    fmt(r.cached_tokens, 0),
                    fmt_count(r.preemptions),
                )
                for r in peer.rows
            ),
        )
    ]
    if peer.reductions:
        seeds = sorted({s for r in peer.reductions.values() for s in r.per_seed})
        rows = tuple(
            (
                label(b),
                fmt(r.mean, 1),
                fmt(peer.floor.get(b), 1),
                *(fmt(r.per_seed.get(s), 1) for s in seeds),
                f"{r.pairs_faster}/{r.pairs}",
            )
            for b, r in peer.reductions.items()
        )
        # The mean and its floor first: a narrow terminal's first part holds both.
        headers = ("LADS vs", "mean %", "A/A floor %", *(f"seed {s}" for s in seeds))
        title = "LADS mean-latency reduction vs peers (A/A floor: repeat noise of the pair)"
        grids.append(Grid(title, (*headers, "workflows faster"), rows))
    if peer.yardsticks:
        grids.append(yardstick_grid(peer))
    return grids


def _digits(key: str) -> int:
    """Seconds with 2 decimals; fractions and rates (small numbers) with 3."""
    return 2 if key.endswith("_s") and not key.endswith("_per_s") else 3


def yardstick_grid(peer: PeerComparison) -> Grid:
    """Each peer's own yardstick (ladsd.metrics.yardsticks) for every policy compared."""
    title = (
        f"The peers' own yardsticks ({peer.workload}; averaged over seeds; "
        f"TTFT to first scheduled token, SLO {yard.TTFT_SLO_S:g} s)"
    )
    rows = tuple(
        (label(p), *(fmt(y[k], _digits(k)) for k in yard.COLUMNS))
        for p, y in peer.yardsticks.items()
    )
    return Grid(title, ("policy", *yard.COLUMNS.values()), rows)


def peer_dict(peer: PeerComparison) -> dict:
    """The peer comparison as plain JSON-ready data (seeds as string keys)."""
    return {
        "workload": peer.workload,
        "rows": [
            {
                "policy": r.policy,
                "seeds": list(r.seeds),
                "mean_s": r.mean_s,
                "p95_s": r.p95_s,
                "makespan_s": r.makespan_s,
                "cached_tokens": r.cached_tokens,
                "preemptions": r.preemptions,
            }
            for r in peer.rows
        ],
        "reductions": {
            b: {
                "candidate": r.candidate,
                "per_seed": {str(s): v for s, v in r.per_seed.items()},
                "mean": r.mean,
                "aa_floor": peer.floor.get(b),
                "workflows_faster": r.pairs_faster,
                "workflows": r.pairs,
            }
            for b, r in peer.reductions.items()
        },
        "yardsticks": peer.yardsticks,
        "ttft_slo_s": yard.TTFT_SLO_S,
    }
