"""Sampling parameters built from plain values (HTTP bodies, agent steps)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams


def sampling(
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    json_schema: dict[str, Any] | None = None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    knobs: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """SamplingParams; ``json_schema`` constrains the output to compact JSON (xgrammar).

    ``knobs``: more SamplingParams keywords as they are (top_k, min_p, the penalties,
    logit_bias: :meth:`ladsd.serve.chat.Sampling.knobs`); vLLM checks them.
    """
    so = None
    if json_schema is not None:
        # Compact JSON: no free whitespace, so outputs are short and token-stable.
        so = StructuredOutputsParams(json=json_schema, disable_any_whitespace=True)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stop,
        structured_outputs=so,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        **(knobs or {}),
    )


def forced(n: int) -> SamplingParams:
    """Exactly ``n`` output tokens (replay): greedy, no early stop at EOS."""
    return sampling(max_tokens=n, min_tokens=n, ignore_eos=True)
