"""``vllm-router`` in front of the replicas: its command line, readiness and worker removal.

The flags are the router's own (``vllm-router --help``, version 0.1.17). Three choices
keep a session on the replica that holds its lease:

* ``--policy`` is always given: the router's default, ``cache_aware``, is a prefix-tree
  guess, not session affinity; ``consistent_hash`` keys on the ``X-Session-ID`` header.
* ``--disable-retries``: the router retries 408/429/500/502/503/504 (5 attempts by
  default). A ladsd 429 (admission) or 503 (draining) is an answer about *this*
  replica; the client's own retry (``Retry-After``) comes back to the same replica.
  A 409 (requirement refused) is not retried by the router anyway.
* ``--disable-circuit-breaker``: the breaker counts every failed attempt, 4xx
  included, and an open circuit sends the worker's sessions elsewhere for
  ``--cb-timeout-duration-secs``: a burst of 429s would strand every lease on the
  replica. A dead replica is taken out instead by the cluster (``/remove_worker``, at
  once) and by the router's health checks (``--health-check-*``, a hung one).
"""

from __future__ import annotations

import shutil
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROUTINGS = ("consistent_hash", "round_robin", "cache_aware")  # the policies `--routing` offers
RELIABILITY = ("--disable-retries", "--disable-circuit-breaker")  # why: module docstring


def router_binary() -> str:
    """The ``vllm-router`` launcher of this environment (beside the interpreter), else PATH's."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if found is None:
        raise RuntimeError("vllm-router is not installed (./scripts/install.sh installs it)")
    return found


@dataclass(frozen=True)
class RouterSpec:
    """One router: where it listens, the workers it routes to, and how it watches them."""

    port: int
    workers: tuple[str, ...]  # replica base URLs, e.g. http://127.0.0.1:40001
    metrics_port: int  # the router's own Prometheus port (its default 29000 would collide)
    policy: str = "consistent_hash"
    host: str = "127.0.0.1"
    health_interval_s: int = 2  # router-side health checks of every worker's /health
    health_failures: int = 2  # consecutive failed checks before a worker is taken out
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.policy not in ROUTINGS:
            raise ValueError(f"unknown routing {self.policy!r}; choose from {', '.join(ROUTINGS)}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            router_binary(),
            *("--host", self.host, "--port", str(self.port)),
            "--worker-urls", *self.workers,
            "--policy", self.policy,
            *RELIABILITY,
            *("--health-check-endpoint", "/health"),
            *("--health-check-interval-secs", str(self.health_interval_s)),
            *("--health-failure-threshold", str(self.health_failures)),
            *("--health-success-threshold", "1"),
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port)),
            *("--worker-startup-check-interval", "1"),  # the replicas are healthy already
            *("--log-level", self.log_level),
        ]  # fmt: skip

    def describe(self) -> str:
        return (
            f"policy {self.policy}"
            + (" on X-Session-ID" if self.policy == "consistent_hash" else "")
            + f", retries off, circuit breaker off, health checks every {self.health_interval_s}"
            f" s (out after {self.health_failures} failures)"
        )


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """``GET url``: (status, body); (0, why) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


def wait_routing(spec: RouterSpec, alive: Callable[[], bool], guard_s: float) -> bool:
    """Until a worker answers ``GET /v1/models`` through the router (200, or 401 from
    replicas that want an API key), or ``alive()`` turns false, or ``guard_s`` passes (a
    hang guard): whether one answered."""
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline and alive():
        status, _ = get(spec.url + "/v1/models")
        if status in (200, 401):
            return True
        time.sleep(0.2)
    return False


def remove_worker(spec: RouterSpec, worker: str) -> str:
    """Take ``worker`` out of the router now (``POST /remove_worker?url=``): what it said."""
    query = urllib.parse.urlencode({"url": worker})
    req = urllib.request.Request(f"{spec.url}/remove_worker?{query}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return f"{r.status} {r.read().decode(errors='replace')[:200]}"
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read().decode(errors='replace')[:200]}"
    except OSError as e:
        return f"no answer ({e})"


def removed(spec: RouterSpec, worker: str, guard_s: float = 10.0) -> bool:
    """Whether ``GET /list_workers`` stops naming ``worker`` within ``guard_s`` (the router
    may apply a removal after it answered)."""
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline:
        status, body = get(spec.url + "/list_workers")
        if status == 200 and worker not in body:
            return True
        time.sleep(0.2)
    return False
