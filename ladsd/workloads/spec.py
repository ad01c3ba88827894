"""A workload instance: identical inputs for every policy of one seed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallSpec:
    """Model call k >= 1 of a workflow: the tool result that resumes it.

    ``suffix_ids``: recorded tool-message tokens (captured replay); when None the
    runner tokenizes ``observation`` into a tool message.
    """

    observation: bytes
    tool_seconds: float
    output_tokens: int
    suffix_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class WorkflowSpec:
    """One agent task: call 0 (cold) then tool result / model call pairs."""

    wid: str
    arrival: float  # seconds after the run starts
    prompt_ids: tuple[int, ...]  # call 0's prompt
    first_output_tokens: int
    calls: tuple[CallSpec, ...]  # calls 1..K
    cohort: int | None = None  # tool-service cohort (None: no barrier)


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    workflows: tuple[WorkflowSpec, ...]
    cohort_gap_s: float = 0.05
    cohort_limit_s: float = 60.0
    codec: str = "identity"
    rate_bytes_per_s: float | None = None  # overrides the profile's link rate

    @property
    def continuations(self) -> int:
        return sum(len(w.calls) for w in self.workflows)
