"""Scheduler hooks: what an engine policy adds around the lease API and vLLM's steps.

Contract (one seam instead of ``super()`` overrides stacked on the scheduler):

* One hook object per scheduler, installed at ``lease_setup``
  (``LeaseMixin._lease_hooks``). :class:`SchedHooks` itself does nothing:
  vLLM's own order (``EnginePolicy.VLLM``). AugServe's order, budget and
  context policy is one (:class:`~ladsd.engine.sched_augserve.AugServe`).
* Engine thread only; :class:`~ladsd.engine.sched_leases.LeaseMixin` is the only
  caller, at fixed points:

  - ``noticed``, ``bound``, ``cancelled``, ``ticked``, ``released_all``:
    after the lease book's operation of that name;
  - ``counters``: merged into every ``lease_state()``, after the book's;
  - ``before_step``: at ``schedule()`` entry, before the book's maintenance;
    ``after_step``: after vLLM's schedule and the book's handoffs;
  - ``added``: after vLLM queued a request; ``preempted``: after vLLM
    preempted one; ``freed``: before vLLM frees a finished or aborted one
    (its status is final, its blocks still held).
* A hook never takes or gives back lease references itself; it may call
  the lease API (e.g. ``lease_preserve``) like the engine thread does.
"""

from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

from ladsd.records import ContinuationId, HistoryNotice


class SchedHooks:
    """The hooks of vLLM's own order: none of them does anything."""

    def noticed(self, n: HistoryNotice) -> None:
        """The book took ``n`` (a result is ready)."""

    def bound(self, cid: ContinuationId, request_id: str) -> None:
        """``cid`` was registered as engine request ``request_id``."""

    def cancelled(self, cid: ContinuationId) -> None:
        """``cid``'s workflow was cancelled."""

    def ticked(self) -> None:
        """The lease tick ran."""

    def released_all(self) -> None:
        """End of run: the book released everything."""

    def counters(self) -> dict[str, float]:
        """Counters added to every published state."""
        return {}

    def before_step(self) -> None:
        """``schedule()`` entry."""

    def after_step(self, out: SchedulerOutput) -> None:
        """``schedule()`` returned ``out``."""

    def added(self, request: Request) -> None:
        """vLLM queued ``request``."""

    def preempted(self, request: Request) -> None:
        """vLLM preempted ``request`` (it waits again)."""

    def freed(self, request: Request) -> None:
        """vLLM is about to free ``request`` (finished or aborted)."""


NO_HOOKS = SchedHooks()
