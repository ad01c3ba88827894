"""The scheduler-book rig: a lease scheduler on vLLM's real Scheduler (no model) and a
manual clock, with requests run to completion, history notices and budget ticks; every
operation checks integrity."""

from __future__ import annotations

from ladsd import testing
from ladsd.clock import ManualClock
from ladsd.config import LeaseConfig
from ladsd.engine.sched_leases import LeaseScheduler
from ladsd.records import ContinuationId, HistoryNotice, InventoryItem, Phase, SenderInventory

BS = 16  # block size


def toks(seed: int, n_blocks: int) -> list[int]:
    """``n_blocks`` full blocks of token ids, distinct per ``seed``."""
    return [1000 + seed * 7919 + i for i in range(n_blocks * BS)]


class Book:
    """A lease scheduler on a manual clock; every operation checks integrity."""

    def __init__(self, num_blocks: int = 64, enabled: bool = True) -> None:
        self.s = testing.make_scheduler(LeaseScheduler, num_blocks=num_blocks, block_size=BS)
        self.clk = ManualClock(1000.0)
        cfg = LeaseConfig(enabled=enabled, headroom_blocks=4, lease_lifetime_s=8.0)
        self.s.lease_setup(cfg, 0.0, self.clk)
        self.items: dict[ContinuationId, InventoryItem] = {}
        self.n = 0

    def run(self, tokens: list[int]) -> None:
        """Run a request to completion: its full blocks stay cached (evictable)."""
        self.n += 1
        req = testing.make_request(f"r{self.n}", tokens, max_tokens=2)
        self.s.add_request(req)
        for _ in range(200):  # bounded: a broken scenario fails, never hangs
            if req.is_finished():
                return
            testing.step(self.s)
            self.s.check_integrity()
        raise AssertionError("request did not finish")

    def notice(self, cid: ContinuationId, history: list[int]) -> None:
        key = cid.key()
        n = HistoryNotice(cid, tuple(history), f"p-{key}", f"d-{key}", self.clk(), 500)
        self.items[cid] = InventoryItem(cid, Phase.PENDING, 500, n.ready_time)
        self.s.lease_notice(n)
        self.s.lease_inventory(SenderInventory(self.clk(), tuple(self.items.values()), 0, 1e6))
        self.s.check_integrity()

    def tick(self) -> None:
        self.clk.advance(0.1)
        self.s.lease_tick()
        self.s.check_integrity()
