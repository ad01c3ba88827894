"""AugServe inside vLLM's scheduler (peers.md section 1), as hooks of the lease scheduler.

:class:`AugServe` is a :class:`~ladsd.engine.sched_hooks.SchedHooks` object:
the lease scheduler calls it at fixed points (lease API, ``schedule()``,
``add_request``, preemption, ``_free_request``), it overrides nothing.
:class:`AugServeMixin` only installs it at ``lease_setup`` and offers its
diagnostics (``scheduler_class(EnginePolicy.AUGSERVE, async)``). Contract:

* Engine thread only, like :class:`~ladsd.engine.sched_leases.LeaseMixin`; until
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
  (:func:`~ladsd.engine.lease_pins.pin_ttl`, so a wait near its mean still finds its
  history), capped at ``l``, ended by handoff or expiry. Discard leaves the
  history to vLLM's eviction. Swap is not offered (no KV tier on the CPU
  backend, and ladsd runs vLLM without ``--kv-offloading-size``).
* Order only (engine policy ``augserve-order``, ours; ``lease_setup(order_only=True)``):
  the theta order above and nothing else. ``max_num_scheduled_tokens`` is never
  touched (vLLM's fixed budget and step buffer; chunked prefill not required), no
  Preserve/Discard is taken (readiness stamps are kept: the wait predictor's
  samples), so every history is left to the delivery's leases and vLLM's eviction.
  The budget and Preserve counters stay 0; ``augserve_budget_ceiling`` is then
  vLLM's fixed budget.
* Waiting time ``w_i`` (ours): seconds the engine request has spent in vLLM's
  waiting queue, summed over its waiting spans (from registration, and from
  each preemption, until a step schedules it); a workflow's earlier requests
  do not carry over (their wait ended).
* Memory: per-request entries leave with ``_free_request`` (finished or
  aborted); a readiness stamp leaves at registration, cancellation, the end of
  the run, or ``10 * l`` after readiness (:meth:`AugServe.sizes`).
* Counters: ``lease_state().counters`` carries ``augserve_*`` (order changes,
  budget steps/sum/min/max/ceiling, preserves, refused preserves, discards and
  the predictor's sample counts).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.request import Request, RequestStatus

from ladsd import clock as _clock
from ladsd.config import LeaseConfig, PeerConfig
from ladsd.engine import augserve as aug
from ladsd.engine.kappa import kappa_tokens
from ladsd.engine.lease_pins import pin_ttl
from ladsd.engine.lease_resident import lookup_hit
from ladsd.engine.sched_hooks import SchedHooks
from ladsd.engine.sched_leases import AsyncLeaseScheduler, LeaseScheduler
from ladsd.modes import Retention
from ladsd.records import ContinuationId, HistoryNotice

__all__ = ["AsyncAugServeScheduler", "AugServe", "AugServeMixin", "AugServeScheduler"]

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


@dataclass(frozen=True)
class AugParams:
    """AugServe's fixed parameters on one engine (set at lease setup)."""

    cfg: aug.AugServeConfig
    kappa: float
    n_kappa: int  # tokens of the step kappa was measured on
    ceiling: int  # the engine's configured max_num_scheduled_tokens
    lifetime_s: float  # l: the longest a Preserve holds
    tick_s: float  # the lease tick (a pin's expiry is checked at least this often)
    horizon_s: float  # readiness stamps older than this are dropped
    order_only: bool = False  # augserve-order: no token budget, no Preserve/Discard


class AugServe(SchedHooks):
    """AugServe's order, budget and context policy as scheduler hooks (see the module contract).

    ``s`` is the scheduler it plugs into: it reads vLLM's queues and KV
    manager, reorders ``waiting`` and sets ``max_num_scheduled_tokens``.
    """

    def __init__(self, s: Any, p: AugParams, clock: Callable[[], float]) -> None:
        self.s = s
        self.p = p
        self.clock = clock
        self.predictor = aug.Predictor(p.cfg.prior_output_tokens, p.lifetime_s, p.kappa)
        self.counts: Counter[str] = Counter()
        self.budget_min = 0
        self.budget_max = 0
        self.since: dict[str, float] = {}  # request id -> entered waiting
        self.waited: dict[str, float] = {}  # request id -> earlier spans
        self.cids: dict[str, ContinuationId] = {}  # request id -> its cid
        self.ready: dict[ContinuationId, float] = {}  # cid -> readiness
        self.decode_since: float | None = None  # entry of the last step if it was decode-only

    # -- the lease API's hooks ---------------------------------------------------

    def noticed(self, n: HistoryNotice) -> None:
        """Preserve or Discard for the predicted remaining wait, once per continuation."""
        if n.cid in self.ready:  # decided at its first notice
            return
        self.ready[n.cid] = self.clock()
        if self.p.order_only:
            return
        call_s = self.predictor.wait_s(n.cid.turn)
        if self.context(len(n.token_ids), call_s) is aug.Context.PRESERVE:
            self.counts["preserves"] += 1
            ttl = pin_ttl(call_s, self.p.lifetime_s, self.p.tick_s)  # ttl-pin's margin (ours)
            if not self.s.lease_preserve(n.cid, ttl):
                self.counts["preserve_refusals"] += 1
        else:
            self.counts["discards"] += 1

    def bound(self, cid: ContinuationId, request_id: str) -> None:
        """A registered continuation: its wait is complete (a sample), its step is known."""
        self.cids[request_id] = cid
        t = self.ready.pop(cid, None)
        if t is not None:
            self.predictor.wait.add(cid.turn, self.clock() - t)
            self.counts["wait_samples"] += 1

    def cancelled(self, cid: ContinuationId) -> None:
        self.ready.pop(cid, None)

    def ticked(self) -> None:
        old = self.clock() - self.p.horizon_s
        for cid in [c for c, t in self.ready.items() if t < old]:
            del self.ready[cid]

    def released_all(self) -> None:
        self.ready.clear()

    def counters(self) -> dict[str, float]:
        out = {f"augserve_{k}": float(v) for k, v in self.counts.items()}
        for k in _COUNTERS:
            out.setdefault(f"augserve_{k}", 0.0)
        cfg = self.p.cfg
        out["augserve_budget_min"] = float(self.budget_min)
        out["augserve_budget_max"] = float(self.budget_max)
        out["augserve_budget_ceiling"] = float(
            min(math.floor(cfg.beta_high * cfg.t_max), self.p.ceiling)
        )
        out["augserve_output_samples"] = float(self.predictor.output.all.n)
        out["augserve_step_samples"] = float(self.predictor.step.n)
        return out

    # -- vLLM's hooks --------------------------------------------------------------

    def before_step(self) -> None:
        """Order the waiting queue and set this step's token budget."""
        now = self.clock()
        if self.decode_since is not None and now > self.decode_since:
            self.predictor.step.add(now - self.decode_since)  # a completed decode step
        self.decode_since = now  # kept by after_step only if this step is decode-only
        self._order(now)
        if not self.p.order_only:
            self._budget()

    def after_step(self, out: Any) -> None:
        after = self.clock()
        for rid in out.num_scheduled_tokens:
            t = self.since.pop(rid, None)
            if t is not None:
                self.waited[rid] = self.waited.get(rid, 0.0) + after - t
        counts = out.num_scheduled_tokens.values()
        if not (counts and all(n == 1 for n in counts)):
            self.decode_since = None

    def added(self, request: Request) -> None:
        self.since.setdefault(request.request_id, self.clock())  # w_i starts

    def preempted(self, request: Request) -> None:
        self.since[request.request_id] = self.clock()  # waiting again

    def freed(self, request: Request) -> None:
        rid = request.request_id
        cid = self.cids.pop(rid, None)
        self.since.pop(rid, None)
        self.waited.pop(rid, None)
        if request.status in _COMPLETED:  # completed calls only: never an abort
            self.predictor.output.add(_key(cid), request.num_output_tokens)

    # -- AugServe ------------------------------------------------------------------

    def context(self, context: int, call_s: float) -> aug.Context:
        """Preserve or Discard a history of ``context`` tokens for a wait of ``call_s``."""
        bs = self.s.block_size
        keep = aug.preserve_waste(call_s, context, bs)
        drop = aug.discard_waste(context, self._slots(), self.p.kappa, self.p.n_kappa, bs)
        return aug.choose(keep, drop)

    def priorities(self) -> list[tuple[str, float]]:
        """``(request id, theta)`` of vLLM's waiting queue, highest first."""
        return [(r.request_id, t) for r, t in self._ranked(self.clock())]

    def sizes(self) -> dict[str, int]:
        """Entries per table (0 when no request is in flight and no result is waiting)."""
        return {
            "since": len(self.since),
            "waited": len(self.waited),
            "cids": len(self.cids),
            "ready": len(self.ready),
        }

    def _order(self, now: float) -> None:
        """Reorder vLLM's waiting queue by theta; count a step whose order is not FCFS."""
        ranked = [r for r, _ in self._ranked(now)]
        if len(ranked) < 2:
            return
        if ranked != sorted(ranked, key=lambda r: r.arrival_time):
            self.counts["order_changes"] += 1
        waiting = self.s.waiting
        if ranked != list(waiting):
            waiting.clear()
            waiting.extend(ranked)

    def _ranked(self, now: float) -> list[tuple[Request, float]]:
        reqs = list(self.s.waiting)
        if not reqs:
            return []
        bs, pred, p = self.s.block_size, self.predictor, self.p
        slots = self._slots()
        step_s = pred.step_s()
        ranked = []
        for r in reqs:
            rid = r.request_id
            waited = self.waited.get(rid, 0.0) + now - self.since.setdefault(rid, now)
            cid = self.cids.get(rid)
            seg = aug.Segment(
                tokens=r.num_tokens,
                hit=self._hit(r),
                output=max(1.0, pred.output_tokens(_key(cid)) - r.num_output_tokens),
                call_s=pred.wait_s(None if cid is None else cid.turn + 1),
                other=slots - aug.mem(r.num_tokens, bs),
            )
            cost, _ = aug.segment_cost(
                seg, kappa=p.kappa, n_kappa=p.n_kappa, step_s=step_s, block_size=bs
            )
            ranked.append((r, aug.theta(waited, cost, p.cfg.aging)))
        ranked.sort(key=lambda x: (-x[1], x[0].arrival_time))
        return ranked

    def _budget(self) -> None:
        """Set this step's token budget (formula: :func:`~ladsd.engine.augserve.token_budget`)."""
        free = self.s.kv_cache_manager.block_pool.get_num_free_blocks()
        b = aug.token_budget(free, 0, self.s.block_size, self.p.cfg, self.p.ceiling)
        self.s.max_num_scheduled_tokens = b
        c = self.counts
        self.budget_min = b if not c["steps"] else min(self.budget_min, b)
        self.budget_max = max(self.budget_max, b)
        c["steps"] += 1
        c["budget_sum"] += b

    def _hit(self, r: Request) -> int:
        """Tokens of ``r`` vLLM will find in its prefix cache now (as its admission looks)."""
        kv = self.s.kv_cache_manager
        if not kv.prefix_cache_lookup_enabled(r):
            return 0
        return lookup_hit(kv, r.block_hashes, r.num_tokens - 1)[1]

    def _slots(self) -> int:
        """KV slots of every runnable request (``L_other`` plus the request's own)."""
        s = self.s
        reqs = [*s.running, *s.waiting, *s.kv_holding_waiting]
        return sum(aug.mem(r.num_tokens, s.block_size) for r in reqs)


def _key(cid: ContinuationId | None) -> Hashable:
    return None if cid is None else cid.turn


class AugServeMixin:
    """Installs :class:`AugServe` as the lease scheduler's hooks (see the module contract)."""

    _lease_hooks: SchedHooks
    # vLLM attributes this mixin relies on (provided by Scheduler).
    waiting: Any
    scheduler_config: Any
    max_num_scheduled_tokens: int
    max_model_len: int

    def lease_setup(
        self,
        cfg: LeaseConfig,
        kappa: float,
        clock: Callable[[], float] = _clock.now,
        *,
        retention: Retention = Retention.LADS,
        augserve: aug.AugServeConfig | None = None,
        order_only: bool = False,
    ) -> None:
        """Start leasing, then AugServe (checks the engine can run it).

        ``augserve``: the run profile's knobs (``profile.peers.augserve``, which also
        sized the step buffer); None: the default profile's (model-free harnesses).
        ``order_only``: AugServe's waiting-queue order alone (``augserve-order``).
        """
        if not isinstance(self.waiting, FCFSRequestQueue):
            raise ValueError("the augserve engine policy needs vLLM's fcfs scheduling policy")
        if not order_only and not self.scheduler_config.enable_chunked_prefill:
            raise ValueError("the augserve engine policy needs chunked prefill (dynamic budget)")
        super().lease_setup(cfg, kappa, clock, retention=retention)  # type: ignore[misc]
        params = AugParams(
            cfg=augserve or PeerConfig().augserve,
            kappa=kappa,
            n_kappa=kappa_tokens(self.scheduler_config.max_num_batched_tokens, self.max_model_len),
            ceiling=self.max_num_scheduled_tokens,
            lifetime_s=cfg.lease_lifetime_s,
            tick_s=cfg.tick_s,
            horizon_s=_READY_HORIZON * cfg.lease_lifetime_s,
            order_only=order_only,
        )
        self._lease_hooks = AugServe(self, params, clock)

    @property
    def augserve(self) -> AugServe:
        hooks = self._lease_hooks
        if not isinstance(hooks, AugServe):
            raise RuntimeError("augserve is not set up: call lease_setup() first")
        return hooks

    def augserve_context(self, context: int, call_s: float) -> aug.Context:
        """Preserve or Discard a history of ``context`` tokens for a wait of ``call_s``."""
        return self.augserve.context(context, call_s)

    def augserve_priorities(self) -> list[tuple[str, float]]:
        """``(request id, theta)`` of vLLM's waiting queue, highest first (diagnostics, tests)."""
        return self.augserve.priorities()

    def augserve_counters(self) -> dict[str, float]:
        return self.augserve.counters()

    def augserve_sizes(self) -> dict[str, int]:
        return self.augserve.sizes()


class AugServeScheduler(AugServeMixin, LeaseScheduler):
    """vLLM's synchronous scheduler with AugServe, prefix leases and first-allocation stamps."""


class AsyncAugServeScheduler(AugServeMixin, AsyncLeaseScheduler):
    """vLLM's async scheduler with AugServe, prefix leases and first-allocation stamps."""
