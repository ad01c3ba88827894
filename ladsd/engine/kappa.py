"""kappa for the daemon: measured once per machine and engine shape, then read from a cache.

Contract:

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
import tempfile
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

from ladsd.config import ladsd_home
from ladsd.engine.cpu import cpu_info

log = logging.getLogger("ladsd.engine")
FORMAT = 1  # bump when the key or the entry changes meaning
SERVE_SAMPLES = 3  # timed steps of a daemon's cache miss (replays time 15)


class KappaSource(StrEnum):
    MEASURE = "measure"  # every start, 15 timed steps, no cache (replays)
    CACHE = "cache"  # the cached value; on a miss measure SERVE_SAMPLES steps, store
    FRESH = "fresh"  # measure as a replay does, store (`ladsd serve --fresh-kappa`)


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
