"""How the agent's model calls reach the engine: a small protocol.

The agent loop knows nothing of the return path. Model call 0 goes straight
into the engine (:meth:`Backend.cold`). Every later call starts when a tool
result is ready (time ``r``): the loop hands the observation bytes to
:meth:`Backend.resume`, which carries them to the engine however it likes
(directly, or framed over the paced TCP link under a delivery policy) and
resumes the model with ``render(observation)``: the full continuation prompt,
``history_ids`` + the tool-message tokens, a token-exact extension of the
previous call's prompt + output.

A backend returns the runtime's :class:`~ladsd.runtime.CallOutcome`: the
engine's :class:`Completion` and the call's :class:`~ladsd.clock.Stamps`
(a, n, f from the engine; ``r``, ``s``, ``c`` where the backend knows them),
on the clock of :mod:`ladsd.clock`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from ladsd import clock
from ladsd.config import EngineConfig
from ladsd.engine.thread import EngineThread
from ladsd.records import ContinuationId
from ladsd.runtime import CallOutcome

Render = Callable[[bytes], list[int]]


@runtime_checkable
class Backend(Protocol):
    name: str  # recorded in the trace header: "direct", "link", ...
    model: str  # model profile name
    tokenizer: Any  # the engine's tokenizer (asyncio side)
    max_model_len: int

    async def cold(self, workflow: str, prompt_ids: list[int], params: Any) -> CallOutcome:
        """Model call 0 of ``workflow``, straight into the engine."""
        ...

    async def resume(
        self,
        cid: ContinuationId,
        history_ids: list[int],
        observation: bytes,
        render: Render,
        params: Any,
        *,
        workflow_arrival: float,
        tool_seconds: float,
    ) -> CallOutcome:
        """The observation is ready now (``r``): carry it to the engine, then run
        ``render(observation)`` (= history_ids + tool-message ids) with ``params``.

        ``history_ids`` is everything before the observation (what the engine
        should still hold in its prefix cache); ``tool_seconds`` is the tool's
        service time; ``workflow_arrival`` the workflow's start on the clock.
        """
        ...


class DirectBackend:
    """No return link: the observation enters the engine the moment it is ready."""

    name = "direct"

    def __init__(self, engine: EngineThread) -> None:
        self.engine = engine
        self.model = engine.cfg.model
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.cfg.max_model_len

    async def cold(self, workflow: str, prompt_ids: list[int], params: Any) -> CallOutcome:
        out = await self.engine.complete(prompt_ids, params, request_id=f"{workflow}/0")
        return CallOutcome(out, out.stamps)

    async def resume(
        self,
        cid: ContinuationId,
        history_ids: list[int],
        observation: bytes,
        render: Render,
        params: Any,
        *,
        workflow_arrival: float,
        tool_seconds: float,
    ) -> CallOutcome:
        r = clock.now()
        out = await self.engine.complete(render(observation), params, cid=cid, request_id=cid.key())
        return CallOutcome(out, replace(out.stamps, r=r))


@asynccontextmanager
async def direct_backend(cfg: EngineConfig | None = None) -> AsyncIterator[DirectBackend]:
    """Start an engine and yield a :class:`DirectBackend` over it (a backend factory)."""
    async with EngineThread(cfg or EngineConfig()) as eng:
        yield DirectBackend(eng)
