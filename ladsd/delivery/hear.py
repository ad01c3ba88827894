"""HEAR's delivery orders (peers.md section 2): cache-aware, plus the waiting guard W.

In the replay harness the sender plays HEAR's harness: the pending results
are its ready requests, the delivery order is its admission order.

* **Hot** (``is_hot``): the reusable resident prefix covers at least 50 % of
  the prompt, ``|P_i| * block_size >= 0.5 * prompt_tokens`` with
  ``|P_i| > 0``. ``|P_i|`` is the engine's published resident prefix (blocks
  matched from the start, stopping at the first miss); ``prompt_tokens`` is
  the continuation's full prompt (history + observation). Without an engine
  state (or with ``block_size`` 0) nothing is hot.
* **Cache-aware** (``cache_aware_key``): hot before cold; hot by more reusable
  blocks first, then FCFS; cold in FCFS order (ready time, then identity).
* **Guard** (``guard_key``): a result that has waited *longer than* ``W``
  seconds since ready (``now - r_i > W``) is *protected*: protected results
  go before every unprotected one (hot or cold), in waiting order (ready
  time, then identity), so no later hot result bypasses them.

``W`` (``guard_s``): HEAR publishes 40 s and 60 s; peers.md sets 10 s at paper
scale *(ours)*. ladsd's link and timing constants are the paper's in every
profile (only token quantities scale, and the link rate is dilated to keep
the calibrated link/engine ratio), so 10 s is the default in every profile;
``policy_for`` may pass another ``guard_s``.

The three HEAR entries form a cumulative ladder *(ours)*: ``hear-cache-aware``
-> ``hear-guard`` (+ W) -> ``hear-session`` (+ session-aware retention on the
engine side, ``Retention.SESSION``; same delivery order as ``hear-guard``),
so each step adds one of HEAR's mechanisms. None of them grants LADS leases.

Counters (``hear-guard``, ``hear-session``), taken at commit only (a preview
that is not committed changes nothing):

* ``promotions``: commitments of a protected result (each was promoted to
  the protected class at W while it waited; counted once, when it is sent);
* ``overrides``: commitments where the guard changed the cache-aware choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ladsd.delivery.base import BasePolicy, Previews, need
from ladsd.delivery.policy import Pending, SenderView
from ladsd.modes import Retention
from ladsd.records import ContinuationId, EngineState

HOT_SHARE = 0.5  # hot: resident prefix covers >= 50 % of the prompt
GUARD_S = 10.0  # W at paper scale (ours; HEAR publishes 40 s and 60 s)


def is_hot(blocks: int, block_size: int, prompt_tokens: int) -> bool:
    """``|P_i| > 0`` and ``|P_i| * block_size >= HOT_SHARE * prompt_tokens``."""
    return blocks > 0 and blocks * block_size >= HOT_SHARE * prompt_tokens


def cache_aware_key(
    item: Pending, resident: Mapping[ContinuationId, int], block_size: int
) -> tuple:
    """Hot first (more reusable blocks first), then cold; FCFS within equals."""
    blocks = resident.get(item.cid, 0)
    if is_hot(blocks, block_size, item.prompt_tokens):
        return (0, -blocks, item.ready_time, item.cid)
    return (1, 0, item.ready_time, item.cid)


def is_protected(item: Pending, now: float, guard_s: float) -> bool:
    """Waited longer than ``W`` since ready: ``now - r_i > guard_s``."""
    return now - item.ready_time > guard_s


def guard_key(
    item: Pending,
    resident: Mapping[ContinuationId, int],
    block_size: int,
    now: float,
    guard_s: float,
) -> tuple:
    """Protected first in waiting order, then the cache-aware order."""
    if is_protected(item, now, guard_s):
        return (0, item.ready_time, item.cid)
    return (1, cache_aware_key(item, resident, block_size))


def block_size_of(state: EngineState | None) -> int:
    """Tokens per block of the latest state (0: no state, nothing is hot)."""
    return 0 if state is None else state.block_size


class HearCacheAware(BasePolicy):
    name = "hear-cache-aware"
    uses_leases = False
    retention = Retention.NONE

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
        resident, bs = self.index(view.state).resident, block_size_of(view.state)
        return min(need(pending), key=lambda it: cache_aware_key(it, resident, bs))


@dataclass(frozen=True)
class GuardDecision:
    choice: Pending
    base: Pending  # the cache-aware choice
    protected: bool  # the choice waited longer than W at decision time


class HearGuard(Previews, HearCacheAware):
    name = "hear-guard"

    def __init__(self, *, guard_s: float = GUARD_S, uses_leases: bool | None = None) -> None:
        super().__init__(uses_leases=uses_leases)
        if not guard_s > 0:
            raise ValueError(f"guard_s must be > 0, got {guard_s}")
        self.guard_s = guard_s

    def decide(self, pending: Sequence[Pending], view: SenderView, now: float) -> GuardDecision:
        """One decision as a pure function of its inputs (and ``guard_s``)."""
        resident, bs = self.index(view.state).resident, block_size_of(view.state)
        base = min(need(pending), key=lambda it: cache_aware_key(it, resident, bs))
        choice = min(pending, key=lambda it: guard_key(it, resident, bs, now, self.guard_s))
        return GuardDecision(choice, base, is_protected(choice, now, self.guard_s))

    def on_commit(self, item: Pending, now: float) -> None:
        super().on_commit(item, now)
        d: GuardDecision | None = self.take(item)
        if d is None:  # no matching preview: judged at commit time
            self.counts["promotions"] += int(is_protected(item, now, self.guard_s))
            return
        self.counts["promotions"] += int(d.protected)
        self.counts["overrides"] += int(d.choice.cid != d.base.cid)


class HearSession(HearGuard):
    """``hear-guard``'s order with HEAR's session-aware retention on the engine side."""

    name = "hear-session"
    retention = Retention.SESSION
