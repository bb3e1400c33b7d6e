"""tcp:// specifics beyond the conformance suite: addresses, handshake, framing faults,
partial messages, backpressure and the software put emulation."""

from __future__ import annotations

import errno
import socket
import struct
import threading
import time
import zlib

import numpy as np
import pytest

from qlink.errors import BrokenLinkError, QlinkTimeoutError, RegistrationError, WireError, WouldBlock
from qlink.memory import alloc
from transports import BufferTooSmallError, tcp
from transports import framing as fr

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def listener():
    with tcp.listen("tcp://127.0.0.1:0") as lis:
        yield lis


@pytest.fixture
def pair(listener):
    client = tcp.connect(listener.url, timeout_s=5)
    server = listener.accept(timeout_s=5)
    try:
        yield client, server
    finally:
        client.close()
        server.close()


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    return host.strip("[]"), int(port)


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    out = b""
    while len(out) < nbytes:
        chunk = sock.recv(nbytes - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _raw_client(url: str, *, hello: bytes | None = None) -> socket.socket:
    """A bare socket; with the default hello it completes the qlink handshake."""
    sock = socket.create_connection(_addr(url), timeout=5)
    sock.sendall(fr.pack_hello(123) if hello is None else hello)
    if hello is None:
        _version, status, _key, reason_n = fr.parse_reply(_recv_exact(sock, fr.REPLY.size))
        assert status == fr.STATUS_OK and reason_n == 0
    return sock


def _read_refusal(sock: socket.socket) -> tuple[int, str]:
    _version, status, _key, reason_n = fr.parse_reply(_recv_exact(sock, fr.REPLY.size))
    return status, _recv_exact(sock, reason_n).decode()


def _frame(kind: int, payload: bytes = b"", **fields) -> bytes:
    hdr = bytearray(fr.HEADER.size)
    fr.pack_header(hdr, kind, nbytes=fields.pop("nbytes", len(payload)), **fields)
    return bytes(hdr) + payload


# ----- addresses -------------------------------------------------------------------


def test_listen_binds_loopback_by_default_and_reports_the_port():
    for url in ("tcp://:0", "tcp://127.0.0.1", "tcp://127.0.0.1:0"):
        with tcp.listen(url) as lis:
            host, port = _addr(lis.url)
            assert host == "127.0.0.1" and port > 0, lis.url
            assert lis._sock.getsockname()[0] == "127.0.0.1"


def test_listen_on_a_busy_port_names_it():
    with tcp.listen("tcp://127.0.0.1:0") as lis:
        with pytest.raises(OSError) as info:
            tcp.listen(lis.url)
        assert info.value.errno == errno.EADDRINUSE and lis.url in str(info.value)


def test_bad_urls_are_value_errors():
    with pytest.raises(ValueError):
        tcp.listen("udp://127.0.0.1:0")
    with pytest.raises(ValueError):
        tcp.connect("tcp://127.0.0.1", timeout_s=1)  # a client needs a port
    with pytest.raises(ValueError):
        tcp.connect("tcp://127.0.0.1:99999", timeout_s=1)


def test_ipv6_loopback_when_available():
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6 support")
    try:
        lis = tcp.listen("tcp://[::1]:0")
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    with lis:
        assert lis.url.startswith("tcp://[::1]:")
        with tcp.connect(lis.url, timeout_s=5) as client, lis.accept(timeout_s=5) as server:
            client.send(b"v6", timeout_s=5)
            assert server.recv(timeout_s=5) == b"v6"


def test_nodelay_on_both_sides(pair):
    for ep in pair:
        assert ep._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


# ----- handshake -------------------------------------------------------------------


def test_wrong_magic_is_refused_with_a_reason_and_others_still_connect(listener):
    intruder = _raw_client(listener.url, hello=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    silent = socket.create_connection(_addr(listener.url), timeout=5)
    try:
        status, reason = _read_refusal(intruder)
        assert status == fr.STATUS_BAD_MAGIC
        assert "magic" in reason and "b'GET '" in reason
        assert intruder.recv(1) == b""  # then the listener hangs up
        with tcp.connect(listener.url, timeout_s=5) as client, listener.accept(timeout_s=5) as server:
            client.send(b"fine", timeout_s=5)
            assert server.recv(timeout_s=5) == b"fine"
        assert listener.refused_handshakes >= 1 and listener.accepted_handshakes == 1
    finally:
        intruder.close()
        silent.close()


def test_wrong_version_is_refused_with_both_versions_named(listener):
    sock = _raw_client(listener.url, hello=fr.pack_hello(1, version=99))
    try:
        status, reason = _read_refusal(sock)
    finally:
        sock.close()
    assert status == fr.STATUS_BAD_VERSION
    assert "version 99" in reason and f"version {fr.PROTOCOL_VERSION}" in reason
    with pytest.raises(QlinkTimeoutError):
        listener.accept(timeout_s=0.05)  # nothing was queued for accept()


def _fake_server(answer: bytes):
    srv = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = srv.accept()
        with conn:
            _recv_exact(conn, fr.HELLO.size)
            conn.sendall(answer)
            time.sleep(0.2)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv, t, f"tcp://127.0.0.1:{srv.getsockname()[1]}"


def test_client_reports_the_servers_refusal():
    srv, t, url = _fake_server(fr.pack_reply(fr.STATUS_BAD_VERSION, 0, "speaks version 7 only"))
    with srv:
        with pytest.raises(WireError, match="speaks version 7 only"):
            tcp.connect(url, timeout_s=5)
        t.join(5)


def test_client_refuses_a_server_that_is_not_qlink():
    srv, t, url = _fake_server(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    with srv:
        with pytest.raises(WireError, match="magic"):
            tcp.connect(url, timeout_s=5)
        t.join(5)


def test_silent_client_is_dropped_and_blocks_nobody():
    with tcp.listen("tcp://127.0.0.1:0", handshake_timeout_s=0.2) as lis:
        silent = socket.create_connection(_addr(lis.url), timeout=5)
        try:
            with tcp.connect(lis.url, timeout_s=5) as client, lis.accept(timeout_s=5) as server:
                client.send(b"x", timeout_s=5)
                assert server.recv(timeout_s=5) == b"x"
            assert silent.recv(1) == b""  # hung up after handshake_timeout_s
            assert lis.refused_handshakes == 1
        finally:
            silent.close()


def test_connect_times_out_when_the_handshake_is_never_answered():
    with socket.create_server(("127.0.0.1", 0)) as srv:  # the kernel accepts, nobody answers
        url = f"tcp://127.0.0.1:{srv.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(QlinkTimeoutError):
            tcp.connect(url, timeout_s=0.2)
        assert time.monotonic() - t0 < 3


# ----- framing faults --------------------------------------------------------------


@pytest.mark.parametrize("frame, fault", [
    (_frame(77), "kind 77"),
    (_frame(fr.KIND_MSG, nbytes=(1 << 30) + 1), "more than"),
    (_frame(fr.KIND_PUT, tag_nbytes=300), "tag"),
    (_frame(fr.KIND_BYE, nbytes=5), "BYE"),
])
def test_malformed_frame_breaks_the_link_with_the_fault_chained(listener, frame, fault):
    raw = _raw_client(listener.url)
    with raw, listener.accept(timeout_s=5) as server:
        raw.sendall(_frame(fr.KIND_MSG, b"good") + frame)
        assert server.recv(timeout_s=5) == b"good"  # what came before the fault is delivered
        with pytest.raises(BrokenLinkError) as info:
            server.recv(timeout_s=5)
        assert isinstance(info.value.__cause__, WireError) and fault in str(info.value.__cause__)
        assert server.statistics().errors >= 1
        with pytest.raises(BrokenLinkError):
            server.send(b"x", timeout_s=1)
        assert raw.recv(1) == b""  # the bad peer is hung up on


def test_send_over_the_maximum_is_refused_before_any_byte(pair):
    client, server = pair
    huge = np.zeros((1 << 30) + 1, dtype=np.uint8)  # calloc: pages are never touched
    with pytest.raises(ValueError, match="max_message_bytes"):
        client.send(huge, timeout_s=1)
    client.send(b"ok", timeout_s=5)
    assert server.recv(timeout_s=5) == b"ok"


# ----- partial messages ------------------------------------------------------------


def test_timeout_in_the_middle_of_a_message_loses_nothing(listener):
    raw = _raw_client(listener.url)
    data = np.random.default_rng(1).bytes(1 << 20)
    frame = _frame(fr.KIND_MSG, data)
    with raw, listener.accept(timeout_s=5) as server:
        raw.sendall(frame[:300_000])
        first = bytearray(1 << 20)
        with pytest.raises(QlinkTimeoutError):
            server.recv_into(first, timeout_s=0.2)
        with pytest.raises(WouldBlock):
            server.recv_into_nowait(bytearray(1 << 20))
        with pytest.raises(BufferTooSmallError) as info:  # the header is known: size errors come at once
            server.recv_into_nowait(bytearray(10))
        assert info.value.needed_nbytes == 1 << 20
        raw.sendall(frame[300_000:])
        other = bytearray(1 << 20)
        assert server.recv_into(other, timeout_s=5) == 1 << 20
        assert bytes(other) == data
        assert server.statistics().extra["staged_messages"] >= 1


def test_nowait_polling_a_large_message_in_flight(pair):
    client, server = pair
    data = np.random.default_rng(2).bytes(16 << 20)
    t = threading.Thread(target=client.send, args=(data,), kwargs={"timeout_s": 20})
    t.start()
    buf = bytearray(16 << 20)
    deadline = time.monotonic() + 20
    while True:
        try:
            n = server.recv_into_nowait(buf)
            break
        except WouldBlock:
            assert time.monotonic() < deadline
    t.join(20)
    assert n == len(data) and zlib.crc32(buf) == zlib.crc32(data)


def test_large_message_lands_straight_in_the_callers_buffer(pair):
    client, server = pair
    data = np.random.default_rng(3).bytes(16 << 20)
    t = threading.Thread(target=client.send, args=(data,), kwargs={"timeout_s": 20})
    t.start()
    buf = np.empty(16 << 20, dtype=np.uint8)
    assert server.recv_into(buf, timeout_s=20) == len(data)
    t.join(20)
    assert buf.tobytes() == data
    assert server.statistics().extra["staged_messages"] == 0  # never parked in an internal buffer


def test_killed_or_closed_peer_chains_the_cause(pair):
    client, server = pair
    client.close()
    with pytest.raises(BrokenLinkError, match="closed its endpoint") as info:
        server.recv_into(bytearray(8), timeout_s=5)
    assert isinstance(info.value.__cause__, EOFError)


def test_send_nowait_backpressure_then_everything_arrives(pair):
    client, server = pair
    chunk = 1 << 20
    accepted = []
    for i in range(256):
        data = np.random.default_rng(100 + i).bytes(chunk)
        try:
            client.send_nowait(data)
        except WouldBlock:
            break
        accepted.append(data)
    else:
        pytest.fail("256 MiB went into the socket without WouldBlock")
    with pytest.raises(WouldBlock):  # still full: nothing of this one is sent either
        client.send_nowait(b"tiny")
    got = []

    def drain():
        buf = bytearray(chunk)
        for _ in range(len(accepted) + 1):
            n = server.recv_into(buf, timeout_s=20)
            got.append(bytes(buf[:n]))

    t = threading.Thread(target=drain)
    t.start()
    client.send(b"END", timeout_s=20)
    t.join(30)
    assert len(got) == len(accepted) + 1 and got[-1] == b"END"
    assert all(a == b for a, b in zip(accepted, got))


def test_both_sides_sending_large_messages_at_once_do_not_deadlock(pair):
    client, server = pair
    blobs = {ep: np.random.default_rng(i).bytes(16 << 20) for i, ep in enumerate(pair)}
    results = {}

    def run(me, other):
        me.send(blobs[me], timeout_s=20)
        results[me] = me.recv(timeout_s=20, max_nbytes=16 << 20)

    threads = [threading.Thread(target=run, args=(client, server)), threading.Thread(target=run, args=(server, client))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    assert results[client] == blobs[server] and results[server] == blobs[client]


def test_one_thread_sends_large_messages_while_another_receives(pair):
    client, server = pair
    count, nbytes = 24, 1 << 20
    blobs = [np.random.default_rng(50 + i).bytes(nbytes) for i in range(count)]
    acks, errors = [], []

    def sender():  # blocks on a full socket while the receiving thread sits in poll on the same socket
        try:
            for b in blobs:
                client.send(b, timeout_s=20)
        except BaseException as e:  # reported below
            errors.append(e)

    def ack_reader():
        try:
            for _ in range(count):
                acks.append(client.recv(timeout_s=20))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=sender), threading.Thread(target=ack_reader)]
    for t in threads:
        t.start()
    buf = bytearray(nbytes)
    for i in range(count):
        assert server.recv_into(buf, timeout_s=20) == nbytes and bytes(buf) == blobs[i]
        server.send(b"ack%d" % i, timeout_s=20)
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert acks == [b"ack%d" % i for i in range(count)]


# ----- emulated puts ---------------------------------------------------------------


def test_puts_are_applied_by_the_targets_progress(pair):
    client, server = pair
    target = alloc(4096)
    region = server.register(target)
    for i in range(5):
        client.put(bytes([i + 1]) * 100, region.descriptor(), offset=i * 100, notify_id=i, timeout_s=5)
    client.send(b"after the puts", timeout_s=5)
    assert server.recv(timeout_s=5) == b"after the puts"  # progress for the message applied the puts on the way
    notes = [server.poll_notification_nowait() for _ in range(5)]
    assert [n.notify_id for n in notes] == list(range(5))
    assert all((target[i * 100:(i + 1) * 100] == i + 1).all() for i in range(5))
    assert server.statistics().extra["staged_messages"] == 0  # the message went straight into the caller's buffer


def test_descriptor_of_another_connection_is_refused(listener):
    with tcp.connect(listener.url, timeout_s=5) as c1, listener.accept(timeout_s=5) as s1, \
            tcp.connect(listener.url, timeout_s=5) as c2, listener.accept(timeout_s=5) as s2:
        region = s1.register(alloc(64))
        with pytest.raises(RegistrationError, match="not issued by this endpoint's peer"):
            c2.put(b"x", region.descriptor(), timeout_s=5)
        c1.put(b"x", region.descriptor(), timeout_s=5)
        assert s1.wait_notification(timeout_s=5).nbytes == 1
        del s2


def test_put_racing_a_deregistration_is_rejected_and_counted(pair):
    client, server = pair
    target = alloc(64)
    region = server.register(target)
    server.deregister(region)  # the DEREG frame is on its way, the client has not read it yet
    client.put(b"late", region.descriptor(), timeout_s=5)
    client.send(b"marker", timeout_s=5)
    assert server.recv(timeout_s=5) == b"marker"
    with pytest.raises(WouldBlock):
        server.poll_notification_nowait()
    assert not target.any()
    stats = server.statistics()
    assert stats.extra["puts_rejected"] == 1 and stats.errors >= 1
    server.send(b"ack", timeout_s=5)
    assert client.recv(timeout_s=5) == b"ack"  # reading past the DEREG frame teaches the client
    with pytest.raises(RegistrationError, match="deregistered"):
        client.put(b"later", region.descriptor(), timeout_s=5)


def test_endpoint_addresses_and_repr(pair):
    client, server = pair
    assert client.peer_address == server.local_address
    assert "TcpEndpoint" in repr(client)
    assert struct.calcsize("<BBHIQQQ") == fr.HEADER.size == 32
