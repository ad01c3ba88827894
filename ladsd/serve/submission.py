"""What one chat request submits: its prompt ids and sampling params, checked first.

The prompt is a session's history extended token-exactly when the request's
turns extend the session's (binding the continuation that waits), else the
whole conversation rendered; tokenising runs off the event loop (:mod:`.render`)
and only after a cheap lower bound shows the prompt may fit. Every refusal is a
400 before anything reaches the engine (``context_length_exceeded``, vLLM's own
parameter checks, ``logit_bias`` outside the vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ladsd.engine.params import sampling
from ladsd.records import ContinuationId
from ladsd.serve import replies
from ladsd.serve.chat import ChatRequest
from ladsd.serve.context import ServeContext
from ladsd.serve.errors import bad
from ladsd.serve.replies import Piece
from ladsd.serve.sessions import Session


@dataclass
class Plan:
    """What one request submits: prompt ids, and the continuation it binds (if any)."""

    turns: tuple[Piece, ...]
    prompt: list[int]
    cid: ContinuationId | None
    extends: bool


async def plan(ctx: ServeContext, req: ChatRequest, s: Session | None) -> Plan:
    """The request's prompt ids, tokenised off the loop after the cheap context check."""
    turns = replies.pieces(req)
    said = s.transcript if s is not None else None
    n = len(said.turns) if said is not None else 0
    extends = said is not None and 0 < n < len(turns) and turns[:n] == said.turns
    history = said.history if said is not None and extends else None
    waiting = s.wait.notice if s is not None and extends else None
    cid = waiting.cid if waiting is not None else None
    new = turns[n:] if extends else turns
    renderer = ctx.runtime.renderer
    assert renderer is not None  # the runtime is up: admitted requests only
    fits(ctx, req, len(history or ()) + renderer.least(new))
    return Plan(turns, await renderer.ids(new, history), cid, extends)


def fits(ctx: ServeContext, req: ChatRequest, least: int) -> None:
    """Refuse, untokenised, a prompt of at least ``least`` tokens that certainly cannot fit."""
    limit, want = ctx.served.max_model_len, req.output.max_tokens
    if least + (want or 1) > limit:
        more = f" and {want} more were requested" if want else ""
        raise bad(
            f"this model's maximum context length is {limit} tokens; the messages take at "
            f"least {least}{more}",
            "messages",
            "context_length_exceeded",
        )


def params_for(ctx: ServeContext, req: ChatRequest, prompt_len: int) -> Any:
    limit = ctx.served.max_model_len
    room = limit - prompt_len
    out, smp = req.output, req.sampling
    want = out.max_tokens if out.max_tokens is not None else room
    if room < 1 or want > room:
        raise bad(
            f"this model's maximum context length is {limit} tokens; the messages take "
            f"{prompt_len} and {want} more were requested",
            "messages",
            "context_length_exceeded",
        )
    check_bias(ctx, req)
    try:
        return sampling(
            max_tokens=want,
            temperature=smp.temperature,
            top_p=smp.top_p,
            seed=smp.seed,
            stop=list(out.stop) or None,
            json_schema=dict(s) if (s := replies.output_schema(req)) is not None else None,
            min_tokens=out.min_tokens,
            ignore_eos=out.ignore_eos,
            knobs=smp.knobs(),
        )
    except Exception as e:  # vLLM's own checks (e.g. min_tokens > max_tokens)
        raise bad(str(e)) from None


def check_bias(ctx: ServeContext, req: ChatRequest) -> None:
    """``logit_bias`` names token ids of this model's vocabulary (400 before any output)."""
    if not req.sampling.logit_bias:
        return
    vocab = len(ctx.live().tokenizer)
    outside = [t for t, _ in req.sampling.logit_bias if t >= vocab]
    if outside:
        raise bad(f"logit_bias: token ids {outside[:8]} are not in the vocabulary "
                  f"(0-{vocab - 1})", "logit_bias")  # fmt: skip
