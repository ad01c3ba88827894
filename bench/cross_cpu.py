"""The same seeds on two CPUs: does a dilated pass give the same verdicts on either?

For each policy of ``--workload`` (seeds ``--seeds``) in two results folders made on two
CPUs: its mean workflow latency raw and in calibrated seconds (raw / the pass dilation),
its reduction vs FIFO per CPU, and the difference of the two reductions (points). The A/A
spread (|repeat 2 - repeat 1| of FIFO, Cache-first, LADS, ...) of each CPU is the noise
floor the difference is held against. Reads run files (a folder's own or its
``runs.tar.xz``); runs nothing, asserts nothing.

    .venv/bin/python bench/cross_cpu.py bench/results/cpu-f32 bench/results/cpu-f32-amd \\
        --workload captured --seeds 1 [--md F] [--json F]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

from ladsd.delivery.registry import label, ordered
from ladsd.metrics.events import RunRecord
from ladsd.metrics.summary import mean_latency, reduction

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_head  # noqa: E402
from dilation import normalised as calibrated  # noqa: E402
from rerender import Subset, runs_of  # noqa: E402

Runs = dict[str, list[RunRecord]]


def side(runs: Runs) -> dict[str, Any]:
    """One CPU's figures: per policy raw and calibrated means, vs FIFO, and its A/A."""
    any_run = next(r for rs in runs.values() for r in rs)
    m = any_run.meta
    out: dict[str, Any] = {
        "cpu_model": m.get("cpu_model"),
        "cpu_flags": m.get("cpu_flags"),
        "dtype": m.get("dtype"),
        "dilation": m.get("dilation"),
        "commit": m.get("git"),  # the commit the runs were made at
        "policies": {},
    }
    fifo = runs.get("fifo")
    for p in ordered(runs):
        rs = runs[p]
        raw = statistics.mean(mean_latency(r) for r in rs)
        cal = statistics.mean(calibrated(r) for r in rs)
        row: dict[str, Any] = {"runs": len(rs), "raw_s": raw, "calibrated_s": cal}
        if fifo and p != "fifo":
            row["vs_fifo_pct"] = reduction(statistics.mean(mean_latency(r) for r in fifo), raw)
        if len(rs) >= 2:
            row["aa_pct"] = abs(reduction(mean_latency(rs[0]), mean_latency(rs[1])))
        out["policies"][p] = row
    aa = [r["aa_pct"] for r in out["policies"].values() if "aa_pct" in r]
    out["aa_max_pct"] = max(aa) if aa else None
    return out


def table(a: dict[str, Any], b: dict[str, Any]) -> str:
    def cpu(s: dict[str, Any]) -> str:
        flags = ", ".join(s["cpu_flags"] or ())
        return f"{s['cpu_model']} ({flags}), {s['dtype']}, d {s['dilation']:.3f}"

    lines = [
        f"- A: {cpu(a)}, commit {str(a['commit'])[:7]}",
        f"- B: {cpu(b)}, commit {str(b['commit'])[:7]}",
        f"- A/A noise floor (largest |repeat 2 - repeat 1|): A {a['aa_max_pct']:.1f} %, "
        f"B {b['aa_max_pct']:.1f} %",
        "",
        "| policy | A raw s | A calibrated s | A vs FIFO % | B raw s | B calibrated s "
        "| B vs FIFO % | B - A (points) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in ordered(set(a["policies"]) & set(b["policies"])):
        x, y = a["policies"][p], b["policies"][p]
        vs = [r.get("vs_fifo_pct") for r in (x, y)]
        d = f"{vs[1] - vs[0]:+.1f}" if None not in vs else ""
        cells = [
            label(p),
            f"{x['raw_s']:.2f}",
            f"{x['calibrated_s']:.2f}",
            "" if vs[0] is None else f"{vs[0]:.1f}",
            f"{y['raw_s']:.2f}",
            f"{y['calibrated_s']:.2f}",
            "" if vs[1] is None else f"{vs[1]:.1f}",
            d,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="results folder of CPU A")
    ap.add_argument("b", type=Path, help="results folder of CPU B")
    ap.add_argument("--workload", required=True, help="file prefix, e.g. captured, controlled-c8")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--seeds", default="1", help="comma-separated seeds both folders have")
    ap.add_argument("--md", type=Path, default=None, help="write the table here")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    a = ap.parse_args()
    seeds = tuple(int(s) for s in a.seeds.split(","))
    tag = f"{a.workload}-{a.profile}"
    sides = []
    for folder in (a.a, a.b):
        runs = runs_of(folder, tag, Subset(tag, seeds))
        if not runs:
            sys.exit(f"{folder}: no {tag} run files for seeds {a.seeds}")
        sides.append(side(runs))
    text = f"{tag}, seeds {a.seeds}\n\n" + table(*sides)
    print(text)
    if a.md:
        a.md.write_text(text)
    if a.json:
        from datetime import UTC, datetime

        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        doc = result_head("cross_cpu", stamp) | {
            "tag": tag,
            "seeds": seeds,
            "a": sides[0],
            "b": sides[1],
        }
        a.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")


if __name__ == "__main__":
    main()
