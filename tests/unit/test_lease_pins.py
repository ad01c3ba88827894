"""Pins outside the LADS budget on vLLM's real Scheduler / KVCacheManager (no model).

ttl-pin (every notice pinned at readiness for its predicted wait plus a
margin, capped at l) and AugServe's ``preserve`` share one primitive. Every
scenario checks integrity after every operation and ends with a balanced
audit (pins are references too).
"""

from __future__ import annotations

import pytest

from ladsd.config import FRAME_OVERHEAD
from ladsd.engine.lease_pins import pin_ttl
from ladsd.modes import Retention
from ladsd.records import ContinuationId, LeaseKind
from tests.rigs.leases import BS, Rig, cont, rig, toks

A = ContinuationId("wa", 1)
B = ContinuationId("wb", 1)
C = ContinuationId("wc", 1)
LIFE = 8.0


def pin_rig(
    retention: Retention = Retention.TTL_PIN,
    *,
    enabled: bool = False,
    num_blocks: int = 64,
    headroom: int = 4,
) -> Rig:
    return rig(num_blocks=num_blocks, headroom=headroom, lifetime=LIFE, enabled=enabled,
               retention=retention)  # fmt: skip


def kinds(r: Rig) -> dict[ContinuationId, LeaseKind]:
    return {rec.cid: rec.kind for rec in r.s.lease_state().leases}


def balanced(r: Rig, refs: int) -> None:
    r.s.lease_release_all()
    audit = r.s.lease_audit()
    assert audit["refs_added"] == audit["refs_released"] == refs
    assert audit["refs_held"] == 0 and audit["pin_refs_added"] == audit["pin_refs_released"]


def test_ttl_pin_survives_headroom_pressure_and_expires_at_its_ttl() -> None:
    r = pin_rig(headroom=40)  # H far above what the flood leaves free
    ha, hb = toks(1, 8), toks(2, 8)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, expected_wait_s=2.0)  # T = 2 s: ttl = 2 + max(0.1, 0.5) = 2.5
    st = r.s.lease_state()
    (rec,) = st.leases
    assert rec.kind is LeaseKind.PIN and rec.cid == A and len(rec.protected_blocks) == 8
    assert rec.deadline == pytest.approx(1000.0 + 2.5) and rec.exclusive_blocks == 0
    assert st.U == st.B == 0 and st.counters["pins"] == 1 and st.counters["grants"] == 0
    big = r.add(toks(10, 50), max_tokens=4)  # the flood: 51 of the 55 evictable blocks
    r.until(lambda: r.pool.get_num_free_blocks() < 40)
    r.s.lease_tick()  # below H: a LADS lease would be revoked here
    r.step()
    assert r.pool.get_num_free_blocks() < 40 and kinds(r) == {A: LeaseKind.PIN}
    r.until(big.is_finished)
    assert r.s.lease_resident(hb) < 8  # the unpinned twin lost its tail
    assert r.s.lease_resident(ha) == 8 and kinds(r) == {A: LeaseKind.PIN}
    st = r.s.lease_state()
    assert st.counters["revocations"] == 0 and st.counters["pin_expiries"] == 0
    r.clk.t = 1002.4
    r.s.lease_tick()
    assert kinds(r) == {A: LeaseKind.PIN}
    r.clk.t = 1002.5  # the deadline
    r.s.lease_tick()
    r.ok()
    st = r.s.lease_state()
    assert st.leases == () and st.counters["pin_expiries"] == 1
    blocks = [r.pool.blocks[i] for i in rec.protected_blocks]
    assert all(b.ref_cnt == 0 for b in blocks)  # evictable again, still cached
    balanced(r, 8)


def test_ttl_from_the_link_estimate_is_capped_at_l() -> None:
    r = pin_rig()
    r.rate = 10_000.0
    ha, hb = toks(1, 4), toks(2, 4)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha)  # no inventory yet: no link rate known, T = inf: pinned for l
    r.notice(B, hb)  # behind A in the FIFO: T = 2 (h + p) / R
    recs = {rec.cid: rec for rec in r.s.lease_state().leases}
    assert recs[A].deadline == pytest.approx(1000.0 + LIFE)
    t = 2 * (FRAME_OVERHEAD + 500) / 10_000.0
    assert recs[B].deadline == pytest.approx(1000.0 + t + max(0.1, 0.25 * t))
    assert pin_ttl(t, LIFE, 0.1) == pytest.approx(t + 0.1)  # the margin is the tick here
    assert pin_ttl(100.0, LIFE, 0.1) == LIFE
    r.notice(C, toks(3, 4))  # cold: nothing to pin
    assert r.s.lease_state().counters["pin_cold"] == 1
    balanced(r, 8)


def test_pin_hands_off_when_the_resumed_request_is_allocated() -> None:
    r = pin_rig()
    ha = toks(1, 8)
    r.run(ha)
    r.notice(A, ha, expected_wait_s=1.0)
    pinned = r.s.lease_state().leases[0].protected_blocks
    del r.items[A]  # received: leaves the inventory, the pin stays until handoff
    r.publish()
    req = r.add(cont(ha), max_tokens=4)
    r.s.lease_bind(A, req.request_id)
    assert kinds(r) == {A: LeaseKind.PIN} and r.book.sizes()["pin_bound"] == 1
    out = r.step()
    assert {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs} == {
        req.request_id: 8 * BS
    }
    st = r.s.lease_state()
    assert st.leases == () and st.counters["pin_handoffs"] == 1
    assert st.counters["pin_handoff_mismatches"] == 0
    table = r.s.kv_cache_manager.coordinator.get_blocks(req.request_id)[0]
    assert tuple(b.block_id for b in table[:8]) == pinned  # the same physical blocks
    assert all(b.ref_cnt == 1 for b in table[:8])  # only the request holds them now
    r.until(req.is_finished)
    assert "pins" not in r.book.sizes() and "pin_bound" not in r.book.sizes()
    balanced(r, 8)


def test_cancel_ends_a_pin() -> None:
    r = pin_rig()
    ha = toks(1, 5)
    r.run(ha)
    r.notice(A, ha)
    r.s.lease_cancel(A)
    r.ok()
    st = r.s.lease_state()
    assert st.leases == () and st.counters["pin_cancels"] == 1
    sizes = r.book.sizes()
    assert sizes["pending"] == sizes["latest"] == 0 and "pins" not in sizes
    balanced(r, 5)


def test_preserve_answers_and_coexists_with_lads_leases() -> None:
    # augserve+lads: LADS grants on, AugServe preserves some histories.
    r = pin_rig(Retention.LADS, enabled=True, num_blocks=64, headroom=20)
    ha, hb = toks(1, 8), toks(2, 8)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha)
    assert kinds(r) == {A: LeaseKind.LADS}  # granted at readiness
    lease_blocks = r.lease(A).protected_blocks
    assert r.s.lease_preserve(A, 3.0) is True  # the pin takes over from the lease
    r.ok()
    st = r.s.lease_state()
    assert kinds(r) == {A: LeaseKind.PIN} and st.U == 0
    assert st.leases[0].protected_blocks == lease_blocks
    assert st.leases[0].deadline == pytest.approx(1003.0)
    assert all(r.pool.blocks[i].ref_cnt == 1 for i in lease_blocks)  # one reference each
    c = st.counters
    assert (c["preserves"], c["pins"], c["leases_to_pins"]) == (1, 1, 1)
    assert r.s.lease_preserve(A, 5.0) is True  # a repeat leaves the pin as it is
    assert r.s.lease_state().leases[0].deadline == pytest.approx(1003.0)
    assert r.s.lease_preserve(ContinuationId("nobody", 1), 1.0) is False
    r.notice(C, toks(3, 4))  # cold
    assert r.s.lease_preserve(C, 1.0) is False
    c = r.s.lease_state().counters
    assert (c["preserve_repeats"], c["preserve_refused_not_candidate"]) == (1, 1)
    assert c["preserve_refused_cold"] == 1
    # While pinned, A gets no LADS grant; B does, within the budget.
    r.notice(B, hb)
    r.s.lease_tick()
    assert kinds(r) == {A: LeaseKind.PIN, B: LeaseKind.LADS}
    assert r.s.lease_state().U == 8
    # Headroom pressure revokes the LADS lease, never the pin.
    big = r.add(toks(9, 30), max_tokens=2)
    r.until(lambda: r.lease(B) is None)
    assert kinds(r) == {A: LeaseKind.PIN}
    assert r.s.lease_state().counters["revocations"] == 1
    r.until(big.is_finished)
    # At its deadline the pin expires; A, still a candidate, may now be leased.
    r.clk.t = 1003.0
    r.s.lease_tick()
    r.ok()
    st = r.s.lease_state()
    assert st.counters["pin_expiries"] == 1
    assert kinds(r).get(A) is LeaseKind.LADS  # back under the budget
    assert all(r.pool.blocks[i].ref_cnt == 1 for i in st.lease_for(A).protected_blocks)
    r.s.lease_release_all()
    audit = r.s.lease_audit()
    assert audit["refs_added"] == audit["refs_released"] and audit["refs_held"] == 0
    assert audit["pin_refs_added"] == audit["pin_refs_released"] == 8


def test_preserve_works_with_lads_grants_off() -> None:
    r = pin_rig(Retention.NONE)  # augserve on FIFO delivery: no LADS leases at all
    ha = toks(1, 6)
    r.run(ha)
    r.notice(A, ha)
    assert r.lease(A) is None
    assert r.s.lease_preserve(A, 100.0) is True
    (rec,) = r.s.lease_state().leases
    assert rec.kind is LeaseKind.PIN and rec.deadline == pytest.approx(1000.0 + LIFE)  # capped
    with pytest.raises(ValueError):
        r.s.lease_preserve(A, -1.0)
    balanced(r, 6)


def test_a_pool_held_by_pins_stalls_the_step_and_the_step_says_so() -> None:
    """Hard pins may hold every free block: vLLM then schedules nothing until one ends.

    The engine thread must see such a step as a stall (it waits instead of
    spinning and publishing a state per empty step), and runs record how often.
    """
    r = pin_rig(num_blocks=64)
    ha, hb = toks(1, 30), toks(2, 30)
    r.run(ha)
    r.run(hb)
    r.notice(A, ha, expected_wait_s=2.0)  # ttl 2.5 s
    r.notice(B, hb, expected_wait_s=2.0)
    assert set(kinds(r)) == {A, B} and r.pool.get_num_free_blocks() == 3
    req = r.add(toks(3, 10))  # needs 10 blocks; the pins leave 3
    r.step()
    r.step()
    assert r.s.last_scheduled_tokens == 0 and r.s.stalled_steps == 2
    assert r.s.lease_state().counters["stalled_steps"] == 2
    r.clk.t = 1002.5  # both pins expire; their blocks become evictable
    r.s.lease_tick()
    r.step()
    assert r.s.last_scheduled_tokens == 10 * BS and r.s.stalled_steps == 2
    r.until(req.is_finished)
    balanced(r, 60)
