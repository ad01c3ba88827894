"""The embedded engine on the real vLLM: tiny dummy-weight shape and SmolLM2."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from ladsd.config import EngineConfig
from ladsd.engine.params import sampling
from ladsd.engine.thread import EngineError, EngineThread

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

TINY = EngineConfig(model="tiny", max_model_len=1024, num_gpu_blocks_override=64)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tiny(model_ready):
    async with EngineThread(TINY) as eng:
        yield eng


def ids(n: int, start: int = 100) -> list[int]:
    return [start + (i * 37) % 5000 for i in range(n)]


async def test_concurrent_generates_finish_with_ordered_stamps(tiny):
    reqs = [tiny.complete(ids(40, 200 + 10 * k), sampling(max_tokens=6)) for k in range(6)]
    done = await asyncio.gather(*reqs)
    assert len({d.request_id for d in done}) == 6
    for d in done:
        assert len(d.token_ids) == 6
        assert d.finish_reason == "length"
        st = d.stamps
        assert st.n is not None and st.a <= st.n <= st.f


async def test_repeated_prefix_hits_prefix_cache(tiny):
    prefix = ids(160, 900)  # five full 32-token blocks
    first = await tiny.complete(prefix + [7], sampling(max_tokens=2))
    second = await tiny.complete(prefix + [8], sampling(max_tokens=2))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 128


async def test_abort_ends_stream_and_frees_slots(tiny):
    rid = tiny.submit(ids(50, 3000), sampling(max_tokens=500, ignore_eos=True), request_id="ab")
    stream = tiny.stream(rid)
    first = await stream.__anext__()
    assert len(first.outputs[0].token_ids) >= 1
    await tiny.abort("ab")
    rest = [o async for o in stream]
    assert all(not o.finished for o in rest)
    for _ in range(50):  # the engine drops the request within a few steps
        snap = await tiny.snapshot()
        if snap.running == 0 and snap.waiting == 0:
            break
        await asyncio.sleep(0.05)
    assert snap.running == 0 and snap.waiting == 0


async def test_engine_error_surfaces_and_engine_survives(tiny):
    with pytest.raises(EngineError, match="longer than the maximum model length"):
        await tiny.complete(ids(4000), sampling(max_tokens=2))
    tiny.submit(ids(10), sampling(max_tokens=50), request_id="dup")
    with pytest.raises(EngineError, match="already in flight"):
        await tiny.complete(ids(10), sampling(max_tokens=2), request_id="dup")
    await tiny.abort("dup")
    ok = await tiny.complete(ids(20), sampling(max_tokens=3))
    assert tiny.alive and len(ok.token_ids) == 3


async def test_snapshot_reports_pool(tiny):
    snap = await tiny.snapshot()
    assert snap.total_blocks == 64
    assert 0 < snap.free_blocks <= 64
    assert snap.max_num_seqs == 8 and snap.block_size == 32
    assert tiny.kappa > 0


async def test_smollm2_knows_paris(smol):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = await smol.complete(msgs, sampling(max_tokens=32))
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


async def test_structured_output_parses(smol):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    msgs = [{"role": "user", "content": "Give the capital of France as JSON."}]
    out = await smol.complete(msgs, sampling(max_tokens=64, json_schema=schema))
    obj = json.loads(out.text)
    assert set(obj) == {"city", "country"}
    assert " " not in out.text.replace(obj["city"], "").replace(obj["country"], "")


async def test_seeded_request_refused_on_cpu_engine_keeps_running(tiny):
    if not tiny.settings.cpu:
        pytest.skip("GPU engine: per-request seeds are supported")
    with pytest.raises(EngineError, match="seeds"):
        await tiny.complete(ids(10), sampling(max_tokens=2, seed=3))
    assert len((await tiny.complete(ids(10), sampling(max_tokens=2))).token_ids) == 2


async def test_real_preemptions_are_counted(model_ready):
    """A pool too small for the batch makes vLLM preempt; the engine state counts each one."""
    cfg = EngineConfig(model="tiny", max_model_len=512, num_gpu_blocks_override=24)
    async with EngineThread(cfg) as eng:
        assert (await eng.state()).counters["preemptions"] == 0
        params = sampling(max_tokens=200, ignore_eos=True)
        prompts = [ids(64, 100 + 97 * k) for k in range(8)]
        outs = await asyncio.gather(*(eng.complete(p, params) for p in prompts))
        assert all(len(o.token_ids) == 200 for o in outs)
        assert (await eng.state()).counters["preemptions"] > 0
