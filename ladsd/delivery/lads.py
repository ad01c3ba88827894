"""LADS: Cache-first + FIFO leases + turnover priority + bounded intervention.

Spec section 4. When the override is active, the sender may send next a
leased result whose handoff returns the most exclusive quota per second of
delay (``rho_i = E_i / e_i``), so that another pending resident history can
be protected. A *promotion* is a commitment that differs from the
Cache-first choice; after one, the next commitment is Cache-first again.

Only records passing the validity rules of spec 3.4
(:func:`ladsd.records.check_record`) are read; if any record this
decision would read is invalid, the decision is Cache-first and the fallback
is counted by reason.

``choose`` is a pure preview: it remembers its last :class:`Decision` only so
that ``on_commit`` can count it. Counters and the bounded-intervention flag
change in ``on_commit`` alone, so previews that are not committed change
nothing, counters included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ladsd.delivery.base import BasePolicy, Previews, StateIndex, need
from ladsd.delivery.cache_first import cache_first, cache_key
from ladsd.delivery.policy import Pending, SenderView
from ladsd.records import (
    ContinuationId,
    EngineState,
    LeaseRecord,
    LeaseStatus,
    RecordInvalid,
    check_record,
)

# The base order: the pending item the sender would commit with no override.
BaseOrder = Callable[[Sequence[Pending], Mapping[ContinuationId, int]], Pending]
# The override condition on an accepted state at ``now``.
Active = Callable[[EngineState, float], bool]

# Why a decision came out as it did (counted at commit).
OFF = "off"  # override disabled (turnover-off)
BOUNDED = "bounded"  # the previous commitment was a promotion
NO_STATE = "no_state"  # no engine state accepted yet
FALLBACK = "fallback"  # a record failed the validity rules
INACTIVE = "inactive"  # override condition not met
NO_CANDIDATE = "no_candidate"  # override active, nobody eligible
OVERRIDE = "override"  # override active, a candidate chosen (maybe = Cache-first)


def handoff_delay(
    frame_bytes: int, q_b: int, rate: float, kappa: float, w: int, a: int, m: int
) -> float:
    """``T_i = (Q_B + h + p_i) / R + kappa * max(0, w + a + 1 - m)`` (ours); inf if R <= 0."""
    if rate <= 0:
        return math.inf
    return (q_b + frame_bytes) / rate + kappa * max(0, w + a + 1 - m)


def turnover_ratio(exclusive_blocks: int, delay: float) -> float:
    """``rho_i = E_i / e_i`` with ``e_i = T_i`` (ours)."""
    return exclusive_blocks / delay


def fresh_denial(state: EngineState, now: float, max_age_s: float) -> bool:
    """A budget-denial record of the current generation, at most ``max_age_s`` old."""
    return any(
        d.generation == state.generation and -1e-6 <= now - d.time <= max_age_s
        for d in state.denials
    )


def override_active(
    state: EngineState, now: float, theta: float, max_age_s: float, *, denial_only: bool = False
) -> bool:
    """``C > 0 and U >= theta * C``, or a fresh denial of the current generation.

    ``denial_only`` (ours, the ``lads-denial`` ablation): the fresh denial alone. A
    handoff returns quota (``U``), not free blocks (``F``), so the override can only
    help a history the *budget* refused, not one the headroom rule refused.
    """
    if denial_only:
        return fresh_denial(state, now, max_age_s)
    return (state.C > 0 and state.U >= theta * state.C) or fresh_denial(state, now, max_age_s)


def is_eligible(rec: LeaseRecord, delay: float, now: float) -> bool:
    """Active lease with ``E_i > 0``, ``0 < e_i < inf`` and a timely handoff ``t + T_i <= d_i``."""
    return (
        rec.status is LeaseStatus.GRANTED
        and rec.exclusive_blocks > 0
        and 0 < delay < math.inf
        and now + delay <= rec.deadline
    )


def first_invalid(
    pending: Sequence[Pending], ix: StateIndex, view: SenderView, now: float, max_age_s: float
) -> RecordInvalid | None:
    """The first validity rule broken by a record owned by (any version of) a pending item."""
    assert ix.state is not None
    for it in pending:
        rec = ix.lease_by_cid.get(it.cid) or ix.lease_by_turn.get((it.cid.workflow, it.cid.turn))
        if rec is None:
            continue
        bad = check_record(
            ix.state,
            rec,
            cid=it.cid,
            prefix_digest=it.prefix_digest,
            payload_digest=it.payload_digest,
            now=now,
            last_seq=view.state_seq_before,
            max_age_s=max_age_s,
        )
        if bad is not None:
            return bad
    return None


@dataclass(frozen=True)
class Decision:
    choice: Pending
    base: Pending  # the Cache-first choice
    reason: str
    invalid: RecordInvalid | None = None

    @property
    def promoted(self) -> bool:
        return self.choice.cid != self.base.cid


def decide(
    pending: Sequence[Pending],
    view: SenderView,
    now: float,
    ix: StateIndex,
    *,
    theta: float,
    max_age_s: float,
    override: bool,
    after_promotion: bool,
    denial_only: bool = False,
    base_order: BaseOrder = cache_first,
    active: Active | None = None,
) -> Decision:
    """One LADS decision as a pure function of its inputs.

    ``base_order`` and ``active`` replace Cache-first and :func:`override_active`
    (``lads-adaptive``, ours); by default this is the spec's LADS.
    """
    base = base_order(pending, ix.resident)
    if not override:
        return Decision(base, base, OFF)
    if after_promotion:
        return Decision(base, base, BOUNDED)
    state = ix.state
    if state is None:
        return Decision(base, base, NO_STATE)
    bad = first_invalid(pending, ix, view, now, max_age_s)
    if bad is not None:
        return Decision(base, base, FALLBACK, bad)
    on = (
        override_active(state, now, theta, max_age_s, denial_only=denial_only)
        if active is None
        else active(state, now)
    )
    if not on:
        return Decision(base, base, INACTIVE)
    protected = {c for c, r in ix.lease_by_cid.items() if r.status is LeaseStatus.GRANTED}
    # Someone must be able to use the returned quota: an unprotected resident history.
    if not any(ix.resident.get(it.cid, 0) > 0 and it.cid not in protected for it in pending):
        return Decision(base, base, NO_CANDIDATE)
    best: Pending | None = None
    best_rank: tuple = ()
    for it in pending:
        rec = ix.lease_by_cid.get(it.cid)
        if rec is None:
            continue
        delay = handoff_delay(
            it.frame_bytes, view.q_b, view.rate, state.kappa, state.w, state.a, state.m
        )
        if not is_eligible(rec, delay, now):
            continue
        rank = (-turnover_ratio(rec.exclusive_blocks, delay), cache_key(it, ix.resident))
        if best is None or rank < best_rank:
            best, best_rank = it, rank
    if best is None:
        return Decision(base, base, NO_CANDIDATE)
    return Decision(best, base, OVERRIDE)


class Lads(Previews, BasePolicy):
    name = "lads"
    uses_leases = True

    def __init__(
        self,
        *,
        theta: float = 0.75,
        max_age_s: float = 1.0,
        override: bool = True,
        uses_leases: bool | None = None,
        denial_only: bool = False,
    ) -> None:
        super().__init__(uses_leases=uses_leases)
        if not 0 < theta <= 1:
            raise ValueError(f"theta must be in (0, 1], got {theta}")
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self.theta = theta
        self.max_age_s = max_age_s
        self.override = override
        self.denial_only = denial_only
        self.after_promotion = False  # bounded intervention: next commit is Cache-first

    def decide(self, pending: Sequence[Pending], view: SenderView, now: float) -> Decision:
        need(pending)
        return decide(
            pending,
            view,
            now,
            self.index(view.state),
            theta=self.theta,
            max_age_s=self.max_age_s,
            override=self.override,
            after_promotion=self.after_promotion,
            denial_only=self.denial_only,
            base_order=self.base_order(view),
            active=self.override_rule(),
        )

    def base_order(self, view: SenderView) -> BaseOrder:
        """The order the override departs from: Cache-first (a subclass may refine it)."""
        return cache_first

    def override_rule(self) -> Active | None:
        """None: the spec's condition (:func:`override_active`); a subclass may replace it."""
        return None

    def on_commit(self, item: Pending, now: float) -> None:
        super().on_commit(item, now)
        d: Decision | None = self.take(item)
        if d is None:  # committed without a matching preview: cannot be a promotion
            self.after_promotion = False
            return
        self.counts[d.reason] += 1
        if d.invalid is not None:
            self.counts[f"fallback_{d.invalid.value}"] += 1
        self.after_promotion = d.promoted
        if d.promoted:
            self.counts["promotions"] += 1

    def stats(self) -> dict[str, int]:
        return {"promotions": 0, "fallback": 0, **self.counts}


class TurnoverOff(Lads):
    """LADS with the override disabled: Cache-first order, same leases and budget."""

    name = "turnover-off"

    def __init__(
        self, *, theta: float = 0.75, max_age_s: float = 1.0, uses_leases: bool | None = None
    ) -> None:
        super().__init__(theta=theta, max_age_s=max_age_s, override=False, uses_leases=uses_leases)


class LadsDenial(Lads):
    """LADS whose override acts only after a fresh budget denial (ours; an ablation).

    Same leases, budget, base order and bounded intervention; the spec's
    ``U >= theta * C`` trigger is dropped (see :func:`override_active`).
    """

    name = "lads-denial"

    def __init__(
        self, *, theta: float = 0.75, max_age_s: float = 1.0, uses_leases: bool | None = None
    ) -> None:
        super().__init__(
            theta=theta, max_age_s=max_age_s, uses_leases=uses_leases, denial_only=True
        )
