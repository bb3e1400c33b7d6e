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
