"""Frozen configuration dataclasses and named profiles.

Names follow lads-spec.md: ``H`` is ``headroom_blocks``, ``l`` is
``lease_lifetime_s``, ``R`` is ``rate_bytes_per_s``, ``h`` is ``FRAME_OVERHEAD``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ladsd import sizing
from ladsd.engine.augserve import AugServeConfig  # a leaf: AugServe's pure formulas

FRAME_HEADER_BYTES = 1024
FRAME_OVERHEAD = 4 + FRAME_HEADER_BYTES  # h = 1028 framing bytes per result


def ladsd_home() -> Path:
    """The ladsd cache dir: ``$LADSD_HOME`` or ``~/.cache/ladsd``."""
    return Path(os.environ.get("LADSD_HOME", Path.home() / ".cache" / "ladsd"))


def has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # torch missing or broken: treat as CPU
        return False


@dataclass(frozen=True)
class EngineConfig:
    """How the embedded vLLM engine is built."""

    model: str = "smollm2-135m"  # a profile name from ladsd.engine.models
    max_num_seqs: int = 8  # m
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    block_size: int | None = None  # None: 32 on CPU (CPU attention), 16 on GPU
    num_gpu_blocks_override: int | None = None  # sizes the KV pool
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None  # None: on for CPU
    async_scheduling: bool = False
    seed: int = 0
    dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None  # CPU: KV cache space
    gpu_memory_utilization: float = 0.85

    def resolved_block_size(self) -> int:
        if self.block_size is not None:
            return self.block_size
        return 16 if has_cuda() else 32


@dataclass(frozen=True)
class LinkConfig:
    """The token-bucket paced localhost TCP return link (spec section 2)."""

    rate_bytes_per_s: float = 4000.0  # R: 32 kbit/s
    bucket_bytes: int = 512  # depth: at most one write chunk
    window: int = 4  # committed frames not yet completely received
    codec: str = "identity"  # or "gzip6"
    max_payload_bytes: int = 16 * 1024 * 1024
    host: str = "127.0.0.1"


@dataclass(frozen=True)
class LeaseConfig:
    """Prefix-lease parameters (spec section 3)."""

    enabled: bool = True
    headroom_blocks: int = 2048  # H
    lease_lifetime_s: float = 8.0  # l
    tick_s: float = 0.1  # budget evaluation period
    theta: float = 0.75  # turnover override threshold U >= theta * C
    record_max_age_s: float = 1.0  # sender-side validity: at most 1 s old
    kappa_s: float | None = None  # None: measured once at engine start


@dataclass(frozen=True)
class WorkloadConfig:
    """Token quantities and timing of the workloads (spec section 5)."""

    n_workflows: int = 16
    calls_per_workflow: int = 6
    history_tokens: tuple[int, ...] = (8192, 12288, 20480, 22528)
    context_tokens: int = 32768
    output_tokens: int = 64
    cohort: int = 8
    cohort_gap_s: float = 0.05
    cohort_limit_s: float = 60.0
    arrival_spread_s: float = 2.0
    # web-burst / captured: at most this many workflows and calls each (smoke only)
    replay_limit: tuple[int, int] | None = None


@dataclass(frozen=True)
class PeerConfig:
    """Knobs of the neighbouring designs (peers.md) that a profile may change.

    Run files record them only when they differ from these defaults (plan.config).
    """

    guard_s: float = 10.0  # HEAR's waiting guard W (ours: 10 s; ladsd.delivery.hear.GUARD_S)
    # AugServe's knobs: its scheduler and its step buffer (ladsd.sizing.engine_for) read these.
    augserve: AugServeConfig = field(default_factory=AugServeConfig)


@dataclass(frozen=True)
class Profile:
    """A named, complete run configuration."""

    name: str
    engine: EngineConfig
    link: LinkConfig
    lease: LeaseConfig
    workload: WorkloadConfig
    notes: str = ""
    # Size the KV pool and H per workload by the paper's ratios (ladsd.sizing).
    pool_rule: bool = False
    # Calibration's kappa (s) in bfloat16, and in float32 (the dtype of a CPU without
    # native bf16): a pass divides the link rate by kappa / the reference of the dtype
    # it runs and multiplies every time constant by it (time dilation, recorded in
    # every run file; ladsd.workloads.dilation, kappa_ref()).
    kappa_ref_s: float | None = None
    kappa_ref_float32_s: float | None = None
    peers: PeerConfig = field(default_factory=PeerConfig)
    extra: dict = field(default_factory=dict, compare=False, hash=False)


PAPER_WORKLOAD = WorkloadConfig()  # spec section 5 at paper scale
# kappa (one 512-token step) of the cpu profile's engine when it was calibrated:
# the mean of the four engine starts of bench/calibrate.py --profile cpu, seeds 1
# and 2, quiet machine, 2026-11-30 (0.0329, 0.0356, 0.0377, 0.0308 s; docs/profiles.md).
CPU_KAPPA_REF_S: float | None = 0.034
# The float32 reference: the float32 kappa at which a float32 engine's time on the
# calibration workload equals the calibration's. Calibrated on a quiet Intel Xeon with
# AMX, 2026-12-02 (bench/calibrate.py --profile cpu --dtype float32, seeds 1 and 2):
# kappa 0.0438, 0.0429, 0.0405, 0.0374 s (mean 0.0412) at engine times 1.095x the
# calibration's (geometric mean of both sides, both seeds), so 0.0412 / 1.095
# (docs/profiles.md; bench/results/calibration/).
CPU_KAPPA_REF_F32_S: float | None = 0.038
# The cpu profile's dtype. float32 on every CPU: its kernels are plain FMA on any
# x86, where bf16's gains depend on the CPU (AMX speeds a 512-token prefill ~5x but a
# decode ~1.7x, which narrows no-reuse / reuse from ~3 to ~2 and leaves the regime;
# docs/profiles.md). `--dtype` overrides it.
CPU_DTYPE = "float32"

PROFILES: dict[str, Profile] = {
    "paper": Profile(
        name="paper",
        engine=EngineConfig(
            model="qwen2.5-7b-shape",
            max_model_len=32768,
            block_size=sizing.PAPER_BLOCK_SIZE,
            num_gpu_blocks_override=sizing.PAPER_BLOCKS,  # KV pool of 197,040 tokens
        ),
        link=LinkConfig(rate_bytes_per_s=4000.0),
        lease=LeaseConfig(headroom_blocks=sizing.PAPER_HEADROOM, lease_lifetime_s=8.0),
        workload=PAPER_WORKLOAD,
        notes="Paper scale (spec 5): Qwen2.5-7B shape, dummy weights; one NVIDIA GPU.",
    ),
    "cpu": Profile(
        name="cpu",
        engine=EngineConfig(
            model="smollm2-shape-2l",
            max_model_len=8192,
            block_size=32,
            num_gpu_blocks_override=2300,  # replaced per workload by the pool rule
            dtype=CPU_DTYPE,
        ),
        link=LinkConfig(rate_bytes_per_s=4000.0),
        lease=LeaseConfig(headroom_blocks=sizing.headroom_for(2300), lease_lifetime_s=8.0),
        workload=WorkloadConfig(
            history_tokens=(2048, 3072, 5120, 5632),
            context_tokens=8192,
            output_tokens=64,
        ),
        notes="1/4 token scale, SmolLM2 shape with 2 layers, calibrated with "
        "bench/calibrate.py; pool and H by the paper's ratios per workload (README).",
        pool_rule=True,
        kappa_ref_s=CPU_KAPPA_REF_S,
        kappa_ref_float32_s=CPU_KAPPA_REF_F32_S,
    ),
    "cpu-eighth": Profile(
        name="cpu-eighth",
        engine=EngineConfig(
            model="smollm2-shape-6l",
            max_model_len=4096,
            block_size=32,
            # Not 1/8 of the paper's pool (769 blocks): observations and outputs
            # are not scaled, so 1/8-scale histories grow ~60 % over a workflow
            # (paper: ~7 %). 1,150 blocks hold as many final histories (~11.5)
            # as the paper's pool does; at 769 leases are revoked before their
            # handoff (docs/results.md).
            num_gpu_blocks_override=1150,
        ),
        link=LinkConfig(rate_bytes_per_s=4000.0),
        lease=LeaseConfig(headroom_blocks=4096 // 32, lease_lifetime_s=8.0),
        workload=WorkloadConfig(
            history_tokens=(1024, 1536, 2560, 2816),
            context_tokens=4096,
            output_tokens=64,
        ),
        notes="The earlier 1/8 token scale (bench/results/cpu-eighth was run with it).",
    ),
    "smoke": Profile(
        name="smoke",
        engine=EngineConfig(model="tiny", max_model_len=4096, num_gpu_blocks_override=160),
        link=LinkConfig(rate_bytes_per_s=64000.0),
        lease=LeaseConfig(headroom_blocks=8, lease_lifetime_s=8.0),
        workload=WorkloadConfig(
            n_workflows=4,
            calls_per_workflow=3,
            history_tokens=(128, 192, 256, 320),
            context_tokens=2048,
            output_tokens=8,
            cohort=4,
            arrival_spread_s=0.2,
            replay_limit=(4, 3),
        ),
        notes="CI smoke: tiny dummy-weight shape, 4 workflows x 3 calls.",
    ),
}


def kappa_ref(profile: Profile, dtype: str) -> float | None:
    """The calibration's kappa for an engine that runs ``dtype`` (None: no reference).

    A kappa compares only with one measured in the same dtype: emulated bf16 slows
    prefill and decode by different factors, so a float32 engine is set against
    the float32 reference (docs/profiles.md).
    """
    return {"bfloat16": profile.kappa_ref_s, "float32": profile.kappa_ref_float32_s}.get(dtype)
