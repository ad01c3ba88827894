"""Build a workload instance by name (one seed; identical for every policy)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ladsd.config import Profile
from ladsd.workloads import captured, controlled, web_burst
from ladsd.workloads.spec import Workload
from ladsd.workloads.trace import Trace, load

WORKLOADS = ("controlled", "web-burst", "captured", "captured-scaled")
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "traces" / "smollm2-16tasks.jsonl"


def limit(tr: Trace, workflows: int, calls: int) -> Trace:
    """The first ``workflows`` workflows with their first ``calls`` calls (smoke runs)."""
    flows = tuple(replace(w, calls=w.calls[:calls]) for w in tr.workflows[:workflows])
    return replace(tr, workflows=flows)


def make(
    name: str, profile: Profile, seed: int, *, cohort: int | None = None, trace: Path | None = None
) -> Workload:
    if name == "controlled":
        return controlled.build(
            profile.workload, seed, controlled.archive_from_catalog(), cohort=cohort
        )
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    path = trace or DEFAULT_TRACE
    if not path.exists():
        raise FileNotFoundError(f"trace {path} not found (capture one: `ladsd capture tasks`)")
    tr = load(path)
    if profile.workload.replay_limit is not None:
        tr = limit(tr, *profile.workload.replay_limit)
    if name == "web-burst":
        return web_burst.build(profile.workload, seed, tr, cohort=cohort or 16)
    if name == "captured-scaled":
        sizes = profile.workload.history_tokens
        return captured.build(tr, seed, profile.workload.arrival_spread_s, sizes)
    return captured.build(tr, seed, profile.workload.arrival_spread_s)
