"""The outcome hub behind ``GET /v1/events`` (HEAR's *execution outcomes*).

Lease events come from the engine's published states (``EngineState.events``:
grant, denial, handoff, expiry, revocation, cancellation, each once); the
daemon adds its own (completion, session end, refused requirements). Each
event is a flat JSON object with ``type``, ``time`` and ``session_id``.

Bounded everywhere: the hub keeps the last ``backlog`` events (a subscriber
may ask for them first), at most ``max_subscribers`` subscribers, and each a
queue of ``queue_size``; a subscriber that falls that far behind loses its
oldest events and is told how many (``type: "dropped"``) instead of growing
without end.

Tenants: every event belongs to a tenant (its ``tenant`` key: the session's or
the run's, else the tenant of the request being handled when it was
published); a subscriber of a tenant sees only that tenant's events. The
``tenant`` key stays inside the daemon (:func:`wire` drops it).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from ladsd import clock
from ladsd.records import EngineState
from ladsd.serve.app import REQUEST_TENANT
from ladsd.serve.errors import ApiError
from ladsd.serve.sessions import client_key

Event = dict[str, Any]
# workflow -> (its tenant, the session id a client knows it by)
Owner = Callable[[str], tuple[str | None, str]]


def _same(workflow: str) -> tuple[str | None, str]:
    return None, workflow


def wire(ev: Event) -> Event:
    """The event as a client sees it (without the daemon's ``tenant``)."""
    return {k: v for k, v in ev.items() if k != "tenant"}


@dataclass(eq=False)
class Sub:
    session: str | None
    tenant: str | None  # None: every tenant's events (the daemon's own readers)
    queue: deque[Event]
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: int = 0

    def wants(self, ev: Event) -> bool:
        if self.tenant is not None and ev.get("tenant") != self.tenant:
            return False
        return self.session is None or ev["session_id"] == self.session


class EventHub:
    def __init__(
        self,
        backlog: int = 1024,
        queue_size: int = 1024,
        max_subscribers: int = 64,
        tenants: int = 1,
    ) -> None:
        self.backlog: deque[Event] = deque(maxlen=backlog)
        self.queue_size = queue_size
        self.max_subscribers = max_subscribers
        # Each tenant's share of the streams: one tenant cannot take every slot.
        self.per_tenant = max(1, max_subscribers // max(1, tenants))
        self._subs: set[Sub] = set()
        self._ids = itertools.count(1)
        self.closed = False
        self.published = 0

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def publish(
        self, kind: str, session_id: str | None, *, tenant: str | None = None, **data: Any
    ) -> Event:
        """Publish ``kind``; ``tenant`` defaults to the tenant of the request being handled."""
        ev: Event = {"id": next(self._ids), "type": kind, "time": clock.now()}
        ev["session_id"] = session_id
        ev.update(data)
        ev["tenant"] = tenant if tenant is not None else REQUEST_TENANT.get()
        self.backlog.append(ev)
        self.published += 1
        for sub in self._subs:
            if not sub.wants(ev):
                continue
            if len(sub.queue) >= self.queue_size:
                sub.queue.popleft()
                sub.dropped += 1
            sub.queue.append(ev)
            sub.wake.set()
        return ev

    def on_state(self, state: EngineState, owner: Owner = _same) -> None:
        """The engine's lease events, one event each (``owner`` names the workflow's
        tenant and session id)."""
        for e in state.events:
            tenant, sid = owner(e.cid.workflow)
            self.publish(
                e.kind.value,
                sid,
                tenant=tenant,
                turn=e.cid.turn,
                version=e.cid.version,
                continuation=client_key(e.cid),
                blocks=e.blocks,
                engine_time=e.time,
            )

    def join(self, session: str | None = None, backlog: int = 0, tenant: str | None = None) -> Sub:
        """A new subscriber (first the last ``backlog`` of its events); 429 past the cap.

        The caller must :meth:`leave` it (a ``finally``), or read it with :meth:`follow`.
        """
        mine = sum(1 for s in self._subs if s.tenant == tenant)
        if len(self._subs) >= self.max_subscribers or mine >= self.per_tenant:
            which = "" if mine < self.per_tenant else " of your tenant's share"
            raise ApiError(
                429,
                f"{mine if which else len(self._subs)} event streams{which} are open; "
                "close one or retry later",
                code="too_many_event_streams",
                headers={"Retry-After": "5"},
            )
        sub = Sub(session, tenant, deque())
        if backlog > 0:
            old = [e for e in self.backlog if sub.wants(e)]
            sub.queue.extend(old[-backlog:])
        self._subs.add(sub)
        return sub

    def leave(self, sub: Sub) -> None:
        self._subs.discard(sub)

    async def follow(self, sub: Sub, heartbeat_s: float = 15.0) -> AsyncIterator[Event | None]:
        """``sub``'s events as they come; None is a heartbeat. Ends when the hub closes
        (daemon shutdown), after what was queued; ``sub`` leaves when it ends."""
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
            self.leave(sub)

    async def subscribe(
        self,
        session: str | None = None,
        backlog: int = 0,
        heartbeat_s: float = 15.0,
        tenant: str | None = None,
    ) -> AsyncIterator[Event | None]:
        """:meth:`join` then :meth:`follow` (the subscriber joins at the first read)."""
        async with aclosing(self.follow(self.join(session, backlog, tenant), heartbeat_s)) as evs:
            async for ev in evs:
                yield ev

    def close(self) -> None:
        self.closed = True
        for sub in self._subs:
            sub.wake.set()
