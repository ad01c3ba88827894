"""The Daemon in process on the tiny dummy-weight engine (smoke profile): the HTTP API's
shapes, sessions, the harness-engine protocol's refusals, disconnects, a dead engine.

The tiny model's text is noise; what these tests check is the protocol around it.
SmolLM2 end to end (the openai client, leases that survive a flood) is
tests/engine/test_serve.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from ladsd.config import PROFILES
from ladsd.engine.sched_leases import LeaseScheduler
from ladsd.serve.daemon import Daemon, ServeConfig
from tests.helpers import FORCE, Api, free_port, running, weather_tool

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]
GUARD_S = 120  # hang guard only
WEATHER = weather_tool(max_len=8)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(model_ready) -> AsyncIterator[Daemon]:
    prof = PROFILES["smoke"]
    prof = replace(prof, lease=replace(prof.lease, lease_lifetime_s=60.0))
    d = Daemon(prof, "lads", ServeConfig(port=free_port(), max_waiting=2))
    async with running(d, GUARD_S):
        yield d


@pytest_asyncio.fixture(loop_scope="module")
async def api(daemon: Daemon) -> AsyncIterator[Api]:
    async with aiohttp.ClientSession() as http:
        yield Api(f"http://127.0.0.1:{daemon.cfg.port}", http)


async def test_health_models_and_engine_state(api: Api):
    assert (await api.call("GET", "/health"))[0] == 200
    status, models = await api.call("GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny"
    status, st = await api.call("GET", "/v1/engine/state")
    assert status == 200
    assert {"B", "U", "C", "F", "H", "l", "w", "a", "m", "block_size", "policy"} <= set(st)
    assert (st["H"], st["l"], st["block_size"], st["policy"]) == (8, 60.0, 32, "lads")
    assert st["leases_enabled"] and "requirement" in st["supports"]["retention"]
    assert "grant" in st["supports"]["events"] and "handoff" in st["supports"]["events"]


async def test_chat_body_and_stream(api: Api):
    status, out = await api.chat()
    assert status == 200 and out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] == 4
    assert "cached_tokens" in out["usage"]["prompt_tokens_details"]
    status, text = await api.chat(stream=True, stream_options={"include_usage": True})
    events = [e[len("data: ") :] for e in text.strip().split("\n\n")]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_tool_call_session_round_trip(api: Api, daemon: Daemon):
    msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Paris?"}]
    status, out = await api.chat("T", messages=msgs, tools=[WEATHER], tool_choice=FORCE,
                                 max_tokens=40)  # fmt: skip
    assert status == 200, out
    choice = out["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    assert "city" in json.loads(call["function"]["arguments"])
    status, s = await api.call("GET", "/v1/sessions/T")
    assert status == 200 and s["waiting_for_tool"] and s["turn"] == 1
    assert s["lease"]["continuation"] == f"T/1/{s['version']}"
    history = s["history_tokens"]
    msgs += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "Sunny"}]
    status, out = await api.chat("T", messages=msgs, tools=[WEATHER], tool_choice="none")
    assert status == 200
    # Same engine, nothing in between: the history is still cached, whole blocks of it.
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= history - 32
    done = [
        e for e in daemon.events.backlog if e["type"] == "completion" and e["session_id"] == "T"
    ]
    assert done[-1]["bound"] == f"T/1/{s['version']}"  # submitted as the waiting continuation
    assert (await api.call("DELETE", "/v1/sessions/T"))[0] == 200
    assert (await api.call("GET", "/v1/sessions/T"))[0] == 404
    assert (await api.call("DELETE", "/v1/sessions/T"))[0] == 404


async def test_protocol_refusals_and_intent(api: Api):
    assert (await api.chat("P"))[0] == 200  # a chat request creates the session (an intent: 404)
    status, out = await api.call("POST", "/v1/sessions/P/intent",
                                 json={"tool": "get_weather", "expected_tool_s": 2.5})  # fmt: skip
    assert status == 202 and out["intent"]["expected_tool_s"] == 2.5
    status, out = await api.call("POST", "/v1/sessions/P/retention", json={"mode": "requirement"})
    assert status == 409 and out["error"]["code"] == "not_waiting"
    status, out = await api.call("POST", "/v1/sessions/P/retention", json={"mode": "keep"})
    assert status == 400 and out["error"]["param"] == "mode"
    status, out = await api.call("POST", "/v1/sessions/P/intent", json={"tool": "x"})
    assert status == 400
    status, out = await api.chat("P", tools=[WEATHER], tool_choice=FORCE, max_tokens=40)
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    status, out = await api.call("POST", "/v1/sessions/P/retention", json={"mode": "release"})
    assert status == 200 and out["status"] == "released"
    status, s = await api.call("GET", "/v1/sessions/P")
    assert not s["waiting_for_tool"] and s["intents"][0]["tool"] == "get_weather"


async def test_bad_requests_keep_the_daemon_up(api: Api):
    status, out = await api.chat(messages=[{"role": "user", "content": "x " * 5000}])
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    status, out = await api.chat(min_tokens=10, max_tokens=2)
    assert status == 400 and out["error"]["type"] == "invalid_request_error"
    status, out = await api.chat(seed=3)  # vLLM 0.32's CPU runner cannot seed a request
    assert status in (200, 400)
    assert (await api.chat())[0] == 200


async def test_busy_session_409_then_disconnect_aborts_and_keeps_the_session(
    api: Api, daemon: Daemon
):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "stream": True,
            "max_tokens": 2000, "min_tokens": 2000, "ignore_eos": True}  # fmt: skip
    url = f"{api.base}/v1/chat/completions"
    async with aiohttp.ClientSession() as other:
        r = await other.post(url, json=body, headers={"x-session-id": "D"})
        assert r.status == 200
        await asyncio.wait_for(r.content.readline(), GUARD_S)  # the first chunk: it runs
        status, out = await api.chat("D")
        assert status == 409 and out["error"]["code"] == "session_busy"
        r.close()  # the client goes away mid-stream

    def kinds() -> list[str]:
        return [e["type"] for e in daemon.events.backlog if e["session_id"] == "D"]

    async def gone() -> None:
        while daemon.in_flight or "disconnect" not in kinds():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(gone(), GUARD_S)
    assert daemon.stats["disconnected"] >= 1
    # The session stays for the client's retry (tests/engine/test_serve_turns.py); DELETE ends it.
    s = daemon.sessions.get("D")
    assert s is not None and not s.busy and "session_end" not in kinds()
    assert (await api.call("DELETE", "/v1/sessions/D"))[0] == 200
    assert "session_end" in kinds()


async def test_admission_limit_answers_429_with_retry_after(api: Api, daemon: Daemon):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "stream": True,
            "max_tokens": 2000, "min_tokens": 2000, "ignore_eos": True}  # fmt: skip
    url = f"{api.base}/v1/chat/completions"
    async with aiohttp.ClientSession() as other:
        held = [await other.post(url, json=body) for _ in range(daemon.admit_limit)]
        assert all(r.status == 200 for r in held) and daemon.in_flight == daemon.admit_limit
        async with other.post(url, json=body) as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["type"] == "rate_limit_error"
        for r in held:
            r.close()

    async def drained() -> None:
        while daemon.in_flight:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(drained(), GUARD_S)
    assert (await api.chat())[0] == 200


async def test_events_stream_is_sse_with_session_ids(api: Api):
    await api.chat("E")
    async with api.http.get(f"{api.base}/v1/events?session_id=E&backlog=5") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        head = await asyncio.wait_for(r.content.readline(), GUARD_S)
        data = await asyncio.wait_for(r.content.readline(), GUARD_S)
    assert head == b"event: completion\n"
    ev = json.loads(data[len(b"data: ") :])
    assert ev["session_id"] == "E" and ev["type"] == "completion" and ev["turn"] == 0


async def test_metrics_exposition(api: Api):
    from prometheus_client.parser import text_string_to_metric_families

    status, text = await api.call("GET", "/metrics")
    names = {f.name for f in text_string_to_metric_families(text)}
    assert status == 200 and {"vllm:num_requests_running", "ladsd_lease_grants"} <= names


async def test_dead_engine_answers_503_never_hangs(api: Api, daemon: Daemon, monkeypatch):
    """Last in the module: it kills the module's engine."""

    def broken(self: LeaseScheduler, *a: Any, **kw: Any) -> Any:
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(LeaseScheduler, "schedule", broken)
    status, out = await asyncio.wait_for(api.chat(), GUARD_S)
    assert status == 503 and out["error"]["code"] == "engine_dead"
    assert "injected step failure" in out["error"]["message"]
    status, health = await api.call("GET", "/health")
    assert status == 503 and "injected" in health["error"]
    for path in ("/v1/engine/state",):
        status, out = await asyncio.wait_for(api.call("GET", path), GUARD_S)
        assert status == 503 and out["error"]["type"] == "server_error"
    status, out = await asyncio.wait_for(api.chat("Z"), GUARD_S)
    assert status == 503
