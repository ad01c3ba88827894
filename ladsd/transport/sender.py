"""The sending end of the return link (spec 2): the socket part.

Queues, window, Q_B, the policy and the tickets live in
:class:`~ladsd.transport.outbox.Outbox`; this module dials the receiver,
writes the committed queue in order through the token bucket, reads acks and
nacks, and re-dials after a dropped connection (the outbox then resends the
unacknowledged frames whole, in their order).

All methods run on the event loop's thread (the engine thread hands states
over with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ladsd.clock import Clock, now
from ladsd.config import FRAME_OVERHEAD, LinkConfig
from ladsd.delivery.policy import Pending, Policy, SenderView
from ladsd.records import ContinuationId, EngineState, SenderInventory
from ladsd.transport.control import nodelay, read_control
from ladsd.transport.errors import ControlError, LinkDown, LinkError
from ladsd.transport.frame import Codec, digest, encode_payload
from ladsd.transport.outbox import OUTBOX_COUNTERS, Outbox
from ladsd.transport.outbox_entries import Entry, Ticket
from ladsd.transport.pacer import TokenBucket

__all__ = ["SENDER_COUNTERS", "Fault", "Prepared", "Sender", "Ticket", "prepare"]


@dataclass(frozen=True)
class Prepared:
    """An observation made ready for :meth:`Sender.offer`."""

    item: Pending
    payload: bytes
    codec: Codec
    encode_s: float  # codec time at the sender (inside workflow time)


def prepare(
    cid: ContinuationId,
    observation: bytes,
    *,
    prefix_digest: str,
    ready_time: float,
    workflow_arrival: float,
    prompt_tokens: int,
    codec: Codec | str = Codec.IDENTITY,
) -> Prepared:
    """Encode ``observation`` with ``codec`` and describe it as a :class:`Pending`."""
    c = Codec.parse(codec)
    payload, encode_s = encode_payload(observation, c)
    item = Pending(
        cid=cid,
        ready_time=ready_time,
        payload_bytes=len(payload),
        frame_bytes=FRAME_OVERHEAD + len(payload),
        prefix_digest=prefix_digest,
        payload_digest=digest(payload),
        workflow_arrival=workflow_arrival,
        prompt_tokens=prompt_tokens,
    )
    return Prepared(item, payload, c, encode_s)


_DROPS = (ConnectionError, asyncio.IncompleteReadError, ControlError, OSError)

Fault = Callable[[ContinuationId, int, bytes], bytes]

SOCKET_COUNTERS = (
    "control_bytes",  # ack/nack bytes received
    "connects",
    "connect_failures",
    "drops",
)
SENDER_COUNTERS = (*OUTBOX_COUNTERS, *SOCKET_COUNTERS)


class Sender:
    """The sending end: a paced TCP writer and control reader around one :class:`Outbox`.

    Owns: the connection (dial, re-dial with backoff), the token bucket, the
    writer and reader tasks, the drop streak, and the socket counters
    (``connects``, ``connect_failures``, ``drops``, ``control_bytes``). All
    queue and policy state is the outbox's (:attr:`outbox`); the Sender only
    reports the wire to it. The owner of the results calls :meth:`offer` /
    :meth:`offer_many`, :meth:`set_state`, :meth:`complete`, :meth:`cancel`,
    then :meth:`start` once, and :meth:`drain` / :meth:`close`.

    ``on_inventory(SenderInventory)`` is called at readiness and on every
    change (offer, commit, each chunk on the wire, ack, re-queue, cancel).
    A result the receiver rejects more than ``max_rejects`` times fails with
    :class:`FrameRejected`; one on which the connection drops ``max_drops``
    times fails with :class:`SendFailed`. ``fault(cid, send_no, frame_bytes)
    -> bytes`` (tests only) may alter a transmission; it must keep the length.

    Fail fast: the sender stops, failing every outstanding ticket with the
    same error, when the policy fails (:class:`PolicyError`), when the
    connection drops or cannot be re-dialled more than ``max_drops`` times in
    a row with results outstanding and no answer from the receiver
    (:class:`LinkDown`), or on any other error of its task; :attr:`error`
    then holds it. A caller waits on its ticket's ``received`` beside its own
    futures: the ticket fails with that error.

    Invariants (:meth:`check_integrity`): the outbox's; the drop streak is at
    most ``max_drops`` while running; a closing sender's outbox is closed.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        config: LinkConfig = LinkConfig(),
        on_inventory: Callable[[SenderInventory], None] | None = None,
        clock: Clock = now,
        bucket: TokenBucket | None = None,
        max_rejects: int = 3,
        max_drops: int = 8,
        fault: Fault | None = None,
    ) -> None:
        if max_rejects < 0 or max_drops < 1:
            raise ValueError(
                f"need max_rejects >= 0 and max_drops >= 1, got {max_rejects}, {max_drops}"
            )
        self.outbox = Outbox(
            policy,
            config=config,
            on_inventory=on_inventory,
            on_stop=self._stopped,
            clock=clock,
            max_rejects=max_rejects,
        )
        self.config = config
        self.bucket = bucket or TokenBucket(config.rate_bytes_per_s, config.bucket_bytes)
        self.max_drops = max_drops
        self.fault = fault
        self._connected = asyncio.Event()  # set at the first connection, stays set
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._streak = 0  # drops / failed re-dials since the receiver last answered
        self.host: str = config.host
        self.port: int | None = None
        self.counters: Counter[str] = Counter(dict.fromkeys(SOCKET_COUNTERS, 0))

    # ---- state (the outbox's)

    @property
    def policy(self) -> Policy:
        return self.outbox.policy

    @property
    def chunk(self) -> int:
        """A write is at most one chunk = the bucket's depth."""
        return self.bucket.depth

    @property
    def q_b(self) -> int:
        """Committed bytes not yet on the wire."""
        return self.outbox.q_b

    @property
    def in_flight(self) -> int:
        """Committed frames not yet completely received (acknowledged)."""
        return self.outbox.in_flight

    @property
    def pending(self) -> tuple[Pending, ...]:
        """F(t) in FIFO order."""
        return self.outbox.pending

    @property
    def committed(self) -> tuple[ContinuationId, ...]:
        """The committed queue, in transport order."""
        return self.outbox.committed

    @property
    def decision_s(self) -> float:
        """CPU time (this thread's) inside ``policy.choose`` and the policy's hooks."""
        return self.outbox.decision_s

    @property
    def error(self) -> LinkError | None:
        """The fatal error once the sender has died (None while running or after close)."""
        return self.outbox.error

    def view(self) -> SenderView:
        return self.outbox.view()

    def inventory(self) -> SenderInventory:
        """The causal inventory: pending and committed results, FIFO order."""
        return self.outbox.inventory()

    # ---- inputs

    async def offer(
        self, item: Pending, payload: bytes, *, codec: Codec | str | None = None
    ) -> Ticket:
        """Make one ready result (payload already encoded with ``codec``) available."""
        (ticket,) = await self.offer_many([(item, payload)], codec=codec)
        return ticket

    async def offer_many(
        self, items: Iterable[tuple[Pending, bytes]], *, codec: Codec | str | None = None
    ) -> list[Ticket]:
        """Make several results ready at once, so the policy sees them together.

        All or nothing: a bad item raises :class:`OfferError` and none is added.
        Raises the fatal error once the sender died, :class:`LinkClosed` once closed.
        """
        return self.outbox.offer_many(items, codec=codec)

    def set_state(self, state: EngineState) -> None:
        """The latest engine state, passed to the policy unfiltered (see :class:`Outbox`)."""
        self.outbox.set_state(state)

    def complete(self, cid: ContinuationId, output_tokens: int) -> None:
        """The continuation's model call ended: tell the policy, then decide again."""
        self.outbox.complete(cid, output_tokens)

    def cancel(self, cid: ContinuationId) -> bool:
        """Withdraw a pending (uncommitted) result; committed frames keep their place."""
        return self.outbox.cancel(cid)

    # ---- lifecycle

    async def start(self, host: str, port: int, *, connect_timeout: float = 10.0) -> None:
        """Dial the receiver and keep the connection (re-dialling after drops).

        Raises at once if the sender already died or was closed, and if it dies
        while connecting; after ``connect_timeout`` it closes and raises.
        """
        if self._task is not None:
            raise LinkError("sender already started")
        self.outbox.check_open()
        self.host, self.port = host, port
        self._task = asyncio.create_task(self._run(), name="ladsd-sender")
        up = asyncio.ensure_future(self._connected.wait())
        try:
            await asyncio.wait(
                {up, self._task}, timeout=connect_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            up.cancel()
        if self._connected.is_set():
            return
        err = self.outbox.error
        await self.close()
        raise err or LinkError(f"could not connect to {host}:{port} in {connect_timeout} s")

    async def drain(self) -> None:
        """Wait until every offered result is received (or failed)."""
        await self.outbox.idle.wait()
        if self.outbox.error is not None:
            raise self.outbox.error

    async def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop; with ``drain``, first wait (up to ``timeout``) for everything offered.

        Results not yet received fail with :class:`LinkClosed`.
        """
        try:
            if drain and self.outbox.error is None and not self._closing:
                await asyncio.wait_for(self.drain(), timeout)
        finally:
            self._closing = True
            self.outbox.close()  # before any await: nothing commits or moves from here on
            if self._task is not None and not self._task.done():
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task

    def stats(self) -> dict[str, float]:
        return {**self.outbox.stats(), **self.counters}

    def sizes(self) -> dict[str, int]:
        """Per-result structures (the socket part keeps none of its own)."""
        return self.outbox.sizes()

    def check_integrity(self) -> None:
        """Assert the invariants of the class docstring."""
        self.outbox.check_integrity()
        assert self.outbox.error is not None or self._streak <= self.max_drops, "streak"
        assert not self._closing or self.outbox.closed, "closing, but the outbox is open"
        assert self._connected.is_set() == (self.counters["connects"] > 0)

    # ---- connection

    def _stopped(self, err: LinkError) -> None:
        # The outbox died (policy, streak, ...): the connection has nothing left to do.
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    async def _run(self) -> None:
        try:
            await self._dial()
        except Exception as exc:  # not a dropped connection: stop loudly
            err = exc if isinstance(exc, LinkError) else LinkError(f"sender stopped: {exc!r}")
            if err is not exc:
                err.__cause__ = exc
            self.outbox.stop(err)

    async def _dial(self) -> None:
        backoff = 0.02
        while not self._closing and self.outbox.error is None:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                self.counters["connect_failures"] += 1
                # Before the first connection start()'s connect_timeout governs.
                if self._connected.is_set() and self.outbox.in_flight:
                    self._strike("re-dial failed")
                if self.outbox.error is None:
                    await asyncio.sleep(backoff)
                    backoff = min(2 * backoff, 1.0)
                continue
            backoff = 0.02
            nodelay(writer)
            self.counters["connects"] += 1
            self._connected.set()
            tasks = [
                asyncio.create_task(self._read_control(reader)),
                asyncio.create_task(self._write(writer)),
            ]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    exc = None if t.cancelled() else t.exception()
                    if exc is not None and not isinstance(exc, _DROPS):
                        raise exc
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                writer.close()
                with contextlib.suppress(*_DROPS):
                    await writer.wait_closed()
            if not self._closing:
                self._dropped()

    def _dropped(self) -> None:
        """Resend what is unacknowledged; charge the drop (the outbox fails a choking frame)."""
        self.counters["drops"] += 1
        outstanding = self.outbox.in_flight > 0
        self.outbox.rewind(self.max_drops)
        if outstanding:
            self._strike("connection dropped")

    def _strike(self, what: str) -> None:
        """One more drop or failed re-dial with results outstanding and no answer since.

        A frame that chokes the receiver fails alone after ``max_drops`` charges
        (the outbox's rewind); a link that keeps failing beyond that stops the sender.
        """
        self._streak += 1
        if self._streak > self.max_drops:
            self.outbox.stop(
                LinkDown(
                    f"{what}: {self._streak} drops or failed re-dials of {self.host}:{self.port} "
                    f"in a row with results outstanding and no answer (max_drops "
                    f"{self.max_drops})"
                )
            )

    def _wire(self, e: Entry) -> bytes:
        """Start a transmission of ``e``: the bytes to send (a test fault may alter them)."""
        send_no = self.outbox.begin(e)
        if self.fault is None:
            return e.data
        wire = self.fault(e.ticket.cid, send_no, e.data)
        if len(wire) != len(e.data):
            raise LinkError("a fault must keep the frame length")
        return wire

    async def _write(self, writer: asyncio.StreamWriter) -> None:
        cur: Entry | None = None
        wire = b""
        while True:
            e = self.outbox.next_unsent()
            if e is None:
                await self.outbox.unsent.wait()
                continue
            if e.sent == 0 or e is not cur:
                assert e.sent == 0, "a frame resumed mid-transmission by a new writer"
                cur, wire = e, self._wire(e)
            left = len(wire) - e.sent
            n = await self.bucket.take(
                min(self.chunk, left), least=min(max(1, self.chunk // 2), left)
            )
            writer.write(wire[e.sent : e.sent + n])
            self.outbox.wrote(e, n)
            await writer.drain()

    async def _read_control(self, reader: asyncio.StreamReader) -> None:
        while True:
            msg, size = await read_control(reader)
            self.counters["control_bytes"] += size
            self._streak = 0  # the receiver answers: the link works
            self.outbox.answer(msg)
