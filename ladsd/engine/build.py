"""Building the embedded engine: vLLM's ``LLMEngine`` in this process, and its tokenizer.

Contract:

* :func:`build` runs on the engine thread (vLLM state is that thread's) and
  returns a frozen :class:`Built`; only ``tokenizer`` and ``dtype`` may be read
  on the asyncio side (a separate tokenizer: fast tokenizers are not safe to
  share across threads).
* vLLM 0.32's ``AsyncLLM`` always spawns its engine core in a child process,
  so the engine is built with multiprocessing off (:func:`in_process`) and
  stepped by ladsd; an engine core in another process is an error.
* dtype: the one asked (:func:`ladsd.engine.cpu.resolve_dtype`); ``Built.dtype``
  is the one vLLM chose (on CUDA ``auto`` becomes the model's).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ladsd.config import EngineConfig
from ladsd.engine import models
from ladsd.engine.cpu import cpu_info
from ladsd.engine.outbound import EngineError
from ladsd.modes import EnginePolicy

log = logging.getLogger("ladsd.engine")
MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@dataclass(frozen=True)
class Built:
    """What :func:`build` made: vLLM's engine and its scheduler (engine thread only),
    the asyncio side's tokenizer, the dtype vLLM chose and the model's directory."""

    engine: Any  # vllm LLMEngine
    sched: Any  # the LeaseScheduler (LeaseMixin) of the engine core
    tokenizer: Any
    dtype: str
    model_dir: Any  # pathlib.Path


def in_process() -> None:
    """Keep EngineCore in this process (ladsd steps it); override a user's setting loudly."""
    v = os.environ.get(MP_ENV)
    if v not in (None, "0"):
        log.warning(
            "%s=%s is not supported by ladsd (the engine runs in-process): using 0", MP_ENV, v
        )
    os.environ[MP_ENV] = "0"


def build(
    cfg: EngineConfig,
    dtype: str,
    engine_policy: EnginePolicy,
    cpu: bool,
    say: Callable[[str], None],
) -> Built:
    """vLLM's engine for ``cfg`` with the scheduler class of ``engine_policy``."""
    in_process()
    from vllm import EngineArgs
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.engine.llm_engine import LLMEngine

    from ladsd.engine.schedulers import scheduler_class

    prof = models.MODEL_PROFILES.get(cfg.model)
    if prof is None:
        raise models.ModelError(f"unknown model profile {cfg.model!r}")
    path = models.model_path(cfg.model)
    args = EngineArgs(
        model=str(path),
        tokenizer=str(path),
        load_format="dummy" if prof.dummy else "auto",
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        block_size=cfg.resolved_block_size(),
        enable_prefix_caching=cfg.enable_prefix_caching,
        enforce_eager=cpu if cfg.enforce_eager is None else cfg.enforce_eager,
        num_gpu_blocks_override=cfg.num_gpu_blocks_override,
        scheduler_cls=scheduler_class(engine_policy, cfg.async_scheduling),
        async_scheduling=cfg.async_scheduling,
        seed=cfg.seed,
        dtype=dtype,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes or (2**30 if cpu else None),
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        disable_log_stats=True,
        # Compact JSON actions (xgrammar): whitespace off engine-wide.
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    )
    say(f"loading model {cfg.model} ({'dummy weights' if prof.dummy else path})...")
    say(dtype_line(cfg, dtype, cpu))
    engine = LLMEngine.from_engine_args(args)
    client = engine.engine_core
    if not isinstance(client, InprocClient):  # a child process: ladsd cannot step it
        raise EngineError(f"vLLM started its engine core in another process; set {MP_ENV}=0")
    chosen = str(engine.model_config.dtype).removeprefix("torch.")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return Built(engine, client.engine_core.scheduler, tokenizer, chosen, path)


def dtype_line(cfg: EngineConfig, dtype: str, cpu: bool) -> str:
    if cfg.dtype != "auto" or not cpu:
        return f"dtype {dtype} (asked: {cfg.dtype})"
    why = "native bf16" if cpu_info().native_bf16 else "this CPU has no native bf16"
    return f"dtype {dtype} (auto: {why}; --dtype overrides)"


def kappa_key(cfg: EngineConfig, built: Built, step_tokens: int) -> dict[str, Any]:
    """The engine's part of kappa's cache key (:func:`ladsd.engine.kappa.cache_key`)."""
    mc = built.engine.model_config
    return {
        "model": cfg.model,
        "dtype": mc.dtype,
        "step_tokens": step_tokens,
        "block_size": cfg.resolved_block_size(),
        "enforce_eager": mc.enforce_eager,
    }
