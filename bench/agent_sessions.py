"""Real coding-agent sessions (cc-traces) on `ladsd serve`, side by side with stock vLLM.

Usage (from the repository root, nothing else running)::

    .venv/bin/python bench/agent_sessions.py            # the comparison (~45 min here)
    .venv/bin/python bench/agent_sessions.py --plain    # the overhead check (~15 min)
    .venv/bin/python bench/agent_sessions.py --seeds 1 --servers vllm,lads --no-pin  # a try

The workload (ladsd/workloads/sessions.py, its docstring says what is kept from the
trace and what is synthesised) is cut from ``../shared/data/cc-traces`` (``--traces``):
``--sessions`` conversations at once (their subagents on top), token scale
``--token-scale``, ``--max-turns`` turns, tool waits = ``think_time`` x
``--time-factor`` (capped at ``--max-tool-wait-s``). Token ids are word indices: a
block's ids pick words of the model's own vocabulary that are one token each with
their leading space (" parsley"), so the text of a block tokenises back to exactly its
64 ids, and equal ``hash_ids`` give equal token blocks on both servers.

The driver is the official ``openai`` client (``AsyncOpenAI``, streaming, so TTFT is
measured), one task per session, ``x-session-id`` on every request. Turn 0 sends the
first prompt as a user message; every reply is a call of the one tool ``run``
(``tool_choice`` names it; its one argument is a string of at most 40 characters, so a
call always closes within ``max_tokens`` 64); after the recorded tool wait the next
turn sends the new blocks of the next recorded prompt as the tool's result (when the
trace's next prompt does not extend the previous one, the session starts a new
conversation with it). Greedy decoding. With ``intent``, each ladsd request carries the
recorded tool time of the wait that follows it (the chat body's ``intent`` field, the
HEAR intent) so the daemon knows it before the reply ends; without it the daemon learns
each session's tool times from the session itself.

Servers (``--servers``; one at a time, each a subprocess on a free loopback port, the
order rotated every repeat, each configuration repeated): ``vllm`` (stock
``python -m vllm.entrypoints.openai.api_server``, prefix caching on), ``fifo``, ``lads``,
``lads-aa`` (an identical second ``lads``: the A/A floor), ``lads-nointent``,
``lads-fixed`` (``--lease-rule fixed``: the paper's fixed ``l``), ``ttl-pin``,
``hear-session``. Every server gets the same model, KV pool in blocks, max_num_seqs,
batched tokens, max_model_len, block size and dtype (``bench/_servers.py``); each
server's pool is read back as that server reports it (ladsd ``/v1/engine/state``
``num_gpu_blocks``, vLLM ``/metrics`` ``vllm:cache_config_info``) and the run stops when
they differ. ladsd runs from a ``git archive`` of HEAD unless ``--no-pin``.

Reported per run: mean session latency (arrival -> last reply, tool waits included),
mean session model time (the sum of its turn latencies: what the server changes),
mean turn latency, mean and p50 TTFT, cached-token fraction (``cached_tokens`` /
``prompt_tokens`` as each server reports them), ladsd's lease counters and exit code
(0 = lease audit balanced), vLLM's preemptions. Per seed and repeat the ratio of each
server to ``vllm`` and the A/A pair's ratio. JSON (git commit, flags, machine, dtype,
CPU, workload, every turn) to bench/results/agents/. Never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import free_port, pinned_tree, result_head  # noqa: E402
from _servers import cpu_dict, engine_settings, linked_home, stop, vllm_command  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from ladsd.workloads import cc_traces  # noqa: E402
from ladsd.workloads import sessions as wl  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "agents"
START_TIMEOUT_S = 900.0  # hang guard: a first start may measure kappa
REQUEST_TIMEOUT_S = 600.0
TOOL = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command in the repository.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "maxLength": 40}},
            "required": ["cmd"],
            "additionalProperties": False,
        },
    },
}
TURN_FIELDS = ("latency_s", "ttft_s", "prompt_tokens", "cached_tokens", "completion_tokens")
CHOICE = {"type": "function", "function": {"name": "run"}}
console = Console()


@dataclass(frozen=True)
class Server:
    name: str
    kind: str  # vllm | ladsd | cluster (`ladsd cluster`: replicas behind vllm-router)
    flags: tuple[str, ...] = ()
    intent: bool = False
    env: tuple[tuple[str, str], ...] = ()  # on top of the kind's environment
    routing: str | None = None  # the router's policy (cluster only)


def cluster(name: str, routing: str, policy: str) -> Server:
    """Two replicas, each with half of ``--kv-blocks`` and half of the cores."""
    return Server(name, "cluster", ("--policy", policy), policy == "lads", routing=routing)


ROUTINGS = (("ch", "consistent_hash"), ("rr", "round_robin"), ("ca", "cache_aware"))
SERVERS = {
    "vllm": Server("vllm", "vllm"),
    # vLLM with its engine core in the server's process, as ladsd runs its engine: on 2
    # cores this isolates what the stock two-process layout costs.
    "vllm-inproc": Server("vllm-inproc", "vllm", env=(("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),)),
    "fifo": Server("fifo", "ladsd", ("--policy", "fifo")),
    "fifo-aa": Server("fifo-aa", "ladsd", ("--policy", "fifo")),
    "lads": Server("lads", "ladsd", ("--policy", "lads"), True),
    "lads-aa": Server("lads-aa", "ladsd", ("--policy", "lads"), True),
    "lads-nointent": Server("lads-nointent", "ladsd", ("--policy", "lads")),
    "lads-fixed": Server(
        "lads-fixed", "ladsd", ("--policy", "lads", "--lease-rule", "fixed"), True
    ),
    "ttl-pin": Server("ttl-pin", "ladsd", ("--policy", "ttl-pin"), True),
    "hear-session": Server("hear-session", "ladsd", ("--policy", "hear-session"), True),
    # Two replicas (issue 22): ch = consistent_hash on X-Session-ID, rr = round_robin,
    # ca = cache_aware (the router's default). ch-lads-aa is the A/A pair of ch-lads.
    **{
        f"{tag}-{pol}": cluster(f"{tag}-{pol}", routing, pol)
        for tag, routing in ROUTINGS
        for pol in ("lads", "fifo")
    },
    "ch-lads-aa": cluster("ch-lads-aa", "consistent_hash", "lads"),
}
REPLICAS = 2  # of every cluster server
SCALE_OUT = "ch-lads,ch-lads-aa,ch-fifo,rr-lads,rr-fifo,ca-lads,ca-fifo,lads,fifo"


# ---- text from token ids --------------------------------------------------------------


def one_token_words(model_path: str) -> list[str]:
    """Lower-case words that are one token with their leading space, by token id.

    Concatenated as ``" w1 w2 ..."`` they tokenise back to exactly their ids: the
    pre-tokeniser splits before every space-led word, so no merge crosses two words.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    out = []
    for piece, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        w = piece[1:]
        if piece.startswith("Ġ") and re.fullmatch(r"[a-z]{3,10}", w):
            if tok.encode(" " + w, add_special_tokens=False) == [i]:
                out.append(w)
    return out


def text(ids: tuple[int, ...], words: list[str]) -> str:
    return "".join(" " + words[i] for i in ids)


# ---- the driver -----------------------------------------------------------------------


async def one_turn(
    client: Any, model: str, sid: str, msgs: list[dict[str, Any]], intent_s: float | None
) -> dict[str, Any]:
    """One streamed request; its reply's tool call, TTFT, latency and usage."""
    extra: dict[str, Any] = {}
    if intent_s is not None:
        extra["intent"] = {"tool": "run", "expected_tool_s": round(intent_s, 3)}
    t0 = time.monotonic()
    ttft = None
    call = {"id": "", "name": "", "arguments": ""}
    usage = None
    content = ""
    stream = await client.chat.completions.create(
        model=model,
        messages=msgs,
        tools=[TOOL],
        tool_choice=CHOICE,
        max_tokens=64,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-session-id": sid},
        extra_body=extra or None,
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            if ttft is None and (d.content or d.tool_calls):
                ttft = time.monotonic() - t0
            content += d.content or ""
            for tc in d.tool_calls or []:
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] = tc.function.name or call["name"]
                    call["arguments"] += tc.function.arguments or ""
    latency = time.monotonic() - t0
    if usage is None:
        raise RuntimeError(f"{sid}: the stream ended without usage")
    details = usage.prompt_tokens_details
    return {
        "latency_s": latency,
        "ttft_s": ttft if ttft is not None else latency,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": (details.cached_tokens or 0) if details is not None else 0,
        "completion_tokens": usage.completion_tokens,
        "call": call if call["name"] else None,
        "content": content,
    }


def assistant(reply: dict[str, Any], k: int) -> dict[str, Any]:
    c = reply["call"]
    if c is None:  # no call came back (cannot happen with a named tool_choice): keep going
        return {"role": "assistant", "content": reply["content"] or "."}
    cid = c["id"] or f"call_{k}"
    fn = {"name": c["name"], "arguments": c["arguments"] or "{}"}
    call = {"id": cid, "type": "function", "function": fn}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


async def one_session(
    client: Any, model: str, s: wl.SessionSpec, words: list[str], tag: str, intent: bool, t0: float
) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + s.arrival - time.monotonic()))
    start = time.monotonic()
    sid = f"{tag}-{s.sid.replace('/', '.')}"
    msgs: list[dict[str, Any]] = []
    prev: tuple[int, ...] = ()
    turns = []
    for k, t in enumerate(s.turns):
        ids = t.prompt_ids
        if msgs and ids[: len(prev)] == prev:
            calls = msgs[-1].get("tool_calls") or [{"id": "call"}]
            new = text(ids[len(prev) :], words)
            msgs.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": new})
            kind = "extends"
        else:
            msgs = [{"role": "user", "content": text(ids, words)}]
            kind = "first" if k == 0 else "new"
        reply = await one_turn(client, model, sid, msgs, t.tool_wait_s if intent else None)
        msgs.append(assistant(reply, k))
        prev = ids
        rec = {"turn": k, "kind": kind, "tokens": len(ids), "tool_wait_s": t.tool_wait_s}
        turns.append(rec | {x: reply[x] for x in TURN_FIELDS})
        if t.tool_wait_s > 0:
            await asyncio.sleep(t.tool_wait_s)
    end = time.monotonic()
    model_s = sum(x["latency_s"] for x in turns)
    return {
        "sid": s.sid,
        "arrival": s.arrival,
        "latency_s": end - start,
        "model_s": model_s,
        "turns": turns,
    }


# ---- the servers ----------------------------------------------------------------------


def command(sv: Server, args: argparse.Namespace, e: dict[str, Any], port: int) -> list[str]:
    if sv.kind == "vllm":
        # Its stats stay on: /metrics carries the pool and the prefix-cache counters.
        cmd = [x for x in vllm_command(args, port, e) if x != "--disable-log-stats"]
        # A named tool_choice is structured output of the tool's parameters; vLLM still
        # wants tool parsing on (hermes: the parser is not used for a named choice).
        tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        return cmd + ["--enable-prompt-tokens-details", *tools]
    ladsd = [sys.executable, "-c", "from cli.main import app; app()"]
    pool, h = e["num_gpu_blocks_override"], args.h
    if sv.kind == "cluster":
        # The same total pool, split: each replica has 1/N of the blocks (and of H).
        pool, h = pool // REPLICAS, round(args.headroom * (pool // REPLICAS))
        cmd = ladsd + ["cluster", "--replicas", str(REPLICAS), "--port", str(port)]
        cmd += ["--routing", str(sv.routing)]
    else:
        cmd = ladsd + ["serve", "--port", str(port)]
    cmd += ["--profile", args.profile, "--model", args.model, "--dtype", e["dtype"]]
    cmd += ["--kv-blocks", str(pool), "--headroom-blocks", str(h)]
    cmd += ["--max-num-seqs", str(e["max_num_seqs"]), "--max-model-len", str(e["max_model_len"])]
    return cmd + list(sv.flags)


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    try:
        async with http.get(url) as r:
            return r.status, await r.text()
    except aiohttp.ClientError:
        return 0, ""


def vllm_metric(text: str, name: str) -> float:
    """Sum of the samples of counter ``name`` (``_total`` suffix allowed)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? ([0-9.eE+-]+)$", line)
        if m:
            total += float(m.group(1))
    return total


async def pool_of(http: aiohttp.ClientSession, sv: Server, base: str) -> int | None:
    """The KV pool in blocks as the server itself reports it (a cluster's: each replica's)."""
    if sv.kind != "vllm":
        _, body = await get(http, f"{base}/v1/engine/state")
        return json.loads(body).get("num_gpu_blocks") if body else None
    _, body = await get(http, f"{base}/metrics")
    m = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', body)
    return int(m.group(1)) if m else None


async def counters(http: aiohttp.ClientSession, sv: Server, base: str) -> dict[str, float]:
    if sv.kind != "vllm":
        _, body = await get(http, f"{base}/v1/engine/state")
        return dict(json.loads(body).get("counters", {})) if body else {}
    _, body = await get(http, f"{base}/metrics")
    names = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")
    return {n: vllm_metric(body, f"vllm:{n}") for n in names}


REPLICA_LINE = re.compile(r"replica (\S+): (http://\S+) \(pid \d+, cpus ([^,]+), log (\S+)\)")


class Running:
    """One server subprocess, from spawn to a checked stop."""

    def __init__(self, sv: Server, args: argparse.Namespace, e: dict[str, Any], work: Path) -> None:
        self.sv, self.port = sv, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        ours = sv.kind != "vllm"
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if ours else "1"
        if ours:
            env["LADSD_HOME"] = str(args.home)
        env |= dict(sv.env)
        self.log = work / f"{sv.name}-{self.port}.log"
        cwd = args.src if ours else ROOT
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                command(sv, args, e, self.port),
                cwd=cwd,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
            )

    async def ready(self, http: aiohttp.ClientSession) -> float:
        t0 = time.monotonic()
        while (await get(http, f"{self.base}/health"))[0] != 200:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.sv.name} exited {self.proc.returncode}; see {self.log}")
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise SystemExit(f"{self.sv.name}: no /health within {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.2)
        if self.sv.kind == "cluster":  # the router answers /health before it routes
            while (await get(http, f"{self.base}/v1/models"))[0] != 200:
                if self.proc.poll() is not None or time.monotonic() - t0 > START_TIMEOUT_S:
                    raise SystemExit(f"{self.sv.name}: the router never routed; see {self.log}")
                await asyncio.sleep(0.2)
        return time.monotonic() - t0

    def replicas(self) -> dict[str, dict[str, str]]:
        """A cluster's replicas as its log names them: url, cpus, log file."""
        found = REPLICA_LINE.findall(self.log.read_text(errors="replace"))
        return {n: {"url": u, "cpus": c, "log": lg} for n, u, c, lg in found}

    def client(self) -> Any:
        """The official client on this server; no retries (a failure must show)."""
        from openai import AsyncOpenAI

        return AsyncOpenAI(
            base_url=f"{self.base}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0
        )

    def stop(self) -> dict[str, Any]:
        """Stop (SIGINT: ladsd drains and audits); the exit code and, for ladsd, the audit."""
        rc = stop(self.proc)
        if self.sv.kind == "vllm":
            return {"exit": rc, "audit_balanced": None}
        logs = [Path(r["log"]) for r in self.replicas().values()] or [self.log]
        audit = all("audit balanced" in lg.read_text(errors="replace") for lg in logs)
        return {"exit": rc, "audit_balanced": audit}


# ---- one run, one pass ----------------------------------------------------------------


async def warm(client: Any, model: str) -> None:
    """One short sessionless request, so first-call costs stay out of the run."""
    await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello."}], max_tokens=8, temperature=0
    )


async def one_run(
    sv: Server,
    args: argparse.Namespace,
    e: dict[str, Any],
    w: wl.SessionWorkload,
    words: list[str],
    work: Path,
    tag: str,
) -> dict[str, Any]:

    srv = Running(sv, args, e, work)
    run: dict[str, Any] = {
        "server": sv.name,
        "kind": sv.kind,
        "flags": list(sv.flags),
        "intent": sv.intent,
        "seed": w.seed,
        "log": str(srv.log),
    }
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            run["start_s"] = await srv.ready(http)
            # A cluster is checked and counted replica by replica, each at its own URL.
            bases = {n: r["url"] for n, r in srv.replicas().items()} or {"": srv.base}
            if sv.kind == "cluster":
                run["replicas"] = srv.replicas()
                if len(bases) != REPLICAS:
                    raise SystemExit(f"{sv.name}: {len(bases)} replicas in {srv.log}")
            pools = [await pool_of(http, sv, b) for b in bases.values()]
            run["pool_blocks"] = sum(p or 0 for p in pools)
            want = args.expect_pool.get(sv.kind)
            if any(p != want // len(pools) for p in pools) or run["pool_blocks"] != want:
                raise SystemExit(
                    f"{sv.name} reports pools of {pools} blocks, {want} expected in all: "
                    "the servers would not be comparable"
                )
            client = srv.client()
            await warm(client, args.model)
            before = {n: await counters(http, sv, b) for n, b in bases.items()}
            t0 = time.monotonic()
            tasks = [
                one_session(client, args.model, s, words, tag, sv.intent, t0) for s in w.sessions
            ]
            run["sessions"] = await asyncio.gather(*tasks)
            run["makespan_s"] = time.monotonic() - t0
            per = {}
            for n, b in bases.items():
                after = await counters(http, sv, b)
                per[n] = {k: v - before[n].get(k, 0) for k, v in after.items()}
            names = next(iter(per.values()))
            run["counters"] = {k: sum(c.get(k, 0) for c in per.values()) for k in names}
            if sv.kind == "cluster":
                run["replica_counters"] = per
                run["session_replicas"] = await owners(http, bases, run["sessions"], tag)
            await client.close()
    finally:
        run |= srv.stop()
    run["summary"] = summarise(run)
    return run


async def owners(
    http: aiohttp.ClientSession, bases: dict[str, str], sessions: list[dict], tag: str
) -> dict[str, list[str]]:
    """Per session, the replicas whose session table knows it (``GET /v1/sessions/{id}``
    at each replica): one under affinity, more where its turns were spread."""
    out = {}
    for s in sessions:
        sid = f"{tag}-{s['sid'].replace('/', '.')}"
        out[s["sid"]] = [
            n for n, b in bases.items() if (await get(http, f"{b}/v1/sessions/{sid}"))[0] == 200
        ]
    return out


def summarise(run: dict[str, Any]) -> dict[str, float]:
    ss = run["sessions"]
    turns = [t for s in ss for t in s["turns"]]
    later = [t for t in turns if t["kind"] == "extends"]
    prompt = sum(t["prompt_tokens"] for t in turns)
    return {
        "session_s": statistics.mean(s["latency_s"] for s in ss),
        "session_model_s": statistics.mean(s["model_s"] for s in ss),
        "turn_s": statistics.mean(t["latency_s"] for t in turns),
        "cont_turn_s": statistics.mean(t["latency_s"] for t in later) if later else 0.0,
        "ttft_s": statistics.mean(t["ttft_s"] for t in turns),
        "ttft_p50_s": statistics.median(t["ttft_s"] for t in turns),
        "cached_frac": sum(t["cached_tokens"] for t in turns) / prompt if prompt else 0.0,
        "prompt_tokens": float(prompt),
        "makespan_s": run["makespan_s"],
    }


# ---- the plain load (overhead check) --------------------------------------------------


async def plain_user(client: Any, model: str, u: int, n: int, words: list[str]) -> list[dict]:
    """``n`` sequential sessionless requests of one user: a fixed prompt, 64 tokens out."""
    prompt = text(tuple((u * 997 + j * 31) % len(words) for j in range(256)), words)
    out = []
    for _ in range(n):
        t0, ttft, toks = time.monotonic(), None, 0
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=64,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                toks = chunk.usage.completion_tokens
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.monotonic() - t0
        lat = time.monotonic() - t0
        out.append({"latency_s": lat, "ttft_s": ttft or lat, "completion_tokens": toks})
    return out


async def plain_run(
    sv: Server, args: argparse.Namespace, e: dict[str, Any], words: list[str], work: Path
) -> dict[str, Any]:

    srv = Running(sv, args, e, work)
    run: dict[str, Any] = {"server": sv.name, "kind": sv.kind, "log": str(srv.log)}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            run["start_s"] = await srv.ready(http)
            run["pool_blocks"] = await pool_of(http, sv, srv.base)
            client = srv.client()
            await warm(client, args.model)
            t0 = time.monotonic()
            users = [
                plain_user(client, args.model, u, args.plain_requests, words)
                for u in range(args.plain_users)
            ]
            reqs = [r for rs in await asyncio.gather(*users) for r in rs]
            wall = time.monotonic() - t0
            await client.close()
    finally:
        run |= srv.stop()
    lat = sorted(r["latency_s"] for r in reqs)
    run["summary"] = {
        "throughput_tok_s": sum(r["completion_tokens"] for r in reqs) / wall,
        "p50_s": statistics.median(lat),
        "p99_s": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
        "ttft_p50_s": statistics.median(r["ttft_s"] for r in reqs),
        "requests": float(len(reqs)),
    }
    return run


# ---- report ---------------------------------------------------------------------------

COLUMNS = (
    ("session_s", "session s"),
    ("session_model_s", "session model s"),
    ("turn_s", "turn s"),
    ("ttft_s", "TTFT s"),
    ("cached_frac", "cached"),
    ("makespan_s", "makespan s"),
)
PLAIN = (
    ("throughput_tok_s", "tok/s"),
    ("p50_s", "p50 s"),
    ("p99_s", "p99 s"),
    ("ttft_p50_s", "TTFT p50 s"),
)


def spread(xs: list[float]) -> str:
    m = statistics.mean(xs)
    return f"{m:.3f}" if len(xs) == 1 else f"{m:.3f} ({min(xs):.3f}-{max(xs):.3f})"


def table(runs: list[dict[str, Any]], cols: tuple[tuple[str, str], ...], title: str) -> dict:
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["server"], []).append(r["summary"])
    t = Table(title=title)
    t.add_column("server")
    for _, head in cols:
        t.add_column(head, justify="right")
    out = {}
    for name, ss in by.items():
        out[name] = {k: [s[k] for s in ss] for k, _ in cols}
        t.add_row(name, *(spread(out[name][k]) for k, _ in cols))
    console.print(t)
    return out


def ratios(runs: list[dict[str, Any]], key: str, base: str, pair: tuple[str, str]) -> dict:
    """Per (seed, repeat): each server's ``key`` over ``base``'s, and the A/A pair's."""
    cell: dict[tuple[int, int], dict[str, float]] = {}
    for r in runs:
        cell.setdefault((r["seed"], r["repeat"]), {})[r["server"]] = r["summary"][key]
    out: dict[str, list[float]] = {}
    for c in cell.values():
        for name, v in c.items():
            if base in c and name != base:
                out.setdefault(f"{name}/{base}", []).append(v / c[base])
        if pair[0] in c and pair[1] in c:
            out.setdefault(f"{pair[1]}/{pair[0]} (A/A)", []).append(c[pair[1]] / c[pair[0]])
    return show(out, f"{key}: ratios per seed and repeat")


def vs_one(runs: list[dict[str, Any]], key: str) -> dict[str, list[float]]:
    """Per (seed, repeat): each cluster server's ``key`` over one replica's with the same
    policy and the same total pool (``rr-fifo`` over ``fifo``)."""
    cell: dict[tuple[int, int], dict[str, float]] = {}
    for r in runs:
        cell.setdefault((r["seed"], r["repeat"]), {})[r["server"]] = r["summary"][key]
    out: dict[str, list[float]] = {}
    for c in cell.values():
        for name, v in c.items():
            one = c.get(SERVERS[name].flags[1]) if SERVERS[name].kind == "cluster" else None
            if one:
                out.setdefault(f"{name}/{SERVERS[name].flags[1]}", []).append(v / one)
    return show(out, f"{key}: 2 replicas over 1 at the same total pool")


def show(out: dict[str, list[float]], title: str) -> dict[str, list[float]]:
    """Print ratio lists as a table (each ratio's values and mean); return them."""
    t = Table(title=title)
    t.add_column("ratio")
    t.add_column("values")
    t.add_column("mean", justify="right")
    for k, v in out.items():
        t.add_row(k, " ".join(f"{x:.3f}" for x in v), f"{statistics.mean(v):.3f}")
    console.print(t)
    return out


# ---- main -----------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--servers",
        default="vllm,fifo,lads,lads-aa,lads-nointent,lads-fixed,ttl-pin,hear-session",
        help=f"of {', '.join(SERVERS)}",
    )
    ap.add_argument("--seeds", default="1,2", help="workload seeds (selection and order)")
    ap.add_argument("--repeats", type=int, default=1, help="passes over every seed")
    ap.add_argument("--traces", default=None, help="cc-traces directory [../shared/data/cc-traces]")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--token-scale", type=float, default=0.125)
    ap.add_argument("--time-factor", type=float, default=1.0)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--max-tool-wait-s", type=float, default=30.0)
    ap.add_argument("--stagger-s", type=float, default=2.0)
    ap.add_argument("--max-context", type=int, default=6000, help="prompt tokens of a turn")
    ap.add_argument("--profile", default="cpu", help="ladsd's profile: the engine settings")
    ap.add_argument("--model", default="smollm2-135m", help="a model profile with real weights")
    ap.add_argument("--kv-blocks", type=int, default=1024, help="KV pool of every server")
    ap.add_argument("--headroom", type=float, default=0.166, help="H as a fraction of the pool")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument(
        "--dtype", default=None, help="engine dtype of every server [auto: ladsd's rule]"
    )
    ap.add_argument(
        "--scale-out",
        action="store_true",
        help=f"two replicas behind vllm-router against one at the same total pool ({SCALE_OUT})",
    )
    ap.add_argument("--plain", action="store_true", help="the overhead check (vllm, fifo, fifo-aa)")
    ap.add_argument("--plain-servers", default="vllm,fifo,fifo-aa", help="servers of --plain")
    ap.add_argument("--plain-users", type=int, default=8)
    ap.add_argument("--plain-requests", type=int, default=8, help="requests per user")
    ap.add_argument("--no-pin", action="store_true", help="ladsd from the working tree, not HEAD")
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args()


async def main() -> None:
    args = parse_args()
    e = engine_settings(args)
    args.h = round(args.headroom * e["num_gpu_blocks_override"])
    pool = e["num_gpu_blocks_override"]
    args.expect_pool = {"ladsd": pool, "vllm": pool, "cluster": pool // REPLICAS * REPLICAS}
    work = Path(tempfile.mkdtemp(prefix="ladsd-bench-agents-"))
    args.src = ROOT if args.no_pin else pinned_tree(work)
    args.home = linked_home(work)
    words = one_token_words(e["model_path"])
    if args.scale_out:
        args.servers = SCALE_OUT
    names = (args.plain_servers if args.plain else args.servers).split(",")
    unknown = [n for n in names if n not in SERVERS]
    if unknown:
        raise SystemExit(f"unknown servers: {', '.join(unknown)} (known: {', '.join(SERVERS)})")
    servers = [SERVERS[n] for n in names]
    seeds = [int(x) for x in args.seeds.split(",")]
    params = wl.SessionParams(
        sessions=args.sessions,
        token_scale=args.token_scale,
        time_factor=args.time_factor,
        max_turns=args.max_turns,
        max_tool_wait_s=args.max_tool_wait_s,
        stagger_s=args.stagger_s,
        max_context=args.max_context,
        vocab=(0, len(words)),
    )
    traces = None if args.plain else cc_traces.load(args.traces)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    kind = "plain" if args.plain else "scale-out" if args.scale_out else "sessions"
    out = args.out or RESULTS / f"agents-{kind}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    doc: dict[str, Any] = {
        **result_head(f"agents/{kind}", stamp),
        "flags": {k: v for k, v in flags.items() if k not in ("expect_pool", "src", "home")},
        "engine": e | {"headroom_blocks": args.h},
        "machine": {"platform": platform.platform(), "cpu": cpu_dict()},
        "ladsd_from": "working tree" if args.no_pin else "HEAD (git archive)",
        "workload": None
        if args.plain
        else asdict(params)
        | {
            "traces": str(traces.root) if traces else None,
            "traces_commit": traces.commit if traces else None,
            "words": len(words),
        },
        "runs": [],
    }
    k = 0
    for rep in range(args.repeats):
        for seed in [0] if args.plain else seeds:
            w = None if args.plain else wl.build(traces.conversations, seed, params)
            shift = k % len(servers)
            order = servers[shift:] + servers[:shift]  # rotate: drift hits every server alike
            k += 1
            for sv in order:
                console.print(f"repeat {rep + 1}/{args.repeats} seed {seed}: {sv.name} ...")
                if args.plain:
                    run = await plain_run(sv, args, e, words, work)
                else:
                    run = await one_run(sv, args, e, w, words, work, f"r{rep}s{seed}")
                run |= {"repeat": rep, "seed": seed, "order": [s.name for s in order]}
                doc["runs"].append(run)
                console.print(
                    {m: round(v, 3) for m, v in run["summary"].items()}, f"exit {run['exit']}"
                )
                out.write_text(json.dumps(doc, indent=1))  # partial results survive a failure
    if args.plain:
        doc["table"] = table(doc["runs"], PLAIN, "plain chat load")
        doc["ratios"] = {k: ratios(doc["runs"], k, "vllm", ("fifo", "fifo-aa")) for k, _ in PLAIN}
    elif args.scale_out:
        doc["table"] = table(doc["runs"], COLUMNS, "coding-agent sessions, 2 replicas vs 1")
        doc["ratios"] = {
            k: ratios(doc["runs"], k, "ch-lads", ("ch-lads", "ch-lads-aa"))
            for k in ("session_s", "session_model_s", "cached_frac")
        }
        doc["vs_one_replica"] = {k: vs_one(doc["runs"], k) for k in ("session_s", "cached_frac")}
    else:
        doc["table"] = table(doc["runs"], COLUMNS, "coding-agent sessions")
        doc["ratios"] = {
            k: ratios(doc["runs"], k, "vllm", ("lads", "lads-aa"))
            for k in ("session_s", "session_model_s", "turn_s")
        }
    out.write_text(json.dumps(doc, indent=1))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
