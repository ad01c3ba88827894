"""The CDF's fixed style table: every registered policy its own colour, dash and marker.

No engine: run records are built by hand, figures drawn with matplotlib's Agg canvas.
"""

from __future__ import annotations

import itertools

from matplotlib.colors import to_rgb

from ladsd.clock import Stamps
from ladsd.delivery import registry
from ladsd.metrics import plots
from ladsd.metrics.events import CallRecord, RunRecord, WorkflowRecord

NAMES = [e.name for e in registry.REGISTRY]


def lab(colour: str) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of a matplotlib colour."""
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in to_rgb(colour)]
    r, g, b = lin
    xyz = (
        (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047,
        0.2126 * r + 0.7152 * g + 0.0722 * b,
        (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883,
    )
    fx, fy, fz = (t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def delta_e(a: str, b: str) -> float:
    return sum((x - y) ** 2 for x, y in zip(lab(a), lab(b), strict=True)) ** 0.5


def test_every_registered_policy_has_its_entry_in_the_style_table() -> None:
    assert set(plots.STYLES) == set(NAMES) - {registry.CANDIDATE}
    assert len(NAMES) == 16


def test_every_registered_policy_has_a_distinct_colour_and_linestyle_pair() -> None:
    styles = {p: plots.style(p) for p in NAMES}
    pairs = {(s["color"], str(s["linestyle"])) for s in styles.values()}
    assert len(pairs) == len(NAMES)
    assert len({s["color"] for s in styles.values()}) == len(NAMES)  # colours alone too
    markers = [s.get("marker") for p, s in styles.items() if p != registry.CANDIDATE]
    assert len(set(markers)) == len(markers) and all(markers)


def test_colours_are_dark_enough_for_white_and_none_is_a_tint_of_another() -> None:
    styles = {p: plots.style(p) for p in NAMES}
    for p, s in styles.items():
        assert lab(s["color"])[0] <= 70, f"{p}: {s['color']} is too light to read on white"
    for (p, a), (q, b) in itertools.combinations(styles.items(), 2):
        d = delta_e(a["color"], b["color"])
        assert d >= 20, f"{p} and {q} look alike ({a['color']}, {b['color']}: dE {d:.0f})"
        if d < 35:  # the nearest hues: also told apart by their dash and marker
            assert str(a["linestyle"]) != str(b["linestyle"]), (p, q)
            assert a.get("marker") != b.get("marker"), (p, q)


def test_an_unknown_policy_still_gets_a_style() -> None:
    s = plots.style("some-new-policy")
    assert s["color"] and s["linestyle"] and s["zorder"] < plots.style("lads")["zorder"]


def _runs() -> dict[str, list[RunRecord]]:
    def run(policy: str, k: int) -> RunRecord:
        flows = []
        for i in range(6):
            t = 1.0 + k + i * 0.5
            st = Stamps(n=0.0, f=t)
            call = CallRecord(f"w{i}", 0, 0, True, st, 16, 0, 8, 0, 0)
            flows.append(WorkflowRecord(f"w{i}", 0.0, t, (call,)))
        return RunRecord(policy, "controlled", "smoke", 1, tuple(flows))

    return {p: [run(p, k)] for k, p in enumerate(NAMES)}


def test_the_cdf_draws_every_policy_in_its_style_lads_on_top_legend_beside() -> None:
    fig = plots.cdf_figure(_runs())
    ax = fig.axes[0]
    drawn = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(drawn) == {registry.label(p) for p in NAMES}
    for p in NAMES:
        ln, want = drawn[registry.label(p)], plots.style(p)
        assert to_rgb(ln.get_color()) == to_rgb(str(want["color"]))
    top = max(drawn.values(), key=lambda ln: ln.get_zorder())
    assert top.get_label() == "LADS" and top.get_linewidth() > 2
    leg = ax.get_legend()
    assert len(leg.get_texts()) == len(NAMES)
    assert all(t.get_fontsize() >= 9 for t in leg.get_texts())  # readable at 110 dpi
    # The legend sits right of the axes, inside the figure: nothing covers a curve.
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    lb, ab, fb = leg.get_window_extent(r), ax.get_window_extent(r), fig.bbox
    assert lb.x0 >= ab.x1 and lb.x1 <= fb.x1 + 1 and lb.y0 >= fb.y0 - 1
