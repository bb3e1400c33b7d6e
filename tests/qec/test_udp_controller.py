"""qlink's controller emulator on the raw UDP wire: frames cut to one datagram, and a decoder
server that is not qlink's driven by address.

* A frame never exceeds one message of the endpoint (``capabilities.max_message_bytes``):
  a shot larger than one datagram is cut between rounds, each piece a complete
  ``enqueue_syndromes`` request, and decodes bit for bit as PyMatching called directly;
  whole shots fill a datagram up to the 65,507-byte cap; what cannot be made to fit is a
  :class:`~qlink.qec.controller.FrameTooLargeError` that names the limit.
* ``run_loop(service_url=...)`` drives a tiny decoder server written with ``socket``,
  ``struct`` and PyMatching alone (:mod:`cuqr_plain`, in a ``python -I`` process that
  refuses qlink imports) and accounts its logical errors right.
"""

import contextlib
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

import transports
from qlink import wire
from qlink.qec.controller import Controller, FrameTooLargeError, SyndromeStream
from qlink.qec.loop import build_source, run_loop, sample_stream, source_spec
from qlink.qec.service import DecoderConfig, DecoderService
from transports import udp

pytestmark = pytest.mark.timeout(120)

_PLAIN_PATH = Path(__file__).with_name("cuqr_plain.py")


@contextlib.contextmanager
def udp_service(dem, *, capacity_shots=1024):
    """The qlink decoder service (decoder 0) on a udp:// serve endpoint, in a thread; yields (service, url)."""
    service = DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem, capacity_shots=capacity_shots)})
    listener = transports.listen("udp://127.0.0.1:0", rcvbuf_nbytes=1 << 20)
    endpoint = listener.serve_endpoint()
    stop = threading.Event()
    errors = []

    def run():
        try:
            service.serve(endpoint, stop_event=stop, timeout_s=100, spin=2000)
        except BaseException as e:  # surfaced below
            errors.append(e)

    thread = threading.Thread(target=run, name="udp-decoder-service", daemon=True)
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)  # two busy-polling threads under one GIL: switch often
    thread.start()
    try:
        yield service, listener.url
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(old_switch)
        endpoint.close()
        listener.close()
    assert not thread.is_alive() and not errors, errors


def _corrections(result, num_observables):
    return np.unpackbits(result.corrections, axis=1, count=num_observables, bitorder="little")


def test_a_shot_larger_than_one_datagram_is_cut_between_rounds_and_decodes_bit_identically():
    src = build_source(source_spec(distance=7, rounds=7, p=0.005))
    stream = sample_stream(src, num_shots=60, seed=3)
    expected = pymatching.Matching.from_detector_error_model(src.dem).decode_batch(stream.detectors)
    assert expected.any()
    limit = 70  # bytes per datagram: 14 bytes (112 bits) of syndromes after header and fields
    with udp_service(src.dem) as (service, url):
        ep = udp.connect(url, max_message_bytes=limit)
        ctl = Controller(ep, stream, rounds_per_frame=0, cycle_ns=20_000, max_in_flight_shots=4)
        # the whole shot (336 bits, a 98-byte frame) does not fit: cut between rounds, as many as fit
        assert wire.enqueue_syndromes_nbytes(stream.num_detectors) > limit
        assert [(f.first_round, f.last_round) for f in ctl.layout] == [(0, 1), (2, 3), (4, 5), (6, 7)]
        assert all(wire.enqueue_syndromes_nbytes(f.num_bits) <= limit for f in ctl.layout)
        assert sum(f.num_bits for f in ctl.layout) == stream.num_detectors
        res = ctl.run(timeout_s=60)
        stats = ep.statistics()
        ep.close()
    assert res.frames_per_shot == 4 and res.shots_ok == 60 and res.shots_dropped == 0
    assert _corrections(res, 1).tolist() == expected.tolist()
    assert stats.extra["oversize"] == 0
    assert service.counts["enqueue"] == 60 * 4 and service.counts["shots_decoded"] == 60
    assert not service.faults


def test_whole_shots_fill_a_datagram_to_the_udp_cap_and_one_more_is_a_typed_error():
    src = build_source(source_spec(distance=3, rounds=3, p=0.01))
    nd = src.dem.num_detectors
    k = (udp.MAX_DATAGRAM_BYTES_IPV4 - wire.enqueue_syndromes_nbytes(0)) * 8 // nd
    assert wire.enqueue_syndromes_nbytes(k * nd) == udp.MAX_DATAGRAM_BYTES_IPV4 == 65507  # exactly at the cap
    stream = sample_stream(src, num_shots=2 * k, seed=4)
    expected = pymatching.Matching.from_detector_error_model(src.dem).decode_batch(stream.detectors)
    with udp_service(src.dem, capacity_shots=2 * k) as (service, url):
        ep = udp.connect(url, rcvbuf_nbytes=1 << 20)
        with pytest.raises(FrameTooLargeError, match=f"over this endpoint's max_message_bytes=65507; use "
                                                     f"shots_per_frame <= {k}") as info:
            Controller(ep, stream, rounds_per_frame=0, shots_per_frame=k + 1)
        assert isinstance(info.value, ValueError) and info.value.max_nbytes == 65507
        assert info.value.nbytes == wire.enqueue_syndromes_nbytes((k + 1) * nd)
        ctl = Controller(ep, stream, rounds_per_frame=0, shots_per_frame=k, cycle_ns=1, max_in_flight_shots=k)
        res = ctl.run(timeout_s=60)
        stats = ep.statistics()
        ep.close()
    assert res.shots_ok == 2 * k and res.shots_dropped == 0
    assert _corrections(res, 1).tolist() == expected.tolist()
    assert stats.bytes_sent >= 2 * 65507 and stats.extra["oversize"] == 0
    assert service.counts["shots_decoded"] == 2 * k and not service.faults


def test_a_round_larger_than_one_datagram_is_a_typed_error_naming_the_limit():
    src = build_source(source_spec(distance=7, rounds=3, p=0.001))
    stream = sample_stream(src, num_shots=2, seed=1)
    raw = udp.listen("udp://127.0.0.1:0")
    ep = udp.connect(raw.url, max_message_bytes=60)  # 32 bits per frame: a d=7 round has 48
    try:
        with pytest.raises(FrameTooLargeError, match=r"round 1 alone has 48 syndrome bits: an enqueue_syndromes "
                                                     r"frame of 62 bytes, over this endpoint's max_message_bytes=60"):
            Controller(ep, stream, rounds_per_frame=1)
        assert ep.statistics().messages_sent == 0  # refused before anything was sent
    finally:
        ep.close()
        raw.close()


def test_frames_never_carry_more_than_the_wire_s_2_20_bits():
    """Without a message limit (tcp, shm) a shot of more than 2^20 syndrome bits is still cut,
    between rounds, into frames the protocol allows."""
    per_round = 400_000
    stream = SyndromeStream(detectors=np.zeros((1, 3 * per_round), np.uint8), observables=np.zeros((1, 1), np.uint8),
                            round_of_detector=np.repeat(np.arange(3), per_round))
    frames = stream.frames(rounds_per_frame=0)
    assert [(f.first_bit, f.num_bits, f.first_round, f.last_round) for f in frames] == [
        (0, 2 * per_round, 0, 1), (2 * per_round, per_round, 2, 2)]
    assert all(f.num_bits <= wire.MAX_SYNDROME_BITS for f in frames)
    assert len(stream.frames(rounds_per_frame=0, max_frame_nbytes=1 << 30)) == 2


@contextlib.contextmanager
def plain_matching_server(dem_text):
    """The decoder server of cuqr_plain (socket, struct, PyMatching; no qlink) in a ``python -I``
    process; yields (its udp:// URL, a dict filled with its final report when it stops)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([sys.executable, "-I", str(_PLAIN_PATH), "server"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=_PLAIN_PATH.parent)
    report: dict = {}
    try:
        proc.stdin.write(json.dumps({"0": dem_text}) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"the plain server did not start: {proc.stderr.read()[-2000:]}"
        yield f"udp://127.0.0.1:{json.loads(line)['port']}", report
        proc.stdin.close()  # the server's cue to stop and report
        proc.stdin = None  # (communicate would flush it)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-2000:]
        report.update(json.loads(out))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_run_loop_drives_a_decoder_server_that_is_not_qlink_s():
    spec = source_spec(distance=3, rounds=3, p=0.03)
    src = build_source(spec)
    num_shots = 400
    stream = sample_stream(src, num_shots=num_shots, seed=8)
    # the server decodes the DEM it was handed as text: the direct call uses the same text
    dem_text = str(src.dem)
    expected = pymatching.Matching.from_detector_error_model(stim.DetectorErrorModel(dem_text)).decode_batch(
        stream.detectors)
    expected_errors = int((expected != stream.observables).any(axis=1).sum())
    assert 0 < expected_errors < num_shots // 2
    with plain_matching_server(dem_text) as (url, server):
        res = run_loop(service_url=url, transport="tcp", source=spec, stream=stream, num_shots=num_shots,
                       warmup_shots=0, cycle_ns=5_000, rounds_per_frame=1, max_in_flight_shots=8,
                       keep_samples=0, timeout_s=60,
                       # this server keeps no answers to replay (a qlink extension): never ask twice
                       controller_options={"get_timeout_ns": 30_000_000_000})
    assert server["qlink_loaded"] is False and server["transports_loaded"] is False
    assert res.transport == "udp" and res.url == url and res.service == {}
    assert res.shots_ok == num_shots and res.shots_dropped == 0
    assert _corrections(res.controller, 1).tolist() == expected.tolist()
    assert res.logical_errors == expected_errors
    assert res.logical_error_rate == pytest.approx(expected_errors / num_shots)
    c = server["counts"]
    frames = res.frames_per_shot
    assert frames == 4  # rounds 0..3, one frame each (the last holds the data-qubit readout)
    assert c["shots_decoded"] == num_shots and c["enqueue"] == num_shots * frames
    assert c["refused"] == 0 and c["counter_mismatch"] == 0 and c["get_corrections"] >= num_shots
    assert res.controller.statuses.get("enqueue.OK") == num_shots * frames  # the server acks every frame


def test_run_loop_refuses_a_service_url_that_is_no_url():
    with pytest.raises(ValueError, match="service_url must be a transport URL"):
        run_loop(service_url="127.0.0.1:5000", source=source_spec(distance=3), num_shots=1)
