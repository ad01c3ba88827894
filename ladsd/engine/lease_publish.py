"""Publication: what the lease book tells the world (counters, lease events, lease records).

Contract (mini-sglang style: one owner per structure):

* Owns: the counters (one :class:`~collections.Counter`; the holds managers
  and the grants count into it, nothing else writes it), the lease events
  since the last published state (``events``, drained by :meth:`drain_events`)
  and the cache of the published lease records.
* Reads, never changes: the holds (records, active counts, block-seconds),
  the candidates (resident sizes), the sessions (waiting count) and the pool
  (free blocks, reference totals); the grants' budget comes with each state.
* Thread: engine thread only; nothing locks. The :class:`EngineState` built
  from it is frozen and safe to hand to the loop.
* Integrity: :meth:`check_integrity` (no negative counter; no more LADS
  lease ends than grants). ``events`` is bounded by one publication interval:
  every published state drains it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from ladsd.engine import budget as bud
from ladsd.engine.lease_candidates import Candidates
from ladsd.engine.lease_holds import Holds
from ladsd.engine.lease_pool import LeaseIntegrityError
from ladsd.engine.lease_sessions import Sessions
from ladsd.records import (
    LEASE_COUNTERS,
    RETENTION_COUNTERS,
    ContinuationId,
    DenialEvent,
    EngineState,
    LeaseEvent,
    LeaseEventKind,
    LeaseKind,
    LeaseRecord,
    LeaseStatus,
    RefusalEvent,
)

_END_EVENTS = {
    LeaseStatus.HANDED_OFF: LeaseEventKind.HANDOFF,
    LeaseStatus.EXPIRED: LeaseEventKind.EXPIRY,
    LeaseStatus.REVOKED: LeaseEventKind.REVOCATION,
    LeaseStatus.CANCELLED: LeaseEventKind.CANCELLATION,
}


class Publication:
    """Counters, lease events and the records cache of one book (see the module contract)."""

    def __init__(
        self,
        counters: Counter[str],
        leases: Holds,
        pins: Holds,
        cands: Candidates,
        sessions: Sessions,
        *,
        enabled: bool,
        kappa: float,
        block_size: int,
    ) -> None:
        self.counters = counters  # the holds count into it too
        self.events: list[LeaseEvent] = []  # outcomes since the last published state
        self._records: tuple[tuple[int, int, int], tuple[LeaseRecord, ...]] = ((-1, -1, -1), ())
        self.leases = leases
        self.pins = pins
        self.cands = cands
        self.sessions = sessions
        self.enabled = enabled  # LADS leases on: B and C are published
        self.kappa = kappa
        self.block_size = block_size  # tokens per block of |P_i|

    def state(
        self,
        seq: int,
        now: float,
        load: tuple[int, int, int],
        budget: bud.Budget,
        generation: int,
        denials: Sequence[DenialEvent],
        refusals: Sequence[RefusalEvent] = (),
    ) -> EngineState:
        """A frozen snapshot (spec 3.4); takes the events since the last one."""
        w, a, m = load
        pool = self.leases.table.pool
        used = self.leases.table.used
        target = budget.B if self.enabled else 0
        return EngineState(
            time=now,
            seq=seq,
            generation=generation,
            U=used,
            B=target,
            C=bud.committed_capacity(target, used) if self.enabled else 0,
            F=pool.get_num_free_blocks(),
            w=w,
            a=a,
            m=m,
            total_blocks=pool.num_gpu_blocks - 1,  # the null block is never usable
            block_size=self.block_size,
            kappa=self.kappa,
            leases=self.records(generation),
            denials=tuple(denials),
            resident=self.cands.sizes_of(),
            counters=self.snapshot(now),
            events=self.drain_events(),
            refusals=tuple(refusals),
        )

    def event(self, kind: LeaseEventKind, cid: ContinuationId, now: float, blocks: int = 0) -> None:
        self.events.append(LeaseEvent(kind, cid, now, blocks))

    def lease_ended(
        self, cid: ContinuationId, status: LeaseStatus, blocks: int, now: float
    ) -> None:
        """A LADS lease ended: its event and ``ended_<status>`` (pins publish neither)."""
        kind = _END_EVENTS.get(status)
        if kind is not None:
            self.event(kind, cid, now, blocks)
        self.counters[f"ended_{status.value}"] += 1

    def drain_events(self) -> tuple[LeaseEvent, ...]:
        events, self.events = tuple(self.events), []
        return events

    def records(self, generation: int) -> tuple[LeaseRecord, ...]:
        """Active lease and pin records, rebuilt only after a reference change.

        A new generation alone restamps the cached records (:func:`restamp`):
        every other field changes only with a lease or pin reference.
        """
        pool = self.leases.table.pool
        key = (pool.refs_added, pool.refs_released, generation)
        cached, recs = self._records
        if cached == key:
            return recs
        if cached[:2] == key[:2]:
            recs = restamp(recs, generation)
        else:
            recs = build_records(self.leases, self.pins, generation)
        self._records = (key, recs)
        return recs

    def snapshot(self, now: float) -> dict[str, float]:
        """The published counters: every named one (0 until it happens), then the gauges."""
        leases, pins = self.leases, self.pins
        out: dict[str, float] = dict.fromkeys((*LEASE_COUNTERS, *RETENTION_COUNTERS), 0.0)
        out.update((k, float(v)) for k, v in self.counters.items())
        pool = leases.table.pool
        out["protection_block_seconds"] = leases.table.integrate(now)
        out["pin_block_seconds"] = pins.table.integrate(now)
        out["refs_added"] = float(pool.refs_added)  # every kind (leases and pins)
        out["refs_released"] = float(pool.refs_released)
        out["active_leases"] = float(len(leases.held))
        out["active_pins"] = float(len(pins.held))
        out["waiting_sessions"] = float(len(self.sessions.entries))
        return out

    def sizes(self) -> dict[str, int]:
        return {"events": len(self.events)}

    def check_integrity(self) -> None:
        """Raise :class:`LeaseIntegrityError` unless the counters are consistent."""
        c = self.counters
        negative = sorted(k for k, v in c.items() if v < 0)
        if negative:
            raise LeaseIntegrityError(f"negative counters: {', '.join(negative)}")
        ended = sum(c[f"ended_{s.value}"] for s in _END_EVENTS)
        if ended > c["grants"]:
            raise LeaseIntegrityError(f"{ended} lease ends counted for {c['grants']} grants")


def restamp(records: tuple[LeaseRecord, ...], generation: int) -> tuple[LeaseRecord, ...]:
    """``records`` as of budget ``generation`` (what :func:`build_records` would give)."""
    return tuple(replace(r, generation=generation) for r in records)


def build_records(leases: Holds, pins: Holds, generation: int) -> tuple[LeaseRecord, ...]:
    """Lease records (with ``|E_i|``) then pin records, each in grant order."""
    table = leases.table
    out = tuple(x.record(table.exclusive(x), generation) for x in leases.ordered())
    # A pin's handoff returns no budget quota: its record's E_i is 0.
    return out + tuple(x.record(0, generation, LeaseKind.PIN) for x in pins.ordered())
