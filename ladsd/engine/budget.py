"""The lease budget of spec section 3.1 (and the grant order of 3.2) as pure functions.

Every symbol is the spec's: ``tau`` (remaining horizon), ``T_B`` (FIFO-inventory
estimate of the time to first successful allocation), ``N`` (near-use set),
``D`` (demand), ``C_safe`` (safe ceiling), fit, ``B`` (target), ``C``
(committed capacity). Blocks are opaque hashable ids, so the functions are
tested without an engine; :mod:`ladsd.engine.lease_book` feeds them the
resident prefixes found in vLLM's prefix cache.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K")


def fifo_key(ready_time: float, ident: K) -> tuple[float, K]:
    """Grant order (spec 3.2): ready time, then identity and version.

    ``ident`` is a :class:`~ladsd.records.ContinuationId`, whose own order
    (``order=True``) is (workflow, turn, version); the key only puts the ready
    time in front. The one definition for candidates, leases and link times.
    """
    return (ready_time, ident)


def remaining_horizon(lifetime: float, granted_at: float | None, now: float) -> float:
    """``tau_i(t)``: ``l`` before the first grant, ``g_i + l - t`` after it.

    ``lifetime`` is the continuation's own ``l_i`` where it has one (:func:`lease_lifetime`).
    """
    if lifetime <= 0:
        raise ValueError(f"lease lifetime must be positive, got {lifetime}")
    if granted_at is None:
        return lifetime
    return granted_at + lifetime - now


LIFETIME_MARGIN = 1.5  # (ours) an expected wait is a prediction: cover half as much again
LIFETIME_CAP_FACTOR = 8.0  # (ours) default cap on l_i, in multiples of l


def lease_lifetime(lifetime: float, expected_s: float, margin: float, cap: float) -> float:
    """``l_i = min(cap, max(l, margin * expected_s))``: one continuation's lease lifetime.

    Ours, not the spec's (issue 21 item 4): a coding agent's tool waits are
    seconds (median ~11 s) against ``l`` = 8 s, so a history bounded by ``l``
    is either never near use (``T_B > tau``) or expires before use. ``l_i``
    replaces ``l`` for that continuation only: in ``tau``, its deadline
    ``g_i + l_i``, the drop of its candidate and the ttl-pin cap. It never
    escapes the budget: ``B = min(D, C_safe)`` still counts only what fits,
    a grant still leaves ``H`` free, and the headroom revocation still
    revokes it (latest deadline first: a long lease goes before shorter ones).
    ``cap >= l`` is a stated bound; ``cap == l`` is the fixed rule.
    """
    if lifetime <= 0 or not math.isfinite(lifetime):
        raise ValueError(f"lease lifetime must be positive, got {lifetime}")
    if not (margin > 0 and math.isfinite(margin)):
        raise ValueError(f"lifetime margin must be positive, got {margin}")
    if not (lifetime <= cap < math.inf):
        raise ValueError(f"lifetime cap {cap} must be finite and at least l = {lifetime}")
    if not (0 <= expected_s < math.inf):
        raise ValueError(f"expected wait must be finite and non-negative, got {expected_s}")
    return min(cap, max(lifetime, margin * expected_s))


def engine_delay(kappa: float, waiting: int, running: int, max_seqs: int) -> float:
    """``kappa * max(0, w + a + 1 - m)``: steps to wait for a running slot."""
    if kappa < 0:
        raise ValueError(f"kappa must be non-negative, got {kappa}")
    if max_seqs <= 0:
        raise ValueError(f"max_num_seqs must be positive, got {max_seqs}")
    return kappa * max(0, waiting + running + 1 - max_seqs)


def fifo_wait_times(
    q_b: int, payload_bytes: Sequence[int], overhead: int, rate: float
) -> list[float]:
    """Link time of each pending frame in FIFO order: ``(Q_B + sum_{j<=i}(h+p_j)) / R``."""
    if rate <= 0:
        raise ValueError(f"link rate must be positive, got {rate}")
    if q_b < 0 or overhead < 0 or any(p < 0 for p in payload_bytes):
        raise ValueError("byte counts must be non-negative")
    out: list[float] = []
    acc = q_b
    for p in payload_bytes:
        acc += overhead + p
        out.append(acc / rate)
    return out


def time_to_allocation(link_time: float, delay: float) -> float:
    """``T_B_i = link time + engine delay`` (ours, spec 3.1)."""
    return link_time + delay


@dataclass(frozen=True)
class Candidate:
    """One current pending result as the budget sees it."""

    key: Hashable
    prefix: frozenset[Hashable]  # P_i (block ids); empty = cold
    tau: float  # remaining horizon
    t_b: float  # T_B_i


def is_near(c: Candidate) -> bool:
    """``i in N(t)``: ``P_i != {}``, ``tau_i > 0`` and ``T_B_i <= tau_i``."""
    return bool(c.prefix) and c.tau > 0 and c.t_b <= c.tau


def near_use_set(cands: Iterable[Candidate]) -> list[Candidate]:
    """``N(t) = { i : P_i != {}, tau_i > 0, T_B_i <= tau_i }`` (input order kept)."""
    return [c for c in cands if c.prefix and c.tau > 0 and c.t_b <= c.tau]


def demand(near: Iterable[Candidate]) -> int:
    """``D(t) = |union_{i in N} P_i|``."""
    union: set[Hashable] = set()
    for c in near:
        union |= c.prefix
    return len(union)


class DemandMemo:
    """``D(t)`` of the last near-use set, reused while it is the same prefixes (ours: a cache).

    The budget is evaluated every 100 ms tick, and the union of the ``P_i`` is
    its cost (O(sum |P_i|)); between ticks the near set and its prefixes (each
    ``P_i`` a frozenset replaced only when looked up anew) rarely change. The
    key is the tuple of prefixes in order: equal tuples (identity first, then
    set equality) have the same union, so an answer never changes.
    """

    def __init__(self) -> None:
        self.key: tuple[frozenset[Hashable], ...] = ()
        self.d = 0

    def __call__(self, near: Sequence[Candidate]) -> int:
        key = tuple(c.prefix for c in near)
        if key != self.key:
            self.key, self.d = key, demand(near)
        return self.d


def safe_ceiling(used: int, free: int, headroom: int) -> int:
    """``C_safe(t) = max(0, U + F - H)`` (ours)."""
    return max(0, used + free - headroom)


def fits(near: Iterable[Candidate], c_safe: int) -> bool:
    """Some ``i in N`` has ``|P_i| <= C_safe``."""
    return any(len(c.prefix) <= c_safe for c in near)


def budget_target(d: int, c_safe: int, fit: bool) -> int:
    """``B(t) = min(D, C_safe)`` if fit else 0."""
    return min(d, c_safe) if fit else 0


def committed_capacity(target: int, used: int) -> int:
    """``C(t) = max(B, U)`` (ours): a lowered target never revokes."""
    return max(target, used)


@dataclass(frozen=True)
class Budget:
    """One budget evaluation."""

    near: tuple[Hashable, ...]  # keys of N(t), input order
    D: int
    C_safe: int
    fit: bool
    B: int
    C: int


def evaluate(
    cands: Sequence[Candidate],
    used: int,
    free: int,
    headroom: int,
    memo: DemandMemo | None = None,
) -> Budget:
    """Section 3.1 end to end for the given candidates, ``U`` and ``F``.

    ``memo``: a :class:`DemandMemo` carried between evaluations (same answers).
    """
    near = near_use_set(cands)
    d = demand(near) if memo is None else memo(near)
    c_safe = safe_ceiling(used, free, headroom)
    fit = fits(near, c_safe)
    b = budget_target(d, c_safe, fit)
    return Budget(tuple(c.key for c in near), d, c_safe, fit, b, committed_capacity(b, used))
