"""Engine benchmark: start-up, prefill throughput, decode step time at batch 1 and 8.

Runs the embedded engine (default model SmolLM2-135M-Instruct) and prints a
table, then one JSON line. Measures; never asserts.

    .venv/bin/python bench/engine.py [--model smollm2-135m] [--prefill 1024] [--decode 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

import orjson
from rich.console import Console
from rich.table import Table

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from ladsd.config import EngineConfig  # noqa: E402
from ladsd.engine import cpu  # noqa: E402
from ladsd.engine.params import sampling  # noqa: E402
from ladsd.engine.thread import EngineThread  # noqa: E402


def prompt(n: int, salt: int) -> list[int]:
    return [100 + (salt * 7919 + i * 104729) % 40000 for i in range(n)]


async def run(model: str, prefill: int, decode: int) -> dict:
    cfg = EngineConfig(model=model, max_model_len=max(4096, prefill + decode + 16))
    t0 = time.perf_counter()
    async with EngineThread(cfg) as eng:
        startup = time.perf_counter() - t0
        # Prefill: one uncached prompt, one output token.
        t = time.perf_counter()
        await eng.complete(prompt(prefill, 1), sampling(max_tokens=1))
        prefill_s = time.perf_counter() - t
        res = {
            "model": model,
            "startup_s": startup,
            "kappa_s": eng.kappa,
            "prefill_tokens": prefill,
            "prefill_tok_s": prefill / prefill_s,
        }
        for batch in (1, 8):
            # Short prompts, `decode` forced tokens each: (time - prefill share) / steps.
            ps = [prompt(32, 100 + batch * 10 + k) for k in range(batch)]
            params = sampling(max_tokens=decode, ignore_eos=True)
            t = time.perf_counter()
            outs = await asyncio.gather(*[eng.complete(p, params) for p in ps])
            wall = time.perf_counter() - t
            firsts = [o.stamps.n for o in outs if o.stamps.n is not None]
            # decode window: from the last first-allocation to the last completion
            span = max(o.stamps.f for o in outs) - max(firsts)
            res[f"decode_ms_step_b{batch}"] = 1000 * span / (decode - 1)
            res[f"decode_wall_s_b{batch}"] = wall
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=64)
    a = ap.parse_args()
    res = asyncio.run(run(a.model, a.prefill, a.decode))
    res["machine"] = f"{platform.machine()} {os.cpu_count()} cpus"
    res |= cpu.meta()  # the CPU model and flags
    t = Table("metric", "value", title=f"engine benchmark ({a.model})")
    t.add_row("start-up (s)", f"{res['startup_s']:.2f}")
    t.add_row("kappa: one 512-token step (s)", f"{res['kappa_s']:.3f}")
    t.add_row(f"prefill tok/s ({a.prefill} tokens)", f"{res['prefill_tok_s']:.0f}")
    for b in (1, 8):
        t.add_row(f"decode ms/step, batch {b}", f"{res[f'decode_ms_step_b{b}']:.1f}")
    t.add_row(
        "batch-8 / batch-1 step time", f"{res['decode_ms_step_b8'] / res['decode_ms_step_b1']:.2f}x"
    )
    Console().print(t)
    print(orjson.dumps(res).decode())


if __name__ == "__main__":
    main()
