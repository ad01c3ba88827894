"""Controller-CPU shortcuts of the lease book (issue 23 item 5) never change an answer.

On vLLM's real Scheduler / KVCacheManager (no model, no workers): an incomplete
``P_i`` is not looked up again while it cannot have changed, yet grows when its
next block is cached and shrinks when a hash goes; the published lease records
are restamped, not rebuilt, on a new generation alone; the headroom rule is
judged before ``Delta_i`` is counted. Every published state is the same with
and without the shortcuts.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    make_block_hash_with_group_id,
)

from ladsd.engine import lease_candidates, lease_publish
from ladsd.engine.lease_grants import Reserve
from ladsd.engine.lease_resident import Prefix, lookup_hit, unchanged
from ladsd.engine.lease_table import LeaseTable
from ladsd.records import ContinuationId
from tests.rigs import book as rigs
from tests.rigs.book import toks
from tests.rigs.leases import real_blocks as real

A = ContinuationId("wa", 1)
B = ContinuationId("wb", 1)


class Book(rigs.Book):
    """The book rig, with the candidates' view and a checked ``P_i``."""

    @property
    def cands(self) -> Any:
        return self.s.lease_book.cands

    def fresh(self, cid: ContinuationId) -> list[int]:
        """``P_i`` as the book holds it, after checking it against a full vLLM lookup."""
        p = self.cands.pending[cid]
        groups, _ = lookup_hit(self.s.kv_cache_manager, p.hashes, len(p.notice.token_ids))
        mine = list(p.prefix.block_ids)
        assert mine == [b.block_id for b in real(groups)]
        assert p.size == len(mine) and p.ids == frozenset(mine)
        assert p.prefix.hashes == tuple(b.block_hash for b in real(groups))
        return mine


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the full vLLM lookups the candidates make."""
    calls: list[int] = []

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return lookup_hit(*a, **k)

    monkeypatch.setattr(lease_candidates, "lookup_hit", counted)
    return calls


def test_an_unchanged_incomplete_prefix_is_not_looked_up_again(lookups: list[int]) -> None:
    b = Book(enabled=False)
    b.run(toks(1, 6))
    b.notice(A, toks(1, 6) + toks(2, 2))  # 6 of its 8 blocks resident: incomplete
    assert not b.cands.pending[A].complete
    assert len(b.fresh(A)) == 6
    n = len(lookups)
    for _ in range(5):
        b.tick()
    b.run(toks(3, 4))  # other blocks cached: the prefix's next block is not among them
    b.tick()
    assert len(lookups) == n  # the probe of its next block stood in for every walk
    assert len(b.fresh(A)) == 6


def test_an_incomplete_prefix_grows_when_its_next_block_is_cached(lookups: list[int]) -> None:
    b = Book(enabled=False)
    b.run(toks(1, 6))
    history = toks(1, 6) + toks(2, 2)
    b.notice(A, history)
    b.tick()
    assert len(b.fresh(A)) == 6
    b.run(history + toks(3, 1))  # computes (and caches) the history's last two blocks
    b.tick()
    assert len(b.fresh(A)) == 8 and b.cands.pending[A].complete


def test_an_evicted_prefix_is_looked_up_again() -> None:
    b = Book(num_blocks=24, enabled=False)
    b.run(toks(1, 6))
    b.notice(A, toks(1, 6) + toks(2, 2))
    assert len(b.fresh(A)) == 6
    b.run(toks(4, 20))  # needs nearly the whole pool: A's cached blocks are evicted
    b.tick()
    assert len(b.fresh(A)) < 6


def test_a_new_generation_restamps_the_records(monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[int] = []
    build = lease_publish.build_records

    def counted(*a: Any, **k: Any) -> Any:
        builds.append(1)
        return build(*a, **k)

    monkeypatch.setattr(lease_publish, "build_records", counted)
    b = Book()
    for seed, cid in ((1, A), (2, B)):
        b.run(toks(seed, 4))
        b.notice(cid, toks(seed, 4))
    st = b.s.lease_state()
    assert {r.cid for r in st.leases} == {A, B}
    n = len(builds)
    for _ in range(3):
        b.tick()  # a new generation, no reference changes
        st = b.s.lease_state()
        book = b.s.lease_book
        assert st.leases == lease_publish.build_records(book.leases, book.pins, st.generation)
        assert {r.generation for r in st.leases} == {st.generation}
    assert len(builds) == n + 3  # only the three comparisons above built records
    b.s.lease_cancel(A)  # references released: rebuilt
    st = b.s.lease_state()
    assert [r.cid for r in st.leases] == [B] and len(builds) == n + 4


def test_a_headroom_refusal_does_not_count_delta(monkeypatch: pytest.MonkeyPatch) -> None:
    b = Book(num_blocks=16)  # H = 4: a 12-block prefix leaves too few free
    b.run(toks(1, 12))
    delta = LeaseTable.delta

    def never(self: LeaseTable, blocks: Any) -> int:
        raise AssertionError("Delta_i counted for a headroom refusal")

    monkeypatch.setattr(LeaseTable, "delta", never)
    b.notice(A, toks(1, 12))
    assert b.s.lease_state().counters["headroom_refusals"] == 1
    monkeypatch.setattr(LeaseTable, "delta", delta)


def test_reserve_taken_is_the_union_of_free_blocks() -> None:
    rng = random.Random(5)
    for _ in range(200):
        blocks = [KVCacheBlock(i, rng.choice((0, 0, 1))) for i in rng.sample(range(60), 20)]
        cached = set(rng.sample(range(60), rng.randrange(30)))
        new = rng.randrange(5)
        want = len({b.block_id for b in blocks if b.ref_cnt == 0} | cached) + new
        ids = tuple(b.block_id for b in blocks)
        prefix = Prefix(blocks=tuple(blocks), block_ids=ids, ids=frozenset(ids))
        assert Reserve(set(cached), new).taken(prefix) == want


def scenario() -> list[Any]:
    """Grants, ticks, growth, a cancellation and eviction; every published state."""
    b = Book(num_blocks=48)
    out = []
    b.run(toks(1, 6))
    b.notice(A, toks(1, 6) + toks(2, 2))
    out.append(b.s.lease_state())
    b.run(toks(5, 3))
    b.notice(B, toks(5, 3))
    for _ in range(3):
        b.tick()
        out.append(b.s.lease_state())
    b.run(toks(1, 6) + toks(2, 2) + toks(3, 1))
    b.tick()
    out.append(b.s.lease_state())
    b.s.lease_cancel(A)
    b.run(toks(7, 30))
    b.tick()
    out.append(b.s.lease_state())
    return out


def test_published_states_are_the_same_without_the_shortcuts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = scenario()
    monkeypatch.setattr(lease_candidates, "unchanged", lambda *a, **k: False)  # look up all

    def rebuilt(self: Any, generation: int) -> Any:
        return lease_publish.build_records(self.leases, self.pins, generation)

    monkeypatch.setattr(lease_publish.Publication, "records", rebuilt)
    slow = scenario()
    assert fast == slow
    assert any(s.leases for s in fast) and any(dict(s.resident).get(A) == 8 for s in fast)


class _Pool:
    """What :func:`unchanged` reads of a pool: its epoch, strip stamps and cached hashes."""

    def __init__(self) -> None:
        self.hash_epoch = 0
        self.stripped_at: dict[int, int] = {}
        self.cached: set[Any] = set()

    def get_cached_block(self, h: Any, groups: list[int]) -> Any:
        key = make_block_hash_with_group_id(h, groups[0])
        return key if key in self.cached else None


def test_a_prefix_whose_block_got_its_hash_back_is_looked_up_again() -> None:
    # Block 1 loses hash h1 (epoch 1) and later gets it back while another block holds
    # h1 in vLLM's map: the hash alone looks intact, the strip stamp says it changed.
    h = [make_block_hash_with_group_id(BlockHash(bytes([i])), 0) for i in range(3)]
    blocks = [KVCacheBlock(i, 0, _block_hash=h[i]) for i in range(2)]
    prefix = Prefix.of([blocks])
    pool = _Pool()
    raw = [BlockHash(bytes([i])) for i in range(3)]
    assert unchanged(pool, True, prefix, raw, 0, complete=True)
    pool.hash_epoch = 1  # a removal elsewhere: the hashes are read, and hold
    assert unchanged(pool, True, prefix, raw, 0, complete=True)
    pool.stripped_at[1] = 1  # block 1's own removal, after the check at epoch 0
    assert not unchanged(pool, True, prefix, raw, 0, complete=True)
    assert unchanged(pool, True, prefix, raw, 1, complete=True)  # checked after it
    blocks[1].reset_hash()  # a hash gone without a stamp (a prefix-cache reset)
    pool.hash_epoch = 2
    assert not unchanged(pool, True, prefix, raw, 1, complete=True)


def test_an_incomplete_prefix_stays_until_its_next_block_is_cached() -> None:
    h = [make_block_hash_with_group_id(BlockHash(bytes([i])), 0) for i in range(3)]
    prefix = Prefix.of([[KVCacheBlock(i, 0, _block_hash=h[i]) for i in range(2)]])
    pool = _Pool()
    raw = [BlockHash(bytes([i])) for i in range(3)]
    assert not unchanged(pool, True, prefix, raw, -1, complete=False)  # never looked up
    assert unchanged(pool, True, prefix, raw, 0, complete=False)
    assert not unchanged(pool, False, prefix, raw, 0, complete=False)  # no plain lookup
    pool.cached.add(make_block_hash_with_group_id(raw[2], 0))
    assert not unchanged(pool, True, prefix, raw, 0, complete=False)  # it can grow now
