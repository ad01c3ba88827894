"""`ladsd serve` under the captured trace: leases (LADS) vs none (FIFO), over HTTP.

The committed trace's workflows (traces/smollm2-16tasks.jsonl) are replayed as
OpenAI chat sessions against real daemons on loopback; each workflow is one
session (``x-session-id``). Per session the client first states its intent
(the first request's ``intent`` body field: the workflow's mean recorded tool seconds
and result bytes). Turn 0 sends the recorded system and user turns; every
recorded tool step is asked for as a call of that tool (``tool_choice`` names
it; the tools ``open`` / ``read_reviews`` take the recorded reply's
``thought`` and one of the task's product ids), so the reply is a tool call
and the session's history waits for the tool as the daemon's lease candidate;
the client then waits the recorded tool seconds and sends the recorded tool
result (and the harness's progress note) as the next turn. The recorded
``finish`` turn is asked for as text of the recorded length. Greedy sampling,
so both daemons get the same conversations.

What is exact and what is not: the tool results, notes, system and user turns
are the recorded text (checked token by token against the trace's prompt ids
before anything runs); the daemon extends each session's history token-exactly
with its own outputs. The assistant turns are the daemon's own tool-call JSON
(``{"name", "arguments"}``), not the recorded ``{"thought", "action", ...}``,
and the daemon appends the tool descriptions to the system turn: prompts are
longer than recorded (both lengths are in the results).

One daemon per policy (``ladsd serve --policy lads`` and ``--policy fifo``,
same profile and flags), each a subprocess on a free loopback port, run from
a ``git archive`` of HEAD (``--no-pin``: the working tree); the order rotates
every repeat, so drift on a shared machine hits both alike. The KV
pool and ``H`` follow the replay's rule (ladsd/sizing.py: 11.53 mean
final histories per pool, ``H`` 16.6 % of it) unless ``--pool profile``.
Reported per run: mean turn latency (request sent -> reply read), continuation
turns and all turns, cached prompt tokens, workflow latency, makespan, lease
events; the LADS/FIFO ratio per repeat and its spread over repeats. Results
(git commit, profile, flags, every turn) go to bench/results/serve/. Prints a
table and, last, one JSON line. Never asserts.

    .venv/bin/python bench/serve.py --profile cpu --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import free_port, git_meta, pinned_tree  # noqa: E402

from ladsd.agent import actions  # noqa: E402
from ladsd.agent.prompt import system_prompt, user_prompt  # noqa: E402
from ladsd.engine import cpu  # noqa: E402
from ladsd.workloads import trace as tr  # noqa: E402
from web_catalog.tasks import load_tasks  # noqa: E402

TRACE = ROOT / "traces" / "smollm2-16tasks.jsonl"
RESULTS = ROOT / "bench" / "results" / "serve"
START_TIMEOUT_S = 600.0  # daemon start-up (engine build, kappa): generous on a loaded machine
TURN_TIMEOUT_S = 600.0  # hang guard per request
console = Console()


# ---- the workload: the trace's turns as chat messages -------------------------------


@dataclass(frozen=True)
class Turn:
    """One model call of a workflow: what the client appends before sending it."""

    turn: int
    append: tuple[dict[str, Any], ...]  # messages after the previous reply (tool result first)
    prompt_len: int  # recorded prompt length (tokens)
    output_tokens: int  # recorded output length
    tool_seconds: float  # wait before this turn (the tool's recorded service time)
    tool: str | None  # the recorded reply's tool (asked for by name), None: text
    result_bytes: int  # bytes of the tool result this turn sends (0 for turn 0)


@dataclass(frozen=True)
class Flow:
    wid: str
    arrival: float  # seconds after the run's start
    product_ids: tuple[int, ...]
    turns: tuple[Turn, ...]

    def intent(self) -> dict[str, Any]:
        """What the client expects of its tools: the recorded means (HEAR intent)."""
        waits = [t for t in self.turns if t.turn > 0]
        secs = sum(t.tool_seconds for t in waits) / max(1, len(waits))
        size = sum(t.result_bytes for t in waits) // max(1, len(waits))
        return {"expected_tool_s": secs, "expected_result_bytes": size}


def build_flows(trace: tr.Trace, seed: int, spread_s: float, tool_scale: float) -> list[Flow]:
    """The trace's workflows as chat turns; arrivals seeded as ``ladsd replay`` does."""
    rng = random.Random(f"captured/{seed}")
    tasks = {t.task_id: t for t in load_tasks()}
    flows = []
    for w in trace.workflows:
        task = tasks[w.task_id]
        opened: set[int] = set()
        read: set[int] = set()
        turns = []
        for c in w.calls:
            o = c.observation
            if o is None:
                append: tuple[dict[str, Any], ...] = (
                    {"role": "system", "content": system_prompt()},
                    {"role": "user", "content": user_prompt(task)},
                )
            else:
                if o.ok and o.tool is not None:
                    pid = int(o.args["product_id"])
                    (opened if o.tool == "open" else read).add(pid)
                note = actions.progress_note(opened, read, w.product_ids)
                append = ({"role": "tool", "content": o.text}, {"role": "user", "content": note})
                if not trace.header.agent.get("progress_note", True):
                    append = append[:1]
            turns.append(
                Turn(
                    turn=c.turn,
                    append=append,
                    prompt_len=len(c.prompt_ids),
                    output_tokens=max(1, len(c.output_ids)),
                    tool_seconds=(o.tool_seconds * tool_scale) if o else 0.0,
                    tool=c.action.name if c.action.is_tool else None,
                    result_bytes=len(o.payload) if o else 0,
                )
            )
        arrival = rng.uniform(0.0, spread_s)
        flows.append(Flow(w.workflow, arrival, tuple(w.product_ids), tuple(turns)))
    return flows


def check_tokens(trace: tr.Trace, flows: list[Flow]) -> None:
    """The messages are the recorded text: with the recorded outputs in place of the
    daemon's replies they render to exactly the recorded prompt ids."""
    from transformers import AutoTokenizer

    from ladsd.agent.prompt import ChatML
    from ladsd.engine import models

    tok = AutoTokenizer.from_pretrained(str(models.model_path("smollm2-135m")))
    chat = ChatML(tok)
    for w, f in zip(trace.workflows, flows, strict=True):
        msgs: list[dict[str, Any]] = []
        ids: list[int] = []
        for c, t in zip(w.calls, f.turns, strict=True):
            if c.turn == 0:
                msgs = list(t.append)
                ids = chat.turn("system", msgs[0]["content"]) + chat.turn(
                    "user", msgs[1]["content"]
                )
                ids += chat.header()
            else:
                prev = w.calls[c.turn - 1]
                ids = chat.history(prev.prompt_ids, prev.output_ids)
                note = t.append[1]["content"] if len(t.append) > 1 else None
                ids += chat.tool_turn(t.append[0]["content"].encode(), note)
            if tuple(ids) != c.prompt_ids:
                raise SystemExit(
                    f"{w.workflow} call {c.turn}: the chat messages do not give the recorded "
                    "prompt tokens"
                )


# ---- one daemon ---------------------------------------------------------------


@dataclass
class Daemon:
    """``ladsd serve`` as a subprocess; its output goes to a log file."""

    policy: str
    args: list[str]
    log_dir: Path
    src: Path = ROOT  # the source tree the daemon runs from (its cwd)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def command(self) -> list[str]:
        exe = [sys.executable, "-c", "from cli.main import app; app()"]
        return [*exe, "serve", "--port", str(self.port), "--policy", self.policy, *self.args]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, http: aiohttp.ClientSession) -> None:
        self.log_path = self.log_dir / f"serve-{self.policy}-{self.port}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(), cwd=self.src, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"ladsd serve exited ({self.proc.returncode}); see {self.log_path}"
                )
            try:
                async with http.get(f"{self.url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        self.stop()
        raise SystemExit(f"ladsd serve did not answer /health in {START_TIMEOUT_S:.0f} s")

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)  # clean shutdown: lease audit
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# ---- the replay over HTTP -------------------------------------------------------

MAX_TOOL_TOKENS = 256  # the trace's agent cap per reply
THOUGHT_CHARS = 200


def tools_for(flow: Flow) -> list[dict[str, Any]]:
    """The catalog tools as OpenAI tools; one list per session (it is part of the
    system turn, so it must not change within a session)."""
    params = {
        "type": "object",
        "properties": {
            "thought": {"type": "string", "maxLength": THOUGHT_CHARS},
            "product_id": {"enum": list(flow.product_ids)},
        },
        "required": ["thought", "product_id"],
        "additionalProperties": False,
    }
    descs = {
        "open": "Open a product page: name, price, description, sizes and colours.",
        "read_reviews": "Read a product's customer reviews.",
    }
    return [
        {"type": "function", "function": {"name": n, "description": d, "parameters": params}}
        for n, d in descs.items()
    ]


def chat_body(
    msgs: list[dict[str, Any]], t: Turn, model: str, tools: list[dict[str, Any]]
) -> dict[str, Any]:
    """A recorded tool step is asked for as a call of that tool; any other reply as text
    of the recorded length (vLLM's min_tokens / ignore_eos, as ``ladsd replay`` forces)."""
    body: dict[str, Any] = {"model": model, "messages": msgs, "tools": tools, "temperature": 0}
    if t.tool is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": t.tool}}
        body["max_tokens"] = MAX_TOOL_TOKENS
    else:
        body["tool_choice"] = "none"
        body |= {"max_tokens": t.output_tokens, "min_tokens": t.output_tokens, "ignore_eos": True}
    return body


@dataclass
class TurnResult:
    workflow: str
    turn: int
    sent: float  # seconds after the run's start
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    recorded_prompt_tokens: int
    recorded_output_tokens: int
    finish_reason: str | None
    tool_call: bool


async def post(http: aiohttp.ClientSession, url: str, body: Any, sid: str) -> Any:
    async with http.post(
        url,
        json=body,
        headers={"x-session-id": sid},
        timeout=aiohttp.ClientTimeout(total=TURN_TIMEOUT_S),
    ) as r:
        data = await r.json()
        if r.status >= 300:
            raise RuntimeError(f"{sid}: {url}: HTTP {r.status}: {data}")
        return data


async def replay_flow(
    http: aiohttp.ClientSession,
    url: str,
    flow: Flow,
    sid: str,
    t0: float,
    model: str,
    intent: bool,
) -> list[TurnResult]:
    await asyncio.sleep(max(0.0, t0 + flow.arrival - time.monotonic()))
    tools = tools_for(flow)
    msgs: list[dict[str, Any]] = []
    out: list[TurnResult] = []
    call_id: str | None = None
    for t in flow.turns:
        if t.turn > 0:
            await asyncio.sleep(t.tool_seconds)  # the tool runs
            result, *rest = t.append
            if call_id is not None:
                msgs.append({**result, "tool_call_id": call_id})
            else:  # the previous reply was not a call: the result goes as a user turn
                msgs.append({"role": "user", "content": result["content"]})
            msgs.extend(rest)
        else:
            msgs.extend(t.append)
        sent = time.monotonic()
        body = chat_body(msgs, t, model, tools)
        if intent and t.turn == 0:  # the request that creates the session states it
            body["intent"] = flow.intent()
        data = await post(http, f"{url}/v1/chat/completions", body, sid)
        latency = time.monotonic() - sent
        choice = data["choices"][0]
        msg = choice["message"]
        msgs.append({k: v for k, v in msg.items() if v is not None})  # as the daemon said it
        calls = msg.get("tool_calls") or []
        call_id = calls[0]["id"] if calls else None
        usage = data["usage"]
        out.append(
            TurnResult(
                workflow=flow.wid,
                turn=t.turn,
                sent=sent - t0,
                latency_s=latency,
                prompt_tokens=int(usage["prompt_tokens"]),
                cached_tokens=int(usage["prompt_tokens_details"]["cached_tokens"]),
                completion_tokens=int(usage["completion_tokens"]),
                recorded_prompt_tokens=t.prompt_len,
                recorded_output_tokens=t.output_tokens,
                finish_reason=choice.get("finish_reason"),
                tool_call=bool(calls),
            )
        )
    return out


async def collect_events(http: aiohttp.ClientSession, url: str, into: list[dict]) -> None:
    """The daemon's outcome stream (grants, handoffs, expiries, ..., completions)."""
    async with http.get(f"{url}/v1/events", timeout=aiohttp.ClientTimeout(total=None)) as r:
        async for raw in r.content:
            if raw.startswith(b"data: "):
                into.append(orjson.loads(raw[6:]))


async def one_run(
    policy: str, flows: list[Flow], args: argparse.Namespace, log_dir: Path, tag: str
) -> dict[str, Any]:
    d = Daemon(policy, args.serve_args, log_dir, args.src)
    events: list[dict] = []
    load: list[float] = []
    async with aiohttp.ClientSession() as http:
        await d.start(http)
        try:
            model = (await fetch_json(http, f"{d.url}/v1/models"))["data"][0]["id"]
            watcher = asyncio.create_task(collect_events(http, d.url, events))
            sampler = asyncio.create_task(sample_load(load))
            t0 = time.monotonic() + 0.5
            per_flow = await asyncio.gather(
                *(
                    replay_flow(http, d.url, f, f"{tag}-{f.wid}", t0, model, not args.no_intent)
                    for f in flows
                )
            )
            makespan = time.monotonic() - t0
            await asyncio.sleep(0.3)  # the last published state's events
            state = await fetch_json(http, f"{d.url}/v1/engine/state")
            watcher.cancel()
            sampler.cancel()
        finally:
            rc = d.stop()
    turns = [t for fl in per_flow for t in fl]
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["type"]] = kinds.get(e["type"], 0) + 1
    bound = sum(1 for e in events if e["type"] == "completion" and e.get("bound"))
    return {
        "policy": policy,
        "tag": tag,
        "command": d.command(),
        "log": str(d.log_path),
        "exit_code": rc,  # 0: the daemon's lease audit balanced at shutdown
        "model": model,
        "makespan_s": makespan,
        # 1-minute load average every 5 s: the daemon and this client make ~2 on
        # 2 cores; more means other work shared the machine during the run.
        "load_1m": {"mean": statistics.fmean(load), "max": max(load)} if load else None,
        "events": kinds,
        "bound_continuations": bound,
        "engine_state": state,
        "summary": summarize(turns, per_flow) | {"makespan_s": makespan},
        "turns": [t.__dict__ for t in turns],
    }


async def sample_load(into: list[float], every_s: float = 5.0) -> None:
    while True:
        into.append(os.getloadavg()[0])
        await asyncio.sleep(every_s)


async def fetch_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as r:
        return await r.json()


def summarize(turns: list[TurnResult], per_flow: list[list[TurnResult]]) -> dict[str, float]:
    conts = [t for t in turns if t.turn > 0]
    wf = [fl[-1].sent + fl[-1].latency_s - fl[0].sent for fl in per_flow if fl]
    return {
        "turns": len(turns),
        "mean_turn_s": statistics.fmean(t.latency_s for t in turns),
        "mean_continuation_s": statistics.fmean(t.latency_s for t in conts) if conts else 0.0,
        "p95_turn_s": _pct([t.latency_s for t in turns], 0.95),
        "mean_workflow_s": statistics.fmean(wf) if wf else 0.0,
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "recorded_prompt_tokens": sum(t.recorded_prompt_tokens for t in turns),
        "completion_tokens": sum(t.completion_tokens for t in turns),
        "cached_tokens": sum(t.cached_tokens for t in turns),
        "continuation_cached_share": (
            sum(t.cached_tokens for t in conts) / max(1, sum(t.prompt_tokens for t in conts))
        ),
        "tool_call_replies": sum(t.tool_call for t in turns),
    }


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


# ---- reporting -------------------------------------------------------------------


def spread(xs: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(xs),
        "min": min(xs),
        "max": max(xs),
        "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
    }


def report(runs: list[dict[str, Any]], policies: list[str]) -> dict[str, Any]:
    by = {p: [r for r in runs if r["policy"] == p] for p in policies}
    keys = ("mean_turn_s", "mean_continuation_s", "mean_workflow_s", "cached_tokens")
    out: dict[str, Any] = {
        p: {k: spread([r["summary"][k] for r in rs]) for k in keys} for p, rs in by.items() if rs
    }
    base, test = policies[-1], policies[0]  # lads vs fifo: ratio = lads / fifo
    pairs = list(zip(by[test], by[base], strict=False))
    if pairs:
        out["ratio"] = {
            "of": f"{test}/{base}",
            "mean_turn_s": spread(
                [a["summary"]["mean_turn_s"] / b["summary"]["mean_turn_s"] for a, b in pairs]
            ),
            "mean_continuation_s": spread(
                [
                    a["summary"]["mean_continuation_s"] / b["summary"]["mean_continuation_s"]
                    for a, b in pairs
                ]
            ),
            "cached_tokens": spread(
                [
                    a["summary"]["cached_tokens"] / max(1, b["summary"]["cached_tokens"])
                    for a, b in pairs
                ]
            ),
        }
    return out


def print_table(runs: list[dict[str, Any]], agg: dict[str, Any]) -> None:
    t = Table(title="ladsd serve: captured trace over HTTP (per run)")
    for col in (
        "repeat",
        "policy",
        "mean turn s",
        "mean cont. s",
        "p95 turn s",
        "workflow s",
        "makespan s",
        "cached tok",
        "cached share",
        "grants",
        "load 1m",
    ):
        t.add_column(col, justify="right")
    for r in runs:
        s = r["summary"]
        t.add_row(
            r["tag"].split("-")[0],
            r["policy"],
            f"{s['mean_turn_s']:.3f}",
            f"{s['mean_continuation_s']:.3f}",
            f"{s['p95_turn_s']:.3f}",
            f"{s['mean_workflow_s']:.2f}",
            f"{r['makespan_s']:.2f}",
            f"{s['cached_tokens']:,}",
            f"{s['continuation_cached_share']:.1%}",
            str(r["events"].get("grant", 0)),
            f"{r['load_1m']['mean']:.1f}" if r.get("load_1m") else "-",
        )
    console.print(t)
    if "ratio" in agg:
        ra = agg["ratio"]
        for k in ("mean_turn_s", "mean_continuation_s", "cached_tokens"):
            x = ra[k]
            console.print(
                f"{ra['of']} {k}: {x['mean']:.3f} (min {x['min']:.3f}, max {x['max']:.3f}, "
                f"stdev {x['stdev']:.3f})"
            )


def pool_flags(trace: tr.Trace, profile: str) -> list[str]:
    """``--kv-blocks`` / ``--headroom-blocks`` by the replay's rule for these workflows
    (recorded final histories: last prompt + last output)."""
    from ladsd.config import PROFILES
    from ladsd.sizing import pool_for

    finals = [len(w.calls[-1].prompt_ids) + len(w.calls[-1].output_ids) for w in trace.workflows]
    block = PROFILES[profile].engine.resolved_block_size()
    blocks, h = pool_for(sum(finals) / len(finals), block)
    return ["--kv-blocks", str(blocks), "--headroom-blocks", str(h)]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profile", default="cpu", help="ladsd serve --profile")
    ap.add_argument("--policies", default="lads,fifo", help="first is compared to the last")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1, help="arrival seed (repeat k uses seed + k)")
    ap.add_argument("--spread", type=float, default=2.0, help="arrivals uniform in [0, spread] s")
    ap.add_argument("--tool-scale", type=float, default=1.0, help="x recorded tool seconds")
    ap.add_argument("--workflows", type=int, default=0, help="first N workflows (0: all)")
    ap.add_argument(
        "--pool",
        choices=("rule", "profile"),
        default="rule",
        help="KV pool and H: the replay's sizing rule for this trace, or the profile's",
    )
    ap.add_argument("--no-intent", action="store_true", help="send no intent (daemon default)")
    ap.add_argument(
        "--no-pin", action="store_true", help="run the daemons from the working tree, not HEAD"
    )
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-check", action="store_true", help="skip the recorded-text check")
    ap.add_argument("serve_args", nargs="*", help="more `ladsd serve` flags (after --)")
    args = ap.parse_args()
    policies = args.policies.split(",")
    trace = tr.load(args.trace)
    if args.workflows:
        trace = tr.Trace(trace.header, trace.workflows[: args.workflows])
    pool = pool_flags(trace, args.profile) if args.pool == "rule" else []
    args.serve_args = ["--profile", args.profile, *pool, *args.serve_args]
    if not args.no_check:
        check_tokens(trace, build_flows(trace, args.seed, args.spread, args.tool_scale))
    log_dir = Path(tempfile.mkdtemp(prefix="ladsd-bench-serve-"))
    args.src = ROOT if args.no_pin else pinned_tree(log_dir)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or RESULTS / f"serve-{args.profile}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "bench": "serve",
        "created": stamp,
        "git": git_meta(),
        "profile": args.profile,
        "flags": {
            "argv": sys.argv[1:],
            "serve_args": args.serve_args,
            "policies": policies,
            "repeats": args.repeats,
            "seed": args.seed,
            "spread_s": args.spread,
            "tool_scale": args.tool_scale,
            "pool": args.pool,
            "intent": not args.no_intent,
            "daemons_from": "working tree" if args.no_pin else "HEAD (git archive)",
            "workflows": len(trace.workflows),
            "trace": str(
                args.trace.relative_to(ROOT) if args.trace.is_relative_to(ROOT) else args.trace
            ),
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), **cpu.meta()},
        "complete": False,
        "aggregate": {},
        "runs": [],
    }
    runs: list[dict[str, Any]] = doc["runs"]
    for k in range(args.repeats):
        flows = build_flows(trace, args.seed + k, args.spread, args.tool_scale)
        order = policies[k % len(policies) :] + policies[: k % len(policies)]
        for p in order:
            console.print(f"[dim]repeat {k + 1}/{args.repeats}: {p} ...[/dim]")
            runs.append(await one_run(p, flows, args, log_dir, f"r{k + 1}-{p}"))
            doc["aggregate"] = report(runs, policies)
            # Written after every run: an interrupted bench keeps what it measured.
            out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    doc["complete"] = True
    out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    print_table(runs, doc["aggregate"])
    console.print(f"[dim]results: {out}; daemon logs: {log_dir}[/dim]")
    line = {"bench": "serve", "out": str(out), "git": doc["git"], **doc["aggregate"]}
    print(orjson.dumps(line).decode())


if __name__ == "__main__":
    asyncio.run(main())
