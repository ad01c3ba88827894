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

from ladsd import testing
from ladsd.clock import ManualClock
from ladsd.config import LeaseConfig
from ladsd.engine import budget as bud
from ladsd.engine.sched_leases import LeaseScheduler
from ladsd.records import ContinuationId, HistoryNotice, InventoryItem, Phase, SenderInventory

BS = 16


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


def toks(seed: int, n_blocks: int) -> list[int]:
    return [1000 + seed * 7919 + i for i in range(n_blocks * BS)]


class Book:
    """A lease scheduler on a manual clock (real vLLM scheduler, no model)."""

    def __init__(self) -> None:
        self.s = testing.make_scheduler(LeaseScheduler, num_blocks=64, block_size=BS)
        self.clk = ManualClock(1000.0)
        cfg = LeaseConfig(enabled=True, headroom_blocks=4, lease_lifetime_s=8.0)
        self.s.lease_setup(cfg, 0.0, self.clk)
        self.items: dict[ContinuationId, InventoryItem] = {}
        self.n = 0

    def run(self, tokens: list[int]) -> None:
        """Run a request to completion: its full blocks stay cached (evictable)."""
        self.n += 1
        req = testing.make_request(f"r{self.n}", tokens, max_tokens=2)
        self.s.add_request(req)
        for _ in range(200):  # bounded: a broken scenario fails, never hangs
            if req.is_finished():
                return
            testing.step(self.s)
        raise AssertionError("request did not finish")

    def notice(self, cid: ContinuationId, history: list[int]) -> None:
        key = cid.key()
        n = HistoryNotice(cid, tuple(history), f"p-{key}", f"d-{key}", self.clk(), 500)
        self.items[cid] = InventoryItem(cid, Phase.PENDING, 500, n.ready_time)
        self.s.lease_notice(n)
        self.s.lease_inventory(SenderInventory(self.clk(), tuple(self.items.values()), 0, 1e6))

    def tick(self) -> None:
        self.clk.advance(0.1)
        self.s.lease_tick()
        self.s.check_integrity()

    def spec_budget(self) -> bud.Budget:
        """The budget the spec's evaluation gives for the book's view now (no memo)."""
        book = self.s.lease_book
        table = book.grants.leases.table
        view = book._view(self.clk())
        free = table.pool.get_num_free_blocks()
        return bud.evaluate([c for _, c in view], table.used, free, book.cfg.headroom_blocks)


def test_ticks_reuse_the_demand_and_keep_the_spec_budget(unions: list[int]) -> None:
    b = Book()
    a, c = ContinuationId("wa", 1), ContinuationId("wb", 1)
    b.run(toks(1, 4))
    b.notice(a, toks(1, 4))
    b.run(toks(2, 3))
    b.notice(c, toks(2, 3))
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
    b = Book()
    a, c = ContinuationId("wa", 1), ContinuationId("wb", 1)
    b.run(toks(1, 4))
    b.notice(a, toks(1, 4))
    b.run(toks(2, 3))
    b.notice(c, toks(2, 3))
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
