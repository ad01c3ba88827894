"""PNG figures of run records (matplotlib, Agg; no pyplot, no global state).

Each function draws one figure, writes it to ``path`` and returns the path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ladsd.delivery.registry import CANDIDATE, label, ordered
from ladsd.metrics.events import RunRecord
from ladsd.metrics.summary import STAGES, latencies, stage_means

_STAGE_LABELS = {
    "sender_wait": "sender wait (s-r)",
    "queue_transfer": "queue+transfer (c-s)",
    "receipt_to_alloc": "receipt to allocation (n-c)",
    "resumed_inference": "resumed inference (f-n)",
}


# One fixed style per registered run name: fifteen hue families (no light tint of
# another's colour: tab20's pairs drew FIFO and HEAR guard both blue), a dash mostly
# by group (baselines solid, ablations dashed, peers dash-dot, the reference dotted)
# and a marker each; two hues that are near (teal and cyan, olive and gold, lime and
# green) differ in dash and marker too (tests/unit/test_plot_styles.py). Every colour is
# dark enough to read on white; LADS is black, thicker, unmarked and drawn last.
_SOLID, _DASHED, _DASHDOT, _DOTTED = "-", (0, (5, 2)), (0, (6, 2, 1.5, 2)), (0, (1.5, 1.5))
_DASHDOTDOT = (0, (6, 2, 1.5, 2, 1.5, 2))
STYLES: dict[str, tuple[str, object, str]] = {
    "fifo": ("#1f5fd6", _SOLID, "o"),  # blue
    "size-first": ("#e8710a", _SOLID, "s"),  # orange
    "tail-release": ("#1e9c3c", _SOLID, "^"),  # green
    "cache-first": ("#d3212d", _DASHED, "v"),  # red
    "cache-first-noleases": ("#8a2be2", _DASHED, "D"),  # violet
    "turnover-off": ("#8b5a2b", _DASHED, "P"),  # brown
    "lads-denial": ("#e0249a", _DASHED, "X"),  # magenta
    "lads-adaptive": ("#4b0082", _SOLID, "H"),  # indigo (issue 23; ours, like LADS: solid)
    "infinite-cache": ("#6e6e6e", _DOTTED, "*"),  # grey
    "augserve": ("#808000", _DASHDOT, "<"),  # olive
    "hear-cache-aware": ("#0fa3b8", _DASHDOT, ">"),  # cyan
    "hear-guard": ("#b8860b", _DOTTED, "h"),  # gold
    "hear-session": ("#7a0019", _DASHDOT, "p"),  # maroon
    "ttl-pin": ("#2f8f83", _DASHDOTDOT, "d"),  # teal
    "augserve+lads": ("#6fae1f", _DASHDOTDOT, "8"),  # lime
}
LEGEND_PT = 9.0
_TOP = CANDIDATE  # drawn last, black and thicker: the policy every figure is about
_OTHER_DASHES = (_SOLID, _DASHED, _DASHDOT, _DOTTED)


def style(policy: str) -> dict[str, object]:
    """Line style of ``policy`` from :data:`STYLES`; LADS black, thick, on top.

    A name outside the table (a new policy not yet given a style) gets grey in a
    dash picked from its name, so a figure still draws.
    """
    if policy == _TOP:
        return {"color": "black", "linestyle": _SOLID, "linewidth": 2.4, "zorder": 10}
    dash = _OTHER_DASHES[sum(map(ord, policy)) % len(_OTHER_DASHES)]
    color, dash, marker = STYLES.get(policy, ("#9e9e9e", dash, ""))
    return {
        "color": color,
        "linestyle": dash,
        "linewidth": 1.5,
        "marker": marker,
        "markersize": 4.5,
        "markevery": 0.12,  # a few per curve: they name it, not its points
        "zorder": 2,
    }


def _save(fig: Figure, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(p, format="png", dpi=110)
    return p


def latency_cdf(runs: Mapping[str, Sequence[RunRecord]], path: str | Path) -> Path:
    """Empirical CDF of complete-workflow latency per policy, pooled over its runs."""
    return _save(cdf_figure(runs), path)


def cdf_figure(runs: Mapping[str, Sequence[RunRecord]]) -> Figure:
    """The figure :func:`latency_cdf` writes (one line per policy, in table order)."""
    fig = Figure(figsize=(10, 5.2), layout="constrained")
    ax = fig.add_subplot()
    for p in ordered(runs):
        lat = sorted(x for r in runs[p] for x in latencies(r).values())
        if not lat:
            raise ValueError(f"policy {p!r} has no workflows to plot")
        n = len(lat)
        # Start at 0 so the curve rises from the axis at the fastest workflow.
        ys = [0.0] + [(i + 1) / n for i in range(n)]
        ax.step([lat[0], *lat], ys, where="post", label=label(p), **style(p))
    ax.set_xlabel("complete-workflow latency (s)")
    ax.set_ylabel("fraction of workflows")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    # Beside the axes (fifteen entries inside would cover the curves), 9 pt, with
    # handles long enough to show each dash pattern.
    ax.legend(
        fontsize=LEGEND_PT, handlelength=3.6, loc="upper left", bbox_to_anchor=(1.01, 1.0),
        frameon=False,
    )
    return fig


def stage_breakdown(runs: Mapping[str, Sequence[RunRecord]], path: str | Path) -> Path:
    """Stacked bars of the four stage means per policy, over all its continuations."""
    names = ordered(runs)
    means = {
        p: stage_means(c for r in runs[p] for w in r.workflows for c in w.calls) for p in names
    }
    fig = Figure(figsize=(max(5.0, 1.1 * len(names) + 3), 4.5), layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(names))
    bottom = [0.0] * len(names)
    for stage in STAGES:
        h = [means[p][stage] or 0.0 for p in names]
        ax.bar(xs, h, bottom=bottom, label=_STAGE_LABELS[stage])
        bottom = [b + x for b, x in zip(bottom, h, strict=True)]
    ax.set_xticks(list(xs), [label(p) for p in names], rotation=20, ha="right")
    ax.set_ylabel("mean per continuation (s)")
    ax.legend(fontsize="small")
    return _save(fig, path)


def lease_timeline(run: RunRecord, path: str | Path) -> Path:
    """Protected U, target B and free F blocks over time (seconds since the first sample)."""
    s = sorted(run.lease_samples, key=lambda x: x.t)
    if not s:
        raise ValueError(f"run {run.policy}/seed {run.seed} has no lease samples to plot")
    t0 = s[0].t
    ts = [x.t - t0 for x in s]
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for name, style in (("U", "-"), ("B", "--"), ("F", ":")):
        ax.step(ts, [getattr(x, name) for x in s], style, where="post", label=name)
    ax.set_title(f"{label(run.policy)}, {run.workload}, seed {run.seed}")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("blocks")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)
