"""The peers' delivery policies (peers.md sections 2 and 3) on hand-built states, no engine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ladsd.delivery import POLICY_NAMES, make_policy
from ladsd.delivery.hear import HearGuard, cache_aware_key, is_hot
from ladsd.delivery.policy import Pending, SenderView
from ladsd.modes import Retention
from ladsd.records import ContinuationId, EngineState
from tests.rigs import policy

BS = 16  # tokens per block in these states


def item(wf: str, *, r: float = 0.0, prompt: int = 320, p: int = 500) -> Pending:
    """A first-turn result: 500 bytes on a 320-token prompt (20 blocks) unless told."""
    return policy.item(wf, r=r, prompt=prompt, p=p)


def state(resident: dict[ContinuationId, int], *, block_size: int = BS) -> EngineState:
    return policy.engine_state(0.0, seq=1, gen=0, resident=resident, block_size=block_size)


def view(s: EngineState | None) -> SenderView:
    return policy.view(s, seq_before=0)


def drain(pol, pending: list[Pending], v: SenderView, now: float = 0.0) -> list[str]:
    """The workflow names in delivery order."""
    return [x.cid.workflow for x in policy.drain(pol, pending, v, now)]


# --- the peers' identities -------------------------------------------------------------------


def test_registered_with_their_retention_and_no_leases() -> None:
    want = {
        "hear-cache-aware": Retention.NONE,
        "hear-guard": Retention.NONE,
        "hear-session": Retention.SESSION,
        "ttl-pin": Retention.TTL_PIN,
    }
    for name, retention in want.items():
        pol = make_policy(name)
        assert name in POLICY_NAMES and pol.name == name
        assert pol.retention is retention and not pol.uses_leases
    # The shared keyword rule: guard_s is known, and the others ignore it.
    assert make_policy("hear-guard", guard_s=3.0).guard_s == 3.0
    assert make_policy("hear-session", guard_s=3.0).guard_s == 3.0
    make_policy("lads", guard_s=3.0, theta=0.5)
    with pytest.raises(ValueError, match="guard_s"):
        make_policy("hear-guard", guard_s=0.0)


# --- hot / cold -------------------------------------------------------------------------------


def test_hot_threshold_is_half_the_prompt_in_tokens() -> None:
    # 10 blocks of 16 tokens = 160 tokens: hot for a prompt of 320, cold for 321.
    assert is_hot(10, 16, 320) and not is_hot(10, 16, 321)
    assert is_hot(10, 32, 640) and not is_hot(10, 32, 641)  # the block size is used
    assert not is_hot(0, 16, 0)  # nothing resident is never hot
    assert not is_hot(10, 0, 320)  # unknown block size: nothing is hot


def test_cache_aware_hot_first_by_blocks_cold_fcfs() -> None:
    cold1 = item("cold1", r=1.0)  # 9 blocks = 144 < 160: cold despite residency
    hot_small = item("hot_small", r=5.0)  # 10 blocks: exactly 50 %, hot
    hot_big = item("hot_big", r=6.0, prompt=1000)  # 40 blocks of 1000: 64 %, hot
    cold0 = item("cold0", r=0.5)  # not resident
    cold2 = item("cold2", r=2.0)  # not known to the engine
    s = state({cold1.cid: 9, hot_small.cid: 10, hot_big.cid: 40, cold0.cid: 0})
    order = drain(
        make_policy("hear-cache-aware"), [cold1, hot_small, hot_big, cold0, cold2], view(s)
    )
    assert order == ["hot_big", "hot_small", "cold0", "cold1", "cold2"]


def test_cache_aware_reads_block_size_from_the_state() -> None:
    a, b = item("a", r=0.0), item("b", r=1.0)
    resident = {b.cid: 10}  # 10 blocks: hot at 16 tokens per block, cold at 8
    pol = make_policy("hear-cache-aware")
    assert pol.choose([a, b], view(state(resident, block_size=16)), 0.0) == b
    assert pol.choose([a, b], view(state(resident, block_size=8)), 0.0) == a
    assert pol.choose([a, b], view(None), 0.0) == a  # no state: all cold, FCFS


def test_ties_hot_equal_blocks_fcfs_then_identity() -> None:
    x, y, z = item("x", r=2.0), item("y", r=1.0), item("z", r=1.0)
    s = state({x.cid: 12, y.cid: 12, z.cid: 12})
    assert drain(make_policy("hear-cache-aware"), [x, z, y], view(s)) == ["y", "z", "x"]
    assert cache_aware_key(y, dict(s.resident), BS) < cache_aware_key(x, dict(s.resident), BS)


# --- the guard ----------------------------------------------------------------------------------


def test_guard_promotes_exactly_past_w() -> None:
    old_cold = item("old", r=0.0)
    hot = item("hot", r=5.0)
    s = state({hot.cid: 20})
    g = HearGuard(guard_s=10.0)
    assert g.choose([old_cold, hot], view(s), 10.0) == hot  # waited exactly W: not protected
    assert g.choose([old_cold, hot], view(s), 10.001) == old_cold  # longer than W: protected
    g.on_commit(old_cold, 10.001)
    assert g.stats()["promotions"] == 1 and g.stats()["overrides"] == 1
    # hear-cache-aware has no guard: the hot one goes first whatever the wait
    assert make_policy("hear-cache-aware").choose([old_cold, hot], view(s), 100.0) == hot


def test_protected_keep_waiting_order_and_no_later_hot_bypasses() -> None:
    p1 = item("p1", r=0.0)  # cold, protected
    p2 = item("p2", r=1.0)  # hot, protected: still after p1 (waiting order)
    later_hot = [item(f"h{i}", r=8.0 + i) for i in range(3)]  # hotter, not protected
    s = state({p2.cid: 20, **{h.cid: 40 for h in later_hot}})
    g = HearGuard(guard_s=5.0)
    order = drain(g, [*later_hot, p2, p1], view(s), now=11.5)
    assert order == ["p1", "p2", "h0", "h1", "h2"]
    assert g.stats()["promotions"] == 2
    assert g.stats()["overrides"] == 2  # both displaced a hotter h (40 blocks > 20)


def test_guard_without_protected_is_cache_aware_and_counts_nothing() -> None:
    items = [item("a", r=0.0), item("b", r=1.0, prompt=64), item("c", r=2.0)]
    s = state({items[1].cid: 3, items[2].cid: 10})
    g, ca = make_policy("hear-guard"), make_policy("hear-cache-aware")
    assert drain(g, items, view(s), now=3.0) == drain(ca, items, view(s), now=3.0)
    assert g.stats()["promotions"] == 0 and g.stats()["overrides"] == 0


def test_uncommitted_guard_preview_counts_nothing() -> None:
    old, hot = item("old", r=0.0), item("hot", r=9.0)
    s = state({hot.cid: 20})
    g = HearGuard(guard_s=5.0)
    assert g.choose([old, hot], view(s), 6.0) == old  # previewed only
    assert g.stats() == {}
    g.on_commit(hot, 6.0)  # the sender committed something else
    assert g.stats()["promotions"] == 0 and g.stats()["unmatched"] == 1


def test_session_orders_as_guard() -> None:
    old, hot, cold = item("old", r=0.0), item("hot", r=9.0), item("cold", r=8.0)
    s = state({hot.cid: 20})
    want = drain(HearGuard(guard_s=5.0), [old, hot, cold], view(s), now=6.0)
    assert drain(make_policy("hear-session", guard_s=5.0), [old, hot, cold], view(s), 6.0) == want
    assert want == ["old", "hot", "cold"]


def test_ttl_pin_delivers_fifo() -> None:
    a, b, c = item("a", r=2.0), item("b", r=0.0, p=9000), item("c", r=1.0)
    s = state({a.cid: 20})  # residency does not matter to FIFO
    assert drain(make_policy("ttl-pin"), [a, b, c], view(s)) == ["b", "c", "a"]


# --- properties: every registered policy ---------------------------------------------------


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 8))
    names = draw(st.lists(st.sampled_from("abcdefghijk"), min_size=n, max_size=n, unique=True))
    items = [
        item(
            w,
            r=draw(st.floats(0, 30)),
            prompt=draw(st.integers(0, 2000)),
            p=draw(st.integers(0, 5000)),
        )
        for w in names
    ]
    resident = {it.cid: draw(st.integers(0, 80)) for it in items if draw(st.booleans())}
    s = state(resident, block_size=draw(st.sampled_from([0, 16, 32])))
    return items, view(s if draw(st.booleans()) else None), draw(st.floats(0, 60))


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_choose_returns_a_member_and_is_side_effect_free(sc) -> None:
    items, v, now = sc
    for name in POLICY_NAMES:
        pol = make_policy(name, guard_s=5.0)
        before = pol.stats()
        x = pol.choose(items, v, now)
        assert x in items
        assert pol.choose(items, v, now) == x
        assert pol.choose(list(reversed(items)), v, now) == x  # a total order
        assert pol.stats() == before


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_guard_choice_is_the_oldest_protected_else_cache_aware(sc) -> None:
    items, v, now = sc
    g, ca = HearGuard(guard_s=5.0), make_policy("hear-cache-aware")
    protected = [it for it in items if now - it.ready_time > 5.0]
    x = g.choose(items, v, now)
    if protected:
        assert x == min(protected, key=lambda it: (it.ready_time, it.cid))
    else:
        assert x == ca.choose(items, v, now)
