"""Captured web-agent replay (spec 5): the recorded paths, preserved across policies.

Each call keeps its recorded prompt length and tool-message tokens, its
recorded output length (forced), its recorded observation and tool-service
duration; calls depend on the previous call of their workflow (ReAct).
Arrivals come from the seed. The link carries gzip6 payloads at 48 kbit/s.
"""

from __future__ import annotations

import random

from ladsd.workloads.spec import CallSpec, WorkflowSpec, Workload
from ladsd.workloads.trace import Trace

CAPTURED_RATE = 6000.0  # 48 kbit/s
CAPTURED_CODEC = "gzip6"


def build(trace: Trace, seed: int, spread_s: float = 2.0) -> Workload:
    rng = random.Random(f"captured/{seed}")
    flows = []
    for w in trace.workflows:
        if not w.calls:
            continue
        calls = []
        for prev, cur in zip(w.calls, w.calls[1:], strict=False):
            if cur.observation is None:
                raise ValueError(f"{w.workflow} call {cur.turn} has no observation")
            # The tool message as recorded: what the agent appended after the
            # previous prompt and output (end-of-turn token included).
            start = len(prev.prompt_ids) + len(prev.output_ids)
            calls.append(
                CallSpec(
                    observation=cur.observation.payload,
                    tool_seconds=cur.observation.tool_seconds,
                    output_tokens=max(1, len(cur.output_ids)),
                    suffix_ids=tuple(cur.prompt_ids[start:]),
                )
            )
        flows.append(
            WorkflowSpec(
                wid=w.workflow,
                arrival=rng.uniform(0.0, spread_s),
                prompt_ids=tuple(w.calls[0].prompt_ids),
                first_output_tokens=max(1, len(w.calls[0].output_ids)),
                calls=tuple(calls),
                cohort=None,
            )
        )
    return Workload(
        "captured", seed, tuple(flows), codec=CAPTURED_CODEC, rate_bytes_per_s=CAPTURED_RATE
    )
