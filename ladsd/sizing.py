"""Sizing, in one place: the paper's constants, the pool and ``H`` rules, and the
engine a run name needs; :func:`for_run` applies them, once per run.

The paper's numbers (spec 5): a KV pool of 197,040 tokens in blocks of 16
(12,315 blocks) and ``H`` 2,048 of them; the ``paper`` profile is built from them.

Pool rule (ours, stated in the issue that introduced it): the pool holds as many
*final* workflow histories as the paper's pool does, and ``H`` is the same
fraction of the pool as the paper's. The controlled workload's mean final
history at paper scale (prompt, six outputs and six tool messages) is what
:data:`HISTORIES_PER_POOL` divides into the pool. The rule is applied per
workload instance (a profile with ``pool_rule``), so captured paths (short,
real agent histories) get a pool as tight as the synthetic ones.

Engine rule (:func:`engine_for`): an unbounded-pool run name (``infinite-cache``)
gets a pool nothing outgrows; the AugServe engine policy gets a step buffer its
token budget can fill (the profile's :class:`~ladsd.engine.augserve.AugServeConfig`).

Contract: a run's profile is ``for_run(profile, run, workload, tokens_of)``,
computed once by whoever opens the runtime (the replay runner, ``ladsd serve``,
capture); :func:`ladsd.wiring.open_runtime` takes it as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ladsd.modes import EnginePolicy

if TYPE_CHECKING:
    from ladsd.config import Profile
    from ladsd.workloads.spec import Workload

PAPER_POOL_TOKENS = 197_040
PAPER_BLOCK_SIZE = 16
PAPER_BLOCKS = PAPER_POOL_TOKENS // PAPER_BLOCK_SIZE  # 12,315
PAPER_HEADROOM = 2048
HEADROOM_FRACTION = PAPER_HEADROOM / PAPER_BLOCKS  # 0.166
# 197,040 / the paper-scale controlled workload's mean final history (17,087-17,102
# tokens with the SmolLM2 tokenizer's tool messages, seeds 1-3; tests/unit/test_sizing.py).
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


def engine_for(
    profile: Profile, policy: str, engine_policy: EnginePolicy = EnginePolicy.VLLM
) -> Profile:
    """``profile`` with the engine the run name (``policy`` on ``engine_policy``) needs.

    * an unbounded-pool name of the registry (``infinite-cache``) gets a pool nothing
      outgrows;
    * the AugServe engine policy gets a step buffer its token budget can fill:
      ``max_num_batched_tokens >= beta_high * T_max`` of the profile's AugServe
      config (1,024; vLLM's own scheduler and ``augserve-order``, which keeps vLLM's
      budget, keep the profile's fixed 512).
    """
    from ladsd.delivery.registry import unbounded_pool  # it imports the policies

    eng = profile.engine
    if EnginePolicy(engine_policy).dynamic_budget:
        aug = profile.peers.augserve
        step = max(eng.max_num_batched_tokens, math.floor(aug.beta_high * aug.t_max))
        eng = replace(eng, max_num_batched_tokens=step)
    if unbounded_pool(policy):
        w = profile.workload
        need = sum(w.history_tokens) * w.n_workflows  # generous: every history at the largest
        eng = replace(eng, num_gpu_blocks_override=need // eng.resolved_block_size() * 2)
    return profile if eng == profile.engine else replace(profile, engine=eng)


def for_run(
    profile: Profile,
    policy: str,
    engine_policy: EnginePolicy = EnginePolicy.VLLM,
    workload: Workload | None = None,
    tokens_of: Callable[[str], TokensOf] | None = None,
) -> Profile:
    """The profile one run uses: :func:`engine_for`, then (a ``pool_rule`` profile, a
    bounded pool, a ``workload`` given) the pool rule for that workload instance.

    ``tokens_of(model)`` gives the tool-message token count of an observation with
    that model's tokenizer (asked only where the pool rule applies).
    """
    from ladsd.delivery.registry import unbounded_pool

    prof = engine_for(profile, policy, engine_policy)
    if workload is not None and prof.pool_rule and not unbounded_pool(policy):
        if tokens_of is None:
            raise ValueError(f"profile {prof.name!r} sizes its pool by the rule: give tokens_of")
        prof = sized(prof, workload, tokens_of(prof.engine.model))
    return prof
