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
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock, get_request_block_hasher
from vllm.v1.request import Request

Hasher = Callable[[Request], list[BlockHash]]

_PROBE_PARAMS = SamplingParams(max_tokens=1)


def make_hasher(hash_block_size: int, hash_algo: str = "sha256") -> Hasher:
    """vLLM's request block hasher for ``hash_block_size`` and ``hash_algo``."""
    return get_request_block_hasher(hash_block_size, get_hash_fn_by_name(hash_algo))


def prefix_hashes(
    token_ids: Sequence[int],
    hasher: Hasher,
    *,
    cache_salt: str | None = None,
    lora_request: Any = None,
) -> list[BlockHash]:
    """Block hashes of every full block of ``token_ids`` (extra keys included)."""
    if not token_ids:
        return []
    probe = Request(
        request_id="ladsd-lease-probe",
        prompt_token_ids=list(token_ids),
        sampling_params=_PROBE_PARAMS,
        pooling_params=None,
        cache_salt=cache_salt,
        lora_request=lora_request,
        block_hasher=hasher,
    )
    return list(probe.block_hashes)


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


def flatten(groups: Sequence[Sequence[KVCacheBlock]]) -> list[KVCacheBlock]:
    """The real blocks of a per-group block list, null blocks skipped."""
    return [b for g in groups for b in g if not b.is_null]


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
    return flatten(lookup(kv, hashes, len(token_ids)))
