"""Scheduler mixin that stamps ``n``: first step with positive new-token work.

vLLM reports when a request finished but not when its work was first
allocated; the spec's receipt-to-allocation stage needs that moment, so the
scheduler records it right after ``schedule()`` succeeds. The engine thread
takes each stamp when its request finishes or is aborted, so the table holds
only requests in flight. It also counts vLLM's real preemptions (each one
that increments ``request.num_preemptions``) and the steps that could allocate
nothing although requests were waiting (``stalled_steps``: e.g. hard pins hold
every free block).
"""

from __future__ import annotations

from typing import Any

from ladsd import clock


class StampMixin:
    """Records ``first_alloc[req_id] = clock.now()`` on the first positive schedule."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_alloc: dict[str, float] = {}
        self.preemptions = 0
        self.last_scheduled_tokens = 0  # of the latest schedule()
        self.stalled_steps = 0  # schedule() calls with requests but nothing allocatable

    def _preempt_request(self, *args: Any, **kwargs: Any) -> None:
        self.preemptions += 1
        super()._preempt_request(*args, **kwargs)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self.last_scheduled_tokens = out.total_num_scheduled_tokens
        if self.last_scheduled_tokens == 0 and (self.waiting or self.running):  # type: ignore[attr-defined]
            self.stalled_steps += 1
        t = clock.now()
        for req_id, n in out.num_scheduled_tokens.items():
            if n > 0 and req_id not in self.first_alloc:
                self.first_alloc[req_id] = t
        return out

    def pop_first_alloc(self, req_id: str) -> float | None:
        """Take the stamp of a finished or aborted request (keeps the table bounded)."""
        return self.first_alloc.pop(req_id, None)
