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

A client that goes away (aiohttp cancels the handler; a write fails) aborts
its request and ends its session, releasing whatever the session holds.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ladsd.engine.params import sampling
from ladsd.engine.thread import EngineDead, EngineError
from ladsd.records import ContinuationId
from ladsd.serve import chat, protocol
from ladsd.serve.app import DAEMON, json_response, open_sse, read_json, sse
from ladsd.serve.chat import ChatRequest, Piece, Reply
from ladsd.serve.errors import ApiError, bad
from ladsd.serve.sessions import Session

if TYPE_CHECKING:
    from ladsd.serve.daemon import Daemon


@dataclass
class Plan:
    """What one request submits: prompt ids, and the continuation it binds (if any)."""

    turns: tuple[Piece, ...]
    prompt: list[int]
    cid: ContinuationId | None
    extends: bool


def plan(d: Daemon, req: ChatRequest, s: Session | None) -> Plan:
    turns = chat.pieces(req)
    if s is None:
        return Plan(turns, d.renderer.prompt(turns), None, False)
    n = len(s.turns)
    extends = 0 < n < len(turns) and turns[:n] == s.turns
    cid = s.waiting.cid if extends and s.waiting is not None else None
    prompt = d.renderer.extend(s.history, turns[n:]) if extends else d.renderer.prompt(turns)
    return Plan(turns, prompt, cid, extends)


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
        )
    except Exception as e:  # vLLM's own checks (e.g. min_tokens > max_tokens)
        raise bad(str(e)) from None


class Turn:
    """One chat request from admission to its reply."""

    def __init__(self, d: Daemon, req: ChatRequest, request: web.Request) -> None:
        self.d = d
        self.req = req
        self.request = request
        self.id = f"chatcmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.session: Session | None = None
        self.rid: str | None = None

    async def run(self) -> web.StreamResponse:
        d, req = self.d, self.req
        s = self.session = d.sessions.open(req.session_id) if req.session_id else None
        if s is not None and s.busy:
            raise ApiError(
                409, f"session {s.id!r} already has a request in flight", code="session_busy"
            )
        p = plan(d, req, s)
        params = params_for(d, req, len(p.prompt))
        if s is not None:
            if s.waiting is not None and p.cid is None:
                d.cancel(s.waiting.cid)  # the conversation went another way: nothing to keep
            s.waiting, s.bound, s.busy = None, p.cid, True
        try:
            try:
                self.rid = d.live_engine().submit(p.prompt, params, cid=p.cid)
            except EngineDead:
                raise
            except EngineError as e:
                raise bad(str(e)) from None
            if req.stream:
                return await self._stream(p)
            return await self._complete(p)
        except (asyncio.CancelledError, ConnectionError):
            self._gone()
            raise
        except BaseException:
            if p.cid is not None:
                d.cancel(p.cid)  # the bound request failed: its lease protects nothing now
            raise
        finally:
            if s is not None:
                s.busy = False
                s.bound = None
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
        resp = await open_sse(self.request)

        def chunk(
            delta: dict[str, Any] | None, finish: str | None = None, use: Any = None
        ) -> bytes:
            return sse(chat.chunk(self.id, self.created, req.model, delta, finish, use))

        await resp.write(chunk({"role": "assistant", "content": ""}))
        sent, last = 0, None
        try:
            async with aclosing(eng.stream(self.rid or "")) as outs:
                async for out in outs:
                    last = out
                    text = out.outputs[0].text
                    # Tool calls and the content envelope are JSON: sent whole at the end.
                    if not req.calls_tools and len(text) > sent:
                        await resp.write(chunk({"content": text[sent:]}))
                        sent = len(text)
        except EngineError as e:  # headers are out: the error goes in the stream
            if p.cid is not None:
                self.d.cancel(p.cid)
            status = 503 if isinstance(e, EngineDead) else 400
            err = ApiError(status, str(e), code="engine_dead" if status == 503 else None)
            await resp.write(sse(err.body()))
            await resp.write(sse("[DONE]"))
            return resp
        if last is None:
            raise ApiError(500, "the engine ended the request without output")
        c = last.outputs[0]
        reply, finish, use = await self._finish(
            p, tuple(c.token_ids), c.text, c.finish_reason, int(last.num_cached_tokens or 0)
        )
        if reply.calls:
            await resp.write(chunk({"tool_calls": chat.calls_body(reply.calls, index=True)}))
        elif req.calls_tools and reply.content:
            await resp.write(chunk({"content": reply.content}))
        await resp.write(chunk({}, finish))
        if req.include_usage:
            await resp.write(chunk(None, use=use))
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp

    async def _finish(
        self,
        p: Plan,
        output: tuple[int, ...],
        text: str,
        engine_reason: str | None,
        cached: int,
    ) -> tuple[Reply, str, dict[str, Any]]:
        """Reply, finish reason and usage; the session's bookkeeping and the tool notice."""
        d, req, s = self.d, self.req, self.session
        reply = chat.parse_reply(text, req)
        finish = chat.finish_reason(engine_reason, reply)
        use = chat.usage(len(p.prompt), len(output), cached)
        d.stats["prompt_tokens"] += len(p.prompt)
        d.stats["cached_tokens"] += cached
        d.stats["completion_tokens"] += len(output)
        turn = None
        if s is not None:
            turn = s.turn
            s.turn += 1
            s.turns = (*p.turns, chat.reply_piece(reply))
            s.history = tuple(d.renderer.history(p.prompt, output))
            if reply.calls:
                protocol.announce(d, s, reply.calls[0].name)
        d.events.publish(
            "completion",
            s.id if s is not None else None,
            turn=turn,
            finish_reason=finish,
            prompt_tokens=len(p.prompt),
            cached_tokens=cached,
            completion_tokens=len(output),
            bound=p.cid.key() if p.cid is not None else None,
        )
        return reply, finish, use

    def _gone(self) -> None:
        """The client went away: abort the request, end its session (releasing its leases)."""
        d = self.d
        d.stats["disconnected"] += 1
        if self.rid is not None and d.alive:
            # The stream's own cleanup aborts too; this covers a cancel between submit and read.
            asyncio.get_running_loop().create_task(d.live_engine().abort(self.rid))
        s = self.session
        d.events.publish("disconnect", s.id if s is not None else None, request=self.id)
        if s is not None:
            d.sessions.end(s.id)


async def create(request: web.Request) -> web.StreamResponse:
    d: Daemon = request.app[DAEMON]
    body = await read_json(request)
    req = chat.parse(body, request.headers.get(chat.SESSION_HEADER))
    chat.check_model(req.model, d.model)
    d.live_engine()  # 503 at once if the engine is down
    with d.admit():
        return await Turn(d, req, request).run()


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
