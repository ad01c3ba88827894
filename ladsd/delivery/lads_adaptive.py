"""LADS adaptive (ours, issue 23): the spec's LADS plus three rules.

``lads`` stays the paper's mechanism, unchanged; ``lads-adaptive`` is the same
leases, budget, turnover priority and bounded intervention, plus:

1. **Regime-aware override** (:func:`regime_override`): the spec's condition
   (``U >= theta * C`` or a fresh denial) acts while the recent failed grants
   are budget denials and stands down while they are headroom refusals: a
   handoff returns quota (``U``) but frees no block (``F``), so a promotion
   cannot help a history the headroom rule refused.
2. **Progress in the base order** (:func:`progress_first`): Smith's rule
   on the residency classes, weighted by progress. Among resident frames,
   the smallest ``size / calls done`` goes first, ``size`` the workflow's
   mean frame (:class:`FrameMeans`): a frame's link time is what it costs
   every frame behind it, and the workflow further along is the one it
   finishes soonest; the mean keeps a workflow's place from reshuffling with
   each frame's jitter. Frames of one synchronized round (a cohort's burst)
   have done as many calls, so there the smaller workflows go first; no
   band is tuned. Cold means the state says ``|P_i| == 0``
   (:func:`known_cold`: a result no state lists yet is presumed resident);
   cold frames stay in Cache-first's order. With no engine state yet,
   Cache-first itself. (Before 2026-12-05 ``size`` was the frame's own bytes
   and unknown was cold; before 2026-12-04 progress was ``|P_i|`` over the
   whole class, and before 2026-12-03 a one-block band of frame size:
   docs/design-decisions.md.)
3. **Soft protection** (engine side, ``Retention.LADS_SESSION``): the waiting
   histories no lease holds get HEAR session's free-queue order (evicted
   last), at no budget cost (:mod:`ladsd.engine.lease_sessions`).

Counters (at commit): ``stood_down`` (the spec would have acted, the headroom
regime held it back), ``progress`` (the progress rule moved the base choice
off Cache-first's), and LADS's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ladsd.delivery.cache_first import cache_first, cache_key
from ladsd.delivery.lads import INACTIVE, Active, BaseOrder, Decision, Lads, override_active
from ladsd.delivery.policy import Pending, SenderView
from ladsd.modes import Retention
from ladsd.records import ContinuationId, DenialEvent, EngineState, RefusalEvent


def failed_grants(state: EngineState, now: float, max_age_s: float) -> tuple[int, int]:
    """(budget denials, headroom refusals) that are recent (ours).

    Recent: the record-age rule of spec 3.4, as for a fresh denial: of the
    current generation and at most ``max_age_s`` old.
    """

    def recent(events: Sequence[DenialEvent | RefusalEvent]) -> int:
        g = state.generation
        return sum(1 for e in events if e.generation == g and -1e-6 <= now - e.time <= max_age_s)

    return recent(state.denials), recent(state.refusals)


def headroom_regime(state: EngineState, now: float, max_age_s: float) -> bool:
    """Recent failed grants are mostly headroom refusals (ours): more refusals than denials."""
    denials, refusals = failed_grants(state, now, max_age_s)
    return refusals > denials


def regime_check(
    state: EngineState, now: float, theta: float, max_age_s: float
) -> tuple[bool, bool]:
    """Rule 1 and what it did: (acts, stood down), each condition evaluated once.

    Stood down: the spec's condition holds but the headroom regime holds it back.
    """
    spec = override_active(state, now, theta, max_age_s)
    if headroom_regime(state, now, max_age_s):
        return False, spec
    return spec, False


def regime_override(state: EngineState, now: float, theta: float, max_age_s: float) -> bool:
    """Rule 1 (ours): the spec's override condition, except in a headroom regime.

    Acts on ``U >= theta * C`` (or a fresh denial) while the recent failed
    grants are budget denials (or there are none); stands down while they are
    headroom refusals, since a handoff returns quota but frees no blocks.
    """
    return regime_check(state, now, theta, max_age_s)[0]


class FrameMeans:
    """Each workflow's committed frame bytes: the stable size of rule 2 (ours).

    Owns: a (sum, count) per workflow, the ``cap`` most recently sent
    workflows only (a daemon sees workflows without end; one forgotten is
    sized by its own frame again). Contract: :meth:`add` once per commit (the
    sender thread, as every policy hook); :meth:`mean` reads only.
    """

    def __init__(self, cap: int = 65536) -> None:
        if cap < 1:
            raise ValueError(f"FrameMeans cap must be >= 1, got {cap}")
        self.cap = cap
        self._sums: dict[str, tuple[int, int]] = {}

    def add(self, item: Pending) -> None:
        total, n = self._sums.pop(item.cid.workflow, (0, 0))
        self._sums[item.cid.workflow] = (total + item.frame_bytes, n + 1)  # now the newest
        if len(self._sums) > self.cap:
            del self._sums[next(iter(self._sums))]  # the least recently sent

    def mean(self, item: Pending) -> float:
        """The workflow's mean frame, ``item``'s included (its first: ``item``'s bytes)."""
        total, n = self._sums.get(item.cid.workflow, (0, 0))
        return (total + item.frame_bytes) / (n + 1)

    def __len__(self) -> int:
        return len(self._sums)


def known_cold(item: Pending, resident: Mapping[ContinuationId, int]) -> bool:
    """Cold for rule 2: the state says ``|P_i| == 0``. Unknown is presumed resident (ours).

    A result the latest state does not list yet has just finished its model
    call, so its history was in use moments ago; Cache-first's "unknown is
    cold" keeps it behind every listed result until the next state (up to a
    tick), whoever is further along.
    """
    n = resident.get(item.cid)
    return n is not None and n <= 0


def progress_key(
    item: Pending, resident: Mapping[ContinuationId, int], size: float | None = None
) -> tuple:
    """Smith's rule on the residency classes (ours): ``(cold?, size / calls done, arrival, k_i)``.

    Exchange argument: sending ``b`` before ``a`` delays ``a`` by ``size_b / R``
    and saves ``b`` ``size_a / R``; weighting each workflow by its progress
    (calls done, the continuation's turn), ``b`` goes first iff
    ``size_b / w_b < size_a / w_a``. Not ``|P_i|``: within one round every
    workflow has done as many calls, and a history the pool has half evicted
    is not behind (sent last, its recompute ends the round; 2026-12-04 runs).
    ``size``: the workflow's mean frame (:class:`FrameMeans`; default the
    frame's own bytes), so a workflow's place does not reshuffle with each
    frame's few-percent jitter (2026-12-05 runs). Cold (:func:`known_cold`):
    Cache-first's order. Equal ratios: the older workflow, then ``k_i``.
    """
    if known_cold(item, resident):
        return (True, 0.0, 0.0, cache_key(item, resident))
    size = item.frame_bytes if size is None else size
    w = max(item.cid.turn, 1)
    return (False, size / w, item.workflow_arrival, cache_key(item, resident))


def progress_choice(
    pending: Sequence[Pending],
    resident: Mapping[ContinuationId, int],
    means: FrameMeans | None = None,
) -> tuple[Pending, bool]:
    """Rule 2 and what it did: (the choice, moved off Cache-first's choice)."""
    if means is None:
        choice = min(pending, key=lambda it: progress_key(it, resident))
    else:
        choice = min(pending, key=lambda it: progress_key(it, resident, means.mean(it)))
    return choice, choice.cid != cache_first(pending, resident).cid


def progress_first(
    pending: Sequence[Pending],
    resident: Mapping[ContinuationId, int],
    means: FrameMeans | None = None,
) -> Pending:
    """Rule 2 (ours): Smith's rule on the residency classes (:func:`progress_key`)."""
    return progress_choice(pending, resident, means)[0]


@dataclass
class _Note:
    """What one decision's hooks did (reset by every ``decide``)."""

    moved: bool = False
    stood_down: bool = False


@dataclass(frozen=True)
class AdaptiveDecision(Decision):
    moved: bool = False  # the progress rule moved the base choice off Cache-first's
    stood_down: bool = False  # the spec's override would have acted; the regime rule did not


class LadsAdaptive(Lads):
    """LADS + regime-aware override + progress in the base order + soft protection (ours)."""

    name = "lads-adaptive"
    retention = Retention.LADS_SESSION

    def __init__(
        self, *, theta: float = 0.75, max_age_s: float = 1.0, uses_leases: bool | None = None
    ) -> None:
        super().__init__(theta=theta, max_age_s=max_age_s, uses_leases=uses_leases)
        self._note = _Note()
        self.means = FrameMeans()

    def base_order(self, view: SenderView) -> BaseOrder:
        if view.state is None:  # nothing known of residency yet: Cache-first itself
            return cache_first
        note, means = self._note, self.means

        def order(pending: Sequence[Pending], resident: Mapping[ContinuationId, int]) -> Pending:
            choice, note.moved = progress_choice(pending, resident, means)
            return choice

        return order

    def override_rule(self) -> Active | None:
        theta, age, note = self.theta, self.max_age_s, self._note

        def active(state: EngineState, now: float) -> bool:
            on, note.stood_down = regime_check(state, now, theta, age)
            return on

        return active

    def decide(self, pending: Sequence[Pending], view: SenderView, now: float) -> Decision:
        """LADS's decision; the hooks note what they did, so nothing is evaluated twice.

        A stand-down counts only where the override hook decided (``INACTIVE``).
        """
        note = self._note  # reset in place: a hook built earlier writes the same note
        note.moved = note.stood_down = False
        d = super().decide(pending, view, now)
        stood = d.reason == INACTIVE and note.stood_down
        return AdaptiveDecision(d.choice, d.base, d.reason, d.invalid, note.moved, stood)

    def on_commit(self, item: Pending, now: float) -> None:
        d = self._preview
        super().on_commit(item, now)
        self.means.add(item)
        if isinstance(d, AdaptiveDecision) and d.choice.cid == item.cid:
            self.counts["progress"] += int(d.moved)
            self.counts["stood_down"] += int(d.stood_down)

    def stats(self) -> dict[str, int]:
        return {"progress": 0, "stood_down": 0, **super().stats()}


__all__ = [
    "FrameMeans",
    "LadsAdaptive",
    "known_cold",
    "failed_grants",
    "headroom_regime",
    "progress_choice",
    "progress_first",
    "progress_key",
    "regime_check",
    "regime_override",
]
