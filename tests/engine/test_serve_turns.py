"""A chat turn's life on the daemon in process (tiny dummy-weight engine, smoke profile):
clients that stop reading, disconnects and retries, DELETE while a request runs,
tokenising off the event loop, and the shutdown's cancellations.

The daemon: m = 2 running, no waiting room (2 admission slots), a write timeout of
1 s, a drain of 1 s. Every wait has a generous guard (hang guards, no timing
assertions); traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from ladsd.config import PROFILES
from ladsd.engine.client import END as _END
from ladsd.engine.client import StreamQueue
from ladsd.engine.outbound import Done as _Done
from ladsd.engine.params import sampling
from ladsd.serve import completions
from ladsd.serve.daemon import Daemon, ServeConfig
from tests.helpers import FORCE, Api, free_port, weather_tool

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]
GUARD_S = 240  # hang guard only: this machine is shared and may be slow
WEATHER = weather_tool(max_len=8)
BLOCK = 32
# A stream long enough to fill a small socket's buffers many times over (~170 bytes a token).
LONG = {"max_tokens": 3000, "min_tokens": 3000, "ignore_eos": True, "stream": True}


@dataclass
class Served:
    d: Daemon
    task: asyncio.Task


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(model_ready) -> AsyncIterator[Served]:
    prof = PROFILES["smoke"]
    prof = replace(
        prof,
        engine=replace(prof.engine, max_num_seqs=2, num_gpu_blocks_override=320),
        lease=replace(prof.lease, lease_lifetime_s=120.0),
    )
    cfg = ServeConfig(port=free_port(), max_waiting=0, write_timeout_s=1.0, drain_s=1.0)
    d = Daemon(prof, "lads", cfg)
    up = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(d.run(up.set_result))
    await asyncio.wait_for(up, GUARD_S)
    yield Served(d, task)
    d.stop()
    audit = await asyncio.wait_for(task, GUARD_S)
    assert audit["refs_added"] == audit["refs_released"]


@pytest.fixture
def daemon(served: Served) -> Daemon:
    return served.d


@pytest_asyncio.fixture(loop_scope="module")
async def api(daemon: Daemon) -> AsyncIterator[Api]:
    async with aiohttp.ClientSession() as http:
        yield Api(f"http://127.0.0.1:{daemon.cfg.port}", http)


async def until(what: str, check: Callable[[], bool]) -> None:
    """Poll ``check`` until it holds (a hang guard, not a timing assertion)."""

    async def poll() -> None:
        while not check():
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(poll(), GUARD_S)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


def events(d: Daemon, kind: str, **match: Any) -> list[dict[str, Any]]:
    return [
        e
        for e in d.events.backlog
        if e["type"] == kind and all(e.get(k) == v for k, v in match.items())
    ]


def stalled_stream(port: int, body: dict[str, Any]) -> socket.socket:
    """Send a chat request from a client that never reads its answer.

    A small receive window and small segments keep the daemon's socket buffers
    small (loopback's 64 KiB segments would let its send buffer grow to MiBs),
    so its writes stall after a few hundred chunks.
    """
    go = [{"role": "user", "content": "go"}]
    raw = json.dumps({"model": "tiny", "temperature": 0, "messages": go, **body}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 256)
    s.settimeout(GUARD_S)
    s.connect(("127.0.0.1", port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    s.sendall(head.encode() + raw)
    return s


def watch(caplog: pytest.LogCaptureFixture) -> None:
    for name in ("aiohttp", "ladsd"):
        caplog.set_level(logging.DEBUG, logger=name)


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Records of the server's loggers that carry a traceback (a disconnect logs none)."""
    ours = ("aiohttp", "ladsd")
    return [r.getMessage() for r in caplog.records if r.exc_info and r.name.startswith(ours)]


def spy_text(d: Daemon, monkeypatch: pytest.MonkeyPatch, hook: Callable[[], None] = lambda: None):
    """Record (on which thread) every tokenisation of the daemon's renderer."""
    assert d.renderer is not None
    ml, orig = d.renderer.ml, d.renderer.ml.text
    calls: list[threading.Thread] = []

    def text(s: str) -> list[int]:
        calls.append(threading.current_thread())
        hook()
        return orig(s)

    monkeypatch.setattr(ml, "text", text)
    return calls


# ---- bounded stream queues -------------------------------------------------------------


async def test_stream_queue_keeps_the_newest_output_and_the_end():
    q = StreamQueue()
    for i in range(1000):
        q.put(i)
    assert len(q) == 1 and q.replaced == 999
    done = _Done(rid="r", out=1000, stamps=None)  # type: ignore[arg-type]
    q.put(done)
    q.put(1001)  # after the end: dropped
    q.put(RuntimeError("late"))
    assert len(q) == 2
    assert await q.get() == 999 and await q.get() is done
    q = StreamQueue()
    q.put(1)
    q.put(_END)
    assert await q.get() == 1 and await q.get() is _END
    err = StreamQueue()
    err.put(RuntimeError("boom"))
    assert isinstance(await err.get(), RuntimeError)


async def test_an_unread_request_keeps_two_items_and_loses_nothing(daemon: Daemon):
    eng = daemon.live_engine()
    rid = eng.submit(list(range(100, 140)), sampling(max_tokens=64, min_tokens=64, ignore_eos=True))

    async def finished() -> None:
        while (await eng.sizes())["requests"]:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(finished(), GUARD_S)  # the engine is done; nobody read a thing
    sizes = await eng.sizes()
    assert sizes["streams"] == 1 and sizes["stream_items"] == 2
    outs = [out async for out in eng.stream(rid)]
    assert len(outs) == 2 and len(outs[-1].outputs[0].token_ids) == 64  # the last is whole
    assert outs[-1].finished
    assert (await eng.sizes())["streams"] == 0


# ---- defect 1: a client that stops reading --------------------------------------------


async def test_a_client_that_stops_reading_gives_its_slot_back(
    api: Api, daemon: Daemon, caplog: pytest.LogCaptureFixture
):
    watch(caplog)
    n = daemon.admit_limit
    before = daemon.stats["disconnected"]
    socks = [stalled_stream(daemon.cfg.port, LONG) for _ in range(n)]
    try:
        await until("write timeouts", lambda: len(events(daemon, "disconnect",
                                                         reason="write_timeout")) >= n)  # fmt: skip
        await until("the slots back", lambda: daemon.in_flight == 0)
        status, health = await api.call("GET", "/health")
        assert status == 200 and health["in_flight"] == 0
        assert (await api.chat())[0] == 200  # admitted again
    finally:
        for s in socks:
            s.close()
    assert daemon.stats["disconnected"] - before == n
    sizes = await daemon.live_engine().sizes()
    assert (sizes["streams"], sizes["stream_items"], sizes["requests"]) == (0, 0, 0)
    assert not tracebacks(caplog)


# ---- defect 6: tokenising off the loop, the cheap length check first -------------------


async def test_a_huge_prompt_is_refused_before_it_is_tokenised(
    api: Api, daemon: Daemon, monkeypatch: pytest.MonkeyPatch
):
    calls = spy_text(daemon, monkeypatch)
    huge = "word " * 600_000  # 3 MB
    status, out = await api.chat("huge", messages=[{"role": "user", "content": huge}])
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert calls == []  # refused by the bound alone
    assert daemon.sessions.get("huge") is None
    assert (await api.chat())[0] == 200 and calls  # (the spy sees a request that fits)


async def test_tokenising_runs_off_the_event_loop(
    api: Api, daemon: Daemon, monkeypatch: pytest.MonkeyPatch
):
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:  # the tokenizer is busy until the test has its answers
        if not entered.is_set():
            entered.set()
            release.wait(GUARD_S / 4)

    calls = spy_text(daemon, monkeypatch, hold)
    order: list[str] = []
    task = asyncio.create_task(api.chat(messages=[{"role": "user", "content": "hello there"}]))
    try:
        await until("tokenising", entered.is_set)
        status, health = await api.call("GET", "/health")  # served while tokenising
        assert status == 200 and health["in_flight"] == 1
        status, _ = await api.call("GET", "/v1/sessions")
        assert status == 200
        order.append("served" if not release.is_set() else "late")
    finally:
        release.set()
    status, out = await asyncio.wait_for(task, GUARD_S)
    assert status == 200, out
    assert order == ["served"]
    assert calls and all(t.name.startswith("ladsd-tokenizer") for t in calls)


async def test_the_length_bound_never_exceeds_the_tokens(daemon: Daemon):
    r = daemon.renderer
    assert r is not None and r.k is not None
    for text in ("x" * 5000, "word " * 999, "日本語のテキスト" * 300, "🙂 " * 700, "\n\t  " * 900):
        turns = [("system", "Be brief."), ("user", text)]
        assert r.least(turns) <= len(r.prompt(turns))


# ---- defect 3: sessions only for valid requests ----------------------------------------


async def test_an_invalid_request_leaves_no_session(api: Api, daemon: Daemon):
    status, out = await api.chat("inv", max_tokens=5000)
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    status, out = await api.chat("inv", min_tokens=10, max_tokens=2)  # vLLM's own check
    assert status == 400
    assert daemon.sessions.get("inv") is None
    status, listing = await api.call("GET", "/v1/sessions")
    assert status == 200 and "inv" not in [s["id"] for s in listing["data"]]
    assert (await api.chat("inv"))[0] == 200  # a valid one opens it
    s = daemon.sessions.get("inv")
    assert s is not None and s.turn == 1
    assert (await api.chat("inv", max_tokens=5000))[0] == 400  # and a bad one leaves it be
    assert daemon.sessions.holds(s) and s.turn == 1 and not s.busy
    assert (await api.call("DELETE", "/v1/sessions/inv"))[0] == 200


# ---- defect 5: DELETE while a request runs ---------------------------------------------


async def test_delete_while_a_request_runs_leaves_nothing_announced(
    api: Api, daemon: Daemon, monkeypatch: pytest.MonkeyPatch
):
    eng = daemon.live_engine()
    done, go = asyncio.Event(), asyncio.Event()
    result = eng.result

    async def held(rid: str) -> Any:  # the engine is done; the reply waits for the DELETE
        out = await result(rid)
        done.set()
        await asyncio.wait_for(go.wait(), GUARD_S)
        return out

    monkeypatch.setattr(eng, "result", held)
    msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Paris?"}]
    task = asyncio.create_task(
        api.chat("del", messages=msgs, tools=[WEATHER], tool_choice=FORCE, max_tokens=40)
    )
    try:
        await asyncio.wait_for(done.wait(), GUARD_S)
        assert (await api.call("DELETE", "/v1/sessions/del"))[0] == 200
    finally:
        go.set()
    status, out = await asyncio.wait_for(task, GUARD_S)
    assert status == 200 and out["choices"][0]["finish_reason"] == "tool_calls", out
    assert daemon.sessions.get("del") is None
    sizes = await eng.sizes()  # no candidate, no lease: the tool wait was never announced
    assert sizes["lease_book.pending"] == 0 and sizes["lease_book.leases"] == 0, sizes


async def test_a_disconnect_never_ends_a_newer_session_of_the_same_id(
    api: Api, daemon: Daemon, caplog: pytest.LogCaptureFixture
):
    watch(caplog)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], **LONG}
    async with aiohttp.ClientSession() as other:
        r = await other.post(
            f"{api.base}/v1/chat/completions", json=body, headers={"x-session-id": "reuse"}
        )
        assert r.status == 200
        await asyncio.wait_for(r.content.readline(), GUARD_S)  # it runs
        old = daemon.sessions.get("reuse")
        assert (await api.call("DELETE", "/v1/sessions/reuse"))[0] == 200
        assert (await api.chat("reuse"))[0] == 200  # a new session of the same id
        new = daemon.sessions.get("reuse")
        assert new is not None and new is not old
        r.close()  # the old request's client goes away
    await until("the disconnect", lambda: bool(events(daemon, "disconnect", session_id="reuse")))
    await until("the slot back", lambda: daemon.in_flight == 0)
    assert daemon.sessions.get("reuse") is new
    assert (await api.call("DELETE", "/v1/sessions/reuse"))[0] == 200
    assert not tracebacks(caplog)


# ---- a disconnect keeps the session for a retry -----------------------------------------


async def test_a_retry_after_a_disconnect_binds_the_waiting_history(api: Api, daemon: Daemon):
    msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Oslo?"}]
    status, first = await api.chat(
        "retry", messages=msgs, tools=[WEATHER], tool_choice=FORCE, max_tokens=40
    )
    assert status == 200 and first["choices"][0]["finish_reason"] == "tool_calls", first
    status, view = await api.call("GET", "/v1/sessions/retry")
    history, key = view["history_tokens"], view["lease"]["continuation"]
    msg = first["choices"][0]["message"]
    call = msg["tool_calls"][0]
    nxt = [*msgs, msg, {"role": "tool", "tool_call_id": call["id"], "content": "Sunny"}]
    body = {"model": "tiny", "messages": nxt, "tools": [WEATHER], "tool_choice": "none", **LONG}
    async with aiohttp.ClientSession() as other:
        r = await other.post(
            f"{api.base}/v1/chat/completions", json=body, headers={"x-session-id": "retry"}
        )
        assert r.status == 200
        await asyncio.wait_for(r.content.readline(), GUARD_S)  # it runs, bound to the history
        r.close()  # the client's timeout
    await until("the disconnect", lambda: bool(events(daemon, "disconnect", session_id="retry")))
    await until("the slot back", lambda: daemon.in_flight == 0)
    status, view = await api.call("GET", "/v1/sessions/retry")
    assert status == 200 and view["waiting_for_tool"] and view["turn"] == 1, view
    assert view["lease"]["continuation"] == key
    s = daemon.sessions.get("retry")
    assert s is not None and s.abandoned  # ended now, it would be no completed workflow
    status, out = await api.chat(
        "retry", messages=nxt, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    assert status == 200, out
    assert not s.abandoned  # the retry recorded its turn
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= history - BLOCK
    done = events(daemon, "completion", session_id="retry")
    assert done[-1]["bound"] == key and done[-1]["turn"] == 1  # the retry bound the history
    assert (await api.call("DELETE", "/v1/sessions/retry"))[0] == 200


async def test_a_request_the_engine_refuses_leaves_no_session(api: Api, daemon: Daemon):
    # vLLM's CPU build refuses a per-request seed when the request is added: a 400 that only
    # the engine gives, after the session was opened for it.
    status, out = await api.chat("seeded", seed=7)
    assert status == 400, out
    assert daemon.sessions.get("seeded") is None


async def test_retention_waits_for_the_request_in_flight(api: Api, daemon: Daemon):
    """While a request is being checked and tokenised it may bind the waiting history:
    a retention change then would cancel what it is about to bind (409 instead)."""
    msgs = [{"role": "user", "content": "Lima?"}]
    status, first = await api.chat(
        "busy", messages=msgs, tools=[WEATHER], tool_choice=FORCE, max_tokens=40
    )
    assert status == 200 and first["choices"][0]["finish_reason"] == "tool_calls", first
    s = daemon.sessions.get("busy")
    assert s is not None and s.wait.notice is not None
    waiting = s.wait.notice
    s.busy = True  # as Turn.run holds it between its checks and the submit
    try:
        for mode in ("release", "requirement", "preference"):
            status, out = await api.call(
                "POST", "/v1/sessions/busy/retention", json={"mode": mode}
            )
            assert status == 409 and out["error"]["code"] == "session_busy", (mode, out)
        assert s.wait.notice is waiting  # untouched
    finally:
        s.busy = False
    status, out = await api.call("POST", "/v1/sessions/busy/retention", json={"mode": "release"})
    assert status == 200 and out["status"] == "released"
    assert (await api.call("DELETE", "/v1/sessions/busy"))[0] == 200


async def test_a_disconnect_after_the_reply_keeps_the_new_tool_wait(
    api: Api, daemon: Daemon, monkeypatch: pytest.MonkeyPatch
):
    """The turn was recorded (its tool wait announced) before the client went away at the
    finish chunk: that wait stays the session's, nothing older comes back in its place."""
    msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Rome?"}]
    status, first = await api.chat(
        "late", messages=msgs, tools=[WEATHER], tool_choice=FORCE, max_tokens=40
    )
    assert status == 200 and first["choices"][0]["finish_reason"] == "tool_calls", first
    msg = first["choices"][0]["message"]
    nxt = [*msgs, msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
                        "content": "Rain"}]  # fmt: skip
    write = completions.Turn._write

    async def cut(self: Any, resp: Any, data: bytes = b"", eof: bool = False) -> None:
        if b'"finish_reason":"tool_calls"' in data:
            raise ConnectionResetError("the client went away")  # after the reply's notice
        await write(self, resp, data, eof)

    monkeypatch.setattr(completions.Turn, "_write", cut)
    status, _ = await api.chat(
        "late", messages=nxt, tools=[WEATHER], tool_choice=FORCE, max_tokens=40, stream=True
    )
    assert status == 200
    await until("the disconnect", lambda: bool(events(daemon, "disconnect", session_id="late")))
    status, view = await api.call("GET", "/v1/sessions/late")
    assert status == 200 and view["turn"] == 2 and view["waiting_for_tool"], view
    assert view["lease"]["continuation"].split("/")[-2] == "2"  # the new wait, turn 2
    assert (await api.call("DELETE", "/v1/sessions/late"))[0] == 200
    sizes = await daemon.live_engine().sizes()
    assert sizes["lease_book.pending"] == 0 and sizes["lease_book.leases"] == 0, sizes


# ---- the shutdown's cancellations (last: it stops the module's daemon) ------------------


async def test_requests_cancelled_by_the_shutdown_are_no_disconnects(
    api: Api, served: Served, monkeypatch: pytest.MonkeyPatch
):
    d = served.d
    eng = d.live_engine()
    done = asyncio.Event()
    result = eng.result

    async def held(rid: str) -> Any:  # runs past the drain: the shutdown cancels it
        out = await result(rid)
        done.set()
        await asyncio.sleep(GUARD_S)
        return out

    monkeypatch.setattr(eng, "result", held)
    before = d.stats["disconnected"]
    task = asyncio.create_task(api.chat("shut"))
    await asyncio.wait_for(done.wait(), GUARD_S)
    d.stop()
    audit = await asyncio.wait_for(served.task, GUARD_S)
    with contextlib.suppress(aiohttp.ClientError):
        await asyncio.wait_for(task, GUARD_S)
    assert d.stats["disconnected"] == before
    assert d.stats["shutdown_cancelled"] == 1
    assert not events(d, "disconnect", session_id="shut")
    assert audit["refs_added"] == audit["refs_released"]
