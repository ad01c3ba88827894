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
from dataclasses import replace
from typing import Any

from aiohttp import web

from ladsd import clock
from ladsd.agent.backend import Render
from ladsd.agent.link_backend import LinkBackend
from ladsd.agent.loop import run_workflow
from ladsd.records import ContinuationId
from ladsd.runtime import CallOutcome
from ladsd.serve.agent_run import AgentRun, RunRequest, call_view, parse_run, stage_totals
from ladsd.serve.app import LOCAL, read_json, tenant_of
from ladsd.serve.context import CONTEXT, ServeContext
from ladsd.serve.errors import ApiError
from ladsd.serve.responses import WRITE_TIMEOUT_S, dumps, json_response, open_sse, write_within
from ladsd.workloads.trace import TraceCall
from web_catalog.db import Catalog
from web_catalog.tasks import Task, load_tasks

MAX_RUNS = 256  # runs kept in the table (finished ones are evicted oldest first)
MAX_ACTIVE = 32  # runs queued or running at once; more get 429
HEARTBEAT_S = 15.0  # SSE comment line while nothing happens (keeps proxies from timing out)
MAX_EVENT_ID_DIGITS = 9  # Last-Event-ID: a run has far fewer events

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

    Reads the serve context at run time, not at construction (the runtime opens
    when the engine starts): ``rt`` (the Runtime), ``catalog`` (None when not
    built), ``live()`` (503 while starting or after the engine died),
    ``draining`` and ``events.publish(kind, session_id, **data)``.
    """

    def __init__(
        self,
        ctx: ServeContext,
        *,
        tasks: list[Task] | None = None,
        max_runs: int = MAX_RUNS,
        max_active: int = MAX_ACTIVE,
    ) -> None:
        if not 1 <= max_active <= max_runs:
            raise ValueError("need 1 <= max_active <= max_runs")
        self.ctx = ctx
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
        cat = self.ctx.catalog
        if cat is None:
            raise ApiError(
                503, "no catalog is built: run `ladsd catalog build`", code="catalog_missing"
            )
        return cat

    def start(self, req: RunRequest, tenant: str = LOCAL) -> AgentRun:
        if self.closing or self.ctx.draining:
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
        self.ctx.events.publish(f"agent_{kind}", run.id, tenant=run.tenant, **brief)

    async def _drive(self, run: AgentRun) -> None:
        run.status = "running"
        self._emit(run, "status", {"status": "running"})

        def on_call(_: str, call: TraceCall) -> None:
            run.calls.append(call)
            self._emit(run, "step", call_view(call))

        try:
            rt = self.ctx.rt
            assert rt is not None  # create() saw the engine up
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
        run.result.record = rec
        if rec.termination == "error":
            self._end(run, "failed", rec.error)
        else:
            self._end(run, "completed", None)

    def _end(self, run: AgentRun, status: str, error: str | None) -> None:
        run.status = status
        run.result.error, run.result.ended = error, clock.now()
        rec = run.result.record
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
            run.log.changed.set()

    # ---- handlers (an ApiError becomes OpenAI's error body in the daemon's middleware)
    async def create(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        req = parse_run(body, self.tasks, self.catalog())
        self.ctx.live()  # 503 at once while the engine starts or after it died
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
        ctx = request.app.get(CONTEXT)  # a reader that stops reading is cut
        limit = ctx.cfg.write_timeout_s if ctx is not None else WRITE_TIMEOUT_S
        while True:
            log = run.log
            wake = log.changed  # taken before reading, so no event is missed
            while i < len(log.events):
                kind, data = log.events[i]
                await write_within(request, resp, _sse(i, kind, data), limit)
                i += 1
            if (run.done and i >= len(log.events)) or self.closing:
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


def install(app: web.Application) -> AgentRuns:
    """Add the agent-run endpoints to ``app`` (its :data:`~.context.CONTEXT` set).

    Active runs are cancelled on the app's shutdown, before the runtime closes.
    """
    runs = AgentRuns(app[CONTEXT])
    app[AGENTS] = runs
    app.add_routes(
        [
            web.post("/v1/agent/runs", runs.create),
            web.get("/v1/agent/runs", runs.index),
            web.get("/v1/agent/runs/{id}", runs.show),
            web.delete("/v1/agent/runs/{id}", runs.delete),
            web.get("/v1/agent/runs/{id}/events", runs.stream),
        ]
    )
    app.on_shutdown.append(runs.shutdown)
    return runs
