"""Notice hashes carried on from a workflow's last history equal vLLM's whole hashing."""

from __future__ import annotations

import random

import pytest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import init_none_hash

from ladsd.engine.lease_hashes import NoticeHashes
from ladsd.engine.lease_resident import make_hasher, prefix_hashes

BS = 16


@pytest.mark.parametrize("seed", range(8))
def test_carried_hashes_are_the_whole_historys(seed: int) -> None:
    """Random turns of a few workflows: mostly appended (the ReAct loop), sometimes
    edited inside the shared blocks, cut shorter, salted differently, or of a workflow
    dropped from the bounded memory. Every list equals hashing the history whole, and
    both ways were taken."""
    init_none_hash(get_hash_fn_by_name("sha256"))
    rng = random.Random(seed)
    hasher = make_hasher(BS)
    hashes = NoticeHashes(hasher, BS, size=3)
    hist: dict[str, list[int]] = {f"w{k}": [] for k in range(5)}
    salt: dict[str, str | None] = dict.fromkeys(hist)
    for _ in range(60):
        w = rng.choice(sorted(hist))
        h = hist[w]
        kind = rng.random()
        if kind < 0.7 or len(h) < BS:
            h += [rng.randrange(1, 5000) for _ in range(rng.randint(1, 3 * BS))]
        elif kind < 0.8:
            h[rng.randrange(len(h))] += 1  # an edit: a shared block differs
        elif kind < 0.9:
            del h[rng.randrange(len(h)) :]
        else:
            salt[w] = rng.choice((None, "a", "b"))
        got = hashes.of(w, tuple(h), salt[w])
        assert got == prefix_hashes(tuple(h), hasher, cache_salt=salt[w])
        assert len(got) == len(h) // BS
    assert hashes.reused > 0 and hashes.hashed > 0


def test_a_bad_size_is_refused() -> None:
    with pytest.raises(ValueError, match="bad notice hashes"):
        NoticeHashes(make_hasher(BS), BS, size=0)
