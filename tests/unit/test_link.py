"""The return link over real TCP on 127.0.0.1: order, window, rejects, reconnects."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ladsd.config import FRAME_OVERHEAD, LinkConfig
from ladsd.records import ContinuationId, EngineState, Phase, SenderInventory
from ladsd.transport.frame import Codec, digest
from ladsd.transport.link import (
    Control,
    ControlError,
    Delivery,
    Fault,
    FrameRejected,
    Kind,
    Link,
    LinkClosed,
    LinkDown,
    LinkError,
    PolicyError,
    Prepared,
    Reason,
    Rejected,
    Sender,
    SendFailed,
    Ticket,
    decode_control,
    encode_control,
)
from tests.rigs.link import FAST, Boom, Recorder, item

LIMIT_S = 30.0  # every test is bounded in time


class Log:
    """Registration callback that records deliveries (and can misbehave on cue)."""

    def __init__(self) -> None:
        self.got: list[Delivery] = []
        self.refuse: dict[ContinuationId, int] = {}  # cid -> refusals left
        self.after = None  # called after registering

    async def __call__(self, d: Delivery) -> None:
        if self.refuse.get(d.cid, 0) > 0:
            self.refuse[d.cid] -= 1
            raise Rejected(f"no binding for {d.cid.key()}")
        self.got.append(d)
        if self.after is not None:
            self.after(d)

    @property
    def cids(self) -> list[ContinuationId]:
        return [d.cid for d in self.got]


async def started(policy: Recorder, log: Log, config: LinkConfig = FAST, **kw: Any) -> Link:
    link = Link(policy, log, config=config, **kw)
    policy.sender = link.sender
    await link.start()
    return link


async def offer_all(link: Link, preps: list[Prepared]) -> list[Ticket]:
    return await link.sender.offer_many([(p.item, p.payload) for p in preps])


async def all_received(tickets: list[Ticket]) -> list[float]:
    async with asyncio.timeout(LIMIT_S):
        return await asyncio.gather(*(t.received for t in tickets))


def observation_of(d: Delivery, sizes: list[int]) -> bytes:
    i = int(d.cid.workflow.split("-")[1])
    return bytes((i * 31 + k) % 251 for k in range(sizes[i]))


async def test_delivers_in_commit_order_with_the_window_respected() -> None:
    sizes = [100, 800, 500, 200, 900, 600, 300, 1000, 700, 400, 150, 850]
    preps = [item(i, s) for i, s in enumerate(sizes)]
    policy = Recorder(key=lambda p: (-p.payload_bytes, p.cid))  # largest first, not ready order
    log = Log()
    link = await started(policy, log)
    tickets = await offer_all(link, preps)
    cs = await all_received(tickets)
    await link.close(drain=True)

    by_size = [p.item.cid for p in sorted(preps, key=lambda p: -p.item.payload_bytes)]
    assert policy.commits == by_size
    assert log.cids == policy.commits  # receipt order is commit order
    assert max(policy.in_flight) == 4 and all(n <= 4 for n in policy.in_flight)
    assert cs == [t.c for t in tickets]
    assert [t.cid for t in sorted(tickets, key=lambda t: t.c)] == log.cids
    assert all(t.s is not None and t.s <= t.c and t.commits == 1 for t in tickets)
    for d in log.got:
        p = preps[int(d.cid.workflow.split("-")[1])]
        assert d.observation == observation_of(d, sizes)
        assert d.binding == (d.cid.workflow, 1, p.item.prefix_digest, p.item.payload_digest)
        assert d.c == next(t.c for t in tickets if t.cid == d.cid)
    st = link.stats()
    assert st["commits"] == st["frames"] == st["acks"] == st["rx_delivered"] == 12
    assert st["bytes"] == sum(FRAME_OVERHEAD + p.item.payload_bytes for p in preps)
    assert st["rejects"] == st["resends"] == st["rx_duplicates"] == st["failed"] == 0
    assert st["control_bytes"] == st["rx_control_bytes"] > 0
    assert st["rx_stream_errors"] == 0  # clean close: the stream ended on a frame boundary


async def test_inventory_is_published_in_fifo_order_with_q_b() -> None:
    seen: list[SenderInventory] = []
    policy = Recorder(key=lambda p: (-p.ready_time, p.cid))  # newest first
    log = Log()
    link = Link(policy, log, config=FAST, on_inventory=seen.append)
    policy.sender = link.sender
    preps = [item(i, 700) for i in range(6)]
    tickets = await offer_all(link, preps)  # before start: commits wait for the connection
    first = seen[0]
    assert [i.cid for i in first.items] == [p.item.cid for p in preps]
    assert all(i.phase is Phase.PENDING for i in first.items)
    assert first.q_b == 0 and first.rate == FAST.rate_bytes_per_s and first.overhead == 1028
    assert link.sender.q_b == 4 * (FRAME_OVERHEAD + 700)  # four committed, none on the wire
    await link.start()
    await all_received(tickets)
    await link.close(drain=True)
    for inv in seen:
        assert [i.ready_time for i in inv.items] == sorted(i.ready_time for i in inv.items)
        committed = sum(
            FRAME_OVERHEAD + i.payload_bytes for i in inv.items if i.phase is Phase.COMMITTED
        )
        assert 0 <= inv.q_b <= committed
    assert any(0 < inv.q_b < 4 * (FRAME_OVERHEAD + 700) for inv in seen)  # moves per chunk
    assert seen[-1].items == () and seen[-1].q_b == 0


async def test_refused_binding_is_requeued_and_delivered_once() -> None:
    preps = [item(i) for i in range(6)]
    target = preps[2].item.cid
    log = Log()
    log.refuse[target] = 1
    policy = Recorder()
    link = await started(policy, log)
    tickets = await offer_all(link, preps)
    await all_received(tickets)
    await link.close(drain=True)
    assert sorted(log.cids) == sorted(p.item.cid for p in preps)
    assert log.cids.count(target) == 1
    t = tickets[2]
    assert t.rejects == 1 and t.reasons == ["binding"] and t.commits == 2
    assert policy.commits.count(target) == 2
    delivered_commits = list(policy.commits)
    delivered_commits.remove(target)  # the refused first commitment
    assert log.cids == delivered_commits
    st = link.stats()
    assert st["rejects"] == st["requeues"] == st["rx_refused"] == st["rx_nacks"] == 1
    assert st["rx_delivered"] == 6 and st["failed"] == 0


async def test_digest_mismatch_on_the_wire_is_rejected_and_resent_intact() -> None:
    preps = [item(i) for i in range(5)]
    target = preps[1].item.cid

    def corrupt(cid: ContinuationId, send_no: int, data: bytes) -> bytes:
        if cid == target and send_no == 1:
            return data[:-1] + bytes([data[-1] ^ 0xFF])
        return data

    log = Log()
    link = await started(Recorder(), log, fault=corrupt)
    tickets = await offer_all(link, preps)
    await all_received(tickets)
    await link.close(drain=True)
    assert sorted(log.cids) == sorted(p.item.cid for p in preps)
    assert log.cids.count(target) == 1
    assert tickets[1].reasons == ["digest"] and tickets[1].sends == 2
    assert all(d.observation == item(int(d.cid.workflow[3:])).payload for d in log.got)
    st = link.stats()
    assert st["rejects"] == st["rx_nacks"] == 1 and st["rx_delivered"] == 5


async def test_permanent_refusal_fails_the_ticket_loudly_and_loses_nothing_else() -> None:
    preps = [item(i) for i in range(4)]
    target = preps[0].item.cid
    log = Log()
    log.refuse[target] = 100
    link = await started(Recorder(), log, max_rejects=2)
    tickets = await offer_all(link, preps)
    async with asyncio.timeout(LIMIT_S):
        with pytest.raises(FrameRejected, match="rejected 3 times"):
            await tickets[0].received
        await asyncio.gather(*(t.received for t in tickets[1:]))
    await link.close(drain=True)
    assert sorted(log.cids) == sorted(p.item.cid for p in preps[1:])
    assert tickets[0].rejects == 3 and link.stats()["failed"] == 1
    assert link.sender.error is None  # one bad frame does not stop the link


async def test_drop_after_registration_reconnects_without_loss_or_duplicates() -> None:
    preps = [item(i, 900) for i in range(10)]
    log = Log()
    policy = Recorder()
    link = await started(policy, log)

    def drop_once(d: Delivery) -> None:
        if len(log.got) == 3:  # registered, but its ack will be lost with the connection
            assert link.receiver.abort_connection()

    log.after = drop_once
    tickets = await offer_all(link, preps)
    await all_received(tickets)
    await link.close(drain=True)
    assert log.cids == [p.item.cid for p in preps] == policy.commits
    assert tickets[2].c == log.got[2].c  # c is the first complete receipt
    st = link.stats()
    assert st["drops"] >= 1 and st["connects"] >= 2
    assert st["duplicate_acks"] >= 1 and st["rx_duplicates"] >= 1 and st["resends"] >= 1
    assert st["rx_delivered"] == 10 and st["failed"] == 0


async def test_drop_mid_frame_resends_whole_frames_in_order() -> None:
    preps = [item(i, 1500) for i in range(8)]
    log = Log()
    policy = Recorder(key=lambda p: (-p.ready_time, p.cid))
    link: Link | None = None
    total = 0

    def cut(n: int, t: float) -> None:
        nonlocal total
        total += n
        if (
            total > 2.5 * (FRAME_OVERHEAD + 1500)
            and link is not None
            and link.stats()["drops"] == 0
        ):
            link.receiver.abort_connection()

    link = await started(policy, log, on_bytes=cut)
    tickets = await offer_all(link, preps)
    await all_received(tickets)
    await link.close(drain=True)
    assert log.cids == policy.commits == [p.item.cid for p in reversed(preps)]
    st = link.stats()
    assert st["drops"] >= 1 and st["resends"] >= 1
    assert st["rx_delivered"] == 8 and st["rx_duplicates"] == st["failed"] == 0


async def test_gzip_frames_arrive_decoded() -> None:
    preps = [item(i, 4000, codec=Codec.GZIP6) for i in range(3)]
    assert all(p.item.payload_bytes < 4000 for p in preps)
    log = Log()
    link = await started(Recorder(), log, config=LinkConfig(rate_bytes_per_s=1e6, codec="gzip6"))
    tickets = await offer_all(link, preps)
    await all_received(tickets)
    await link.close(drain=True)
    for d in log.got:
        i = int(d.cid.workflow[3:])
        assert d.codec is Codec.GZIP6 and d.decode_s >= 0
        assert d.observation == bytes((i * 31 + k) % 251 for k in range(4000))


async def test_hold_waits_for_the_next_event() -> None:
    policy = Recorder()
    policy.hold = True
    log = Log()
    link = await started(policy, log)
    tickets = await offer_all(link, [item(i) for i in range(3)])
    assert policy.commits == [] and link.sender.stats()["holds"] == 1
    policy.hold = False
    link.sender.set_state(EngineState(time=0.0, seq=7, generation=1))
    await all_received(tickets)
    await link.close(drain=True)
    assert len(policy.commits) == 3 and policy.states == [7]
    assert policy.views[-1].state is not None and policy.views[-1].state.seq == 7


async def test_cancel_only_before_commitment() -> None:
    policy = Recorder()
    policy.hold = True
    sender = Sender(policy, config=FAST)
    policy.sender = sender
    t0 = await sender.offer(item(0).item, item(0).payload)
    assert sender.cancel(item(0).item.cid)
    assert not sender.cancel(item(0).item.cid)
    assert sender.pending == ()
    with pytest.raises(LinkError):
        await t0.received
    policy.hold = False
    t1 = await sender.offer(item(1).item, item(1).payload)
    assert sender.committed == (item(1).item.cid,)
    assert not sender.cancel(item(1).item.cid)
    await sender.close()
    with pytest.raises(LinkClosed):
        await t1.received


def test_control_messages_round_trip_and_reject_garbage() -> None:
    msg = Control(Kind.NACK, Reason.DIGEST, ContinuationId("wf-é", 3, 2), digest(b"x"), 12.25)
    data = encode_control(msg)
    assert decode_control(data[2:]) == msg
    assert int.from_bytes(data[:2], "big") == len(data) - 2
    for bad in (data[2:10], data[2:] + b"x", b"\x09" + data[3:]):
        with pytest.raises(ControlError):
            decode_control(bad)


async def test_start_without_a_receiver_fails_clearly() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    sender = Sender(Recorder(), config=FAST)
    t = await sender.offer(item(0).item, item(0).payload)
    with pytest.raises(LinkError, match="could not connect"):
        await sender.start("127.0.0.1", port, connect_timeout=0.3)
    assert sender.stats()["connect_failures"] >= 1
    with pytest.raises(LinkClosed):
        await t.received


async def test_link_as_context_manager_closes_cleanly() -> None:
    log = Log()
    async with Link(Recorder(), log, config=FAST) as link:
        tickets = await offer_all(link, [item(i) for i in range(3)])
        await all_received(tickets)
    assert len(log.got) == 3
    assert link.receiver.stats()["stream_errors"] == 0


def break_header(target: ContinuationId, bad_sends: int) -> Fault:
    def fault(cid: ContinuationId, send_no: int, data: bytes) -> bytes:
        if cid == target and send_no <= bad_sends:
            return data[:4] + b"XXXX" + data[8:]  # bad magic: the stream cannot be trusted
        return data

    return fault


async def test_broken_stream_is_dropped_and_resent_in_order() -> None:
    preps = [item(i, 800) for i in range(6)]
    target = preps[2].item.cid
    log = Log()
    policy = Recorder()
    link = await started(policy, log, fault=break_header(target, 2))
    tickets = await offer_all(link, preps)
    await all_received(tickets)
    await link.close(drain=True)
    assert log.cids == [p.item.cid for p in preps] == policy.commits
    assert tickets[2].sends == 3
    st = link.stats()
    assert st["rx_stream_errors"] == 2 and st["drops"] == 2 and st["rx_delivered"] == 6


async def test_a_frame_that_never_gets_through_fails_after_max_drops() -> None:
    preps = [item(i) for i in range(3)]
    target = preps[0].item.cid
    log = Log()
    link = await started(Recorder(), log, fault=break_header(target, 100), max_drops=3)
    tickets = await offer_all(link, preps)
    async with asyncio.timeout(LIMIT_S):
        with pytest.raises(SendFailed, match="dropped 3 times"):
            await tickets[0].received
        await asyncio.gather(*(t.received for t in tickets[1:]))
    await link.close(drain=True)
    assert log.cids == [p.item.cid for p in preps[1:]]
    assert link.stats()["failed"] == 1 and link.sender.error is None


async def test_a_policy_that_raises_fails_every_ticket_and_stops_the_sender() -> None:
    log = Log()
    link = await started(Boom("choose", at=5), log)  # the 5th choice follows the first ack
    tickets = await offer_all(link, [item(i) for i in range(8)])
    async with asyncio.timeout(LIMIT_S):
        assert await tickets[0].received == tickets[0].c
        for t in tickets[1:]:  # committed (maybe even registered) or pending: all fail
            with pytest.raises(PolicyError, match=r"policy boom failed in choose\(\).*bad ch"):
                await t.received
    assert isinstance(link.sender.error, PolicyError)
    with pytest.raises(PolicyError):
        await link.sender.offer(item(9).item, item(9).payload)
    with pytest.raises(PolicyError):
        await link.sender.drain()
    link.sender.check_integrity()
    await link.close()
    assert log.cids[0] == tickets[0].cid and len(log.cids) <= 4
    assert link.sender.sizes() == {"pending": 0, "committed": 0, "by_cid": 0}


async def test_a_link_that_keeps_dropping_stops_the_sender_after_max_drops() -> None:
    log = Log()
    link: Link | None = None

    def cut(n: int, t: float) -> None:
        assert link is not None and link.receiver.abort_connection()  # every read

    link = await started(Recorder(), log, on_bytes=cut, max_drops=2)
    tickets = await offer_all(link, [item(i) for i in range(3)])
    async with asyncio.timeout(LIMIT_S):
        with pytest.raises(SendFailed, match="dropped 2 times"):  # charged to the head first
            await tickets[0].received
        for t in tickets[1:]:
            with pytest.raises(LinkDown, match="connection dropped: 3 drops"):
                await t.received
    assert isinstance(link.sender.error, LinkDown)
    link.sender.check_integrity()
    await link.close()
    assert log.got == []
    st = link.stats()
    assert st["drops"] == 3 and st["failed"] == 3


async def test_a_receiver_that_goes_away_fails_everything_outstanding() -> None:
    got: list[ContinuationId] = []
    stuck = asyncio.Event()

    async def register(d: Delivery) -> None:
        got.append(d.cid)
        if len(got) == 2:  # the second frame never gets its answer
            stuck.set()
            await asyncio.Event().wait()

    link = Link(Recorder(), register, config=FAST, max_drops=2)
    await link.start()
    tickets = await offer_all(link, [item(i) for i in range(4)])
    async with asyncio.timeout(LIMIT_S):
        await tickets[0].received
        await stuck.wait()
        await link.receiver.close(grace_s=0.05)  # stops listening: every re-dial is refused
        for t in tickets[1:]:
            with pytest.raises(LinkDown, match="re-dial failed"):
                await t.received
    assert isinstance(link.sender.error, LinkDown)
    assert link.stats()["connect_failures"] >= 2
    await link.close()


async def test_nothing_is_kept_per_continuation_after_many_workflows() -> None:
    log = Log()
    link = await started(Recorder(), log)
    for n in range(20):
        tickets = await offer_all(link, [item(i) for i in range(3 * n, 3 * n + 3)])
        await all_received(tickets)
        for t in tickets:
            link.sender.complete(t.cid, 64)
            assert link.receiver.forget(t.cid)
        link.sender.check_integrity()
    assert link.sender.sizes() == link.sender.outbox.sizes()
    assert link.sender.sizes() == {"pending": 0, "committed": 0, "by_cid": 0}
    assert link.receiver.sizes() == {"delivered": 0}
    assert not link.receiver.forget(tickets[0].cid)
    await link.close(drain=True)
    st = link.stats()
    assert st["acks"] == st["rx_delivered"] == st["rx_forgotten"] == 60


async def test_a_frame_for_a_forgotten_continuation_is_no_longer_a_duplicate() -> None:
    log = Log()
    link = await started(Recorder(), log)
    p = item(0)
    for forget in (False, True):
        (t,) = await offer_all(link, [p])
        await all_received([t])
        if forget:
            link.receiver.forget(p.item.cid)
        (t,) = await offer_all(link, [p])  # the same frame again
        await all_received([t])
        link.receiver.forget(p.item.cid)
    await link.close(drain=True)
    # Remembered: acked as a duplicate, registered once. Forgotten: a stale frame goes
    # to the registration callback like any other (the runtime's refuses it).
    assert log.cids == [p.item.cid] * 3
    assert link.stats()["rx_duplicates"] == 1


async def test_start_after_a_policy_failure_raises_it_at_once() -> None:
    sender = Sender(Boom("choose"), config=FAST)
    with pytest.raises(PolicyError):
        await sender.offer(item(0).item, item(0).payload)
    with pytest.raises(PolicyError, match="policy boom"):
        await sender.start("127.0.0.1", 9, connect_timeout=LIMIT_S)
    await sender.close()
    assert isinstance(sender.error, PolicyError)
