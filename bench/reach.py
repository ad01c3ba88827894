"""The reach of a delivery policy: at the profile's pool, and on a pool nothing outgrows.

Reads pairs of ``ladsd compare`` folders (in ``FOLDER``, or its ``runs.tar.xz``):
``NAME/`` ran FIFO, the policy and the infinite cache (FIFO's delivery on a pool
nothing outgrows) at the profile's pool; ``NAME-inf/`` ran the policy alone with
``--kv-blocks`` set to the infinite cache's pool and ``--dilation`` to ``NAME/``'s.
For every policy, and the policy on the big pool (``<policy> on the infinite
pool``), it prints per seed the mean workflow latency (the mean of the seed's
repeats), the reduction against FIFO per seed and over the seeds' means, raw and
normalised (each run divided by its own dilation, its kappa / kappa_ref, as
``bench/versus.py`` does), the A/A pair spread (|repeat 2 / repeat 1 - 1|), cached
prompt tokens, grants, headroom refusals and budget denials a run, and the most KV
blocks referenced at once in any run of the row (running requests and leases: the
pool minus the fewest free, evictable cached blocks counted free; vLLM's null block
included; the lease timeline keeps one sample per 0.1 s, so a lower bound).

What it says: if the policy on the big pool meets a goal it misses at the profile's
pool, more retention is enough to close that gap (not that it is the only way); if
neither meets it, the pool alone does not explain the gap. Measures nothing; ``--md``
writes what it prints.

    .venv/bin/python bench/reach.py bench/results/issue23-reach --pair c8 --pair cs --pair web
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rerender import run_dir, run_files  # noqa: E402
from versus import per_run  # noqa: E402

from ladsd.metrics import events  # noqa: E402
from ladsd.metrics.events import RunRecord  # noqa: E402
from ladsd.metrics.summary import mean_latency, repeat_of  # noqa: E402

Metric = Callable[[RunRecord], float]
COLUMNS = (
    "| policy | pool | {seeds} | below FIFO % (per seed) | below FIFO % | normalised % "
    "| pair spread % | cached tok | grants | headroom refusals | denials | most referenced |"
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


def referenced(run: RunRecord) -> int | None:
    """The most blocks referenced at once (running requests and leases): pool - min F;
    None without a lease timeline."""
    if not run.lease_samples:
        return None
    return pool(run) - min(s.F for s in run.lease_samples)


def by_seed(runs: list[RunRecord], metric: Metric = mean_latency) -> dict[int, dict[int, float]]:
    """seed -> repeat -> ``metric``; a repeat listed twice is an error, not overwritten."""
    out: dict[int, dict[int, float]] = {}
    for r in runs:
        reps = out.setdefault(r.seed, {})
        if repeat_of(r) in reps:
            sys.exit(f"{r.policy}: seed {r.seed} repeat {repeat_of(r)} twice")
        reps[repeat_of(r)] = metric(r)
    return out


def seed_means(runs: list[RunRecord], metric: Metric = mean_latency) -> dict[int, float]:
    return {s: statistics.mean(v.values()) for s, v in by_seed(runs, metric).items()}


def spreads(runs: list[RunRecord]) -> list[float]:
    by = by_seed(runs)
    return [100 * abs(v[2] / v[1] - 1) for _, v in sorted(by.items()) if 1 in v and 2 in v]


def below(runs: list[RunRecord], fifo: list[RunRecord], metric: Metric) -> float:
    """The reduction against FIFO over the seeds' means (%)."""
    mine, base = seed_means(runs, metric), seed_means(fifo, metric)
    return 100 * (1 - statistics.mean(mine.values()) / statistics.mean(base.values()))


def table(name: str, base: Path, policy: str) -> list[str]:
    """The lines of one pair of folders (``name`` and ``name-inf``)."""
    big = load(base / f"{name}-inf").get(policy)
    runs = load(base / name) if big else {}
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
        "|---|---:|" + "---:|" * len(seeds) + "---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, rs in rows.items():
        m = seed_means(rs)
        if sorted(m) != seeds:
            sys.exit(f"{name}: {p} ran seeds {sorted(m)}, FIFO {seeds}")
        per = [100 * (1 - m[s] / fifo[s]) for s in seeds]
        tot, norm = (below(rs, runs["fifo"], f) for f in (mean_latency, per_run))
        most = max((x for x in map(referenced, rs) if x is not None), default=None)

        def avg(key: str, rs: list[RunRecord] = rs) -> float:
            return statistics.mean(r.counters.get(key, 0) for r in rs)

        lines.append(
            f"| {p} | {pool(rs[0])} | "
            + " | ".join(f"{m[s]:.2f}" for s in seeds)
            + f" | {', '.join(f'{x:.1f}' for x in per)} | {tot:.1f} | {norm:.1f}"
            + f" | {', '.join(f'{x:.1f}' for x in spreads(rs)) or '-'}"
            + f" | {avg('cached_prompt_tokens') / 1000:.0f}K | {avg('grants'):.0f}"
            + f" | {avg('headroom_refusals'):.0f} | {avg('denials'):.0f}"
            + f" | {'-' if most is None else most} |"
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
        a.md.write_text(text + "\n")


if __name__ == "__main__":
    main()
