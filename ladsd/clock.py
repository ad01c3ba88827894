"""One monotonic clock for the whole daemon.

Every timestamp in ladsd (r, s, c, a, n, f, lease grants, deadlines, record
times) is read from :func:`now`, so stage latencies are differences on one
clock. Tests inject a :class:`ManualClock` where they need exact control.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

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


# Stage name -> (later stamp, earlier stamp): the four stages of spec section 1.
STAGES: dict[str, tuple[str, str]] = {
    "sender_wait": ("s", "r"),
    "queue_transfer": ("c", "s"),
    "receipt_to_alloc": ("n", "c"),
    "resumed_inference": ("f", "n"),
}
STAMP_NAMES: tuple[str, ...] = ("r", "s", "c", "a", "n", "f")


@dataclass(frozen=True)
class Stamps:
    """The six timestamps of one model call (spec section 1); None until they happen.

    r: result ready; s: committed; c: completely received; a: registered with
    the engine; n: first allocation with positive new tokens; f: inference done.
    A cold call (call 0) has no r, s, c. The one type for these stamps: the
    engine's completion, the runtime's outcome, traces and run records use it.
    """

    r: float | None = None
    s: float | None = None
    c: float | None = None
    a: float | None = None
    n: float | None = None
    f: float | None = None

    def stages(self) -> dict[str, float | None]:
        """The four stage latencies s-r, c-s, n-c, f-n (None where a stamp is missing)."""
        out: dict[str, float | None] = {}
        for name, (later, earlier) in STAGES.items():
            x, y = getattr(self, later), getattr(self, earlier)
            out[name] = None if x is None or y is None else x - y
        return out

    def shift(self, t0: float) -> Stamps:
        """Every stamp relative to ``t0``."""
        return Stamps(**{k: None if v is None else v - t0 for k, v in self.as_dict().items()})

    def as_dict(self) -> dict[str, float | None]:
        return {k: getattr(self, k) for k in STAMP_NAMES}
