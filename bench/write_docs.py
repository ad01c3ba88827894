"""Write the tables of docs/*.md from the run files, between marker comments.

    .venv/bin/python bench/write_docs.py           # rewrite every marked table
    .venv/bin/python bench/write_docs.py --check   # exit 1 if a marked table differs

A marked table in a doc::

    <!-- table: bench/results/cpu-quarter/controlled-c8-cpu-table.md 1-5 -->

    ...written by this script...

    <!-- /table -->

The source names a table file under bench/results/ and, optionally, which of its grids
(the bold-titled tables, counted from 1: ``2``, ``1-5``; all without). The file is not
read: it is rendered again from its run files as ``ladsd compare`` renders it
(bench/rerender.py), so a doc and a committed table can only show the same figures.
A source ``PATH VIEW`` with a view of :data:`VIEWS` is a table laid out for one page from
the result files at ``PATH`` (a file or a folder): the agent sessions, the scale-out, the
serve benches, the captured-scaled pool sweep, the A/A pairs and the link dilation. Only
what is between the markers is written; the prose around them is left alone.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import dilation as dil  # noqa: E402  (bench/dilation.py)
import rerender  # noqa: E402

DOCS = ROOT / "docs"
OPEN = re.compile(r"^<!-- table: (?P<src>.+?) -->$", re.M)
CLOSE = "<!-- /table -->"
GRID_START = re.compile(r"\n\n(?=\*\*)")  # markdown() joins bold-titled grids this way


class MarkerError(ValueError):
    """A doc's markers are malformed, or a source cannot be rendered."""


@dataclass(frozen=True)
class Region:
    """One marked table of a doc: its source, and the character span of its content."""

    doc: Path
    source: str
    start: int  # just after the opening marker's line
    end: int  # at the closing marker


def grids(text: str, which: str | None) -> str:
    """The ``which`` grids (``2``, ``1-5``; None: all) of a rendered markdown table file."""
    parts = GRID_START.split(text.rstrip("\n"))
    if which is None:
        return "\n\n".join(parts)
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", which)
    if not m:
        raise MarkerError(f"grid range {which!r}: give N or N-M")
    lo, hi = int(m[1]), int(m[2] or m[1])
    if not 1 <= lo <= hi <= len(parts):
        raise MarkerError(f"grids {which} of {len(parts)}")
    return "\n\n".join(parts[lo - 1 : hi])


# ---------------------------------------------------------------- views: agent sessions


def _md(head: list[str], rows: list[list[str]], right: int = 0) -> str:
    """A pipe table; the ``right`` columns after the first are right-aligned."""
    align = ["---", *["---:"] * right, *["---"] * (len(head) - 1 - right)]
    lines = ["| " + " | ".join(head) + " |", "|" + "".join(f"{a}|" for a in align)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _runs(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Runs per server in file order, those marked ``disturbed`` left out."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        if not r.get("disturbed"):
            out.setdefault(r["server"], []).append(r)
    return out


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.mean(r["summary"][key] for r in runs)


AGENT_LABELS = {"vllm": "vllm (stock)", "lads-aa": "lads-aa (A/A)"}
AGENT_BOLD = "lads"  # the candidate's row, bold in the docs
POOL_NOTES = {1024: "every history fits", 512: "pressure", 384: "heavy eviction"}


def _row(server: str, cells: list[str]) -> list[str]:
    row = [AGENT_LABELS.get(server, server), *cells]
    return [f"**{c}**" for c in row] if server == AGENT_BOLD else row


def sessions_by_seed(path: Path) -> str:
    """Per server and seed: mean session latency [model time], and its ratio to vllm."""
    doc = json.loads(path.read_text())
    per = _runs(doc)
    seeds = sorted({r["seed"] for r in doc["runs"]})
    cell = {(s, k): [r for r in rs if r["seed"] == k] for s, rs in per.items() for k in seeds}
    head = ["server", *(f"seed {k}" for k in seeds), *(f"/ vllm, seed {k}" for k in seeds)]
    rows = []
    for s in per:
        lat = [
            f"{_mean(cell[s, k], 'session_s'):.1f} [{_mean(cell[s, k], 'session_model_s'):.1f}]"
            for k in seeds
        ]
        ratio = [
            _ratio(_mean(cell[s, k], "session_s"), _mean(cell["vllm", k], "session_s"))
            for k in seeds
        ]
        rows.append(_row(s, lat + ratio))
    return _md(head, rows)


def pool_sweep(folder: Path) -> str:
    """Seed 1 per pool: vllm, fifo, lads session latency [cached fraction] and lads's ratios."""
    files = [p for p in sorted(folder.glob("*.json")) if p.name.startswith(("sweep-", "sessions-"))]
    docs = [d for d in map(json.loads, (p.read_text() for p in files)) if d.get("runs")]
    by_pool = {d["engine"]["num_gpu_blocks_override"]: d for d in docs}
    head = ["pool (blocks)", "vllm", "fifo", "lads", "lads / vllm", "lads / fifo"]
    rows = []
    for pool in sorted(by_pool, reverse=True):
        per = {s: [r for r in rs if r["seed"] == 1] for s, rs in _runs(by_pool[pool]).items()}
        lat = {s: _mean(per[s], "session_s") for s in ("vllm", "fifo", "lads")}
        cells = [f"{lat[s]:.1f} [{_mean(per[s], 'cached_frac'):.2f}]" for s in lat]
        note = f" ({POOL_NOTES[pool]})" if pool in POOL_NOTES else ""
        rows.append([f"{pool:,}{note}", *cells, *(
            f"{lat['lads'] / lat[b]:.3f}" for b in ("vllm", "fifo")
        )])  # fmt: skip
    return _md(head, rows)


ROUTERS = {"ch": "`consistent_hash`", "rr": "`round_robin`", "ca": "`cache_aware`"}
POLICY_LABELS = {"lads": "LADS", "lads-aa": "LADS (A/A)", "fifo": "FIFO"}


def _span(xs: list[float], digits: int) -> str:
    return f"{statistics.mean(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def scale_out(path: Path) -> str:
    """Two replicas behind each router against one replica at the same total pool."""
    doc = json.loads(path.read_text())
    per = _runs(doc)
    ratios = doc["vs_one_replica"]["session_s"]
    head = ["server", "mean session latency s", "session model time s", "cached-token fraction",
            "per-run ratio to one replica, session latency"]  # fmt: skip
    names = [p for p in POLICY_LABELS if p in per]
    names += [f"{r}-{p}" for r in ROUTERS for p in POLICY_LABELS if f"{r}-{p}" in per]
    rows = []
    for name in names:
        rs = per[name]
        lat = _span([r["summary"]["session_s"] for r in rs], 1)
        model = f"{_mean(rs, 'session_model_s'):.1f}"
        cached = [r["summary"]["cached_frac"] for r in rs]
        router, _, pol = name.partition("-") if name not in POLICY_LABELS else ("", "", name)
        if not router:  # one replica: the reference of every ratio
            rows.append([f"one replica, {POLICY_LABELS[pol]}", lat, model,
                         f"{statistics.mean(cached):.3f}", "1"])  # fmt: skip
            continue
        base = "lads" if pol.startswith("lads") else "fifo"
        v = ratios[f"{name}/{base}"]
        rows.append([f"{ROUTERS[router]}, {POLICY_LABELS[pol]}", lat, model, _span(cached, 3),
                     f"{min(v):.2f}-{max(v):.2f}"])  # fmt: skip
    return _md(head, rows)


# ---------------------------------------------------------------- views: compare folders

WORKLOAD_ROWS = (  # (file tag, the row's name) in the order of the results page
    ("controlled-c8-cpu", "controlled cohort-8"),
    ("web-burst-cpu", "web-derived bursts"),
    ("captured-cpu", "captured paths"),
    ("controlled-c16-cpu", "controlled cohort-16"),
    ("captured-scaled-cpu", "captured-scaled (2,300 blocks)"),
)


def dilation_aa(folder: Path) -> str:
    """Per workload and core policy: the A/A difference, raw / divided by the link dilation."""
    head = ["A/A, \\|repeat 2 - repeat 1\\| %, raw / normalised", "FIFO", "Cache-first", "LADS",
            "infinite cache"]  # fmt: skip
    rows = []
    for tag, name in WORKLOAD_ROWS:
        runs = dil.runs_by_policy(folder, tag, 10**6)
        cells = []
        for p in ("fifo", "cache-first", "lads", "infinite-cache"):
            pairs = [r for _, r in sorted(runs.get(p, {}).items()) if len(r) >= 2]
            views = [[abs(dil.reduction(m(r[0]), m(r[1]))) for r in pairs] for m in dil.VIEWS]
            cells.append(" / ".join(f"{statistics.mean(v):.1f}" for v in views))
        rows.append([name, *cells])
    return _md(head, rows)


def _sweep_run(path: Path) -> Any:
    """A pool-sweep file (``ladsd replay --json``: a list of one run) or a compare run file."""
    from ladsd.metrics import events

    d = json.loads(path.read_bytes())
    return events.from_dict(d[0] if isinstance(d, list) else d)


def captured_pool_sweep(folder: Path) -> str:
    """captured-scaled seed 1, FIFO and LADS per pool: the rule's pool, then the sweep."""
    from ladsd.metrics import summary

    rule = 1982  # the pool rule's pool for captured-scaled (the folder's compare runs)
    pools = {rule: (folder / f"captured-scaled-cpu-{p}-s1.json" for p in ("fifo", "lads"))}
    for f in sorted((folder / "pool-sweep").glob("captured-scaled-cpu-fifo-kv*.json")):
        kv = int(f.stem.rsplit("kv", 1)[1])
        pools[kv] = (f, f.with_name(f.name.replace("-fifo-", "-lads-")))
    head = ["pool (blocks)", "FIFO s", "LADS s", "LADS vs FIFO",
            "histories recomputed of 96, FIFO / LADS",
            "LADS grants / budget denials / headroom refusals"]  # fmt: skip
    rows = []
    for kv in sorted(pools):
        fifo, lads = (_sweep_run(p) for p in pools[kv])
        a, b = summary.mean_latency(fifo), summary.mean_latency(lads)

        def recomputed(run: Any) -> int:  # a continuation that found < half its prompt cached
            return sum(c.cached_tokens < c.prompt_tokens / 2 for c in summary.continuations(run))

        name = f"{kv:,}" + (" (the rule)" if kv == rule else "")
        c = lads.counters
        rows.append([f"**{name}**" if kv == CAPTURED_POOL else name, f"{a:.2f}", f"{b:.2f}",
                     f"{summary.reduction(a, b):.1f} %", f"{recomputed(fifo)} / {recomputed(lads)}",
                     " / ".join(f"{c[k]:.0f}" for k in ("grants", "denials", "headroom_refusals"))
                     ])  # fmt: skip
    return _md(head, rows, right=3)


CAPTURED_POOL = 2300  # the pool the comparison ran at (bench/paper_cpu.sh's CAPTURED_POOL)


# ---------------------------------------------------------------- views: serve benches

LIFE_ROWS = (
    ("health_s", "first 200 on `/health` (s)"),
    ("models_s", "first 200 on `/v1/models` (s)"),
    ("idle_cpu_s_per_10s", "idle CPU (CPU s per 10 s, process tree)"),
    ("rss_warm_mib", "RSS after warm-up (MiB)"),
)


def serve_life(folder: Path) -> str:
    """bench/serve_life.py: ladsd serve now and before, and stock vLLM (median (min-max))."""
    files = sorted(folder.glob("serve-life-*.json"))
    before = [f for f in files if "-before-" in f.name]
    doc = json.loads(next(f for f in files if f not in before).read_text())
    now, old = doc["summary"], json.loads(before[0].read_text())["summary"]["ladsd"]
    head = ["figure", "ladsd serve", "ladsd serve, before", "vLLM api_server"]
    f = doc["flags"]
    rounds = f"RSS after {f['rounds']} rounds of {f['requests']} requests (MiB)"
    rows = []
    for key, name in (*LIFE_ROWS, ("rss_rounds_mib", rounds)):
        cells = [now["ladsd"][key], old[key], now["vllm"][key]]
        if key.endswith("_mib"):
            rows.append([name, *(f"{c['median']:,.0f}" for c in cells)])
        else:
            rows.append([name, *(f"{c['median']:.2f} ({c['min']:.2f}-{c['max']:.2f})"
                                 for c in cells)])  # fmt: skip
    return _md(head, rows)


def serve_bench(path: Path) -> str:
    """bench/serve.py: LADS against FIFO over HTTP sessions, and their ratio."""
    doc = json.loads(path.read_text())
    agg = doc["aggregate"]
    head = ["policy", "mean turn s", "mean continuation s", "mean workflow s",
            "cached prompt tokens (share)"]  # fmt: skip
    rows = []
    for pol, name in (("lads", "LADS (leases)"), ("fifo", "FIFO (none)")):
        a = agg[pol]
        runs = [r["summary"] for r in doc["runs"] if r["policy"] == pol]
        share = statistics.mean(r["prompt_tokens"] for r in runs)
        t = a["mean_turn_s"]
        rows.append([name, f"{t['mean']:.2f} ({t['min']:.2f}-{t['max']:.2f})",
                     f"{a['mean_continuation_s']['mean']:.2f}",
                     f"{a['mean_workflow_s']['mean']:.1f}",
                     f"{a['cached_tokens']['mean']:,.0f} "
                     f"({100 * a['cached_tokens']['mean'] / share:.0f} %)"])  # fmt: skip
    r = agg["ratio"]
    t, c = r["mean_turn_s"], r["cached_tokens"]
    wf = agg["lads"]["mean_workflow_s"]["mean"] / agg["fifo"]["mean_workflow_s"]["mean"]
    rows.append(["LADS / FIFO",
                 f"**{t['mean']:.3f}** ({t['min']:.3f}-{t['max']:.3f}, stdev {t['stdev']:.3f})",
                 f"{r['mean_continuation_s']['mean']:.3f}", f"{wf:.3f}",
                 f"**{c['mean']:.3f}** ({c['min']:.3f}-{c['max']:.3f})"])  # fmt: skip
    return _md(head, rows, right=4)


def _ratio(a: float, b: float) -> str:
    return "1" if a == b else f"{a / b:.3f}"


VIEWS: dict[str, Callable[[Path], str]] = {
    "sessions-by-seed": sessions_by_seed,  # a result file
    "pool-sweep": pool_sweep,  # the folder
    "scale-out": scale_out,  # a result file of --scale-out
    "dilation-aa": dilation_aa,  # a compare folder (bench/dilation.py's A/A pairs)
    "captured-pool-sweep": captured_pool_sweep,  # explore-captured-scaled/
    "serve-life": serve_life,  # bench/results/serve-life/
    "serve-bench": serve_bench,  # a result file of bench/serve.py
}


# ---------------------------------------------------------------- rendering a source


def render(source: str) -> str:
    """What a marker's source renders to now (no trailing newline)."""
    path_s, _, which = source.partition(" ")
    path = ROOT / path_s
    which = which.strip() or None
    if which in VIEWS:
        return VIEWS[which](path)
    if not path.name.endswith(("-table.md", "-peers.md")):
        raise MarkerError(f"{source!r}: not a table file of bench/results/")
    if not path.exists():
        raise MarkerError(f"{source!r}: no such table file")
    r = rerender.render_file(path)
    if r.earlier:
        raise MarkerError(f"{source!r}: an archived table of an earlier format")
    return grids(r.text, which)


def regions(doc: Path, text: str) -> list[Region]:
    """Every marked table of ``text``, in order; a marker without its close is an error."""
    out = []
    for m in OPEN.finditer(text):
        start = m.end() + 1
        end = text.find(CLOSE, start)
        nxt = OPEN.search(text, start)
        if end < 0 or (nxt is not None and nxt.start() < end):
            raise MarkerError(f"{doc.name}: table {m['src']!r} has no {CLOSE}")
        out.append(Region(doc, m["src"], start, end))
    return out


def written(doc: Path) -> tuple[str, list[tuple[Region, bool]]]:
    """``doc``'s text with every marked table rendered, and which regions changed."""
    text = doc.read_text()
    out, pos, seen = [], 0, []
    for r in regions(doc, text):
        body = "\n" + render(r.source) + "\n\n"
        out += [text[pos : r.start], body]
        seen.append((r, text[r.start : r.end] != body))
        pos = r.end
    out.append(text[pos:])
    return "".join(out), seen


def docs() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 on a difference")
    a = ap.parse_args()
    stale = 0
    for doc in docs():
        new, seen = written(doc)
        for r, changed in seen:
            stale += changed
            print(f"{'DIFFERS' if changed else 'same'}  {doc.name}: {r.source}")
        if not a.check and any(c for _, c in seen):
            doc.write_text(new)
            print(f"wrote {doc.relative_to(ROOT)}")
    n = sum(len(regions(d, d.read_text())) for d in docs())
    print(f"{n} marked tables, {stale} " + ("differ" if a.check else "rewritten"))
    if a.check and stale:
        sys.exit(1)


if __name__ == "__main__":
    main()
