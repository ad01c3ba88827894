"""Sessions: the bounded table (LRU, idle TTL) and each session's lease state.

A session (``x-session-id``) is one agent's conversation. Request ``k`` of a
session is continuation ``ContinuationId(session, k, version)``; ``version``
is the session's incarnation (a new one after ``DELETE`` or expiry), so a
lease of an ended incarnation can never bind a request of the next one.

When a request ends in a tool call, the session keeps the history that waits
for the tool (``waiting``: the notice sent to the engine) and the canonical
turns it renders; the next request whose turns extend them binds that
continuation (``bound`` while it runs). Ending a session, however it ends
(``DELETE``, TTL, a client that disconnects, eviction, shutdown), hands every
continuation it holds to ``release``, which cancels them in the engine.

The table is bounded: a new session evicts the least recently used idle one;
when every session is busy the new one is refused (429).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ladsd import clock
from ladsd.records import ContinuationId, EngineState, HistoryNotice, LeaseEventKind
from ladsd.serve.chat import Piece
from ladsd.serve.errors import ApiError

ANY_TOOL = "*"

# Lease status of a session's waiting history, after the engine's events.
_STATUS = {
    LeaseEventKind.GRANT: "granted",
    LeaseEventKind.DENIAL: "denied",
    LeaseEventKind.HANDOFF: "handed_off",
    LeaseEventKind.EXPIRY: "expired",
    LeaseEventKind.REVOCATION: "revoked",
    LeaseEventKind.CANCELLATION: "cancelled",
}


@dataclass(frozen=True)
class Intent:
    """HEAR intent: what the harness expects of a tool (a prediction, not a promise)."""

    tool: str  # a tool name, or ANY_TOOL
    expected_tool_s: float | None = None
    expected_result_bytes: int | None = None


@dataclass
class LeaseView:
    """What the daemon knows of one continuation's lease (records and events)."""

    cid: ContinuationId
    mode: str = "preference"  # preference | requirement
    # announced | no_leases | granted | denied | refused | handed_off | expired | revoked
    # | cancelled
    status: str = "announced"
    protected_blocks: int = 0
    exclusive_blocks: int = 0
    granted_at: float | None = None
    deadline: float | None = None
    generation: int | None = None
    reason: str | None = None  # why a requirement was refused
    events: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "continuation": self.cid.key(),
            "turn": self.cid.turn,
            "mode": self.mode,
            "status": self.status,
            "protected_blocks": self.protected_blocks,
            "exclusive_blocks": self.exclusive_blocks,
            "granted_at": self.granted_at,
            "deadline": self.deadline,
            "generation": self.generation,
            "reason": self.reason,
            "events": list(self.events),
        }


@dataclass
class Session:
    id: str
    version: int
    created: float
    last_used: float
    turn: int = 0  # the next request's turn
    turns: tuple[Piece, ...] = ()  # canonical conversation through the last reply
    history: tuple[int, ...] = ()  # its token ids: the last prompt + output, closed
    waiting: HistoryNotice | None = None  # history announced to the engine, waiting for a tool
    bound: ContinuationId | None = None  # continuation of the request in flight
    busy: bool = False
    intents: dict[str, Intent] = field(default_factory=dict)
    lease: LeaseView | None = None  # of the latest waiting history

    def cid(self, turn: int) -> ContinuationId:
        return ContinuationId(self.id, turn, self.version)

    def held(self) -> list[ContinuationId]:
        """Continuations this session may hold engine state for."""
        out = [self.waiting.cid] if self.waiting is not None else []
        if self.bound is not None and self.bound not in out:
            out.append(self.bound)
        return out

    def intent_for(self, tool: str) -> Intent | None:
        return self.intents.get(tool) or self.intents.get(ANY_TOOL)

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "session",
            "version": self.version,
            "turn": self.turn,
            "busy": self.busy,
            "waiting_for_tool": self.waiting is not None,
            "history_tokens": len(self.history),
            "idle_s": max(0.0, clock.now() - self.last_used) if not self.busy else 0.0,
            "intents": [i.__dict__ for i in self.intents.values()],
            "lease": self.lease.as_dict() if self.lease is not None else None,
        }


class SessionTable:
    """At most ``max_sessions`` sessions, in least-recently-used order."""

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        release: Callable[[Session], None],
        now: Callable[[], float] = clock.now,
    ) -> None:
        if max_sessions < 1 or ttl_s <= 0:
            raise ValueError("need max_sessions >= 1 and ttl_s > 0")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.release = release
        self.now = now
        self._table: OrderedDict[str, Session] = OrderedDict()
        self._versions = itertools.count(1)
        self.ended = 0  # sessions ended (any way)

    def __len__(self) -> int:
        return len(self._table)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._table.values()))

    def get(self, sid: str) -> Session | None:
        return self._table.get(sid)

    def find(self, sid: str) -> Session:
        s = self._table.get(sid)
        if s is None:
            raise ApiError(404, f"no session {sid!r}", param="session_id", code="session_not_found")
        return s

    def open(self, sid: str) -> Session:
        """The session ``sid``, created if new (evicting the least recently used idle one)."""
        s = self._table.get(sid)
        now = self.now()
        if s is not None:
            self._table.move_to_end(sid)
            s.last_used = now
            return s
        if len(self._table) >= self.max_sessions:
            idle = next((x for x in self._table.values() if not x.busy), None)
            if idle is None:
                raise ApiError(
                    429,
                    f"all {self.max_sessions} sessions are busy",
                    code="sessions_full",
                    headers={"Retry-After": "1"},
                )
            self.end(idle.id)
        s = Session(sid, next(self._versions), created=now, last_used=now)
        self._table[sid] = s
        return s

    def touch(self, s: Session) -> None:
        s.last_used = self.now()
        if s.id in self._table:
            self._table.move_to_end(s.id)

    def end(self, sid: str) -> Session | None:
        """Remove ``sid`` and release everything it holds (idempotent)."""
        s = self._table.pop(sid, None)
        if s is not None:
            self.ended += 1
            self.release(s)
            s.waiting = s.bound = None
        return s

    def expire(self) -> list[str]:
        """End the sessions idle for longer than the TTL."""
        cut = self.now() - self.ttl_s
        old = [s.id for s in self._table.values() if not s.busy and s.last_used < cut]
        for sid in old:
            self.end(sid)
        return old

    def end_all(self) -> None:
        for sid in list(self._table):
            self.end(sid)

    def owner(self, cid: ContinuationId) -> Session | None:
        s = self._table.get(cid.workflow)
        return s if s is not None and s.version == cid.version else None

    def observe(self, state: EngineState) -> None:
        """Follow the engine's lease records and events for the sessions' leases."""
        for rec in state.leases:
            s = self.owner(rec.cid)
            if s is not None and s.lease is not None and s.lease.cid == rec.cid:
                v = s.lease
                v.protected_blocks = len(rec.protected_blocks)
                v.exclusive_blocks = rec.exclusive_blocks
                v.granted_at, v.deadline, v.generation = (
                    rec.granted_at,
                    rec.deadline,
                    rec.generation,
                )
        for ev in state.events:
            s = self.owner(ev.cid)
            if s is None or s.lease is None or s.lease.cid != ev.cid:
                continue
            v = s.lease
            if ev.kind is not LeaseEventKind.DENIAL or v.status != "granted":
                v.status = _STATUS[ev.kind]
            if ev.kind is LeaseEventKind.GRANT:
                v.protected_blocks = ev.blocks
            v.events.append({"type": ev.kind.value, "time": ev.time, "blocks": ev.blocks})
            del v.events[:-16]  # bounded: the latest few
