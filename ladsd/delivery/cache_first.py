"""Cache-first, the base order: ``k_i = (cold?, frame bytes, r_i, identity)``.

Results whose history is resident go first, smaller frames first. Cold means
the latest accepted EngineState says ``|P_i| == 0`` or does not know ``i``.
``cache-first`` runs with the engine's FIFO leases; ``cache-first-noleases``
is the same order with no leases granted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ladsd.delivery.base import BasePolicy, need
from ladsd.delivery.policy import Pending, SenderView
from ladsd.records import ContinuationId


def cache_key(item: Pending, resident: Mapping[ContinuationId, int]) -> tuple:
    """``k_i``; ``resident`` maps cid -> |P_i| (missing: unknown, i.e. cold)."""
    return (resident.get(item.cid, 0) <= 0, item.frame_bytes, item.ready_time, item.cid)


def cache_first(pending: Sequence[Pending], resident: Mapping[ContinuationId, int]) -> Pending:
    """The item with the smallest ``k_i``."""
    return min(pending, key=lambda it: cache_key(it, resident))


class CacheFirst(BasePolicy):
    name = "cache-first"
    uses_leases = True

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
        return cache_first(need(pending), self.index(view.state).resident)


class CacheFirstNoLeases(CacheFirst):
    name = "cache-first-noleases"
    uses_leases = False
