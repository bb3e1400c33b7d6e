"""Signed udp datagrams cannot be replayed: each carries its sender's id and a sequence number
under the HMAC (qlink.access), and the decoder service keeps a window per sender. Replays
captured by a plain-socket relay are refused and counted while the controller's corrections
stay bit-identical to a direct PyMatching call."""

from __future__ import annotations

import random
import select
import socket
import threading

import numpy as np
import pymatching
import pytest

from qlink import wire
from qlink.access import (DATAGRAM_TRAILER_NBYTES, DatagramSigner, ReplayGuard, datagram_sender_seq, sign_datagram,
                          verify_datagram)
from qlink.bench._lockstep import LockstepController
from qlink.qec import start_service_process
from qlink.qec.specs import build_source

pytestmark = pytest.mark.timeout(180)

SPEC = {"code": "surface_code:rotated_memory_z", "distance": 3, "rounds": 3, "p": 0.01}
TOKEN = "qlink-replay-token-0123456789"
KEY = TOKEN.encode()


@pytest.fixture(scope="module")
def code():
    src = build_source(SPEC)
    dets = np.asarray(src.sample(200, seed=5)[0], dtype=np.uint8)
    expected = pymatching.Matching.from_detector_error_model(src.dem).decode_batch(dets).astype(np.uint8)
    return src.dem, dets, expected


class _Relay:
    """A man in the middle made of two plain sockets: forwards the controller's datagrams to
    the service (keeping a copy of each, and with ``echo`` sending each a second time at once)
    and the service's answers back."""

    def __init__(self, service_addr):
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(("127.0.0.1", 0))
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.back.connect(service_addr)
        self.url = "udp://127.0.0.1:%d" % self.front.getsockname()[1]
        self.captured: list[bytes] = []
        self.echo = False
        self.echoed = 0
        self._client = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            ready, _, _ = select.select([self.front, self.back], [], [], 0.05)
            for s in ready:
                data, addr = s.recvfrom(65536)
                if s is self.front:
                    self._client = addr
                    with self._lock:
                        self.captured.append(data)
                        self.back.send(data)
                        if self.echo:
                            self.back.send(data)
                            self.echoed += 1
                elif self._client is not None:
                    self.front.sendto(data, self._client)

    def send_again(self, datagrams):
        """Replays from the relay's own address: the one the service knows the session by."""
        with self._lock:
            for d in datagrams:
                self.back.send(d)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.front.close()
        self.back.close()


def _addr(url):
    host, port = url[len("udp://"):].rsplit(":", 1)
    return host, int(port)


def test_replayed_datagrams_are_refused_and_counted_while_the_controller_stays_bit_identical(code):
    dem, dets, expected = code
    with start_service_process("udp://127.0.0.1:0", {0: {"source": SPEC}}, token=TOKEN, max_peers=1,
                               session_limits={"datagram_idle_timeout_s": 2.0}) as svc:
        relay = _Relay(_addr(svc.url))
        try:
            with LockstepController(relay.url, num_observables=dem.num_observables, token=TOKEN,
                                    timeout_s=30) as ctl:
                first = ctl.run(dets[:60])
                # every captured datagram once more, from the session's address and from a stranger's
                old = list(relay.captured)
                relay.send_again(old)
                stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                for d in old[:20]:
                    stranger.sendto(d, _addr(svc.url))
                # and every datagram of the next shots twice, the copy right behind the original
                relay.echo = True
                second = ctl.run(dets[60:120])
                relay.echo = False
                third = ctl.run(dets[120:])
                stranger.settimeout(0.3)
                with pytest.raises(socket.timeout):
                    stranger.recv(100)  # a replay gets no answer
                stranger.close()
            rep = svc.report(timeout_s=60)
        finally:
            relay.close()
    flips = np.concatenate([first[0], second[0], third[0]])
    statuses = np.concatenate([first[1], second[1], third[1]])
    np.testing.assert_array_equal(flips, expected)
    assert (statuses == 0).all()
    assert relay.echoed >= 120
    assert rep["refused_peers"] == {"replayed": len(old) + 20 + relay.echoed}
    assert rep["sessions"]["sessions_opened"] == 1  # the stranger's replays opened no session
    assert rep["sessions"]["replay_windows"] == 1


def test_an_old_sequence_number_is_refused_and_reordered_ones_within_the_window_are_taken():
    with start_service_process("udp://127.0.0.1:0", {0: {"source": SPEC}}, token=TOKEN, max_peers=1,
                               session_limits={"datagram_idle_timeout_s": 0.5, "replay_window": 64}) as svc:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.connect(_addr(svc.url))
        sock.settimeout(10)
        buf = bytearray(64)

        def signed(rid, seq):
            n = wire.encode_get_corrections_into(buf, request_id=rid, decoder_id=0, return_size=1, reset=False)
            return sign_datagram(bytes(buf[:n]), KEY, sender_id=99, seq=seq)

        def answer():
            r = wire.decode_response(sock.recv(1000))
            return r.request_id

        sock.send(signed(1, 200))
        assert answer() == 1
        sock.send(signed(2, 150))  # behind, within the window: taken
        assert answer() == 2
        sock.send(signed(3, 199))
        assert answer() == 3
        sock.send(signed(2, 150))  # the same datagram again
        sock.send(signed(4, 100))  # 100 behind the highest: past the 64-wide window
        sock.send(signed(5, 201))  # the next one: answered, and the two before were not
        assert answer() == 5
        sock.settimeout(0.3)
        with pytest.raises(socket.timeout):
            sock.recv(1000)
        sock.close()
        rep = svc.report(timeout_s=30)
    assert rep["refused_peers"] == {"replayed": 2}


def test_a_udp_service_with_a_token_refuses_the_native_engine():
    with pytest.raises(RuntimeError, match="native engine does not"):
        start_service_process("udp://127.0.0.1:0", {0: {"source": SPEC}}, token=TOKEN,
                              service_options={"engine": "native"}, start_timeout_s=60)


def test_the_replay_guard_matches_a_model_that_remembers_everything():
    """Random arrival orders (reordered, repeated, late) against a set of everything seen: a
    number is taken iff it is new and no more than ``window - 1`` behind the highest taken."""
    rng = random.Random(3)
    for window in (1, 8, 64, 1024):
        guard = ReplayGuard(window=window)
        seen: set[int] = set()
        top = 0
        for _ in range(4000):
            seq = max(1, top + rng.randint(-2 * window, 3))
            expect_ok = seq not in seen and (not seen or seq > top - window)
            got = guard.check(5, seq)
            assert (got is None) == expect_ok, (window, seq, top)
            if expect_ok:
                seen.add(seq)
                top = max(top, seq)
    far = ReplayGuard(window=64)
    assert far.check(1, 1) is None and far.check(1, 2 ** 63) is None  # a long jump, no long shift
    assert far.check(1, 2 ** 63 - 63) is None and far.check(1, 2 ** 63 - 64) == "replayed"


def test_replay_windows_are_per_sender_and_bounded():
    guard = ReplayGuard(window=16, max_senders=2)
    assert guard.check(1, 5) is None and guard.check(2, 5) is None  # each sender its own numbers
    assert guard.check(1, 5) == "replayed"
    assert guard.check(3, 1) is None  # a third sender: the least recent (2) is forgotten
    assert len(guard) == 2 and guard.evicted == 1
    with pytest.raises(ValueError, match="window"):
        ReplayGuard(window=0)
    from qlink.qec.sessions import SessionLimits

    with pytest.raises(ValueError, match="replay_window"):
        SessionLimits(replay_window=0)


def test_signed_datagrams_keep_the_frame_bytes_and_a_resend_takes_a_new_number():
    signer = DatagramSigner(KEY)
    frame = bytes(range(41))
    a, b = signer.sign(frame), signer.sign(frame)
    assert a[:41] == frame and b[:41] == frame and len(a) == 41 + DATAGRAM_TRAILER_NBYTES
    assert verify_datagram(a, len(a), KEY) == 41 and verify_datagram(b, len(b), KEY) == 41
    (sid_a, seq_a), (sid_b, seq_b) = datagram_sender_seq(a, 41), datagram_sender_seq(b, 41)
    assert sid_a == sid_b == signer.sender_id and seq_b == seq_a + 1
    forged = bytearray(a)
    forged[41 + 8] ^= 1  # a sequence number changed: the tag no longer matches
    assert verify_datagram(forged, len(forged), KEY) == -1
    assert verify_datagram(a, len(a), b"another-key-0123456") == -1
