"""AugServe's engine policy (peers.md section 1) as pure formulas and a running-mean predictor.

Units (ours): memory in KV token slots at block granularity (``M = 1`` slot
per token; a context of ``L`` tokens holds ``mem(L) = ceil(L / b) * b``
slots), time in seconds, so every waste and space-time cost is in
slot-seconds. Time comes from ``kappa``, the measured wall time of one prefill
step of ``n_kappa`` tokens (:func:`ladsd.engine.kappa.kappa_tokens`: ``n_kappa =
min(512, max_num_batched_tokens, max_model_len - 1)``, 512 on every profile,
also on the augserve engine's 1,024-token step buffer):

* ``tau_fwd(n) = kappa * n / n_kappa``: forward (prefill) time of ``n`` new
  tokens, linear in ``n`` (ours);
* ``step_s``: one decode step, the running mean of measured decode-only step
  intervals (prior: ``kappa``, ours: a step of at most ``T_max`` tokens).

Context policy during a wait (InferCept's waste; Swap is not offered: the CPU
backend has no KV tier to swap to and ladsd runs vLLM without KV offloading):

* Preserve: ``tau_call_hat * mem(L~)``;
* Discard: ``tau_fwd(L~) * mem(L~) + tau_fwd(L~) * L_other``;
* Preserve iff its waste is strictly smaller (a tie discards, ours).

Space-time cost of a segment, the priority and the token budget are below
(:func:`segment_cost`, :func:`theta`, :func:`token_budget`). Predictions come
only from completed work (:class:`Predictor`), never from a request's
``max_tokens`` (in a replay it carries the replayed output length).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import StrEnum

T_MAX = 512  # the static reference budget T_max
BETA_LOW = 0.5  # (ours) unless calibrated
BETA_HIGH = 2.0  # (ours) unless calibrated


class Context(StrEnum):
    """What happens to a waiting history's KV (Swap: not offered, see the module doc)."""

    PRESERVE = "preserve"
    DISCARD = "discard"


@dataclass(frozen=True)
class AugServeConfig:
    """AugServe's knobs; every default is ours unless calibrated.

    ``aging`` is ``beta`` of ``theta`` (per second of waiting). ``prior_output_tokens``
    is the output-length prediction before any request completed; the wait
    prediction before any completed wait is the lease lifetime ``l`` (so no
    Preserve is taken on no evidence unless Discard would waste more than
    holding the history for a whole ``l``).
    """

    t_max: int = T_MAX
    beta_low: float = BETA_LOW
    beta_high: float = BETA_HIGH
    aging: float = 1.0
    mu: float = 1.0  # per-token footprint, in KV token slots
    prior_output_tokens: float = 128.0


# -- pure formulas ------------------------------------------------------------


def mem(tokens: float, block_size: int) -> int:
    """KV token slots a context of ``tokens`` holds: whole blocks (``M = 1`` per slot)."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    return math.ceil(max(0.0, tokens) / block_size) * block_size


def forward_s(tokens: float, kappa: float, n_kappa: int) -> float:
    """``tau_fwd(n) = kappa * n / n_kappa``: prefill time of ``n`` new tokens (ours)."""
    if n_kappa <= 0 or kappa < 0:
        raise ValueError(f"bad kappa {kappa} over {n_kappa} tokens")
    return kappa * max(0.0, tokens) / n_kappa


def preserve_waste(call_s: float, context: float, block_size: int) -> float:
    """``tau_call_hat * L~ * M``."""
    return max(0.0, call_s) * mem(context, block_size)


def discard_waste(
    context: float, other: float, kappa: float, n_kappa: int, block_size: int
) -> float:
    """``tau_fwd(L~) * L~ * M + tau_fwd(L~) * L_other * M`` (``other`` in slots)."""
    t = forward_s(context, kappa, n_kappa)
    return t * mem(context, block_size) + t * max(0.0, other)


def choose(preserve: float, discard: float) -> Context:
    """The context policy of least waste; a tie discards (ours)."""
    return Context.PRESERVE if preserve < discard else Context.DISCARD


@dataclass(frozen=True)
class Segment:
    """What the cost of one waiting request's segment is computed from."""

    tokens: int  # L: prompt (+ output so far, after a preemption)
    hit: int  # tokens vLLM will find in its prefix cache now
    output: float  # predicted output tokens still to decode
    call_s: float  # predicted wait of the call that ends the segment
    other: int  # L_other: KV slots of every other runnable request


def segment_cost(
    seg: Segment, *, kappa: float, n_kappa: int, step_s: float, block_size: int
) -> tuple[float, Context]:
    """``C_{i,k}`` and the context policy predicted for the segment's call.

    (ours) One formula for both cases of peers.md::

        C = mem(L) * tau_fwd(L - hit)                  prefill, or C^return + C^recompute
          + mem(L + o) * o * step_s                    decode of o predicted tokens
          + {tau_call_hat * mem(L + o) | 0}            C^call(p): Preserve | Discard

    Before the first call ``hit`` is the prompt's cache hit. After a call
    returns, the recompute term is the realised feedback of the policy actually
    used, read from the cache: a held Preserve leaves the whole history
    resident (``C^recompute = 0``), a Discard leaves whatever vLLM has not
    evicted yet; the returned tokens always count. ``p`` is chosen by the
    waste rule at ``L~ = L + o`` (every segment is assumed to end in a call:
    the engine cannot know the last one).
    """
    context = seg.tokens + seg.output
    prefill = mem(seg.tokens, block_size) * forward_s(seg.tokens - seg.hit, kappa, n_kappa)
    decode = mem(context, block_size) * seg.output * max(0.0, step_s)
    keep = preserve_waste(seg.call_s, context, block_size)
    policy = choose(keep, discard_waste(context, seg.other, kappa, n_kappa, block_size))
    return prefill + decode + (keep if policy is Context.PRESERVE else 0.0), policy


def theta(waited_s: float, cost: float, aging: float) -> float:
    """``theta = (1 + beta * w) / C``; a zero cost (``kappa = 0``) ranks first (ours)."""
    value = 1.0 + aging * max(0.0, waited_s)
    return value / cost if cost > 0 else math.inf


def token_budget(
    free_blocks: int,
    preempt_blocks: int,
    block_size: int,
    cfg: AugServeConfig,
    ceiling: int,
) -> int:
    """``B_token = floor((G_free + G_preempt) / mu)``, clipped to ``[beta_low, beta_high] * T_max``.

    ``G`` in KV token slots (blocks times ``block_size``). ``ceiling`` is the
    engine's configured maximum (``max_num_scheduled_tokens``, which vLLM sets
    from ``max_num_batched_tokens``, the size of the model runner's buffers):
    the upper clip is ``min(beta_high * T_max, ceiling)`` and the lower one never
    exceeds it (ours: a budget vLLM cannot use is not counted as given).
    """
    if ceiling <= 0 or cfg.mu <= 0:
        raise ValueError(f"bad budget ceiling {ceiling} or footprint {cfg.mu}")
    hi = min(math.floor(cfg.beta_high * cfg.t_max), ceiling)
    lo = min(math.ceil(cfg.beta_low * cfg.t_max), hi)
    raw = math.floor((max(0, free_blocks) + max(0, preempt_blocks)) * block_size / cfg.mu)
    return max(lo, min(raw, hi))


# -- predictions ----------------------------------------------------------------


@dataclass
class RunningMean:
    n: int = 0
    mean: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.mean += (x - self.mean) / self.n


@dataclass
class Means:
    """A running mean per key (a workflow step) and one over all keys."""

    by_key: dict[Hashable, RunningMean] = field(default_factory=dict)
    all: RunningMean = field(default_factory=RunningMean)

    def add(self, key: Hashable, x: float) -> None:
        self.by_key.setdefault(key, RunningMean()).add(x)
        self.all.add(x)

    def get(self, key: Hashable, prior: float) -> float:
        """The key's mean, else the global one, else ``prior``."""
        m = self.by_key.get(key)
        if m is not None:
            return m.mean
        return self.all.mean if self.all.n else prior


@dataclass
class Predictor:
    """Running means of completed work only (ours; AugServe uses a small model).

    Keys are workflow steps (the turn of a request's continuation id; ``None``
    for requests registered without one); the engine sees no tool names, so no
    per-tool means. Memory is bounded by the number of distinct steps.

    * output tokens: from requests that finished (stopped or length-capped),
      never aborted ones; prior ``prior_output_tokens``;
    * wait: readiness (``lease_notice``) to registration (``lease_bind``) of
      continuations that were registered; prior ``prior_wait_s`` (``l``);
    * decode step: measured decode-only step intervals; prior ``kappa``.
    """

    prior_output_tokens: float
    prior_wait_s: float
    prior_step_s: float
    output: Means = field(default_factory=Means)
    wait: Means = field(default_factory=Means)
    step: RunningMean = field(default_factory=RunningMean)

    def output_tokens(self, key: Hashable) -> float:
        return self.output.get(key, self.prior_output_tokens)

    def wait_s(self, key: Hashable) -> float:
        return self.wait.get(key, self.prior_wait_s)

    def step_s(self) -> float:
        return self.step.mean if self.step.n else self.prior_step_s


__all__ = [
    "BETA_HIGH",
    "BETA_LOW",
    "T_MAX",
    "AugServeConfig",
    "Context",
    "Means",
    "Predictor",
    "RunningMean",
    "Segment",
    "choose",
    "discard_waste",
    "forward_s",
    "mem",
    "preserve_waste",
    "segment_cost",
    "theta",
    "token_budget",
]
