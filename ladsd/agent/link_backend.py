"""The agent's backend over the real return link (capture runs over FIFO by default)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ladsd.agent.backend import Render, Reply
from ladsd.config import EngineConfig, LeaseConfig, LinkConfig
from ladsd.delivery import make_policy
from ladsd.records import ContinuationId
from ladsd.engine.thread import EngineThread
from ladsd.runtime import Runtime
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

    async def cold(self, workflow: str, prompt_ids: list[int], params: Any) -> Reply:
        out = await self.rt.cold(prompt_ids, params, cid=ContinuationId(workflow, 0))
        return Reply(out.completion)

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
        out = await self.rt.resume(
            cid, history_ids, observation, render, params, workflow_arrival=workflow_arrival
        )
        return Reply(out.completion, {"r": out.r, "s": out.s, "c": out.c})


@asynccontextmanager
async def link_backend(
    cfg: EngineConfig | None = None,
    policy: str = "fifo",
    link: LinkConfig = CAPTURE_LINK,
    lease: LeaseConfig | None = None,
) -> AsyncIterator[LinkBackend]:
    """Engine + runtime + link; yields a :class:`LinkBackend`; checks the lease audit."""
    pol = make_policy(policy)
    lease = lease or LeaseConfig(enabled=pol.uses_leases)
    async with EngineThread(cfg or EngineConfig(), lease) as eng:
        rt = await Runtime(eng, pol, link).start()
        try:
            yield LinkBackend(rt, policy)
            await rt.finish()  # raises LeaseIntegrityError unless the audit balances
        finally:
            await rt.close()
