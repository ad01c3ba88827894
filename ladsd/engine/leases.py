"""Prefix leases inside vLLM's scheduler (placeholder: thin subclasses).

The lease mixin (spec section 3) plugs in here; until then the scheduler only
stamps first allocations.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ladsd.engine.stamps import StampMixin


class LeaseScheduler(StampMixin, Scheduler):
    pass


class AsyncLeaseScheduler(StampMixin, AsyncScheduler):
    pass
