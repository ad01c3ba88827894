"""``lads-adaptive`` evaluates each rule once per decision (issue 23 item 5), same answers.

Model-free (hand-built EngineStates): the base order (:func:`cache_first` under the
progress rule) and the spec's condition (:func:`override_active` under the regime
rule) run once per ``decide``; the ``progress`` and ``stood_down`` counts come from
what the hooks noted and stay what they were.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from ladsd.config import FRAME_OVERHEAD as H
from ladsd.delivery import lads_adaptive
from ladsd.delivery.lads import INACTIVE, OVERRIDE
from ladsd.delivery.lads_adaptive import AdaptiveDecision, LadsAdaptive
from ladsd.delivery.policy import Pending, SenderView
from ladsd.records import ContinuationId, EngineState, LeaseRecord, RefusalEvent
from tests.rigs.policy import item as rig_item

GEN = 7
T = 10.0
BS = 16


def item(
    wf: str, p: int, *, r: float = 0.0, arrival: float | None = None, turn: int = 1
) -> Pending:
    return rig_item(wf, p=p, r=r, arrival=arrival, turn=turn)


def lease(it: Pending, exclusive: int) -> LeaseRecord:
    cid = it.cid
    blocks = tuple(range(exclusive))
    return LeaseRecord(cid, it.prefix_digest, it.payload_digest, blocks, exclusive, 5.0, 13.0, GEN)


def view(st: EngineState) -> SenderView:
    return SenderView(q_b=0, rate=4000.0, overhead=H, state=st, state_seq_before=2)


def capped(used: int, refusals: tuple[RefusalEvent, ...] = ()) -> tuple[list[Pending], EngineState]:
    """A and B leased, C resident and unprotected; ``U = used`` of ``C = 100``."""
    a, b, c = item("A", 1000, r=1.0), item("B", 3000, r=2.0, turn=4), item("C", 6000, r=3.0)
    st = EngineState(
        time=T, seq=3, generation=GEN, U=used, B=100, C=100,
        leases=(lease(a, 2), lease(b, 40)),
        resident=((a.cid, 30), (b.cid, 50), (c.cid, 60)),
        refusals=refusals, block_size=BS,
    )  # fmt: skip
    return [a, b, c], st


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count the calls of the two rules' inner evaluations, as lads_adaptive names them."""
    n: Counter[str] = Counter()

    def counted(name: str) -> Callable[..., Any]:
        real = getattr(lads_adaptive, name)

        def f(*a: Any, **kw: Any) -> Any:
            n[name] += 1
            return real(*a, **kw)

        return f

    for name in ("cache_first", "override_active"):
        monkeypatch.setattr(lads_adaptive, name, counted(name))
    return n


def test_inactive_decision_evaluates_each_rule_once(calls: Counter[str]) -> None:
    pending, st = capped(used=10)  # U < theta * C, no denial: the spec's override is off
    pol = LadsAdaptive()
    d = pol.decide(pending, view(st), T)
    assert isinstance(d, AdaptiveDecision)
    # The base order's choice (Smith's rule): B, the fewest frame bytes per call done
    # (3000 / 4 against A's 1000 / 1 and C's 6000 / 1), passes A.
    assert d.reason == INACTIVE and d.choice == pending[1] and d.moved and not d.stood_down
    assert calls == {"cache_first": 1, "override_active": 1}


def test_stand_down_is_counted_from_one_evaluation(calls: Counter[str]) -> None:
    refused = RefusalEvent(ContinuationId("C", 1), T - 0.3, GEN, free=5, taken=60)
    pending, st = capped(used=100, refusals=(refused,))  # spec: on; headroom regime: off
    pol = LadsAdaptive()
    d = pol.choose(pending, view(st), T)
    assert d == pending[1]  # the base order's: B, by Smith's rule (no promotion)
    assert calls == {"cache_first": 1, "override_active": 1}
    pol.on_commit(d, T)
    assert pol.stats()["stood_down"] == 1 and pol.stats()["promotions"] == 0
    # Not in a headroom regime: the override acts (B's handoff), nothing stood down.
    pending, st = capped(used=100)
    calls.clear()
    d2 = pol.decide(pending, view(st), T)
    assert d2.reason == OVERRIDE and d2.choice == pending[1] and not d2.stood_down
    assert calls == {"cache_first": 1, "override_active": 1}


def test_progress_move_is_counted_from_one_base_order(calls: Counter[str]) -> None:
    x = item("X", 300, r=1.0, arrival=5.0)  # Cache-first's choice (smallest frame)
    z = item("Z", 400, r=2.0, arrival=1.0, turn=2)  # same class, smaller per call done: picked
    st = EngineState(
        time=T, seq=3, generation=GEN, resident=((x.cid, 4), (z.cid, 20)), block_size=BS
    )
    pol = LadsAdaptive()
    d = pol.decide([x, z], view(st), T)
    assert isinstance(d, AdaptiveDecision) and d.choice == z and d.base == z and d.moved
    assert calls["cache_first"] == 1
    pol.choose([x, z], view(st), T)
    pol.on_commit(z, T)
    assert pol.stats()["progress"] == 1
    # In a headroom regime too (rule 1's signal) the same order: Z goes first.
    refused = RefusalEvent(ContinuationId("Q", 1), T - 0.3, GEN, free=5, taken=60)
    calls.clear()
    d2 = pol.decide([x, z], view(replace(st, refusals=(refused,))), T)
    assert isinstance(d2, AdaptiveDecision) and d2.choice == z and d2.moved
    assert calls == {"cache_first": 1, "override_active": 1}
