"""Size-first: smallest frame (h + p) first; ties by ready time, then identity."""

from __future__ import annotations

from collections.abc import Sequence

from ladsd.delivery.base import BasePolicy, need
from ladsd.delivery.policy import Pending, SenderView


def size_key(item: Pending) -> tuple:
    return (item.frame_bytes, item.ready_time, item.cid)


class SizeFirst(BasePolicy):
    name = "size-first"

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
        return min(need(pending), key=size_key)
