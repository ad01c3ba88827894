"""Pins: lease references outside the LADS budget (ttl-pin, AugServe's Preserve).

Contract (mini-sglang style; the policy is the lease book's, as for leases):

* One primitive, two users. ``Retention.TTL_PIN`` pins every noticed history
  at readiness for :func:`pin_ttl`; AugServe's engine policy pins the
  histories it decides to Preserve (``LeaseBook.preserve``). Both go through
  the book's ``pins``, a :class:`~ladsd.engine.lease_holds.Holds` of kind
  ``LeaseKind.PIN`` (the LADS leases are the other one).
* A pin holds one reference on every real block of the resident prefix
  ``P_i`` of a live candidate, taken through its own ledger
  (``LeaseKind.PIN``) of the shared :class:`LeaseBlockPool`: it is not in
  ``U``, ``B``, ``C`` or ``Delta_i``, so it never competes with LADS leases for
  the budget, and the headroom revocation never touches it.
* A pin ends exactly once, by: handoff (the resumed request is allocated and
  its block table covers the pin: the rule of a LADS handoff), expiry at its
  deadline ``now + min(ttl, l)`` (set once, never extended), cancellation
  (workflow cancelled or superseded), a stripped head block, or the end of
  the run (``release_all``, prefix-cache reset).
* One history is protected by one kind at a time (ours): a pinned candidate is
  not granted a LADS lease, and pinning a leased candidate takes the pin first
  and then ends the lease, so its blocks never pass through the free queue.
* Callers: only :class:`~ladsd.engine.lease_book.LeaseBook`, on the engine
  thread; nothing locks. The pins' holds own the pin table and the handoff
  bindings of pins; :class:`PinRules` decides what is pinned (and counts
  ``pins``, ``pin_cold`` and the ``preserve*`` outcomes); the book decides
  when (at readiness under ttl-pin, on AugServe's Preserve).
* Integrity: ``Holds.check_integrity`` (the table's ledger equals the pins'
  blocks; every binding belongs to a held pin); the audit balances the pin
  ledger like the LADS one (added == released + held).
"""

from __future__ import annotations

import math

from ladsd.engine.lease_candidates import Candidates, LeaseCandidate
from ladsd.engine.lease_holds import Holds
from ladsd.records import ContinuationId, LeaseStatus

PIN_MARGIN = 0.25  # (ours) fraction of the predicted wait added as a safety margin


def pin_ttl(wait: float, lifetime: float, tick: float) -> float:
    """TTL of a ttl-pin: ``min(l, T + max(tick, 0.25 * T))`` for a predicted wait ``T``.

    ``T`` is the predicted time until the result is delivered and its request
    allocated (``T_B_i``); the margin (ours) covers the tick between expiry
    checks and a quarter of the estimate for its error. An unknown wait
    (``inf``: no link rate known yet) pins for ``l``.
    """
    if lifetime <= 0 or tick < 0:
        raise ValueError(f"bad pin parameters: l {lifetime}, tick {tick}")
    if math.isnan(wait) or wait < 0:
        raise ValueError(f"predicted wait must be non-negative, got {wait}")
    return min(lifetime, wait + max(tick, PIN_MARGIN * wait))


class PinRules:
    """What is pinned, and what a new pin ends (see the module contract)."""

    def __init__(self, pins: Holds, leases: Holds, cands: Candidates, tick_s: float) -> None:
        self.pins = pins
        self.leases = leases  # a new pin ends the LADS lease of its continuation
        self.cands = cands
        self.tick_s = tick_s  # the lease tick: the least margin of a ttl-pin

    def at_readiness(self, p: LeaseCandidate, now: float, delay: float, generation: int) -> None:
        """ttl-pin: pin ``P_i`` for the predicted wait ``T_B_i`` plus a margin, up to ``l_i``."""
        t_b = self.cands.time_to_use(p, now, delay, self.cands.link_times())
        ttl = pin_ttl(t_b, self.cands.lifetime_of(p.notice), self.tick_s)
        if not self.pin(p, ttl, now, generation):
            self.pins.counters["pin_cold"] += 1

    def preserve(self, cid: ContinuationId, ttl_s: float, now: float, generation: int) -> bool:
        """AugServe's Preserve of an unpinned ``cid``: pin it for ``min(ttl_s, l_i)``.

        ``cid`` must be a live candidate (noticed, not yet registered) with a
        resident prefix; otherwise nothing is pinned, the reason is counted
        (``preserve_refused_not_candidate`` / ``preserve_refused_cold``) and
        the answer is False.
        """
        c = self.pins.counters
        p = self.cands.pending.get(cid)
        if p is None:
            c["preserve_refused_not_candidate"] += 1
            return False
        if not self.pin(p, ttl_s, now, generation):
            c["preserve_refused_cold"] += 1
            return False
        c["preserves"] += 1
        return True

    def pin(self, p: LeaseCandidate, ttl: float, now: float, generation: int) -> bool:
        """Pin ``p``'s ``P_i`` now until ``now + min(ttl, l_i)``; False if nothing is resident.

        A LADS lease of ``p`` ends once the pin holds its blocks
        (``leases_to_pins``), so they never pass through the free queue.
        """
        if not self.cands.resident(p):
            return False
        self.pins.acquire(
            p.notice,
            p.prefix,
            granted_at=now,
            deadline=now + min(ttl, self.cands.lifetime_of(p.notice)),
            committed=p.committed,
            generation=generation,
            now=now,
        )
        self.pins.counters["pins"] += 1
        lease = self.leases.get(p.cid)
        if lease is not None:  # the pin holds the blocks now: the lease's quota goes back
            self.leases.release(lease, LeaseStatus.CANCELLED, "leases_to_pins", now)
        return True
