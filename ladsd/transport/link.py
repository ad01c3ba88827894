"""The return link: a paced sender and a verifying receiver over localhost TCP (spec 2).

Sender = Outbox (no socket) + the socket part
  * ``F(t)``, the uncommitted inventory: ready, uncommitted results (FIFO order);
  * the committed queue: transport order is fixed once committed;
  * at most ``window`` committed frames not yet completely received;
  * ``Q_B``: committed bytes not yet on the wire.
  Whenever the window has room and results are pending the outbox asks the
  delivery policy which one to commit (stamp ``s``). One writer task sends the
  committed queue in order, paced by a token bucket at ``R`` bytes/s.

Receiver
  Decodes the stream, verifies each frame, binds it to (workflow, turn,
  prefix digest, payload digest) and awaits the registration callback at
  once, in receipt order (stamp ``c``: the read that completed the frame).
  It answers every frame on the same connection: an ack (``c`` included,
  which frees a window slot) or a nack (the sender re-queues the result).
  Deliveries are deduplicated by identity + payload digest, so a frame resent
  after a lost ack is acknowledged again but registered once.

A dropped connection is re-dialled; committed frames not yet acknowledged are
resent whole, in their order. Nothing is lost silently and nothing hangs: a
result the receiver keeps rejecting, or that cannot be sent, fails its ticket
with a clear error; a failing policy or a link that keeps dropping stops the
sender, fails every outstanding ticket with its error and keeps it as ``Sender.error``.

Modules: ``outbox.py`` (no socket: the rules over ``outbox_queues.py``, queues
and window; ``outbox_policy.py``, policy calls; ``outbox_entries.py``, tickets),
``sender.py`` (dial, pacing, acks, resends), ``receiver.py``, ``control.py``
(acks/nacks on the wire), ``errors.py``; this one pairs the two ends and
re-exports the API.
"""

from __future__ import annotations

from collections.abc import Callable

from ladsd.clock import Clock, now
from ladsd.config import LinkConfig
from ladsd.delivery.policy import Policy
from ladsd.records import SenderInventory
from ladsd.transport.control import (
    Control,
    Kind,
    Reason,
    decode_control,
    encode_control,
)
from ladsd.transport.errors import (
    Cancelled,
    ControlError,
    FrameRejected,
    LinkClosed,
    LinkDown,
    LinkError,
    OfferError,
    PolicyError,
    Rejected,
    SendFailed,
)
from ladsd.transport.outbox import Outbox
from ladsd.transport.pacer import TokenBucket
from ladsd.transport.receiver import Delivery, Receiver, Register
from ladsd.transport.sender import Fault, Prepared, Sender, Ticket, prepare

__all__ = [
    "Cancelled",
    "Control",
    "ControlError",
    "Delivery",
    "Fault",
    "FrameRejected",
    "Kind",
    "Link",
    "LinkClosed",
    "LinkDown",
    "LinkError",
    "OfferError",
    "Outbox",
    "PolicyError",
    "Prepared",
    "Reason",
    "Receiver",
    "Register",
    "Rejected",
    "SendFailed",
    "Sender",
    "Ticket",
    "decode_control",
    "encode_control",
    "prepare",
]


class Link:
    """Sender and receiver of one return link on ``config.host`` (127.0.0.1)."""

    def __init__(
        self,
        policy: Policy,
        register: Register,
        *,
        config: LinkConfig = LinkConfig(),
        on_inventory: Callable[[SenderInventory], None] | None = None,
        on_bytes: Callable[[int, float], None] | None = None,
        clock: Clock = now,
        bucket: TokenBucket | None = None,
        max_rejects: int = 3,
        max_drops: int = 8,
        fault: Fault | None = None,
    ) -> None:
        self.config = config
        self.receiver = Receiver(register, config=config, clock=clock, on_bytes=on_bytes)
        self.sender = Sender(
            policy,
            config=config,
            on_inventory=on_inventory,
            clock=clock,
            bucket=bucket,
            max_rejects=max_rejects,
            max_drops=max_drops,
            fault=fault,
        )

    async def start(self) -> None:
        port = await self.receiver.start()
        await self.sender.start(self.config.host, port)

    async def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        try:
            await self.sender.close(drain=drain, timeout=timeout)
        finally:
            await self.receiver.close()

    def stats(self) -> dict[str, float]:
        """Sender counters, then the receiver's prefixed ``rx_``."""
        out = self.sender.stats()
        out.update({f"rx_{k}": v for k, v in self.receiver.stats().items()})
        return out

    async def __aenter__(self) -> Link:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
