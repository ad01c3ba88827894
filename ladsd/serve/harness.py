"""What a session's harness says of its tools and what its tool waits show.

HEAR's *intent* (:class:`Intent`) is a prediction the harness sends: a tool's
expected time and result size. Each session also learns its own tool waits
(:class:`ToolTimes`, an EWMA); ``--lease-rule`` (:class:`~.sessions.LeaseRule`)
turns the expected wait into the lease lifetime ``l_i``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ANY_TOOL = "*"
TOOL_EWMA = 0.5  # weight of the latest wait: one float kept, a new tool shows within 2 waits


@dataclass(frozen=True)
class Intent:
    """HEAR intent: what the harness expects of a tool (a prediction, not a promise)."""

    tool: str  # a tool name, or ANY_TOOL
    expected_tool_s: float | None = None
    expected_result_bytes: int | None = None


@dataclass
class ToolTimes:
    """A session's observed tool waits (ours): an EWMA, alpha :data:`TOOL_EWMA`.

    A wait runs from the notice of a reply that ended in a tool call (its
    ``ready_time``) to the session's next request that binds it: the tool, the
    client and the request's tokenisation, i.e. what the lease had to cover.
    """

    expected_s: float | None = None  # None until a wait was observed
    observed: int = 0
    last_s: float | None = None

    def observe(self, wait_s: float) -> None:
        """One more wait; a clock step back counts as 0 s (never an error in a request)."""
        if math.isnan(wait_s) or math.isinf(wait_s):
            return
        w = max(0.0, wait_s)
        prev = self.expected_s
        self.expected_s = w if prev is None else TOOL_EWMA * w + (1 - TOOL_EWMA) * prev
        self.observed += 1
        self.last_s = w

    def as_dict(self) -> dict[str, Any]:
        return {"observed": self.observed, "expected_s": self.expected_s, "last_s": self.last_s}


@dataclass
class Harness:
    """What a session's harness said of its tools (HEAR intents: predictions, newest per
    tool) and what its tool waits showed (:class:`ToolTimes`)."""

    intents: dict[str, Intent] = field(default_factory=dict)
    tools: ToolTimes = field(default_factory=ToolTimes)

    def intent_for(self, tool: str) -> Intent | None:
        return self.intents.get(tool) or self.intents.get(ANY_TOOL)
