"""The replicas: ``ladsd serve`` subprocesses on loopback, each on its own share of the cores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

# Set per replica by the cluster, so not accepted among the flags passed to every replica.
OWNED_FLAGS = ("--host", "--port", "--replica")


def core_shares(n: int, cpus: Sequence[int]) -> list[tuple[int, ...]]:
    """``n`` contiguous, near-equal shares of ``cpus`` (the first ones one core larger);
    fewer cores than replicas: one core each, taken in turn (they share)."""
    cpus = sorted(cpus)
    if not cpus:
        raise ValueError("no CPU is available to this process")
    if len(cpus) < n:
        return [(cpus[i % len(cpus)],) for i in range(n)]
    size, extra = divmod(len(cpus), n)
    out, at = [], 0
    for i in range(n):
        step = size + (1 if i < extra else 0)
        out.append(tuple(cpus[at : at + step]))
        at += step
    return out


def cpu_ranges(cpus: Sequence[int]) -> str:
    """``0-3,6``: a CPU list as taskset writes it."""
    parts: list[str] = []
    for c in sorted(cpus):
        if parts and int(parts[-1].split("-")[-1]) == c - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{c}"
        else:
            parts.append(str(c))
    return ",".join(parts)


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica: its name (the ``replica`` label), loopback port, cores and serve flags."""

    name: str
    port: int
    cpus: tuple[int, ...]
    serve_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        own = ("--host", "127.0.0.1", "--port", str(self.port), "--replica", self.name)
        return [sys.executable, "-m", "cli.main", "serve", *own, *self.serve_args]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the thread counts of this share: torch's intra-op pool is sized by
        OMP_NUM_THREADS (the in-process engine binds no threads of its own)."""
        n = str(len(self.cpus))
        return base | {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


class Child:
    """A subprocess in its own session (a terminal's Ctrl-C reaches only the cluster, which
    forwards it once), its output in ``log``."""

    def __init__(
        self, cmd: list[str], log: Path, env: dict[str, str], cpus: Sequence[int] = ()
    ) -> None:
        self.log = log
        self._out: IO[str] = open(log, "w")  # closed by poll() once the child exited
        share = set(cpus)

        def pin() -> None:  # in the child before exec (safe: the cluster runs no threads)
            os.sched_setaffinity(0, share)

        pinned = bool(share) and hasattr(os, "sched_setaffinity")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=pin if pinned else None,
        )
        self.code: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        if self.code is None:
            self.code = self.proc.poll()
            if self.code is not None:
                self._out.close()
        return self.code

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def wait(self, guard_s: float) -> int:
        """Its exit status; killed after ``guard_s`` (a hang guard)."""
        try:
            self.proc.wait(timeout=guard_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.poll()
        return self.proc.returncode

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 8) -> str:
        return "\n".join(self.output().rstrip().splitlines()[-lines:])


def wait_healthy(
    children: dict[str, tuple[ReplicaSpec, Child]],
    get: Callable[[str], tuple[int, str]],
    stop: Callable[[], bool],
    guard_s: float,
) -> str | None:
    """Until every replica's ``/health`` says 200: None; else why not (one exited, ``stop()``
    turned true, or ``guard_s`` passed: a hang guard)."""
    pending = set(children)
    deadline = time.monotonic() + guard_s
    while pending:
        if stop():
            return "stopped while the replicas started"
        if time.monotonic() > deadline:
            return f"replicas {', '.join(sorted(pending))} not healthy after {guard_s:.0f} s"
        for name in sorted(pending):
            spec, child = children[name]
            if child.poll() is not None:
                return f"replica {name} exited {child.code} while starting:\n{child.tail()}"
            if get(spec.url + "/health")[0] == 200:
                pending.discard(name)
        time.sleep(0.3)
    return None
