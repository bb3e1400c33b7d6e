"""The lock-step controller over udp when a shot's syndrome datagram is lost: its get is
answered NOT_READY, and the controller sends both frames again with the get as a new request.
A service keeps a consuming get's NOT_READY for that very request (the native engine answers
the same get sent again with NOT_READY, even once the shot has come), so sending the very same
get again never ended: the controller waited out its timeout. Both engines, bit-exact against a
direct PyMatching call."""

from __future__ import annotations

import numpy as np
import pymatching
import pytest

from qlink.bench._lockstep import LockstepController
from qlink.qec import start_service_process
from qlink.qec.specs import build_source
from tests.qec.test_hotpath_udp_loss import _LossyRelay

pytestmark = pytest.mark.timeout(120)

SPEC = {"code": "surface_code:rotated_memory_z", "distance": 3, "rounds": 3, "p": 0.01}


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_lost_syndrome_datagram_is_sent_again_with_a_new_get_bit_exact(engine):
    src = build_source(SPEC)
    dets = np.asarray(src.sample(40, seed=3)[0], dtype=np.uint8)
    expected = pymatching.Matching.from_detector_error_model(src.dem).decode_batch(dets).astype(np.uint8)
    with start_service_process("udp://127.0.0.1:0", {0: {"source": SPEC, "decoder": "pymatching"}},
                               service_options={"engine": engine}) as svc:
        lost = {("enqueue", 3), ("enqueue", 17)}  # each the first time it passes
        relay = _LossyRelay(svc.url, lambda direction, fields: fields in lost)
        try:
            with LockstepController(relay.url, num_observables=src.dem.num_observables, timeout_s=10) as ctl:
                flips, statuses, _ = ctl.run(dets)
                retries = ctl.retries
        finally:
            relay.close()
    assert sorted(relay.dropped) == [("up", f) for f in sorted(lost)]
    assert (statuses == 0).all()
    np.testing.assert_array_equal(flips, expected)
    assert retries >= 2
