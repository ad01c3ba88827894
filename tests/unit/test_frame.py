"""Result frames: round trips, strict decoding, fuzzing (spec section 2)."""

from __future__ import annotations

import gzip
import hashlib
import struct
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ladsd.config import FRAME_HEADER_BYTES, FRAME_OVERHEAD
from ladsd.records import ContinuationId
from ladsd.transport.frame import (
    MAX_TEXT_BYTES,
    BadMagic,
    BadVersion,
    Codec,
    CodecError,
    DigestMismatch,
    FieldError,
    Frame,
    FrameDecoder,
    FrameError,
    FrameTooLarge,
    HeaderCorrupt,
    TrailingBytes,
    Truncated,
    UnknownCodec,
    decode,
    decode_payload,
    digest,
    encode,
    encode_payload,
    make_frame,
)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def text(max_bytes: int) -> st.SearchStrategy[str]:
    return st.text(max_size=40).filter(lambda s: len(s.encode()) <= max_bytes)


cids = st.builds(
    ContinuationId,
    text(MAX_TEXT_BYTES),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
)


@st.composite
def frames(draw: st.DrawFn) -> Frame:
    codec = draw(st.sampled_from(list(Codec)))
    observation = draw(st.binary(max_size=3000))
    payload, _ = encode_payload(observation, codec)
    return make_frame(
        draw(cids),
        payload,
        prefix_digest=draw(text(MAX_TEXT_BYTES)),
        ready_time=draw(st.floats(allow_nan=False, allow_infinity=False)),
        codec=codec,
    )


def sample(payload: bytes = b"observation " * 20, codec: Codec = Codec.IDENTITY) -> Frame:
    data, _ = encode_payload(payload, codec)
    return make_frame(
        ContinuationId("wf-7", 3, 1),
        data,
        prefix_digest=digest(b"history"),
        ready_time=12.5,
        codec=codec,
    )


def resign(wire: bytearray) -> bytearray:
    """Recompute the header digest after editing header fields (a forged but intact header)."""
    head = wire[4:FRAME_OVERHEAD]
    head[64:96] = bytes(32)
    head[64:96] = hashlib.sha256(head).digest()
    wire[4:FRAME_OVERHEAD] = head
    return wire


# ---------------------------------------------------------------- round trips


@given(frames())
def test_round_trip(frame: Frame) -> None:
    wire = encode(frame)
    assert len(wire) == frame.size == FRAME_OVERHEAD + len(frame.payload)
    assert struct.unpack(">I", wire[:4])[0] == len(frame.payload)
    assert decode(wire) == frame
    observation, _ = decode_payload(frame.payload, frame.header.codec)
    assert encode_payload(observation, frame.header.codec)[0] == frame.payload


@given(st.lists(frames(), max_size=5), st.lists(st.integers(1, 700), min_size=1))
def test_stream_round_trip_any_chunking(fs: list[Frame], cuts: list[int]) -> None:
    wire = b"".join(encode(f) for f in fs)
    dec = FrameDecoder()
    out: list[Frame] = []
    i = k = 0
    while i < len(wire):
        step = cuts[k % len(cuts)]
        dec.feed(wire[i : i + step])
        out.extend(dec)
        i += step
        k += 1
    dec.close()
    assert out == fs
    assert dec.buffered == 0


def test_header_is_fixed_size_and_zero_padded() -> None:
    wire = encode(sample())
    head = wire[4:FRAME_OVERHEAD]
    assert len(head) == FRAME_HEADER_BYTES == 1024
    assert head[:4] == b"LADF"
    used = 100 + len(b"wf-7") + len(digest(b"history"))
    assert not any(head[used:])


@pytest.mark.parametrize("codec", list(Codec))
def test_codecs_round_trip_and_report_time(codec: Codec) -> None:
    obs = b"<li>product review text</li>" * 200
    payload, enc_s = encode_payload(obs, codec)
    back, dec_s = decode_payload(payload, codec)
    assert back == obs
    assert enc_s >= 0 and dec_s >= 0
    if codec is Codec.GZIP6:
        assert len(payload) < len(obs)
        assert payload == encode_payload(obs, "gzip6")[0]  # deterministic (mtime 0)
        assert gzip.decompress(payload) == obs


def test_codec_names() -> None:
    assert Codec.parse("identity") is Codec.IDENTITY
    assert Codec.parse("gzip6") is Codec.GZIP6
    with pytest.raises(UnknownCodec, match="brotli"):
        Codec.parse("brotli")


# ---------------------------------------------------------------- strict decoding


def test_bad_magic() -> None:
    wire = bytearray(encode(sample()))
    wire[4:8] = b"HTTP"
    with pytest.raises(BadMagic):
        decode(bytes(wire))


def test_bad_version() -> None:
    wire = bytearray(encode(sample()))
    wire[8:10] = (2).to_bytes(2, "big")
    with pytest.raises(BadVersion, match="version 2"):
        decode(bytes(wire))


def test_length_over_maximum_is_refused_before_reading_the_payload() -> None:
    wire = encode(sample())
    dec = FrameDecoder(max_payload=100)
    dec.feed(wire[:4])  # the length alone is enough to refuse
    with pytest.raises(FrameTooLarge, match="exceeds the maximum 100"):
        dec.next()
    with pytest.raises(FrameTooLarge):
        decode(wire, max_payload=10)


@pytest.mark.parametrize("cut", [0, 1, 3, 4, 500, FRAME_OVERHEAD, FRAME_OVERHEAD + 5])
def test_truncated(cut: int) -> None:
    wire = encode(sample())
    with pytest.raises(Truncated):
        decode(wire[:cut])
    dec = FrameDecoder()
    dec.feed(wire[:cut])
    assert dec.next() is None
    if cut:
        with pytest.raises(Truncated):
            dec.close()


def test_trailing_bytes() -> None:
    with pytest.raises(TrailingBytes):
        decode(encode(sample()) + b"\0")


def test_digest_mismatch_names_the_frame_and_the_stream_continues() -> None:
    good, bad = sample(b"first"), sample(b"second")
    wire = bytearray(encode(bad))
    wire[-1] ^= 0x01
    dec = FrameDecoder()
    dec.feed(bytes(wire) + encode(good))
    with pytest.raises(DigestMismatch) as info:
        dec.next()
    assert info.value.recoverable
    assert info.value.cid == bad.cid
    assert info.value.payload_digest == bad.header.payload_digest
    assert dec.next() == good


def test_unknown_codec_is_recoverable() -> None:
    f = sample()
    wire = resign(bytearray(encode(f)))
    wire[4 + 6] = 9
    wire = resign(wire)
    dec = FrameDecoder()
    dec.feed(bytes(wire) + encode(f))
    with pytest.raises(UnknownCodec, match="codec id 9") as info:
        dec.next()
    assert info.value.cid == f.cid
    assert dec.next() == f


@pytest.mark.parametrize("offset", [7, 8 + 4, 16, 24, 32, 70, 96, 100, 1023])
def test_any_header_change_is_header_corrupt(offset: int) -> None:
    wire = bytearray(encode(sample()))
    wire[4 + offset] ^= 0x40
    with pytest.raises(HeaderCorrupt):
        decode(bytes(wire))


def test_forged_header_fields_are_refused() -> None:
    base = bytearray(encode(sample()))
    flags = bytearray(base)
    flags[4 + 7] = 1
    with pytest.raises(HeaderCorrupt, match="flags"):
        decode(bytes(resign(flags)))
    length = bytearray(base)
    length[4 + 16 : 4 + 24] = (1).to_bytes(8, "big")
    with pytest.raises(HeaderCorrupt, match="length prefix"):
        decode(bytes(resign(length)))
    padding = bytearray(base)
    padding[4 + 1000] = 1
    with pytest.raises(HeaderCorrupt, match="padding"):
        decode(bytes(resign(padding)))


def test_broken_stream_stays_broken() -> None:
    wire = bytearray(encode(sample()))
    wire[4] ^= 0xFF
    dec = FrameDecoder()
    dec.feed(bytes(wire) + encode(sample()))
    with pytest.raises(BadMagic):
        dec.next()
    with pytest.raises(BadMagic):
        dec.next()


def test_gzip_bomb_and_garbage_payload() -> None:
    bomb, _ = encode_payload(bytes(1_000_000), Codec.GZIP6)
    with pytest.raises(FrameTooLarge, match="inflates"):
        decode_payload(bomb, Codec.GZIP6, max_bytes=10_000)
    with pytest.raises(CodecError):
        decode_payload(b"not gzip at all", Codec.GZIP6)
    good, _ = encode_payload(b"abc", Codec.GZIP6)
    with pytest.raises(CodecError, match="trailing"):
        decode_payload(good + b"x", Codec.GZIP6)
    with pytest.raises(CodecError, match="incomplete"):
        decode_payload(good[:-3], Codec.GZIP6)


def test_errors_share_one_base() -> None:
    kinds = [BadMagic, BadVersion, FrameTooLarge, Truncated, DigestMismatch, UnknownCodec]
    assert len(set(kinds)) == 6
    assert all(issubclass(k, FrameError) for k in kinds)


def test_unframeable_fields_are_refused_when_encoding() -> None:
    f = sample()
    h = f.header
    cases = [
        (replace(h, cid=ContinuationId("x" * 300, 0)), "workflow id"),
        (replace(h, cid=ContinuationId("w", -1)), "turn"),
        (replace(h, payload_digest="abc"), "digest"),
        (replace(h, ready_time=float("nan")), "finite"),
        (replace(h, prefix_digest="p" * 257), "prefix digest"),
    ]
    for header, msg in cases:
        with pytest.raises(FieldError, match=msg):
            encode(Frame(header, f.payload))
    with pytest.raises(FieldError, match="digest does not match"):
        encode(Frame(f.header, b"x" * len(f.payload)))
    with pytest.raises(FieldError, match="payload is"):
        Frame(f.header, b"")


# ---------------------------------------------------------------- fuzzing


@FUZZ
@given(st.binary(max_size=3000), st.integers(1, 600))
def test_random_bytes_only_raise_frame_errors(data: bytes, step: int) -> None:
    try:
        decode(data)
    except FrameError:
        pass
    dec = FrameDecoder(max_payload=4096)
    for i in range(0, len(data), step):
        dec.feed(data[i : i + step])
        try:
            while dec.next() is not None:
                pass  # a random frame would need two forged sha256 digests
        except FrameError as e:
            if not e.recoverable:
                break


def mutate(wire: bytes, data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "cut", "splice"]))
    b = bytearray(wire)
    i = data.draw(st.integers(0, max(0, len(b) - 1)))
    if kind == "flip":
        b[i] ^= data.draw(st.integers(1, 255))
    elif kind == "set":
        b[i : i + 8] = data.draw(st.binary(min_size=1, max_size=8))
    elif kind == "insert":
        b[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    elif kind == "delete":
        del b[i : i + data.draw(st.integers(1, 16))]
    elif kind == "cut":
        del b[i:]
    else:
        j = data.draw(st.integers(0, max(0, len(b) - 1)))
        b[i:i] = b[j : j + data.draw(st.integers(1, 64))]
    return bytes(b)


@FUZZ
@given(frames(), st.data())
def test_mutated_frame_is_never_accepted(frame: Frame, data: st.DataObject) -> None:
    wire = encode(frame)
    bad = mutate(wire, data)
    if bad == wire:
        return
    with pytest.raises(FrameError):
        decode(bad)


@FUZZ
@given(st.lists(frames(), min_size=1, max_size=4), st.data(), st.integers(1, 900))
def test_mutated_stream_yields_only_original_frames_in_order(
    fs: list[Frame], data: st.DataObject, step: int
) -> None:
    wire = b"".join(encode(f) for f in fs)
    bad = mutate(wire, data)
    dec = FrameDecoder()
    got: list[Frame] = []
    broken = False
    for i in range(0, len(bad), step):
        dec.feed(bad[i : i + step])
        while not broken:
            try:
                f = dec.next()
            except FrameError as e:
                broken = not e.recoverable
                continue
            if f is None:
                break
            got.append(f)
    # Every accepted frame is an original one, in order (a subsequence of fs).
    it = iter(fs)
    assert all(any(g == f for f in it) for g in got)
    if bad != wire:  # the damage shows: a frame refused, a stream error, or bytes left over
        assert len(got) < len(fs) or dec.buffered or broken
