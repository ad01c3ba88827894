"""Which vLLM scheduler class an engine runs: one place, chosen by engine policy."""

from __future__ import annotations

from ladsd.modes import EnginePolicy


def scheduler_class(policy: EnginePolicy, async_scheduling: bool) -> type:
    """The scheduler class for ``policy`` (vLLM's own order, or AugServe's: whole or
    its order alone, one class told which at ``lease_setup``)."""
    if policy is EnginePolicy.VLLM:
        from ladsd.engine.sched_leases import AsyncLeaseScheduler, LeaseScheduler

        return AsyncLeaseScheduler if async_scheduling else LeaseScheduler
    if policy.augserve:
        from ladsd.engine.sched_augserve import AsyncAugServeScheduler, AugServeScheduler

        return AsyncAugServeScheduler if async_scheduling else AugServeScheduler
    raise ValueError(f"unknown engine policy {policy!r}")
