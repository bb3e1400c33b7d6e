"""The controller on its own edges: a transport that stays full, a second run on one connection."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import transports
from qlink.qec.controller import Controller
from qlink.qec.decoders import compile_decoder
from qlink.qec.loop import build_source, sample_stream, source_spec
from qlink.qec.service import DecoderConfig, DecoderService

pytestmark = pytest.mark.timeout(120)


def _serve_later(lis, svc, delay_s, out):
    ep = lis.accept(timeout_s=10)
    time.sleep(delay_s)  # meanwhile the controller fills the transport and must wait without recursing
    out["report"] = svc.serve(ep, timeout_s=60)
    ep.close()


def test_a_transport_that_stays_full_makes_the_controller_wait_not_recurse():
    spec = source_spec(distance=3, rounds=3, p=0.01)
    src = build_source(spec)
    stream = sample_stream(src, num_shots=300, seed=13)
    url = f"shm://qlink-full-{os.getpid()}"
    out: dict = {}
    with transports.listen(url) as lis:
        svc = DecoderService({0: DecoderConfig(dem=src.dem)}, ack_enqueue="errors")
        th = threading.Thread(target=_serve_later, args=(lis, svc, 0.5, out), daemon=True)
        th.start()
        ep = transports.connect(url, ring_nbytes=4096)  # a few dozen frames fill it
        try:
            runs = [Controller(ep, stream.take(150), cycle_ns=1100, rounds_per_frame=0)]
            first = runs[0].run(timeout_s=60)
            # a second controller on the same connection continues the counters
            runs.append(Controller(ep, stream, cycle_ns=1, rounds_per_frame=0, counter_start=runs[0].counter,
                                   request_id_start=runs[0].next_request_id))
            second = runs[1].run(timeout_s=60)
        finally:
            ep.close()
        th.join(30)
    expected = np.asarray(compile_decoder("pymatching", src.dem).decode_shots_bit_packed(
        np.packbits(stream.detectors, axis=1, bitorder="little")))
    assert first.shots_ok == 150 and np.array_equal(first.corrections, expected[:150])
    # the shots whose ticks passed while the transport was full count in the backlog, sent or
    # not (every tick had passed when the service woke: 150 shots of 4 rounds, a few answered)
    assert first.backlog_rounds.max() >= 130 * 4 and first.late_frames > 100
    assert second.shots_ok == 300 and np.array_equal(second.corrections, expected)
    assert out["report"]["counts"]["shots_decoded"] == 450 and not out["report"]["faults"]


_names = iter(range(1 << 30))


def _loop_once(stream, *, src, controller_options=None, before=None, decoder_id=0, runs=1):
    """Serve in a thread over inproc; ``before(service_side_endpoint)`` sends frames of its own
    to the controller before the run. Returns the controllers' results and the controllers."""
    import sys

    name = f"inproc://qlink-ctl-edges-{os.getpid()}-{next(_names)}"
    out: dict = {}
    svc = DecoderService({0: DecoderConfig(dem=src.dem)}, ack_enqueue="errors")
    with transports.listen(name) as lis:
        ep = transports.connect(name)
        server = lis.accept(timeout_s=5)
        if before is not None:
            before(server)
        stop = threading.Event()
        th = threading.Thread(target=lambda: out.update(report=svc.serve(server, stop_event=stop)), daemon=True)
        old = sys.getswitchinterval()
        sys.setswitchinterval(2e-5)
        th.start()
        ctls, results = [], []
        try:
            for _ in range(runs):
                ctl = Controller(ep, stream, decoder_id=decoder_id, cycle_ns=20_000, rounds_per_frame=0,
                                 get_request_id_start=ctls[-1].next_get_request_id if ctls else 0,
                                 counter_start=ctls[-1].counter if ctls else 0, **(controller_options or {}))
                ctls.append(ctl)
                results.append(ctl.run(timeout_s=30))
        finally:
            sys.setswitchinterval(old)
            stop.set()
            th.join(10)
            ep.close()
            server.close()
    return results, ctls


def test_garbage_and_answers_to_nothing_asked_are_counted_and_ignored():
    from qlink import wire

    src = build_source(source_spec(distance=3, rounds=3, p=0.01))
    stream = sample_stream(src, num_shots=60, seed=3)
    expected = np.asarray(compile_decoder("pymatching", src.dem).decode_shots_bit_packed(
        np.packbits(stream.detectors, axis=1, bitorder="little")))

    def garbage(server):
        buf = bytearray(64)
        n = wire.encode_response_into(buf, status=wire.Status.OK, request_id=0x8000_0000 | 12345, result=b"\x01")
        server.send(buf[:n])  # an answer to a get never sent
        server.send(b"\x00" * 25)  # not a response at all
        server.send(bytes(buf[:n - 1]))  # result_len says 1 byte, none follows
        n = wire.encode_response_into(buf, status=wire.Status.OK, request_id=0x8000_0000, ptp_timestamp=1,
                                      result=b"\x01")
        server.send(buf[:n])  # request_id of the first get, but not its echo (or read before that is sent)

    (res,), (ctl,) = _loop_once(stream, src=src, before=garbage)
    assert res.shots_ok == 60 and np.array_equal(res.corrections, expected)
    f = res.answer_faults
    assert f["bad_frame.bad_magic"] == 1 and f["bad_frame.length_past_end"] == 1
    assert f["unknown_request_id"] + f.get("echo_mismatch", 0) == 2


def test_a_refusal_is_confirmed_by_a_second_ask_then_raised():
    from qlink.errors import QlinkError

    src = build_source(source_spec(distance=3, rounds=3, p=0.01))
    stream = sample_stream(src, num_shots=3, seed=3)
    with pytest.raises(QlinkError, match="refused get_corrections with INVALID_DECODER"):
        _loop_once(stream, src=src, decoder_id=5)  # the service has decoder 0 only


def test_get_request_ids_go_on_across_controllers_on_one_connection():
    src = build_source(source_spec(distance=3, rounds=3, p=0.01))
    stream = sample_stream(src, num_shots=20, seed=4)
    results, ctls = _loop_once(stream, src=src, runs=2)
    assert all(r.shots_ok == 20 for r in results)
    assert ctls[0].next_get_request_id >= 20 and ctls[1].next_get_request_id >= ctls[0].next_get_request_id + 20
