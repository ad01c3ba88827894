"""kappa: its rule, its measurement, and the daemon's cache of it.

Contract:

* kappa is the wall time of one prefill step of :func:`kappa_tokens` tokens
  (the one rule: 512, less only where the engine cannot run 512), measured on
  the engine thread before the lease scheduler starts (:func:`obtain`) and
  handed to it as a frozen :class:`Kappa`.
* Replays measure kappa at every engine start (:attr:`KappaSource.MEASURE`,
  the default): their link dilation depends on it, and nothing here changes
  that path.
* The daemon (:attr:`KappaSource.CACHE`) reads ``$LADSD_HOME/kappa/<key>.json``
  (default ``~/.cache/ladsd``); on a miss it measures with fewer timed steps
  (:data:`SERVE_SAMPLES`) and stores the result. :attr:`KappaSource.FRESH`
  measures as a replay does and stores the result.
* The key is everything that sets a prefill step's wall time: model and its
  shape (``config.json``), dtype, step tokens, block size, eager mode, CPU model
  and flags (or the GPU), vLLM and torch versions and torch's thread count. An
  entry is used only if its stored key equals the computed one.
* Never fatal: an unreadable, corrupt or foreign entry is ignored with a
  warning (and measured again); a cache that cannot be written is a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from ladsd.config import ladsd_home
from ladsd.engine.cpu import cpu_info

log = logging.getLogger("ladsd.engine")
FORMAT = 1  # bump when the key or the entry changes meaning
KAPPA_TOKENS = 512  # kappa is the wall time of one prefill step of this many tokens
KAPPA_SAMPLES = 15  # timed steps after the warm-up; kappa is their median (about 0.5 s)
SERVE_SAMPLES = 3  # timed steps of a daemon's cache miss (replays time 15)


class KappaSource(StrEnum):
    MEASURE = "measure"  # every start, 15 timed steps, no cache (replays)
    CACHE = "cache"  # the cached value; on a miss measure SERVE_SAMPLES steps, store
    FRESH = "fresh"  # measure as a replay does, store (`ladsd serve --fresh-kappa`)


@dataclass(frozen=True)
class Kappa:
    """kappa: ``seconds`` per prefill step of ``tokens`` tokens.

    ``source``: "measured", "cache", "config" (the lease config's ``kappa_s``) or
    "" (none: 0.0); ``steps``: engine steps run to measure it (0: not measured).
    """

    seconds: float
    tokens: int
    source: str = ""
    steps: int = 0


def kappa_tokens(max_num_batched_tokens: int, max_model_len: int) -> int:
    """Tokens of kappa's step: always 512 (the spec's kappa), also on an engine built
    with a larger step budget (AugServe's ceiling), so dilation compares; fewer only
    where the engine cannot schedule 512."""
    return min(KAPPA_TOKENS, max_num_batched_tokens, max_model_len - 1)


def measure(engine: Any, sched: Any, tokens: int, samples: int = KAPPA_SAMPLES) -> list[float]:
    """Wall times of ``samples`` prefill steps of ``tokens`` tokens (engine thread).

    The first step of a fresh engine pays one-off warm-up costs, so a warm-up
    request runs first; then ``samples`` distinct prompts are timed
    (:data:`KAPPA_SAMPLES` for a replay). One sample let a momentary stall of a
    shared machine set the run's link dilation (1.58 where its neighbours
    measured 0.89-1.10); a median of fifteen follows only a stall longer than
    about a quarter second. The prefix cache is reset afterwards.
    """
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input

    times = []
    for salt in range(samples + 1):  # salt 0 is the warm-up
        ids = [(7919 * i + 104729 * (salt + 1)) % 30000 + 100 for i in range(tokens)]
        params = SamplingParams(max_tokens=1)
        rid = engine.add_request(f"ladsd-kappa-{salt}", tokens_input(ids), params)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
        sched.pop_first_alloc(rid)
    sched.reset_prefix_cache()
    return times[1:]


def obtain(
    source: KappaSource,
    engine: Any,
    sched: Any,
    key_parts: dict[str, Any],
    model_dir: Path,
    say: Callable[[str], None],
) -> Kappa:
    """kappa as ``source`` says: measured at every start (replays) or cached (the daemon).

    ``key_parts``: the engine's part of the cache key (model, dtype, step_tokens, ...).
    """
    n = int(key_parts["step_tokens"])
    if source is KappaSource.MEASURE:
        return Kappa(statistics.median(measure(engine, sched, n)), n, "measured", KAPPA_SAMPLES + 1)
    key = cache_key(key_parts, model_dir)
    if source is KappaSource.CACHE:
        cached = load(key)
        if cached is not None:
            say(f"kappa {cached * 1e3:.1f} ms (cached: {entry_path(key)})")
            return Kappa(cached, n, "cache")
    samples = KAPPA_SAMPLES if source is KappaSource.FRESH else SERVE_SAMPLES
    say(
        f"measuring kappa: {samples + 1} prefill steps of {n} tokens "
        "(cached for the next start)..."
    )
    times = measure(engine, sched, n, samples)
    value = statistics.median(times)
    store(key, value, times)
    return Kappa(value, n, "measured", samples + 1)  # the warm-up step too


def cache_dir() -> Path:
    return ladsd_home() / "kappa"


def _cpu() -> tuple[str, str]:
    """(CPU model, digest of its feature flags) (:func:`ladsd.engine.cpu.cpu_info`)."""
    info = cpu_info()
    flags = " ".join(sorted(info.flags))
    return info.model, hashlib.sha256(flags.encode()).hexdigest()[:16]


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def cache_key(engine: dict[str, Any], model_dir: Path) -> dict[str, str]:
    """The entry's key: ``engine`` (model, dtype, step_tokens, ...) plus machine and versions.

    Call it on the engine thread after vLLM built the engine (torch's thread
    count is vLLM's then).
    """
    import torch
    import vllm

    try:
        shape = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]
    except OSError:
        shape = "unknown"
    cpu, flags = _cpu()
    key = {str(k): str(v) for k, v in engine.items()}
    key |= {"shape": shape, "cpu": cpu, "cpu_flags": flags, "device": _device()}
    key |= {"vllm": vllm.__version__, "torch": torch.__version__}
    key |= {"threads": str(torch.get_num_threads()), "format": str(FORMAT)}
    return key


def entry_path(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{digest}.json"


def load(key: dict[str, str]) -> float | None:
    """The cached kappa of ``key``; None on a miss (a bad entry also warns)."""
    path = entry_path(key)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("kappa cache %s unreadable (%s): measuring again", path, e)
        return None
    try:
        entry = json.loads(raw)
        kappa = float(entry["kappa"])
        stored = entry["key"]
    except (ValueError, TypeError, KeyError) as e:
        log.warning("kappa cache %s is corrupt (%s): measuring again", path, e)
        return None
    if stored != key:
        log.warning("kappa cache %s was stored for another engine or machine: ignored", path)
        return None
    if not (math.isfinite(kappa) and kappa > 0):
        log.warning("kappa cache %s holds kappa %r: measuring again", path, kappa)
        return None
    return kappa


def store(key: dict[str, str], kappa: float, samples: list[float]) -> Path | None:
    """Write the entry atomically; None (and a warning) if it cannot be written."""
    path = entry_path(key)
    entry = {"key": key, "kappa": kappa, "samples": samples, "measured_at": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kappa-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("kappa cache %s not written (%s): the next start measures again", path, e)
        return None
    return path
