"""What handlers see of the daemon: one narrow :class:`ServeContext` on the app.

The Daemon (:mod:`.daemon`) builds the context and the app, installs each
handler module's routes and runs the life cycle; handlers (:mod:`.completions`,
:mod:`.protocol`, :mod:`.metrics`, :mod:`.agents`) read ``request.app[CONTEXT]``
and never import the daemon. The context holds only what they need:

* :class:`Served`: what this daemon serves (profile, policies, lease rule);
* the session table and the event hub;
* :class:`Admission`: the chat requests in flight (429 past the limit) and the
  request counters;
* :class:`RuntimeSlot`: the runtime once the engine is up (503 before, or after
  it died); handlers reach the engine only through it;
* the settings (:class:`ServeConfig`) and the agent catalog.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ladsd.config import Profile
from ladsd.modes import EnginePolicy
from ladsd.records import ContinuationId, EngineState
from ladsd.runtime import Runtime
from ladsd.serve.app import Limits
from ladsd.serve.errors import ApiError
from ladsd.serve.events import EventHub
from ladsd.serve.render import Renderer
from ladsd.serve.responses import WRITE_TIMEOUT_S
from ladsd.serve.sessions import LeaseRule, SessionTable
from web_catalog.db import Catalog


@dataclass(frozen=True)
class ServeConfig:
    """The server's own settings (the engine's and the leases' are the profile's)."""

    host: str = "127.0.0.1"
    port: int = 8731
    api_key: str | None = None  # the tenant "default"'s key; a key is required off loopback
    keys: tuple[tuple[str, str], ...] = ()  # (tenant, key) pairs (--api-keys FILE)
    max_waiting: int = 64  # chat requests admitted beyond the engine's m running ones
    max_sessions: int = 1024
    session_ttl_s: float = 600.0
    max_body_bytes: int = 4 * 1024 * 1024
    drain_s: float = 30.0  # SIGTERM: how long requests in flight may take to finish
    write_timeout_s: float = WRITE_TIMEOUT_S  # a stream reader that takes nothing this long: gone
    limits: Limits = Limits()  # connections: keep-alive, body timeout, caps
    lease_rule: str = "session"  # a tool wait's lease lifetime: session | fixed (LeaseRule)
    lease_max_s: float | None = None  # the cap on l_i; None: 8 x the profile's l
    replica: str | None = None  # this replica's name (ladsd cluster): a label on /metrics


@dataclass(frozen=True)
class Served:
    """What this daemon serves: fixed at construction."""

    profile: Profile
    policy: str  # the delivery policy
    engine_policy: EnginePolicy
    lease_rule: LeaseRule
    started: int  # Unix time

    @property
    def model(self) -> str:
        return self.profile.engine.model

    @property
    def max_model_len(self) -> int:
        return self.profile.engine.max_model_len

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": self.started,
            "owned_by": "ladsd",
            "max_model_len": self.max_model_len,
        }


class Admission:
    """At most ``running + waiting`` chat requests in flight; more get 429, and every
    one gets 503 once the daemon drains. Owns the request counters (``stats``)."""

    def __init__(self, running: int, waiting: int) -> None:
        self.limit = running + waiting
        self.waiting = waiting
        self.in_flight = 0
        self.draining = False
        self.stats: Counter[str] = Counter()

    @contextmanager
    def admit(self) -> Iterator[None]:
        """One chat request's slot, for the ``with`` block."""
        if self.draining:
            raise ApiError(503, "the daemon is shutting down", code="shutting_down")
        if self.in_flight >= self.limit:
            self.stats["rejected"] += 1
            raise ApiError(
                429,
                f"{self.in_flight} requests in flight (limit {self.limit}: "
                f"{self.limit - self.waiting} running + {self.waiting} waiting); retry later",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self.in_flight += 1
        self.stats["requests"] += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class RuntimeSlot:
    """The daemon's runtime, empty until the engine is up; the one way handlers reach it.

    ``state`` is the engine's last published state (None before the first);
    ``renderer`` tokenises the sessions' turns (the engine's tokenizer).
    """

    def __init__(self) -> None:
        self.rt: Runtime | None = None
        self.state: EngineState | None = None
        self.renderer: Renderer | None = None

    def attach(self, rt: Runtime) -> None:
        self.rt = rt
        self.renderer = Renderer(rt.tokenizer)

    @property
    def alive(self) -> bool:
        return self.rt is not None and self.rt.alive

    @property
    def leases_enabled(self) -> bool:
        return self.rt is not None and self.rt.leases_enabled

    def live(self) -> Runtime:
        """The runtime; 503 at once while the engine starts or after it died (never a hang)."""
        rt = self.rt
        if rt is None:
            raise ApiError(503, "the engine is starting", code="engine_starting")
        if not rt.alive:
            raise ApiError(503, f"the engine is down: {rt.error}", code="engine_dead")
        return rt

    def cancel(self, cid: ContinuationId) -> None:
        """Drop a continuation's lease and candidate in the engine (if it still runs)."""
        if self.rt is not None:
            self.rt.cancel(cid)  # a chat session's cid is never the sender's: engine only


@dataclass(frozen=True)
class ServeContext:
    """Everything a handler may use (the read-through properties name the common reads)."""

    cfg: ServeConfig
    served: Served
    sessions: SessionTable
    events: EventHub
    admission: Admission
    runtime: RuntimeSlot
    catalog: Catalog | None

    @property
    def model(self) -> str:
        return self.served.model

    @property
    def rt(self) -> Runtime | None:
        return self.runtime.rt

    @property
    def state(self) -> EngineState | None:
        return self.runtime.state

    @property
    def alive(self) -> bool:
        return self.runtime.alive

    @property
    def stats(self) -> Counter[str]:
        return self.admission.stats

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    @property
    def draining(self) -> bool:
        return self.admission.draining

    def live(self) -> Runtime:
        return self.runtime.live()


CONTEXT: web.AppKey[ServeContext] = web.AppKey("ladsd.serve", ServeContext)
