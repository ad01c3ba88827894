"""One monotonic clock for the whole daemon.

Every timestamp in ladsd (r, s, c, a, n, f, lease grants, deadlines, record
times) is read from :func:`now`, so stage latencies are differences on one
clock. Tests inject a :class:`ManualClock` where they need exact control.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]


def now() -> float:
    """Seconds on the process-wide monotonic clock."""
    return time.monotonic()


@dataclass
class ManualClock:
    """A clock that only moves when told to (for unit tests)."""

    t: float = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t


@dataclass
class Stamps:
    """Per-continuation timestamps of spec section 1 (None until they happen).

    r: result ready; s: committed; c: completely received; a: registered with
    the engine; n: first allocation with positive new tokens; f: inference done.
    """

    r: float | None = None
    s: float | None = None
    c: float | None = None
    a: float | None = None
    n: float | None = None
    f: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def stages(self) -> dict[str, float | None]:
        """The four stage latencies: s-r, c-s, n-c, f-n."""

        def d(x: float | None, y: float | None) -> float | None:
            return None if x is None or y is None else x - y

        return {
            "sender_wait": d(self.s, self.r),
            "queue_transfer": d(self.c, self.s),
            "receipt_to_alloc": d(self.n, self.c),
            "resumed_inference": d(self.f, self.n),
        }
