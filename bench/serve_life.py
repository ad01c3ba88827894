"""Start-up, idle CPU and memory of `ladsd serve` beside stock vLLM's OpenAI server.

Usage (from the repository root; one server runs at a time, the order alternates)::

    .venv/bin/python bench/serve_life.py --repeats 3 --idle-s 60 --rounds 20
    .venv/bin/python bench/serve_life.py --repeats 1 --idle-s 10 --rounds 2 --no-pin  # a try

Both servers serve the same model (default SmolLM2-135M-Instruct, real weights, from
``ladsd.engine.models.model_path``) with the same engine settings: the ``--profile``'s
(default ``cpu``) max_model_len, block size, step tokens, pool (``--kv-blocks``),
batch (``--max-num-seqs``), dtype (``--dtype``, default ``auto``, resolved here by
ladsd's rule, ``ladsd.engine.cpu``: bfloat16 where the CPU has native bf16, else
float32, and passed explicitly to both), eager mode, 1 GiB of KV space, prefix caching
on. Stock vLLM runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script fails on the CPU build) with its own default of an engine core in a
child process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``); ``ladsd serve`` steps its engine
in-process (it sets that variable to 0). Hub access is off (``HF_HUB_OFFLINE=1``).

Per start (figures, never assertions):

* time from spawn to the first 200 of ``/health`` and of ``/v1/models``;
* idle CPU: CPU seconds of the process and all its descendants (``/proc``) over
  ``--idle-s`` seconds after a warm-up request, reported per 10 s;
* RSS (sum over the process tree) after the warm-up and after ``--rounds`` rounds of
  ``--requests`` concurrent chat requests (distinct prompts every round).

ladsd's kappa: one bench-private ``$LADSD_HOME`` (models linked) for every start, so
the first start measures kappa and later ones read its cache (each run records
which); ``--cold-kappa`` gives every start a fresh home. ``ladsd serve`` runs from a
``git archive`` of HEAD unless ``--no-pin``. Prints a table; writes JSON (git commit,
flags, engine settings, dtype, CPU model and flags, every run) to
bench/results/serve-life/ or ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import free_port, pinned_tree, result_head  # noqa: E402
from _servers import (  # noqa: E402
    cpu_dict,
    engine_settings,
    ladsd_command,
    linked_home,
    stop,
    vllm_command,
)

from ladsd.config import PROFILES  # noqa: E402
from ladsd.engine import cpu  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "serve-life"
START_TIMEOUT_S = 900.0  # hang guard: a first start measures kappa on a slow CPU
REQUEST_TIMEOUT_S = 600.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
console = Console()


# ---- the process tree, from /proc ----------------------------------------------------


def tree(root: int) -> list[int]:
    """``root`` and every live descendant."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parent[int(d.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def cpu_s(pids: list[int]) -> float:
    """utime + stime (+ reaped children's) of ``pids``, in seconds."""
    total = 0
    for p in pids:
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2 :].split()
        total += sum(int(x) for x in f[11:15])
    return total / CLK_TCK


def rss_mib(pids: list[int]) -> float:
    kib = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    kib += int(line.split()[1])
        except OSError:
            continue
    return kib / 1024


async def first_200(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url) as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def chat(http: aiohttp.ClientSession, base: str, model: str, text: str, n: int) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    body |= {"max_tokens": n, "temperature": 0}
    async with http.post(f"{base}/v1/chat/completions", json=body) as r:
        out = await r.text()
        if r.status != 200:
            raise SystemExit(f"{base}: chat answered {r.status}: {out[:300]}")


async def one_start(
    args: argparse.Namespace, server: str, e: dict[str, Any], work: Path, home: Path
) -> dict[str, Any]:
    """Spawn ``server``, time its first 200s, warm it up, idle, load it, stop it."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if server == "ladsd":
        cmd, cwd = ladsd_command(args, port, e), args.src
        env |= {"LADSD_HOME": str(home), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    else:
        cmd, cwd = vllm_command(args, port, e), ROOT
        env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    log = work / f"{server}-{port}.log"
    with open(log, "wb") as f:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    run: dict[str, Any] = {"server": server, "log": str(log)}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            ready: dict[str, float] = {}
            while len(ready) < 2:
                if proc.poll() is not None:
                    raise SystemExit(f"{server} exited {proc.returncode}; see {log}")
                if time.monotonic() - t0 > START_TIMEOUT_S:
                    raise SystemExit(f"{server}: no 200 within {START_TIMEOUT_S:.0f} s; see {log}")
                for path in ("/health", "/v1/models"):
                    if path not in ready and await first_200(http, base + path):
                        ready[path] = time.monotonic() - t0
                await asyncio.sleep(0.05)
            run["health_s"], run["models_s"] = ready["/health"], ready["/v1/models"]
            await chat(http, base, args.model, "Hello! Say something.", 16)
            await asyncio.sleep(args.settle_s)
            run["rss_warm_mib"] = rss_mib(tree(proc.pid))
            pids = tree(proc.pid)
            c0 = cpu_s(pids)
            await asyncio.sleep(args.idle_s)
            run["idle_cpu_s_per_10s"] = (cpu_s(tree(proc.pid)) - c0) * 10.0 / args.idle_s
            for r in range(args.rounds):
                texts = [f"Round {r}, question {i}: name a colour." for i in range(args.requests)]
                await asyncio.gather(*(chat(http, base, args.model, t, 32) for t in texts))
            await asyncio.sleep(args.settle_s)
            run["rss_rounds_mib"] = rss_mib(tree(proc.pid))
    finally:
        run["exit"] = stop(proc)
    if server == "ladsd":
        text = log.read_text(errors="replace")
        run["kappa_from"] = "cache" if "(cached:" in text else "measured"
    return run


# ---- report ----------------------------------------------------------------------------

METRICS = (
    ("health_s", "first 200 /health (s)"),
    ("models_s", "first 200 /v1/models (s)"),
    ("idle_cpu_s_per_10s", "idle CPU (s per 10 s)"),
    ("rss_warm_mib", "RSS after warm-up (MiB)"),
    ("rss_rounds_mib", "RSS after rounds (MiB)"),
)


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for server in ("ladsd", "vllm"):
        mine = [r for r in runs if r["server"] == server]
        out[server] = {
            k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
            for k, _ in METRICS
            if (v := [r[k] for r in mine if k in r])
        }
    return out


def print_table(s: dict[str, dict[str, dict[str, float]]], repeats: int) -> None:
    t = Table(title=f"ladsd serve vs vLLM api_server, median (min-max) of {repeats}")
    t.add_column("figure")
    for server in s:
        t.add_column(server, justify="right")
    for k, label in METRICS:
        cells = []
        for server in s:
            x = s[server].get(k)
            cells.append("-" if x is None else f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})")
        t.add_row(label, *cells)
    console.print(t)


def model_dtype(path: str) -> str | None:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("dtype") or config.get("torch_dtype")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=60.0, help="idle CPU window (s)")
    ap.add_argument("--settle-s", type=float, default=2.0, help="wait before RSS and idle")
    ap.add_argument("--rounds", type=int, default=20, help="request rounds before the last RSS")
    ap.add_argument("--requests", type=int, default=8, help="concurrent chat requests a round")
    ap.add_argument("--profile", default="cpu", help="ladsd's profile: the engine settings")
    ap.add_argument("--model", default="smollm2-135m", help="a model profile with real weights")
    ap.add_argument("--policy", default="lads", help="ladsd serve --policy")
    ap.add_argument("--kv-blocks", type=int, default=None, help="KV pool (blocks) of both")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument(
        "--dtype",
        choices=cpu.DTYPES,
        default=None,
        help="engine dtype of both [default: the profile's, auto]; auto resolves by "
        "ladsd's rule (native bf16: bfloat16, else float32)",
    )
    ap.add_argument("--servers", default="ladsd,vllm", help="which to run (first goes first)")
    ap.add_argument("--cold-kappa", action="store_true", help="a fresh LADSD_HOME every start")
    ap.add_argument("--no-pin", action="store_true", help="ladsd from the working tree, not HEAD")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    e = engine_settings(args)
    servers = args.servers.split(",")
    work = Path(tempfile.mkdtemp(prefix="ladsd-bench-life-"))
    args.src = ROOT if args.no_pin else pinned_tree(work)
    shared_home = linked_home(work)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or RESULTS / f"serve-life-{args.profile}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        **result_head("serve_life", stamp),
        "flags": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "engine": e,
        "dtype": {
            "asked": args.dtype or PROFILES[args.profile].engine.dtype,
            "resolved": e["dtype"],  # what both servers were given
            "model_config": model_dtype(e["model_path"]),
        },
        "machine": {"platform": platform.platform(), "cpu": cpu_dict()},
        "ladsd_from": "working tree" if args.no_pin else "HEAD (git archive)",
        "runs": [],
    }
    for k in range(args.repeats):
        order = servers if k % 2 == 0 else servers[::-1]  # alternate: drift hits both
        for server in order:
            home = linked_home(work) if args.cold_kappa else shared_home
            console.print(f"repeat {k + 1}/{args.repeats}: {server} ...")
            run = await one_start(args, server, e, work, home)
            run["repeat"] = k
            doc["runs"].append(run)
            console.print({m: round(v, 3) for m, v in run.items() if isinstance(v, float)})
            out.write_text(json.dumps(doc, indent=1))  # partial results survive a failure
    doc["summary"] = summary(doc["runs"])
    out.write_text(json.dumps(doc, indent=1))
    print_table(doc["summary"], args.repeats)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
