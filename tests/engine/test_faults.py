"""Fault injection on the real engine and link: every failure ends the run, never hangs.

Each test runs a smoke replay with one fault and checks that the run fails
with a clear error naming the cause, and that the lease audit still ran and
balanced. ``GUARD_S`` only turns a hang into a failure; no test measures time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from ladsd.config import PROFILES, EngineConfig
from ladsd.delivery.lads import Lads
from ladsd.engine.lease_book import LeaseBook
from ladsd.engine.params import sampling
from ladsd.engine.sched_leases import LeaseScheduler
from ladsd.engine.thread import EngineDead, EngineThread
from ladsd.runtime import Runtime
from ladsd.workloads.factory import make
from ladsd.workloads.runner import RunFailed, run

pytestmark = [pytest.mark.engine]
SMOKE = PROFILES["smoke"]
GUARD_S = 300.0  # a hang guard, far above a smoke run


async def failed_run(policy: str = "lads") -> RunFailed:
    wl = make("controlled", SMOKE, 1)
    with pytest.raises(RunFailed) as info:
        await asyncio.wait_for(run(wl, SMOKE, policy), GUARD_S)
    err = info.value
    assert err.audit is not None, "the lease audit must run after a failure"
    assert err.audit["refs_added"] == err.audit["refs_released"]
    return err


def with_sender_fault(monkeypatch: pytest.MonkeyPatch, fault: Callable[..., bytes]) -> None:
    """Install ``fault`` on the runtime's sender right after it starts."""
    start = Runtime.start

    async def start_with_fault(self: Runtime) -> Runtime:
        await start(self)
        self.sender.fault = fault
        return self

    monkeypatch.setattr(Runtime, "start", start_with_fault)


async def test_receiver_rejecting_a_frame_too_often_fails_the_run(monkeypatch, model_ready):
    def corrupt(cid: Any, send_no: int, data: bytes) -> bytes:  # payload digest never matches
        return data[:-1] + bytes([data[-1] ^ 0xFF])

    with_sender_fault(monkeypatch, corrupt)
    err = await failed_run()
    assert "FrameRejected" in str(err) and "rejected" in str(err)


async def test_link_dropping_more_than_max_drops_fails_the_run(monkeypatch, model_ready):
    def break_header(cid: Any, send_no: int, data: bytes) -> bytes:  # the receiver drops it
        return b"\xff" * 8 + data[8:]

    with_sender_fault(monkeypatch, break_header)
    err = await failed_run()
    assert "SendFailed" in str(err) or "LinkDown" in str(err)


async def test_policy_that_raises_fails_the_run(monkeypatch, model_ready):
    def broken(self: Lads, *a: Any, **kw: Any) -> None:
        raise ValueError("injected policy bug")

    monkeypatch.setattr(Lads, "choose", broken)
    err = await failed_run("lads")
    assert "PolicyError" in str(err) and "injected policy bug" in str(err)


async def test_lease_tick_that_raises_kills_the_engine_and_fails_the_run(
    monkeypatch, model_ready
):
    def broken(self: LeaseBook) -> None:
        raise RuntimeError("injected tick bug")

    monkeypatch.setattr(LeaseBook, "tick", broken)
    err = await failed_run()
    assert "EngineDead" in str(err) and "injected tick bug" in str(err)


def fail_step_after(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    schedule = LeaseScheduler.schedule
    calls = 0

    def flaky(self: LeaseScheduler, *a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > n:
            raise RuntimeError("injected step failure")
        return schedule(self, *a, **kw)

    monkeypatch.setattr(LeaseScheduler, "schedule", flaky)


async def test_engine_step_that_raises_fails_the_run(monkeypatch, model_ready):
    fail_step_after(monkeypatch, 30)
    err = await failed_run()
    assert "EngineDead" in str(err) and "injected step failure" in str(err)


async def test_failed_step_declares_the_engine_dead_and_it_refuses_work(
    monkeypatch, model_ready
):
    """Blocks hashed at allocation may never get their KV after a failed step, so the
    engine does not serve from that cache again: it is dead and refuses all work."""
    async with EngineThread(EngineConfig(model="tiny", num_gpu_blocks_override=160)) as eng:
        ok = await eng.complete(list(range(100, 300)), sampling(max_tokens=2))
        assert len(ok.token_ids) == 2
        fail_step_after(monkeypatch, 0)
        with pytest.raises(EngineDead, match="injected step failure"):
            await asyncio.wait_for(
                eng.complete(list(range(400, 600)), sampling(max_tokens=2)), GUARD_S
            )
        assert not eng.alive and eng.error is not None
        with pytest.raises(EngineDead):
            eng.submit(list(range(100, 300)), sampling(max_tokens=2))
        with pytest.raises(EngineDead):
            await eng.snapshot()
        audit = await eng.finish()  # taken when it died
        assert audit["refs_added"] == audit["refs_released"]
