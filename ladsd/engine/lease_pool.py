"""vLLM's block pool with a ledger of lease references, and the integrity check.

Lock/unlock contract (spec 3, architecture.md "Lease operations"):

* ``lease_touch(blocks)`` is the only way a lease takes references: one
  ``BlockPool.touch`` reference per real block (a block at ``ref_cnt == 0``
  leaves the free queue and so cannot be evicted) plus one entry in the
  per-block lease ledger.
* ``lease_free(blocks)`` is the only way a lease gives them back:
  ``BlockPool.free_blocks(reversed(blocks))`` for blocks that hold a lease
  reference; blocks without one are skipped, so a stray second release can
  never take a reference that a running request owns.
* ``ref_cnt`` is never written here; null blocks are never counted.
* A block whose prefix-cache hash is stripped while leased (KV-connector
  eviction, partial-to-full promotion, hash move) is remembered; the lease book
  drains :meth:`LeaseBlockPool.take_stripped` and lets such blocks leave their
  leases.

Without leases the pool behaves exactly like vLLM's (``scripts/vllm_compat.sh``
runs vLLM's prefix-caching suite with it installed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock


class LeaseIntegrityError(AssertionError):
    """A block's reference count disagrees with its holders (fails the run)."""


class LeaseBlockPool(BlockPool):
    """A :class:`BlockPool` that also counts lease references per block."""

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
        self.lease_refs: dict[int, int] = {}  # block id -> lease references
        self.refs_added = 0
        self.refs_released = 0
        self._stripped: set[int] = set()
        self.hash_epoch = 0  # bumps whenever any block loses a prefix-cache hash

    # -- lease references -------------------------------------------------

    def lease_touch(self, blocks: Sequence[KVCacheBlock]) -> int:
        """Add one lease reference to each real block; returns how many."""
        real = [b for b in blocks if not b.is_null]
        self.touch(real)
        for b in real:
            self.lease_refs[b.block_id] = self.lease_refs.get(b.block_id, 0) + 1
        self.refs_added += len(real)
        return len(real)

    def lease_free(self, blocks: Sequence[KVCacheBlock]) -> int:
        """Remove one lease reference from each block that holds one; returns how many."""
        held: list[KVCacheBlock] = []
        for b in blocks:
            n = self.lease_refs.get(b.block_id, 0)
            if b.is_null or n == 0:
                continue
            if n == 1:
                del self.lease_refs[b.block_id]
            else:
                self.lease_refs[b.block_id] = n - 1
            held.append(b)
        # Tail first, as vLLM frees a request: the prefix head is evicted last.
        self.free_blocks(reversed(held))
        self.refs_released += len(held)
        return len(held)

    def lease_ref(self, block_id: int) -> int:
        return self.lease_refs.get(block_id, 0)

    @property
    def num_leased_blocks(self) -> int:
        """``U``: distinct blocks protected by at least one lease."""
        return len(self.lease_refs)

    # -- hash stripping ---------------------------------------------------

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        removed = super()._remove_cached_block_hashes(block)
        if removed:
            self.hash_epoch += 1
            if block.block_id in self.lease_refs:
                self._stripped.add(block.block_id)
        return removed

    def reset_prefix_cache(self) -> bool:
        ok = super().reset_prefix_cache()
        if ok:  # every hash is gone at once (not through _remove_cached_block_hashes)
            self.hash_epoch += 1
        return ok

    def take_stripped(self) -> set[int]:
        """Leased block ids whose hash was removed since the last call."""
        out, self._stripped = self._stripped, set()
        return out


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
    lease = getattr(pool, "lease_refs", {})
    bad: list[str] = []
    for b in pool.blocks:
        if b.is_null:
            continue
        want = native.get(b.block_id, 0) + lease.get(b.block_id, 0)
        if b.ref_cnt != want:
            bad.append(
                f"block {b.block_id}: ref_cnt {b.ref_cnt} != native "
                f"{native.get(b.block_id, 0)} + lease {lease.get(b.block_id, 0)}"
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
