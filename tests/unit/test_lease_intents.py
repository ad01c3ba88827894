"""The HTTP sessions' lease vocabulary on vLLM's real scheduler (no model).

Intent timing (``expected_wait_s``), retention as a requirement and the published lease
events; then per-continuation lease lifetimes (ours, issue 21 item 4): a notice's
``lifetime_s`` is that continuation's ``l_i``: it stands for ``l`` in the remaining
horizon ``tau``, the deadline ``g_i + l_i``, the drop of a candidate past its expected
use and the ttl-pin cap. A notice without one behaves as before. A manual clock drives
every deadline; HTTP sessions have no sender, so no inventory is published.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from ladsd import testing
from ladsd.engine import budget as bud
from ladsd.modes import Retention
from ladsd.records import ContinuationId, HistoryNotice, LeaseEventKind, LeaseKind
from tests.rigs.leases import BS, T0, Rig, cont, rig, toks

L = 8.0
A = ContinuationId("session-a", 2)
B = ContinuationId("session-b", 2)


def session_rig(**kw: Any) -> Rig:
    """The rig over 64 blocks with ``l`` = L, no sender; a notice's result is 600 bytes."""
    return rig(lifetime=L, payload=600, lists=False, **kw)


# ---- intents and requirements --------------------------------------------------------------


S = ContinuationId("session-a", 2)


def session_notice(r, history: list[int], wait: float | None) -> HistoryNotice:
    return HistoryNotice(S, tuple(history), "p", "", r.clk(), 600, expected_wait_s=wait)


def kinds(r) -> list[tuple[LeaseEventKind, ContinuationId]]:
    return [(e.kind, e.cid) for e in r.s.lease_state().events]


def test_expected_wait_makes_a_session_a_candidate_without_any_inventory() -> None:
    r = rig(num_blocks=64, headroom=4, lifetime=8.0)
    h = toks(1, 6)
    r.run(h)
    # No sender inventory at all (HTTP sessions): the intent's timing is T_B.
    r.s.lease_notice(session_notice(r, h, wait=2.0))
    r.ok()
    assert kinds(r) == [(LeaseEventKind.GRANT, S)]
    assert kinds(r) == []  # each event is published once
    assert r.lease(S) is not None and len(r.lease(S).protected_blocks) == 6


def test_an_expected_wait_beyond_the_lifetime_is_not_near_use() -> None:
    r = rig(num_blocks=64, headroom=4, lifetime=8.0)
    h = toks(1, 6)
    r.run(h)
    r.s.lease_notice(session_notice(r, h, wait=30.0))  # T_B > tau = l: not in N
    assert r.lease(S) is None
    # ... and it is forgotten once it is past its expected use by more than l.
    r.clk.advance(30.0 + 8.0 + 0.1)
    r.s.lease_tick()
    assert r.book.sizes()["pending"] == 0


def test_requirement_is_held_now_or_refused_with_the_reason() -> None:
    r = rig(num_blocks=24, headroom=4, lifetime=8.0)  # 23 usable blocks
    big, h = toks(2, 14), toks(1, 6)
    r.run(big)
    r.run(h)  # both histories resident (evictable)
    assert r.s.lease_require(session_notice(r, h, wait=30.0)) is None  # not near use: held
    assert r.lease(S) is not None
    # Holding big's 14 blocks too would leave 23 - 6 - 14 = 3 < H free: refused, with why.
    other = HistoryNotice(
        ContinuationId("session-b", 1), tuple(big), "p", "", r.clk(), 1, expected_wait_s=30.0
    )
    why = r.s.lease_require(other)
    assert why is not None and why.startswith("headroom")
    assert r.lease(other.cid) is None
    cold = HistoryNotice(ContinuationId("session-c", 1), tuple(toks(9, 4)), "p", "", r.clk(), 1)
    assert r.s.lease_require(cold).startswith("cold")
    r.ok()


def test_requirement_refused_when_leases_are_off() -> None:
    r = rig(enabled=False)
    h = toks(1, 4)
    r.run(h)
    assert r.s.lease_require(session_notice(r, h, wait=1.0)) == "leases are off under this policy"


def test_events_name_handoff_expiry_and_revocation() -> None:
    r = rig(num_blocks=64, headroom=4, lifetime=8.0)
    h = toks(1, 6)
    r.run(h)
    r.s.lease_notice(session_notice(r, h, wait=1.0))
    kinds(r)  # drain the grant
    req = r.add(cont(h), rid="resumed")
    r.s.lease_bind(S, req.request_id)
    r.step()
    assert kinds(r) == [(LeaseEventKind.HANDOFF, S)]
    # expiry
    t = ContinuationId("session-t", 1)
    ht = toks(3, 4)
    r.run(ht)
    r.s.lease_notice(HistoryNotice(t, tuple(ht), "p", "", r.clk(), 1, expected_wait_s=1.0))
    kinds(r)
    r.clk.advance(8.1)
    r.s.lease_tick()
    assert (LeaseEventKind.EXPIRY, t) in kinds(r)
    assert BS == 16


# ---- the rule ------------------------------------------------------------------------------


def test_lease_lifetime_is_l_below_l_then_the_margin_then_the_cap() -> None:
    assert bud.lease_lifetime(8.0, 1.0, 1.5, 64.0) == 8.0  # 1.5 s < l: l
    assert bud.lease_lifetime(8.0, 0.0, 1.5, 64.0) == 8.0
    assert bud.lease_lifetime(8.0, 11.0, 1.5, 64.0) == pytest.approx(16.5)  # the margin
    assert bud.lease_lifetime(8.0, 100.0, 1.5, 64.0) == 64.0  # the cap
    assert bud.lease_lifetime(8.0, 11.0, 1.5, 8.0) == 8.0  # cap = l: the fixed rule


@pytest.mark.parametrize(
    ("life", "wait", "margin", "cap"),
    [(0.0, 1.0, 1.5, 64.0), (8.0, -1.0, 1.5, 64.0), (8.0, math.nan, 1.5, 64.0),
     (8.0, 1.0, 0.0, 64.0), (8.0, 1.0, 1.5, 7.0), (8.0, math.inf, 1.5, 64.0)],
)  # fmt: skip
def test_lease_lifetime_refuses_bad_parameters(
    life: float, wait: float, margin: float, cap: float
) -> None:
    with pytest.raises(ValueError):
        bud.lease_lifetime(life, wait, margin, cap)


# ---- the engine side -----------------------------------------------------------------------


def test_a_long_lifetime_makes_an_11_s_wait_near_use_and_holds_past_l() -> None:
    r = session_rig()
    h = toks(1, 6)
    r.run(h)
    r.notice(A, h, expected_wait_s=11.0, lifetime_s=30.0)  # T_B 11 <= tau 30: near use at readiness
    rec = r.lease(A)
    assert rec is not None and rec.granted_at == T0 and rec.deadline == T0 + 30.0
    r.tick_at(T0 + L + 0.5)  # past g + l: a fixed-l lease would be gone
    assert r.lease(A) is not None and r.counters()["expiries"] == 0
    r.tick_at(T0 + 29.9)
    assert r.lease(A) is not None
    r.tick_at(T0 + 30.0)  # exactly d_i = g_i + l_i
    assert r.lease(A) is None and r.counters()["expiries"] == 1


def test_without_a_lifetime_an_11_s_wait_is_not_near_use_and_ends_at_g_plus_l() -> None:
    r = session_rig()
    h = toks(1, 6)
    r.run(h)
    r.notice(A, h, expected_wait_s=11.0, lifetime_s=None)  # T_B 11 > tau = l = 8: not near use
    assert r.lease(A) is None and r.counters()["grants"] == 0
    r.tick_at(T0 + 3.0)  # T_B has counted down to 8 <= tau: granted now, as before
    rec = r.lease(A)
    assert rec is not None and rec.deadline == T0 + 3.0 + L
    r.tick_at(T0 + 3.0 + L)
    assert r.lease(A) is None and r.counters()["expiries"] == 1


def test_a_candidate_is_kept_until_its_expected_use_plus_its_own_lifetime() -> None:
    r = session_rig()
    cold = toks(5, 4)  # never run: nothing resident, so it stays a candidate
    r.notice(A, cold, expected_wait_s=11.0, lifetime_s=30.0)
    r.tick_at(T0 + 11.0 + L + 0.1)  # past ready + wait + l: kept (l_i = 30)
    assert r.s.lease_book.sizes()["pending"] == 1
    r.tick_at(T0 + 11.0 + 30.0 + 0.1)
    assert r.s.lease_book.sizes()["pending"] == 0


def test_revocation_still_takes_a_long_lifetime_lease_first() -> None:
    r = session_rig(headroom=20)
    ha, hb = toks(1, 10), toks(2, 10)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, expected_wait_s=11.0, lifetime_s=30.0)  # d = T0 + 30
    r.clk.advance(1.0)
    r.notice(B, hb, expected_wait_s=1.0, lifetime_s=None)  # d = T0 + 1 + 8: the earlier deadline
    assert r.lease(A) is not None and r.lease(B) is not None
    big = r.add(toks(9, 29), max_tokens=40)  # 30 blocks once decoding: F falls below H
    for _ in range(200):
        if r.s.kv_cache_manager.block_pool.get_num_free_blocks() < 20:
            break
        testing.step(r.s)
    testing.step(r.s)  # schedule() entry revokes to restore H: latest deadline first
    st = r.s.lease_state()
    assert st.lease_for(A) is None and st.lease_for(B) is not None
    assert st.counters["revocations"] == 1 and st.F >= 20
    r.s.finish_requests(big.request_id, RequestStatus.FINISHED_ABORTED)
    r.s.check_integrity()


def test_ttl_pin_caps_at_the_continuation_s_lifetime() -> None:
    r = session_rig(retention=Retention.TTL_PIN, enabled=False)
    ha, hb = toks(1, 4), toks(2, 4)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, expected_wait_s=11.0, lifetime_s=30.0)  # ttl = 11 + 0.25 * 11 = 13.75 <= 30
    r.notice(B, hb, expected_wait_s=11.0, lifetime_s=None)  # capped at l = 8, as before
    recs = {x.cid: x for x in r.s.lease_state().leases}
    assert recs[A].kind is LeaseKind.PIN and recs[A].deadline == pytest.approx(T0 + 13.75)
    assert recs[B].deadline == pytest.approx(T0 + L)


def test_a_non_positive_lifetime_is_refused() -> None:
    r = session_rig()
    h = toks(1, 2)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="lifetime"):
            r.notice(A, h, expected_wait_s=1.0, lifetime_s=bad)
    assert r.s.lease_book.sizes()["pending"] == 0


def test_a_later_lease_with_a_shorter_lifetime_expires_at_its_own_deadline() -> None:
    """Deadlines are not granted in order: A (l_i 30 s) is scanned past first, then B
    (l 8 s) is granted with the earlier deadline. B expires at its own ``d_i`` at
    ``schedule()`` entry, A at its own, not one step later than either."""
    r = session_rig()
    ha, hb = toks(1, 4), toks(2, 4)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, expected_wait_s=11.0, lifetime_s=30.0)  # d = T0 + 30
    r.clk.advance(1.0)
    testing.step(r.s)  # schedule() entry: nothing due, the next deadline is A's
    r.notice(B, hb, expected_wait_s=1.0, lifetime_s=None)  # d = T0 + 1 + 8: earlier
    da, db = r.lease(A).deadline, r.lease(B).deadline
    assert db < da
    r.clk.t = db - 0.001
    testing.step(r.s)
    assert r.lease(B) is not None
    r.clk.t = db  # exactly B's d_i
    testing.step(r.s)
    assert r.lease(B) is None and r.lease(A) is not None
    r.clk.t = da  # exactly A's
    testing.step(r.s)
    assert r.lease(A) is None and r.s.lease_state().counters["expiries"] == 2
    r.s.check_integrity()
