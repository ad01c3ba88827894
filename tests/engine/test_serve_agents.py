"""The daemon's agent runs: request checks, and task runs over the real engine and link."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import orjson
import pytest
import pytest_asyncio

from ladsd.serve import agents
from ladsd.serve.agent_run import DEFAULT_AGENT, parse_agent, parse_run
from ladsd.serve.errors import ApiError
from ladsd.serve.events import EventHub
from tests.helpers import free_port
from web_catalog import source
from web_catalog.build import build
from web_catalog.db import Catalog
from web_catalog.tasks import load_tasks

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 300  # hang guard only (a tiny-model run takes seconds)


TASKS = {t.task_id: t for t in load_tasks()}


# ---- request parsing (no engine) ---------------------------------------------


def refused(body: object, db: Catalog) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_run(body, TASKS, db)
    return e.value


def test_task_body_gives_the_task_and_default_agent(db):
    req = parse_run({"task_id": "shop-03"}, TASKS, db)
    assert req.task == TASKS["shop-03"] and req.agent == DEFAULT_AGENT
    assert req.agent.repeats is False  # the committed trace's setting


def test_question_body_names_products_from_the_catalog(db):
    req = parse_run({"question": "Which is best?", "product_ids": [1, 2]}, TASKS, db)
    assert req.task.product_ids == (1, 2) and req.task.question == "Which is best?"
    assert req.task.products[0].name == db.product(1).name


@pytest.mark.parametrize(
    "body,status,param,code",
    [
        ({"task_id": "shop-99"}, 404, "task_id", "task_not_found"),
        ({"question": "q", "product_ids": [999999]}, 404, "product_ids", "product_not_found"),
        ([], 400, None, None),
        ({}, 400, None, None),
        ({"task_id": "shop-01", "question": "q"}, 400, None, None),
        ({"task_id": 3}, 400, "task_id", None),
        ({"question": "", "product_ids": [1]}, 400, "question", None),
        ({"question": "q", "product_ids": []}, 400, "product_ids", None),
        ({"question": "q", "product_ids": [1, 1]}, 400, "product_ids", None),
        ({"question": "q", "product_ids": [True]}, 400, "product_ids", None),
        ({"task_id": "shop-01", "colour": "red"}, 400, "colour", None),
        ({"task_id": "shop-01", "agent": []}, 400, "agent", None),
    ],
)
def test_bad_bodies_are_refused_with_status_param_and_code(db, body, status, param, code):
    e = refused(body, db)
    assert (e.status, e.param, e.code) == (status, param, code) and e.message


@pytest.mark.parametrize(
    "agent,param",
    [
        ({"step_limit": 0}, "agent.step_limit"),
        ({"step_limit": 2.5}, "agent.step_limit"),
        ({"max_tokens": True}, "agent.max_tokens"),
        ({"temperature": 3}, "agent.temperature"),
        ({"repeats": 1}, "agent.repeats"),
        ({"seed": 1}, "agent"),
    ],
)
def test_bad_agent_settings(agent, param):
    with pytest.raises(ApiError) as e:
        parse_agent(agent)
    assert e.value.status == 400 and e.value.param == param


def test_agent_settings_override_defaults():
    cfg = parse_agent({"step_limit": 3, "temperature": 0, "repeats": True})
    assert (cfg.step_limit, cfg.temperature, cfg.repeats) == (3, 0.0, True)
    assert cfg.max_tokens == DEFAULT_AGENT.max_tokens


def test_errors_are_the_daemons_openai_shaped_ones(db):
    e = refused({"task_id": "shop-99"}, db)
    assert e.body()["error"] == {
        "message": e.message,
        "type": "not_found_error",
        "param": "task_id",
        "code": "task_not_found",
    }


def test_sse_frame():
    assert agents._sse(3, "step", {"a": 1}) == b'id: 3\nevent: step\ndata: {"a":1}\n\n'


# ---- runs through a real `ladsd serve` (smoke profile, tiny model, LADS) -------------


@pytest.fixture(scope="module")
def daemon_url(model_ready, tmp_path_factory) -> Iterator[str]:
    """``ladsd serve`` as a subprocess; its own LADSD_HOME holds a fresh catalog and
    the prepared models (a link). Stopped with SIGTERM: exit 0 means the audit balanced."""
    from ladsd.engine import models

    if not source.DEFAULT_SOURCE.is_dir():
        pytest.skip(f"shared fixtures not found at {source.DEFAULT_SOURCE}")
    home = tmp_path_factory.mktemp("ladsd-home")
    (home / "models").symlink_to(models.model_path("tiny").parent)
    build(source.DEFAULT_SOURCE, home / "catalog.sqlite")
    port = free_port()
    cmd = [sys.executable, "-c", "from cli.main import app; app()", "serve"]
    cmd += ["--profile", "smoke", "--model", "tiny", "--policy", "lads", "--port", str(port)]
    env = {**os.environ, "LADSD_HOME": str(home)}
    with open(home / "serve.out", "wb") as log:  # the child keeps its own copy of the fd
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_healthy(proc, url))
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(HANG_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    out = (home / "serve.out").read_text(errors="replace")
    assert rc == 0, f"ladsd serve exited {rc}:\n{out[-3000:]}"


async def wait_healthy(proc: subprocess.Popen, url: str) -> None:
    async with asyncio.timeout(HANG_S), aiohttp.ClientSession() as http:
        while True:
            assert proc.poll() is None, f"ladsd serve exited with {proc.returncode}"
            try:
                async with http.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)


@pytest_asyncio.fixture(loop_scope="module")
async def http(daemon_url):
    async with aiohttp.ClientSession(daemon_url) as session:
        yield session


async def get_run(http: aiohttp.ClientSession, run_id: str) -> dict:
    async with http.get(f"/v1/agent/runs/{run_id}") as r:
        assert r.status == 200
        return await r.json()


async def wait_done(http: aiohttp.ClientSession, run_id: str) -> dict:
    async with asyncio.timeout(HANG_S):
        while True:
            view = await get_run(http, run_id)
            if view["status"] in ("completed", "failed", "cancelled"):
                return view
            await asyncio.sleep(0.2)


async def read_sse(http: aiohttp.ClientSession, run_id: str) -> list[tuple[str, dict]]:
    events: list[tuple[str, dict]] = []
    async with asyncio.timeout(HANG_S), http.get(f"/v1/agent/runs/{run_id}/events") as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        kind = None
        async for raw in r.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, orjson.loads(line[6:])))
    return events


RUN = {"task_id": "shop-01", "agent": {"step_limit": 3, "max_tokens": 48}}


@pytest.mark.engine
@pytest.mark.asyncio(loop_scope="module")
async def test_task_run_completes_with_steps_and_stage_times(http):
    async with http.post("/v1/agent/runs", json=RUN) as r:
        assert r.status == 201
        created = await r.json()
    assert created["status"] in ("queued", "running") and created["task"]["task_id"] == "shop-01"
    view = await wait_done(http, created["id"])
    assert view["status"] == "completed", view["error"]
    assert view["termination"] in ("finish", "step_limit", "context_limit")
    steps = view["steps"]
    assert 1 <= len(steps) <= 3 and [s["turn"] for s in steps] == list(range(len(steps)))
    for s in steps:
        assert s["action"]["name"] in ("open", "read_reviews", "finish", "invalid")
        t = s["times"]
        assert t["a"] is not None and t["a"] <= t["f"]
    for s in steps[1:]:  # continuations: the result went over the link (r <= s <= c <= a)
        t = s["times"]
        assert t["r"] <= t["s"] <= t["c"] <= t["a"] <= t["f"]
        assert s["observation"]["bytes"] > 0
        assert all(v is not None for v in s["stages"].values())
    st = view["stage_times"]
    assert set(st) == {"sender_wait", "queue_transfer", "receipt_to_alloc", "resumed_inference"}
    assert st["sender_wait"]["calls"] == len(steps) - 1
    assert view["usage"]["model_calls"] == len(steps)
    link = view["link"]
    assert link["policy"] == "lads" and link["rate_bytes_per_s"] > 0 and link["dilation"] > 0
    async with http.get("/v1/agent/runs") as r:
        ids = [x["id"] for x in (await r.json())["data"]]
    assert created["id"] in ids


@pytest.mark.engine
@pytest.mark.asyncio(loop_scope="module")
async def test_events_stream_shows_the_steps(http):
    body = {"question": "Which bag is best?", "product_ids": [1, 2], "agent": RUN["agent"]}
    async with http.post("/v1/agent/runs", json=body) as r:
        assert r.status == 201
        run_id = (await r.json())["id"]
    events = await read_sse(http, run_id)  # follows the run live, ends after "done"
    kinds = [k for k, _ in events]
    assert kinds[0] == "status" and kinds[-1] == "done"
    assert all(d["run"] == run_id for _, d in events)
    steps = [d for k, d in events if k == "step"]
    view = await wait_done(http, run_id)
    assert [s["turn"] for s in steps] == [s["turn"] for s in view["steps"]]
    assert steps and events[-1][1]["status"] == view["status"] == "completed"
    # Replayed from the start for a late reader; Last-Event-ID skips what was seen.
    assert await read_sse(http, run_id) == events
    async with http.get(f"/v1/agent/runs/{run_id}/events", headers={"Last-Event-ID": "1"}) as r:
        text = await r.text()
    assert text.startswith("id: 2\n") and "event: done" in text
    # The daemon's outcome stream carries the run too (session id = run id).
    seen = []
    url = f"/v1/events?session_id={run_id}&backlog=1000"
    async with asyncio.timeout(HANG_S), http.get(url) as r:
        async for raw in r.content:
            if raw.startswith(b"data: "):
                seen.append(orjson.loads(raw[6:])["type"])
                if seen[-1] == "agent_done":
                    break
    assert seen.count("agent_step") == len(steps) and seen[0] == "agent_status"
    assert seen.count("agent_tool_result") == len(steps) - 1


@pytest.mark.engine
@pytest.mark.asyncio(loop_scope="module")
async def test_bad_requests_over_http(http):
    cases = [
        ({"task_id": "shop-99"}, 404, "task_not_found"),
        ({"nope": 1}, 400, None),
    ]
    for body, status, code in cases:
        async with http.post("/v1/agent/runs", json=body) as r:
            assert r.status == status
            err = (await r.json())["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    raw = {"Content-Type": "application/json"}  # a raw body (else 415)
    async with http.post("/v1/agent/runs", data=b"{not json", headers=raw) as r:
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
    for method in ("GET", "DELETE"):
        async with http.request(method, "/v1/agent/runs/agent-0-none") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "run_not_found"


@pytest.mark.engine
@pytest.mark.asyncio(loop_scope="module")
async def test_cancel_a_running_run(http):
    body = {"task_id": "shop-02", "agent": {"step_limit": 32, "max_tokens": 48}}
    async with http.post("/v1/agent/runs", json=body) as r:
        run_id = (await r.json())["id"]
    async with asyncio.timeout(HANG_S):  # let it get going first
        while not (await get_run(http, run_id))["steps"]:
            await asyncio.sleep(0.05)
    async with http.delete(f"/v1/agent/runs/{run_id}") as r:
        assert r.status == 200
        view = await r.json()
    assert view["status"] == "cancelled" and view["error"] is None
    events = await read_sse(http, run_id)
    assert events[-1][0] == "done" and events[-1][1]["status"] == "cancelled"
    # The runtime is still healthy: another run completes after the cancel.
    async with http.post("/v1/agent/runs", json=RUN) as r:
        again = (await r.json())["id"]
    assert (await wait_done(http, again))["status"] == "completed"


@pytest.mark.asyncio
async def test_runs_table_is_bounded():
    """Finished runs are evicted oldest first; too many active runs get 429."""
    gate = asyncio.Event()
    hub = EventHub()
    daemon = SimpleNamespace(draining=False, events=hub)
    runs = agents.AgentRuns(daemon, max_runs=3, max_active=2)

    async def fake_drive(run):  # stands in for the agent loop
        run.status = "running"
        await gate.wait()
        runs._end(run, "completed", None)

    runs._drive = fake_drive  # type: ignore[method-assign]
    req = parse_run({"task_id": "shop-01"}, TASKS, None)  # type: ignore[arg-type]
    a, b = runs.start(req), runs.start(req)
    with pytest.raises(ApiError) as e:
        runs.start(req)
    assert e.value.status == 429 and e.value.code == "too_many_runs"
    gate.set()
    await asyncio.gather(a.job, b.job)
    c, d = runs.start(req), runs.start(req)  # 4 runs into a table of 3: a is evicted
    assert list(runs.runs) == [b.id, c.id, d.id]
    await asyncio.gather(c.job, d.job)
    await runs.shutdown()
    assert c.status == d.status == "completed"
    kinds = [e["type"] for e in hub.backlog if e["session_id"] == c.id]
    assert kinds == ["agent_status", "agent_done"]  # the daemon's outcome stream has them too
