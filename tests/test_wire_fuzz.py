"""Property-based fuzz of qlink.wire's decoders.

Whatever bytes arrive, ``decode_request`` / ``decode_response`` either return a frame
or raise ``FrameError`` — never IndexError, struct.error, a bare ValueError... — and
their answer depends only on the frame's own bytes: the same frame followed by
different bytes in a larger buffer decodes identically.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlink import wire
from qlink.wire import FrameError

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
REQ_HDR = struct.Struct("<IIIIQ")
RESP_HDR = struct.Struct("<IiIIQ")
SENTINELS = (b"\x00", b"\xFF", b"\xA5")

# ----------------------------------------------------------------- strategies

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
decoder_ids = st.integers(0, 31)


@st.composite
def enqueue_frames(draw):
    num = draw(st.one_of(st.integers(1, 300), st.sampled_from([2**20 - 1, 2**20])))
    if num <= 300:
        bits = draw(st.binary(min_size=(num + 7) // 8, max_size=(num + 7) // 8))
    else:  # too large for hypothesis' own byte budget: derive the bits from a drawn seed
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        bits = rng.integers(0, 256, (num + 7) // 8, dtype=np.uint8).tobytes()
    buf = bytearray(wire.enqueue_syndromes_nbytes(num))
    wire.encode_enqueue_syndromes_into(
        buf, request_id=draw(u32), decoder_id=draw(decoder_ids), counter=draw(st.integers(0, 2**63 - 1)),
        syndrome_mapping_id=draw(i64), syndromes_bits_packed=bits, num_syndromes=num,
        ptp_timestamp=draw(u64),
    )
    return bytes(buf)


@st.composite
def get_corrections_frames(draw):
    buf = bytearray(41)
    wire.encode_get_corrections_into(
        buf, request_id=draw(u32), decoder_id=draw(decoder_ids), return_size=draw(st.integers(0, 2**20)),
        reset=draw(st.booleans()), ptp_timestamp=draw(u64),
    )
    return bytes(buf)


@st.composite
def reset_frames(draw):
    buf = bytearray(32)
    wire.encode_reset_decoder_into(buf, request_id=draw(u32), decoder_id=draw(decoder_ids), ptp_timestamp=draw(u64))
    return bytes(buf)


@st.composite
def response_frames(draw):
    result = draw(st.binary(max_size=64))
    buf = bytearray(24 + len(result))
    wire.encode_response_into(
        buf, status=draw(st.integers(-(2**31), 2**31 - 1)), request_id=draw(u32),
        ptp_timestamp=draw(u64), result=result,
    )
    return bytes(buf)


valid_requests = st.one_of(enqueue_frames(), get_corrections_frames(), reset_frames())
valid_frames = st.one_of(valid_requests, response_frames())


@st.composite
def header_shaped(draw):
    """A plausible header (right magic, a known id) over arbitrary payload bytes."""
    magic = draw(st.sampled_from([wire.REQUEST_MAGIC, wire.RESPONSE_MAGIC, 0, 0x52515543]))
    fid = draw(st.one_of(st.sampled_from([wire.ENQUEUE_SYNDROMES, wire.GET_CORRECTIONS, wire.RESET_DECODER]), u32))
    payload = draw(st.binary(max_size=80))
    arg_len = draw(st.one_of(st.just(len(payload)), st.integers(0, 100), u32))
    return REQ_HDR.pack(magic, fid, arg_len, draw(u32), draw(u64)) + payload


@st.composite
def truncated(draw):
    frame = draw(valid_frames)
    return frame[: draw(st.integers(0, len(frame) - 1))]


@st.composite
def field_mutated(draw):
    """A valid frame with one 8-byte-aligned or arbitrary field overwritten."""
    frame = bytearray(draw(valid_frames))
    kind = draw(st.sampled_from(["u32", "i64", "byte", "span"]))
    if kind == "u32":
        pos = draw(st.sampled_from([0, 4, 8, 12]))
        struct.pack_into("<I", frame, pos, draw(st.one_of(u32, st.integers(0, 64))))
    elif kind == "i64" and len(frame) >= 32:
        pos = draw(st.sampled_from([p for p in (16, 24, 32, 40, 48) if p + 8 <= len(frame)]))
        value = draw(st.one_of(i64, st.integers(-2, 40), st.sampled_from([2**20, 2**20 + 1])))
        struct.pack_into("<q", frame, pos, value)
    elif kind == "byte":
        frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
    else:
        start = draw(st.integers(0, len(frame) - 1))
        junk = draw(st.binary(min_size=1, max_size=16))
        frame[start : start + len(junk)] = junk
    return bytes(frame)


any_bytes = st.one_of(st.binary(max_size=200), header_shaped(), truncated(), field_mutated(), valid_frames)

# -------------------------------------------------------------------- checks


def _plain(value):
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, tuple):
        return type(value)(*map(_plain, value)) if hasattr(value, "_fields") else tuple(map(_plain, value))
    return value


def _outcome(decode, buf):
    try:
        result = decode(buf)
    except FrameError as exc:
        # The built-in parsers name their faults; the catch-all is for registered parsers.
        assert exc.fault is not wire.Fault.PAYLOAD_INVALID, str(exc)
        return ("error", type(exc), exc.fault, str(exc), exc.request_id, exc.ptp_timestamp)
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{decode.__name__} raised {type(exc).__name__}: {exc!r} on {bytes(buf).hex()}")
    assert result.nbytes <= len(buf)
    return ("ok", _plain(result))


def _check(data: bytes) -> None:
    for decode in (wire.decode_request, wire.decode_response):
        reference = _outcome(decode, data)
        for sentinel in SENTINELS:
            big = bytearray(data + sentinel * 64)
            assert _outcome(decode, memoryview(big)[: len(data)]) == reference
        if reference[0] == "ok":
            # Bytes past the frame (within the buffer) never change the decoded frame.
            frame_len = reference[1].nbytes
            for sentinel in SENTINELS:
                assert _outcome(decode, data[:frame_len] + sentinel * 8) == reference


def _reencode(req: wire.Request) -> bytes:
    buf = bytearray(req.nbytes)
    p = req.payload
    if req.function == "enqueue_syndromes":
        wire.encode_enqueue_syndromes_into(
            buf, request_id=req.request_id, decoder_id=p.decoder_id, counter=p.counter,
            syndrome_mapping_id=p.syndrome_mapping_id, syndromes_bits_packed=p.syndromes_bits_packed,
            num_syndromes=p.num_syndromes, ptp_timestamp=req.ptp_timestamp,
        )
    elif req.function == "get_corrections":
        wire.encode_get_corrections_into(
            buf, request_id=req.request_id, decoder_id=p.decoder_id, return_size=p.return_size,
            reset=p.reset, ptp_timestamp=req.ptp_timestamp,
        )
    else:
        wire.encode_reset_decoder_into(
            buf, request_id=req.request_id, decoder_id=p.decoder_id, ptp_timestamp=req.ptp_timestamp
        )
    return bytes(buf)


# --------------------------------------------------------------------- tests


@FUZZ
@given(any_bytes)
def test_decoders_raise_only_frame_errors_and_read_only_the_frame(data):
    _check(data)


@FUZZ
@given(truncated())
def test_truncated_frames_are_refused(data):
    for decode in (wire.decode_request, wire.decode_response):
        try:
            decode(data)
        except FrameError as exc:
            assert exc.fault in (wire.Fault.SHORT_BUFFER, wire.Fault.LENGTH_PAST_END, wire.Fault.BAD_MAGIC)
        else:  # a truncated frame of the other kind never decodes either
            pytest.fail(f"{decode.__name__} accepted a truncated frame {data.hex()}")


@FUZZ
@given(field_mutated())
def test_accepted_requests_re_encode_to_the_same_bytes(data):
    try:
        req = wire.decode_request(data)
    except FrameError:
        return
    expected = bytearray(data[: req.nbytes])
    if req.function == "enqueue_syndromes" and req.payload.num_syndromes % 8:
        expected[-1] &= (1 << (req.payload.num_syndromes % 8)) - 1  # pad bits are not data
    assert _reencode(req) == bytes(expected)


@FUZZ
@given(valid_requests)
def test_valid_requests_decode(data):
    req = wire.decode_request(data)
    assert req.nbytes == len(data) and _reencode(req) == data
    if req.function == "enqueue_syndromes":
        bits = req.payload.syndromes()
        np.testing.assert_array_equal(wire.pack_bits(bits), np.frombuffer(data, np.uint8, offset=56))


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(max_examples=100_000, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(any_bytes)
def test_decoders_fuzz_long(data):
    _check(data)
