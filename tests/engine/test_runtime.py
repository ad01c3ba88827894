"""The runtime on the real engine and link: a burst is offered whole, after its notices."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from ladsd import clock
from ladsd.config import PROFILES
from ladsd.delivery.fifo import Fifo
from ladsd.delivery.policy import Pending, SenderView
from ladsd.engine.params import forced
from ladsd.engine.thread import EngineThread
from ladsd.records import ContinuationId, EngineState, LeaseEventKind
from ladsd.runtime import Runtime
from tests.rigs.engine import HeldNotice

pytestmark = [pytest.mark.engine]
SMOKE = PROFILES["smoke"]
GUARD_S = 60.0  # hang guard only
BURST = 6


class Watcher(Fifo):
    """FIFO that records what each decision saw: pending ids and announced residency."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[set[ContinuationId], set[ContinuationId]]] = []

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
        st = view.state
        known = {p.cid for p in pending if st is not None and st.resident_blocks(p.cid) is not None}
        self.seen.append(({p.cid for p in pending}, known))
        return super().choose(pending, view, now)


async def test_a_burst_is_seen_whole_by_the_first_decision(model_ready):
    policy = Watcher()
    async with EngineThread(SMOKE.engine, SMOKE.lease) as eng:
        rt = await Runtime(eng, policy, SMOKE.link).start()
        try:
            prompts = [[100 + (7 * i + k) % 3000 for k in range(96)] for i in range(BURST)]
            cids = [ContinuationId(f"w{i}", 0) for i in range(BURST)]
            colds = await asyncio.gather(
                *(rt.cold(p, forced(2), cid=c) for p, c in zip(prompts, cids, strict=True))
            )
            hist = [p + list(o.completion.token_ids) for p, o in zip(prompts, colds, strict=True)]
            # Every result of the burst becomes ready in the same loop turn.
            burst = [ContinuationId(f"w{i}", 1) for i in range(BURST)]
            await asyncio.gather(
                *(
                    rt.resume(
                        cid,
                        h,
                        b"x" * (50 * (i + 1)),
                        lambda obs, h=h: h + [300 + b % 50 for b in obs[:16]],
                        forced(2),
                        workflow_arrival=clock.now(),
                    )
                    for i, (cid, h) in enumerate(zip(burst, hist, strict=True))
                )
            )
            assert (await rt.finish())["refs_added"] == rt.audit["refs_released"]
        finally:
            await rt.close()
    first_pending, first_known = policy.seen[0]
    assert first_pending == set(burst)  # the whole burst, not the first result alone
    assert first_known == set(burst)  # and the engine had seen every notice before it


class SeqWatcher(Fifo):
    """FIFO that records (state seq before, state seq) of every decision."""

    def __init__(self) -> None:
        super().__init__()
        self.seqs: list[tuple[int, int]] = []

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
        if view.state is not None:
            self.seqs.append((view.state_seq_before, view.state.seq))
        return super().choose(pending, view, now)


async def one_workflow(rt: Runtime, cid: ContinuationId) -> None:
    """Call 0 of ``cid``'s workflow, then its resume over the link (a burst of one);
    the lease audit must balance."""
    prompt = [100 + k for k in range(96)]
    cold = await rt.cold(prompt, forced(2), cid=ContinuationId(cid.workflow, 0))
    hist = prompt + list(cold.completion.token_ids)
    await rt.resume(
        cid,
        hist,
        b"x" * 50,
        lambda obs: hist + [300 + b % 50 for b in obs[:16]],
        forced(2),
        workflow_arrival=clock.now(),
    )
    assert (await rt.finish())["refs_added"] == rt.audit["refs_released"]


async def test_a_state_published_before_the_bursts_reply_is_not_undone(model_ready):
    """The burst's state reply can arrive after a newer published state; the sender keeps the newer.

    The race is forced: the reply is held back until the engine has published
    a newer state (taken after it), which reaches the runtime first. (The State
    command is a barrier: the engine publishes each state it replies with, so
    the newer one reaches the runtime by itself.)
    """
    policy = SeqWatcher()
    async with EngineThread(SMOKE.engine, SMOKE.lease) as eng:
        rt = await Runtime(eng, policy, SMOKE.link).start()
        ask = eng.state
        replies: list[int] = []

        async def late_reply(check: bool = True):
            reply = await ask(check=check)
            newer = await ask(check=check)  # published after the reply was taken
            assert newer.seq > reply.seq
            replies.append(reply.seq)
            return reply

        eng.state = late_reply  # type: ignore[method-assign]
        try:
            await one_workflow(rt, ContinuationId("w0", 1))
        finally:
            eng.state = ask  # type: ignore[method-assign]
            await rt.close()
    assert replies, "the burst asked for a state"
    assert policy.seqs, "the policy decided"
    # Every decision saw states in order: no decision read an older state than the last one.
    assert all(before < seq for before, seq in policy.seqs), policy.seqs
    assert rt.state is not None and rt.state.seq > replies[-1]


async def test_a_bursts_grant_events_reach_the_listeners_when_a_publication_overtakes_it(
    model_ready,
):
    """A lease event taken into the burst's state must reach every listener (the daemon's
    session table and ``/v1/events`` listen beside the sender), also when a newer state
    reaches the runtime before that state does.

    Forced: the engine thread is held inside the burst's notice until a requirement for
    the same history and the burst's State are both queued behind it, so they run in one
    batch and the requirement's grant event is drained into the burst's state, not into
    a publication; then a newer state reaches the runtime first.
    """
    async with EngineThread(SMOKE.engine, SMOKE.lease) as eng:
        rt = await Runtime(eng, SeqWatcher(), SMOKE.link).start()
        seen: list[tuple[LeaseEventKind, ContinuationId]] = []

        def listen(state: EngineState) -> None:  # as the daemon attaches its listeners
            seen.extend((e.kind, e.cid) for e in state.events)

        rt.subscribe(listen)
        ask, hold = eng.state, HeldNotice(eng, GUARD_S)

        async def overtaken(check: bool = True) -> EngineState:
            reply = await hold.burst_state(ask, check)
            await ask(check=check)  # a newer state (published) reaches the runtime first
            return reply

        eng.state = overtaken  # type: ignore[method-assign]
        cid = ContinuationId("w0", 1)
        try:
            with hold:
                await one_workflow(rt, cid)
        finally:
            eng.state = ask  # type: ignore[method-assign]
            await rt.close()
    assert (LeaseEventKind.GRANT, cid) in seen, seen
