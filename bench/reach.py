"""The reach of a delivery policy: at the profile's pool, and on a pool nothing outgrows.

Reads pairs of ``ladsd compare`` folders (in ``FOLDER``, or its ``runs.tar.xz``):
``NAME/`` ran FIFO, the policy and the infinite cache (FIFO's delivery on a pool
nothing outgrows) at the profile's pool; ``NAME-inf/`` ran the policy alone with
``--kv-blocks`` set to the infinite cache's pool and ``--dilation`` to ``NAME/``'s.
For every policy, and the policy on the big pool (``<policy> on the infinite
pool``), it prints per seed the mean workflow latency (the mean of the seed's
repeats), the reduction against FIFO per seed and over the seeds' means, the
A/A pair spread (|repeat 2 / repeat 1 - 1|), cached prompt tokens, grants,
headroom refusals and budget denials a run, and the most KV blocks the run
held referenced at once (pool minus the fewest free in its lease timeline): on
the big pool, what holding every waiting history took.

What it says: if the policy on the big pool meets a goal the policy misses at
the profile's pool, the gap is retention (the pool); if neither meets it, the
gap is the order. Measures nothing; ``--md`` writes what it prints.

    .venv/bin/python bench/reach.py bench/results/issue23-reach --pair c8 --pair cs --pair web
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rerender import run_dir, run_files  # noqa: E402

from ladsd.metrics import events  # noqa: E402
from ladsd.metrics.events import RunRecord  # noqa: E402
from ladsd.metrics.summary import mean_latency, repeat_of  # noqa: E402

COLUMNS = (
    "| policy | pool | {seeds} | below FIFO % (per seed) | below FIFO % | pair spread % "
    "| cached tok | grants | headroom refusals | denials | most referenced |"
)


def load(folder: Path) -> dict[str, list[RunRecord]]:
    """policy -> its runs in ``folder``, by (seed, repeat)."""
    out: dict[str, list[RunRecord]] = {}
    for p in run_files(folder):
        r = events.load(p)
        out.setdefault(r.policy, []).append(r)
    return {k: sorted(v, key=lambda r: (r.seed, repeat_of(r))) for k, v in out.items()}


def pool(run: RunRecord) -> int:
    return int(run.meta["profile"]["engine"]["num_gpu_blocks_override"])


def referenced(run: RunRecord) -> int:
    """The most blocks referenced at once (running requests and leases): pool - min F."""
    return pool(run) - min((s.F for s in run.lease_samples), default=pool(run))


def seed_means(runs: list[RunRecord]) -> dict[int, float]:
    seeds: dict[int, list[float]] = {}
    for r in runs:
        seeds.setdefault(r.seed, []).append(mean_latency(r))
    return {s: statistics.mean(v) for s, v in seeds.items()}


def spreads(runs: list[RunRecord]) -> list[float]:
    by: dict[int, dict[int, float]] = {}
    for r in runs:
        by.setdefault(r.seed, {})[repeat_of(r)] = mean_latency(r)
    return [100 * abs(v[2] / v[1] - 1) for _, v in sorted(by.items()) if 1 in v and 2 in v]


def table(name: str, base: Path, policy: str) -> list[str]:
    """The lines of one pair of folders (``name`` and ``name-inf``)."""
    runs = load(base / name)
    big = load(base / f"{name}-inf").get(policy)
    if "fifo" not in runs or not big:
        sys.exit(f"{name}: needs FIFO in {name}/ and {policy} in {name}-inf/")
    rows = runs | {f"{policy} on the infinite pool": big}
    fifo = seed_means(runs["fifo"])
    seeds = sorted(fifo)
    dil = sorted({round(r.meta.get("dilation", 1.0), 3) for rs in rows.values() for r in rs})
    git = sorted({str(r.meta.get("git", ""))[:7] for rs in rows.values() for r in rs})
    lines = [
        f"## {name}: {runs['fifo'][0].workload}, seeds {', '.join(map(str, seeds))}; "
        f"dilation {', '.join(map(str, dil))}; commit {', '.join(git)}",
        "",
        COLUMNS.format(seeds=" | ".join(f"s{s} mean s" for s in seeds)),
        "|---|---:|" + "---:|" * len(seeds) + "---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, rs in rows.items():
        m = seed_means(rs)
        if sorted(m) != seeds:
            sys.exit(f"{name}: {p} ran seeds {sorted(m)}, FIFO {seeds}")
        per = [100 * (1 - m[s] / fifo[s]) for s in seeds]
        tot = 100 * (1 - statistics.mean(m.values()) / statistics.mean(fifo.values()))

        def avg(key: str, rs: list[RunRecord] = rs) -> float:
            return statistics.mean(r.counters.get(key, 0) for r in rs)

        lines.append(
            f"| {p} | {pool(rs[0])} | "
            + " | ".join(f"{m[s]:.2f}" for s in seeds)
            + f" | {', '.join(f'{x:.1f}' for x in per)} | {tot:.1f}"
            + f" | {', '.join(f'{x:.1f}' for x in spreads(rs)) or '-'}"
            + f" | {avg('cached_prompt_tokens') / 1000:.0f}K | {avg('grants'):.0f}"
            + f" | {avg('headroom_refusals'):.0f} | {avg('denials'):.0f}"
            + f" | {max(map(referenced, rs))} |"
        )
    return [*lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="holds NAME/ and NAME-inf/ (or a runs.tar.xz)")
    ap.add_argument("--pair", action="append", required=True, help="NAME (repeatable)")
    ap.add_argument("--policy", default="lads-adaptive", help="the policy on both pools")
    ap.add_argument("--md", type=Path, default=None, help="write the tables here")
    a = ap.parse_args()
    base = run_dir(a.folder)
    text = "\n".join(line for name in a.pair for line in table(name, base, a.policy))
    print(text)
    if a.md:
        a.md.write_text(text)


if __name__ == "__main__":
    main()
