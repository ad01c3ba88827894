"""AugServe inside vLLM's scheduler (peers.md section 1), composed over the lease scheduler.

:class:`AugServeMixin` goes in front of :class:`~ladsd.engine.leases.LeaseScheduler`
(``scheduler_class(EnginePolicy.AUGSERVE, async)``). Contract:

* Engine thread only, like :class:`~ladsd.engine.leases.LeaseMixin`; until
  ``lease_setup`` the scheduler is a plain lease scheduler.
* ``schedule()``: vLLM's waiting queue (``Scheduler.waiting``; never
  ``kv_holding_waiting``, which vLLM drains first) is reordered by descending
  ``theta`` (ties: arrival order), the step's token budget is set from the free
  KV memory, then the lease scheduler and vLLM schedule as usual. vLLM's own
  semantics stay: blocked requests (grammar, remote KV, streaming) and skipped
  ones are skipped by vLLM's scan wherever they sit, preempted requests are
  ranked like every waiting request, and the queue keeps exactly its requests.
* Token budget: ``max_num_scheduled_tokens`` is set before each step to
  :func:`~ladsd.engine.augserve.token_budget`, clipped at the engine's
  configured maximum (vLLM's ``max_num_scheduled_tokens`` at setup, which it
  takes from ``max_num_batched_tokens``, the model runner's buffer size; vLLM's
  separate input budget ``max_num_batched_tokens`` also caps every step). To
  reach ``beta_high * T_max`` the engine must be built with
  ``max_num_batched_tokens >= beta_high * T_max``; below that the budget can
  only go down (the ceiling is published as ``augserve_budget_ceiling``).
  Chunked prefill is required (a budget below a prompt would stall it).
* ``G_preempt = 0`` (ours): a discarded history holds no reference, so its
  blocks are already free (evictable cache) and counted in ``G_free``; vLLM's
  preemption is by recompute and frees its blocks the same way.
* Preserve/Discard (ours): decided once per continuation when the harness
  announces its waiting history at readiness (``lease_notice``), for the
  predicted remaining wait ``tau_call_hat`` (readiness to registration).
  Preserve is ``lease_preserve(cid, pin_ttl(tau_call_hat, l, tick))``: a
  pin outside the LADS budget for the predicted wait plus ttl-pin's margin
  (:func:`~ladsd.engine.pins.pin_ttl`, so a wait near its mean still finds its
  history), capped at ``l``, ended by handoff or expiry. Discard leaves the
  history to vLLM's eviction. Swap is not offered (no KV tier on the CPU
  backend, and ladsd runs vLLM without ``--kv-offloading-size``).
* Waiting time ``w_i`` (ours): seconds the engine request has spent in vLLM's
  waiting queue, summed over its waiting spans (from registration, and from
  each preemption, until a step schedules it); a workflow's earlier requests
  do not carry over (their wait ended).
* Memory: per-request entries leave with ``_free_request`` (finished or
  aborted); a readiness stamp leaves at registration, cancellation, the end of
  the run, or ``10 * l`` after readiness (:meth:`AugServeMixin.augserve_sizes`).
* Counters: ``lease_state().counters`` carries ``augserve_*`` (order changes,
  budget steps/sum/min/max/ceiling, preserves, refused preserves, discards and
  the predictor's sample counts).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.request import Request, RequestStatus

from ladsd import clock as _clock
from ladsd.config import LeaseConfig
from ladsd.engine import augserve as aug
from ladsd.engine.leases import AsyncLeaseScheduler, LeaseScheduler
from ladsd.engine.pins import pin_ttl
from ladsd.engine.resident import lookup_hit
from ladsd.engine.thread import KAPPA_TOKENS
from ladsd.modes import Retention
from ladsd.records import ContinuationId, EngineState, HistoryNotice

__all__ = ["AsyncAugServeScheduler", "AugServeMixin", "AugServeScheduler"]

_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
# Always published (zero until they happen), with the augserve_ prefix.
_COUNTERS = (
    "order_changes",
    "steps",
    "budget_sum",
    "preserves",
    "preserve_refusals",
    "discards",
    "wait_samples",
)
_READY_HORIZON = 10.0  # readiness stamps older than this many l are dropped (ours)


@dataclass
class AugState:
    """What the mixin keeps between steps (engine thread only)."""

    cfg: aug.AugServeConfig
    kappa: float
    n_kappa: int  # tokens of the step kappa was measured on
    ceiling: int  # the engine's configured max_num_scheduled_tokens
    lifetime_s: float  # l: the longest a Preserve holds
    tick_s: float  # the lease tick (a pin's expiry is checked at least this often)
    horizon_s: float  # readiness stamps older than this are dropped
    clock: Callable[[], float]
    predictor: aug.Predictor
    counters: Counter[str] = field(default_factory=Counter)
    budget_min: int = 0
    budget_max: int = 0
    since: dict[str, float] = field(default_factory=dict)  # request id -> entered waiting
    waited: dict[str, float] = field(default_factory=dict)  # request id -> earlier spans
    cids: dict[str, ContinuationId] = field(default_factory=dict)  # request id -> its cid
    ready: dict[ContinuationId, float] = field(default_factory=dict)  # cid -> readiness
    decode_since: float | None = None  # entry of the last step if it was decode-only


class AugServeMixin:
    """AugServe's order, budget and context policy (see the module contract)."""

    _aug: AugState | None = None

    # vLLM attributes this mixin relies on (provided by Scheduler / LeaseMixin).
    waiting: Any
    kv_holding_waiting: Any
    running: list[Request]
    kv_cache_manager: Any
    scheduler_config: Any
    max_num_scheduled_tokens: int
    max_model_len: int
    block_size: int

    def lease_setup(
        self,
        cfg: LeaseConfig,
        kappa: float,
        clock: Callable[[], float] = _clock.now,
        *,
        retention: Retention = Retention.LADS,
        augserve: aug.AugServeConfig | None = None,
    ) -> None:
        """Start leasing, then AugServe (checks the engine can run it)."""
        if not isinstance(self.waiting, FCFSRequestQueue):
            raise ValueError("the augserve engine policy needs vLLM's fcfs scheduling policy")
        if not self.scheduler_config.enable_chunked_prefill:
            raise ValueError("the augserve engine policy needs chunked prefill (dynamic budget)")
        super().lease_setup(cfg, kappa, clock, retention=retention)  # type: ignore[misc]
        conf = augserve or aug.AugServeConfig()
        self._aug = AugState(
            cfg=conf,
            kappa=kappa,
            n_kappa=min(
                KAPPA_TOKENS, self.scheduler_config.max_num_batched_tokens, self.max_model_len - 1
            ),  # as EngineThread._kappa times it
            ceiling=self.max_num_scheduled_tokens,
            lifetime_s=cfg.lease_lifetime_s,
            tick_s=cfg.tick_s,
            horizon_s=_READY_HORIZON * cfg.lease_lifetime_s,
            clock=clock,
            predictor=aug.Predictor(conf.prior_output_tokens, cfg.lease_lifetime_s, kappa),
        )

    @property
    def augserve(self) -> AugState:
        if self._aug is None:
            raise RuntimeError("augserve is not set up: call lease_setup() first")
        return self._aug

    # -- the lease API of the engine thread, extended --------------------------

    def lease_notice(self, n: HistoryNotice) -> None:
        """Lease book first, then Preserve or Discard for the predicted remaining wait."""
        super().lease_notice(n)  # type: ignore[misc]
        st = self.augserve
        if n.cid in st.ready:  # decided at its first notice
            return
        st.ready[n.cid] = st.clock()
        call_s = st.predictor.wait_s(n.cid.turn)
        if self.augserve_context(len(n.token_ids), call_s) is aug.Context.PRESERVE:
            st.counters["preserves"] += 1
            ttl = pin_ttl(call_s, st.lifetime_s, st.tick_s)  # ttl-pin's margin (ours)
            if not self.lease_preserve(n.cid, ttl):  # type: ignore[attr-defined]
                st.counters["preserve_refusals"] += 1
        else:
            st.counters["discards"] += 1

    def lease_bind(self, cid: ContinuationId, request_id: str) -> None:
        """A registered continuation: its wait is complete (a sample), its step is known."""
        super().lease_bind(cid, request_id)  # type: ignore[misc]
        st = self.augserve
        st.cids[request_id] = cid
        t = st.ready.pop(cid, None)
        if t is not None:
            st.predictor.wait.add(cid.turn, st.clock() - t)
            st.counters["wait_samples"] += 1

    def lease_cancel(self, cid: ContinuationId) -> None:
        super().lease_cancel(cid)  # type: ignore[misc]
        self.augserve.ready.pop(cid, None)

    def lease_tick(self) -> None:
        super().lease_tick()  # type: ignore[misc]
        st = self.augserve
        old = st.clock() - st.horizon_s
        for cid in [c for c, t in st.ready.items() if t < old]:
            del st.ready[cid]

    def lease_release_all(self) -> None:
        super().lease_release_all()  # type: ignore[misc]
        self.augserve.ready.clear()

    def lease_state(self) -> EngineState:
        state = super().lease_state()  # type: ignore[misc]
        if self._aug is not None:
            state.counters.update(self.augserve_counters())
        return state

    # -- AugServe ----------------------------------------------------------------

    def augserve_context(self, context: int, call_s: float) -> aug.Context:
        """Preserve or Discard a history of ``context`` tokens for a wait of ``call_s``."""
        st = self.augserve
        keep = aug.preserve_waste(call_s, context, self.block_size)
        drop = aug.discard_waste(
            context, self._augserve_slots(), st.kappa, st.n_kappa, self.block_size
        )
        return aug.choose(keep, drop)

    def augserve_priorities(self) -> list[tuple[str, float]]:
        """``(request id, theta)`` of vLLM's waiting queue, highest first (diagnostics, tests)."""
        return [(r.request_id, t) for r, t in self._augserve_ranked(self.augserve.clock())]

    def augserve_counters(self) -> dict[str, float]:
        st = self.augserve
        out = {f"augserve_{k}": float(v) for k, v in st.counters.items()}
        for k in _COUNTERS:
            out.setdefault(f"augserve_{k}", 0.0)
        out["augserve_budget_min"] = float(st.budget_min)
        out["augserve_budget_max"] = float(st.budget_max)
        out["augserve_budget_ceiling"] = float(
            min(math.floor(st.cfg.beta_high * st.cfg.t_max), st.ceiling)
        )
        out["augserve_output_samples"] = float(st.predictor.output.all.n)
        out["augserve_step_samples"] = float(st.predictor.step.n)
        return out

    def augserve_sizes(self) -> dict[str, int]:
        """Entries per table (0 when no request is in flight and no result is waiting)."""
        st = self.augserve
        return {
            "since": len(st.since),
            "waited": len(st.waited),
            "cids": len(st.cids),
            "ready": len(st.ready),
        }

    # -- vLLM hooks ----------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        st = self._aug
        if st is None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        now = st.clock()
        if st.decode_since is not None and now > st.decode_since:
            st.predictor.step.add(now - st.decode_since)  # a completed decode step
        self._augserve_order(now)
        self._augserve_budget()
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        after = st.clock()
        for rid in out.num_scheduled_tokens:
            t = st.since.pop(rid, None)
            if t is not None:
                st.waited[rid] = st.waited.get(rid, 0.0) + after - t
        counts = out.num_scheduled_tokens.values()
        st.decode_since = now if counts and all(n == 1 for n in counts) else None
        return out

    def add_request(self, request: Request) -> None:
        super().add_request(request)  # type: ignore[misc]
        if self._aug is not None:
            self._aug.since.setdefault(request.request_id, self._aug.clock())  # w_i starts

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]
        if self._aug is not None:
            self._aug.since[request.request_id] = self._aug.clock()  # waiting again

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        st = self._aug
        if st is not None:
            rid = request.request_id
            cid = st.cids.pop(rid, None)
            st.since.pop(rid, None)
            st.waited.pop(rid, None)
            if request.status in _COMPLETED:  # completed calls only: never an abort
                st.predictor.output.add(self._augserve_key(cid), request.num_output_tokens)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    # -- internals -------------------------------------------------------------------

    def _augserve_order(self, now: float) -> None:
        """Reorder vLLM's waiting queue by theta; count a step whose order is not FCFS."""
        ranked = [r for r, _ in self._augserve_ranked(now)]
        if len(ranked) < 2:
            return
        if ranked != sorted(ranked, key=lambda r: r.arrival_time):
            self.augserve.counters["order_changes"] += 1
        if ranked != list(self.waiting):
            self.waiting.clear()
            self.waiting.extend(ranked)

    def _augserve_ranked(self, now: float) -> list[tuple[Request, float]]:
        st = self.augserve
        reqs = list(self.waiting)
        if not reqs:
            return []
        bs, pred = self.block_size, st.predictor
        slots = self._augserve_slots()
        step_s = pred.step_s()
        ranked = []
        for r in reqs:
            rid = r.request_id
            waited = st.waited.get(rid, 0.0) + now - st.since.setdefault(rid, now)
            cid = st.cids.get(rid)
            seg = aug.Segment(
                tokens=r.num_tokens,
                hit=self._augserve_hit(r),
                output=max(1.0, pred.output_tokens(self._augserve_key(cid)) - r.num_output_tokens),
                call_s=pred.wait_s(None if cid is None else cid.turn + 1),
                other=slots - aug.mem(r.num_tokens, bs),
            )
            cost, _ = aug.segment_cost(
                seg, kappa=st.kappa, n_kappa=st.n_kappa, step_s=step_s, block_size=bs
            )
            ranked.append((r, aug.theta(waited, cost, st.cfg.aging)))
        ranked.sort(key=lambda x: (-x[1], x[0].arrival_time))
        return ranked

    def _augserve_budget(self) -> None:
        """Set this step's token budget (formula: :func:`~ladsd.engine.augserve.token_budget`)."""
        st = self.augserve
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        b = aug.token_budget(free, 0, self.block_size, st.cfg, st.ceiling)
        self.max_num_scheduled_tokens = b
        c = st.counters
        st.budget_min = b if not c["steps"] else min(st.budget_min, b)
        st.budget_max = max(st.budget_max, b)
        c["steps"] += 1
        c["budget_sum"] += b

    def _augserve_hit(self, r: Request) -> int:
        """Tokens of ``r`` vLLM will find in its prefix cache now (as its admission looks)."""
        kv = self.kv_cache_manager
        if not kv.prefix_cache_lookup_enabled(r):
            return 0
        return lookup_hit(kv, r.block_hashes, r.num_tokens - 1)[1]

    def _augserve_slots(self) -> int:
        """KV slots of every runnable request (``L_other`` plus the request's own)."""
        reqs = [*self.running, *self.waiting, *self.kv_holding_waiting]
        return sum(aug.mem(r.num_tokens, self.block_size) for r in reqs)

    @staticmethod
    def _augserve_key(cid: ContinuationId | None) -> Hashable:
        return None if cid is None else cid.turn


class AugServeScheduler(AugServeMixin, LeaseScheduler):
    """vLLM's synchronous scheduler with AugServe, prefix leases and first-allocation stamps."""


class AsyncAugServeScheduler(AugServeMixin, AsyncLeaseScheduler):
    """vLLM's async scheduler with AugServe, prefix leases and first-allocation stamps."""
