"""Sessions: the bounded table (LRU, idle TTL) and each session's lease state.

A session (``x-session-id``) is one agent's conversation. Request ``k`` of a
session is continuation ``ContinuationId(session, k, version)``; ``version``
is the session's incarnation (a new one after ``DELETE`` or expiry), so a
lease of an ended incarnation can never bind a request of the next one.

When a request ends in a tool call, the session keeps the history that waits
for the tool (``wait.notice``: the notice sent to the engine) and the canonical
turns it renders; the next request whose turns extend them binds that
continuation (``wait.bound`` while it runs). Ending a session, however it ends
(``DELETE``, TTL, eviction, shutdown), hands every continuation it holds to
``release``, which cancels them in the engine. A client that disconnects
mid-request does not end its session: the history its request bound waits
again, for a retry of the same turn (:mod:`.completions`).

Sessions belong to the tenant whose key created them (:mod:`.app`): a
session is named by ``(tenant, id)``, so tenant B's ``s1`` is another session
than A's ``s1``, invisible to A, and its engine workflow id is
``<tenant>/<id>`` (agent runs' ids have no ``/``: the two never share one).

The table is bounded, fairly: each tenant holds at most ``max_sessions //
tenants`` sessions, and a new session evicts the least recently used idle
session *of its own tenant* (never another tenant's); when every one of them
is busy it is refused (429).

How a session ended (``ended_by``) decides whether it counts as a completed
workflow in HEAR's continuation estimate (:meth:`Session.completed`).

Each session learns its own tool time (:class:`~.harness.ToolTimes`); ``--lease-rule``
(:class:`LeaseRule`) turns the expected wait into the lease lifetime ``l_i``.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ladsd import clock
from ladsd.engine import budget as bud
from ladsd.records import ContinuationId, EngineState, HistoryNotice, LeaseEventKind
from ladsd.serve.app import LOCAL
from ladsd.serve.errors import ApiError
from ladsd.serve.harness import Harness
from ladsd.serve.replies import Piece

LEASE_RULES = ("session", "fixed")

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
class LeaseRule:
    """How a tool wait gets its lease lifetime ``l_i`` (``--lease-rule``; ours).

    ``session``: expected wait = the intent's ``expected_tool_s``, else the
    session's learned wait (:class:`~.harness.ToolTimes`), else the default (1 s);
    ``l_i = min(cap_s, max(l, 1.5 x expected))``
    (:func:`~ladsd.engine.budget.lease_lifetime`). ``fixed``: the spec's ``l``
    for every lease (no lifetime on the notice) and nothing learned is used.
    """

    name: str
    base_s: float  # the profile's l
    cap_s: float  # the bound on l_i (--lease-max-s)

    def __post_init__(self) -> None:
        if self.name not in LEASE_RULES:
            raise ValueError(f"unknown lease rule {self.name!r}; choose from {LEASE_RULES}")
        bud.lease_lifetime(self.base_s, 0.0, bud.LIFETIME_MARGIN, self.cap_s)  # checks l, cap

    @classmethod
    def of(cls, name: str, base_s: float, cap_s: float | None) -> LeaseRule:
        """The rule; ``cap_s`` None: :data:`~ladsd.engine.budget.LIFETIME_CAP_FACTOR` x l."""
        return cls(name, base_s, bud.LIFETIME_CAP_FACTOR * base_s if cap_s is None else cap_s)

    @property
    def learns(self) -> bool:
        return self.name == "session"

    def lifetime(self, expected_s: float) -> float | None:
        """The notice's ``lifetime_s``: ``l_i`` under ``session``, None (= l) under ``fixed``."""
        if not self.learns:
            return None
        return bud.lease_lifetime(self.base_s, expected_s, bud.LIFETIME_MARGIN, self.cap_s)

    def as_dict(self) -> dict[str, Any]:
        return {
            "lease_rule": self.name,
            "lease_max_s": self.cap_s,
            "lease_margin": bud.LIFETIME_MARGIN,
        }


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
            "continuation": client_key(self.cid),
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
class ToolWait:
    """A session's continuations in the engine: the history that waits for a tool (the
    notice sent), the lease view of it, and the continuation its request in flight binds."""

    notice: HistoryNotice | None = None  # history announced to the engine, waiting for a tool
    lease: LeaseView | None = None  # of the latest waiting history
    bound: ContinuationId | None = None  # continuation of the request in flight

    def held(self) -> list[ContinuationId]:
        out = [self.notice.cid] if self.notice is not None else []
        if self.bound is not None and self.bound not in out:
            out.append(self.bound)
        return out


@dataclass
class Transcript:
    """What a session has said so far: its canonical turns through the last reply and
    their token ids (the history a tool result extends)."""

    turns: tuple[Piece, ...] = ()  # canonical conversation through the last reply
    history: tuple[int, ...] = ()  # its token ids: the last prompt + output, closed


@dataclass
class Session:
    """One agent's conversation: its identity and life here, the rest in parts by concern
    (what it said, what waits in the engine, what its harness said of its tools)."""

    id: str
    version: int
    created: float
    last_used: float
    turn: int = 0  # the next request's turn
    busy: bool = False
    tenant: str = LOCAL  # whose key created it
    ended_by: str | None = None  # delete | ttl | evicted | shutdown | ...
    abandoned: bool = False  # its client went away mid-request and no turn came since
    wait: ToolWait = field(default_factory=ToolWait)  # its continuations in the engine
    transcript: Transcript = field(default_factory=Transcript)  # its turns and token ids
    harness: Harness = field(default_factory=Harness)  # its tools' intents and waits

    @property
    def workflow(self) -> str:
        """The engine's workflow id: unique across tenants, never an agent run's."""
        return workflow_of(self.tenant, self.id)

    @property
    def awaits_tool(self) -> bool:
        """Its last reply was a tool call whose result has not come."""
        lease = self.wait.lease
        return lease is not None and lease.cid.turn == self.turn

    def completed(self) -> bool:
        """A workflow that ended by itself (HEAR learns its call count from these only).

        Ended idle, after at least one call, on an answer (not a tool call left
        waiting), by the client's DELETE or by idle expiry (the client never came
        back: its last call was its last). Not an eviction or the shutdown (it
        might have gone on), a client gone mid-request, or a tool wait abandoned.
        """
        ended_well = self.ended_by in ("delete", "ttl")
        done = self.turn > 0 and not (self.busy or self.awaits_tool or self.abandoned)
        return ended_well and done

    def cid(self, turn: int) -> ContinuationId:
        return ContinuationId(self.workflow, turn, self.version)

    def held(self) -> list[ContinuationId]:
        """Continuations this session may hold engine state for."""
        return self.wait.held()

    def view(self) -> dict[str, Any]:
        lease, wait = None, self.wait
        if wait.lease is not None:  # with the waiting history's timing
            w = wait.notice
            n = w if w is not None and w.cid == wait.lease.cid else None
            lease = wait.lease.as_dict() | {
                "lifetime_s": n.lifetime_s if n is not None else None,  # l_i; None: l
                "expected_wait_s": n.expected_wait_s if n is not None else None,
            }
        return {
            "id": self.id,
            "object": "session",
            "version": self.version,
            "turn": self.turn,
            "busy": self.busy,
            "waiting_for_tool": wait.notice is not None,
            "history_tokens": len(self.transcript.history),
            "idle_s": max(0.0, clock.now() - self.last_used) if not self.busy else 0.0,
            "intents": [i.__dict__ for i in self.harness.intents.values()],
            "tool_times": self.harness.tools.as_dict(),
            "lease": lease,
        }


def workflow_of(tenant: str, sid: str) -> str:
    return f"{tenant}/{sid}"


def client_key(cid: ContinuationId) -> str:
    """``cid`` as its client names it, ``<session id>/<turn>/<version>``: without the
    tenant (an agent run's workflow has none to drop)."""
    return cid.key().partition("/")[2] if "/" in cid.workflow else cid.key()


class SessionTable:
    """At most ``max_sessions`` sessions (``per_tenant`` each), in least-recently-used order."""

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        release: Callable[[Session], None],
        now: Callable[[], float] = clock.now,
        tenants: int = 1,
    ) -> None:
        if max_sessions < 1 or ttl_s <= 0 or tenants < 1:
            raise ValueError("need max_sessions >= 1, ttl_s > 0 and tenants >= 1")
        self.max_sessions = max_sessions
        self.per_tenant = max(1, max_sessions // tenants)
        self.ttl_s = ttl_s
        self.release = release
        self.now = now
        self._table: OrderedDict[str, Session] = OrderedDict()  # by workflow id
        self._held: Counter[str] = Counter()  # tenant -> its sessions
        self._versions = itertools.count(1)
        self.ended = 0  # sessions ended (any way)

    def __len__(self) -> int:
        return len(self._table)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._table.values()))

    def of(self, tenant: str) -> list[Session]:
        """``tenant``'s sessions, least recently used first."""
        return [s for s in self._table.values() if s.tenant == tenant]

    def get(self, sid: str, tenant: str = LOCAL) -> Session | None:
        return self._table.get(workflow_of(tenant, sid))

    def find(self, sid: str, tenant: str = LOCAL) -> Session:
        """``tenant``'s session ``sid``; 404 if it has none (another tenant's is none)."""
        s = self.get(sid, tenant)
        if s is None:
            raise ApiError(404, f"no session {sid!r}", param="session_id", code="session_not_found")
        return s

    def open(self, sid: str, tenant: str = LOCAL) -> Session:
        """``tenant``'s session ``sid``, created if new (evicting the tenant's least
        recently used idle session when the tenant, or the table, is full)."""
        key = workflow_of(tenant, sid)
        s = self._table.get(key)
        now = self.now()
        if s is not None:
            self._table.move_to_end(key)
            s.last_used = now
            return s
        if self._held[tenant] >= self.per_tenant or len(self._table) >= self.max_sessions:
            idle = next((x for x in self.of(tenant) if not x.busy), None)
            if idle is None:
                raise ApiError(
                    429,
                    f"all {self._held[tenant]} sessions of this key are busy "
                    f"(at most {self.per_tenant} per tenant, {self.max_sessions} in all)",
                    code="sessions_full",
                    headers={"Retry-After": "1"},
                )
            self._end(idle, "evicted")
        s = Session(sid, next(self._versions), created=now, last_used=now, tenant=tenant)
        self._table[key] = s
        self._held[tenant] += 1
        return s

    def touch(self, s: Session) -> None:
        s.last_used = self.now()
        if s.workflow in self._table:
            self._table.move_to_end(s.workflow)

    def holds(self, s: Session) -> bool:
        """``s`` itself is still in the table (not ended, not replaced by a newer session)."""
        return self._table.get(s.workflow) is s

    def end(self, sid: str, tenant: str = LOCAL, why: str = "ended") -> Session | None:
        """Remove ``tenant``'s ``sid`` and release everything it holds (idempotent)."""
        s = self.get(sid, tenant)
        if s is not None:
            self._end(s, why)
        return s

    def _end(self, s: Session, why: str) -> None:
        if self._table.get(s.workflow) is not s:
            return  # already ended (a newer session may hold the id now)
        del self._table[s.workflow]
        self._held[s.tenant] -= 1
        if not self._held[s.tenant]:
            del self._held[s.tenant]
        self.ended += 1
        s.ended_by = why
        self.release(s)
        s.wait.notice = s.wait.bound = None

    def expire(self) -> list[str]:
        """End the sessions idle for longer than the TTL (their ids)."""
        cut = self.now() - self.ttl_s
        old = [s for s in self._table.values() if not s.busy and s.last_used < cut]
        for s in old:
            self._end(s, "ttl")
        return [s.id for s in old]

    def end_all(self, why: str = "shutdown") -> None:
        for s in list(self._table.values()):
            self._end(s, why)

    def owner(self, cid: ContinuationId) -> Session | None:
        s = self._table.get(cid.workflow)  # keyed by workflow id
        return s if s is not None and s.version == cid.version else None

    def observe(self, state: EngineState) -> None:
        """Follow the engine's lease records and events for the sessions' leases."""
        for rec in state.leases:
            s = self.owner(rec.cid)
            if s is not None and s.wait.lease is not None and s.wait.lease.cid == rec.cid:
                v = s.wait.lease
                v.protected_blocks = len(rec.protected_blocks)
                v.exclusive_blocks = rec.exclusive_blocks
                v.granted_at, v.deadline, v.generation = (
                    rec.granted_at,
                    rec.deadline,
                    rec.generation,
                )
        for ev in state.events:
            s = self.owner(ev.cid)
            if s is None or s.wait.lease is None or s.wait.lease.cid != ev.cid:
                continue
            v = s.wait.lease
            if ev.kind is not LeaseEventKind.DENIAL or v.status != "granted":
                v.status = _STATUS[ev.kind]
            if ev.kind is LeaseEventKind.GRANT:
                v.protected_blocks = ev.blocks
            v.events.append({"type": ev.kind.value, "time": ev.time, "blocks": ev.blocks})
            del v.events[:-16]  # bounded: the latest few
