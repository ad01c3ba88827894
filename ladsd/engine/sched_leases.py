"""Prefix leases inside vLLM's scheduler (spec section 3).

:class:`LeaseMixin` plugs the lease book into vLLM's ``Scheduler`` and
``AsyncScheduler`` (``scheduler_cls``). Contract:

* Engine thread only. ``EngineThread`` owns vLLM's EngineCore and is the only
  caller of every ``lease_*`` method and of ``schedule()``; nothing locks.
* Until :meth:`LeaseMixin.lease_setup` the scheduler is a plain vLLM scheduler
  (no lease pool, no hashing, no hooks beyond a ``None`` check).
* ``schedule()``: expiry and revocation at entry (before vLLM allocates), then
  vLLM's schedule, then handoff of bound continuations with positive scheduled
  tokens whose block table natively covers their lease. The CPU of the lease
  work and the hooks around vLLM's own schedule is summed in
  ``lease_schedule_cpu_s`` (part of ``ctrl CPU s``; vLLM's part is not).
* ``reset_prefix_cache()`` drops every lease first when nothing else holds a
  block (a held lease would make vLLM's reset fail); while requests hold
  blocks vLLM refuses the reset anyway and the leases stay.
* Engine policies plug in as one hook object (:mod:`ladsd.engine.sched_hooks`,
  installed at setup), called at fixed points of the lease API and of
  ``schedule()`` / ``add_request`` / ``_preempt_request`` / ``_free_request``;
  vLLM's own order has hooks that do nothing.
* Lock/unlock rules are in :mod:`ladsd.engine.lease_book` and
  :mod:`ladsd.engine.lease_pool`: references only through ``BlockPool.touch``
  and ``BlockPool.free_blocks``, one release per lease, ``ref_cnt`` never
  written, audit fails loudly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from ladsd import clock as _clock
from ladsd.config import LeaseConfig
from ladsd.engine.lease_book import LeaseBook
from ladsd.engine.lease_pool import (
    LeaseBlockPool,
    LeaseIntegrityError,
    check_pool,
    native_refs,
)
from ladsd.engine.lease_resident import resident_prefix
from ladsd.engine.sched_hooks import NO_HOOKS, SchedHooks
from ladsd.engine.sched_stamps import StampMixin
from ladsd.modes import Retention
from ladsd.records import ContinuationId, EngineState, HistoryNotice, SenderInventory

__all__ = [
    "AsyncLeaseScheduler",
    "LeaseBlockPool",
    "LeaseIntegrityError",
    "LeaseMixin",
    "LeaseScheduler",
    "resident_prefix",
]


class LeaseMixin:
    """Lease API of a vLLM scheduler; every method runs on the engine thread."""

    _lease_book: LeaseBook | None = None
    _lease_seq = 0
    _lease_hooks: SchedHooks = NO_HOOKS  # the engine policy's (set up after the book)
    # Engine-thread CPU of the book and the hooks inside schedule() (expiry, refill,
    # handoff, the session order, an engine policy's order): the controller's too.
    lease_schedule_cpu_s = 0.0

    # vLLM attributes this mixin relies on (provided by Scheduler).
    kv_cache_manager: Any
    cache_config: Any
    hash_block_size: int
    max_num_running_reqs: int
    deferred_frees: Any
    waiting: Any
    preemptions: int  # StampMixin
    stalled_steps: int  # StampMixin

    def lease_setup(
        self,
        cfg: LeaseConfig,
        kappa: float,
        clock: Callable[[], float] = _clock.now,
        *,
        retention: Retention = Retention.LADS,
    ) -> None:
        """Start leasing (once, after EngineCore init; ``kappa`` is measured and frozen).

        ``retention`` (:class:`~ladsd.modes.Retention`): LADS and NONE differ
        only by ``cfg.enabled``; TTL_PIN pins every notice at readiness
        (:mod:`ladsd.engine.lease_pins`); SESSION orders the free queue by HEAR's
        ``r`` (:mod:`ladsd.engine.lease_sessions`).
        """
        if self._lease_book is not None:
            raise RuntimeError("lease_setup() was already called")
        self._lease_book = LeaseBook(
            self.kv_cache_manager,
            cfg,
            kappa,
            clock,
            load=self._lease_load,
            hash_block_size=self.hash_block_size,
            hash_algo=self.cache_config.prefix_caching_hash_algo,
            native_extra=self._lease_native_extra,
            waiting=lambda: self.waiting,  # vLLM's admission queue: its pending allocation
            retention=Retention(retention),
        )

    @property
    def lease_book(self) -> LeaseBook:
        if self._lease_book is None:
            raise RuntimeError("leases are not set up: call lease_setup() first")
        return self._lease_book

    # -- the API of the engine thread --------------------------------------

    def lease_notice(self, n: HistoryNotice) -> None:
        """Result ready: compute ``P_i``, evaluate the budget, FIFO grant before the sender."""
        self.lease_book.notice(n)
        self._lease_hooks.noticed(n)

    def lease_preserve(self, cid: ContinuationId, ttl_s: float) -> bool:
        """AugServe's Preserve: pin ``cid``'s ``P_i`` outside the budget for ``min(ttl_s, l)``."""
        return self.lease_book.preserve(cid, ttl_s)

    def lease_require(self, n: HistoryNotice) -> str | None:
        """Retention as a requirement: grant now within ``B`` and ``H``, or say why not."""
        return self.lease_book.require(n)

    def lease_inventory(self, inv: SenderInventory) -> None:
        """The sender's causal inventory changed: phases and marks; an evaluation and
        grants at a first listing, a refill after a release (LeaseBook.inventory)."""
        self.lease_book.inventory(inv)

    def lease_mark(self) -> tuple[float, ...]:
        """What a published state shows, but its time: equal marks, equal states. The
        book's (:meth:`~ladsd.engine.lease_book.LeaseBook.mark`), then what
        :meth:`lease_state` adds: the load ``w, a, m`` and the scheduler's counters."""
        hooks = tuple(self._lease_hooks.counters().values())
        stamps = (self.preemptions, self.stalled_steps)
        return self.lease_book.mark() + self._lease_load() + stamps + hooks

    def lease_bind(self, cid: ContinuationId, request_id: str) -> None:
        """``cid`` was registered as engine request ``request_id`` (handoff target)."""
        self.lease_book.bind(cid, request_id)
        self._lease_hooks.bound(cid, request_id)

    def lease_cancel(self, cid: ContinuationId) -> None:
        """The workflow was cancelled: drop lease and candidate (idempotent)."""
        self.lease_book.cancel(cid)
        self._lease_hooks.cancelled(cid)

    def lease_tick(self) -> None:
        """100 ms tick: expiry, revocation, budget evaluation, replenishment."""
        self.lease_book.tick()
        self._lease_hooks.ticked()

    def lease_quiet(self) -> bool:
        """No candidate, lease or pin is live: a tick would find nothing to do."""
        return self.lease_book.quiet()

    def lease_state(self) -> EngineState:
        """A fresh frozen snapshot with a new sequence number."""
        self._lease_seq += 1
        state = self.lease_book.state(self._lease_seq)
        state.counters["preemptions"] = self.preemptions
        state.counters["stalled_steps"] = self.stalled_steps
        state.counters.update(self._lease_hooks.counters())
        return state

    def lease_audit(self) -> dict[str, float]:
        """References added vs released; raises :class:`LeaseIntegrityError` on mismatch."""
        return self.lease_book.audit()

    def lease_release_all(self) -> None:
        """End of run: release every lease and pin."""
        self.lease_book.release_all()
        self._lease_hooks.released_all()

    def check_integrity(self) -> None:
        """Every block's ``ref_cnt`` == native holders + lease and pin references, or raise."""
        if self._lease_book is not None:
            self._lease_book.check()
            return
        kv = self.kv_cache_manager
        pool = kv.block_pool
        check_pool(pool, native_refs(kv.coordinator, pool, self._lease_native_extra()))

    def lease_resident(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """``|P_i|`` of ``token_ids`` right now (engine thread; diagnostics and tests)."""
        return len(
            resident_prefix(
                self.kv_cache_manager,
                token_ids,
                hash_block_size=self.hash_block_size,
                hash_algo=self.cache_config.prefix_caching_hash_algo,
                cache_salt=cache_salt,
            )
        )

    # -- vLLM hooks --------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        book = self._lease_book
        if book is None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        hooks = self._lease_hooks
        t0 = time.thread_time()
        hooks.before_step()
        book.before_schedule()
        t1 = time.thread_time()
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        t2 = time.thread_time()
        book.after_schedule(out.num_scheduled_tokens)
        hooks.after_step(out)
        self.lease_schedule_cpu_s += t1 - t0 + time.thread_time() - t2
        return out

    def add_request(self, request: Request) -> None:
        super().add_request(request)  # type: ignore[misc]
        self._lease_hooks.added(request)

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]
        self._lease_hooks.preempted(request)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        self._lease_hooks.freed(request)  # before vLLM: the request is still whole
        if self._lease_book is not None:
            self._lease_book.freed(request.request_id)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Drop every lease and pin first when the reset can succeed (one held would fail it)."""
        book = self._lease_book
        if book is not None and (reset_running_requests or self._lease_only_holders()):
            book.drop_all("reset_drops")
        return super().reset_prefix_cache(  # type: ignore[misc]
            reset_running_requests=reset_running_requests, reset_connector=reset_connector
        )

    def _lease_only_holders(self) -> bool:
        """No request holds a block: vLLM's reset fails only because of leases and pins."""
        pool = self.kv_cache_manager.block_pool
        return all(b.ref_cnt == pool.held_refs(b.block_id) for b in pool.blocks if not b.is_null)

    def _lease_load(self) -> tuple[int, int, int]:
        running, waiting = self.get_request_counts()  # type: ignore[attr-defined]
        return waiting, running, self.max_num_running_reqs

    def _lease_native_extra(self) -> Iterable[Iterable[KVCacheBlock]]:
        return [blocks for _, blocks in getattr(self, "deferred_frees", ())]


class LeaseScheduler(LeaseMixin, StampMixin, Scheduler):
    """vLLM's synchronous scheduler with prefix leases and first-allocation stamps."""


class AsyncLeaseScheduler(LeaseMixin, StampMixin, AsyncScheduler):
    """vLLM's async scheduler with prefix leases and first-allocation stamps."""
