"""The Daemon: one ``open_runtime`` kept open for the daemon's life, behind HTTP.

Life: bind the port (an address in use fails at once) -> open the runtime
(engine thread with the lease scheduler, paced link, delivery policy) -> serve
-> on SIGTERM/SIGINT (or :meth:`Daemon.stop`): stop accepting, drain the
requests in flight (up to ``drain_s``), end every session (releasing its
leases), leave the runtime, which releases every lease and checks the lease
audit. :meth:`Daemon.run` returns that audit.

The daemon builds the app and the narrow :class:`~.context.ServeContext` its
handlers read (sessions, events, admission, the runtime, the settings); each
handler module exports its routes (``install``), and none imports this module.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

from aiohttp import web

from ladsd import sizing
from ladsd.config import Profile
from ladsd.engine.thread import DAEMON_UPKEEP, EngineThread, Upkeep
from ladsd.modes import EnginePolicy
from ladsd.records import EngineState
from ladsd.runtime import Runtime
from ladsd.serve import agents, completions, metrics, protocol
from ladsd.serve.app import CappedSite, check_bind, is_loopback, key_table, make_app, make_runner
from ladsd.serve.context import (
    CONTEXT,
    Admission,
    RuntimeSlot,
    ServeConfig,
    ServeContext,
    Served,
)
from ladsd.serve.events import EventHub
from ladsd.serve.render import Renderer
from ladsd.serve.responses import json_response
from ladsd.serve.sessions import LeaseRule, Session, SessionTable
from ladsd.wiring import open_runtime
from web_catalog.db import Catalog, CatalogMissing, open_catalog

log = logging.getLogger("ladsd.serve")


class StartInterrupted(Exception):
    """SIGTERM/SIGINT (or :meth:`Daemon.stop`) came while the engine was starting."""

    def __init__(self, sig: int | None) -> None:
        name = signal.Signals(sig).name if sig is not None else "a stop"
        super().__init__(f"{name} while starting: nothing to drain, no lease was held")
        self.signal = sig
        self.status = 128 + sig if sig is not None else 1  # the shell's code for the signal


def exit_now(status: int) -> None:
    """Leave at once (a second signal cut the drain): flush what was said, skip teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _catalog() -> Catalog | None:
    try:
        return open_catalog()
    except CatalogMissing:
        log.info("no catalog built: agent runs are unavailable (`ladsd catalog build`)")
        return None


def completed(s: Session, draining: bool) -> bool:
    """The daemon's harness report of a completed workflow (:meth:`Session.completed`:
    the client's DELETE or idle expiry after an answer), never during the shutdown drain."""
    return s.completed() and not draining


class Daemon:
    """The daemon of one delivery ``policy`` on one ``engine_policy`` (``--engine-policy``)."""

    def __init__(
        self,
        profile: Profile,
        policy: str = "lads",
        cfg: ServeConfig | None = None,
        engine_policy: EnginePolicy = EnginePolicy.VLLM,
        upkeep: Upkeep = DAEMON_UPKEEP,
    ):
        self.cfg = cfg = cfg or ServeConfig()
        self.upkeep = upkeep  # cached kappa, quiet idle, bounded timeline; progress lines
        self.signal: int | None = None  # the signal that began the shutdown
        check_bind(cfg.host, cfg.api_key, cfg.keys)
        keys = key_table(cfg.api_key, cfg.keys)  # API key -> tenant
        rule = LeaseRule.of(  # ValueError on a bad rule or cap
            cfg.lease_rule, profile.lease.lease_lifetime_s, cfg.lease_max_s
        )
        served = Served(profile, policy, EnginePolicy(engine_policy), rule, int(time.time()))
        tenants = max(1, len(set(keys.values())))
        self.ctx = ServeContext(
            cfg=cfg,
            served=served,
            sessions=SessionTable(
                cfg.max_sessions, cfg.session_ttl_s, self._release, tenants=tenants
            ),
            events=EventHub(max_subscribers=cfg.limits.max_event_streams, tenants=tenants),
            admission=Admission(profile.engine.max_num_seqs, cfg.max_waiting),
            runtime=RuntimeSlot(),
            catalog=_catalog(),
        )
        self.audit: dict[str, float] | None = None
        self._stop: asyncio.Event | None = None
        self._closer: asyncio.Task[None] | None = None  # closes the event hub after the drain
        self.app = make_app(
            max_body_bytes=cfg.max_body_bytes,
            keys=keys,
            loopback=is_loopback(cfg.host),
            limits=cfg.limits,
        )
        self.app[CONTEXT] = self.ctx
        self.app.router.add_get("/health", self.health)
        completions.install(self.app)
        protocol.install(self.app)
        metrics.install(self.app)
        agents.install(self.app)
        self.app.on_shutdown.append(self._close_streams)

    # ---- the parts, for the CLI and tests (handlers read the context) ------------------
    @property
    def sessions(self) -> SessionTable:
        return self.ctx.sessions

    @property
    def events(self) -> EventHub:
        return self.ctx.events

    @property
    def catalog(self) -> Catalog | None:
        return self.ctx.catalog

    @property
    def profile(self) -> Profile:
        return self.ctx.served.profile

    @property
    def stats(self) -> Counter[str]:
        return self.ctx.admission.stats

    @property
    def in_flight(self) -> int:
        return self.ctx.admission.in_flight

    @property
    def admit_limit(self) -> int:
        return self.ctx.admission.limit

    @property
    def draining(self) -> bool:
        return self.ctx.admission.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.ctx.admission.draining = value

    @property
    def rt(self) -> Runtime | None:
        return self.ctx.runtime.rt

    @rt.setter
    def rt(self, rt: Runtime | None) -> None:
        self.ctx.runtime.rt = rt

    @property
    def state(self) -> EngineState | None:
        return self.ctx.runtime.state

    @state.setter
    def state(self, state: EngineState | None) -> None:
        self.ctx.runtime.state = state

    @property
    def renderer(self) -> Renderer | None:
        return self.ctx.runtime.renderer

    def live_engine(self) -> EngineThread:
        """The engine thread itself, or 503 while it starts or after it died (tests)."""
        return self.ctx.runtime.live().engine

    async def health(self, _: web.Request) -> web.Response:
        rt, served = self.ctx.runtime.rt, self.ctx.served
        if rt is None:
            return json_response({"status": "starting"}, 503)
        if not rt.alive:
            return json_response({"status": "engine down", "error": str(rt.error)}, 503)
        body = {"status": "ok", "model": served.model, "policy": served.policy}
        body |= {"engine_policy": served.engine_policy.value, "dtype": rt.engine_info().dtype}
        body |= {"sessions": len(self.sessions), "in_flight": self.in_flight}
        return json_response(body)

    # ---- wiring ------------------------------------------------------------------------
    def _attach(self, rt: Runtime) -> None:
        self.ctx.runtime.attach(rt)

        def on_state(state: EngineState) -> None:  # after the runtime's (sender feedback)
            self.state = state
            self.sessions.observe(state)
            self.events.on_state(state, self._owner)

        rt.subscribe(on_state)

    def _owner(self, workflow: str) -> tuple[str | None, str]:
        """An engine workflow's tenant and the id its client knows: ``tenant/session``
        for a chat session, an agent run's id for a run."""
        tenant, slash, sid = workflow.partition("/")
        if slash:
            return tenant, sid
        run = self.app[agents.AGENTS].runs.get(workflow)
        return (run.tenant if run is not None else None), workflow

    def _release(self, s: Session) -> None:
        for cid in s.held():
            self.ctx.runtime.cancel(cid)
        if self.rt is not None and completed(s, self.draining):
            self.rt.end_workflow(s.workflow, s.turn)  # HEAR's continuation estimate learns it
        self.events.publish("session_end", s.id, tenant=s.tenant, turns=s.turn, why=s.ended_by)

    async def _close_streams(self, _: web.Application) -> None:
        """Event streams end after the drain (so they carry its completions), and the
        drain does not wait for them: they end as soon as no chat request is in flight."""

        async def after_drain() -> None:
            while self.in_flight:
                await asyncio.sleep(0.05)
            self.events.close()

        self._closer = asyncio.get_running_loop().create_task(after_drain())

    async def _reap(self) -> None:
        period = min(5.0, self.sessions.ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            self.sessions.expire()

    # ---- life ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Begin the shutdown (what SIGTERM does); while starting, give the start up."""
        if self._stop is not None:
            self._stop.set()

    def _on_signal(self, sig: int) -> None:
        """SIGTERM/SIGINT: the first stops (drains); a second one cuts the drain and exits."""
        name = signal.Signals(sig).name
        if self._stop is not None and self._stop.is_set():
            self._say(f"{name} again: the drain was cut ({self.in_flight} requests in flight)")
            exit_now(128 + sig)
        self.signal = sig
        if self.rt is not None:
            self._say(
                f"{name}: draining {self.in_flight} requests in flight (up to "
                f"{self.cfg.drain_s:g} s; {name} again cuts it)"
            )
        self.stop()

    def _say(self, line: str) -> None:
        if self.upkeep.progress is not None:
            self.upkeep.progress(line)

    @asynccontextmanager
    async def _runtime(self) -> AsyncIterator[Runtime]:
        """``open_runtime``, given up as soon as a stop comes while the engine starts.

        The engine's load cannot be interrupted (native code); the engine thread
        stops once it ends, and ``ladsd serve`` exits without waiting for that.
        """
        assert self._stop is not None
        async with AsyncExitStack() as stack:
            s = self.ctx.served
            prof = sizing.for_run(s.profile, s.policy, s.engine_policy)  # the engine it runs
            cm = open_runtime(prof, s.policy, engine_policy=s.engine_policy, upkeep=self.upkeep)
            opening = asyncio.ensure_future(stack.enter_async_context(cm))
            stopped = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait({opening, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
            if not opening.done():
                opening.cancel()
                await asyncio.gather(opening, return_exceptions=True)
                raise StartInterrupted(self.signal)
            yield opening.result()

    async def sizes(self) -> dict[str, int]:
        """Entries per table of the daemon and its runtime: bounded however long it runs.

        The runtime's tables (:meth:`Runtime.sizes`) are 0 when nothing is in
        flight; the rest are capped: the lease timeline (``Upkeep``), the event
        backlog, the session and agent-run tables.
        """
        own = {
            "sessions": len(self.sessions),
            "events.backlog": len(self.events.backlog),
            "events.subscribers": self.events.subscribers,
            "agent_runs": len(self.app[agents.AGENTS].runs),
            "stats": len(self.stats),
        }
        if self.rt is None:
            return own
        rt = {f"rt.{k}": v for k, v in (await self.rt.sizes()).items()}
        return own | rt | self.rt.timeline.sizes()

    async def run(self, ready: Callable[[str], None] | None = None) -> dict[str, float]:
        """Serve until :meth:`stop`, SIGTERM or SIGINT; return the lease audit."""
        cfg = self.cfg
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handled = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
                handled.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass
        if not is_loopback(cfg.host):
            log.warning(
                "serving on %s, which is not loopback: every request needs the API key", cfg.host
            )
        runner = make_runner(self.app, cfg.drain_s)
        await runner.setup()
        cleaned = False
        try:
            await CappedSite(runner, cfg.host, cfg.port, cfg.limits.max_connections).start()
            self._say(f"listening on http://{cfg.host}:{cfg.port} (503 until the engine is up)")
            async with self._runtime() as rt:
                self._attach(rt)
                if ready is not None:
                    ready(f"http://{cfg.host}:{cfg.port}")
                reaper = asyncio.create_task(self._reap(), name="ladsd-session-reaper")
                try:
                    await self._stop.wait()
                finally:
                    reaper.cancel()
                    self.draining = True
                    cleaned = True
                    await runner.cleanup()  # stop listening, end event streams, drain
                    self.sessions.end_all()  # release what the sessions hold
            self.audit = rt.audit
        finally:
            if not cleaned:
                await runner.cleanup()
            self.events.close()  # past the drain's time limit the streams were cut anyway
            if self._closer is not None:
                self._closer.cancel()
            if self.catalog is not None:
                self.catalog.close()
            if self.renderer is not None:
                self.renderer.close()  # its tokenizer thread
            for sig in handled:
                loop.remove_signal_handler(sig)
        assert self.audit is not None
        return self.audit
