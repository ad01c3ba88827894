"""Controller CPU on ``captured`` (issue 23 item 5): the budget's demand is not re-unioned.

``D(t) = |union P_i|`` over the near-use set was computed on every 100 ms tick;
:class:`~ladsd.engine.budget.DemandMemo` reuses it while the near set holds the
same prefixes. Model-free for the memo itself; on vLLM's real Scheduler /
KVCacheManager (no model) for the lease book's ticks, whose budgets must be the
spec's (:func:`~ladsd.engine.budget.evaluate` without the memo).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ladsd.engine import budget as bud
from ladsd.records import ContinuationId
from tests.rigs import book as rigs
from tests.rigs.book import toks


def cand(key: str, blocks: frozenset[int]) -> bud.Candidate:
    return bud.Candidate(key, blocks, 5.0, 1.0)


@pytest.fixture
def unions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the unions of prefixes (``budget.demand`` calls)."""
    calls: list[int] = []
    real = bud.demand

    def counted(near: Any) -> int:
        calls.append(1)
        return real(near)

    monkeypatch.setattr(bud, "demand", counted)
    return calls


def test_the_memo_answers_as_demand_does() -> None:
    rng = random.Random(3)
    pool = [frozenset(rng.sample(range(40), rng.randrange(0, 12))) for _ in range(8)]
    memo = bud.DemandMemo()
    for _ in range(400):
        near = [cand(f"c{i}", rng.choice(pool)) for i in range(rng.randrange(0, 6))]
        if rng.random() < 0.3:  # an equal prefix as a new object (a fresh lookup)
            near = [cand(c.key, frozenset(c.prefix)) for c in near]
        assert memo(near) == bud.demand(near)


def test_an_unchanged_near_set_is_unioned_once(unions: list[int]) -> None:
    a, b = frozenset(range(10)), frozenset(range(5, 20))
    memo = bud.DemandMemo()
    near = [cand("a", a), cand("b", b)]
    assert [memo(near) for _ in range(5)] == [20] * 5
    assert len(unions) == 1
    assert memo([cand("a", a)]) == 10  # the set changed: unioned anew
    assert memo([cand("a", a), cand("b", frozenset(range(5, 25)))]) == 25  # a prefix grew
    assert len(unions) == 3
    cands = [cand("a", a), cand("b", b), bud.Candidate("far", b, 5.0, 9.0)]  # far: not near
    assert bud.evaluate(cands, 0, 100, 10, memo) == bud.evaluate(cands, 0, 100, 10)


class Book(rigs.Book):
    """The book rig, with the spec's budget of its view."""

    def spec_budget(self) -> bud.Budget:
        """The budget the spec's evaluation gives for the book's view now (no memo)."""
        book = self.s.lease_book
        table = book.grants.leases.table
        view = book._view(self.clk())
        free = table.pool.get_num_free_blocks()
        return bud.evaluate([c for _, c in view], table.used, free, book.cfg.headroom_blocks)


def two_waiting() -> tuple[Book, ContinuationId, ContinuationId]:
    """A book with two waiting histories, of 4 and 3 resident blocks."""
    b = Book()
    a, c = ContinuationId("wa", 1), ContinuationId("wb", 1)
    b.run(toks(1, 4))
    b.notice(a, toks(1, 4))
    b.run(toks(2, 3))
    b.notice(c, toks(2, 3))
    return b, a, c


def test_ticks_reuse_the_demand_and_keep_the_spec_budget(unions: list[int]) -> None:
    b, a, c = two_waiting()
    grants = b.s.lease_book.grants
    assert grants.budget.D == 7 and len(grants.budget.near) == 2
    n = len(unions)
    for _ in range(5):
        b.tick()
        assert grants.budget == b.spec_budget()
    assert len(unions) == n + 5  # only spec_budget's five unions: every tick reused D
    b.s.lease_cancel(c)  # the near set shrinks: the next tick unions anew
    b.tick()
    assert grants.budget.D == 4 and grants.budget == b.spec_budget()
    assert len(unions) == n + 7


def test_is_near_is_membership_of_the_near_use_set() -> None:
    rng = random.Random(8)
    cands = [
        bud.Candidate(
            i,
            frozenset(range(rng.randrange(0, 3))),
            rng.choice((-1.0, 0.0, 2.0, 5.0)),
            rng.choice((0.0, 2.0, 5.0, 9.0, float("inf"))),
        )
        for i in range(300)
    ]
    near = {c.key for c in bud.near_use_set(cands)}
    assert [bud.is_near(c) for c in cands] == [c.key in near for c in cands]
    assert 0 < len(near) < len(cands)


def test_a_tick_judges_the_near_use_set_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget's evaluation builds N(t); replenishment judges it in place (same grants)."""
    b, a, c = two_waiting()
    assert {r.cid for r in b.s.lease_state().leases} == {a, c}
    calls: list[int] = []
    real = bud.near_use_set

    def counted(cands: Any) -> list[bud.Candidate]:
        calls.append(1)
        return real(cands)

    monkeypatch.setattr(bud, "near_use_set", counted)
    b.s.lease_cancel(c)  # a release: the next replenishment may grant again
    b.tick()
    assert len(calls) == 1  # the evaluation's; replenishment built no second set
    assert {r.cid for r in b.s.lease_state().leases} == {a}


def scenario() -> list[Any]:
    """Grants, ticks, a growing prefix, a cancellation and eviction; every published state."""
    b = Book()
    a, c = ContinuationId("wa", 1), ContinuationId("wb", 1)
    out = []
    b.run(toks(1, 6))
    b.notice(a, toks(1, 6) + toks(2, 2))
    out.append(b.s.lease_state())
    b.run(toks(5, 3))
    b.notice(c, toks(5, 3))
    for _ in range(3):
        b.tick()
        out.append(b.s.lease_state())
    b.run(toks(1, 6) + toks(2, 2) + toks(3, 1))  # a's prefix grows to 8 blocks
    b.tick()
    out.append(b.s.lease_state())
    b.s.lease_cancel(a)
    b.run(toks(7, 40))  # needs most of the pool: evicts cached blocks
    for _ in range(2):
        b.tick()
        out.append(b.s.lease_state())
    return out


def test_published_states_are_the_same_without_the_memo_and_in_place_near_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = scenario()
    monkeypatch.setattr(bud.DemandMemo, "__call__", lambda self, near: bud.demand(near))
    monkeypatch.setattr(bud, "is_near", lambda c: c in bud.near_use_set([c]))
    slow = scenario()
    assert fast == slow
    assert any(s.leases for s in fast) and len({s.generation for s in fast}) == len(fast)
