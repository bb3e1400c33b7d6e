"""The native per-frame QEC path (qlink.qec.hotpath) over real shared memory.

Every correction that comes back through the C service and the C controller is checked
bit for bit against the same decoder called directly on the same shots; frames carry one
round each (the hardware's way) unless a test says otherwise.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import struct
import threading
import time

import numpy as np
import pytest
import stim

from qlink import wire
from qlink.errors import BrokenLinkError
from qlink.qec.controller import SyndromeStream
from qlink.qec.hotpath import NativeController, NativeDecoderService, available, single_shot_decoder
from qlink.qec.service import DecoderConfig
from qlink.qec.sources import StimSource
from qlink.wire import Status

pytestmark = pytest.mark.skipif(available() is not None, reason=f"native path not built: {available()}")
_UCX = pytest.param("ucx", marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                                                     reason="ucxx is not installed (pip install 'qlink[ucx]')"))

_ids = itertools.count()


def _stream(circuit: stim.Circuit, num_shots: int, seed: int) -> tuple[SyndromeStream, stim.DetectorErrorModel]:
    src = StimSource(circuit)
    dets, obs = circuit.compile_detector_sampler(seed=seed).sample(num_shots, separate_observables=True)
    stream = SyndromeStream(detectors=dets.astype(np.uint8), observables=obs.astype(np.uint8),
                            round_of_detector=np.asarray(src.detector_rounds))
    return stream, src.detector_error_model(decompose_errors=True)


def _surface(basis: str, d: int, rounds: int, p: float = 0.004) -> stim.Circuit:
    return stim.Circuit.generated(f"surface_code:rotated_memory_{basis.lower()}", distance=d, rounds=rounds,
                                  after_clifford_depolarization=p, before_measure_flip_probability=p,
                                  after_reset_flip_probability=p, before_round_data_depolarization=p)


class _Served:
    """A native service serving one shm connection from a thread of this process."""

    def __init__(self, dem, *, decoder="pymatching", frames_per_shot=None, capacity_shots=1024, keep=0,
                 ack="errors", scheme="shm", connect=True, rcvbuf_nbytes=None, accept_delay_s=0.0,
                 serve_delay_s=0.0, max_batch_requests=256, ingest_cpu=None):
        import transports

        self.svc = NativeDecoderService({0: DecoderConfig(decoder=decoder, dem=dem, frames_per_shot=frames_per_shot,
                                                          capacity_shots=capacity_shots)},
                                        ack_enqueue=ack, keep_samples=keep, max_batch_requests=max_batch_requests,
                                        ingest_cpu=ingest_cpu)
        self.scheme = scheme
        url = f"shm://qlink-hot-test-{os.getpid()}-{next(_ids)}" if scheme == "shm" else f"{scheme}://127.0.0.1:0"
        self.lis = transports.listen(url, rcvbuf_nbytes=rcvbuf_nbytes) if rcvbuf_nbytes else transports.listen(url)
        self.stop = threading.Event()
        self.report: dict = {}
        self.error: BaseException | None = None
        self.accept_delay_s = accept_delay_s
        self.serve_delay_s = serve_delay_s
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.ep = transports.connect(self.lis.url, timeout_s=10) if connect else None

    def _serve(self):
        try:
            time.sleep(self.accept_delay_s)  # (a service that starts reading late)
            peer = self.lis.accept(timeout_s=10)
            time.sleep(self.serve_delay_s)  # (frames pile up in the link before it reads any)
            try:
                self.report = self.svc.serve(peer, stop_event=self.stop)
            finally:
                peer.close()
        except BaseException as e:  # noqa: BLE001 - surfaced by close()
            self.error = e

    def close(self) -> dict:
        self.ep.close()
        if self.scheme == "udp":  # a datagram peer cannot say it left: every answer is in, stop
            self.stop.set()
        self.thread.join(10)
        self.stop.set()
        self.lis.close()
        if self.error is not None:
            raise self.error
        assert not self.thread.is_alive(), "the service thread did not end after its peer closed"
        return self.report


def _run(circuit, *, num_shots=300, seed=1, decoder="pymatching", lockstep=False, rounds_per_frame=1,
         cycle_ns=1100, scheme="shm", **served):
    """``served``: the service's other options (see _Served)."""
    stream, dem = _stream(circuit, num_shots, seed)
    F = len(stream.frames(rounds_per_frame=rounds_per_frame))
    served = _Served(dem, decoder=decoder, frames_per_shot=F, keep=num_shots, scheme=scheme, **served)
    try:
        res = NativeController(served.ep, stream, lockstep=lockstep, rounds_per_frame=rounds_per_frame,
                               cycle_ns=cycle_ns).run(timeout_s=60)
    finally:
        rep = served.close()
    return stream, dem, res, rep


def _direct(decoder, dem, detectors) -> np.ndarray:
    from qlink.qec.decoders import compile_decoder

    packed = np.packbits(detectors, axis=1, bitorder="little")
    return np.asarray(compile_decoder(decoder, dem).decode_shots_bit_packed(bit_packed_detection_event_data=packed),
                      np.uint8)


@pytest.mark.parametrize("scheme", ["shm", "tcp", "udp", _UCX])
@pytest.mark.parametrize("basis", ["Z", "X"])
@pytest.mark.parametrize("d,rounds", [(3, 5), (5, 3), (7, 8), (9, 4)])
def test_surface_code_per_round_frames_bit_exact(basis, d, rounds, scheme):
    if scheme in ("udp", "ucx") and (basis, d) != ("Z", 5):
        pytest.skip(f"{scheme}: one surface code suffices (the service core is the same as over tcp)")
    stream, dem, res, rep = _run(_surface(basis, d, rounds), num_shots=200 if d < 9 else 120, seed=d + rounds,
                                 scheme=scheme)
    assert res.frames_per_shot == rounds + 1  # one frame per round (the last: the data qubits' readout)
    assert res.shots_ok == stream.num_shots
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    assert rep["counts"]["shots_decoded"] == stream.num_shots
    assert rep["faults"] == {}


@pytest.mark.parametrize("scheme", ["shm", "tcp", "udp"])
def test_lockstep_and_windows_of_rounds_bit_exact(scheme):
    circuit = _surface("Z", 5, 5)
    for lockstep, rpf in ((True, 1), (False, 2), (True, 3), (False, 1)):
        stream, dem, res, _ = _run(circuit, num_shots=150, seed=7, lockstep=lockstep, rounds_per_frame=rpf,
                                   scheme=scheme)
        assert res.shots_ok == 150
        np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
        ok = res.reaction_ns[res.reaction_ns >= 0]
        assert len(ok) == 150 and np.all(ok > 0)


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_repetition_code_bit_exact_and_logical_errors_accounted(scheme):
    circuit = stim.Circuit.generated("repetition_code:memory", distance=7, rounds=6, after_clifford_depolarization=0.05,
                                     before_measure_flip_probability=0.05)
    stream, dem, res, _ = _run(circuit, num_shots=400, seed=11, scheme=scheme)
    want = _direct("pymatching", dem, stream.detectors)
    np.testing.assert_array_equal(res.corrections, want)
    truth = np.packbits(stream.observables, axis=1, bitorder="little")
    assert res.logical_errors == int(np.any(want != truth, axis=1).sum())
    assert res.logical_errors > 0  # p = 5 %: some shots are wrong, and they are counted as such


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_colour_code_with_bposd_bit_exact(scheme):
    pytest.importorskip("ldpc")
    circuit = stim.Circuit.generated("color_code:memory_xyz", distance=3, rounds=3, after_clifford_depolarization=0.01)
    stream, dem, res, rep = _run(circuit, num_shots=80, seed=5, decoder="bposd", scheme=scheme)
    np.testing.assert_array_equal(res.corrections, _direct("bposd", dem, stream.detectors))
    assert "decode_shots_bit_packed" in rep["decoders"]["0"]["single_shot_call"]


def test_single_shot_decoder_matches_batch_call():
    stream, dem = _stream(_surface("X", 5, 4), 300, 2)
    one = single_shot_decoder("pymatching", dem)
    got = np.array([one.decode_one(row) for row in stream.detectors])
    np.testing.assert_array_equal(np.packbits(got, axis=1, bitorder="little"),
                                  _direct("pymatching", dem, stream.detectors))


# ---------------------------------------------------------------- bad input, gaps, dead peers

def _frame_enqueue(rid, counter, bits, *, decoder_id=0, mapping=0):
    buf = bytearray(wire.enqueue_syndromes_nbytes(len(bits)))
    wire.encode_enqueue_syndromes_into(buf, request_id=rid, decoder_id=decoder_id, counter=counter,
                                       syndrome_mapping_id=mapping, syndromes=np.asarray(bits, np.uint8))
    return bytes(buf)


def _frame_get(rid, *, decoder_id=0, return_size=1, reset=True):
    buf = bytearray(wire.HEADER_NBYTES + wire.GET_CORRECTIONS_PAYLOAD_NBYTES)
    wire.encode_get_corrections_into(buf, request_id=rid, decoder_id=decoder_id, return_size=return_size, reset=reset)
    return bytes(buf)


def _answers(ep, n):
    return [wire.decode_response(ep.recv(timeout_s=5)) for _ in range(n)]


@pytest.mark.parametrize("scheme", ["shm", "tcp", "udp"])
def test_bad_frames_get_their_status_and_the_service_keeps_serving(scheme):
    circuit = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=2, after_clifford_depolarization=0.1)
    stream, dem = _stream(circuit, 40, 3)
    nd = dem.num_detectors
    served = _Served(dem, frames_per_shot=1, scheme=scheme)
    ep = served.ep
    good = _frame_enqueue(1, 0, stream.detectors[0])
    bad_magic = bytearray(good)
    bad_magic[0:4] = b"XXXX"
    long_len = bytearray(good)
    struct.pack_into("<I", long_len, 8, len(good))  # arg_len past the end
    unknown = bytearray(good)
    struct.pack_into("<I", unknown, 4, 0x12345678)
    far_id = bytearray(good)  # (the encoder refuses it: written by hand)
    struct.pack_into("<q", far_id, wire.HEADER_NBYTES, 40)
    cases = [
        (bytes(bad_magic), Status.BAD_REQUEST, "bad_magic"),
        (bytes(long_len), Status.BAD_REQUEST, "length"),
        (bytes(unknown), Status.BAD_REQUEST, "unknown_function"),
        (_frame_enqueue(5, 0, stream.detectors[0], decoder_id=7), Status.INVALID_DECODER, "decoder_not_configured"),
        (bytes(far_id), Status.INVALID_DECODER, "decoder_id"),
        (_frame_enqueue(7, 0, stream.detectors[0], mapping=3), Status.BAD_REQUEST, "syndrome_mapping_id"),
        (_frame_enqueue(8, 0, np.zeros(nd + 1, np.uint8)), Status.BAD_REQUEST, "syndrome_count"),
        (_frame_get(9, return_size=0), Status.BAD_REQUEST, "return_size"),
        (_frame_get(10, return_size=2), Status.BAD_REQUEST, "return_size"),
    ]
    try:
        for i, (frame, status, fault) in enumerate(cases):
            ep.send(frame)
            (ans,) = _answers(ep, 1)
            assert ans.status == status, (fault, ans)
        ep.send(b"\x01\x02\x03")  # not even a header: counted, nothing to answer
        ep.send(_frame_get(11))  # nothing decoded yet
        assert _answers(ep, 1)[0].status == Status.NOT_READY
        # the service still serves: every shot decoded right, in order
        want = _direct("pymatching", dem, stream.detectors)
        for k in range(len(stream.detectors)):
            ep.send(_frame_enqueue(100 + k, k, stream.detectors[k]))
            ep.send(_frame_get(0x80000000 + k))
            (ans,) = _answers(ep, 1)
            assert ans.status == Status.OK and ans.request_id == 0x80000000 + k
            assert bytes(ans.result) == bytes(want[k])
        ep.send(_frame_enqueue(999, 3, stream.detectors[0]))  # counter backwards
        assert _answers(ep, 1)[0].status == Status.BAD_REQUEST
    finally:
        rep = served.close()
    want_faults = {f for _, _, f in cases} | {"short_frame", "counter_backwards"}
    assert want_faults <= set(rep["faults"]), rep["faults"]
    assert rep["faults"]["return_size"] == 2
    assert rep["counts"]["shots_decoded"] == len(stream.detectors)


def test_counter_gap_drops_exactly_the_shots_the_lost_frames_touched():
    circuit = _surface("Z", 3, 3)
    stream, dem = _stream(circuit, 6, 4)
    layouts = stream.frames(rounds_per_frame=1)
    F = len(layouts)
    served = _Served(dem, frames_per_shot=F)
    ep = served.ep
    frames = []
    for s in range(6):
        for lay in layouts:
            frames.append(stream.detectors[s, lay.first_bit:lay.first_bit + lay.num_bits])
    lost = set(range(F + 1, F + 3))  # two frames in the middle of shot 1
    lost |= {3 * F + F - 1}  # the last frame of shot 3
    try:
        for i, bits in enumerate(frames):
            if i not in lost:
                ep.send(_frame_enqueue(i, i, bits))
        for k in range(6):
            ep.send(_frame_get(0x80000000 + k))
        answers = _answers(ep, 6)
    finally:
        rep = served.close()
    want = _direct("pymatching", dem, stream.detectors)
    statuses = [a.status for a in answers]
    # shot 3 lost its last frame: that is only seen when shot 4's first frame comes (counter gap)
    assert statuses == [Status.OK, Status.SYNDROMES_DROPPED, Status.OK, Status.SYNDROMES_DROPPED, Status.OK,
                        Status.OK], statuses
    for k in (0, 2, 4, 5):
        assert bytes(answers[k].result) == bytes(want[k])
    assert rep["counts"]["frames_lost"] == 3 and rep["counts"]["shots_dropped"] == 2


@pytest.mark.parametrize("scheme", ["shm", "tcp", "udp", _UCX])
def test_a_killed_service_is_reported_within_a_second(scheme):
    import signal

    import transports
    from qlink.qec.loop import build_source, sample_stream, source_spec
    from qlink.qec import start_service_process

    spec = source_spec(distance=3, p=0.001)
    src = build_source(spec)
    stream = sample_stream(src, num_shots=2_000_000 // 4, seed=1)
    url = f"shm://qlink-hot-kill-{os.getpid()}" if scheme == "shm" else f"{scheme}://127.0.0.1:0"
    proc = start_service_process(url, {0: {"source": spec, "decoder": "pymatching"}},
                                 service_options={"engine": "native"}, max_peers=1, timeout_s=60)
    try:
        ep = transports.connect(proc.url, timeout_s=10)
        ctl = NativeController(ep, stream, cycle_ns=2000)
        killed = []

        def kill():
            time.sleep(0.5)
            killed.append(time.monotonic())
            os.kill(proc.process.pid, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        with pytest.raises(BrokenLinkError):
            ctl.run(timeout_s=30)
        assert killed and time.monotonic() - killed[0] < 1.0
        ep.close()
    finally:
        proc.close()


def _controller_child(url: str, ready) -> None:
    """A native controller in a process of its own, playing a long run until it is killed."""
    import transports
    from qlink.qec.loop import build_source, sample_stream, source_spec

    spec = source_spec(distance=3, p=0.001)
    stream = sample_stream(build_source(spec), num_shots=400_000, seed=2)
    ep = transports.connect(url, timeout_s=10)
    ready.set()
    NativeController(ep, stream, cycle_ns=2000).run(timeout_s=60)


@pytest.mark.parametrize("scheme", ["shm", "tcp", _UCX])
def test_a_killed_controller_leaves_the_native_service_to_the_next_within_a_second(scheme):
    """The controller process is SIGKILLed mid-run: the native service sees its peer gone and
    takes the next controller (connected within 2 s of the kill: the transports' 1 s, and a
    handshake), whose shots are bit-exact."""
    import multiprocessing as mp
    import signal

    import transports
    from qlink.qec import start_service_process
    from qlink.qec.loop import build_source, sample_stream, source_spec

    spec = source_spec(distance=3, p=0.001)
    url = f"shm://qlink-hot-ctlkill-{os.getpid()}" if scheme == "shm" else f"{scheme}://127.0.0.1:0"
    proc = start_service_process(url, {0: {"source": spec, "decoder": "pymatching"}},
                                 service_options={"engine": "native"}, max_peers=2, timeout_s=60)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_controller_child, args=(proc.url, ready), daemon=True)
    try:
        child.start()
        assert ready.wait(60), "the first controller did not connect"
        time.sleep(0.3)  # mid-run
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        killed = time.monotonic()
        src = build_source(spec)
        stream = sample_stream(src, num_shots=20, seed=3)
        ep = transports.connect(proc.url, timeout_s=10)  # (taken once the service has let the dead one go)
        connected = time.monotonic()
        try:
            res = NativeController(ep, stream, cycle_ns=2000).run(timeout_s=30)
        finally:
            ep.close()
        assert connected - killed < 2.0  # the 1 s of the transports' contract, plus the next one's handshake
        assert res.shots_ok == 20
        np.testing.assert_array_equal(res.corrections, _direct("pymatching", src.dem, stream.detectors))
    finally:
        if child.is_alive():
            child.kill()
        proc.close()


def test_run_loop_native_engine_reports_stages_that_add_up():
    from qlink.qec import run_loop, source_spec

    r = run_loop(transport="shm", source=source_spec(distance=3, p=0.002), num_shots=300, engine="native",
                 feed_forward_deadline_ns=1_000_000, warmup_shots=50, seed=2)
    assert r.shots_ok == 300 and r.transport == "shm"
    stages = r.stage_breakdown["stages"]
    assert r.stage_breakdown["n"] == 300
    total = sum(stages[k]["mean_us"] for k in ("send", "wire_in", "queue", "decode", "respond", "wire_out", "apply"))
    mean_reaction = float(np.mean(r.controller.reaction_ns[r.controller.reaction_ns >= 0])) / 1e3
    assert total == pytest.approx(mean_reaction, rel=1e-6)
    with pytest.raises(ValueError, match="shm://, tcp://, udp:// and ucx:// only"):
        run_loop(transport="inproc", source=source_spec(distance=3), num_shots=10, engine="native")


@pytest.mark.parametrize("decoder,scheme", [("pymatching", "shm"), ("bposd", "shm"), ("pymatching", "tcp")])
def test_a_backlog_is_decoded_in_batches_bit_exact(decoder, scheme):
    """Flat out (a 1 ns cycle) the service falls behind: waiting shots go to the decoder in one
    batch call, and every correction still equals the direct call's."""
    if decoder == "bposd":
        pytest.importorskip("ldpc")
    stream, dem, res, rep = _run(_surface("Z", 3, 3), num_shots=3000, seed=9, decoder=decoder, cycle_ns=1,
                                 scheme=scheme)
    assert res.shots_ok == 3000
    np.testing.assert_array_equal(res.corrections, _direct(decoder, dem, stream.detectors))
    batch = np.asarray(rep["shots"]["batch_shots"])
    assert batch.max() > 1, "the service never fell behind: no batch to check"
    assert rep["counts"]["decode_calls"] < rep["counts"]["shots_decoded"]


@pytest.mark.parametrize("max_batch", [64, 2000])
def test_a_backlog_goes_to_the_decoder_in_calls_of_up_to_max_batch_requests(max_batch):
    """All of a run's frames wait in the link before the service reads any: it decodes them in
    calls of at most ``max_batch_requests`` shots (their gets held back beside them, however
    many), every correction equal to the direct call's."""
    n = 3000
    stream, dem = _stream(_surface("Z", 3, 3), n, 5)
    served = _Served(dem, frames_per_shot=1, keep=n, capacity_shots=4096, serve_delay_s=1.0,
                     max_batch_requests=max_batch)
    try:
        res = NativeController(served.ep, stream, rounds_per_frame=0, cycle_ns=1).run(timeout_s=60)
    finally:
        rep = served.close()
    assert res.shots_ok == n
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    batch = np.asarray(rep["shots"]["batch_shots"])
    assert batch.max() <= max_batch
    assert batch.max() > min(max_batch, 256) // 2, "the backlog was not decoded in large calls"
    if max_batch > 256:  # beyond what was once the fixed bound of gets held back
        assert batch.max() > 256
    assert rep["counts"]["decode_calls"] >= n // max_batch


def test_native_service_refuses_a_batch_bound_out_of_range():
    with pytest.raises(ValueError, match="max_batch_requests"):
        NativeDecoderService({0: DecoderConfig(decoder="pymatching", dem=_stream(_surface("Z", 3, 3), 1, 1)[1])},
                             max_batch_requests=0)


@pytest.mark.parametrize("scheme", ["shm", "udp"])
def test_a_message_of_several_whole_frames_is_taken_frame_by_frame(scheme):
    """A shot's last frame and its get in one message (as a udp controller sends them): each
    frame handled as if it came alone, bit-exact; a frame with bytes behind it that are not a
    frame is refused by its length, as before."""
    n = 20
    stream, dem = _stream(_surface("Z", 3, 3), n, 4)
    want = _direct("pymatching", dem, stream.detectors)
    served = _Served(dem, frames_per_shot=1, scheme=scheme)
    ep = served.ep
    try:
        for k in range(n):
            ep.send(_frame_enqueue(100 + k, k, stream.detectors[k]) + _frame_get(0x80000000 + k))
            (ans,) = _answers(ep, 1)
            assert ans.status == Status.OK and ans.request_id == 0x80000000 + k
            assert bytes(ans.result) == bytes(want[k])
        ep.send(_frame_get(0x80000100) + bytes(wire.HEADER_NBYTES + 6))  # zeros behind it: no header
        (ans,) = _answers(ep, 1)
        assert ans.status == Status.BAD_REQUEST and ans.request_id == 0x80000100
    finally:
        rep = served.close()
    assert rep["counts"]["frames_packed"] == n
    assert rep["counts"]["shots_decoded"] == n
    assert rep["faults"]["length"] == 1


@pytest.mark.parametrize("packed", [True, False])
def test_udp_a_shots_get_rides_in_its_last_frames_datagram(packed):
    """Over udp the controller sends a shot's get in the datagram of its last frame (one
    datagram fewer a shot), or on its own when told; bit-exact either way."""
    import transports

    stream, dem = _stream(_surface("Z", 3, 3), 300, 6)
    served = _Served(dem, frames_per_shot=len(stream.frames(rounds_per_frame=1)), scheme="udp", connect=False)
    served.ep = transports.connect(served.lis.url, timeout_s=10)
    try:
        res = NativeController(served.ep, stream, rounds_per_frame=1, cycle_ns=5000,  # (no datagram lost)
                               get_in_last_datagram=packed).run(timeout_s=60)
    finally:
        rep = served.close()
    assert res.shots_ok == stream.num_shots
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    # (a frame the controller sent behind its clock joined the datagram before it: counted apart)
    assert rep["counts"]["frames_packed"] == (stream.num_shots + res.frames_joined if packed else 0)
    assert packed or res.frames_joined == 0


def test_udp_a_controller_behind_its_clock_still_reads_its_answers():
    """Flat out over udp the controller is behind its clock from the first shot to the last;
    it still reads its answers between bursts of frames, so its socket never overflows and no
    get waits out the 50 ms get timeout to be asked again (before, this run answered fewer
    than half its shots: the full socket dropped their answers). One frame a datagram
    (``join_nbytes=0``): datagrams of joined frames, sent flat out, can outpace the service
    and overflow its socket instead -- udp has no flow control; repairs recover those."""
    import transports

    stream, dem = _stream(_surface("Z", 3, 3), 60000, 9)
    served = _Served(dem, frames_per_shot=1, scheme="udp", connect=False)
    served.ep = transports.connect(served.lis.url, timeout_s=10)
    try:
        res = NativeController(served.ep, stream, rounds_per_frame=0, cycle_ns=1, join_nbytes=0).run(timeout_s=120)
    finally:
        served.close()
    assert res.shots_ok == stream.num_shots
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    assert res.answer_faults.get("resent_gets", 0) == 0, res.answer_faults


def _behind_its_clock(scheme: str, num_shots: int, seed: int, **kw):
    """A run at a 1 ns cycle (the controller behind its clock all the way), one frame a round,
    checked bit-exact; (frames sent, controller result, service report)."""
    import transports

    stream, dem = _stream(_surface("Z", 3, 3), num_shots, seed)
    frames = num_shots * len(stream.frames(rounds_per_frame=1))
    served = _Served(dem, frames_per_shot=frames // num_shots, scheme=scheme, connect=scheme != "udp")
    if scheme == "udp":
        served.ep = transports.connect(served.lis.url, timeout_s=10)
    try:
        res = NativeController(served.ep, stream, rounds_per_frame=1, cycle_ns=1, **kw).run(timeout_s=60)
    finally:
        rep = served.close()
    assert res.shots_ok == num_shots
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    return frames, res, rep


@pytest.mark.parametrize("join_nbytes", [1472, 0])
def test_shm_a_controller_behind_its_clock_joins_whole_frames_in_a_ring_record(join_nbytes):
    """Over shm the frames (and gets) a controller behind its clock catches up with go back to
    back in one ring record, which the service takes frame by frame; none joined with
    ``join_nbytes=0``; bit-exact both ways, every frame taken once."""
    frames, res, rep = _behind_its_clock("shm", 400, 8, join_nbytes=join_nbytes)
    assert rep["counts"]["requests"] == frames + 400  # (each frame and get once)
    assert rep["counts"]["frames_packed"] == res.frames_joined
    assert (res.frames_joined > frames // 2) if join_nbytes else res.frames_joined == 0


@pytest.mark.parametrize("packed", [True, False])
def test_udp_a_controller_behind_its_clock_joins_whole_frames_in_a_datagram(packed):
    """Over udp the frames a controller behind its clock catches up with go back to back in one
    datagram (up to 1,472 bytes) where the service takes a datagram frame by frame, and one
    frame a datagram where it does not; bit-exact both ways."""
    frames, res, rep = _behind_its_clock("udp", 300, 7, get_in_last_datagram=packed)
    if packed:
        assert res.frames_joined > frames // 2  # (behind all the way)
        assert rep["counts"]["frames_packed"] == 300 + res.frames_joined
    else:
        assert res.frames_joined == 0 and rep["counts"]["frames_packed"] == 0
    resent = res.answer_faults.get("resent_gets", 0) + res.answer_faults.get("resent_frames", 0)
    assert rep["counts"]["requests"] == frames + 300 + resent + 1  # (+ the look before the run)


def test_udp_a_lost_get_is_asked_again_and_its_kept_answer_replayed():
    """Over udp the service keeps each consuming get's answer: the very same request again
    (request_id and ptp_timestamp) gets it once more and consumes nothing; the next shot's
    get still gets the next shot."""
    circuit = _surface("Z", 3, 3)
    stream, dem = _stream(circuit, 3, 8)
    served = _Served(dem, frames_per_shot=1, scheme="udp")
    ep = served.ep
    want = _direct("pymatching", dem, stream.detectors)
    try:
        for k in range(3):
            ep.send(_frame_enqueue(k, k, stream.detectors[k]))
        first = bytearray(_frame_get(0x80000001))
        struct.pack_into("<Q", first, 16, 12345)  # its ptp stamp
        ep.send(bytes(first))
        a1 = _answers(ep, 1)[0]
        ep.send(bytes(first))  # the same request again (as if its answer were lost)
        a2 = _answers(ep, 1)[0]
        ep.send(_frame_get(0x80000002))
        a3 = _answers(ep, 1)[0]
    finally:
        rep = served.close()
    assert a1.status == a2.status == a3.status == Status.OK
    assert bytes(a1.result) == bytes(a2.result) == bytes(want[0])
    assert bytes(a3.result) == bytes(want[1])
    assert rep["counts"]["get_corrections_replayed"] == 1


def test_run_loop_runs_native_over_udp_by_default_and_python_when_asked():
    from qlink.qec import run_loop, source_spec

    kw = dict(transport="udp", source=source_spec(distance=3, p=0.002), num_shots=300, warmup_shots=20, seed=3,
              cycle_ns=4000)
    r = run_loop(**kw)
    assert r.engine == "native" and r.transport == "udp"
    assert r.shots_ok == 300 and r.shots_dropped == 0  # (a lost frame is sent again, its shot repaired)
    assert run_loop(engine="python", **kw).engine == "python"


# ---------------------------------------------------------------- long experiments: sliding windows

def _window_run(d, rounds, p, num_shots, seed, *, W, C, scheme="shm"):
    from qlink.qec.decoders import SlidingWindowDecoder

    circuit = _surface("Z", d, rounds, p)
    stream, dem = _stream(circuit, num_shots, seed)
    win = SlidingWindowDecoder(dem, detector_rounds=StimSource(circuit).detector_rounds, window_rounds=W,
                               commit_rounds=C)
    F = len(stream.frames(rounds_per_frame=1))
    served = _Served(dem, decoder=win, frames_per_shot=F, keep=num_shots, scheme=scheme)
    try:
        res = NativeController(served.ep, stream, rounds_per_frame=1, cycle_ns=1100).run(timeout_s=120)
    finally:
        rep = served.close()
    return stream, dem, win, res, rep


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_sliding_windows_as_rounds_land_bit_exact_with_the_windowed_decoder(scheme):
    stream, dem, win, res, rep = _window_run(3, 40, 0.01, 200, 3, W=6, C=3, scheme=scheme)
    assert res.shots_ok == stream.num_shots
    want = np.packbits(win.decode_batch(stream.detectors), axis=1, bitorder="little")
    np.testing.assert_array_equal(res.corrections, want)
    windows_per_shot = len(list(win.windows()))
    assert rep["counts"]["windows_decoded"] == windows_per_shot * stream.num_shots
    assert rep["faults"] == {} and rep["first_decoder_error"] is None


def test_a_long_experiment_bulk_windows_share_one_matcher_and_stay_bit_exact():
    """400 rounds: the plan compiles the first and last windows and checks sampled middle
    ones against the bulk; the corrections still equal the windowed decoder's."""
    from qlink.qec.hotpath import window_plan

    stream, dem, win, res, rep = _window_run(3, 400, 0.01, 6, 5, W=8, C=4)
    plan = window_plan(win)
    assert len(plan[5]) <= 6 and len(plan[1]) == len(list(win.windows())) > 64
    np.testing.assert_array_equal(res.corrections,
                                  np.packbits(win.decode_batch(stream.detectors), axis=1, bitorder="little"))


def test_sliding_window_ler_equals_the_whole_history_decoders_within_statistical_error():
    stream, dem, win, res, _ = _window_run(3, 30, 0.008, 1500, 11, W=9, C=3)
    truth = np.packbits(stream.observables, axis=1, bitorder="little")
    whole = np.asarray(win.whole_history_decoder().decode_shots_bit_packed(
        np.packbits(stream.detectors, axis=1, bitorder="little")), np.uint8)
    n = stream.num_shots
    e_win = int(np.any(res.corrections != truth, axis=1).sum())
    e_whole = int(np.any(whole != truth, axis=1).sum())
    assert e_whole > 20  # enough logical errors for the comparison to mean something
    p = (e_win + e_whole) / (2 * n)
    sigma = np.sqrt(2 * p * (1 - p) / n)
    assert abs(e_win - e_whole) / n <= 4 * sigma, (e_win, e_whole)


def test_udp_asking_again_after_not_ready_consumes_nothing():
    """A get answered NOT_READY and sent again later (its answer seemed lost) gets NOT_READY
    again, even though a shot is ready by then: only a new request consumes it."""
    stream, dem = _stream(_surface("Z", 3, 3), 2, 9)
    served = _Served(dem, frames_per_shot=1, scheme="udp")
    ep = served.ep
    want = _direct("pymatching", dem, stream.detectors)
    try:
        early = bytearray(_frame_get(0x80000001))
        struct.pack_into("<Q", early, 16, 777)
        ep.send(bytes(early))
        a1 = _answers(ep, 1)[0]
        ep.send(_frame_enqueue(0, 0, stream.detectors[0]))
        ep.send(bytes(early))
        a2 = _answers(ep, 1)[0]
        ep.send(_frame_get(0x80000002))
        a3 = _answers(ep, 1)[0]
    finally:
        rep = served.close()
    assert a1.status == a2.status == Status.NOT_READY
    assert a3.status == Status.OK and bytes(a3.result) == bytes(want[0])
    assert rep["counts"]["get_corrections_replayed"] == 1


@pytest.mark.parametrize("scheme", ["shm", "tcp", _UCX])
def test_flat_out_through_links_that_fill_both_ways_loses_no_answer(scheme):
    """Flat out over small links: the frames' way fills (the service is behind) and the
    answers' way fills (a controller busy sending reads none). The controller takes answers
    while it waits for room, so neither side waits on the other: every shot is answered,
    bit-exact, and no answer is dropped as blocked."""
    import transports

    stream, dem = _stream(_surface("Z", 3, 3), 6000, 21)
    served = _Served(dem, frames_per_shot=1, keep=0, scheme=scheme, connect=False)
    kw = {"ring_nbytes": 4096} if scheme == "shm" else {}
    served.ep = transports.connect(served.lis.url, timeout_s=10, **kw)
    try:
        res = NativeController(served.ep, stream, rounds_per_frame=0, cycle_ns=1).run(timeout_s=60)
    finally:
        rep = served.close()
    assert res.shots_ok == stream.num_shots
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    assert rep["counts"]["answers"] == rep["counts"]["get_corrections"]
    assert rep["faults"].get("answer_blocked", 0) == 0


def test_the_held_round_trip_floor_holds_each_answer_as_long_as_it_is_told():
    """The floor under the lock-step tail: the echoing side spins each answer as long as the
    next of the given holds; the other side's round trips are timed from when each was due,
    so none is shorter than its hold."""
    import transports

    from qlink.qec.hotpath import link_round_trip_ns

    lis = transports.listen(f"shm://qlink-hold-test-{os.getpid()}-{next(_ids)}")
    holds = np.array([300_000, 20_000, 120_000], np.int64)
    got: dict = {}

    def echo():
        ep = lis.accept(timeout_s=10)
        try:
            link_round_trip_ns(ep, num_round_trips=30, echo=True, hold_ns=holds)
        finally:
            ep.close()

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    ep = transports.connect(lis.url, timeout_s=10)
    try:
        got["rt"] = link_round_trip_ns(ep, num_round_trips=30, pause_ns=50_000)
        with pytest.raises(ValueError, match="array of spins"):
            link_round_trip_ns(ep, num_round_trips=1, echo=True, hold_ns=np.array([5, -1]))
    finally:
        t.join(10)
        ep.close()
        lis.close()
    rt = got["rt"]
    assert (rt >= holds[np.arange(30) % 3]).all(), rt
    # the 300 µs holds are the long ones, in their turn (medians: on a loaded host one 20 µs hold's
    # round trip was once preempted for 7.9 ms, past every 300 µs one)
    assert np.median(rt[0::3]) > np.median(rt[2::3]) > np.median(rt[1::3])
