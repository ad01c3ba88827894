"""The ``ladsd serve`` module rig on SmolLM2: one server per module on a small pool (40
blocks of 32 tokens, context 1,024, ``H`` = 16, ``l`` = 120 s), a forced tool-call turn and
its answer, a flood, and the lease run (session A's history across a flood)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.helpers import CALL_S, FORCE, Server, audited, weather_tool

MODEL = "smollm2-135m"
BLOCK = 32
POOL = ["--kv-blocks", "40", "--max-model-len", "1024", "--headroom-blocks", "16"]
POOL += ["--lease-s", "120"]
WEATHER = weather_tool("Current weather in a city.", max_len=20)
SYSTEM = "You are a helpful assistant. Use the tools when they help."


def serve(*flags: str, pool: list[str] = POOL) -> Iterator[Server]:
    yield from audited("--model", MODEL, *pool, *flags)


def wait_for(what: str, check: Any, timeout: float = CALL_S) -> Any:
    """Poll ``check()`` until it is truthy (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def tool_turn(c: openai.OpenAI, session: str, user: str, **kw: Any) -> Any:
    """A session's first turn, forced to call get_weather."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    r = c.chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER], tool_choice=FORCE, max_tokens=40,
        temperature=0, extra_headers={"x-session-id": session}, **kw,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls", r
    return msgs, r


def answer_turn(
    c: openai.OpenAI, session: str, msgs: list, first: Any, result: str, raw: bool = False
) -> Any:
    """The next turn: the assistant's tool call echoed back + the tool's result.

    ``raw``: the client's message object itself (with its None fields), as the
    openai docs do; else its dict without them.
    """
    m = first.choices[0].message
    msgs = [*msgs, m if raw else m.model_dump(exclude_none=True)]
    msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": result})
    return c.chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=8,
        temperature=0, extra_headers={"x-session-id": session},
    )  # fmt: skip


def flood(c: openai.OpenAI, n: int = 10) -> None:
    """Sessions B..K: distinct prompts (no shared prefix), ~5 blocks each, one by one,
    more in all than the pool holds."""
    for i in range(n):
        text = " ".join(f"{chr(66 + i)}{i}-{j}:{j * 7 + i}" for j in range(30))
        r = c.chat.completions.create(
            model=MODEL, max_tokens=1, temperature=0,
            messages=[{"role": "user", "content": f"Flood {chr(66 + i)}. {text}"}],
            extra_headers={"x-session-id": f"flood-{chr(66 + i)}"},
        )  # fmt: skip
        assert r.usage.prompt_tokens > 4 * BLOCK


def lease_run(srv: Server) -> tuple[int, int]:
    """Session A's tool call, a flood, A's next turn: (A's history, A's cached tokens)."""
    c = srv.client()
    msgs, first = tool_turn(c, "A", "What is the weather in Paris? Do I need an umbrella?")
    history = srv.get("/v1/sessions/A")["history_tokens"]
    output = first.usage.prompt_tokens + first.usage.completion_tokens
    assert history in (output, output + 1)  # + <|im_end|> if the output lacks it
    if srv.get("/v1/engine/state")["leases_enabled"]:
        wait_for("A's lease", lambda: srv.get("/v1/sessions/A")["lease"]["status"] == "granted")
    flood(c)
    nxt = answer_turn(c, "A", msgs, first, "Rain, 12 C, wind 30 km/h.")
    assert nxt.usage.prompt_tokens > history  # the history, extended
    return history, nxt.usage.prompt_tokens_details.cached_tokens
