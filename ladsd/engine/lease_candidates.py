"""Grant candidates: announced results on their way to the engine (spec 3.1-3.2).

Contract (mini-sglang style: one owner per structure):

* Owns: the announced pending results (``pending``: each
  :class:`~ladsd.records.HistoryNotice` becomes a :class:`LeaseCandidate` with its
  block hashes, its last resident prefix ``P_i``, its commitment mark and its
  first grant time ``g_i``); the sender's latest causal inventory (``inv`` and
  its ``phases``); the version of the one live continuation of each turn
  (``latest``); and the FIFO view the budget and the grants read.
* Holds no block references: ``P_i`` is looked up in vLLM's prefix cache and
  re-checked through the pool's hash epoch, never touched (no lock/unlock here).
* Callers: only :class:`~ladsd.engine.lease_book.LeaseBook`, on the engine
  thread; nothing locks. The book decides when a continuation stops being a
  candidate (:meth:`forget`: received, registered, cancelled, superseded,
  never listed) and when it is *settled* (:meth:`settle`: it has no candidate
  entry and no lease left).
* Memory: a continuation is *live* while it has a candidate entry or a lease;
  at most one continuation per turn is live (an announcement supersedes older
  versions). ``latest`` holds exactly the turns with a live continuation, so
  everything here is bounded by the live continuations plus the sender's
  inventory. ``g_i`` and the commitment mark live on the :class:`LeaseCandidate`:
  grants happen only to candidates, so a continuation can be granted (and
  re-granted with its first ``g_i``) exactly while it is a candidate.
* Integrity: :meth:`check_integrity`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock

from ladsd.engine import budget as bud
from ladsd.engine.lease_hashes import NoticeHashes
from ladsd.engine.lease_pool import LeaseBlockPool, LeaseIntegrityError
from ladsd.engine.lease_resident import (
    Prefix,
    lookup_hit,
    make_hasher,
    plain_lookup,
    unchanged,
)
from ladsd.records import ContinuationId, HistoryNotice, InventoryItem, Phase, SenderInventory

Turn = tuple[str, int]  # (workflow, turn)
View = list[tuple["LeaseCandidate", bud.Candidate]]


def turn_of(cid: ContinuationId) -> Turn:
    return (cid.workflow, cid.turn)


def check_notice(n: HistoryNotice) -> None:
    """Raise ValueError for a notice no candidate can come from (before any state changes)."""
    if n.payload_bytes < 0:
        raise ValueError(f"{n.cid.key()}: negative payload_bytes {n.payload_bytes}")
    if n.continuation_p is not None and not 0.0 <= n.continuation_p <= 1.0:
        raise ValueError(f"{n.cid.key()}: continuation_p {n.continuation_p} not in [0, 1]")
    if n.lifetime_s is not None and not 0.0 < n.lifetime_s < math.inf:
        raise ValueError(f"{n.cid.key()}: lifetime_s {n.lifetime_s} must be positive, finite")


@dataclass
class LeaseCandidate:
    """An announced continuation not yet received: a grant candidate."""

    notice: HistoryNotice
    hashes: list[BlockHash]
    resident: tuple[list[KVCacheBlock], ...] = ()  # P_i per group, as vLLM's lookup gave it
    prefix: Prefix = Prefix()  # P_i flattened, with each block's hash at the lookup
    complete: bool = False  # every full block of the history was resident
    epoch: int = -1  # pool hash epoch of the last check
    listed: bool = False  # seen in a sender inventory
    committed: bool = False  # seen committed (or later) by the sender
    granted_at: float | None = None  # g_i, fixed by the first grant

    @property
    def cid(self) -> ContinuationId:
        return self.notice.cid

    @property
    def key(self) -> tuple[float, ContinuationId]:
        return bud.fifo_key(self.notice.ready_time, self.notice.cid)

    @property
    def size(self) -> int:
        """``|P_i|`` at the last lookup (0: cold)."""
        return len(self.prefix)

    @property
    def ids(self) -> frozenset[int]:
        """Block ids of ``P_i`` at the last lookup."""
        return self.prefix.ids


class Candidates:
    """Announced results, the sender's inventory and the FIFO view (see the contract)."""

    def __init__(
        self,
        kv: KVCacheManager,
        pool: LeaseBlockPool,
        lifetime: float,
        hash_block_size: int,
        hash_algo: str = "sha256",
    ) -> None:
        self.kv = kv
        self.pool = pool
        self.lifetime = lifetime  # l: the default of every l_i (lifetime_of)
        self._hash_args = (hash_block_size, hash_algo)
        self._hashes: NoticeHashes | None = None  # lazy: NONE_HASH is set after the scheduler
        self._plain: bool | None = None  # lazy: plain_lookup(kv), see refresh
        self.pending: dict[ContinuationId, LeaseCandidate] = {}
        self.latest: dict[Turn, int] = {}  # version of the live continuation per turn
        self.inv: SenderInventory | None = None
        self.phases: dict[ContinuationId, Phase] = {}  # phases in the latest inventory
        # Moves when a candidate comes or goes or its |P_i| changes: sizes_of is kept
        # until then (a state is published after nearly every engine step).
        self.version = 0
        self._sizes: tuple[int, tuple[tuple[ContinuationId, int], ...]] = (-1, ())
        # No candidate turns unlisted before this (a lower bound: only an announcement
        # adds a time): unlisted() scans only past it (it runs at every schedule()).
        self._unlisted_at = math.inf

    # -- announcements and versions ------------------------------------------

    def stale(self, cid: ContinuationId) -> bool:
        """A newer version of ``cid``'s turn is live."""
        v = self.latest.get(turn_of(cid))
        return v is not None and cid.version < v

    def older(self, cid: ContinuationId) -> ContinuationId | None:
        """The live continuation that ``cid`` supersedes (an older version of its turn)."""
        v = self.latest.get(turn_of(cid))
        if v is None or v >= cid.version:
            return None
        return ContinuationId(cid.workflow, cid.turn, v)

    def announce(self, n: HistoryNotice) -> LeaseCandidate:
        """A new candidate; call after superseding older versions of its turn."""
        turn = turn_of(n.cid)
        if self.latest.get(turn, n.cid.version) != n.cid.version or n.cid in self.pending:
            raise LeaseIntegrityError(f"{n.cid.key()} announced while its turn is live")
        phase = self.phases.get(n.cid)
        # A result with an expected wait (ladsd serve's intent) travels outside the
        # daemon's link: no inventory will list it, its own timing stands in.
        listed = phase is not None or n.expected_wait_s is not None
        p = LeaseCandidate(n, self._hash(n), listed=listed, committed=phase is Phase.COMMITTED)
        self.pending[n.cid] = p
        self.latest[turn] = n.cid.version
        self.version += 1
        self._unlisted_at = min(self._unlisted_at, self._unlisted_time(p))
        return p

    def forget(self, cid: ContinuationId) -> bool:
        """No longer a grant candidate; True if it was one. A lease is not affected."""
        if self.pending.pop(cid, None) is None:
            return False
        self.version += 1
        return True

    def settle(self, cid: ContinuationId) -> None:
        """``cid`` has no candidate entry and no lease left: forget its turn's version."""
        turn = turn_of(cid)
        if cid not in self.pending and self.latest.get(turn) == cid.version:
            del self.latest[turn]

    def lifetime_of(self, n: HistoryNotice) -> float:
        """``l_i``: the notice's own lease lifetime (ours, ladsd serve), else ``l``."""
        return self.lifetime if n.lifetime_s is None else n.lifetime_s

    def unlisted(self, now: float) -> list[ContinuationId]:
        """Candidates the sender has not listed within ``l_i`` of readiness (or, for a
        result with an expected wait, not used within ``l_i`` after it)."""
        if now <= self._unlisted_at:
            return []
        times = {cid: self._unlisted_time(p) for cid, p in self.pending.items()}
        self._unlisted_at = min(times.values(), default=math.inf)  # the returned too
        return [cid for cid, t in times.items() if t < now]

    def _unlisted_time(self, p: LeaseCandidate) -> float:
        """When ``p`` turns unlisted (strictly after it); inf once listed without a wait.
        A listing only ever moves it to inf, so an earlier bound stays a bound."""
        n = p.notice
        if n.expected_wait_s is not None:  # past its expected use by more than l_i
            return n.ready_time + n.expected_wait_s + self.lifetime_of(n)
        return math.inf if p.listed else n.ready_time + self.lifetime_of(n)

    def clear(self) -> None:
        self.pending.clear()
        self.latest.clear()
        self.inv, self.phases = None, {}
        self.version += 1

    # -- the sender's inventory ------------------------------------------------

    def listed(self) -> set[ContinuationId]:
        """Candidates seen in a sender inventory so far."""
        return {c for c, p in self.pending.items() if p.listed}

    def observe(self, inv: SenderInventory) -> bool:
        """Take the latest inventory; True if it is the first one."""
        first = self.inv is None
        self.inv = inv
        self.phases = {it.cid: it.phase for it in inv.items}
        return first

    def mark(self, it: InventoryItem) -> bool:
        """Listing and commitment marks of a pending or committed item; True if newly listed."""
        p = self.pending.get(it.cid)
        if p is None:
            return False
        p.committed |= it.phase is not Phase.PENDING
        fresh, p.listed = not p.listed, True
        return fresh

    # -- the FIFO view ---------------------------------------------------------

    def ordered(self) -> list[LeaseCandidate]:
        return sorted(self.pending.values(), key=lambda x: x.key)

    def view(self, now: float, delay: float) -> View:
        """Candidates in FIFO order with fresh ``P_i``, ``tau`` and ``T_B`` (spec 3.1)."""
        link = self.link_times()
        out: View = []
        for p in self.ordered():
            self.refresh(p)
            tau = bud.remaining_horizon(self.lifetime_of(p.notice), p.granted_at, now)
            t_b = self.time_to_use(p, now, delay, link)
            out.append((p, bud.Candidate(p.cid, p.ids, tau, t_b)))
        return out

    def time_to_use(
        self, p: LeaseCandidate, now: float, delay: float, link: dict[ContinuationId, float]
    ) -> float:
        """``T_B_i``: the notice's expected wait when given, else the FIFO link time; + delay."""
        wait = p.notice.expected_wait_s
        if wait is not None:  # the harness's prediction instead of the link estimate
            return bud.time_to_allocation(max(0.0, p.notice.ready_time + wait - now), delay)
        return bud.time_to_allocation(link.get(p.cid, math.inf), delay)

    def link_times(self) -> dict[ContinuationId, float]:
        """``(Q_B + sum_{j<=i}(h + p_j)) / R`` per pending identity; committed: ``Q_B / R``."""
        inv = self.inv
        if inv is None:
            return {}  # no link rate known yet: T_B is infinite
        out: dict[ContinuationId, float] = {}
        queue: list[tuple[tuple[float, ContinuationId], int]] = []
        for it in inv.items:
            if it.phase is Phase.PENDING:
                queue.append((bud.fifo_key(it.ready_time, it.cid), it.payload_bytes))
            elif it.phase is Phase.COMMITTED:
                out[it.cid] = inv.q_b / inv.rate
        for p in self.pending.values():
            if not p.listed:  # announced, about to be offered: joins the FIFO tail
                queue.append((p.key, p.notice.payload_bytes))
        queue.sort(key=lambda e: e[0])
        times = bud.fifo_wait_times(inv.q_b, [e[1] for e in queue], inv.overhead, inv.rate)
        for ((_, cid), _), t in zip(queue, times, strict=True):
            out[cid] = t
        return out

    def resident(self, p: LeaseCandidate) -> Prefix:
        """``P_i`` now (:meth:`refresh`), flattened (false when cold)."""
        self.refresh(p)
        return p.prefix

    def refresh(self, p: LeaseCandidate) -> None:
        """Bring ``P_i`` up to date; a prefix that cannot have changed is not looked up again
        (:func:`~ladsd.engine.lease_resident.unchanged`)."""
        if self._plain is None:
            self._plain = plain_lookup(self.kv)
        pool = self.pool
        if unchanged(pool, self._plain, p.prefix, p.hashes, p.epoch, p.complete):
            p.epoch = pool.hash_epoch
            return
        n = len(p.notice.token_ids)
        size = p.size
        p.resident, hit = lookup_hit(self.kv, p.hashes, n)
        p.prefix = Prefix.of(p.resident)
        if p.size != size:
            self.version += 1
        p.complete = bool(p.prefix) and hit >= n // self._hash_args[0] * self._hash_args[0]
        p.epoch = pool.hash_epoch

    def sizes_of(self) -> tuple[tuple[ContinuationId, int], ...]:
        """``|P_i|`` per candidate at its last lookup, FIFO order (0 = cold)."""
        version, sizes = self._sizes
        if version != self.version:
            sizes = self._sizes_now()
            self._sizes = (self.version, sizes)
        return sizes

    def _sizes_now(self) -> tuple[tuple[ContinuationId, int], ...]:
        return tuple((p.cid, p.size) for p in self.ordered())

    def _hash(self, n: HistoryNotice) -> list[BlockHash]:
        if not self.kv.enable_caching or not n.token_ids:
            return []
        if self._hashes is None:  # lazy: NONE_HASH is set after the scheduler
            self._hashes = NoticeHashes(make_hasher(*self._hash_args), self._hash_args[0])
        return self._hashes.of(n.cid.workflow, n.token_ids, n.cache_salt)

    def hash_counts(self) -> tuple[int, int]:
        """Notice blocks whose hash was carried from the workflow's last history, and
        blocks hashed (:class:`~ladsd.engine.lease_hashes.NoticeHashes`)."""
        h = self._hashes
        return (h.reused, h.hashed) if h is not None else (0, 0)

    # -- integrity -------------------------------------------------------------

    def sizes(self) -> dict[str, int]:
        return {
            "pending": len(self.pending),
            "latest": len(self.latest),
            "phases": len(self.phases),
        }

    def check_live(self, held: Iterable[ContinuationId]) -> None:
        """Raise unless ``latest`` is exactly one version per turn of the live continuations.

        ``held``: the continuations a lease or a pin holds (the book's join).
        """
        live: dict[Turn, int] = {}
        for cid in {*self.pending, *held}:
            if live.setdefault(turn_of(cid), cid.version) != cid.version:
                raise LeaseIntegrityError(f"two versions of {cid.key()}'s turn are live")
        if live != self.latest:
            raise LeaseIntegrityError("turn versions disagree with the live continuations")

    def check_integrity(self) -> None:
        """Raise :class:`LeaseIntegrityError` unless the candidates are consistent."""
        for cid, p in self.pending.items():
            if p.cid != cid:
                raise LeaseIntegrityError(f"candidate {p.cid.key()} filed as {cid.key()}")
            if self.latest.get(turn_of(cid)) != cid.version:
                raise LeaseIntegrityError(f"candidate {cid.key()}: its turn is not live")
            ids = tuple(b.block_id for g in p.resident for b in g if not b.is_null)
            if p.prefix.block_ids != ids or p.prefix.ids != frozenset(ids):
                raise LeaseIntegrityError(f"candidate {cid.key()}: P_i cache disagrees")
        version, sizes = self._sizes
        if version == self.version and sizes != self._sizes_now():
            raise LeaseIntegrityError("resident sizes cached past a change (version not moved)")
        if self.inv is None and self.phases:
            raise LeaseIntegrityError("inventory phases without an inventory")
        if self.inv is not None and self.phases != {it.cid: it.phase for it in self.inv.items}:
            raise LeaseIntegrityError("inventory phases disagree with the inventory")
