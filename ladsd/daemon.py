"""The daemon: wires the engine thread to a small HTTP API (``ladsd serve``).

Endpoints (loopback by default):
  GET  /health            liveness and engine status
  GET  /v1/engine/state   JSON snapshot: free/total KV blocks, waiting, running, ...
  POST /v1/generate       prompt (text or token ids) or chat messages -> JSON result
Bad requests get a 4xx with a clear message; the daemon stays up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from typing import Any

import orjson
from aiohttp import web

from ladsd.config import EngineConfig, LeaseConfig
from ladsd.engine.params import sampling
from ladsd.engine.thread import EngineError, EngineThread
from ladsd.records import EngineState

_SAMPLING_KEYS = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "seed": int,
    "min_tokens": int,
}


class BadRequest(ValueError):
    pass


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(data, default=_default), status=status, content_type="application/json"
    )


def _default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if hasattr(o, "value"):
        return o.value
    raise TypeError(type(o).__name__)


def parse_generate(body: Any) -> tuple[Any, dict[str, Any]]:
    """Validate a /v1/generate body; return (prompt, sampling kwargs)."""
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    has_prompt, has_msgs = "prompt" in body, "messages" in body
    if has_prompt == has_msgs:
        raise BadRequest("give exactly one of 'prompt' (text or token ids) or 'messages'")
    if has_prompt:
        prompt = body["prompt"]
        ok = isinstance(prompt, str) or (
            isinstance(prompt, list) and all(isinstance(t, int) and t >= 0 for t in prompt)
        )
        if not ok or not prompt:
            raise BadRequest("'prompt' must be a non-empty string or list of token ids")
    else:
        prompt = body["messages"]
        ok = (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in prompt
            )
        )
        if not ok:
            raise BadRequest("'messages' must be a non-empty list of {role, content} strings")
    kw: dict[str, Any] = {}
    for key, typ in _SAMPLING_KEYS.items():
        if key in body:
            val = body[key]
            if isinstance(val, bool) or not isinstance(val, (int, float)):
                raise BadRequest(f"'{key}' must be a number")
            kw[key] = typ(val)
    if "stop" in body:
        if not isinstance(body["stop"], list) or not all(isinstance(s, str) for s in body["stop"]):
            raise BadRequest("'stop' must be a list of strings")
        kw["stop"] = body["stop"]
    if "json_schema" in body:
        if not isinstance(body["json_schema"], dict):
            raise BadRequest("'json_schema' must be a JSON object")
        kw["json_schema"] = body["json_schema"]
    unknown = set(body) - set(_SAMPLING_KEYS) - {"prompt", "messages", "stop", "json_schema"}
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(sorted(unknown))}")
    return prompt, kw


class Daemon:
    """One process: the engine thread plus the HTTP API on loopback."""

    def __init__(self, engine_cfg: EngineConfig, lease_cfg: LeaseConfig | None = None) -> None:
        self.state: EngineState | None = None
        self.engine = EngineThread(engine_cfg, lease_cfg, on_state=self._on_state)
        self.app = web.Application(client_max_size=8 * 1024 * 1024)
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/engine/state", self.engine_state),
                web.post("/v1/generate", self.generate),
            ]
        )

    def _on_state(self, state: EngineState) -> None:
        self.state = state

    async def health(self, _: web.Request) -> web.Response:
        alive = self.engine.alive
        return _json({"status": "ok" if alive else "engine down"}, 200 if alive else 503)

    async def engine_state(self, _: web.Request) -> web.Response:
        if not self.engine.alive:
            return _json({"error": "engine is not running"}, 503)
        snap = (await self.engine.snapshot()).as_dict()
        if self.state is not None:
            s = self.state
            snap["leases"] = {"U": s.U, "B": s.B, "C": s.C, "F": s.F, "active": len(s.leases)}
        return _json(snap)

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            return _json({"error": f"invalid JSON: {e}"}, 400)
        try:
            prompt, kw = parse_generate(body)
            params = sampling(**kw)
        except Exception as e:  # vLLM's own validation errors included
            return _json({"error": str(e)}, 400)
        if not self.engine.alive:
            return _json({"error": "engine is not running"}, 503)
        try:
            res = await self.engine.complete(prompt, params)
        except EngineError as e:
            return _json({"error": str(e)}, 422)
        return _json(
            {
                "text": res.text,
                "token_ids": list(res.token_ids),
                "prompt_token_ids": list(res.prompt_token_ids),
                "finish_reason": res.finish_reason,
                "num_cached_tokens": res.num_cached_tokens,
                "timestamps": {"a": res.stamps.a, "n": res.stamps.n, "f": res.stamps.f},
            }
        )

    async def run(self, host: str = "127.0.0.1", port: int = 8731, ready=None) -> None:
        """Serve until SIGINT/SIGTERM (or cancellation); then shut down cleanly."""
        await self.engine.start()
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        if ready is not None:
            ready(runner.addresses)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            await self.engine.stop()
