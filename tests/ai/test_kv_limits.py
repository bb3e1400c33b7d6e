"""The KV link's control path under hostile peers (plain sockets): a silent peer holds up no
other link's handshake, an oversized frame header is refused unread, links are bounded,
and beyond loopback a token is required and checked."""

from __future__ import annotations

import random
import socket
import struct
import time

import pytest

from qlink.ai import KVCache, KVCacheSpec
from transports import loopback_url
url_for = loopback_url
from qlink.ai._vllm_link import DecodeClient, PrefillServer

pytestmark = pytest.mark.timeout(120)

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=32, block_size=16, dtype_name="float32", num_blocks=8,
                   num_planes=1)
TOKEN = "kv-link-test-token-0123456789"
_FRAME = struct.Struct("<BBHIQQQ")


def _raw_session(url):
    host, port = url[len("tcp://"):].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(struct.pack("<4sHHQ", b"QLTC", 1, 0, random.getrandbits(64)))
    head = b""
    while len(head) < 18:
        chunk = sock.recv(18 - len(head))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        head += chunk
    magic, _v, status, _k, n = struct.unpack("<4sHHQH", head)
    if n:
        sock.recv(n)
    return sock, status


def _load(server, dst, key, xfer, *, token=None):
    client = DecodeClient(dst, load_timeout_s=20, token=token)
    try:
        server.offer(xfer, [1, 2], key=key)
        client.load(key, url=server.url, xfer_id=xfer, src_block_ids=[1, 2], dst_block_ids=[3, 4])
        deadline, out = time.monotonic() + 30, []
        while not out and time.monotonic() < deadline:
            out = client.take_results()
            time.sleep(0.002)
        return out[0] if out else None
    finally:
        client.close()


def _own_address():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))
        addr = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if addr.startswith("127.") else addr


def test_silent_and_oversized_peers_hold_up_no_other_link():
    src, dst = KVCache.allocate(SPEC, shared=False), KVCache.allocate(SPEC, shared=False)
    src.fill_random(seed=1)
    server = PrefillServer(url_for("tcp"), src, handshake_timeout_s=1.0)
    try:
        silent, status = _raw_session(server.url)  # past the transport handshake, then says nothing
        assert status == 0
        t0 = time.monotonic()
        r = _load(server, dst, "a", 1)
        assert r is not None and r.ok, r
        assert time.monotonic() - t0 < 15
        assert (dst.block_checksums([3, 4]) == src.block_checksums([1, 2])).all()
        deadline = time.monotonic() + 10
        while not server.refused_by_reason.get("handshake_timeout") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.refused_by_reason["handshake_timeout"] == 1
        silent.close()
    finally:
        server.close()


def test_kv_receiver_refuses_an_oversized_control_frame_unread():
    import transports
    from qlink.ai import KVReceiver
    from qlink.errors import BrokenLinkError

    dst = KVCache.allocate(SPEC, shared=False)
    lis = transports.listen("tcp://127.0.0.1:0")
    try:
        sock, _ = _raw_session(lis.url)
        ep = lis.accept(timeout_s=5)
        rx = KVReceiver(ep, dst)
        sock.sendall(_FRAME.pack(1, 0, 0, 0, 1 << 30, 0, 0))  # a message of 1 GiB announced, none of it sent
        with pytest.raises(BrokenLinkError):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                rx.progress()
                time.sleep(0.01)
        assert rx.oversized_frames == 1
        sock.settimeout(5)
        while sock.recv(65536):  # the receiver closed the link
            pass
        sock.close()
        rx.close()
    finally:
        lis.close()


def test_prefill_server_beyond_loopback_needs_a_token_and_checks_it():
    from qlink.access import InsecureBindError

    addr = _own_address()
    if addr is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    src, dst = KVCache.allocate(SPEC, shared=False), KVCache.allocate(SPEC, shared=False)
    with pytest.raises(InsecureBindError, match="token"):
        PrefillServer(f"tcp://{addr}:0", src)
    server = PrefillServer(f"tcp://{addr}:0", src, token=TOKEN, max_links=4)
    try:
        _sock, status = _raw_session(server.url)
        assert status != 0  # refused: no token
        r = _load(server, dst, "a", 1, token=TOKEN)
        assert r is not None and r.ok, r
        r = _load(server, dst, "b", 2)  # a decode engine without the token fails clearly
        assert r is not None and not r.ok and "token" in r.error
    finally:
        server.close()
    assert server.refused_by_reason["no_token"] == 2


def _kv_hello_session(url, spec):
    """A plain-socket decode engine: the transport handshake, then a receiver's KV hello
    (send mode, no regions), then whatever the test does."""
    from qlink.ai import frames as fr
    from qlink.ai._handshake import MODE_CODES, ROLE_RECEIVER

    sock, status = _raw_session(url)
    assert status == 0
    hello = fr.pack_hello(role=ROLE_RECEIVER, mode=MODE_CODES["send"], spec=spec.to_bytes(), regions=[])
    sock.sendall(_FRAME.pack(1, 0, 0, 0, len(hello), 0, 0) + hello)
    return sock


def _frames_until_closed(sock, timeout_s=20):
    """Every MSG payload the server sends until it closes the connection."""
    sock.settimeout(timeout_s)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    out, pos = [], 0
    while pos + _FRAME.size <= len(data):
        kind, _f, tag_n, _r, n, _o, _nid = _FRAME.unpack_from(data, pos)
        pos += _FRAME.size + tag_n
        if kind == 1:
            out.append(data[pos:pos + n])
        pos += n
    return out


def _wait_for(cond, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def _land(client, server, src, dst, key, xfer, src_ids, dst_ids):
    server.offer(xfer, src_ids, key=key)
    client.load(key, url=server.url, xfer_id=xfer, src_block_ids=src_ids, dst_block_ids=dst_ids)
    out = []
    assert _wait_for(lambda: out.extend(client.take_results()) or out, 30), "the load never finished"
    r = out[0]
    assert r.ok, r
    assert (dst.block_checksums(dst_ids) == src.block_checksums(src_ids)).all()


def test_an_idle_link_is_closed_with_a_reason_while_a_transfer_lands_bit_exact():
    from qlink.ai._vllm_link import close_notice_reason

    src, dst = KVCache.allocate(SPEC, shared=False), KVCache.allocate(SPEC, shared=False)
    src.fill_random(seed=2)
    server = PrefillServer(url_for("tcp"), src, idle_timeout_s=0.5)
    client = DecodeClient(dst, load_timeout_s=30)
    try:
        silent = _kv_hello_session(server.url, SPEC)  # a link past both handshakes that says nothing more
        _land(client, server, src, dst, "a", 1, [1, 2], [3, 4])
        reasons = [close_notice_reason(f) for f in _frames_until_closed(silent)]
        assert "idle_timeout" in reasons, reasons  # told why, then closed
        silent.close()
        # the decode client's own link went idle too: closed, and opened again for the next load
        assert _wait_for(lambda: server.closed_by_reason["idle_timeout"] >= 2)
        assert _wait_for(lambda: (client.poll(), client.links_closed_by_server["idle_timeout"] >= 1)[1])
        _land(client, server, src, dst, "b", 2, [5, 6, 7], [0, 1, 2])
    finally:
        client.close()
        server.close()
    assert server.closed_by_reason["idle_timeout"] >= 2
    assert server.pushed == 2 and not server.failed


def test_a_half_sent_frame_is_closed_after_the_frame_timeout_and_others_go_on():
    from qlink.ai._vllm_link import close_notice_reason

    src, dst = KVCache.allocate(SPEC, shared=False), KVCache.allocate(SPEC, shared=False)
    src.fill_random(seed=3)
    server = PrefillServer(url_for("tcp"), src, frame_timeout_s=0.3, idle_timeout_s=None)
    client = DecodeClient(dst, load_timeout_s=30)
    try:
        half = _kv_hello_session(server.url, SPEC)
        half.sendall(_FRAME.pack(1, 0, 0, 0, 64, 0, 0) + bytes(10))  # 64 bytes announced, 10 sent
        _land(client, server, src, dst, "a", 1, [0, 1], [6, 7])
        reasons = [close_notice_reason(f) for f in _frames_until_closed(half)]
        assert "frame_timeout" in reasons, reasons
        half.close()
        _land(client, server, src, dst, "b", 2, [2], [5])  # the well-behaved link is still open
    finally:
        client.close()
        server.close()
    assert server.closed_by_reason == {"frame_timeout": 1}
    assert not client.links_closed_by_server


def test_prefill_server_timeouts_are_checked():
    src = KVCache.allocate(SPEC, shared=False)
    with pytest.raises(ValueError, match="idle_timeout_s"):
        PrefillServer(url_for("tcp"), src, idle_timeout_s=0)
    with pytest.raises(ValueError, match="frame_timeout_s"):
        PrefillServer(url_for("tcp"), src, frame_timeout_s=-1.0)


def test_a_load_sent_on_a_link_the_server_just_closed_is_asked_again_on_a_new_one():
    src, dst = KVCache.allocate(SPEC, shared=False), KVCache.allocate(SPEC, shared=False)
    src.fill_random(seed=4)
    server = PrefillServer(url_for("tcp"), src, idle_timeout_s=0.5)
    client = DecodeClient(dst, load_timeout_s=30)
    try:
        _land(client, server, src, dst, "a", 1, [1], [2])
        with client._work:  # the client does nothing while the server closes its idle link ...
            assert _wait_for(lambda: server.closed_by_reason["idle_timeout"] >= 1)
            time.sleep(0.1)
            server.offer(2, [3, 4], key="b")
            # ... so its next load goes out on the closed link first
            client.load("b", url=server.url, xfer_id=2, src_block_ids=[3, 4], dst_block_ids=[5, 6])
        out = []
        assert _wait_for(lambda: out.extend(client.take_results()) or out, 30)
        assert out[0].ok, out[0]
        assert (dst.block_checksums([5, 6]) == src.block_checksums([3, 4])).all()
        assert client.links_closed_by_server["idle_timeout"] == 1
    finally:
        client.close()
        server.close()
