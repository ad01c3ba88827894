"""FIFO: ready order (ties by identity)."""

from __future__ import annotations

from collections.abc import Sequence

from ladsd.delivery.base import BasePolicy, need
from ladsd.delivery.policy import Pending, SenderView


def fifo_key(item: Pending) -> tuple:
    return (item.ready_time, item.cid)


class Fifo(BasePolicy):
    name = "fifo"

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
        return min(need(pending), key=fifo_key)
