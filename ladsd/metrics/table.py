"""Tables of run figures: rich for the terminal, markdown / plain text for files.

Every table is first built as a :class:`Grid` of already formatted strings,
then rendered; the terminal and the committed markdown therefore show the
same numbers.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from ladsd.delivery.registry import (
    ABLATION,
    BASELINES,
    CANDIDATE,
    PEERS,
    REFERENCE,
    label,
    ordered,
)
from ladsd.metrics import yardsticks as yard
from ladsd.metrics.events import RunRecord
from ladsd.metrics.summary import (
    STAGES,
    Reduction,
    Summary,
    by_seed,
    cached_prompt_tokens,
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


@dataclass(frozen=True)
class Grid:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    keys: int = 1  # leading columns that name a row; repeated in every part of a split table


def _latency(r: Any) -> tuple[str, ...]:
    """The cells every latency row starts with: policy, seeds, mean, P95, makespan."""
    return (label(r.policy), str(len(r.seeds)), _f(r.mean_s), _f(r.p95_s), _f(r.makespan_s))


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _n(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


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
                _f(s.mean_s),
                _f(s.p95_s),
                _f(s.makespan_s),
                _f(st["sender_wait"], 3),
                _f(st["queue_transfer"], 3),
                _f(st["receipt_to_alloc"], 3),
                _f(st["resumed_inference"], 3),
                str(s.cached_prompt_tokens),
                *(_n(s.counters.get(k)) for k in _RUN_COUNTERS),
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


def _mean_present(xs: Sequence[float | None]) -> float | None:
    """Mean of the values that exist (None: none does)."""
    v = [x for x in xs if x is not None]
    return mean(v) if v else None


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
        avg = _mean_present
        stages = [avg([s.stages[k] for s in sums]) for k in STAGES]
        kappas = [r.meta.get("kappa_s") for r in runs[p]]
        rows.append(
            (
                label(p),
                *(_f(x, 3) for x in stages),
                _f(avg([float(s.cached_prompt_tokens) for s in sums]), 0),
                *(_n(avg([s.counters.get(k) for s in sums])) for k in _DRIVER_COUNTERS),
                _f(avg([float(k) for k in kappas if isinstance(k, int | float)]), 3),
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
            *(_f(r.per_seed.get(s), 1) for s in seeds),
            _f(r.mean, 1),
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
            *(_f(d.get(s), 1) for s in seeds),
            _f(sum(d.values()) / len(d), 1),
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
                    *_latency(r),
                    *((str(r.repeats), _f(r.spread_pct, 1)) if reps else ()),
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


# ---------------------------------------------------------------- peers


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
        seeds.append({k: _mean_present([y[k] for y in ys]) for k in yard.COLUMNS})
    return {k: _mean_present([d[k] for d in seeds]) for k in yard.COLUMNS}


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
                    *_latency(r),
                    _f(r.cached_tokens, 0),
                    _n(r.preemptions),
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
                _f(r.mean, 1),
                _f(peer.floor.get(b), 1),
                *(_f(r.per_seed.get(s), 1) for s in seeds),
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
        (label(p), *(_f(y[k], _digits(k)) for k in yard.COLUMNS))
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


# ---------------------------------------------------------------- rendering


def rich_table(grid: Grid) -> Table:
    t = Table(title=grid.title)
    for i, h in enumerate(grid.headers):
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for row in grid.rows:
        t.add_row(*row)
    return t


def table_width(grid: Grid) -> int:
    """Columns :func:`rich_table` needs to show every cell in full (its natural width)."""
    widths = [
        max([cell_len(grid.headers[i]), *(cell_len(r[i]) for r in grid.rows)])
        for i in range(len(grid.headers))
    ]
    return sum(w + 3 for w in widths) + 1  # one space each side and a rule per column, one edge


def fit(grid: Grid, width: int) -> list[Grid]:
    """``grid`` laid out for a ``width``-column terminal, every cell in full where possible.

    In order of preference: the grid as it is; transposed (one column per row,
    named by its key cells, one line per figure); split by columns, each part
    repeating the key columns (policy, seed) and taking as many of the
    following columns, in order, as fit, so the first part holds the mean
    latency; one transposed table per row. The content is the same in every
    layout; markdown and JSON outputs never depend on the width.
    """
    if not grid.rows or table_width(grid) <= width:
        return [grid]
    flipped = transposed(grid)
    if table_width(flipped) <= width:
        return [flipped]
    parts = _split(grid, width)
    if all(table_width(p) <= width for p in parts):
        return parts
    return [transposed(_select(grid, grid.title, rows=[i])) for i in range(len(grid.rows))]


def transposed(grid: Grid) -> Grid:
    """Rows become columns, named by their key cells (``lads seed 1``)."""
    k = min(grid.keys, len(grid.headers))

    def name(row: Sequence[str]) -> str:
        return " ".join([row[0], *(f"{grid.headers[i]} {row[i]}" for i in range(1, k))])

    return Grid(
        grid.title,
        (grid.headers[0], *(name(r) for r in grid.rows)),
        tuple((grid.headers[i], *(r[i] for r in grid.rows)) for i in range(k, len(grid.headers))),
    )


def _split(grid: Grid, width: int) -> list[Grid]:
    keys = list(range(min(grid.keys, len(grid.headers))))
    parts: list[list[int]] = []
    cur = list(keys)
    for i in range(len(keys), len(grid.headers)):
        if len(cur) > len(keys) and table_width(_select(grid, "", cols=[*cur, i])) > width:
            parts.append(cur)
            cur = list(keys)
        cur.append(i)
    parts.append(cur)
    n = len(parts)
    return [
        _select(grid, grid.title if n == 1 else f"{grid.title} ({j + 1}/{n})", cols=cols)
        for j, cols in enumerate(parts)
    ]


def _select(
    grid: Grid, title: str, cols: Sequence[int] | None = None, rows: Sequence[int] | None = None
) -> Grid:
    c = range(len(grid.headers)) if cols is None else cols
    r = range(len(grid.rows)) if rows is None else rows
    return Grid(
        title,
        tuple(grid.headers[i] for i in c),
        tuple(tuple(grid.rows[j][i] for i in c) for j in r),
        keys=grid.keys,
    )


def rich_tables(grid: Grid, width: int) -> list[Table]:
    """The terminal tables of ``grid`` for a ``width``-column terminal (see :func:`fit`)."""
    return [rich_table(g) for g in fit(grid, width)]


def text(grids: Sequence[Grid], width: int = 400) -> str:
    """Plain text (no colour codes); tables keep their natural width up to ``width``."""
    buf = io.StringIO()
    con = Console(file=buf, width=width, color_system=None, force_terminal=False)
    for g in grids:
        con.print(rich_table(g))
    return buf.getvalue()


def markdown(grids: Sequence[Grid]) -> str:
    """GitHub markdown: a bold title line and a pipe table per grid."""
    out = []
    for g in grids:
        align = ["---", *["---:"] * (len(g.headers) - 1)]
        lines = [f"**{g.title}**", "", _md_row(g.headers), _md_row(align)]
        lines += [_md_row(r) for r in g.rows]
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
