"""qlink.wire: golden bytes against the published CUDA-Q realtime layout, round trips,
and every validation fault."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from qlink import wire
from qlink.errors import WireError
from qlink.wire import Fault, FrameError, Status

# The published layout, written out independently of qlink.wire's own Structs.
REQ_HDR = "<IIIIQ"  # magic, function_id, arg_len, request_id, ptp_timestamp
RESP_HDR = "<IiIIQ"  # magic, status, result_len, request_id, ptp_timestamp
CUQR, CUQS = 0x43555152, 0x43555153


def _req(function_id, payload, request_id=0, ptp=0, magic=CUQR, arg_len=None):
    n = len(payload) if arg_len is None else arg_len
    return struct.pack(REQ_HDR, magic, function_id, n, request_id, ptp) + payload


def _enqueue_payload(decoder_id=0, counter=0, mapping=0, num=8, packed=None):
    if packed is None:
        packed = bytes((num + 7) // 8)
    return struct.pack("<qqqq", decoder_id, counter, mapping, num) + packed


def _expect_fault(buf, fault, decode=wire.decode_request, **kw):
    with pytest.raises(FrameError) as info:
        decode(buf, **kw)
    assert info.value.fault is fault, str(info.value)
    assert isinstance(info.value, WireError) and isinstance(info.value, ValueError)
    return info.value


# ----------------------------------------------------------------- constants


def test_header_sizes_and_magics_match_published_layout():
    assert struct.calcsize(REQ_HDR) == struct.calcsize(RESP_HDR) == wire.HEADER_NBYTES == 24
    assert wire.REQUEST_MAGIC == CUQR and wire.RESPONSE_MAGIC == CUQS
    # The magics spell CUQR / CUQS when the u32 is read most-significant byte first.
    assert struct.pack(">I", wire.REQUEST_MAGIC) == b"CUQR"
    assert struct.pack(">I", wire.RESPONSE_MAGIC) == b"CUQS"
    assert wire.MAX_SYNDROME_BITS == 2**20 and wire.MAX_DECODERS == 32
    assert (wire.ENQUEUE_SYNDROMES_FIXED_NBYTES, wire.GET_CORRECTIONS_PAYLOAD_NBYTES,
            wire.RESET_DECODER_PAYLOAD_NBYTES) == (32, 17, 8)


@pytest.mark.parametrize(
    "name, expected",
    [("enqueue_syndromes", 0x7ED8BE82), ("get_corrections", 0x882D5BA1), ("reset_decoder", 0x977A59CF)],
)
def test_function_ids_are_fnv1a_of_bare_callee_names(name, expected):
    assert wire.fnv1a_32(name) == expected
    assert wire.fnv1a_32(name.encode()) == expected
    assert wire.function_id_for(name) == expected
    assert wire.REGISTRY.get(expected).name == name


def test_fnv1a_reference_vectors():
    # Published FNV-1a 32 test vectors.
    assert wire.fnv1a_32(b"") == 0x811C9DC5
    assert wire.fnv1a_32(b"a") == 0xE40C292C
    assert wire.fnv1a_32(b"foobar") == 0xBF9CF968


def test_status_values():
    assert [(s.name, int(s)) for s in Status] == [
        ("OK", 0), ("INVALID_DECODER", 1), ("BAD_REQUEST", 2), ("INTERNAL_ERROR", 3),
        ("NOT_READY", 4), ("BUSY", 5), ("SYNDROMES_DROPPED", 6),
    ]


def test_function_id_for_refuses_non_ascii_and_empty():
    for bad in ("", "décodeur", "a\0b"):
        with pytest.raises(ValueError, match="ASCII"):
            wire.function_id_for(bad)


# -------------------------------------------------------------- golden bytes


def test_golden_enqueue_syndromes():
    bits = np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1], dtype=np.uint8)  # 11 bits -> 2 bytes
    packed = bytes([0b01011001, 0b00000110])
    expected = _req(
        0x7ED8BE82, struct.pack("<qqqq", 5, 17, -3, 11) + packed, request_id=0xDEADBEEF,
        ptp=0x0123456789ABCDEF,
    )
    assert len(expected) == 24 + 32 + 2
    buf = bytearray(100)
    n = wire.encode_enqueue_syndromes_into(
        buf, request_id=0xDEADBEEF, decoder_id=5, counter=17, syndrome_mapping_id=-3,
        syndromes=bits, ptp_timestamp=0x0123456789ABCDEF,
    )
    assert n == len(expected) == wire.enqueue_syndromes_nbytes(11)
    assert bytes(buf[:n]) == expected
    # The same frame from pre-packed bits (pad bits are cleared by the encoder).
    buf2 = bytearray(n)
    wire.encode_enqueue_syndromes_into(
        buf2, request_id=0xDEADBEEF, decoder_id=5, counter=17, syndrome_mapping_id=-3,
        syndromes_bits_packed=bytes([0b01011001, 0b11111110]), num_syndromes=11,
        ptp_timestamp=0x0123456789ABCDEF,
    )
    assert bytes(buf2) == expected


def test_golden_get_corrections():
    expected = _req(0x882D5BA1, struct.pack("<qqB", 31, 100, 1), request_id=9, ptp=12345)
    assert len(expected) == 24 + 17
    buf = bytearray(41)
    n = wire.encode_get_corrections_into(
        buf, request_id=9, decoder_id=31, return_size=100, reset=True, ptp_timestamp=12345
    )
    assert n == 41 and bytes(buf) == expected


def test_golden_reset_decoder():
    expected = _req(0x977A59CF, struct.pack("<q", 2), request_id=1, ptp=0)
    assert len(expected) == 24 + 8
    buf = bytearray(32)
    assert wire.encode_reset_decoder_into(buf, request_id=1, decoder_id=2) == 32
    assert bytes(buf) == expected


def test_golden_responses():
    expected = struct.pack(RESP_HDR, CUQS, 0, 2, 77, 999) + bytes([0b00000101, 0b1])
    buf = bytearray(26)
    n = wire.encode_corrections_response_into(
        buf, request_id=77, ptp_timestamp=999, corrections=[1, 0, 1, 0, 0, 0, 0, 0, 1]
    )
    assert n == 26 == wire.corrections_nbytes(9) and bytes(buf) == expected

    expected = struct.pack(RESP_HDR, CUQS, 2, 0, 4, 5)
    buf = bytearray(24)
    assert wire.encode_response_into(buf, status=Status.BAD_REQUEST, request_id=4, ptp_timestamp=5) == 24
    assert bytes(buf) == expected

    expected = struct.pack(RESP_HDR, CUQS, -1, 3, 4, 5) + b"abc"
    buf = bytearray(27)
    assert wire.encode_response_into(buf, status=-1, request_id=4, ptp_timestamp=5, result=b"abc") == 27
    assert bytes(buf) == expected


# The same frames as literal bytes, written out by hand from the published layout (all
# fields little-endian), so that a field-order mistake shared by the test's struct formats
# and the encoder cannot pass unseen.
GOLDEN_HEX = {
    "enqueue_syndromes": (
        "52515543" "82bed87e" "22000000" "efbeadde" "efcdab8967452301"  # CUQR, fid, arg_len 34, rid, ptp
        "0500000000000000" "1100000000000000" "fdffffffffffffff" "0b00000000000000"  # dec 5, ctr 17, map -3, 11 bits
        "5906"),  # bits 1,0,0,1,1,0,1,0 | 0,1,1 packed LSB first
    "get_corrections": (
        "52515543" "a15b2d88" "11000000" "09000000" "3930000000000000"
        "1f00000000000000" "6400000000000000" "01"),  # decoder 31, return_size 100, reset
    "reset_decoder": "52515543" "cf597a97" "08000000" "01000000" "0000000000000000" "0200000000000000",
    "corrections_response": "53515543" "00000000" "02000000" "4d000000" "e703000000000000" "0501",
    "bad_request_response": "53515543" "02000000" "00000000" "04000000" "0500000000000000",
}


def test_golden_literal_bytes():
    bits = np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1], dtype=np.uint8)
    got = {}
    buf = bytearray(64)
    n = wire.encode_enqueue_syndromes_into(buf, request_id=0xDEADBEEF, decoder_id=5, counter=17,
                                           syndrome_mapping_id=-3, syndromes=bits, ptp_timestamp=0x0123456789ABCDEF)
    got["enqueue_syndromes"] = bytes(buf[:n])
    n = wire.encode_get_corrections_into(buf, request_id=9, decoder_id=31, return_size=100, reset=True,
                                         ptp_timestamp=12345)
    got["get_corrections"] = bytes(buf[:n])
    n = wire.encode_reset_decoder_into(buf, request_id=1, decoder_id=2)
    got["reset_decoder"] = bytes(buf[:n])
    n = wire.encode_corrections_response_into(buf, request_id=77, ptp_timestamp=999,
                                              corrections=[1, 0, 1, 0, 0, 0, 0, 0, 1])
    got["corrections_response"] = bytes(buf[:n])
    n = wire.encode_response_into(buf, status=Status.BAD_REQUEST, request_id=4, ptp_timestamp=5)
    got["bad_request_response"] = bytes(buf[:n])
    assert {k: v.hex() for k, v in got.items()} == GOLDEN_HEX
    # and each decodes back to the fields it was built from
    req = wire.decode_request(bytes.fromhex(GOLDEN_HEX["enqueue_syndromes"]))
    assert (req.request_id, req.ptp_timestamp) == (0xDEADBEEF, 0x0123456789ABCDEF)


def test_encode_at_offset_touches_only_its_bytes():
    buf = bytearray(b"\xAA" * 80)
    n = wire.encode_reset_decoder_into(buf, request_id=3, decoder_id=1, offset=10)
    assert buf[:10] == b"\xAA" * 10 and buf[10 + n:] == b"\xAA" * (80 - 10 - n)
    assert wire.decode_request(memoryview(buf)[10:]).payload == wire.ResetDecoder(1)


def test_encode_into_numpy_buffer():
    buf = np.zeros(64, dtype=np.uint8)
    n = wire.encode_enqueue_syndromes_into(
        buf, request_id=1, decoder_id=0, counter=0, syndrome_mapping_id=0,
        syndromes=np.ones(9, dtype=bool),
    )
    assert buf[56:58].tolist() == [0xFF, 0x01] and n == 58


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("num", [1, 7, 8, 9, 64, 1000, 2**20])
def test_enqueue_round_trip(num):
    rng = np.random.default_rng(num)
    bits = rng.integers(0, 2, num, dtype=np.uint8)
    buf = bytearray(wire.enqueue_syndromes_nbytes(num) + 5)
    n = wire.encode_enqueue_syndromes_into(
        buf, request_id=num, decoder_id=31, counter=2**62, syndrome_mapping_id=-(2**63),
        syndromes=bits, ptp_timestamp=2**64 - 1,
    )
    req = wire.decode_request(buf)
    assert req.function == "enqueue_syndromes" and req.function_id == wire.ENQUEUE_SYNDROMES
    assert (req.request_id, req.ptp_timestamp, req.nbytes, req.arg_len) == (num, 2**64 - 1, n, n - 24)
    p = req.payload
    assert (p.decoder_id, p.counter, p.syndrome_mapping_id, p.num_syndromes) == (31, 2**62, -(2**63), num)
    assert isinstance(p.syndromes_bits_packed, memoryview)
    np.testing.assert_array_equal(p.syndromes(), bits)
    out = np.empty(num, dtype=np.uint8)
    assert p.syndromes(out=out) is out
    np.testing.assert_array_equal(out, bits)


def test_decoded_bits_are_a_view_into_the_buffer():
    buf = bytearray(64)
    wire.encode_enqueue_syndromes_into(
        buf, request_id=0, decoder_id=0, counter=0, syndrome_mapping_id=0, syndromes=[0] * 8
    )
    req = wire.decode_request(buf)
    buf[56] = 0x80
    assert req.payload.syndromes().tolist() == [0] * 7 + [1]


def test_get_corrections_and_reset_round_trip():
    buf = bytearray(64)
    for reset in (False, True):
        wire.encode_get_corrections_into(buf, request_id=5, decoder_id=7, return_size=0, reset=reset)
        assert wire.decode_request(buf).payload == wire.GetCorrections(7, 0, reset)
    wire.encode_reset_decoder_into(buf, request_id=6, decoder_id=0, ptp_timestamp=3)
    req = wire.decode_request(buf)
    assert (req.function, req.request_id, req.ptp_timestamp, req.payload) == (
        "reset_decoder", 6, 3, wire.ResetDecoder(0))


def test_response_round_trip_and_unknown_status_stays_int():
    buf = bytearray(40)
    n = wire.encode_response_into(buf, status=Status.BUSY, request_id=2**32 - 1, ptp_timestamp=8, result=b"xyz")
    resp = wire.decode_response(buf)
    assert resp.status is Status.BUSY and resp.nbytes == n
    assert (resp.result_len, resp.request_id, resp.ptp_timestamp, bytes(resp.result)) == (3, 2**32 - 1, 8, b"xyz")
    wire.encode_response_into(buf, status=-1, request_id=1)
    resp = wire.decode_response(buf)
    assert resp.status == -1 and not isinstance(resp.status, Status)


def test_corrections_response_from_packed_bits():
    buf = bytearray(30)
    n = wire.encode_corrections_response_into(
        buf, request_id=1, corrections_bits_packed=b"\x03\x00", num_corrections=10
    )
    resp = wire.decode_response(buf[:n])
    assert wire.unpack_bits(resp.result, 10).tolist() == [1, 1] + [0] * 8
    with pytest.raises(ValueError, match="needs exactly 1"):
        wire.encode_corrections_response_into(
            buf, request_id=1, corrections_bits_packed=b"\x03\x00", num_corrections=3
        )


def test_frame_nbytes_reads_both_kinds():
    buf = bytearray(64)
    n = wire.encode_get_corrections_into(buf, request_id=1, decoder_id=0, return_size=1)
    assert wire.frame_nbytes(buf) == n
    n = wire.encode_response_into(buf, status=0, request_id=1, result=b"12345")
    assert wire.frame_nbytes(buf) == n
    _expect_fault(b"\0" * 23, Fault.SHORT_BUFFER, decode=wire.frame_nbytes)
    _expect_fault(b"\0" * 24, Fault.BAD_MAGIC, decode=wire.frame_nbytes)


# ------------------------------------------------------------- validation


def test_short_buffer():
    for n in (0, 1, 23):
        err = _expect_fault(_req(wire.RESET_DECODER, struct.pack("<q", 0))[:n], Fault.SHORT_BUFFER)
        assert "24" in str(err) and err.request_id is None
        _expect_fault(b"\0" * n, Fault.SHORT_BUFFER, decode=wire.decode_response)


def test_bad_magic_names_seen_and_expected():
    err = _expect_fault(_req(wire.RESET_DECODER, struct.pack("<q", 0), magic=0x41424344), Fault.BAD_MAGIC)
    assert "0x41424344" in str(err) and "'ABCD'" in str(err) and "0x43555152" in str(err)
    err = _expect_fault(_req(wire.RESET_DECODER, struct.pack("<q", 0), magic=CUQS), Fault.BAD_MAGIC)
    assert "decode_response" in str(err)
    err = _expect_fault(_req(0, b"", magic=CUQR), Fault.BAD_MAGIC, decode=wire.decode_response)
    assert "0x43555153" in str(err) and "decode_request" in str(err)


def test_length_past_end():
    frame = _req(wire.RESET_DECODER, struct.pack("<q", 0), request_id=42, ptp=7)
    err = _expect_fault(frame[:-1], Fault.LENGTH_PAST_END)
    assert (err.request_id, err.ptp_timestamp, err.function_id) == (42, 7, wire.RESET_DECODER)
    _expect_fault(_req(wire.RESET_DECODER, b"", arg_len=2**32 - 1), Fault.LENGTH_PAST_END)
    resp = struct.pack(RESP_HDR, CUQS, 0, 5, 9, 0) + b"1234"
    err = _expect_fault(resp, Fault.LENGTH_PAST_END, decode=wire.decode_response)
    assert err.request_id == 9


def test_bytes_after_the_frame_are_ignored():
    frame = _req(wire.RESET_DECODER, struct.pack("<q", 4))
    req = wire.decode_request(frame + b"\xFF" * 50)
    assert req.payload.decoder_id == 4 and req.nbytes == len(frame)
    resp = wire.decode_response(struct.pack(RESP_HDR, CUQS, 0, 1, 0, 0) + b"AB")
    assert bytes(resp.result) == b"A" and resp.nbytes == 25


def test_unknown_function_is_distinct_and_answerable():
    err = _expect_fault(_req(0x12345678, b"", request_id=3, ptp=4), Fault.UNKNOWN_FUNCTION)
    assert isinstance(err, wire.UnknownFunctionError)
    assert "0x12345678" in str(err)
    assert (err.request_id, err.ptp_timestamp, err.function_id) == (3, 4, 0x12345678)
    assert err.fault.status is Status.BAD_REQUEST


@pytest.mark.parametrize(
    "function_id, payload",
    [
        (wire.GET_CORRECTIONS, struct.pack("<qqB", 0, 1, 0) + b"\0"),  # 18 bytes, one too many
        (wire.GET_CORRECTIONS, struct.pack("<qq", 0, 1)),  # 16 bytes
        (wire.RESET_DECODER, struct.pack("<q", 0) + b"\0"),
        (wire.RESET_DECODER, b"\0" * 7),
        (wire.RESET_DECODER, b""),
        (wire.ENQUEUE_SYNDROMES, b"\0" * 31),
        (wire.ENQUEUE_SYNDROMES, b"\0" * (32 + 2**17 + 1)),
    ],
)
def test_payload_size_wrong_for_function(function_id, payload):
    err = _expect_fault(_req(function_id, payload), Fault.PAYLOAD_SIZE)
    assert str(len(payload)) in str(err)


@pytest.mark.parametrize("num", [0, -1, -(2**63), 2**20 + 1, 2**62])
def test_num_syndromes_out_of_range(num):
    err = _expect_fault(_req(wire.ENQUEUE_SYNDROMES, _enqueue_payload(num=num, packed=b"\0")), Fault.NUM_SYNDROMES)
    assert str(num) in str(err)


def test_num_syndromes_at_the_cap_is_accepted():
    frame = _req(wire.ENQUEUE_SYNDROMES, _enqueue_payload(num=2**20))
    assert wire.decode_request(frame).payload.num_syndromes == 2**20


@pytest.mark.parametrize("num, packed_nbytes", [(8, 0), (8, 2), (9, 1), (1, 2), (16, 1)])
def test_packed_length_mismatch(num, packed_nbytes):
    frame = _req(wire.ENQUEUE_SYNDROMES, _enqueue_payload(num=num, packed=b"\0" * packed_nbytes))
    err = _expect_fault(frame, Fault.PACKED_LENGTH)
    assert f"needs exactly {(num + 7) // 8}" in str(err)


@pytest.mark.parametrize("decoder_id", [-1, 32, 2**40, -(2**63)])
def test_decoder_id_out_of_range_in_every_call(decoder_id):
    for frame in (
        _req(wire.ENQUEUE_SYNDROMES, _enqueue_payload(decoder_id=decoder_id)),
        _req(wire.GET_CORRECTIONS, struct.pack("<qqB", decoder_id, 1, 0)),
        _req(wire.RESET_DECODER, struct.pack("<q", decoder_id)),
    ):
        err = _expect_fault(frame, Fault.DECODER_ID)
        assert err.fault.status is Status.INVALID_DECODER and "[0, 32)" in str(err)


def test_negative_counter():
    _expect_fault(_req(wire.ENQUEUE_SYNDROMES, _enqueue_payload(counter=-5)), Fault.COUNTER)


@pytest.mark.parametrize("return_size", [-1, 2**20 + 1])
def test_return_size_out_of_range(return_size):
    _expect_fault(_req(wire.GET_CORRECTIONS, struct.pack("<qqB", 0, return_size, 0)), Fault.RETURN_SIZE)


@pytest.mark.parametrize("reset", [2, 0xFF])
def test_reset_byte_must_be_0_or_1(reset):
    err = _expect_fault(_req(wire.GET_CORRECTIONS, struct.pack("<qqB", 0, 1, reset)), Fault.RESET_FLAG)
    assert str(reset) in str(err)


def test_fault_statuses():
    for fault in Fault:
        expected = Status.INVALID_DECODER if fault is Fault.DECODER_ID else Status.BAD_REQUEST
        assert fault.status is expected


# ----------------------------------------------------------------- registry


def test_other_traffic_through_a_registry():
    reg = wire.REGISTRY.copy()
    kv = struct.Struct("<QQ")
    spec = reg.register("kv_write_done", payload_nbytes=kv.size, parse=lambda mv: kv.unpack_from(mv))
    raw = reg.register("control_blob", max_payload_nbytes=16)
    assert spec.function_id == wire.fnv1a_32("kv_write_done") and spec.function_id not in wire.REGISTRY

    buf = bytearray(64)
    n = wire.encode_request_into(buf, function_id=spec.function_id, request_id=1, payload=kv.pack(3, 4096))
    req = wire.decode_request(buf[:n], registry=reg)
    assert (req.function, req.payload) == ("kv_write_done", (3, 4096))
    with pytest.raises(wire.UnknownFunctionError):
        wire.decode_request(buf[:n])  # the default registry does not know it

    n = wire.encode_request_into(buf, function_id=raw.function_id, request_id=2, payload=b"hello")
    req = wire.decode_request(buf[:n], registry=reg)
    assert isinstance(req.payload, memoryview) and bytes(req.payload) == b"hello"
    n = wire.encode_request_into(buf, function_id=raw.function_id, request_id=2, payload=b"x" * 17)
    _expect_fault(buf[:n], Fault.PAYLOAD_SIZE, registry=reg)
    # The built-in calls still decode through the copied registry.
    n = wire.encode_reset_decoder_into(buf, request_id=1, decoder_id=1)
    assert wire.decode_request(buf[:n], registry=reg).function == "reset_decoder"


def test_registered_parser_errors_become_frame_errors():
    reg = wire.FunctionRegistry()

    def parse(mv):
        if mv[0] != 1:
            raise ValueError("first byte must be 1")
        return int(mv[0])

    spec = reg.register("strict", payload_nbytes=1, parse=parse)
    buf = bytearray(25)
    wire.encode_request_into(buf, function_id=spec.function_id, request_id=8, payload=b"\x02")
    err = _expect_fault(buf, Fault.PAYLOAD_INVALID, registry=reg)
    assert "first byte must be 1" in str(err) and err.request_id == 8


def test_registry_refuses_conflicts():
    reg = wire.FunctionRegistry()
    reg.register("a", payload_nbytes=4)
    reg.register("a", payload_nbytes=4)  # identical: fine
    with pytest.raises(ValueError, match="different options"):
        reg.register("a", payload_nbytes=5)
    with pytest.raises(ValueError, match="0 <= min <= max"):
        reg.register("b", min_payload_nbytes=5, max_payload_nbytes=4)
    with pytest.raises(ValueError, match="FNV-1a of the name"):
        reg.add(wire.FunctionSpec("c", 123))
    # A genuine 32-bit FNV-1a collision: distinct names, same id.
    assert wire.fnv1a_32("costarring") == wire.fnv1a_32("liquid")
    reg.register("costarring")
    with pytest.raises(ValueError, match="collides with 'costarring'"):
        reg.register("liquid")
    assert len(reg) == 2 and {s.name for s in reg} == {"a", "costarring"}


# ------------------------------------------------------------ encoder checks


def test_encoder_argument_errors():
    buf = bytearray(100)
    common = dict(request_id=0, decoder_id=0, counter=0, syndrome_mapping_id=0)
    with pytest.raises(ValueError, match="exactly one"):
        wire.encode_enqueue_syndromes_into(buf, **common)
    with pytest.raises(ValueError, match="num_syndromes"):
        wire.encode_enqueue_syndromes_into(buf, **common, syndromes=[])
    with pytest.raises(ValueError, match="num_syndromes=5 but 3"):
        wire.encode_enqueue_syndromes_into(buf, **common, syndromes=[1, 1, 1], num_syndromes=5)
    with pytest.raises(ValueError, match="needs num_syndromes"):
        wire.encode_enqueue_syndromes_into(buf, **common, syndromes_bits_packed=b"\0")
    with pytest.raises(ValueError, match="needs exactly 2"):
        wire.encode_enqueue_syndromes_into(buf, **common, syndromes_bits_packed=b"\0", num_syndromes=9)
    with pytest.raises(ValueError, match="decoder_id"):
        wire.encode_reset_decoder_into(buf, request_id=0, decoder_id=32)
    with pytest.raises(ValueError, match="request_id"):
        wire.encode_reset_decoder_into(buf, request_id=2**32, decoder_id=0)
    with pytest.raises(ValueError, match="counter"):
        wire.encode_enqueue_syndromes_into(buf, **{**common, "counter": -1}, syndromes=[1])
    with pytest.raises(ValueError, match="return_size"):
        wire.encode_get_corrections_into(buf, request_id=0, decoder_id=0, return_size=-1)
    with pytest.raises(ValueError, match="buffer too small: the frame needs 41 bytes"):
        wire.encode_get_corrections_into(bytearray(40), request_id=0, decoder_id=0, return_size=1)
    with pytest.raises(ValueError, match="offset"):
        wire.encode_reset_decoder_into(buf, request_id=0, decoder_id=0, offset=-1)
    with pytest.raises(ValueError, match="buffer too small"):
        wire.encode_reset_decoder_into(buf, request_id=0, decoder_id=0, offset=69)


def test_failed_encode_leaves_buffer_untouched():
    buf = bytearray(b"\x11" * 64)
    with pytest.raises(ValueError):
        wire.encode_enqueue_syndromes_into(
            buf, request_id=0, decoder_id=99, counter=0, syndrome_mapping_id=0, syndromes=[1] * 9
        )
    assert buf == bytearray(b"\x11" * 64)


# ---------------------------------------------------------------------- bits


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 1001])
def test_pack_unpack_bits_match_numpy_little_bitorder(n):
    bits = np.random.default_rng(n).integers(0, 2, n, dtype=np.uint8)
    packed = wire.pack_bits(bits)
    np.testing.assert_array_equal(packed, np.packbits(bits, bitorder="little"))
    for i in range(n):  # the LSB-first definition, bit by bit
        assert (packed[i // 8] >> (i % 8)) & 1 == bits[i]
    np.testing.assert_array_equal(wire.unpack_bits(packed, n), bits)
    out = np.full(len(packed), 0xFF, dtype=np.uint8)
    wire.pack_bits(bits.astype(bool), out=out)
    np.testing.assert_array_equal(out, packed)  # pad bits cleared
    out = np.empty(n, dtype=np.uint8)
    assert wire.unpack_bits(bytes(packed), n, out=out) is out
    np.testing.assert_array_equal(out, bits)


def test_bits_helpers_validate():
    with pytest.raises(ValueError, match="nbits"):
        wire.unpack_bits(b"\0", 9)
    with pytest.raises(ValueError, match="1-D"):
        wire.pack_bits(np.zeros((2, 8)))
    with pytest.raises(ValueError, match="shape"):
        wire.pack_bits([1] * 9, out=np.empty(1, np.uint8))
    with pytest.raises(ValueError, match="shape"):
        wire.unpack_bits(b"\0", 3, out=np.empty(4, np.uint8))


def test_packed_encode_allocates_no_frame_sized_memory():
    """The hot path (pre-packed bits into the caller's buffer) copies straight into the
    frame: encoding a 2^20-bit request 200 times allocates no frame-sized temporary."""
    import tracemalloc

    nbits = wire.MAX_SYNDROME_BITS
    packed = np.random.default_rng(3).integers(0, 256, nbits // 8, dtype=np.uint8)
    buf = bytearray(wire.enqueue_syndromes_nbytes(nbits))
    wire.encode_enqueue_syndromes_into(buf, request_id=0, decoder_id=0, counter=0, syndrome_mapping_id=0,
                                       syndromes_bits_packed=packed, num_syndromes=nbits)  # warm caches
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for i in range(200):
            wire.encode_enqueue_syndromes_into(buf, request_id=i, decoder_id=0, counter=i, syndrome_mapping_id=0,
                                               syndromes_bits_packed=packed, num_syndromes=nbits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < 16 << 10, f"encoding allocated {peak - base} B at its peak (the frame is {len(buf)} B)"
    assert bytes(buf[56:]) == packed.tobytes()
