"""The conformance suite: every transport scheme passes the same behavioural checks.

Each test runs once per scheme. The test process listens; a scripted peer
(``_peer.py``: a child process, or a thread for ``inproc://``) connects and obeys
commands sent as ordinary messages. Cases that need two processes skip for
transports that declare ``cross_process=False``; one-sided cases skip for
transports without ``one_sided``. A scheme whose optional stack is not installed
(``ucx`` without ``ucxx``) skips; a scheme whose module is missing fails.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import struct
import threading
import time
import uuid
import zlib
from pathlib import Path

import numpy as np
import pytest

import transports
from qlink.errors import (
    BrokenLinkError,
    ClosedError,
    QlinkTimeoutError,
    RegistrationError,
    WouldBlock,
)
from qlink.memory import RemoteRegion, alloc
from transports import BufferTooSmallError, Capabilities, Notification, Statistics
from transports._base import MAX_TAG_BYTES

_spec = importlib.util.spec_from_file_location("_qlink_conformance_peer", Path(__file__).with_name("_peer.py"))
peer_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_mod)
payload, crc = peer_mod.payload, peer_mod.crc

pytestmark = pytest.mark.timeout(60)

SCHEMES = ["inproc", "shm", "cuda_ipc", "tcp", "ucx"]  # cuda_ipc: host regions here (its device path: test_cuda_ipc)
_OPTIONAL_STACKS = {"ucx": "ucxx"}  # scheme -> the package without which it cannot run
SIZES = [0, 1, 64, 4 << 10, 64 << 10, 1 << 20, 16 << 20]


@pytest.fixture(scope="module", autouse=True)
def _reap_warm_peers():
    yield
    peer_mod.stop_all()


@pytest.fixture(params=SCHEMES)
def scheme(request) -> str:
    name = request.param
    stack = _OPTIONAL_STACKS.get(name)
    if stack is not None:
        pytest.importorskip(stack, reason=f"the {name}:// transport needs the optional '{stack}' package")
    importlib.import_module(f"transports.{name}")  # a transport module that is missing is a failure, not a skip
    return name


def fresh_url(scheme: str) -> str:
    tag = uuid.uuid4().hex[:10]
    if scheme in ("tcp", "ucx"):
        return f"{scheme}://127.0.0.1:0"
    return f"{scheme}://qlc{tag}"


def caps_of(scheme: str) -> Capabilities:
    return transports.capabilities(scheme)


def need_one_sided(scheme: str) -> None:
    if not caps_of(scheme).one_sided:
        pytest.skip(f"{scheme}:// declares one_sided=False")


def need_cross_process(scheme: str) -> None:
    if not caps_of(scheme).cross_process:
        pytest.skip(f"{scheme}:// endpoints live in one process (cross_process=False); there is no peer process")


class Link:
    """The test's endpoint plus the peer it drives."""

    def __init__(self, scheme: str, listener, ep, peer):
        self.scheme = scheme
        self.listener = listener
        self.ep = ep
        self.peer = peer
        self.caps = caps_of(scheme)

    def cmd(self, op: bytes, args: bytes = b"") -> None:
        self.ep.send(op + args, timeout_s=30)

    def reply(self, *, timeout_s: float = 30) -> bytes:
        data = self.ep.recv(timeout_s=timeout_s)
        if data.startswith(b"ERR!"):
            raise AssertionError(f"the peer failed: {data[4:].decode(errors='replace')}")
        return data

    def peer_exit(self, timeout_s: float = 10) -> int | None:
        code = self.peer.wait(timeout_s)
        assert code is not None, f"peer still running after {timeout_s} s"
        return code


def open_link(scheme: str) -> Link:
    listener = transports.listen(fresh_url(scheme))
    peer = None
    try:
        peer = peer_mod.start(listener.url, in_thread=not caps_of(scheme).cross_process,
                              preload=tuple(filter(None, [_OPTIONAL_STACKS.get(scheme)])))
        ep = listener.accept(timeout_s=30)
        hello = ep.recv(timeout_s=30)
        assert hello[:4] == b"HELO", hello
        return Link(scheme, listener, ep, peer)
    except BaseException:
        listener.close()
        if peer is not None:
            if peer.is_process:
                peer.kill()
            peer.stop()
        raise


@pytest.fixture
def link(scheme):
    lk = open_link(scheme)
    try:
        yield lk
    finally:
        lk.ep.close()  # the peer sees a broken link and exits by itself
        peer_mod.retire(lk.peer)
        lk.listener.close()


def sizes_for(link: Link) -> list[int]:
    return [n for n in SIZES if n <= link.caps.max_message_bytes]


# ----- declarations ----------------------------------------------------------------


def test_capabilities_are_declared(scheme):
    mod = importlib.import_module(f"transports.{scheme}")
    caps = mod.CAPABILITIES
    assert isinstance(caps, Capabilities)
    assert caps.name == scheme
    assert transports.capabilities(scheme) is caps
    assert callable(mod.listen) and callable(mod.connect)
    assert caps.max_message_bytes >= 16 << 20


def test_listener_url_is_concrete_and_endpoint_reports_capabilities(link):
    url = link.listener.url
    assert url.startswith(link.scheme + "://")
    assert not url.endswith(":0"), f"listener.url must report the bound port, got {url}"
    assert link.ep.capabilities == link.caps


# ----- two-sided -------------------------------------------------------------------


def test_sizes_to_peer_arrive_intact_and_in_order(link):
    sizes = sizes_for(link)
    link.cmd(b"SUM_", struct.pack("<I", len(sizes)))
    expected = []
    for i, n in enumerate(sizes):
        data = payload(1000 + i, n)
        link.ep.send(data, timeout_s=30)
        expected.append((n, crc(data)))
    got = link.reply()
    assert [struct.unpack_from("<QI", got, 12 * i) for i in range(len(sizes))] == expected


def test_sizes_from_peer_arrive_intact_and_in_order(link):
    sizes = sizes_for(link)
    link.cmd(b"GEN_", struct.pack(f"<II{len(sizes)}Q", 2000, len(sizes), *sizes))
    buf = np.zeros(max(sizes), dtype=np.uint8)  # a numpy array as the receive buffer
    for i, n in enumerate(sizes):
        got = link.ep.recv_into(buf, timeout_s=30)
        assert got == n, f"message {i}: expected {n} bytes, got {got} (out of order or truncated?)"
        assert crc(memoryview(buf)[:n]) == crc(payload(2000 + i, n)), f"message {i} of {n} bytes is corrupt"


def test_pipelined_messages_keep_their_order(link):
    count = 200
    for i in range(count):
        link.cmd(b"ECHO", struct.pack("<I", i) + bytes(i % 97))
    for i in range(count):
        data = link.reply()
        assert struct.unpack_from("<I", data)[0] == i and len(data) == 4 + i % 97


def test_numpy_and_memoryview_messages(link):
    arr = np.arange(1000, dtype=np.float64)
    link.cmd(b"ECHO", arr.tobytes())
    assert np.array_equal(np.frombuffer(link.reply(), dtype=np.float64), arr)
    link.ep.send(memoryview(b"ECHO" + arr.tobytes()), timeout_s=10)
    assert link.reply() == arr.tobytes()
    link.ep.send(np.frombuffer(b"ECHO" + arr.tobytes(), dtype=np.uint8), timeout_s=10)
    assert link.reply() == arr.tobytes()


def test_buffer_too_small_keeps_the_message(link):
    small = payload(5, 100)
    big = payload(6, 1 << 20)
    link.cmd(b"ECHO", small)
    link.cmd(b"ECHO", big)
    link.cmd(b"ECHO", b"after")
    with pytest.raises(BufferTooSmallError) as info:
        link.ep.recv_into(bytearray(10), timeout_s=10)
    assert info.value.needed_nbytes == 100
    with pytest.raises(BufferTooSmallError):  # the message is known to be there: not WouldBlock
        link.ep.recv_into_nowait(bytearray(99))
    buf = bytearray(100)
    assert link.ep.recv_into(buf, timeout_s=10) == 100 and bytes(buf) == small
    with pytest.raises(BufferTooSmallError) as info:
        link.ep.recv_into(bytearray(4096), timeout_s=10)
    assert info.value.needed_nbytes == 1 << 20
    buf = bytearray(1 << 20)
    assert link.ep.recv_into(buf, timeout_s=10) == 1 << 20 and crc(buf) == crc(big)
    assert link.reply() == b"after"


def test_recv_timeout_raises_and_endpoint_still_works(link):
    before = link.ep.statistics().timeouts
    buf = bytearray(64)
    t0 = time.monotonic()
    with pytest.raises(QlinkTimeoutError) as info:
        link.ep.recv_into(buf, timeout_s=0.05)
    elapsed = time.monotonic() - t0
    assert isinstance(info.value, TimeoutError)
    assert 0.04 <= elapsed < 5, f"a 50 ms timeout took {elapsed:.3f} s"
    assert link.ep.statistics().timeouts == before + 1
    link.cmd(b"ECHO", b"still alive")
    assert link.reply() == b"still alive"
    if link.caps.one_sided:
        with pytest.raises(QlinkTimeoutError):
            link.ep.wait_notification(timeout_s=0.05)
        link.cmd(b"ECHO", b"and again")
        assert link.reply() == b"and again"


def test_nowait_calls_raise_wouldblock(link):
    buf = bytearray(64)
    with pytest.raises(WouldBlock):
        link.ep.recv_into_nowait(buf)
    if link.caps.one_sided:
        with pytest.raises(WouldBlock):
            link.ep.poll_notification_nowait()
    link.cmd(b"ECHO", b"polled")
    deadline = time.monotonic() + 10
    while True:
        try:
            n = link.ep.recv_into_nowait(buf)
            break
        except WouldBlock:
            assert time.monotonic() < deadline, "recv_into_nowait never saw the echo"
            time.sleep(1e-4)
    assert bytes(buf[:n]) == b"polled"


def test_send_nowait_sends_all_or_nothing(link):
    """While the peer is not reading, send_nowait either takes a whole message or raises WouldBlock."""
    link.cmd(b"HOLD", struct.pack("<d", 0.5))
    chunk = 256 << 10
    accepted = []
    for i in range(256):  # at most 64 MiB
        data = payload(3000 + i, chunk)
        try:
            link.ep.send_nowait(data)
        except WouldBlock:
            break
        accepted.append(data)
    link.ep.send(b"END!", timeout_s=30)
    count, chain = struct.unpack("<QI", link.reply())
    expect = 0
    for data in accepted:
        expect = zlib.crc32(data, expect)
    assert count == len(accepted) and chain == expect & 0xFFFFFFFF


def test_sender_thread_and_receiver_thread(link):
    count = 300
    errors = []

    def sender():
        try:
            for i in range(count):
                link.cmd(b"ECHO", struct.pack("<I", i) + bytes(i % 300))
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=sender)
    t.start()
    try:
        for i in range(count):
            data = link.reply()
            assert struct.unpack_from("<I", data)[0] == i and len(data) == 4 + i % 300
    finally:
        t.join(30)
    assert not errors, errors


# ----- one-sided -------------------------------------------------------------------

_PUT_CASES = [  # offset, nbytes, notify_id, tag
    (0, 0, 1, b""),
    (5, 1, 2, b"t"),
    (100, 64, 3, b"tag" * 10),
    (4096, 4096, 4, b""),
    (8192, 1 << 20, (1 << 64) - 1, bytes(range(256))),
]


def test_put_lands_before_its_notification(link):
    need_one_sided(link.scheme)
    target = alloc(2 << 20)
    region = link.ep.register(target)
    assert region.nbytes == target.nbytes
    before = link.ep.statistics().notifications
    expected = np.zeros_like(target)
    specs = b""
    for seed, (off, n, nid, tag) in enumerate(_PUT_CASES):
        specs += peer_mod.put_spec(offset=off, notify_id=nid, seed=seed, nbytes=n, tag=tag)
        expected[off:off + n] = np.frombuffer(payload(seed, n), dtype=np.uint8)
    link.cmd(b"PUTS", struct.pack("<I", len(_PUT_CASES)) + specs + region.descriptor().to_bytes())
    for seed, (off, n, nid, tag) in enumerate(_PUT_CASES):
        note = link.ep.wait_notification(timeout_s=30)
        # the bytes must be in place the moment the notification is seen
        assert crc(memoryview(target)[off:off + n]) == crc(payload(seed, n)), f"put {seed}: notification before its bytes"
        assert note == Notification(region_id=region.region_id, offset=off, nbytes=n, notify_id=nid, tag=tag)
    assert link.reply() == b"PUT-OK"
    assert np.array_equal(target, expected), "a put wrote outside its range"
    assert link.ep.statistics().notifications == before + len(_PUT_CASES)


def test_burst_of_puts_notifies_in_order_with_bytes_in_place(link):
    need_one_sided(link.scheme)
    target = alloc(64 * 8192)
    region = link.ep.register(target)
    count = 64
    specs = b"".join(peer_mod.put_spec(offset=i * 8192, notify_id=i, seed=500 + i, nbytes=8192) for i in range(count))
    link.cmd(b"PUTS", struct.pack("<I", count) + specs + region.descriptor().to_bytes())
    seen = []
    for _ in range(count):
        note = link.ep.wait_notification(timeout_s=30)
        i = note.notify_id
        assert crc(memoryview(target)[i * 8192:(i + 1) * 8192]) == crc(payload(500 + i, 8192))
        seen.append(i)
    if link.caps.ordered:
        assert seen == list(range(count))
    else:
        assert sorted(seen) == list(range(count))
    assert link.reply() == b"PUT-OK"


def test_put_into_peer_region(link):
    need_one_sided(link.scheme)
    link.cmd(b"REG_", struct.pack("<Q", 1 << 20))
    remote = RemoteRegion.from_bytes(link.reply())
    assert remote.nbytes == 1 << 20
    before = link.ep.statistics()
    data = np.arange(4096, dtype=np.uint32)  # any buffer-protocol object
    link.ep.put(data, remote, offset=12345, notify_id=42, tag=b"kv-block-7", timeout_s=10)
    link.cmd(b"WPUT", struct.pack("<d", 10))
    rid, off, n, nid, c, tag = peer_mod.parse_note_reply(link.reply())
    assert (rid, off, n, nid, tag) == (remote.region_id, 12345, data.nbytes, 42, b"kv-block-7")
    assert c == crc(data.tobytes())
    after = link.ep.statistics()
    assert after.puts == before.puts + 1 and after.put_bytes == before.put_bytes + data.nbytes


def test_put_many_lands_every_piece_and_notifies_as_declared(link):
    """One Notification spanning every piece where the endpoint gathers (put_many_gathers),
    else one per piece; each seen only once its bytes are in place."""
    need_one_sided(link.scheme)
    link.cmd(b"REG_", struct.pack("<Q", 1 << 16))
    remote = RemoteRegion.from_bytes(link.reply())
    before = link.ep.statistics()
    src = np.frombuffer(payload(31, 8192), dtype=np.uint8)
    so, do, ln = np.array([0, 100, 4000]), np.array([512, 8, 20000]), np.array([64, 32, 4096])
    count = link.ep.put_many(src, remote, so, do, ln, notify_id=5, tag=b"pm", timeout_s=10)
    assert count == (1 if link.ep.put_many_gathers else 3)
    expected = np.zeros(1 << 16, dtype=np.uint8)
    for s_, d_, n_ in zip(so, do, ln):
        expected[d_:d_ + n_] = src[s_:s_ + n_]
    if link.ep.put_many_gathers:
        spans = [(8, 20000 + 4096 - 8)]
    else:
        spans = [(int(d_), int(n_)) for d_, n_ in zip(do, ln)]
    seen = []
    for _ in spans:
        link.cmd(b"WPUT", struct.pack("<d", 10))
        rid, off, n, nid, c, tag = peer_mod.parse_note_reply(link.reply())
        assert (rid, nid, tag) == (remote.region_id, 5, b"pm")
        assert c == crc(expected[off:off + n].tobytes()), "a notification came before its bytes"
        seen.append((off, n))
    assert sorted(seen) == sorted(spans)
    after = link.ep.statistics()
    assert after.puts == before.puts + 3 and after.put_bytes == before.put_bytes + int(ln.sum())
    # defer=True from memory registered here: the endpoint may leave the copy to the target (shm);
    # either way the notification comes after the bytes, and flush() returns once they have moved
    home = alloc(8192)
    home[:] = src
    link.ep.register(home)
    count = link.ep.put_many(home, remote, so[::-1], do, ln, notify_id=6, tag=b"pd", defer=True, timeout_s=10)
    for s_, d_, n_ in zip(so[::-1], do, ln):
        expected[d_:d_ + n_] = src[s_:s_ + n_]
    for _ in range(count):
        link.cmd(b"WPUT", struct.pack("<d", 10))
        rid, off, n, nid, c, tag = peer_mod.parse_note_reply(link.reply())
        assert (nid, tag) == (6, b"pd") and c == crc(expected[off:off + n].tobytes())
    link.ep.flush(timeout_s=10)
    assert link.ep.statistics().extra.get("deferred_puts", 1) == 1  # where counted, it was deferred
    with pytest.raises(ValueError):
        link.ep.put_many(src, remote, [0], [0, 1], [1, 1], timeout_s=10)
    with pytest.raises(RegistrationError):
        link.ep.put_many(src, remote, [0], [(1 << 16) - 1], [2], timeout_s=10)


def test_put_outside_the_region_is_refused(link):
    need_one_sided(link.scheme)
    link.cmd(b"REG_", struct.pack("<Q", 4096))
    remote = RemoteRegion.from_bytes(link.reply())
    with pytest.raises(RegistrationError):
        link.ep.put(b"x", remote, offset=4096, timeout_s=10)
    with pytest.raises(RegistrationError):
        link.ep.put(bytes(4097), remote, timeout_s=10)
    with pytest.raises(RegistrationError):
        link.ep.put(b"x", remote, offset=-1, timeout_s=10)
    link.ep.put(b"z", remote, offset=4095, notify_id=9, timeout_s=10)  # the last byte is fine
    link.cmd(b"WPUT", struct.pack("<d", 10))
    rid, off, n, nid, c, _tag = peer_mod.parse_note_reply(link.reply())
    assert (rid, off, n, nid, c) == (remote.region_id, 4095, 1, 9, crc(b"z"))


def test_put_after_peer_deregisters_is_refused(link):
    need_one_sided(link.scheme)
    link.cmd(b"REG_", struct.pack("<Q", 4096))
    remote = RemoteRegion.from_bytes(link.reply())
    link.cmd(b"DREG", struct.pack("<I", remote.region_id))
    assert link.reply() == b"DREG-OK"
    with pytest.raises(RegistrationError):
        link.ep.put(b"late", remote, timeout_s=10)


def test_bad_put_arguments(link):
    need_one_sided(link.scheme)
    link.cmd(b"REG_", struct.pack("<Q", 4096))
    remote = RemoteRegion.from_bytes(link.reply())
    with pytest.raises(ValueError):
        link.ep.put(b"x", remote, tag=bytes(MAX_TAG_BYTES + 1), timeout_s=10)
    with pytest.raises(ValueError):
        link.ep.put(b"x", remote, notify_id=-1, timeout_s=10)


@pytest.mark.parametrize("order", ["messages_first", "notifications_first"])
def test_interleaved_messages_and_notifications_each_reach_their_queue(link, order):
    need_one_sided(link.scheme)
    count = 20
    target = alloc(count * 256)
    region = link.ep.register(target)
    link.cmd(b"MIX_", struct.pack("<I", count) + region.descriptor().to_bytes())

    def take_messages():
        for i in range(count):
            assert link.reply() == b"msg%d" % i

    def take_notifications():
        for i in range(count):
            note = link.ep.wait_notification(timeout_s=30)
            assert (note.notify_id, note.offset, note.nbytes, note.tag) == (i, i * 256, 64 + i, b"m%d" % i)
            assert crc(memoryview(target)[i * 256:i * 256 + 64 + i]) == crc(payload(i, 64 + i))

    if order == "messages_first":
        take_messages()
        take_notifications()
    else:
        take_notifications()
        take_messages()
    with pytest.raises(WouldBlock):
        link.ep.recv_into_nowait(bytearray(64))
    with pytest.raises(WouldBlock):
        link.ep.poll_notification_nowait()


# ----- closing and failure ---------------------------------------------------------


@pytest.mark.timeout(30)
def test_peer_close_drains_then_breaks(link):
    n = 100_000
    args = struct.pack("<IQ", 3, n)
    target = None
    if link.caps.one_sided:
        target = alloc(4096)
        region = link.ep.register(target)
        args += region.descriptor().to_bytes()
    link.cmd(b"SCLO", args)
    buf = bytearray(n)
    for i in range(3):
        assert link.ep.recv_into(buf, timeout_s=10) == n and crc(buf) == crc(payload(i, n)), f"message {i} lost at close"
    if target is not None:
        note = link.ep.wait_notification(timeout_s=10)
        assert note.notify_id == 7 and crc(memoryview(target)[:64]) == crc(payload(99, 64))
    t0 = time.monotonic()
    with pytest.raises(BrokenLinkError):
        link.ep.recv_into(buf, timeout_s=5)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(BrokenLinkError):
        link.ep.recv_into_nowait(buf)
    with pytest.raises(BrokenLinkError):
        link.ep.send(b"anyone?", timeout_s=5)
    if link.caps.one_sided:
        with pytest.raises(BrokenLinkError):
            link.ep.wait_notification(timeout_s=5)
        with pytest.raises(BrokenLinkError):
            link.ep.poll_notification_nowait()
    assert link.peer_exit() == 0, link.peer.diagnostics()


@pytest.mark.timeout(30)
def test_local_close_gives_closed_error_and_the_peer_a_broken_link(link):
    link.cmd(b"ECLO", struct.pack("<Id", 3, 5.0))
    for i in range(3):
        link.ep.send(payload(i, 1 << 20 if i == 1 else 100), timeout_s=10)
    link.ep.close()
    link.ep.close()  # idempotent
    assert link.ep.closed
    buf = bytearray(16)
    for call in (lambda: link.ep.send(b"x", timeout_s=1), lambda: link.ep.send_nowait(b"x"),
                 lambda: link.ep.recv_into(buf, timeout_s=1), lambda: link.ep.recv_into_nowait(buf)):
        with pytest.raises(ClosedError):
            call()
    if link.caps.one_sided:
        remote = RemoteRegion(region_id=1, nbytes=16)
        for call in (lambda: link.ep.wait_notification(timeout_s=1), link.ep.poll_notification_nowait,
                     lambda: link.ep.put(b"x", remote, timeout_s=1), lambda: link.ep.register(alloc(16))):
            with pytest.raises(ClosedError):
                call()
    assert link.peer_exit() == 0, "the peer did not get its 3 messages and then BrokenLinkError: " + link.peer.diagnostics()


@pytest.mark.timeout(30)
def test_close_wakes_a_thread_blocked_in_recv(link):
    result = []

    def blocked():
        try:
            link.ep.recv_into(bytearray(16), timeout_s=20)
        except BaseException as e:  # checked below
            result.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    link.ep.close()
    t.join(5)
    assert not t.is_alive(), "close() did not wake the thread blocked in recv_into"
    assert time.monotonic() - t0 < 2.0
    assert len(result) == 1 and isinstance(result[0], ClosedError), result


@pytest.mark.timeout(30)
@pytest.mark.parametrize("blocked_in", ["recv_into", "wait_notification", "idle"])
def test_sigkilled_peer_is_a_broken_link_within_1s(link, blocked_in):
    need_cross_process(link.scheme)
    if blocked_in == "wait_notification":
        need_one_sided(link.scheme)
    link.cmd(b"ECHO", b"up")
    assert link.reply() == b"up"
    buf = bytearray(64)
    if blocked_in == "idle":
        link.peer.kill()
        assert link.peer.wait(5) is not None
        calls = [lambda: link.ep.recv_into(buf, timeout_s=5)]
    else:
        killer = threading.Timer(0.2, link.peer.kill)
        killer.start()
        calls = [lambda: link.ep.recv_into(buf, timeout_s=None)] if blocked_in == "recv_into" else \
            [lambda: link.ep.wait_notification(timeout_s=None)]
    try:
        with pytest.raises(BrokenLinkError) as info:
            calls[0]()
        t_detected = time.monotonic()
        elapsed = t_detected - max(link.peer.killed_at, min(link.peer.exited_at(), t_detected))
        assert elapsed < 1.0, f"SIGKILLed peer reported {elapsed:.3f} s after it was gone"
        assert str(info.value), "a broken link says what broke"
    finally:
        if blocked_in != "idle":
            killer.join()
    t0 = time.monotonic()
    with pytest.raises(BrokenLinkError):  # sending to the dead peer fails too (a few sends may be buffered)
        while time.monotonic() - t0 < 1.0:
            link.ep.send(b"hello?", timeout_s=1)
    if link.caps.one_sided and blocked_in != "wait_notification":
        with pytest.raises(BrokenLinkError):
            link.ep.wait_notification(timeout_s=1)
    assert link.ep.statistics().errors >= 1


# ----- bookkeeping -----------------------------------------------------------------


def test_statistics_count_and_are_frozen(link):
    s0 = link.ep.statistics()
    assert isinstance(s0, Statistics) and s0.transport == link.scheme
    with pytest.raises(dataclasses.FrozenInstanceError):
        s0.messages_sent = 0
    with pytest.raises(TypeError):
        s0.extra["something"] = 1  # the extra counters are read-only too
    link.cmd(b"ECHO", bytes(100))
    assert link.reply() == bytes(100)
    with pytest.raises(QlinkTimeoutError):
        link.ep.recv_into(bytearray(8), timeout_s=0.01)
    s1 = link.ep.statistics()
    assert s1.messages_sent == s0.messages_sent + 1 and s1.bytes_sent == s0.bytes_sent + 104
    assert s1.messages_received == s0.messages_received + 1 and s1.bytes_received == s0.bytes_received + 100
    assert s1.timeouts == s0.timeouts + 1
    assert s0.messages_sent == s1.messages_sent - 1, "a statistics() snapshot must not change afterwards"


def test_context_managers_close_and_release_the_address(scheme):
    url = fresh_url(scheme)
    with transports.listen(url) as lis:
        bound = lis.url
        with transports.connect(bound, timeout_s=30) as client, lis.accept(timeout_s=30) as server:
            client.send(b"ping", timeout_s=10)
            assert server.recv(timeout_s=10) == b"ping"
            server.send(b"pong", timeout_s=10)
            assert client.recv(timeout_s=10) == b"pong"
        assert client.closed and server.closed
        with pytest.raises(ClosedError):
            client.send(b"x", timeout_s=1)
    with pytest.raises(ClosedError):
        lis.accept(timeout_s=0.1)
    with transports.listen(bound) as again:  # the address is free again
        assert again.url == bound


def test_listen_twice_on_one_address_is_refused(scheme):
    with transports.listen(fresh_url(scheme)) as lis:
        with pytest.raises(OSError):
            transports.listen(lis.url).close()


def test_accept_times_out(scheme):
    with transports.listen(fresh_url(scheme)) as lis:
        t0 = time.monotonic()
        with pytest.raises(QlinkTimeoutError):
            lis.accept(timeout_s=0.05)
        assert time.monotonic() - t0 < 5


@pytest.mark.timeout(30)
def test_connect_where_nobody_listens_is_a_broken_link(scheme):
    with transports.listen(fresh_url(scheme)) as lis:
        url = lis.url
    t0 = time.monotonic()
    with pytest.raises(BrokenLinkError):
        transports.connect(url, timeout_s=5).close()
    assert time.monotonic() - t0 < 5


def test_bad_arguments_are_typed_errors(link):
    with pytest.raises(TypeError):
        link.ep.send(12345, timeout_s=1)
    with pytest.raises(ValueError):
        link.ep.recv_into(bytearray(8), timeout_s=-1)
    with pytest.raises(TypeError):
        link.ep.recv_into(b"read-only", timeout_s=0.01)
    link.cmd(b"ECHO", b"fine")
    assert link.reply() == b"fine"
