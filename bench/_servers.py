"""Start, check and stop the servers the bench scripts compare (imported as ``_servers``).

Both kinds get the same engine settings (:func:`engine_settings`, from a ladsd profile
and the overrides): model path, max_model_len, block size, step tokens, KV pool in
blocks, max_num_seqs, dtype (resolved once here by ladsd's rule and passed to both),
eager mode, 1 GiB of KV space, prefix caching on.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ladsd.config import PROFILES, has_cuda
from ladsd.engine import cpu, models


def cpu_dict() -> dict[str, Any]:
    info = cpu.cpu_info()
    return {
        "model": info.model,
        "notable_flags": info.notable(),
        "bf16_native": info.native_bf16,
        "flags": list(info.flags),
        "cpus": os.cpu_count(),
    }


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    eng = PROFILES[args.profile].engine
    # Both servers get the dtype ladsd would pick, explicitly: vLLM's own "auto" keeps
    # the model's bf16 on a CPU that only emulates it.
    dtype = cpu.resolve_dtype(args.dtype or eng.dtype, has_cuda(), cpu.cpu_info().flags)
    return {
        "model_path": str(models.model_path(args.model)),
        "max_model_len": args.max_model_len or eng.max_model_len,
        "block_size": eng.resolved_block_size(),
        "max_num_batched_tokens": eng.max_num_batched_tokens,
        "num_gpu_blocks_override": args.kv_blocks or eng.num_gpu_blocks_override,
        "max_num_seqs": args.max_num_seqs or eng.max_num_seqs,
        "dtype": dtype,
        "kv_cache_memory_bytes": eng.kv_cache_memory_bytes or 2**30,
        "enforce_eager": True if eng.enforce_eager is None else eng.enforce_eager,
        "seed": eng.seed,
    }


def ladsd_command(args: argparse.Namespace, port: int, e: dict[str, Any]) -> list[str]:
    cmd = [sys.executable, "-c", "from cli.main import app; app()", "serve", "--port", str(port)]
    cmd += ["--profile", args.profile, "--model", args.model, "--policy", args.policy]
    cmd += ["--kv-blocks", str(e["num_gpu_blocks_override"])]
    cmd += ["--max-num-seqs", str(e["max_num_seqs"]), "--max-model-len", str(e["max_model_len"])]
    return cmd + ["--dtype", e["dtype"]]


def vllm_command(args: argparse.Namespace, port: int, e: dict[str, Any]) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--model", e["model_path"], "--served-model-name", args.model]
    cmd += ["--enable-prefix-caching", "--dtype", e["dtype"], "--seed", str(e["seed"])]
    for flag in ("max_model_len", "block_size", "max_num_batched_tokens", "max_num_seqs"):
        cmd += [f"--{flag.replace('_', '-')}", str(e[flag])]
    cmd += ["--num-gpu-blocks-override", str(e["num_gpu_blocks_override"])]
    cmd += ["--kv-cache-memory-bytes", str(e["kv_cache_memory_bytes"])]
    cmd += ["--enforce-eager"] if e["enforce_eager"] else []
    return cmd + ["--disable-log-stats", "--disable-uvicorn-access-log"]


def linked_home(under: Path) -> Path:
    home = Path(tempfile.mkdtemp(prefix="home-", dir=under))
    (home / "models").symlink_to(models.model_path("tiny").parent)
    return home


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
