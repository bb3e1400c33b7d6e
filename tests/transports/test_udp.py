"""udp:// carries exactly the bytes it was given, one datagram per message, and is honest
about what UDP cannot do (size limit, no dead-peer detection, no one-sided put)."""

import socket
import threading
import time

import numpy as np
import pytest

import transports
from qlink.errors import BrokenLinkError, CapabilityError, ClosedError, QlinkTimeoutError, WouldBlock
from qlink.memory import RemoteRegion
from transports import udp
from transports._base import BufferTooSmallError

pytestmark = pytest.mark.timeout(30)


def _raw(bind=("127.0.0.1", 0)):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(bind)
    s.settimeout(2.0)
    return s


def _addr_of(url):
    host, port = url[len("udp://"):].rsplit(":", 1)
    return host, int(port)


def _until(fn, timeout_s=2.0):
    """Retry a *_nowait call until it stops raising WouldBlock (loopback delivery is nearly, not always, instant)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except WouldBlock:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)


@pytest.fixture
def served():
    lis = udp.listen("udp://127.0.0.1:0")
    srv = lis.serve_endpoint()
    cli = udp.connect(lis.url)
    yield lis, srv, cli
    cli.close()
    srv.close()
    lis.close()


def test_capabilities_are_honest():
    caps = transports.capabilities("udp")
    assert caps.name == "udp"
    assert caps.reliable is False and caps.ordered is False
    assert caps.one_sided is False and caps.cross_host is True
    assert caps.max_message_bytes == 65507 == udp.MAX_DATAGRAM_BYTES_IPV4


@pytest.mark.parametrize("nbytes", [0, 1, 24, 1472, 1473, 4096, 65506, 65507])
def test_datagrams_arrive_intact_both_ways(served, nbytes):
    _, srv, cli = served
    payload = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    cli.send(payload)
    buf = np.full(65536, 0xEE, dtype=np.uint8)
    n = srv.recv_into(buf, timeout_s=2)
    assert n == nbytes and bytes(buf[:n]) == payload.tobytes()
    srv.send(payload[::-1].copy())
    small = bytearray(nbytes)  # exactly the size: the peeked path
    assert cli.recv_into(small, timeout_s=2) == nbytes
    assert bytes(small) == payload[::-1].tobytes()
    assert cli.statistics().bytes_sent == nbytes and srv.statistics().bytes_received == nbytes


def test_no_bytes_added_raw_peer_sees_exactly_the_payload():
    raw = _raw()
    with udp.listen("udp://127.0.0.1:0") as lis:
        srv = lis.serve_endpoint()
        url = "udp://%s:%d" % raw.getsockname()
        cli = udp.connect(url)
        assert cli.url == url
        cli.send(b"CUQR\x00\x01")
        data, addr = raw.recvfrom(70000)
        assert data == b"CUQR\x00\x01" and addr == _addr_of(cli.local_url)
        raw.sendto(b"\x00" * 3, addr)  # answer the qlink client from the raw socket
        assert cli.recv(timeout_s=2) == b"\x00" * 3
        raw.sendto(b"frame-from-raw", _addr_of(lis.url))
        buf = bytearray(64)
        n, sender = srv.recvfrom_into(buf, timeout_s=2)
        assert bytes(buf[:n]) == b"frame-from-raw" and sender == raw.getsockname()
        srv.send(b"reply")
        assert raw.recvfrom(100) == (b"reply", _addr_of(lis.url))
        cli.close()
        srv.close()
    raw.close()


def test_oversize_send_is_refused_and_nothing_is_sent():
    raw = _raw()
    cli = udp.connect("udp://%s:%d" % raw.getsockname())
    with pytest.raises(udp.DatagramTooLargeError, match="65508 bytes exceeds max_message_bytes=65507") as info:
        cli.send(bytes(65508))
    assert isinstance(info.value, ValueError) and info.value.max_nbytes == 65507
    # a 2^20-bit syndrome request (131072 payload bytes + 56) does not fit one datagram
    with pytest.raises(udp.DatagramTooLargeError, match="enqueue_syndromes"):
        cli.send_nowait(bytes(24 + 32 + (1 << 20) // 8))
    raw.settimeout(0.05)
    with pytest.raises(socket.timeout):
        raw.recv(1)
    st = cli.statistics()
    assert st.messages_sent == 0 and st.errors == 2 and st.extra["oversize"] == 2
    cli.close()
    limited = udp.connect("udp://%s:%d" % raw.getsockname(), max_message_bytes=1472)
    assert limited.capabilities.max_message_bytes == 1472
    limited.send(bytes(1472))
    with pytest.raises(udp.DatagramTooLargeError):
        limited.send(bytes(1473))
    limited.close()
    raw.close()
    with pytest.raises(ValueError, match="max_message_bytes must be in 1..65507"):
        udp.connect("udp://127.0.0.1:9", max_message_bytes=70000)


def test_buffer_too_small_keeps_the_datagram_connected_and_serve(served):
    _, srv, cli = served
    cli.send(b"0123456789")
    with pytest.raises(BufferTooSmallError) as info:
        srv.recv_into(bytearray(4), timeout_s=2)
    assert info.value.needed_nbytes == 10
    buf = bytearray(10)
    assert srv.recv_into(buf, timeout_s=2) == 10 and bytes(buf) == b"0123456789"
    srv.send(b"abcdef")
    with pytest.raises(BufferTooSmallError):
        cli.recv_into(bytearray(2), timeout_s=2)
    assert cli.recv(timeout_s=2) == b"abcdef"
    assert srv.statistics().extra["truncated"] == 1 and cli.statistics().extra["truncated"] == 1
    srv.send(b"")
    assert _until(lambda: cli.recv_into_nowait(bytearray(0))) == 0  # empty datagram into an empty buffer


def test_timeouts_and_nowait(served):
    lis, srv, cli = served
    t0 = time.monotonic()
    with pytest.raises(QlinkTimeoutError, match="within timeout_s=0.05"):
        srv.recv_into(bytearray(8), timeout_s=0.05)
    assert time.monotonic() - t0 >= 0.05
    with pytest.raises(QlinkTimeoutError):
        cli.recv_into(bytearray(8), timeout_s=0.02)
    assert srv.statistics().timeouts == 1 and cli.statistics().timeouts == 1
    with pytest.raises(WouldBlock):
        srv.recv_into_nowait(bytearray(8))
    with pytest.raises(WouldBlock):
        cli.recv_into_nowait(bytearray(8))
    cli.send_nowait(b"now")
    buf = bytearray(8)
    assert _until(lambda: srv.recv_into_nowait(buf)) == 3 and bytes(buf[:3]) == b"now"
    with pytest.raises(ValueError, match="timeout_s"):
        cli.recv_into(buf, timeout_s=-1)


def test_binds_loopback_by_default_and_reports_the_port():
    for url in ("udp://:0", "udp://"):
        with transports.listen(url) as lis:
            host, port = _addr_of(lis.url)
            assert host == "127.0.0.1" and port > 0
    with pytest.raises(ValueError, match="needs a port"):
        udp.connect("udp://127.0.0.1")
    with pytest.raises(ValueError, match="port 0"):
        udp.connect("udp://127.0.0.1:0")
    with pytest.raises(ValueError, match="udp://"):
        udp.listen("tcp://127.0.0.1:0")


def test_accept_gives_one_endpoint_per_peer_address_and_demultiplexes():
    a, b = _raw(), _raw()
    with udp.listen("udp://127.0.0.1:0") as lis:
        dest = _addr_of(lis.url)
        with pytest.raises(QlinkTimeoutError):
            lis.accept(timeout_s=0.02)  # UDP has no handshake: no datagram, no peer
        a.sendto(b"a1", dest)
        b.sendto(b"b1", dest)
        a.sendto(b"a2", dest)
        ea = lis.accept(timeout_s=2)
        assert ea.peer == a.getsockname()
        eb = lis.accept(timeout_s=2)
        assert eb.peer == b.getsockname()
        with pytest.raises(QlinkTimeoutError):
            lis.accept(timeout_s=0.02)  # a's second datagram is not a new peer
        assert eb.recv(timeout_s=2) == b"b1"  # read past a's datagrams on the shared socket
        assert ea.recv(timeout_s=2) == b"a1"  # the revealing datagram comes first
        assert ea.recv(timeout_s=2) == b"a2"
        b.sendto(b"b-long", dest)
        with pytest.raises(QlinkTimeoutError):
            ea.recv(timeout_s=0.05)  # reads b's datagram off the socket into b's queue
        with pytest.raises(BufferTooSmallError):
            eb.recv_into(bytearray(1), timeout_s=2)  # from the queue: it stays there
        assert eb.recv(timeout_s=2) == b"b-long"
        b.sendto(b"b-direct", dest)
        with pytest.raises(BufferTooSmallError):
            eb.recv_into(bytearray(1), timeout_s=2)  # straight off the socket: it stays there
        assert eb.recv(timeout_s=2) == b"b-direct"
        ea.send(b"to-a")
        eb.send(b"to-b")
        assert a.recvfrom(10) == (b"to-a", dest) and b.recvfrom(10) == (b"to-b", dest)
        ea.close()
        a.sendto(b"a-again", dest)  # after close, the same address is a new peer
        ea2 = lis.accept(timeout_s=2)
        assert ea2.peer == a.getsockname() and ea2.recv(timeout_s=2) == b"a-again"
        with pytest.raises(ValueError, match="not both"):
            lis.serve_endpoint()
        with pytest.raises(ClosedError):
            ea.recv(timeout_s=0.1)
    # the listener is closed, but accepted endpoints keep the socket
    a.sendto(b"still", dest)
    assert ea2.recv(timeout_s=2) == b"still"
    with pytest.raises(ClosedError):
        lis.accept(timeout_s=0.1)
    ea2.close()
    eb.close()
    a.close()
    b.close()


def test_accepted_peers_receive_concurrently_in_their_own_threads():
    peers = [_raw() for _ in range(3)]
    n_each = 50
    with udp.listen("udp://127.0.0.1:0", rcvbuf_nbytes=1 << 20) as lis:
        dest = _addr_of(lis.url)
        for i, p in enumerate(peers):
            p.sendto(b"hello %d" % i, dest)
        eps = [lis.accept(timeout_s=2) for _ in peers]
        got = {ep.peer: [] for ep in eps}

        def drain(ep):
            while True:
                msg = ep.recv(timeout_s=2)
                got[ep.peer].append(msg)
                if msg.endswith(b"last"):
                    return

        threads = [threading.Thread(target=drain, args=(ep,)) for ep in eps]
        for t in threads:
            t.start()
        for k in range(n_each):
            for i, p in enumerate(peers):
                p.sendto(b"%d:%d" % (i, k) + (b" last" if k == n_each - 1 else b""), dest)
            time.sleep(0.0005)  # loopback does not drop at this pace; the point is demultiplexing
        for t in threads:
            t.join(10)
        for i, p in enumerate(peers):
            msgs = got[p.getsockname()]
            assert msgs[0] == b"hello %d" % i
            assert all(m.startswith(b"%d:" % i) for m in msgs[1:]), "a datagram reached the wrong peer"
            assert len(msgs) == n_each + 1
        for ep in eps:
            ep.close()
    for p in peers:
        p.close()


def test_serve_endpoint_answers_whoever_sent():
    a, b = _raw(), _raw()
    with udp.listen("udp://127.0.0.1:0") as lis:
        srv = lis.serve_endpoint()
        with pytest.raises(udp.NoPeerError, match="recv first"):
            srv.send(b"nobody")
        with pytest.raises(ValueError, match="already"):
            lis.serve_endpoint()
        dest = _addr_of(lis.url)
        a.sendto(b"from a", dest)
        b.sendto(b"from b", dest)
        for _ in range(2):
            req = srv.recv(timeout_s=2)
            srv.send(b"re: " + req)
        assert a.recv(100) == b"re: from a" and b.recv(100) == b"re: from b"
        srv.sendto(b"direct", b.getsockname())
        assert b.recv(100) == b"direct"
        st = srv.statistics()
        assert st.messages_received == 2 and st.messages_sent == 3 and st.extra["peers_seen"] == 2
        with pytest.raises(ValueError, match="not both"):
            lis.accept(timeout_s=0.01)
        srv.close()
        with pytest.raises(ClosedError):
            srv.recv(timeout_s=0.1)
        with pytest.raises(ClosedError):
            srv.send(b"x")
    a.close()
    b.close()


def test_connected_client_to_a_closed_port_sees_broken_link():
    s = _raw()
    url = "udp://%s:%d" % s.getsockname()
    s.close()  # nothing listens there now
    cli = transports.connect(url, timeout_s=1)  # UDP connect sends nothing: it succeeds
    cli.send(b"anyone?")
    with pytest.raises(BrokenLinkError, match="ECONNREFUSED"):
        cli.recv_into(bytearray(16), timeout_s=2)  # loopback answers with ICMP port unreachable
    st = cli.statistics()
    assert st.extra["refused"] == 1 and st.errors == 1
    with pytest.raises(QlinkTimeoutError):  # the error is reported once; the endpoint stays usable
        cli.recv_into(bytearray(16), timeout_s=0.02)
    cli.close()
    with pytest.raises(ClosedError):
        cli.send(b"x")


def test_no_one_sided_put(served):
    _, srv, cli = served
    with pytest.raises(CapabilityError):
        cli.put(b"x", RemoteRegion(region_id=1, nbytes=8))
    with pytest.raises(CapabilityError):
        srv.register(bytearray(8))


def test_listener_close_drops_unaccepted_peers_and_counts_them():
    a = _raw()
    lis = udp.listen("udp://127.0.0.1:0")
    dest = _addr_of(lis.url)
    a.sendto(b"1", dest)
    a.sendto(b"2", dest)
    other = _raw()
    other.sendto(b"x", dest)
    ep = lis.accept(timeout_s=2)  # reads a's datagrams into its queue; other's is read too, once needed
    assert ep.recv(timeout_s=2) == b"1"
    time.sleep(0.01)
    assert ep.recv(timeout_s=2) == b"2"
    with pytest.raises(QlinkTimeoutError):
        ep.recv(timeout_s=0.05)  # other's datagram got read and queued for accept
    lis.close()
    assert ep.statistics().extra["listener_dropped"] == 1
    ep.close()
    a.close()
    other.close()


def test_ipv6_loopback_has_the_larger_limit():
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6 support")
    try:
        lis = udp.listen("udp://[::1]:0")
    except OSError as e:
        pytest.skip(f"IPv6 loopback is not available here: {e}")
    with lis:
        assert lis.url.startswith("udp://[::1]:")
        srv = lis.serve_endpoint()
        cli = udp.connect(lis.url)
        assert cli.capabilities.max_message_bytes == 65527
        cli.send(bytes(range(256)) * 255 + bytes(247))  # 65527 bytes
        assert len(srv.recv(timeout_s=2)) == 65527
        cli.close()
        srv.close()


@pytest.mark.parametrize("busy_poll_s", [0, 0.0002])
def test_blocking_receives_with_and_without_busy_poll(busy_poll_s):
    with udp.listen("udp://127.0.0.1:0", busy_poll_s=busy_poll_s) as lis:
        srv = lis.serve_endpoint()
        cli = udp.connect(lis.url, busy_poll_s=busy_poll_s)
        for k in range(20):
            cli.send(b"ping %d" % k)
            assert srv.recv(timeout_s=2) == b"ping %d" % k
            srv.send(b"pong %d" % k)
            assert cli.recv(timeout_s=2) == b"pong %d" % k
        t0 = time.monotonic()
        with pytest.raises(QlinkTimeoutError):
            srv.recv(timeout_s=0.03)  # the spin ends; the rest of the timeout is slept in poll
        assert time.monotonic() - t0 >= 0.03
        cli.close()
        srv.close()
    for bad in (-1e-6, 1.0, True, "50us", float("nan")):
        with pytest.raises(ValueError, match="busy_poll_s"):
            udp.connect("udp://127.0.0.1:9", busy_poll_s=bad)
        with pytest.raises(ValueError, match="busy_poll_s"):
            udp.listen("udp://127.0.0.1:0", busy_poll_s=bad)


def test_a_datagram_too_large_for_the_buffer_stays_ahead_of_later_ones(served):
    _, srv, cli = served
    cli.send(b"X" * 300)
    cli.send(b"small")
    with pytest.raises(BufferTooSmallError) as info:
        srv.recv_into(bytearray(16), timeout_s=2)  # read off the socket, then kept whole
    assert info.value.needed_nbytes == 300
    with pytest.raises(BufferTooSmallError):
        srv.recv_into_nowait(bytearray(16))  # still the first in line
    big = bytearray(300)
    n, addr = srv.recvfrom_into(big, timeout_s=2)
    assert (n, bytes(big), addr) == (300, b"X" * 300, _addr_of(cli.local_url))
    assert srv.recv(timeout_s=2) == b"small"
    srv.send(b"Y" * 200)
    srv.send(b"tiny")
    with pytest.raises(BufferTooSmallError):
        cli.recv_into(bytearray(8), timeout_s=2)
    assert cli.recv(timeout_s=2) == b"Y" * 200 and cli.recv(timeout_s=2) == b"tiny"
    assert srv.statistics().extra["truncated"] == 2 and cli.statistics().extra["truncated"] == 1
