"""The CPU the engine runs on, and the dtype it runs in.

Contract:

* :func:`cpu_info` is the one place that reads ``/proc/cpuinfo`` (once per
  process): the CPU model and its feature flags (x86 ``flags``, Arm
  ``Features``). Without the file, the model is the platform's and the flags
  are empty. Nothing here imports torch or vLLM.
* :func:`native_bf16`: whether the CPU computes bf16 in hardware, from the
  flags as Linux names them: x86 ``avx512_bf16`` (Cooper Lake, Sapphire
  Rapids, Zen 4 and later) or ``amx_bf16`` (AMX); Arm ``bf16`` (FEAT_BF16,
  the NEON BFDOT/BFMMLA instructions, e.g. Graviton 3) or ``svebf16`` (the
  SVE forms, which imply FEAT_BF16). ``sve`` alone is not bf16. Anything else
  (AVX2 only, AVX-512 without BF16, Neoverse N1, other architectures, unread
  flags) emulates bf16 in float32 arithmetic: several times slower than
  float32 itself (a 1,024-token SmolLM2 prefill on an AVX2 EPYC: ~15 s in
  bf16, ~3.5 s in float32).
* :func:`resolve_dtype`: an explicit dtype is kept. ``auto`` on a CPU is
  ``bfloat16`` where bf16 is native, else ``float32``; on CUDA ``auto`` stays
  vLLM's own rule (the model's dtype).
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPES = ("auto", "bfloat16", "float32", "float16")
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16", "svebf16"})
# The flags a run file records: what decides the dtype and the kernels' width.
NOTABLE_FLAGS = (
    *("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"),  # x86
    *("bf16", "sve", "svebf16"),  # Arm
)
DTYPE_HELP = (
    "Engine dtype: auto, bfloat16, float32 or float16. auto: on a CPU bfloat16 where it has "
    "native bf16 (x86 avx512_bf16/amx_bf16, Arm bf16), else float32 (emulated bf16 is "
    "several times slower); on a GPU vLLM's choice."
)


@dataclass(frozen=True)
class CpuInfo:
    """The CPU model and its feature flags, in /proc/cpuinfo's order."""

    model: str
    flags: tuple[str, ...]

    @property
    def native_bf16(self) -> bool:
        return native_bf16(self.flags)

    def notable(self) -> list[str]:
        """The flags of :data:`NOTABLE_FLAGS` this CPU has."""
        have = set(self.flags)
        return [f for f in NOTABLE_FLAGS if f in have]


def parse_cpuinfo(text: str, fallback_model: str = "") -> CpuInfo:
    """The first ``model name`` and the first ``flags``/``Features`` line of ``text``."""
    model, flags = "", ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name == "model name" and not model:
            model = value.strip()
        elif name in ("flags", "Features") and not flags:
            flags = value
    return CpuInfo(model or fallback_model, tuple(flags.split()))


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU (read once; the platform's model name without /proc/cpuinfo)."""
    fallback = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text, fallback)


def native_bf16(flags: Iterable[str]) -> bool:
    """Whether a CPU with these flags has bf16 arithmetic in hardware (module docstring)."""
    return not BF16_FLAGS.isdisjoint(flags)


def resolve_dtype(requested: str, on_cuda: bool, flags: Iterable[str]) -> str:
    """The dtype the engine is built with (module docstring); ``requested`` as given."""
    if requested != "auto" or on_cuda:
        return requested
    return "bfloat16" if native_bf16(flags) else "float32"


def meta(info: CpuInfo | None = None) -> dict[str, Any]:
    """What a result file records of the CPU: model, notable flags, native bf16."""
    info = info or cpu_info()
    return {"cpu_model": info.model, "cpu_flags": info.notable(), "bf16_native": info.native_bf16}
