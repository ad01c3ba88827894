"""Block hashes of notices' histories, carried on from the same workflow's last one.

A workflow's next history begins with its last one (the ReAct loop appends the
model's turn and the observation), so the hashes of the full blocks they share
are already known: vLLM's request block hasher continues a request's chain from
its last hash, and only the new blocks are hashed. The result is the same list
:func:`~ladsd.engine.lease_resident.prefix_hashes` gives for the whole history
(the tokens of the shared blocks are compared, not assumed).

Contract:

* Engine thread only (vLLM's ``NONE_HASH`` seed must be set: after
  ``EngineCore.__init__``); nothing locks.
* Memory: the last history and its hashes of at most ``size`` workflows, the
  least recently noticed dropped first. A dropped or edited history is hashed
  whole: it costs time, never a different hash.
* What it saved shows as ``reused`` and ``hashed`` (blocks). Not in the book's
  ``sizes()``: a bounded cache, not state that must empty when nothing is live.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.core.kv_cache_utils import BlockHash

from ladsd.engine.lease_resident import Hasher, prefix_hashes

SIZE = 256  # workflows kept: more than a cohort's, bounded for ladsd serve's many sessions


@dataclass(frozen=True)
class _Last:
    tokens: tuple[int, ...]
    salt: str | None
    hashes: list[BlockHash]


class NoticeHashes:
    """Each workflow's last hashed history (see the contract)."""

    def __init__(self, hasher: Hasher, block_size: int, size: int = SIZE) -> None:
        if block_size <= 0 or size <= 0:
            raise ValueError(f"bad notice hashes: block size {block_size}, size {size}")
        self.hasher = hasher
        self.block_size = block_size
        self.size = size
        self._last: OrderedDict[str, _Last] = OrderedDict()
        self.reused = 0  # blocks whose hash came from the workflow's last history
        self.hashed = 0  # blocks hashed

    def of(
        self, workflow: str, token_ids: Sequence[int], cache_salt: str | None
    ) -> list[BlockHash]:
        """The hashes of every full block of ``token_ids``, as vLLM computes them."""
        tokens = tuple(token_ids)
        last = self._last.pop(workflow, None)
        known: list[BlockHash] = []
        if last is not None and last.salt == cache_salt:  # the salt keys the first block
            n = min(len(last.tokens), len(tokens)) // self.block_size * self.block_size
            if tokens[:n] == last.tokens[:n]:
                known = last.hashes[: n // self.block_size]
        hashes = prefix_hashes(tokens, self.hasher, cache_salt=cache_salt, known=known)
        self.reused += len(known)
        self.hashed += len(hashes) - len(known)
        self._last[workflow] = _Last(tokens, cache_salt, hashes)
        if len(self._last) > self.size:
            self._last.popitem(last=False)
        return hashes
