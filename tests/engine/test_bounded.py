"""A long-lived process keeps nothing per workflow once the workflow is over.

200 sequential workflows (a cold call, a tool result over the real link, the
resumed call) through the one wiring function with leases on; afterwards every
table on both sides of the engine-thread boundary (runtime, sender, receiver,
engine requests, first-allocation stamps, lease book) is back to its empty size.
"""

from __future__ import annotations

import asyncio

import pytest

from ladsd import clock
from ladsd.config import PROFILES
from ladsd.engine.params import forced
from ladsd.records import ContinuationId
from ladsd.wiring import open_runtime

pytestmark = [pytest.mark.engine]
WORKFLOWS = 200


async def test_tables_are_empty_after_many_workflows(model_ready):
    async with open_runtime(PROFILES["smoke"], "lads") as rt:
        assert set((await rt.sizes()).values()) == {0}
        for i in range(WORKFLOWS):
            wid = f"w{i}"
            prompt = [100 + (i * 7 + k) % 3000 for k in range(64)]
            out = await rt.cold(prompt, forced(2), cid=ContinuationId(wid, 0))
            history = prompt + list(out.completion.token_ids)
            done = await rt.resume(
                ContinuationId(wid, 1),
                history,
                b"observation %d" % i,
                lambda obs, h=history: h + [200 + b for b in obs[:8]],
                forced(2),
                workflow_arrival=clock.now(),
            )
            assert done.stamps.c is not None and done.stamps.f is not None
        await rt.sender.drain()  # the last ack: the receiver forgets a cid once it is settled
        await asyncio.sleep(0)
        sizes = await rt.sizes()
        assert {k: v for k, v in sizes.items() if v} == {}
        audit = await rt.finish()
    assert audit["refs_added"] == audit["refs_released"]
    assert rt.state is not None and rt.state.counters["grants"] > 0  # leases were in play
