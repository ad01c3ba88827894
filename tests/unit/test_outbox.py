"""The sender's Outbox without a socket: commit order, window, Q_B, acks, failures."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from ladsd.config import FRAME_OVERHEAD, LinkConfig
from ladsd.delivery.policy import Pending, SenderView
from ladsd.records import ContinuationId, EngineState, Phase
from ladsd.transport.control import Control, Kind, Reason
from ladsd.transport.errors import (
    Cancelled,
    FrameRejected,
    LinkClosed,
    OfferError,
    PolicyError,
    SendFailed,
)
from ladsd.transport.outbox import Outbox
from ladsd.transport.outbox_entries import Ticket
from tests.rigs.link import FAST, Boom, Recorder, item

ZERO = {"pending": 0, "committed": 0, "by_cid": 0}


def outbox(policy: Recorder, config: LinkConfig = FAST, **kw: object) -> Outbox:
    ob = Outbox(policy, config=config, **kw)  # type: ignore[arg-type]
    policy.sender = ob
    return ob


def offer(ob: Outbox, idx: Sequence[int], size: int = 300) -> list[Ticket]:
    tickets = ob.offer_many([(p.item, p.payload) for p in (item(i, size) for i in idx)])
    ob.check_integrity()
    return tickets


def send_all(ob: Outbox) -> None:
    """Put every committed frame on the wire whole, as the socket part does."""
    while (e := ob.next_unsent()) is not None:
        if e.sent == 0:
            ob.begin(e)
        ob.wrote(e, len(e.data) - e.sent)
        ob.check_integrity()


def answer(ob: Outbox, t: Ticket, kind: Kind = Kind.ACK, reason: Reason = Reason.OK) -> bool:
    ok = ob.answer(Control(kind, reason, t.cid, t.item.payload_digest, 100.0 + t.item.ready_time))
    ob.check_integrity()
    return ok


def by_cid(tickets: list[Ticket]) -> dict[ContinuationId, Ticket]:
    return {t.cid: t for t in tickets}


async def test_commit_order_follows_the_policy_within_the_window() -> None:
    sizes = [100, 800, 500, 200, 900, 600, 300, 1000, 700, 400]
    policy = Recorder(key=lambda p: (-p.payload_bytes, p.cid))  # largest first
    ob = outbox(policy)
    tickets = ob.offer_many([(item(i, s).item, item(i, s).payload) for i, s in enumerate(sizes)])
    ob.check_integrity()
    order = [tickets[i].cid for i in sorted(range(10), key=lambda i: -sizes[i])]
    assert ob.committed == tuple(order[:4])
    assert [p.cid for p in ob.pending] == [t.cid for t in tickets if t.cid not in order[:4]]
    tk = by_cid(tickets)
    while ob.committed:
        send_all(ob)
        assert answer(ob, tk[ob.committed[0]])
    assert policy.commits == order
    assert policy.in_flight == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4]
    assert all(t.received.result() == t.c == 100.0 + t.item.ready_time for t in tickets)
    assert all(t.s is not None and t.commits == 1 and t.sends == 1 for t in tickets)
    st = ob.stats()
    assert st["commits"] == st["acks"] == st["frames"] == st["decisions"] == 10
    assert st["bytes"] == sum(FRAME_OVERHEAD + s for s in sizes)
    assert ob.sizes() == ZERO and ob.idle.is_set()


async def test_q_b_is_the_unsent_bytes_of_the_committed_queue() -> None:
    ob = outbox(Recorder())
    offer(ob, range(3), 700)
    frame = FRAME_OVERHEAD + 700
    assert ob.q_b == ob.view().q_b == ob.inventory().q_b == 3 * frame
    e = ob.next_unsent()
    assert e is not None and ob.begin(e) == 1
    ob.wrote(e, 100)
    ob.check_integrity()
    assert ob.q_b == ob.view().q_b == ob.inventory().q_b == 3 * frame - 100
    assert ob.next_unsent() is e  # transport order: finish the frame first
    ob.wrote(e, frame - 100)
    ob.check_integrity()
    assert ob.q_b == 2 * frame and ob.next_unsent() is not e
    assert ob.rewind(max_drops=8) is None  # the head had started: charged, not failed
    ob.check_integrity()
    assert ob.q_b == 3 * frame and e.drops == 1 and e.sent == 0
    assert [i.phase for i in ob.inventory().items] == [Phase.COMMITTED] * 3


async def test_a_burst_offered_together_is_seen_whole_by_the_first_choice() -> None:
    class Seen(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
            self.sizes.append(len(pending))
            return min(pending, key=lambda p: (-p.ready_time, p.cid))  # newest first

    together = Seen()
    ob = outbox(together)
    offer(ob, range(10))
    assert together.sizes[:4] == [10, 9, 8, 7]
    assert ob.committed == tuple(ContinuationId(f"wf-{i}", 1) for i in (9, 8, 7, 6))

    one_by_one = Seen()
    ob = outbox(one_by_one)
    for i in range(10):
        offer(ob, [i])
    assert one_by_one.sizes[:4] == [1, 1, 1, 1]  # what batching avoids
    assert ob.committed == tuple(ContinuationId(f"wf-{i}", 1) for i in range(4))


async def test_nack_requeues_then_fails_after_max_rejects_and_strays_are_counted() -> None:
    ob = outbox(Recorder(), max_rejects=1)
    t0, t1, t2 = offer(ob, range(3))
    send_all(ob)
    assert answer(ob, t1, Kind.NACK, Reason.DIGEST)
    assert ob.committed == (t0.cid, t2.cid, t1.cid)  # back into F(t), committed again
    assert t1.commits == 2 and t1.rejects == 1 and t1.reasons == ["digest"]
    send_all(ob)
    assert answer(ob, t1, Kind.NACK, Reason.BINDING)
    with pytest.raises(FrameRejected, match=r"rejected 2 times \(digest, binding\)"):
        await t1.received
    (t3,) = offer(ob, [3])  # committed, not on the wire yet
    stray = Control(Kind.ACK, Reason.OK, t0.cid, t2.item.payload_digest, 1.0)
    assert not ob.answer(stray)  # wrong digest
    assert not answer(ob, t1)  # settled already
    assert not answer(ob, t3)  # not completely sent
    assert answer(ob, t0, reason=Reason.DUPLICATE)
    st = ob.stats()
    assert st["rejects"] == 2 and st["requeues"] == 1 and st["failed"] == 1
    assert st["stray_control"] == 3 and st["acks"] == st["duplicate_acks"] == 1
    assert ob.error is None


async def test_rewind_charges_the_started_head_and_fails_it_after_max_drops() -> None:
    ob = outbox(Recorder(), config=LinkConfig(rate_bytes_per_s=1e6, window=2))
    t0, t1, t2 = offer(ob, range(3))
    assert ob.committed == (t0.cid, t1.cid)
    assert ob.rewind(max_drops=2) is None  # nothing on the wire: nobody charged
    for _ in range(2):
        e = ob.next_unsent()
        assert e is not None and e.ticket is t0
        ob.begin(e)
        ob.wrote(e, 10)
        failed = ob.rewind(max_drops=2)
        ob.check_integrity()
    assert failed is not None and failed.ticket is t0
    with pytest.raises(SendFailed, match="dropped 2 times"):
        await t0.received
    assert ob.committed == (t1.cid, t2.cid)  # the window slot went to the next result
    assert t0.sends == 2 and ob.stats()["resends"] == 1


async def test_a_policy_raising_in_choose_fails_every_ticket_and_stops() -> None:
    policy = Boom("choose", at=5)
    ob = outbox(policy)
    tickets = offer(ob, range(6))
    assert len(ob.committed) == 4 and ob.error is None
    send_all(ob)
    assert answer(ob, tickets[0])  # frees a slot: the 5th choice raises
    for t in tickets[1:]:
        with pytest.raises(PolicyError, match=r"policy boom failed in choose\(\).*bad choose"):
            await t.received
    assert isinstance(ob.error, PolicyError) and isinstance(ob.error.__cause__, RuntimeError)
    assert tickets[0].received.result() == tickets[0].c
    assert ob.sizes() == ZERO and ob.idle.is_set()
    ob.check_integrity()
    with pytest.raises(PolicyError):
        offer(ob, [7])
    ob.set_state(EngineState(time=0.0, seq=1, generation=0))  # a dead policy is not asked
    ob.complete(tickets[0].cid, 64)
    assert policy.calls == 5 and ob.stats()["failed"] == 5


@pytest.mark.parametrize("hook", ["on_state", "on_commit", "on_complete"])
async def test_any_policy_hook_that_raises_stops_the_outbox(hook: str) -> None:
    ob = outbox(Boom(hook))
    if hook != "on_commit":
        ob.policy.hold = True  # type: ignore[attr-defined]
    tickets = offer(ob, range(2)) if hook != "on_commit" else []
    if hook == "on_commit":
        with pytest.raises(PolicyError, match=r"on_commit\(\)"):
            offer(ob, range(2))
    elif hook == "on_state":
        ob.set_state(EngineState(time=0.0, seq=1, generation=0))
    else:
        ob.complete(ContinuationId("wf-x", 0), 64)
    with pytest.raises(PolicyError, match=rf"policy boom failed in {hook}\(\): RuntimeError"):
        ob.check_open()
    for t in tickets:
        with pytest.raises(PolicyError):
            await t.received
    ob.check_integrity()
    assert ob.sizes() == ZERO


async def test_a_choice_that_is_not_pending_stops_the_outbox() -> None:
    class Rogue(Recorder):
        def choose(self, pending: Sequence[Pending], view: SenderView, now: float) -> Pending:
            return item(99).item

    ob = outbox(Rogue())
    with pytest.raises(PolicyError, match="chose wf-99.*not a pending result"):
        offer(ob, [0])
    assert isinstance(ob.error, PolicyError)
    ob.check_integrity()


async def test_state_and_previous_seq_reach_the_policy_unfiltered() -> None:
    policy = Recorder()
    policy.hold = True
    ob = outbox(policy)
    offer(ob, [0])
    for seq in (1, 2, 2):
        ob.set_state(EngineState(time=0.0, seq=seq, generation=0))
    assert [(v.state.seq if v.state else None, v.state_seq_before) for v in policy.views] == [
        (None, -1),
        (1, -1),
        (2, 1),
        (2, 2),  # a duplicate: the policy's record check sees it
    ]
    assert policy.states == [1, 2, 2] and ob.stats()["states_out_of_order"] == 1


async def test_complete_reaches_the_policy_and_decides_again() -> None:
    policy = Recorder()
    policy.hold = True
    ob = outbox(policy)
    offer(ob, [0])
    policy.hold = False
    ob.complete(ContinuationId("wf-x", 0), 64)
    assert policy.commits == [item(0).item.cid]
    assert ob.stats()["holds"] == 1


async def test_bad_offers_are_refused_whole() -> None:
    ob = outbox(Recorder())
    good, other = item(0), item(1)
    with pytest.raises(OfferError, match="payload is"):
        ob.offer_many([(good.item, good.payload), (other.item, other.payload[:-1])])
    assert ob.pending == () and ob.committed == () and ob.sizes() == ZERO
    with pytest.raises(OfferError, match="digest"):
        ob.offer_many([(other.item, bytes(len(other.payload)))])
    with pytest.raises(OfferError, match="exceeds"):
        outbox(Recorder(), LinkConfig(max_payload_bytes=10)).offer_many([(good.item, good.payload)])
    ob.offer_many([(good.item, good.payload)])
    with pytest.raises(OfferError, match="already"):
        ob.offer_many([(good.item, good.payload)])
    ob.check_integrity()


async def test_cancel_only_before_commitment_and_close_fails_the_rest() -> None:
    policy = Recorder()
    policy.hold = True
    ob = outbox(policy)
    (t0,) = offer(ob, [0])
    assert ob.cancel(t0.cid) and not ob.cancel(t0.cid)
    with pytest.raises(Cancelled):
        await t0.received
    policy.hold = False
    (t1,) = offer(ob, [1])
    assert ob.committed == (t1.cid,) and not ob.cancel(t1.cid)
    ob.close()
    ob.check_integrity()
    with pytest.raises(LinkClosed, match="before wf-1"):
        await t1.received
    with pytest.raises(LinkClosed, match="sender is closed"):
        ob.check_open()
    with pytest.raises(LinkClosed):
        offer(ob, [2])
    assert ob.error is None and ob.sizes() == ZERO
    assert ob.stats()["cancelled"] == 1 and ob.stats()["failed"] == 2


async def test_nothing_is_kept_per_result_after_many_cycles() -> None:
    policy = Recorder()
    ob = outbox(policy)
    for n in range(25):
        tickets = offer(ob, range(3 * n, 3 * n + 3))
        send_all(ob)
        for t in tickets:
            assert answer(ob, t)
            ob.complete(t.cid, 64)
        policy.hold = True
        (extra,) = offer(ob, [1000 + n])
        assert ob.cancel(extra.cid)
        policy.hold = False
        ob.check_integrity()
    assert ob.sizes() == ZERO
    assert ob.stats()["acks"] == 75 and ob.stats()["cancelled"] == 25
    await asyncio.sleep(0)
