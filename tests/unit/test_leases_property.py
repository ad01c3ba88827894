"""Random sequences of lease and engine operations keep every reference count exact.

A hypothesis state machine drives vLLM's real scheduler (no model) through
acquire (readiness notices), release (cancel, double release), expire (clock
jumps), revoke (allocation pressure below ``H``), handoff (bound continuations),
allocate / free (unrelated requests, aborts), hash stripping and prefix-cache
resets, with ``check_integrity()`` after every step and a balanced audit at the
end.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm.v1.request import RequestStatus

from ladsd import testing
from ladsd.clock import ManualClock
from ladsd.config import LeaseConfig
from ladsd.engine.lease_resident import lookup
from ladsd.engine.sched_leases import LeaseScheduler
from ladsd.records import (
    ContinuationId,
    HistoryNotice,
    InventoryItem,
    LeaseStatus,
    Phase,
    SenderInventory,
)
from tests.rigs.leases import real_blocks as real

BS = 16
H = 6
LIFETIME = 8.0


def blocks(seed: int, n: int) -> list[int]:
    return [500 + seed * 1009 + i for i in range(n * BS)]


SHARED = blocks(0, 3)
HISTORIES = [
    SHARED + blocks(1, 2),  # two histories sharing a 3-block prefix
    SHARED + blocks(2, 3),
    blocks(3, 4),
    blocks(4, 6),
]


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s: Any = testing.make_scheduler(LeaseScheduler, num_blocks=40, block_size=BS)
        self.clk = ManualClock(100.0)
        self.s.lease_setup(
            LeaseConfig(headroom_blocks=H, lease_lifetime_s=LIFETIME), 0.01, self.clk
        )
        # Grants count the pending allocation of waiting requests (issue 10).
        self.s.lease_book.waiting = lambda: self.s.waiting
        self.items: dict[ContinuationId, InventoryItem] = {}
        self.history: dict[ContinuationId, int] = {}
        self.turn = 0
        self.n_req = 0
        self.stale: list[Any] = []  # released lease objects, for double releases

    # -- helpers -----------------------------------------------------------

    @property
    def book(self) -> Any:
        return self.s.lease_book

    @property
    def pool(self) -> Any:
        return self.s.kv_cache_manager.block_pool

    def publish(self) -> None:
        items = tuple(sorted(self.items.values(), key=lambda i: (i.ready_time, i.cid)))
        self.s.lease_inventory(SenderInventory(self.clk(), items, 0, 1e6))

    def add(self, tokens: list[int], max_tokens: int) -> Any:
        self.n_req += 1
        req = testing.make_request(f"q{self.n_req}", tokens, max_tokens=max_tokens)
        self.s.add_request(req)
        return req

    def pick(self, data: st.DataObject, pool: list[Any]) -> Any:
        return data.draw(st.sampled_from(sorted(pool, key=str)))

    # -- rules -------------------------------------------------------------

    @rule(i=st.integers(0, len(HISTORIES) - 1))
    def warm(self, i: int) -> None:
        """Allocate and free a request of history ``i``: its blocks become cached."""
        self.add(HISTORIES[i], max_tokens=1)
        for _ in range(4):
            testing.step(self.s)

    @rule(i=st.integers(0, len(HISTORIES) - 1), warm=st.booleans())
    def acquire(self, i: int, warm: bool) -> None:
        """A result is ready: notice + inventory, which may grant a lease."""
        if warm:
            self.warm(i)
        self.turn += 1
        cid = ContinuationId(f"w{i}", self.turn)
        n = HistoryNotice(cid, tuple(HISTORIES[i]), "p", "d", self.clk(), 200)
        self.s.lease_notice(n)
        self.items[cid] = InventoryItem(cid, Phase.PENDING, 200, n.ready_time)
        self.history[cid] = i
        self.publish()

    @precondition(lambda self: bool(self.items))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        cid = self.pick(data, list(self.items))
        self.items[cid] = InventoryItem(cid, Phase.COMMITTED, 200, self.items[cid].ready_time)
        self.publish()

    @precondition(lambda self: bool(self.history))
    @rule(data=st.data(), twice=st.booleans())
    def release(self, data: st.DataObject, twice: bool) -> None:
        cid = self.pick(data, list(self.history))
        lease = self.book.table.leases.get(cid)
        if lease is not None:
            self.stale.append((lease, list(lease.blocks)))
        self.s.lease_cancel(cid)
        if twice:
            self.s.lease_cancel(cid)
        self.items.pop(cid, None)
        self.history.pop(cid, None)

    @precondition(lambda self: bool(self.stale))
    @rule(data=st.data())
    def release_stale(self, data: st.DataObject) -> None:
        """Releasing an already released lease is a no-op."""
        lease, held = data.draw(st.sampled_from(self.stale))
        assert self.book.table.release(lease, LeaseStatus.CANCELLED, self.clk()) is False
        mine = [b for b in held if self.pool.lease_ref(b.block_id) == 0]
        assert self.pool.lease_free(mine) == 0  # no lease reference: nothing is freed

    @rule(dt=st.sampled_from([0.0, 0.5, 3.0, 7.9, 8.0, 12.0]))
    def expire(self, dt: float) -> None:
        self.clk.advance(dt)
        self.s.lease_tick()
        assert all(x.deadline > self.clk() for x in self.book.table.leases.values())

    @rule(n_blocks=st.integers(1, 30), max_tokens=st.integers(1, 120), steps=st.integers(1, 4))
    def allocate(self, n_blocks: int, max_tokens: int, steps: int) -> None:
        """Unrelated work: a new request, one step (schedule entry may revoke)."""
        self.add(blocks(100 + self.n_req, n_blocks), max_tokens)
        for _ in range(steps):
            testing.step(self.s)

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = self.pick(data, list(self.s.requests))
        self.s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    @rule()
    def step(self) -> None:
        testing.step(self.s)

    @precondition(lambda self: bool(self.items))
    @rule(data=st.data(), same=st.booleans(), leased=st.booleans())
    def handoff(self, data: st.DataObject, same: bool, leased: bool) -> None:
        """Receipt: register the continuation (or a diverging prompt) and step."""
        held = [c for c in self.items if c in self.book.table.leases]
        cid = self.pick(data, held if leased and held else list(self.items))
        del self.items[cid]
        self.publish()
        hist = HISTORIES[self.history.pop(cid)]
        prompt = hist + blocks(7, 1) if same else hist[: 2 * BS] + blocks(8, 2)
        req = self.add(prompt, max_tokens=3)
        self.s.lease_bind(cid, req.request_id)
        lease = self.book.table.leases.get(cid)
        held = [b.block_id for b in lease.blocks] if lease else []
        testing.step(self.s)
        if lease is not None and lease.status is LeaseStatus.HANDED_OFF:
            # Only a block table that holds the protected blocks takes the lease over.
            table = self.s.kv_cache_manager.coordinator.get_blocks(req.request_id)[0]
            assert [b.block_id for b in table[: len(held)]] == held

    @precondition(lambda self: bool(self.book.table.holders))
    @rule(data=st.data())
    def strip(self, data: st.DataObject) -> None:
        """A leased block loses its hash (e.g. a KV connector eviction)."""
        bid = self.pick(data, list(self.book.table.holders))
        self.s.kv_cache_manager.evict_blocks({bid})
        self.s.lease_tick()

    @rule()
    def reset(self) -> None:
        before = dict(self.book.table.leases)
        if self.s.reset_prefix_cache():
            assert not self.book.table.leases and not self.pool.lease_refs
        else:
            assert self.book.table.leases == before  # vLLM refused: leases untouched

    # -- invariants --------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.s.check_integrity()
        assert self.pool.num_leased_blocks == len(self.book.table.holders)
        assert self.book.records() == self.book._build_records()  # the cache is current
        for x in self.book.table.leases.values():
            assert x.deadline == x.granted_at + LIFETIME
            p = self.book.cands.pending.get(x.cid)
            assert p is None or p.granted_at == x.granted_at  # a regrant keeps g_i
            assert all(b.ref_cnt >= 1 for b in x.blocks)

    @invariant()
    def residency(self) -> None:
        """The cached ``P_i`` of every candidate equals a fresh vLLM lookup."""
        kv = self.s.kv_cache_manager
        for p in list(self.book.cands.pending.values()):
            cached = self.book.cands.resident(p).blocks
            fresh = real(lookup(kv, p.hashes, len(p.notice.token_ids)))
            # the same blocks, not only the same hashes: a hash can come back on a block
            # while another holds it
            assert [b.block_id for b in cached] == [b.block_id for b in fresh]
            assert [b.block_hash for b in cached] == [b.block_hash for b in fresh]

    @invariant()
    def headroom(self) -> None:
        """Below H, no remaining lease could free a block by being revoked."""
        self.book.maintain(self.clk())
        if self.pool.get_num_free_blocks() < H:
            for x in self.book.table.leases.values():
                assert not any(
                    b.ref_cnt == 1 and self.pool.lease_ref(b.block_id) == 1 for b in x.blocks
                )

    def teardown(self) -> None:
        self.s.lease_release_all()
        self.s.finish_requests(list(self.s.requests), RequestStatus.FINISHED_ABORTED)
        self.s.check_integrity()
        audit = self.s.lease_audit()
        assert audit["refs_added"] == audit["refs_released"]
        assert all(b.ref_cnt == 0 for b in self.pool.blocks if not b.is_null)


LeaseMachine.TestCase.settings = settings(
    max_examples=75,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLeaseMachine = LeaseMachine.TestCase
