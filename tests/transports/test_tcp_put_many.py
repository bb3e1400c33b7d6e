"""tcp's vectored put: one PUTV frame and one Notification per ``put_many`` between two
version-2 ends, bit-exact however the pieces lie; one PUT frame per piece, readable by the
version-1 parser, towards a peer that speaks version 1 (both ends of the handshake
checked); malformed PUTV frames break the link, a withdrawn region is never announced."""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

from qlink.errors import BrokenLinkError, QlinkTimeoutError
from qlink.memory import RemoteRegion
from transports import framing as fr
from transports import _tcp_frames, _tcp_handshake, tcp

pytestmark = pytest.mark.timeout(60)


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    out = bytearray()
    while len(out) < nbytes:
        chunk = sock.recv(nbytes - len(out))
        if not chunk:
            raise EOFError(f"socket closed after {len(out)} of {nbytes} bytes")
        out += chunk
    return bytes(out)


@pytest.fixture
def pair(tcp_pair):
    return tcp_pair


def _expected(region_nbytes, src, so, do, ln):
    want = np.zeros(region_nbytes, np.uint8)
    for s, d, n in zip(so, do, ln):
        want[d:d + n] = src[s:s + n]
    return want


@pytest.mark.parametrize("unit, count", [(4096, 37), (1, 5), (24, 3000)])  # rows for NumPy, odd sizes, > IOV_MAX
def test_put_many_is_one_frame_and_one_notification_bit_exact(pair, unit, count):
    client, server = pair
    assert client.put_many_gathers and server.put_many_gathers  # both ends speak version 2
    rng = np.random.default_rng(unit)
    slots = count * 2
    target = np.zeros(slots * unit, np.uint8)
    region = server.register(target)
    src = rng.integers(0, 256, slots * unit, dtype=np.uint8)
    so = rng.permutation(slots)[:count] * unit
    do = rng.permutation(slots)[:count] * unit
    ln = np.full(count, unit)
    ln[::3] = unit if unit == 1 else unit // 2  # pieces of two sizes
    assert client.put_many(src, region.descriptor(), so, do, ln, notify_id=77, tag=b"layer-3", timeout_s=10) == 1
    note = server.wait_notification(timeout_s=10)
    lo, hi = int(do.min()), int((do + ln).max())
    assert (note.region_id, note.offset, note.nbytes, note.notify_id, note.tag) == \
        (region.region_id, lo, hi - lo, 77, b"layer-3")
    assert (target == _expected(target.size, src, so, do, ln)).all()
    with pytest.raises(QlinkTimeoutError):
        server.wait_notification(timeout_s=0.05)  # one notification, not one per piece
    assert client.statistics().extra["gathered_puts"] == 1
    assert client.statistics().puts == count and server.statistics().notifications == 1


@pytest.mark.parametrize("way", ["native", "in place", "staged"])  # how every frame's pieces are read
def test_pieces_land_in_place_or_staged_bit_exact_across_frames_and_a_withdrawn_region(pair, monkeypatch, way):
    """Large and odd pieces (one of 1 byte, one past the read-ahead buffer), over several
    frames of one put_many, then one piece alone: bit-exact and one Notification each, read
    straight into the region (by the C loop, or piece by piece) or through the staging
    buffer; a frame for a withdrawn region is read past and the link goes on."""
    from transports import _tcp_pump
    if way == "native" and _tcp_pump.recv_pieces is None:
        pytest.skip("transports._tcpc is not built here")
    client, server = pair
    direct_piece = 1 if way == "in place" else 1 << 40
    monkeypatch.setattr(_tcp_pump, "_NATIVE_PIECE", 1 if way == "native" else 1 << 40)
    monkeypatch.setattr(_tcp_pump, "_DIRECT_PIECE", direct_piece)
    monkeypatch.setattr(fr, "MAX_FRAME_PAYLOAD", 1 << 20)  # a few pieces a frame: several frames
    rng = np.random.default_rng(direct_piece % 97)
    ln = np.array([1, 300_001, 65_536, 7, 700_000, 131_072, 99_999, 3])
    do = np.cumsum(ln[::-1])[::-1] - ln + 11  # back to front in the region
    so = np.cumsum(ln) - ln
    src = rng.integers(0, 256, int(ln.sum()), dtype=np.uint8)
    target = np.zeros(int((do + ln).max()) + 5, np.uint8)
    region = server.register(target)
    assert len(_tcp_frames.frame_groups(ln)) > 1
    got = []
    t = threading.Thread(target=lambda: got.append(server.wait_notification(timeout_s=30)))
    t.start()
    client.put_many(src, region.descriptor(), so, do, ln, notify_id=3, tag=b"k", timeout_s=30)
    t.join(30)
    assert got and (got[0].offset, got[0].nbytes, got[0].tag) == (11, int(ln.sum()), b"k")
    assert (target == _expected(target.size, src, so, do, ln)).all()
    client.put_many(src, region.descriptor(), [5], [0], [400_000], notify_id=4, timeout_s=30)  # one piece
    note = server.wait_notification(timeout_s=30)
    assert (note.offset, note.nbytes, note.notify_id) == (0, 400_000, 4)
    assert (target[:400_000] == src[5:400_005]).all()
    gone = server.register(np.zeros(1 << 20, np.uint8))
    desc = gone.descriptor()
    server.deregister(gone)
    client.put_many(src, desc, [0, 300_000], [0, 500_000], [300_000, 400_000], timeout_s=30)
    client.put_many(src, region.descriptor(), [1], [1], [2], notify_id=6, timeout_s=30)  # the link still works
    note = server.wait_notification(timeout_s=30)
    assert (note.notify_id, note.offset, note.nbytes) == (6, 1, 2)
    assert server.statistics().extra["puts_rejected"] == 1


def test_a_large_put_many_while_the_target_is_not_reading_and_in_the_other_direction(pair):
    """Bigger than the socket buffers: the sender writes in pieces and waits for room
    while the target receives in another thread; then the same from the listener's side."""
    client, server = pair
    nbytes = 24 << 20
    block = 64 << 10
    src = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    for a, b in ((client, server), (server, client)):
        target = np.zeros(nbytes, np.uint8)
        region = b.register(target)
        rows = nbytes // block
        so = np.random.default_rng(3).permutation(rows) * block
        do = np.arange(rows) * block
        got = []
        t = threading.Thread(target=lambda: got.append(b.wait_notification(timeout_s=30)))
        t.start()
        assert a.put_many(src, region.descriptor(), so, do, np.full(rows, block), notify_id=5, timeout_s=30) == 1
        t.join(30)
        assert got and (got[0].offset, got[0].nbytes) == (0, nbytes)
        assert (target.reshape(rows, block) == src.reshape(rows, block)[so // block]).all()
        b.deregister(region)


def test_a_put_many_past_the_frame_limit_goes_as_several_frames_one_notification(pair, monkeypatch):
    client, server = pair
    monkeypatch.setattr(fr, "MAX_FRAME_PAYLOAD", 4096)  # both ends of this process see the smaller limit
    target = np.zeros(1 << 16, np.uint8)
    region = server.register(target)
    src = np.arange(1 << 15, dtype=np.uint32).view(np.uint8)[: 1 << 15]
    so, do, ln = np.arange(20) * 1500, np.arange(20) * 3000 + 7, np.full(20, 1500)
    assert _tcp_frames.frame_groups(ln)[:2] == [(0, 2), (2, 4)]  # two pieces and their table entries per frame
    client.put_many(src, region.descriptor(), so, do, ln, notify_id=9, tag=b"t", timeout_s=10)
    note = server.wait_notification(timeout_s=10)
    assert (note.offset, note.nbytes, note.tag) == (7, 19 * 3000 + 1500, b"t")
    assert (target == _expected(target.size, src, so, do, ln)).all()
    with pytest.raises(QlinkTimeoutError):
        server.wait_notification(timeout_s=0.05)


def test_a_region_withdrawn_in_flight_is_never_announced(pair):
    client, server = pair
    target = np.zeros(4096, np.uint8)
    region = server.register(target)
    desc = region.descriptor()
    server.deregister(region)  # the DEREG frame is on its way; the client has not read it yet
    client.put_many(b"x" * 64, desc, [0, 32], [0, 100], [32, 32], notify_id=1, timeout_s=5)
    with pytest.raises(QlinkTimeoutError):
        server.wait_notification(timeout_s=0.2)
    assert server.statistics().extra["puts_rejected"] == 1 and not target.any()
    other = server.register(np.zeros(64, np.uint8))
    client.put_many(b"abcd", other.descriptor(), [0, 2], [60, 0], [2, 2], timeout_s=5)  # the link still works
    assert server.wait_notification(timeout_s=5).nbytes == 62


@pytest.mark.parametrize("piece", [64, 1 << 17])  # staged behind the table / read into place
def test_a_region_deregistered_here_while_its_putv_frame_is_half_in(pair, piece):
    """The target deregisters while a PUTV frame for that region is half received: the rest
    lands where the frame began landing (as a PUT's bytes do), nothing raises, and the link
    goes on."""
    client, server = pair
    target = np.zeros(8 * piece, np.uint8)
    region = server.register(target)
    ln = np.full(4, piece, "<u8")
    do = np.arange(4, dtype="<u8")[::-1] * piece * 2
    payload = np.random.default_rng(piece).integers(0, 256, int(ln.sum()), dtype=np.uint8).tobytes()
    table = np.stack([do, ln], axis=1).astype("<u8").tobytes()
    head = bytearray(fr.HEADER.size)
    fr.HEADER.pack_into(head, 0, _tcp_frames.KIND_PUTV, 0, 0, region.region_id, len(table) + len(payload), 4, 7)
    half = len(payload) // 2
    client._sock.sendall(bytes(head) + table + payload[:half])
    with pytest.raises(QlinkTimeoutError):
        server.wait_notification(timeout_s=0.2)  # the table and half the pieces read
    server.deregister(region)
    client._sock.sendall(payload[half:])
    note = server.wait_notification(timeout_s=5)
    assert (note.region_id, note.notify_id) == (region.region_id, 7)
    for i in range(4):
        assert target[int(do[i]):int(do[i]) + piece].tobytes() == payload[i * piece:(i + 1) * piece]
    other = server.register(np.zeros(16, np.uint8))
    client.put_many(b"abcd", other.descriptor(), [0], [4], [4], timeout_s=5)
    assert server.wait_notification(timeout_s=5).nbytes == 4


def test_a_malformed_putv_frame_breaks_the_link(pair):
    """Pieces that do not add up to the payload put the stream out of step: BrokenLinkError."""
    client, server = pair
    target = np.zeros(64, np.uint8)
    region = server.register(target)
    head = bytearray(fr.HEADER.size)
    fr.HEADER.pack_into(head, 0, _tcp_frames.KIND_PUTV, 0, 0, region.region_id, 16 + 4, 1, 0)
    client._sock.sendall(bytes(head) + struct.pack("<QQ", 0, 8) + b"abcd")  # a table of 8 B, 4 B follow
    with pytest.raises(BrokenLinkError, match="add up"):
        server.wait_notification(timeout_s=5)
    assert not target.any()


# ----- version 1 peers ----------------------------------------------------------------------


def _parse_frames(data: bytes) -> list[tuple]:
    """Frames as the version-1 parser reads them: (kind, region_id, offset, notify_id, tag, payload)."""
    out, pos = [], 0
    while pos < len(data):
        kind, tag_n, rid, n, off, nid = fr.parse_header(data, pos)
        pos += fr.HEADER.size
        tag, payload = data[pos:pos + tag_n], data[pos + tag_n:pos + tag_n + n]
        pos += tag_n + n
        out.append((kind, rid, off, nid, tag, payload))
    return out


def test_a_new_client_speaks_version_1_to_a_version_1_listener():
    """The client's hello is a version-1 hello (a v1 listener accepts it) with the PUTV flag;
    a v1 listener answers version 1, so put_many goes as one PUT frame per piece."""
    srv = socket.create_server(("127.0.0.1", 0))
    seen = {}

    def old_listener():
        conn, _ = srv.accept()
        with conn:
            hello = _recv_exact(conn, fr.HELLO.size)
            seen["hello"] = fr.HELLO.unpack(hello)
            seen["check"] = fr.check_hello(hello)[0]
            conn.sendall(fr.pack_reply(fr.STATUS_OK, 4242))  # what a version-1 listener sends
            seen["frames"] = _recv_exact(conn, 3 * fr.HEADER.size + 2 + 3 + 5 + 3 * 2)

    t = threading.Thread(target=old_listener, daemon=True)
    t.start()
    with srv:
        client = tcp.connect(f"tcp://127.0.0.1:{srv.getsockname()[1]}", timeout_s=5)
        with client:
            assert not client.put_many_gathers
            remote = RemoteRegion(region_id=3, nbytes=100, key=(4242).to_bytes(8, "little"))
            assert client.put_many(b"0123456789", remote, [0, 2, 5], [90, 0, 40], [2, 3, 5], notify_id=6,
                                   tag=b"kv", timeout_s=5) == 3
            t.join(5)
    magic, version, flags, _key = seen["hello"]
    assert (magic, version, flags & _tcp_handshake.HELLO_PUTV, seen["check"]) == (fr.MAGIC, 1, 1, fr.STATUS_OK)
    frames = _parse_frames(seen["frames"])
    assert [(f[0], f[1], f[2], f[3], f[4], f[5]) for f in frames] == [
        (fr.KIND_PUT, 3, 90, 6, b"kv", b"01"), (fr.KIND_PUT, 3, 0, 6, b"kv", b"234"),
        (fr.KIND_PUT, 3, 40, 6, b"kv", b"56789")]


def test_a_version_1_client_gets_version_1_and_put_frames_from_the_listener():
    with tcp.listen("tcp://127.0.0.1:0") as lis:
        host, port = lis.url.removeprefix("tcp://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=5)
        with sock:
            sock.sendall(fr.pack_hello(777))  # a version-1 client: no flags
            version, status, _key, reason_n = fr.parse_reply(_recv_exact(sock, fr.REPLY.size))
            assert (version, status, reason_n) == (1, fr.STATUS_OK, 0)
            with lis.accept(timeout_s=5) as server:
                assert not server.put_many_gathers
                remote = RemoteRegion(region_id=1, nbytes=64, key=(777).to_bytes(8, "little"))
                assert server.put_many(b"abcdef", remote, [0, 3], [10, 20], [3, 3], notify_id=2, timeout_s=5) == 2
                frames = _parse_frames(_recv_exact(sock, 2 * (fr.HEADER.size + 3)))
                assert [(f[0], f[2], f[5]) for f in frames] == [(fr.KIND_PUT, 10, b"abc"), (fr.KIND_PUT, 20, b"def")]


def test_a_version_2_listener_answers_version_2_to_a_client_that_takes_putv():
    with tcp.listen("tcp://127.0.0.1:0") as lis:
        host, port = lis.url.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(fr.HELLO.pack(fr.MAGIC, fr.PROTOCOL_VERSION, _tcp_handshake.HELLO_PUTV, 5))
            version, status, _key, _n = fr.parse_reply(_recv_exact(sock, fr.REPLY.size))
            assert (version, status) == (2, fr.STATUS_OK)
            with lis.accept(timeout_s=5) as server:
                assert server.put_many_gathers


@pytest.mark.parametrize("piece", [64, 1 << 17])  # staged behind the table / read into place
def test_a_peer_gone_halfway_through_a_putv_frame_is_a_broken_link_and_never_announced(pair, piece):
    client, server = pair
    target = np.zeros(8 * piece, np.uint8)
    region = server.register(target)
    ln = np.full(4, piece, "<u8")
    do = np.arange(4, dtype="<u8") * piece * 2
    table = np.stack([do, ln], axis=1).astype("<u8").tobytes()
    head = bytearray(fr.HEADER.size)
    fr.HEADER.pack_into(head, 0, _tcp_frames.KIND_PUTV, 0, 0, region.region_id, len(table) + 4 * piece, 4, 7)
    client._sock.sendall(bytes(head) + table + b"\x05" * (2 * piece + 1))
    client._sock.shutdown(socket.SHUT_WR)  # the end of the stream, mid-piece
    with pytest.raises(BrokenLinkError, match="without a goodbye"):
        server.wait_notification(timeout_s=5)
    # pieces read into place landed as they came; staged ones are scattered only once all are in
    assert (target[:piece] == (5 if piece > 64 else 0)).all()
