"""``POST /v1/chat/completions`` and ``GET /v1/models`` over the daemon's engine.

One chat request: parse (:mod:`.chat`) -> model check -> admission (429 past
the limit) -> its session, if it names one -> prompt ids and params
(:mod:`.submission`: a session's history extended token-exactly, or the whole
conversation rendered) -> the engine (through the runtime) ->
one JSON body, or SSE chunks ending in ``data: [DONE]``.

A session's request whose turns extend its waiting history is submitted with
that continuation's id, so the engine binds it and hands its lease off at
allocation. A reply that is a tool call makes the new history wait for the
tool: the daemon announces it to the engine (:func:`.protocol.announce`)
before the client has the reply.

A session is opened only for a valid request (checked, tokenised off the
event loop: :mod:`.render`). A client that goes away (aiohttp cancels the
handler; a write fails, or takes nothing for ``write_timeout_s``) aborts its
request and frees its slot; its session stays, with the history the request
bound waiting again, so a retry of the same turn binds it. A request whose
session ended while it ran (DELETE) records and announces nothing.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from ladsd import clock
from ladsd.engine.thread import EngineDead, EngineError
from ladsd.records import HistoryNotice
from ladsd.serve import chat, protocol, replies
from ladsd.serve.app import read_json, tenant_of
from ladsd.serve.chat import ChatRequest
from ladsd.serve.context import CONTEXT, ServeContext
from ladsd.serve.envelope import Reply
from ladsd.serve.errors import ApiError, bad
from ladsd.serve.harness import Intent
from ladsd.serve.responses import StalledReader, json_response, open_sse, sse, write_within
from ladsd.serve.sessions import LeaseView, Session, client_key
from ladsd.serve.submission import Plan, params_for, plan

_ABORTS: set[asyncio.Task] = set()


def claim(s: Session) -> None:
    """Mark ``s`` busy for one request; 409 if another one has it."""
    if s.busy:
        msg = f"session {s.id!r} already has a request in flight"
        raise ApiError(409, msg, code="session_busy")
    s.busy = True


class Turn:
    """One chat request from admission to its reply."""

    def __init__(
        self,
        ctx: ServeContext,
        req: ChatRequest,
        request: web.Request,
        intents: tuple[Intent, ...] = (),
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.request = request
        self.intents = intents  # the body's ``intent``: set on the session it runs in
        self.id = f"chatcmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.session: Session | None = None
        self.rid: str | None = None
        self.resume: HistoryNotice | None = None  # the waiting history this request binds
        self.resp: web.StreamResponse | None = None  # the stream, once its headers are out

    async def run(self) -> web.StreamResponse:
        ctx, req = self.ctx, self.req
        # An existing session is held (busy) while the request is checked and tokenised;
        # a new one is opened only once the request is valid (a bad one leaves none).
        tenant = tenant_of(self.request)  # sessions are per tenant (the key's)
        held = ctx.sessions.get(req.session_id, tenant) if req.session_id else None
        if held is not None:
            claim(held)
        try:
            p = await plan(ctx, req, held)
            params = params_for(ctx, req, len(p.prompt))
            p = self._enter(held, p)
        except BaseException:
            if held is not None:
                held.busy = False
            raise
        return await self._submit(p, params)

    def _enter(self, held: Session | None, p: Plan) -> Plan:
        """The session the valid request runs in (``self.session``) and its plan there."""
        sessions, sid = self.ctx.sessions, self.req.session_id
        if sid is None:
            if self.intents:
                raise bad("'intent' needs a session (x-session-id or session_id)", "intent")
            return p
        if held is not None:
            if sessions.holds(held):
                self.session = held
                protocol.keep_intents(held, self.intents)
                return p
            held.busy = False  # ended while the request was tokenised: it runs without
            return Plan(p.turns, p.prompt, None, False)
        s = sessions.open(sid, tenant_of(self.request))
        if s.transcript.turns:  # created by a concurrent request meanwhile: its plan is not ours
            raise ApiError(409, f"session {s.id!r} changed; retry", code="session_busy")
        claim(s)
        self.session = s
        protocol.keep_intents(s, self.intents)
        return p

    async def _submit(self, p: Plan, params: Any) -> web.StreamResponse:
        ctx, req, s = self.ctx, self.req, self.session
        if s is not None:
            wait = s.wait
            if wait.notice is not None and p.cid is None:
                # the conversation went another way: nothing to keep
                ctx.runtime.cancel(wait.notice.cid)
            self.resume = wait.notice if p.cid is not None else None
            if self.resume is not None:  # the tool's result is back: its wait, learned
                s.harness.tools.observe(clock.now() - self.resume.ready_time)
            wait.notice, wait.bound = None, p.cid
        try:
            try:
                self.rid = ctx.live().submit(p.prompt, params, cid=p.cid)
            except EngineDead:
                raise
            except EngineError as e:
                if s is not None and s.turn == 0 and ctx.sessions.holds(s):
                    ctx.sessions.end(s.id, s.tenant, "refused")  # opened for a refused request
                raise bad(str(e)) from None
            if req.output.stream:
                return await self._stream(p)
            return await self._complete(p)
        except asyncio.CancelledError:
            # While the daemon drains, the cancel is the shutdown's (aiohttp's, past --drain-s)
            self._gone(by_shutdown=ctx.draining)
            raise
        except ConnectionError as e:  # a write failed or timed out: nobody to answer or log
            self._gone(stalled=isinstance(e, StalledReader))
            return self.resp if self.resp is not None else web.Response()
        except BaseException:
            if p.cid is not None:
                ctx.runtime.cancel(p.cid)  # the bound request failed: its lease protects nothing
            self._abort()  # e.g. a 503 before its stream was read: its queue must not stay
            raise
        finally:
            if s is not None:
                s.busy = False
                s.wait.bound = None
                if ctx.sessions.holds(s):
                    ctx.sessions.touch(s)

    async def _complete(self, p: Plan) -> web.Response:
        try:
            comp = await self.ctx.live().result(self.rid or "")
        except EngineDead:
            raise
        except EngineError as e:
            raise bad(str(e)) from None
        reply, finish, use = await self._finish(
            p, comp.token_ids, comp.text, comp.finish_reason, comp.num_cached_tokens
        )
        return json_response(
            replies.completion_body(self.id, self.created, self.req.model, reply, finish, use)
        )

    async def _stream(self, p: Plan) -> web.StreamResponse:
        req, rt = self.req, self.ctx.live()
        resp = self.resp = await open_sse(self.request)

        def chunk(
            delta: dict[str, Any] | None, finish: str | None = None, use: Any = None
        ) -> bytes:
            return sse(replies.chunk(self.id, self.created, req.model, delta, finish, use))

        await self._write(resp, chunk({"role": "assistant", "content": ""}))
        # With tools the output is a JSON envelope: decoded as it comes, so an answer
        # streams as content and a call as tool_calls deltas (its notice still goes
        # out before the finish chunk that completes it).
        dec = replies.decoder(req) if req.calls_tools else None
        sent, last = 0, None
        try:
            async with aclosing(rt.stream(self.rid or "")) as outs:
                async for out in outs:
                    last = out
                    text = out.outputs[0].text
                    if len(text) > sent:
                        piece, sent = text[sent:], len(text)
                        for delta in [{"content": piece}] if dec is None else dec.feed(piece):
                            await self._write(resp, chunk(delta))
        except EngineError as e:  # headers are out: the error goes in the stream
            status = 503 if isinstance(e, EngineDead) else 400
            err = ApiError(status, str(e), code="engine_dead" if status == 503 else None)
            return await self._fail_stream(resp, p, err)
        if last is None:
            return await self._fail_stream(
                resp, p, ApiError(500, "the engine ended the request without output")
            )
        c = last.outputs[0]
        cached, decoded = int(last.num_cached_tokens or 0), dec.reply() if dec is not None else None
        reply, finish, use = await self._finish(
            p, tuple(c.token_ids), c.text, c.finish_reason, cached, decoded
        )
        for delta in dec.close() if dec is not None else ():
            await self._write(resp, chunk(delta))  # an output that streamed nothing yet
        await self._write(resp, chunk({}, finish))
        if req.output.include_usage:
            await self._write(resp, chunk(None, use=use))
        await self._write(resp, sse("[DONE]"))
        await self._write(resp, eof=True)
        return resp

    async def _fail_stream(
        self, resp: web.StreamResponse, p: Plan, err: ApiError
    ) -> web.StreamResponse:
        """The SSE headers are out: the error is the stream's last event (never a second
        response), and the bound history is released (its request failed)."""
        if p.cid is not None:
            self.ctx.runtime.cancel(p.cid)
        await self._write(resp, sse(err.body()))
        await self._write(resp, sse("[DONE]"))
        return resp

    async def _write(self, resp: web.StreamResponse, data: bytes = b"", eof: bool = False) -> None:
        """One write of the stream (or its end, ``eof``), bounded by the write timeout.

        A client that takes none of it for ``write_timeout_s`` counts as gone: its
        connection is dropped (what it never read with it) and ConnectionResetError
        raised, so its request is aborted like any disconnect's and its slot comes back.
        """
        await write_within(self.request, resp, data, self.ctx.cfg.write_timeout_s, eof=eof)

    async def _finish(
        self,
        p: Plan,
        output: tuple[int, ...],
        text: str,
        engine_reason: str | None,
        cached: int,
        decoded: Reply | None = None,
    ) -> tuple[Reply, str, dict[str, Any]]:
        """Reply, finish reason and usage; the session's bookkeeping and the tool notice.

        ``decoded``: the reply a stream's decoder made (its call ids were sent), else
        ``text`` is parsed.
        """
        ctx, req, s = self.ctx, self.req, self.session
        reply = decoded if decoded is not None else replies.parse_reply(text, req)
        finish = replies.finish_reason(engine_reason, reply)
        use = replies.usage(len(p.prompt), len(output), cached)
        ctx.stats["prompt_tokens"] += len(p.prompt)
        ctx.stats["cached_tokens"] += cached
        ctx.stats["completion_tokens"] += len(output)
        turn = None
        if s is not None and not ctx.sessions.holds(s):
            s = None  # ended while it ran (DELETE, eviction): nothing to record or announce
        if s is not None:
            self.resume = None  # the turn is recorded: a later disconnect brings nothing back
            s.abandoned = False
            turn = s.turn
            s.turn += 1
            s.transcript.turns = (*p.turns, replies.reply_piece(reply))
            renderer = ctx.runtime.renderer
            assert renderer is not None
            s.transcript.history = tuple(renderer.history(p.prompt, output))
            if reply.calls:
                protocol.announce(ctx, s, [c.name for c in reply.calls])
        ctx.events.publish(
            "completion",
            s.id if s is not None else None,
            turn=turn,
            finish_reason=finish,
            prompt_tokens=len(p.prompt),
            cached_tokens=cached,
            completion_tokens=len(output),
            bound=client_key(p.cid) if p.cid is not None else None,
        )
        return reply, finish, use

    def _gone(self, by_shutdown: bool = False, stalled: bool = False) -> None:
        """The client went away (or stopped reading): abort the request, keep the session.

        A client's timeout-and-retry must not lose its history: the history this
        request bound waits again (:meth:`_resume`), so a retry of the same turn
        binds it; the session ends as sessions do (TTL, DELETE, eviction).
        ``by_shutdown``: cancelled by the shutdown, which is no disconnect;
        ``stalled``: it read nothing for the write timeout.
        """
        ctx = self.ctx
        self._abort()
        if by_shutdown:
            ctx.stats["shutdown_cancelled"] += 1
            return
        ctx.stats["disconnected"] += 1
        s = self.session
        reason = "write_timeout" if stalled else "client"
        ctx.events.publish(
            "disconnect", s.id if s is not None else None, request=self.id, reason=reason
        )
        if s is not None and ctx.sessions.holds(s):
            s.abandoned = True  # until a retry records a turn: not a completed workflow
            if self.resume is not None:
                self._resume(s, self.resume)

    def _abort(self) -> None:
        """Abort the engine request (idempotent). The stream's own cleanup aborts too; this
        covers an end between submit and read."""
        ctx = self.ctx
        if self.rid is not None and ctx.alive:
            t = asyncio.get_running_loop().create_task(ctx.live().abort(self.rid))
            _ABORTS.add(t)  # a task nothing references may be collected before it runs
            t.add_done_callback(_ABORTS.discard)

    def _resume(self, s: Session, n: HistoryNotice) -> None:
        """``n`` waits again for the retry of its turn: announced afresh (ready now)."""
        ctx = self.ctx
        wait = s.wait
        wait.notice = n = replace(n, ready_time=clock.now())
        if wait.lease is None or wait.lease.cid != n.cid or wait.lease.status != "granted":
            # granted: the lease was never handed off and still holds; else a new candidate
            on = ctx.runtime.leases_enabled
            wait.lease = LeaseView(n.cid, status="announced" if on else "no_leases")
        if ctx.alive:
            ctx.live().notice(n)


async def create(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    body = await read_json(request)
    req = chat.parse(body, request.headers.get(chat.SESSION_HEADER))
    intents = protocol.parse_intents(body.get("intent"))
    chat.check_model(req.model, ctx.model)
    ctx.live()  # 503 at once if the engine is down
    with ctx.admission.admit():
        return await Turn(ctx, req, request, intents).run()


async def models(request: web.Request) -> web.Response:
    card = request.app[CONTEXT].served.model_card()
    return json_response({"object": "list", "data": [card]})


async def model(request: web.Request) -> web.Response:
    served = request.app[CONTEXT].served
    chat.check_model(request.match_info["id"], served.model)
    return json_response(served.model_card())


def install(app: web.Application) -> None:
    """Add the chat and model routes to ``app`` (its :data:`~.context.CONTEXT` set)."""
    app.add_routes(
        [
            web.post("/v1/chat/completions", create),
            web.get("/v1/models", models),
            web.get("/v1/models/{id}", model),
        ]
    )
