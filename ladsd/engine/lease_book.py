"""The lease book: prefix leases of spec section 3, composed from two parts.

Contract (mini-sglang style; read this before touching the code):

* Parts: :class:`~ladsd.engine.candidates.Candidates` owns the announced
  results, the sender's inventory, versions and the FIFO view;
  :class:`~ladsd.engine.lease_table.LeaseTable` owns the active leases and
  every lease reference on the pool. The book owns the policy: the budget and
  its generation, grants, handoff bindings (``bound``), expiry, revocation,
  denial events, counters and the published state. Only the book calls the
  parts; the parts never call each other or the book.
* Thread: every method runs on the engine thread, between scheduler steps.
  Nothing here locks and nothing is thread-safe; the engine thread is the only
  caller (``EngineThread`` owns vLLM's EngineCore, whose scheduler owns this
  book through :class:`~ladsd.engine.leases.LeaseMixin`).
* Lock/unlock: only through the table (one reference per real block of the
  whole ``P_i``; a release gives back exactly the lease's references, once).
  Every lease that ends goes through :meth:`_end`, which counts it, unbinds
  it and settles its continuation.
* Every public operation starts with :meth:`maintain`: leased blocks whose hash
  was stripped leave their lease (with everything after them in the prefix),
  leases at ``d_i`` expire, leases are revoked while fewer than ``H`` blocks
  are free, and candidates the sender never listed within ``l`` are dropped.
  An idle engine does not call ``schedule()``, so the tick and the lease
  operations are what keep expiry on time.
* Grants: only candidates in the near-use set ``N`` of the current budget, in
  FIFO (ready time, identity, version) order; ``U + Delta_i <= B`` and
  ``F_after >= H``, where ``F_after`` also takes off the blocks vLLM is about
  to allocate for requests waiting to be admitted (:class:`Reserve`, ours).
  The first grant fixes ``g_i`` and ``d_i = g_i + l_i``; regrants never extend
  it.
* Handoff: after ``schedule()``, for a bound request with positive scheduled
  tokens whose block table holds every protected block's hash at its position.
* Memory: a continuation is live while it is a candidate or holds a lease; when
  both have ended the book keeps nothing about it (:meth:`_settle`), so every
  structure is bounded by the live continuations and the sender's inventory
  (:meth:`sizes`). No call from the engine is needed when a request finishes:
  a bound lease ends by handoff, expiry, revocation or cancellation. The
  price: a notice for a settled identity (announced again after its receipt,
  or an older version once the newer one has settled) is a new candidate with
  a new ``g_i``, where the book used to remember every identity forever. The
  runtime announces each continuation once, before the sender sees it.
* Retention other than LADS (``retention``; :mod:`ladsd.modes`): pins
  (:mod:`ladsd.engine.pins`: ``Retention.TTL_PIN`` pins every notice at
  readiness; :meth:`LeaseBook.preserve` pins for AugServe's Preserve) and
  HEAR's session order (:mod:`ladsd.engine.session`: ``Retention.SESSION``
  reorders the free queue at ``schedule()`` entry, with no references). Pins
  are outside the budget: not in ``U``, ``B`` or the budget's view, never
  revoked; a pinned candidate gets no LADS grant, and pinning a leased one
  ends its lease (``leases_to_pins``) after the pin holds the blocks. A
  continuation is also live while pinned. Under LADS and NONE neither part
  ever holds anything, and nothing they do runs.
* Audit: ``ref_cnt == native holders + lease and pin references`` for every
  block, and the parts agree with each other (:meth:`check`); added ==
  released + held references, per kind and in total (:meth:`audit`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from ladsd.audit import check_refs
from ladsd.clock import Clock
from ladsd.config import LeaseConfig
from ladsd.engine import budget as bud
from ladsd.engine.candidates import Candidates, Pending, View, turn_of
from ladsd.engine.lease_pool import LeaseIntegrityError
from ladsd.engine.lease_table import Lease, LeaseTable, Native
from ladsd.engine.pins import Pins, pin_ttl
from ladsd.engine.resident import flatten, lookup_hit
from ladsd.engine.session import P_PRIOR, Sessions
from ladsd.modes import Retention
from ladsd.records import (
    LEASE_COUNTERS,
    RETENTION_COUNTERS,
    ContinuationId,
    DenialEvent,
    EngineState,
    HistoryNotice,
    LeaseEvent,
    LeaseEventKind,
    LeaseKind,
    LeaseRecord,
    LeaseStatus,
    Phase,
    SenderInventory,
)

Load = Callable[[], tuple[int, int, int]]  # (w waiting, a running, m max_num_seqs)
Waiting = Callable[[], Iterable[Request]]  # vLLM's waiting requests without KV blocks, in order

_NO_BUDGET = bud.Budget((), 0, 0, False, 0, 0)


@dataclass
class Reserve:
    """The engine's pending allocation: what admitting the next waiting requests takes from F.

    Formula (ours; issue 10). Let ``R`` be the first ``max(0, m - a)`` requests
    of vLLM's waiting queue that hold no KV blocks yet (``Scheduler.waiting``,
    in the order vLLM admits them: the ones the next step can admit into free
    running slots; requests beyond the slots wait for a running request to
    finish, which frees its own blocks). For ``r`` in ``R`` with ``n_r`` tokens
    (prompt, plus output for a preempted request) and ``P_r`` its prefix-cache
    hit as vLLM will find it (hashes up to ``n_r - 1`` tokens), per KV group
    of block size ``b``::

        new   = sum_r max(0, ceil(n_r / b) - |P_r|)     blocks allocated fresh
        cached = { blocks of union_r P_r with ref_cnt == 0 }  leave the free queue

    and a grant of ``P_i`` passes the headroom rule iff::

        F - |{ x in P_i : ref_cnt(x) == 0 } union cached| - new >= H

    Blocks already referenced (by a running request or a lease) cost nothing;
    a block shared by ``P_i`` and some ``P_r``, or by two ``P_r``, counts once.
    After a grant its blocks are referenced, so they leave ``cached``. The
    budget (``C_safe``, ``B``) and revocation (``F < H`` now) are unchanged.
    """

    cached: set[int]
    new: int

    def taken(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Free blocks a grant of ``blocks`` plus the pending allocation take."""
        return len({b.block_id for b in blocks if b.ref_cnt == 0} | self.cached) + self.new

    def hold(self, blocks: Iterable[KVCacheBlock]) -> None:
        """``blocks`` were just leased: admitting a request no longer takes them from F."""
        self.cached.difference_update(b.block_id for b in blocks)


_END_EVENTS = {
    LeaseStatus.HANDED_OFF: LeaseEventKind.HANDOFF,
    LeaseStatus.EXPIRED: LeaseEventKind.EXPIRY,
    LeaseStatus.REVOKED: LeaseEventKind.REVOCATION,
    LeaseStatus.CANCELLED: LeaseEventKind.CANCELLATION,
}


class LeaseBook:
    """Leases, budget and counters of one engine (see the module contract)."""

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
        self.kv = kv
        self.block_size = hash_block_size  # tokens per block of |P_i|
        self.cfg = cfg
        self.kappa = kappa
        self.clock = clock
        self.load = load
        self.waiting = waiting
        self.table = LeaseTable(kv, clock(), native_extra)
        self.pool = self.table.pool
        self.cands = Candidates(kv, self.pool, cfg.lease_lifetime_s, hash_block_size, hash_algo)
        self.bound: dict[str, ContinuationId] = {}  # request id -> its leased continuation
        self.retention = Retention(retention)
        self.pins = Pins(kv, clock(), native_extra)  # outside the budget (ttl-pin, preserve)
        self.sessions = Sessions(self.pool, self.table.block_sizes)  # HEAR's eviction order
        if self.retention is Retention.SESSION:
            self.pool.stamp_frees(clock)  # idle: when a session's blocks became free

        self.generation = 0
        self.budget = _NO_BUDGET
        self.denials: list[DenialEvent] = []
        self._refused: dict[ContinuationId, set[str]] = {}  # refusal kinds, per generation
        self.counters: Counter[str] = Counter()
        self._released = False  # a release since the last replenishment
        self._released_all = False
        self._records: tuple[tuple[int, int, int], tuple[LeaseRecord, ...]] = ((-1, -1, -1), ())
        self.events: list[LeaseEvent] = []  # outcomes since the last published state

    # -- public operations (engine thread) ---------------------------------

    def notice(self, n: HistoryNotice) -> None:
        """A result is ready: find ``P_i``, evaluate the budget, try FIFO grants."""
        if n.payload_bytes < 0:
            raise ValueError(f"{n.cid.key()}: negative payload_bytes {n.payload_bytes}")
        if n.continuation_p is not None and not 0.0 <= n.continuation_p <= 1.0:
            raise ValueError(f"{n.cid.key()}: continuation_p {n.continuation_p} not in [0, 1]")
        if n.lifetime_s is not None and not 0.0 < n.lifetime_s < math.inf:
            raise ValueError(f"{n.cid.key()}: lifetime_s {n.lifetime_s} must be positive, finite")
        now = self.clock()
        self.maintain(now)
        if not self._supersede(n.cid):
            self.counters["stale_notices"] += 1
            return
        if n.cid in self.cands.pending or n.cid in self.table.leases:
            self.counters["repeat_notices"] += 1  # a repeat leaves the lease unchanged
            return
        if self.cands.phases.get(n.cid) in (Phase.RECEIVED, Phase.CANCELLED):
            self.counters["late_notices"] += 1  # nothing left to protect ahead of receipt
            return
        p = self.cands.announce(n)
        if self.retention is Retention.TTL_PIN:
            self._pin_at_readiness(p, now)
        elif self.retention is Retention.SESSION:
            self._enter_session(p, now)
        view = self._view(now)
        self._evaluate(now, view)
        self._replenish(now, view)

    def preserve(self, cid: ContinuationId, ttl_s: float) -> bool:
        """AugServe's Preserve: pin ``cid``'s ``P_i`` outside the budget for ``min(ttl_s, l)``.

        ``cid`` must be a live candidate (noticed, not yet registered) with a
        resident prefix; otherwise nothing is pinned, the reason is counted
        (``preserve_refused_not_candidate`` / ``preserve_refused_cold``) and
        the answer is False. Already pinned: True, the pin unchanged
        (``preserve_repeats``). A LADS lease it holds ends once the pin holds
        its blocks (``leases_to_pins``); while pinned it gets no LADS grant.
        """
        if not ttl_s >= 0:
            raise ValueError(f"{cid.key()}: preserve ttl must be non-negative, got {ttl_s}")
        now = self.clock()
        self.maintain(now)
        if cid in self.pins:
            self.counters["preserve_repeats"] += 1
            return True
        p = self.cands.pending.get(cid)
        if p is None:
            self.counters["preserve_refused_not_candidate"] += 1
            return False
        if not self._pin(p, ttl_s, now):
            self.counters["preserve_refused_cold"] += 1
            return False
        self.counters["preserves"] += 1
        self._refill(now)
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
        cid = n.cid
        if cid in self.table.leases or cid in self.pins:
            return None  # a pin holds it too, outside the budget and never revoked
        p = self.cands.pending.get(cid)
        if p is None:
            return "not a lease candidate (a stale, repeated or late notice)"
        now = self.clock()
        self.cands.resident(p)  # P_i now
        blocks = flatten(p.resident)
        if not blocks:
            return "cold: no resident prefix to hold"
        reserve = self._reserve()
        free, h = self.pool.get_num_free_blocks(), self.cfg.headroom_blocks
        if free - reserve.taken(blocks) < h:
            return f"headroom: holding {len(blocks)} blocks would leave fewer than H = {h} free"
        used, delta = self.table.used, self.table.delta(blocks)
        ceiling = bud.safe_ceiling(used, free, h)
        if used + delta > ceiling:
            return f"budget: U + Delta = {used} + {delta} > C_safe = {ceiling}"
        self._take(p, now, reserve)
        return None

    def inventory(self, inv: SenderInventory) -> None:
        """The sender's causal inventory changed: track phases, then replenish."""
        if inv.rate <= 0 or inv.q_b < 0 or inv.overhead < 0:
            raise ValueError(f"bad sender inventory: rate {inv.rate}, Q_B {inv.q_b}")
        now = self.clock()
        self.maintain(now)
        seen_before = self.cands.listed()
        fresh = self.cands.observe(inv)
        for it in inv.items:
            self._supersede(it.cid)
            if it.phase is Phase.CANCELLED:
                self._cancel(it.cid, "cancellations")
            elif it.phase is Phase.RECEIVED:
                self._forget(it.cid)
            else:
                fresh |= self.cands.mark(it)
        for cid in seen_before - self.cands.phases.keys():  # received (a lease stays)
            self._forget(cid)
        view = self._view(now)
        if fresh:  # first real offer of a result to the sender
            self._evaluate(now, view)
        self._replenish(now, view)

    def bind(self, cid: ContinuationId, req_id: str) -> None:
        """``cid`` was registered with the engine as ``req_id``: the handoff target."""
        self.maintain(self.clock())
        self.sessions.bind(cid, req_id)  # first: a bound session outlives its candidate
        self._forget(cid)
        lease = self.table.leases.get(cid)
        if lease is not None:
            lease.reqs.append(req_id)  # any request of it whose table covers the lease takes over
            self.bound[req_id] = cid
        self.pins.bind(cid, req_id)
        self._refill(self.clock())

    def cancel(self, cid: ContinuationId) -> None:
        """Workflow cancelled: drop the lease and the candidate (idempotent)."""
        now = self.clock()
        self.maintain(now)
        self._cancel(cid, "cancellations")
        self._refill(now)

    def tick(self) -> None:
        """The 100 ms tick: maintenance, budget evaluation, replenishment."""
        now = self.clock()
        self.maintain(now)
        view = self._view(now)
        self._evaluate(now, view)
        self._replenish(now, view)

    def quiet(self) -> bool:
        """Nothing a tick could act on: no candidate, lease or pin is live.

        Then a tick only starts a generation over an empty view; the daemon
        (quiet idle) skips such ticks once one has run after the last change.
        """
        return not (self.cands.pending or self.table.leases or self.pins.pins)

    def before_schedule(self) -> None:
        """``schedule()`` entry: expiry, revocation and the session order before vLLM allocates."""
        now = self.clock()
        self.maintain(now)
        self._refill(now)
        if self.retention is Retention.SESSION and self.sessions.reorder(now):
            self.counters["session_reorders"] += 1

    def after_schedule(self, num_scheduled_tokens: dict[str, int]) -> None:
        """Handoff of bound continuations whose allocation succeeded this step."""
        now = self.clock()
        for req_id, n in num_scheduled_tokens.items():
            if n <= 0:
                continue
            cid = self.bound.get(req_id)
            if cid is not None:
                lease = self.table.leases[cid]  # bound only while leased (see check)
                if lease.covered_by(self.kv.coordinator.get_blocks(req_id)):
                    self._end(lease, LeaseStatus.HANDED_OFF, "handoffs", now)
                elif not lease.mismatch:
                    lease.mismatch = True
                    self.counters["handoff_mismatches"] += 1
            pcid = self.pins.bound.get(req_id)
            if pcid is not None:  # the same rule as a lease's handoff
                pin = self.pins.pins[pcid]
                if pin.covered_by(self.kv.coordinator.get_blocks(req_id)):
                    self._end_pin(pin, LeaseStatus.HANDED_OFF, "pin_handoffs", now)
                elif not pin.mismatch:
                    pin.mismatch = True
                    self.counters["pin_handoff_mismatches"] += 1
            if self.sessions.by_req:
                self.sessions.allocated(req_id)  # allocated: no longer waiting
        self._refill(now)

    def drop_all(self, counter: str) -> None:
        """Release every lease and pin (prefix-cache reset, end of run)."""
        now = self.clock()
        self._strip(now)
        for lease in self.table.ordered():
            self._end(lease, LeaseStatus.CANCELLED, counter, now)
        for pin in self.pins.ordered():
            self._end_pin(pin, LeaseStatus.CANCELLED, f"pin_{counter}", now)

    def release_all(self) -> None:
        """End of run: release every lease and forget all candidates."""
        self.drop_all("released_at_end")
        self.cands.clear()
        self.bound.clear()
        self.sessions.clear()
        self._refused.clear()
        self.denials = []
        self._released = False
        self._released_all = True

    # -- maintenance -------------------------------------------------------

    def maintain(self, now: float) -> bool:
        """Strip, expire, revoke, drop unlisted; True if any lease reference was released."""
        before = self.pool.refs_released
        self._strip(now)
        for lease in self.table.due(now):
            self._end(lease, LeaseStatus.EXPIRED, "expiries", now)
        for pin in self.pins.table.due(now):
            self._end_pin(pin, LeaseStatus.EXPIRED, "pin_expiries", now)
        self._revoke(now)  # LADS leases only: a pin is never revoked for headroom
        for cid in self.cands.unlisted(now):  # never offered within l (bounded memory)
            self._forget(cid)
        return self.pool.refs_released != before

    def _strip(self, now: float) -> None:
        """Leased blocks whose hash was stripped leave their leases (prefix cut there)."""
        for lease in self.table.stripped():
            cut = self.table.cut(lease, now)
            if cut is None:
                self._end(lease, LeaseStatus.CANCELLED, "stripped_leases", now)
            elif cut:
                self.counters["stripped_blocks"] += cut
                self._released = True
        for pin in self.pins.table.stripped():
            cut = self.pins.table.cut(pin, now)
            if cut is None:
                self._end_pin(pin, LeaseStatus.CANCELLED, "pin_stripped", now)
            elif cut:
                self.counters["pin_stripped_blocks"] += cut
                self._released = True

    def _revoke(self, now: float) -> None:
        """Keep ``H`` free: untimely handoffs first, then latest deadline first (ours)."""
        h = self.cfg.headroom_blocks
        if not self.table.leases or self.pool.get_num_free_blocks() >= h:
            return
        link = self.cands.link_times()
        delay = self._engine_delay()

        def timely(x: Lease) -> bool:
            t = link.get(x.cid, math.inf) if x.cid in self.cands.pending else 0.0
            return now + t + delay <= x.deadline

        order = sorted(self.table.leases.values(), key=lambda x: (timely(x), -x.deadline, x.key))
        for lease in order:
            if self.pool.get_num_free_blocks() >= h:
                break
            if self.table.gain(lease) > 0:  # revoking a lease that frees nothing would not help H
                self._end(lease, LeaseStatus.REVOKED, "revocations", now)

    # -- budget and grants -------------------------------------------------

    def _view(self, now: float) -> View:
        """Candidates in FIFO order; pinned ones are outside the budget and left out."""
        view = self.cands.view(now, self._engine_delay())
        if self.pins.pins:
            view = [(p, c) for p, c in view if p.cid not in self.pins]
        return view

    # -- pins and sessions -------------------------------------------------

    def _pin_at_readiness(self, p: Pending, now: float) -> None:
        """ttl-pin: pin ``P_i`` for the predicted wait ``T_B_i`` plus a margin, up to ``l_i``."""
        t_b = self.cands.time_to_use(p, now, self._engine_delay(), self.cands.link_times())
        ttl = pin_ttl(t_b, self.cands.lifetime_of(p.notice), self.cfg.tick_s)
        if not self._pin(p, ttl, now):
            self.counters["pin_cold"] += 1

    def _pin(self, p: Pending, ttl: float, now: float) -> bool:
        """Pin ``p``'s ``P_i`` now until ``now + min(ttl, l_i)``; False if nothing is resident."""
        if not self.cands.resident(p):
            return False
        self.pins.pin(
            p.notice,
            p.resident,
            deadline=now + min(ttl, self.cands.lifetime_of(p.notice)),
            committed=p.committed,
            generation=self.generation,
            now=now,
        )
        self.counters["pins"] += 1
        self._released_all = False
        lease = self.table.leases.get(p.cid)
        if lease is not None:  # the pin holds the blocks now: the lease's quota goes back
            self._end(lease, LeaseStatus.CANCELLED, "leases_to_pins", now)
        return True

    def _end_pin(self, pin: Lease, status: LeaseStatus, counter: str, now: float) -> bool:
        """Release ``pin`` (once), count how it ended, settle its continuation."""
        if not self.pins.release(pin, status, now):
            return False
        self.counters[counter] += 1
        self._released = True
        self._settle(pin.cid)
        return True

    def _enter_session(self, p: Pending, now: float) -> None:
        """HEAR: ``p``'s session waits with its resident ``P_i`` in the eviction order."""
        if not self.cands.resident(p):
            return  # nothing resident to order
        prob = p.notice.continuation_p
        self.sessions.enter(p.cid, P_PRIOR if prob is None else prob, p.resident, now)
        self.counters["sessions"] += 1

    def _evaluate(self, now: float, view: View) -> None:
        """One budget evaluation: a new generation with its own denial list."""
        self.generation += 1
        self.denials = []
        self._refused.clear()
        self.counters["evaluations"] += 1
        if not self.cfg.enabled:
            self.budget = _NO_BUDGET
            return
        self.budget = bud.evaluate(
            [c for _, c in view],
            self.table.used,
            self.pool.get_num_free_blocks(),
            self.cfg.headroom_blocks,
        )

    def _refill(self, now: float) -> None:
        """Replenish after a release (a fresh view; the budget stays as evaluated)."""
        if self._released and self.cands.pending:
            self._replenish(now, self._view(now))
        self._released = False

    def _replenish(self, now: float, view: View) -> None:
        """FIFO grants over unprotected near-use candidates under the current ``B``."""
        self._released = False
        if not self.cfg.enabled:
            return
        near = {c.key for c in bud.near_use_set(c for _, c in view)}
        reserve: Reserve | None = None  # looked up once per pass, at the first try
        for p, c in view:
            if c.key in near and p.cid not in self.table.leases:
                if reserve is None:
                    reserve = self._reserve()
                self._grant(p, now, reserve)

    def _reserve(self) -> Reserve:
        """The pending allocation of the next admissions (formula: :class:`Reserve`)."""
        _, a, m = self.load()
        cached: set[int] = set()
        new = 0
        for req in islice(self.waiting(), max(0, m - a)):
            n = req.num_tokens
            if self.kv.prefix_cache_lookup_enabled(req):
                hit, _ = lookup_hit(self.kv, req.block_hashes, n - 1)
            else:
                hit = tuple([] for _ in self.table.block_sizes)
            for size, row in zip(self.table.block_sizes, hit, strict=True):
                new += max(0, cdiv(n, size) - len(row))
                cached.update(b.block_id for b in row if not b.is_null and b.ref_cnt == 0)
        return Reserve(cached, new)

    def _grant(self, p: Pending, now: float, reserve: Reserve) -> bool:
        cid = p.cid
        blocks = flatten(p.resident)
        used = self.table.used
        delta = self.table.delta(blocks)
        if self.pool.get_num_free_blocks() - reserve.taken(blocks) < self.cfg.headroom_blocks:
            self._refuse("headroom_refusals", cid)
            return False
        if used + delta > self.budget.B:
            if self._refuse("denials", cid):
                self.denials.append(
                    DenialEvent(cid, now, self.generation, delta, self.budget.B, used)
                )
                self.events.append(LeaseEvent(LeaseEventKind.DENIAL, cid, now))
            return False
        self._take(p, now, reserve)
        return True

    def _take(self, p: Pending, now: float, reserve: Reserve) -> None:
        """Acquire ``p``'s lease (the checks have passed)."""
        blocks = flatten(p.resident)
        if p.granted_at is None:
            p.granted_at = now  # g_i: a regrant keeps it, so d_i never moves
        self.table.acquire(
            p.notice,
            p.resident,
            granted_at=p.granted_at,
            deadline=p.granted_at + self.cands.lifetime_of(p.notice),  # d_i = g_i + l_i
            committed=p.committed,
            generation=self.generation,
            now=now,
        )
        reserve.hold(blocks)
        self.counters["grants"] += 1
        self.counters["grants_after_commit" if p.committed else "grants_before_commit"] += 1
        self._released_all = False
        self.events.append(LeaseEvent(LeaseEventKind.GRANT, p.cid, now, len(blocks)))

    def _refuse(self, kind: str, cid: ContinuationId) -> bool:
        """Count a refusal once per identity and generation; True if new."""
        kinds = self._refused.setdefault(cid, set())
        if kind in kinds:
            return False
        kinds.add(kind)
        self.counters[kind] += 1
        return True

    # -- ends of leases and candidates ---------------------------------------

    def _end(self, lease: Lease, status: LeaseStatus, counter: str, now: float) -> bool:
        """Release ``lease`` (once), count how it ended, unbind it, settle its continuation."""
        blocks = len(lease.blocks)
        if not self.table.release(lease, status, now):
            return False
        kind = _END_EVENTS.get(status)
        if kind is not None:
            self.events.append(LeaseEvent(kind, lease.cid, now, blocks))
        for req_id in lease.reqs:
            if self.bound.get(req_id) == lease.cid:
                del self.bound[req_id]
        self.counters[counter] += 1
        self.counters[f"ended_{status.value}"] += 1
        self._released = True
        self._settle(lease.cid)
        return True

    def _supersede(self, cid: ContinuationId) -> bool:
        """Invalidate the older live version of ``cid``'s turn; False if ``cid`` itself is old."""
        if self.cands.stale(cid):
            return False
        old = self.cands.older(cid)
        if old is not None:
            self._cancel(old, "invalidations")
        return True

    def _cancel(self, cid: ContinuationId, counter: str) -> None:
        lease = self.table.leases.get(cid)
        if lease is not None:
            self._end(lease, LeaseStatus.CANCELLED, counter, self.clock())
        elif cid in self.cands.pending:
            self.counters[counter] += 1
        pin = self.pins.pins.get(cid)
        if pin is not None:  # cancelled or superseded
            self._end_pin(pin, LeaseStatus.CANCELLED, "pin_cancels", self.clock())
        self.sessions.end(cid)
        self._forget(cid)

    def _forget(self, cid: ContinuationId) -> None:
        """No longer a grant candidate (received, cancelled, unlisted); a lease stays."""
        if self.cands.forget(cid):
            # Only candidates are refused, and a new candidate comes with a notice,
            # which starts a new generation: its refusals can never be counted again.
            self._refused.pop(cid, None)
            self.sessions.end_unbound(cid)  # dropped before any request was bound
            self._settle(cid)

    def _settle(self, cid: ContinuationId) -> None:
        """Keep nothing about ``cid`` once it is neither a candidate nor leased."""
        if cid not in self.cands.pending and cid not in self.table.leases and cid not in self.pins:
            self.cands.settle(cid)

    def _engine_delay(self) -> float:
        w, a, m = self.load()
        return bud.engine_delay(self.kappa, w, a, m)

    # -- publication and audit ---------------------------------------------

    def exclusive(self, lease: Lease) -> int:
        """``|E_i|``: blocks of the lease protected by no other lease."""
        return self.table.exclusive(lease)

    def records(self) -> tuple[LeaseRecord, ...]:
        """Active lease records, rebuilt only after a lease change or a new generation."""
        key = (self.pool.refs_added, self.pool.refs_released, self.generation)
        if self._records[0] != key:
            self._records = (key, self._build_records())
        return self._records[1]

    def _build_records(self) -> tuple[LeaseRecord, ...]:
        gen = self.generation
        leases = tuple(x.record(self.exclusive(x), gen) for x in self.table.ordered())
        # A pin's handoff returns no budget quota: its record's E_i is 0.
        return leases + tuple(x.record(0, gen, LeaseKind.PIN) for x in self.pins.ordered())

    def snapshot_counters(self, now: float) -> dict[str, float]:
        out: dict[str, float] = dict.fromkeys((*LEASE_COUNTERS, *RETENTION_COUNTERS), 0.0)
        out.update((k, float(v)) for k, v in self.counters.items())
        out["protection_block_seconds"] = self.table.integrate(now)
        out["pin_block_seconds"] = self.pins.table.integrate(now)
        out["refs_added"] = float(self.pool.refs_added)  # every kind (leases and pins)
        out["refs_released"] = float(self.pool.refs_released)
        out["active_leases"] = float(len(self.table.leases))
        out["active_pins"] = float(len(self.pins.pins))
        out["waiting_sessions"] = float(len(self.sessions.entries))
        return out

    def state(self, seq: int) -> EngineState:
        """A frozen snapshot (spec 3.4): leases, budget, load, denials, resident sizes."""
        now = self.clock()
        w, a, m = self.load()
        used = self.table.used
        target = self.budget.B if self.cfg.enabled else 0
        return EngineState(
            time=now,
            seq=seq,
            generation=self.generation,
            U=used,
            B=target,
            C=bud.committed_capacity(target, used) if self.cfg.enabled else 0,
            F=self.pool.get_num_free_blocks(),
            w=w,
            a=a,
            m=m,
            total_blocks=self.pool.num_gpu_blocks - 1,  # the null block is never usable
            block_size=self.block_size,
            kappa=self.kappa,
            leases=self.records(),
            denials=tuple(self.denials),
            resident=self.cands.sizes_of(),
            counters=self.snapshot_counters(now),
            events=self._drain_events(),
        )

    def _drain_events(self) -> tuple[LeaseEvent, ...]:
        events, self.events = tuple(self.events), []
        return events

    def sizes(self) -> dict[str, int]:
        """Entries per structure (candidates, lease table, book): all 0 when nothing is live.

        ``denials`` (this generation's denial events, published as they are) is
        not listed: every evaluation replaces it, so it never holds more than
        one generation's candidates. The pins' and sessions' entries are
        listed only while non-zero, so a LADS run's listing is unchanged.
        """
        retention = {**self.pins.sizes(), **self.sessions.sizes()}
        return {
            **self.cands.sizes(),
            **self.table.sizes(),
            "bound": len(self.bound),
            "refused": len(self._refused),
            **{k: v for k, v in retention.items() if v},  # listed while they hold something
        }

    def check(self) -> None:
        """Raise :class:`LeaseIntegrityError` unless every count agrees (see contract)."""
        self.table.check_integrity()
        self.pins.check_integrity()
        self.sessions.check_integrity()
        self.cands.check_integrity()
        both = self.table.leases.keys() & self.pins.pins.keys()
        if both:
            raise LeaseIntegrityError(f"{len(both)} continuation(s) both leased and pinned")
        live: dict[tuple[str, int], int] = {}
        for cid in {*self.cands.pending, *self.table.leases, *self.pins.pins}:
            if live.setdefault(turn_of(cid), cid.version) != cid.version:
                raise LeaseIntegrityError(f"two versions of {cid.key()}'s turn are live")
        if live != self.cands.latest:
            raise LeaseIntegrityError("turn versions disagree with the live continuations")
        if not self._refused.keys() <= self.cands.pending.keys():
            raise LeaseIntegrityError("refusals kept for a continuation that is no candidate")
        for req_id, cid in self.bound.items():
            lease = self.table.leases.get(cid)
            if lease is None or req_id not in lease.reqs:
                raise LeaseIntegrityError(f"request {req_id} bound to {cid.key()} without a lease")

    def audit(self) -> dict[str, float]:
        """Added vs released references, per kind and in total; raises on any mismatch."""
        self.check()
        held = self.table.balance() + self.pins.table.balance()
        pool = self.pool
        check_refs(pool.refs_added, pool.refs_released, held)
        out = self.snapshot_counters(self.clock())
        out["refs_held"] = float(held)
        out["pin_refs_added"] = float(self.pins.table.ledger.added)
        out["pin_refs_released"] = float(self.pins.table.ledger.released)
        if self._released_all and (self.table.leases or self.pins.pins or held):
            n = len(self.table.leases) + len(self.pins.pins)
            raise LeaseIntegrityError(f"{n} leases and pins remain after release_all")
        return out
