"""Tables and figures of bench/agent_sessions.py's result files (nothing is re-run).

    .venv/bin/python bench/agent_sessions_report.py bench/results/agents

Reads every ``*.json`` of the folder written by bench/agent_sessions.py and writes, beside them,
``README.md`` (one table per file: per server the mean and min-max over its runs;
the per-seed ratios to ``vllm``; the A/A pair; ladsd's lease counters), the session
latency CDF of the comparison (``sessions-cdf.png``) and, when sweep files
(``sweep-pool<N>.json``, plus the comparison's pool) exist, mean session latency and
cached fraction against the pool (``sweep.png``). Every figure in README.md is read
from the files: none is typed in.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ladsd.metrics.plots import style

SESSION_COLS = (
    ("session_s", "session latency s"),
    ("session_model_s", "session model time s"),
    ("turn_s", "turn s"),
    ("ttft_s", "TTFT s"),
    ("ttft_p50_s", "TTFT p50 s"),
    ("cached_frac", "cached fraction"),
)
PLAIN_COLS = (
    ("throughput_tok_s", "tokens/s"),
    ("p50_s", "p50 s"),
    ("p99_s", "p99 s"),
    ("ttft_p50_s", "TTFT p50 s"),
)
COUNTERS = ("grants", "expiries", "handoffs", "revocations", "denials", "headroom_refusals",
            "pins", "pin_handoffs", "pin_expiries", "session_reorders")  # fmt: skip


def cell(xs: list[float], digits: int = 3) -> str:
    m = statistics.mean(xs)
    if len(xs) == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def by_server(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The runs per server, without those marked ``disturbed`` (listed by :func:`report`)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        if not r.get("disturbed"):
            out.setdefault(r["server"], []).append(r)
    return out


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def ratio_rows(doc: dict[str, Any], key: str, base: str, pair: tuple[str, str]) -> list[list[str]]:
    cells: dict[tuple[int, int], dict[str, float]] = {}
    for r in doc["runs"]:
        if not r.get("disturbed"):
            cells.setdefault((r["seed"], r["repeat"]), {})[r["server"]] = r["summary"][key]
    rows = []
    for (seed, rep), c in sorted(cells.items()):
        if base not in c:
            continue
        vals = [f"{n}/{base} {c[n] / c[base]:.3f}" for n in c if n != base]
        if pair[0] in c and pair[1] in c:
            vals.append(f"**A/A {pair[1]}/{pair[0]} {c[pair[1]] / c[pair[0]]:.3f}**")
        rows.append([f"seed {seed}, repeat {rep}", "; ".join(vals)])
    return rows


def meta_lines(doc: dict[str, Any], name: str) -> list[str]:
    cpu = doc["machine"]["cpu"]
    e = doc["engine"]
    git = doc["git"]
    w = doc.get("workload") or {}
    lines = [
        f"`{name}`: {doc['bench']}, {doc['created']}, commit `{git['commit'][:10]}`"
        f"{' (dirty)' if git['dirty'] else ''}, ladsd from {doc['ladsd_from']};",
        f"CPU {cpu['model']} ({cpu['cpus']} CPUs, {', '.join(cpu['notable_flags'])}; "
        f"bf16 native: {cpu['bf16_native']}), dtype {e['dtype']};",
        f"every server: pool {e['num_gpu_blocks_override']} blocks of {e['block_size']}, "
        f"max_num_seqs {e['max_num_seqs']}, {e['max_num_batched_tokens']} batched tokens, "
        f"max_model_len {e['max_model_len']}, prefix caching on; ladsd `H` "
        f"{e['headroom_blocks']}; argv `{' '.join(doc['argv'])}`",
    ]
    if w:
        lines.append(
            f"workload: {w['sessions']} sessions, token scale {w['token_scale']}, time factor "
            f"{w['time_factor']}, at most {w['max_turns']} turns and {w['max_context']} tokens "
            f"a turn, tool waits capped at {w['max_tool_wait_s']} s, stagger {w['stagger_s']} s,"
            f" traces at `{(w.get('traces_commit') or '?')[:10]}`"
        )
    return [" ".join(lines), ""]


def report(doc: dict[str, Any], name: str) -> list[str]:
    plain = doc["bench"].endswith("plain")
    cols = PLAIN_COLS if plain else SESSION_COLS
    out = [f"## {name}", ""] + meta_lines(doc, name)
    for r in doc["runs"]:
        if r.get("disturbed"):
            out += [f"Left out: {r['server']}, seed {r['seed']}, repeat {r['repeat']}: "
                    f"{r['disturbed']}.", ""]  # fmt: skip
    rows = []
    for server, runs in by_server(doc).items():
        vals = [cell([r["summary"][k] for r in runs], 1 if k == "throughput_tok_s" else 3)
                for k, _ in cols]  # fmt: skip
        ok = all(r["exit"] == 0 for r in runs)
        audit = {r.get("audit_balanced") for r in runs}
        rows.append([server, str(len(runs)), *vals, "yes" if ok else "NO",
                     {None: "-", True: "balanced"}.get(audit.pop(), "NO") if len(audit) == 1
                     else "NO"])  # fmt: skip
    out += md_table(["server", "runs", *(h for _, h in cols), "exit 0", "lease audit"], rows)
    out.append("")
    seeds = sorted({r["seed"] for r in doc["runs"]})
    if not plain and len(seeds) > 1:
        for seed in seeds:
            out += [f"Seed {seed} alone:", ""]
            rows = []
            for server, runs in by_server(doc).items():
                mine = [r for r in runs if r["seed"] == seed]
                if mine:
                    rows.append([server, *(cell([r["summary"][k] for r in mine]) for k, _ in cols)])
            out += md_table(["server", *(h for _, h in cols)], rows) + [""]
    scale = doc["bench"].endswith("scale-out")
    base, pair = ("vllm", ("fifo", "fifo-aa")) if plain else ("vllm", ("lads", "lads-aa"))
    keys = ("throughput_tok_s", "p50_s") if plain else ("session_s", "session_model_s")
    if scale:
        base, pair, keys = "ch-lads", ("ch-lads", "ch-lads-aa"), ("session_s", "cached_frac")
    for key in keys:
        out += [f"Ratios of `{key}` per seed and repeat:", ""]
        out += md_table(["run", "ratios"], ratio_rows(doc, key, base, pair)) + [""]
    if scale:
        out += scale_out(doc)
    if not plain:
        rows = []
        for server, runs in by_server(doc).items():
            if runs[0]["kind"] == "vllm":
                continue
            rows.append([server, *(cell([r["counters"].get(c, 0) for r in runs], 1)
                                   for c in COUNTERS)])  # fmt: skip
        out += ["ladsd's lease counters per run (mean, min-max):", ""]
        out += md_table(["server", *COUNTERS], rows) + [""]
    return out


def scale_out(doc: dict[str, Any]) -> list[str]:
    """Two replicas against one at the same total pool, and what each replica did."""
    out = ["Two replicas over one (same policy, same total pool), per seed and repeat:", ""]
    rows = [[f"`{key}`: {name}", " ".join(f"{x:.3f}" for x in v), f"{statistics.mean(v):.3f}"]
            for key, per in doc["vs_one_replica"].items() for name, v in per.items()]  # fmt: skip
    out += md_table(["ratio", "values", "mean"], rows) + [""]
    out += ["Per replica (mean over runs): sessions whose turns all reached it, sessions "
            "spread over both, its mean session latency (its own sessions), lease grants, "
            "headroom refusals, stalled steps:", ""]  # fmt: skip
    rows = []
    for server, runs in by_server(doc).items():
        if runs[0]["kind"] != "cluster":
            continue
        for rep in sorted(runs[0]["replica_counters"]):
            own = [[s for s in r["sessions"] if r["session_replicas"][s["sid"]] == [rep]]
                   for r in runs]  # fmt: skip
            lat = [statistics.mean(s["latency_s"] for s in o) for o in own if o]
            spread = [sum(len(v) > 1 for v in r["session_replicas"].values()) for r in runs]
            c = [r["replica_counters"][rep] for r in runs]
            rows.append([server, rep, cell([float(len(o)) for o in own], 1),
                         cell([float(x) for x in spread], 1), cell(lat) if lat else "-",
                         *(cell([x.get(k, 0) for x in c], 1)
                           for k in ("grants", "headroom_refusals", "stalled_steps"))])  # fmt: skip
    head = ["server", "replica", "own sessions", "spread sessions", "own session s", "grants",
            "headroom refusals", "stalled steps"]  # fmt: skip
    return out + md_table(head, rows) + [""]


def save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def cdf(doc: dict[str, Any], path: Path) -> None:
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for server, runs in by_server(doc).items():
        xs = sorted(s["latency_s"] for r in runs for s in r["sessions"])
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=server, **style(server))
    ax.set_xlabel("session latency (s, tool waits included)")
    ax.set_ylabel("fraction of sessions")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save(fig, path)


def sweep(docs: list[dict[str, Any]], path: Path) -> None:
    pts: dict[str, list[tuple[int, float, float]]] = {}
    for doc in docs:
        pool = doc["engine"]["num_gpu_blocks_override"]
        for server, runs in by_server(doc).items():
            if server in ("vllm", "fifo", "lads"):
                s = statistics.mean(r["summary"]["session_s"] for r in runs if r["seed"] == 1)
                c = statistics.mean(r["summary"]["cached_frac"] for r in runs if r["seed"] == 1)
                pts.setdefault(server, []).append((pool, s, c))
    fig = Figure(figsize=(10, 4))
    a, b = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for server, p in pts.items():
        p.sort()
        kw = {"marker": "o", "label": server, **style(server)}
        a.plot([x for x, _, _ in p], [y for _, y, _ in p], **kw)
        b.plot([x for x, _, _ in p], [c for _, _, c in p], **kw)
    a.set_xlabel("KV pool (blocks of 32 tokens)")
    a.set_ylabel("mean session latency (s), seed 1")
    b.set_xlabel("KV pool (blocks of 32 tokens)")
    b.set_ylabel("cached-token fraction, seed 1")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, path)


def main(folder: str) -> None:
    root = Path(folder)
    files = sorted(p for p in root.glob("*.json"))
    docs = {p.name: json.loads(p.read_text()) for p in files}
    out = ["# Coding-agent sessions: `ladsd serve` beside stock vLLM", "",
           "Written by `bench/agent_sessions_report.py` from the result files of "
           "`bench/agent_sessions.py` in this folder (every number below is read from them).",
           ""]  # fmt: skip
    for name, doc in docs.items():
        if doc.get("runs"):
            out += report(doc, name)
    sessions = [d for n, d in docs.items() if n.startswith("sessions-") and d.get("runs")]
    if sessions:
        cdf(sessions[0], root / "sessions-cdf.png")
        out += ["![session latency CDF](sessions-cdf.png)", ""]
    scaled = [d for n, d in docs.items() if n.startswith("scale-out-") and d.get("runs")]
    if scaled:
        cdf(scaled[0], root / "scale-out-cdf.png")
        out += ["![two replicas vs one: session latency CDF](scale-out-cdf.png)", ""]
    swept = [d for n, d in docs.items() if n.startswith(("sweep-", "sessions-")) and d.get("runs")]
    if len(swept) > 1:
        sweep(swept, root / "sweep.png")
        out += ["![pool sweep](sweep.png)", ""]
    (root / "README.md").write_text("\n".join(out))
    print(f"wrote {root / 'README.md'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/agents")
