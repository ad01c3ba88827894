"""The neighbours' own yardsticks (peers.md), as pure functions over one run record.

Where a peer measures itself differently from ladsd's workflow latency, its
figure is computed for every policy from the run file alone:

* **TTFT** (HEAR, AugServe). The stamps (``ladsd.clock.Stamps``) have no
  first-token stamp. ``n`` is the first engine step with positive new-token
  work, i.e. when the call's prefill is first scheduled; its first token comes
  at the end of its last prefill chunk, between ``n`` and ``f``. So ladsd's
  TTFT is the *time to first scheduled token* *(ours)*:
  ``ttft = n - start``, with ``start = r`` (the result is ready: in the
  replay harness the sender plays HEAR's harness, so delivery order is the
  queue a ready request waits in) or ``a`` for a cold call (it enters the
  engine directly). It is a lower bound on the true TTFT by the call's
  prefill time. A call without ``n`` never got a token: it has no TTFT.
* **P50 TTFT** is the nearest-rank median (``nearest_rank(values, 50)``: an
  observed value, as ladsd's P95). ``ttft_max_s`` is reported too: HEAR's
  cache-aware order improves the median at the price of the maximum.
* **Batch completion** (HEAR) is the makespan: last termination - first
  arrival.
* **Prefix reuse** (HEAR) = cached prompt tokens / prompt tokens, over all
  calls (cold calls included).
* **Effective throughput** (AugServe: goodput under an SLO). SLO rule
  *(ours)*: a call meets the SLO if it has a TTFT and ``ttft <= ttft_slo_s``
  (default 5 s: ladsd's link and timing constants are the paper's in every
  profile, and the link rate is dilated to keep the calibrated link/engine
  ratio, so one threshold in seconds serves every profile); a workflow meets
  it if every one of its calls does. Goodput = workflows (or calls) meeting
  the SLO per second of makespan. One threshold, one run file: nothing is
  taken from another run.
"""

from __future__ import annotations

from ladsd.metrics.events import CallRecord, RunRecord
from ladsd.metrics.summary import makespan, nearest_rank

TTFT_SLO_S = 5.0  # AugServe-style SLO on TTFT (ours)

# Keys of :func:`yardsticks`, with a short column label and whose yardstick each is.
COLUMNS: dict[str, str] = {
    "ttft_p50_s": "P50 TTFT s (HEAR)",
    "ttft_max_s": "max TTFT s (HEAR)",
    "batch_completion_s": "batch completion s (HEAR)",
    "prefix_reuse": "prefix reuse (HEAR)",
    "slo_attainment": "calls in SLO (AugServe)",
    "goodput_calls_per_s": "goodput calls/s (AugServe)",
    "goodput_wf_per_s": "goodput wf/s (AugServe)",
}


def ttft(call: CallRecord) -> float | None:
    """``n - r`` (``n - a`` for a cold call); None without ``n`` or a start stamp."""
    st = call.stamps
    start = st.a if call.is_cold else st.r
    if st.n is None or start is None:
        return None
    return st.n - start


def ttfts(run: RunRecord) -> list[float]:
    """TTFT of every call that has one."""
    return [t for w in run.workflows for c in w.calls if (t := ttft(c)) is not None]


def prefix_reuse(run: RunRecord) -> float | None:
    """Cached prompt tokens / prompt tokens over all calls (None: no prompt tokens)."""
    calls = [c for w in run.workflows for c in w.calls]
    prompt = sum(c.prompt_tokens for c in calls)
    return sum(c.cached_tokens for c in calls) / prompt if prompt else None


def meets_slo(call: CallRecord, ttft_slo_s: float = TTFT_SLO_S) -> bool:
    """The call has a TTFT and it is at most ``ttft_slo_s``."""
    t = ttft(call)
    return t is not None and t <= ttft_slo_s


def goodput(run: RunRecord, ttft_slo_s: float = TTFT_SLO_S) -> tuple[float, float]:
    """(workflows, calls) meeting the SLO per second of makespan."""
    span = makespan(run)
    if not span > 0:
        raise ValueError(f"goodput needs a positive makespan, got {span}")
    good_calls = sum(meets_slo(c, ttft_slo_s) for w in run.workflows for c in w.calls)
    good_wf = sum(all(meets_slo(c, ttft_slo_s) for c in w.calls) for w in run.workflows)
    return good_wf / span, good_calls / span


def yardsticks(run: RunRecord, *, ttft_slo_s: float = TTFT_SLO_S) -> dict[str, float | None]:
    """Every peer yardstick of one run, keyed as :data:`COLUMNS` (None: not defined)."""
    if not ttft_slo_s > 0:
        raise ValueError(f"ttft_slo_s must be > 0, got {ttft_slo_s}")
    t = ttfts(run)
    calls = [c for w in run.workflows for c in w.calls]
    wf_s, calls_s = goodput(run, ttft_slo_s)
    return {
        "ttft_p50_s": nearest_rank(t, 50) if t else None,
        "ttft_max_s": max(t) if t else None,
        "batch_completion_s": makespan(run),
        "prefix_reuse": prefix_reuse(run),
        "slo_attainment": sum(meets_slo(c, ttft_slo_s) for c in calls) / len(calls)
        if calls
        else None,
        "goodput_calls_per_s": calls_s,
        "goodput_wf_per_s": wf_s,
    }
