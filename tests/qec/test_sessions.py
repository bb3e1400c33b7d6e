"""Many controllers at once against one decoder service (qlink.qec.sessions), each
bit-identical to a direct PyMatching call; decoders shared by id; who may connect."""

from __future__ import annotations

import socket
import threading
import uuid

import numpy as np
import pymatching
import pytest

from qlink.bench._lockstep import LockstepController
from qlink.qec import start_service_process
from qlink.qec.specs import build_source

pytestmark = pytest.mark.timeout(180)

SPEC = {"code": "surface_code:rotated_memory_z", "distance": 3, "rounds": 3, "p": 0.01}
TOKEN = "qlink-test-token-0123456789"


@pytest.fixture(scope="module")
def code():
    src = build_source(SPEC)
    dets = np.asarray(src.sample(600, seed=11)[0], dtype=np.uint8)
    expected = pymatching.Matching.from_detector_error_model(src.dem).decode_batch(dets).astype(np.uint8)
    return src.dem, dets, expected


def _url(scheme):
    return {"tcp": "tcp://127.0.0.1:0", "udp": "udp://127.0.0.1:0", "shm": f"shm://sessions-{uuid.uuid4().hex[:8]}",
            "ucx": "ucx://127.0.0.1:0"}[scheme]


def _run_controllers(url, dem, dets, n, *, decoder_ids=None, token=None, shots=150):
    """``n`` controllers at once, controller k decoding shots [k*shots, (k+1)*shots)."""
    out, errors = {}, []
    barrier = threading.Barrier(n)

    def one(k):
        try:
            did = 0 if decoder_ids is None else decoder_ids[k]
            with LockstepController(url, num_observables=dem.num_observables, decoder_id=did, token=token,
                                    timeout_s=30) as ctl:
                mine = dets[k * shots:(k + 1) * shots]
                first = ctl.run(mine[:1])  # answered: the service now holds this session
                barrier.wait(timeout=30)  # so all n sessions are live at once past this line
                rest = ctl.run(mine[1:])
                out[k] = tuple(np.concatenate([a, b]) for a, b in zip(first, rest))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return out


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("scheme", ["tcp", "udp", "shm", "ucx"])
def test_two_then_four_controllers_at_once_each_bit_identical(code, scheme, engine):
    if scheme == "ucx":
        pytest.importorskip("ucxx", reason="the ucx:// transport needs the optional 'ucxx' package")
    dem, dets, expected = code
    with start_service_process(_url(scheme), {0: {"source": SPEC, "decoder": "pymatching"}},
                               service_options={"engine": engine}) as svc:
        for n in (2, 4):
            out = _run_controllers(svc.url, dem, dets, n)
            for k in range(n):
                flips, statuses, _ = out[k]
                assert (statuses == 0).all()
                np.testing.assert_array_equal(flips, expected[k * 150:(k + 1) * 150])
        reports = [svc.report(timeout_s=30) for _ in range(6)]
    assert reports[-1]["sessions"]["max_live"] >= 4
    assert reports[-1]["sessions"]["ended"] == 6
    assert reports[-1]["counts"]["shots_decoded"] == 2 * 150 + 4 * 150


def test_decoders_shared_by_id_serve_controllers_on_their_own_ids(code):
    dem, dets, expected = code
    spec = {"source": SPEC, "decoder": "pymatching", "shared": True}
    with start_service_process("tcp://127.0.0.1:0", {0: spec, 1: spec}) as svc:
        out = _run_controllers(svc.url, dem, dets, 2, decoder_ids=[0, 1])
        for k in range(2):
            np.testing.assert_array_equal(out[k][0], expected[k * 150:(k + 1) * 150])
        rep = svc.report(timeout_s=30)
    assert rep["sessions"]["sessions_opened"] == 2


def test_the_native_engine_refuses_decoders_shared_between_sessions():
    spec = {"source": SPEC, "decoder": "pymatching", "shared": True}
    with pytest.raises(RuntimeError, match="shared between sessions"):
        start_service_process("tcp://127.0.0.1:0", {0: spec}, service_options={"engine": "native"},
                              start_timeout_s=60)


@pytest.mark.parametrize("engine", ["python", "native"])
def test_one_session_gets_its_own_decoder_state(code, engine):
    """Two controllers on the same decoder id, each with counter 0, 1, 2...: no counter clash."""
    dem, dets, expected = code
    with start_service_process("tcp://127.0.0.1:0", {0: {"source": SPEC, "decoder": "pymatching"}},
                               service_options={"engine": engine}) as svc:
        out = _run_controllers(svc.url, dem, dets, 2, decoder_ids=[0, 0])
        for k in range(2):
            assert (out[k][1] == 0).all()
            np.testing.assert_array_equal(out[k][0], expected[k * 150:(k + 1) * 150])


def _own_address():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # (sends nothing: picks the route's source address)
        addr = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if addr.startswith("127.") else addr


def test_a_non_loopback_bind_without_a_token_is_refused():
    from qlink.access import InsecureBindError, check_bind

    addr = _own_address()
    if addr is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    with pytest.raises(RuntimeError, match="needs a shared token"):
        start_service_process(f"tcp://{addr}:0", {0: {"source": SPEC}}, start_timeout_s=60)
    with pytest.raises(InsecureBindError):
        check_bind(f"udp://{addr}:0", token=None, insecure=False)
    check_bind("tcp://127.0.0.2:0", token=None, insecure=False)  # 127/8 is loopback
    with start_service_process(f"tcp://{addr}:0", {0: {"source": SPEC}}, insecure=True) as svc:
        assert svc.url.startswith(f"tcp://{addr}:")


def test_with_a_token_a_tcp_client_without_it_is_refused_and_counted(code):
    from qlink.errors import WireError
    import transports

    dem, dets, expected = code
    addr = _own_address() or "127.0.0.1"
    with start_service_process(f"tcp://{addr}:0", {0: {"source": SPEC}}, token=TOKEN, max_peers=1) as svc:
        with pytest.raises(WireError, match="shared token"):
            transports.connect(svc.url, timeout_s=5)
        with pytest.raises(WireError, match="not the listener's"):
            transports.connect(svc.url, timeout_s=5, token="another-token-of-the-same-size")
        with LockstepController(svc.url, num_observables=dem.num_observables, token=TOKEN) as ctl:
            flips, statuses, _ = ctl.run(dets[:40])
        np.testing.assert_array_equal(flips, expected[:40])
        rep = svc.report(timeout_s=30)
    assert rep["refused_peers"] == {"no_token": 1, "bad_token": 1}


def test_with_a_token_a_ucx_client_without_it_is_refused_and_counted(code):
    pytest.importorskip("ucxx", reason="the ucx:// transport needs the optional 'ucxx' package")
    from qlink.errors import WireError
    import transports

    dem, dets, expected = code
    with start_service_process("ucx://127.0.0.1:0", {0: {"source": SPEC}}, token=TOKEN, max_peers=1) as svc:
        with pytest.raises(WireError, match="shared token"):
            transports.connect(svc.url, timeout_s=10)
        with pytest.raises(WireError, match="not the listener's"):
            transports.connect(svc.url, timeout_s=10, token="another-token-of-the-same-size")
        with LockstepController(svc.url, num_observables=dem.num_observables, token=TOKEN, timeout_s=30) as ctl:
            flips, statuses, _ = ctl.run(dets[:40])
        np.testing.assert_array_equal(flips, expected[:40])
        assert (statuses == 0).all()
        rep = svc.report(timeout_s=30)
    assert rep["refused_peers"] == {"no_token": 1, "bad_token": 1}


def test_with_a_token_udp_datagrams_without_its_hmac_are_ignored_and_counted(code):
    from qlink import wire

    dem, dets, expected = code
    with start_service_process("udp://127.0.0.1:0", {0: {"source": SPEC}}, token=TOKEN, max_peers=1,
                               session_limits={"datagram_idle_timeout_s": 0.5}) as svc:
        host, port = svc.url[len("udp://"):].rsplit(":", 1)
        raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        raw.settimeout(0.5)
        buf = bytearray(64)
        n = wire.encode_get_corrections_into(buf, request_id=5, decoder_id=0, return_size=1, reset=True)
        for _ in range(3):
            raw.sendto(bytes(buf[:n]), (host, int(port)))
        with pytest.raises(socket.timeout):
            raw.recv(100)  # an unsigned datagram gets no answer
        raw.close()
        with LockstepController(svc.url, num_observables=dem.num_observables, token=TOKEN) as ctl:
            flips, statuses, _ = ctl.run(dets[:40])
        np.testing.assert_array_equal(flips, expected[:40])
        rep = svc.report(timeout_s=30)
    assert rep["refused_peers"] == {"udp_bad_hmac": 3}
    assert rep["sessions"]["sessions_opened"] == 1


def test_close_frames_round_trip_and_say_why():
    from qlink import wire
    from qlink.qec.sessions import CLOSE_REQUEST_ID, CloseReason, encode_close_frame, parse_close_frame

    for reason in CloseReason:
        frame = encode_close_frame(reason, "because")
        r = wire.decode_response(frame)
        assert r.request_id == CLOSE_REQUEST_ID and r.status == reason.status
        assert parse_close_frame(frame) == (reason.value, "because")
    assert parse_close_frame(b"\x00" * 30) is None


def test_session_limits_are_checked():
    from qlink.qec.sessions import SessionLimits

    with pytest.raises(ValueError, match="max_sessions"):
        SessionLimits(max_sessions=0)
    with pytest.raises(ValueError, match="frame_timeout_s"):
        SessionLimits(frame_timeout_s=-1)
    with pytest.raises(ValueError, match="max_frame_nbytes"):
        SessionLimits(max_frame_nbytes=10)
    assert SessionLimits().frame_timeout_s < 1.0


def test_a_frame_longer_than_the_derived_maximum_is_refused_over_shm(code):
    """The maximum comes from the decoders' shot size: 3128 bytes at d=3 with 1024 shots queued."""
    import transports
    from qlink.qec.sessions import parse_close_frame

    with start_service_process(_url("shm"), {0: {"source": SPEC}}, max_peers=1) as svc:
        ep = transports.connect(svc.url, timeout_s=5)
        ep.send(bytes(4000))
        reason, detail = parse_close_frame(ep.recv(timeout_s=10))
        assert reason == "oversized_frame" and "4000" in detail and "3128" in detail
        ep.close()
        rep = svc.report(timeout_s=30)
    assert rep["sessions"]["closed_by_reason"] == {"oversized_frame": 1}
    assert rep["faults"]["oversized_frame"] == 1


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_udp_sender_of_mostly_malformed_frames_gets_rationed_answers_and_others_are_served(code, engine):
    """Answers to a udp sender most of whose frames are malformed are rationed (its source
    address may be forged: the service must not reflect a flood), counted, and a
    well-behaved controller is served as before."""
    import time

    from qlink import wire
    from qlink.qec.sessions import _ABUSIVE_ANSWERS_PER_S, _BAD_GRACE

    dem, dets, expected = code
    with start_service_process("udp://127.0.0.1:0", {0: {"source": SPEC}}, max_peers=2,
                               session_limits={"datagram_idle_timeout_s": 0.5},
                               service_options={"engine": engine}) as svc:
        host, port = svc.url[len("udp://"):].rsplit(":", 1)
        raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        buf = bytearray(64)
        n = wire.encode_get_corrections_into(buf, request_id=5, decoder_id=0, return_size=1, reset=True)
        bad = bytearray(buf[:n])
        bad[4:8] = b"\xee\xee\xee\xee"  # no such function: refused with a status, request id kept
        t0 = time.monotonic()
        sent = 600
        for i in range(sent):
            raw.sendto(bytes(bad), (host, int(port)))
            time.sleep(0.001)  # (paced: about one a round of the service's, none lost in the kernel)
        time.sleep(0.3)
        elapsed_s = time.monotonic() - t0
        raw.setblocking(False)
        answers = 0
        while True:
            try:
                raw.recv(256)
                answers += 1
            except BlockingIOError:
                break
        raw.close()
        rep = svc.report(timeout_s=30)  # the garbage sender's session, ended by its idle time
        assert 0 < answers <= _BAD_GRACE + 1 + _ABUSIVE_ANSWERS_PER_S * (int(elapsed_s) + 1), answers
        counts = rep["sessions"]
        assert counts.get("udp_answers_withheld", 0) > 0, counts
        # each datagram answered, withheld or dropped, and counted: none lost silently
        assert answers + counts["udp_answers_withheld"] + counts.get("udp_dropped", 0) == sent, (answers, counts)
        with LockstepController(svc.url, num_observables=dem.num_observables) as ctl:
            flips, statuses, _ = ctl.run(dets[:40])
        np.testing.assert_array_equal(flips, expected[:40])
        assert (statuses == 0).all()
