"""Holds: one kind of protection on KV blocks (LADS leases or pins), from grant to end.

Contract (nano-vllm ``BlockManager`` verbs, mini-sglang ownership):

* Owns: one :class:`~ladsd.engine.lease_table.LeaseTable` (the holds of its
  :class:`~ladsd.records.LeaseKind`, their references on the shared pool and
  the holder index) and the handoff bindings (``bound``: request id -> the
  held continuation it resumes). The lease book builds two: ``leases``
  (LADS) and ``pins`` (ttl-pin, AugServe's Preserve); each kind's counter and
  size names are its :class:`HoldNames`.
* Verbs: :meth:`acquire` (one reference per real block of ``P_i``),
  :meth:`bind`, :meth:`release` (once), :meth:`due` / :meth:`expire`
  (deadline reached), :meth:`strip` (a held block lost its hash: cut the
  prefix there, or end the hold when its head broke), :meth:`handoff` (the
  resumed request's block table covers the hold) and :meth:`drop` (every hold).
* Lock/unlock: only through the table (exactly the hold's references, given
  back once). Every end goes through :meth:`release`, which unbinds the hold,
  counts it under the caller's counter name and then calls ``ended`` (the
  book's: events, refill, settling). Which hold to grant or revoke, and
  when, is the book's; the verbs here decide only what their rule says.
* Thread: engine thread only, between scheduler steps; nothing locks.
* Integrity: :meth:`check_integrity` (the table's checks; every binding
  belongs to a held continuation that lists the request) and
  :meth:`balance` (added == released + held for this kind's ledger).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from ladsd.engine.lease_pool import LeaseIntegrityError
from ladsd.engine.lease_resident import Prefix
from ladsd.engine.lease_table import Lease, LeaseTable, Native
from ladsd.records import ContinuationId, HistoryNotice, LeaseKind, LeaseStatus

# (kind, the hold, how it ended, blocks it held, now): called once per end.
Ended = Callable[[LeaseKind, Lease, LeaseStatus, int, float], None]
BlockTable = Callable[[str], Sequence[Sequence[KVCacheBlock]]]  # request id -> blocks per group


@dataclass(frozen=True)
class HoldNames:
    """Counter and size names of one kind (the published names: ``ladsd.records``)."""

    noun: str  # in integrity messages
    expired: str
    handed_off: str
    mismatch: str  # a first failed handoff check
    stripped: str  # ended because its head block lost its hash
    stripped_blocks: str
    dropped: str  # prefix of a drop's counter
    sizes: tuple[str, str, str]  # holds, holder index, bindings


LEASES = HoldNames(
    "lease",
    "expiries",
    "handoffs",
    "handoff_mismatches",
    "stripped_leases",
    "stripped_blocks",
    "",
    ("leases", "holders", "bound"),
)
PINS = HoldNames(
    "pin",
    "pin_expiries",
    "pin_handoffs",
    "pin_handoff_mismatches",
    "pin_stripped",
    "pin_stripped_blocks",
    "pin_",
    ("pins", "pin_holders", "pin_bound"),
)


class Holds:
    """The holds of one kind and their handoff bindings (see the module contract)."""

    def __init__(
        self,
        kv: KVCacheManager,
        now: float,
        native_extra: Native,
        *,
        kind: LeaseKind,
        names: HoldNames,
        counters: Counter[str],
        ended: Ended,
    ) -> None:
        self.table = LeaseTable(kv, now, native_extra, kind=kind)
        self.bound: dict[str, ContinuationId] = {}  # request id -> its held continuation
        self.names = names
        self.counters = counters  # the book's (publication) counters
        self.ended = ended

    @property
    def held(self) -> dict[ContinuationId, Lease]:
        return self.table.leases

    def __contains__(self, cid: ContinuationId) -> bool:
        return cid in self.table.leases

    def get(self, cid: ContinuationId) -> Lease | None:
        return self.table.leases.get(cid)

    def ordered(self) -> list[Lease]:
        """Held in grant (FIFO) order."""
        return self.table.ordered()

    # -- verbs -----------------------------------------------------------------

    def acquire(
        self,
        notice: HistoryNotice,
        prefix: Prefix,
        *,
        granted_at: float,
        deadline: float,
        committed: bool,
        generation: int,
        now: float,
    ) -> Lease:
        """One reference on every real block of ``P_i`` (``prefix``)."""
        return self.table.acquire(
            notice,
            prefix,
            granted_at=granted_at,
            deadline=deadline,
            committed=committed,
            generation=generation,
            now=now,
        )

    def bind(self, cid: ContinuationId, req_id: str) -> bool:
        """``req_id`` resumes ``cid``: a handoff target of its hold, if held."""
        x = self.table.leases.get(cid)
        if x is None:
            return False
        x.reqs.append(req_id)
        self.bound[req_id] = cid
        return True

    def release(self, x: Lease, status: LeaseStatus, counter: str, now: float) -> bool:
        """End ``x`` once: free its references, unbind it, count ``counter``, call ``ended``."""
        blocks = len(x.blocks)
        if not self.table.release(x, status, now):
            return False
        for req_id in x.reqs:
            if self.bound.get(req_id) == x.cid:
                del self.bound[req_id]
        self.counters[counter] += 1
        self.ended(self.table.kind, x, status, blocks, now)
        return True

    def due(self, now: float) -> list[Lease]:
        """Holds at or past their deadline, in grant order."""
        return self.table.due(now)

    def expire(self, now: float) -> None:
        """End every hold at or past its deadline (set once at acquire, never extended)."""
        for x in self.due(now):
            self.release(x, LeaseStatus.EXPIRED, self.names.expired, now)

    def strip(self, now: float) -> bool:
        """Cut holds at their first block whose hash was stripped; True if blocks left a hold.

        A hold whose head block broke keeps nothing and ends (CANCELLED).
        """
        cut_some = False
        for x in self.table.stripped():
            cut = self.table.cut(x, now)
            if cut is None:
                self.release(x, LeaseStatus.CANCELLED, self.names.stripped, now)
            elif cut:
                self.counters[self.names.stripped_blocks] += cut
                cut_some = True
        return cut_some

    def handoff(self, req_id: str, blocks: BlockTable, now: float) -> None:
        """``req_id`` was scheduled: its hold ends if its block table covers the hold.

        A table that does not cover it is counted once per hold (``mismatch``);
        the hold stays until a later step covers it or it ends otherwise.
        """
        cid = self.bound.get(req_id)
        if cid is None:
            return
        x = self.table.leases[cid]  # bound only while held (check_integrity)
        if x.covered_by(blocks(req_id)):
            self.release(x, LeaseStatus.HANDED_OFF, self.names.handed_off, now)
        elif not x.mismatch:
            x.mismatch = True
            self.counters[self.names.mismatch] += 1

    def drop(self, counter: str, now: float) -> None:
        """End every hold (prefix-cache reset, end of run), counted as the kind's ``counter``."""
        for x in self.ordered():
            self.release(x, LeaseStatus.CANCELLED, self.names.dropped + counter, now)

    # -- counts and integrity --------------------------------------------------

    def sizes(self) -> dict[str, int]:
        holds, holders, bound = self.names.sizes
        t = self.table.sizes()
        return {holds: t["leases"], holders: t["holders"], bound: len(self.bound)}

    def check_integrity(self, with_pool: bool = True) -> None:
        """Raise :class:`LeaseIntegrityError` unless the table and the bindings agree.

        ``with_pool=False`` skips the whole-pool check (the second kind on the
        same pool, after the first one ran it).
        """
        self.table.check_integrity(with_pool=with_pool)
        for req_id, cid in self.bound.items():
            x = self.table.leases.get(cid)
            if x is None or req_id not in x.reqs:
                noun = self.names.noun
                raise LeaseIntegrityError(f"request {req_id} bound to {cid.key()} without a {noun}")

    def balance(self) -> int:
        """References added == released + held for this kind's ledger; returns held."""
        return self.table.balance()
