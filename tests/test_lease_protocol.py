"""The daemon's lease vocabulary on vLLM's real scheduler (no model): intent timing
(``expected_wait_s``), retention as a requirement, and the published lease events."""

from __future__ import annotations

from ladsd.records import ContinuationId, HistoryNotice, LeaseEventKind
from tests.test_leases import BS, cont, rig, toks

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
