"""FIFO: ready order (ties by identity)."""

from __future__ import annotations

from collections.abc import Sequence

from ladsd.delivery.base import BasePolicy, need
from ladsd.delivery.policy import Pending, SenderView
from ladsd.engine.budget import fifo_key  # the one FIFO key: the lease book grants in it too


class Fifo(BasePolicy):
    name = "fifo"

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
        return min(need(pending), key=lambda it: fifo_key(it.ready_time, it.cid))
