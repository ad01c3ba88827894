"""Token bucket on an injected clock: exact rate and burst bounds."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ladsd.clock import ManualClock
from ladsd.transport.pacer import TokenBucket

R = 4000.0  # 32 kbit/s
DEPTH = 512
SLACK = 1e-6  # bytes of float slack


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Drive a coroutine whose sleeps only move the manual clock (it never suspends)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("coroutine suspended on a real await")


class Sim:
    """A manual clock whose sleep oversleeps by ``late`` seconds (a late wake-up)."""

    def __init__(self, late: float = 0.0) -> None:
        self.clock = ManualClock()
        self.late = late
        self.sleeps: list[float] = []

    async def sleep(self, dt: float) -> None:
        self.sleeps.append(dt)
        self.clock.advance(dt + self.late)

    def bucket(self, rate: float = R, depth: int = DEPTH) -> TokenBucket:
        return TokenBucket(rate, depth, clock=self.clock, sleep=self.sleep)


def test_starts_full_and_bursts_at_most_depth() -> None:
    sim = Sim()
    b = sim.bucket()
    assert run(b.take(DEPTH)) == DEPTH
    assert sim.clock() == 0.0 and not sim.sleeps
    assert not b.try_take(1)
    assert b.delay(DEPTH) == pytest.approx(DEPTH / R)


def test_backlogged_rate_is_exact() -> None:
    sim = Sim()
    b = sim.bucket()
    total = 0
    for _ in range(100):
        total += run(b.take(DEPTH))
    # depth up front, then R bytes per second exactly
    assert sim.clock() == pytest.approx((total - DEPTH) / R, rel=1e-12)


def test_late_wakeups_lose_no_credit_when_taking_down_to_half_a_chunk() -> None:
    late = 0.02  # 80 bytes of credit at R; below (depth - least) / R = 64 ms
    sim = Sim(late=late)
    b = sim.bucket()
    total = 0
    while total < 100_000:
        total += run(b.take(DEPTH, least=DEPTH // 2))
    # time to move `total` bytes: no lost credit, except the last wake-up's lateness
    assert sim.clock() <= (total - DEPTH) / R + late + 1e-9
    assert sim.clock() >= (total - DEPTH) / R - 1e-9


def test_late_wakeups_waiting_for_a_whole_chunk_do_lose_credit() -> None:
    # The reason take() has `least`: with least == want == depth, lateness overflows the bucket.
    sim = Sim(late=0.02)
    b = sim.bucket()
    total = 0
    while total < 100_000:
        total += run(b.take(DEPTH))
    assert sim.clock() > (total - DEPTH) / R + 0.5


def test_idle_credit_is_capped_at_depth() -> None:
    sim = Sim()
    b = sim.bucket()
    run(b.take(DEPTH))
    sim.clock.advance(3600.0)
    assert b.available() == DEPTH
    assert run(b.take(DEPTH, least=1)) == DEPTH
    assert not b.try_take(1)


def test_take_returns_between_least_and_want() -> None:
    sim = Sim()
    b = sim.bucket()
    run(b.take(DEPTH))
    sim.clock.advance(100 / R)
    assert run(b.take(DEPTH, least=50)) == 100
    assert sim.clock() == pytest.approx(100 / R)


@pytest.mark.parametrize("want,least", [(0, None), (DEPTH + 1, None), (10, 20), (10, 0)])
def test_bad_requests_are_refused(want: int, least: int | None) -> None:
    b = Sim().bucket()
    with pytest.raises(ValueError, match="least"):
        run(b.take(want, least))


@pytest.mark.parametrize("rate,depth", [(0, 512), (-1, 512), (float("inf"), 512), (4000, 0)])
def test_bad_configuration_is_refused(rate: float, depth: int) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, depth)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 0.5),  # idle gap before the request (s)
            st.integers(1, DEPTH),  # want
            st.floats(0, 1),  # least as a fraction of want
        ),
        min_size=1,
        max_size=60,
    ),
    st.floats(0, 0.01),
    st.sampled_from([4000.0, 6000.0, 1234.5]),
)
def test_any_interval_carries_at_most_depth_plus_rate_times_length(
    requests: list[tuple[float, int, float]], late: float, rate: float
) -> None:
    sim = Sim(late=late)
    b = sim.bucket(rate=rate)
    grants: list[tuple[float, int]] = []
    for gap, want, frac in requests:
        sim.clock.advance(gap)
        least = max(1, int(want * frac))
        n = run(b.take(want, least))
        assert least <= n <= want
        grants.append((sim.clock(), n))
    for i in range(len(grants)):
        total = 0
        for j in range(i, len(grants)):
            total += grants[j][1]
            span = grants[j][0] - grants[i][0]
            assert total <= DEPTH + rate * span + SLACK


async def test_default_clock_is_the_event_loop() -> None:
    b = TokenBucket(1e6, DEPTH)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await b.take(DEPTH) == DEPTH
    assert await b.take(DEPTH) == DEPTH  # waits for the credit on the loop's clock
    assert loop.time() - t0 >= DEPTH / 1e6 - 1e-9
    assert b.taken == 2 * DEPTH
