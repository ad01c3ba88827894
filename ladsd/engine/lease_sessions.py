"""HEAR session-aware retention: the eviction order by ``r = p * exp(-idle / 400 s)``.

Contract (mini-sglang style; peers.md section 2):

* No references. Retention acts on the order of vLLM's free queue only
  (``FreeKVCacheBlockQueue``: vLLM evicts from its front); ``ref_cnt`` is
  never written, nothing is pinned, a session's blocks stay evictable.
* Sessions. A *live waiting session* is a workflow whose continuation was
  noticed (its result is ready, ``HistoryNotice``) and whose resumed request
  has not been allocated yet. It enters at the notice (readiness, the moment
  the harness describes the history, as for LADS and ttl-pin; ours) with the
  blocks of its resident prefix ``P_i`` and leaves when its bound request is
  scheduled (allocated), when it is cancelled or superseded, when its
  candidate is dropped unreceived before any request was bound to it, or at
  the end of the run, or when every request bound to it is freed unallocated
  (aborted; :meth:`Sessions.aborted`, ours). A session whose result is received
  before its request is bound is *kept* (:meth:`Sessions.received`, ours): it waits for the bind
  up to ``l_i`` after the receipt (:meth:`Sessions.expire`), since HEAR's
  session waits from its last request's end to its next one (until stop 55
  it left at the receipt: 60-80 of 96 sessions on captured-scaled seed 16, a
  race with the request's registration, whose blocks then fell to the front of
  the session region while the agent built the request). At most one entry
  per workflow: a newer notice replaces it.
* Priority. ``p`` is the notice's ``continuation_p`` (the harness's estimate
  from completed sessions; :data:`P_PRIOR` when absent); ``idle`` is the time
  since the session's last request ended, engine-side: the earliest free stamp
  of ``P_i``'s free blocks (every block of the history was freed when that
  request ended; a block freed later was shared with another request).
  The order of two sessions never changes with time (both ``idle`` grow
  alike), so it changes only when a session enters or leaves.
* Order (front = evicted first): blocks of no live waiting session keep
  vLLM's own order (LRU, hashless blocks first) ahead of every session block;
  then sessions by ascending ``r`` (ties: identity); within a session its tail
  before its head, as vLLM frees a request. A block of several sessions'
  prefixes goes with the highest ``r``. Only the prefix up to the first block
  whose hash changed counts (a hit stops at the first miss).
* When (ours): :meth:`Sessions.reorder` runs at ``schedule()`` entry, before
  vLLM allocates (every eviction happens inside ``schedule()``), and only if a
  session entered or left or a block was freed since the last reorder (frees
  join the tail of the queue, behind the sessions). Frees inside a step
  (preemption) join the tail until the next step. Cost: O(S) for the S
  session blocks (plus ranking the sessions), on such steps only, unless the
  *splice* applies (:class:`Placed`): no session entered, none left but by
  allocation with its own blocks referenced and in no other waiting prefix (they
  are let go: freed again, they are foreign frees), and none of their blocks lost
  its hash since the order was computed (``LeaseBlockPool.watched_lost``), so
  every other session block keeps its rank and the
  blocks placed are still in order (vLLM only removes from the middle of the
  queue). The session blocks freed since (``watched_freed``: a request that
  shared a head ended) go back to their places before the next free block of
  higher rank; every other block behind the placed run was freed since and
  belongs to no session, and that run moves in front of the first placed
  block, O(1). Cost: O(F) for F such frees, plus the referenced blocks skipped
  to find each place and the run's ends (a hit or a re-free moves them
  inwards). An eviction of a session block strips its hash: the full order.
  The full order reads a session's hashes again only if one of its blocks lost
  its hash since (``LeaseBlockPool.watched_lost``); a whole prefix is kept
  (``WaitingSession.tail``), a broken one is read every time.
* Callers: only :class:`~ladsd.engine.lease_book.LeaseBook`, on the engine
  thread; nothing locks. Memory: bounded by the live workflows.
* Retention ``SESSION`` (hear-session) and ``LADS_SESSION`` (lads-adaptive, ours):
  beside LADS leases a leased block is referenced, never free, so the order
  acts exactly on the waiting histories no lease holds (skipped: ``ref_cnt > 0``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_utils import (
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)

from ladsd.engine.lease_pool import LeaseBlockPool, LeaseIntegrityError
from ladsd.engine.lease_resident import Prefix
from ladsd.records import SESSION_AUDIT, ContinuationId

SESSION_TAU_S = 400.0  # HEAR's idle decay constant
P_PRIOR = 0.5  # (ours) p of a notice that carries none: no information either way


def retention_priority(p: float, idle: float, tau: float = SESSION_TAU_S) -> float:
    """HEAR's ``r = p * exp(-idle / tau)``; the lowest ``r`` is evicted first."""
    if not 0.0 <= p <= 1.0 or tau <= 0:
        raise ValueError(f"bad retention priority inputs: p {p}, tau {tau}")
    return p * math.exp(-max(0.0, idle) / tau)


@dataclass
class WaitingSession:
    """One live waiting session: its prefix blocks, ``p`` and when it went idle."""

    cid: ContinuationId
    p: float
    ended_at: float  # its last request ended (engine-side free stamps)
    blocks: list[KVCacheBlock]  # P_i at the notice, prefix order per group
    hashes: list[BlockHashWithGroupId]
    spans: list[tuple[int, int]]  # (first token, end token) of each block in the history
    reqs: list[str] = field(default_factory=list)  # requests registered for it
    # valid() tail first, kept while the whole prefix is valid: it stays so until one
    # of its blocks loses its hash (LeaseBlockPool.watched_lost), so the full order
    # does not compare every session's hashes again (controller CPU).
    tail: list[KVCacheBlock] | None = field(default=None, repr=False)
    ids: frozenset[int] = field(default=frozenset(), repr=False)  # the blocks' ids

    def __post_init__(self) -> None:
        if not self.ids:  # Sessions.enter passes the Prefix's own set
            self.ids = frozenset(b.block_id for b in self.blocks)

    def r(self, now: float) -> float:
        return retention_priority(self.p, now - self.ended_at)

    def tail_first(self, lost: set[int]) -> list[KVCacheBlock]:
        """The valid prefix, tail first (stable: prefix order per group); ``lost``: the
        watched blocks that lost their hash since the last call."""
        if self.tail is not None and lost.isdisjoint(self.ids):
            return self.tail
        valid = self.valid()
        tail = [b for b, _ in sorted(valid, key=lambda e: -e[1])]
        # Whole: kept until one of its blocks is lost; a broken prefix is read again
        # each time (a block may be cached back with its hash).
        self.tail = tail if len(valid) == len(self.blocks) else None
        return tail

    def valid(self) -> list[tuple[KVCacheBlock, int]]:
        """(block, end token) of the prefix up to the first block whose hash changed."""
        broken = [
            start
            for b, h, (start, _) in zip(self.blocks, self.hashes, self.spans, strict=True)
            if b.block_hash != h
        ]
        limit = min(broken, default=math.inf)
        return [
            (b, end) for b, (_, end) in zip(self.blocks, self.spans, strict=True) if end <= limit
        ]


@dataclass
class SessionCounts:
    """How sessions left and how the order was kept (the audit and the run files
    report them)."""

    computed: int = 0  # reorders that computed the order
    splices: int = 0  # reorders done by the splice
    put_back: int = 0  # session blocks a splice put back in their places
    let_go: int = 0  # sessions left by allocation that a splice let go
    allocated: int = 0  # left: their bound request was scheduled
    unbound: int = 0  # left: the candidate dropped with no request bound (not received)
    ended: int = 0  # left: cancelled or superseded
    replaced: int = 0  # left: a newer notice of the workflow entered
    kept: int = 0  # received before their bind: kept waiting for it (ours)
    expired: int = 0  # left: kept, and no bind came within l of the receipt
    aborted: int = 0  # left: every request bound to it was freed unallocated

    def audit(self) -> dict[str, float]:
        """The counts under their audit names (:data:`~ladsd.records.SESSION_AUDIT`)."""
        return {name: float(getattr(self, k)) for k, name in SESSION_AUDIT.items()}


class Sessions:
    """Live waiting sessions and the free-queue order they impose (see the contract)."""

    def __init__(self, pool: LeaseBlockPool, block_sizes: Sequence[int]) -> None:
        self.pool = pool
        self.block_sizes = list(block_sizes)
        self.entries: dict[str, WaitingSession] = {}  # workflow -> its live waiting session
        self.by_req: dict[str, str] = {}  # request id -> workflow
        self.version = 0  # bumps when a session enters or leaves
        self._seen: tuple[int, int] = (-1, -1)  # (version, free epoch) at the last reorder
        self._placed: Placed | None = None  # what the last full order placed
        self._watched_for = -1  # the version pool.watched was built for
        self.counts = SessionCounts()
        # Received before their bind (workflow -> until when they wait for it, ours).
        self.kept: dict[str, float] = {}
        self._left: list[str] = []  # allocated since the last order (workflows)
        self._changed = False  # since the last order: an entry, or a leave not allocated

    def enter(
        self,
        cid: ContinuationId,
        p: float,
        prefix: Prefix,
        now: float,
    ) -> WaitingSession:
        """``cid``'s result is ready: its session waits with ``P_i`` = ``prefix``."""
        if self._drop(cid.workflow):
            self.counts.replaced += 1
        sizes = self.block_sizes
        spans = [(pos * sizes[g], (pos + 1) * sizes[g]) for g, pos in prefix.slots]
        stamps = map(self.pool.freed_at.get, prefix.unreferenced())
        ended = min((t for t in stamps if t is not None), default=now)
        retention_priority(p, 0.0)  # validates p
        s = WaitingSession(
            cid, p, min(ended, now), list(prefix.blocks), list(prefix.hashes), spans, ids=prefix.ids
        )
        self.entries[cid.workflow] = s
        self.version += 1
        self._changed = True
        return s

    def bind(self, cid: ContinuationId, req_id: str) -> bool:
        s = self.entries.get(cid.workflow)
        if s is None or s.cid != cid:
            return False
        s.reqs.append(req_id)
        self.by_req[req_id] = cid.workflow
        self.kept.pop(cid.workflow, None)  # bound: it waits for its allocation now
        return True

    def received(self, cid: ContinuationId, until: float) -> bool:
        """``cid``'s result reached the agent before a request was bound to it: its
        session waits on for the bind until ``until`` (ours; the resumed request is the
        history's next use, so the history stays in the order until it is allocated)."""
        s = self.entries.get(cid.workflow)
        if s is None or s.cid != cid or s.reqs:
            return False
        self.kept[cid.workflow] = until
        self.counts.kept += 1
        return True

    def expire(self, now: float) -> int:
        """Kept sessions whose bind did not come by their ``until`` leave; how many."""
        if not self.kept:
            return 0
        gone = [w for w, until in self.kept.items() if until <= now]
        for w in gone:
            self._drop(w)
        if gone:
            self.counts.expired += len(gone)
            self._changed = True
        return len(gone)

    def end(self, cid: ContinuationId) -> bool:
        """Cancelled or superseded: ``cid``'s session leaves the order."""
        if not self._end(cid):
            return False
        self.counts.ended += 1
        return True

    def end_unbound(self, cid: ContinuationId) -> bool:
        """``cid`` stopped being a candidate with no request bound and was not received
        (:meth:`received` keeps it): it leaves."""
        s = self.entries.get(cid.workflow)
        if s is None or s.cid != cid or s.reqs or cid.workflow in self.kept:
            return False
        self.counts.unbound += 1
        return self._end(cid)

    def _end(self, cid: ContinuationId) -> bool:
        s = self.entries.get(cid.workflow)
        if s is None or s.cid != cid:
            return False
        self._drop(cid.workflow)
        self._changed = True
        return True

    def allocated(self, req_id: str) -> bool:
        """``req_id`` was scheduled: its session's blocks are referenced now; it leaves."""
        w = self.by_req.get(req_id)
        if w is None:
            return False
        self._drop(w)
        self._left.append(w)
        self.counts.allocated += 1
        return True

    def aborted(self, req_id: str) -> bool:
        """``req_id`` was freed before its allocation (aborted). If no other request binds
        its session, the session leaves: the bind took its candidate over, so nothing
        will resume it (ours; until stop 56 it waited for the workflow's next notice or
        the end of the run). True if it left."""
        w = self.by_req.pop(req_id, None)
        if w is None:  # allocated already (it left then), or never bound
            return False
        s = self.entries[w]
        s.reqs.remove(req_id)
        if s.reqs:
            return False
        self._end(s.cid)
        self.counts.aborted += 1
        return True

    def clear(self) -> None:
        for w in list(self.entries):
            self._drop(w)
        self._changed = True

    def _drop(self, workflow: str) -> bool:
        s = self.entries.pop(workflow, None)
        if s is None:
            return False
        for req_id in s.reqs:
            if self.by_req.get(req_id) == workflow:
                del self.by_req[req_id]
        self.kept.pop(workflow, None)
        self.version += 1
        return True

    # -- the order -------------------------------------------------------------

    def order(self, now: float) -> list[KVCacheBlock]:
        """The free session blocks in eviction order (front first; see the contract)."""
        return [b for b in self.owned(now) if b.ref_cnt == 0]

    def owned(self, now: float) -> list[KVCacheBlock]:
        """Every block of the sessions' valid prefixes, free or not, in eviction order.

        O(S) beyond ranking the sessions: from the highest ``r`` down, each session
        emits the blocks of its tail that no higher session took, and the runs go out
        lowest ``r`` first. (Sorting every block by ``(r, cid, -end)`` gave the same
        order for one KV group but compared a ``ContinuationId`` per block pair: 2-4x
        slower in isolation; an owner map per block, 2.8x slower than this on 20 sessions
        sharing heads of 50-200 blocks.)
        """
        out: list[KVCacheBlock] = []
        for _, run in self._runs(now):
            out.extend(run)
        return out

    def _runs(self, now: float) -> list[tuple[str, list[KVCacheBlock]]]:
        """(workflow, the blocks it owns, tail first) per session, lowest ``r`` first."""
        ranked = sorted(self.entries.values(), key=lambda s: (s.r(now), s.cid))
        lost = self.pool.watched_lost
        taken: set[int] = set()
        runs: list[tuple[str, list[KVCacheBlock]]] = []
        for s in reversed(ranked):  # a shared block goes with the highest r
            tail = s.tail_first(lost)
            runs.append((s.cid.workflow, [b for b in tail if b.block_id not in taken]))
            if s.tail is tail:  # whole: its ids are the tail's
                taken |= s.ids
            else:
                taken.update([b.block_id for b in tail])
        runs.reverse()
        return runs

    def reorder(self, now: float) -> bool:
        """Move the free session blocks behind every other free block, in order.

        Runs only if a session entered or left, or a block was freed, since the
        last reorder; True if it ran.
        """
        pool = self.pool
        seen = (self.version, pool.free_epoch)
        if seen == self._seen:
            return False
        placed = self._placed
        q = pool.free_block_queue
        if placed is not None and not pool.watched_lost and self._let_go(placed):
            self.counts.splices += 1
            self.counts.put_back += placed.splice(q, pool.watched_freed)
        else:
            self.counts.computed += 1
            runs = self._runs(now)
            owned = [b for _, run in runs for b in run]
            blocks = [b for b in owned if b.ref_cnt == 0]
            for b in blocks:
                q.remove(b)
            q.append_n(blocks)
            self._watch()
            pool.watched_lost.clear()  # _runs() read it: every session is current
            first, last = (blocks[0], blocks[-1]) if blocks else (None, None)
            self._placed = Placed(owned, first, last, dict(runs))
        pool.watched_freed.clear()
        self._seen = seen
        self._left.clear()
        self._changed = False
        return True

    def _watch(self) -> None:
        """``pool.watched``: the sessions' blocks (the prefixes change only with them)."""
        if self._watched_for != self.version:
            self.pool.watched = set().union(*(s.ids for s in self.entries.values()))
            self._watched_for = self.version

    def _let_go(self, placed: Placed) -> bool:
        """Whether ``placed`` still stands: no session changed since it was computed, or
        only sessions left by allocation (:meth:`allocated`), each of whose own blocks is
        referenced now and in no waiting session's prefix. Their blocks then hold no
        free place and no rank passes to another session, so every other rank stands;
        they leave the order (:meth:`Placed.let_go`)."""
        if self._changed:
            return False
        runs = [placed.runs.get(w) for w in self._left]
        for run in runs:
            if run is None or any(b.ref_cnt == 0 for b in run):
                return False
            ids = {b.block_id for b in run}
            if any(not s.ids.isdisjoint(ids) for s in self.entries.values()):
                return False
        for w in self._left:
            placed.let_go(w)
        self.counts.let_go += len(runs)
        self._watch()
        return True

    # -- integrity ---------------------------------------------------------------

    def sizes(self) -> dict[str, int]:
        return {
            "sessions": len(self.entries),
            "session_reqs": len(self.by_req),
            "sessions_kept": len(self.kept),
        }

    def check_integrity(self) -> None:
        """Raise :class:`LeaseIntegrityError` unless entries and bindings agree."""
        for w, s in self.entries.items():
            if s.cid.workflow != w or not 0.0 <= s.p <= 1.0:
                raise LeaseIntegrityError(f"session {s.cid.key()} filed as {w} (p {s.p})")
            if not len(s.blocks) == len(s.hashes) == len(s.spans):
                raise LeaseIntegrityError(f"session {s.cid.key()}: blocks, hashes, spans differ")
            for req_id in s.reqs:
                if self.by_req.get(req_id) != w:
                    raise LeaseIntegrityError(f"session {s.cid.key()}: request {req_id} unbound")
            if w in self.kept and s.reqs:
                raise LeaseIntegrityError(f"session {s.cid.key()} kept for a bind it has")
        if not self.kept.keys() <= self.entries.keys():
            raise LeaseIntegrityError("a kept session is not waiting")
        for req_id, w in self.by_req.items():
            s = self.entries.get(w)
            if s is None or req_id not in s.reqs:
                raise LeaseIntegrityError(f"request {req_id} bound to no session of {w}")


class Placed:
    """The session order a full reorder placed, kept to splice the next reorders.

    Contract: ``owned`` is every session block in eviction order (free or not) as
    the order was computed; ``first`` and ``last`` bound the *run*: the owned
    blocks the queue holds, in order and contiguous (``None`` when it holds none).
    Everything behind ``last`` was freed since. The caller splices only while no
    session entered or left and no session block lost its hash (``owned`` and the
    ranks stand then); the queue is only touched with its own links, and
    ``num_free_blocks`` moves with every block unlinked or linked here.
    """

    def __init__(
        self,
        owned: list[KVCacheBlock],
        first: KVCacheBlock | None,
        last: KVCacheBlock | None,
        runs: dict[str, list[KVCacheBlock]],
    ) -> None:
        self.owned = owned
        self._rank: dict[int, int] | None = None  # built at the first splice only
        self.first, self.last = first, last
        self.runs = runs  # workflow -> the owned blocks it placed
        self.gone: set[int] = set()  # blocks of sessions let go: no longer ordered

    def let_go(self, workflow: str) -> None:
        """``workflow`` left with every block it owned referenced: those blocks keep no
        place (freed again, they are foreign frees)."""
        self.gone.update(b.block_id for b in self.runs.pop(workflow))

    @property
    def rank(self) -> dict[int, int]:
        """Block id -> its place in ``owned`` (many orders are never spliced)."""
        if self._rank is None:
            self._rank = {b.block_id: i for i, b in enumerate(self.owned)}
        return self._rank

    def splice(self, q: FreeKVCacheBlockQueue, freed: Sequence[KVCacheBlock]) -> int:
        """Put the ``freed`` session blocks still free back in their places and move
        the rest of what was freed behind the run in front of it; how many were put
        back. O(F) for F such frees, plus the referenced blocks skipped."""
        rank = self.rank
        back = {
            b.block_id: b
            for b in freed
            if b.block_id in rank
            and b.block_id not in self.gone
            and b.ref_cnt == 0
            and b.prev_free_block is not None
        }
        for b in back.values():  # out of the freed run: every one was freed since
            q.remove(b)
        # vLLM only unlinks from the run (a hit, an eviction): its ends move inwards.
        first = self._linked(self.first, 1)
        last = self._linked(self.last, -1) if first is not None else None
        tail = q.fake_free_list_tail
        if last is not None and last.next_free_block is not tail:
            assert first is not None and first.prev_free_block is not None
            new_first, new_last = last.next_free_block, tail.prev_free_block
            assert new_first is not None and new_last is not None
            before = first.prev_free_block  # the freed run goes in front of the first
            last.next_free_block, tail.prev_free_block = tail, last
            before.next_free_block, new_first.prev_free_block = new_first, before
            new_last.next_free_block, first.prev_free_block = first, new_last
        self.first, self.last = first, last
        for b in sorted(back.values(), key=lambda b: -rank[b.block_id]):
            nxt = self._linked(self._after(rank[b.block_id]), 1)
            if nxt is None:  # the highest rank put back: it ends the run
                q.append(b)
                self.last = b
            else:
                prev = nxt.prev_free_block
                assert prev is not None
                prev.next_free_block, b.prev_free_block = b, prev
                b.next_free_block, nxt.prev_free_block = nxt, b
                q.num_free_blocks += 1
            if self.first is None or nxt is self.first:  # lowest rank so far
                self.first = b
        return len(back)

    def _after(self, i: int) -> KVCacheBlock | None:
        return self.owned[i + 1] if i + 1 < len(self.owned) else None

    def _linked(self, b: KVCacheBlock | None, step: int) -> KVCacheBlock | None:
        """The first owned block from ``b`` on (by ``step``) that the queue holds."""
        if b is None:
            return None
        owned, i, gone = self.owned, self.rank[b.block_id], self.gone
        while 0 <= i < len(owned):
            b = owned[i]
            if b.ref_cnt == 0 and b.prev_free_block is not None and b.block_id not in gone:
                return b
            i += step
        return None
