"""The resident reusable prefix ``P_i`` of a history, by vLLM's own hashes.

``P_i`` is the longest run of full blocks of a history found in the prefix
cache (spec section 3). The history is hashed with the engine's request block
hasher on a throw-away :class:`vllm.v1.request.Request`, so cache salt, LoRA
and any other extra keys are folded in exactly as for a real request, and the
lookup is ``coordinator.find_longest_cache_hit`` without the ``num_tokens - 1``
cap that ``get_computed_blocks`` applies (the continuation appends an
observation after the history).

Hash only on the engine thread and only after ``EngineCore.__init__``: vLLM's
``NONE_HASH`` seed is set there, after the scheduler was built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, not_
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    KVCacheBlock,
    get_request_block_hasher,
)
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.request import Request

Hasher = Callable[[Request], list[BlockHash]]

_PROBE_PARAMS = SamplingParams(max_tokens=1)
# Mapped over a prefix's blocks: C speed on the ~560-block prefixes of captured-scaled.
get_block_id = attrgetter("block_id")
_block_hash = attrgetter("block_hash")
_ref_cnt = attrgetter("ref_cnt")
_is_null = attrgetter("is_null")


def make_hasher(hash_block_size: int, hash_algo: str = "sha256") -> Hasher:
    """vLLM's request block hasher for ``hash_block_size`` and ``hash_algo``."""
    return get_request_block_hasher(hash_block_size, get_hash_fn_by_name(hash_algo))


def prefix_hashes(
    token_ids: Sequence[int],
    hasher: Hasher,
    *,
    cache_salt: str | None = None,
    lora_request: Any = None,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Block hashes of every full block of ``token_ids`` (extra keys included).

    ``known``: the hashes of its first blocks, already computed for these tokens with
    this salt (:mod:`~ladsd.engine.lease_hashes`): vLLM's hasher goes on from the last.
    """
    if not token_ids:
        return []
    probe = Request(
        request_id="ladsd-lease-probe",
        prompt_token_ids=list(token_ids),
        sampling_params=_PROBE_PARAMS,
        pooling_params=None,
        cache_salt=cache_salt,
        lora_request=lora_request,
        block_hasher=None,
    )
    probe.block_hashes = list(known)
    probe.block_hashes.extend(hasher(probe))
    return probe.block_hashes


def lookup_hit(
    kv: KVCacheManager, hashes: list[BlockHash], num_tokens: int
) -> tuple[tuple[list[KVCacheBlock], ...], int]:
    """Per-group resident blocks of the longest cached prefix (null blocks kept), hit tokens."""
    if not kv.enable_caching or not hashes or num_tokens <= 0:
        return tuple([] for _ in range(kv.num_kv_cache_groups)), 0
    groups, hit, _ = kv.coordinator.find_longest_cache_hit(hashes, num_tokens)
    return tuple(list(g) for g in groups), hit


def lookup(
    kv: KVCacheManager, hashes: list[BlockHash], num_tokens: int
) -> tuple[list[KVCacheBlock], ...]:
    """Per-group resident blocks of the longest cached prefix (null blocks kept)."""
    return lookup_hit(kv, hashes, num_tokens)[0]


@dataclass(frozen=True, eq=False)  # eq=False: a block's == walks vLLM's free list
class Prefix:
    """``P_i`` as one lookup found it, flattened once for every reader of it.

    The candidate's checks, the headroom rule, the lease and the waiting session
    all read the same lists (issue 23 item 5: one pass over ``P_i`` per lookup,
    not one per reader). ``blocks``: the real blocks, prefix order per group
    (null blocks skipped); ``slots``: (kv cache group, position in the block
    table) of each; ``hashes``: each block's hash at the lookup; ``block_ids``
    and ``ids``: their ids, in order and as a set.
    """

    blocks: tuple[KVCacheBlock, ...] = ()
    slots: tuple[tuple[int, int], ...] = ()
    hashes: tuple[BlockHashWithGroupId, ...] = ()
    block_ids: tuple[int, ...] = ()
    ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, groups: Sequence[Sequence[KVCacheBlock]]) -> Prefix:
        """The real blocks of a per-group lookup result (every one must carry a hash)."""
        blocks: list[KVCacheBlock] = []
        slots: list[tuple[int, int]] = []
        for g, row in enumerate(groups):
            pos: Sequence[int] = range(len(row))
            if any(map(_is_null, row)):  # sliding-window groups: holes before the window
                pos = [k for k, b in enumerate(row) if not b.is_null]
            blocks.extend(map(row.__getitem__, pos))
            slots.extend(zip(repeat(g), pos, strict=False))
        hashes = tuple(map(_block_hash, blocks))
        if None in hashes:
            raise ValueError("a cache hit without a block hash")
        ids = tuple(map(get_block_id, blocks))
        return cls(tuple(blocks), tuple(slots), hashes, ids, frozenset(ids))

    def __len__(self) -> int:
        return len(self.blocks)

    def intact(self) -> bool:
        """Every block still carries the hash it had at the lookup."""
        return tuple(map(_block_hash, self.blocks)) == self.hashes

    def unreferenced(self) -> list[int]:
        """Ids of the blocks nothing references now (``ref_cnt == 0``: in the free queue)."""
        return list(compress(self.block_ids, map(not_, map(_ref_cnt, self.blocks))))


def plain_lookup(kv: KVCacheManager) -> bool:
    """vLLM's prefix lookup is the plain longest run of cached full blocks here: one
    full-attention group, no EAGLE drop, no context parallelism, hash block = cache block."""
    c = getattr(kv, "coordinator", None)
    if type(c) is not UnitaryKVCacheCoordinator or c.eagle_group_ids:
        return False
    return (
        type(c.single_type_managers[0]) is FullAttentionManager
        and c.dcp_world_size == 1
        and c.pcp_world_size == 1
        and c.block_size == c.block_pool.hash_block_size
    )


def unchanged(
    pool: Any, plain: bool, prefix: Prefix, hashes: Sequence[BlockHash], epoch: int, complete: bool
) -> bool:
    """Would vLLM's lookup of ``hashes`` return ``prefix`` again? O(1) while no hash went.

    ``prefix`` was looked up at the pool's hash epoch ``epoch`` (-1: never) and
    was ``complete`` (it reached the lookup's cap). Removing a hash is the only
    way a complete prefix can change, so the check is O(1) while the epoch
    holds; after a removal, O(|P_i|) C-level reads: no block of it was stripped
    since (``stripped_at``) and every hash holds (a prefix-cache reset strips
    none one by one). An incomplete prefix that holds can only grow at its next
    block: under vLLM's plain lookup (``plain``: one full-attention group, hash
    block = cache block) one probe of that hash stands for the walk. Otherwise:
    False, look it up.
    """
    if epoch < 0:
        return False
    if epoch != pool.hash_epoch:
        last = max(map(pool.stripped_at.get, prefix.block_ids, repeat(-1)), default=-1)
        if last > epoch or not prefix.intact():
            return False
    if complete:
        return True
    k = len(prefix)
    return plain and (k >= len(hashes) or pool.get_cached_block(hashes[k], [0]) is None)


def resident_prefix(
    kv: KVCacheManager,
    token_ids: Sequence[int],
    *,
    hash_block_size: int,
    hash_algo: str = "sha256",
    cache_salt: str | None = None,
    lora_request: Any = None,
) -> list[KVCacheBlock]:
    """``P_i`` of a history as a flat block list (helper for tests and tools)."""
    hashes = prefix_hashes(
        token_ids,
        make_hasher(hash_block_size, hash_algo),
        cache_salt=cache_salt,
        lora_request=lora_request,
    )
    return list(Prefix.of(lookup(kv, hashes, len(token_ids))).blocks)
