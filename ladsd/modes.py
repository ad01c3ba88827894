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
    # (ours, lads-adaptive) LADS leases, and SESSION's free-queue order for the
    # waiting histories no lease holds (a leased block is never free): no budget cost
    LADS_SESSION = "lads+session"

    @property
    def orders_free_queue(self) -> bool:
        """Does this retention impose HEAR's session order on vLLM's free queue?"""
        return self in (Retention.SESSION, Retention.LADS_SESSION)


class EnginePolicy(StrEnum):
    VLLM = "vllm"  # vLLM's own FCFS admission and fixed token budget
    AUGSERVE = "augserve"  # value-density order, dynamic token budget, Preserve/Discard
    # (ours, issue 23) AugServe's waiting-queue order only: vLLM's fixed token budget,
    # no Preserve (waiting histories are left to the delivery's leases and vLLM's eviction)
    AUGSERVE_ORDER = "augserve-order"

    # What each engine policy implies, in one place (the scheduler class, its setup and
    # the step buffer all read these two).
    @property
    def augserve(self) -> bool:
        """Does this engine order vLLM's waiting queue by AugServe's theta?"""
        return self in (EnginePolicy.AUGSERVE, EnginePolicy.AUGSERVE_ORDER)

    @property
    def dynamic_budget(self) -> bool:
        """AugServe's dynamic token budget and Preserve/Discard, and the step buffer
        (``beta_high * T_max``) the budget needs; else vLLM's fixed budget, no Preserve."""
        return self is EnginePolicy.AUGSERVE


__all__ = ["EnginePolicy", "Retention"]
