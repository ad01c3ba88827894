"""One run's wiring: engine thread + lease provider + return link + delivery policy.

The loop of architecture.md, in code: a tool result is ready (r) -> the
engine-side lease provider sees its history first (``lease_notice``) -> the
sender offers it to the policy -> commit (s) -> paced TCP -> complete
receipt (c) -> the receiver registers the continuation with the engine at
once (a) -> first allocation (n) -> completion (f). Engine state flows back
as published records (``on_state`` -> sender).
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ladsd import clock
from ladsd.config import LinkConfig
from ladsd.delivery.policy import Policy
from ladsd.records import ContinuationId, EngineState, HistoryNotice, SenderInventory
from ladsd.engine.thread import Completion, EngineThread
from ladsd.transport.link import Delivery, Receiver, Rejected, Sender, prepare


def prefix_digest(token_ids: Sequence[int]) -> str:
    """Digest of a history (token ids): binds a frame to the prefix it continues."""
    return hashlib.sha256(array("I", token_ids).tobytes()).hexdigest()


@dataclass(frozen=True)
class CallOutcome:
    """One model call with every timestamp of spec section 1 (cold: r, s, c None)."""

    completion: Completion
    r: float | None = None
    s: float | None = None
    c: float | None = None
    payload_bytes: int = 0
    frame_bytes: int = 0

    @property
    def a(self) -> float:
        return self.completion.a

    @property
    def n(self) -> float | None:
        return self.completion.n

    @property
    def f(self) -> float:
        return self.completion.f


@dataclass
class _Waiting:
    history_digest: str
    render: Callable[[bytes], list[int]]
    params: Any
    registered: asyncio.Future


@dataclass
class Timeline:
    """U, B, C, F samples as published by the engine (for the lease timeline plot)."""

    samples: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    min_dt: float = 0.05

    def add(self, s: EngineState) -> None:
        if self.samples and s.time - self.samples[-1][0] < self.min_dt:
            last = self.samples[-1]
            if (s.U, s.B, s.C, s.F) == last[1:]:
                return
        self.samples.append((s.time, s.U, s.B, s.C, s.F))


class Runtime:
    """Carries tool results from ready to resumed inference for one run."""

    def __init__(self, engine: EngineThread, policy: Policy, link: LinkConfig) -> None:
        self.engine = engine
        self.policy = policy
        self.link = link
        self.sender = Sender(policy, config=link, on_inventory=self._on_inventory)
        self.receiver = Receiver(self._register, config=link)
        self.state: EngineState | None = None
        self.timeline = Timeline()
        self.state_bytes = 0
        self._waiting: dict[ContinuationId, _Waiting] = {}
        self._inventory: SenderInventory | None = None
        self._inventory_posted = False
        self._leases = False
        self._batch: list[tuple[Any, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> Runtime:
        self.engine.on_state = self._on_state
        self._leases = await self.engine.call(lambda s: hasattr(s, "lease_notice"))
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
        return CallOutcome(comp)

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
        """A tool result is ready now: carry it over the link and resume the model."""
        r = clock.now()
        digest = prefix_digest(history_ids)
        prep = prepare(
            cid,
            observation,
            prefix_digest=digest,
            ready_time=r,
            workflow_arrival=workflow_arrival,
            prompt_tokens=expected_prompt_tokens or len(history_ids),
            codec=self.link.codec,
        )
        loop = asyncio.get_running_loop()
        self._waiting[cid] = _Waiting(digest, render, params, loop.create_future())
        if self._leases:
            notice = HistoryNotice(
                cid=cid,
                token_ids=tuple(history_ids),
                prefix_digest=digest,
                payload_digest=prep.item.payload_digest,
                ready_time=r,
                payload_bytes=prep.item.payload_bytes,
            )
            # The lease provider sees the result before the sender does (spec 3.2).
            await self.engine.call(lambda s: s.lease_notice(notice))
        try:
            ticket = await self._offer(prep)
            rid, c = await self._waiting[cid].registered
            comp = await self.engine.result(rid)
        finally:
            self._waiting.pop(cid, None)
        self.sender.complete(cid, len(comp.token_ids))
        return CallOutcome(
            comp,
            r=r,
            s=ticket.s,
            c=c,
            payload_bytes=prep.item.payload_bytes,
            frame_bytes=prep.item.frame_bytes,
        )

    async def _offer(self, prep: Any) -> Any:
        """Offer a ready result; results ready in the same loop turn go in one batch.

        A cohort's results become ready together; offering them as one batch lets
        the policy choose among all of them instead of committing the first four
        in arrival order.
        """
        fut = asyncio.get_running_loop().create_future()
        self._batch.append((prep, fut))
        if len(self._batch) == 1:
            asyncio.get_running_loop().call_soon(self._flush)
        return await fut

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        by_codec: dict[Any, list] = {}
        for prep, fut in batch:
            by_codec.setdefault(prep.codec, []).append((prep, fut))

        async def go(codec: Any, items: list) -> None:
            try:
                tickets = await self.sender.offer_many(
                    [(p.item, p.payload) for p, _ in items], codec=codec
                )
            except Exception as e:
                for _, fut in items:
                    if not fut.done():
                        fut.set_exception(e)
                return
            for (_, fut), t in zip(items, tickets, strict=True):
                if not fut.done():
                    fut.set_result(t)

        for codec, items in by_codec.items():
            self._tasks.add(t := asyncio.ensure_future(go(codec, items)))
            t.add_done_callback(self._tasks.discard)

    async def cancel(self, cid: ContinuationId) -> None:
        self.sender.cancel(cid)
        w = self._waiting.pop(cid, None)
        if w is not None and not w.registered.done():
            w.registered.cancel()
        if self._leases:
            await self.engine.call(lambda s: s.lease_cancel(cid))

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
        self.state = state
        self.state_bytes += len(orjson.dumps(state))
        self.timeline.add(state)
        self.sender.set_state(state)

    def _on_inventory(self, inv: SenderInventory) -> None:
        # Coalesce: the engine thread only ever needs the latest inventory.
        self._inventory = inv
        if self._leases and not self._inventory_posted:
            self._inventory_posted = True
            self.engine.post(self._push_inventory)

    def _push_inventory(self, sched: Any) -> None:
        self._inventory_posted = False
        inv = self._inventory
        if inv is not None:
            self.state_bytes += len(orjson.dumps(inv))  # what actually crossed
            sched.lease_inventory(inv)

    # ---- end of run --------------------------------------------------------
    async def finish(self) -> dict[str, Any]:
        """Release every lease, check integrity, and return the lease audit."""
        if not self._leases:
            return {"refs_added": 0, "refs_released": 0}

        def end(s: Any) -> dict[str, Any]:
            s.lease_release_all()
            s.check_integrity()
            return s.lease_audit()

        return await self.engine.call(end)

    def controller_cpu_s(self) -> float:
        return self.sender.decision_s + self.engine.command_cpu_s
