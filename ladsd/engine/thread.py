"""EngineThread: vLLM's EngineCore in-process, stepped on one dedicated thread.

vLLM 0.32's ``AsyncLLM`` always spawns its engine core in a child process, so
ladsd builds ``LLMEngine`` with multiprocessing off (:mod:`ladsd.engine.build`)
and steps it here.

Contract:

* One boundary, both ways (the parts, one concern each):
  :mod:`ladsd.engine.commands` (typed commands into one
  :class:`~ladsd.engine.commands.Inbox`), :mod:`ladsd.engine.loop` (the
  engine thread, the only code that touches vLLM state; one dispatcher),
  :mod:`ladsd.engine.outbound` (typed records back through one sink) and
  :mod:`ladsd.engine.client` (the asyncio side, one record dispatcher;
  :class:`EngineThread` is that client, plus the thread's life cycle).
* Published states reach :meth:`~ladsd.engine.client.EngineClient.subscribe`'s
  listeners in engine order. ``State`` is a barrier: its state is published
  ahead of the reply (its seq), so every lease event reaches every listener
  exactly once, in engine order.
* Start-up (engine thread): build the engine, then kappa
  (:func:`ladsd.engine.kappa.obtain`, as the :class:`Upkeep` says; the lease
  config's ``kappa_s`` skips it), then the lease scheduler starts with it.
* dtype: the config's, resolved once (:func:`ladsd.engine.cpu.resolve_dtype`:
  ``auto`` on a CPU without native bf16 is float32); :attr:`EngineThread.dtype`.
* Fail fast (:mod:`ladsd.engine.loop`): on death every request in flight and
  every queued command fail with :class:`EngineDead`, every lease is released
  and the final audit kept (:meth:`finish` still returns it). Every later
  call raises :class:`EngineDead` at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

from ladsd import clock
from ladsd.config import AugServeConfig, EngineConfig, LeaseConfig, PeerConfig, has_cuda
from ladsd.engine import commands as cmd
from ladsd.engine import kappa as kappa_rule
from ladsd.engine.build import Built, build, kappa_key
from ladsd.engine.client import END as _END  # noqa: F401 (tests put it in a stream)
from ladsd.engine.client import Completion, EngineClient, Prompt, StreamQueue
from ladsd.engine.cpu import cpu_info, resolve_dtype
from ladsd.engine.kappa import KAPPA_SAMPLES, Kappa
from ladsd.engine.loop import EngineLoop, PoolSnapshot
from ladsd.engine.outbound import Counters, EngineDead, EngineError, Reply, Sink
from ladsd.engine.upkeep import DAEMON_UPKEEP, Activity, Upkeep
from ladsd.modes import EnginePolicy, Retention


@dataclass(frozen=True)
class Settings:
    """How the engine is built and run (frozen: both threads read it)."""

    cfg: EngineConfig
    lease: LeaseConfig
    retention: Retention
    engine_policy: EnginePolicy
    upkeep: Upkeep
    cpu: bool  # no CUDA: vLLM's CPU build
    dtype: str  # asked of vLLM (resolve_dtype)
    augserve: AugServeConfig  # the augserve engine policy's knobs (the profile's)


@dataclass(frozen=True)
class Ready:
    """The engine thread's start-up reply: what the asyncio side may hold."""

    tokenizer: Any  # its own (fast tokenizers are not safe to share across threads)
    dtype: str  # the one vLLM chose
    kappa: Kappa


class EngineThread(EngineClient):
    """Owns the embedded engine. Use ``async with EngineThread(cfg) as eng``."""

    def __init__(
        self,
        cfg: EngineConfig = EngineConfig(),
        lease: LeaseConfig | None = None,
        *,
        retention: Retention = Retention.LADS,
        engine_policy: EnginePolicy = EnginePolicy.VLLM,
        upkeep: Upkeep = Upkeep(),
        augserve: AugServeConfig | None = None,
    ) -> None:
        cpu = not has_cuda()
        dtype = resolve_dtype(cfg.dtype, not cpu, cpu_info().flags)
        lease = lease or LeaseConfig()
        self.settings = Settings(
            cfg,
            lease,
            Retention(retention),
            EnginePolicy(engine_policy),
            upkeep,
            cpu,
            dtype,
            augserve or PeerConfig().augserve,
        )
        super().__init__(cmd.Inbox(), refuse_seeds=cpu)
        self.startup_s = 0.0
        self._ready: Ready | None = None
        self._core: EngineLoop | None = None  # the engine thread's, once built
        self._thread: threading.Thread | None = None

    # ---- settings and start-up results ---------------------------------------------------
    @property
    def cfg(self) -> EngineConfig:
        return self.settings.cfg

    @property
    def lease(self) -> LeaseConfig:
        return self.settings.lease

    @property
    def dtype(self) -> str:
        """The dtype vLLM chose once built; before that, the one it will be asked for."""
        return self._ready.dtype if self._ready is not None else self.settings.dtype

    @property
    def kappa(self) -> float:
        if self._ready is not None:
            return self._ready.kappa.seconds
        return self.settings.lease.kappa_s or 0.0

    @property
    def tokenizer(self) -> Any:
        return self._ready.tokenizer if self._ready is not None else None

    @property
    def activity(self) -> Activity:
        """What the engine thread did (a fresh, empty one before it is built)."""
        return self._core.activity if self._core is not None else Activity()

    @property
    def final_audit(self) -> dict[str, float] | None:
        """The lease audit taken when the engine died (None otherwise)."""
        return self._core.final_audit if self._core is not None else None

    @property
    def _sched(self) -> Any:
        """The engine core's scheduler (engine-thread object: tests hook it, nothing calls it)."""
        return self._core.sched if self._core is not None else None

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> EngineThread:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()
        sink = Sink(loop, self._on_record)
        self._thread = threading.Thread(
            target=self._main, args=(ready, sink), name="ladsd-engine", daemon=True
        )
        t0 = time.perf_counter()
        self._inbox.open = True
        self._thread.start()
        try:
            self._ready = await ready
        except asyncio.CancelledError:
            # A start given up (a signal while loading): native code cannot be
            # interrupted, so the thread stops as soon as its engine is built.
            self._inbox.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._inbox.stop()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def __aenter__(self) -> EngineThread:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def alive(self) -> bool:
        return self._inbox.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def error(self) -> EngineDead | None:
        """Why the engine died (None while it is alive or stopped cleanly)."""
        return self._inbox.error

    async def finish(self) -> dict[str, float]:
        """Release every lease, check integrity, return the audit (also after death)."""
        try:
            return await self._ask(cmd.Finish())
        except EngineDead:
            if self.final_audit is None:
                raise
            return self.final_audit

    # ---- engine thread -----------------------------------------------------
    def _main(self, ready: asyncio.Future, sink: Sink) -> None:
        try:
            built, kappa = self._build()
        except BaseException as e:  # report start-up failure to the caller
            err = EngineError(f"engine start failed: {type(e).__name__}: {e}")
            sink.put(Reply(ready, err, Counters()))
            return
        s = self.settings
        core = EngineLoop(
            built,
            kappa,
            self._inbox,
            sink,
            s.upkeep,
            tick_s=s.lease.tick_s,
            block_size=s.cfg.resolved_block_size(),
        )
        self._core = core
        sink.put(Reply(ready, Ready(built.tokenizer, built.dtype, kappa), Counters()))
        core.run()

    def _build(self) -> tuple[Built, Kappa]:
        """The engine, its kappa, and the lease scheduler started with it (engine thread)."""
        s = self.settings
        built = build(s.cfg, s.dtype, s.engine_policy, s.cpu, self._say)
        kappa = self._kappa(built)
        ep = s.engine_policy
        aug = {"augserve": s.augserve, "order_only": not ep.dynamic_budget} if ep.augserve else {}
        built.sched.lease_setup(s.lease, kappa.seconds, clock.now, retention=s.retention, **aug)
        return built, kappa

    def _kappa(self, built: Built) -> Kappa:
        s = self.settings
        n = kappa_rule.kappa_tokens(s.cfg.max_num_batched_tokens, s.cfg.max_model_len)
        if s.lease.kappa_s is not None:
            return Kappa(s.lease.kappa_s, n, "config")
        key = kappa_key(s.cfg, built, n)
        return kappa_rule.obtain(
            s.upkeep.kappa, built.engine, built.sched, key, built.model_dir, self._say
        )

    def _say(self, line: str) -> None:
        if self.settings.upkeep.progress is not None:
            self.settings.upkeep.progress(line)


__all__ = [
    "DAEMON_UPKEEP",
    "KAPPA_SAMPLES",
    "Activity",
    "Completion",
    "EngineDead",
    "EngineError",
    "EngineThread",
    "PoolSnapshot",
    "Prompt",
    "StreamQueue",
    "Upkeep",
]
