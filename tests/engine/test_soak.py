"""Soak: an in-process daemon through a fixed number of request rounds keeps every table
bounded (defect 2: the lease timeline grew by a sample per tick, idle too).

Each round, on fresh session ids: a tool call whose result comes back (a lease, its
handoff), a tool call left waiting then deleted (a cancelled lease) after an intent and
a retention requirement, a plain streamed turn whose session expires idle, a stream the
client leaves early, and an events reader that leaves. After each round the daemon
settles (nothing in flight) and idles a few tick periods; then every table's size
(:meth:`Daemon.sizes`) must be at most its size after the warm-up round or its cap
(the timeline's cap is set small here, so the rounds overrun it). RSS is a bench figure
(bench/serve_life.py), not an assertion.
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
from ladsd.engine.thread import DAEMON_UPKEEP
from ladsd.serve.agents import MAX_RUNS
from ladsd.serve.daemon import Daemon, ServeConfig
from tests.helpers import FORCE, free_port, running, weather_tool

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]
GUARD_S = 300  # hang guards only
ROUNDS = 6  # after the warm-up round
TIMELINE = 16  # the daemon's timeline cap in this test (the rounds publish far more)
SMOKE = PROFILES["smoke"]
TICK = SMOKE.lease.tick_s
WEATHER = weather_tool(max_len=8)
USER = [{"role": "user", "content": "Paris?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(model_ready) -> AsyncIterator[Daemon]:
    prof = replace(SMOKE, lease=replace(SMOKE.lease, lease_lifetime_s=3.0))
    cfg = ServeConfig(port=free_port(), session_ttl_s=0.5)
    d = Daemon(prof, "lads", cfg, upkeep=replace(DAEMON_UPKEEP, timeline_samples=TIMELINE))
    async with running(d, GUARD_S):
        yield d


class Client:
    def __init__(self, d: Daemon, http: aiohttp.ClientSession) -> None:
        self.base, self.http = f"http://127.0.0.1:{d.cfg.port}", http

    async def call(self, method: str, path: str, sid: str | None = None, **kw: Any) -> Any:
        headers = {"x-session-id": sid} if sid else {}
        async with self.http.request(method, self.base + path, headers=headers, **kw) as r:
            text = await r.text()
            return r.status, (json.loads(text) if text.startswith("{") else text)

    async def chat(self, sid: str, **body: Any) -> dict:
        b = {"model": "tiny", "max_tokens": 4, "temperature": 0} | body
        b.setdefault("messages", USER)
        status, out = await self.call("POST", "/v1/chat/completions", sid, json=b)
        assert status == 200, out
        return out

    async def tool_call(self, sid: str) -> dict:
        out = await self.chat(sid, tools=[WEATHER], tool_choice=FORCE, max_tokens=40)
        assert out["choices"][0]["finish_reason"] == "tool_calls", out
        return out["choices"][0]["message"]

    async def leave_early(self, method: str, path: str, sid: str | None = None, **kw: Any) -> None:
        """Read the first bytes of a stream, then go away (a disconnect)."""
        headers = {"x-session-id": sid} if sid else {}
        async with self.http.request(method, self.base + path, headers=headers, **kw) as r:
            assert r.status == 200
            await r.content.readany()


async def one_round(c: Client, r: int) -> None:
    a, b, e = f"a{r}", f"b{r}", f"e{r}"
    # A tool call answered: the lease for the wait is handed off; the session ends.
    reply = await c.tool_call(a)
    result = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "Sunny"}
    await c.chat(a, messages=[*USER, reply, result], tools=[WEATHER], tool_choice="none")
    assert (await c.call("DELETE", f"/v1/sessions/{a}"))[0] == 200
    # A tool call never answered: an intent, a requirement, then DELETE cancels the lease.
    await c.tool_call(b)
    body = {"tool": "get_weather", "expected_tool_s": 1.0}
    assert (await c.call("POST", f"/v1/sessions/{b}/intent", json=body))[0] == 202
    status, _ = await c.call("POST", f"/v1/sessions/{b}/retention", json={"mode": "requirement"})
    assert status in (200, 409)  # held, or refused by the budget: both bounded
    assert (await c.call("DELETE", f"/v1/sessions/{b}"))[0] == 200
    # A streamed turn; its session expires idle (TTL 0.5 s).
    await c.chat(e, stream=True, stream_options={"include_usage": True})
    # A client that leaves a stream early, an events reader that leaves.
    body = {"model": "tiny", "messages": USER, "max_tokens": 64, "stream": True}
    await c.leave_early("POST", "/v1/chat/completions", f"d{r}", json=body)
    await c.leave_early("GET", "/v1/events?backlog=5")


async def settle(d: Daemon) -> dict[str, int]:
    """Sizes once nothing is in flight and every session has ended (bounded wait)."""
    for _ in range(int(GUARD_S / (3 * TICK))):
        sizes = await d.sizes()
        busy = {k: v for k, v in sizes.items() if v and k.startswith("rt.")}
        if not busy and not sizes["sessions"] and not d.in_flight:
            await asyncio.sleep(3 * TICK)  # idle a few ticks: nothing should grow
            return await d.sizes()
        await asyncio.sleep(3 * TICK)
    pytest.fail(f"the daemon never settled: {sizes}")


async def test_every_table_stays_bounded_over_the_rounds(daemon: Daemon):
    caps = {"timeline": TIMELINE, "events.backlog": daemon.events.backlog.maxlen}
    caps |= {"sessions": daemon.cfg.max_sessions, "agent_runs": MAX_RUNS}
    async with aiohttp.ClientSession() as http:
        c = Client(daemon, http)
        await one_round(c, 0)
        warm = await settle(daemon)
        for r in range(1, ROUNDS + 1):
            await one_round(c, r)
            sizes = await settle(daemon)
            grown = {
                k: (warm.get(k, 0), v)
                for k, v in sizes.items()
                if v > max(warm.get(k, 0), caps.get(k, 0))
            }
            assert not grown, f"round {r}: (after warm-up, now) {grown}"
    assert sizes["timeline"] == TIMELINE  # the rounds did overrun the cap
    assert all(v == 0 for k, v in sizes.items() if k.startswith("rt.")), sizes
