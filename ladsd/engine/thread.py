"""EngineThread: vLLM's EngineCore in-process, stepped on one dedicated thread.

vLLM 0.32's ``AsyncLLM`` always spawns its engine core in a child process, so
ladsd builds ``LLMEngine`` with multiprocessing off and steps it here.

Contract:

* This thread is the only code that touches vLLM state. The asyncio side
  crosses the boundary only with the typed commands of
  :mod:`ladsd.engine.commands`, handled in one place (:meth:`_dispatch`);
  replies come back on futures, request outputs on per-request streams, engine
  state through ``on_state`` (all via ``call_soon_threadsafe``). ``State`` is
  a barrier: its state is published (ahead of the reply), so every lease event
  reaches ``on_state`` exactly once, in engine order.
* Step = drain commands -> step engine -> deliver outputs -> lease tick ->
  publish state.
* Upkeep (:class:`Upkeep`): a replay's engine (the default) ticks every
  ``tick_s`` and publishes after every command, step and tick, and measures
  kappa at every start. The daemon's is quiet when idle (no tick while no
  candidate, lease or pin is live and nothing changed since the last one; no
  state after a query; the thread sleeps until a command) and reads kappa
  from a cache (:mod:`ladsd.engine.kappa`).
* dtype: the config's, resolved once (:func:`ladsd.engine.cpu.resolve_dtype`:
  ``auto`` on a CPU without native bf16 is float32); :attr:`EngineThread.dtype`.
* Fail fast: a failed step, a failed lease tick or any other error of this
  thread declares the engine dead (as vLLM itself does on a failed step: a
  step that raised may have registered block hashes for KV it never computed,
  so the prefix cache can no longer be trusted). On death the thread fails
  every request in flight and every queued command with :class:`EngineDead`,
  releases every lease and keeps the final lease audit (:meth:`finish` still
  returns it), and stops. Every later call raises :class:`EngineDead` at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ladsd import clock
from ladsd.clock import Stamps
from ladsd.config import EngineConfig, LeaseConfig, has_cuda
from ladsd.engine import commands as cmd
from ladsd.engine import kappa as kappa_cache
from ladsd.engine import models
from ladsd.engine.cpu import cpu_info, resolve_dtype
from ladsd.engine.kappa import KappaSource
from ladsd.modes import EnginePolicy, Retention
from ladsd.records import ContinuationId, EngineState, HistoryNotice, SenderInventory

log = logging.getLogger("ladsd.engine")
KAPPA_TOKENS = 512  # kappa is the wall time of one prefill step of this many tokens
KAPPA_SAMPLES = 15  # timed steps after the warm-up; kappa is their median (about 0.5 s)
# A step that scheduled nothing (unfinished requests, none allocatable: e.g. hard pins
# hold the pool) is retried after this wait, not at once, and publishes no state:
# spinning published thousands of states a second and starved the event loop.
STALL_WAIT_S = 0.005
# Commands that only read: under quiet idle (Upkeep) they publish no state.
_QUERIES = (cmd.Snapshot, cmd.State, cmd.Sizes)
Prompt = str | Sequence[int] | Sequence[dict]
_MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


class EngineError(RuntimeError):
    """The engine rejected a request or failed while running it."""


class EngineDead(EngineError):
    """The engine thread stopped after an error; it refuses all work."""


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


@dataclass(frozen=True)
class PoolSnapshot:
    free_blocks: int
    total_blocks: int
    waiting: int
    running: int
    max_num_seqs: int
    block_size: int
    kappa: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class _Done:
    """The last item of a request's stream: its final output and its stamps."""

    out: Any  # vllm RequestOutput
    stamps: Stamps


@dataclass(frozen=True)
class Upkeep:
    """How a long-lived engine (the daemon's) runs; the defaults are a replay's, unchanged.

    * ``kappa``: where kappa comes from (:mod:`ladsd.engine.kappa`);
    * ``quiet_idle``: no tick while no candidate, lease or pin is live and nothing
      changed since the last tick; no state published after a query (state,
      sizes, snapshot, resident); an idle thread sleeps until the next command;
    * ``timeline_samples``: the runtime's lease timeline keeps its last samples
      only (None: every one, as a replay's run file needs);
    * ``progress``: told one line per start-up phase (on the engine thread).
    """

    kappa: KappaSource = KappaSource.MEASURE
    quiet_idle: bool = False
    timeline_samples: int | None = None
    progress: Callable[[str], None] | None = None


DAEMON_UPKEEP = Upkeep(KappaSource.CACHE, quiet_idle=True, timeline_samples=1024)


@dataclass
class Activity:
    """What the engine thread did (tests and bench figures count these, never time)."""

    loops: int = 0  # iterations of the engine loop
    ticks: int = 0  # lease ticks run
    published: int = 0  # engine states published
    kappa_steps: int = 0  # engine steps run to measure kappa (0: not measured)
    kappa_from: str = ""  # "measured", "cache" or "config" (the lease config's kappa_s)


@dataclass
class _Req:
    """Engine-thread book-keeping of one registered request."""

    internal_id: str
    a: float


_END = object()


def _final(item: object) -> bool:
    """The last item of a stream: the result, an error, or the end of an aborted request."""
    return item is _END or isinstance(item, _Done | BaseException)


class StreamQueue:
    """One request's undelivered outputs (loop thread only): at most two items.

    vLLM's outputs are cumulative, so a newer output replaces an older one the
    reader has not taken yet (``replaced`` counts them): a reader that stops
    reading holds the newest output and the final item, however long its
    request runs. The final item (:func:`_final`) is never replaced or lost;
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
        if _final(item):
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


def _in_process() -> None:
    """Keep EngineCore in this process (ladsd steps it); override a user's setting loudly."""
    v = os.environ.get(_MP_ENV)
    if v not in (None, "0"):
        log.warning(
            "%s=%s is not supported by ladsd (the engine runs in-process): using 0", _MP_ENV, v
        )
    os.environ[_MP_ENV] = "0"


class EngineThread:
    """Owns the embedded engine. Use ``async with EngineThread(cfg) as eng``."""

    def __init__(
        self,
        cfg: EngineConfig = EngineConfig(),
        lease: LeaseConfig | None = None,
        on_state: Callable[[EngineState], None] | None = None,
        measure_kappa: bool = True,
        *,
        retention: Retention = Retention.LADS,
        engine_policy: EnginePolicy = EnginePolicy.VLLM,
        upkeep: Upkeep = Upkeep(),
    ) -> None:
        self.cfg = cfg
        self.upkeep = upkeep
        self.activity = Activity()
        self.lease = lease or LeaseConfig()
        self.retention = Retention(retention)
        self.engine_policy = EnginePolicy(engine_policy)
        self.on_state = on_state
        self.kappa = self.lease.kappa_s or 0.0
        self._measure_kappa = measure_kappa and self.lease.kappa_s is None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders puts against death (no orphaned command)
        self._error: EngineDead | None = None
        self._streams: dict[str, StreamQueue] = {}  # loop thread only
        self._reqs: dict[str, _Req] = {}  # engine thread only
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine: Any = None
        self._sched: Any = None  # the LeaseScheduler (LeaseMixin) of the engine core
        self.final_audit: dict[str, float] | None = None
        self.tokenizer: Any = None
        self.startup_s = 0.0
        self.steps = 0
        self.command_cpu_s = 0.0  # engine-thread CPU in lease commands and ticks
        self.inventory_bytes = 0  # inventories that crossed (after coalescing)
        self._cpu = not has_cuda()
        # What _build asks vLLM for (ladsd.engine.cpu.resolve_dtype); once built, the
        # dtype vLLM chose (on CUDA "auto" becomes the model's).
        self.dtype = resolve_dtype(cfg.dtype, not self._cpu, cpu_info().flags)

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> EngineThread:
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name="ladsd-engine", daemon=True
        )
        t0 = time.perf_counter()
        self._thread.start()
        try:
            await ready
        except asyncio.CancelledError:
            # A start given up (a signal while loading): native code cannot be
            # interrupted, so the thread stops as soon as its engine is built.
            self._cmds.put((cmd.Stop(), None))
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    async def stop(self) -> None:
        if self._thread is None:
            return
        with self._lock:
            if self._error is None:
                self._cmds.put((cmd.Stop(), None))
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def __aenter__(self) -> EngineThread:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def alive(self) -> bool:
        return self._error is None and self._thread is not None and self._thread.is_alive()

    @property
    def error(self) -> EngineDead | None:
        """Why the engine died (None while it is alive or stopped cleanly)."""
        return self._error

    # ---- asyncio facade ----------------------------------------------------
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
        if getattr(params, "seed", None) is not None and self._cpu:
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
            yield item.out if isinstance(item, _Done) else item

    async def result(self, rid: str) -> Completion:
        """Wait for a submitted request to finish; return it with its stamps."""
        done: _Done | None = None
        async for item in self._items(rid):
            if isinstance(item, _Done):
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
            q.put(_END)
            if self._error is None:
                self._put(cmd.Abort(request_id))

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

    async def snapshot(self) -> PoolSnapshot:
        return await self._ask(cmd.Snapshot())

    async def state(self, check: bool = True) -> EngineState:
        """A fresh lease state (after the integrity check unless ``check`` is False).

        It reflects every command sent before it (one queue, handled in order).
        """
        return await self._ask(cmd.State(check))

    async def sizes(self) -> dict[str, int]:
        """Entries per table on both sides of the boundary (all 0 when nothing is in flight).

        ``stream_items``: outputs not taken yet, at most two per stream (:class:`StreamQueue`).
        """
        items = sum(len(q) for q in self._streams.values())
        engine = await self._ask(cmd.Sizes())
        return {"streams": len(self._streams), "stream_items": items, **engine}

    async def finish(self) -> dict[str, float]:
        """Release every lease, check integrity, return the audit (also after death)."""
        try:
            return await self._ask(cmd.Finish())
        except EngineDead:
            if self.final_audit is None:
                raise
            return self.final_audit

    def _put(self, command: cmd.Command, fut: asyncio.Future | None = None) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._thread is None:
                raise EngineError("engine not started")
            self._cmds.put((command, fut))

    async def _ask(self, command: cmd.Command) -> Any:
        assert self._loop is not None, "engine not started"
        fut: asyncio.Future = self._loop.create_future()
        self._put(command, fut)
        return await fut

    async def _items(self, rid: str) -> AsyncIterator[Any]:
        q = self._streams.get(rid)
        if q is None:
            raise EngineError(f"unknown request id {rid!r}")
        try:
            while True:
                item = await q.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, _Done):
                    return
        finally:
            if self._streams.pop(rid, None) is not None and self._error is None:
                self._put(cmd.Abort(rid))

    def _deliver(self, rid: str, item: object) -> None:  # loop thread
        q = self._streams.get(rid)
        if q is not None:
            q.put(item)

    # ---- engine thread -----------------------------------------------------
    def _main(self, ready: asyncio.Future) -> None:
        try:
            self._build()
        except BaseException as e:  # report start-up failure to the caller
            self._resolve(ready, EngineError(f"engine start failed: {type(e).__name__}: {e}"))
            return
        self._resolve(ready, True)
        try:
            self._serve()
        except BaseException as e:
            log.exception("engine thread failed")
            self._die(e)
        finally:
            if self._error is None:  # clean stop: fail what is still queued or running
                self._fail_reqs(EngineError("engine stopped"))
                self._fail_queued(EngineError("engine stopped"))
            try:
                self._engine.engine_core.shutdown()
            except Exception:  # already down
                pass

    def _build(self) -> None:
        _in_process()
        from vllm import EngineArgs
        from vllm.v1.engine.core_client import InprocClient
        from vllm.v1.engine.llm_engine import LLMEngine

        from ladsd.engine.schedulers import scheduler_class

        cfg = self.cfg
        prof = models.PROFILES.get(cfg.model)
        if prof is None:
            raise models.ModelError(f"unknown model profile {cfg.model!r}")
        path = models.model_path(cfg.model)
        cpu = self._cpu
        args = EngineArgs(
            model=str(path),
            tokenizer=str(path),
            load_format="dummy" if prof.dummy else "auto",
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            block_size=cfg.resolved_block_size(),
            enable_prefix_caching=cfg.enable_prefix_caching,
            enforce_eager=cpu if cfg.enforce_eager is None else cfg.enforce_eager,
            num_gpu_blocks_override=cfg.num_gpu_blocks_override,
            scheduler_cls=scheduler_class(self.engine_policy, cfg.async_scheduling),
            async_scheduling=cfg.async_scheduling,
            seed=cfg.seed,
            dtype=self.dtype,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes or (2**30 if cpu else None),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            disable_log_stats=True,
            # Compact JSON actions (xgrammar): whitespace off engine-wide.
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        )
        self._say(f"loading model {cfg.model} ({'dummy weights' if prof.dummy else path})...")
        self._say(self._dtype_line())
        self._engine = LLMEngine.from_engine_args(args)
        self.dtype = str(self._engine.model_config.dtype).removeprefix("torch.")
        client = self._engine.engine_core
        if not isinstance(client, InprocClient):  # a child process: ladsd cannot step it
            raise EngineError(f"vLLM started its engine core in another process; set {_MP_ENV}=0")
        self._sched = client.engine_core.scheduler
        from transformers import AutoTokenizer

        # A separate tokenizer for the asyncio side: fast tokenizers are not
        # safe to share across threads.
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        if self._measure_kappa:
            self.kappa = self._kappa_for(path)
        elif self.lease.kappa_s is not None:
            self.activity.kappa_from = "config"
        self._sched.lease_setup(self.lease, self.kappa, clock.now, retention=self.retention)

    def _say(self, line: str) -> None:
        if self.upkeep.progress is not None:
            self.upkeep.progress(line)

    def _dtype_line(self) -> str:
        if self.cfg.dtype != "auto" or not self._cpu:
            return f"dtype {self.dtype} (asked: {self.cfg.dtype})"
        why = "native bf16" if cpu_info().native_bf16 else "this CPU has no native bf16"
        return f"dtype {self.dtype} (auto: {why}; --dtype overrides)"

    def _kappa_for(self, path: Any) -> float:
        """kappa as the upkeep says: measured at every start (replays) or cached (the daemon)."""
        source = self.upkeep.kappa
        if source is KappaSource.MEASURE:
            return statistics.median(self._kappa())
        n = self._kappa_tokens()
        engine = {"model": self.cfg.model, "dtype": self._engine.model_config.dtype}
        engine |= {"step_tokens": n, "block_size": self.cfg.resolved_block_size()}
        engine |= {"enforce_eager": self._engine.model_config.enforce_eager}
        key = kappa_cache.cache_key(engine, path)
        if source is KappaSource.CACHE:
            cached = kappa_cache.load(key)
            if cached is not None:
                self.activity.kappa_from = "cache"
                self._say(f"kappa {cached * 1e3:.1f} ms (cached: {kappa_cache.entry_path(key)})")
                return cached
        samples = KAPPA_SAMPLES if source is KappaSource.FRESH else kappa_cache.SERVE_SAMPLES
        self._say(
            f"measuring kappa: {samples + 1} prefill steps of {n} tokens "
            "(cached for the next start)..."
        )
        times = self._kappa(samples)
        value = statistics.median(times)
        kappa_cache.store(key, value, times)
        return value

    def _kappa_tokens(self) -> int:
        # Always a 512-token step (the spec's kappa), also on an engine built
        # with a larger step budget (AugServe's ceiling), so dilation compares.
        return min(KAPPA_TOKENS, self.cfg.max_num_batched_tokens, self.cfg.max_model_len - 1)

    def _kappa(self, samples: int = KAPPA_SAMPLES) -> list[float]:
        """Wall times of ``samples`` 512-token prefill steps; kappa is their median.

        The first step of a fresh engine pays one-off warm-up costs, so a
        warm-up request runs first; then ``samples`` distinct prompts are timed
        (:data:`KAPPA_SAMPLES` for a replay). One sample let a momentary stall
        of a shared machine set the run's link dilation (1.58 where its
        neighbours measured 0.89-1.10); a median of fifteen follows only a stall
        longer than about a quarter second.
        """
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        n = self._kappa_tokens()
        times = []
        for salt in range(samples + 1):  # salt 0 is the warm-up
            ids = [(7919 * i + 104729 * (salt + 1)) % 30000 + 100 for i in range(n)]
            params = SamplingParams(max_tokens=1)
            rid = self._engine.add_request(f"ladsd-kappa-{salt}", tokens_input(ids), params)
            t0 = time.perf_counter()
            self._engine.step()
            times.append(time.perf_counter() - t0)
            self.activity.kappa_steps += 1
            while self._engine.has_unfinished_requests():
                self._engine.step()
            self._sched.pop_first_alloc(rid)
        self._sched.reset_prefix_cache()
        self.activity.kappa_from = "measured"
        return times[1:]

    def _serve(self) -> None:
        tick = self.lease.tick_s
        next_tick = clock.now() + tick
        stalled = False
        dirty = True  # (quiet idle) something changed since the last tick
        while True:
            self.activity.loops += 1
            busy = self._engine.has_unfinished_requests()
            wait = max(0.0, next_tick - clock.now())
            if busy:
                wait = min(wait, STALL_WAIT_S) if stalled else 0.0
            # Nothing to tick for (quiet idle): sleep until the next command.
            idle = not busy and self._at_rest(dirty)
            stop, changed = self._drain(None if idle else wait)
            if stop:
                return
            if idle:
                next_tick = clock.now() + tick  # the first tick after idle is a period away
            if self._engine.has_unfinished_requests():
                worked = self._step()
                stalled = not worked
                changed = changed or worked
            dirty = dirty or changed
            if clock.now() >= next_tick:
                if not self._at_rest(dirty):
                    self._dispatch(cmd.Tick())
                    self.activity.ticks += 1
                    changed, dirty = True, False
                next_tick = clock.now() + tick
            if changed:
                self._publish()

    def _at_rest(self, dirty: bool) -> bool:
        """Quiet idle: nothing changed since the last tick and no lease, candidate or pin
        is live, so a tick has nothing to do."""
        return self.upkeep.quiet_idle and not dirty and self._sched.lease_quiet()

    def _drain(self, wait: float | None) -> tuple[bool, bool]:
        """Run every queued command (None: wait for one); return (stop, anything changed).

        Under quiet idle a query (:data:`_QUERIES`) changes nothing; otherwise
        every command counts, as a replay always did.
        """
        try:
            if wait is None:
                first = self._cmds.get()
            else:
                first = self._cmds.get(timeout=wait) if wait > 0 else self._cmds.get_nowait()
        except queue.Empty:
            return False, False
        batch = [first]
        while True:
            try:
                batch.append(self._cmds.get_nowait())
            except queue.Empty:
                break
        changed = False
        for command, fut in _coalesce(batch):
            if isinstance(command, cmd.Stop):
                return True, True
            changed = changed or not (self.upkeep.quiet_idle and isinstance(command, _QUERIES))
            try:
                res = self._dispatch(command)
            except Exception as e:
                if fut is None:  # nobody to tell: fatal (see the contract)
                    raise
                self._resolve(fut, e)  # e.g. an audit mismatch: the caller's error
                continue
            if fut is not None:
                self._resolve(fut, res)
        return False, changed

    def _dispatch(self, c: cmd.Command) -> Any:
        """The one place that acts on a command (engine thread)."""
        s = self._sched
        t0 = time.thread_time()
        match c:
            case cmd.Submit():
                return self._add(c)
            case cmd.Abort(rid):
                return self._abort(rid)
            case cmd.Notice(notice):
                s.lease_notice(notice)
            case cmd.Require(notice):
                return s.lease_require(notice)
            case cmd.Inventory(inv):
                self.inventory_bytes += inv_bytes(inv)
                s.lease_inventory(inv)
            case cmd.Cancel(cid):
                s.lease_cancel(cid)
            case cmd.Tick():
                s.lease_tick()
            case cmd.Snapshot():
                return self._pool()
            case cmd.State(check):
                if check:
                    s.check_integrity()
                # A barrier: the state is published too, ahead of the reply, so the lease
                # events it took from the book reach every listener (a reply alone was
                # dropped when a newer publication overtook it, and its events with it).
                return self._publish(s.lease_state())
            case cmd.Sizes():
                book = {f"lease_book.{k}": v for k, v in s.lease_book.sizes().items()}
                return {"requests": len(self._reqs), "first_alloc": len(s.first_alloc), **book}
            case cmd.Finish():
                s.lease_release_all()
                s.check_integrity()
                return s.lease_audit()
            case _:
                raise TypeError(f"not an engine command: {c!r}")
        self.command_cpu_s += time.thread_time() - t0
        return None

    def _add(self, c: cmd.Submit) -> None:
        from vllm.inputs.engine import tokens_input

        try:
            internal = self._engine.add_request(c.rid, tokens_input(list(c.ids)), c.params)
        except Exception as e:
            self._emit(c.rid, EngineError(f"request {c.rid} rejected: {e}"))
            return
        self._reqs[c.rid] = _Req(internal, c.a)
        if c.cid is not None:
            self._sched.lease_bind(c.cid, internal)

    def _abort(self, rid: str) -> None:
        req = self._reqs.pop(rid, None)
        if req is None:  # finished, or rejected at registration
            return
        self._engine.abort_request([rid])
        self._sched.pop_first_alloc(req.internal_id)

    def _step(self) -> bool:
        """One engine step; whether it did anything (scheduled tokens or gave outputs)."""
        try:
            outs = self._engine.step()
        except Exception as e:
            raise EngineDead(f"engine step failed: {e!r}") from e
        if not outs and self._sched.last_scheduled_tokens == 0:
            return False
        self.steps += 1
        t = clock.now()
        for out in outs:
            req = self._reqs.get(out.request_id)
            if req is None:
                continue
            if out.finished:
                del self._reqs[out.request_id]
                n = self._sched.pop_first_alloc(req.internal_id)
                self._emit(out.request_id, _Done(out, Stamps(a=req.a, n=n, f=t)))
            else:
                self._emit(out.request_id, out)
        return True

    def _die(self, err: BaseException) -> None:
        """Declare the engine dead: fail everything, release leases, keep the audit."""
        dead = err if isinstance(err, EngineDead) else EngineDead(f"engine failed: {err!r}")
        try:  # before anyone hears of the death, so the audit is there when they ask
            self._sched.lease_release_all()
            self.final_audit = self._sched.lease_audit()
        except Exception:
            log.exception("lease release after engine failure")
        with self._lock:
            self._error = dead
        self._fail_reqs(dead)
        self._fail_queued(dead)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_streams, dead)

    def _fail_reqs(self, err: EngineError) -> None:
        for rid in list(self._reqs):
            self._emit(rid, err)
        self._reqs.clear()

    def _fail_queued(self, err: EngineError) -> None:
        while True:
            try:
                command, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if fut is not None:
                self._resolve(fut, err)
            elif isinstance(command, cmd.Submit):
                self._emit(command.rid, err)

    def _fail_streams(self, err: EngineError) -> None:  # loop thread
        for q in self._streams.values():
            q.put(err)

    def _publish(self, state: EngineState | None = None) -> EngineState | None:
        """Send ``state`` (default: a fresh one) to ``on_state``, in engine order."""
        if self.on_state is None:
            return state
        state = state if state is not None else self._sched.lease_state()
        self.activity.published += 1
        self._loop.call_soon_threadsafe(self.on_state, state)
        return state

    def _pool(self) -> PoolSnapshot:
        s = self._sched
        pool = s.kv_cache_manager.block_pool
        return PoolSnapshot(
            free_blocks=pool.get_num_free_blocks(),
            total_blocks=pool.num_gpu_blocks,
            waiting=len(s.waiting),
            running=len(s.running),
            max_num_seqs=s.max_num_running_reqs,
            block_size=self.cfg.resolved_block_size(),
            kappa=self.kappa,
        )

    def _emit(self, rid: str, item: object) -> None:
        self._loop.call_soon_threadsafe(self._deliver, rid, item)

    def _resolve(self, fut: asyncio.Future, value: object) -> None:
        def set_() -> None:
            if fut.done():
                return
            if isinstance(value, BaseException):
                fut.set_exception(value)
            else:
                fut.set_result(value)

        try:
            self._loop.call_soon_threadsafe(set_)
        except RuntimeError:  # the loop closed: a start given up while the engine loaded
            log.debug("event loop closed; dropped a reply")


def inv_bytes(inv: SenderInventory) -> int:
    """Bytes of an inventory as a control record (what crosses to the engine)."""
    import orjson

    return len(orjson.dumps(inv))


def _coalesce(batch: list[tuple[cmd.Command, Any]]) -> list[tuple[cmd.Command, Any]]:
    """Only the newest inventory of a drained batch crosses, at the first one's place."""
    invs = [i for i, (c, _) in enumerate(batch) if isinstance(c, cmd.Inventory)]
    if len(invs) < 2:
        return batch
    out = list(batch)
    out[invs[0]] = batch[invs[-1]]
    drop = set(invs[1:])
    return [x for i, x in enumerate(out) if i not in drop]


__all__ = [
    "Completion",
    "EngineDead",
    "EngineError",
    "EngineThread",
    "PoolSnapshot",
]
