"""The policy rig: pending results, lease records, engine states and sender views built
by hand, and a drain that commits a policy's choices one by one (no engine)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ladsd.config import FRAME_OVERHEAD as H
from ladsd.delivery.policy import Pending, SenderView
from ladsd.records import ContinuationId, DenialEvent, EngineState, LeaseRecord, LeaseStatus

RATE = 4000.0  # the link, bytes/s


def item(
    wf: str,
    *,
    p: int = 1000,
    r: float = 0.0,
    arrival: float | None = None,
    prompt: int = 100,
    turn: int = 1,
    version: int = 0,
) -> Pending:
    return Pending(
        cid=ContinuationId(wf, turn, version),
        ready_time=r,
        payload_bytes=p,
        frame_bytes=H + p,
        prefix_digest=f"pre-{wf}-{turn}",
        payload_digest=f"pay-{wf}-{turn}-{version}",
        workflow_arrival=r if arrival is None else arrival,
        prompt_tokens=prompt,
    )


def lease(
    it: Pending,
    *,
    E: int,
    g: float = 5.0,
    life: float = 8.0,
    gen: int = 7,
    status: LeaseStatus = LeaseStatus.GRANTED,
    cid: ContinuationId | None = None,
    payload_digest: str | None = None,
) -> LeaseRecord:
    return LeaseRecord(
        cid=cid or it.cid,
        prefix_digest=it.prefix_digest,
        payload_digest=payload_digest or it.payload_digest,
        protected_blocks=tuple(range(E)),
        exclusive_blocks=E,
        granted_at=g,
        deadline=g + life,
        generation=gen,
        status=status,
    )


def engine_state(
    t: float,
    *,
    seq: int = 3,
    gen: int = 7,
    U: int = 0,
    C: int = 0,
    leases: tuple[LeaseRecord, ...] = (),
    resident: dict[ContinuationId, int] | None = None,
    denials: tuple[DenialEvent, ...] = (),
    w: int = 0,
    a: int = 0,
    m: int = 8,
    kappa: float = 0.0,
    block_size: int = 0,
) -> EngineState:
    return EngineState(
        time=t,
        seq=seq,
        generation=gen,
        U=U,
        B=C,
        C=C,
        w=w,
        a=a,
        m=m,
        kappa=kappa,
        block_size=block_size,
        leases=leases,
        denials=denials,
        resident=tuple((resident or {}).items()),
    )


def view(state: EngineState | None, *, q_b: int = 0, seq_before: int = 2) -> SenderView:
    return SenderView(q_b=q_b, rate=RATE, overhead=H, state=state, state_seq_before=seq_before)


def drain(pol: Any, pending: Sequence[Pending], v: SenderView, now: float = 0.0) -> list[Pending]:
    """Commit ``pol``'s choices one by one: the results in delivery order."""
    out, left = [], list(pending)
    while left:
        x = pol.choose(left, v, now)
        pol.on_commit(x, now)
        out.append(x)
        left.remove(x)
    return out
