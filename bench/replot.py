"""Redraw a results folder's figures from its run files (no run is repeated).

    .venv/bin/python bench/replot.py bench/results/cpu-quarter

For every ``<tag>-table.md`` in the folder, the run files ``<tag>-<policy>-s<seed>[-r<k>].json``
(or those in its ``runs.tar.xz``) are read back and ``<tag>-cdf.png`` and ``<tag>-stages.png``
are drawn again, as ``ladsd compare`` draws them (ladsd.metrics.plots). Only the figures change:
tables and run files are left as they are.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

from ladsd.metrics import events, plots
from ladsd.metrics.events import RunRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rerender import run_dir  # noqa: E402


def runs_of(folder: Path, tag: str) -> dict[str, list[RunRecord]]:
    pat = re.compile(rf"^{re.escape(tag)}-(?P<policy>.+)-s\d+(-r\d+)?\.json$")
    runs: dict[str, list[RunRecord]] = defaultdict(list)
    for p in sorted(run_dir(folder).iterdir()):
        if pat.match(p.name):
            rec = events.load(p)
            runs[rec.policy].append(rec)
    return dict(runs)


def main(folder: str) -> None:
    root = Path(folder)
    for t in sorted(root.glob("*-table.md")):
        tag = t.name.removesuffix("-table.md")
        runs = runs_of(root, tag)
        plots.latency_cdf(runs, root / f"{tag}-cdf.png")
        plots.stage_breakdown(runs, root / f"{tag}-stages.png")
        n = sum(len(v) for v in runs.values())
        print(f"{tag}: {len(runs)} policies, {n} runs -> {tag}-cdf.png, {tag}-stages.png")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/cpu-quarter")
