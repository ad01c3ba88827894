"""The cluster's life: start the replicas, wait for their health, start the router, watch
them all, and on SIGTERM/SIGINT drain every replica before the router goes.

No threads and no event loop: one process polls its children (the replicas and the
router do the work). A replica that dies is reported and taken out of the router at
once; the cluster keeps serving on the others and exits non-zero at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from ladsd.cluster.replicas import Child, ReplicaSpec, core_shares, cpu_ranges, wait_healthy
from ladsd.cluster.router import RouterSpec, get, remove_worker, removed, wait_routing

POLL_S = 0.2
AUDITED = "audit balanced"  # what `ladsd serve` prints when its lease audit balanced


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ClusterSpec:
    """``ladsd cluster``'s settings; ``serve_args`` go to every replica's ``ladsd serve``."""

    replicas: int
    port: int
    routing: str = "consistent_hash"
    host: str = "127.0.0.1"
    serve_args: tuple[str, ...] = ()
    health_interval_s: int = 2
    start_guard_s: float = 1800.0  # hang guards: the replicas' start, a replica's drain
    stop_guard_s: float = 900.0

    def plan(self, cpus: list[int]) -> list[ReplicaSpec]:
        shares = core_shares(self.replicas, cpus)
        return [
            ReplicaSpec(f"r{i}", free_port(), share, self.serve_args)
            for i, share in enumerate(shares)
        ]


class Cluster:
    """Runs one :class:`ClusterSpec` until a signal; :meth:`run` returns the exit status."""

    def __init__(self, spec: ClusterSpec, say: Callable[[str], None], log_dir: Path) -> None:
        self.spec, self.say, self.dir = spec, say, log_dir
        self.replicas: dict[str, tuple[ReplicaSpec, Child]] = {}
        self.router: RouterSpec | None = None
        self.router_proc: Child | None = None
        self.signals: list[int] = []
        self.dead: dict[str, int] = {}  # replicas that exited while serving: their status

    def run(self) -> int:
        sigs = (signal.SIGTERM, signal.SIGINT)
        old = {s: signal.signal(s, self._on_signal) for s in sigs}
        try:
            return self._run()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for child in self._children():  # only after a failure: nothing left behind
                if child.poll() is None:
                    child.proc.kill()
                    child.wait(30)

    def _on_signal(self, sig: int, _frame: FrameType | None) -> None:
        self.signals.append(sig)

    def _children(self) -> list[Child]:
        kids = [c for _, c in self.replicas.values()]
        return kids + ([self.router_proc] if self.router_proc is not None else [])

    def _run(self) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        for r in self.spec.plan(cpus or list(range(os.cpu_count() or 1))):
            child = Child(r.command(), self.dir / f"{r.name}.log", r.env(dict(os.environ)), r.cpus)
            self.replicas[r.name] = (r, child)
            self.say(
                f"replica {r.name}: {r.url} (pid {child.pid}, cpus {cpu_ranges(r.cpus)}, "
                f"log {child.log})"
            )
        why = wait_healthy(self.replicas, get, lambda: bool(self.signals), self.spec.start_guard_s)
        if why is None:
            why = self._start_router()
        if why is not None:
            self.say(f"cluster not started: {why}")
            self._shutdown()
            return 1
        assert self.router is not None
        self.say(f"ladsd cluster serving on {self.router.url} ({len(self.replicas)} replicas)")
        self._supervise()
        return self._shutdown()

    def _start_router(self) -> str | None:
        urls = tuple(r.url for r, _ in self.replicas.values())
        self.router = spec = RouterSpec(
            port=self.spec.port,
            workers=urls,
            metrics_port=free_port(),
            policy=self.spec.routing,
            host=self.spec.host,
            health_interval_s=self.spec.health_interval_s,
        )
        self.router_proc = proc = Child(spec.command(), self.dir / "router.log", dict(os.environ))
        self.say(f"router: {spec.url} (pid {proc.pid}, {spec.describe()}; log {proc.log})")

        def up() -> bool:
            return proc.poll() is None and not self.signals

        if wait_routing(spec, up, guard_s=120.0):
            return None
        if self.signals:
            return "stopped while the router started"
        return f"the router did not route (exit {proc.poll()}):\n{proc.tail()}"

    def _supervise(self) -> None:
        """Until a signal, the router's exit or the last replica's: report deaths."""
        assert self.router is not None and self.router_proc is not None
        while not self.signals:
            for name, (r, child) in self.replicas.items():
                if name not in self.dead and child.poll() is not None:
                    self.dead[name] = code = child.poll() or 0
                    self.say(f"replica {name} (pid {child.pid}) exited {code}: {self._take_out(r)};"
                             f" its sessions go to the others, their history recomputed\n"
                             f"{child.tail()}")  # fmt: skip
            if len(self.dead) == len(self.replicas):
                self.say("every replica exited: stopping the cluster")
                return
            if self.router_proc.poll() is not None:
                self.say(f"the router exited {self.router_proc.code}:\n{self.router_proc.tail()}")
                return
            time.sleep(POLL_S)

    def _take_out(self, r: ReplicaSpec) -> str:
        """Take a dead replica out of the router now; what happened, in words."""
        assert self.router is not None
        said = remove_worker(self.router, r.url)
        if removed(self.router, r.url):
            return f"taken out of the router ({said})"
        n = self.router.health_interval_s * self.router.health_failures
        return f"removal not confirmed ({said}); the router's health checks skip it in ~{n} s"

    def _shutdown(self) -> int:
        """Forward the signal (SIGTERM if none) to every live replica, forward each further
        one (it cuts their drains), then stop the router: 0 iff every replica's audit
        balanced and none had died."""
        own = 0 if self.signals else 1  # no signal came (a failure): a SIGTERM of our own
        sent = 0
        live = [(n, c) for n, (_, c) in self.replicas.items() if n not in self.dead]
        deadline = time.monotonic() + self.spec.stop_guard_s
        while any(c.poll() is None for _, c in live) and time.monotonic() < deadline:
            while sent < own + len(self.signals):
                sig = signal.SIGTERM if sent < own else self.signals[sent - own]
                for _, c in live:
                    c.signal(sig)
                sent += 1
            time.sleep(POLL_S)
        ok = not self.dead and bool(live)
        for name, child in live:
            code = child.wait(5)
            audited = AUDITED in child.output()
            ok = ok and code == 0 and audited
            self.say(f"replica {name} exited {code}" + (": audit balanced" if audited else ""))
        if self.router_proc is not None:
            self.router_proc.signal(signal.SIGTERM)
            self.router_proc.wait(30)
        for name, code in self.dead.items():
            self.say(f"replica {name} had died (exit {code}): its audit did not run")
        return 0 if ok else 1
