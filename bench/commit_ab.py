"""Two or more commits of the same policies side by side: latency and ctrl CPU per seed.

Reads ``ladsd compare`` folders named ``VARIANT-WORKLOAD-sSEED`` (in ``FOLDER``, or its
``runs.tar.xz``), each run from a worktree of one commit (``VARIANT``), every policy
twice a seed at one given dilation. Per workload, seed and variant it prints FIFO's and
the policy's mean workflow latency (the mean of the two repeats), the policy's
reduction against FIFO, the A/A pair spreads (|repeat 2 / repeat 1 - 1|, FIFO / the
policy), ctrl CPU per run (FIFO's and the policy's means, their ratio) and its four
parts (decide / commands / published states / lease work in ``schedule()``; ``-``
where a run file predates the part), the policy's grants and cached prompt tokens,
the engine steps per run (FIFO / the policy; ``-`` before stop 54: every step runs the
lease work inside ``schedule()`` and a publication check), ctrl CPU per engine step
(µs, FIFO / the policy) and its ratio (the policy's over FIFO's: the ctrl CPU ratio with
the step counts taken out; not every part scales with steps, so it is a view of the
gap, not the goal's measure) and the commit each variant's run files name;
``--counters`` adds columns of the policy's own run-file counters (the mean over its
runs, ``-`` where a run file lacks one). Measures nothing; ``--md`` writes what it
prints.

    .venv/bin/python bench/commit_ab.py bench/results/issue23-ctrl48
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ctrl_cpu import PARTS, mean_or_none  # noqa: E402
from rerender import run_dir, run_files  # noqa: E402

from ladsd.metrics import events  # noqa: E402
from ladsd.metrics.events import RunRecord  # noqa: E402
from ladsd.metrics.summary import mean_latency, repeat_of  # noqa: E402

FOLDER = re.compile(r"^(?P<variant>[a-z0-9]+)-(?P<workload>[a-z0-9]+)-s(?P<seed>\d+)$")


def load(folder: Path) -> dict[tuple[str, str, int], dict[str, list[RunRecord]]]:
    """(workload, variant, seed) -> policy -> its runs (repeat order)."""
    out: dict[tuple[str, str, int], dict[str, list[RunRecord]]] = {}
    root = run_dir(folder)
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        m = FOLDER.match(sub.name)
        if m is None:
            continue
        key = (m["workload"], m["variant"], int(m["seed"]))
        runs = out.setdefault(key, {})
        for path in run_files(sub):
            r = events.load(path)
            if r.seed != key[2]:
                sys.exit(f"{path}: seed {r.seed} in a folder named for seed {key[2]}")
            runs.setdefault(r.policy, []).append(r)
    for runs in out.values():
        for p, rs in runs.items():
            rs.sort(key=repeat_of)
            if [repeat_of(r) for r in rs] != list(range(1, len(rs) + 1)):
                sys.exit(f"{p}: repeats {[repeat_of(r) for r in rs]}, not 1..n once each")
    return out


def spread(rs: list[RunRecord]) -> str:
    return f"{abs(mean_latency(rs[1]) / mean_latency(rs[0]) - 1) * 100:.1f}" if len(rs) > 1 else "-"


def parts(rs: list[RunRecord]) -> str:
    """decide / commands / states / schedule, each the mean over ``rs`` (``-``: a run
    lacks it)."""
    means = (mean_or_none([r.counters.get(k) for r in rs]) for k in PARTS)
    return " / ".join("-" if m is None else f"{m:.3f}" for m in means)


def steps(rs: list[RunRecord]) -> str:
    """Engine steps per run, the mean over ``rs`` (``-``: a run file lacks them)."""
    return counter(rs, "engine_steps", ".0f")


def per_step(rs: list[RunRecord]) -> float | None:
    """Mean ctrl CPU over mean engine steps, in µs (None: a run file lacks the steps)."""
    n = mean_or_none([r.counters.get("engine_steps") for r in rs])
    if not n:
        return None
    return statistics.mean(r.counters["controller_cpu_s"] for r in rs) / n * 1e6


def per_steps(fifo: list[RunRecord], pol: list[RunRecord]) -> tuple[str, str]:
    """The two cells ``F / P`` and ``ratio`` of :func:`per_step` (``-`` where steps are missing)."""
    f, p = per_step(fifo), per_step(pol)
    if f is None or p is None:
        return "-", "-"
    return f"{f:.0f} / {p:.0f}", f"{p / f:.2f}x"


def counter(rs: list[RunRecord], key: str, fmt: str = "g") -> str:
    """The mean of one run-file counter over ``rs`` (``-``: a run file lacks it)."""
    m = mean_or_none([r.counters.get(key) for r in rs])
    return "-" if m is None else format(m, fmt)


def commit(rs: list[RunRecord]) -> str:
    shas = {str(r.meta.get("git", "?"))[:7] for r in rs}
    return ",".join(sorted(shas))


def report(folder: Path, policy: str, counters: tuple[str, ...] = ()) -> list[str]:
    data = load(folder)
    extra = "".join(f" {k} |" for k in counters)
    lines = [
        "| workload | seed | variant | commit | FIFO s | policy s | below FIFO % | pairs % "
        "| ctrl CPU s (FIFO / policy) | ratio | parts FIFO | parts policy | grants | cached "
        "| steps | µs/step (FIFO / policy) | per step |" + extra,
        "|---|---:|---|---|---:|---:|---:|---|---|---:|---|---|---:|---:|---|---|---:|"
        + "---:|" * len(counters),
    ]
    for (wl, var, seed), runs in sorted(data.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        fifo, pol = runs.get("fifo"), runs.get(policy)
        if not fifo or not pol:
            sys.exit(f"{var}-{wl}-s{seed}: needs fifo and {policy}")
        f = statistics.mean(map(mean_latency, fifo))
        p = statistics.mean(map(mean_latency, pol))
        cf = statistics.mean(r.counters["controller_cpu_s"] for r in fifo)
        cp = statistics.mean(r.counters["controller_cpu_s"] for r in pol)
        grants = statistics.mean(r.counters.get("grants", 0.0) for r in pol)
        cached = statistics.mean(r.counters.get("cached_prompt_tokens", 0.0) for r in pol)
        us, per = per_steps(fifo, pol)
        lines.append(
            f"| {wl} | {seed} | {var} | {commit(fifo + pol)} | {f:.2f} | {p:.2f} "
            f"| {100 * (1 - p / f):.1f} | {spread(fifo)} / {spread(pol)} | {cf:.3f} / {cp:.3f} "
            f"| {cp / cf:.2f}x | {parts(fifo)} | {parts(pol)} | {grants:.0f} "
            f"| {cached / 1e3:.0f}K | {steps(fifo)} / {steps(pol)} | {us} | {per} |"
            + "".join(f" {counter(pol, k)} |" for k in counters)
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="holds VARIANT-WORKLOAD-sSEED/ (or a runs.tar.xz)")
    ap.add_argument("--policy", default="lads-adaptive", help="compared with fifo")
    ap.add_argument("--md", type=Path, default=None, help="also write the table here")
    ap.add_argument(
        "--counters",
        default="",
        help="comma-separated run-file counters of the policy to add as columns "
        "(e.g. sessions_kept,session_order_computed)",
    )
    a = ap.parse_args()
    lines = report(a.folder, a.policy, tuple(k for k in a.counters.split(",") if k))
    print("\n".join(lines))
    if a.md:
        a.md.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
