"""`ladsd serve`: the HTTP API over the real engine, bad requests, clean shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest
import pytest_asyncio

from ladsd.config import EngineConfig, has_cuda
from ladsd.daemon import Daemon

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def base(model_ready):
    port = free_port()
    d = Daemon(EngineConfig(model="tiny", max_model_len=1024, num_gpu_blocks_override=64))
    started = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(d.run("127.0.0.1", port, lambda _: started.set_result(True)))
    await asyncio.wait_for(started, 120)
    yield f"http://127.0.0.1:{port}"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not d.engine.alive


async def post(base: str, body: object, raw: bytes | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else None
        kw = {"data": data} if raw is not None else {"json": body}
        async with s.post(f"{base}/v1/generate", **kw) as r:
            return r.status, await r.json()


async def test_health_and_state(base):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with s.get(f"{base}/v1/engine/state") as r:
            st = await r.json()
    assert st["total_blocks"] == 64 and st["max_num_seqs"] == 8
    assert {"free_blocks", "waiting", "running", "kappa"} <= set(st)


async def test_generate_token_prompt(base):
    status, out = await post(base, {"prompt": list(range(100, 180)), "max_tokens": 4})
    assert status == 200
    assert len(out["token_ids"]) == 4 and out["prompt_token_ids"] == list(range(100, 180))
    ts = out["timestamps"]
    assert ts["a"] <= ts["n"] <= ts["f"]


async def test_generate_chat_messages(base):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, out = await post(base, body)
    assert status == 200 and len(out["token_ids"]) == 3


@pytest.mark.parametrize(
    "body,msg",
    [
        ({}, "exactly one"),
        ({"prompt": "x", "messages": []}, "exactly one"),
        ({"prompt": []}, "non-empty"),
        ({"prompt": [1, -2]}, "token ids"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "bogus": 1}, "unknown fields"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ([1, 2], "JSON object"),
    ],
)
async def test_bad_requests_get_400_and_daemon_stays_up(base, body, msg):
    status, out = await post(base, body)
    assert status == 400 and msg in out["error"]
    status, _ = await post(base, {"prompt": "still up", "max_tokens": 1})
    assert status == 200


async def test_malformed_json_and_engine_rejection(base):
    status, out = await post(base, None, raw=b"{not json")
    assert status == 400 and "invalid JSON" in out["error"]
    status, out = await post(base, {"prompt": list(range(2000)), "max_tokens": 1})
    assert status == 422 and "context length" in out["error"]
    status, out = await post(base, {"prompt": "x", "seed": 1, "max_tokens": 1})
    # vLLM 0.32's CPU runner cannot seed a request: refused there, served on a GPU
    expect = (200, False) if has_cuda() else (422, True)
    assert (status, "seeds" in out.get("error", "")) == expect


def test_serve_stops_cleanly_on_sigterm(model_ready):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "cli.main",
        "serve",
        "--model",
        "tiny",
        "--port",
        str(port),
        "--kv-blocks",
        "64",
        "--max-model-len",
        "1024",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
