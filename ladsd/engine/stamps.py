"""Scheduler mixin that stamps ``n``: first step with positive new-token work.

vLLM reports when a request finished but not when its work was first
allocated; the spec's receipt-to-allocation stage needs that moment, so the
scheduler records it right after ``schedule()`` succeeds. The engine thread
takes each stamp when its request finishes or is aborted, so the table holds
only requests in flight. It also counts vLLM's real preemptions (each one
that increments ``request.num_preemptions``).
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

    def _preempt_request(self, *args: Any, **kwargs: Any) -> None:
        self.preemptions += 1
        super()._preempt_request(*args, **kwargs)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        t = clock.now()
        for req_id, n in out.num_scheduled_tokens.items():
            if n > 0 and req_id not in self.first_alloc:
                self.first_alloc[req_id] = t
        return out

    def pop_first_alloc(self, req_id: str) -> float | None:
        """Take the stamp of a finished or aborted request (keeps the table bounded)."""
        return self.first_alloc.pop(req_id, None)
