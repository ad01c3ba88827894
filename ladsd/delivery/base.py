"""Shared plumbing for the policies: no-op hooks, counters, a per-state index.

The index turns the latest EngineState's tuples into dicts once per state, so
a decision over 1,000 pending results stays linear.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ladsd.delivery.policy import Pending, SenderView
from ladsd.modes import Retention
from ladsd.records import ContinuationId, EngineState, LeaseRecord


@dataclass(frozen=True)
class StateIndex:
    """Lookups into one EngineState (``state`` None: nothing known, all cold)."""

    state: EngineState | None
    resident: dict[ContinuationId, int]  # cid -> |P_i|
    lease_by_cid: dict[ContinuationId, LeaseRecord]
    lease_by_turn: dict[tuple[str, int], LeaseRecord]  # any version of (workflow, turn)


EMPTY = StateIndex(None, {}, {}, {})


def index_state(state: EngineState | None) -> StateIndex:
    if state is None:
        return EMPTY
    by_turn: dict[tuple[str, int], LeaseRecord] = {}
    for rec in state.leases:
        by_turn.setdefault((rec.cid.workflow, rec.cid.turn), rec)
    return StateIndex(
        state,
        dict(state.resident),
        {rec.cid: rec for rec in state.leases},
        by_turn,
    )


def need(pending: Sequence[Pending]) -> Sequence[Pending]:
    """``pending`` itself; a clear error if it is empty (the sender must not ask then)."""
    if not pending:
        raise ValueError("choose() needs a non-empty pending set")
    return pending


class BasePolicy:
    """No-op hooks and a counter; subclasses implement :meth:`choose`."""

    name: str = "base"
    uses_leases: bool = False
    # Engine-side protection of waiting histories this policy runs with; LADS
    # leases when ``uses_leases``, none otherwise, unless a peer says more.
    retention: Retention | None = None

    def __init__(self, *, uses_leases: bool | None = None) -> None:
        if uses_leases is not None:
            self.uses_leases = uses_leases
        if self.retention is None:
            self.retention = Retention.LADS if self.uses_leases else Retention.NONE
        self.counts: Counter[str] = Counter()
        self._ix: StateIndex = EMPTY

    def index(self, state: EngineState | None) -> StateIndex:
        """The index of ``state``, rebuilt only when the state object changes."""
        if self._ix.state is not state:
            self._ix = index_state(state)  # a cache: never changes an answer
        return self._ix

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending | None:
        raise NotImplementedError

    def on_state(self, state: EngineState, now: float) -> None:
        pass

    def on_commit(self, item: Pending, now: float) -> None:
        self.counts["commits"] += 1

    def on_complete(self, cid: ContinuationId, output_tokens: int, now: float) -> None:
        if output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {output_tokens} for {cid.key()}")

    def stats(self) -> dict[str, int]:
        return dict(self.counts)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} leases={self.uses_leases}>"


class Previews:
    """Choose by a pure ``decide``; keep its decision to judge the commit that follows.

    ``choose`` remembers the decision for ``on_commit`` only (never read by
    ``choose``), so a preview that is not committed changes nothing.
    :meth:`take` hands it over once, or None (counted ``unmatched``) when the
    committed item is not the one previewed.
    """

    _preview: Any = None
    counts: Counter[str]

    def decide(self, pending: Sequence[Pending], view: SenderView, now: float) -> Any:
        raise NotImplementedError

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
        d = self.decide(pending, view, now)
        self._preview = d
        return d.choice

    def take(self, item: Pending) -> Any:
        """The decision that chose ``item``, once; None if none did."""
        d, self._preview = self._preview, None
        if d is None or d.choice.cid != item.cid:
            self.counts["unmatched"] += 1
            return None
        return d
