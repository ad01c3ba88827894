"""Result frames of the return path (spec section 2).

On the wire a frame is a 4-byte big-endian payload length, a 1024-byte fixed
metadata header, then the payload: ``h = 1028`` framing bytes per result.

Header layout (big-endian, zero padded to 1024 bytes)::

    0   magic            4s   b"LADF"
    4   format version   u16  1
    6   codec            u8   0 identity, 1 gzip level 6
    7   flags            u8   0 (reserved)
    8   turn             u32
    12  version          u32
    16  payload length   u64  equals the 4-byte prefix
    24  ready time       f64  r_i on ladsd.clock
    32  payload digest   32s  sha256 of the payload as sent (after the codec)
    64  header digest    32s  sha256 of the 1024 header bytes with this field zeroed
    96  workflow length  u16, then 100: workflow id (utf-8)
    98  prefix length    u16, then the prefix digest (utf-8) right after the workflow id

The payload digest covers the bytes on the wire, so a receiver verifies a
frame before it decompresses anything. The header digest makes every header
byte (padding included) tamper-evident: a corrupted frame is never accepted.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum

from ladsd.config import FRAME_HEADER_BYTES, FRAME_OVERHEAD
from ladsd.records import ContinuationId

MAGIC = b"LADF"
FORMAT_VERSION = 1
DEFAULT_MAX_PAYLOAD = 16 * 1024 * 1024
MAX_TEXT_BYTES = 256  # workflow id, prefix digest

_PREFIX = struct.Struct(">I")
_FIXED = struct.Struct(">4sHBBIIQd32s32sHH")
_DIGEST_AT = 64  # offset of the header digest
_TEXT_AT = _FIXED.size  # 100
_U32 = 2**32 - 1


class Codec(IntEnum):
    """Payload codecs; the codec time is part of measured workflow time."""

    IDENTITY = 0
    GZIP6 = 1

    @classmethod
    def parse(cls, name: str | int | Codec) -> Codec:
        """``"identity"`` / ``"gzip6"`` (or a Codec) -> Codec; a clear error otherwise."""
        if isinstance(name, Codec):
            return name
        if isinstance(name, int):
            try:
                return cls(name)
            except ValueError:
                raise UnknownCodec(f"unknown codec id {name}") from None
        for c in cls:
            if c.label == name:
                return c
        raise UnknownCodec(f"unknown codec {name!r}; choose identity or gzip6")

    @property
    def label(self) -> str:
        return {Codec.IDENTITY: "identity", Codec.GZIP6: "gzip6"}[self]


class FrameError(ValueError):
    """A frame that cannot be encoded or accepted.

    ``recoverable``: the decoder consumed the bad frame whole and the stream
    stays aligned; then ``cid`` and ``payload_digest`` name the frame (its
    header was intact), so a receiver can reject just that frame.
    """

    recoverable = False

    def __init__(
        self, msg: str, *, cid: ContinuationId | None = None, payload_digest: str | None = None
    ) -> None:
        super().__init__(msg)
        self.cid = cid
        self.payload_digest = payload_digest


class BadMagic(FrameError):
    """The header does not start with ``MAGIC``: not a ladsd frame (or misaligned)."""


class BadVersion(FrameError):
    """A header format version this decoder does not speak."""


class FrameTooLarge(FrameError):
    """A payload (or decoded observation) over the configured maximum."""


class Truncated(FrameError):
    """The bytes end inside a frame."""


class TrailingBytes(FrameError):
    """Bytes after the one frame :func:`decode` was asked for."""


class HeaderCorrupt(FrameError):
    """Header digest mismatch, or a malformed header field."""


class FieldError(FrameError):
    """A field that cannot be framed (raised when encoding)."""


class DigestMismatch(FrameError):
    """The payload does not hash to the header's payload digest."""

    recoverable = True


class UnknownCodec(FrameError):
    """A codec id this decoder does not know."""

    recoverable = True


class CodecError(FrameError):
    """A payload that does not decode with its codec."""

    recoverable = True


def digest(data: bytes) -> str:
    """sha256 hex digest (payload and prefix digests)."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FrameHeader:
    cid: ContinuationId  # (workflow, turn, version)
    prefix_digest: str
    payload_digest: str  # sha256 hex of the payload as sent
    codec: Codec
    payload_length: int
    ready_time: float  # r_i


@dataclass(frozen=True)
class Frame:
    header: FrameHeader
    payload: bytes  # as sent (after the codec)

    def __post_init__(self) -> None:
        if len(self.payload) != self.header.payload_length:
            raise FieldError(
                f"payload is {len(self.payload)} bytes, header says {self.header.payload_length}"
            )

    @property
    def cid(self) -> ContinuationId:
        return self.header.cid

    @property
    def size(self) -> int:
        """Bytes on the wire: h + p."""
        return FRAME_OVERHEAD + len(self.payload)


def encode_payload(observation: bytes, codec: Codec | str) -> tuple[bytes, float]:
    """(payload, codec seconds). gzip is deterministic (mtime 0), level 6."""
    c = Codec.parse(codec)
    t0 = time.perf_counter()
    out = observation if c is Codec.IDENTITY else gzip.compress(observation, 6, mtime=0)
    return bytes(out), time.perf_counter() - t0


def decode_payload(
    payload: bytes, codec: Codec | str, max_bytes: int = DEFAULT_MAX_PAYLOAD
) -> tuple[bytes, float]:
    """(observation, codec seconds); bounded so a small payload cannot inflate past max_bytes."""
    c = Codec.parse(codec)
    t0 = time.perf_counter()
    if c is Codec.IDENTITY:
        out = bytes(payload)
    else:
        d = zlib.decompressobj(wbits=31)  # gzip container, one member
        try:
            out = d.decompress(payload, max_bytes + 1)
        except zlib.error as e:
            raise CodecError(f"gzip payload does not decode: {e}") from None
        if len(out) > max_bytes or d.unconsumed_tail:
            raise FrameTooLarge(f"gzip payload inflates past {max_bytes} bytes")
        if not d.eof or d.unused_data:
            raise CodecError("gzip payload is incomplete or has trailing data")
    return out, time.perf_counter() - t0


def make_frame(
    cid: ContinuationId,
    payload: bytes,
    *,
    prefix_digest: str,
    ready_time: float,
    codec: Codec | str = Codec.IDENTITY,
) -> Frame:
    """A frame for an already encoded payload (see :func:`encode_payload`)."""
    header = FrameHeader(
        cid=cid,
        prefix_digest=prefix_digest,
        payload_digest=digest(payload),
        codec=Codec.parse(codec),
        payload_length=len(payload),
        ready_time=ready_time,
    )
    return Frame(header, bytes(payload))


def _text(value: str, what: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > MAX_TEXT_BYTES:
        raise FieldError(f"{what} is {len(raw)} bytes (utf-8), at most {MAX_TEXT_BYTES} fit")
    return raw


def encode_header(h: FrameHeader) -> bytes:
    """The 1024 header bytes of ``h``."""
    cid = h.cid
    if not (0 <= cid.turn <= _U32 and 0 <= cid.version <= _U32):
        raise FieldError(f"turn and version must be in [0, 2^32): {cid.key()}")
    if not math.isfinite(h.ready_time):
        raise FieldError(f"ready time must be finite, got {h.ready_time}")
    if not 0 <= h.payload_length <= _U32:
        raise FieldError(f"payload length {h.payload_length} does not fit the 4-byte prefix")
    try:
        pd = bytes.fromhex(h.payload_digest)
    except ValueError:
        pd = b""
    if len(pd) != 32:
        raise FieldError(f"payload digest must be 64 hex digits (sha256): {h.payload_digest!r}")
    wf = _text(cid.workflow, "workflow id")
    prefix = _text(h.prefix_digest, "prefix digest")
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        int(Codec.parse(h.codec)),
        0,
        cid.turn,
        cid.version,
        h.payload_length,
        h.ready_time,
        pd,
        bytes(32),
        len(wf),
        len(prefix),
    )
    raw = bytearray(FRAME_HEADER_BYTES)
    raw[: len(fixed)] = fixed
    raw[_TEXT_AT : _TEXT_AT + len(wf) + len(prefix)] = wf + prefix
    raw[_DIGEST_AT : _DIGEST_AT + 32] = hashlib.sha256(raw).digest()
    return bytes(raw)


def encode(frame: Frame) -> bytes:
    """Length prefix + header + payload. Refuses a frame whose digest does not match."""
    if digest(frame.payload) != frame.header.payload_digest:
        raise FieldError(f"payload digest does not match the payload of {frame.cid.key()}")
    return _PREFIX.pack(len(frame.payload)) + encode_header(frame.header) + frame.payload


def _length(buf: bytes | bytearray, max_payload: int) -> int:
    (n,) = _PREFIX.unpack_from(buf)
    if n > max_payload:
        raise FrameTooLarge(f"payload length {n} exceeds the maximum {max_payload}")
    return n


def _parse_header(raw: bytes | bytearray, length: int) -> FrameHeader:
    """The header of a frame whose length prefix is ``length``."""
    (magic, fmt, codec, flags, turn, version, plen, ready, pd, hd, wf_len, pre_len) = (
        _FIXED.unpack_from(raw)
    )
    if magic != MAGIC:
        raise BadMagic(f"bad magic {magic!r}, expected {MAGIC!r}")
    if fmt != FORMAT_VERSION:
        raise BadVersion(f"frame format version {fmt}, this decoder speaks {FORMAT_VERSION}")
    zeroed = bytearray(raw)
    zeroed[_DIGEST_AT : _DIGEST_AT + 32] = bytes(32)
    if hashlib.sha256(zeroed).digest() != hd:
        raise HeaderCorrupt("header digest mismatch")
    if flags != 0:
        raise HeaderCorrupt(f"reserved flags byte is {flags}, expected 0")
    if plen != length:
        raise HeaderCorrupt(f"header payload length {plen} != length prefix {length}")
    end = _TEXT_AT + wf_len + pre_len
    if wf_len > MAX_TEXT_BYTES or pre_len > MAX_TEXT_BYTES or end > FRAME_HEADER_BYTES:
        raise HeaderCorrupt("text fields overrun the header")
    if any(raw[end:FRAME_HEADER_BYTES]):
        raise HeaderCorrupt("header padding is not zero")
    if not math.isfinite(ready):
        raise HeaderCorrupt(f"ready time is not finite: {ready}")
    try:
        workflow = bytes(raw[_TEXT_AT : _TEXT_AT + wf_len]).decode("utf-8")
        prefix = bytes(raw[_TEXT_AT + wf_len : end]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderCorrupt(f"text field is not utf-8: {e}") from None
    cid = ContinuationId(workflow, turn, version)
    pd_hex = pd.hex()
    if codec not in Codec._value2member_map_:
        msg = f"unknown codec id {codec} in {cid.key()}"
        raise UnknownCodec(msg, cid=cid, payload_digest=pd_hex)
    return FrameHeader(cid, prefix, pd_hex, Codec(codec), plen, ready)


def _check_payload(header: FrameHeader, payload: bytes) -> Frame:
    if digest(payload) != header.payload_digest:
        raise DigestMismatch(
            f"payload digest mismatch in {header.cid.key()}",
            cid=header.cid,
            payload_digest=header.payload_digest,
        )
    return Frame(header, payload)


def decode(data: bytes, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Frame:
    """Exactly one frame from ``data``; every defect is a specific :class:`FrameError`."""
    dec = FrameDecoder(max_payload=max_payload)
    dec.feed(data)
    frame = dec.next()
    if frame is None:
        raise Truncated(f"{len(data)} bytes end inside a frame")
    if dec.buffered:
        raise TrailingBytes(f"{dec.buffered} bytes after the frame")
    return frame


class FrameDecoder:
    """Incremental decoder for the receiver: ``feed`` bytes, then ``next`` frames.

    ``next`` returns a frame, None (needs more bytes) or raises. After a
    recoverable error (digest mismatch, unknown codec) the bad frame is
    consumed and decoding continues with the next one. Any other error means
    the stream cannot be trusted to be aligned: the decoder stays broken and
    raises it again.
    """

    def __init__(self, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        if max_payload < 0 or max_payload > _U32:
            raise ValueError(f"max_payload must be in [0, 2^32), got {max_payload}")
        self.max_payload = max_payload
        self._buf = bytearray()
        self._length: int | None = None  # payload length of the frame being read
        # header of the frame being read, or its (recoverable) unknown-codec error
        self._head: FrameHeader | UnknownCodec | None = None
        self._broken: FrameError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next(self) -> Frame | None:
        if self._broken is not None:
            raise self._broken
        try:
            return self._next()
        except FrameError as e:
            if not e.recoverable:
                self._broken = e
            raise

    def _next(self) -> Frame | None:
        buf = self._buf
        if self._length is None:
            if len(buf) < _PREFIX.size:
                return None
            self._length = _length(buf, self.max_payload)
        if self._head is None:
            if len(buf) < FRAME_OVERHEAD:
                return None
            try:
                self._head = _parse_header(buf[_PREFIX.size : FRAME_OVERHEAD], self._length)
            except UnknownCodec as e:
                self._head = e  # header intact: reject once the whole frame is consumed
        end = FRAME_OVERHEAD + self._length
        if len(buf) < end:
            return None
        head = self._head
        payload = bytes(buf[FRAME_OVERHEAD:end])
        del buf[:end]
        self._length = None
        self._head = None
        if isinstance(head, UnknownCodec):
            raise head
        return _check_payload(head, payload)

    def __iter__(self) -> Iterator[Frame]:
        """Frames available now (raises like :meth:`next`)."""
        while (f := self.next()) is not None:
            yield f

    def close(self) -> None:
        """End of stream: raises :class:`Truncated` if a partial frame is left."""
        if self._broken is None and self._buf:
            raise Truncated(f"stream ends with {len(self._buf)} bytes of an incomplete frame")
