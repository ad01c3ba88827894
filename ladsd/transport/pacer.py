"""User-space pacing of the return link: a token bucket at ``R`` bytes/s (spec 2).

The bucket holds at most ``depth`` bytes of credit (at most one write chunk,
512 B by default), so on *any* interval of length ``dt`` at most
``depth + R * dt`` bytes leave: the rate holds on every window of a second.

A writer that waits for a whole chunk loses credit whenever it wakes late
(the bucket is full and overflows meanwhile). :meth:`TokenBucket.take`
therefore waits for ``least`` bytes (e.g. half a chunk) and then takes all the
whole credit it has, up to ``want``: lateness below ``(depth - least) / R`` is
absorbed and the long-run rate stays exactly ``R``.

Time comes from the running event loop (``loop.time()``) unless a clock and a
sleep function are injected (tests drive it on a manual clock).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

# Float slack when comparing credit (bytes): far below one byte.
_EPS = 1e-6


class TokenBucket:
    """Token bucket for one writer; starts full."""

    def __init__(
        self,
        rate: float,
        depth: int,
        *,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be a positive finite number of bytes/s, got {rate}")
        if depth < 1:
            raise ValueError(f"depth must be at least 1 byte, got {depth}")
        self.rate = float(rate)
        self.depth = int(depth)
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(depth)
        self._last: float | None = None
        self._lock = asyncio.Lock()  # one taker at a time: grants stay in call order
        self.taken = 0  # bytes granted so far

    def _now(self) -> float:
        if self._clock is not None:
            return self._clock()
        return asyncio.get_running_loop().time()

    def _refill(self) -> None:
        t = self._now()
        if self._last is not None and t > self._last:
            self._tokens = min(float(self.depth), self._tokens + (t - self._last) * self.rate)
        if self._last is None or t > self._last:
            self._last = t

    def available(self) -> float:
        """Credit in bytes now (0 <= credit <= depth, up to float slack)."""
        self._refill()
        return self._tokens

    def delay(self, n: int) -> float:
        """Seconds until ``n`` bytes of credit are available (0 if now)."""
        self._check(n, n)
        missing = n - self.available()
        return max(0.0, missing / self.rate) if missing > _EPS else 0.0

    def try_take(self, n: int) -> bool:
        """Take ``n`` bytes now if the credit is there."""
        self._check(n, n)
        if self.available() < n - _EPS:
            return False
        self._debit(n)
        return True

    async def take(self, want: int, least: int | None = None) -> int:
        """Wait for ``least`` bytes of credit (default ``want``), then take up to ``want``.

        Returns the bytes granted, ``least <= granted <= want``.
        """
        least = want if least is None else least
        self._check(want, least)
        async with self._lock:
            while True:
                credit = self.available()
                if credit >= least - _EPS:
                    n = max(least, min(want, math.floor(credit + _EPS)))
                    self._debit(n)
                    return n
                await self._sleep((least - credit) / self.rate)

    def _debit(self, n: int) -> None:
        self._tokens -= n  # may dip below 0 by float slack only
        self.taken += n

    def _check(self, want: int, least: int) -> None:
        if not 1 <= least <= want <= self.depth:
            raise ValueError(
                f"need 1 <= least ({least}) <= want ({want}) <= depth ({self.depth}) bytes"
            )
