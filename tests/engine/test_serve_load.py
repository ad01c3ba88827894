"""Load on a real ``ladsd serve`` (SmolLM2, LADS): 32 concurrent sessions x 4 turns
through the HTTP API, twice.

The admission limit is set low (8 running + 2 waiting), so most first requests
get 429 and come back after ``Retry-After``: nothing else may fail. Each round
is bounded in time (a hang guard). After the rounds nothing is left (sessions,
leases, requests), RSS after the second round is within 10 % of after the
first, and the server's exit on SIGTERM reports a balanced lease audit.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers import FORCE, Server
from tests.rigs.server import MODEL, SYSTEM, WEATHER, serve, wait_for

# slow: ~45 s on a quiet 2-core machine, ~9 min when it is shared; too much for CI's budget.
pytestmark = [pytest.mark.engine, pytest.mark.slow]
SESSIONS, TURNS = 32, 4
ROUND_S = 1800  # hang guard for one round
POOL = ["--kv-blocks", "400", "--max-model-len", "2048", "--headroom-blocks", "32"]
CITIES = ("Paris", "Oslo", "Rome", "Lima", "Kyiv", "Doha", "Bern", "Riga")


@pytest.fixture(scope="module")
def srv(model_ready) -> Iterator[Server]:
    yield from serve("--policy", "lads", "--max-waiting", "2", pool=POOL)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def create(c: openai.AsyncOpenAI, stats: Counter[str], **kw: Any) -> Any:
    """One completion; a 429 waits for Retry-After and tries again (the only retry)."""
    while True:
        try:
            return await c.chat.completions.create(model=MODEL, temperature=0, **kw)
        except openai.RateLimitError as e:
            stats["429"] += 1
            await asyncio.sleep(float(e.response.headers.get("retry-after", "1")))


async def session(c: openai.AsyncOpenAI, sid: str, i: int, stats: Counter[str]) -> None:
    city = CITIES[i % len(CITIES)]
    msgs: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Session {i}: what is the weather in {city} this week?"},
    ]
    head = {"x-session-id": sid}
    for turn in range(TURNS):
        if turn == TURNS - 1:
            r = await create(c, stats, messages=msgs, tools=[WEATHER], tool_choice="none",
                             max_tokens=4, extra_headers=head)  # fmt: skip
            assert r.choices[0].finish_reason in ("stop", "length")
            break
        r = await create(c, stats, messages=msgs, tools=[WEATHER], tool_choice=FORCE,
                         max_tokens=40, extra_headers=head)  # fmt: skip
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", r
        stats["cached"] += r.usage.prompt_tokens_details.cached_tokens
        msgs.append(m.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id,
                     "content": f"Day {turn}: {10 + turn} C, cloudy."})  # fmt: skip
    stats["sessions"] += 1


async def load_round(srv: Server) -> Counter[str]:
    stats: Counter[str] = Counter()
    async with openai.AsyncOpenAI(
        base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=ROUND_S
    ) as c:
        jobs = [session(c, f"load-{i}", i, stats) for i in range(SESSIONS)]
        await asyncio.wait_for(asyncio.gather(*jobs), ROUND_S)
    for i in range(SESSIONS):
        assert srv.http("DELETE", f"/v1/sessions/load-{i}")[0] == 200
    return stats


def test_32_sessions_x_4_turns_twice(srv: Server):
    first = asyncio.run(load_round(srv))
    assert first["sessions"] == SESSIONS
    assert first["429"] > 0  # the low limit did refuse (and nothing else failed)
    rss1 = rss_kib(srv.proc.pid)
    second = asyncio.run(load_round(srv))
    assert second["sessions"] == SESSIONS
    rss2 = rss_kib(srv.proc.pid)
    print(f"429s {first['429']} + {second['429']}, cached {first['cached']} / {second['cached']},"
          f" RSS {rss1} -> {rss2} KiB")  # fmt: skip
    assert abs(rss2 - rss1) <= 0.10 * rss1, (rss1, rss2)

    def idle() -> dict[str, float] | None:
        m = srv.metrics()
        return m if m["ladsd_lease_active"] == 0 and m["ladsd_requests_in_flight"] == 0 else None

    m = wait_for("an idle daemon", idle)
    assert m["ladsd_sessions_active"] == 0 and m["vllm:prefix_cache_hits"] > 0
    assert m["ladsd_lease_grants"] > 0 and m["ladsd_lease_handoffs"] > 0
    assert m["ladsd_requests_rejected"] == first["429"] + second["429"]
