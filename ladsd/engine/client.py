"""The asyncio side of the engine boundary: commands out, records in, one dispatcher.

Contract:

* Loop thread only. Commands go out through the :class:`~ladsd.engine.commands.Inbox`
  (never blocking: a reply comes back as a :class:`~ladsd.engine.outbound.Reply`
  record); every record from the engine thread is handled in one place,
  :meth:`EngineClient._on_record`.
* :meth:`EngineClient.subscribe`: listeners of published states, called in
  subscription order with every state, in engine order. Nothing overwrites them.
* Counters (:attr:`command_cpu_s`, :attr:`inventory_bytes`) are the ones the
  newest record carried, never read off the engine thread.
* Streams: one :class:`StreamQueue` per request in flight; leaving a stream
  early aborts its request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ladsd import clock
from ladsd.clock import Stamps
from ladsd.engine import commands as cmd
from ladsd.engine.outbound import (
    Counters,
    Dead,
    Done,
    EngineDead,
    EngineError,
    Failed,
    Output,
    Published,
    Record,
    Reply,
)
from ladsd.records import ContinuationId, EngineState, HistoryNotice, SenderInventory

Prompt = str | Sequence[int] | Sequence[dict]
END = object()  # the last item of an aborted request's stream


@dataclass(frozen=True)
class Completion:
    """A finished generation with the engine-side stamps a, n, f."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    stamps: Stamps


def final(item: object) -> bool:
    """The last item of a stream: the result, an error, or the end of an aborted request."""
    return item is END or isinstance(item, Done | BaseException)


class StreamQueue:
    """One request's undelivered outputs (loop thread only): at most two items.

    vLLM's outputs are cumulative, so a newer output replaces an older one the
    reader has not taken yet (``replaced`` counts them): a reader that stops
    reading holds the newest output and the final item, however long its
    request runs. The final item (:func:`final`) is never replaced or lost;
    nothing put after it is kept.
    """

    def __init__(self) -> None:
        self._newest: object | None = None
        self._last: object | None = None
        self._ready = asyncio.Event()
        self.replaced = 0

    def __len__(self) -> int:
        return (self._newest is not None) + (self._last is not None)

    def put(self, item: object) -> None:
        if self._last is not None:
            return  # the stream has ended
        if final(item):
            self._last = item
        else:
            self.replaced += self._newest is not None
            self._newest = item
        self._ready.set()

    async def get(self) -> object:
        """The newest output not taken yet, else the final item (waits for one)."""
        while self._newest is None and self._last is None:
            self._ready.clear()
            await self._ready.wait()
        if self._newest is not None:
            item, self._newest = self._newest, None
            return item
        return self._last


class EngineClient:
    """Talks to the engine thread (see the module contract).

    Its owner (:class:`~ladsd.engine.thread.EngineThread`) puts the engine thread's
    records through a :class:`~ladsd.engine.outbound.Sink` of :meth:`_on_record`
    and provides ``tokenizer`` once the engine is built.
    """

    tokenizer: Any

    def __init__(self, inbox: cmd.Inbox, *, refuse_seeds: bool) -> None:
        self._inbox = inbox
        self._refuse_seeds = refuse_seeds  # vLLM 0.32 on CPU (see submit)
        self._streams: dict[str, StreamQueue] = {}
        self._subscribers: list[Callable[[EngineState], None]] = []
        self._ids = itertools.count()
        self.published: EngineState | None = None  # the newest published state
        self.counters = Counters()

    def subscribe(self, fn: Callable[[EngineState], None]) -> None:
        """Call ``fn`` with every state published from now on (loop thread, engine order)."""
        self._subscribers.append(fn)

    @property
    def command_cpu_s(self) -> float:
        """Engine-thread CPU in lease commands, queries and ticks (as of the newest record)."""
        return self.counters.command_cpu_s

    @property
    def publish_cpu_s(self) -> float:
        """Engine-thread CPU building the states published after steps (newest record's)."""
        return self.counters.publish_cpu_s

    @property
    def schedule_cpu_s(self) -> float:
        """Engine-thread CPU of the lease book and hooks inside vLLM's ``schedule()``."""
        return self.counters.schedule_cpu_s

    @property
    def inventory_bytes(self) -> int:
        """Bytes of the inventories that crossed (as of the newest record)."""
        return self.counters.inventory_bytes

    def _on_record(self, r: Record) -> None:
        """The one place that acts on a record from the engine thread (loop thread)."""
        match r:
            case Published(state, counters):
                self.published, self.counters = state, counters
                for fn in self._subscribers:
                    fn(state)
            case Output(rid, out):
                self._deliver(rid, out)
            case Done(rid):
                self._deliver(rid, r)
            case Failed(rid, error):
                self._deliver(rid, error)
            case Reply(fut, value, counters):
                self.counters = counters
                if fut.done():
                    return
                if isinstance(value, BaseException):
                    fut.set_exception(value)
                else:
                    fut.set_result(value)
            case Dead(error):
                for q in self._streams.values():
                    q.put(error)
            case _:
                raise TypeError(f"not an engine record: {r!r}")

    def _deliver(self, rid: str, item: object) -> None:
        q = self._streams.get(rid)
        if q is not None:
            q.put(item)

    # ---- requests ------------------------------------------------------------------
    def tokens(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: ids as given, text encoded, chat messages templated."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        items = list(prompt)
        if items and isinstance(items[0], dict):
            return list(
                self.tokenizer.apply_chat_template(
                    items, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return [int(t) for t in items]

    def submit(
        self,
        prompt: Prompt,
        params: Any,
        *,
        request_id: str | None = None,
        cid: ContinuationId | None = None,
    ) -> str:
        """Register a request with the engine now (stamps ``a``); return its id.

        Synchronous on purpose: the receiver registers continuations in receipt
        order, so nothing may be awaited between receipt and registration.
        Consume the outputs with :meth:`stream` or :meth:`result`.
        """
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise EngineError(f"request id {rid!r} is already in flight")
        if getattr(params, "seed", None) is not None and self._refuse_seeds:
            # vLLM 0.32's CPU runner fails the whole step when a seeded request's
            # prompt spans steps (CPU generators have no offset): refuse it here.
            raise EngineError("per-request seeds are not supported by vLLM 0.32 on CPU")
        ids = tuple(self.tokens(prompt))
        self._streams[rid] = StreamQueue()
        try:
            self._put(cmd.Submit(rid, ids, params, clock.now(), cid))
        except EngineDead:
            self._streams.pop(rid, None)
            raise
        return rid

    async def stream(self, rid: str) -> AsyncIterator[Any]:
        """Cumulative vLLM ``RequestOutput`` s of a submitted request.

        Raises :class:`EngineError` if the engine rejects the request or fails
        while running it. Leaving the stream early aborts the request.
        """
        async for item in self._items(rid):
            yield item.out if isinstance(item, Done) else item

    async def result(self, rid: str) -> Completion:
        """Wait for a submitted request to finish; return it with its stamps."""
        done: Done | None = None
        async for item in self._items(rid):
            if isinstance(item, Done):
                done = item
        if done is None:
            raise EngineError(f"request {rid} ended without a result (aborted)")
        last, comp = done.out, done.out.outputs[0]
        return Completion(
            request_id=rid,
            prompt_token_ids=tuple(last.prompt_token_ids or ()),
            token_ids=tuple(comp.token_ids),
            text=comp.text,
            finish_reason=comp.finish_reason,
            num_cached_tokens=int(last.num_cached_tokens or 0),
            stamps=done.stamps,
        )

    async def complete(self, prompt: Prompt, params: Any, **kw: Any) -> Completion:
        """Submit and wait for the result (see :meth:`submit` and :meth:`result`)."""
        return await self.result(self.submit(prompt, params, **kw))

    async def abort(self, request_id: str) -> None:
        q = self._streams.pop(request_id, None)
        if q is not None:
            q.put(END)
            self._inbox.offer(cmd.Abort(request_id))

    async def _items(self, rid: str) -> AsyncIterator[Any]:
        q = self._streams.get(rid)
        if q is None:
            raise EngineError(f"unknown request id {rid!r}")
        try:
            while True:
                item = await q.get()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Done):
                    return
        finally:
            if self._streams.pop(rid, None) is not None:
                self._inbox.offer(cmd.Abort(rid))

    # ---- leases and queries ----------------------------------------------------------
    def notice(self, n: HistoryNotice) -> None:
        """A result is ready: queued ahead of everything asked of the engine after it."""
        self._put(cmd.Notice(n))

    async def require(self, n: HistoryNotice) -> str | None:
        """Lease ``n``'s history now if the budget can hold it: None, else why not."""
        return await self._ask(cmd.Require(n))

    def inventory(self, inv: SenderInventory) -> None:
        self._put(cmd.Inventory(inv))

    def cancel(self, cid: ContinuationId) -> None:
        self._put(cmd.Cancel(cid))

    async def snapshot(self) -> Any:
        """The pool and queues now (a :class:`ladsd.engine.thread.PoolSnapshot`)."""
        return await self._ask(cmd.Snapshot())

    async def state(self, check: bool = True) -> EngineState:
        """A barrier: the engine publishes a fresh state now (after the integrity check
        unless ``check`` is False) and replies with its seq.

        The state reflects every command sent before it (one queue, handled in
        order) and has reached every subscriber when this returns. Returns the
        newest published state: that one, or one published after it.
        """
        seq = await self._ask(cmd.State(check))
        st = self.published
        assert st is not None and st.seq >= seq, "the barrier's state is published first"
        return st

    async def sizes(self) -> dict[str, int]:
        """Entries per table on both sides of the boundary (all 0 when nothing is in flight).

        ``stream_items``: outputs not taken yet, at most two per stream (:class:`StreamQueue`).
        """
        items = sum(len(q) for q in self._streams.values())
        engine = await self._ask(cmd.Sizes())
        return {"streams": len(self._streams), "stream_items": items, **engine}

    def _put(self, command: cmd.Command, fut: asyncio.Future | None = None) -> None:
        self._inbox.put(command, fut)

    async def _ask(self, command: cmd.Command) -> Any:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._put(command, fut)
        return await fut
