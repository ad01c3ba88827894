"""Metrics: percentiles, reductions, audit, JSON format, tables and plots on plain data."""

from __future__ import annotations

import dataclasses
import gzip

import orjson
import pytest

from ladsd.audit import LeaseIntegrityError
from ladsd.delivery import registry
from ladsd.metrics import comparison, events, grid, plots, summary
from ladsd.metrics.events import RecordFormatError, RunRecord
from tests.rigs.runs import cold, cont, run

# ---------------------------------------------------------------- percentiles


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([7.0], 7.0),  # n=1: rank 1
        (list(range(1, 21)), 19),  # n=20: ceil(19.0) = 19 exactly, no float drift
        (list(range(1, 22)), 20),  # n=21: ceil(19.95) = 20
        (list(range(1, 101)), 95),  # n=100: rank 95
        (list(range(1, 11)), 10),  # n=10: ceil(9.5) = 10
        ([5.0, 1.0, 3.0], 5.0),  # unsorted input, n=3: ceil(2.85) = 3
    ],
)
def test_p95_nearest_rank(values: list[float], expected: float) -> None:
    assert summary.p95(values) == expected


def test_nearest_rank_rejects_empty_and_bad_percent() -> None:
    with pytest.raises(ValueError, match="no values"):
        summary.p95([])
    with pytest.raises(ValueError, match="integer in 1..100"):
        summary.nearest_rank([1.0], 0)
    assert summary.nearest_rank([3.0, 1.0, 2.0], 50) == 2.0  # ceil(1.5) = 2


def test_run_summary_figures() -> None:
    r = run("fifo", 0, [10.0, 20.0, 30.0, 40.0], grants=3)
    s = summary.summarize(r)
    assert s.mean_s == 25.0
    assert s.p95_s == 40.0
    assert s.makespan_s == 3 + 40.0 - 0  # last termination (w3 at 3+40) - first arrival (0)
    assert s.stages == {
        "sender_wait": 1.0,
        "queue_transfer": 2.0,
        "receipt_to_alloc": 3.0,
        "resumed_inference": pytest.approx(sum(x - 7 for x in [10, 20, 30, 40]) / 4),
    }
    assert s.continuations == 4 and s.workflows == 4
    assert s.cached_prompt_tokens == 4 * 96
    assert s.counters["grants"] == 3
    assert summary.block_seconds(r.lease_samples) == 10 * 2 + 4 * 1


def test_stage_means_skip_missing_stamps_and_cold_calls() -> None:
    full = cont("w", 1, 0, 1, 2, 3, 4)
    half = dataclasses.replace(full, stamps=dataclasses.replace(full.stamps, n=None, f=None))
    m = summary.stage_means([cold("w", 0, 1), cont("w", 2, 0, 2, 3, 5, 9), half])
    assert m == {
        "sender_wait": 1.5,
        "queue_transfer": 1.0,
        "receipt_to_alloc": 2.0,
        "resumed_inference": 4.0,
    }
    assert summary.stage_means([cold("w", 0, 1)])["sender_wait"] is None


# ---------------------------------------------------------------- reductions


def test_reductions_per_seed_then_averaged() -> None:
    runs = {
        "lads": [run("lads", 1, [50.0]), run("lads", 0, [60.0])],
        "fifo": [run("fifo", 0, [100.0]), run("fifo", 1, [200.0])],
        "size-first": [run("size-first", 0, [60.0]), run("size-first", 1, [40.0])],
    }
    flat = [r for rs in runs.values() for r in rs]
    assert list(summary.group(flat)) == ["fifo", "size-first", "lads"]
    assert [r.seed for r in summary.group(flat)["lads"]] == [0, 1]
    red = summary.reductions(runs)
    assert list(red) == ["fifo", "size-first"]
    assert red["fifo"].per_seed == {0: 40.0, 1: 75.0}
    assert red["fifo"].mean == 57.5  # not the reduction of the pooled means (36.7)
    assert red["size-first"].per_seed == {0: 0.0, 1: -25.0}
    assert red["size-first"].mean == -12.5


def test_reductions_reject_mismatched_or_duplicate_seeds() -> None:
    runs = {"lads": [run("lads", 0, [1.0]), run("lads", 1, [1.0])], "fifo": [run("fifo", 0, [2.0])]}
    with pytest.raises(ValueError, match="seeds differ"):
        summary.reductions(runs)
    dup = {"lads": [run("lads", 0, [1.0]), run("lads", 0, [2.0])], "fifo": [run("fifo", 0, [2.0])]}
    with pytest.raises(ValueError, match="two runs with seed 0"):
        summary.reductions(dup)
    with pytest.raises(ValueError, match="no runs for baseline"):
        summary.reductions({"lads": [run("lads", 0, [1.0])]}, baselines=["fifo"])
    wrong = {"lads": [run("lads", 0, [1.0])], "fifo": [run("lads", 0, [2.0])]}
    with pytest.raises(ValueError, match="listed under 'fifo'"):
        summary.reductions(wrong)
    mixed = {"lads": [run("lads", 0, [1.0])], "fifo": [run("fifo", 0, [2.0], workload="web")]}
    with pytest.raises(ValueError, match="different workloads"):
        summary.reductions(mixed)


# ---------------------------------------------------------------- audit


def test_audit() -> None:
    summary.audit(run("lads", 0, [1.0], refs_added=120, refs_released=120))
    with pytest.raises(LeaseIntegrityError, match=r"added 120 != released 118 \(\+2 leaked\)"):
        summary.audit(run("lads", 0, [1.0], refs_added=120, refs_released=118))
    bare = dataclasses.replace(run("lads", 0, [1.0]), counters={"grants": 1})
    with pytest.raises(LeaseIntegrityError, match="lack refs_added, refs_released"):
        summary.audit(bare)


# ---------------------------------------------------------------- JSON


def test_json_round_trip_is_exact_and_stable(tmp_path) -> None:
    r = run("lads", 3, [12.5, 7.25, 1 / 3], refs_added=5, refs_released=5)
    data = events.to_json(r)
    assert orjson.loads(data)["format"] == 1
    back = events.from_json(data)
    assert back == r
    assert events.to_json(back) == data  # stable bytes
    p = events.save(r, tmp_path / "sub" / "run.json")
    assert events.load(p) == r
    gz = tmp_path / "run.json.gz"
    gz.write_bytes(gzip.compress(data))
    assert events.load(gz) == r
    gz.write_bytes(data)  # named .gz but not compressed
    with pytest.raises(RecordFormatError, match=r"run\.json\.gz: not a gzip file"):
        events.load(gz)


def _doc() -> dict:
    return orjson.loads(events.to_json(run("fifo", 0, [5.0, 6.0])))


def _bad(mutate) -> str:
    d = _doc()
    mutate(d)
    with pytest.raises(RecordFormatError) as e:
        events.from_json(orjson.dumps(d))
    return str(e.value)


def test_loader_rejects_malformed_files(tmp_path) -> None:
    with pytest.raises(RecordFormatError, match="not valid JSON"):
        events.from_json(b"{nope")
    with pytest.raises(RecordFormatError, match="expected an object"):
        events.from_json(b"[1, 2]")
    assert "unsupported format 2" in _bad(lambda d: d.update(format=2))
    assert "missing field(s) format" in _bad(lambda d: d.pop("format"))
    assert "missing field(s) seed" in _bad(lambda d: d.pop("seed"))
    assert "workflows[1].calls[0]: missing field(s) f" in _bad(
        lambda d: d["workflows"][1]["calls"][0].pop("f")
    )
    msg = _bad(lambda d: d["workflows"][0]["calls"][1].update(s="soon"))
    assert "workflows[0].calls[1].s: expected a finite number or null, got 'soon'" in msg
    msg = _bad(lambda d: d["workflows"][0]["calls"][1].update(prompt_tokens=-1))
    assert "prompt_tokens: expected a non-negative integer" in msg
    assert "cold call has no return-path stamps" in _bad(
        lambda d: d["workflows"][0]["calls"][0].update(r=1.0)
    )
    assert "termination 0.0 before arrival 1.0" in _bad(
        lambda d: d["workflows"][1].update(termination=0.0)
    )

    def dup(d: dict) -> None:
        d["workflows"][1]["workflow"] = "w0"
        for c in d["workflows"][1]["calls"]:
            c["workflow"] = "w0"

    assert "workflows[1].workflow: duplicate workflow id 'w0'" in _bad(dup)
    assert "inside workflow 'w0'" in _bad(
        lambda d: d["workflows"][0]["calls"][0].update(workflow="x")
    )
    assert "lease_samples[2].U" in _bad(lambda d: d["lease_samples"][2].update(U=1.5))
    assert "run.counters.grants" in _bad(lambda d: d["counters"].update(grants="3"))
    assert "run.seed: expected an integer, got True" in _bad(lambda d: d.update(seed=True))
    p = tmp_path / "broken.json"
    p.write_bytes(b"")
    with pytest.raises(RecordFormatError, match="broken.json: not valid JSON"):
        events.load(p)


def test_writer_refuses_what_it_could_not_read_back() -> None:
    bad = dataclasses.replace(run("fifo", 0, [1.0]), counters={"x": float("nan")})
    with pytest.raises(RecordFormatError, match="run.counters.x"):
        events.to_json(bad)
    odd = dataclasses.replace(run("fifo", 0, [1.0]), meta={"obj": object()})
    with pytest.raises(RecordFormatError, match="not JSON-serialisable"):
        events.to_json(odd)


# ---------------------------------------------------------------- tables and plots


def _paper_runs() -> dict[str, list[RunRecord]]:
    lat = {
        "fifo": ([100.0, 120.0], [200.0, 220.0]),
        "size-first": ([80.0, 100.0], [150.0, 150.0]),
        "tail-release": ([90.0, 90.0], [160.0, 180.0]),
        "cache-first": ([65.0, 50.0], [105.0, 100.0]),
        "cache-first-noleases": ([70.0, 70.0], [120.0, 140.0]),
        "turnover-off": ([60.0, 60.0], [110.0, 110.0]),
        "lads": ([55.0, 55.0], [100.0, 100.0]),
        "infinite-cache": ([50.0, 50.0], [80.0, 80.0]),
    }
    return {p: [run(p, s, list(x)) for s, x in enumerate(v)] for p, v in lat.items()}


def test_comparison_tables_contain_expected_numbers() -> None:
    comp = comparison.compare(_paper_runs())
    grids = comparison.comparison_grids(comp)
    md = grid.markdown(grids)
    # FIFO: seed means 110, 210 -> 160.00; P95 = the larger latency: (120 + 220) / 2 = 170.00.
    assert "| FIFO | 2 | 160.00 | 170.00 |" in md
    # LADS vs FIFO: seed 0: 100*(110-55)/110 = 50.0; seed 1: 100*(210-100)/210 = 52.4; mean 51.2
    # ... and LADS finished sooner in all 4 (seed, workflow) pairs.
    assert "| LADS vs FIFO | 50.0 | 52.4 | 51.2 | 4/4 |" in md
    # vs Size-first: 100*(90-55)/90 = 38.9; 100*(150-100)/150 = 33.3; mean 36.1
    assert "| LADS vs Size-first | 38.9 | 33.3 | 36.1 |" in md
    # Ablation per seed: Turnover-off 100*(60-55)/60 = 8.3, 100*(110-100)/110 = 9.1, mean 8.7
    assert "| LADS vs Turnover-off | 8.3 | 9.1 | 8.7 | 4/4 |" in md
    # Cache-first: seed means 57.5, 102.5 -> 4.3, 2.4, mean 3.4; LADS faster in 2 of 4 pairs
    # (55 < 65, 55 > 50, 100 < 105, 100 = 100 is not faster).
    assert "| LADS vs Cache-first | 4.3 | 2.4 | 3.4 | 2/4 |" in md
    # Gap to the infinite cache: 100*(50-55)/50 = -10.0, 100*(80-100)/80 = -25.0, mean -17.5
    assert "| LADS vs Infinite cache (reference) | -10.0 | -25.0 | -17.5 |" in md
    txt = grid.text(grids)
    assert "51.2" in txt and "Tail-aware" in txt and "\x1b[" not in txt
    assert [r.policy for r in comp.rows][:3] == ["fifo", "size-first", "tail-release"]


def test_comparison_without_lads_has_no_reductions() -> None:
    comp = comparison.compare({"fifo": [run("fifo", 0, [1.0])]})
    assert comp.baselines == {} and comp.ablation == {} and comp.reference is None
    assert len(comparison.comparison_grids(comp)) == 1


def test_run_table_renders_summary_numbers() -> None:
    r = run("lads", 4, [10.0, 20.0], grants=7, handoffs=6, protection_block_seconds=2.5)
    g = comparison.run_grid([summary.summarize(r)])
    md = grid.markdown([g])
    assert (
        "| lads | 4 | 2 | 15.00 | 20.00 | 21.00 | 1.000 | 2.000 | 3.000 | 8.000 | 192 | 7 | 6 |"
        in md
    )
    assert "2.50" in grid.text([g])
    assert grid.rich_table(g).row_count == 1


def test_plots_write_png_files(tmp_path) -> None:
    runs = _paper_runs()
    out = [
        plots.latency_cdf(runs, tmp_path / "cdf.png"),
        plots.stage_breakdown(runs, tmp_path / "stages.png"),
        plots.lease_timeline(runs["lads"][0], tmp_path / "lease.png"),
    ]
    for p in out:
        data = p.read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    empty = dataclasses.replace(runs["fifo"][0], lease_samples=())
    with pytest.raises(ValueError, match="no lease samples"):
        plots.lease_timeline(empty, tmp_path / "x.png")


def test_every_policy_has_its_own_colour_and_lads_is_drawn_on_top() -> None:
    names = list(registry.LABELS)
    styles = {p: plots.style(p) for p in names}
    colours = [s["color"] for s in styles.values()]
    assert len(set(colours)) == len(names)  # no two policies share a colour
    assert styles["lads"]["zorder"] > max(s["zorder"] for p, s in styles.items() if p != "lads")
    assert plots.style("some-new-policy")["color"]  # unknown names still get a style
    runs = _paper_runs()
    ax = plots.cdf_figure(runs).axes[0]
    drawn = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(drawn) == {registry.label(p) for p in runs}
    assert len({ln.get_color() for ln in drawn.values()}) == len(runs)
    top = max(drawn.values(), key=lambda ln: ln.get_zorder())
    assert top.get_label() == registry.label("lads")


def test_drivers_grid_averages_stages_and_counters_per_policy() -> None:
    runs = {
        "fifo": [run("fifo", 1, [10.0]), run("fifo", 2, [20.0])],
        "lads": [
            run("lads", 1, [10.0], grants=4, handoffs=3, revocations=1, headroom_refusals=7),
            run("lads", 2, [20.0], grants=6, handoffs=6, revocations=0, headroom_refusals=0),
        ],
    }
    runs["lads"][0].meta["kappa_s"] = 0.04
    runs["lads"][1].meta["kappa_s"] = 0.05
    g = comparison.drivers_grid(runs)
    md = grid.markdown([g])
    # The helper's continuation: s-r 1, c-s 2, n-c 3 s; 96 cached tokens per workflow;
    # f - n = (t + x) - (t + 7): seeds x=10 and x=20 -> 3 and 13, averaged 8.000.
    assert "| FIFO | 1.000 | 2.000 | 3.000 | 8.000 | 96 | 0 | 0 |" in md
    # LADS counters averaged: grants 5, handoffs 4.50, revoked 0.50; kappa (0.04 + 0.05) / 2.
    # ... then budget denials 0 and headroom refusals (7 + 0) / 2.
    assert "| LADS | 1.000 | 2.000 | 3.000 | 8.000 | 96 | 5 | 4.50 | 0 | 0.50 | 0 | 3.50 |" in md
    assert md.rstrip().endswith("| 0.045 |")
    assert "| FIFO |" in md and md.index("| FIFO |") < md.index("| LADS |")
