"""Prefix leases on the real engine: a leased history survives a flood, its twin does not."""

from __future__ import annotations

import asyncio

import pytest

from ladsd import clock
from ladsd.config import EngineConfig, LeaseConfig
from ladsd.engine.params import sampling
from ladsd.engine.thread import EngineThread
from ladsd.records import (
    ContinuationId,
    HistoryNotice,
    InventoryItem,
    Phase,
    SenderInventory,
)

pytestmark = [pytest.mark.engine]
BLOCK = 32


def hist(seed: int, blocks: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 40000 for i in range(blocks * BLOCK)]


async def test_leased_prefix_survives_flood_and_hands_off(model_ready):
    cfg = EngineConfig(model="tiny", max_model_len=1024, num_gpu_blocks_override=48)
    # A lifetime no run reaches: the test must not depend on wall-clock speed.
    lease = LeaseConfig(headroom_blocks=2, lease_lifetime_s=3600.0)
    async with EngineThread(cfg, lease) as eng:
        leased, control = hist(1, 10), hist(2, 10)
        # Both histories become resident (cold calls), then their results are ready.
        await asyncio.gather(*(eng.complete(h, sampling(max_tokens=1)) for h in (leased, control)))
        cid = ContinuationId("w-leased", 1)
        now = clock.now()
        inv = SenderInventory(
            time=now, items=(InventoryItem(cid, Phase.PENDING, 500, now),), q_b=0, rate=4000.0
        )
        notice = HistoryNotice(cid, tuple(leased), "pd", "yd", now, 500)

        eng.inventory(inv)
        eng.notice(notice)
        state = await eng.state()  # after the integrity check
        rec = state.lease_for(cid)
        assert rec is not None and len(rec.protected_blocks) == 10
        assert state.U == 10

        # Flood: distinct prompts that need every unprotected block of the pool.
        for k in range(4):
            await eng.complete(hist(100 + k, 28), sampling(max_tokens=1))

        # The leased continuation reuses its protected prefix; the control recomputes.
        cont = await eng.complete(leased + [7] * 40, sampling(max_tokens=2), cid=cid)
        ctrl = await eng.complete(control + [7] * 40, sampling(max_tokens=2))
        assert cont.num_cached_tokens >= 10 * BLOCK
        assert ctrl.num_cached_tokens == 0

        st = await eng.state()
        audit = await eng.finish()
        assert st.counters["handoffs"] == 1 and st.U == 0
        assert audit["refs_added"] == audit["refs_released"] == 10
