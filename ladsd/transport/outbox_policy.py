"""The outbox's side of the delivery policy: what the policy is shown and its timing.

:class:`PolicyCalls` is one resource of :class:`~ladsd.transport.outbox.Outbox`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ladsd.config import FRAME_OVERHEAD
from ladsd.delivery.policy import Pending, Policy, SenderView
from ladsd.records import EngineState
from ladsd.transport.errors import PolicyError


class PolicyCalls:
    """The policy, the engine state it is shown, and the time spent deciding.

    Owns: the policy; the engine state passed to it in :class:`SenderView`
    (the latest state, unfiltered, and the previous one's seq, so the policy's
    record checks see exactly what arrived); ``decision_s``, this thread's
    CPU time inside ``choose`` and the policy's hooks (``on_state`` reads
    every published state; not wall time: on two cores a wait for the GIL,
    which the engine thread holds between its ops, is no decision work).
    It names the :class:`PolicyError` of a hook that raised or a choice that
    is not pending; the outbox decides what follows (it stops). Event loop's thread only.

    Invariants (:meth:`check_integrity`): ``decision_s`` never negative; the
    previous seq is -1 until a state arrived.
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.state: EngineState | None = None
        self.seq_before = -1
        self.decision_s = 0.0  # CPU time spent inside policy.choose and its hooks

    @property
    def name(self) -> str:
        return str(getattr(self.policy, "name", type(self.policy).__name__))

    def view(self, q_b: int, rate: float) -> SenderView:
        return SenderView(
            q_b=q_b,
            rate=rate,
            overhead=FRAME_OVERHEAD,
            state=self.state,
            state_seq_before=self.seq_before,
        )

    def new_state(self, state: EngineState) -> bool:
        """Keep ``state`` as the latest; False if its seq is not newer than the previous."""
        self.seq_before = self.state.seq if self.state is not None else -1
        self.state = state
        return state.seq > self.seq_before

    def choose(self, items: Sequence[Pending], view: SenderView, t: float) -> Pending | None:
        """The policy's choice among ``items`` (it may raise), timed into ``decision_s``."""
        t0 = time.thread_time()
        try:
            return self.policy.choose(tuple(items), view, t)
        finally:
            self.decision_s += time.thread_time() - t0

    def hook(self, fn: Callable[..., object], *args: object) -> None:
        """Call one of the policy's hooks (it may raise), timed into ``decision_s``."""
        t0 = time.thread_time()
        try:
            fn(*args)
        finally:
            self.decision_s += time.thread_time() - t0

    def broken(self, hook: str, exc: Exception) -> PolicyError:
        """The error of a hook that raised ``exc`` (its cause)."""
        err = PolicyError(f"policy {self.name} failed in {hook}(): {exc!r}")
        err.__cause__ = exc
        return err

    def not_pending(self, choice: Pending) -> PolicyError:
        return PolicyError(
            f"policy {self.name} chose {choice.cid.key()}, which is not a pending result"
        )

    def check_integrity(self) -> None:
        """Assert the invariants of the class docstring."""
        assert self.decision_s >= 0.0, f"decision time {self.decision_s} < 0"
        assert self.state is not None or self.seq_before == -1, "a previous seq without a state"
