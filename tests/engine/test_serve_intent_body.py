"""The chat body's ``intent`` (ladsd's extension): a harness states the timing of the tool
wait a request will end in, in the request that creates the session (``POST .../intent``
needs the session to exist first). In-process Daemon on the tiny dummy-weight model."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from ladsd.config import PROFILES
from ladsd.serve.daemon import Daemon, ServeConfig
from tests.helpers import FORCE, free_port, running, weather_tool

pytestmark = pytest.mark.engine
GUARD_S = 300.0  # hang guard (never a speed assertion)
URL = "/v1/chat/completions"


async def post(port: int, body: dict[str, Any], sid: str | None) -> tuple[int, Any]:
    headers = {"x-session-id": sid} if sid else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=GUARD_S)) as s:
        async with s.post(f"http://127.0.0.1:{port}{URL}", json=body, headers=headers) as r:
            return r.status, await r.json()


def body(**kw: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": "weather?"}]
    out = {"model": "tiny", "max_tokens": 40, "temperature": 0, "messages": msgs}
    return out | {"tools": [weather_tool(max_len=8)], "tool_choice": FORCE} | kw


async def test_the_first_request_carries_its_intent(model_ready):
    async with running(Daemon(PROFILES["smoke"], "lads", ServeConfig(port=free_port())),
                       GUARD_S) as d:  # fmt: skip
        port = d.cfg.port
        intent = {"tool": "get_weather", "expected_tool_s": 7.5, "expected_result_bytes": 900}
        status, out = await post(port, body(intent=intent), "s1")
        assert status == 200 and out["choices"][0]["finish_reason"] == "tool_calls"
        s = d.sessions.get("s1", "local")
        n = s.wait.notice if s is not None else None
        assert n is not None and n.expected_wait_s == 7.5 and n.payload_bytes == 900

        # A list is several intents; a bad one is a 400 naming it, and creates no session.
        status, err = await post(port, body(intent=[intent, {"tool": "x", "eta": 1}]), "s2")
        assert status == 400 and err["error"]["param"] == "intent"
        assert "eta" in err["error"]["message"] and d.sessions.get("s2", "local") is None
        # Without a session there is nothing to keep it on.
        status, err = await post(port, body(intent=intent), None)
        assert status == 400 and err["error"]["param"] == "intent"
