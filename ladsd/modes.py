"""The two orthogonal axes a run is built from besides its delivery order.

* :class:`Retention`: what protects a waiting history's KV blocks on the
  engine side. It belongs to the delivery policy (``Policy.retention``).
* :class:`EnginePolicy`: how vLLM's scheduler orders its waiting queue and
  sizes each step (``--engine-policy``), independent of delivery.
"""

from __future__ import annotations

from enum import StrEnum


class Retention(StrEnum):
    LADS = "lads"  # budgeted, revocable FIFO leases (spec section 3)
    NONE = "none"  # no protection: vLLM's own LRU eviction
    TTL_PIN = "ttl-pin"  # hard pin at readiness for the predicted wait, capped at l
    SESSION = "session"  # HEAR: eviction order by r = p * exp(-idle / 400 s), no references


class EnginePolicy(StrEnum):
    VLLM = "vllm"  # vLLM's own FCFS admission and fixed token budget
    AUGSERVE = "augserve"  # value-density order, dynamic token budget, Preserve/Discard


__all__ = ["EnginePolicy", "Retention"]
