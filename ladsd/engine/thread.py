"""EngineThread: vLLM's EngineCore in-process, stepped on one dedicated thread.

vLLM 0.32's ``AsyncLLM`` always spawns its engine core in a child process, so
ladsd builds ``LLMEngine`` with multiprocessing off and steps it here. This
thread is the only code that touches vLLM state: the asyncio side sends
commands through a thread-safe queue (drained between steps) and gets outputs
back with ``call_soon_threadsafe``. Step = drain commands -> step engine ->
dispatch outputs -> lease tick -> publish state.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ladsd import clock
from ladsd.config import EngineConfig, LeaseConfig, has_cuda
from ladsd.engine import models
from ladsd.records import ContinuationId, EngineState

# Must be set before vLLM builds its engine: keeps EngineCore in this process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

log = logging.getLogger("ladsd.engine")
T = TypeVar("T")
Prompt = str | Sequence[int] | Sequence[dict]


class EngineError(RuntimeError):
    """The engine rejected a request or failed while running it."""


@dataclass(frozen=True)
class Completion:
    """A finished generation with the spec's engine-side timestamps."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    a: float  # registration with the engine
    n: float | None  # first step with positive new-token work
    f: float  # completion


@dataclass(frozen=True)
class Snapshot:
    free_blocks: int
    total_blocks: int
    waiting: int
    running: int
    max_num_seqs: int
    block_size: int
    kappa: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Live:
    """Book-keeping of one in-flight request (engine thread writes, loop reads)."""

    out: asyncio.Queue
    a: float
    internal_id: str | None = None
    n: float | None = None


_END = object()


class EngineThread:
    """Owns the embedded engine. Use ``async with EngineThread(cfg) as eng``."""

    def __init__(
        self,
        cfg: EngineConfig = EngineConfig(),
        lease: LeaseConfig | None = None,
        on_state: Callable[[EngineState], None] | None = None,
        measure_kappa: bool = True,
    ) -> None:
        self.cfg = cfg
        self.lease = lease or LeaseConfig()
        self.on_state = on_state
        self.kappa = self.lease.kappa_s or 0.0
        self._measure_kappa = measure_kappa and self.lease.kappa_s is None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._engine: Any = None
        self.tokenizer: Any = None
        self.startup_s = 0.0
        self.steps = 0
        self.step_errors = 0
        self.command_cpu_s = 0.0  # engine-thread CPU in lease commands and ticks
        self._cpu = not has_cuda()

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> EngineThread:
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name="ladsd-engine", daemon=True
        )
        t0 = time.perf_counter()
        self._thread.start()
        await ready
        self.startup_s = time.perf_counter() - t0
        return self

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._stop = True
        self._cmds.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def __aenter__(self) -> EngineThread:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- asyncio facade ----------------------------------------------------
    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(scheduler)`` on the engine thread between steps; return its result."""
        assert self._loop is not None, "engine not started"
        fut: asyncio.Future = self._loop.create_future()
        self._cmds.put((fn, fut))
        return await fut

    def post(self, fn: Callable[[Any], object]) -> None:
        """Fire-and-forget ``fn(scheduler)`` on the engine thread (errors are logged)."""
        self._cmds.put((fn, None))

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
        if rid in self._live:
            raise EngineError(f"request id {rid!r} is already in flight")
        if getattr(params, "seed", None) is not None and self._cpu:
            # vLLM 0.32's CPU runner fails the whole step when a seeded request's
            # prompt spans steps (CPU generators have no offset): refuse it here.
            raise EngineError("per-request seeds are not supported by vLLM 0.32 on CPU")
        ids = self.tokens(prompt)
        self._live[rid] = _Live(out=asyncio.Queue(), a=clock.now())
        self._cmds.put((_AddRequest(rid, ids, params, cid), None))
        return rid

    async def stream(self, rid: str) -> AsyncIterator[Any]:
        """Cumulative vLLM ``RequestOutput`` s of a submitted request.

        Raises :class:`EngineError` if the engine rejects the request or fails
        while running it; the engine thread itself keeps running. Leaving the
        stream early aborts the request.
        """
        live = self._live.get(rid)
        if live is None:
            raise EngineError(f"unknown request id {rid!r}")
        try:
            while True:
                item = await live.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if self._live.pop(rid, None) is not None and self.alive:
                self._cmds.put((_Abort(rid), None))

    async def result(self, rid: str) -> Completion:
        """Wait for a submitted request to finish; return it with its timestamps."""
        last = None
        async for out in self.stream(rid):
            last = out
        if last is None or not last.finished:
            raise EngineError(f"request {rid} ended without a result (aborted)")
        a, n, f = last._ladsd_stamps
        comp = last.outputs[0]
        return Completion(
            request_id=rid,
            prompt_token_ids=tuple(last.prompt_token_ids or ()),
            token_ids=tuple(comp.token_ids),
            text=comp.text,
            finish_reason=comp.finish_reason,
            num_cached_tokens=int(last.num_cached_tokens or 0),
            a=a,
            n=n,
            f=f,
        )

    async def generate(self, prompt: Prompt, params: Any, **kw: Any) -> AsyncIterator[Any]:
        """Submit and stream (see :meth:`submit` and :meth:`stream`)."""
        rid = self.submit(prompt, params, **kw)
        async for out in self.stream(rid):
            yield out

    async def complete(self, prompt: Prompt, params: Any, **kw: Any) -> Completion:
        """Submit and wait for the result (see :meth:`submit` and :meth:`result`)."""
        return await self.result(self.submit(prompt, params, **kw))

    async def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self._cmds.put((_Abort(request_id), None))
            live.out.put_nowait(_END)

    async def snapshot(self) -> Snapshot:
        return await self.call(self._snapshot)

    # ---- engine thread -----------------------------------------------------
    def _main(self, ready: asyncio.Future) -> None:
        try:
            self._build()
        except BaseException as e:  # report start-up failure to the caller
            self._resolve(ready, EngineError(f"engine start failed: {e!r}"))
            return
        self._resolve(ready, True)
        try:
            self._serve()
        finally:
            self._fail_all(EngineError("engine stopped"))
            try:
                self._engine.engine_core.shutdown()
            except Exception:  # already down
                pass

    def _build(self) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        cfg = self.cfg
        prof = models.PROFILES.get(cfg.model)
        if prof is None:
            raise models.ModelError(f"unknown model profile {cfg.model!r}")
        path = models.model_path(cfg.model)
        cpu = self._cpu
        sched_cls = cfg.scheduler_cls
        if cfg.async_scheduling and sched_cls.endswith(".LeaseScheduler"):
            sched_cls = sched_cls[: -len("LeaseScheduler")] + "AsyncLeaseScheduler"
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
            scheduler_cls=sched_cls,
            async_scheduling=cfg.async_scheduling,
            seed=cfg.seed,
            dtype=cfg.dtype,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes or (2**30 if cpu else None),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            disable_log_stats=True,
            # Compact JSON actions (xgrammar): whitespace off engine-wide.
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        )
        self._engine = LLMEngine.from_engine_args(args)
        from transformers import AutoTokenizer

        # A separate tokenizer for the asyncio side: fast tokenizers are not
        # safe to share across threads.
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        if self._measure_kappa:
            self.kappa = self._kappa()
        setup = getattr(self._sched, "lease_setup", None)
        if setup is not None:
            setup(self.lease, self.kappa, clock.now)

    @property
    def _sched(self) -> Any:
        return self._engine.engine_core.engine_core.scheduler

    def _kappa(self) -> float:
        """Wall time of one 512-token prefill step, measured once and frozen.

        The first step of a fresh engine pays one-off warm-up costs, so a
        warm-up request runs first and the second, distinct prompt is timed.
        """
        from vllm import SamplingParams

        n = min(self.cfg.max_num_batched_tokens, self.cfg.max_model_len - 1)
        dt = 0.0
        for salt in (1, 2):
            ids = [(7919 * i + 104729 * salt) % 30000 + 100 for i in range(n)]
            params = SamplingParams(max_tokens=1)
            self._engine.add_request(f"ladsd-kappa-{salt}", {"prompt_token_ids": ids}, params)
            t0 = time.perf_counter()
            self._engine.step()
            dt = time.perf_counter() - t0
            while self._engine.has_unfinished_requests():
                self._engine.step()
        self._sched.reset_prefix_cache()
        return dt

    def _serve(self) -> None:
        tick = self.lease.tick_s
        next_tick = clock.now() + tick
        while not self._stop:
            busy = self._engine.has_unfinished_requests()
            wait = 0.0 if busy else max(0.0, next_tick - clock.now())
            changed = self._drain(wait)
            if self._stop:
                break
            if self._engine.has_unfinished_requests():
                self._step()
                changed = True
            if clock.now() >= next_tick:
                fn = getattr(self._sched, "lease_tick", None)
                if fn is not None:
                    t0 = time.thread_time()
                    fn()
                    self.command_cpu_s += time.thread_time() - t0
                next_tick = clock.now() + tick
                changed = True
            if changed:
                self._publish()

    def _drain(self, wait: float) -> bool:
        try:
            item = self._cmds.get(timeout=wait) if wait > 0 else self._cmds.get_nowait()
        except queue.Empty:
            return False
        while True:
            if item is None:
                return True
            fn, fut = item
            t0 = time.thread_time()
            try:
                res = fn(self) if isinstance(fn, _Cmd) else fn(self._sched)
                if fut is not None:
                    self._resolve(fut, res)
            except Exception as e:
                if fut is not None:
                    self._resolve(fut, e)
                else:
                    log.exception("engine command failed")
            if not isinstance(fn, _Cmd):
                self.command_cpu_s += time.thread_time() - t0
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _step(self) -> None:
        try:
            outs = self._engine.step()
        except Exception as e:
            # A failed step fails the requests in flight, not the engine thread.
            self.step_errors += 1
            log.exception("engine step failed")
            self._fail_all(EngineError(f"engine step failed: {e!r}"), abort=True)
            return
        self.steps += 1
        t = clock.now()
        for out in outs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if out.finished:
                n = self._first_alloc(live)
                out._ladsd_stamps = (live.a, n, t)
                self._emit(live, out)
                self._emit(live, _END)
            else:
                self._emit(live, out)

    def _first_alloc(self, live: _Live) -> float | None:
        pop = getattr(self._sched, "pop_first_alloc", None)
        if pop is None or live.internal_id is None:
            return None
        return pop(live.internal_id)

    def _fail_all(self, err: Exception, abort: bool = False) -> None:
        for live in list(self._live.values()):
            if abort and live.internal_id is not None:
                try:
                    self._engine.abort_request([live.internal_id], internal=True)
                except Exception:
                    log.exception("abort after failed step")
            self._emit(live, err)

    def _publish(self) -> None:
        if self.on_state is None:
            return
        fn = getattr(self._sched, "lease_state", None)
        if fn is None:
            return
        try:
            state = fn()
        except Exception:
            log.exception("lease_state failed")
            return
        self._loop.call_soon_threadsafe(self.on_state, state)

    def _snapshot(self, sched: Any) -> Snapshot:
        pool = sched.kv_cache_manager.block_pool
        return Snapshot(
            free_blocks=pool.get_num_free_blocks(),
            total_blocks=pool.num_gpu_blocks,
            waiting=len(sched.waiting),
            running=len(sched.running),
            max_num_seqs=sched.max_num_running_reqs,
            block_size=self.cfg.resolved_block_size(),
            kappa=self.kappa,
        )

    def _emit(self, live: _Live, item: object) -> None:
        self._loop.call_soon_threadsafe(live.out.put_nowait, item)

    def _resolve(self, fut: asyncio.Future, value: object) -> None:
        def set_() -> None:
            if fut.done():
                return
            if isinstance(value, BaseException):
                fut.set_exception(value)
            else:
                fut.set_result(value)

        self._loop.call_soon_threadsafe(set_)


class _Cmd:
    """A command that needs the EngineThread itself (not just the scheduler)."""

    def __call__(self, eng: EngineThread) -> object:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass
class _AddRequest(_Cmd):
    rid: str
    ids: list[int]
    params: Any
    cid: ContinuationId | None

    def __call__(self, eng: EngineThread) -> object:
        live = eng._live.get(self.rid)
        if live is None:  # cancelled before it reached the engine
            return None
        try:
            internal = eng._engine.add_request(
                self.rid, {"prompt_token_ids": self.ids}, self.params
            )
        except Exception as e:
            eng._emit(live, EngineError(f"request {self.rid} rejected: {e}"))
            return None
        live.internal_id = internal
        bind = getattr(eng._sched, "lease_bind", None)
        if self.cid is not None and bind is not None:
            bind(self.cid, internal)
        return None


@dataclass
class _Abort(_Cmd):
    rid: str

    def __call__(self, eng: EngineThread) -> object:
        eng._engine.abort_request([self.rid])
        return None
