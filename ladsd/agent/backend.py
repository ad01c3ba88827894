"""How the agent's model calls reach the engine: a small protocol.

The agent loop knows nothing of the return path. Model call 0 goes straight
into the engine (:meth:`Backend.cold`). Every later call starts when a tool
result is ready (time ``r``): the loop hands the observation bytes to
:meth:`Backend.resume`, which carries them to the engine however it likes
(directly, or framed over the paced TCP link under a delivery policy) and
resumes the model with ``render(observation)``: the full continuation prompt,
``history_ids`` + the tool-message tokens, a token-exact extension of the
previous call's prompt + output.

A backend returns a :class:`Reply`: the engine's :class:`Completion` (a, n, f
stamps) plus the stamps only the backend knows (``r``, ``s``, ``c`` on the
clock of :mod:`ladsd.clock`). A bare ``Completion`` is accepted too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ladsd import clock
from ladsd.config import EngineConfig
from ladsd.records import ContinuationId
from ladsd.engine.thread import Completion, EngineThread

Render = Callable[[bytes], list[int]]


@dataclass(frozen=True)
class Reply:
    completion: Completion
    stamps: Mapping[str, float] = field(default_factory=dict)  # r, s, c (absolute clock)


def as_reply(x: Reply | Completion) -> Reply:
    return x if isinstance(x, Reply) else Reply(x)


@runtime_checkable
class Backend(Protocol):
    name: str  # recorded in the trace header: "direct", "link", ...
    model: str  # model profile name
    tokenizer: Any  # the engine's tokenizer (asyncio side)
    max_model_len: int

    async def cold(self, workflow: str, prompt_ids: list[int], params: Any) -> Reply:
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
    ) -> Reply:
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

    async def cold(self, workflow: str, prompt_ids: list[int], params: Any) -> Reply:
        out = await self.engine.complete(prompt_ids, params, request_id=f"{workflow}/0")
        return Reply(out)

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
    ) -> Reply:
        r = clock.now()
        out = await self.engine.complete(render(observation), params, cid=cid, request_id=cid.key())
        return Reply(out, {"r": r})


@asynccontextmanager
async def direct_backend(cfg: EngineConfig | None = None) -> AsyncIterator[DirectBackend]:
    """Start an engine and yield a :class:`DirectBackend` over it (a backend factory)."""
    async with EngineThread(cfg or EngineConfig()) as eng:
        yield DirectBackend(eng)
