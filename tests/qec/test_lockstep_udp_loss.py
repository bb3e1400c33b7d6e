"""The lock-step controller over udp when a shot's syndrome datagram is lost: its get is
answered NOT_READY, and the controller sends both frames again with the get as a new request.
A service keeps a consuming get's NOT_READY for that very request (the native engine answers
the same get sent again with NOT_READY, even once the shot has come), so sending the very same
get again never ended: the controller waited out its timeout. Both engines, bit-exact against a
direct PyMatching call."""

from __future__ import annotations

import select
import socket
import struct
import threading

import numpy as np
import pymatching
import pytest

from qlink import wire
from qlink.bench._lockstep import LockstepController
from qlink.qec import start_service_process
from qlink.qec.specs import build_source

pytestmark = pytest.mark.timeout(120)

SPEC = {"code": "surface_code:rotated_memory_z", "distance": 3, "rounds": 3, "p": 0.01}


class _DropRelay:
    """Two plain sockets between a controller and a udp service: forwards both ways, except
    the enqueue_syndromes datagrams whose counters are in ``drop`` (each the first time only)."""

    def __init__(self, service_url: str, drop: set[int]) -> None:
        host, port = service_url[len("udp://"):].rsplit(":", 1)
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(("127.0.0.1", 0))
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.back.connect((host, int(port)))
        self.url = "udp://127.0.0.1:%d" % self.front.getsockname()[1]
        self.drop, self.dropped = set(drop), []
        self._client = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.front, self.back], [], [], 0.05)
            for s in ready:
                data, addr = s.recvfrom(65536)
                if s is self.back:
                    if self._client is not None:
                        self.front.sendto(data, self._client)
                    continue
                self._client = addr
                fn = struct.unpack_from("<I", data, 4)[0]
                if fn == wire.ENQUEUE_SYNDROMES:
                    counter = wire.ENQUEUE_FIXED.unpack_from(data, wire.REQUEST_HEADER.size)[1]
                    if counter in self.drop:
                        self.drop.discard(counter)
                        self.dropped.append(counter)
                        continue
                self.back.send(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.front.close()
        self.back.close()


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_lost_syndrome_datagram_is_sent_again_with_a_new_get_bit_exact(engine):
    src = build_source(SPEC)
    dets = np.asarray(src.sample(40, seed=3)[0], dtype=np.uint8)
    expected = pymatching.Matching.from_detector_error_model(src.dem).decode_batch(dets).astype(np.uint8)
    with start_service_process("udp://127.0.0.1:0", {0: {"source": SPEC, "decoder": "pymatching"}},
                               service_options={"engine": engine}) as svc:
        relay = _DropRelay(svc.url, drop={3, 17})
        try:
            with LockstepController(relay.url, num_observables=src.dem.num_observables, timeout_s=10) as ctl:
                flips, statuses, _ = ctl.run(dets)
                retries = ctl.retries
        finally:
            relay.close()
    assert sorted(relay.dropped) == [3, 17]
    assert (statuses == 0).all()
    np.testing.assert_array_equal(flips, expected)
    assert retries >= 2
