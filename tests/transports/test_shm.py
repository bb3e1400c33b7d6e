"""shm:// specifics: the ring (C and Python, byte for byte), streaming through a small ring,
full rings, peers that die, what is left behind after a crash, permissions, and puts."""

from __future__ import annotations

import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import transports
from qlink.errors import (
    BrokenLinkError,
    ClosedError,
    MissingDependencyError,
    QlinkTimeoutError,
    RegistrationError,
    RingFullError,
    WouldBlock,
)
from qlink.memory import RemoteRegion, alloc
from transports import _ring, shm
from transports._base import BufferTooSmallError

pytestmark = pytest.mark.timeout(60)

RING_CLASSES = {"python": _ring.Ring}
if shm._ringc is not None:
    RING_CLASSES["c"] = shm._ringc.Ring
IMPLS = sorted(RING_CLASSES)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(transports.__file__)))


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """A private socket directory per test, so leftovers can be checked exactly."""
    d = tmp_path / "qlink-shm"
    monkeypatch.setenv("QLINK_SHM_DIR", str(d))
    return d


def _url(tag: str) -> str:
    return f"shm://{tag}-{os.getpid()}"


def _pair(tag: str, *, ring_impl=None, ring_nbytes=1 << 16, **kw):
    lis = shm.listen(_url(tag), ring_impl=ring_impl, **kw)
    a = shm.connect(lis.url, ring_impl=ring_impl, ring_nbytes=ring_nbytes, **kw)
    b = lis.accept(timeout_s=5)
    return lis, a, b


def _payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# ----------------------------------------------------------------------------- helpers: child processes

_PRELUDE = """
import ctypes, os, signal, sys, time
ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # die with the test process
import numpy as np
import transports
from transports import shm
from qlink.memory import alloc, RemoteRegion
"""


def _spawn(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(code), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, timeout_s: float = 20) -> str:
    try:
        out, err = p.communicate(timeout=timeout_s)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    assert p.returncode == 0, f"child failed ({p.returncode}):\n{err}"
    return out


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(5)
    for f in (p.stdout, p.stderr):
        if f:
            f.close()


def _wait_for_file(path, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


# ----------------------------------------------------------------------------- the ring


def _ring_mem(data_nbytes: int) -> np.ndarray:
    mem = np.zeros(_ring.ring_region_nbytes(data_nbytes) + 64, dtype=np.uint8)
    off = (-mem.ctypes.data) % 64
    mem = mem[off:off + _ring.ring_region_nbytes(data_nbytes)]
    _ring.init_ring(mem, data_nbytes=data_nbytes)
    return mem


def _script(ring, out, sizes, *, recv_every: int):
    """Drive one ring through a fixed sequence of sends and receives; return the messages seen."""
    seen = []
    for i, n in enumerate(sizes):
        msg = _payload(n, i)
        while True:
            r = ring.try_send_msg(msg) if i % 3 else ring.try_send(_ring.KIND_PUT_DONE, i, msg[:8], msg[8:])
            if r == _ring.SEND_OK:
                break
            assert r == _ring.SEND_FULL
            _drain_one(ring, out, seen)
        if i % recv_every == 0:
            _drain_one(ring, out, seen)
    while ring.peek() is not None:
        _drain_one(ring, out, seen)
    return seen


def _drain_one(ring, out, seen) -> None:
    n = ring.try_recv(out, 0)
    if n >= 0:
        seen.append(("msg", bytes(out[:n])))
        return
    rec = ring.peek()
    if rec is None:
        return
    kind, nbytes, aux, off = rec
    seen.append((kind, aux, bytes(ring.data[off:off + nbytes])))
    ring.consume()


@pytest.mark.parametrize("impl", IMPLS)
def test_ring_roundtrip_with_wraparound(impl):
    mem = _ring_mem(1024)
    ring = RING_CLASSES[impl](mem)
    sizes = [(i * 37) % 230 for i in range(600)]  # many laps of a 1 KiB ring, pads included
    seen = _script(ring, bytearray(256), sizes, recv_every=2)
    msgs = [s for s in seen if s[0] == "msg"]
    assert [m[1] for m in msgs] == [_payload(n, i) for i, n in enumerate(sizes) if i % 3]
    assert ring.producer_head == ring.tail > 10 * 1024  # wrapped many times
    assert ring.messages == 2 * len(msgs)  # counted once by the producer, once by the consumer


@pytest.mark.skipif(len(IMPLS) < 2, reason="the C ring accelerator is not built here")
def test_c_and_python_rings_agree_byte_for_byte():
    sizes = [(i * 53) % 240 for i in range(500)]
    mems = {}
    for impl in IMPLS:
        mems[impl] = _ring_mem(2048)
        _script(RING_CLASSES[impl](mems[impl]), bytearray(256), sizes, recv_every=3)
        mems[impl][320:328] = 0  # the producer-CPU scheduling hint, which only the C ring writes
    assert mems["c"].tobytes() == mems["python"].tobytes()


@pytest.mark.parametrize("producer", IMPLS)
@pytest.mark.parametrize("consumer", IMPLS)
def test_rings_interoperate(producer, consumer):
    mem = _ring_mem(4096)
    tx, rx = RING_CLASSES[producer](mem), RING_CLASSES[consumer](mem)
    out, got = bytearray(1024), []
    for i in range(300):
        msg = _payload(i % 200, i)
        while tx.try_send_msg(msg) != _ring.SEND_OK:
            n = rx.try_recv(out, 0)
            got.append(bytes(out[:n]))
    while (n := rx.try_recv(out, 0)) >= 0:
        got.append(bytes(out[:n]))
    assert got == [_payload(i % 200, i) for i in range(300)]


@pytest.mark.parametrize("impl", IMPLS)
def test_ring_full_writes_nothing(impl):
    mem = _ring_mem(1024)
    ring = RING_CLASSES[impl](mem)
    sent = 0
    while ring.try_send_msg(_payload(100, sent)) == _ring.SEND_OK:
        sent += 1
    head, snapshot = ring.head, mem.tobytes()
    assert ring.try_send_msg(b"x" * 100) == _ring.SEND_FULL
    assert ring.head == head and mem.tobytes() == snapshot  # a refused send leaves the ring untouched
    out = bytearray(128)
    got = []
    while (n := ring.try_recv(out, 0)) >= 0:
        got.append(bytes(out[:n]))
    assert got == [_payload(100, i) for i in range(sent)]


@pytest.mark.parametrize("impl", IMPLS)
def test_ring_limits_and_corruption(impl):
    mem = _ring_mem(1024)
    ring = RING_CLASSES[impl](mem)
    assert ring.max_payload == 1024 // 4 - 16
    assert ring.try_send_msg(bytes(ring.max_payload + 1)) == _ring.SEND_TOO_BIG
    assert ring.try_send_msg(b"abcdef") == _ring.SEND_OK
    assert ring.try_recv(bytearray(3), 0) == _ring.RECV_SLOW  # too small: stays queued
    assert ring.peek()[:3] == (_ring.KIND_MSG, 6, 6)
    out = bytearray(8)
    assert ring.try_recv(out, 0) == 6 and bytes(out[:6]) == b"abcdef"
    # a record header claiming more bytes than were published is reported, not followed
    fresh = RING_CLASSES[impl](mem)
    assert fresh.try_send_msg(b"12345678") == _ring.SEND_OK
    pos = fresh.tail & 1023
    struct.pack_into("<I", mem, _ring.HEADER_NBYTES + pos, 5000)
    assert fresh.peek()[0] == _ring.KIND_CORRUPT
    assert fresh.try_recv(out, 0) == _ring.RECV_SLOW


def test_ring_rejects_bad_memory():
    with pytest.raises(ValueError, match="power of two"):
        _ring.init_ring(bytearray(4096), data_nbytes=3000)
    for cls in RING_CLASSES.values():
        with pytest.raises(ValueError, match="magic"):
            cls(np.zeros(_ring.ring_region_nbytes(1024), dtype=np.uint8))


# ----------------------------------------------------------------------------- endpoints in one process


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", IMPLS)
def test_sizes_stream_through_a_small_ring_in_order(shm_dir, impl):
    sizes = [0, 1, 64, 1000, 4096, 65536, 1 << 20, 16 << 20]
    lis, a, b = _pair("sizes", ring_impl=impl, ring_nbytes=1 << 16)
    errors = []

    def sender():
        try:
            for i, n in enumerate(sizes):
                a.send(_payload(n, i), timeout_s=30)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    t = threading.Thread(target=sender)
    t.start()
    buf = bytearray(16 << 20)
    try:
        for i, n in enumerate(sizes):
            got = b.recv_into(buf, timeout_s=30)
            assert got == n and buf[:n] == _payload(n, i), f"message {i} of {n} bytes"
    finally:
        t.join(30)
        a.close(), b.close(), lis.close()
    assert not errors
    s = b.statistics()
    assert (s.messages_received, s.bytes_received) == (len(sizes), sum(sizes))
    assert a.statistics().messages_sent == len(sizes)


@pytest.mark.parametrize("impl", IMPLS)
def test_buffer_too_small_keeps_message(shm_dir, impl):
    lis, a, b = _pair("small", ring_impl=impl, ring_nbytes=1 << 16)
    with lis, a, b:
        a.send(b"0123456789")
        with pytest.raises(BufferTooSmallError) as e:
            b.recv_into(bytearray(4), timeout_s=1)
        assert e.value.needed_nbytes == 10
        assert b.recv(timeout_s=1) == b"0123456789"
        t = threading.Thread(target=a.send, args=(_payload(100_000, 1),), kwargs={"timeout_s": 10})
        t.start()
        with pytest.raises(BufferTooSmallError) as e:
            b.recv_into(bytearray(1000), timeout_s=5)
        assert e.value.needed_nbytes == 100_000
        buf = bytearray(100_000)
        assert b.recv_into(buf, timeout_s=5) == 100_000 and bytes(buf) == _payload(100_000, 1)
        t.join(10)


@pytest.mark.parametrize("impl", IMPLS)
def test_full_ring_send_nowait_raises_and_loses_nothing(shm_dir, impl):
    lis, a, b = _pair("full", ring_impl=impl, ring_nbytes=4096)
    with lis, a, b:
        sent = 0
        with pytest.raises(RingFullError):
            while True:
                a.send_nowait(_payload(200, sent))
                sent += 1
        assert sent > 5
        with pytest.raises(QlinkTimeoutError):
            a.send(_payload(200, 999), timeout_s=0.05)
        with pytest.raises(RingFullError, match="ring holds"):
            a.send_nowait(bytes(10_000))  # can never fit a 4 KiB ring in one go
        got = []
        while True:
            try:
                got.append(b.recv(timeout_s=0, max_nbytes=1000))
            except (WouldBlock, QlinkTimeoutError):
                break
        assert got == [_payload(200, i) for i in range(sent)]
        a.send_nowait(bytes(3000))  # multi-record message, all or nothing, fits an empty ring
        assert b.recv(timeout_s=1) == bytes(3000)
        assert a.statistics().timeouts == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_send_timeout_mid_message_is_dropped_by_receiver(shm_dir, impl):
    lis, a, b = _pair("abort", ring_impl=impl, ring_nbytes=4096)
    with lis, a, b:
        big = _payload(50_000, 3)
        with pytest.raises(QlinkTimeoutError):
            a.send(big, timeout_s=0.05)  # the ring fills after a few chunks and nobody drains it
        buf = bytearray(50_000)
        with pytest.raises(QlinkTimeoutError):
            b.recv_into(buf, timeout_s=0.05)  # takes the chunks there are, then waits in vain
        a.send(b"next")
        assert b.recv(timeout_s=1) == b"next"
        assert b.statistics().extra["aborted_messages"] == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_orderly_close_delivers_then_breaks(shm_dir, impl):
    lis, a, b = _pair("close", ring_impl=impl)
    with lis:
        for i in range(3):
            a.send(_payload(10, i))
        a.close()
        assert [b.recv(timeout_s=1) for _ in range(3)] == [_payload(10, i) for i in range(3)]
        with pytest.raises(BrokenLinkError, match="closed"):
            b.recv(timeout_s=5)
        with pytest.raises(BrokenLinkError):
            b.send(b"x")
        with pytest.raises(BrokenLinkError):
            b.recv_into_nowait(bytearray(8))
        with pytest.raises(ClosedError):
            a.send(b"x")
        with pytest.raises(ClosedError):
            a.recv_into(bytearray(8), timeout_s=0)
        a.close()  # idempotent
        b.close()
        with pytest.raises(ClosedError):
            b.wait_notification(timeout_s=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_close_from_another_thread_while_one_spins(shm_dir, impl):
    # the C ring spins without the GIL; a close meanwhile must not pull the memory from under it
    for i in range(10):
        lis, a, b = _pair(f"spinclose{i}", ring_impl=impl, spin_s=10.0)  # spin, never sleep
        got = []

        def waiter():
            try:
                b.recv_into(bytearray(64), timeout_s=10)
            except Exception as e:  # checked below
                got.append(e)

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.02)
        b.close()
        t.join(10)
        assert not t.is_alive() and len(got) == 1 and isinstance(got[0], ClosedError), got
        a.close(), lis.close()


def test_threads_of_one_process_share_the_cpu_while_spinning(shm_dir):
    # an echo thread and the main thread ping-pong on two endpoints of one process: each
    # receive spins (the C ring without the GIL), yet both threads keep making progress
    lis, a, b = _pair("threads", spin_s=10.0)

    def echo():
        buf = bytearray(64)
        for _ in range(300):
            n = b.recv_into(buf, timeout_s=10)
            b.send(memoryview(buf)[:n], timeout_s=10)

    t = threading.Thread(target=echo)
    t.start()
    try:
        for i in range(300):
            a.send(i.to_bytes(4, "little"), timeout_s=10)
            assert a.recv(timeout_s=10) == i.to_bytes(4, "little")
    finally:
        t.join(20)
        a.close(), b.close(), lis.close()


def test_mixed_ring_implementations_talk(shm_dir):
    if len(IMPLS) < 2:
        pytest.skip("the C ring accelerator is not built here")
    with shm.listen(_url("mixed"), ring_impl="python") as lis:
        a = shm.connect(lis.url, ring_impl="c", ring_nbytes=1 << 12)
        b = lis.accept(timeout_s=5)
        with a, b:
            assert (a.statistics().extra["ring_impl"], b.statistics().extra["ring_impl"]) == ("c", "python")
            t = threading.Thread(target=lambda: [a.send(_payload(n, n)) for n in (5, 5000, 50)])
            t.start()
            assert [b.recv(timeout_s=5) for _ in range(3)] == [_payload(n, n) for n in (5, 5000, 50)]
            t.join(5)
            b.send(b"back")
            assert a.recv(timeout_s=1) == b"back"


def test_ring_implementation_choice(shm_dir, monkeypatch):
    assert shm.ring_impls()[-1] == "python"
    monkeypatch.setattr(shm, "_ringc", None)  # as if the C accelerator had not been built
    assert shm.ring_impls() == ["python"]
    with pytest.raises(MissingDependencyError, match="build_ext"):
        shm.connect(_url("noc"), ring_impl="c")
    lis, a, b = _pair("noc")  # the default falls back to the Python ring
    with lis, a, b:
        assert a.statistics().extra["ring_impl"] == "python"
        a.send(b"still works")
        assert b.recv(timeout_s=1) == b"still works"


def test_a_stale_c_accelerator_is_not_used(shm_dir):
    """A _ringc built from an older source (no one-sided fast path) is set aside for the Python ring."""
    code = textwrap.dedent("""
        import sys, types
        stale = types.ModuleType("transports._ringc")
        stale.Ring = type("Ring", (), {})  # what an old build had: a ring without set_pulled, no make_note
        sys.modules["transports._ringc"] = stale
        import numpy as np
        from transports import shm
        from qlink.memory import alloc
        assert shm.ring_impls() == ["python"], shm.ring_impls()
        lis = shm.listen(sys.argv[1])
        a = shm.connect(lis.url, timeout_s=5)
        b = lis.accept(timeout_s=5)
        region = b.register(alloc(64, dtype=np.uint8))
        a.put_many(b"abcd", region.descriptor(), [0], [8], [4], notify_id=1)
        assert b.wait_notification(timeout_s=5).notify_id == 1
        print(a.statistics().extra["ring_impl"])
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, _url("stale")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "python"


def test_url_and_option_errors(shm_dir):
    with pytest.raises(ValueError, match="name"):
        shm.listen("shm://bad/name")
    with pytest.raises(ValueError, match="name"):
        shm.listen("shm://")
    with pytest.raises(ValueError):
        shm.connect("tcp://x")
    with pytest.raises(BrokenLinkError, match="nobody listens"):
        shm.connect(_url("nobody"), timeout_s=1)
    with shm.listen(_url("twice")) as lis:
        with pytest.raises(OSError, match="already listening"):
            shm.listen(lis.url)
        with pytest.raises(ValueError, match="power of two"):
            shm.connect(lis.url, ring_nbytes=5000)
        with pytest.raises(ValueError, match="ring_impl"):
            shm.connect(lis.url, ring_impl="fortran")
        with pytest.raises(QlinkTimeoutError):
            lis.accept(timeout_s=0.01)
    with pytest.raises(ClosedError):
        lis.accept(timeout_s=0)
    assert transports.capabilities("shm").one_sided and not transports.capabilities("shm").cross_host


def test_listener_survives_junk_connections(shm_dir):
    with shm.listen(_url("junk")) as lis:
        for payload in (b"", b"hello, not a qlink peer", struct.pack("<8sIIQQ", b"QLSHMHI1", 1, 4096, 1 << 16, 1)):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(lis.path)
            if payload:
                s.send(payload)
            s.close()
        good = shm.connect(lis.url)
        ep = lis.accept(timeout_s=5)
        with good, ep:
            good.send(b"ok")
            assert ep.recv(timeout_s=1) == b"ok"
        assert lis.rejected == 3


def test_permissions_are_owner_only(shm_dir):
    shm_dir.mkdir(mode=0o755)
    os.chmod(shm_dir, 0o755)  # an existing, too open directory is tightened
    with shm.listen(_url("perm")) as lis:
        assert stat.S_IMODE(os.stat(shm_dir).st_mode) == 0o700
        st = os.stat(lis.path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
    assert not os.path.exists(lis.path)


# ----------------------------------------------------------------------------- puts in one process


@pytest.mark.parametrize("impl", IMPLS)
def test_put_inline_into_plain_numpy_memory(shm_dir, impl):
    lis, a, b = _pair("inline", ring_impl=impl, ring_nbytes=4096)
    with lis, a, b:
        target = np.zeros(20_000, dtype=np.uint8)  # not alloc() memory: the target applies the bytes
        region = b.register(target)
        data = _payload(10_000, 7)
        t = threading.Thread(target=a.put, args=(data, region.descriptor().to_bytes()),
                             kwargs={"offset": 5000, "notify_id": 42, "tag": b"kv", "timeout_s": 10})
        t.start()
        note = b.wait_notification(timeout_s=10)
        t.join(10)
        assert (note.region_id, note.offset, note.nbytes, note.notify_id, note.tag) == (region.region_id, 5000,
                                                                                      10_000, 42, b"kv")
        assert target[5000:15000].tobytes() == data and not target[:5000].any() and not target[15000:].any()
        assert a.statistics().extra["inline_puts"] == 1 and a.statistics().extra["zero_copy_puts"] == 0
        assert (a.statistics().puts, a.statistics().put_bytes, b.statistics().notifications) == (1, 10_000, 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_put_zero_copy_into_alloc_memory(shm_dir, impl):
    lis, a, b = _pair("zc", ring_impl=impl)
    with lis, a, b:
        block = alloc(4096, dtype=np.uint8)
        target = block[1024:3072]  # a region inside a larger alloc() block
        region = b.register(target)
        a.put(b"\x07" * 100, region.descriptor(), offset=10, notify_id=1)
        assert (target[10:110] == 7).all()  # landed before the target did anything
        note = b.wait_notification(timeout_s=1)
        assert (note.offset, note.nbytes, note.notify_id) == (10, 100, 1)
        assert a.statistics().extra["zero_copy_puts"] == 1 and a.statistics().extra["inline_puts"] == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_puts_raise_registration_error_and_write_nothing(shm_dir, impl):
    lis, a, b = _pair("badput", ring_impl=impl)
    with lis, a, b:
        target = alloc(256, dtype=np.uint8)
        region = b.register(target)
        desc = region.descriptor()
        bad = [
            dict(offset=200, data=bytes(100)),  # past the end
            dict(offset=-1, data=bytes(1)),
            dict(remote=RemoteRegion(region_id=desc.region_id + 4096, nbytes=256, key=desc.key)),  # unknown id
            dict(remote=RemoteRegion(region_id=desc.region_id, nbytes=512, key=desc.key)),  # wrong size
            dict(remote=RemoteRegion(region_id=desc.region_id, nbytes=256, key=b"another connection")),
        ]
        for case in bad:
            with pytest.raises(RegistrationError):
                a.put(case.get("data", b"\x01"), case.get("remote", desc), offset=case.get("offset", 0))
        own = a.register(np.zeros(8, dtype=np.uint8))
        with pytest.raises(RegistrationError, match="not issued by this connection's peer"):
            a.put(b"x", own.descriptor())  # a's own region is not a target at the peer
        with pytest.raises(ValueError, match="tag"):
            a.put(b"x", desc, tag=bytes(300))
        b.deregister(region)
        with pytest.raises(RegistrationError, match="not registered"):
            a.put(b"\x01", desc)
        with pytest.raises(RegistrationError):
            b.deregister(region)
        assert not target.any()
        with pytest.raises(WouldBlock):
            b.poll_notification_nowait()
        assert a.statistics().puts == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_messages_and_notifications_share_the_ring(shm_dir, impl):
    lis, a, b = _pair("mix", ring_impl=impl)
    with lis, a, b:
        plain = np.zeros(16, dtype=np.uint8)
        r = b.register(plain)
        a.send(b"m1")
        a.put(b"\x05", r.descriptor(), offset=3, notify_id=1)
        a.send(_payload(40_000, 2))  # streamed: several records
        a.put(b"\x06", r.descriptor(), offset=4, notify_id=2)
        a.send(b"m3")
        # notifications first: the messages in front of and between them are kept aside
        assert [b.wait_notification(timeout_s=1).notify_id for _ in range(2)] == [1, 2]
        assert plain[3] == 5 and plain[4] == 6
        assert b.recv(timeout_s=1) == b"m1"
        assert b.recv(timeout_s=1) == _payload(40_000, 2)
        assert b.recv(timeout_s=1) == b"m3"
        # and the other way round: a receive moves a notification aside
        a.put(b"\x09", r.descriptor(), offset=0, notify_id=3)
        a.send(b"m4")
        assert b.recv(timeout_s=1) == b"m4"
        assert b.poll_notification_nowait().notify_id == 3
        assert b.statistics().extra["queued_messages"] == 2  # m1 and the streamed one; m4 went straight out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["alloc", "numpy"])
def test_put_many_lands_every_piece_then_one_notification(shm_dir, impl, kind):
    lis, a, b = _pair(f"pm-{kind}", ring_impl=impl, ring_nbytes=1 << 14)
    with lis, a, b:
        target = alloc(1 << 16, dtype=np.uint8) if kind == "alloc" else np.zeros(1 << 16, dtype=np.uint8)
        region = b.register(target)
        src = np.frombuffer(_payload(1 << 15, 3), dtype=np.uint8)
        so = np.array([0, 5000, 100, 20000], dtype=np.int64)
        do = np.array([40000, 7, 300, 9000], dtype=np.int64)
        ln = np.array([6000, 64, 0, 12000], dtype=np.int64)  # 12000 B: more than one record of this ring
        out = []
        t = threading.Thread(target=lambda: out.append(a.put_many(src, region.descriptor(), so, do, ln, notify_id=8,
                                                                   tag=b"layer", timeout_s=10)))
        t.start()  # numpy targets are written by b as it progresses: a may wait for ring space
        note = b.wait_notification(timeout_s=10)
        t.join(10)
        assert out == [1] and a.put_many_gathers
        expected = np.zeros_like(target)
        for s_, d_, n_ in zip(so, do, ln):
            expected[d_:d_ + n_] = src[s_:s_ + n_]
        assert np.array_equal(target, expected)
        assert (note.region_id, note.offset, note.nbytes, note.notify_id, note.tag) == (
            region.region_id, 7, 46000 - 7, 8, b"layer")  # the smallest range covering every piece
        with pytest.raises(WouldBlock):
            b.poll_notification_nowait()  # one notification, not one per piece
        st = a.statistics()
        assert (st.puts, st.put_bytes, st.extra["gathered_puts"]) == (4, int(ln.sum()), 1)
        assert st.extra["zero_copy_puts" if kind == "alloc" else "inline_puts"] == 4
        assert b.statistics().notifications == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_put_many_takes_any_integer_sequences_and_checks_before_writing(shm_dir, impl):
    lis, a, b = _pair("pm-bad", ring_impl=impl)
    with lis, a, b:
        target = alloc(1024, dtype=np.uint8)
        region = b.register(target)
        desc = region.descriptor()
        src = bytes(range(256))
        assert a.put_many(src, desc, [0, 16], [100, 0], [16, 4], notify_id=2) == 1  # lists, not arrays
        note = b.wait_notification(timeout_s=1)
        assert (note.offset, note.nbytes, note.notify_id) == (0, 116, 2)
        assert target[100:116].tobytes() == src[:16] and target[:4].tobytes() == src[16:20]
        target[:] = 0
        bad = [
            (ValueError, "one length", ([0, 1], [0], [1])),
            (ValueError, "one length", ([], [], [])),
            (ValueError, "inside the 256-byte source", ([250], [0], [16])),
            (ValueError, "inside the 256-byte source", ([-1], [0], [1])),
            (ValueError, "inside the 256-byte source", ([0], [0], [-1])),
            (RegistrationError, "piece 1", ([0, 0], [0, 1020], [4, 8])),  # the second piece is past the end
            (RegistrationError, "piece 0", ([0], [-4], [4])),
            (TypeError, "integers", ([0.5], [0], [1])),
        ]
        for exc, match, (so, do, ln) in bad:
            with pytest.raises(exc, match=match):
                a.put_many(src, desc, np.asarray(so, dtype=np.int64) if exc is not TypeError else so, do, ln)
        with pytest.raises(ValueError, match="tag"):
            a.put_many(src, desc, [0], [0], [1], tag=bytes(300))
        with pytest.raises(ValueError, match="notify_id"):
            a.put_many(src, desc, [0], [0], [1], notify_id=-1)
        assert not target.any()
        with pytest.raises(WouldBlock):
            b.poll_notification_nowait()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_put_after_the_target_deregistered_is_refused_even_when_puts_went_there_before(shm_dir, impl):
    """The C path keeps mapped regions by descriptor: a deregistration must still stop it."""
    lis, a, b = _pair("re-dereg", ring_impl=impl)
    with lis, a, b:
        target = alloc(64, dtype=np.uint8)
        region = b.register(target)
        desc = region.descriptor()
        for i in range(3):  # the first maps the region, the next ones take the C path
            a.put(b"\x01", desc, offset=i, notify_id=i)
            a.put_many(b"\x02\x03", desc, np.array([0, 1]), np.array([10 + i, 20 + i]), np.array([1, 1]))
        assert [b.wait_notification(timeout_s=1).notify_id for _ in range(6)] == [0, 0, 1, 0, 2, 0]
        b.deregister(region)
        target[:] = 0
        with pytest.raises(RegistrationError, match="not registered"):
            a.put(b"\x01", desc)
        with pytest.raises(RegistrationError, match="not registered"):
            a.put_many(b"\x01", desc, np.array([0]), np.array([0]), np.array([1]))
        again = b.register(target)  # same memory, new id: the old descriptor stays refused
        with pytest.raises(RegistrationError):
            a.put(b"\x01", desc)
        a.put(b"\x04", again.descriptor(), offset=5)
        assert target[5] == 4 and target.sum() == 4
        assert b.wait_notification(timeout_s=1).region_id == again.region_id


@pytest.mark.parametrize("impl", IMPLS)
def test_notifications_are_plain_frozen_notifications(shm_dir, impl):
    from transports import Notification

    lis, a, b = _pair("note", ring_impl=impl)
    with lis, a, b:
        target = alloc(64, dtype=np.uint8)
        region = b.register(target)
        for i in range(2):
            a.put(b"ab", region.descriptor(), offset=3, notify_id=(1 << 64) - 1, tag=b"t" * 256)
        notes = [b.wait_notification(timeout_s=1), b.poll_notification_nowait()]
        want = Notification(region_id=region.region_id, offset=3, nbytes=2, notify_id=(1 << 64) - 1, tag=b"t" * 256)
        for note in notes:
            assert type(note) is Notification and note == want and hash(note) == hash(want) and repr(note) == repr(want)
            with pytest.raises(AttributeError):
                note.offset = 4
        assert b.statistics().notifications == 2


def test_put_records_that_name_no_region_here_are_counted_not_delivered(shm_dir):
    """A PUT_DONE for a region this side does not have (deregistered after the put) is dropped and counted."""
    lis, a, b = _pair("stale-note")
    with lis, a, b:
        target = alloc(64, dtype=np.uint8)
        region = b.register(target)
        a.put(b"x", region.descriptor(), notify_id=1)
        a.put(b"y", region.descriptor(), notify_id=2)
        b.deregister(region)
        with pytest.raises(WouldBlock):
            b.poll_notification_nowait()
        assert b.statistics().extra["bad_records"] == 2 and b.statistics().notifications == 0


def _pieces_of(n: int, piece: int, seed: int):
    """n scattered pieces of ``piece`` bytes: sources and destinations both shuffled."""
    rng = np.random.default_rng(seed)
    return (rng.permutation(n).astype(np.int64) * piece, rng.permutation(n).astype(np.int64) * piece,
            np.full(n, piece, dtype=np.int64))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["alloc", "numpy"])
def test_deferred_put_many_is_pulled_by_the_target(shm_dir, impl, kind):
    lis, a, b = _pair(f"pull-{kind}", ring_impl=impl)
    with lis, a, b:
        target = alloc(1 << 16, dtype=np.uint8) if kind == "alloc" else np.zeros(1 << 16, dtype=np.uint8)
        region = b.register(target)
        source = alloc(1 << 16, dtype=np.uint8)
        source[:] = np.frombuffer(_payload(1 << 16, 4), dtype=np.uint8)
        a.register(source)
        so, do, ln = _pieces_of(64, 1024, 1)
        for rep in range(3):  # the first goes through Python (maps the source), later ones through C
            target[:] = 0
            assert a.put_many(source[1024:], region.descriptor(), so[:63], do[:63], ln[:63], notify_id=rep,
                              tag=b"L", defer=True) == 1
            assert not target.any()  # nothing moved yet: the target copies when it progresses
            with pytest.raises(QlinkTimeoutError):
                a.flush(timeout_s=0.01)
            note = b.wait_notification(timeout_s=5)
            assert (note.region_id, note.notify_id, note.tag) == (region.region_id, rep, b"L")
            assert (note.offset, note.nbytes) == (int(do[:63].min()), int((do[:63] + 1024).max() - do[:63].min()))
            expected = np.zeros_like(target)
            for s_, d_ in zip(so[:63], do[:63]):
                expected[d_:d_ + 1024] = source[1024 + s_:1024 + s_ + 1024]
            assert np.array_equal(target, expected)
            a.flush(timeout_s=5)  # the target has pulled it: the source may change now
        st, bt = a.statistics(), b.statistics()
        assert (st.extra["deferred_puts"], st.puts, st.put_bytes) == (3, 3 * 63, 3 * 63 * 1024)
        assert bt.extra["pulled_bytes"] == 3 * 63 * 1024 and bt.notifications == 3
        # a source this side did not register cannot be pulled: the copy is made at once
        plain = np.frombuffer(_payload(4096, 5), dtype=np.uint8).copy()
        target[:] = 0
        a.put_many(plain, region.descriptor(), [0], [100], [4096], defer=True)
        if kind == "alloc":
            assert target[100:4196].tobytes() == plain.tobytes()  # landed before the target looked
        b.wait_notification(timeout_s=5)
        assert target[100:4196].tobytes() == plain.tobytes()
        assert a.statistics().extra["deferred_puts"] == 3
        a.flush(timeout_s=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_receive_that_meets_deferred_puts_carries_them_out(shm_dir, impl):
    """recv() looking for a message past PUT_PULL records copies them (in C once mapped) and
    keeps their notifications for wait_notification."""
    lis, a, b = _pair("pull-recv", ring_impl=impl)
    with lis, a, b:
        target = alloc(1 << 16, dtype=np.uint8)
        region = b.register(target)
        source = alloc(1 << 16, dtype=np.uint8)
        source[:] = np.frombuffer(_payload(1 << 16, 9), dtype=np.uint8)
        a.register(source)
        for rep in range(3):
            for k in range(4):
                a.put_many(source, region.descriptor(), [k * 4096], [k * 4096 + 8], [4096], notify_id=k, defer=True)
            a.send(b"after the puts")
            assert b.recv(timeout_s=5) == b"after the puts"
            assert target[8:8 + 4 * 4096].tobytes() == source[:4 * 4096].tobytes()
            assert [b.poll_notification_nowait().notify_id for _ in range(4)] == [0, 1, 2, 3]
            a.flush(timeout_s=5)
        python_pulled = b._x["pulled_bytes"]  # what the Python path copied (the C path counts apart)
        assert python_pulled == (3 * 4 * 4096 if impl == "python" else 4096)  # C: all but the first, which maps
        assert b.statistics().extra["pulled_bytes"] == 3 * 4 * 4096
        assert b.statistics().notifications == 3 * 4  # each counted once, wherever it was carried out


@pytest.mark.parametrize("impl", IMPLS)
def test_a_nowait_receive_hands_back_each_completed_put_before_the_message(shm_dir, impl):
    """recv_into_nowait that meets deferred puts carries out one put, then raises WouldBlock
    so the caller sees that completion at once (a KV receiver stamps a layer ready when it
    sees its notification); the message behind the puts comes once they are all done."""
    lis, a, b = _pair("pull-nowait", ring_impl=impl)
    with lis, a, b:
        target = alloc(1 << 16, dtype=np.uint8)
        region = b.register(target)
        source = alloc(1 << 16, dtype=np.uint8)
        source[:] = np.frombuffer(_payload(1 << 16, 4), dtype=np.uint8)
        a.register(source)
        for k in range(4):
            a.put_many(source, region.descriptor(), [k * 4096], [k * 4096], [4096], notify_id=k, defer=True)
        a.send(b"after the puts")
        buf = bytearray(64)
        seen, got = [], None
        deadline = time.monotonic() + 5
        while got is None and time.monotonic() < deadline:
            try:
                got = bytes(buf[:b.recv_into_nowait(buf)])
            except WouldBlock:
                while True:
                    try:
                        note = b.poll_notification_nowait()
                    except WouldBlock:
                        break
                    # this put's bytes have landed; the later ones have not been carried out yet
                    assert target[note.notify_id * 4096:(note.notify_id + 1) * 4096].tobytes() == \
                        source[note.notify_id * 4096:(note.notify_id + 1) * 4096].tobytes()
                    later = note.notify_id + 1
                    if later < 4:
                        assert not target[later * 4096:(later + 1) * 4096].any()
                    seen.append(note.notify_id)
        assert got == b"after the puts"
        assert seen == [0, 1, 2, 3]  # every completion handed back before the message
        a.flush(timeout_s=5)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_deferred_put_larger_than_a_record_is_one_notification(shm_dir, impl):
    lis, a, b = _pair("pull-big", ring_impl=impl, ring_nbytes=1 << 12)  # ~40 pieces per record
    with lis, a, b:
        target = np.zeros(1 << 18, dtype=np.uint8)
        region = b.register(target)
        source = alloc(1 << 18, dtype=np.uint8)
        source[:] = np.frombuffer(_payload(1 << 18, 6), dtype=np.uint8)
        a.register(source)
        so, do, ln = _pieces_of(1024, 256, 2)
        t = threading.Thread(target=a.put_many, args=(source, region.descriptor(), so, do, ln),
                             kwargs={"notify_id": 9, "defer": True, "timeout_s": 10})
        t.start()  # the ring holds a few records at a time: the target makes room as it pulls
        note = b.wait_notification(timeout_s=10)
        t.join(10)
        a.flush(timeout_s=5)
        assert (note.offset, note.nbytes, note.notify_id) == (0, 1 << 18, 9)
        expected = np.empty_like(target)
        for s_, d_ in zip(so, do):
            expected[d_:d_ + 256] = source[s_:s_ + 256]
        assert np.array_equal(target, expected)
        with pytest.raises(WouldBlock):
            b.poll_notification_nowait()


def _stream_kinds():
    if shm._ringc is None:
        return ["python"]
    kinds = []
    for kind in ("avx512", "avx2", "sse2", "memcpy"):
        try:
            shm._ringc.set_stream_copy(kind)
            kinds.append(kind)
        except ValueError:  # this CPU does not have it
            pass
    shm._ringc.set_stream_copy(None)
    return kinds + ["python"]


@pytest.fixture(params=_stream_kinds())
def stream_kind(request):
    if request.param == "python":
        yield "python"
        return
    before = shm._ringc.set_stream_copy(request.param)
    yield "c"
    shm._ringc.set_stream_copy(before)


def test_a_large_deferred_put_with_odd_sizes_and_offsets_lands_exactly(shm_dir, stream_kind):
    """Past 1 MiB the target copies with the kind set (streaming stores, memcpy): unaligned starts
    and ragged tails too."""
    lis, a, b = _pair("pull-odd", ring_impl=stream_kind)
    with lis, a, b:
        nbytes = 4 << 20
        target = alloc(nbytes, dtype=np.uint8)
        region = b.register(target)
        source = alloc(nbytes, dtype=np.uint8)
        source[:] = np.frombuffer(_payload(nbytes, 8), dtype=np.uint8)
        a.register(source)
        rng = np.random.default_rng(3)
        ln = rng.integers(1, 9000, 300).astype(np.int64)
        ln[:4] = [1, 63, 64, 255]  # below and around the streamed minimum
        slots = rng.permutation(nbytes // 10000)[:300].astype(np.int64) * 10000  # non-overlapping destinations
        do = slots + rng.integers(0, 900, 300)
        so = rng.integers(0, nbytes - 9000, 300).astype(np.int64)
        assert ln.sum() >= 1 << 20  # streamed in C
        for rep in range(2):  # Python, then C
            target[:] = 0
            a.put_many(source, region.descriptor(), so, do, ln, notify_id=rep, defer=True)
            b.wait_notification(timeout_s=10)
            expected = np.zeros_like(target)
            for s_, d_, n_ in zip(so, do, ln):
                expected[d_:d_ + n_] = source[s_:s_ + n_]
            assert np.array_equal(target, expected)
        a.flush(timeout_s=5)


@pytest.mark.skipif(shm._ringc is None, reason="the C ring (transports._ringc) is not built")
def test_auto_copy_tries_memcpy_and_streaming_then_keeps_landing_bytes_exactly(shm_dir):
    """Kind "auto" (the default) copies large pulls with memcpy and with the streaming copy, times
    both on the pulls themselves, and goes on with the faster; every byte lands either way."""
    before = shm._ringc.set_stream_copy("auto")
    try:
        assert shm._ringc.set_stream_copy("auto") == "auto"
        kind, _, _, n_memcpy0, n_streamed0 = shm._ringc.pull_copy()
        assert kind == "auto"
        lis, a, b = _pair("pull-auto", ring_nbytes=1 << 20)
        with lis, a, b:
            nbytes = 3 << 20
            target = alloc(nbytes, dtype=np.uint8)
            region = b.register(target)
            source = alloc(nbytes, dtype=np.uint8)
            a.register(source)
            rng = np.random.default_rng(5)
            k = 40
            ln = np.full(k, 40000, dtype=np.int64) + rng.integers(0, 64, k)  # > 1 MiB in all, ragged sizes
            so = rng.permutation(nbytes // 50000)[:k].astype(np.int64) * 50000 + 3
            do = rng.permutation(nbytes // 50000)[:k].astype(np.int64) * 50000 + 17
            for rep in range(6):  # the first is pulled in Python (the source is mapped then), the rest in C
                source[:] = np.frombuffer(_payload(nbytes, rep), dtype=np.uint8)
                target[:] = 0
                a.put_many(source, region.descriptor(), so, do, ln, notify_id=rep, defer=True)
                assert b.wait_notification(timeout_s=10).notify_id == rep
                a.flush(timeout_s=5)
                expected = np.zeros_like(target)
                for s_, d_, n_ in zip(so, do, ln):
                    expected[d_:d_ + n_] = source[s_:s_ + n_]
                assert np.array_equal(target, expected)
        kind, memcpy_GBps, streamed_GBps, n_memcpy, n_streamed = shm._ringc.pull_copy()
        assert n_memcpy > n_memcpy0 and n_streamed > n_streamed0  # both were tried
        assert memcpy_GBps > 0 and streamed_GBps > 0
    finally:
        shm._ringc.set_stream_copy(before)


def _mapped_pull_regions(a, b, *, fill: int, nbytes: int):
    """A 4 KiB target registered on ``b`` and a source (all ``fill``) on ``a``, mapped at both
    ends by one deferred put of ``nbytes`` (later records may take the C path); the target
    is zeroed again. Returns ``(target, region, source, home)``."""
    target = alloc(4096, dtype=np.uint8)
    region = b.register(target)
    source = alloc(4096, dtype=np.uint8)
    source[:] = fill
    home = a.register(source)
    a.put_many(source, region.descriptor(), [0], [0], [nbytes], notify_id=1, defer=True)
    b.wait_notification(timeout_s=5)
    target[:] = 0
    return target, region, source, home


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gone", ["target region", "source region"])
def test_a_deferred_put_whose_region_went_away_is_dropped_and_flush_returns(shm_dir, impl, gone):
    lis, a, b = _pair(f"pull-gone-{gone[0]}", ring_impl=impl)
    with lis, a, b:
        target, region, source, home = _mapped_pull_regions(a, b, fill=7, nbytes=64)
        a.put_many(source, region.descriptor(), [0], [0], [64], notify_id=2, defer=True)
        if gone == "target region":
            b.deregister(region)
        else:
            a.deregister(home)
        with pytest.raises(WouldBlock):
            b.poll_notification_nowait()  # the record is consumed and counted, nothing is written
        assert not target.any() and b.statistics().extra["bad_records"] == 1
        a.flush(timeout_s=5)  # the target is done with it either way


@pytest.mark.parametrize("impl", IMPLS)
def test_forged_pull_records_are_counted_and_write_nothing(shm_dir, impl):
    """A peer's PUT_PULL records are checked against both regions before a byte is copied."""
    pull = struct.Struct("<IIIIQQQQII")
    lis, a, b = _pair("pull-forged", ring_impl=impl)
    with lis, a, b:
        target, region, source, home = _mapped_pull_regions(a, b, fill=9, nbytes=16)
        rid, sid = region.region_id, home.region_id

        def forge(pieces, *, dst=rid, src=sid, k=None, span=(0, 16), extra=b""):
            body = np.asarray(pieces, dtype="<u8").tobytes() + extra
            head = pull.pack(dst, src, len(pieces) if k is None else k, 0, 7, 99, span[0], span[1], 1, 0)
            assert a._tx.try_send(_ring.KIND_PUT_PULL, 0, head, body) == _ring.SEND_OK

        forge([[(1 << 64) - 8, 0, 16]])  # source offset wraps
        forge([[0, (1 << 63) + 5, 16]])  # destination far out
        forge([[0, 4090, 16]])  # destination past the end
        forge([[4090, 0, 16]])  # source past the end
        forge([[0, 0, 16]], k=2)  # piece count disagrees with the record length
        forge([[0, 0, 16]], extra=b"x")  # trailing garbage
        forge([[0, 0, 16]], dst=rid + 4096)  # no such target region
        forge([[0, 0, 16]], src=sid + 4096)  # no such source region
        forge([[0, 0, 16]], span=(4000, 200))  # the notification would name bytes outside the region
        with pytest.raises(WouldBlock):
            b.poll_notification_nowait()
        assert b.statistics().extra["bad_records"] == 9 and not target.any()
        a.put_many(source, region.descriptor(), [0], [8], [8], notify_id=2, defer=True)  # still works
        assert b.wait_notification(timeout_s=5).notify_id == 2 and target[8:16].tolist() == [9] * 8


_DEFER_THEN_DIE = """
url = sys.argv[1]
ep = shm.connect(url, timeout_s=10)
remote = RemoteRegion.from_bytes(ep.recv(timeout_s=10))
source = alloc(1 << 20, dtype=np.uint8)
source[:] = np.arange(1 << 20) % 241
ep.register(source)
ep.put_many(source, remote, np.array([4096, 0]), np.array([0, 100000]), np.array([50000, 4096]), notify_id=3,
            tag=b"last words", defer=True)
os.kill(os.getpid(), signal.SIGKILL)  # gone before the target has even mapped the source
"""


@pytest.mark.timeout(60)
def test_a_deferred_put_outlives_its_sigkilled_initiator(shm_dir):
    with shm.listen(_url("pull-die")) as lis:
        p = _spawn(_DEFER_THEN_DIE, lis.url)
        try:
            ep = lis.accept(timeout_s=20)
            with ep:
                target = alloc(1 << 18, dtype=np.uint8)
                ep.send(ep.register(target).descriptor().to_bytes())
                p.wait(20)  # dead before anything was pulled
                note = ep.wait_notification(timeout_s=10)
                assert (note.notify_id, note.tag, note.offset, note.nbytes) == (3, b"last words", 0, 104096)
                pattern = (np.arange(1 << 20) % 241).astype(np.uint8)
                assert np.array_equal(target[:50000], pattern[4096:54096])
                assert np.array_equal(target[100000:104096], pattern[:4096])
                assert ep.statistics().extra["pulled_bytes"] == 54096  # this side copied them, after the death
                with pytest.raises(BrokenLinkError):
                    ep.wait_notification(timeout_s=10)
        finally:
            _kill(p)


def test_memfds_handed_over_are_bounded_and_puts_still_land(shm_dir):
    """Each alloc() region registered hands its memfd to the peer; the peer keeps a bounded number
    unmapped (then maps through /proc), so a peer registering many regions cannot exhaust our fds."""
    from transports._shm_regions import MAX_OFFERED_FDS

    lis, a, b = _pair("many-fds")
    with lis, a, b:
        targets = [alloc(64, dtype=np.uint8) for _ in range(MAX_OFFERED_FDS + 20)]
        regions = [b.register(t) for t in targets]
        for i in (0, len(regions) // 2, len(regions) - 1):
            a.put(bytes([i % 251 + 1]) * 8, regions[i].descriptor(), offset=8, notify_id=i)
            assert b.wait_notification(timeout_s=5).notify_id == i
            assert targets[i][8:16].tolist() == [i % 251 + 1] * 8
        assert len(a._peer._offered) <= MAX_OFFERED_FDS
        assert a.statistics().extra["zero_copy_puts"] == 3 and a.statistics().extra["zero_copy_unavailable"] == 0


@pytest.mark.timeout(60)
def test_endpoints_dropped_without_close_are_collected(shm_dir):
    """The C path holds buffers of the connection's tables and of mapped regions: an endpoint left to
    the garbage collector (in a reference cycle, after puts) must be freed without harm."""
    import gc

    for i in range(5):
        lis, a, b = _pair(f"gc{i}")
        region = b.register(alloc(4096, dtype=np.uint8))
        a.put(b"x" * 100, region.descriptor())
        a.put_many(b"y" * 8, region.descriptor(), np.array([0]), np.array([200]), np.array([8]))
        b.wait_notification(timeout_s=1)
        a.loop, b.loop = a, b
        try:
            raise RuntimeError("a traceback whose frames hold both endpoints")
        except RuntimeError as e:
            a.err = e
        del a, b, region
        lis.close()
        gc.collect()


# ----------------------------------------------------------------------------- other processes

_ECHO_PUT_TARGET = """
url, kind = sys.argv[1], sys.argv[2]
ep = shm.connect(url, timeout_s=10, ring_nbytes=1 << 16)
target = alloc(1 << 20, dtype=np.uint8) if kind == "alloc" else np.zeros(1 << 20, dtype=np.uint8)
region = ep.register(target)
ep.send(region.descriptor().to_bytes())
note = ep.wait_notification(timeout_s=10)
digest = bytes(target[note.offset:note.offset + note.nbytes])
ep.send(np.frombuffer(digest, dtype=np.uint8).sum().tobytes() + note.tag)
print(ep.statistics().extra)
ep.recv(timeout_s=10)
ep.close()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["alloc", "numpy"])
def test_put_between_processes(shm_dir, kind):
    with shm.listen(_url(f"xput-{kind}")) as lis:
        p = _spawn(_ECHO_PUT_TARGET, lis.url, kind)
        try:
            ep = lis.accept(timeout_s=20)
            with ep:
                remote = RemoteRegion.from_bytes(ep.recv(timeout_s=10))
                data = _payload(300_000, 9)
                ep.put(data, remote, offset=12345, notify_id=77, tag=b"blk", timeout_s=10)
                reply = ep.recv(timeout_s=10)
                assert reply == np.frombuffer(data, dtype=np.uint8).sum().tobytes() + b"blk"
                extra = ep.statistics().extra
                assert (extra["zero_copy_puts"], extra["inline_puts"]) == ((1, 0) if kind == "alloc" else (0, 1))
                ep.send(b"bye")
            _finish(p)
        finally:
            _kill(p)


_SLEEPY_PEER = """
url = sys.argv[1]
ep = shm.connect(url, timeout_s=10, ring_nbytes=1 << 12)
ep.send(b"hello")
time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", IMPLS)
def test_sigkilled_peer_is_reported_within_one_second(shm_dir, impl):
    with shm.listen(_url(f"kill-{impl}"), ring_impl=impl) as lis:
        p = _spawn(_SLEEPY_PEER, lis.url)
        try:
            ep = lis.accept(timeout_s=20)
            assert ep.recv(timeout_s=10) == b"hello"
            p.send_signal(signal.SIGKILL)
            p.wait(5)
            t0 = time.monotonic()
            with pytest.raises(BrokenLinkError) as e:
                ep.recv(timeout_s=10)
            elapsed = time.monotonic() - t0
            assert elapsed < 1.0, f"dead peer noticed after {elapsed:.3f} s"
            assert e.value.__cause__ is not None
            # a sender finds out too, once the ring is full (blocking) or right away
            t0 = time.monotonic()
            with pytest.raises(BrokenLinkError):
                for _ in range(10_000):
                    ep.send(bytes(100), timeout_s=10)
            assert time.monotonic() - t0 < 1.0
            ep.close()
        finally:
            _kill(p)


_SLEEPY_TARGET = """
url = sys.argv[1]
ep = shm.connect(url, timeout_s=10, ring_nbytes=1 << 16)
target = alloc(1 << 16, dtype=np.uint8)
ep.send(ep.register(target).descriptor().to_bytes())
time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("defer", [False, True])
def test_a_put_many_into_a_sigkilled_peer_raises_on_the_next_peer_check(shm_dir, defer):
    """Puts into a mapped region run in C; every few milliseconds one looks at the peer's socket
    first: a put_many issued after the peer was killed raises BrokenLinkError, however much ring
    room is left."""
    with shm.listen(_url(f"killput-{int(defer)}")) as lis:
        p = _spawn(_SLEEPY_TARGET, lis.url)
        try:
            ep = lis.accept(timeout_s=20)
            remote = RemoteRegion.from_bytes(ep.recv(timeout_s=10))
            source = alloc(1 << 16, dtype=np.uint8)
            ep.register(source)
            so = np.array([0, 4096], dtype=np.int64)
            for _ in range(3):  # mapped by the first; then in C
                time.sleep(0.01)  # past the peer-check interval: each of them looks at the peer
                assert ep.put_many(source, remote, so, so + 8, np.array([64, 64]), notify_id=1, defer=defer) == 1
            p.send_signal(signal.SIGKILL)
            p.wait(5)
            time.sleep(0.01)
            with pytest.raises(BrokenLinkError):
                ep.put_many(source, remote, so, so + 8, np.array([64, 64]), notify_id=2, defer=defer)
            ep.close()
        finally:
            _kill(p)


@pytest.mark.timeout(60)
def test_sigkilled_peer_unblocks_a_waiting_sender(shm_dir):
    with shm.listen(_url("killsend")) as lis:
        p = _spawn(_SLEEPY_PEER, lis.url)
        try:
            ep = lis.accept(timeout_s=20)
            while True:  # fill the ring towards the peer (it never reads)
                try:
                    ep.send_nowait(bytes(100))
                except RingFullError:
                    break
            threading.Timer(0.2, p.kill).start()
            t0 = time.monotonic()
            with pytest.raises(BrokenLinkError):
                ep.send(bytes(100), timeout_s=20)
            assert time.monotonic() - t0 < 1.2  # 0.2 s until the kill, then well under a second
            ep.close()
        finally:
            _kill(p)


_LISTENER = """
url, ready = sys.argv[1], sys.argv[2]
lis = shm.listen(url)
open(ready, "w").close()
ep = lis.accept(timeout_s=20)
ep.send(b"up")
time.sleep(60)
"""

_CONNECTOR = """
url = sys.argv[1]
ep = shm.connect(url, timeout_s=10)
target = alloc(1 << 16)
ep.register(target)
assert ep.recv(timeout_s=10) == b"up"
print("connected", flush=True)
time.sleep(60)
"""


def _dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


@pytest.mark.timeout(60)
def test_nothing_outlives_a_crash(shm_dir, tmp_path):
    before = _dev_shm()
    url = _url("crash")
    ready = str(tmp_path / "ready")
    listener = _spawn(_LISTENER, url, ready)
    connector = None
    try:
        _wait_for_file(ready)
        connector = _spawn(_CONNECTOR, url)
        assert connector.stdout.readline().strip() == "connected"
        sock_path = os.path.join(str(shm_dir), url.split("//")[1] + ".sock")
        assert os.path.exists(sock_path)
        assert {n for n in _dev_shm() - before if "qlink" in n} == set()  # no named segment, ever
        for p in (listener, connector):
            p.send_signal(signal.SIGKILL)
            p.wait(5)
        assert {n for n in _dev_shm() - before if "qlink" in n} == set()
        # the dead listener's socket file is reclaimed by the next listen on the name ...
        with shm.listen(url) as lis:
            a = shm.connect(url)
            b = lis.accept(timeout_s=5)
            a.send(b"again")
            assert b.recv(timeout_s=1) == b"again"
            a.close(), b.close()
        # ... and closing that listener leaves nothing in the directory
        assert os.listdir(shm_dir) == []
    finally:
        _kill(listener)
        if connector is not None:
            _kill(connector)
