"""The link rig: recording policies (``Recorder``, ``Boom``) and prepared frames for the
sender, link and outbox tests (real TCP on 127.0.0.1 stays in those tests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ladsd.config import LinkConfig
from ladsd.delivery.policy import Pending, SenderView
from ladsd.records import ContinuationId, EngineState
from ladsd.transport.frame import Codec, digest
from ladsd.transport.link import Prepared, Sender, prepare
from ladsd.transport.outbox import Outbox

FAST = LinkConfig(rate_bytes_per_s=1_000_000.0)  # loopback tests: pacing on, but quick


class Recorder:
    """A tiny policy: picks by ``key``; records commits and the window at each commit."""

    name = "recorder"
    uses_leases = False

    def __init__(self, key: Callable[[Pending], Any] = lambda p: (p.ready_time, p.cid)) -> None:
        self.key = key
        self.sender: Sender | Outbox | None = None  # anything with ``in_flight``
        self.commits: list[ContinuationId] = []
        self.in_flight: list[int] = []
        self.views: list[SenderView] = []
        self.hold = False
        self.states: list[int] = []

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending | None:
        self.views.append(view)
        return None if self.hold else min(pending, key=self.key)

    def on_state(self, state: EngineState, now: float) -> None:
        self.states.append(state.seq)

    def on_commit(self, item: Pending, now: float) -> None:
        self.commits.append(item.cid)
        if self.sender is not None:
            self.in_flight.append(self.sender.in_flight)

    def on_complete(self, cid: ContinuationId, output_tokens: int, now: float) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


class Boom(Recorder):
    """Raises in ``hook`` from its ``at``-th call on."""

    name = "boom"

    def __init__(self, hook: str, at: int = 1) -> None:
        super().__init__()
        self.hook, self.at, self.calls = hook, at, 0

    def _maybe(self, hook: str) -> None:
        if hook == self.hook:
            self.calls += 1
            if self.calls >= self.at:
                raise RuntimeError(f"bad {hook}")

    def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending | None:
        self._maybe("choose")
        return super().choose(pending, view, now)

    def on_state(self, state: EngineState, now: float) -> None:
        self._maybe("on_state")

    def on_commit(self, item: Pending, now: float) -> None:
        self._maybe("on_commit")
        super().on_commit(item, now)

    def on_complete(self, cid: ContinuationId, output_tokens: int, now: float) -> None:
        self._maybe("on_complete")


def item(i: int, size: int = 300, codec: Codec = Codec.IDENTITY) -> Prepared:
    obs = bytes((i * 31 + k) % 251 for k in range(size))
    return prepare(
        ContinuationId(f"wf-{i}", 1),
        obs,
        prefix_digest=digest(f"history {i}".encode()),
        ready_time=float(i),
        workflow_arrival=0.0,
        prompt_tokens=1000 + i,
        codec=codec,
    )
