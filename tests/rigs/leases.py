"""The lease rig: vLLM's real Scheduler / KVCacheManager with leases (no model, no workers).

One :class:`Rig` for every lease test module: a lease scheduler, a manual clock and a
fake sender (its inventory). ``notice`` sends a history notice and, when ``listed``, has
the sender list the result; every operation runs ``check_integrity()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ladsd import testing
from ladsd.clock import ManualClock
from ladsd.config import LeaseConfig
from ladsd.engine.lease_pool import LeaseBlockPool
from ladsd.engine.sched_leases import LeaseScheduler
from ladsd.modes import Retention
from ladsd.records import ContinuationId, HistoryNotice, InventoryItem, Phase, SenderInventory

BS = 16  # block size
T0 = 1000.0  # the manual clock's start


def real_blocks(groups: Any) -> list[Any]:
    """The real blocks of a per-group lookup, null blocks skipped: the tests' own
    reference for ``Prefix.of`` (the product's one flattening)."""
    return [b for g in groups for b in g if not b.is_null]


def toks(seed: int, n_blocks: int) -> list[int]:
    """A history of ``n_blocks`` full blocks, distinct per seed."""
    return [1000 + seed * 7919 + i for i in range(n_blocks * BS)]


def cont(history: list[int], seed: int = 99) -> list[int]:
    """The continuation prompt: history + a new observation (3 blocks)."""
    return history + toks(seed, 3)


@dataclass
class Rig:
    """A lease scheduler, a manual clock and a fake sender."""

    s: Any
    clk: ManualClock
    items: dict[ContinuationId, InventoryItem] = field(default_factory=dict)
    q_b: int = 0
    rate: float = 1e6  # fast link: T_B is tiny unless a test says otherwise
    n_req: int = 0
    payload: int = 500  # a notice's payload bytes unless it names its own
    lists: bool = True  # the sender lists each noticed result (HTTP sessions have none)

    @property
    def pool(self) -> LeaseBlockPool:
        return self.s.kv_cache_manager.block_pool

    @property
    def book(self) -> Any:
        return self.s.lease_book

    def ok(self) -> None:
        self.s.check_integrity()

    def run(self, tokens: list[int], max_tokens: int = 2, rid: str | None = None) -> Any:
        """Run a request to completion (its blocks stay cached, evictable)."""
        req = self.add(tokens, max_tokens, rid)
        self.until(req.is_finished)
        return req

    def add(self, tokens: list[int], max_tokens: int = 2, rid: str | None = None) -> Any:
        self.n_req += 1
        req = testing.make_request(rid or f"r{self.n_req}", tokens, max_tokens=max_tokens)
        self.s.add_request(req)
        return req

    def step(self) -> Any:
        out = testing.step(self.s)
        self.ok()
        return out

    def until(self, done: Any, limit: int = 200) -> None:
        """Step until ``done()`` (bounded, so a broken scenario fails instead of hanging)."""
        for _ in range(limit):
            if done():
                return
            self.step()
        raise AssertionError(f"not reached in {limit} steps")

    def notice(
        self,
        cid: ContinuationId,
        history: list[int],
        payload: int | None = None,
        *,
        listed: bool | None = None,
        **intent: Any,
    ) -> None:
        """A history notice (``intent``: its optional fields, e.g. ``expected_wait_s``);
        ``listed`` (default ``lists``): the sender lists the result too."""
        p = self.payload if payload is None else payload
        listed = self.lists if listed is None else listed
        key = cid.key()
        n = HistoryNotice(cid, tuple(history), f"p-{key}", f"d-{key}", self.clk(), p, **intent)
        if listed:
            self.items[cid] = InventoryItem(cid, Phase.PENDING, p, n.ready_time)
        self.s.lease_notice(n)
        self.ok()
        if listed:
            self.publish()

    def phase(self, cid: ContinuationId, phase: Phase) -> None:
        self.items[cid] = replace(self.items[cid], phase=phase)
        self.publish()

    def publish(self) -> None:
        items = tuple(sorted(self.items.values(), key=lambda i: (i.ready_time, i.cid)))
        self.s.lease_inventory(SenderInventory(self.clk(), items, self.q_b, self.rate))
        self.ok()

    def receive(self, cid: ContinuationId) -> None:
        """Committed, then completely received: the sender stops listing it."""
        self.phase(cid, Phase.COMMITTED)
        del self.items[cid]
        self.publish()

    def tick_at(self, t: float) -> None:
        self.clk.advance(t - self.clk())
        self.s.lease_tick()
        self.ok()

    def lease(self, cid: ContinuationId) -> Any:
        return self.s.lease_state().lease_for(cid)

    def leased(self, cid: ContinuationId) -> bool:
        return self.lease(cid) is not None

    def counters(self) -> dict[str, float]:
        return self.s.lease_state().counters

    def empty(self) -> None:
        """The book keeps nothing: every part's size is 0 and no block is leased."""
        sizes = self.book.sizes()
        parts = {"pending", "latest", "phases", "leases", "holders", "bound", "refused"}
        assert set(sizes) == parts
        assert {k: v for k, v in sizes.items() if v} == {}
        assert self.s.lease_state().U == 0


def rig(
    cls: type = LeaseScheduler,
    num_blocks: int = 64,
    headroom: int = 4,
    lifetime: float = 8.0,
    kappa: float = 0.0,
    enabled: bool = True,
    retention: Retention = Retention.LADS,
    payload: int = 500,
    lists: bool = True,
) -> Rig:
    s = testing.make_scheduler(cls, num_blocks=num_blocks, block_size=BS)
    clk = ManualClock(T0)
    cfg = LeaseConfig(enabled=enabled, headroom_blocks=headroom, lease_lifetime_s=lifetime)
    s.lease_setup(cfg, kappa, clk, retention=retention)
    return Rig(s, clk, payload=payload, lists=lists)
