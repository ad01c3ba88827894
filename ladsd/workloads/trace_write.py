"""Writing captured agent traces (:mod:`ladsd.workloads.trace` reads them).

``dumps`` refuses a trace whose prompts are not token-exact extensions, so a
written trace always loads back equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from ladsd.clock import Stamps
from ladsd.workloads.trace import (
    Action,
    Observation,
    Trace,
    TraceCall,
    TraceError,
    TraceHeader,
    TraceWorkflow,
)


def _times(t: Stamps) -> dict[str, float | None]:
    return t.as_dict()


def _obs(o: Observation | None) -> dict[str, Any] | None:
    if o is None:
        return None
    return {
        "tool": o.tool,
        "args": dict(o.args),
        "ok": o.ok,
        "text": o.text,
        "bytes": len(o.payload),
        "sha256": o.sha256,
        "tool_seconds": o.tool_seconds,
    }


def _action(a: Action) -> dict[str, Any]:
    return {
        "name": a.name,
        "thought": a.thought,
        "product_id": a.product_id,
        "answer": a.answer,
        "error": a.error,
    }


def _call(c: TraceCall, prev: TraceCall | None, where: str) -> dict[str, Any]:
    d: dict[str, Any] = {"turn": c.turn, "depends_on": c.depends_on}
    d["observation"] = _obs(c.observation)
    if prev is None:
        d["prompt_ids"] = list(c.prompt_ids)
    else:
        base = prev.prompt_ids + prev.output_ids
        if c.prompt_ids[: len(base)] != base:
            raise TraceError(
                f"{where} call {c.turn}: prompt is not an extension of call {prev.turn}'s "
                "prompt + output"
            )
        d["added_ids"] = list(c.prompt_ids[len(base) :])
    d["prompt_len"] = len(c.prompt_ids)
    d["output_ids"] = list(c.output_ids)
    d["text"] = c.text
    d["finish_reason"] = c.finish_reason
    d["cached_tokens"] = c.cached_tokens
    d["offered"] = {name: list(ids) for name, ids in c.offered.items()}
    d["action"] = _action(c.action)
    d["times"] = _times(c.times)
    return d


def workflow_dict(w: TraceWorkflow) -> dict[str, Any]:
    where = f"workflow {w.workflow}:"
    calls, prev = [], None
    for c in w.calls:
        calls.append(_call(c, prev, where))
        prev = c
    return {
        "workflow": w.workflow,
        "task_id": w.task_id,
        "product_ids": list(w.product_ids),
        "arrival": w.arrival,
        "end": w.end,
        "termination": w.termination,
        "answer": w.answer,
        "error": w.error,
        "calls": calls,
    }


def header_dict(h: TraceHeader) -> dict[str, Any]:
    return {
        "format": h.format,
        "version": h.version,
        "model": h.model,
        "tokenizer": h.tokenizer,
        "tokenizer_sha256": h.tokenizer_sha256,
        "ladsd_version": h.ladsd_version,
        "vllm_version": h.vllm_version,
        "seed": h.seed,
        "catalog_digest": h.catalog_digest,
        "tasks_sha256": h.tasks_sha256,
        "created": h.created,
        "workflows": h.workflows,
        "backend": h.backend,
        "agent": dict(h.agent),
    }


def dumps(trace: Trace) -> bytes:
    """The trace as JSONL bytes (every line ends with a newline)."""
    if trace.header.workflows != len(trace.workflows):
        raise TraceError(
            f"header says {trace.header.workflows} workflows, trace has {len(trace.workflows)}"
        )
    lines = [orjson.dumps(header_dict(trace.header))]
    lines += [orjson.dumps(workflow_dict(w)) for w in trace.workflows]
    return b"\n".join(lines) + b"\n"


def dump(trace: Trace, path: Path | str) -> Path:
    """Write atomically (temp file + rename): a crash never leaves half a trace."""
    path = Path(path)
    data = dumps(trace)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path
