"""Which vLLM scheduler class an engine runs: one place, chosen by engine policy."""

from __future__ import annotations

from ladsd.modes import EnginePolicy


def scheduler_class(policy: EnginePolicy, async_scheduling: bool) -> type:
    """The scheduler class for ``policy`` (vLLM's own order, or AugServe's)."""
    from ladsd.engine.leases import AsyncLeaseScheduler, LeaseScheduler

    if policy is EnginePolicy.VLLM:
        return AsyncLeaseScheduler if async_scheduling else LeaseScheduler
    raise NotImplementedError(f"engine policy {policy.value!r} is not built yet")
