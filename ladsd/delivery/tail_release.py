"""Tail-aware Release, delivery-side adaptation (ours, after Feng et al. 2026).

* Work estimate, frozen at ready: ``W_i = prompt_tokens + 4 * mean_out(r_i)``
  where ``mean_out(r_i)`` is the running mean of the model outputs observed
  (``on_complete``) up to ``r_i`` (``output_prior`` before any): causal, and
  the same whenever it is recomputed, so nothing is stored at readiness.
* Committed-work ledger: ``W_i`` enters at commitment, retires when the
  continuation's model call completes.
* Gate: a frame is admissible if ``ledger + W_i <= cap``; among admissible
  frames the oldest workflow goes first (workflow arrival, ready time,
  identity). If none is admissible the policy holds (``choose`` returns
  None) until a completion or new state; with an empty ledger the oldest is
  always admitted, so holding never deadlocks.
* Cap (AIMD on engine feedback, ``on_state``, at most once per ``adapt_s``):
  starts unbounded; the first state of a congestion episode (engine waiting
  ``w > 0``) shrinks it once to ``beta * min(cap, ledger)`` (never below one
  mean estimate), and it holds for the rest of the episode (a multiplicative
  decrease per congestion event, as in AIMD, not one per tick); an idle
  engine (``w == 0`` and ``a < m``) grows it by one mean estimate;
  otherwise (full but not queueing) it holds. The episode ends at ``w == 0``.
* ``prompt_tokens`` is the continuation's full prompt (history + observation).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from ladsd.delivery.base import BasePolicy, need
from ladsd.delivery.policy import Pending, SenderView
from ladsd.records import ContinuationId, EngineState

OUTPUT_WEIGHT = 4  # W_i = prompt + 4 x expected output


def work_estimate(prompt_tokens: int, expected_output: float) -> float:
    return prompt_tokens + OUTPUT_WEIGHT * expected_output


def oldest_key(item: Pending) -> tuple:
    return (item.workflow_arrival, item.ready_time, item.cid)


def adapt_cap(
    cap: float, ledger: float, step: float, state: EngineState, beta: float, shrunk: bool = False
) -> tuple[float, str]:
    """The next cap and what happened (``shrink``, ``grow``, ``hold``).

    ``step`` is one mean committed estimate; before any commitment (``step``
    0) there is no scale for the cap yet, so it holds. ``shrunk``: the cap was
    already cut in this congestion episode, so it holds until the episode ends.
    """
    if step <= 0:
        return cap, "hold"
    if state.w > 0:
        if shrunk:
            return cap, "hold"
        return max(step, beta * min(cap, ledger)), "shrink"
    if state.a < state.m:
        return cap + step, "grow"  # inf stays inf
    return cap, "hold"


class OutputMean:
    """Running mean of observed outputs, queryable as of any past time."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cum: list[int] = [0]  # cum[k] = sum of the first k outputs (time order)

    def add(self, t: float, tokens: int) -> None:
        if not self.times or t >= self.times[-1]:
            self.times.append(t)
            self.cum.append(self.cum[-1] + tokens)
            return
        # Out-of-order report (rare): rebuild the prefix sums.
        k = bisect.bisect_right(self.times, t)
        outs = [b - a for a, b in zip(self.cum, self.cum[1:], strict=True)]
        self.times.insert(k, t)
        outs.insert(k, tokens)
        self.cum = [0]
        for o in outs:
            self.cum.append(self.cum[-1] + o)

    def mean_at(self, t: float, prior: float) -> float:
        k = bisect.bisect_right(self.times, t)
        return self.cum[k] / k if k else prior


class TailRelease(BasePolicy):
    name = "tail-release"

    def __init__(
        self,
        *,
        output_prior: float = 64.0,
        beta: float = 0.5,
        adapt_s: float = 0.1,
        cap: float = math.inf,
        uses_leases: bool | None = None,
    ) -> None:
        super().__init__(uses_leases=uses_leases)
        if output_prior < 0:
            raise ValueError(f"output_prior must be >= 0, got {output_prior}")
        if not 0 < beta < 1:
            raise ValueError(f"beta must be in (0, 1), got {beta}")
        if adapt_s < 0:
            raise ValueError(f"adapt_s must be >= 0, got {adapt_s}")
        if not cap > 0:
            raise ValueError(f"cap must be > 0, got {cap}")
        self.output_prior = output_prior
        self.beta = beta
        self.adapt_s = adapt_s
        self.cap = cap
        self.outputs = OutputMean()
        self.ledger: dict[ContinuationId, float] = {}
        self.ledger_work = 0.0
        self._est_sum = 0.0  # committed estimates, for the AIMD step
        self._est_n = 0
        self._last_adapt: float | None = None
        self._shrunk = False  # the cap was cut in the current congestion episode

    def estimate(self, item: Pending) -> float:
        """``W_i``, frozen at ready (depends only on outputs seen up to ``r_i``)."""
        return work_estimate(
            item.prompt_tokens, self.outputs.mean_at(item.ready_time, self.output_prior)
        )

    def step(self) -> float:
        """One mean committed estimate (the AIMD increment and shrink floor)."""
        return self._est_sum / self._est_n if self._est_n else 0.0

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending | None:
        need(pending)
        if not self.ledger:
            return min(pending, key=oldest_key)  # no deadlock: nothing is running
        room = self.cap - self.ledger_work
        best: Pending | None = None
        best_key: tuple = ()
        for it in pending:
            if self.estimate(it) > room:
                continue
            k = oldest_key(it)
            if best is None or k < best_key:
                best, best_key = it, k
        return best

    def on_commit(self, item: Pending, now: float) -> None:
        super().on_commit(item, now)
        w = self.estimate(item)
        if self.ledger_work + w > self.cap:
            self.counts["over_cap"] += 1  # admitted by the empty-ledger rule
        old = self.ledger.pop(item.cid, None)
        if old is not None:
            self.ledger_work -= old
        self.ledger[item.cid] = w
        self.ledger_work += w
        self._est_sum += w
        self._est_n += 1

    def on_complete(self, cid: ContinuationId, output_tokens: int, now: float) -> None:
        super().on_complete(cid, output_tokens, now)
        w = self.ledger.pop(cid, None)
        if w is not None:
            self.ledger_work = max(0.0, self.ledger_work - w) if self.ledger else 0.0
            self.counts["retired"] += 1
        if output_tokens > 0:
            self.outputs.add(now, output_tokens)

    def on_state(self, state: EngineState, now: float) -> None:
        if self._last_adapt is not None and now - self._last_adapt < self.adapt_s:
            return
        self._last_adapt = now
        self.cap, what = adapt_cap(
            self.cap, self.ledger_work, self.step(), state, self.beta, self._shrunk
        )
        self._shrunk = state.w > 0 and (self._shrunk or what == "shrink")
        self.counts[f"cap_{what}"] += 1

    def stats(self) -> dict[str, int]:
        cap = -1 if math.isinf(self.cap) else int(self.cap)
        return {**self.counts, "cap": cap, "ledger": int(self.ledger_work)}
