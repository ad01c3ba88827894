"""The outcome hub behind ``GET /v1/events`` (HEAR's *execution outcomes*).

Lease events come from the engine's published states (``EngineState.events``:
grant, denial, handoff, expiry, revocation, cancellation, each once); the
daemon adds its own (completion, session end, refused requirements). Each
event is a flat JSON object with ``type``, ``time`` and ``session_id``.

Bounded everywhere: the hub keeps the last ``backlog`` events (a subscriber
may ask for them first) and each subscriber a queue of ``queue_size``; a
subscriber that falls that far behind loses its oldest events and is told how
many (``type: "dropped"``) instead of growing without end.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ladsd import clock
from ladsd.records import EngineState

Event = dict[str, Any]


@dataclass(eq=False)
class _Sub:
    session: str | None
    queue: deque[Event]
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: int = 0


class EventHub:
    def __init__(self, backlog: int = 1024, queue_size: int = 1024) -> None:
        self.backlog: deque[Event] = deque(maxlen=backlog)
        self.queue_size = queue_size
        self._subs: set[_Sub] = set()
        self._ids = itertools.count(1)
        self.closed = False
        self.published = 0

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def publish(self, kind: str, session_id: str | None, **data: Any) -> Event:
        ev: Event = {"id": next(self._ids), "type": kind, "time": clock.now()}
        ev["session_id"] = session_id
        ev.update(data)
        self.backlog.append(ev)
        self.published += 1
        for sub in self._subs:
            if sub.session is not None and sub.session != session_id:
                continue
            if len(sub.queue) >= self.queue_size:
                sub.queue.popleft()
                sub.dropped += 1
            sub.queue.append(ev)
            sub.wake.set()
        return ev

    def on_state(self, state: EngineState) -> None:
        """The engine's lease events, one event each (session id = the workflow)."""
        for e in state.events:
            self.publish(
                e.kind.value,
                e.cid.workflow,
                turn=e.cid.turn,
                version=e.cid.version,
                continuation=e.cid.key(),
                blocks=e.blocks,
                engine_time=e.time,
            )

    async def subscribe(
        self, session: str | None = None, backlog: int = 0, heartbeat_s: float = 15.0
    ) -> AsyncIterator[Event | None]:
        """Events as they come (first the last ``backlog`` ones); None is a heartbeat.

        Ends when the hub closes (daemon shutdown), after what was queued.
        """
        sub = _Sub(session, deque())
        if backlog > 0:
            old = [e for e in self.backlog if session is None or e["session_id"] == session]
            sub.queue.extend(old[-backlog:])
        self._subs.add(sub)
        try:
            while True:
                if sub.dropped:
                    n, sub.dropped = sub.dropped, 0
                    yield {"id": 0, "type": "dropped", "time": clock.now(), "count": n}
                while sub.queue:
                    yield sub.queue.popleft()
                if self.closed:
                    return
                sub.wake.clear()
                try:
                    await asyncio.wait_for(sub.wake.wait(), heartbeat_s)
                except TimeoutError:
                    yield None
        finally:
            self._subs.discard(sub)

    def close(self) -> None:
        self.closed = True
        for sub in self._subs:
            sub.wake.set()
