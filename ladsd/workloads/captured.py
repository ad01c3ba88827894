"""Captured web-agent replay (spec 5): the recorded paths, preserved across policies.

Each call keeps its recorded prompt length and tool-message tokens, its
recorded output length (forced), its recorded observation and tool-service
duration; calls depend on the previous call of their workflow (ReAct).
Arrivals come from the seed. The link carries gzip6 payloads at 48 kbit/s.

``captured-scaled`` (ours, an exploratory variant): the same paths, each
workflow's first prompt grown to one of the profile's ``history_tokens`` by
inert tokens in front (assigned per seed, as in the controlled workload). The
recorded captures are short (320-token prompts, ~1.8K-token final histories),
so at the ``cpu`` profile they never pressure the pool and a recomputation
costs a few engine steps: the plain replay measures ordering, not leases.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ladsd.workloads.controlled import assign_sizes, history_ids
from ladsd.workloads.spec import CallSpec, WorkflowSpec, Workload
from ladsd.workloads.trace import Trace

CAPTURED_RATE = 6000.0  # 48 kbit/s
CAPTURED_CODEC = "gzip6"


def build(
    trace: Trace, seed: int, spread_s: float = 2.0, history_tokens: Sequence[int] = ()
) -> Workload:
    """The replay for ``seed``; with ``history_tokens``, the scaled variant."""
    rng = random.Random(f"captured/{seed}")
    # A separate stream, so both variants of one seed get the same arrivals.
    pad_rng = random.Random(f"captured-scaled/{seed}")
    live = [w for w in trace.workflows if w.calls]
    sizes = assign_sizes(history_tokens, len(live), pad_rng) if history_tokens else []
    flows = []
    for i, w in enumerate(live):
        first = tuple(w.calls[0].prompt_ids)
        if sizes:
            first = history_ids(max(0, sizes[i] - len(first)), pad_rng) + first
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
                prompt_ids=first,
                first_output_tokens=max(1, len(w.calls[0].output_ids)),
                calls=tuple(calls),
                cohort=None,
            )
        )
    name = "captured-scaled" if sizes else "captured"
    return Workload(
        name, seed, tuple(flows), codec=CAPTURED_CODEC, rate_bytes_per_s=CAPTURED_RATE
    )
