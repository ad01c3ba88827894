"""vLLM schedulers and requests without a model (lease tests and benchmarks).

Built the way vLLM's own ``tests/v1/core/utils.py::create_scheduler`` builds
them: ``VllmConfig`` from a local model-config directory (a ``config.json``
only, never a hub download), a ``KVCacheConfig`` with one full-attention group
of ``num_blocks`` blocks, and no workers. Steps are driven by
:func:`fake_output`, which plays the model's part in ``update_from_output``.
"""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.request import Request

from ladsd.engine.lease_resident import make_hasher

EOS = 2

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": EOS,
}


@cache
def model_dir() -> str:
    """A process-wide temp dir holding only a tiny Llama ``config.json``."""
    d = Path(tempfile.mkdtemp(prefix="ladsd-bare-model-"))
    (d / "config.json").write_text(json.dumps(_CONFIG))
    return str(d)


def make_scheduler(
    cls: type,
    *,
    num_blocks: int = 128,
    block_size: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 512,
    max_model_len: int = 8192,
    enable_prefix_caching: bool = True,
    hash_algo: str = "sha256",
) -> Any:
    """A ``cls`` scheduler (vLLM ``Scheduler`` or subclass) over ``num_blocks`` blocks."""
    import torch
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(
        model=model_dir(),
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        async_scheduling=issubclass(cls, AsyncScheduler),
        is_encoder_decoder=False,
        watermark=0.0,
    )
    cache_cfg = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
        prefix_caching_hash_algo=hash_algo,
    )
    vcfg = VllmConfig(
        scheduler_config=sched,
        model_config=model,
        cache_config=cache_cfg,
        parallel_config=ParallelConfig(),
    )
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    cache_cfg.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(vcfg)
    s = cls(
        vllm_config=vcfg,
        kv_cache_config=kv_cfg,
        block_size=block_size,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vcfg),
    )
    # As EngineCore.__init__ does after building the scheduler.
    init_none_hash(get_hash_fn_by_name(hash_algo))
    return s


def make_request(
    request_id: str,
    token_ids: list[int],
    *,
    block_size: int = 16,
    max_tokens: int = 4,
    hash_algo: str = "sha256",
    cache_salt: str | None = None,
) -> Request:
    """A vLLM request hashed like EngineCore hashes real ones."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=params,
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=make_hasher(block_size, hash_algo),
    )


def fake_output(scheduler: Any, scheduler_output: Any, token: int = 7) -> Any:
    """The model's answer to a step: one sampled token per request done prefilling."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[
            [] if scheduler.requests[r].is_prefill_chunk else [token] for r in req_ids
        ],
    )


def step(scheduler: Any) -> Any:
    """One engine step without a model: schedule, then feed back fake tokens."""
    out = scheduler.schedule()
    if out.total_num_scheduled_tokens > 0:
        scheduler.update_from_output(out, fake_output(scheduler, out))
    return out
