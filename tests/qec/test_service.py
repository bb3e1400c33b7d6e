"""The decoder service: CUDA-Q realtime RPC semantics, bad input, bounded queue, loss.

Each test sends frames on one side of an ``inproc://`` pair, lets the service handle
exactly those frames (``serve(max_requests=...)``), then reads every answer. Expected
corrections come from the same decoder called directly on the same shots.
"""

from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest
import stim

import transports
from qlink import wire
from qlink.errors import WouldBlock
from qlink.qec.decoders import compile_decoder
from qlink.qec.service import DecoderConfig, DecoderService
from qlink.wire import Status

pytestmark = pytest.mark.timeout(60)

_names = itertools.count()


def _circuit(distance=3, rounds=3, p=0.01):
    return stim.Circuit.generated("surface_code:rotated_memory_z", distance=distance, rounds=rounds,
                                  after_clifford_depolarization=p, before_measure_flip_probability=p,
                                  after_reset_flip_probability=p, before_round_data_depolarization=p)


@pytest.fixture(scope="module")
def code():
    circuit = _circuit()
    dem = circuit.detector_error_model(decompose_errors=True)
    dets, obs = circuit.compile_detector_sampler(seed=3).sample(64, separate_observables=True)
    expected = compile_decoder("pymatching", dem).decode_batch(dets)
    assert expected.any(), "the sample should exercise non-trivial corrections"
    return dem, dets.astype(np.uint8), expected


class Pair:
    """A service and a client endpoint, connected over inproc."""

    def __init__(self, service):
        self.service = service
        name = f"inproc://test-service-{next(_names)}"
        self.listener = transports.listen(name)
        self.client = transports.connect(name)
        self.server = self.listener.accept(timeout_s=5)
        self.buf = bytearray(1 << 18)
        self.rid = 0
        self.sent = 0

    def close(self):
        self.client.close()
        self.server.close()
        self.listener.close()

    # ---- frames
    def _send(self, n):
        self.client.send(self.buf[:n])
        self.sent += 1
        return self.rid

    def next_rid(self):
        self.rid += 1
        return self.rid

    def enqueue(self, bits, *, counter, decoder_id=0, mapping=0):
        n = wire.encode_enqueue_syndromes_into(self.buf, request_id=self.next_rid(), decoder_id=decoder_id,
                                               counter=counter, syndrome_mapping_id=mapping, syndromes=bits)
        return self._send(n)

    def get(self, *, decoder_id=0, return_size=1, reset=True, ptp=0):
        n = wire.encode_get_corrections_into(self.buf, request_id=self.next_rid(), decoder_id=decoder_id,
                                             return_size=return_size, reset=reset, ptp_timestamp=ptp)
        return self._send(n)

    def reset(self, *, decoder_id=0):
        n = wire.encode_reset_decoder_into(self.buf, request_id=self.next_rid(), decoder_id=decoder_id)
        return self._send(n)

    def raw(self, data):
        self.client.send(data)
        self.sent += 1

    # ---- answers
    def run(self):
        """Serve exactly the frames sent so far; return every answer as (status, request_id, ptp, result)."""
        if self.sent:
            self.service.serve(self.server, max_requests=self.sent, timeout_s=10)
        self.sent = 0
        out = []
        rx = bytearray(1 << 16)
        while True:
            try:
                n = self.client.recv_into_nowait(rx)
            except WouldBlock:
                return out
            r = wire.decode_response(rx[:n])
            out.append((r.status, r.request_id, r.ptp_timestamp, bytes(r.result)))


@pytest.fixture
def pair(code):
    dem = code[0]
    p = Pair(DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem)}))
    yield p
    p.close()


def _flip(result, num_obs=1):
    return np.unpackbits(np.frombuffer(result, np.uint8), bitorder="little")[:num_obs].tolist()


def _answers_by_rid(answers):
    return {rid: (st, res) for st, rid, _, res in answers}


def test_shots_in_round_frames_decode_bit_identically(pair, code):
    dem, dets, expected = code
    rounds = np.array([int(c[-1]) for c in dem.get_detector_coordinates().values()])
    counter = 0
    gets = []
    for shot in range(len(dets)):
        for r in range(rounds.max() + 1):  # one frame per round, as a controller streams them
            pair.enqueue(dets[shot][rounds == r], counter=counter)
            counter += 1
        gets.append(pair.get())
    answers = _answers_by_rid(pair.run())
    for shot, rid in enumerate(gets):
        status, result = answers[rid]
        assert status == Status.OK
        assert _flip(result) == expected[shot].tolist(), f"shot {shot}"
    counts = pair.service.report()["counts"]
    assert counts["shots_decoded"] == len(dets)
    assert counts["decode_calls"] < len(dets), "shots queued together are decoded in one call"


def test_unaligned_frames_and_whole_shot_windows_give_the_same_bits(pair, code):
    dem, dets, expected = code
    nd = dem.num_detectors
    counter = 0
    gets = []
    for shot in range(8):  # frames of 3, 5, 7 ... bits: never byte-aligned
        bits, start, size = dets[shot], 0, 3
        while start < nd:
            pair.enqueue(bits[start:start + size], counter=counter)
            counter += 1
            start += size
            size += 2
        gets.append(pair.get())
    # four whole shots in one frame (a window of rounds spanning shots)
    pair.enqueue(dets[8:12].reshape(-1), counter=counter)
    gets += [pair.get() for _ in range(4)]
    answers = _answers_by_rid(pair.run())
    for shot, rid in enumerate(gets):
        assert answers[rid][0] == Status.OK
        assert _flip(answers[rid][1]) == expected[shot].tolist(), f"shot {shot}"


def test_shots_that_are_not_whole_bytes_ignore_pad_bits_one_per_frame_or_many():
    circuit = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=5,
                                     before_round_data_depolarization=0.05)
    dem = circuit.detector_error_model(decompose_errors=True)
    nd = dem.num_detectors
    assert nd % 8, "the shot must end inside a byte for this test"
    dets, _ = circuit.compile_detector_sampler(seed=4).sample(40, separate_observables=True)
    dets = dets.astype(np.uint8)
    expected = compile_decoder("pymatching", dem).decode_batch(dets)
    assert expected.any()
    p = Pair(DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem)}))
    try:
        gets = []
        for shot in range(20):  # one shot per frame, the pad bits of its last byte set (garbage)
            n = wire.encode_enqueue_syndromes_into(p.buf, request_id=p.next_rid(), decoder_id=0, counter=shot,
                                                   syndrome_mapping_id=0, syndromes=dets[shot])
            p.buf[n - 1] |= 0xFF ^ ((1 << (nd % 8)) - 1)
            p._send(n)
            gets.append(p.get())
        p.enqueue(dets[20:40].reshape(-1), counter=20)  # twenty shots in one frame, not byte-aligned
        window = p.get(return_size=20)
        answers = _answers_by_rid(p.run())
        for shot, rid in enumerate(gets):
            assert answers[rid][0] == Status.OK and _flip(answers[rid][1]) == expected[shot].tolist(), shot
        status, result = answers[window]
        assert status == Status.OK
        assert _flip(result, 20) == expected[20:40, 0].tolist()
    finally:
        p.close()


def test_request_id_and_ptp_timestamp_are_echoed_and_not_ready_before_a_shot(pair):
    rid = pair.get(ptp=0x0102030405060708)
    assert pair.run() == [(Status.NOT_READY, rid, 0x0102030405060708, b"")]


def test_unknown_decoder_ids_are_invalid_decoder_and_the_service_keeps_serving(pair, code):
    dem, dets, expected = code
    a = pair.enqueue(dets[0], counter=0, decoder_id=5)  # in range, not configured
    b = pair.get(decoder_id=31)
    c = pair.reset(decoder_id=7)
    pair.raw(struct.pack("<IIIIQ", wire.REQUEST_MAGIC, wire.GET_CORRECTIONS, 17, 99, 0)
                 + struct.pack("<qqB", 40, 1, 1))  # decoder_id 40 >= 32
    pair.enqueue(dets[0], counter=0)
    ok = pair.get()
    answers = _answers_by_rid(pair.run())
    for rid in (a, b, c, 99):
        assert answers[rid][0] == Status.INVALID_DECODER
    assert answers[ok] == (Status.OK, bytes([expected[0][0]]))
    faults = pair.service.report()["faults"]
    assert faults["decoder_not_configured"] == 3 and faults["decoder_id"] == 1


def test_wrong_syndrome_count_is_bad_request_and_changes_nothing(pair, code):
    dem, dets, expected = code
    nd = dem.num_detectors
    bad = pair.enqueue(np.zeros(nd + 3, np.uint8), counter=0)  # more bits than a shot
    pair.enqueue(dets[1][:10], counter=0)  # the same counter again: the refused frame consumed nothing
    bad2 = pair.enqueue(dets[1][:nd], counter=1)  # overflows the shot in progress
    pair.enqueue(dets[1][10:], counter=1)
    ok = pair.get()
    answers = _answers_by_rid(pair.run())
    assert answers[bad][0] == Status.BAD_REQUEST and answers[bad2][0] == Status.BAD_REQUEST
    assert answers[ok] == (Status.OK, bytes([expected[1][0]]))
    assert pair.service.report()["faults"]["syndrome_count"] == 2


def test_too_many_bits_and_corrupt_frames_are_refused_and_counted(pair, code):
    dem, dets, expected = code
    too_many = (1 << 20) + 1
    pair.raw(struct.pack("<IIIIQ", wire.REQUEST_MAGIC, wire.ENQUEUE_SYNDROMES, 32 + (too_many + 7) // 8, 10, 0)
             + struct.pack("<qqqq", 0, 0, 0, too_many) + bytes((too_many + 7) // 8))  # all its bits, too many
    pair.raw(struct.pack("<IIIIQ", wire.REQUEST_MAGIC, wire.ENQUEUE_SYNDROMES, 32 + 1, 11, 0)
             + struct.pack("<qqqq", 0, 0, 0, too_many) + b"\x01")  # claims too many bits
    pair.raw(struct.pack("<IIIIQ", wire.REQUEST_MAGIC, wire.RESET_DECODER, 4000, 12, 0) + bytes(8))  # past end
    pair.raw(struct.pack("<IIIIQ", 0xDEADBEEF, wire.RESET_DECODER, 8, 13, 0) + bytes(8))  # bad magic
    pair.raw(b"\x00" * 5)  # shorter than a header
    pair.raw(struct.pack("<IIIIQ", wire.REQUEST_MAGIC, wire.ENQUEUE_SYNDROMES, 32 + 2, 14, 0)
             + struct.pack("<qqqq", 0, 0, 0, 24) + bytes(2))  # 24 bits need 3 packed bytes
    pair.raw(struct.pack("<IIIIQ", wire.REQUEST_MAGIC, wire.fnv1a_32("no_such_call"), 0, 15, 0))
    pair.raw(b"\xff" * (wire.enqueue_syndromes_nbytes(wire.MAX_SYNDROME_BITS) + 100))  # larger than any frame
    mapping = pair.enqueue(dets[2], counter=0, mapping=3)  # only the identity mapping (0) exists
    pair.enqueue(dets[2], counter=0)
    ok = pair.get()
    answers = _answers_by_rid(pair.run())
    for rid in (10, 11, 12, 14, 15, mapping):
        assert answers[rid][0] == Status.BAD_REQUEST, rid
    assert 13 not in answers, "a frame whose header is not ours cannot be answered"
    assert answers[ok] == (Status.OK, bytes([expected[2][0]]))
    rep = pair.service.report()
    expected_faults = {"oversized_frame": 2, "payload_size": 1, "num_syndromes": 1, "length_past_end": 1,
                       "bad_magic": 2, "short_buffer": 1, "packed_length": 1, "unknown_function": 1,
                       "syndrome_mapping_id": 1}
    assert rep["faults"] == expected_faults
    assert rep["counts"]["frames_unanswerable"] == 3  # bad magic, short, oversized garbage


def test_a_message_of_several_whole_frames_is_taken_frame_by_frame(pair, code):
    """A shot's frame and its get in one message (as a udp controller sends them): both
    handled, each answer bit-exact."""
    dem, dets, expected = code
    buf = bytearray(1 << 12)
    for k in range(4):
        n = wire.encode_enqueue_syndromes_into(buf, request_id=100 + k, decoder_id=0, counter=k,
                                               syndrome_mapping_id=0, syndromes=dets[k])
        frame = bytes(buf[:n])
        n = wire.encode_get_corrections_into(buf, request_id=200 + k, decoder_id=0, return_size=1, reset=True)
        pair.raw(frame + bytes(buf[:n]))
    answers = _answers_by_rid(pair.run())
    for k in range(4):
        assert answers[200 + k] == (Status.OK, bytes([expected[k][0]])), k
    rep = pair.service.report()
    assert rep["counts"]["frames_packed"] == 4
    assert rep["counts"]["requests"] == 8


def test_a_counter_gap_drops_exactly_the_shots_it_touched(code):
    dem, dets, expected = code
    rounds = np.array([int(c[-1]) for c in dem.get_detector_coordinates().values()])
    R = rounds.max() + 1
    p = Pair(DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem, frames_per_shot=R)}))
    try:
        lost = {(2, 1), (4, R - 1), (5, 0), (9, 0), (9, 1), (9, 2), (9, 3)}  # shot 9 lost entirely
        counter = 0
        for shot in range(12):
            for r in range(R):
                if (shot, r) not in lost:
                    p.enqueue(dets[shot][rounds == r], counter=counter)
                counter += 1
        gets = [p.get() for _ in range(12)]
        answers = _answers_by_rid(p.run())
        for shot, rid in enumerate(gets):
            status, result = answers[rid]
            if shot in (2, 4, 5, 9):
                assert status == Status.SYNDROMES_DROPPED, f"shot {shot}: {status!r}"
            else:
                assert status == Status.OK, f"shot {shot}: {status!r}"
                assert _flip(result) == expected[shot].tolist(), f"shot {shot}"
        rep = p.service.report()
        assert rep["counts"]["frames_lost"] == len(lost)
        assert rep["counts"]["shots_dropped"] == 4
        assert rep["counts"]["frames_discarded"] == 5  # the frames of shots 2 and 5 after their gaps
    finally:
        p.close()


def test_the_queue_is_bounded_and_busy_shots_are_dropped(code):
    dem, dets, expected = code
    p = Pair(DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem, capacity_shots=2)}))
    try:
        acks = [p.enqueue(dets[s], counter=s) for s in range(3)]  # the third finds the queue full
        gets = [p.get() for _ in range(2)]
        answers = _answers_by_rid(p.run())
        assert [answers[r][0] for r in acks] == [Status.OK, Status.OK, Status.BUSY]
        assert [answers[g] for g in gets] == [(Status.OK, bytes([expected[s][0]])) for s in range(2)]
        p.enqueue(dets[3], counter=3)  # the busy frame used up counter 2: no gap, its shot is dropped
        gets = [p.get() for _ in range(3)]
        answers = _answers_by_rid(p.run())
        assert [answers[g][0] for g in gets] == [Status.SYNDROMES_DROPPED, Status.OK, Status.NOT_READY]
        assert answers[gets[1]][1] == bytes([expected[3][0]])
        assert p.service.report()["faults"]["queue_full"] == 1
    finally:
        p.close()


def test_peek_keeps_the_shot_and_reset_clears_the_decoder(pair, code):
    dem, dets, expected = code
    pair.enqueue(dets[4], counter=0)
    peek = pair.get(reset=False)
    take = pair.get(reset=True)
    pair.enqueue(dets[5][:7], counter=1)  # a partial shot ...
    pair.reset()  # ... forgotten, with the counter
    after = pair.get()
    pair.enqueue(dets[6], counter=0)
    last = pair.get()
    answers = _answers_by_rid(pair.run())
    assert answers[peek] == answers[take] == (Status.OK, bytes([expected[4][0]]))
    assert answers[after][0] == Status.NOT_READY
    assert answers[last] == (Status.OK, bytes([expected[6][0]]))


def test_return_size_beyond_the_queue_is_bad_request(pair):
    rid = pair.get(return_size=1025)  # 1025 shots of one observable; the queue holds 1024
    assert pair.run()[0][:2] == (Status.BAD_REQUEST, rid)


def test_fire_and_forget_enqueue_answers_nothing_but_errors(code):
    dem, dets, expected = code
    for mode, expect in (("none", 1), ("errors", 2)):
        p = Pair(DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem)}, ack_enqueue=mode))
        try:
            p.enqueue(dets[0], counter=0)
            bad = p.enqueue(dets[0], counter=0)  # counter went backwards
            get = p.get()
            answers = p.run()
            assert len(answers) == expect, mode
            assert answers[-1][:2] == (Status.OK, get)
            if mode == "errors":
                assert answers[0][:2] == (Status.BAD_REQUEST, bad)
        finally:
            p.close()


class _Exploding:
    """A compiled decoder that fails, to check the service answers INTERNAL_ERROR and lives on."""

    num_detectors, num_observables = 24, 1

    def decode_shots_bit_packed(self, bit_packed_detection_event_data):
        raise RuntimeError("decoder failure")


def test_a_failing_decoder_is_internal_error_and_other_decoders_still_work(code):
    dem, dets, expected = code
    svc = DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem),
                          1: DecoderConfig(decoder=_Exploding(), num_detectors=24, num_observables=1)})
    p = Pair(svc)
    try:
        p.enqueue(dets[0], counter=0, decoder_id=1)
        g1 = p.get(decoder_id=1)
        p.enqueue(dets[0], counter=0, decoder_id=0)
        g0 = p.get(decoder_id=0)
        answers = _answers_by_rid(p.run())
        assert answers[g1][0] == Status.INTERNAL_ERROR
        assert answers[g0] == (Status.OK, bytes([expected[0][0]]))
        assert svc.report()["faults"]["decoder_exception"] == 1
    finally:
        p.close()


def test_every_stage_is_timed_and_shot_records_are_kept(code):
    dem, dets, expected = code
    p = Pair(DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem)}, keep_samples=3))
    try:
        for s in range(5):
            p.enqueue(dets[s], counter=s)
            p.get(ptp=wire_ptp())
        p.run()
        rep = p.service.report()
        for stage in ("wire_in", "parse", "queue", "decode", "respond", "residence", "shot_service"):
            assert rep["stages"][stage]["count"] > 0, stage
        shots = rep["shots"]
        assert len(shots["out_ns"]) == 3 and rep["shots_not_kept"] == 2
        for i in range(3):
            assert shots["in_last_ns"][i] <= shots["complete_ns"][i] <= shots["decode_start_ns"][i] \
                <= shots["decode_end_ns"][i] <= shots["out_ns"][i]
    finally:
        p.close()


def wire_ptp():
    from qlink.clock import ptp_now_ns

    return ptp_now_ns()


def test_configuration_errors_are_typed_and_say_what_is_right(code):
    dem = code[0]
    with pytest.raises(ValueError, match="decoder ids"):
        DecoderService({32: DecoderConfig(dem=dem)})
    with pytest.raises(ValueError, match="unknown decoder"):
        DecoderService({0: DecoderConfig(decoder="no-such-decoder", dem=dem)})
    with pytest.raises(ValueError, match="ack_enqueue"):
        DecoderService({0: DecoderConfig(dem=dem)}, ack_enqueue="sometimes")
    with pytest.raises(ValueError, match="capacity_shots"):
        DecoderConfig(dem=dem, capacity_shots=0)
    with pytest.raises(ValueError, match="source"):
        DecoderConfig.from_spec({"decoder": "pymatching"})


def test_many_shots_per_frame_and_per_answer(code):
    dem, dets, expected = code
    p = Pair(DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem, capacity_shots=40)}))
    try:
        # 3 frames of 8 whole shots each; then the corrections of 10, 10 and 4 shots in three answers
        for g in range(3):
            p.enqueue(dets[8 * g:8 * g + 8].reshape(-1), counter=g)
        gets = [p.get(return_size=m) for m in (10, 10, 4)]
        answers = _answers_by_rid(p.run())
        got = np.concatenate([_flip(answers[g][1], m) for g, m in zip(gets, (10, 10, 4))])
        assert [answers[g][0] for g in gets] == [Status.OK] * 3
        assert got.tolist() == expected[:24, 0].tolist()
        assert p.service.report()["counts"]["decode_calls"] == 1, "24 shots, one decoder call"
        # not enough complete shots for the window: NOT_READY, nothing consumed
        p.enqueue(dets[24:28].reshape(-1), counter=3)
        g = p.get(return_size=5)
        g2 = p.get(return_size=4)
        answers = _answers_by_rid(p.run())
        assert answers[g][0] == Status.NOT_READY
        assert answers[g2] == (Status.OK, np.packbits(expected[24:28, 0], bitorder="little").tobytes())
        bad = p.get(return_size=1000 * dem.num_observables + 1)
        assert p.run()[0][:2] == (Status.BAD_REQUEST, bad)
    finally:
        p.close()


def test_a_window_with_dropped_shots_answers_their_mask_beside_the_flips(code):
    dem, dets, expected = code
    p = Pair(DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem)}))
    try:
        p.enqueue(dets[0:4].reshape(-1), counter=0)  # shots 0-3
        # the frame with counter 1 (shots 4-7) is lost
        p.enqueue(dets[8:12].reshape(-1), counter=2)  # shots 8-11
        first = p.get(return_size=6)  # shots 0-5: 4 and 5 were dropped
        second = p.get(return_size=6)  # shots 6-11: 6 and 7 were dropped
        answers = _answers_by_rid(p.run())
        for rid, shots, lost in ((first, range(0, 6), {4, 5}), (second, range(6, 12), {6, 7})):
            status, result = answers[rid]
            assert status == Status.SYNDROMES_DROPPED
            flips = np.unpackbits(np.frombuffer(result[:1], np.uint8), bitorder="little")[:6]
            mask = np.unpackbits(np.frombuffer(result[1:2], np.uint8), bitorder="little")[:6]
            assert mask.tolist() == [int(s in lost) for s in shots]
            assert flips.tolist() == [0 if s in lost else int(expected[s, 0]) for s in shots]
        assert len(answers[first][1]) == 2  # ceil(6 flips / 8) + ceil(6 mask bits / 8)
        p.enqueue(dets[12:14].reshape(-1), counter=3)
        ok = p.get(return_size=2)  # no drop left in the window: a plain OK
        answers = _answers_by_rid(p.run())
        assert answers[ok] == (Status.OK, np.packbits(expected[12:14, 0], bitorder="little").tobytes())
    finally:
        p.close()


@pytest.mark.parametrize("seed", range(4))
def test_random_frame_loss_drops_exactly_the_shots_that_lost_a_frame(code, seed):
    dem, _, _ = code
    circuit = _circuit()
    dets, _ = circuit.compile_detector_sampler(seed=seed).sample(300, separate_observables=True)
    dets = dets.astype(np.uint8)
    expected = compile_decoder("pymatching", dem).decode_batch(dets)
    rounds = np.array([int(c[-1]) for c in dem.get_detector_coordinates().values()])
    R = rounds.max() + 1
    p = Pair(DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem, frames_per_shot=R)}, ack_enqueue="none"))
    try:
        rng = np.random.default_rng(seed)
        counter, lost = 0, set()
        for shot in range(300):
            for r in range(R):
                if rng.random() < 0.03:
                    lost.add(shot)  # this frame never arrives; its counter value is used up
                else:
                    p.enqueue(dets[shot][rounds == r], counter=counter)
                counter += 1
        p.enqueue(dets[0][rounds == 0], counter=counter)  # a later frame shows a lost tail
        gets = [p.get() for _ in range(300)]
        answers = _answers_by_rid(p.run())
        for shot, rid in enumerate(gets):
            status, result = answers[rid]
            if shot in lost:
                assert status == Status.SYNDROMES_DROPPED, f"shot {shot} lost a frame but was answered {status!r}"
            else:
                assert status == Status.OK and _flip(result) == expected[shot].tolist(), f"shot {shot}"
        assert p.service.report()["counts"]["shots_dropped"] == len(lost) > 0
    finally:
        p.close()


def test_a_corrupt_counter_costs_only_its_own_shot_and_a_confirmed_jump_is_a_loss(code):
    dem, dets, expected = code
    p = Pair(DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem, frames_per_shot=1, capacity_shots=8)}))
    try:
        for shot in range(6):
            p.enqueue(dets[shot], counter=shot | (1 << 40) if shot == 2 else shot)  # one flipped counter bit
        gets = [p.get() for _ in range(6)]
        answers = _answers_by_rid(p.run())
        assert [answers[g][0] for g in gets] == [Status.OK, Status.OK, Status.SYNDROMES_DROPPED] + [Status.OK] * 3
        assert p.service.report()["faults"]["counter_jump"] == 1
        # a real jump (two frames in a row continue from it) is accepted as lost frames
        p.enqueue(dets[6], counter=1000)
        p.enqueue(dets[7], counter=1001)
        gets = [p.get() for _ in range(2)]
        answers = _answers_by_rid(p.run())
        assert [answers[g][0] for g in gets] == [Status.SYNDROMES_DROPPED, Status.OK]
        assert answers[gets[1]][1] == bytes([expected[7][0]])
    finally:
        p.close()


def test_a_new_peer_starts_with_reset_decoders_and_the_same_endpoint_continues(code):
    dem, dets, expected = code
    service = DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem, frames_per_shot=1)},
                             ack_enqueue="errors")
    first = Pair(service)
    try:
        first.enqueue(dets[0], counter=0)
        assert first.run() == []  # served: one shot queued, nobody asked for it yet
        first.enqueue(dets[1], counter=1)  # the same endpoint again: the counter goes on from 1
        first.enqueue(dets[2][:5], counter=2)  # ... and a shot is left half filled
        assert first.run() == []
        assert service.backlog_shots(0) == 2
    finally:
        first.close()  # this controller goes away without a reset_decoder
    second = Pair(service)
    try:
        second.enqueue(dets[7], counter=0)  # its counter starts at 0: not 'backwards'
        got = second.get()
        answers = _answers_by_rid(second.run())
        # its own shot's correction, not the ones the first controller left queued
        assert answers == {got: (Status.OK, bytes([expected[7][0]]))}
        assert service.backlog_shots(0) == 0
        counts = service.report()["counts"]
        assert counts["decoders_reset_for_new_peer"] == 1 and "counter_backwards" not in service.faults
    finally:
        second.close()


@pytest.fixture
def quiet(code):
    """A pair whose service answers enqueues only when it refuses them."""
    p = Pair(DecoderService({0: DecoderConfig(decoder="pymatching", dem=code[0])}, ack_enqueue="errors"))
    yield p
    p.close()


def test_a_retransmitted_get_is_answered_again_and_consumes_nothing(quiet, code):
    dem, dets, expected = code
    for shot in range(3):
        quiet.enqueue(dets[shot], counter=shot)
    first = quiet.get(ptp=111)
    again = quiet.rid  # a peek repeating first's request_id (its answer was lost, say)
    n = wire.encode_get_corrections_into(quiet.buf, request_id=first, decoder_id=0, return_size=1, reset=False,
                                         ptp_timestamp=222)
    quiet.raw(quiet.buf[:n])
    # the very same request again (a duplicate on the way), in the same batch
    n = wire.encode_get_corrections_into(quiet.buf, request_id=first, decoder_id=0, return_size=1, reset=True,
                                         ptp_timestamp=111)
    quiet.raw(quiet.buf[:n])
    second = quiet.get(ptp=333)
    answers = quiet.run()
    assert again == first
    one = (Status.OK, first, 111, bytes([expected[0][0]]))  # the first ptp_timestamp, echoed every time
    assert answers == [one, one, one, (Status.OK, second, 333, bytes([expected[1][0]]))]
    assert quiet.service.report()["counts"]["get_corrections_replayed"] == 2
    # in a later batch too
    n = wire.encode_get_corrections_into(quiet.buf, request_id=second, decoder_id=0, return_size=1, reset=False,
                                         ptp_timestamp=444)
    quiet.raw(quiet.buf[:n])
    third = quiet.get()
    assert quiet.run() == [(Status.OK, second, 333, bytes([expected[1][0]])),
                          (Status.OK, third, 0, bytes([expected[2][0]]))]


def test_a_repeated_request_id_that_is_not_a_retransmission_is_served_afresh(quiet, code):
    dem, dets, expected = code
    for shot in range(3):
        quiet.enqueue(dets[shot], counter=shot)
    raw = bytearray(64)

    def get(rid, *, reset=True, ptp=0):
        n = wire.encode_get_corrections_into(raw, request_id=rid, decoder_id=0, return_size=1, reset=reset,
                                             ptp_timestamp=ptp)
        quiet.raw(raw[:n])

    # a sender that numbers nothing (request_id 7, no ptp stamp): every get consumes
    get(7)
    get(7)
    # the same request_id with another stamp is another request
    get(7, ptp=5)
    get(7, ptp=6)  # nothing left: NOT_READY, and request_id 7 keeps no answer any more
    get(7, reset=False, ptp=9)  # so a peek of it is a plain peek
    answers = quiet.run()
    assert [(st, res) for st, _, _, res in answers] == [
        (Status.OK, bytes([expected[0][0]])), (Status.OK, bytes([expected[1][0]])),
        (Status.OK, bytes([expected[2][0]])), (Status.NOT_READY, b""), (Status.NOT_READY, b"")]
    assert "get_corrections_replayed" not in quiet.service.report()["counts"]
    # a reset forgets the kept answers with the shots
    quiet.enqueue(dets[3], counter=3)
    get(8, ptp=1)
    quiet.reset()
    get(8, reset=False, ptp=2)
    answers = quiet.run()
    assert [(st, rid) for st, rid, _, _ in answers][-1] == (Status.NOT_READY, 8)
