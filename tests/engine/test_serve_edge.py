"""``ladsd serve``'s HTTP edge: who owns a session, what a browser may do, bad headers and
query values, clients that go away, and connection limits.

Most tests serve the Daemon's app without an engine, behind the daemon's own runner and
capped site (``make_runner``, ``CappedSite``) on an ephemeral loopback port: what they test
(middlewares, the session table, the event hub, the server's limits) has no engine. Two
tests need one (a chat turn creates a session; a drain finishes a request): the in-process
Daemon on the tiny dummy-weight model.

Every wait has a generous hang guard; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from ladsd import clock
from ladsd.config import PROFILES
from ladsd.serve import agents
from ladsd.serve.agent_run import DEFAULT_AGENT
from ladsd.serve.app import LOCAL, CappedSite, Limits, key_table, make_runner, read_key_file
from ladsd.serve.daemon import Daemon, ServeConfig
from ladsd.serve.errors import ApiError
from ladsd.serve.events import EventHub
from ladsd.serve.protocol import parse_intent
from ladsd.serve.sessions import LeaseView, SessionTable
from tests.helpers import FORCE, free_port, running, weather_tool

GUARD_S = 30.0  # hang guard of one network wait (never a speed assertion)
ENGINE_GUARD_S = 300.0
KEYS = (("alice", "key-a"), ("bob", "key-b"))
ALICE = {"Authorization": "Bearer key-a"}
BOB = {"Authorization": "Bearer key-b"}
JSON = {"Content-Type": "application/json"}


@asynccontextmanager
async def serving(
    cfg: ServeConfig | None = None,
    *,
    cancel: bool = True,
    routes: tuple[tuple[str, str, Any], ...] = (),
) -> AsyncIterator[tuple[Daemon, int, web.AppRunner]]:
    """A Daemon's app without an engine, behind the daemon's runner and capped site.

    ``cancel=False``: a plain aiohttp runner instead (no handler cancellation, aiohttp's
    default), as an app embedded elsewhere would run.
    """
    d = Daemon(PROFILES["smoke"], "lads", cfg or ServeConfig())
    for method, path, handler in routes:
        d.app.router.add_route(method, path, handler)
    runner = make_runner(d.app, 5.0) if cancel else web.AppRunner(d.app, access_log=None)
    await runner.setup()
    site = CappedSite(runner, "127.0.0.1", 0, d.cfg.limits.max_connections)
    await site.start()
    try:
        yield d, site.port, runner
    finally:
        await runner.cleanup()
        if d.catalog is not None:
            d.catalog.close()


async def call(
    port: int, method: str, path: str, headers: dict[str, str] | None = None, **kw: Any
) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=GUARD_S)) as s:
        async with s.request(method, f"http://127.0.0.1:{port}{path}", headers=headers, **kw) as r:
            text = await r.text()
    try:
        return r.status, json.loads(text)
    except json.JSONDecodeError:
        return r.status, text


async def raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection; everything the server sends until it closes."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        await w.drain()
        return await asyncio.wait_for(r.read(), GUARD_S)
    finally:
        w.close()


def get(path: str, port: int, *headers: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", *headers, "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def fake_run(d: Daemon, tenant: str = LOCAL, events: int = 0) -> agents.AgentRun:
    """An agent run in the daemon's table (no engine: its events are the test's)."""
    runs = d.app[agents.AGENTS]
    task = next(iter(runs.tasks.values()))
    run = agents.AgentRun(
        f"agent-9-{tenant}", task, DEFAULT_AGENT, time.time(), clock.now(), "running"
    )
    run.tenant = tenant
    for i in range(events):
        run.emit("step", {"i": i})
    runs.runs[run.id] = run
    return run


async def until(cond: Any, what: str, poke: Any = None) -> None:
    """Wait (bounded) until ``cond()``; ``poke()`` each round."""
    for _ in range(int(GUARD_S / 0.05)):
        if cond():
            return
        if poke is not None:
            poke()
        await asyncio.sleep(0.05)
    pytest.fail(f"not within the guard: {what}")


# ---- defect 3: sessions belong to the tenant whose key created them ------------------------


def test_keys_map_to_tenants_and_key_files_parse(tmp_path):
    assert key_table("k0", KEYS) == {"k0": "default", "key-a": "alice", "key-b": "bob"}
    f = tmp_path / "keys"
    f.write_text("# tenant key\nalice key-a\n\nbob key-b  # rotated monthly\nbob key-b2\n")
    assert read_key_file(f) == (("alice", "key-a"), ("bob", "key-b"), ("bob", "key-b2"))
    for bad in ("alice", "a/b k", "local k", "a k1\nb k1", "a k é"):
        f.write_text(bad)
        with pytest.raises(ValueError):
            read_key_file(f)


async def test_another_tenants_session_is_a_404_and_never_listed():
    async with serving(ServeConfig(keys=KEYS)) as (d, port, _):
        mine = d.sessions.open("s1", "alice")
        mine.turn = 1
        assert (await call(port, "GET", "/v1/sessions", BOB))[1]["data"] == []
        listed = (await call(port, "GET", "/v1/sessions", ALICE))[1]["data"]
        assert [s["id"] for s in listed] == ["s1"]
        intent = {"tool": "get_weather", "expected_tool_s": 2}
        for method, path, body in [
            ("GET", "/v1/sessions/s1", None),
            ("DELETE", "/v1/sessions/s1", None),
            ("POST", "/v1/sessions/s1/intent", intent),
            ("POST", "/v1/sessions/s1/retention", {"mode": "release"}),
        ]:
            status, out = await call(port, method, path, BOB, json=body)
            assert status == 404 and out["error"]["code"] == "session_not_found", (method, path)
        assert d.sessions.get("s1", "alice") is mine and not mine.harness.intents  # untouched
        status, _ = await call(port, "POST", "/v1/sessions/s1/intent", ALICE, json=intent)
        assert status == 202 and "get_weather" in mine.harness.intents
        status, out = await call(port, "DELETE", "/v1/sessions/s1", ALICE)
        assert status == 200 and out["deleted"] and len(d.sessions) == 0


async def test_an_intent_never_creates_a_session():
    async with serving() as (d, port, _):
        body = {"tool": "search", "expected_tool_s": 1}
        status, out = await call(port, "POST", "/v1/sessions/new/intent", json=body)
        assert status == 404 and out["error"]["code"] == "session_not_found"
        assert len(d.sessions) == 0


def test_each_tenant_evicts_only_its_own_sessions():
    released: list[str] = []
    t = SessionTable(4, 60.0, lambda s: released.append(s.workflow), tenants=2)
    assert t.per_tenant == 2
    t.open("a1", "alice"), t.open("a2", "alice")
    for i in range(5):  # bob floods: only bob's own idle sessions go
        t.open(f"b{i}", "bob")
    assert [s.id for s in t.of("alice")] == ["a1", "a2"]
    assert [s.id for s in t.of("bob")] == ["b3", "b4"]
    assert released == ["bob/b0", "bob/b1", "bob/b2"]
    assert {s.ended_by for s in t} == {None}
    for s in t.of("bob"):
        s.busy = True
    with pytest.raises(ApiError) as e:  # bob's are all busy: refused, alice's stay
        t.open("b9", "bob")
    assert e.value.status == 429 and len(t.of("alice")) == 2


def test_session_workflows_are_per_tenant_and_never_an_agent_runs():
    t = SessionTable(8, 60.0, lambda s: None, tenants=2)
    run_id = "agent-1-0a1b2c3d"  # the shape of an agent run's id (no "/")
    a, b = t.open(run_id, "alice"), t.open(run_id, "bob")
    assert a is not b and a.id == b.id == run_id
    assert {a.cid(1).workflow, b.cid(1).workflow} == {f"alice/{run_id}", f"bob/{run_id}"}
    assert t.owner(a.cid(1)) is a and t.owner(b.cid(1)) is b
    runs = agents.AgentRuns(SimpleNamespace(draining=False, events=EventHub()))
    runs._drive = lambda run: asyncio.sleep(0)  # type: ignore[method-assign,assignment]

    async def started() -> str:
        req = agents.parse_run({"task_id": next(iter(runs.tasks))}, runs.tasks, None)  # type: ignore[arg-type]
        return runs.start(req, "alice").id

    assert "/" not in asyncio.run(started())


def test_events_belong_to_their_tenant():
    hub = EventHub()
    hub.publish("completion", "s1", tenant="alice", n=1)
    hub.publish("completion", "s1", tenant="bob", n=2)
    assert [e["n"] for e in hub.join("s1", 10, "bob").queue] == [2]
    assert [e["n"] for e in hub.join(None, 10, "alice").queue] == [1]
    assert len(hub.join(None, 10, None).queue) == 2  # the daemon's own readers see all


async def test_event_streams_and_agent_runs_are_per_tenant():
    async with serving(ServeConfig(keys=KEYS)) as (d, port, _):
        d.events.publish("completion", "s1", tenant="alice", secret="alice's")
        run = fake_run(d, "alice")
        status, out = await call(port, "GET", f"/v1/agent/runs/{run.id}", BOB)
        assert status == 404 and out["error"]["code"] == "run_not_found"
        assert (await call(port, "GET", "/v1/agent/runs", BOB))[1]["data"] == []
        assert (await call(port, "GET", f"/v1/agent/runs/{run.id}", ALICE))[0] == 200
        url = f"http://127.0.0.1:{port}/v1/events?backlog=100"
        async with aiohttp.ClientSession() as s, s.get(url, headers=BOB) as r:
            assert r.status == 200
            await until(lambda: d.events.subscribers == 1, "bob subscribed")
            d.events.publish("marker", None, tenant="bob")
            seen = []
            async with asyncio.timeout(GUARD_S):
                async for line in r.content:
                    if line.startswith(b"data: "):
                        seen.append(json.loads(line[6:]))
                        if seen[-1]["type"] == "marker":
                            break
        assert [e["type"] for e in seen] == ["marker"] and "tenant" not in seen[0]


# ---- item 12: what counts as a completed workflow for HEAR ----------------------------------


async def test_only_sessions_ended_by_the_client_after_an_answer_are_completed_workflows():
    async with serving(ServeConfig(max_sessions=2)) as (d, port, _):
        done: list[tuple[str, int]] = []
        d.rt = SimpleNamespace(end_workflow=lambda w, n: done.append((w, n)))  # type: ignore[assignment]

        def session(sid: str, turns: int, tool_wait: bool = False) -> None:
            s = d.sessions.open(sid)
            s.turn = turns
            if tool_wait:  # its last reply called a tool: the history waits for the result
                s.wait.lease = LeaseView(s.cid(turns))

        session("answered", 2)
        assert (await call(port, "DELETE", "/v1/sessions/answered"))[0] == 200
        session("calling", 3, tool_wait=True)  # the client gave up on a tool wait
        assert (await call(port, "DELETE", "/v1/sessions/calling"))[0] == 200
        session("dropped", 2)  # its client went away mid-request and never retried
        d.sessions.get("dropped").abandoned = True  # type: ignore[union-attr]
        d.sessions.get("dropped").last_used -= 3600  # type: ignore[union-attr]
        assert d.sessions.expire() == ["dropped"]
        session("old", 1)
        session("evicted", 4)
        session("newer", 1)  # the table holds 2: the least recently used ("old") is evicted
        d.sessions.get("evicted").last_used -= 3600  # type: ignore[union-attr]
        assert d.sessions.expire() == ["evicted"]  # idle past the TTL after an answer
        session("cut", 5)
        d.draining = True
        d.sessions.end_all()
    assert done == [("local/answered", 2), ("local/evicted", 4)]


# ---- defect 4: browsers ------------------------------------------------------------------


async def test_post_bodies_must_be_application_json():
    async with serving() as (d, port, _):
        path = "/v1/sessions/x/intent"
        body = b'{"tool": "search", "expected_tool_s": 1}'
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            status, out = await call(port, "POST", path, {"Content-Type": ctype}, data=body)
            assert status == 415 and out["error"]["code"] == "unsupported_media_type", ctype
        status, _ = await call(port, "POST", path, data=body)  # no Content-Type at all
        assert status == 415
        charset = {"Content-Type": "application/json; charset=utf-8"}
        assert (await call(port, "POST", path, charset, data=body))[0] == 404  # past the check


async def test_foreign_host_or_origin_is_refused_on_loopback():
    async with serving() as (d, port, _):
        for host in (f"evil.example:{port}", "rebind.example", "a b", "127.0.0.1:x"):
            status, out = await call(port, "GET", "/v1/sessions", {"Host": host})
            assert status == 403 and out["error"]["code"] == "foreign_host", host
        # a forwarded port (ssh -L 9000:127.0.0.1:<port>) sends its own port in Host
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost:9000"):
            assert (await call(port, "GET", "/v1/sessions", {"Host": host}))[0] == 200, host
        for origin in ("http://evil.example", "null", f"http://localhost:{port + 1}", "file://"):
            status, out = await call(port, "GET", "/v1/events", {"Origin": origin})
            assert status == 403 and out["error"]["code"] == "foreign_origin", origin
        ok = {"Origin": f"http://localhost:{port}"}
        assert (await call(port, "GET", "/v1/sessions", ok))[0] == 200
        # OpenAI's own client and curl-like clients send neither a foreign Host nor Origin.
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        )
        async with client:
            assert [m.id async for m in client.models.list()] == ["tiny"]
        assert status_of(await raw(port, get("/v1/models", port))) == 200
    # Off loopback the key guards everything; Host is whatever name the server has there.
    async with serving(ServeConfig(host="0.0.0.0", api_key="k")) as (d, port, _):
        headers = {"Host": "ladsd.internal:8731", "Authorization": "Bearer k"}
        assert (await call(port, "GET", "/v1/sessions", headers))[0] == 200


# ---- defect 7 and OpenAI compat: bad headers and values are 4xx, never a 500 -----------------


async def test_the_bearer_scheme_is_case_insensitive_and_odd_headers_are_401():
    async with serving(ServeConfig(keys=KEYS)) as (d, port, _):
        for value in ("bearer key-a", "BEARER key-a", "Bearer  key-a "):
            assert (await call(port, "GET", "/v1/models", {"Authorization": value}))[0] == 200
        for value in ("Basic key-a", "Bearer", "key-a", "Bearer key-a-x"):
            assert (await call(port, "GET", "/v1/models", {"Authorization": value}))[0] == 401
        for value in ("Bearer ²".encode(), b"Bearer \xff\xfe", "Bearer ké".encode("latin-1")):
            head = get("/v1/models", port).replace(b"\r\n\r\n", b"\r\n")
            out = await raw(port, head + b"Authorization: " + value + b"\r\n\r\n")
            assert status_of(out) == 401 and b"invalid_api_key" in out, value


async def test_bad_backlog_and_last_event_id_are_400_before_any_stream():
    async with serving() as (d, port, _):
        for backlog in ("²", "1" * 5000, "-1", "1e3", "٣"):
            status, out = await call(port, "GET", "/v1/events", params={"backlog": backlog})
            assert status == 400 and out["error"]["param"] == "backlog", backlog
        run = fake_run(d)
        path = f"/v1/agent/runs/{run.id}/events"
        for last in ("²", "9" * 5000, "x"):
            status, out = await call(port, "GET", path, {"Last-Event-ID": last})
            assert status == 400 and out["error"]["param"] == "Last-Event-ID", last
        # A backlog beyond what the hub keeps is what it keeps: the stream opens.
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/v1/events?backlog=999999999") as r:
                assert r.status == 200


async def test_a_500_says_internal_error_with_an_id_not_the_exception(caplog):
    async def boom(_: web.Request) -> web.Response:
        raise RuntimeError("secret-detail-xyz")

    async with serving(routes=(("GET", "/boom", boom),)) as (d, port, _):
        status, out = await call(port, "GET", "/boom")
    msg = out["error"]["message"]
    assert status == 500 and out["error"]["type"] == "server_error"
    assert "secret-detail-xyz" not in msg and "RuntimeError" not in msg
    ref = msg.split("id ")[1].split(",")[0]
    logged = [r for r in caplog.records if ref in r.getMessage()]
    assert logged and "secret-detail-xyz" in str(logged[0].exc_info[1])


# ---- defect 8: a client that goes away is normal ------------------------------------------


@pytest.mark.parametrize("cancel", [True, False], ids=["daemon-runner", "plain-runner"])
@pytest.mark.parametrize("endpoint", ["agent-run", "events"])
async def test_a_reader_that_goes_away_leaves_no_traceback(caplog, cancel, endpoint):
    caplog.set_level(logging.DEBUG, logger="ladsd.serve")
    async with serving(cancel=cancel) as (d, port, runner):
        run = fake_run(d, events=3)
        d.events.publish("completion", "s")
        path = f"/v1/agent/runs/{run.id}/events" if endpoint == "agent-run" else "/v1/events"
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(get(path, port).replace(b"Connection: close", b"X-Stay: 1"))
        await w.drain()
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), GUARD_S)
        assert status_of(head) == 200
        w.close()  # gone mid-stream; the next events are written to a closed connection

        def more() -> None:
            run.emit("step", {"pad": "x" * 1000})
            d.events.publish("completion", "s", tenant=LOCAL, pad="y" * 1000)

        assert runner.server is not None
        await until(lambda: not runner.server.connections, "the stream ended", more)  # type: ignore[union-attr]
    tracebacks = [r for r in caplog.records if r.exc_info and r.levelno >= logging.WARNING]
    assert tracebacks == [], [r.getMessage() for r in tracebacks]


# ---- defect 9: connection limits --------------------------------------------------------


async def test_an_idle_keepalive_connection_is_closed_by_the_server():
    async with serving(ServeConfig(limits=Limits(keepalive_s=1.0))) as (d, port, _):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(get("/v1/models", port).replace(b"Connection: close", b"Connection: keep-alive"))
        await w.drain()
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), GUARD_S)
        assert status_of(head) == 200
        await asyncio.wait_for(r.read(), GUARD_S)  # returns at EOF: the server closed it
        assert r.at_eof()
        w.close()


async def test_a_request_head_sent_byte_by_byte_is_cut():
    async with serving(ServeConfig(limits=Limits(keepalive_s=1.0))) as (d, port, _):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: ".encode())
        cut = False
        for _ in range(int(GUARD_S / 0.05)):  # a byte every 50 ms, the head never ends
            try:
                w.write(b"a")
                await w.drain()
                cut = await asyncio.wait_for(r.read(1), 0.05) == b""
            except TimeoutError:
                continue
            except ConnectionError:
                cut = True
            if cut:
                break
        w.close()
        assert cut, "the server kept a request head open that never ended"


async def test_a_body_that_does_not_arrive_is_408():
    async with serving(ServeConfig(limits=Limits(body_timeout_s=1.0))) as (d, port, _):
        head = (
            f"POST /v1/sessions/x/intent HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(head.encode() + b'{"tool":')  # and nothing more
        out = await asyncio.wait_for(r.readuntil(b"}}"), GUARD_S)  # the error body's end
        w.close()
        assert status_of(out) == 408 and b"request_timeout" in out


async def test_connections_past_the_cap_are_refused_with_503():
    async with serving(ServeConfig(limits=Limits(max_connections=3))) as (d, port, runner):
        held = []
        for _ in range(3):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(get("/v1/models", port).replace(b"Connection: close", b"X-Keep: 1"))
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), GUARD_S)
            assert status_of(head) == 200
            held.append(w)
        out = await raw(port, get("/v1/models", port))
        assert status_of(out) == 503 and b"too_many_connections" in out
        held.pop().close()
        assert runner.server is not None
        await until(lambda: len(runner.server.connections) < 3, "a slot came back")  # type: ignore[union-attr]
        assert status_of(await raw(port, get("/v1/models", port))) == 200
        for w in held:
            w.close()


async def test_event_streams_past_the_cap_get_429():
    async with serving(ServeConfig(limits=Limits(max_event_streams=2))) as (d, port, _):
        url = f"http://127.0.0.1:{port}/v1/events"
        async with aiohttp.ClientSession() as s:
            first, second = await s.get(url), await s.get(url)
            assert first.status == second.status == 200
            async with s.get(url) as r:
                assert r.status == 429 and r.headers["Retry-After"]
                assert (await r.json())["error"]["code"] == "too_many_event_streams"
            first.close()
            await until(lambda: d.events.subscribers < 2, "the closed stream left")
            async with s.get(url) as r:
                assert r.status == 200
            second.close()


async def test_an_event_reader_that_stops_reading_loses_its_stream():
    """A subscriber that reads nothing must not hold its slot (and a blocked write) forever."""
    async with serving(ServeConfig(write_timeout_s=0.5)) as (d, port, _):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few events
        s.settimeout(GUARD_S)
        s.connect(("127.0.0.1", port))
        s.sendall(f"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        try:
            await until(lambda: d.events.subscribers == 1, "the reader subscribed")
            big = "x" * 65536
            await until(
                lambda: d.events.subscribers == 0,
                "the stalled reader dropped",
                poke=lambda: d.events.publish("completion", None, tenant=LOCAL, note=big),
            )
        finally:
            s.close()


async def test_one_tenant_cannot_take_every_event_stream():
    cfg = ServeConfig(keys=KEYS, limits=Limits(max_event_streams=2))  # a share of 1 each
    async with serving(cfg) as (d, port, _):
        url = f"http://127.0.0.1:{port}/v1/events"
        async with aiohttp.ClientSession() as s:
            first = await s.get(url, headers=ALICE)
            assert first.status == 200
            async with s.get(url, headers=ALICE) as r:
                assert r.status == 429 and "share" in (await r.json())["error"]["message"]
            bobs = await s.get(url, headers=BOB)
            assert bobs.status == 200  # alice's streams left bob his share
            first.close()
            bobs.close()


# ---- item 12: intents name a tool --------------------------------------------------------


def test_an_intents_tool_follows_the_tool_name_rule():
    assert parse_intent({"tool": "get_weather", "expected_tool_s": 1}).tool == "get_weather"
    assert parse_intent({"tool": "*", "expected_tool_s": 1}).tool == "*"
    assert parse_intent({"expected_tool_s": 1}).tool == "*"
    for tool in ("bad name", "x" * 65, "a/b", "", "ü"):
        with pytest.raises(ApiError) as e:
            parse_intent({"tool": tool, "expected_tool_s": 1})
        assert e.value.status == 400 and e.value.param == "tool", tool


# ---- on the engine: chat sessions per tenant; events after the drain ------------------------


@asynccontextmanager
async def daemon(cfg: ServeConfig) -> AsyncIterator[Daemon]:
    async with running(Daemon(PROFILES["smoke"], "lads", cfg), ENGINE_GUARD_S) as d:
        yield d


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "weather?"}]} | kw  # fmt: skip


@pytest.mark.engine
async def test_the_same_session_id_in_two_tenants_is_two_sessions(model_ready):
    async with daemon(ServeConfig(port=free_port(), keys=KEYS)) as d:
        port = d.cfg.port
        url = "/v1/chat/completions"
        tools = {"tools": [weather_tool(max_len=8)], "tool_choice": FORCE}
        status, out = await call(port, "POST", url, ALICE | {"x-session-id": "s1"},
                                 json=chat_body(max_tokens=40, **tools))  # fmt: skip
        assert status == 200 and out["choices"][0]["finish_reason"] == "tool_calls"
        status, _ = await call(port, "POST", url, BOB | {"x-session-id": "s1"}, json=chat_body())
        assert status == 200
        a = (await call(port, "GET", "/v1/sessions/s1", ALICE))[1]
        b = (await call(port, "GET", "/v1/sessions/s1", BOB))[1]
        # Bob's turn neither bound nor cancelled Alice's waiting history.
        assert a["turn"] == b["turn"] == 1 and a["version"] != b["version"]
        assert a["waiting_for_tool"] and not b["waiting_for_tool"]
        assert a["lease"]["status"] != "cancelled"
        assert {s.workflow for s in d.sessions} == {"alice/s1", "bob/s1"}
        assert [s["id"] for s in (await call(port, "GET", "/v1/sessions", BOB))[1]["data"]] == [
            "s1"
        ]


@pytest.mark.engine
async def test_event_streams_carry_the_drains_completions(model_ready):
    cfg = ServeConfig(port=free_port(), drain_s=ENGINE_GUARD_S)
    async with daemon(cfg) as d:
        base = f"http://127.0.0.1:{cfg.port}"
        long = chat_body(max_tokens=400, min_tokens=400, ignore_eos=True)
        seen: list[dict[str, Any]] = []
        async with aiohttp.ClientSession() as s:
            events = await s.get(f"{base}/v1/events")
            assert events.status == 200
            work = asyncio.create_task(
                s.post(f"{base}/v1/chat/completions", json=long, headers={"x-session-id": "d"})
            )
            await until(lambda: d.in_flight == 1, "the request runs")
            d.stop()  # the drain lets it finish; the event stream must see its completion
            async with asyncio.timeout(ENGINE_GUARD_S):
                async for line in events.content:  # to the end of the stream
                    if line.startswith(b"data: "):
                        seen.append(json.loads(line[6:]))
                resp = await work
                assert resp.status == 200
                resp.close()
    kinds = [(e["type"], e["session_id"]) for e in seen]
    assert ("completion", "d") in kinds
