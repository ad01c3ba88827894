"""The one small interface every delivery policy implements.

The sender calls :meth:`Policy.choose` whenever the in-flight window has room
and at least one ready, uncommitted result exists. Only the returned item is
committed; nothing else a policy computes while choosing has any effect
("a preview that is not committed changes nothing").

Sender contract (all calls on the asyncio loop, in this order of events):

* ``on_state(state, now)`` for every EngineState the sender accepts;
* ``choose(pending, view, now)`` when the window has room and ``pending`` is
  non-empty. It may return ``None``: "hold for now" (only a gating policy,
  Tail-aware Release, does). The sender then commits nothing and calls
  ``choose`` again after the next event (a completion, a new state, a new
  ready result). A policy never holds while nothing it committed is still
  running, so holding cannot deadlock;
* ``on_commit(item, now)`` once the sender commits the returned item;
* ``on_complete(cid, output_tokens, now)`` when the continuation's model call
  ends (``output_tokens=0``: ended without output, e.g. cancelled).

``uses_leases`` tells the daemon whether the engine side grants prefix leases
for this policy (False for the baselines and ``cache-first-noleases``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ladsd.modes import Retention
from ladsd.records import ContinuationId, EngineState


@dataclass(frozen=True)
class Pending:
    """One ready, uncommitted result in F(t), as the sender knows it."""

    cid: ContinuationId
    ready_time: float  # r_i
    payload_bytes: int  # p_i, after the codec
    frame_bytes: int  # h + p_i
    prefix_digest: str
    payload_digest: str
    workflow_arrival: float  # arrival of the workflow (Tail-aware: oldest first)
    prompt_tokens: int  # full-prompt tokens of the continuation (Tail-aware estimate)


@dataclass(frozen=True)
class SenderView:
    """What the sender knows at decision time besides the pending set."""

    q_b: int  # committed bytes not yet on the wire
    rate: float  # R, bytes/s
    overhead: int  # h
    state: EngineState | None  # latest engine state the sender accepted
    state_seq_before: int  # seq of the state accepted before ``state`` (-1: none)


class Policy(Protocol):
    name: str
    uses_leases: bool  # does the engine side grant prefix leases for this policy?
    retention: Retention  # how the engine protects waiting histories for this policy

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending | None:
        """Return the item to commit next (``pending`` is non-empty), or None to hold.

        Side-effect free: calling it twice without a commit gives the same answer.
        """
        ...

    def on_state(self, state: EngineState, now: float) -> None:
        """Called for every EngineState the sender accepts (engine feedback)."""
        ...

    def on_commit(self, item: Pending, now: float) -> None:
        """Called once the sender commits ``item``."""
        ...

    def on_complete(self, cid: ContinuationId, output_tokens: int, now: float) -> None:
        """Called when the engine finishes the continuation's model call.

        ``output_tokens=0`` means it ended without output (cancelled/aborted).
        """
        ...

    def stats(self) -> dict[str, int]:
        """Counters (promotions, fallbacks, ...) for the run summary."""
        ...
