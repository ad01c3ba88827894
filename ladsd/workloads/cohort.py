"""Tool service in cohorts: same-round calls complete together (spec 5).

A cohort's round-k tool calls complete together ``gap`` seconds after the
last member starts its call; ``limit`` seconds after the first start, a
partial cohort is released. A member that starts after its round was
released completes ``gap`` after its own start.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class _Round:
    started: int = 0
    released: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    timers: list[asyncio.TimerHandle] = field(default_factory=list)


class Cohorts:
    def __init__(self, members: dict[int, int], gap: float, limit: float) -> None:
        self.members = members  # cohort id -> number of live members
        self.gap = gap
        self.limit = limit
        self._rounds: dict[tuple[int, int], _Round] = {}
        self.partial_releases = 0

    def leave(self, cohort: int) -> None:
        """A member terminated: later rounds wait for one member fewer."""
        self.members[cohort] -= 1
        for (c, _), rnd in self._rounds.items():
            if c == cohort and not rnd.released and rnd.started >= self.members[cohort] > 0:
                self._arm(rnd, self.gap)

    async def tool(self, cohort: int | None, round_: int, service_s: float = 0.0) -> None:
        """Wait until this member's tool call of ``round_`` completes."""
        if cohort is None:
            await asyncio.sleep(max(service_s, 0.0))
            return
        rnd = self._rounds.setdefault((cohort, round_), _Round())
        if rnd.released:
            await asyncio.sleep(self.gap)
            return
        rnd.started += 1
        if rnd.started == 1:
            self._arm(rnd, self.limit, partial=True)
        if rnd.started >= self.members[cohort]:
            self._arm(rnd, self.gap)
        await rnd.event.wait()

    def _arm(self, rnd: _Round, delay: float, partial: bool = False) -> None:
        loop = asyncio.get_running_loop()

        def fire() -> None:
            if rnd.released:
                return
            rnd.released = True
            if partial:
                self.partial_releases += 1
            for t in rnd.timers:
                t.cancel()
            rnd.event.set()

        rnd.timers.append(loop.call_later(delay, fire))
