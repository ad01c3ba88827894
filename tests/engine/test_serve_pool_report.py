"""``GET /v1/engine/state`` reports one pool, before and after the engine's first
publication (bench/agent_sessions.py refuses to compare servers whose pools differ, so the two
paths must agree): ``total_blocks`` usable (the null block excluded), ``num_gpu_blocks``
as vLLM's ``cache_config_info`` names it. In-process Daemon on the tiny model."""

from __future__ import annotations

import aiohttp
import pytest

from ladsd.config import PROFILES
from ladsd.serve.daemon import Daemon, ServeConfig
from tests.helpers import free_port, running

pytestmark = pytest.mark.engine
GUARD_S = 300.0  # hang guard (never a speed assertion)


async def test_the_pool_is_the_same_before_and_after_the_first_state(model_ready):
    async with running(Daemon(PROFILES["smoke"], "lads", ServeConfig(port=free_port())),
                       GUARD_S) as d:  # fmt: skip
        base = f"http://127.0.0.1:{d.cfg.port}"
        timeout = aiohttp.ClientTimeout(total=GUARD_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            body = {"model": "tiny", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
            async with http.post(f"{base}/v1/chat/completions", json=body) as r:
                assert r.status == 200
            assert d.state is not None  # the engine has published: the state path
            async with http.get(f"{base}/v1/engine/state") as r:
                after = await r.json()
            d.state = None  # as before the first publication: the snapshot path
            async with http.get(f"{base}/v1/engine/state") as r:
                before = await r.json()
        pool = PROFILES["smoke"].engine.num_gpu_blocks_override
        for got in (before, after):
            assert got["num_gpu_blocks"] == pool and got["total_blocks"] == pool - 1
