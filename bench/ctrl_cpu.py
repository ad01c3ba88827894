"""Controller CPU, LADS (and lads-adaptive) against FIFO: ``ctrl CPU s`` per run, ratios, A/A.

``ctrl CPU s`` (``controller_cpu_s`` of a run file) is the sender's CPU time
inside ``policy.choose`` and the policy's hooks (``decision_cpu_s``), plus the
engine thread's CPU in lease commands, queries and ticks (``command_cpu_s``),
plus its CPU building the states it publishes after steps (``publish_cpu_s``),
plus its CPU in the lease work inside vLLM's ``schedule()`` (expiry, refill,
handoff, the session order; ``schedule_cpu_s``; ``Runtime.controller_cpu``).
Run files written before a part was counted lack it and print ``-`` for it:
before the third, ``ctrl CPU s`` is the first two parts only (and hooks sat
outside ``decision_cpu_s``); before the fourth, the first three.
Each run is one ``ladsd replay`` process, as the tables' runs are. Repeat ``r``
runs the policies rotated by ``r - 1`` (rotation); a policy's repeats are its
A/A pair. One dilation for the pass: the first run measures it, every later run
is given it (``--dilation``). Prints one line per run (with both parts), each
policy's ratio of the means to FIFO's, the A/A ratios and the wall time;
``--json`` writes the commit, argv, CPU model and flags (``result_head``) with
every run's dtype, dilation and decision counters. Measures; never asserts.
Run it alone on the machine: other load moves CPU seconds.
``--from FOLDER --tag TAG`` runs nothing: it reads the run files a pass already
wrote there (or their ``runs.tar.xz``) and prints the same parts and ratios over
every seed and repeat of the listed policies.

    .venv/bin/python bench/ctrl_cpu.py --profile smoke
    .venv/bin/python bench/ctrl_cpu.py --from bench/results/issue23-pass/captured-scaled \
        --tag captured-scaled-cpu
    .venv/bin/python bench/ctrl_cpu.py --profile cpu --workload controlled --json /tmp/ctrl.json
    .venv/bin/python bench/ctrl_cpu.py --profile cpu --workload captured-scaled --kv-blocks 2300 \
        --policies fifo,lads-adaptive --dilation 1.0
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, result_head  # noqa: E402
from rerender import Subset, runs_of  # noqa: E402

from ladsd.metrics.events import CPU_PARTS  # noqa: E402
from ladsd.metrics.summary import repeat_of  # noqa: E402

POLICIES = ("fifo", "lads", "lads-adaptive")  # FIFO first: the others' ratios are to it
PARTS = CPU_PARTS  # ctrl CPU s = their sum (of those a run file has)
# Decision counters kept per run: the same choices show as the same counts.
COUNTERS = (
    "controller_cpu_s",
    "decision_cpu_s",  # its sender part (policy.choose)
    "command_cpu_s",  # its engine-thread part (lease commands, queries, ticks)
    "publish_cpu_s",  # its engine-thread part in the states published after steps
    "schedule_cpu_s",  # its engine-thread part inside vLLM's schedule()
    "evaluations",
    "grants",
    "denials",
    "headroom_refusals",
    "handoffs",
    "revocations",
    "promotions",
    "fallbacks",
    "link_frames",
)


def order(repeat: int, policies: tuple[str, ...] = POLICIES) -> tuple[str, ...]:
    """Repeat 1 in the listed order, repeat ``r`` rotated left by ``r - 1``."""
    k = (repeat - 1) % len(policies)
    return policies[k:] + policies[:k]


def ladsd() -> list[str]:
    exe = Path(sys.executable).with_name("ladsd")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "from cli.main import main; main()"]


def replay(policy: str, a: argparse.Namespace, dilation: float | None, tmp: Path) -> dict:
    """One ``ladsd replay`` run; its run record (a dict) and the process wall time."""
    out = tmp / f"{policy}-{time.monotonic_ns()}.json"
    cmd = [*ladsd(), "replay", "--policy", policy, "--profile", a.profile]
    cmd += ["--workload", a.workload, "--seeds", str(a.seed), "--json", str(out)]
    if a.dtype:
        cmd += ["--dtype", a.dtype]
    if a.kv_blocks is not None:
        cmd += ["--kv-blocks", str(a.kv_blocks)]
    if dilation is not None:
        cmd += ["--dilation", repr(dilation)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-2000:]}")
    (rec,) = orjson.loads(out.read_bytes())
    rec["wall_s"] = wall
    return rec


def read(folder: Path, tag: str, policies: tuple[str, ...]) -> list[dict[str, Any]]:
    """The rows of ``policies``' runs of ``tag`` in ``folder`` (or its pack), by seed, repeat."""
    runs = runs_of(folder, tag, Subset(tag, policies=policies))
    return [
        row(p, repeat_of(r), {"meta": r.meta, "counters": r.counters, "wall_s": None})
        for p in policies
        for r in runs.get(p, [])
    ]


def summary(rows: list[dict[str, Any]], policies: tuple[str, ...]) -> None:
    """Per policy: runs, mean ctrl CPU (min-max), its parts, the ratio to FIFO."""
    missing = [p for p in policies if not any(r["policy"] == p for r in rows)]
    if missing:
        sys.exit(f"no runs of {', '.join(map(repr, missing))}")
    res = report(rows, policies)
    for p in policies:
        rs = [r for r in rows if r["policy"] == p]
        cpu = [r["controller_cpu_s"] for r in rs]
        part = {k: mean_or_none([r[k] for r in rs]) for k in PARTS}
        over = f"{res[f'{p}_over_fifo']:.2f}x" if p != "fifo" else "1.00x"
        print(
            f"{p:22s} {len(rs):2d} runs: ctrl CPU {statistics.mean(cpu):.3f} s "
            f"({min(cpu):.3f}-{max(cpu):.3f}; {parts(part)}) / FIFO {over}"
        )


def mean_or_none(xs: list[float | None]) -> float | None:
    """The mean, or None when a run file lacks the part (written before it was counted)."""
    return None if any(x is None for x in xs) else statistics.mean(x for x in xs if x is not None)


def parts(part: dict[str, Any]) -> str:
    """``decide D, engine E, publish P, schedule S`` (``-``: a part the run files lack)."""
    return ", ".join(
        f"{name} {'-' if part[k] is None else format(part[k], '.3f')}"
        for name, k in zip(("decide", "engine", "publish", "schedule"), PARTS, strict=True)
    )


def row(policy: str, repeat: int, rec: dict) -> dict[str, Any]:
    meta, c = rec["meta"], rec["counters"]
    return {
        "policy": policy,
        "repeat": repeat,
        "dtype": meta.get("dtype"),
        "dilation": meta.get("dilation"),
        "kappa_s": meta.get("kappa_s"),
        "wall_s": rec["wall_s"],
        **{k: c.get(k, 0) for k in COUNTERS},
        # None: a run file written before the part was counted.
        **{k: c.get(k) for k in PARTS[2:]},
    }


def ratio(x: float, y: float) -> float:
    return x / y if y > 0 else float("nan")


def report(rows: list[dict[str, Any]], policies: tuple[str, ...]) -> dict[str, float]:
    """Each policy's mean ctrl CPU over FIFO's (``<policy>_over_fifo``), and its A/A
    (repeat 2 / repeat 1)."""
    cpu = {p: [r["controller_cpu_s"] for r in rows if r["policy"] == p] for p in policies}
    fifo = statistics.mean(cpu["fifo"])
    out = {f"{p}_over_fifo": ratio(statistics.mean(cpu[p]), fifo) for p in policies[1:]}
    for p, xs in cpu.items():
        if len(xs) >= 2:
            out[f"aa_{p}"] = ratio(xs[1], xs[0])
    return out


def parse_policies(text: str) -> tuple[str, ...]:
    names = tuple(x for x in text.split(",") if x)
    if not names or names[0] != "fifo" or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError("a list of distinct policies that starts with fifo")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="smoke", help="ladsd profile (smoke, cpu, ...)")
    ap.add_argument("--workload", default="controlled")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="runs per policy (A/A: >= 2)")
    ap.add_argument("--dtype", default=None, help="engine dtype [default: the profile's]")
    ap.add_argument("--kv-blocks", type=int, default=None, help="KV pool (captured-scaled: 2300)")
    ap.add_argument("--dilation", type=float, default=None, help="[default: measured once]")
    ap.add_argument("--policies", type=parse_policies, default=POLICIES, help="fifo first")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    ap.add_argument("--from", dest="src", type=Path, default=None, help="read a pass's runs")
    ap.add_argument("--tag", default="", help="with --from: the run files' prefix")
    a = ap.parse_args()
    if a.src:
        if not a.tag:
            ap.error("--from needs --tag (the run files' prefix, e.g. captured-scaled-cpu)")
        summary(read(a.src, a.tag, a.policies), a.policies)
        return
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    dilation = a.dilation
    with tempfile.TemporaryDirectory(prefix="ctrl-cpu-") as tmp:
        for rep in range(1, a.repeats + 1):
            for pol in order(rep, a.policies):
                rec = replay(pol, a, dilation, Path(tmp))
                dilation = rec["meta"].get("dilation", dilation) if dilation is None else dilation
                rows.append(row(pol, rep, rec))
                r = rows[-1]
                print(
                    f"{pol:13s} r{rep}: ctrl CPU {r['controller_cpu_s']:.3f} s "
                    f"({parts(r)}), "
                    f"{r['evaluations']:.0f} evaluations, {r['grants']:.0f} grants, "
                    f"{r['promotions']} promotions (run {r['wall_s']:.0f} s)",
                    flush=True,
                )
    res = report(rows, a.policies)
    wall = time.perf_counter() - t0
    aa = ", ".join(f"{p} {res[f'aa_{p}']:.2f}" for p in a.policies if f"aa_{p}" in res)
    for p in a.policies[1:]:
        print(f"{p} / FIFO ctrl CPU: {res[f'{p}_over_fifo']:.2f}x")
    print(f"A/A: {aa or 'n/a'}")
    print(f"wall time {wall:.0f} s")
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    doc = result_head("ctrl_cpu", stamp) | {
        "profile": a.profile,
        "flags": {
            "workload": a.workload,
            "seed": a.seed,
            "repeats": a.repeats,
            "dtype": a.dtype,
            "kv_blocks": a.kv_blocks,
            "policies": list(a.policies),
        },
        "dilation": dilation,
        "runs": rows,
        **res,
        "wall_s": wall,
    }
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
