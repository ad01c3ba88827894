"""Pins: lease references outside the LADS budget (ttl-pin, AugServe's Preserve).

Contract (mini-sglang style; the policy is the lease book's, as for leases):

* One primitive, two users. ``Retention.TTL_PIN`` pins every noticed history
  at readiness for :func:`pin_ttl`; AugServe's engine policy pins the
  histories it decides to Preserve (``LeaseBook.preserve``). Both go through
  :class:`Pins`.
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
  thread; nothing locks. ``Pins`` owns the pin table and the handoff
  bindings of pins (``bound``); it decides nothing and counts nothing.
* Integrity: :meth:`Pins.check_integrity` (the table's ledger equals the
  pins' blocks; every binding belongs to a held pin); the audit balances the
  pin ledger like the LADS one (added == released + held).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from ladsd.engine.lease_pool import LeaseIntegrityError
from ladsd.engine.lease_table import Lease, LeaseTable, Native
from ladsd.records import ContinuationId, HistoryNotice, LeaseKind, LeaseStatus

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


class Pins:
    """Active pins, their references and handoff bindings (see the module contract)."""

    def __init__(self, kv: KVCacheManager, now: float, native_extra: Native = lambda: ()) -> None:
        self.table = LeaseTable(kv, now, native_extra, kind=LeaseKind.PIN)
        self.bound: dict[str, ContinuationId] = {}  # request id -> its pinned continuation

    @property
    def pins(self) -> dict[ContinuationId, Lease]:
        return self.table.leases

    def __contains__(self, cid: ContinuationId) -> bool:
        return cid in self.table.leases

    def pin(
        self,
        notice: HistoryNotice,
        resident: Sequence[Sequence[KVCacheBlock]],
        *,
        deadline: float,
        committed: bool,
        generation: int,
        now: float,
    ) -> Lease:
        """One pin reference on every real block of ``P_i`` (``resident``, per group)."""
        return self.table.acquire(
            notice,
            resident,
            granted_at=now,
            deadline=deadline,
            committed=committed,
            generation=generation,
            now=now,
        )

    def bind(self, cid: ContinuationId, req_id: str) -> bool:
        """``req_id`` resumes ``cid``: the handoff target of its pin, if pinned."""
        pin = self.table.leases.get(cid)
        if pin is None:
            return False
        pin.reqs.append(req_id)
        self.bound[req_id] = cid
        return True

    def release(self, pin: Lease, status: LeaseStatus, now: float) -> bool:
        """Give back the pin's references once and unbind it; False if already ended."""
        if not self.table.release(pin, status, now):
            return False
        for req_id in pin.reqs:
            if self.bound.get(req_id) == pin.cid:
                del self.bound[req_id]
        return True

    def ordered(self) -> list[Lease]:
        return self.table.ordered()

    def sizes(self) -> dict[str, int]:
        t = self.table.sizes()
        return {"pins": t["leases"], "pin_holders": t["holders"], "pin_bound": len(self.bound)}

    def check_integrity(self) -> None:
        """Raise :class:`LeaseIntegrityError` unless the pins agree with their ledger."""
        self.table.check_integrity(with_pool=False)
        for req_id, cid in self.bound.items():
            pin = self.table.leases.get(cid)
            if pin is None or req_id not in pin.reqs:
                raise LeaseIntegrityError(f"request {req_id} bound to {cid.key()} without a pin")
