"""The harness-engine protocol in HEAR's four kinds of message (peers.md section 2).

* **intent** (harness -> engine, a prediction): ``POST /v1/sessions/{id}/intent``
  ``{"tool", "expected_tool_s", "expected_result_bytes"}`` on a session that a
  chat request created (404 otherwise: an intent never creates one). The next
  tool wait of the session that calls ``tool`` (or any tool, without ``tool``) is
  announced with that timing: ``expected_wait_s`` becomes the notice's ``T_B``
  and the bytes its payload size, instead of the defaults.
* **requirements / control**: ``POST /v1/sessions/{id}/retention``
  ``{"mode": "preference" | "requirement" | "release"}`` for the history that
  waits for a tool. A *preference* is the budgeted lease every tool wait gets
  anyway (it may be denied or revoked; 202: accepted is not granted). A
  *requirement* is leased now if the budget and the headroom can hold it
  (200 with the record), else refused with the engine's reason (409), never
  dropped silently. Both stay bounded by ``l_i`` and ``H``. *release* drops it.
* **state & capabilities** (engine -> harness, observations, not guarantees):
  ``GET /v1/sessions/{id}`` (the session and its lease record: status,
  protected blocks, deadline, generation), ``GET /v1/engine/state`` (B, U, C,
  F, H, l, w, a, m, block size, dtype, the policy, the lease rule and its cap,
  what the daemon supports).
* **outcomes**: ``GET /v1/events``: SSE of grant, denial, handoff, expiry,
  revocation, cancellation and completion events with session ids.

The notice of a tool wait is the replay path's :class:`HistoryNotice`: the
continuation is the session's next turn, its history the prompt + output ids.

Every route sees only the sessions and events of the caller's tenant (another
tenant's session is a 404, as one that does not exist).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from ladsd import clock
from ladsd.engine.thread import EngineDead
from ladsd.records import HistoryNotice, LeaseEventKind
from ladsd.runtime import prefix_digest
from ladsd.serve.app import read_json, tenant_of
from ladsd.serve.chat import _TOOL_NAME, SESSION_HEADER, session_of
from ladsd.serve.context import CONTEXT, ServeContext
from ladsd.serve.errors import ApiError, bad
from ladsd.serve.events import wire
from ladsd.serve.harness import ANY_TOOL, Intent
from ladsd.serve.responses import json_response, open_sse, sse, write_within
from ladsd.serve.sessions import LeaseRule, LeaseView, Session, client_key

log = logging.getLogger("ladsd.serve")
# Defaults when no intent says otherwise. The client's tool results never travel
# the daemon's link, so the lease provider has no link estimate of T_B for them:
# without a default expected wait a session's history could never be near-use.
DEFAULT_RESULT_BYTES = 1024
DEFAULT_TOOL_S = 1.0
MAX_INTENTS = 64  # per session
MAX_TOOL_S = 3600.0
MAX_RESULT_BYTES = 64 * 1024 * 1024
MODES = ("preference", "requirement", "release")
MAX_BACKLOG_DIGITS = 9  # ?backlog=: more is refused (the hub keeps far fewer anyway)


def notice(
    s: Session,
    tool: str | Sequence[str] | None,
    p: float | None = None,
    rule: LeaseRule | None = None,
) -> HistoryNotice:
    """The notice of ``s``'s history waiting for ``tool`` (timing from its intent).

    Several tools (one reply's parallel calls): the wait ends with the slowest call,
    and the results together are the payload (the longest time, the summed bytes).
    ``p``: HEAR's continuation probability of the session, from completed sessions.
    ``rule`` (``--lease-rule``; None: ``fixed``): under ``session`` a tool without an
    intent expects the session's learned wait (once one was observed) and the notice
    carries ``l_i`` from the expected wait; under ``fixed`` it carries no lifetime.
    """
    tools = [tool or ANY_TOOL] if tool is None or isinstance(tool, str) else list(tool)
    learned = s.harness.tools.expected_s if rule is not None and rule.learns else None
    default = DEFAULT_TOOL_S if learned is None else learned
    secs, size = 0.0, 0
    for name in tools:
        it = s.harness.intent_for(name)
        t = it.expected_tool_s if it is not None else None
        b = it.expected_result_bytes if it is not None else None
        secs = max(secs, default if t is None else t)
        size += DEFAULT_RESULT_BYTES if b is None else b
    return HistoryNotice(
        cid=s.cid(s.turn),
        token_ids=s.transcript.history,
        prefix_digest=prefix_digest(s.transcript.history),
        payload_digest="",  # the result is the client's: the daemon never sees it in advance
        ready_time=clock.now(),
        payload_bytes=size,
        expected_wait_s=secs,
        continuation_p=p,
        lifetime_s=rule.lifetime(secs) if rule is not None else None,
    )


def announce(ctx: ServeContext, s: Session, tool: str | Sequence[str]) -> None:
    """``s`` ended in a call of ``tool`` (or calls of several): its history waits; tell the
    lease provider."""
    p = ctx.rt.continuation.p(s.turn) if ctx.rt is not None else None
    n = notice(s, tool, p, ctx.served.lease_rule)
    s.wait.notice = n
    # Without leases (e.g. --policy fifo) the notice is still sent, as the replay does,
    # but nothing will ever be granted: say so instead of "announced".
    on = ctx.runtime.leases_enabled
    s.wait.lease = LeaseView(n.cid, status="announced" if on else "no_leases")
    try:
        ctx.live().notice(n)  # queued ahead of the client's next request
    except (EngineDead, ApiError):
        log.warning("engine down: the history of session %s is not announced", s.id)


# ---- intent --------------------------------------------------------------------------


def parse_intent(body: Any) -> Intent:
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    unknown = sorted(set(body) - {"tool", "expected_tool_s", "expected_result_bytes"})
    if unknown:
        raise bad(f"unknown fields: {', '.join(unknown)}", unknown[0])
    tool = body.get("tool", ANY_TOOL)
    if not isinstance(tool, str) or not (tool == ANY_TOOL or _TOOL_NAME.match(tool)):
        raise bad(f"'tool' must be a tool name ([A-Za-z0-9_-]{{1,64}}) or {ANY_TOOL!r}", "tool")
    secs, size = body.get("expected_tool_s"), body.get("expected_result_bytes")
    if secs is None and size is None:
        raise bad("give expected_tool_s and/or expected_result_bytes")
    if secs is not None and (
        isinstance(secs, bool) or not isinstance(secs, int | float) or not 0 <= secs <= MAX_TOOL_S
    ):
        raise bad(f"'expected_tool_s' must be a number in [0, {MAX_TOOL_S:g}]", "expected_tool_s")
    if size is not None and (
        isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_RESULT_BYTES
    ):
        raise bad(
            f"'expected_result_bytes' must be an integer in [0, {MAX_RESULT_BYTES}]",
            "expected_result_bytes",
        )
    return Intent(tool, None if secs is None else float(secs), size)


def _sid(request: web.Request) -> str:
    sid = session_of(request.match_info["id"], None)
    assert sid is not None
    return sid


def _session(request: web.Request) -> Session:
    """The caller's session named in the path (404 if the caller has none by that id)."""
    return request.app[CONTEXT].sessions.find(_sid(request), tenant_of(request))


def parse_intents(raw: Any) -> tuple[Intent, ...]:
    """A chat body's ``intent`` (ladsd's extension): one intent object, a list of them, or
    absent. It lets a harness state its first tool's timing in the request that creates
    the session (``POST .../intent`` needs the session to exist)."""
    if raw is None:
        return ()
    items = raw if isinstance(raw, list) else [raw]
    if len(items) > MAX_INTENTS:
        raise bad(f"at most {MAX_INTENTS} intents", "intent")
    try:
        return tuple(parse_intent(x) for x in items)
    except ApiError as e:
        raise bad(f"intent: {e.message}", "intent") from None


def keep_intents(s: Session, intents: Sequence[Intent]) -> None:
    """Set ``intents`` on ``s`` (newest per tool wins); 400 past MAX_INTENTS tools."""
    for it in intents:
        kept = s.harness.intents
        if it.tool not in kept and len(kept) >= MAX_INTENTS:
            raise bad(f"a session keeps at most {MAX_INTENTS} intents", "tool")
        kept[it.tool] = it


async def intent(request: web.Request) -> web.Response:
    it = parse_intent(await read_json(request))
    s = _session(request)
    keep_intents(s, [it])
    body = {"accepted": True, "session_id": s.id, "intent": it.__dict__}
    body["applies_to"] = "tool waits that start after it (the session's next tool calls)"
    return json_response(body, 202)


# ---- requirements / control -----------------------------------------------------------


async def retention(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    body = await read_json(request)
    mode = body.get("mode") if isinstance(body, dict) else None
    if mode not in MODES:
        raise bad(f"'mode' must be one of {', '.join(MODES)}", "mode")
    s = _session(request)
    rt = ctx.live()
    if mode != "release" and not ctx.runtime.leases_enabled:
        raise ApiError(
            409,
            f"policy {ctx.served.policy} runs without leases: nothing can be retained",
            code="leases_disabled",
        )
    if s.busy:  # its request may be binding the waiting history right now
        raise ApiError(
            409, f"session {s.id!r} has a request in flight", code="session_busy"
        )
    n, view = s.wait.notice, s.wait.lease
    if n is None or view is None:
        raise ApiError(
            409, f"session {s.id!r} has no history waiting for a tool", code="not_waiting"
        )
    if mode == "release":
        ctx.runtime.cancel(n.cid)
        s.wait.notice = None
        return json_response({"status": "released", "lease": view.as_dict()})
    view.mode = mode
    if mode == "preference":
        rt.notice(n)  # a repeat leaves a lease or a pending candidate as it is
        return json_response({"status": "accepted", "lease": view.as_dict()}, 202)
    reason = await rt.require(n)
    if reason is not None:
        view.status, view.reason = "refused", reason
        key = client_key(n.cid)
        ctx.events.publish("refusal", s.id, turn=n.cid.turn, continuation=key, reason=reason)
        raise ApiError(409, f"the requirement cannot be held now: {reason}", code="refused")
    # Held now; its record (blocks, deadline) comes with the next published state.
    view.status, view.reason = "granted", None
    return json_response({"status": "held", "lease": view.as_dict()})


# ---- state & capabilities -------------------------------------------------------------


async def session_state(request: web.Request) -> web.Response:
    return json_response(_session(request).view())


async def sessions(request: web.Request) -> web.Response:
    mine = request.app[CONTEXT].sessions.of(tenant_of(request))
    return json_response({"object": "list", "data": [s.view() for s in mine]})


async def delete_session(request: web.Request) -> web.Response:
    s = _session(request)
    request.app[CONTEXT].sessions.end(s.id, s.tenant, why="delete")
    return json_response({"id": s.id, "object": "session.deleted", "deleted": True})


async def engine_state(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    served = ctx.served
    rt = ctx.live()
    info = rt.engine_info()  # lease config, block size, dtype
    lease = info.lease
    s = ctx.state
    body: dict[str, Any] = {"object": "engine.state", "model": served.model}
    body["profile"] = served.profile.name
    if s is None:  # nothing published yet (the first tick is 100 ms away)
        snap = await rt.snapshot()
        body |= {"F": snap.free_blocks, "w": snap.waiting, "a": snap.running}
        usable = snap.total_blocks - 1  # the null block, as the published state counts it
        body |= {"m": snap.max_num_seqs, "total_blocks": usable, "kappa": snap.kappa}
        body |= {"B": 0, "U": 0, "C": 0, "generation": 0, "active_leases": 0, "counters": {}}
    else:
        body |= {"B": s.B, "U": s.U, "C": s.C, "F": s.F, "w": s.w, "a": s.a, "m": s.m}
        body |= {"total_blocks": s.total_blocks, "kappa": s.kappa, "generation": s.generation}
        body |= {"time": s.time, "seq": s.seq, "active_leases": len(s.leases)}
        body["counters"] = s.counters
    # vLLM's num_gpu_blocks (its cache_config_info): the pool with its null block
    body["num_gpu_blocks"] = body["total_blocks"] + 1
    body |= {
        "H": lease.headroom_blocks,
        "l": lease.lease_lifetime_s,
        "block_size": info.block_size,
        "dtype": info.dtype,
        "max_model_len": served.max_model_len,
        "policy": served.policy,
        **served.lease_rule.as_dict(),  # --lease-rule, --lease-max-s and the margin (ours)
        "leases_enabled": ctx.runtime.leases_enabled,
        "sessions": len(ctx.sessions),
        "supports": capabilities(ctx),
    }
    return json_response(body)


# ---- outcomes ------------------------------------------------------------------------


def _backlog(raw: str, keep: int) -> int:
    """``?backlog=``: ASCII digits (``isdigit`` takes "²"), at most the hub's ``keep``."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > MAX_BACKLOG_DIGITS:
        raise bad(
            f"'backlog' must be a non-negative integer of at most {MAX_BACKLOG_DIGITS} digits",
            "backlog",
        )
    return min(int(raw), keep)


async def events(request: web.Request) -> web.StreamResponse:
    """SSE of the caller's outcomes; ``?session_id=`` filters, ``?backlog=N`` replays the
    last N first. Every refusal (400, 429) comes before the stream opens."""
    ctx = request.app[CONTEXT]
    hub = ctx.events
    sid = session_of(request.query.get("session_id"), None)
    n = _backlog(request.query.get("backlog", "0"), hub.backlog.maxlen or 0)
    sub = hub.join(sid, n, tenant_of(request))  # 429 past the subscriber cap
    try:
        resp = await open_sse(request)
        limit = ctx.cfg.write_timeout_s  # a reader that stops reading loses its subscription
        async for ev in hub.follow(sub):
            data = b": keep-alive\n\n" if ev is None else sse(wire(ev), ev["type"])
            await write_within(request, resp, data, limit)
        await resp.write_eof()
        return resp  # a reader that went away: the errors middleware logs it at debug
    finally:
        hub.leave(sub)


EVENT_TYPES = (
    *(k.value for k in LeaseEventKind),
    "completion",
    "disconnect",
    "refusal",
    "session_end",
    # /v1/agents runs: a compact copy of each run's own stream (run id as session id)
    "agent_status",
    "agent_tool_result",
    "agent_step",
    "agent_done",
)


def capabilities(ctx: ServeContext) -> dict[str, Any]:
    """What this daemon supports (``GET /v1/engine/state``'s ``supports``)."""
    t = ctx.sessions
    return {
        "chat": {
            "tools": True,
            "tool_choice": ["none", "auto", "required", "function"],
            "streaming": True,
            "response_format": ["text", "json_object", "json_schema"],
        },
        "sessions": {
            "header": SESSION_HEADER,
            "max": t.max_sessions,
            "max_per_tenant": t.per_tenant,
            "idle_ttl_s": t.ttl_s,
            "owner": "the tenant of the API key that created it",
        },
        "intent": ["tool", "expected_tool_s", "expected_result_bytes"],
        "retention": list(MODES) if ctx.runtime.leases_enabled else ["release"],
        "events": list(EVENT_TYPES),
        "admission": {"max_in_flight": ctx.admission.limit},
        "connections": dataclasses.asdict(ctx.cfg.limits),
    }


def install(app: web.Application) -> None:
    """Add the session, state and event routes to ``app`` (its :data:`~.context.CONTEXT` set)."""
    app.add_routes(
        [
            web.get("/v1/engine/state", engine_state),
            web.get("/v1/events", events),
            web.get("/v1/sessions", sessions),
            web.get("/v1/sessions/{id}", session_state),
            web.delete("/v1/sessions/{id}", delete_session),
            web.post("/v1/sessions/{id}/intent", intent),
            web.post("/v1/sessions/{id}/retention", retention),
        ]
    )
