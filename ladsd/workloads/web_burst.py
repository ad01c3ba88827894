"""Web-derived bursts (spec 5): the cohort-16 controlled shape, real observations.

Same histories, arrivals and cohorts as the controlled workload of the same
seed, but every tool result is a real catalog observation from the committed
16-task capture: workflow i's call k carries capture workflow i's k-th
observation (cycling through that workflow's observations if it has fewer).
"""

from __future__ import annotations

from dataclasses import replace

from ladsd.config import WorkloadConfig
from ladsd.workloads import controlled
from ladsd.workloads.spec import Workload
from ladsd.workloads.trace import Trace


def observations(trace: Trace) -> list[list[bytes]]:
    """Per captured workflow, its observations in call order."""
    out = []
    for w in trace.workflows:
        obs = [c.observation.payload for c in w.calls if c.observation is not None]
        if obs:
            out.append(obs)
    if not out:
        raise ValueError("the trace holds no observations")
    return out


def build(cfg: WorkloadConfig, seed: int, trace: Trace, cohort: int = 16) -> Workload:
    per_flow = observations(trace)
    base = controlled.build(cfg, seed, [b"-"], name="web-burst", cohort=cohort)
    flows = []
    for i, w in enumerate(base.workflows):
        obs = per_flow[i % len(per_flow)]
        calls = tuple(replace(c, observation=obs[k % len(obs)]) for k, c in enumerate(w.calls))
        flows.append(replace(w, calls=calls))
    return replace(base, workflows=tuple(flows))
