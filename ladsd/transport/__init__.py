"""The return path (spec section 2): frames, pacing, the localhost TCP link."""

from ladsd.transport.errors import LinkDown, LinkError, PolicyError, Rejected
from ladsd.transport.frame import (
    Codec,
    Frame,
    FrameDecoder,
    FrameError,
    FrameHeader,
    decode,
    decode_payload,
    digest,
    encode,
    encode_payload,
    make_frame,
)
from ladsd.transport.link import Link
from ladsd.transport.outbox import Outbox
from ladsd.transport.pacer import TokenBucket
from ladsd.transport.receiver import Delivery, Receiver
from ladsd.transport.sender import Prepared, Sender, Ticket, prepare

__all__ = [
    "Codec",
    "Delivery",
    "Frame",
    "FrameDecoder",
    "FrameError",
    "FrameHeader",
    "Link",
    "LinkDown",
    "LinkError",
    "Outbox",
    "PolicyError",
    "Prepared",
    "Receiver",
    "Rejected",
    "Sender",
    "Ticket",
    "TokenBucket",
    "decode",
    "decode_payload",
    "digest",
    "encode",
    "encode_payload",
    "make_frame",
    "prepare",
]
