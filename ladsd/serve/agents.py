"""The daemon's own agents: shopping tasks run as ReAct loops inside ``ladsd serve``.

Endpoints (installed on the daemon's aiohttp app by :func:`install`):

  POST   /v1/agent/runs              {"task_id": "shop-01"} or {"question", "product_ids"};
                                     optional "agent": {step_limit, max_tokens, ...}
  GET    /v1/agent/runs              the runs table (newest last)
  GET    /v1/agent/runs/{id}         status, steps (action, observation, stamps, stages),
                                     answer, stage totals
  GET    /v1/agent/runs/{id}/events  progress as server-sent events (replayed from the start)
  DELETE /v1/agent/runs/{id}         cancel a run

A run belongs to the tenant whose key started it (:mod:`.app`): another
tenant's run is a 404 and is not listed.

Every model call of a run goes through :class:`~ladsd.agent.link_backend.LinkBackend`
over the daemon's own :class:`~ladsd.runtime.Runtime`: call 0 enters the engine
directly, every tool result travels the paced TCP return link under the daemon's
delivery policy and its history is a lease candidate until the engine allocates
the resumed call (``Runtime.resume``). So a run's stage times are the spec's
r, s, c, a, n, f of each call, measured by the same code as a replay.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from ladsd import clock
from ladsd.agent.backend import Render
from ladsd.agent.link_backend import LinkBackend
from ladsd.agent.loop import AgentConfig, run_workflow
from ladsd.clock import STAGES
from ladsd.records import ContinuationId
from ladsd.runtime import CallOutcome
from ladsd.serve.app import (
    DAEMON,
    LOCAL,
    WRITE_TIMEOUT_S,
    dumps,
    json_response,
    open_sse,
    read_json,
    tenant_of,
    write_within,
)
from ladsd.serve.errors import ApiError
from ladsd.workloads.trace import CallRecord, WorkflowRecord
from web_catalog.db import Catalog
from web_catalog.tasks import Task, TaskProduct, load_tasks

MAX_RUNS = 256  # runs kept in the table (finished ones are evicted oldest first)
MAX_ACTIVE = 32  # runs queued or running at once; more get 429
MAX_PRODUCTS = 6
MAX_QUESTION_CHARS = 2000
HEARTBEAT_S = 15.0  # SSE comment line while nothing happens (keeps proxies from timing out)
TERMINAL = ("completed", "failed", "cancelled")
MAX_EVENT_ID_DIGITS = 9  # Last-Event-ID: a run has far fewer events

# Agent settings a client may change, with their bounds. The defaults are the
# committed trace's (traces/README.md): no repeats, because SmolLM2-135M loops
# on the system prompt's example tool otherwise.
DEFAULT_AGENT = AgentConfig(repeats=False)
_AGENT_KEYS: dict[str, tuple[type, float, float]] = {
    "step_limit": (int, 1, 32),
    "max_tokens": (int, 1, 1024),
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 0.01, 1.0),
    "repeats": (bool, 0, 1),
    "progress_note": (bool, 0, 1),
}


# ---- request parsing ---------------------------------------------------------


@dataclass(frozen=True)
class RunRequest:
    task: Task
    agent: AgentConfig


def parse_run(body: Any, tasks: dict[str, Task], catalog: Catalog) -> RunRequest:
    """Validate a POST body; raise :class:`ApiError` (400 bad body, 404 unknown id)."""
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object")
    unknown = sorted(set(body) - {"task_id", "question", "product_ids", "agent"})
    if unknown:
        raise ApiError(400, f"unknown fields: {', '.join(unknown)}", param=unknown[0])
    has_task = "task_id" in body
    if has_task == ("question" in body or "product_ids" in body):
        raise ApiError(400, "give either 'task_id' or 'question' with 'product_ids'")
    task = _task_by_id(body["task_id"], tasks) if has_task else _custom_task(body, catalog)
    return RunRequest(task, parse_agent(body.get("agent", {})))


def _task_by_id(tid: Any, tasks: dict[str, Task]) -> Task:
    if not isinstance(tid, str) or not tid:
        raise ApiError(400, "'task_id' must be a non-empty string", param="task_id")
    task = tasks.get(tid)
    if task is None:
        first, last = min(tasks), max(tasks)
        raise ApiError(
            404,
            f"no task {tid!r} (web_catalog/tasks.json has {first} ... {last})",
            param="task_id",
            code="task_not_found",
        )
    return task


def _custom_task(body: dict[str, Any], catalog: Catalog) -> Task:
    q, pids = body.get("question"), body.get("product_ids")
    if not isinstance(q, str) or not q.strip() or len(q) > MAX_QUESTION_CHARS:
        raise ApiError(
            400, f"'question' must be a string of 1-{MAX_QUESTION_CHARS} chars", param="question"
        )
    ok = (
        isinstance(pids, list)
        and 1 <= len(pids) <= MAX_PRODUCTS
        and all(isinstance(p, int) and not isinstance(p, bool) for p in pids)
        and len(set(pids)) == len(pids)
    )
    if not ok:
        raise ApiError(
            400,
            f"'product_ids' must be a list of 1-{MAX_PRODUCTS} distinct integers",
            param="product_ids",
        )
    products = []
    for pid in pids:
        p = catalog.product(pid)
        if p is None:
            raise ApiError(
                404,
                f"no product {pid} in the catalog",
                param="product_ids",
                code="product_not_found",
            )
        products.append(TaskProduct(p.product_id, p.name))
    return Task("custom", "", tuple(products), q.strip())


def parse_agent(raw: Any) -> AgentConfig:
    if not isinstance(raw, dict):
        raise ApiError(400, "'agent' must be a JSON object", param="agent")
    kw: dict[str, Any] = {}
    for key, val in raw.items():
        spec = _AGENT_KEYS.get(key)
        if spec is None:
            known = ", ".join(_AGENT_KEYS)
            raise ApiError(400, f"unknown agent setting {key!r}; known: {known}", param="agent")
        typ, lo, hi = spec
        if typ is bool:
            good = isinstance(val, bool)
        elif typ is int:
            good = isinstance(val, int) and not isinstance(val, bool) and lo <= val <= hi
        else:
            good = isinstance(val, int | float) and not isinstance(val, bool) and lo <= val <= hi
        if not good:
            what = "a boolean" if typ is bool else f"a number in [{lo:g}, {hi:g}]"
            raise ApiError(400, f"agent.{key} must be {what}", param=f"agent.{key}")
        kw[key] = typ(val)
    return replace(DEFAULT_AGENT, **kw)


# ---- runs ----------------------------------------------------------------------


def call_view(c: CallRecord) -> dict[str, Any]:
    """One model call as the API shows it (times relative to the run's start)."""
    o = c.observation
    a = c.action
    return {
        "turn": c.turn,
        "observation": None
        if o is None
        else {
            "tool": o.tool,
            "args": dict(o.args),
            "ok": o.ok,
            "bytes": len(o.payload),
            "tool_seconds": o.tool_seconds,
            "text": o.text,
        },
        "action": {
            "name": a.name,
            "thought": a.thought,
            "product_id": a.product_id,
            "answer": a.answer,
            "error": a.error,
        },
        "prompt_tokens": len(c.prompt_ids),
        "output_tokens": len(c.output_ids),
        "cached_tokens": c.cached_tokens,
        "finish_reason": c.finish_reason,
        "times": c.times.as_dict(),
        "stages": c.times.stages(),
    }


def stage_totals(calls: list[CallRecord]) -> dict[str, dict[str, float | int]]:
    """Per stage: calls that have it, total and mean seconds (cold calls lack s-r, c-s, n-c)."""
    out: dict[str, dict[str, float | int]] = {}
    for name in STAGES:
        vals = [v for c in calls if (v := c.times.stages()[name]) is not None]
        total = sum(vals)
        out[name] = {
            "calls": len(vals),
            "total_s": total,
            "mean_s": total / len(vals) if vals else 0,
        }
    return out


@dataclass
class AgentRun:
    id: str
    task: Task
    agent: AgentConfig
    created: float  # Unix time (for people)
    t0: float  # ladsd.clock at creation: every time of the run is relative to it
    status: str = "queued"  # queued | running | completed | failed | cancelled
    calls: list[CallRecord] = field(default_factory=list)
    record: WorkflowRecord | None = None
    error: str | None = None
    ended: float | None = None  # ladsd.clock
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    job: asyncio.Task | None = None
    link: dict[str, Any] | None = None  # the return path its results took (set at start)
    tenant: str = LOCAL  # whose key started it

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        """Append an event and wake every stream (each waits on the current Event)."""
        self.events.append((kind, {"run": self.id, **data}))
        old, self.changed = self.changed, asyncio.Event()
        old.set()

    def view(self) -> dict[str, Any]:
        rec = self.record
        end = self.ended if self.ended is not None else clock.now()
        conts = self.calls[1:]
        return {
            "id": self.id,
            "object": "agent.run",
            "created": int(self.created),
            "status": self.status,
            "task": {
                "task_id": self.task.task_id,
                "question": self.task.question,
                "product_ids": list(self.task.product_ids),
            },
            "agent": self.agent.as_dict(),
            "link": self.link,
            "termination": rec.termination if rec else None,
            "answer": rec.answer if rec else None,
            "error": self.error,
            "elapsed_s": end - self.t0,
            "steps": [call_view(c) for c in self.calls],
            "stage_times": stage_totals(self.calls),
            "usage": {
                "model_calls": len(self.calls),
                "prompt_tokens": sum(len(c.prompt_ids) for c in self.calls),
                "completion_tokens": sum(len(c.output_ids) for c in self.calls),
                "cached_tokens": sum(c.cached_tokens for c in self.calls),
                "continuation_prompt_tokens": sum(len(c.prompt_ids) for c in conts),
                "continuation_cached_tokens": sum(c.cached_tokens for c in conts),
            },
        }

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status,
            "task_id": self.task.task_id,
            "steps": len(self.calls),
            "created": int(self.created),
        }


class _RunBackend(LinkBackend):
    """The daemon's link backend, plus progress events and clean cancellation.

    A run cancelled while its tool result waits in the sender withdraws the
    result (and any lease on its history) instead of leaving it to be sent.
    """

    def __init__(self, rt: Any, policy: str, emit: Callable[[str, dict[str, Any]], None]) -> None:
        super().__init__(rt, policy)
        self.emit = emit

    async def resume(
        self,
        cid: ContinuationId,
        history_ids: list[int],
        observation: bytes,
        render: Render,
        params: Any,
        *,
        workflow_arrival: float,
        tool_seconds: float,
    ) -> CallOutcome:
        self.emit(
            "tool_result",
            {"turn": cid.turn, "bytes": len(observation), "tool_seconds": tool_seconds},
        )
        try:
            return await super().resume(
                cid,
                history_ids,
                observation,
                render,
                params,
                workflow_arrival=workflow_arrival,
                tool_seconds=tool_seconds,
            )
        except asyncio.CancelledError:
            self.rt.cancel(cid)
            raise


class AgentRuns:
    """The bounded runs table and the HTTP handlers over it.

    Reads the daemon at run time, not at construction (the runtime opens when
    the engine starts): ``rt`` (the Runtime), ``catalog`` (None when not
    built), ``live_engine()`` (503 while starting or after the engine died),
    ``draining`` and ``events.publish(kind, session_id, **data)``.
    """

    def __init__(
        self,
        daemon: Any,
        *,
        tasks: list[Task] | None = None,
        max_runs: int = MAX_RUNS,
        max_active: int = MAX_ACTIVE,
    ) -> None:
        if not 1 <= max_active <= max_runs:
            raise ValueError("need 1 <= max_active <= max_runs")
        self.d = daemon
        self.tasks = {t.task_id: t for t in (tasks if tasks is not None else load_tasks())}
        self.max_runs, self.max_active = max_runs, max_active
        self.runs: OrderedDict[str, AgentRun] = OrderedDict()
        self._seq = itertools.count(1)
        self.closing = False

    # ---- table
    def active(self) -> int:
        return sum(not r.done for r in self.runs.values())

    def get(self, run_id: str, tenant: str = LOCAL) -> AgentRun:
        """``tenant``'s run ``run_id`` (404 for another tenant's, as for none)."""
        run = self.runs.get(run_id)
        if run is None or run.tenant != tenant:
            raise ApiError(404, f"no agent run {run_id!r}", param="id", code="run_not_found")
        return run

    def catalog(self) -> Catalog:
        cat = self.d.catalog
        if cat is None:
            raise ApiError(
                503, "no catalog is built: run `ladsd catalog build`", code="catalog_missing"
            )
        return cat

    def start(self, req: RunRequest, tenant: str = LOCAL) -> AgentRun:
        if self.closing or self.d.draining:
            raise ApiError(503, "the daemon is shutting down", code="shutting_down")
        if self.active() >= self.max_active:
            raise ApiError(
                429,
                f"{self.max_active} agent runs are active; wait for one to end or cancel one",
                code="too_many_runs",
                headers={"Retry-After": "1"},
            )
        while len(self.runs) >= self.max_runs:  # evict the oldest finished run
            oldest = next(rid for rid, r in self.runs.items() if r.done)
            del self.runs[oldest]
        # The id names the workflow, hence every engine request id and link frame
        # of the run; it has no "/", so it is never a chat session's workflow id
        # (those are "<tenant>/<session id>").
        rid = f"agent-{next(self._seq)}-{secrets.token_hex(4)}"
        task = req.task if req.task.task_id != "custom" else replace(req.task, task_id=rid)
        now = clock.now()
        run = AgentRun(rid, task, req.agent, created=time.time(), t0=now, tenant=tenant)
        self.runs[rid] = run
        self._emit(run, "status", {"status": "queued"})
        run.job = asyncio.create_task(self._drive(run), name=f"ladsd-{rid}")
        return run

    def _emit(self, run: AgentRun, kind: str, data: dict[str, Any]) -> None:
        run.emit(kind, data)
        # The daemon's outcome stream gets a compact copy (no page texts).
        if kind == "step":
            a, st = data["action"], data["stages"]
            brief = {"turn": data["turn"], "action": a["name"], "product_id": a["product_id"]}
            brief |= {"cached_tokens": data["cached_tokens"], "stages": st}
        elif kind == "done":
            brief = {k: data[k] for k in ("status", "termination", "steps", "error")}
        else:
            brief = dict(data)
        self.d.events.publish(f"agent_{kind}", run.id, tenant=run.tenant, **brief)

    async def _drive(self, run: AgentRun) -> None:
        run.status = "running"
        self._emit(run, "status", {"status": "running"})

        def on_call(_: str, call: CallRecord) -> None:
            run.calls.append(call)
            self._emit(run, "step", call_view(call))

        try:
            rt = self.d.rt
            # The rate actually paced (the profile's, divided by the runtime's time
            # dilation): what queue_transfer (c-s) is to be read against.
            run.link = {
                "policy": rt.policy.name,
                "rate_bytes_per_s": rt.link.rate_bytes_per_s,
                "codec": rt.link.codec,
                "dilation": rt.dilation,
            }
            backend = _RunBackend(rt, rt.policy.name, lambda k, d: self._emit(run, k, d))
            rec = await run_workflow(
                run.task,
                backend,
                self.catalog(),
                run.agent,
                workflow=run.id,
                origin=run.t0,
                on_call=on_call,
            )
        except asyncio.CancelledError:
            self._end(run, "cancelled", None)
            raise
        except Exception as e:  # the loop catches model-call failures; this is the rest
            self._end(run, "failed", f"{type(e).__name__}: {e}")
            return
        run.record = rec
        if rec.termination == "error":
            self._end(run, "failed", rec.error)
        else:
            self._end(run, "completed", None)

    def _end(self, run: AgentRun, status: str, error: str | None) -> None:
        run.status, run.error, run.ended = status, error, clock.now()
        rec = run.record
        self._emit(
            run,
            "done",
            {
                "status": status,
                "termination": rec.termination if rec else None,
                "answer": rec.answer if rec else None,
                "error": error,
                "steps": len(run.calls),
                "stage_times": stage_totals(run.calls),
            },
        )

    async def cancel(self, run: AgentRun) -> None:
        if run.job is not None and not run.done:
            run.job.cancel()
            try:
                await run.job
            except asyncio.CancelledError:
                pass
        if not run.done:  # cancelled before its job ever ran
            self._end(run, "cancelled", None)

    async def shutdown(self, _app: web.Application | None = None) -> None:
        """Cancel every active run and end every run's stream (before the runtime closes)."""
        self.closing = True
        for run in list(self.runs.values()):
            await self.cancel(run)
            run.changed.set()

    # ---- handlers (an ApiError becomes OpenAI's error body in the daemon's middleware)
    async def create(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        req = parse_run(body, self.tasks, self.catalog())
        self.d.live_engine()  # 503 at once while the engine starts or after it died
        return json_response(self.start(req, tenant_of(request)).view(), 201)

    async def index(self, request: web.Request) -> web.Response:
        tenant = tenant_of(request)
        data = [r.summary() for r in self.runs.values() if r.tenant == tenant]
        return json_response({"object": "list", "data": data})

    def _run(self, request: web.Request) -> AgentRun:
        return self.get(request.match_info["id"], tenant_of(request))

    async def show(self, request: web.Request) -> web.Response:
        return json_response(self._run(request).view())

    async def delete(self, request: web.Request) -> web.Response:
        run = self._run(request)
        await self.cancel(run)
        return json_response(run.view())

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """SSE: every event of the run from the start (or after ``Last-Event-ID``),
        then live ones; ends after ``done``."""
        run = self._run(request)
        i = _resume_at(request.headers.get("Last-Event-ID", ""))
        resp = await open_sse(request)
        d = request.app.get(DAEMON)  # a reader that stops reading is cut
        limit = d.cfg.write_timeout_s if d is not None else WRITE_TIMEOUT_S
        while True:
            wake = run.changed  # taken before reading, so no event is missed
            while i < len(run.events):
                kind, data = run.events[i]
                await write_within(request, resp, _sse(i, kind, data), limit)
                i += 1
            if (run.done and i >= len(run.events)) or self.closing:
                break
            try:
                await asyncio.wait_for(wake.wait(), HEARTBEAT_S)
            except TimeoutError:
                await write_within(request, resp, b": keep-alive\n\n", limit)
        await resp.write_eof()
        return resp


def _resume_at(last: str) -> int:
    """The index after ``Last-Event-ID`` (none: 0); 400 unless ASCII digits (not "²")."""
    if not last:
        return 0
    if not (last.isascii() and last.isdigit()) or len(last) > MAX_EVENT_ID_DIGITS:
        raise ApiError(
            400,
            f"Last-Event-ID must be an event id: at most {MAX_EVENT_ID_DIGITS} digits",
            param="Last-Event-ID",
        )
    return int(last) + 1


def _sse(i: int, kind: str, data: dict[str, Any]) -> bytes:
    """One event with its index as ``id`` (a client resumes with ``Last-Event-ID``)."""
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (i, kind.encode(), dumps(data))


AGENTS: web.AppKey[AgentRuns] = web.AppKey("ladsd.agents", AgentRuns)


def install(daemon: Any) -> AgentRuns:
    """Add the agent-run endpoints to ``daemon.app`` (the Daemon calls this at construction).

    Active runs are cancelled on the app's shutdown, before the runtime closes.
    """
    runs = AgentRuns(daemon)
    daemon.app[AGENTS] = runs
    daemon.app.add_routes(
        [
            web.post("/v1/agent/runs", runs.create),
            web.get("/v1/agent/runs", runs.index),
            web.get("/v1/agent/runs/{id}", runs.show),
            web.delete("/v1/agent/runs/{id}", runs.delete),
            web.get("/v1/agent/runs/{id}/events", runs.stream),
        ]
    )
    daemon.app.on_shutdown.append(runs.shutdown)
    return runs
