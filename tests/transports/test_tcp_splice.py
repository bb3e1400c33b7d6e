"""tcp's deferred put_many by splice (protocol version 3): the pieces' pages go to the
socket without a copy and land bit-exact; ``flush`` returns only once the peer has read
them (its PUTV_ACK); a put_many that is not deferred is still copied; a peer of version 2
gets copies; malformed acknowledgements break the link."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from qlink.errors import BrokenLinkError, QlinkTimeoutError, WouldBlock
from transports import _tcp_frames, _tcp_handshake, _tcp_splice, tcp
from transports import framing as fr

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not _tcp_splice.built(), reason="transports._tcpc is not built here")]


@pytest.fixture(autouse=True)
def _splice_asked_for(monkeypatch):
    """These tests are about the splice way: ask for it, whichever way this host measures faster."""
    monkeypatch.setenv("QLINK_TCP_SPLICE", "1")


@pytest.fixture
def pair(tcp_pair):
    return tcp_pair


def _roomy(client, server) -> None:
    """Socket buffers that hold a few hundred KiB unread (so a put can finish while the peer waits)."""
    client._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 << 20)
    server._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2 << 20)


def _pieces(rng, count: int, src_nbytes: int, region_nbytes: int):
    """``count`` pieces of odd sizes at odd offsets, none overlapping at either end."""
    ln = rng.integers(1, 300 << 10, count)
    so = np.cumsum(ln + rng.integers(0, 5000, count)) - ln
    do = np.cumsum(ln[::-1] + 3)[::-1] - ln  # the last piece first in the region
    assert so[-1] + ln[-1] <= src_nbytes and do.max() + ln.max() <= region_nbytes
    return so, do, ln


def _expected(region_nbytes, src, so, do, ln):
    want = np.zeros(region_nbytes, np.uint8)
    for s, d, n in zip(so, do, ln):
        want[d:d + n] = src[s:s + n]
    return want


def test_both_ends_speak_version_3_and_defer_in_place(pair):
    client, server = pair
    assert (client.version, server.version) == (3, 3)
    assert client.defers_puts_in_place and server.defers_puts_in_place


def test_a_deferred_put_many_goes_by_splice_and_lands_bit_exact(pair):
    client, server = pair
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 16 << 20, dtype=np.uint8)
    target = np.zeros(12 << 20, np.uint8)
    region = server.register(target)
    so, do, ln = _pieces(rng, 37, src.size, target.size)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("note", server.wait_notification(timeout_s=20)))
    t.start()
    assert client.put_many(src, region.descriptor(), so, do, ln, notify_id=9, tag=b"zc", timeout_s=20,
                           defer=True) == 1
    client.flush(timeout_s=20)
    t.join(20)
    note = got["note"]
    assert (note.notify_id, note.tag, note.offset, note.nbytes) == (9, b"zc", int(do.min()),
                                                                     int((do + ln).max() - do.min()))
    assert np.array_equal(target, _expected(target.size, src, so, do, ln))
    stats = client.statistics().extra
    assert (stats["spliced_puts"], stats["spliced_puts_confirmed"]) == (1, 1)


def test_flush_waits_until_the_peer_has_read_the_pages_it_was_lent(pair, monkeypatch):
    """The pages are lent, not copied: a change to the source before the peer reads is what
    lands (which is why a deferred source must stay unchanged until flush returns), and flush
    does not return before the peer has read."""
    from transports import _tcp_endpoint

    monkeypatch.setattr(_tcp_endpoint, "ZERO_COPY_MIN_NBYTES", 64 << 10)  # small: it fits any socket's buffers
    client, server = pair
    _roomy(client, server)
    src = np.full(64 << 10, 7, np.uint8)
    target = np.zeros(src.size, np.uint8)
    region = server.register(target)
    client.put_many(src, region.descriptor(), [0], [0], [src.size], notify_id=1, timeout_s=10, defer=True)
    assert client.statistics().extra["spliced_puts"] == 1
    with pytest.raises(QlinkTimeoutError, match="flush"):
        client.flush(timeout_s=0.3)  # the peer has not read anything yet
    src[:] = 8  # after the put returned: the socket holds this memory, not a copy of it
    server.wait_notification(timeout_s=10)
    assert (target == 8).all()
    client.flush(timeout_s=10)
    assert client.statistics().extra["spliced_puts_confirmed"] == 1


def test_a_put_many_not_deferred_is_copied_and_a_small_one_too(pair):
    client, server = pair
    _roomy(client, server)
    src = np.full(1 << 20, 5, np.uint8)
    target = np.zeros(src.size, np.uint8)
    region = server.register(target)
    client.put_many(src, region.descriptor(), [0], [0], [src.size // 4], timeout_s=10)  # not deferred
    client.put_many(src, region.descriptor(), [0], [src.size // 2], [4096], timeout_s=10, defer=True)  # small
    src[:] = 6  # copies went: the change does not reach the target
    server.wait_notification(timeout_s=10)
    server.wait_notification(timeout_s=10)
    assert (target[:src.size // 4] == 5).all() and (target[src.size // 2:src.size // 2 + 4096] == 5).all()
    assert client.statistics().extra["spliced_puts"] == 0
    client.flush(timeout_s=0.01)  # nothing to wait for



def _put_out_of_time(client, server, *, seed: int, notify_id: int):
    """A 48 MiB deferred put_many into a peer that does not read: it returns at its timeout
    with the frame begun and the rest kept (the socket full). ``(src, target, region)``."""
    src = np.random.default_rng(seed).integers(0, 256, 48 << 20, dtype=np.uint8)
    target = np.zeros(src.size, np.uint8)
    region = server.register(target)
    client.put_many(src, region.descriptor(), [0], [0], [src.size], notify_id=notify_id, timeout_s=0.3, defer=True)
    assert client._pending is not None  # the rest is kept
    return src, target, region

def test_a_spliced_put_out_of_time_keeps_the_rest_and_it_still_lands(pair):
    """The socket fills while the peer does not read: put_many returns at its timeout with the
    frame begun, keeps the rest (the pipe's bytes and the pieces not yet sent), and the next
    call writes it; every byte lands in order."""
    client, server = pair
    src, target, region = _put_out_of_time(client, server, seed=5, notify_id=2)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("note", server.wait_notification(timeout_s=20)))
    t.start()
    client.send(b"after", timeout_s=20)  # writes the rest first
    t.join(20)
    assert got["note"].notify_id == 2
    assert np.array_equal(target, src)
    buf = bytearray(16)
    assert bytes(buf[:server.recv_into(buf, timeout_s=5)]) == b"after"
    client.flush(timeout_s=10)



def test_a_spliced_frame_whose_header_never_left_the_pipe_raises_and_leaves_nothing_behind(pair):
    """A spliced frame's header and table go into the splice pipe ahead of its pieces. With
    the socket already full (the peer not reading), nothing of the next put_many leaves
    before its timeout: it raises, keeps nothing (no pending bytes, the pipe empty, no ack
    asked for it), and the stream stays whole: the earlier put and a later one land."""
    from qlink.errors import QlinkTimeoutError

    client, server = pair
    src, target, region = _put_out_of_time(client, server, seed=6, notify_id=1)
    tail = client._pending
    client._pending = None  # (held back for a moment: the socket stays full for the next frame)
    asked = client._ack_asked
    small = np.full(1 << 20, 7, np.uint8)
    with pytest.raises(QlinkTimeoutError):
        client.put_many(small, region.descriptor(), [0], [0], [small.size], notify_id=9, timeout_s=0.2, defer=True)
    assert client._pending is None and client._ack_asked == asked
    with pytest.raises(BlockingIOError):
        os.read(client._splice_pipe.r, 1)  # the header did not stay behind in the pipe
    client._pending = tail
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("notes", [server.wait_notification(timeout_s=20).notify_id
                                                                 for _ in range(2)]))
    t.start()
    src2 = np.full(src.size, 3, np.uint8)
    client.put_many(src2, region.descriptor(), [0], [0], [4 << 20], notify_id=2, timeout_s=20, defer=True)
    t.join(30)
    assert got["notes"] == [1, 2]
    assert (target[:4 << 20] == 3).all() and np.array_equal(target[4 << 20:], src[4 << 20:])
    client.flush(timeout_s=10)


def test_a_splice_pipe_found_holding_bytes_breaks_the_link_rather_than_send_out_of_order(pair):
    """Between frames the splice pipe is empty. Should it hold bytes when a frame's header goes
    in (and so take only part of it), the stream's order is lost: the link is marked broken
    with that reason and the put raises BrokenLinkError; nothing is sent out of order."""
    client, server = pair
    client._splice_pipe = pipe = _tcp_splice.SplicePipe.open()
    os.write(pipe.w, bytes(pipe.nbytes - 8))  # all but 8 bytes of room: a header does not fit
    target = np.zeros(_tcp_splice.ZERO_COPY_MIN_NBYTES, np.uint8)
    region = server.register(target)
    src = np.ones(target.size, np.uint8)
    with pytest.raises(BrokenLinkError, match="splice pipe took 0 of a .*-byte frame header; it was not empty"):
        client.put_many(src, region.descriptor(), [0], [0], [src.size], timeout_s=5, defer=True)
    assert client.closed or client._dead is not None

def test_a_version_2_peer_gets_copies_and_flush_returns_at_once():
    with tcp.listen("tcp://127.0.0.1:0") as lis:
        host, port = lis.url.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(fr.HELLO.pack(fr.MAGIC, fr.PROTOCOL_VERSION, _tcp_handshake.HELLO_PUTV, 5))
            version = fr.parse_reply(sock.recv(fr.REPLY.size, socket.MSG_WAITALL))[0]
            assert version == 2
            with lis.accept(timeout_s=5) as server:
                assert server.put_many_gathers and not server.defers_puts_in_place
                src = np.full(1 << 20, 1, np.uint8)
                from qlink.memory import RemoteRegion

                remote = RemoteRegion(region_id=1, nbytes=src.size, key=(5).to_bytes(8, "little"))
                sock.setblocking(False)
                t = threading.Thread(target=_drain, args=(sock, src.size), daemon=True)
                t.start()
                server.put_many(src, remote, [0], [0], [src.size], timeout_s=10, defer=True)
                server.flush(timeout_s=0.01)
                t.join(10)
                assert server.statistics().extra["spliced_puts"] == 0
                head = fr.HEADER.unpack_from(_drain.first, 0)
                assert head[0] == _tcp_frames.KIND_PUTV and head[1] == 0  # no ACK flag towards version 2


def _drain(sock: socket.socket, nbytes: int) -> None:
    sock.setblocking(True)
    first, total = b"", 0
    while total < nbytes:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        first = first or chunk
        total += len(chunk)
    _drain.first = first


def _raw_v3_client(lis):
    host, port = lis.url.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(fr.HELLO.pack(fr.MAGIC, fr.PROTOCOL_VERSION, _tcp_handshake.HELLO_PUTV | _tcp_handshake.HELLO_PUTV_ACK, 5))
    assert fr.parse_reply(sock.recv(fr.REPLY.size, socket.MSG_WAITALL))[0] == 3
    return sock


def test_a_putv_ack_with_a_payload_breaks_the_link_and_is_counted():
    with tcp.listen("tcp://127.0.0.1:0") as lis:
        with _raw_v3_client(lis) as sock, lis.accept(timeout_s=5) as server:
            hdr = bytearray(fr.HEADER.size)
            fr.HEADER.pack_into(hdr, 0, _tcp_frames.KIND_PUTV_ACK, 0, 0, 0, 4, 1, 0)
            sock.sendall(bytes(hdr) + b"junk")
            with pytest.raises(BrokenLinkError, match="PUTV_ACK frame announces 4 payload bytes"):
                server.wait_notification(timeout_s=5)
            assert server.statistics().errors >= 1


def test_the_peer_answers_a_putv_flagged_ack_with_its_count():
    """A raw version-3 client sends two PUTV frames flagged ACK; the endpoint answers each with
    a PUTV_ACK counting them, as it reads them, before anything asks it for the notification."""
    with tcp.listen("tcp://127.0.0.1:0") as lis:
        with _raw_v3_client(lis) as sock, lis.accept(timeout_s=5) as server:
            target = np.zeros(64, np.uint8)
            region = server.register(target)
            for k in (1, 2):
                table = np.array([[8 * k, 8]], dtype="<u8").tobytes()
                hdr = bytearray(fr.HEADER.size)
                fr.HEADER.pack_into(hdr, 0, _tcp_frames.KIND_PUTV, _tcp_frames.PUTV_ACK, 0, region.region_id,
                                    len(table) + 8, 1, k)
                sock.sendall(bytes(hdr) + table + bytes([k]) * 8)
                note = server.wait_notification(timeout_s=5)
                assert note.notify_id == k
                ack = fr.HEADER.unpack(sock.recv(fr.HEADER.size, socket.MSG_WAITALL))
                assert (ack[0], ack[5]) == (_tcp_frames.KIND_PUTV_ACK, k)
            assert bytes(target[8:24]) == b"\x01" * 8 + b"\x02" * 8



def test_frames_flagged_ack_that_arrive_together_get_one_answer_once_the_socket_is_dry():
    """Three PUTV frames flagged ACK sent in one write: while the next frame's bytes wait in
    the socket, no answer goes; once it is dry, one PUTV_ACK counts all three (and nothing
    else is sent)."""
    with tcp.listen("tcp://127.0.0.1:0") as lis:
        with _raw_v3_client(lis) as sock, lis.accept(timeout_s=5) as server:
            target = np.zeros(64, np.uint8)
            region = server.register(target)
            wire = b""
            for k in (1, 2, 3):
                table = np.array([[8 * k, 8]], dtype="<u8").tobytes()
                hdr = bytearray(fr.HEADER.size)
                fr.HEADER.pack_into(hdr, 0, _tcp_frames.KIND_PUTV, _tcp_frames.PUTV_ACK, 0, region.region_id,
                                    len(table) + 8, 1, k)
                wire += bytes(hdr) + table + bytes([k]) * 8
            sock.sendall(wire)
            time.sleep(0.2)  # all of it in the server's socket before it reads
            assert [server.wait_notification(timeout_s=5).notify_id for _ in range(3)] == [1, 2, 3]
            ack = fr.HEADER.unpack(sock.recv(fr.HEADER.size, socket.MSG_WAITALL))
            assert (ack[0], ack[5]) == (_tcp_frames.KIND_PUTV_ACK, 3)
            sock.settimeout(0.2)
            with pytest.raises(TimeoutError):
                sock.recv(1)  # one answer, not three
            assert bytes(target[8:32]) == b"\x01" * 8 + b"\x02" * 8 + b"\x03" * 8

def test_qlink_tcp_splice_0_has_deferred_puts_copied(monkeypatch):
    monkeypatch.setenv("QLINK_TCP_SPLICE", "0")
    with tcp.listen("tcp://127.0.0.1:0") as lis:
        with tcp.connect(lis.url, timeout_s=5) as client, lis.accept(timeout_s=5) as server:
            assert client.version == 3 and not client.defers_puts_in_place
            _roomy(client, server)
            src = np.full(_tcp_splice.ZERO_COPY_MIN_NBYTES, 3, np.uint8)
            target = np.zeros(src.size, np.uint8)
            region = server.register(target)
            client.put_many(src, region.descriptor(), [0], [0], [src.size], timeout_s=10, defer=True)
            src[:] = 4  # copied: the change does not reach the target
            server.wait_notification(timeout_s=10)
            assert (target == 3).all() and client.statistics().extra["spliced_puts"] == 0


def test_the_c_loops_refuse_pieces_outside_their_memory_and_a_state_that_does_not_fit():
    from transports import _tcpc

    src = np.zeros(100, np.uint8)
    so, ln = np.array([0, 90], np.int64), np.array([10, 20], np.int64)
    with pytest.raises(ValueError, match="piece 1 .20 bytes at 90. lies outside the 100-byte source"):
        _tcpc.splice_pieces(-1, -1, -1, 4096, src, so, ln, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="the state does not fit"):
        _tcpc.recv_pieces(-1, src, np.array([0], np.int64), np.array([10], np.int64), np.array([0, 11], np.int64))
    with pytest.raises(ValueError, match="int64 arrays of one length"):
        _tcpc.recv_pieces(-1, src, np.array([0], np.int64), np.array([10, 1], np.int64), np.zeros(2, np.int64))


def test_an_ack_due_while_this_side_is_sending_goes_when_that_send_ends(pair, monkeypatch):
    """The server is in the middle of a large send (its send lock held, the client not reading)
    when it reads the client's spliced put: the PUTV_ACK cannot go then, and goes as soon as that
    send ends, with nothing else sent after it, so the client's flush returns."""
    from transports import _tcp_endpoint

    monkeypatch.setattr(_tcp_endpoint, "ZERO_COPY_MIN_NBYTES", 64 << 10)
    client, server = pair
    _roomy(client, server)
    big = np.zeros(32 << 20, np.uint8)
    sending = threading.Thread(target=lambda: server.send(big, timeout_s=30))
    sending.start()
    for _ in range(100):  # until the server's send fills the socket and waits for room
        if server._slock.locked() and server._pending is None:
            break
        threading.Event().wait(0.01)
    assert sending.is_alive()
    target = np.zeros(64 << 10, np.uint8)
    region = server.register(target)
    src = np.full(target.size, 9, np.uint8)
    client.put_many(src, region.descriptor(), [0], [0], [src.size], timeout_s=10, defer=True)
    server.wait_notification(timeout_s=10)  # read while the send lock is held: the ack is owed
    assert server._ack_read == 1 and server._ack_told == 0
    out = np.empty_like(big)
    assert client.recv_into(out, timeout_s=30) == big.size  # the server's send can end now
    sending.join(30)
    client.flush(timeout_s=5)
    assert (target == 9).all()


def test_an_ack_that_comes_due_while_a_spliced_frame_begins_goes_after_the_frame(pair, monkeypatch):
    """This side's receive thread reads a flagged frame of the peer (an ack comes due) just as
    this side begins a spliced frame: the ack must not go between that frame's table and its
    pieces, but after them; the peer gets the pieces bit-exact and the ack after them."""
    client, server = pair
    _roomy(client, server)
    target = np.zeros(_tcp_splice.ZERO_COPY_MIN_NBYTES, np.uint8)
    region = client.register(target)
    src = np.arange(target.size, dtype=np.uint8)
    real_check = server._check_peer
    due = []

    def check_then_an_ack_comes_due(what):  # as if the receive thread read a flagged frame now
        real_check(what)
        if not due:
            due.append(1)
            server._ack_read += 1

    monkeypatch.setattr(server, "_check_peer", check_then_an_ack_comes_due)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("note", client.wait_notification(timeout_s=10)))
    t.start()
    server.put_many(src, region.descriptor(), [0], [0], [src.size], notify_id=4, timeout_s=10, defer=True)
    t.join(10)
    assert got["note"].notify_id == 4 and np.array_equal(target, src)
    for _ in range(100):  # read on: the ack came after the frame, whole
        with pytest.raises(WouldBlock):
            client.poll_notification_nowait()
        if client._ack_heard:
            break
        threading.Event().wait(0.01)
    assert client._ack_heard == 1 and client.statistics().errors == 0


def test_the_c_reader_waits_for_the_rest_of_a_frame_for_as_long_as_it_is_told():
    """recv_pieces with spin_ns: bytes that come 20 ms after the first are read in the same call
    when it may wait 2 s for them, and not when it may not wait (it returns what was there)."""
    from transports import _tcpc

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        dst = np.zeros(8, np.uint8)
        at, ln = np.array([0, 4], np.int64), np.array([4, 4], np.int64)
        for spin_ns, want in ((0, 4), (2_000_000_000, 8)):
            dst[:] = 0
            st = np.zeros(2, np.int64)
            a.sendall(bytes([1, 2, 3, 4]))
            later = threading.Timer(0.02, lambda: a.sendall(bytes([5, 6, 7, 8])))
            later.start()
            got = _tcpc.recv_pieces(b.fileno(), dst, at, ln, st, spin_ns)
            later.join()
            assert got == want, spin_ns
            if want == 4:  # the rest, read once it is there
                time.sleep(0.05)
                assert _tcpc.recv_pieces(b.fileno(), dst, at, ln, st) == 4
            assert dst.tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and st.tolist() == [2, 0]
        a.close()  # the end of the stream, nothing read: -1 at once, however long it may wait
        assert _tcpc.recv_pieces(b.fileno(), dst, at, ln, np.zeros(2, np.int64), 2_000_000_000) == -1
    finally:
        a.close()
        b.close()
