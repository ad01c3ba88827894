"""The daemon's long life: start-up, idle cost and the signals that end it.

* kappa: a replay's engine measures it at every start (15 timed steps, no cache); the
  daemon's reads it from ``$LADSD_HOME/kappa`` (a miss measures 3 steps and stores
  it); an entry of another key is not used, a corrupt one is ignored with a warning.
* idle: an in-process daemon nobody asks anything publishes no state and runs no tick,
  however many commands (queries) its engine loop handles; a lease granted after idle
  is still handed off, another one still expires (states flow again while they live).
* signals (``ladsd serve`` subprocesses): SIGTERM while the model loads ends the
  process at once (143); a second SIGINT during a drain cuts it (130).

Every wait has a generous guard (hang guards only; no assertion is about time).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from ladsd.config import PROFILES
from ladsd.engine import kappa as kappa_cache
from ladsd.engine.kappa import SERVE_SAMPLES, KappaSource
from ladsd.engine.thread import KAPPA_SAMPLES, EngineThread, Upkeep
from ladsd.records import EngineState
from ladsd.serve.daemon import Daemon, ServeConfig
from tests.helpers import FORCE, free_port, linked_home, running, serve_log, weather_tool

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
GUARD_S = 300  # hang guards only: this machine may be shared and slow
SMOKE = PROFILES["smoke"]
TICK = SMOKE.lease.tick_s
WEATHER = weather_tool(max_len=8)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = linked_home(tmp_path)
    monkeypatch.setenv("LADSD_HOME", str(h))
    return h


# ---- kappa -------------------------------------------------------------------------


async def _start(upkeep: Upkeep) -> EngineThread:
    async with EngineThread(SMOKE.engine, SMOKE.lease, upkeep=upkeep) as eng:
        return eng


def test_kappa_cache_uses_only_its_own_key(home: Path, caplog: pytest.LogCaptureFixture):
    key = {"model": "tiny", "threads": "2"}
    other = key | {"threads": "4"}
    assert kappa_cache.store(other, 0.5, [0.5]) is not None
    assert kappa_cache.load(key) is None  # another key's entry is another file
    kappa_cache.entry_path(key).write_text(json.dumps({"key": other, "kappa": 0.5}))
    with caplog.at_level(logging.WARNING, logger="ladsd.engine"):
        assert kappa_cache.load(key) is None  # an entry filed under our name, of another key
    assert "another engine or machine" in caplog.text
    kappa_cache.store(key, 0.25, [0.25])
    assert kappa_cache.load(key) == 0.25
    for bad in ("{not json", json.dumps({"key": key, "kappa": "nan"}), json.dumps([1])):
        kappa_cache.entry_path(key).write_text(bad)
        assert kappa_cache.load(key) is None  # never raises


def test_kappa_key_names_the_machine_and_versions(home: Path):
    key = kappa_cache.cache_key({"model": "tiny", "step_tokens": 512}, home / "models" / "tiny")
    assert {"model", "step_tokens", "shape", "cpu", "cpu_flags", "vllm", "torch"} <= set(key)
    assert key["shape"] != "unknown" and int(key["threads"]) >= 1


@pytest.mark.asyncio
async def test_replay_measures_kappa_at_every_start_and_caches_nothing(home: Path, model_ready):
    eng = await _start(Upkeep())
    assert (eng.activity.kappa_from, eng.activity.kappa_steps) == ("measured", KAPPA_SAMPLES + 1)
    assert eng.kappa > 0 and not (home / "kappa").exists()


@pytest.mark.asyncio
async def test_daemon_reads_kappa_from_its_cache(
    home: Path, model_ready, caplog: pytest.LogCaptureFixture
):
    daemon = Upkeep(KappaSource.CACHE)
    first = await _start(daemon)
    act = first.activity
    assert (act.kappa_from, act.kappa_steps) == ("measured", SERVE_SAMPLES + 1)
    (entry,) = (home / "kappa").glob("*.json")
    assert json.loads(entry.read_text())["kappa"] == first.kappa
    second = await _start(daemon)
    assert (second.activity.kappa_from, second.activity.kappa_steps) == ("cache", 0)
    assert second.kappa == first.kappa
    entry.write_text('{"kappa": 0.1, "key": ')  # a torn write
    with caplog.at_level(logging.WARNING, logger="ladsd.engine"):
        third = await _start(daemon)
    assert "corrupt" in caplog.text
    assert third.activity.kappa_from == "measured" and third.kappa > 0
    assert json.loads(entry.read_text())["kappa"] == third.kappa  # stored again


# ---- idle ---------------------------------------------------------------------------


class Life:
    """An in-process daemon and a count of the engine states it received."""

    def __init__(self, d: Daemon) -> None:
        assert d.rt is not None
        self.d, self.engine, self.states = d, d.rt.engine, 0

        def on_state(s: EngineState) -> None:
            self.states += 1

        d.rt.subscribe(on_state)

    async def settle(self) -> None:
        """Wait until nothing is live and no state came over three tick periods (bounded)."""
        for _ in range(200):
            s = await self.engine.sizes()
            live = sum(s.get(k, 0) for k in ("streams", "requests", "lease_book.pending"))
            live += s.get("lease_book.leases", 0) + s.get("lease_book.pins", 0)
            n = self.states
            await asyncio.sleep(3 * TICK)
            if not live and self.states == n:
                return
        pytest.fail(f"the daemon never went quiet: {self.states} states, sizes {s}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def life(model_ready) -> AsyncIterator[Life]:
    prof = replace(SMOKE, lease=replace(SMOKE.lease, lease_lifetime_s=5.0))
    async with running(Daemon(prof, "lads", ServeConfig(port=free_port())), GUARD_S) as d:
        yield Life(d)


async def chat(http: aiohttp.ClientSession, d: Daemon, sid: str, **body: Any) -> dict:
    b = {"model": "tiny", "max_tokens": 4, "temperature": 0} | body
    b.setdefault("messages", [{"role": "user", "content": "hello"}])
    url = f"http://127.0.0.1:{d.cfg.port}/v1/chat/completions"
    async with http.post(url, json=b, headers={"x-session-id": sid}) as r:
        out = await r.json()
        assert r.status == 200, out
        return out


async def event(d: Daemon, sid: str, kind: str) -> dict:
    for _ in range(int(GUARD_S / 0.05)):
        for e in d.events.backlog:
            if e["type"] == kind and e["session_id"] == sid:
                return e
        await asyncio.sleep(0.05)
    pytest.fail(f"no {kind} event for session {sid}")


@pytest.mark.asyncio(loop_scope="module")
async def test_an_idle_daemon_publishes_no_state_and_runs_no_tick(life: Life):
    await life.settle()
    act = life.engine.activity
    n, published, ticks, loops = life.states, act.published, act.ticks, act.loops
    for _ in range(20):  # queries: each one an iteration of the engine loop
        await life.engine.sizes()
        await life.engine.snapshot()
    await asyncio.sleep(5 * TICK)  # room for ticks, had there been any
    assert (life.states, act.published, act.ticks) == (n, published, ticks)
    assert act.loops >= loops + 20


@pytest.mark.asyncio(loop_scope="module")
async def test_leases_after_idle_are_handed_off_and_expire(life: Life):
    await life.settle()
    daemon, n = life.d, life.states
    msgs = [{"role": "user", "content": "Paris?"}]
    async with aiohttp.ClientSession() as http:
        out = await chat(http, daemon, "A", messages=msgs, tools=[WEATHER], tool_choice=FORCE,
                         max_tokens=40)  # fmt: skip
        reply = out["choices"][0]["message"]
        assert out["choices"][0]["finish_reason"] == "tool_calls"
        await event(daemon, "A", "grant")
        call = reply["tool_calls"][0]
        msgs += [reply, {"role": "tool", "tool_call_id": call["id"], "content": "Sunny"}]
        await chat(http, daemon, "A", messages=msgs, tools=[WEATHER], tool_choice="none")
        await event(daemon, "A", "handoff")
        out = await chat(http, daemon, "B", messages=msgs[:1], tools=[WEATHER],
                         tool_choice=FORCE, max_tokens=40)  # fmt: skip
        assert out["choices"][0]["finish_reason"] == "tool_calls"
        await event(daemon, "B", "grant")
        await event(daemon, "B", "expiry")  # nobody answered: it ends at g + l
    assert life.states > n  # states flowed while the leases lived
    await life.settle()  # and stop again


# ---- signals (ladsd serve subprocesses) ---------------------------------------------


class Serve:
    """``ladsd serve`` with its own LADSD_HOME; its output goes to a file."""

    def __init__(self, home: Path, *flags: str) -> None:
        self.home, self.port = home, free_port()
        self.out = home / "serve.out"
        cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(self.port), *flags]
        env = {**os.environ, "LADSD_HOME": str(home), "VLLM_LOGGING_LEVEL": "INFO"}
        with open(self.out, "wb") as f:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def health(self) -> int | None:
        """/health's status; None when nothing listens."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def wait(self, until: Any, what: str) -> None:
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"exited {self.proc.returncode} before {what}:\n{self.output()}")
            if until():
                return
            time.sleep(0.05)
        pytest.fail(f"not {what} after {GUARD_S} s:\n{self.output()}")

    def exit_status(self) -> int:
        try:
            return self.proc.wait(GUARD_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"still running {GUARD_S} s after the signal:\n{self.output()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_sigterm_while_the_model_loads_ends_the_process(tmp_path: Path, model_ready):
    srv = Serve(linked_home(tmp_path))  # SmolLM2-135M, real weights: a load of seconds
    try:
        srv.wait(lambda: "Starting to load model" in serve_log(srv.home, srv.proc.pid), "loading")
        assert srv.health() == 503  # still starting
        srv.proc.send_signal(signal.SIGTERM)
        status = srv.exit_status()
    finally:
        srv.kill()
    out = srv.output()
    assert status == 128 + signal.SIGTERM, out
    assert "SIGTERM while starting" in out and "ladsd serving" not in out


def _stream(port: int, started: threading.Event) -> None:
    """A long streaming chat request, read until the server goes away."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body |= {"max_tokens": 3500, "temperature": 0}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=GUARD_S) as r:
            for _ in r:
                started.set()
    except OSError:  # the daemon exited mid-stream
        pass


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError:
        return True
    return False


def test_a_second_sigint_cuts_the_drain(tmp_path: Path, model_ready):
    srv = Serve(linked_home(tmp_path), "--profile", "smoke", "--model", "tiny", "--drain-s", "600")
    try:
        srv.wait(lambda: srv.health() == 200, "healthy")
        started = [threading.Event() for _ in range(4)]  # streams that take a while
        readers = [threading.Thread(target=_stream, args=(srv.port, e)) for e in started]
        for t in readers:
            t.start()
        srv.wait(lambda: all(e.is_set() for e in started), "streaming")
        srv.proc.send_signal(signal.SIGINT)
        srv.wait(lambda: _refused(srv.port), "draining")  # it stopped listening
        srv.proc.send_signal(signal.SIGINT)
        status = srv.exit_status()
        for t in readers:
            t.join(GUARD_S)
    finally:
        srv.kill()
    out = srv.output()
    assert status == 128 + signal.SIGINT, out
    assert "SIGINT again: the drain was cut" in out
