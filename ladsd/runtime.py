"""One run's loop over engine thread + lease provider + return link + delivery policy
(opened, and wired, by :func:`ladsd.wiring.open_runtime`).

The loop of architecture.md, in code: a tool result is ready (r) -> the
engine-side lease provider sees its history first (``lease_notice``) -> the
sender offers it to the policy -> commit (s) -> paced TCP -> complete
receipt (c) -> the receiver registers the continuation with the engine at
once (a) -> first allocation (n) -> completion (f). Engine state flows back
as published records (the engine client's subscribers: the sender first, then
:meth:`Runtime.subscribe`'s listeners).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from array import array
from asyncio import FIRST_COMPLETED
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from ladsd import clock
from ladsd.clock import Stamps
from ladsd.config import LeaseConfig, LinkConfig
from ladsd.continuation import ContinuationEstimate
from ladsd.delivery.policy import Policy
from ladsd.engine.thread import (
    Completion,
    EngineDead,
    EngineThread,
    PoolSnapshot,
    Prompt,
)
from ladsd.records import ContinuationId, EngineState, HistoryNotice, SenderInventory
from ladsd.transport.link import Delivery, Receiver, Rejected, Sender, prepare

log = logging.getLogger("ladsd.runtime")


def prefix_digest(token_ids: Sequence[int]) -> str:
    """Digest of a history (token ids): binds a frame to the prefix it continues."""
    return hashlib.sha256(array("I", token_ids).tobytes()).hexdigest()


@dataclass(frozen=True)
class CallOutcome:
    """One model call with every stamp of spec section 1 (cold: r, s, c None)."""

    completion: Completion
    stamps: Stamps
    payload_bytes: int = 0
    frame_bytes: int = 0


@dataclass(frozen=True)
class EngineInfo:
    """The engine's settings a handler shows (``GET /v1/engine/state``)."""

    lease: LeaseConfig
    block_size: int
    dtype: str


@dataclass
class _Waiting:
    history_digest: str
    render: Callable[[bytes], list[int]]
    params: Any
    registered: asyncio.Future


@dataclass
class Timeline:
    """U, B, C, F as published by the engine, at most one sample per ``min_dt``.

    Within a window the sample keeps the window's start time and its latest
    values (run files stay lean: the engine publishes after every step). A
    replay keeps every sample for its run file; the daemon keeps the last
    ``limit`` (it runs for days).
    """

    min_dt: float = 0.1
    limit: int | None = None
    samples: deque[tuple[float, int, int, int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.samples = deque(maxlen=self.limit)

    def sizes(self) -> dict[str, int]:
        return {"timeline": len(self.samples)}

    def add(self, s: EngineState) -> None:
        if self.samples and s.time - self.samples[-1][0] < self.min_dt:
            self.samples[-1] = (self.samples[-1][0], s.U, s.B, s.C, s.F)
            return
        self.samples.append((s.time, s.U, s.B, s.C, s.F))


class Runtime:
    """Carries tool results from ready to resumed inference for one run.

    Lives on the asyncio side only: it talks to the engine thread through
    :class:`EngineThread`'s typed facade (``notice``, ``inventory``,
    ``cancel``, ``submit``, ``finish``) and never runs code there.
    """

    def __init__(
        self,
        engine: EngineThread,
        policy: Policy,
        link: LinkConfig,
        *,
        timeline_samples: int | None = None,
    ) -> None:
        self.engine = engine
        self.sender = Sender(policy, config=link, on_inventory=self._on_inventory)
        self.receiver = Receiver(self._register, config=link)
        self.timeline = Timeline(limit=timeline_samples)
        self.state_bytes = 0  # engine states received (loop thread)
        self.audit: dict[str, float] | None = None
        self.dilation = 1.0  # link rate = profile rate / dilation (open_runtime sets it)
        self._waiting: dict[ContinuationId, _Waiting] = {}
        self._batch: list[tuple[HistoryNotice, Any, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()
        self.continuation = ContinuationEstimate()  # p for HEAR, from completed workflows
        self._subscribers: list[Callable[[EngineState], None]] = []

    @property
    def policy(self) -> Policy:
        return self.sender.policy

    @property
    def link(self) -> LinkConfig:
        return self.sender.config

    def subscribe(self, fn: Callable[[EngineState], None]) -> None:
        """Call ``fn`` with every published EngineState (loop thread, engine order),
        after the runtime's own handler (the sender sees a state first)."""
        self._subscribers.append(fn)

    @property
    def state(self) -> EngineState | None:
        """The newest published engine state (None before the first)."""
        return self.engine.published

    async def start(self) -> Runtime:
        self.engine.subscribe(self._on_state)
        port = await self.receiver.start(0)
        await self.sender.start(self.link.host, port)
        return self

    async def close(self) -> None:
        await self.sender.close()
        await self.receiver.close()

    # ---- model calls -----------------------------------------------------
    async def cold(
        self, prompt_ids: Sequence[int], params: Any, *, cid: ContinuationId
    ) -> CallOutcome:
        """Model call 0: enters the engine directly."""
        comp = await self.engine.complete(list(prompt_ids), params, request_id=cid.key())
        return CallOutcome(comp, comp.stamps)

    async def resume(
        self,
        cid: ContinuationId,
        history_ids: Sequence[int],
        observation: bytes,
        render: Callable[[bytes], list[int]],
        params: Any,
        *,
        workflow_arrival: float,
        expected_prompt_tokens: int | None = None,
    ) -> CallOutcome:
        """A tool result is ready now: carry it over the link and resume the model.

        Fails (never hangs) if the link fails the result's delivery or the
        engine dies: the result's ticket and the engine stream both raise.
        """
        r = clock.now()
        digest = prefix_digest(history_ids)
        prep = prepare(
            cid,
            observation,
            prefix_digest=digest,
            ready_time=r,
            workflow_arrival=workflow_arrival,
            # the full prompt (history + observation): Tail-aware's work estimate
            prompt_tokens=expected_prompt_tokens or len(render(observation)),
            codec=self.link.codec,
        )
        registered = asyncio.get_running_loop().create_future()
        self._waiting[cid] = _Waiting(digest, render, params, registered)
        notice = HistoryNotice(
            cid=cid,
            token_ids=tuple(history_ids),
            prefix_digest=digest,
            payload_digest=prep.item.payload_digest,
            ready_time=r,
            payload_bytes=prep.item.payload_bytes,
            continuation_p=self.continuation.p(cid.turn),  # calls 0 .. turn-1 are done
        )
        try:
            ticket = await self._offer(notice, prep)
            # Registration precedes the ack, so a received ticket means registered;
            # a failed ticket (rejects, drops, policy error) ends the wait with its error.
            await asyncio.wait({registered, ticket.received}, return_when=FIRST_COMPLETED)
            if not registered.done():
                ticket.received.result()  # raises the link's error
            rid, c = await registered
            comp = await self.engine.result(rid)
        finally:
            self._waiting.pop(cid, None)
            if not registered.done():
                registered.cancel()
        self.sender.complete(cid, len(comp.token_ids))
        # A settled ticket is never resent: only then may the receiver forget the cid.
        ticket.received.add_done_callback(lambda _: self.receiver.forget(cid))
        return CallOutcome(
            comp,
            replace(comp.stamps, r=r, s=ticket.s, c=c),
            payload_bytes=prep.item.payload_bytes,
            frame_bytes=prep.item.frame_bytes,
        )

    async def _offer(self, notice: HistoryNotice, prep: Any) -> Any:
        """Offer a ready result; results ready in the same loop turn go in one batch.

        A burst's results become ready together. The batch's notices all reach the
        lease provider first (spec 3.2: it sees a result before the sender does),
        then one engine state taken after them reaches the sender, and then the
        whole batch is offered at once: the policy's first decision of the burst
        sees every result of it, with the leases granted for them.
        """
        fut = asyncio.get_running_loop().create_future()
        self._batch.append((notice, prep, fut))
        if len(self._batch) == 1:
            asyncio.get_running_loop().call_soon(self._flush)
        return await fut

    def _flush(self) -> None:
        batch, self._batch = self._batch, []

        async def go() -> None:
            try:
                for notice, _, _ in batch:
                    self.engine.notice(notice)
                # A barrier: the engine publishes the state it takes after the notices,
                # and that publication reaches every listener (the sender first) before
                # this returns, in engine order: no older state can follow a newer one,
                # and no lease event it carries is lost.
                await self.engine.state(check=False)
                tickets = await self.sender.offer_many(
                    [(p.item, p.payload) for _, p, _ in batch], codec=self.link.codec
                )
            except Exception as e:
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                return
            for (_, _, fut), t in zip(batch, tickets, strict=True):
                if not fut.done():
                    fut.set_result(t)

        self._tasks.add(t := asyncio.ensure_future(go()))
        t.add_done_callback(self._tasks.discard)

    def end_workflow(self, workflow: str, calls: int) -> None:
        """``workflow`` completed after ``calls`` model calls (cold call included).

        The harness's only source for the continuation probability: call it
        once per workflow that completed (never for a failed or cancelled one).
        """
        self.continuation.end(calls)
        log.debug("workflow %s completed after %d calls", workflow, calls)

    def cancel(self, cid: ContinuationId) -> None:
        self.sender.cancel(cid)
        w = self._waiting.pop(cid, None)
        if w is not None and not w.registered.done():
            w.registered.cancel()
        if self.engine.alive:
            self.engine.cancel(cid)

    # ---- receiver side ---------------------------------------------------
    async def _register(self, d: Delivery) -> None:
        """Verified frame -> continuation registered with the engine, in receipt order."""
        w = self._waiting.get(d.cid)
        if w is None:
            raise Rejected(f"no continuation is waiting for {d.cid.key()}")
        if d.prefix_digest != w.history_digest:
            raise Rejected(f"prefix digest of {d.cid.key()} does not match its history")
        rid = self.engine.submit(
            w.render(d.observation), w.params, request_id=d.cid.key(), cid=d.cid
        )
        w.registered.set_result((rid, d.c))

    # ---- engine <-> sender records ----------------------------------------
    def _on_state(self, state: EngineState) -> None:
        self.state_bytes += len(orjson.dumps(state))
        self.timeline.add(state)
        self.sender.set_state(state)
        for fn in self._subscribers:
            fn(state)

    # ---- the engine, for the serve handlers (thin: they reach it only through here) ----
    @property
    def alive(self) -> bool:
        return self.engine.alive

    @property
    def error(self) -> EngineDead | None:
        return self.engine.error

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def leases_enabled(self) -> bool:
        return self.engine.lease.enabled

    def engine_info(self) -> EngineInfo:
        """What the engine runs with: lease config, block size, dtype."""
        e = self.engine
        return EngineInfo(e.lease, e.cfg.resolved_block_size(), e.dtype)

    def submit(self, prompt: Prompt, params: Any, *, cid: ContinuationId | None = None) -> str:
        """Register a request now (:meth:`EngineThread.submit`); return its id."""
        return self.engine.submit(prompt, params, cid=cid)

    def stream(self, rid: str) -> AsyncIterator[Any]:
        return self.engine.stream(rid)

    async def result(self, rid: str) -> Completion:
        return await self.engine.result(rid)

    async def abort(self, rid: str) -> None:
        await self.engine.abort(rid)

    def notice(self, n: HistoryNotice) -> None:
        """A result is ready: the engine's lease provider sees its history now."""
        self.engine.notice(n)

    async def require(self, n: HistoryNotice) -> str | None:
        """Lease ``n``'s history now if the budget can hold it: None, else why not."""
        return await self.engine.require(n)

    async def snapshot(self) -> PoolSnapshot:
        return await self.engine.snapshot()

    def _on_inventory(self, inv: SenderInventory) -> None:
        if self.engine.alive:  # a dead engine has already failed the run
            self.engine.inventory(inv)  # coalesced on the engine thread

    # ---- end of run --------------------------------------------------------
    async def finish(self) -> dict[str, float]:
        """Release every lease, check integrity; return the lease audit (once)."""
        if self.audit is None:
            self.audit = await self.engine.finish()
        return self.audit

    async def sizes(self) -> dict[str, int]:
        """Entries per table of the run's parts (all 0 between workflows: nothing leaks)."""
        own = {"waiting": len(self._waiting), "batch": len(self._batch), "tasks": len(self._tasks)}
        parts = {
            "sender": self.sender.sizes(),
            "receiver": self.receiver.sizes(),
            "engine": await self.engine.sizes(),
        }
        return own | {f"{p}.{k}": v for p, d in parts.items() for k, v in d.items()}

    def control_bytes(self) -> int:
        """Control-record bytes: link acks/nacks, engine states, sender inventories."""
        link = self.sender.stats().get("control_bytes", 0)
        return int(link + self.state_bytes + self.engine.inventory_bytes)

    def controller_cpu(self) -> tuple[float, float, float, float]:
        """The controller's CPU in four parts: the sender's in the policy (``choose`` and
        its hooks), the engine thread's in lease commands, in the published states, and
        in the lease work inside vLLM's ``schedule()``."""
        eng = self.engine
        return self.sender.decision_s, eng.command_cpu_s, eng.publish_cpu_s, eng.schedule_cpu_s
