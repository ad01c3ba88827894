"""The agent's backend over the real return link (capture runs over FIFO by default)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ladsd import sizing
from ladsd.agent.backend import Render
from ladsd.config import EngineConfig, LeaseConfig, LinkConfig, Profile, WorkloadConfig
from ladsd.records import ContinuationId
from ladsd.runtime import CallOutcome, Runtime
from ladsd.wiring import open_runtime
from ladsd.workloads.captured import CAPTURED_CODEC, CAPTURED_RATE

# Capture's return path: the captured-replay link (gzip6 at 48 kbit/s).
CAPTURE_LINK = LinkConfig(rate_bytes_per_s=CAPTURED_RATE, codec=CAPTURED_CODEC)


class LinkBackend:
    """Tool results travel the paced TCP link under a delivery policy, then resume."""

    def __init__(self, rt: Runtime, policy: str) -> None:
        self.rt = rt
        self.name = f"link:{policy}"
        self.model = rt.engine.cfg.model
        self.tokenizer = rt.engine.tokenizer
        self.max_model_len = rt.engine.cfg.max_model_len

    async def cold(self, workflow: str, prompt_ids: list[int], params: Any) -> CallOutcome:
        return await self.rt.cold(prompt_ids, params, cid=ContinuationId(workflow, 0))

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
        return await self.rt.resume(
            cid, history_ids, observation, render, params, workflow_arrival=workflow_arrival
        )


@asynccontextmanager
async def link_backend(
    cfg: EngineConfig | None = None,
    policy: str = "fifo",
    link: LinkConfig = CAPTURE_LINK,
    lease: LeaseConfig | None = None,
) -> AsyncIterator[LinkBackend]:
    """Engine + runtime + link (:func:`open_runtime`); yields a :class:`LinkBackend`.

    The lease audit runs on the way out; an unbalanced audit raises.
    """
    prof = Profile(
        name="capture",
        engine=cfg or EngineConfig(),
        link=link,
        lease=lease or LeaseConfig(),
        workload=WorkloadConfig(),
    )
    async with open_runtime(sizing.for_run(prof, policy), policy) as rt:
        yield LinkBackend(rt, policy)
