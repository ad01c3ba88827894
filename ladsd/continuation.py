"""The harness's continuation probability of a session (HEAR session retention).

Contract:

* Estimated from COMPLETED workflows only: the harness reports each
  workflow's end with the number of model calls it made
  (:meth:`ContinuationEstimate.end`); nothing about the replayed future or an
  unfinished workflow enters the estimate.
* ``p_k`` is the probability that a session which has made ``k`` calls makes
  another one::

      p_k = (#completed with more than k calls + 1) / (#completed with at least k calls + 2)

  The ``+1 / +2`` is the prior (ours): Laplace's rule of succession, a
  uniform prior on ``p_k``. Before any workflow completed ``p_k = 1/2``; it
  is never exactly 0 or 1, so ``r = p * exp(-idle / 400 s)`` keeps ordering
  sessions by idle time when every ``p`` is alike.
* A notice for turn ``t`` (calls ``0 .. t-1`` done) carries ``p_t``: the
  probability as known when call ``t - 1`` ended, as HEAR records it after
  each request.
* Memory: one counter per distinct call count. asyncio side only.
"""

from __future__ import annotations

from collections import Counter


class ContinuationEstimate:
    """``p_k`` from completed workflows (see the module contract)."""

    def __init__(self) -> None:
        self.completed: Counter[int] = Counter()  # calls made -> completed workflows

    def end(self, calls: int) -> None:
        """A workflow completed after ``calls`` model calls (the cold call included)."""
        if calls < 1:
            raise ValueError(f"a completed workflow made at least one call, got {calls}")
        self.completed[calls] += 1

    def p(self, k: int) -> float:
        """``p_k``: a session that made ``k`` calls makes another one."""
        if k < 0:
            raise ValueError(f"calls made must be non-negative, got {k}")
        at_least = sum(n for c, n in self.completed.items() if c >= k)
        more = sum(n for c, n in self.completed.items() if c > k)
        return (more + 1) / (at_least + 2)
