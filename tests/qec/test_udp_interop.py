"""A controller that knows nothing of qlink talks to the qlink decoder service over UDP.

The client side of these tests is written from the published CUDA-Q realtime decoder
RPC layout alone, with ``socket``, ``struct`` and ``numpy`` (no qlink import on its
code path), one request frame per datagram, as a controller or FPGA would send it.
Expected corrections come from PyMatching called directly on the same DEM.
"""

import contextlib
import socket
import struct
import threading

import numpy as np
import pymatching
import pytest
import stim

pytestmark = pytest.mark.timeout(60)

# ----- the published wire layout (little-endian), written out by hand --------------------------
REQ_HEADER = struct.Struct("<IIIIQ")  # magic, function_id, arg_len, request_id, ptp_timestamp
RESP_HEADER = struct.Struct("<IiIIQ")  # magic, status, result_len, request_id, ptp_timestamp
REQ_MAGIC, RESP_MAGIC = 0x43555152, 0x43555153
ENQUEUE_SYNDROMES, GET_CORRECTIONS, RESET_DECODER = 0x7ED8BE82, 0x882D5BA1, 0x977A59CF
ENQUEUE_FIXED = struct.Struct("<qqqq")  # decoder_id, counter, syndrome_mapping_id, num_syndromes
GET_PAYLOAD = struct.Struct("<qqB")  # decoder_id, return_size, reset
RESET_PAYLOAD = struct.Struct("<q")  # decoder_id
OK, INVALID_DECODER, BAD_REQUEST, INTERNAL_ERROR, NOT_READY, BUSY, SYNDROMES_DROPPED = range(7)


def frame(function_id, payload, *, request_id, ptp_timestamp=0, magic=REQ_MAGIC, arg_len=None):
    """One request datagram: header + payload (``arg_len``/``magic`` overridable to build bad frames)."""
    n = len(payload) if arg_len is None else arg_len
    return REQ_HEADER.pack(magic, function_id, n, request_id, ptp_timestamp) + payload


def enqueue_payload(decoder_id, counter, bits, *, num_syndromes=None):
    bits = np.asarray(bits, dtype=np.uint8)
    n = len(bits) if num_syndromes is None else num_syndromes
    return ENQUEUE_FIXED.pack(decoder_id, counter, 0, n) + np.packbits(bits, bitorder="little").tobytes()


def parse_response(datagram):
    magic, status, result_len, request_id, ptp = RESP_HEADER.unpack_from(datagram)
    assert magic == RESP_MAGIC, f"response magic 0x{magic:08X}"
    assert len(datagram) == RESP_HEADER.size + result_len, "one response per datagram, nothing around it"
    return status, request_id, ptp, datagram[RESP_HEADER.size:]


class RawController:
    """A controller's decoder client: one UDP socket, frames built with struct, lockstep requests."""

    def __init__(self, address, *, timeout_s=5.0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.connect(address)
        self.sock.settimeout(timeout_s)
        self.next_request_id = 1
        self.counters = {}

    def close(self):
        self.sock.close()

    def send(self, datagram):
        self.sock.send(datagram)

    def call(self, function_id, payload, *, ptp_timestamp=0):
        rid = self.next_request_id
        self.next_request_id += 1
        self.send(frame(function_id, payload, request_id=rid, ptp_timestamp=ptp_timestamp))
        return rid

    def response(self):
        return parse_response(self.sock.recv(65536))

    def answer_to(self, rid):
        """Responses are matched by request_id; anything else arriving first is returned too."""
        others = []
        while True:
            status, got, ptp, result = self.response()
            if got == rid:
                return (status, ptp, result), others
            others.append((status, got))

    def enqueue(self, decoder_id, bits):
        counter = self.counters.get(decoder_id, 0)
        self.counters[decoder_id] = counter + 1
        return self.call(ENQUEUE_SYNDROMES, enqueue_payload(decoder_id, counter, bits))

    def send_shot(self, decoder_id, chunks, *, skip_frame=None):
        """Send a shot as several enqueue frames; ``skip_frame`` is "lost" (its counter value is never sent)."""
        rids = []
        for i, bits in enumerate(chunks):
            if i == skip_frame:  # the datagram is sent into the void: its counter value is used up
                self.counters[decoder_id] = self.counters.get(decoder_id, 0) + 1
                continue
            rids.append(self.enqueue(decoder_id, bits))
        return rids

    def get_corrections(self, decoder_id, num_observables, *, pending=()):
        """Ask for the oldest shot's corrections; returns (status, flips or None, statuses of ``pending`` acks)."""
        get = self.call(GET_CORRECTIONS, GET_PAYLOAD.pack(decoder_id, num_observables, 1))
        (status, _, result), acks = self.answer_to(get)
        assert [rid for _, rid in acks] == list(pending), "every enqueue is acknowledged, in order"
        flips = None
        if status == OK:
            assert len(result) == (num_observables + 7) // 8
            flips = np.unpackbits(np.frombuffer(result, np.uint8), bitorder="little")[:num_observables]
        return status, flips, [s for s, _ in acks]

    def decode_shot(self, decoder_id, chunks, num_observables):
        """Send a whole shot, then get its corrections."""
        rids = self.send_shot(decoder_id, chunks)
        return self.get_corrections(decoder_id, num_observables, pending=rids)


# ----- the qlink side --------------------------------------------------------------------------
CODES = {
    0: ("surface_code:rotated_memory_z", 3, 3, 0.01),
    1: ("surface_code:rotated_memory_z", 5, 5, 0.005),
    2: ("repetition_code:memory", 5, 5, 0.03),
}


def _dem(name, distance, rounds, p):
    circuit = stim.Circuit.generated(name, distance=distance, rounds=rounds, after_clifford_depolarization=p,
                                     before_measure_flip_probability=p, after_reset_flip_probability=p)
    return circuit, circuit.detector_error_model(decompose_errors=True)


@contextlib.contextmanager
def running_service(decoder_ids=tuple(CODES)):
    """The qlink decoder service on a udp:// serve endpoint, in a thread; yields (service, address)."""
    import transports
    from qlink.qec.service import DecoderConfig, DecoderService

    configs = {i: DecoderConfig(decoder="pymatching", dem=_dem(*CODES[i])[1]) for i in decoder_ids}
    service = DecoderService(configs)
    listener = transports.listen("udp://127.0.0.1:0")
    endpoint = listener.serve_endpoint()
    stop = threading.Event()
    errors = []

    def run():
        try:
            service.serve(endpoint, stop_event=stop, timeout_s=50, spin=200)
        except BaseException as e:  # surfaced by the test below
            errors.append(e)

    thread = threading.Thread(target=run, name="udp-decoder-service", daemon=True)
    thread.start()
    host, port = listener.url[len("udp://"):].rsplit(":", 1)
    try:
        yield service, (host, int(port)), thread
    finally:
        stop.set()
        thread.join(10)
        endpoint.close()
        listener.close()
    assert not thread.is_alive(), "the service did not stop"
    assert not errors, f"the service loop raised {errors!r}"


def _chunks(bits, rounds):
    """Split one shot's detection events into ``rounds`` frames (the last may be shorter)."""
    size = -(-len(bits) // rounds)
    return [bits[i:i + size] for i in range(0, len(bits), size)]


# ----- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("decoder_id", sorted(CODES))
def test_corrections_over_udp_are_bit_identical_to_pymatching(decoder_id):
    name, distance, rounds, p = CODES[decoder_id]
    circuit, dem = _dem(name, distance, rounds, p)
    num_shots = 60
    dets, _ = circuit.compile_detector_sampler(seed=decoder_id).sample(num_shots, separate_observables=True)
    expected = pymatching.Matching.from_detector_error_model(dem).decode_batch(dets)
    assert expected.any(), "the sample should exercise non-trivial corrections"
    with running_service() as (service, address, _):
        client = RawController(address)
        client.call(RESET_DECODER, RESET_PAYLOAD.pack(decoder_id))
        assert client.response()[0] == OK
        for shot in range(num_shots):
            status, flips, acks = client.decode_shot(decoder_id, _chunks(dets[shot], rounds), dem.num_observables)
            assert status == OK and acks == [OK] * len(acks)
            assert flips.tolist() == expected[shot].astype(np.uint8).tolist(), f"shot {shot}"
        client.close()
    assert service.counts["shots_decoded"] == num_shots


def test_ptp_timestamp_and_request_id_are_echoed():
    with running_service(decoder_ids=(2,)) as (_, address, _):
        client = RawController(address)
        rid = client.call(GET_CORRECTIONS, GET_PAYLOAD.pack(2, 1, 0), ptp_timestamp=0x0102030405060708)
        status, got, ptp, result = client.response()
        assert (status, got, ptp, result) == (NOT_READY, rid, 0x0102030405060708, b"")
        client.close()


def test_malformed_datagrams_are_answered_counted_and_never_stop_the_service():
    circuit, dem = _dem(*CODES[0])
    with running_service(decoder_ids=(0,)) as (service, address, thread):
        client = RawController(address)
        good_bits = np.zeros(dem.num_detectors, np.uint8)
        cases = [  # (datagram, the status the protocol answers, or None when no request_id can be read)
            (frame(ENQUEUE_SYNDROMES, enqueue_payload(0, 0, good_bits), request_id=101, magic=0xDEADBEEF), None),
            (b"CUQR", None),  # shorter than a header
            (b"", None),  # an empty datagram
            (frame(RESET_DECODER, RESET_PAYLOAD.pack(0), request_id=102, arg_len=4000), BAD_REQUEST),  # past the end
            (frame(ENQUEUE_SYNDROMES, enqueue_payload(0, 0, [1] * 8, num_syndromes=(1 << 20) + 1), request_id=103),
             BAD_REQUEST),  # over 2^20 bits
            (frame(0x12345678, b"\x00" * 8, request_id=104), BAD_REQUEST),  # unknown function id
            (frame(GET_CORRECTIONS, GET_PAYLOAD.pack(40, 1, 1), request_id=105), INVALID_DECODER),  # id >= 32
            (frame(RESET_DECODER, RESET_PAYLOAD.pack(7), request_id=106), INVALID_DECODER),  # not configured
            (frame(ENQUEUE_SYNDROMES, enqueue_payload(0, 0, good_bits)[:-1], request_id=107), BAD_REQUEST),  # short
        ]
        for datagram, status in cases:
            client.send(datagram)
            probe = client.call(GET_CORRECTIONS, GET_PAYLOAD.pack(0, 1, 0))
            if status is not None:
                got_status, rid, _, _ = client.response()
                assert (got_status, rid) == (status, REQ_HEADER.unpack_from(datagram)[3])
            # the next answer is the probe's: an unanswerable datagram left nothing behind, and the service lives
            got_status, rid, _, _ = client.response()
            assert (got_status, rid) == (NOT_READY, probe)
        # still decoding correctly after all that
        dets, _ = circuit.compile_detector_sampler(seed=7).sample(5, separate_observables=True)
        expected = pymatching.Matching.from_detector_error_model(dem).decode_batch(dets)
        for shot in range(5):
            status, flips, _ = client.decode_shot(0, _chunks(dets[shot], 3), dem.num_observables)
            assert status == OK and flips.tolist() == expected[shot].astype(np.uint8).tolist()
        assert thread.is_alive()
        client.close()
    faults = service.faults
    for fault in ("bad_magic", "short_buffer", "length_past_end", "num_syndromes", "unknown_function", "decoder_id",
                  "decoder_not_configured", "packed_length"):
        assert faults[fault] == (2 if fault == "short_buffer" else 1), (fault, dict(faults))
    assert service.counts["frames_unanswerable"] == 3


def test_a_lost_datagram_is_reported_as_dropped_not_as_a_wrong_correction():
    circuit, dem = _dem(*CODES[0])
    rounds = CODES[0][2]
    num_shots = 14
    dets, _ = circuit.compile_detector_sampler(seed=11).sample(num_shots, separate_observables=True)
    expected = pymatching.Matching.from_detector_error_model(dem).decode_batch(dets)
    # shot -> the frame whose datagram never arrives (first, middle, last; two shots in a row)
    lost = {3: 1, 7: 0, 8: 2, 11: 2}
    answers = {}
    with running_service(decoder_ids=(0,)) as (service, address, _):
        client = RawController(address)
        outstanding = []  # shots sent but not answered yet, oldest first
        for shot in range(num_shots):
            rids = client.send_shot(0, _chunks(dets[shot], rounds), skip_frame=lost.get(shot))
            outstanding.append(shot)
            while outstanding:
                status, flips, _ = client.get_corrections(0, dem.num_observables, pending=rids)
                rids = []
                if status == NOT_READY:
                    # A lost *last* frame is only noticed when the next frame's counter shows the gap;
                    # until then the shot is simply not ready (never a guess).
                    assert lost.get(outstanding[0]) == rounds - 1, f"shot {outstanding[0]} not ready"
                    break
                answers[outstanding.pop(0)] = (status, flips)
        assert not outstanding, "every shot got an answer once the controller sent on"
        client.close()
    for shot in range(num_shots):
        status, flips = answers[shot]
        if shot in lost:
            assert status == SYNDROMES_DROPPED, f"shot {shot} lost a frame but was answered {status}"
        else:
            assert status == OK, f"shot {shot} was answered {status}"
            assert flips.tolist() == expected[shot].astype(np.uint8).tolist(), f"shot {shot}"
    assert service.counts["frames_lost"] == len(lost)
    assert service.counts["shots_decoded"] == num_shots - len(lost)


def test_two_controllers_in_one_batch_each_get_their_own_answer():
    import transports
    from qlink.qec.service import DecoderConfig, DecoderService

    service = DecoderService({2: DecoderConfig(decoder="pymatching", dem=_dem(*CODES[2])[1])})
    with transports.listen("udp://127.0.0.1:0") as listener:
        endpoint = listener.serve_endpoint()
        host, port = listener.url[len("udp://"):].rsplit(":", 1)
        a, b = RawController((host, int(port)), timeout_s=1), RawController((host, int(port)), timeout_s=1)
        b.next_request_id = 1000
        rid_a = a.call(GET_CORRECTIONS, GET_PAYLOAD.pack(2, 1, 0))
        rid_b = b.call(GET_CORRECTIONS, GET_PAYLOAD.pack(2, 1, 0))
        service.serve(endpoint, max_requests=2, timeout_s=5)  # both frames are read in one batch
        try:
            assert a.response()[:2] == (NOT_READY, rid_a)
            assert b.response()[:2] == (NOT_READY, rid_b)
        finally:
            a.close()
            b.close()
            endpoint.close()
