"""A pipelined native service (``ingest_cpu``): frames taken in by a thread of their own while
the serving thread only calls the decoder. Every correction is checked bit for bit against
the decoder called directly; the queue, the gets held back, a reset and bad frames all pass
between the two threads."""

from __future__ import annotations

import os

import numpy as np
import pytest

from qlink.qec.hotpath import NativeController, NativeDecoderService, available
from qlink.qec.service import DecoderConfig
from qlink.wire import Status

from .test_hotpath import _answers, _direct, _frame_enqueue, _frame_get, _run, _Served, _stream, _surface

pytestmark = pytest.mark.skipif(available() is not None, reason=f"native path not built: {available()}")

_CPU = (os.cpu_count() or 1) - 1  # (any CPU will do: pinned there, the ingest thread shares it)


def _Piped(dem, *, ingest_cpu=_CPU, **kw):
    """_Served with an ingest thread on _CPU."""
    return _Served(dem, ingest_cpu=ingest_cpu, **kw)


def _piped_run(circuit, *, num_shots, seed, cycle_ns=1, capacity_shots=4096, max_batch_requests=4096, **kw):
    """_run with an ingest thread on _CPU, flat out unless told, a queue and batch bound of 4096."""
    return _run(circuit, num_shots=num_shots, seed=seed, cycle_ns=cycle_ns, ingest_cpu=_CPU,
                capacity_shots=capacity_shots, max_batch_requests=max_batch_requests, **kw)


@pytest.mark.parametrize("d,rounds,rounds_per_frame", [(5, 5, 1), (3, 3, 0), (7, 4, 1)])
def test_flat_out_pipelined_is_bit_exact_and_batches(d, rounds, rounds_per_frame):
    """Flat out (a 1 ns cycle), frames of one round or of whole shots: every correction equals
    the direct call's, the run was pipelined, and the decoder took its backlog in batches."""
    stream, dem, res, rep = _piped_run(_surface("Z", d, rounds), num_shots=6000, seed=d, rounds_per_frame=rounds_per_frame)
    assert res.shots_ok == stream.num_shots
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    pipe = rep["ingest_thread"]
    assert pipe["not_piped_because"] == "" and pipe["piped_runs"] >= 1, pipe
    assert rep["counts"]["shots_decoded"] == stream.num_shots and rep["faults"] == {}
    batch = np.asarray(rep["shots"]["batch_shots"])
    assert batch.max() > 1 and rep["counts"]["decode_calls"] < stream.num_shots


def test_pipelined_at_the_cycle_and_in_lock_step_is_bit_exact():
    """At a 1.1 us cycle and in lock-step (each shot's answer before the next shot), where the
    decoding thread mostly takes one shot at a time."""
    circuit = _surface("X", 5, 3)
    for kw in ({"cycle_ns": 1100}, {"cycle_ns": 1100, "lockstep": True}):
        stream, dem, res, rep = _piped_run(circuit, num_shots=400, seed=11, **kw)
        assert res.shots_ok == 400, kw
        np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
        assert rep["ingest_thread"]["piped_runs"] >= 1


def test_a_small_queue_waits_for_room_rather_than_refusing():
    """A queue of 64 shots with a batch bound far above it: the ingest thread waits for the
    decoder to free slots (its gets answered), it refuses no shot as busy."""
    stream, dem, res, rep = _piped_run(_surface("Z", 3, 3), num_shots=5000, seed=4, capacity_shots=64)
    assert res.shots_ok == 5000
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    assert rep["counts"].get("shots_refused_busy", 0) == 0
    assert np.asarray(rep["shots"]["batch_shots"]).max() <= 64


def test_bposd_pipelined_is_bit_exact():
    pytest.importorskip("ldpc")
    stream, dem, res, rep = _piped_run(_surface("Z", 3, 3), num_shots=1500, seed=6, decoder="bposd")
    assert res.shots_ok == 1500
    np.testing.assert_array_equal(res.corrections, _direct("bposd", dem, stream.detectors))


def test_bad_frames_and_a_reset_pass_through_the_ingest_thread():
    """Malformed frames are refused with their status and counted by the ingest thread; a
    reset_decoder mid-stream (the decoding thread held still while the queue empties) starts
    the decoder afresh; every shot before and after it decodes right."""
    import struct

    from qlink import wire

    stream, dem = _stream(_surface("Z", 3, 3), 300, 8)
    want = _direct("pymatching", dem, stream.detectors)
    served = _Piped(dem, frames_per_shot=1, capacity_shots=1024)
    ep = served.ep
    good = _frame_enqueue(1, 0, stream.detectors[0])
    bad_magic = bytearray(good)
    bad_magic[0:4] = b"XXXX"
    try:
        ep.send(bytes(bad_magic))
        assert _answers(ep, 1)[0].status == Status.BAD_REQUEST
        ep.send(_frame_enqueue(2, 0, stream.detectors[0], decoder_id=9))
        assert _answers(ep, 1)[0].status == Status.INVALID_DECODER
        # 200 shots in one go, then their gets: the decoder takes them while the gets wait
        for k in range(200):
            ep.send(_frame_enqueue(10 + k, k, stream.detectors[k]))
        for k in range(200):
            ep.send(_frame_get(1000 + k))
        got = _answers(ep, 200)
        assert [a.request_id for a in got] == list(range(1000, 1200))
        assert all(a.status == Status.OK for a in got)
        assert [bytes(a.result) for a in got] == [bytes(want[k]) for k in range(200)]
        # three shots queued and not asked for, then a reset: they are gone, the counter restarts
        for k in range(3):
            ep.send(_frame_enqueue(5000 + k, 200 + k, stream.detectors[200 + k]))
        reset = bytearray(wire.HEADER_NBYTES + wire.RESET_DECODER_PAYLOAD_NBYTES)
        wire.encode_reset_decoder_into(reset, request_id=6000, decoder_id=0)
        ep.send(bytes(reset))
        (ans,) = _answers(ep, 1)
        assert ans.status == Status.OK and ans.request_id == 6000
        ep.send(_frame_get(6001))
        assert _answers(ep, 1)[0].status == Status.NOT_READY
        for k in range(200, 300):
            ep.send(_frame_enqueue(7000 + k, k - 200, stream.detectors[k]))
            ep.send(_frame_get(8000 + k))
        got = _answers(ep, 100)
        assert [bytes(a.result) for a in got] == [bytes(want[k]) for k in range(200, 300)]
        long_len = bytearray(good)
        struct.pack_into("<I", long_len, 8, len(good))
        ep.send(bytes(long_len))
        assert _answers(ep, 1)[0].status == Status.BAD_REQUEST
    finally:
        rep = served.close()
    assert {"bad_magic", "decoder_not_configured", "length"} <= set(rep["faults"]), rep["faults"]
    assert rep["counts"]["shots_decoded"] == 303  # (the three reset away were decoded, never asked for)
    assert rep["ingest_thread"]["piped_runs"] >= 1


def test_a_link_that_cannot_be_pipelined_is_served_single_threaded_and_says_why():
    stream, dem = _stream(_surface("Z", 3, 3), 500, 2)
    served = _Piped(dem, frames_per_shot=1, keep=500, scheme="tcp")
    try:
        res = NativeController(served.ep, stream, rounds_per_frame=0, cycle_ns=1).run(timeout_s=60)
    finally:
        rep = served.close()
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    assert rep["ingest_thread"]["piped_runs"] == 0
    assert "shared-memory ring" in rep["ingest_thread"]["not_piped_because"]


@pytest.mark.parametrize("bad", [-1, 10_000, True, 1.0])
def test_ingest_cpu_out_of_range_is_refused(bad):
    dem = _stream(_surface("Z", 3, 3), 1, 1)[1]
    with pytest.raises(ValueError, match="ingest_cpu"):
        NativeDecoderService({0: DecoderConfig(decoder="pymatching", dem=dem)}, ingest_cpu=bad)


def test_run_loop_takes_the_ingest_cpu_for_the_native_engine_only():
    from qlink.qec import run_loop, source_spec

    r = run_loop(transport="shm", source=source_spec(distance=3, p=0.002), num_shots=2000, engine="native",
                 cycle_ns=1, rounds_per_frame=0, warmup_shots=50, seed=5, capacity_shots=4096,
                 max_batch_requests=4096, service_ingest_cpu=0)
    assert r.shots_ok == 2000
    assert r.service["ingest_thread"]["piped_runs"] >= 1
    with pytest.raises(ValueError, match="service_ingest_cpu"):
        run_loop(transport="shm", source=source_spec(distance=3), num_shots=10, engine="python",
                 service_ingest_cpu=0)
