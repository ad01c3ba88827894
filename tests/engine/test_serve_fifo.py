"""``ladsd serve --policy fifo`` (no leases) on SmolLM2: the lease test's run without
leases finds almost nothing of A's history; retention is refused; SIGTERM with
requests in flight drains them and exits 0. And a non-loopback bind without a key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import ROOT, Server
from tests.rigs.server import BLOCK, MODEL, lease_run, serve, wait_for

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def srv(model_ready) -> Iterator[Server]:
    yield from serve("--policy", "fifo")


def test_without_leases_the_flood_evicts_the_history(srv: Server):
    st = srv.get("/v1/engine/state")
    assert not st["leases_enabled"] and st["policy"] == "fifo"
    assert st["supports"]["retention"] == ["release"]
    history, cached = lease_run(srv)
    assert history > 4 * BLOCK
    assert cached <= BLOCK  # near 0 (tests/engine/test_serve.py: >= history - 1 block with leases)
    assert srv.get("/v1/sessions/A")["lease"]["status"] == "no_leases"
    status, out = srv.http("POST", "/v1/sessions/A/retention", {"mode": "requirement"})
    assert status == 409 and out["error"]["code"] in ("leases_disabled", "not_waiting")
    assert srv.metrics()["ladsd_lease_grants"] == 0


def test_sigterm_drains_requests_in_flight_then_exits_0(srv: Server):
    """Last in the module: it stops the module's server."""
    n, want = 3, 48
    results: list[Any] = []

    def ask(i: int) -> None:
        try:
            r = srv.client().chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Count to {100 + i}."}],
                max_tokens=want,
                temperature=0,
                extra_body={"min_tokens": want, "ignore_eos": True},
            )
            results.append(r)
        except Exception as e:  # reported below
            results.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    wait_for("requests in flight", lambda: srv.metrics()["ladsd_requests_in_flight"] == n)
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=600)
    assert len(results) == n
    for r in results:
        assert not isinstance(r, Exception), r
        assert r.usage.completion_tokens == want  # finished, not cut
    assert srv.proc.wait(timeout=600) == 0, srv.output()
    assert "audit balanced" in srv.output()


def test_non_loopback_without_a_key_is_refused():
    cmd = [sys.executable, "-m", "cli.main", "serve", "--host", "0.0.0.0", "--port", "1"]
    env = {k: v for k, v in os.environ.items() if k != "LADSD_API_KEY"}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert res.returncode == 2
    text = " ".join((res.stdout + res.stderr).split())
    assert "--api-key" in text and "not loopback" in text
