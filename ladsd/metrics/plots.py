"""PNG figures of run records (matplotlib, Agg; no pyplot, no global state).

Each function draws one figure, writes it to ``path`` and returns the path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ladsd.delivery.registry import CANDIDATE, LABELS, label, ordered
from ladsd.metrics.events import RunRecord
from ladsd.metrics.summary import STAGES, latencies, stage_means

_STAGE_LABELS = {
    "sender_wait": "sender wait (s-r)",
    "queue_transfer": "queue+transfer (c-s)",
    "receipt_to_alloc": "receipt to allocation (n-c)",
    "resumed_inference": "resumed inference (f-n)",
}


# tab20's pairs: a strong and a light tone of ten hues; with four dash patterns every
# known policy gets its own (colour, dash) and no two share a colour.
_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
    "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5",
)
_DASHES = ("-", "--", "-.", ":")
_TOP = CANDIDATE  # drawn last, black and thicker: the policy every figure is about


def style(policy: str) -> dict[str, object]:
    """Line style of ``policy``: its own colour and dash; LADS black, thick, on top."""
    if policy == _TOP:
        return {"color": "black", "linestyle": "-", "linewidth": 2.2, "zorder": 10}
    others = [p for p in LABELS if p != _TOP]
    i = others.index(policy) if policy in others else len(others) + sum(map(ord, policy))
    return {
        "color": _PALETTE[i % len(_PALETTE)],
        "linestyle": _DASHES[i % len(_DASHES)],
        "linewidth": 1.4,
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
    fig = Figure(figsize=(9, 4.5), layout="constrained")
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
    # Beside the axes: fifteen entries inside would cover the curves.
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
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
