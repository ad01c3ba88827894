"""The lease book: prefix leases of spec section 3 over a :class:`LeaseBlockPool`.

Contract (mini-sglang style; read this before touching the code):

* Thread: every method runs on the engine thread, between scheduler steps.
  Nothing here locks and nothing is thread-safe; the engine thread is the only
  caller (``EngineThread`` owns vLLM's EngineCore and this book).
* Lock: :meth:`_acquire` takes exactly one reference per real block of the
  whole resident prefix ``P_i`` (never a subset) through
  ``LeaseBlockPool.lease_touch``. A lease exists iff it is in ``self.leases``.
* Unlock: :meth:`_release` removes the lease from ``self.leases`` first and
  then frees exactly the references the lease still holds through
  ``LeaseBlockPool.lease_free``. A second release of the same lease finds
  nothing and does nothing (idempotent); native references and other leases'
  references are never touched. ``ref_cnt`` is never written.
* Every public operation starts with :meth:`maintain`: leased blocks whose hash
  was stripped leave their lease (with everything after them in the prefix),
  leases at ``d_i`` expire, and leases are revoked while fewer than ``H`` blocks
  are free. An idle engine does not call ``schedule()``, so the tick and the
  lease operations are what keep expiry on time.
* Grants: only candidates in the near-use set ``N`` of the current budget, in
  FIFO (ready time, identity, version) order; ``U + Delta_i <= B`` and
  ``F_after >= H``. The first grant fixes ``g_i`` and ``d_i = g_i + l``;
  regrants never extend it.
* Handoff: after ``schedule()``, for a bound request with positive scheduled
  tokens whose block table holds every protected block's hash at its position.
* Audit: ``ref_cnt == native holders + lease references`` for every block
  (:meth:`check`); added == released + held references (:meth:`audit`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash, BlockHashWithGroupId, KVCacheBlock

from ladsd.clock import Clock
from ladsd.config import LeaseConfig
from ladsd.engine import budget as bud
from ladsd.engine.lease_pool import LeaseBlockPool, LeaseIntegrityError, check_pool, native_refs
from ladsd.records import (
    LEASE_COUNTERS,
    ContinuationId,
    DenialEvent,
    EngineState,
    HistoryNotice,
    LeaseRecord,
    LeaseStatus,
    Phase,
    SenderInventory,
)
from ladsd.engine.resident import Hasher, flatten, lookup_hit, make_hasher, prefix_hashes

Load = Callable[[], tuple[int, int, int]]  # (w waiting, a running, m max_num_seqs)
FifoKey = tuple[float, str, int, int]

_NO_BUDGET = bud.Budget((), 0, 0, False, 0, 0)


def fifo_key(ready_time: float, cid: ContinuationId) -> FifoKey:
    """Grant order: (ready time, identity, version), independent of sender priority."""
    return (ready_time, cid.workflow, cid.turn, cid.version)


@dataclass
class Lease:
    """One active lease: the references it holds and where they sit in ``P_i``."""

    cid: ContinuationId
    notice: HistoryNotice
    blocks: list[KVCacheBlock]  # held references, prefix order per group
    slots: list[tuple[int, int]]  # (kv cache group, position in the block table)
    hashes: list[BlockHashWithGroupId]  # block hash at grant, per block
    granted_at: float  # g_i (first grant of this identity)
    deadline: float  # d_i = g_i + l
    committed_before_grant: bool
    generation: int
    req_id: str | None = None  # handoff target (lease_bind)
    mismatch: bool = False  # a handoff check already failed once

    @property
    def key(self) -> FifoKey:
        return fifo_key(self.notice.ready_time, self.cid)


@dataclass
class Pending:
    """An announced continuation not yet received: a grant candidate."""

    notice: HistoryNotice
    hashes: list[BlockHash]
    resident: tuple[list[KVCacheBlock], ...] = ()
    size: int = 0  # |P_i| at the last lookup
    complete: bool = False  # every full block of the history was resident
    checked: list[tuple[KVCacheBlock, BlockHashWithGroupId | None]] = field(default_factory=list)
    epoch: int = -1  # pool hash epoch of the last check
    ids: frozenset[int] = frozenset()  # block ids of P_i
    listed: bool = False  # seen in a sender inventory

    @property
    def key(self) -> FifoKey:
        return fifo_key(self.notice.ready_time, self.notice.cid)


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
        native_extra: Callable[[], Iterable[Iterable[KVCacheBlock]]] = lambda: (),
    ) -> None:
        if kappa < 0 or not math.isfinite(kappa):
            raise ValueError(f"kappa must be a finite non-negative number, got {kappa}")
        if cfg.headroom_blocks < 0 or cfg.lease_lifetime_s <= 0:
            raise ValueError(f"bad lease config: {cfg}")
        self.kv = kv
        self.pool = LeaseBlockPool.adopt(kv.block_pool)
        for m in kv.coordinator.single_type_managers:
            if m.block_pool is not self.pool:
                raise NotImplementedError("leases need one shared block pool for all groups")
        self.cfg = cfg
        self.kappa = kappa
        self.clock = clock
        self.load = load
        self.native_extra = native_extra
        self._hash_args = (hash_block_size, hash_algo)
        self._hasher: Hasher | None = None  # lazy: NONE_HASH is set after the scheduler
        self._group_block_sizes = [m.block_size for m in kv.coordinator.single_type_managers]

        self.leases: dict[ContinuationId, Lease] = {}
        self.holders: dict[int, set[ContinuationId]] = {}  # block id -> leases holding it
        self.pending: dict[ContinuationId, Pending] = {}
        self.first_grant: dict[ContinuationId, float] = {}
        self.committed: set[ContinuationId] = set()
        self.bound: dict[str, ContinuationId] = {}  # request id -> continuation
        self.latest_version: dict[tuple[str, int], int] = {}
        self.inv: SenderInventory | None = None
        self.inv_phase: dict[ContinuationId, Phase] = {}  # phases in the latest inventory

        self.generation = 0
        self.budget = _NO_BUDGET
        self.denials: list[DenialEvent] = []
        self._refused: set[tuple[str, ContinuationId]] = set()  # per generation
        self.counters: Counter[str] = Counter()
        self._u_area = 0.0
        self._u_t = clock()
        self._released = False  # a release since the last replenishment
        self._released_all = False
        self._records: tuple[tuple[int, int, int], tuple[LeaseRecord, ...]] = ((-1, -1, -1), ())

    # -- public operations (engine thread) ---------------------------------

    def notice(self, n: HistoryNotice) -> None:
        """A result is ready: find ``P_i``, evaluate the budget, try FIFO grants."""
        if n.payload_bytes < 0:
            raise ValueError(f"{n.cid.key()}: negative payload_bytes {n.payload_bytes}")
        now = self.clock()
        self.maintain(now)
        if not self._supersede(n.cid):
            self.counters["stale_notices"] += 1
            return
        if n.cid in self.pending or n.cid in self.leases:
            self.counters["repeat_notices"] += 1  # a repeat leaves the lease unchanged
            return
        phase = self.inv_phase.get(n.cid)
        if phase in (Phase.RECEIVED, Phase.CANCELLED):
            self.counters["late_notices"] += 1  # nothing left to protect ahead of receipt
            return
        self.pending[n.cid] = Pending(n, self._hash(n), listed=phase is not None)
        view = self._view(now)
        self._evaluate(now, view)
        self._replenish(now, view)

    def inventory(self, inv: SenderInventory) -> None:
        """The sender's causal inventory changed: track phases, then replenish."""
        if inv.rate <= 0 or inv.q_b < 0 or inv.overhead < 0:
            raise ValueError(f"bad sender inventory: rate {inv.rate}, Q_B {inv.q_b}")
        now = self.clock()
        self.maintain(now)
        seen_before = {c for c, p in self.pending.items() if p.listed}
        fresh = self.inv is None
        self.inv = inv
        self.inv_phase = {it.cid: it.phase for it in inv.items}
        listed: set[ContinuationId] = set()
        for it in inv.items:
            self._supersede(it.cid)
            listed.add(it.cid)
            if it.phase is not Phase.PENDING:
                self.committed.add(it.cid)
            if it.phase is Phase.CANCELLED:
                self._cancel(it.cid, "cancellations")
            elif it.phase is Phase.RECEIVED:
                self._forget(it.cid)
            elif (p := self.pending.get(it.cid)) is not None:
                fresh |= not p.listed
                p.listed = True
        for cid in seen_before - listed:  # left the inventory: received (lease stays)
            self._forget(cid)
        view = self._view(now)
        if fresh:  # first real offer of a result to the sender
            self._evaluate(now, view)
        self._replenish(now, view)

    def bind(self, cid: ContinuationId, req_id: str) -> None:
        """``cid`` was registered with the engine as ``req_id``: the handoff target."""
        self.maintain(self.clock())
        self.committed.add(cid)
        self._forget(cid)
        lease = self.leases.get(cid)
        if lease is not None:
            lease.req_id = req_id
            self.bound[req_id] = cid
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

    def before_schedule(self) -> None:
        """``schedule()`` entry: expiry and revocation before vLLM allocates."""
        now = self.clock()
        self.maintain(now)
        self._refill(now)

    def after_schedule(self, num_scheduled_tokens: dict[str, int]) -> None:
        """Handoff of bound continuations whose allocation succeeded this step."""
        now = self.clock()
        for req_id, n in num_scheduled_tokens.items():
            cid = self.bound.get(req_id)
            if cid is None or n <= 0:
                continue
            lease = self.leases.get(cid)
            if lease is None:
                del self.bound[req_id]
            elif self._covers(lease, req_id):
                self._release(lease, LeaseStatus.HANDED_OFF, "handoffs", now)
            elif not lease.mismatch:
                lease.mismatch = True
                self.counters["handoff_mismatches"] += 1
        self._refill(now)

    def drop_all(self, counter: str) -> None:
        """Release every lease (prefix-cache reset, end of run)."""
        now = self.clock()
        self._strip(now)
        for lease in sorted(self.leases.values(), key=lambda x: x.key):
            self._release(lease, LeaseStatus.CANCELLED, counter, now)

    def release_all(self) -> None:
        """End of run: release every lease and forget all candidates."""
        self.drop_all("released_at_end")
        self.pending.clear()
        self.bound.clear()
        self.first_grant.clear()
        self.committed.clear()
        self.latest_version.clear()
        self.inv, self.inv_phase = None, {}
        self.denials = []
        self._released = False
        self._released_all = True

    # -- maintenance -------------------------------------------------------

    def maintain(self, now: float) -> bool:
        """Strip, expire, revoke; True if any lease reference was released."""
        before = self.pool.refs_released
        self._strip(now)
        self._expire(now)
        self._revoke(now)
        self._drop_stale(now)
        return self.pool.refs_released != before

    def _strip(self, now: float) -> None:
        """Leased blocks whose hash was stripped leave their leases (prefix cut there)."""
        for bid in self.pool.take_stripped():
            for cid in list(self.holders.get(bid, ())):
                self._cut(self.leases[cid], now)

    def _cut(self, lease: Lease, now: float) -> None:
        sizes = self._group_block_sizes
        bad = [
            lease.slots[k] for k, b in enumerate(lease.blocks) if b.block_hash != lease.hashes[k]
        ]
        if not bad:
            return
        # Hashes chain: the prefix ends where the first block broke (in tokens).
        limit = min(pos * sizes[g] for g, pos in bad)
        keep = [(pos + 1) * sizes[g] <= limit for g, pos in lease.slots]
        dropped = [b for b, ok in zip(lease.blocks, keep, strict=True) if not ok]
        if len(dropped) == len(lease.blocks):
            self._release(lease, LeaseStatus.CANCELLED, "stripped_leases", now)
            return
        self._integrate(now)
        self.pool.lease_free(dropped)
        for b in dropped:
            self._unhold(b.block_id, lease.cid)
        lease.blocks = [b for b, ok in zip(lease.blocks, keep, strict=True) if ok]
        lease.slots = [s for s, ok in zip(lease.slots, keep, strict=True) if ok]
        lease.hashes = [h for h, ok in zip(lease.hashes, keep, strict=True) if ok]
        self.counters["stripped_blocks"] += len(dropped)
        self._released = True

    def _expire(self, now: float) -> None:
        due = [x for x in self.leases.values() if x.deadline <= now]
        for lease in sorted(due, key=lambda x: x.key):
            self._release(lease, LeaseStatus.EXPIRED, "expiries", now)

    def _revoke(self, now: float) -> None:
        """Keep ``H`` free: untimely handoffs first, then latest deadline first (ours)."""
        h = self.cfg.headroom_blocks
        if not self.leases or self.pool.get_num_free_blocks() >= h:
            return
        link = self._link_times()
        delay = self._engine_delay()

        def timely(x: Lease) -> bool:
            t = link.get(x.cid, math.inf) if x.cid in self.pending else 0.0
            return now + t + delay <= x.deadline

        order = sorted(self.leases.values(), key=lambda x: (timely(x), -x.deadline, x.key))
        for lease in order:
            if self.pool.get_num_free_blocks() >= h:
                break
            gain = sum(
                1 for b in lease.blocks if b.ref_cnt == 1 and self.pool.lease_ref(b.block_id) == 1
            )
            if gain > 0:  # revoking a lease that frees nothing would not help H
                self._release(lease, LeaseStatus.REVOKED, "revocations", now)

    def _drop_stale(self, now: float) -> None:
        """Forget announced results the sender never listed within ``l`` (bounded memory)."""
        horizon = self.cfg.lease_lifetime_s
        for cid, p in list(self.pending.items()):
            if not p.listed and p.notice.ready_time + horizon < now:
                self._forget(cid)

    # -- budget and grants -------------------------------------------------

    def _view(self, now: float) -> list[tuple[Pending, bud.Candidate]]:
        """Current pending candidates in FIFO order with fresh ``P_i``, ``tau``, ``T_B``."""
        link = self._link_times()
        delay = self._engine_delay()
        out: list[tuple[Pending, bud.Candidate]] = []
        for p in sorted(self.pending.values(), key=lambda x: x.key):
            cid = p.notice.cid
            self._resident(p)
            tau = bud.remaining_horizon(self.cfg.lease_lifetime_s, self.first_grant.get(cid), now)
            t_b = bud.time_to_allocation(link.get(cid, math.inf), delay)
            out.append((p, bud.Candidate(cid, p.ids, tau, t_b)))
        return out

    def _resident(self, p: Pending) -> list[KVCacheBlock]:
        """``P_i`` now; a complete prefix whose hashes all still hold is not looked up again.

        Removing a hash is the only way a complete prefix can change, so the
        check is O(1) while no hash was removed anywhere, O(|P_i|) attribute
        reads after one (far cheaper than vLLM's lookup), and a full lookup when
        the prefix was incomplete (it may have grown) or broke.
        """
        epoch = self.pool.hash_epoch
        if p.complete and (p.epoch == epoch or all(b.block_hash == h for b, h in p.checked)):
            p.epoch = epoch
            return [b for b, _ in p.checked]
        n = len(p.notice.token_ids)
        p.resident, hit = lookup_hit(self.kv, p.hashes, n)
        blocks = flatten(p.resident)
        p.size = len(blocks)
        p.checked = [(b, b.block_hash) for b in blocks]
        p.ids = frozenset(b.block_id for b in blocks)
        p.complete = bool(blocks) and hit >= n // self._hash_args[0] * self._hash_args[0]
        p.epoch = epoch
        return blocks

    def _evaluate(self, now: float, view: list[tuple[Pending, bud.Candidate]]) -> None:
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
            self.pool.num_leased_blocks,
            self.pool.get_num_free_blocks(),
            self.cfg.headroom_blocks,
        )

    def _refill(self, now: float) -> None:
        """Replenish after a release (a fresh view; the budget stays as evaluated)."""
        if self._released and self.pending:
            self._replenish(now, self._view(now))
        self._released = False

    def _replenish(self, now: float, view: list[tuple[Pending, bud.Candidate]]) -> None:
        """FIFO grants over unprotected near-use candidates under the current ``B``."""
        self._released = False
        if not self.cfg.enabled:
            return
        near = {c.key for c in bud.near_use_set(c for _, c in view)}
        for p, c in view:
            if c.key in near and p.notice.cid not in self.leases:
                self._grant(p, c, now)

    def _grant(self, p: Pending, c: bud.Candidate, now: float) -> bool:
        cid = p.notice.cid
        blocks = flatten(p.resident)
        used = self.pool.num_leased_blocks
        delta = sum(1 for b in blocks if self.pool.lease_ref(b.block_id) == 0)
        taken = sum(1 for b in blocks if b.ref_cnt == 0)  # these leave the free queue
        if self.pool.get_num_free_blocks() - taken < self.cfg.headroom_blocks:
            self._refuse("headroom_refusals", cid)
            return False
        if used + delta > self.budget.B:
            if self._refuse("denials", cid):
                self.denials.append(
                    DenialEvent(cid, now, self.generation, delta, self.budget.B, used)
                )
            return False
        self._acquire(p, now)
        return True

    def _refuse(self, kind: str, cid: ContinuationId) -> bool:
        """Count a refusal once per identity and generation; True if new."""
        if (kind, cid) in self._refused:
            return False
        self._refused.add((kind, cid))
        self.counters[kind] += 1
        return True

    # -- lock / unlock -----------------------------------------------------

    def _acquire(self, p: Pending, now: float) -> Lease:
        cid = p.notice.cid
        blocks: list[KVCacheBlock] = []
        slots: list[tuple[int, int]] = []
        hashes: list[BlockHashWithGroupId] = []
        for g, row in enumerate(p.resident):
            for pos, b in enumerate(row):
                if b.is_null:
                    continue
                assert b.block_hash is not None, "a cache hit without a hash"
                blocks.append(b)
                slots.append((g, pos))
                hashes.append(b.block_hash)
        self._integrate(now)
        self.pool.lease_touch(blocks)
        for b in blocks:
            self.holders.setdefault(b.block_id, set()).add(cid)
        g_i = self.first_grant.setdefault(cid, now)
        before = cid in self.committed
        lease = Lease(
            cid, p.notice, blocks, slots, hashes, g_i, g_i + self.cfg.lease_lifetime_s,
            before, self.generation,
        )  # fmt: skip
        self.leases[cid] = lease
        self.counters["grants"] += 1
        self.counters["grants_after_commit" if before else "grants_before_commit"] += 1
        self._released_all = False
        return lease

    def _release(self, lease: Lease, status: LeaseStatus, counter: str, now: float) -> bool:
        """Give back exactly this lease's references, once (idempotent)."""
        if self.leases.get(lease.cid) is not lease:
            return False
        self._integrate(now)
        del self.leases[lease.cid]
        for b in lease.blocks:
            self._unhold(b.block_id, lease.cid)
        self.pool.lease_free(lease.blocks)
        lease.blocks = []
        if lease.req_id is not None and self.bound.get(lease.req_id) == lease.cid:
            del self.bound[lease.req_id]
        self.counters[counter] += 1
        self.counters[f"ended_{status.value}"] += 1
        self._released = True
        return True

    def _unhold(self, block_id: int, cid: ContinuationId) -> None:
        s = self.holders.get(block_id)
        if s is not None:
            s.discard(cid)
            if not s:
                del self.holders[block_id]

    # -- helpers -----------------------------------------------------------

    def _hash(self, n: HistoryNotice) -> list[BlockHash]:
        if not self.kv.enable_caching or not n.token_ids:
            return []
        if self._hasher is None:
            self._hasher = make_hasher(*self._hash_args)
        return prefix_hashes(n.token_ids, self._hasher, cache_salt=n.cache_salt)

    def _supersede(self, cid: ContinuationId) -> bool:
        """Invalidate older versions of ``cid``'s turn; False if ``cid`` itself is old."""
        turn = (cid.workflow, cid.turn)
        latest = self.latest_version.get(turn)
        if latest is not None and cid.version < latest:
            return False
        if latest is None or cid.version > latest:
            self.latest_version[turn] = cid.version
            for old in {*self.pending, *self.leases}:
                if (old.workflow, old.turn) == turn and old.version < cid.version:
                    self._cancel(old, "invalidations")
        return True

    def _cancel(self, cid: ContinuationId, counter: str) -> None:
        lease = self.leases.get(cid)
        known = lease is not None or cid in self.pending
        if lease is not None:
            self._release(lease, LeaseStatus.CANCELLED, counter, self.clock())
        elif known:
            self.counters[counter] += 1
        self._forget(cid)

    def _forget(self, cid: ContinuationId) -> None:
        """No longer a grant candidate (received, cancelled, stale); a lease stays."""
        self.pending.pop(cid, None)
        if cid not in self.leases:
            self.first_grant.pop(cid, None)
            self.committed.discard(cid)

    def _covers(self, lease: Lease, req_id: str) -> bool:
        """The request's block table holds every protected block's hash at its position."""
        table = self.kv.coordinator.get_blocks(req_id)
        for (g, pos), h in zip(lease.slots, lease.hashes, strict=True):
            row = table[g]
            if pos >= len(row) or row[pos].block_hash != h:
                return False
        return True

    def _link_times(self) -> dict[ContinuationId, float]:
        """``(Q_B + sum_{j<=i}(h + p_j)) / R`` per pending identity; committed: ``Q_B / R``."""
        inv = self.inv
        if inv is None:
            return {}  # no link rate known yet: T_B is infinite
        out: dict[ContinuationId, float] = {}
        queue: list[tuple[FifoKey, ContinuationId, int]] = []
        for it in inv.items:
            if it.phase is Phase.PENDING:
                queue.append((fifo_key(it.ready_time, it.cid), it.cid, it.payload_bytes))
            elif it.phase is Phase.COMMITTED:
                out[it.cid] = inv.q_b / inv.rate
        for cid, p in self.pending.items():
            if not p.listed:  # announced, about to be offered: joins the FIFO tail
                queue.append((p.key, cid, p.notice.payload_bytes))
        queue.sort(key=lambda e: e[0])
        times = bud.fifo_wait_times(inv.q_b, [e[2] for e in queue], inv.overhead, inv.rate)
        for (_, cid, _), t in zip(queue, times, strict=True):
            out[cid] = t
        return out

    def _engine_delay(self) -> float:
        w, a, m = self.load()
        return bud.engine_delay(self.kappa, w, a, m)

    def _integrate(self, now: float) -> None:
        """Protection block-seconds: the time integral of ``U``."""
        if now > self._u_t:
            self._u_area += self.pool.num_leased_blocks * (now - self._u_t)
        self._u_t = max(self._u_t, now)

    def exclusive(self, lease: Lease) -> int:
        """``|E_i|``: blocks of the lease protected by no other lease."""
        return sum(1 for b in lease.blocks if self.pool.lease_ref(b.block_id) == 1)

    # -- publication and audit ---------------------------------------------

    def records(self) -> tuple[LeaseRecord, ...]:
        """Active lease records, rebuilt only after a lease change or a new generation."""
        key = (self.pool.refs_added, self.pool.refs_released, self.generation)
        if self._records[0] != key:
            self._records = (key, self._build_records())
        return self._records[1]

    def _build_records(self) -> tuple[LeaseRecord, ...]:
        return tuple(
            LeaseRecord(
                cid=x.cid,
                prefix_digest=x.notice.prefix_digest,
                payload_digest=x.notice.payload_digest,
                protected_blocks=tuple(b.block_id for b in x.blocks),
                exclusive_blocks=self.exclusive(x),
                granted_at=x.granted_at,
                deadline=x.deadline,
                generation=self.generation,
                status=LeaseStatus.GRANTED,
                committed_before_grant=x.committed_before_grant,
            )
            for x in sorted(self.leases.values(), key=lambda x: x.key)
        )

    def snapshot_counters(self, now: float) -> dict[str, float]:
        self._integrate(now)
        out: dict[str, float] = dict.fromkeys(LEASE_COUNTERS, 0.0)
        out.update((k, float(v)) for k, v in self.counters.items())
        out["protection_block_seconds"] = self._u_area
        out["refs_added"] = float(self.pool.refs_added)
        out["refs_released"] = float(self.pool.refs_released)
        out["active_leases"] = float(len(self.leases))
        return out

    def state(self, seq: int) -> EngineState:
        """A frozen snapshot (spec 3.4): leases, budget, load, denials, resident sizes."""
        now = self.clock()
        w, a, m = self.load()
        used = self.pool.num_leased_blocks
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
            kappa=self.kappa,
            leases=self.records(),
            denials=tuple(self.denials),
            resident=tuple(
                (p.notice.cid, p.size) for p in sorted(self.pending.values(), key=lambda x: x.key)
            ),
            counters=self.snapshot_counters(now),
        )

    def check(self) -> None:
        """Raise :class:`LeaseIntegrityError` unless every count agrees (see contract)."""
        check_pool(self.pool, native_refs(self.kv.coordinator, self.pool, self.native_extra()))
        held: Counter[int] = Counter()
        for x in self.leases.values():
            if len({b.block_id for b in x.blocks}) != len(x.blocks):
                raise LeaseIntegrityError(f"lease {x.cid.key()} holds a block twice")
            for b, h in zip(x.blocks, x.hashes, strict=True):
                held[b.block_id] += 1
                if b.block_hash != h and b.block_id not in self.pool._stripped:
                    raise LeaseIntegrityError(f"lease {x.cid.key()}: block {b.block_id} rehashed")
                if x.cid not in self.holders.get(b.block_id, ()):
                    raise LeaseIntegrityError(f"holder index misses block {b.block_id}")
        if held != Counter(self.pool.lease_refs):
            raise LeaseIntegrityError("lease ledger disagrees with the leases' blocks")
        if set(self.holders) != set(held):
            raise LeaseIntegrityError("holder index has blocks no lease holds")

    def audit(self) -> dict[str, float]:
        """Added vs released references; raises on any mismatch."""
        self.check()
        held = sum(self.pool.lease_refs.values())
        out = self.snapshot_counters(self.clock())
        out["refs_held"] = float(held)
        if self.pool.refs_added != self.pool.refs_released + held:
            raise LeaseIntegrityError(
                f"references added {self.pool.refs_added} != released "
                f"{self.pool.refs_released} + held {held}"
            )
        if self._released_all and (self.leases or held):
            raise LeaseIntegrityError(f"{len(self.leases)} leases remain after release_all")
        return out
