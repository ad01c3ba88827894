"""Small helpers shared by the serve tests (no fixtures: those live in conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
START_S = 600  # hang guards only: this machine may be shared and slow
CALL_S = 300

FORCE = {"type": "function", "function": {"name": "get_weather"}}  # tool_choice naming it


def weather_tool(description: str = "The weather in a city.", max_len: int | None = None) -> dict:
    """An OpenAI function tool ``get_weather(city)`` (``max_len`` caps the city's length)."""
    city: dict[str, Any] = {"type": "string"}
    if max_len is not None:
        city["maxLength"] = max_len
    return {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"city": city},
                "required": ["city"],
            },
        },
    }


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def linked_home(root: Path) -> Path:
    """A fresh ``$LADSD_HOME`` under ``root`` that links the prepared models (no kappa cache,
    no logs, no catalog of the user's)."""
    from ladsd.engine import models

    home = root / "ladsd-home"
    home.mkdir()
    (home / "models").symlink_to(models.model_path("tiny").parent)
    return home


def serve_log(home: Path, pid: int) -> str:
    """The engine log of the ``ladsd serve`` process ``pid`` under ``home`` ('' until it exists)."""
    for path in (home / "logs").glob(f"serve-*-{pid}.log"):
        return path.read_text(errors="replace")
    return ""


class Api:
    """JSON calls to a daemon over HTTP (``aiohttp``): ``(status, body)``."""

    def __init__(self, base: str, http: Any) -> None:
        self.base, self.http = base, http

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, Any]:
        async with self.http.request(method, self.base + path, **kw) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except json.JSONDecodeError:
                return r.status, text

    async def chat(self, session: str | None = None, **body: Any) -> tuple[int, Any]:
        b = {"model": "tiny", "max_tokens": 4, "temperature": 0} | body
        b.setdefault("messages", [{"role": "user", "content": "hello"}])
        headers = {"x-session-id": session} if session else {}
        return await self.call("POST", "/v1/chat/completions", json=b, headers=headers)


@asynccontextmanager
async def running(d: Any, guard_s: float) -> AsyncIterator[Any]:
    """``d`` (a :class:`~ladsd.serve.daemon.Daemon`) serving in this loop until the block
    ends; then stopped, and its lease audit must balance. ``guard_s``: hang guard only."""
    up = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(d.run(up.set_result))
    await asyncio.wait_for(up, guard_s)
    try:
        yield d
    finally:
        d.stop()
        audit = await asyncio.wait_for(task, guard_s)
    assert audit["refs_added"] == audit["refs_released"]


class Server:
    """``ladsd serve`` in a subprocess; its output goes to a file (no pipe to fill)."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ.copy()
        )

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def wait_ready(self) -> Server:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"ladsd serve exited {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        pytest.fail(f"ladsd serve not healthy after {START_S} s:\n{self.output()}")

    def client(self, **kw: Any) -> Any:
        import openai

        return openai.OpenAI(
            base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=CALL_S, **kw
        )

    def http(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=CALL_S) as r:
                raw, status = r.read(), r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw.decode()

    def get(self, path: str) -> Any:
        status, out = self.http("GET", path)
        assert status == 200, (path, status, out)
        return out

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=CALL_S) as r:
            text = r.read().decode()
        from prometheus_client.parser import text_string_to_metric_families

        return {f.name: f.samples[0].value for f in text_string_to_metric_families(text)}

    def events(self, session: str, until: set[str], count: int = 1) -> list[dict[str, Any]]:
        """Read ``/v1/events`` for ``session`` (its backlog first) until every kind in
        ``until`` was seen ``count`` times."""
        url = f"{self.base}/v1/events?session_id={session}&backlog=1000"
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + CALL_S  # a hang guard (heartbeats come every 15 s)
        with urllib.request.urlopen(url, timeout=CALL_S) as r:
            for line in r:
                if line.startswith(b"data: "):
                    seen.append(json.loads(line[6:]))
                kinds = [e["type"] for e in seen]
                if all(kinds.count(k) >= count for k in until) or time.monotonic() > deadline:
                    break
        return seen

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=START_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        self.log.close()
        os.unlink(self.log.name)


def audited(*flags: str) -> Iterator[Server]:
    """A ``ladsd serve`` subprocess for a fixture: ready when yielded; after the tests it
    must exit 0 with a balanced lease audit."""
    srv = Server(*flags)
    try:
        yield srv.wait_ready()
    finally:
        rc = srv.stop()
        out = srv.output()
        srv.close()
    assert rc == 0, out
    assert "audit balanced" in out, out


def bench_script(name: str) -> Any:
    """``bench/<name>.py`` as a module, loaded by path under ``bench_<name>`` with sys.path
    restored: bench/ on the path would shadow packages (the OpenAI Agents SDK is
    ``agents``), and the scripts add bench/ themselves."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    if f"bench_{name}" in sys.modules:
        return sys.modules[f"bench_{name}"]
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", root / f"bench/{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    sys.path[:] = path
    for helper in ("_common", "_servers"):  # bench helpers, not packages other tests import
        sys.modules.pop(helper, None)
    return mod
