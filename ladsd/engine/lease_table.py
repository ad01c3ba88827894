"""The lease table: which lease holds which references on the :class:`LeaseBlockPool`.

Contract (mini-sglang style: one owner per structure):

* Owns: the active leases (``leases``, one per continuation), the holder index
  (``holders``: block id -> continuations whose lease holds it) and the time
  integral of ``U`` (protection block-seconds). One table per
  :class:`~ladsd.records.LeaseKind`: the LADS table and the pin table each own
  their ledger on the shared pool. Tables are the only callers of
  ``LeaseBlockPool.lease_touch`` / ``lease_free``, so a ledger (its ``refs``,
  ``added``, ``released``) changes only through its own table.
* Lock: :meth:`acquire` takes exactly one reference per real block of the whole
  resident prefix ``P_i`` (never a subset). A lease is active iff it is in
  ``leases``; its status is GRANTED exactly then.
* Unlock: :meth:`release` takes the lease out of ``leases`` first, then frees
  exactly the references it still holds and stamps how it ended (HANDED_OFF,
  EXPIRED, REVOKED, CANCELLED). A second release finds nothing and does
  nothing. :meth:`cut` gives back the tail of a lease from its first block
  whose hash was stripped. Native references and other leases' references are
  never touched; ``ref_cnt`` is never written.
* Callers: only :class:`~ladsd.engine.lease_book.LeaseBook`, on the engine
  thread between scheduler steps; nothing locks. The table decides nothing:
  which lease to grant, cut, expire, revoke or hand off, and what to count, is
  the book's.
* Integrity: :meth:`check_integrity` (every block's ``ref_cnt`` == native
  holders + references of every kind; this table's ledger equals its leases'
  blocks; the holder index is exact) and :meth:`balance` (added == released +
  held, for this table's ledger).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock

from ladsd.engine.budget import fifo_key
from ladsd.engine.lease_pool import LeaseBlockPool, LeaseIntegrityError, check_pool, native_refs
from ladsd.engine.lease_resident import Prefix, get_block_id
from ladsd.records import ContinuationId, HistoryNotice, LeaseKind, LeaseRecord, LeaseStatus

Native = Callable[[], Iterable[Iterable[KVCacheBlock]]]


@dataclass
class Lease:
    """One lease: the references it holds, where they sit in ``P_i``, how it ended."""

    cid: ContinuationId
    notice: HistoryNotice
    blocks: list[KVCacheBlock]  # held references, prefix order per group
    slots: list[tuple[int, int]]  # (kv cache group, position in the block table)
    hashes: list[BlockHashWithGroupId]  # block hash at grant, per block
    granted_at: float  # g_i (first grant of this identity)
    deadline: float  # d_i = g_i + l
    committed_before_grant: bool
    generation: int
    reqs: list[str] = field(default_factory=list)  # requests registered for it (handoff targets)
    mismatch: bool = False  # a handoff check already failed once
    status: LeaseStatus = LeaseStatus.GRANTED  # set once, by release

    @property
    def key(self) -> tuple[float, ContinuationId]:
        return fifo_key(self.notice.ready_time, self.cid)

    def covered_by(self, table: Sequence[Sequence[KVCacheBlock]]) -> bool:
        """A block table (per group) holds every protected block's hash at its position."""
        for (g, pos), h in zip(self.slots, self.hashes, strict=True):
            row = table[g]
            if pos >= len(row) or row[pos].block_hash != h:
                return False
        return True

    def record(
        self, exclusive: int, generation: int, kind: LeaseKind = LeaseKind.LADS
    ) -> LeaseRecord:
        """The published record (spec 3.4) as of budget ``generation``."""
        return LeaseRecord(
            cid=self.cid,
            prefix_digest=self.notice.prefix_digest,
            payload_digest=self.notice.payload_digest,
            protected_blocks=tuple(map(get_block_id, self.blocks)),
            exclusive_blocks=exclusive,
            granted_at=self.granted_at,
            deadline=self.deadline,
            generation=generation,
            status=self.status,
            committed_before_grant=self.committed_before_grant,
            kind=kind,
        )


class LeaseTable:
    """Active leases (or pins) and their references on one pool (see the module contract)."""

    def __init__(
        self,
        kv: KVCacheManager,
        now: float,
        native_extra: Native = lambda: (),
        kind: LeaseKind = LeaseKind.LADS,
    ) -> None:
        self.kv = kv
        self.kind = kind
        self.pool = LeaseBlockPool.adopt(kv.block_pool)
        self.ledger = self.pool.ledgers[kind]
        for m in kv.coordinator.single_type_managers:
            if m.block_pool is not self.pool:
                raise NotImplementedError("leases need one shared block pool for all groups")
        self.native_extra = native_extra
        self.block_sizes = [m.block_size for m in kv.coordinator.single_type_managers]
        self.leases: dict[ContinuationId, Lease] = {}
        self.holders: dict[int, set[ContinuationId]] = {}  # block id -> leases holding it
        self._u_area = 0.0  # integral of U up to _u_t
        self._u_t = now
        # No deadline is earlier (a lower bound: deadlines are set once, at acquire):
        # due() scans only past it, not at every schedule() entry (controller CPU).
        self._soonest = math.inf

    @property
    def used(self) -> int:
        """Distinct blocks held by at least one of this table's leases (LADS: ``U``)."""
        return len(self.ledger.refs)

    def ordered(self) -> list[Lease]:
        """Active leases in grant (FIFO) order."""
        return sorted(self.leases.values(), key=lambda x: x.key)

    # -- lock / unlock -----------------------------------------------------

    def acquire(
        self,
        notice: HistoryNotice,
        prefix: Prefix,
        *,
        granted_at: float,
        deadline: float,
        committed: bool,
        generation: int,
        now: float,
    ) -> Lease:
        """One reference on every real block of ``P_i`` (``prefix``: as just checked)."""
        cid = notice.cid
        if cid in self.leases:
            raise LeaseIntegrityError(f"lease {cid.key()} is already held")
        blocks = list(prefix.blocks)
        self.integrate(now)
        self.pool.lease_touch(blocks, self.kind)
        holders = self.holders
        for bid in prefix.block_ids:
            holders.setdefault(bid, set()).add(cid)
        lease = Lease(
            cid,
            notice,
            blocks,
            list(prefix.slots),
            list(prefix.hashes),
            granted_at,
            deadline,
            committed,
            generation,
        )
        self.leases[cid] = lease
        self._soonest = min(self._soonest, deadline)
        return lease

    def release(self, lease: Lease, status: LeaseStatus, now: float) -> bool:
        """Give back exactly this lease's references, once; False if already released."""
        if self.leases.get(lease.cid) is not lease:
            return False
        self.integrate(now)
        del self.leases[lease.cid]
        for b in lease.blocks:
            self._unhold(b.block_id, lease.cid)
        self.pool.lease_free(lease.blocks, self.kind)
        lease.blocks = []
        lease.status = status
        return True

    def stripped(self) -> list[Lease]:
        """Leases holding a block whose hash was stripped since the last call (once each)."""
        if not self.ledger.stripped:  # nearly every call: nothing held was stripped
            return []
        out: dict[ContinuationId, Lease] = {}
        for bid in self.pool.take_stripped(self.kind):
            for cid in self.holders.get(bid, ()):
                if (lease := self.leases.get(cid)) is not None:
                    out[cid] = lease
        return list(out.values())

    def cut(self, lease: Lease, now: float) -> int | None:
        """Give back the lease's blocks from the first broken hash on (hashes chain).

        Returns how many blocks left the lease (0: none broke); None when the
        first block broke, so nothing would remain: then nothing is done and the
        caller releases the whole lease.
        """
        sizes = self.block_sizes
        bad = [
            lease.slots[k] for k, b in enumerate(lease.blocks) if b.block_hash != lease.hashes[k]
        ]
        if not bad:
            return 0
        limit = min(pos * sizes[g] for g, pos in bad)  # the prefix ends here, in tokens
        keep = [(pos + 1) * sizes[g] <= limit for g, pos in lease.slots]
        if not any(keep):
            return None
        dropped = [b for b, ok in zip(lease.blocks, keep, strict=True) if not ok]
        self.integrate(now)
        self.pool.lease_free(dropped, self.kind)
        for b in dropped:
            self._unhold(b.block_id, lease.cid)
        lease.blocks = [b for b, ok in zip(lease.blocks, keep, strict=True) if ok]
        lease.slots = [s for s, ok in zip(lease.slots, keep, strict=True) if ok]
        lease.hashes = [h for h, ok in zip(lease.hashes, keep, strict=True) if ok]
        return len(dropped)

    def _unhold(self, block_id: int, cid: ContinuationId) -> None:
        s = self.holders.get(block_id)
        if s is not None:
            s.discard(cid)
            if not s:
                del self.holders[block_id]

    # -- counts --------------------------------------------------------------

    def due(self, now: float) -> list[Lease]:
        """Leases at or past their deadline ``d_i``, in grant order."""
        if now < self._soonest:
            return []
        due = sorted((x for x in self.leases.values() if x.deadline <= now), key=lambda x: x.key)
        # Over all, the due too: one the caller keeps is found again at the next call.
        self._soonest = min((x.deadline for x in self.leases.values()), default=math.inf)
        return due

    # The three counts read this kind's ledger in one lookup: they run per block of every
    # lease at each state published and each grant tried (controller CPU, issue 23).

    def delta(self, prefix: Prefix) -> int:
        """``Delta_i``: blocks of ``prefix`` no lease protects yet (each raises ``U`` by one)."""
        refs = self.pool.refs_of(self.kind)
        return list(map(refs.get, prefix.block_ids)).count(None)  # refs keeps counts >= 1

    def exclusive(self, lease: Lease) -> int:
        """``|E_i|``: blocks of the lease protected by no other lease."""
        refs = self.pool.refs_of(self.kind)
        return list(map(refs.get, map(get_block_id, lease.blocks))).count(1)

    def gain(self, lease: Lease) -> int:
        """Free blocks a release would return now: held by this lease and nothing else."""
        refs = self.pool.refs_of(self.kind)
        return sum(1 for b in lease.blocks if b.ref_cnt == 1 and refs.get(b.block_id) == 1)

    def integrate(self, now: float) -> float:
        """Protection block-seconds up to ``now``: the time integral of :attr:`used`."""
        if now > self._u_t:
            self._u_area += self.used * (now - self._u_t)
        self._u_t = max(self._u_t, now)
        return self._u_area

    def held(self) -> int:
        """This table's references held right now."""
        return sum(self.ledger.refs.values())

    def sizes(self) -> dict[str, int]:
        return {"leases": len(self.leases), "holders": len(self.holders)}

    # -- integrity -------------------------------------------------------------

    def check_integrity(self, with_pool: bool = True) -> None:
        """Raise :class:`LeaseIntegrityError` unless every count agrees (see contract).

        ``with_pool=False`` skips the whole-pool check (a second table on the
        same pool, after the first one ran it).
        """
        if with_pool:
            check_pool(self.pool, native_refs(self.kv.coordinator, self.pool, self.native_extra()))
        held: Counter[int] = Counter()
        holders: dict[int, set[ContinuationId]] = {}
        for cid, x in self.leases.items():
            if x.cid != cid or x.status is not LeaseStatus.GRANTED:
                raise LeaseIntegrityError(f"lease {x.cid.key()} filed as {cid.key()}, {x.status}")
            if len({b.block_id for b in x.blocks}) != len(x.blocks):
                raise LeaseIntegrityError(f"lease {x.cid.key()} holds a block twice")
            if not len(x.blocks) == len(x.slots) == len(x.hashes):
                raise LeaseIntegrityError(f"lease {x.cid.key()}: blocks, slots, hashes differ")
            for b, h in zip(x.blocks, x.hashes, strict=True):
                held[b.block_id] += 1
                holders.setdefault(b.block_id, set()).add(cid)
                if b.block_hash != h and b.block_id not in self.ledger.stripped:
                    raise LeaseIntegrityError(f"lease {x.cid.key()}: block {b.block_id} rehashed")
        if held != Counter(self.ledger.refs):
            raise LeaseIntegrityError(f"{self.kind.value} ledger disagrees with its leases' blocks")
        if holders != self.holders:
            bad = sorted(set(holders) ^ set(self.holders))[:8]
            raise LeaseIntegrityError(f"holder index disagrees with the leases (blocks {bad})")

    def balance(self) -> int:
        """This ledger's references added == released + held (after :meth:`check_integrity`)."""
        held = self.held()
        led = self.ledger
        if led.added != led.released + held:
            raise LeaseIntegrityError(
                f"{self.kind.value} references added {led.added} != released "
                f"{led.released} + held {held}"
            )
        return held
