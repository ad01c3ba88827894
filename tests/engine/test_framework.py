"""An agent framework users already use, unchanged, drives a tool-using conversation
against a real ``ladsd serve`` subprocess on SmolLM2-135M: the OpenAI Agents SDK
(``openai-agents``) with a function tool, streaming on (``Runner.run_streamed``).

Nothing leaves the machine: the SDK's tracing is off (``set_tracing_disabled`` and
``OPENAI_AGENTS_DISABLE_TRACING``), its client points at 127.0.0.1 only (and so does
``OPENAI_BASE_URL``, for any client it might make itself).

The model is tiny and weak, so the test is made deterministic where it can be
(temperature 0, ``tool_choice="required"`` on the first turn: the SDK resets it after a
tool call) and bounded (``max_turns``); it checks structure, not wording: the tool ran
with parsed arguments, the tool result came back through the framework (the second
request carried the tool message: the daemon bound the session's waiting history), and
the run ended with a final output or at the turn bound.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import CALL_S, Server, audited

pytestmark = pytest.mark.engine

MODEL = "smollm2-135m"
BLOCK = 32
POOL = ["--kv-blocks", "40", "--max-model-len", "1024", "--headroom-blocks", "16"]
POOL += ["--lease-s", "120"]
SESSION = "agents-sdk"


@pytest.fixture(scope="module")
def srv(model_ready) -> Iterator[Server]:
    yield from audited("--model", MODEL, "--policy", "lads", *POOL)


def loopback(address: Any) -> bool:
    """An address on this machine (AF_UNIX paths are not tuples)."""
    if not isinstance(address, tuple):
        return True
    host = str(address[0])
    return host.startswith("127.") or host in ("::1", "localhost")


@pytest.fixture
def local_only(srv: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The SDK's tracing off; any default OpenAI client it makes points at the daemon;
    a connection to anywhere but loopback from this process is refused and fails the test."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{srv.base}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    off: list[Any] = []

    def guarded(real: Any) -> Any:
        def connect(self: socket.socket, address: Any) -> Any:
            if not loopback(address):
                off.append(address)
                raise ConnectionRefusedError(f"not on loopback: {address}")
            return real(self, address)

        return connect

    monkeypatch.setattr(socket.socket, "connect", guarded(socket.socket.connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guarded(socket.socket.connect_ex))
    yield
    assert not off, f"connections off the machine: {off}"


async def run_agent(
    srv: Server, session: str, output_type: Any = None
) -> tuple[list[str], list[str], str, Any]:
    """One streamed run of a weather agent: (cities the tool ran for, event kinds,
    outcome, final output)."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
    from agents.exceptions import MaxTurnsExceeded
    from openai import AsyncOpenAI

    ran: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
            city: The city's name.
        """
        ran.append(city)
        return f"Sunny, 21 C in {city}."

    client = AsyncOpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0,
                         timeout=CALL_S)  # fmt: skip
    agent = Agent(
        name="Weather",
        instructions="You are a helpful assistant. Use the tools when they help.",
        tools=[get_weather],
        output_type=output_type,
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required",  # the first turn calls the tool (the SDK resets it after)
            temperature=0,
            max_tokens=40,
            extra_headers={"x-session-id": session},
        ),
    )
    result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
    kinds: list[str] = []
    outcome = "finished"
    try:
        async for ev in result.stream_events():
            kinds.append(ev.type if ev.type != "run_item_stream_event" else ev.name)
    except MaxTurnsExceeded:
        outcome = "max_turns"  # the weak model kept calling: the bound ended the run
    finally:
        await client.close()
    return ran, kinds, outcome, result.final_output if outcome == "finished" else None


def check_tool_round_trip(srv: Server, session: str, ran: list[str], kinds: list[str]) -> None:
    """The tool ran with parsed arguments and its result went back through the framework:
    the second request carried the tool message after the echoed call (ids unchanged),
    so it extended the session's waiting history, cached."""
    assert ran and all(isinstance(c, str) and c for c in ran), ran
    assert "tool_called" in kinds and "tool_output" in kinds
    assert kinds.count("raw_response_event") > 2  # streamed: chunks, not one body
    seen = srv.events(session, {"completion"}, count=2)
    first, second = [e for e in seen if e["type"] == "completion"][:2]
    assert first["turn"] == 0 and first["finish_reason"] == "tool_calls"
    assert second["turn"] == 1 and second["bound"] is not None
    history = first["prompt_tokens"] + first["completion_tokens"]
    assert second["prompt_tokens"] > history  # + the tool message (and the header)
    assert second["cached_tokens"] >= history - BLOCK
    assert srv.get(f"/v1/sessions/{session}")["turn"] >= 2


async def test_openai_agents_sdk_runs_a_tool_conversation_streamed(srv: Server, local_only):
    ran, kinds, outcome, final = await run_agent(srv, SESSION)
    check_tool_round_trip(srv, SESSION, ran, kinds)
    assert outcome == "max_turns" or isinstance(final, str)


async def test_agents_sdk_output_type_with_tools(srv: Server, local_only):
    """``Agent(tools=..., output_type=...)`` sends ``response_format`` with tools (refused
    with 400 before): the answer, if the model gives one, is JSON of the type's schema."""
    from pydantic import BaseModel, Field

    class Report(BaseModel):
        city: str = Field(max_length=20)
        sky: str = Field(max_length=20)

    ran, kinds, outcome, final = await run_agent(srv, "agents-sdk-typed", Report)
    check_tool_round_trip(srv, "agents-sdk-typed", ran, kinds)
    assert outcome == "max_turns" or isinstance(final, Report)
