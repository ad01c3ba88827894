"""The lease book: prefix leases of spec section 3, composed from small managers.

Contract (mini-sglang's scheduler composing its managers; read this first):

* Parts, one resource each, each with its own contract, ``check_integrity()``
  and ``sizes()``: :class:`~ladsd.engine.lease_candidates.Candidates` (announced
  results, the sender's inventory, versions, the FIFO view);
  :class:`~ladsd.engine.lease_holds.Holds` twice, ``leases`` (LADS) and
  ``pins`` (outside the budget: ttl-pin, AugServe's Preserve);
  :class:`~ladsd.engine.lease_grants.Grants` (budget, generations, FIFO
  grants, revocation, refusals, denials);
  :class:`~ladsd.engine.lease_publish.Publication` (counters, events,
  records); :class:`~ladsd.engine.lease_pins.PinRules` (what is pinned);
  :class:`~ladsd.engine.lease_sessions.Sessions` (HEAR's free-queue order);
  :class:`~ladsd.engine.lease_ends.Ends` (no state: maintenance and what each
  end does to the parts: expire, revoke, supersede, cancel, forget, settle).
  The book owns the rules that join the rest: notices, pins versus leases,
  binds, handoff, the published state. Only the book calls the parts; a part
  calls back only through what the book gave it (``ended``, ``view``).
* Thread: engine thread only, between scheduler steps; nothing locks (vLLM's
  scheduler owns the book: :class:`~ladsd.engine.sched_leases.LeaseMixin`).
* Lock/unlock: only through the holds (one reference per real block of the
  whole ``P_i``, given back exactly once). Every end goes through
  ``Holds.release``, which unbinds, counts and calls ``Ends.ended``.
* Every public operation starts with :meth:`maintain` (``Ends.maintain``:
  strip, expire, revoke while fewer than ``H`` are free, drop the unlisted).
  An idle engine does not call ``schedule()``: the tick and the lease
  operations keep expiry on time.
* Handoff: after ``schedule()``, for a bound request with positive scheduled
  tokens whose block table holds every protected block's hash at its position.
* Memory: a continuation is live while it is a candidate, leased or pinned;
  once none holds, the book keeps nothing about it (``Ends.settle``), so every
  structure is bounded by the live continuations and the sender's inventory.
  A notice for a settled identity is a new candidate with a new ``g_i``.
* Retention other than LADS (:mod:`ladsd.modes`): TTL_PIN pins every notice
  at readiness, :meth:`preserve` pins for AugServe, SESSION reorders the free
  queue (no references); LADS_SESSION (ours) is LADS plus SESSION's order.
  A pinned candidate gets no LADS grant; pinning a leased one ends its lease
  (``leases_to_pins``) once the pin holds the blocks.
* Audit: ``ref_cnt == native holders + lease and pin references`` per block
  and the parts agree (:meth:`check`); added == released + held references,
  per kind and in total (:meth:`audit`).
"""

from __future__ import annotations

import math
from collections import Counter

from vllm.v1.core.kv_cache_manager import KVCacheManager

from ladsd.audit import check_refs
from ladsd.clock import Clock
from ladsd.config import LeaseConfig
from ladsd.engine import budget as bud
from ladsd.engine.lease_candidates import Candidates, View, check_notice
from ladsd.engine.lease_ends import Ends
from ladsd.engine.lease_grants import Grants, Load, Waiting
from ladsd.engine.lease_holds import LEASES, PINS, Holds
from ladsd.engine.lease_pins import PinRules
from ladsd.engine.lease_pool import LeaseBlockPool, LeaseIntegrityError
from ladsd.engine.lease_publish import Publication, build_records
from ladsd.engine.lease_sessions import P_PRIOR, Sessions
from ladsd.engine.lease_table import Lease, LeaseTable, Native
from ladsd.modes import Retention
from ladsd.records import (
    ContinuationId,
    EngineState,
    HistoryNotice,
    LeaseKind,
    LeaseRecord,
    LeaseStatus,
    Phase,
    SenderInventory,
)


class LeaseBook:
    """Leases, pins, budget and counters of one engine (see the module contract)."""

    def __init__(
        self,
        kv: KVCacheManager,
        cfg: LeaseConfig,
        kappa: float,
        clock: Clock,
        *,
        load: Load,
        hash_block_size: int,
        hash_algo: str = "sha256",
        native_extra: Native = lambda: (),
        waiting: Waiting = lambda: (),
        retention: Retention = Retention.LADS,
    ) -> None:
        if kappa < 0 or not math.isfinite(kappa):
            raise ValueError(f"kappa must be a finite non-negative number, got {kappa}")
        if cfg.headroom_blocks < 0 or cfg.lease_lifetime_s <= 0:
            raise ValueError(f"bad lease config: {cfg}")
        self.cfg = cfg
        self.kappa = kappa
        self.clock = clock
        self.retention = Retention(retention)
        c, end = Counter[str](), self._ended
        self.leases = Holds(
            kv, clock(), native_extra, kind=LeaseKind.LADS, names=LEASES, counters=c, ended=end
        )
        pool = self.leases.table.pool
        self.cands = Candidates(kv, pool, cfg.lease_lifetime_s, hash_block_size, hash_algo)
        self.pins = Holds(  # outside the budget (ttl-pin, preserve)
            kv, clock(), native_extra, kind=LeaseKind.PIN, names=PINS, counters=c, ended=end
        )
        self.pinning = PinRules(self.pins, self.leases, self.cands, cfg.tick_s)
        self.sessions = Sessions(pool, self.leases.table.block_sizes)  # HEAR's eviction order
        self.pub = Publication(
            c,
            self.leases,
            self.pins,
            self.cands,
            self.sessions,
            enabled=cfg.enabled,
            kappa=kappa,
            block_size=hash_block_size,
        )
        self.grants = Grants(
            cfg, self.cands, self.leases, self.pub, view=self._view, load=load, waiting=waiting
        )
        self.ends = Ends(
            self.cands, self.leases, self.pins, self.sessions, self.grants, self.pub, clock,
            self._engine_delay,
        )
        self._orders = self.retention.orders_free_queue  # read at every schedule()
        if self._orders:
            pool.stamp_frees(clock)  # idle: when a session's blocks became free

    # -- the parts' state, as callers and tests read it ------------------------

    @property
    def pool(self) -> LeaseBlockPool:
        return self.leases.table.pool

    @property
    def table(self) -> LeaseTable:
        """The LADS leases' table."""
        return self.leases.table

    @property
    def bound(self) -> dict[str, ContinuationId]:
        """Request id -> its leased continuation."""
        return self.leases.bound

    @property
    def counters(self) -> Counter[str]:
        return self.pub.counters

    @property
    def budget(self) -> bud.Budget:
        return self.grants.budget

    @budget.setter
    def budget(self, value: bud.Budget) -> None:
        self.grants.budget = value

    @property
    def waiting(self) -> Waiting:
        return self.grants.waiting

    @waiting.setter
    def waiting(self, fn: Waiting) -> None:
        self.grants.waiting = fn

    # -- public operations (engine thread) ---------------------------------

    def notice(self, n: HistoryNotice) -> None:
        """A result is ready: find ``P_i``, evaluate the budget, try FIFO grants."""
        check_notice(n)
        now = self.clock()
        self.maintain(now)
        if not self.ends.supersede(n.cid):
            self.counters["stale_notices"] += 1
            return
        if n.cid in self.cands.pending or n.cid in self.leases:
            self.counters["repeat_notices"] += 1  # a repeat leaves the lease unchanged
            return
        if self.cands.phases.get(n.cid) in (Phase.RECEIVED, Phase.CANCELLED):
            self.counters["late_notices"] += 1  # nothing left to protect ahead of receipt
            return
        p = self.cands.announce(n)
        if self.retention is Retention.TTL_PIN:
            self.pinning.at_readiness(p, now, self._engine_delay(), self.grants.generation)
        elif self.retention.orders_free_queue and self.cands.resident(p):
            # HEAR: the session waits with its resident P_i in the eviction order
            # (LADS_SESSION too: the order acts only on blocks no lease holds).
            prob = P_PRIOR if n.continuation_p is None else n.continuation_p
            self.sessions.enter(p.cid, prob, p.prefix, now)
            self.counters["sessions"] += 1
        view = self._view(now)
        self.grants.evaluate(view)
        self.grants.replenish(now, view)

    def preserve(self, cid: ContinuationId, ttl_s: float) -> bool:
        """AugServe's Preserve: pin ``cid``'s ``P_i`` outside the budget for ``min(ttl_s, l)``.

        True if pinned (``PinRules.preserve``). Already pinned: True, the pin
        unchanged (``preserve_repeats``). While pinned it gets no LADS grant.
        """
        if not ttl_s >= 0:
            raise ValueError(f"{cid.key()}: preserve ttl must be non-negative, got {ttl_s}")
        now = self.clock()
        self.maintain(now)
        if cid in self.pins:
            self.counters["preserve_repeats"] += 1
            return True
        if not self.pinning.preserve(cid, ttl_s, now, self.grants.generation):
            return False
        self.grants.refill(now)
        return True

    def require(self, n: HistoryNotice) -> str | None:
        """Retention as a requirement (ladsd serve): lease ``n``'s history now, or say why not.

        Honoured or refused at once, never left pending: the lease is granted
        only if it fits the budget's safe ceiling now (``U + Delta_i <=
        C_safe``) and leaves ``H`` free (the same headroom rule as every grant);
        like every lease it ends at ``g_i + l_i`` at the latest and may be revoked
        to keep ``H`` free. Returns None when held, else the reason.
        """
        if not self.cfg.enabled:
            return "leases are off under this policy"
        self.notice(n)  # announce (and grant, if FIFO replenishment already can)
        if n.cid in self.leases or n.cid in self.pins:
            return None  # a pin holds it too, outside the budget and never revoked
        p = self.cands.pending.get(n.cid)
        if p is None:
            return "not a lease candidate (a stale, repeated or late notice)"
        return self.grants.require(p, self.clock())

    def inventory(self, inv: SenderInventory) -> None:
        """The sender's causal inventory changed: track phases; evaluate and replenish at a
        result's first real offer (spec 3.1), else only after a release (spec 3.2).

        Most inventories are a chunk written (``Q_B`` moved): the spec replenishes on
        the 100 ms tick and after releases, not on those (ours until stop 48: every
        inventory replenished, ~40 % of the controller's lease-command CPU).
        """
        if inv.rate <= 0 or inv.q_b < 0 or inv.overhead < 0:
            raise ValueError(f"bad sender inventory: rate {inv.rate}, Q_B {inv.q_b}")
        now = self.clock()
        self.maintain(now)
        seen_before = self.cands.listed()
        fresh = self.cands.observe(inv)
        for it in inv.items:
            self.ends.supersede(it.cid)
            if it.phase is Phase.CANCELLED:
                self.ends.cancel(it.cid, "cancellations")
            elif it.phase is Phase.RECEIVED:
                self.ends.receive(it.cid, now)
            else:
                fresh |= self.cands.mark(it)
        for cid in seen_before - self.cands.phases.keys():  # received (a lease stays)
            self.ends.receive(cid, now)
        if fresh:  # first real offer of a result to the sender
            view = self._view(now)
            self.grants.evaluate(view)
            self.grants.replenish(now, view)
        else:
            self.grants.refill(now)  # a cancellation or an expiry released blocks

    def bind(self, cid: ContinuationId, req_id: str) -> None:
        """``cid`` was registered with the engine as ``req_id``: the handoff target."""
        self.maintain(self.clock())
        self.sessions.bind(cid, req_id)  # first: a bound session outlives its candidate
        self.ends.forget(cid)
        self.leases.bind(cid, req_id)  # any request of it whose table covers it takes over
        self.pins.bind(cid, req_id)
        self.grants.refill(self.clock())

    def freed(self, req_id: str) -> None:
        """vLLM frees ``req_id`` (finished or aborted); one still bound to a session was
        never allocated (an allocation unbinds it): :meth:`Sessions.aborted`."""
        self.sessions.aborted(req_id)

    def cancel(self, cid: ContinuationId) -> None:
        """Workflow cancelled: drop the lease and the candidate (idempotent)."""
        now = self.clock()
        self.maintain(now)
        self.ends.cancel(cid, "cancellations")
        self.grants.refill(now)

    def tick(self) -> None:
        """The 100 ms tick: maintenance, budget evaluation, replenishment."""
        now = self.clock()
        self.maintain(now)
        view = self._view(now)
        self.grants.evaluate(view)
        self.grants.replenish(now, view)

    def mark(self) -> tuple[int, ...]:
        """What :meth:`state` shows, but its time (and the integrals over time): two equal
        marks give equal states. References (``U``, ``F``, records, gauges), the budget
        generation (``B``, ``C``, denials), the events and refusals taken since the last
        state, ``|P_i|`` (the candidates' version), every counter (they only grow), the
        waiting sessions."""
        g, pool = self.grants, self.pool
        return (
            pool.refs_added,
            pool.refs_released,
            pool.get_num_free_blocks(),
            g.generation,
            len(g.denials),
            len(g.refusals),
            len(self.pub.events),
            self.cands.version,
            sum(self.counters.values()),
            len(self.sessions.entries),
        )

    def quiet(self) -> bool:
        """Nothing a tick could act on: no candidate, lease or pin is live.

        Then a tick only starts a generation over an empty view; the daemon
        (quiet idle) skips such ticks once one has run after the last change.
        """
        return not (self.cands.pending or self.leases.held or self.pins.held)

    def before_schedule(self) -> None:
        """``schedule()`` entry: expiry, revocation and the session order before vLLM allocates."""
        now = self.clock()
        self.maintain(now)
        self.grants.refill(now)
        if self._orders and self.sessions.reorder(now):
            self.counters["session_reorders"] += 1

    def after_schedule(self, num_scheduled_tokens: dict[str, int]) -> None:
        """Handoff of bound continuations whose allocation succeeded this step."""
        now = self.clock()
        blocks = self.table.kv.coordinator.get_blocks
        leased, pinned, waiting = self.leases.bound, self.pins.bound, self.sessions.by_req
        for req_id, n in num_scheduled_tokens.items():
            if n <= 0 or not (req_id in leased or req_id in pinned or req_id in waiting):
                continue  # it resumes no hold and no session (nearly every request)
            self.leases.handoff(req_id, blocks, now)
            self.pins.handoff(req_id, blocks, now)  # the same rule as a lease's handoff
            self.sessions.allocated(req_id)  # allocated: no longer waiting
        self.grants.refill(now)

    def drop_all(self, counter: str) -> None:
        """Release every lease and pin (prefix-cache reset, end of run)."""
        self.ends.drop_all(counter)

    def release_all(self) -> None:
        """End of run: release every lease and pin and forget all candidates."""
        self.ends.release_all()

    # -- maintenance -------------------------------------------------------

    def maintain(self, now: float) -> bool:
        """Strip, expire, revoke, drop unlisted; True if any lease reference was released."""
        return self.ends.maintain(now)

    def _view(self, now: float) -> View:
        """Candidates in FIFO order; pinned ones are outside the budget and left out."""
        view = self.cands.view(now, self._engine_delay())
        if self.pins.held:
            view = [(p, c) for p, c in view if p.cid not in self.pins]
        return view

    def _engine_delay(self) -> float:
        w, a, m = self.grants.load()
        return bud.engine_delay(self.kappa, w, a, m)

    def _ended(
        self, kind: LeaseKind, x: Lease, status: LeaseStatus, blocks: int, now: float
    ) -> None:
        """A hold ended (``Holds.release``): :meth:`Ends.ended` (built after the holds)."""
        self.ends.ended(kind, x, status, blocks, now)

    # -- publication and audit ---------------------------------------------

    def records(self) -> tuple[LeaseRecord, ...]:
        """Active lease and pin records, rebuilt only after a change or a new generation."""
        return self.pub.records(self.grants.generation)

    def _build_records(self) -> tuple[LeaseRecord, ...]:
        return build_records(self.leases, self.pins, self.grants.generation)

    def state(self, seq: int) -> EngineState:
        """A frozen snapshot (spec 3.4): leases, budget, load, denials, resident sizes."""
        g = self.grants
        return self.pub.state(
            seq, self.clock(), g.load(), g.budget, g.generation, g.denials, g.refusals
        )

    def sizes(self) -> dict[str, int]:
        """Entries per structure of every part: all 0 when nothing is live.

        Not listed: the grants' denials and the publication's events (each
        bounded by one generation or one publication). The pins' and
        sessions' entries are listed only while non-zero, so a LADS run's
        listing is unchanged.
        """
        retention = {**self.pins.sizes(), **self.sessions.sizes()}
        return {
            **self.cands.sizes(),
            **self.leases.sizes(),
            **self.grants.sizes(),
            **{k: v for k, v in retention.items() if v},  # listed while they hold something
        }

    def check(self) -> None:
        """Raise :class:`LeaseIntegrityError` unless every part and their joins agree."""
        self.leases.check_integrity()
        self.pins.check_integrity(with_pool=False)  # the pool was checked just before
        self.sessions.check_integrity()
        self.cands.check_integrity()
        self.grants.check_integrity()
        self.pub.check_integrity()
        both = self.leases.held.keys() & self.pins.held.keys()
        if both:
            raise LeaseIntegrityError(f"{len(both)} continuation(s) both leased and pinned")
        self.cands.check_live([*self.leases.held, *self.pins.held])

    def audit(self) -> dict[str, float]:
        """Added vs released references, per kind and in total; raises on any mismatch."""
        self.check()
        held = self.leases.balance() + self.pins.balance()
        pool = self.pool
        check_refs(pool.refs_added, pool.refs_released, held)
        out = self.pub.snapshot(self.clock())
        out["refs_held"] = float(held)
        out["pin_refs_added"] = float(self.pins.table.ledger.added)
        out["pin_refs_released"] = float(self.pins.table.ledger.released)
        out.update(self.sessions.counts.audit())  # the session order (HEAR's, lads-adaptive's)
        reused, hashed = self.cands.hash_counts()  # notices' block hashes (NoticeHashes)
        out["notice_blocks_reused"], out["notice_blocks_hashed"] = float(reused), float(hashed)
        self.ends.check_released(held)
        return out
