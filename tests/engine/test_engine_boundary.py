"""The engine boundary both ways: commands in, typed records out through one sink.

* The lost-events race (issue 20): a burst's lease events reach the daemon's event
  hub (what ``/v1/events`` streams) when a newer publication reaches the runtime
  before the burst's ``State`` reply does.
* Counters travel in records, the early-return commands' CPU included.
* One kappa rule, and no import cycle through the engine thread.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import typing
from dataclasses import fields, replace

import pytest

from ladsd import clock
from ladsd.config import PROFILES
from ladsd.engine import commands as cmd
from ladsd.engine.params import forced
from ladsd.records import ContinuationId, EngineState
from ladsd.serve.daemon import Daemon, ServeConfig
from tests.helpers import free_port, running
from tests.rigs.engine import HeldNotice

SMOKE = PROFILES["smoke"]
GUARD_S = 90.0  # hang guard only


@pytest.mark.engine
async def test_a_bursts_grant_events_reach_the_event_hub_when_a_publication_overtakes_it(
    model_ready,
):
    """Forced: the engine thread is held inside the burst's notice until a requirement for
    the same history and the burst's State are queued behind it, so they run in one batch
    and the requirement's grant event is drained into the burst's state; the reply to that
    State is then held until a newer publication (a tick: a lease is live) has reached
    the runtime. The grant must still reach the event hub, once."""
    async with running(Daemon(SMOKE, "lads", ServeConfig(port=free_port())), GUARD_S) as d:
        rt = d.rt
        assert rt is not None
        eng = rt.engine
        ask, hold = eng.state, HeldNotice(eng, GUARD_S)

        async def overtaken(check: bool = True) -> EngineState:
            reply = await hold.burst_state(ask, check)
            for _ in range(int(GUARD_S / 0.02)):  # until a newer state reached the runtime
                if rt.state is not None and rt.state.seq > reply.seq:
                    break
                await asyncio.sleep(0.02)
            assert rt.state is not None and rt.state.seq > reply.seq
            return reply

        eng.state = overtaken  # type: ignore[method-assign]
        cid = ContinuationId("w0", 1)
        try:
            with hold:
                prompt = [100 + k for k in range(96)]
                cold = await rt.cold(prompt, forced(2), cid=ContinuationId("w0", 0))
                hist = prompt + list(cold.completion.token_ids)
                await asyncio.wait_for(
                    rt.resume(
                        cid,
                        hist,
                        b"x" * 50,
                        lambda obs: hist + [300 + b % 50 for b in obs[:16]],
                        forced(2),
                        workflow_arrival=clock.now(),
                    ),
                    GUARD_S,
                )
        finally:
            eng.state = ask  # type: ignore[method-assign]
        grants = [e for e in d.events.backlog if e["type"] == "grant" and e["turn"] == 1]
        assert [(e["session_id"], e["continuation"]) for e in grants] == [("w0", cid.key())], list(
        d.events.backlog
    )


def test_the_command_union_names_every_command():
    """``Command`` is the whole inbound vocabulary (Require and Sizes were missing)."""
    mine = [v for v in vars(cmd).values() if getattr(v, "__module__", "") == cmd.__name__]
    declared = {v for v in mine if hasattr(v, "__dataclass_fields__")}
    assert set(typing.get_args(cmd.Command)) == declared
    assert {cmd.Require, cmd.Sizes} <= declared


def test_the_schedulers_do_not_import_the_engine_thread():
    """The cycle augserve_sched -> thread -> schedulers is cut: kappa's rule lives in kappa."""
    code = (
        "import sys, ladsd.engine.sched_augserve, ladsd.engine.schedulers; "
        "assert 'ladsd.engine.thread' not in sys.modules, 'thread imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_kappa_is_one_frozen_record_with_one_rule():
    from ladsd.engine.kappa import KAPPA_TOKENS, Kappa, kappa_tokens

    assert kappa_tokens(1024, 4096) == KAPPA_TOKENS == 512  # AugServe's wider step: still 512
    assert kappa_tokens(256, 4096) == 256 and kappa_tokens(1024, 300) == 299
    k = Kappa(0.05, 512, "config")
    with pytest.raises(AttributeError):
        k.seconds = 1.0  # type: ignore[misc]
    assert [f.name for f in fields(Kappa)][:2] == ["seconds", "tokens"]


# ---- the asyncio side's one record dispatcher (no engine) ---------------------------------


async def test_records_reach_their_one_place_in_the_order_they_were_put():
    from ladsd.clock import Stamps
    from ladsd.engine.client import EngineClient, StreamQueue
    from ladsd.engine.outbound import (
        Counters,
        Dead,
        Done,
        EngineDead,
        EngineError,
        Failed,
        Output,
        Published,
        Reply,
        Sink,
    )
    client = EngineClient(cmd.Inbox(), refuse_seeds=False)
    sink = Sink(asyncio.get_running_loop(), client._on_record)
    got: list[tuple[str, int]] = []
    client.subscribe(lambda s: got.append(("first", s.seq)))
    client.subscribe(lambda s: got.append(("second", s.seq)))
    for name in ("a", "b", "c"):
        client._streams[name] = StreamQueue()
    fut = asyncio.get_running_loop().create_future()
    states = [EngineState(time=0.1 * i, seq=i, generation=0) for i in (1, 2)]
    sink.put(Published(states[0], Counters(0.5, 10)))
    sink.put(Output("a", "partial"))
    sink.put(Done("a", "final", Stamps(a=0.0, n=1.0, f=2.0)))
    sink.put(Failed("b", EngineError("rejected")))
    sink.put(Published(states[1], Counters(0.75, 20)))
    sink.put(Reply(fut, 2, Counters(1.0, 30)))
    sink.put(Dead(EngineDead("gone")))
    assert await asyncio.wait_for(fut, GUARD_S) == 2
    await asyncio.sleep(0)  # the Dead record after the reply
    assert got == [("first", 1), ("second", 1), ("first", 2), ("second", 2)]
    assert client.published is states[1]
    assert (client.command_cpu_s, client.inventory_bytes) == (1.0, 30)  # the newest record's
    a, b, c = (client._streams[k] for k in "abc")
    assert await a.get() == "partial" and isinstance(await a.get(), Done)
    assert isinstance(await b.get(), EngineError)
    assert isinstance(await c.get(), EngineDead)


def test_the_tally_freezes_into_the_counters_a_record_carries():
    """The engine thread adds up in a mutable Tally; each record gets a frozen copy
    with every Counters field, and later additions do not reach it."""
    from dataclasses import fields

    from ladsd.engine.outbound import Counters, Tally

    assert [f.name for f in fields(Tally)] == [f.name for f in fields(Counters)]
    t = Tally()
    t.command_cpu_s += 0.25
    t.inventory_bytes += 7
    t.publish_cpu_s += 0.5
    t.schedule_cpu_s = 0.125
    first = t.frozen()
    assert first == Counters(0.25, 7, 0.5, 0.125)
    t.command_cpu_s += 1.0
    assert first.command_cpu_s == 0.25 and t.frozen().command_cpu_s == 1.25


async def test_a_batch_hands_a_steps_records_over_together_in_order():
    """Inside ``Sink.batch`` records wait and go with one wake of the loop, in order;
    an error inside still hands them over; outside a batch each goes at once."""
    from ladsd.engine.outbound import Output, Sink

    loop = asyncio.get_running_loop()
    got: list[str] = []
    sink = Sink(loop, lambda r: got.append(r.rid))
    wakes = 0
    real = loop.call_soon_threadsafe

    def counted(*args: typing.Any) -> typing.Any:
        nonlocal wakes
        wakes += 1
        return real(*args)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:
        with sink.batch():
            for rid in ("a", "b", "c"):
                sink.put(Output(rid, None))
            await asyncio.sleep(0)
            assert got == []  # held until the batch ends
        with pytest.raises(RuntimeError, match="step failed"), sink.batch():
            sink.put(Output("d", None))
            raise RuntimeError("step failed")
        sink.put(Output("e", None))
        with pytest.raises(RuntimeError, match="already open"), sink.batch(), sink.batch():
            pass
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    await asyncio.sleep(0)
    assert got == ["a", "b", "c", "d", "e"] and wakes == 3


def test_the_inbox_refuses_before_start_and_after_death_and_orphans_nothing():
    from ladsd.engine.outbound import EngineDead, EngineError

    box = cmd.Inbox()
    with pytest.raises(EngineError, match="not started"):
        box.put(cmd.Tick())
    box.open = True
    box.put(cmd.Tick())
    box.put(cmd.Sizes())
    dead = EngineDead("gone")
    queued = box.close(dead)
    assert [type(c) for c, _ in queued] == [cmd.Tick, cmd.Sizes]
    with pytest.raises(EngineDead):
        box.put(cmd.Tick())
    assert box.get(0) == []


# ---- counters travel in records ---------------------------------------------------------


@pytest.mark.engine
async def test_a_query_that_replies_at_once_counts_its_cpu(model_ready):
    """``command_cpu_s`` counts every command, also those that reply at once (Sizes,
    Snapshot, Require, State, ...), and reaches the asyncio side in the reply."""
    from ladsd.engine.thread import EngineThread, Upkeep

    lease = replace(SMOKE.lease, kappa_s=0.05)  # no kappa measurement
    tick = lease.tick_s
    async with EngineThread(SMOKE.engine, lease, upkeep=Upkeep(quiet_idle=True)) as eng:
        for _ in range(100):  # until the thread is at rest: no tick over three periods
            ticks = eng.activity.ticks
            await asyncio.sleep(3 * tick)
            if eng.activity.ticks == ticks:
                break
        await eng.snapshot()  # a query: its reply carries the counters
        before = eng.command_cpu_s
        await eng.sizes()
        assert eng.activity.ticks == ticks  # nothing else ran on the engine thread
        assert eng.command_cpu_s > before


def test_a_batch_charges_its_wake_to_the_states_only_when_they_alone_needed_it(monkeypatch):
    """``state_wake_cpu_s``: the CPU of a batch's wake when it held only states (the
    controller's alone); 0 when it also carried a step's outputs, which need the wake
    anyway, and 0 for an empty batch (no wake)."""
    from ladsd.engine import outbound
    from ladsd.engine.outbound import Counters, Output, Published, Sink
    from tests.rigs.policy import engine_state

    loop = asyncio.new_event_loop()
    try:
        ticks = iter(range(100))
        monkeypatch.setattr(outbound.time, "thread_time", lambda: float(next(ticks)))
        sink = Sink(loop, lambda r: None)
        state = Published(engine_state(0.0), Counters())
        with sink.batch():
            sink.put(state)
        assert sink.state_wake_cpu_s == 1.0  # one fake CPU second between the reads
        with sink.batch():
            sink.put(Output("a", None))
            sink.put(state)
        assert sink.state_wake_cpu_s == 0.0
        with sink.batch():
            pass
        assert sink.state_wake_cpu_s == 0.0
    finally:
        loop.close()


@pytest.mark.engine
async def test_a_step_that_changes_nothing_a_state_shows_publishes_none(model_ready):
    """Decode steps that move no block, lease, budget or load would publish the last
    state again but for its time: the loop skips them (``activity.unchanged``) while
    that state is younger than a tick, and every state it does publish differs from
    the one before it in what it shows, or is a tick or more younger."""
    from ladsd.engine.thread import EngineThread, Upkeep

    lease = replace(SMOKE.lease, kappa_s=0.05, tick_s=5.0)  # no kappa run; few ticks
    async with EngineThread(SMOKE.engine, lease, upkeep=Upkeep(quiet_idle=True)) as eng:
        got: list[EngineState] = []
        eng.subscribe(got.append)
        await eng.complete([100 + k for k in range(40)], forced(24))
        await eng.state()
        act = eng.activity
        assert act.steps >= 24 and act.unchanged >= 1, act
        assert act.published + act.unchanged >= act.steps  # a step publishes or is skipped
    def shows(st: EngineState) -> tuple:
        counters = {k: v for k, v in st.counters.items() if not k.endswith("_block_seconds")}
        return replace(st, time=0.0, seq=0, events=()), sorted(counters.items()), st.events

    published = got[:-1]  # the last is the State barrier's: published whatever it shows
    assert len(published) >= 2
    for prev, cur in zip(published, published[1:], strict=False):
        if shows(prev) == shows(cur):
            assert cur.time - prev.time >= lease.tick_s, (prev, cur)
