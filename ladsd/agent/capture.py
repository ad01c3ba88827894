"""Capture: run shopping tasks concurrently as real workflows, into one trace.

No files, no terminal output here (``cli/capture.py`` adds both): the run,
the trace header's provenance, and a per-workflow summary as pure functions.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ladsd import clock
from ladsd.agent.backend import Backend
from ladsd.agent.loop import AgentConfig, OnCall, run_workflow
from ladsd.workloads.trace import Trace, TraceHeader, TraceWorkflow
from web_catalog.db import Catalog
from web_catalog.source import sha256_file
from web_catalog.tasks import TASKS_PATH, Task

OnDone = Callable[[TraceWorkflow], None]


def tokenizer_sha256(tokenizer: Any) -> str:
    """Digest of the tokenizer's full serialization (vocab, merges, special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()
    path = Path(getattr(tokenizer, "name_or_path", "")) / "tokenizer.json"
    return sha256_file(path)


def _ladsd_version() -> str:
    try:
        return importlib.metadata.version("ladsd")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def make_header(
    backend: Backend,
    db: Catalog,
    cfg: AgentConfig,
    seed: int,
    workflows: int,
    tasks_file: Path | str = TASKS_PATH,
) -> TraceHeader:
    import vllm

    tok = backend.tokenizer
    return TraceHeader(
        model=backend.model,
        tokenizer=Path(str(getattr(tok, "name_or_path", type(tok).__name__))).name,
        tokenizer_sha256=tokenizer_sha256(tok),
        ladsd_version=_ladsd_version(),
        vllm_version=str(vllm.__version__),
        seed=seed,
        catalog_digest=db.meta().get("digest", ""),
        tasks_sha256=sha256_file(Path(tasks_file)),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        workflows=workflows,
        backend=backend.name,
        agent=cfg.as_dict(),
    )


async def capture(
    backend: Backend,
    tasks: Sequence[Task],
    db: Catalog,
    cfg: AgentConfig = AgentConfig(),
    *,
    seed: int = 0,
    tasks_file: Path | str = TASKS_PATH,
    on_call: OnCall | None = None,
    on_done: OnDone | None = None,
) -> Trace:
    """Run every task at once (one workflow each); times are relative to the start."""
    if len({t.task_id for t in tasks}) != len(tasks):
        raise ValueError("task ids must be unique (they name the workflows)")
    origin = clock.now()

    async def one(task: Task) -> TraceWorkflow:
        rec = await run_workflow(task, backend, db, cfg, seed=seed, origin=origin, on_call=on_call)
        if on_done is not None:
            on_done(rec)
        return rec

    flows = await asyncio.gather(*(one(t) for t in tasks))
    header = make_header(backend, db, cfg, seed, len(flows), tasks_file)
    return Trace(header, tuple(flows))


@dataclass(frozen=True)
class WorkflowSummary:
    workflow: str
    steps: int  # model calls
    tools: dict[str, int]  # tool calls run, by tool
    invalid: int  # outputs that did not parse
    opened_all: bool
    read_all: bool
    cached_share: float | None  # cached / prompt tokens over continuations
    termination: str
    seconds: float


def summarize(w: TraceWorkflow) -> WorkflowSummary:
    tools: Counter[str] = Counter()
    opened: set[int] = set()
    read: set[int] = set()
    for c in w.calls:
        o = c.observation
        if o is not None and o.tool is not None:
            tools[o.tool] += 1
            if o.ok:
                pid = int(o.args.get("product_id", -1))
                (opened if o.tool == "open" else read).add(pid)
    conts = w.calls[1:]
    prompt = sum(len(c.prompt_ids) for c in conts)
    cached = sum(c.cached_tokens for c in conts)
    return WorkflowSummary(
        workflow=w.workflow,
        steps=len(w.calls),
        tools=dict(sorted(tools.items())),
        invalid=sum(c.action.name == "invalid" for c in w.calls),
        opened_all=set(w.product_ids) <= opened,
        read_all=set(w.product_ids) <= read,
        cached_share=cached / prompt if prompt else None,
        termination=w.termination,
        seconds=w.end - w.arrival,
    )
