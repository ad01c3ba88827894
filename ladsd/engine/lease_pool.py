"""vLLM's block pool with ledgers of lease references, and the integrity check.

Lock/unlock contract (spec 3, architecture.md "Lease operations"):

* ``lease_touch(blocks, kind)`` is the only way a lease or a pin takes
  references: one ``BlockPool.touch`` reference per real block (a block at
  ``ref_cnt == 0`` leaves the free queue and so cannot be evicted) plus one
  entry in the per-block ledger of its :class:`~ladsd.records.LeaseKind`
  (LADS leases and pins keep separate ledgers, so ``U`` counts LADS leases
  only, while the integrity check counts both).
* ``lease_free(blocks, kind)`` is the only way they give them back:
  ``BlockPool.free_blocks(reversed(blocks))`` for blocks that hold a reference
  of that kind; blocks without one are skipped, so a stray second release can
  never take a reference that a running request (or the other kind) owns.
* ``ref_cnt`` is never written here; null blocks are never counted.
* ``refs_added`` / ``refs_released`` count every kind (the run's audit);
  each :class:`Ledger` counts its own.
* A block whose prefix-cache hash is stripped while held (KV-connector
  eviction, partial-to-full promotion, hash move) is remembered per ledger;
  the lease book drains :meth:`LeaseBlockPool.take_stripped` and lets such
  blocks leave their leases and pins.
* Hash epochs: ``hash_epoch`` counts hash removals (and prefix-cache
  resets); ``stripped_at`` keeps the epoch of each block's last removal, so a
  prefix checked at epoch ``e`` changed iff one of its blocks was stripped
  after ``e`` (a block can get the same hash back later, while another block
  holds it: checking the hash alone would miss that) or a reset came after.
* Free stamps (HEAR session retention only, :meth:`stamp_frees`): when a block
  returns to the free queue its time is kept in ``freed_at`` and
  ``free_epoch`` counts the frees; the order of the free queue is not touched
  here (the session order moves blocks with the queue's own remove/append).
  ``watched`` (the session order's blocks): a free of one of them is kept in
  ``watched_freed`` (the order puts it back in its place); a lost hash puts it
  in ``watched_lost`` and a prefix-cache reset puts every watched block there:
  only then must the order read that session's hashes again (a set lookup per
  free or eviction, inside vLLM's part of ``schedule()``).

Without leases the pool behaves exactly like vLLM's (``scripts/vllm_compat.sh``
runs vLLM's prefix-caching suite with it installed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock

from ladsd.audit import LeaseIntegrityError
from ladsd.records import LeaseKind


@dataclass
class Ledger:
    """References of one kind per block, with their totals (see the module contract)."""

    refs: dict[int, int] = field(default_factory=dict)  # block id -> references
    added: int = 0
    released: int = 0
    stripped: set[int] = field(default_factory=set)  # held blocks whose hash was removed


class LeaseBlockPool(BlockPool):
    """A :class:`BlockPool` that also counts lease and pin references per block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lease_init()

    @classmethod
    def adopt(cls, pool: BlockPool) -> LeaseBlockPool:
        """Turn vLLM's pool (built inside KVCacheManager) into a lease pool in place.

        vLLM offers no factory seam for the pool, so the instance changes
        class; the subclass adds state only, and every manager and block keeps
        pointing at the same object.
        """
        if isinstance(pool, cls):
            return pool
        if type(pool) is not BlockPool:
            raise TypeError(f"cannot add leases to {type(pool).__name__}; only BlockPool")
        pool.__class__ = cls
        assert isinstance(pool, cls)
        pool._lease_init()
        return pool

    def _lease_init(self) -> None:
        self.ledgers: dict[LeaseKind, Ledger] = {k: Ledger() for k in LeaseKind}
        self.lease_refs = self.ledgers[LeaseKind.LADS].refs  # block id -> LADS references
        self.refs_added = 0  # every kind
        self.refs_released = 0
        self.hash_epoch = 0  # bumps whenever any block loses a prefix-cache hash
        self.stripped_at: dict[int, int] = {}  # block id -> hash epoch of its last removal
        self.free_epoch = 0  # bumps on every free while stamping (see stamp_frees)
        self.freed_at: dict[int, float] = {}  # block id -> when it last became free
        self._free_clock: Callable[[], float] | None = None
        self.watched: set[int] = set()  # block ids of the waiting sessions' prefixes
        self.watched_freed: list[KVCacheBlock] = []  # freed since the session order took it
        self.watched_lost: set[int] = set()  # watched blocks that lost their hash since

    # -- lease and pin references ----------------------------------------------

    def lease_touch(self, blocks: Sequence[KVCacheBlock], kind: LeaseKind = LeaseKind.LADS) -> int:
        """Add one reference of ``kind`` to each real block; returns how many."""
        real = [b for b in blocks if not b.is_null]
        self.touch(real)
        led = self.ledgers[kind]
        for b in real:
            led.refs[b.block_id] = led.refs.get(b.block_id, 0) + 1
        led.added += len(real)
        self.refs_added += len(real)
        return len(real)

    def lease_free(self, blocks: Sequence[KVCacheBlock], kind: LeaseKind = LeaseKind.LADS) -> int:
        """Remove one reference of ``kind`` from each block that holds one; returns how many."""
        led = self.ledgers[kind]
        held: list[KVCacheBlock] = []
        for b in blocks:
            n = led.refs.get(b.block_id, 0)
            if b.is_null or n == 0:
                continue
            if n == 1:
                del led.refs[b.block_id]
            else:
                led.refs[b.block_id] = n - 1
            held.append(b)
        # Tail first, as vLLM frees a request: the prefix head is evicted last.
        self.free_blocks(reversed(held))
        led.released += len(held)
        self.refs_released += len(held)
        return len(held)

    def lease_ref(self, block_id: int, kind: LeaseKind = LeaseKind.LADS) -> int:
        return self.ledgers[kind].refs.get(block_id, 0)

    def refs_of(self, kind: LeaseKind = LeaseKind.LADS) -> Mapping[int, int]:
        """``kind``'s references per block id, read-only (only counts >= 1 are kept)."""
        return self.ledgers[kind].refs

    def held_refs(self, block_id: int) -> int:
        """References of every kind on ``block_id`` (what ``ref_cnt`` holds beyond vLLM's)."""
        return sum(led.refs.get(block_id, 0) for led in self.ledgers.values())

    @property
    def num_leased_blocks(self) -> int:
        """``U``: distinct blocks protected by at least one lease."""
        return len(self.lease_refs)

    # -- hash stripping ---------------------------------------------------

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        removed = super()._remove_cached_block_hashes(block)
        if removed:
            self.hash_epoch += 1
            if block.block_id in self.watched:
                self.watched_lost.add(block.block_id)
            self.stripped_at[block.block_id] = self.hash_epoch
            for led in self.ledgers.values():
                if block.block_id in led.refs:
                    led.stripped.add(block.block_id)
        return removed

    def reset_prefix_cache(self) -> bool:
        ok = super().reset_prefix_cache()
        if ok:  # every hash is gone at once (not through _remove_cached_block_hashes)
            self.hash_epoch += 1
            self.watched_lost |= self.watched
        return ok

    def take_stripped(self, kind: LeaseKind = LeaseKind.LADS) -> set[int]:
        """Block ids held by ``kind`` whose hash was removed since the last call."""
        led = self.ledgers[kind]
        out, led.stripped = led.stripped, set()
        return out

    # -- free stamps (session retention) -----------------------------------------

    def stamp_frees(self, clock: Callable[[], float]) -> None:
        """From now on, stamp each block that becomes free with ``clock()`` (engine thread)."""
        self._free_clock = clock

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        clk = self._free_clock
        if clk is None:
            super().free_blocks(ordered_blocks)
            return
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        t = clk()
        watched = self.watched
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null and (b.pool is None or b.pool is self):
                self.freed_at[b.block_id] = t
                if b.block_id in watched:
                    self.watched_freed.append(b)
        self.free_epoch += 1


def native_refs(
    coordinator: KVCacheCoordinator,
    pool: BlockPool,
    extra: Iterable[Iterable[KVCacheBlock]] = (),
) -> Counter[int]:
    """References vLLM itself holds per block of ``pool``.

    Request block tables, pending copy-on-write endpoints (the source keeps its
    hit reference, the copy one extra), and ``extra`` (e.g. the scheduler's
    deferred frees).
    """
    refs: Counter[int] = Counter()

    def add(blocks: Iterable[KVCacheBlock]) -> None:
        for b in blocks:
            if not b.is_null and (b.pool is None or b.pool is pool):
                refs[b.block_id] += 1

    for m in coordinator.single_type_managers:
        if m.block_pool is not pool:
            continue
        for blocks in m.req_to_blocks.values():
            add(blocks)
        for src, cow in m._pending_cow_copies:
            add((src, cow))
    for blocks in extra:
        add(blocks)
    return refs


def check_pool(pool: BlockPool, native: Counter[int]) -> None:
    """Every block's ``ref_cnt`` equals native holders + lease references.

    Also: no negative count, and exactly the unreferenced real blocks sit in
    the free queue. Raises :class:`LeaseIntegrityError` listing the first few
    violations.
    """
    ledgers = pool.ledgers if isinstance(pool, LeaseBlockPool) else {}
    bad: list[str] = []
    for b in pool.blocks:
        if b.is_null:
            continue
        held = {k: led.refs.get(b.block_id, 0) for k, led in ledgers.items()}
        want = native.get(b.block_id, 0) + sum(held.values())
        if b.ref_cnt != want:
            extra = "".join(f" + {k.value} {n}" for k, n in held.items())
            bad.append(
                f"block {b.block_id}: ref_cnt {b.ref_cnt} != native "
                f"{native.get(b.block_id, 0)}{extra}"
            )
    free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    unref = {b.block_id for b in pool.blocks if not b.is_null and b.ref_cnt == 0}
    if free != unref:
        bad.append(
            f"free queue {sorted(free ^ unref)[:8]} disagrees with ref_cnt == 0 "
            f"({len(free)} queued, {len(unref)} unreferenced)"
        )
    if pool.free_block_queue.num_free_blocks != len(free):
        bad.append("free queue length counter is off")
    if bad:
        more = f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""
        raise LeaseIntegrityError("; ".join(bad[:5]) + more)
