"""One agent run: the POST body that starts it, its record, and how the API shows it.

:func:`parse_run` validates ``POST /v1/agent/runs`` (400 for a bad body, 404
for an unknown task or product); :class:`AgentRun` is a run's state and event
log; :func:`call_view` and :func:`stage_totals` are its model calls as the API
shows them. No engine and no table here: :mod:`.agents` drives the runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from ladsd import clock
from ladsd.agent.loop import AgentConfig
from ladsd.clock import STAGES
from ladsd.serve.app import LOCAL
from ladsd.serve.errors import ApiError
from ladsd.workloads.trace import TraceCall, TraceWorkflow
from web_catalog.db import Catalog
from web_catalog.tasks import Task, TaskProduct

MAX_PRODUCTS = 6
MAX_QUESTION_CHARS = 2000
TERMINAL = ("completed", "failed", "cancelled")

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


def call_view(c: TraceCall) -> dict[str, Any]:
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


def stage_totals(calls: list[TraceCall]) -> dict[str, dict[str, float | int]]:
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
class RunLog:
    """A run's events in order, and the wake-up of every stream that follows them."""

    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def append(self, kind: str, data: dict[str, Any]) -> None:
        """Append an event and wake every stream (each waits on the current Event)."""
        self.events.append((kind, data))
        old, self.changed = self.changed, asyncio.Event()
        old.set()


@dataclass
class RunResult:
    """What a run came to: the loop's record (None if it never returned one), the error."""

    record: TraceWorkflow | None = None
    error: str | None = None
    ended: float | None = None  # ladsd.clock


@dataclass
class AgentRun:
    id: str
    task: Task
    agent: AgentConfig
    created: float  # Unix time (for people)
    t0: float  # ladsd.clock at creation: every time of the run is relative to it
    status: str = "queued"  # queued | running | completed | failed | cancelled
    calls: list[TraceCall] = field(default_factory=list)
    result: RunResult = field(default_factory=RunResult)
    log: RunLog = field(default_factory=RunLog)
    job: asyncio.Task | None = None
    link: dict[str, Any] | None = None  # the return path its results took (set at start)
    tenant: str = LOCAL  # whose key started it

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        """Append an event and wake every stream."""
        self.log.append(kind, {"run": self.id, **data})

    def view(self) -> dict[str, Any]:
        rec, res = self.result.record, self.result
        end = res.ended if res.ended is not None else clock.now()
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
            "error": res.error,
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
