"""Smoke replays of every registered run name on each workload, seed 1: their counters.

"No behaviour change" (issue 20) as a check: run this on the old code and on the
new one, and diff. One ``ladsd compare --profile smoke`` per workload runs every
name of the registry (``ladsd/delivery/registry.py``: the delivery policies and the
peers) once at dilation 1 (a fixed link, so no measured kappa scales the time
constants), and each run's counters are kept: the run file's ``counters`` plus
what its calls add up to (calls, cached / prompt / output tokens, frames and
their bytes, lease samples). Latencies are not counters and are left out.

    .venv/bin/python bench/smoke_counters.py --out /tmp/new.json
    .venv/bin/python bench/smoke_counters.py --diff old-1.json old-2.json new.json

``--diff A B [C]``: A and B are two runs of the same code (what varies run to
run); C, if given, is the other code, compared with A. The code under test is the
one this file sits in (its parent folder is run as the repository), so a copy of
the old tree runs its own ``cli`` and ``ladsd``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tree this file sits in, before any installed ladsd
Counters = dict[str, dict[str, float]]  # "workload/policy" -> counter -> value
# Counters measured in seconds of CPU or wall time: expected to vary run to run.
TIMED = ("controller_cpu_s", "protection_block_seconds", "pin_block_seconds", "lease_samples")


def names() -> list[str]:
    """Every run name of the registry, in its order."""
    from ladsd.delivery.registry import REGISTRY

    return [e.name for e in REGISTRY]


def workloads() -> tuple[str, ...]:
    from ladsd.workloads.factory import WORKLOADS

    return tuple(WORKLOADS)


def compare(workload: str, policies: list[str], out: Path) -> None:
    """One ``ladsd compare`` of ``policies`` on ``workload`` (smoke, seed 1, once each)."""
    cmd = [
        sys.executable, "-m", "cli.main", "compare", "--profile", "smoke",
        "--workload", workload, "--policies", ",".join(policies), "--seeds", "1",
        "--repeats", "1", "--dilation", "1", "--out", str(out), "--no-resume",
    ]  # fmt: skip
    env = {"PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    res = subprocess.run(
        cmd, cwd=ROOT, env=os.environ | env, capture_output=True, text=True, timeout=3600
    )
    if res.returncode != 0:
        sys.exit(f"compare {workload} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")


def run_counters(run: dict[str, Any]) -> dict[str, float]:
    """A run file's counters and the sums over its calls (no latencies)."""
    calls = [c for w in run["workflows"] for c in w["calls"]]
    sums = {
        "workflows": len(run["workflows"]),
        "calls": len(calls),
        "cold_calls": sum(1 for c in calls if c["is_cold"]),
        "sum_prompt_tokens": sum(c["prompt_tokens"] for c in calls),
        "sum_cached_tokens": sum(c["cached_tokens"] for c in calls),
        "sum_output_tokens": sum(c["output_tokens"] for c in calls),
        "frames": sum(1 for c in calls if c["frame_bytes"]),
        "frame_bytes": sum(c["frame_bytes"] for c in calls),
        "payload_bytes": sum(c["payload_bytes"] for c in calls),
        "lease_samples": len(run.get("lease_samples", ())),
    }
    return {**{k: float(v) for k, v in sorted(run["counters"].items())}, **sums}


def collect(out: Path) -> Counters:
    """Every run file of a compare folder, by ``workload/policy``."""
    found: Counters = {}
    for p in sorted(out.glob("*-s1.json")):
        run = json.loads(p.read_bytes())
        found[f"{run['workload']}/{run['policy']}"] = run_counters(run)
    return found


def record(path: Path) -> None:
    policies = names()
    result: dict[str, Any] = {"root": str(ROOT), "policies": policies, "runs": {}}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="smoke-counters-") as tmp:
        for wl in workloads():
            t = time.monotonic()
            compare(wl, policies, Path(tmp) / wl)
            got = collect(Path(tmp) / wl)
            missing = [p for p in policies if f"{wl}/{p}" not in got]
            if missing:
                sys.exit(f"{wl}: no run file for {missing}")
            result["runs"].update(got)
            print(f"{wl}: {len(got)} runs in {time.monotonic() - t:.0f} s", flush=True)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}: {len(result['runs'])} runs, {result['wall_s']} s")


def changes(a: Counters, b: Counters) -> set[tuple[str, str]]:
    """(run, counter) pairs, in both files, whose values differ."""
    common = set(a) & set(b)
    return {(r, k) for r in common for k in set(a[r]) & set(b[r]) if a[r][k] != b[r][k]}


def differing(a: Counters, b: Counters) -> dict[str, list[str]]:
    """counter -> the runs (in both) where it differs between ``a`` and ``b``."""
    out: dict[str, list[str]] = {}
    for run, k in sorted(changes(a, b), key=lambda rk: (rk[1], rk[0])):
        out.setdefault(k, []).append(f"{run} ({a[run][k]:g} vs {b[run][k]:g})")
    return out


def one_sided(a: Counters, b: Counters) -> list[str]:
    """Runs and counters that only one of ``a``, ``b`` has (a new policy or counter)."""
    out = [f"run {r} only in {'A' if r in a else 'the other'}" for r in sorted(set(a) ^ set(b))]
    keys = {k for r in set(a) & set(b) for k in set(a[r]) ^ set(b[r])}
    return out + [f"counter {k} in one file only" for k in sorted(keys)]


def show(title: str, diff: dict[str, list[str]], extra: list[str]) -> None:
    print(f"== {title}: {len(diff)} counter(s) differ")
    for k, runs in diff.items():
        tag = " (timing)" if k in TIMED else ""
        more = " ..." if len(runs) > 4 else ""
        print(f"  {k}{tag}: {len(runs)} run(s): " + "; ".join(runs[:4]) + more)
    for line in extra:
        print(f"  ({line})")


def diff(paths: list[Path]) -> int:
    """Print what differs; exit 1 if the other code (C) differs beyond A vs B's variation."""
    runs = [json.loads(p.read_text())["runs"] for p in paths]
    ab = differing(runs[0], runs[1])
    show(f"A vs B ({paths[0].name} vs {paths[1].name}: run to run)", ab, one_sided(*runs[:2]))
    if len(runs) < 3:
        return 0
    ac = differing(runs[0], runs[2])
    show(f"A vs C ({paths[0].name} vs {paths[2].name}: old vs new)", ac,
         one_sided(runs[0], runs[2]))  # fmt: skip
    # A (run, counter) that varied between A and B may differ in C too; no other may.
    varied = changes(runs[0], runs[1])
    beyond = sorted(rk for rk in changes(runs[0], runs[2]) - varied if rk[1] not in TIMED)
    text = ", ".join(f"{k} ({r})" for r, k in beyond)
    print("beyond run-to-run variation: " + (text or "none"))
    return 1 if beyond else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write this tree's counters here (JSON)")
    ap.add_argument("--diff", type=Path, nargs="+", metavar="F", help="A B [C]: compare files")
    a = ap.parse_args()
    if a.diff:
        if not 2 <= len(a.diff) <= 3:
            ap.error("--diff takes two or three files")
        sys.exit(diff(a.diff))
    if not a.out:
        ap.error("give --out F.json or --diff A B [C]")
    record(a.out)


if __name__ == "__main__":
    main()
