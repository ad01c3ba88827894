"""The KV pool and ``H`` of a scaled profile, by one rule taken from the paper.

Rule (ours, stated in the issue that introduced it): the pool holds as many
*final* workflow histories as the paper's pool does, and ``H`` is the same
fraction of the pool as the paper's. At paper scale (spec 5) the pool is
197,040 tokens and ``H`` 2,048 of its 12,315 blocks; the controlled workload's
mean final history there (prompt, six outputs and six tool messages) is what
:data:`HISTORIES_PER_POOL` divides into the pool. The rule is applied per
workload instance, so captured paths (short, real agent histories) get a pool
as tight as the synthetic ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from ladsd.config import Profile
from ladsd.workloads.spec import Workload

PAPER_POOL_TOKENS = 197_040
PAPER_BLOCKS = PAPER_POOL_TOKENS // 16
PAPER_HEADROOM = 2048
HEADROOM_FRACTION = PAPER_HEADROOM / PAPER_BLOCKS  # 0.166
# 197,040 / the paper-scale controlled workload's mean final history (17,087-17,102
# tokens with the SmolLM2 tokenizer's tool messages, seeds 1-3; tests/test_sizing.py).
HISTORIES_PER_POOL = 11.53

TokensOf = Callable[[bytes], int]  # tokens of one observation as its tool message


def final_history(wl: Workload, tokens_of: TokensOf) -> float:
    """Mean final history (tokens) over the workload's workflows."""
    sizes = []
    for w in wl.workflows:
        n = len(w.prompt_ids) + w.first_output_tokens
        for c in w.calls:
            obs = len(c.suffix_ids) if c.suffix_ids is not None else tokens_of(c.observation)
            n += obs + c.output_tokens
        sizes.append(n)
    return sum(sizes) / len(sizes)


def pool_for(mean_final: float, block: int) -> tuple[int, int]:
    """(pool blocks, H blocks) by the rule."""
    pool = math.ceil(HISTORIES_PER_POOL * mean_final / block)
    return pool, headroom_for(pool)


def headroom_for(pool: int) -> int:
    """``H`` of a ``pool``-block pool: the paper's fraction of it."""
    return max(1, round(HEADROOM_FRACTION * pool))


def with_pool(profile: Profile, pool: int) -> Profile:
    """``profile`` with a ``pool``-block KV pool and ``H`` the rule's fraction of it."""
    return replace(
        profile,
        engine=replace(profile.engine, num_gpu_blocks_override=pool),
        lease=replace(profile.lease, headroom_blocks=headroom_for(pool)),
    )


def sized(profile: Profile, wl: Workload, tokens_of: TokensOf) -> Profile:
    """``profile`` with its pool and ``H`` set by the rule for ``wl``."""
    pool, _ = pool_for(final_history(wl, tokens_of), profile.engine.resolved_block_size())
    return with_pool(profile, pool)
