"""One offered result as the outbox holds it: its ticket, its entry and its encoded frame.

:class:`Ticket` is the caller's handle (futures, stamps, retries);
:class:`Entry` is the outbox's place for it in F(t) or the committed queue;
:func:`build_frame` checks an offered item against its payload and encodes it.
:func:`stamp_commit`, :func:`settle_received` and :func:`settle_failed` move a
ticket's stamps and futures (the only code that does).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ladsd.config import FRAME_OVERHEAD
from ladsd.delivery.policy import Pending
from ladsd.records import ContinuationId, Phase
from ladsd.transport.errors import LinkError, OfferError
from ladsd.transport.frame import Codec, Frame, FrameError, encode, make_frame


@dataclass(eq=False)
class Ticket:
    """One offered result's progress, from offer to complete receipt.

    ``committed`` resolves with ``s`` at the first commitment; ``received``
    with ``c`` at complete receipt. If the result is not delivered both fail
    with a :class:`LinkError`: :class:`FrameRejected` (nacked more than
    ``max_rejects`` times), :class:`SendFailed` (the connection dropped
    ``max_drops`` times on it), :class:`Cancelled`, :class:`LinkClosed`, or the
    sender's fatal error (:class:`PolicyError`, :class:`LinkDown`, ...).
    A caller waiting for something the receipt causes (e.g. registration)
    should wait on ``received`` beside it, so a dead link never leaves it
    hanging (every ticket fails when the sender stops).

    ``s`` is the latest commitment (the delivered one, once ``c`` is known).
    """

    item: Pending
    committed: asyncio.Future[float]
    received: asyncio.Future[float]
    s: float | None = None
    c: float | None = None
    commits: int = 0
    sends: int = 0  # transmissions, resends included
    rejects: int = 0
    reasons: list[str] = field(default_factory=list)  # one per reject
    error: LinkError | None = None

    @property
    def cid(self) -> ContinuationId:
        return self.item.cid


@dataclass(eq=False)
class Entry:
    """A result in F(t) or in the committed queue (the socket part reads ``data``/``sent``)."""

    ticket: Ticket
    seq: int  # offer order: FIFO tie-break
    data: bytes  # the encoded frame
    phase: Phase = Phase.PENDING
    sent: int = 0  # bytes of the current transmission on the wire
    tx: int = 0  # transmissions of the current commitment
    drops: int = 0  # dropped connections charged to it (oldest unacknowledged)

    def order(self) -> tuple[float, int]:
        return (self.ticket.item.ready_time, self.seq)


def _consume(fut: asyncio.Future) -> None:
    # The failure is also kept on the ticket and counted; don't log it as unretrieved.
    if not fut.cancelled():
        fut.exception()


def stamp_commit(tk: Ticket, t: float) -> None:
    """``tk`` is committed at ``t`` (``s``; ``committed`` resolves at the first)."""
    tk.s = t
    tk.commits += 1
    if not tk.committed.done():
        tk.committed.set_result(t)


def settle_received(tk: Ticket, c: float) -> None:
    """``tk`` was completely received at ``c``."""
    tk.c = c
    if not tk.received.done():
        tk.received.set_result(c)


def settle_failed(tk: Ticket, err: LinkError) -> None:
    """``tk`` failed with ``err``: kept on the ticket, both futures fail (once)."""
    tk.error = err
    for fut in (tk.committed, tk.received):
        if not fut.done():
            fut.set_exception(err)
            fut.add_done_callback(_consume)


def build_frame(item: Pending, payload: bytes, codec: Codec, max_payload: int) -> bytes:
    """The encoded frame of ``item``; :class:`OfferError` if the item contradicts it."""
    cid = item.cid
    if len(payload) != item.payload_bytes:
        raise OfferError(
            f"{cid.key()}: payload is {len(payload)} bytes, item says {item.payload_bytes}"
        )
    if item.frame_bytes != FRAME_OVERHEAD + item.payload_bytes:
        raise OfferError(
            f"{cid.key()}: frame_bytes {item.frame_bytes} != h + p = "
            f"{FRAME_OVERHEAD + item.payload_bytes}"
        )
    if len(payload) > max_payload:
        raise OfferError(
            f"{cid.key()}: payload of {len(payload)} bytes exceeds the link maximum {max_payload}"
        )
    try:
        frame: Frame = make_frame(
            cid, payload, prefix_digest=item.prefix_digest, ready_time=item.ready_time, codec=codec
        )
        data = encode(frame)
    except FrameError as exc:
        raise OfferError(f"{cid.key()}: {exc}") from None
    if frame.header.payload_digest != item.payload_digest:
        raise OfferError(f"{cid.key()}: payload digest does not match the item's payload_digest")
    return data
