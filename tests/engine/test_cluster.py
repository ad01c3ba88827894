"""``ladsd cluster``: two tiny replicas behind a real ``vllm-router`` on loopback.

One cluster for the module (``--model tiny --profile smoke``, blocks of 32 tokens): each
replica runs one request at a time with no waiting room (``--max-num-seqs 1
--max-waiting 0``), so a second request on a busy replica gets a 429 for sure.

* consistent_hash (the default): a session's next turn finds its history cached;
* a round_robin router over the same replicas loses it on some turns (less cached);
* a replica's 429 reaches the client as it is: the router does not retry it, nor open
  a circuit that moves the session;
* POST ``/v1/sessions/{id}/intent`` and ``/retention`` with the header reach the owner;
* ``/metrics`` of each replica carries its ``replica`` label;
* a killed replica: the cluster reports it and takes it out of the router; its sessions'
  next turns complete on the other replica (recomputed), the others' stay cached; no
  request hangs. Last, since the cluster then exits non-zero.

Sessions have distinct first blocks, so no cache is shared between them. Every wait has
a hang guard; nothing asserts a time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from cli.main import app
from ladsd.cluster import ROUTINGS, RouterSpec, core_shares
from ladsd.cluster.replicas import Child, cpu_ranges
from ladsd.cluster.router import wait_routing
from ladsd.records import EngineState
from ladsd.serve.metrics import registry
from ladsd.serve.sessions import SessionTable
from tests.helpers import CALL_S, FORCE, ROOT, START_S, free_port, weather_tool

BLOCK = 32  # the smoke profile's block on CPU
SERVE = ["--model", "tiny", "--profile", "smoke", "--max-num-seqs", "1", "--max-waiting", "0"]
SERVE += ["--lease-s", "120"]  # no lease expires while this machine is slow
SERVE += ["--kv-blocks", "320"]  # room for every session's history: no eviction pressure
WEATHER = weather_tool(max_len=8)
LINE = re.compile(r"replica (r\d+): (http://127\.0\.0\.1:\d+) \(pid (\d+)")


# ---- without the engine --------------------------------------------------------------


def test_core_shares_split_the_cores() -> None:
    assert core_shares(2, [0, 1, 2, 3, 4]) == [(0, 1, 2), (3, 4)]
    assert core_shares(3, [4, 5]) == [(4,), (5,), (4,)]  # fewer cores: they share, in turn
    assert cpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_router_command_sets_policy_and_no_retries() -> None:
    spec = RouterSpec(port=9000, workers=("http://127.0.0.1:1", "http://127.0.0.1:2"),
                      metrics_port=9001)  # fmt: skip
    cmd = spec.command()
    at = cmd.index("--policy")
    assert cmd[at + 1] == "consistent_hash"  # explicit: the router's default is cache_aware
    assert "--disable-retries" in cmd and "--disable-circuit-breaker" in cmd
    assert cmd[cmd.index("--worker-urls") + 1 : cmd.index("--worker-urls") + 3] == list(
        spec.workers
    )
    assert cmd[cmd.index("--prometheus-port") + 1] == "9001"
    with pytest.raises(ValueError, match="unknown routing"):
        RouterSpec(port=1, workers=(), metrics_port=2, policy="power_of_two")
    assert set(ROUTINGS) == {"consistent_hash", "round_robin", "cache_aware"}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--port", "1", "--replica", "x"], "set per replica"),
        (["--no-such-flag"], "no such option"),
        (["--routing", "random"], "choose from"),
        (["--host", "0.0.0.0"], "--api-key"),
    ],
)
def test_cluster_refuses_bad_flags_before_starting(args: list[str], says: str) -> None:
    res = CliRunner().invoke(app, ["cluster", *args])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.replace("│", " ").lower().split())  # rich's box, its wraps
    assert says in text, res.output


def test_metrics_label_every_sample_with_the_replica() -> None:
    state = EngineState(time=1, seq=1, generation=1, U=4, B=10, F=50, w=2, a=3,
                        total_blocks=100, counters={"grants": 3.0})  # fmt: skip
    stats = {"prompt_tokens": 10, "cached_tokens": 4, "requests": 1, "rejected": 0}
    table = SessionTable(2, 10.0, lambda s: None)
    d = SimpleNamespace(state=state, model="m", stats=stats | {"disconnected": 0}, rt=None,
                        sessions=table, in_flight=0, alive=True)  # fmt: skip
    for replica in ("r7", None):
        text = generate_latest(registry(d, replica)).decode()  # type: ignore[arg-type]
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        assert len(samples) > 20
        assert all(s.labels.get("replica") == replica for s in samples), replica
        assert all(s.labels["model_name"] == "m" for s in samples)


def test_serve_refuses_a_bad_replica_name() -> None:
    res = CliRunner().invoke(app, ["serve", "--replica", "a b"])
    assert res.exit_code == 2 and "replica name" in res.output


# ---- the cluster ------------------------------------------------------------------------


@dataclass
class Running:
    """The ``ladsd cluster`` subprocess and what it printed."""

    proc: subprocess.Popen[bytes]
    log: Path
    url: str
    replicas: dict[str, tuple[str, int]] = field(default_factory=dict)  # name: (url, pid)
    killed: set[str] = field(default_factory=set)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def until_printed(self, pattern: str) -> re.Match[str]:
        deadline = time.monotonic() + START_S  # a hang guard
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output())
            if found:
                return found
            if self.proc.poll() is not None:
                pytest.fail(f"ladsd cluster exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.3)
        pytest.fail(f"ladsd cluster never printed {pattern!r}:\n{self.output()}")


def temp_log() -> Path:
    fd, path = tempfile.mkstemp(suffix=".log")
    os.close(fd)
    return Path(path)


@pytest.fixture(scope="module")
def cluster(model_ready) -> Iterator[Running]:
    port = free_port()
    log = temp_log()
    cmd = [sys.executable, "-m", "cli.main", "cluster", "--replicas", "2", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, *SERVE], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ.copy()
        )
    run = Running(proc, log, f"http://127.0.0.1:{port}")
    try:
        run.until_printed(r"ladsd cluster serving on")
        run.replicas = {m[0]: (m[1], int(m[2])) for m in LINE.findall(run.output())}
        assert sorted(run.replicas) == ["r0", "r1"], run.output()
        yield run
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=START_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        out = run.output()
        log.unlink()
    alive = [r for r in run.replicas if r not in run.killed]
    for name in alive:
        assert f"replica {name} exited 0: audit balanced" in out, out
    assert code == (1 if run.killed else 0), out  # a replica that died: the cluster says so


def http(method: str, url: str, body: Any = None, session: str | None = None) -> tuple[int, Any]:
    """One JSON call with a hang guard: (status, body); (0, why) if nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if session is not None:
        req.add_header("X-Session-ID", session)
    try:
        with urllib.request.urlopen(req, timeout=CALL_S) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except OSError as e:
        return 0, str(e)
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def system(sid: str) -> str:
    """A system prompt whose first block is this session's own (no cache shared)."""
    return f"Session {sid}: " + " ".join(f"{sid}-{j}:{(j * 37) % 101}" for j in range(40))


@dataclass
class Turns:
    """A session's two turns: a forced tool call, then the tool's result."""

    sid: str
    msgs: list[dict[str, Any]] = field(default_factory=list)
    history: int = 0  # prompt + output tokens of the first turn

    def first(self, base: str) -> None:
        self.msgs = [{"role": "system", "content": system(self.sid)},
                     {"role": "user", "content": "Weather in Paris?"}]  # fmt: skip
        body = {"model": "tiny", "messages": self.msgs, "tools": [WEATHER], "tool_choice": FORCE,
                "max_tokens": 40, "temperature": 0}  # fmt: skip
        status, out = http("POST", base + "/v1/chat/completions", body, self.sid)
        assert status == 200, out
        msg = out["choices"][0]["message"]
        assert msg["tool_calls"], out
        self.history = out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
        call = msg["tool_calls"][0]
        self.msgs += [msg, {"role": "tool", "tool_call_id": call["id"], "content": "Sunny"}]

    def next(self, base: str) -> tuple[int, Any]:
        body = {"model": "tiny", "messages": self.msgs, "tools": [WEATHER], "tool_choice": "none",
                "max_tokens": 4, "temperature": 0}  # fmt: skip
        return http("POST", base + "/v1/chat/completions", body, self.sid)


def cached(out: dict[str, Any]) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def owner(run: Running, sid: str) -> str:
    """The replica that holds session ``sid`` (asked directly, not through the router)."""
    live = {n: url for n, (url, _) in run.replicas.items() if n not in run.killed}
    have = [n for n, url in live.items() if http("GET", f"{url}/v1/sessions/{sid}")[0] == 200]
    assert len(have) == 1, (sid, have)
    return have[0]


def counters(url: str) -> dict[str, float]:
    status, text = http("GET", url + "/metrics")
    assert status == 200, text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.engine
def test_consistent_hash_keeps_each_session_on_its_replica(cluster: Running) -> None:
    for i in range(3):
        s = Turns(f"hash-{i}")
        s.first(cluster.url)
        home = owner(cluster, s.sid)
        status, out = s.next(cluster.url)
        assert status == 200, out
        assert cached(out) >= s.history - BLOCK, (s.sid, s.history, out["usage"])
        assert owner(cluster, s.sid) == home  # the next turn came to the same replica


def start_router(spec: RouterSpec, log: Path) -> Child:
    """One more router over the cluster's replicas, the cluster's own flags but ``spec``'s
    policy; it routes when this returns."""
    router = Child(spec.command(), log, os.environ.copy())
    if not wait_routing(spec, lambda: router.poll() is None, CALL_S):
        router.signal(signal.SIGKILL)
        pytest.fail(f"the {spec.policy} router did not route:\n{router.output()}")
    return router


@pytest.mark.engine
def test_round_robin_loses_history_that_consistent_hash_keeps(cluster: Running) -> None:
    workers = tuple(url for url, _ in cluster.replicas.values())
    total: dict[str, int] = {}
    for policy in ("round_robin", "consistent_hash"):
        spec = RouterSpec(free_port(), workers, metrics_port=free_port(), policy=policy)
        log = temp_log()
        router = start_router(spec, log)
        try:
            total[policy] = 0
            for i in range(4):
                s = Turns(f"{policy}-{i}")
                s.first(spec.url)
                status, out = s.next(spec.url)
                assert status == 200, out
                total[policy] += cached(out)
        finally:
            router.signal(signal.SIGTERM)
            router.wait(60)
            log.unlink()
    assert total["consistent_hash"] > total["round_robin"], total


@pytest.mark.engine
def test_session_posts_reach_the_owner_by_the_header(cluster: Running) -> None:
    """POST .../intent and .../retention through the router, with X-Session-ID: they reach
    the replica that holds the session (any other one answers 404: it does not know it)."""
    for i in range(3):
        s = Turns(f"api-{i}")
        s.first(cluster.url)
        base = f"{cluster.url}/v1/sessions/{s.sid}"
        status, out = http("POST", base + "/intent", {"expected_tool_s": 2.0}, s.sid)
        assert status == 202 and out["session_id"] == s.sid, out
        status, out = http("POST", base + "/retention", {"mode": "preference"}, s.sid)
        assert status == 202, out


@pytest.mark.engine
def test_metrics_carry_the_replica_label(cluster: Running) -> None:
    for name, (url, _) in cluster.replicas.items():
        status, text = http("GET", url + "/metrics")
        assert status == 200
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        assert samples and all(s.labels.get("replica") == name for s in samples), name


class Blocker(threading.Thread):
    """A long stream sent straight to one replica: it holds that replica's only slot."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        long = {"max_tokens": 3000, "min_tokens": 3000, "ignore_eos": True, "stream": True}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "count"}], **long}
        self.req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode())
        self.req.add_header("Content-Type", "application/json")
        self.running = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        with urllib.request.urlopen(self.req, timeout=CALL_S) as r:
            for line in r:
                if line.startswith(b"data: "):
                    self.running.set()
                if self.stop.is_set():
                    return  # closing the connection: the replica aborts the request


@pytest.mark.engine
def test_a_replica_429_does_not_move_the_session(cluster: Running) -> None:
    s = Turns("busy")
    s.first(cluster.url)
    home = owner(cluster, s.sid)
    other = next(n for n in cluster.replicas if n != home)
    home_url, other_url = cluster.replicas[home][0], cluster.replicas[other][0]
    before = {n: counters(url) for n, (url, _) in cluster.replicas.items()}
    blocker = Blocker(home_url)
    blocker.start()
    try:
        assert blocker.running.wait(CALL_S), "the blocking stream never started"
        # More than the router's circuit-breaker threshold (10 failures) by default.
        refused = [s.next(cluster.url) for _ in range(12)]
    finally:
        blocker.stop.set()
        blocker.join(CALL_S)
    assert [status for status, _ in refused] == [429] * 12, refused
    assert refused[0][1]["error"]["code"] == "rate_limit_exceeded"
    deadline = time.monotonic() + CALL_S  # hang guard: the aborted stream frees the slot
    while http("GET", home_url + "/health")[1].get("in_flight") and time.monotonic() < deadline:
        time.sleep(0.2)
    status, out = s.next(cluster.url)  # the client's own retry, once the replica has room
    assert status == 200, out
    assert cached(out) >= s.history - BLOCK  # served where its history is
    after = {n: counters(url) for n, (url, _) in cluster.replicas.items()}
    rejected = "ladsd_requests_rejected_total"
    assert after[home][rejected] - before[home][rejected] == 12  # one try each: no retries
    assert after[other]["ladsd_requests_total"] == before[other]["ladsd_requests_total"]
    assert http("GET", f"{other_url}/v1/sessions/{s.sid}")[0] == 404  # never moved


@pytest.mark.engine
def test_a_killed_replica_is_taken_out_and_its_sessions_recompute(cluster: Running) -> None:
    sessions: list[Turns] = []
    homes: dict[str, str] = {}
    for i in range(12):  # until both replicas hold a session (bounded)
        s = Turns(f"kill-{i}")
        s.first(cluster.url)
        sessions.append(s)
        homes[s.sid] = owner(cluster, s.sid)
        if len(set(homes.values())) == 2:
            break
    assert len(set(homes.values())) == 2, homes
    victim = homes[sessions[0].sid]
    survivor = next(n for n in cluster.replicas if n != victim)
    os.kill(cluster.replicas[victim][1], signal.SIGKILL)
    cluster.killed.add(victim)
    # A turn sent at once, before the cluster may have noticed, ends too (any status).
    early, _ = sessions[0].next(cluster.url)
    assert early in (0, 200, 500, 502, 503, 504), early
    said = cluster.until_printed(rf"replica {victim} \(pid \d+\) exited -?\d+: [^;]*;")
    assert "taken out of the router (2" in said[0], cluster.output()  # a 2xx, confirmed
    for s in sessions:
        status, out = s.next(cluster.url)
        assert status == 200, (s.sid, out)
        assert owner(cluster, s.sid) == survivor
        if s is sessions[0] and early == 200:
            continue  # the early turn already put its history on the survivor
        if homes[s.sid] == victim:
            assert cached(out) < s.history - BLOCK  # recomputed on the survivor
        else:
            assert cached(out) >= s.history - BLOCK  # consistent hashing left it in place
