"""Real-engine rigs: the SmolLM2 engine (``smol``), histories for the tiny model, and a
lease notice the engine thread is held inside (so a test can queue commands behind it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from ladsd.config import EngineConfig
from ladsd.engine import commands as cmd
from ladsd.records import EngineState, HistoryNotice

BLOCK = 32  # the tiny model's block size
SMOL = EngineConfig(model="smollm2-135m", max_model_len=4096, num_gpu_blocks_override=256)


def hist(seed: int, blocks: int) -> list[int]:
    """A history of ``blocks`` full blocks, distinct per seed, inside the tiny vocabulary."""
    return [100 + (seed * 7919 + i * 104729) % 40000 for i in range(blocks * BLOCK)]


class HeldNotice:
    """Holds the engine thread inside its first lease notice, so that commands queued
    meanwhile run in one batch behind it. A context manager around the patched
    ``lease_notice``: on exit it lets the thread go and restores the scheduler's own."""

    def __init__(self, eng: Any, guard_s: float) -> None:
        self.eng, self.guard_s = eng, guard_s  # guard_s: a hang guard, never a speed check
        self.entered, self.gate = threading.Event(), threading.Event()
        self.notices: list[HistoryNotice] = []
        self._notice = eng._sched.lease_notice

    def _held(self, n: HistoryNotice) -> None:  # engine thread
        if not self.notices:
            self.notices.append(n)
            self.entered.set()
            self.gate.wait(self.guard_s)
        self._notice(n)

    def __enter__(self) -> HeldNotice:
        self.eng._sched.lease_notice = self._held
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()
        self.eng._sched.lease_notice = self._notice

    async def burst_state(
        self, ask: Callable[..., Awaitable[EngineState]], check: bool
    ) -> EngineState:
        """Once the thread holds the notice: queue a requirement for the same history and a
        State behind it, let the thread go; the requirement is held (a grant event drained
        into that State), and the State's reply is returned."""
        assert await asyncio.to_thread(self.entered.wait, self.guard_s)
        held = asyncio.get_running_loop().create_future()
        self.eng._put(cmd.Require(self.notices[0]), held)  # queued behind the held notice
        reply_task = asyncio.ensure_future(ask(check=check))
        await asyncio.sleep(0)  # ... and the State behind it
        self.gate.set()
        assert await asyncio.wait_for(held, self.guard_s) is None  # held: a grant event
        return await asyncio.wait_for(reply_task, self.guard_s)
