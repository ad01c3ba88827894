"""ctrl CPU s counts the sender's CPU in ``policy.choose`` and the policy's hooks, not its
wall time (issue 23 item 5).

On two cores the event loop often waits for the GIL while the engine thread
holds it; that wait is no decision work. The clock is read through the module,
so a fake one shows which clock is used without any timing.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from ladsd.delivery.policy import Pending, SenderView
from ladsd.transport import outbox_policy
from ladsd.transport.outbox_policy import PolicyCalls
from tests.rigs.link import item


class First:
    name = "first"

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
        return pending[0]


class Fails(First):
    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
        raise RuntimeError("boom")


def fake_clocks(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """thread_time advances 0.25 per read; perf_counter must not be read at all."""
    reads: list[float] = []

    def thread_time() -> float:
        reads.append(0.25 * len(reads))
        return reads[-1]

    def wall() -> float:
        raise AssertionError("decision time read the wall clock")

    monkeypatch.setattr(
        outbox_policy, "time", SimpleNamespace(thread_time=thread_time, perf_counter=wall)
    )
    return reads


def test_decision_time_is_this_threads_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = fake_clocks(monkeypatch)
    calls = PolicyCalls(First())
    pending = [item(1).item, item(2).item]
    for _ in range(3):
        assert calls.choose(pending, calls.view(0, 1000.0), 0.0) is pending[0]
    assert len(reads) == 6 and calls.decision_s == pytest.approx(0.75)
    calls.check_integrity()


def test_a_choose_that_raises_still_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_clocks(monkeypatch)
    calls = PolicyCalls(Fails())
    with pytest.raises(RuntimeError):
        calls.choose([item(1).item], calls.view(0, 1000.0), 0.0)
    assert calls.decision_s == pytest.approx(0.25)


class Hooks(First):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_state(self, state: object, now: float) -> None:
        self.seen.append("state")

    def on_complete(self, cid: object, tokens: int, now: float) -> None:
        raise RuntimeError("boom")


def test_the_policys_hooks_count_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_state`` reads every published state: its CPU is decision work (one that
    raises still counts; the outbox names the error)."""
    reads = fake_clocks(monkeypatch)
    pol = Hooks()
    calls = PolicyCalls(pol)
    calls.hook(pol.on_state, None, 0.0)
    with pytest.raises(RuntimeError):
        calls.hook(pol.on_complete, None, 3, 0.0)
    assert pol.seen == ["state"] and len(reads) == 4
    assert calls.decision_s == pytest.approx(0.5)


def test_the_outbox_times_a_hook_it_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Outbox.set_state`` calls ``on_state`` through the timed hook (not around it)."""
    from ladsd.config import LinkConfig
    from ladsd.records import EngineState
    from ladsd.transport.outbox import Outbox

    reads = fake_clocks(monkeypatch)
    pol = Hooks()
    ob = Outbox(pol, config=LinkConfig())  # type: ignore[arg-type]
    ob.set_state(EngineState(time=0.0, seq=1, generation=0))
    assert pol.seen == ["state"] and len(reads) == 2 and ob.decision_s == pytest.approx(0.25)
