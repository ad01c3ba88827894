"""``POST /v1/chat/completions`` and ``GET /v1/models`` over the daemon's engine.

One chat request: parse (:mod:`.chat`) -> model check -> admission (429 past
the limit) -> its session, if it names one -> prompt ids (a session's history
extended token-exactly, or the whole conversation rendered) -> the engine ->
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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ladsd import clock
from ladsd.engine.params import sampling
from ladsd.engine.thread import EngineDead, EngineError
from ladsd.records import ContinuationId, HistoryNotice
from ladsd.serve import chat, protocol
from ladsd.serve.app import (
    DAEMON,
    StalledReader,
    json_response,
    open_sse,
    read_json,
    sse,
    tenant_of,
    write_within,
)
from ladsd.serve.chat import ChatRequest, Piece, Reply
from ladsd.serve.errors import ApiError, bad
from ladsd.serve.sessions import Intent, LeaseView, Session, client_key

if TYPE_CHECKING:
    from ladsd.serve.daemon import Daemon


_ABORTS: set[asyncio.Task] = set()


@dataclass
class Plan:
    """What one request submits: prompt ids, and the continuation it binds (if any)."""

    turns: tuple[Piece, ...]
    prompt: list[int]
    cid: ContinuationId | None
    extends: bool


async def plan(d: Daemon, req: ChatRequest, s: Session | None) -> Plan:
    """The request's prompt ids, tokenised off the loop after the cheap context check."""
    turns = chat.pieces(req)
    n = len(s.turns) if s is not None else 0
    extends = s is not None and 0 < n < len(turns) and turns[:n] == s.turns
    history = s.history if s is not None and extends else None
    cid = s.waiting.cid if s is not None and extends and s.waiting is not None else None
    new = turns[n:] if extends else turns
    fits(d, req, len(history or ()) + d.renderer.least(new))
    return Plan(turns, await d.renderer.ids(new, history), cid, extends)


def fits(d: Daemon, req: ChatRequest, least: int) -> None:
    """Refuse, untokenised, a prompt of at least ``least`` tokens that certainly cannot fit."""
    limit, want = d.max_model_len, req.max_tokens
    if least + (want or 1) > limit:
        more = f" and {want} more were requested" if want else ""
        raise bad(
            f"this model's maximum context length is {limit} tokens; the messages take at "
            f"least {least}{more}",
            "messages",
            "context_length_exceeded",
        )


def params_for(d: Daemon, req: ChatRequest, prompt_len: int) -> Any:
    limit = d.max_model_len
    room = limit - prompt_len
    want = req.max_tokens if req.max_tokens is not None else room
    if room < 1 or want > room:
        raise bad(
            f"this model's maximum context length is {limit} tokens; the messages take "
            f"{prompt_len} and {want} more were requested",
            "messages",
            "context_length_exceeded",
        )
    check_bias(d, req)
    try:
        return sampling(
            max_tokens=want,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop=list(req.stop) or None,
            json_schema=dict(s) if (s := chat.output_schema(req)) is not None else None,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            knobs=req.sampling.knobs(),
        )
    except Exception as e:  # vLLM's own checks (e.g. min_tokens > max_tokens)
        raise bad(str(e)) from None


def check_bias(d: Daemon, req: ChatRequest) -> None:
    """``logit_bias`` names token ids of this model's vocabulary (400 before any output)."""
    if not req.sampling.logit_bias:
        return
    vocab = len(d.live_engine().tokenizer)
    outside = [t for t, _ in req.sampling.logit_bias if t >= vocab]
    if outside:
        raise bad(f"logit_bias: token ids {outside[:8]} are not in the vocabulary "
                  f"(0-{vocab - 1})", "logit_bias")  # fmt: skip


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
        d: Daemon,
        req: ChatRequest,
        request: web.Request,
        intents: tuple[Intent, ...] = (),
    ) -> None:
        self.d = d
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
        d, req = self.d, self.req
        # An existing session is held (busy) while the request is checked and tokenised;
        # a new one is opened only once the request is valid (a bad one leaves none).
        tenant = tenant_of(self.request)  # sessions are per tenant (the key's)
        held = d.sessions.get(req.session_id, tenant) if req.session_id else None
        if held is not None:
            claim(held)
        try:
            p = await plan(d, req, held)
            params = params_for(d, req, len(p.prompt))
            p = self._enter(held, p)
        except BaseException:
            if held is not None:
                held.busy = False
            raise
        return await self._submit(p, params)

    def _enter(self, held: Session | None, p: Plan) -> Plan:
        """The session the valid request runs in (``self.session``) and its plan there."""
        d, sid = self.d, self.req.session_id
        if sid is None:
            if self.intents:
                raise bad("'intent' needs a session (x-session-id or session_id)", "intent")
            return p
        if held is not None:
            if d.sessions.holds(held):
                self.session = held
                protocol.keep_intents(held, self.intents)
                return p
            held.busy = False  # ended while the request was tokenised: it runs without
            return Plan(p.turns, p.prompt, None, False)
        s = d.sessions.open(sid, tenant_of(self.request))
        if s.turns:  # created by a concurrent request meanwhile: its plan is not ours
            raise ApiError(409, f"session {s.id!r} changed; retry", code="session_busy")
        claim(s)
        self.session = s
        protocol.keep_intents(s, self.intents)
        return p

    async def _submit(self, p: Plan, params: Any) -> web.StreamResponse:
        d, req, s = self.d, self.req, self.session
        if s is not None:
            if s.waiting is not None and p.cid is None:
                d.cancel(s.waiting.cid)  # the conversation went another way: nothing to keep
            self.resume = s.waiting if p.cid is not None else None
            if self.resume is not None:  # the tool's result is back: its wait, learned
                s.tools.observe(clock.now() - self.resume.ready_time)
            s.waiting, s.bound = None, p.cid
        try:
            try:
                self.rid = d.live_engine().submit(p.prompt, params, cid=p.cid)
            except EngineDead:
                raise
            except EngineError as e:
                if s is not None and s.turn == 0 and d.sessions.holds(s):
                    d.sessions.end(s.id, s.tenant, "refused")  # opened for a refused request
                raise bad(str(e)) from None
            if req.stream:
                return await self._stream(p)
            return await self._complete(p)
        except asyncio.CancelledError:
            # While the daemon drains, the cancel is the shutdown's (aiohttp's, past --drain-s)
            self._gone(by_shutdown=d.draining)
            raise
        except ConnectionError as e:  # a write failed or timed out: nobody to answer or log
            self._gone(stalled=isinstance(e, StalledReader))
            return self.resp if self.resp is not None else web.Response()
        except BaseException:
            if p.cid is not None:
                d.cancel(p.cid)  # the bound request failed: its lease protects nothing now
            self._abort()  # e.g. a 503 before its stream was read: its queue must not stay
            raise
        finally:
            if s is not None:
                s.busy = False
                s.bound = None
                if d.sessions.holds(s):
                    d.sessions.touch(s)

    async def _complete(self, p: Plan) -> web.Response:
        try:
            comp = await self.d.live_engine().result(self.rid or "")
        except EngineDead:
            raise
        except EngineError as e:
            raise bad(str(e)) from None
        reply, finish, use = await self._finish(
            p, comp.token_ids, comp.text, comp.finish_reason, comp.num_cached_tokens
        )
        return json_response(
            chat.completion_body(self.id, self.created, self.req.model, reply, finish, use)
        )

    async def _stream(self, p: Plan) -> web.StreamResponse:
        req, eng = self.req, self.d.live_engine()
        resp = self.resp = await open_sse(self.request)

        def chunk(
            delta: dict[str, Any] | None, finish: str | None = None, use: Any = None
        ) -> bytes:
            return sse(chat.chunk(self.id, self.created, req.model, delta, finish, use))

        await self._write(resp, chunk({"role": "assistant", "content": ""}))
        # With tools the output is a JSON envelope: decoded as it comes, so an answer
        # streams as content and a call as tool_calls deltas (its notice still goes
        # out before the finish chunk that completes it).
        dec = chat.decoder(req) if req.calls_tools else None
        sent, last = 0, None
        try:
            async with aclosing(eng.stream(self.rid or "")) as outs:
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
        if req.include_usage:
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
            self.d.cancel(p.cid)
        await self._write(resp, sse(err.body()))
        await self._write(resp, sse("[DONE]"))
        return resp

    async def _write(self, resp: web.StreamResponse, data: bytes = b"", eof: bool = False) -> None:
        """One write of the stream (or its end, ``eof``), bounded by the write timeout.

        A client that takes none of it for ``write_timeout_s`` counts as gone: its
        connection is dropped (what it never read with it) and ConnectionResetError
        raised, so its request is aborted like any disconnect's and its slot comes back.
        """
        await write_within(self.request, resp, data, self.d.cfg.write_timeout_s, eof=eof)

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
        d, req, s = self.d, self.req, self.session
        reply = decoded if decoded is not None else chat.parse_reply(text, req)
        finish = chat.finish_reason(engine_reason, reply)
        use = chat.usage(len(p.prompt), len(output), cached)
        d.stats["prompt_tokens"] += len(p.prompt)
        d.stats["cached_tokens"] += cached
        d.stats["completion_tokens"] += len(output)
        turn = None
        if s is not None and not d.sessions.holds(s):
            s = None  # ended while it ran (DELETE, eviction): nothing to record or announce
        if s is not None:
            self.resume = None  # the turn is recorded: a later disconnect brings nothing back
            s.abandoned = False
            turn = s.turn
            s.turn += 1
            s.turns = (*p.turns, chat.reply_piece(reply))
            s.history = tuple(d.renderer.history(p.prompt, output))
            if reply.calls:
                protocol.announce(d, s, [c.name for c in reply.calls])
        d.events.publish(
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
        d = self.d
        self._abort()
        if by_shutdown:
            d.stats["shutdown_cancelled"] += 1
            return
        d.stats["disconnected"] += 1
        s = self.session
        reason = "write_timeout" if stalled else "client"
        d.events.publish(
            "disconnect", s.id if s is not None else None, request=self.id, reason=reason
        )
        if s is not None and d.sessions.holds(s):
            s.abandoned = True  # until a retry records a turn: not a completed workflow
            if self.resume is not None:
                self._resume(s, self.resume)

    def _abort(self) -> None:
        """Abort the engine request (idempotent). The stream's own cleanup aborts too; this
        covers an end between submit and read."""
        d = self.d
        if self.rid is not None and d.alive:
            t = asyncio.get_running_loop().create_task(d.live_engine().abort(self.rid))
            _ABORTS.add(t)  # a task nothing references may be collected before it runs
            t.add_done_callback(_ABORTS.discard)

    def _resume(self, s: Session, n: HistoryNotice) -> None:
        """``n`` waits again for the retry of its turn: announced afresh (ready now)."""
        d = self.d
        s.waiting = n = replace(n, ready_time=clock.now())
        if s.lease is None or s.lease.cid != n.cid or s.lease.status != "granted":
            # granted: the lease was never handed off and still holds; else a new candidate
            s.lease = LeaseView(n.cid, status="announced" if d.leases_enabled else "no_leases")
        if d.alive:
            d.live_engine().notice(n)


async def create(request: web.Request) -> web.StreamResponse:
    d: Daemon = request.app[DAEMON]
    body = await read_json(request)
    req = chat.parse(body, request.headers.get(chat.SESSION_HEADER))
    intents = protocol.parse_intents(body.get("intent"))
    chat.check_model(req.model, d.model)
    d.live_engine()  # 503 at once if the engine is down
    with d.admit():
        return await Turn(d, req, request, intents).run()


async def models(request: web.Request) -> web.Response:
    d: Daemon = request.app[DAEMON]
    return json_response({"object": "list", "data": [d.model_card()]})


async def model(request: web.Request) -> web.Response:
    d: Daemon = request.app[DAEMON]
    chat.check_model(request.match_info["id"], d.model)
    return json_response(d.model_card())


def install(d: Daemon) -> None:
    d.app[DAEMON] = d
    d.app.add_routes(
        [
            web.post("/v1/chat/completions", create),
            web.get("/v1/models", models),
            web.get("/v1/models/{id}", model),
        ]
    )
