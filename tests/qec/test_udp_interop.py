"""A controller that knows nothing of qlink talks to the qlink decoder service over UDP.

The client side is :mod:`cuqr_plain` (beside this file): the published CUDA-Q realtime
decoder RPC layout written out with ``socket``, ``struct`` and ``numpy``, one request
frame per datagram, as a controller or FPGA would send it. The main test runs it in a
process of its own started with ``python -I`` that refuses to import qlink; the others
drive the service from this process with the same plain client. Expected corrections come
from the decoder called directly on the same DEM (PyMatching itself; the BP+OSD decoder
for the colour code, which matching cannot decode).
"""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pymatching
import pytest
import stim

pytestmark = pytest.mark.timeout(120)

_PLAIN_PATH = Path(__file__).with_name("cuqr_plain.py")


def _load_plain():
    spec = importlib.util.spec_from_file_location("cuqr_plain", _PLAIN_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plain = _load_plain()
REQ_HEADER, RESP_HEADER = plain.REQ_HEADER, plain.RESP_HEADER
ENQUEUE_SYNDROMES, GET_CORRECTIONS, RESET_DECODER = plain.ENQUEUE_SYNDROMES, plain.GET_CORRECTIONS, plain.RESET_DECODER
GET_PAYLOAD, RESET_PAYLOAD = plain.GET_PAYLOAD, plain.RESET_PAYLOAD
OK, INVALID_DECODER, BAD_REQUEST = plain.OK, plain.INVALID_DECODER, plain.BAD_REQUEST
NOT_READY, SYNDROMES_DROPPED = plain.NOT_READY, plain.SYNDROMES_DROPPED
frame, enqueue_payload, RawController = plain.frame, plain.enqueue_payload, plain.RawController

# decoder_id -> (stim circuit, distance, rounds, p, decoder the service runs)
CODES = {
    0: ("surface_code:rotated_memory_z", 3, 3, 0.01, "pymatching"),
    1: ("surface_code:rotated_memory_z", 5, 5, 0.005, "pymatching"),
    2: ("repetition_code:memory", 5, 5, 0.03, "pymatching"),
    3: ("surface_code:rotated_memory_z", 7, 7, 0.005, "pymatching"),
    4: ("color_code:memory_xyz", 5, 5, 0.01, "bposd"),  # hyperedges: matching cannot decode it
}
UDP_MAX_DATAGRAM = 65507  # IPv4: 65,535 - 20 (IP header) - 8 (UDP header)


def _circuit(decoder_id):
    name, distance, rounds, p, _ = CODES[decoder_id]
    return stim.Circuit.generated(name, distance=distance, rounds=rounds, after_clifford_depolarization=p,
                                  before_measure_flip_probability=p, after_reset_flip_probability=p)


def _dem(decoder_id):
    return _circuit(decoder_id).detector_error_model(decompose_errors=CODES[decoder_id][4] == "pymatching")


def _expected(decoder_id, dets):
    """The decoder called directly, no wire: PyMatching itself, or the same BP+OSD the service runs."""
    dem = _dem(decoder_id)
    if CODES[decoder_id][4] == "pymatching":
        return pymatching.Matching.from_detector_error_model(dem).decode_batch(dets).astype(np.uint8)
    from qlink.qec.decoders import compile_decoder

    return compile_decoder(CODES[decoder_id][4], dem).decode_batch(dets).astype(np.uint8)


def _sample(decoder_id, num_shots, seed):
    dets, _ = _circuit(decoder_id).compile_detector_sampler(seed=seed).sample(num_shots, separate_observables=True)
    return dets.astype(np.uint8)


@contextlib.contextmanager
def running_service(decoder_ids=tuple(CODES), *, capacity_shots=1024, **service_options):
    """The qlink decoder service on a udp:// serve endpoint, in a thread; yields (service, address, thread)."""
    import transports
    from qlink.qec.service import DecoderConfig, DecoderService

    configs = {i: DecoderConfig(decoder=CODES[i][4], dem=_dem(i), capacity_shots=capacity_shots) for i in decoder_ids}
    service = DecoderService(configs, **service_options)
    listener = transports.listen("udp://127.0.0.1:0")
    endpoint = listener.serve_endpoint()
    stop = threading.Event()
    errors = []

    def run():
        try:
            service.serve(endpoint, stop_event=stop, timeout_s=100, spin=200)
        except BaseException as e:  # surfaced below
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


def _frame_bits(num_bits, frames):
    return [len(c) for c in _chunks(np.zeros(num_bits), frames)]


# ----- tests -----------------------------------------------------------------------------------
def test_a_client_of_socket_and_struct_alone_gets_bit_identical_corrections():
    """In a process started with ``python -I`` that cannot import qlink: several codes and
    distances, each shot cut into frames, every answer's echo checked there."""
    num_shots = 40
    job_decoders, expected = [], {}
    for did in CODES:
        dets = _sample(did, num_shots, seed=100 + did)
        expected[did] = _expected(did, dets)
        assert expected[did].any(), f"decoder {did}: the sample should exercise non-trivial corrections"
        job_decoders.append({
            "decoder_id": did, "num_observables": int(expected[did].shape[1]),
            "frame_bits": _frame_bits(dets.shape[1], CODES[did][2]),
            "shots": [np.packbits(row, bitorder="little").tobytes().hex() for row in dets],
        })
    with running_service() as (service, address, _):
        job = {"address": list(address), "decoders": job_decoders}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([sys.executable, "-I", str(_PLAIN_PATH), "client"], input=json.dumps(job),
                              capture_output=True, text=True, timeout=100, env=env, cwd=_PLAIN_PATH.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["qlink_loaded"] is False and out["transports_loaded"] is False
    requests = 0
    for got in out["decoders"]:
        did = got["decoder_id"]
        frames = len(_frame_bits(_dem(did).num_detectors, CODES[did][2]))
        assert got["statuses"] == [OK] * num_shots, f"decoder {did}"
        assert got["ack_statuses"] == [[OK] * frames] * num_shots, f"decoder {did}"
        assert got["flips"] == expected[did].tolist(), f"decoder {did}: corrections differ from a direct call"
        requests += 1 + num_shots * (frames + 1)  # reset, then per shot its frames and one get
    # every answer (reset, enqueue acks, corrections) echoed its request's request_id and ptp_timestamp
    assert out["echoes_checked"] == {str(OK): requests}
    assert service.counts["shots_decoded"] == num_shots * len(CODES)
    assert not service.faults


def test_ptp_timestamp_and_request_id_are_echoed_on_every_answer():
    circuit = _circuit(0)
    dem = _dem(0)
    dets = circuit.compile_detector_sampler(seed=3).sample(8, separate_observables=True)[0].astype(np.uint8)
    shot = int(np.flatnonzero(dets.any(axis=1))[0])
    expected = pymatching.Matching.from_detector_error_model(dem).decode(dets[shot]).astype(np.uint8)
    with running_service(decoder_ids=(0,)) as (_, address, _):
        client = RawController(address)
        rid = client.call(GET_CORRECTIONS, GET_PAYLOAD.pack(0, 1, 0), ptp_timestamp=0x0102030405060708)
        assert client.response() == (NOT_READY, rid, 0x0102030405060708, b"")
        rid = client.call(ENQUEUE_SYNDROMES, enqueue_payload(0, 0, dets[shot]), ptp_timestamp=0x1122334455667788)
        assert client.response() == (OK, rid, 0x1122334455667788, b"")  # the enqueue's acknowledgement
        rid = client.call(GET_CORRECTIONS, GET_PAYLOAD.pack(0, 1, 1), ptp_timestamp=0xFEDCBA9876543210)
        status, got_rid, ptp, result = client.response()
        assert (status, got_rid, ptp) == (OK, rid, 0xFEDCBA9876543210)
        assert np.unpackbits(np.frombuffer(result, np.uint8), bitorder="little")[:1].tolist() == expected.tolist()
        rid = client.call(RESET_DECODER, RESET_PAYLOAD.pack(0), ptp_timestamp=1)
        assert client.response() == (OK, rid, 1, b"")
        rid = client.call(RESET_DECODER, RESET_PAYLOAD.pack(9), ptp_timestamp=2)  # refused: echoed as well
        assert client.response() == (INVALID_DECODER, rid, 2, b"")
        client.close()


def test_malformed_datagrams_are_answered_counted_and_never_stop_the_service():
    circuit, dem = _circuit(0), _dem(0)
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
    circuit, dem = _circuit(0), _dem(0)
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


def test_a_frame_overtaken_by_the_next_is_refused_and_its_shot_dropped_never_miscorrected():
    """Over real UDP the plain client sends counter N+1 before N. The service takes the gap
    at N+1 for a loss (the shot is dropped, N+1 discarded if it belongs to that shot), and
    the late frame N goes backwards: BAD_REQUEST, counted. Every other shot decodes right."""
    circuit, dem = _circuit(0), _dem(0)
    rounds = CODES[0][2]
    num_shots = 12
    dets, _ = circuit.compile_detector_sampler(seed=21).sample(num_shots, separate_observables=True)
    expected = pymatching.Matching.from_detector_error_model(dem).decode_batch(dets).astype(np.uint8)
    # shot -> the two frames that go out in the wrong order, and the acks of the shot's frames as sent
    swapped = {2: ((1, 2), [OK, SYNDROMES_DROPPED, BAD_REQUEST]),  # the last overtakes the middle
               6: ((0, 1), [SYNDROMES_DROPPED, BAD_REQUEST, SYNDROMES_DROPPED])}  # the middle overtakes the first
    answers, acks = {}, {}
    with running_service(decoder_ids=(0,)) as (service, address, _):
        client = RawController(address)
        for shot in range(num_shots):
            rids = client.send_shot(0, _chunks(dets[shot], rounds), swap_frames=swapped.get(shot, (None,))[0])
            status, flips, ack = client.get_corrections(0, dem.num_observables, pending=rids)
            answers[shot], acks[shot] = (status, flips), ack
        client.close()
    for shot in range(num_shots):
        status, flips = answers[shot]
        if shot in swapped:
            assert status == SYNDROMES_DROPPED, f"shot {shot}: frames reordered, answered {status}"
            # the overtaking frame and any later one of the shot are discarded with it; the late one is refused
            assert acks[shot] == swapped[shot][1], (shot, acks[shot])
        else:
            assert status == OK and acks[shot] == [OK] * rounds, (shot, status, acks[shot])
            assert flips.tolist() == expected[shot].tolist(), f"shot {shot}: a wrong correction"
    assert service.faults["counter_backwards"] == len(swapped)  # each late frame, counted
    assert service.faults["counter_gap"] == len(swapped)
    assert service.counts["frames_lost"] == len(swapped)
    assert service.counts["shots_decoded"] == num_shots - len(swapped)


def test_a_reordered_pair_across_two_shots_drops_only_the_first():
    """Frame 0 of shot 1 overtakes the last frame of shot 0: shot 0 is dropped (its last
    frame then comes late, refused); shot 1, complete in order from its first frame, decodes."""
    circuit, dem = _circuit(0), _dem(0)
    rounds = CODES[0][2]
    dets, _ = circuit.compile_detector_sampler(seed=5).sample(3, separate_observables=True)
    expected = pymatching.Matching.from_detector_error_model(dem).decode_batch(dets).astype(np.uint8)
    with running_service(decoder_ids=(0,)) as (service, address, _):
        client = RawController(address)
        a, b = _chunks(dets[0], rounds), _chunks(dets[1], rounds)
        rids = [client.enqueue(0, a[0], counter=0), client.enqueue(0, a[1], counter=1),
                client.enqueue(0, b[0], counter=3), client.enqueue(0, a[2], counter=2),
                client.enqueue(0, b[1], counter=4), client.enqueue(0, b[2], counter=5)]
        client.counters[0] = 6
        first = client.get_corrections(0, 1, pending=rids)
        second = client.get_corrections(0, 1)
        third = client.decode_shot(0, _chunks(dets[2], rounds), 1)
        client.close()
    assert first[0] == SYNDROMES_DROPPED and first[2] == [OK, OK, OK, BAD_REQUEST, OK, OK]
    assert second[0] == OK and second[1].tolist() == expected[1].tolist()
    assert third[0] == OK and third[1].tolist() == expected[2].tolist()
    assert service.faults["counter_backwards"] == 1 and service.counts["frames_lost"] == 1


def test_datagrams_at_the_udp_size_cap():
    """A 65,507-byte request (the most one IPv4 datagram holds) carrying whole shots is taken and
    decoded; one whose bit count is not whole shots is refused BAD_REQUEST; one with a bad magic
    is counted and left unanswered. The service answers on throughout."""
    dem = _dem(0)
    nd = dem.num_detectors
    header_and_fields = REQ_HEADER.size + plain.ENQUEUE_FIXED.size
    k = (UDP_MAX_DATAGRAM - header_and_fields) * 8 // nd  # whole shots that fill the datagram
    assert header_and_fields + (k * nd + 7) // 8 == UDP_MAX_DATAGRAM, "the code chosen fills it exactly"
    dets = _sample(0, k, seed=9)
    expected = pymatching.Matching.from_detector_error_model(dem).decode_batch(dets).astype(np.uint8)
    with running_service(decoder_ids=(0,), capacity_shots=k) as (service, address, _):
        import socket

        client = RawController(address)
        client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        bad_count = frame(ENQUEUE_SYNDROMES, enqueue_payload(0, 0, dets.reshape(-1)[:-1]), request_id=900)
        assert len(bad_count) == UDP_MAX_DATAGRAM
        client.send(bad_count)
        assert client.response()[:2] == (BAD_REQUEST, 900)
        garbage = b"\xff" * UDP_MAX_DATAGRAM
        client.send(garbage)
        rid = client.enqueue(0, dets.reshape(-1))  # counter 0: the refused frame changed nothing
        (status, _, _), _ = client.answer_to(rid)
        assert status == OK
        window = 4096  # corrections of many shots per answer (k shots in all)
        flips = []
        while len(flips) < k:
            m = min(window, k - len(flips))
            (status, _, result), _ = client.answer_to(client.call(GET_CORRECTIONS, GET_PAYLOAD.pack(0, m, 1)))
            assert status == OK
            flips += np.unpackbits(np.frombuffer(result, np.uint8), count=m, bitorder="little").tolist()
        client.close()
    assert flips == expected[:, 0].tolist()
    assert service.faults["syndrome_count"] == 1 and service.faults["bad_magic"] == 1
    assert service.counts["frames_unanswerable"] == 1 and service.counts["shots_decoded"] == k


def test_two_controllers_in_one_batch_each_get_their_own_answer():
    import transports
    from qlink.qec.service import DecoderConfig, DecoderService

    service = DecoderService({2: DecoderConfig(decoder="pymatching", dem=_dem(2))})
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
