"""Grants: the budget generations, FIFO replenishment, refusals and denials (spec 3.2-3.3).

Contract (mini-sglang style: one owner per structure):

* Owns: the budget of the current generation (``budget``, ``generation``),
  its denial events (``denials``, replaced by every evaluation) and
  headroom-refusal events (``refusals``, ours: alike), the
  refusals counted this generation (``refused``: kinds per candidate) and
  the flag that a hold was released since the last replenishment
  (``released``: :meth:`refill` grants only then).
* Grants: only candidates in the near-use set ``N`` of the current budget, in
  FIFO order of the view (ready time, identity, version); ``U + Delta_i <=
  B`` and ``F_after >= H``, where ``F_after`` also takes off the blocks vLLM
  is about to allocate for requests waiting to be admitted (:class:`Reserve`).
  The first grant fixes ``g_i`` and ``d_i = g_i + l_i``; regrants never
  extend it. A grant takes its references through the LADS holds
  (:meth:`~ladsd.engine.lease_holds.Holds.acquire`), nowhere else.
* Revocation (ours): while fewer than ``H`` blocks are free, LADS leases
  are revoked, untimely handoffs first, then the latest deadline first.
* Callers: only the lease book, on the engine thread; nothing locks. The
  view (candidates with fresh ``P_i``, pinned ones left out) is the book's.
* Integrity: :meth:`check_integrity` (refusals only for candidates; the
  denials are this generation's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice

from vllm.utils.math_utils import cdiv
from vllm.v1.request import Request

from ladsd.config import LeaseConfig
from ladsd.engine import budget as bud
from ladsd.engine.lease_candidates import Candidates, LeaseCandidate, View
from ladsd.engine.lease_holds import Holds
from ladsd.engine.lease_pool import LeaseIntegrityError
from ladsd.engine.lease_publish import Publication
from ladsd.engine.lease_resident import Prefix, lookup_hit
from ladsd.engine.lease_table import Lease
from ladsd.records import ContinuationId, DenialEvent, LeaseEventKind, LeaseStatus, RefusalEvent

Load = Callable[[], tuple[int, int, int]]  # (w waiting, a running, m max_num_seqs)
Waiting = Callable[[], Iterable[Request]]  # vLLM's waiting requests without KV blocks, in order

NO_BUDGET = bud.Budget((), 0, 0, False, 0, 0)


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

    def taken(self, prefix: Prefix) -> int:
        """Free blocks a grant of ``prefix`` plus the pending allocation take."""
        ids = set(prefix.unreferenced())
        # |ids | cached| without copying ``cached`` (the intersection walks the smaller set).
        return len(ids) + len(self.cached) - len(ids & self.cached) + self.new

    def hold(self, prefix: Prefix) -> None:
        """``prefix`` was just leased: admitting a request no longer takes it from F."""
        self.cached.difference_update(prefix.block_ids)


class Grants:
    """Budget, generations and FIFO grants of LADS leases (see the module contract)."""

    def __init__(
        self,
        cfg: LeaseConfig,
        cands: Candidates,
        leases: Holds,
        pub: Publication,
        *,
        view: Callable[[float], View],
        load: Load,
        waiting: Waiting,
    ) -> None:
        self.cfg = cfg
        self.cands = cands
        self.leases = leases
        self.pub = pub
        self.view = view  # the book's: FIFO candidates with fresh P_i, pinned ones left out
        self.load = load
        self.waiting = waiting
        self.generation = 0
        self.budget = NO_BUDGET
        self.denials: list[DenialEvent] = []
        self.refusals: list[RefusalEvent] = []  # headroom refusals, this generation (ours)
        self.refused: dict[ContinuationId, set[str]] = {}  # refusal kinds, this generation
        self.released = False  # a hold was released since the last replenishment
        self.demand = bud.DemandMemo()  # D(t) reused while the near set's P_i stay

    def evaluate(self, view: View) -> None:
        """One budget evaluation: a new generation with its own denial list."""
        self.generation += 1
        self.denials = []
        self.refusals = []
        self.refused.clear()
        self.pub.counters["evaluations"] += 1
        if not self.cfg.enabled:
            self.budget = NO_BUDGET
            return
        table = self.leases.table
        self.budget = bud.evaluate(
            [c for _, c in view],
            table.used,
            table.pool.get_num_free_blocks(),
            self.cfg.headroom_blocks,
            self.demand,
        )

    def refill(self, now: float) -> None:
        """Replenish after a release (a fresh view; the budget stays as evaluated)."""
        if self.released and self.cands.pending:
            self.replenish(now, self.view(now))
        self.released = False

    def replenish(self, now: float, view: View) -> None:
        """FIFO grants over unprotected near-use candidates under the current ``B``."""
        self.released = False
        if not self.cfg.enabled:
            return
        reserve: Reserve | None = None  # looked up once per pass, at the first try
        for p, c in view:  # the near-use set in the view's order, judged in place
            if bud.is_near(c) and p.cid not in self.leases:
                if reserve is None:
                    reserve = self.reserve()
                self.grant(p, now, reserve)

    def reserve(self) -> Reserve:
        """The pending allocation of the next admissions (formula: :class:`Reserve`)."""
        _, a, m = self.load()
        table = self.leases.table
        kv = table.kv
        cached: set[int] = set()
        new = 0
        for req in islice(self.waiting(), max(0, m - a)):
            n = req.num_tokens
            if kv.prefix_cache_lookup_enabled(req):
                hit, _ = lookup_hit(kv, req.block_hashes, n - 1)
            else:
                hit = tuple([] for _ in table.block_sizes)
            for size, row in zip(table.block_sizes, hit, strict=True):
                new += max(0, cdiv(n, size) - len(row))
                cached.update(b.block_id for b in row if not b.is_null and b.ref_cnt == 0)
        return Reserve(cached, new)

    def grant(self, p: LeaseCandidate, now: float, reserve: Reserve) -> bool:
        """Grant ``p`` if it passes the headroom rule and fits ``B``; else count the refusal."""
        cid = p.cid
        prefix = p.prefix
        table = self.leases.table
        free, taken = table.pool.get_num_free_blocks(), reserve.taken(prefix)
        if free - taken < self.cfg.headroom_blocks:
            if self.refuse("headroom_refusals", cid):
                self.refusals.append(RefusalEvent(cid, now, self.generation, free, taken))
            return False
        used, delta = table.used, table.delta(prefix)  # only past the headroom rule
        if used + delta > self.budget.B:
            if self.refuse("denials", cid):
                self.denials.append(
                    DenialEvent(cid, now, self.generation, delta, self.budget.B, used)
                )
                self.pub.event(LeaseEventKind.DENIAL, cid, now)
            return False
        self.take(p, now, reserve)
        return True

    def require(self, p: LeaseCandidate, now: float) -> str | None:
        """Grant ``p`` now within ``C_safe`` and ``H`` (ladsd serve), or say why not."""
        prefix = self.cands.resident(p)  # P_i now
        if not prefix:
            return "cold: no resident prefix to hold"
        reserve = self.reserve()
        table = self.leases.table
        free, h = table.pool.get_num_free_blocks(), self.cfg.headroom_blocks
        if free - reserve.taken(prefix) < h:
            return f"headroom: holding {len(prefix)} blocks would leave fewer than H = {h} free"
        used, delta = table.used, table.delta(prefix)
        ceiling = bud.safe_ceiling(used, free, h)
        if used + delta > ceiling:
            return f"budget: U + Delta = {used} + {delta} > C_safe = {ceiling}"
        self.take(p, now, reserve)
        return None

    def take(self, p: LeaseCandidate, now: float, reserve: Reserve) -> None:
        """Acquire ``p``'s lease (the checks have passed on its ``P_i``, ``p.prefix``)."""
        if p.granted_at is None:
            p.granted_at = now  # g_i: a regrant keeps it, so d_i never moves
        self.leases.acquire(
            p.notice,
            p.prefix,
            granted_at=p.granted_at,
            deadline=p.granted_at + self.cands.lifetime_of(p.notice),  # d_i = g_i + l_i
            committed=p.committed,
            generation=self.generation,
            now=now,
        )
        reserve.hold(p.prefix)
        c = self.pub.counters
        c["grants"] += 1
        c["grants_after_commit" if p.committed else "grants_before_commit"] += 1
        self.pub.event(LeaseEventKind.GRANT, p.cid, now, len(p.prefix))

    def refuse(self, kind: str, cid: ContinuationId) -> bool:
        """Count a refusal once per identity and generation; True if new."""
        kinds = self.refused.setdefault(cid, set())
        if kind in kinds:
            return False
        kinds.add(kind)
        self.pub.counters[kind] += 1
        return True

    def revoke(self, now: float, delay: Callable[[], float]) -> None:
        """Keep ``H`` free: untimely handoffs first, then latest deadline first (ours).

        ``delay`` is the engine delay of a handoff now; a lease that frees no
        block is never revoked (it would not help ``H``).
        """
        h = self.cfg.headroom_blocks
        table = self.leases.table
        if not table.leases or table.pool.get_num_free_blocks() >= h:
            return
        link = self.cands.link_times()
        d = delay()

        def timely(x: Lease) -> bool:
            t = link.get(x.cid, math.inf) if x.cid in self.cands.pending else 0.0
            return now + t + d <= x.deadline

        order = sorted(table.leases.values(), key=lambda x: (timely(x), -x.deadline, x.key))
        freed = True
        while freed and table.pool.get_num_free_blocks() < h:
            # A release raises the gain of a lease passed over that shared its blocks: the
            # remaining leases are passed again, in the same order, until one frees nothing.
            freed = False
            for x in order:
                if table.pool.get_num_free_blocks() >= h:
                    break
                if table.gain(x) > 0:
                    self.leases.release(x, LeaseStatus.REVOKED, "revocations", now)
                    freed = True
            order = [x for x in order if table.leases.get(x.cid) is x]

    def clear(self) -> None:
        """End of run: no refusal or denial is kept."""
        self.refused.clear()
        self.denials = []
        self.refusals = []
        self.released = False

    def sizes(self) -> dict[str, int]:
        """``denials`` is not listed: every evaluation replaces it (one generation at most)."""
        return {"refused": len(self.refused)}

    def check_integrity(self) -> None:
        """Raise :class:`LeaseIntegrityError` unless refusals and denials are current."""
        if not self.refused.keys() <= self.cands.pending.keys():
            raise LeaseIntegrityError("refusals kept for a continuation that is no candidate")
        if any(d.generation != self.generation for d in (*self.denials, *self.refusals)):
            raise LeaseIntegrityError("denials or refusals kept from an earlier generation")
