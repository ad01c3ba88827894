"""KV retention on the real engine (the tiny model): a leased history survives a flood
and its twin does not; a ttl-pin does the same; hear-session evicts the low-p session
first; AugServe runs workflows with a balanced audit."""

from __future__ import annotations

import asyncio

import pytest

from ladsd import clock
from ladsd.config import PROFILES, EngineConfig, LeaseConfig
from ladsd.engine.params import forced, sampling
from ladsd.engine.thread import EngineThread
from ladsd.modes import EnginePolicy, Retention
from ladsd.records import (
    ContinuationId,
    HistoryNotice,
    InventoryItem,
    LeaseKind,
    Phase,
    SenderInventory,
)
from ladsd.sizing import for_run
from ladsd.wiring import open_runtime
from tests.rigs.engine import BLOCK, hist

pytestmark = [pytest.mark.engine]
A = ContinuationId("wa", 1)
B = ContinuationId("wb", 1)


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


@pytest.mark.engine
async def test_ttl_pin_on_the_real_engine(model_ready: None) -> None:
    """ttl-pin end to end: the pinned history survives a flood and hands off; audit balanced."""
    import asyncio

    from ladsd import clock
    from ladsd.config import EngineConfig
    from ladsd.engine.params import sampling
    from ladsd.engine.thread import EngineThread

    cfg = EngineConfig(model="tiny", max_model_len=1024, num_gpu_blocks_override=48)
    lease = LeaseConfig(enabled=False, headroom_blocks=30, lease_lifetime_s=3600.0)
    async with EngineThread(cfg, lease, retention=Retention.TTL_PIN) as eng:
        pinned, control = hist(1, 10), hist(2, 10)
        await asyncio.gather(*(eng.complete(h, sampling(max_tokens=1)) for h in (pinned, control)))
        cid = ContinuationId("w-pinned", 1)
        # An expected wait no run reaches: the test must not depend on wall-clock speed.
        eng.notice(HistoryNotice(cid, tuple(pinned), "pd", "yd", clock.now(), 500, None, 3600.0))
        (rec,) = (await eng.state()).leases
        assert rec.kind is LeaseKind.PIN and len(rec.protected_blocks) == 10
        for k in range(4):  # every unpinned block is needed; free < H all along
            await eng.complete(hist(100 + k, 28), sampling(max_tokens=1))
        cont_ = await eng.complete(pinned + [7] * 40, sampling(max_tokens=2), cid=cid)
        ctrl = await eng.complete(control + [7] * 40, sampling(max_tokens=2))
        assert cont_.num_cached_tokens >= 10 * BLOCK and ctrl.num_cached_tokens == 0
        st = await eng.state()
        audit = await eng.finish()
        assert st.counters["pin_handoffs"] == 1 and st.leases == () and st.U == 0
        assert st.counters["revocations"] == 0
        assert audit["refs_added"] == audit["refs_released"] == 10


@pytest.mark.engine
async def test_session_order_on_the_real_engine(model_ready: None) -> None:
    """hear-session end to end: the low-p session is evicted first, the high-p one is reused.

    Plain LRU would evict A first (its call ended first).
    """
    from ladsd import clock
    from ladsd.config import EngineConfig
    from ladsd.engine.params import sampling
    from ladsd.engine.thread import EngineThread

    cfg = EngineConfig(model="tiny", max_model_len=960, num_gpu_blocks_override=32)
    lease = LeaseConfig(enabled=False, lease_lifetime_s=3600.0)
    async with EngineThread(cfg, lease, retention=Retention.SESSION) as eng:
        ha, hb = hist(1, 8), hist(2, 8)
        await eng.complete(ha, sampling(max_tokens=1))
        await eng.complete(hb, sampling(max_tokens=1))
        now = clock.now()
        for cid, h, p in ((A, ha, 0.9), (B, hb, 0.1)):
            eng.notice(HistoryNotice(cid, tuple(h), "pd", "yd", now, 300, continuation_p=p))
        st = await eng.state()
        assert st.counters["sessions"] == 2 and st.leases == ()
        # 25 blocks of 31: every foreign block, all of B's and A's tail go.
        await eng.complete(hist(100, 25), sampling(max_tokens=1))
        ca = await eng.complete(ha + [7] * 40, sampling(max_tokens=1), cid=A)
        cb = await eng.complete(hb + [7] * 40, sampling(max_tokens=1), cid=B)
        assert 0 < ca.num_cached_tokens < 8 * BLOCK and cb.num_cached_tokens == 0
        assert (await eng.sizes()).get("lease_book.sessions", 0) == 0
        audit = await eng.finish()
        assert audit["refs_added"] == audit["refs_released"] == 0


@pytest.mark.engine
@pytest.mark.parametrize("ep", [EnginePolicy.AUGSERVE, EnginePolicy.AUGSERVE_ORDER])
async def test_augserve_engine_runs_workflows_with_a_balanced_audit(model_ready, ep):
    prof = for_run(PROFILES["smoke"], "fifo", ep)  # its step buffer
    async with open_runtime(prof, "fifo", engine_policy=ep) as rt:

        async def workflow(i: int) -> int:
            prompt = [100 + (i * 31 + k) % 3000 for k in range(96 + 32 * i)]
            out = await rt.cold(prompt, forced(4), cid=ContinuationId(f"w{i}", 0))
            history = prompt + list(out.completion.token_ids)
            for turn in (1, 2):
                done = await rt.resume(
                    ContinuationId(f"w{i}", turn),
                    history,
                    b"observation %d/%d" % (i, turn),
                    lambda obs, h=history: h + [200 + b for b in obs],
                    forced(4),
                    workflow_arrival=clock.now(),
                )
                history = list(done.completion.prompt_token_ids) + list(done.completion.token_ids)
            return len(history)

        lengths = await asyncio.gather(*(workflow(i) for i in range(4)))
        assert all(n > 96 for n in lengths)
        audit = await rt.finish()
        state = await rt.engine.state()
    assert audit["refs_added"] == audit["refs_released"]
    c = state.counters
    assert c["augserve_wait_samples"] == 8 and c["augserve_output_samples"] == 12
    if not ep.dynamic_budget:  # the order alone: no budget, no decision
        assert c["augserve_steps"] == 0 and c["augserve_preserves"] + c["augserve_discards"] == 0
        return
    assert c["augserve_steps"] > 0 and c["augserve_budget_min"] >= 256
    assert c["augserve_preserves"] + c["augserve_discards"] == 8  # one decision per wait
