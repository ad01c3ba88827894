"""A session workload from the cc-traces (issue 21): real coding-agent sessions, synthetic text.

Each selected conversation is one :class:`SessionSpec`; each of its model requests
is one :class:`Turn`; each subagent is a session of its own.

Kept from the trace:

- the order of requests, and which requests share which input blocks
  (``hash_ids``): equal ids give equal token blocks, so a prefix the trace
  shared is a prefix of token ids here, and a turn's prompt extends the
  previous turn's prompt exactly where the trace's ids do;
- the block count of each prompt (scaled, below), ``out`` (scaled, capped),
  ``think_time`` (times ``time_factor``, capped) and a subagent's start ``t``
  (times ``time_factor``, after its parent's arrival).

Synthesised (the traces carry no text):

- token ids. Block ``h`` of conversation ``c`` is ``block_size`` ids drawn from
  SHAKE-128 of ``"c/h"`` in ``[vocab_low, vocab_high)`` (a range of plain-text
  ids that leaves the special tokens out). The function ignores the seed and
  Python's hash randomisation; ``c`` is part of the key because the traces'
  ids are ``local`` (unique within one file only);
- the partial last block (``in % 64`` tokens carry no hash id): dropped, so a
  prompt is whole blocks and a continuation is token-exact;
- the model's reply is not fed back: the next turn's prompt is the next
  recorded input, whose ids already cover the recorded reply.

Scaling (``token_scale`` s in (0, 1]): block position ``p`` is kept iff
``floor((p + 1) s) > floor(p s)`` (every k-th block for s = 1/k). The rule
depends on the position only, so two prompts that share their first ``m``
blocks share their first ``floor(m s)`` kept blocks (the prefix property
survives), a prompt of ``n`` blocks keeps ``floor(n s)``, and the turn-by-turn
growth and the shared fraction are those of the trace. Truncating instead
would keep the first blocks only, so late turns would stop growing and never
diverge; sampling by id would make the counts random.

Limits: ``max_turns`` turns per session; a session ends before the first turn
whose prompt plus output exceeds ``max_context`` tokens (only conversations
with at least ``min_turns`` turns that fit are selected); a subagent is dropped when its
parent ends before the subagent started, or when its first turn does not fit.
Selection and order come from
``random.Random(f"sessions/{seed}")``; session ``i`` arrives at ``i * stagger_s``.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from ladsd.workloads.cc_traces import Conversation, Request


@dataclass(frozen=True)
class SessionParams:
    """How a workload is cut from the traces (stated and recorded with the results)."""

    sessions: int = 8  # N conversations at once (their subagents come on top)
    token_scale: float = 0.25
    time_factor: float = 1.0  # tool waits and subagent starts are multiplied by it
    max_turns: int = 12
    min_turns: int = 1  # only conversations with at least this many turns that fit are chosen
    max_output_tokens: int = 64
    max_context: int = 8192  # prompt + output of a turn, tokens
    max_tool_wait_s: float = 60.0  # after time_factor: the traces have hours-long user idles
    stagger_s: float = 2.0
    vocab: tuple[int, int] = (100, 49000)  # plain-text ids of the SmolLM2 vocabulary

    def check(self) -> None:
        lo, hi = self.vocab
        if not 0 < self.token_scale <= 1:
            raise ValueError(f"token_scale must be in (0, 1], got {self.token_scale}")
        if min(self.sessions, self.max_turns, self.min_turns, self.max_output_tokens) < 1:
            raise ValueError("sessions, max_turns, min_turns and max_output_tokens must be >= 1")
        if self.min_turns > self.max_turns:
            raise ValueError(f"min_turns {self.min_turns} > max_turns {self.max_turns}")
        if self.time_factor < 0 or self.max_tool_wait_s < 0 or self.stagger_s < 0:
            raise ValueError("time_factor, max_tool_wait_s and stagger_s must be >= 0")
        if not 0 <= lo < hi:
            raise ValueError(f"vocab must be a range 0 <= low < high, got {self.vocab}")


@dataclass(frozen=True)
class Turn:
    prompt_ids: tuple[int, ...]  # the whole prompt of this turn
    output_tokens: int
    tool_wait_s: float  # after this turn's reply, before the next turn (0 after the last)
    request: int  # index of the recorded request among its (sub)agent's model requests


@dataclass(frozen=True)
class SessionSpec:
    """One conversation (or subagent) to replay: its turns and when it arrives."""

    sid: str  # the conversation id, or "id/agent_id" for a subagent
    conversation: str
    arrival: float  # seconds after the workload's start
    turns: tuple[Turn, ...]
    parent: str | None = None  # a subagent's parent session
    after_turns: int = 0  # a subagent: the parent's turns that preceded it in the trace


@dataclass(frozen=True)
class SessionWorkload:
    name: str
    seed: int
    params: SessionParams
    sessions: tuple[SessionSpec, ...]  # by arrival, then sid
    commit: str | None = field(default=None)  # the traces' pinned commit, if known


def block_tokens(
    conversation: str, hash_id: int, size: int, vocab: tuple[int, int]
) -> tuple[int, ...]:
    """The ``size`` token ids of block ``hash_id`` of ``conversation`` (seed-independent)."""
    lo, hi = vocab
    raw = hashlib.shake_128(f"{conversation}/{hash_id}".encode()).digest(4 * size)
    words = (int.from_bytes(raw[4 * k : 4 * k + 4], "little") for k in range(size))
    return tuple(lo + x % (hi - lo) for x in words)


def kept(n: int, scale: Fraction) -> list[int]:
    """Kept block positions of ``n``: ``p`` with ``floor((p + 1) s) > floor(p s)``."""
    return [p for p in range(n) if math.floor((p + 1) * scale) > math.floor(p * scale)]


class _Synth:
    """Token ids of a conversation's scaled prompts, blocks cached by id."""

    def __init__(self, conv: Conversation, p: SessionParams) -> None:
        self.conv, self.p = conv, p
        self.scale = Fraction(p.token_scale).limit_denominator(1 << 20)
        self._blocks: dict[int, tuple[int, ...]] = {}

    def prompt(self, r: Request) -> tuple[int, ...]:
        out: list[int] = []
        for pos in kept(len(r.hash_ids), self.scale):
            h = r.hash_ids[pos]
            if h not in self._blocks:
                self._blocks[h] = block_tokens(self.conv.id, h, self.conv.block_size, self.p.vocab)
            out.extend(self._blocks[h])
        return tuple(out)

    def output(self, r: Request) -> int:
        return max(1, min(self.p.max_output_tokens, math.ceil(r.output_tokens * self.scale)))

    def turns(self, reqs: Sequence[Request]) -> tuple[Turn, ...]:
        p, out = self.p, []
        for k, r in enumerate(reqs[: p.max_turns]):
            ids, n_out = self.prompt(r), self.output(r)
            if not ids or len(ids) + n_out > p.max_context:
                break
            nxt = reqs[k + 1].think_time * p.time_factor if k + 1 < len(reqs) else 0.0
            out.append(Turn(ids, n_out, min(nxt, p.max_tool_wait_s), k))
        if out:  # nothing follows the last kept turn
            out[-1] = Turn(out[-1].prompt_ids, out[-1].output_tokens, 0.0, out[-1].request)
        return tuple(out)


def fits(conv: Conversation, p: SessionParams) -> bool:
    """Whether the conversation's first ``min_turns`` turns fit ``max_context`` at the scale."""
    return len(_Synth(conv, p).turns(conv.requests[: p.min_turns])) >= p.min_turns


def sessions_of(conv: Conversation, p: SessionParams, arrival: float) -> list[SessionSpec]:
    """The conversation's session and its subagents' (those its kept turns reach)."""
    synth = _Synth(conv, p)
    main = SessionSpec(conv.id, conv.id, arrival, synth.turns(conv.requests))
    out = [main]
    for sub in conv.subagents:
        turns = synth.turns(sub.requests)
        if sub.after > len(main.turns) or not turns:
            continue  # the parent ended first, or its first turn does not fit
        sid = f"{conv.id}/{sub.agent_id}"
        start = arrival + sub.t * p.time_factor
        out.append(SessionSpec(sid, conv.id, start, turns, conv.id, sub.after))
    return out


def build(
    conversations: Sequence[Conversation],
    seed: int,
    params: SessionParams | None = None,
    name: str = "sessions",
    commit: str | None = None,
) -> SessionWorkload:
    """The workload of ``seed``: ``params.sessions`` conversations, chosen and ordered by seed."""
    p = params or SessionParams()
    p.check()
    pool = sorted((c for c in conversations if fits(c, p)), key=lambda c: c.id)
    if len(pool) < p.sessions:
        raise ValueError(
            f"{p.sessions} sessions asked, {len(pool)} of {len(conversations)} conversations "
            f"have {p.min_turns} turn(s) within {p.max_context} tokens at token scale "
            f"{p.token_scale}"
        )
    rng = random.Random(f"sessions/{seed}")
    chosen = rng.sample(pool, p.sessions)  # a sample is in random order
    out: list[SessionSpec] = []
    for i, conv in enumerate(chosen):
        out += sessions_of(conv, p, i * p.stagger_s)
    out.sort(key=lambda s: (s.arrival, s.sid))
    return SessionWorkload(name, seed, p, tuple(out), commit)
