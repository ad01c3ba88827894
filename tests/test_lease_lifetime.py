"""Per-continuation lease lifetimes (ours, issue 21 item 4) on vLLM's real scheduler.

A notice's ``lifetime_s`` is that continuation's ``l_i``: it stands for ``l`` in the
remaining horizon ``tau``, the deadline ``g_i + l_i``, the drop of a candidate past
its expected use and the ttl-pin cap. A notice without one behaves as before.
No model; a manual clock drives every deadline.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from ladsd import testing
from ladsd.clock import ManualClock
from ladsd.config import LeaseConfig
from ladsd.engine import budget as bud
from ladsd.engine.sched_leases import LeaseScheduler
from ladsd.modes import Retention
from ladsd.records import ContinuationId, HistoryNotice, LeaseKind

BS = 16
L = 8.0
T0 = 1000.0
A = ContinuationId("session-a", 2)
B = ContinuationId("session-b", 2)


def toks(seed: int, n_blocks: int) -> list[int]:
    return [1000 + seed * 7919 + i for i in range(n_blocks * BS)]


class Rig:
    """A lease scheduler over 64 blocks with a manual clock (no sender: HTTP sessions)."""

    def __init__(
        self, headroom: int = 4, retention: Retention = Retention.LADS, enabled: bool = True
    ) -> None:
        self.s: Any = testing.make_scheduler(LeaseScheduler, num_blocks=64, block_size=BS)
        self.clk = ManualClock(T0)
        cfg = LeaseConfig(enabled=enabled, headroom_blocks=headroom, lease_lifetime_s=L)
        self.s.lease_setup(cfg, 0.0, self.clk, retention=retention)
        self.n = 0

    def add(self, tokens: list[int], max_tokens: int = 2) -> Any:
        self.n += 1
        req = testing.make_request(f"r{self.n}", tokens, max_tokens=max_tokens)
        self.s.add_request(req)
        return req

    def run(self, tokens: list[int]) -> None:
        """Run a request to completion: its blocks stay cached (evictable)."""
        req = self.add(tokens)
        for _ in range(200):  # bounded: a broken scenario fails instead of hanging
            if req.is_finished():
                return
            testing.step(self.s)
            self.s.check_integrity()
        raise AssertionError("request did not finish")

    def notice(self, cid: ContinuationId, h: list[int], wait: float, life: float | None) -> None:
        n = HistoryNotice(cid, tuple(h), "p", "", self.clk(), 600, expected_wait_s=wait,
                          lifetime_s=life)  # fmt: skip
        self.s.lease_notice(n)
        self.s.check_integrity()

    def tick_at(self, t: float) -> None:
        self.clk.advance(t - self.clk())
        self.s.lease_tick()
        self.s.check_integrity()

    def lease(self, cid: ContinuationId) -> Any:
        return self.s.lease_state().lease_for(cid)

    def counters(self) -> dict[str, float]:
        return self.s.lease_state().counters


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
    r = Rig()
    h = toks(1, 6)
    r.run(h)
    r.notice(A, h, wait=11.0, life=30.0)  # T_B 11 <= tau 30: near use at readiness
    rec = r.lease(A)
    assert rec is not None and rec.granted_at == T0 and rec.deadline == T0 + 30.0
    r.tick_at(T0 + L + 0.5)  # past g + l: a fixed-l lease would be gone
    assert r.lease(A) is not None and r.counters()["expiries"] == 0
    r.tick_at(T0 + 29.9)
    assert r.lease(A) is not None
    r.tick_at(T0 + 30.0)  # exactly d_i = g_i + l_i
    assert r.lease(A) is None and r.counters()["expiries"] == 1


def test_without_a_lifetime_an_11_s_wait_is_not_near_use_and_ends_at_g_plus_l() -> None:
    r = Rig()
    h = toks(1, 6)
    r.run(h)
    r.notice(A, h, wait=11.0, life=None)  # T_B 11 > tau = l = 8: not near use
    assert r.lease(A) is None and r.counters()["grants"] == 0
    r.tick_at(T0 + 3.0)  # T_B has counted down to 8 <= tau: granted now, as before
    rec = r.lease(A)
    assert rec is not None and rec.deadline == T0 + 3.0 + L
    r.tick_at(T0 + 3.0 + L)
    assert r.lease(A) is None and r.counters()["expiries"] == 1


def test_a_candidate_is_kept_until_its_expected_use_plus_its_own_lifetime() -> None:
    r = Rig()
    cold = toks(5, 4)  # never run: nothing resident, so it stays a candidate
    r.notice(A, cold, wait=11.0, life=30.0)
    r.tick_at(T0 + 11.0 + L + 0.1)  # past ready + wait + l: kept (l_i = 30)
    assert r.s.lease_book.sizes()["pending"] == 1
    r.tick_at(T0 + 11.0 + 30.0 + 0.1)
    assert r.s.lease_book.sizes()["pending"] == 0


def test_revocation_still_takes_a_long_lifetime_lease_first() -> None:
    r = Rig(headroom=20)
    ha, hb = toks(1, 10), toks(2, 10)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, wait=11.0, life=30.0)  # d = T0 + 30
    r.clk.advance(1.0)
    r.notice(B, hb, wait=1.0, life=None)  # d = T0 + 1 + 8: the earlier deadline
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
    r = Rig(retention=Retention.TTL_PIN, enabled=False)
    ha, hb = toks(1, 4), toks(2, 4)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, wait=11.0, life=30.0)  # ttl = 11 + 0.25 * 11 = 13.75 <= 30
    r.notice(B, hb, wait=11.0, life=None)  # capped at l = 8, as before
    recs = {x.cid: x for x in r.s.lease_state().leases}
    assert recs[A].kind is LeaseKind.PIN and recs[A].deadline == pytest.approx(T0 + 13.75)
    assert recs[B].deadline == pytest.approx(T0 + L)


def test_a_non_positive_lifetime_is_refused() -> None:
    r = Rig()
    h = toks(1, 2)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="lifetime"):
            r.notice(A, h, wait=1.0, life=bad)
    assert r.s.lease_book.sizes()["pending"] == 0
