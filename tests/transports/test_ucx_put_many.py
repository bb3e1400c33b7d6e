"""ucx's vectored put: one control frame, one data message and one Notification per
``put_many`` between two ends whose hellos offer it, bit-exact however the pieces lie
(later pieces win where destinations overlap); malformed vectored puts and regions
deregistered in flight are counted and never announced while the link keeps working; a
peer that does not offer the flag (an older qlink) gets one put per piece."""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

import transports
from qlink.errors import QlinkTimeoutError
from transports import _ucx_boot as boot
from transports import _ucx_put as uput
from transports import _ucx_wire as wire
from transports import ucx  # before ucxx itself, so its UCX environment defaults apply

pytest.importorskip("ucxx", reason="the ucx transport needs ucxx-cu12 (pip install 'qlink[ucx]')")
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ucx_pair():
    """A connected pair whose client does not offer RMA: put_many goes as the vectored puts
    tested here (with RMA in force it is written by UCX instead: tests/transports/test_ucx_rma.py)."""
    lis = transports.listen("ucx://127.0.0.1:0")
    a = transports.connect(lis.url, timeout_s=5, rma=False)
    b = lis.accept(timeout_s=5)
    assert not a.rma and not b.rma
    yield a, b
    a.close()
    b.close()
    lis.close()


def _expected(region_nbytes, src, so, do, ln):
    want = np.zeros(region_nbytes, np.uint8)
    for s, d, n in zip(so, do, ln):
        want[d:d + n] = src[s:s + n]
    return want


def _no_more_notes(ep) -> None:
    with pytest.raises(QlinkTimeoutError):
        ep.wait_notification(timeout_s=0.1)


@pytest.mark.parametrize("unit, count, layout", [
    (16384, 64, "scattered"), (4096, 37, "contiguous"), (1, 5, "scattered"), (24, 3000, "scattered"),
    (64, 50, "overlapping"),
])
def test_put_many_is_one_vectored_put_and_one_notification_bit_exact(ucx_pair, unit, count, layout):
    a, b = ucx_pair
    assert a.put_many_gathers and b.put_many_gathers  # both hellos offered vectored puts
    rng = np.random.default_rng(unit + count)
    slots = count * 2
    target = np.zeros(slots * unit, np.uint8)
    region = b.register(target)
    src = rng.integers(0, 256, slots * unit, dtype=np.uint8)
    so = rng.permutation(slots)[:count] * unit
    ln = np.full(count, unit)
    if layout == "contiguous":
        do = np.arange(count) * unit
    elif layout == "overlapping":  # repeated and half-overlapping destinations: later pieces win
        do = rng.integers(0, 8, count) * (unit // 2)
    else:
        do = rng.permutation(slots)[:count] * unit
        ln[::3] = unit if unit == 1 else unit // 2  # pieces of two sizes
    before = b.statistics().extra["bad_frames"]
    assert a.put_many(src, region.descriptor(), so, do, ln, notify_id=77, tag=b"layer-3", timeout_s=10) == 1
    note = b.wait_notification(timeout_s=10)
    lo, hi = int(do.min()), int((do + ln).max())
    assert (note.region_id, note.offset, note.nbytes, note.notify_id, note.tag) == \
        (region.region_id, lo, hi - lo, 77, b"layer-3")
    assert (target == _expected(target.size, src, so, do, ln)).all()
    _no_more_notes(b)  # one notification, not one per piece
    assert a.statistics().extra["gathered_puts"] == 1 and a.statistics().puts == count
    assert b.statistics().notifications == 1 and b.statistics().extra["bad_frames"] == before


def test_a_put_many_of_one_large_piece_is_a_put_straight_into_the_region(ucx_pair):
    a, b = ucx_pair
    rng = np.random.default_rng(11)
    target = np.zeros(3 << 20, np.uint8)
    region = b.register(target)
    src = rng.integers(0, 256, 2 << 20, dtype=np.uint8)
    gathered = a.statistics().extra["gathered_puts"]
    n = (1 << 20) + 12345
    assert a.put_many(src, region.descriptor(), [100], [7777], [n], notify_id=5, tag=b"one", timeout_s=10) == 1
    note = b.wait_notification(timeout_s=10)
    assert (note.region_id, note.offset, note.nbytes, note.notify_id, note.tag) == \
        (region.region_id, 7777, n, 5, b"one")
    assert (target[7777:7777 + n] == src[100:100 + n]).all() and not target[:7777].any() and \
        not target[7777 + n:].any()
    assert a.statistics().extra["gathered_puts"] == gathered  # not staged as a vectored put
    _no_more_notes(b)


@pytest.mark.parametrize("piece", [4096, 300 << 10], ids=["eager", "rendezvous"])
def test_put_many_from_bytes_and_back_to_back_put_many_keep_their_order(ucx_pair, piece):
    """Several put_many of different sizes in flight before the target looks: each lands,
    each announced once, in order (their staging buffers taken and given back in turn)."""
    a, b = ucx_pair
    slot = 2 * piece
    target = np.zeros(6 * slot, np.uint8)
    region = b.register(target)
    desc = region.descriptor()
    src = bytes(range(256)) * (piece // 32)  # 8 pieces' worth
    sizes = [piece, piece // 2, piece, piece // 4, piece]
    for i, k in enumerate(sizes):
        assert a.put_many(src, desc, [0, piece * i], [i * slot, i * slot + piece], [k, k], notify_id=i,
                          tag=b"r%d" % i, timeout_s=10) == 1
    a.put(b"tail", desc, offset=5 * slot, notify_id=9, timeout_s=10)  # a plain put after them keeps its place
    notes = [b.wait_notification(timeout_s=10) for _ in range(6)]
    assert [(n.notify_id, n.tag, n.offset, n.nbytes) for n in notes[:5]] == \
        [(i, b"r%d" % i, i * slot, piece + k) for i, k in enumerate(sizes)]
    assert (notes[5].notify_id, notes[5].offset) == (9, 5 * slot)
    view = np.frombuffer(src, np.uint8)
    for i, k in enumerate(sizes):
        assert (target[i * slot:i * slot + k] == view[:k]).all()
        assert (target[i * slot + piece:i * slot + piece + k] == view[piece * i:piece * i + k]).all()
    assert bytes(target[5 * slot:5 * slot + 4]) == b"tail"
    assert len(b._vstages) <= uput._KEEP_STAGES


def test_a_put_many_past_the_message_limit_goes_as_several_vectored_puts_one_notification(ucx_pair, monkeypatch):
    a, b = ucx_pair
    monkeypatch.setattr(wire, "PUTV_MAX_NBYTES", 4096)  # both ends in this process see the smaller limit
    target = np.zeros(1 << 17, np.uint8)
    region = b.register(target)
    src = np.random.default_rng(4).integers(0, 256, 1 << 16, dtype=np.uint8)
    so, do, ln = np.arange(20) * 1500, np.arange(20) * 3000 + 7, np.full(20, 1500)
    ln[3] = 10000  # larger than one vectored put: cut into pieces first
    do[3:] += 10000
    assert uput.putv_groups(np.full(20, 1500))[:2] == [(0, 2), (2, 4)]  # two pieces and their table entries
    assert a.put_many(src, region.descriptor(), so, do, ln, notify_id=9, tag=b"t", timeout_s=10) == 1
    note = b.wait_notification(timeout_s=10)
    hi = int((do + ln).max())
    assert (note.offset, note.nbytes, note.tag, note.notify_id) == (7, hi - 7, b"t", 9)
    assert (target == _expected(target.size, src, so, do, ln)).all()
    _no_more_notes(b)


def _send_raw_putv(ep, rid: int, table: list[tuple[int, int]], payload: bytes, *, count=None, nbytes=None,
                   notify_id: int = 1) -> None:
    """A vectored put built by hand (control frame + data message), as a faulty peer might send it."""
    body = b"".join(struct.pack("<QQ", d, n) for d, n in table) + payload
    with ep._tx_lock:
        ep._put_seq = (ep._put_seq + 1) & 0xFFFFFFFF
        seq = ep._put_seq
        ep._send_ctrl(wire.OP_PUTV, rid=rid, offset=len(table) if count is None else count,
                      nbytes=len(body) if nbytes is None else nbytes, notify_id=notify_id, seq=seq)
        ep._post(body, len(body), ep._tx_data | seq)


@pytest.mark.parametrize("case", ["table-too-long", "table-too-short", "piece-outside", "count-beyond-message",
                                  "no-pieces", "unknown-region", "message-longer-than-announced"])
def test_a_malformed_vectored_put_is_counted_never_written_never_announced(ucx_pair, case):
    a, b = ucx_pair
    target = np.zeros(64, np.uint8)
    region = b.register(target)
    rid = region.region_id
    if case == "table-too-long":
        _send_raw_putv(a, rid, [(0, 8)], b"abcd")  # the table says 8 bytes, 4 follow
    elif case == "table-too-short":
        _send_raw_putv(a, rid, [(0, 2), (10, 1)], b"abcd")
    elif case == "piece-outside":
        _send_raw_putv(a, rid, [(0, 2), (62, 4)], b"abcdef")  # the second piece ends past the region
    elif case == "count-beyond-message":
        _send_raw_putv(a, rid, [(0, 4)], b"abcd", count=5)
    elif case == "no-pieces":
        _send_raw_putv(a, rid, [(0, 4)], b"abcd", count=0)
    elif case == "unknown-region":
        _send_raw_putv(a, rid + 100, [(0, 4)], b"abcd")
    else:
        _send_raw_putv(a, rid, [(0, 4)], b"abcd" * 8, nbytes=20)  # the receive of 20 bytes is truncated
    _no_more_notes(b)
    assert b.statistics().extra["bad_frames"] == 1 and not target.any()
    a.put_many(b"wxyz", region.descriptor(), [0, 2], [60, 0], [2, 2], notify_id=3, timeout_s=5)  # still works
    note = b.wait_notification(timeout_s=5)
    assert (note.offset, note.nbytes, note.notify_id) == (0, 62, 3)
    assert bytes(target[:2]) == b"yz" and bytes(target[60:62]) == b"wx"
    assert b.statistics().extra["bad_frames"] == 1


def test_a_region_deregistered_in_flight_is_never_announced(ucx_pair):
    a, b = ucx_pair
    target = np.zeros(1 << 16, np.uint8)
    region = b.register(target)
    src = np.full(1 << 15, 7, np.uint8)
    assert a.put_many(src, region.descriptor(), [0, 8192], [0, 32768], [8192, 8192], notify_id=1, timeout_s=5) == 1
    b.deregister(region)  # before the target has looked at the vectored put
    _no_more_notes(b)
    assert not target.any() and b.statistics().extra["bad_frames"] == 1
    other = b.register(np.zeros(64, np.uint8))
    a.put_many(b"abcd", other.descriptor(), [0, 2], [60, 0], [2, 2], timeout_s=5)  # the link still works
    assert b.wait_notification(timeout_s=5).nbytes == 62


# ----- peers that do not offer vectored puts ---------------------------------------------------
def _old_side(monkeypatch, old_server: bool) -> None:
    """One side of the handshake offers only what a qlink without vectored puts offers."""
    new = ucx._offered_flags
    monkeypatch.setattr(ucx, "_offered_flags", lambda opts, *, server: new(opts, server=server) & ~(
        boot.FLAG_PUTV if server == old_server else 0))


@pytest.mark.parametrize("old_server", [True, False], ids=["old-listener", "old-client"])
def test_put_many_is_one_put_per_piece_when_a_side_does_not_offer_vectored_puts(monkeypatch, old_server):
    _old_side(monkeypatch, old_server)
    with transports.listen("ucx://127.0.0.1:0") as lis:
        a = transports.connect(lis.url, timeout_s=5)
        b = lis.accept(timeout_s=5)
        try:
            assert not a.put_many_gathers and not b.put_many_gathers
            for tx, rx in ((a, b), (b, a)):
                target = np.zeros(1 << 15, np.uint8)
                region = rx.register(target)
                src = np.random.default_rng(1).integers(0, 256, 1 << 14, dtype=np.uint8)
                so, do, ln = [0, 100, 6000], [20000, 8, 9000], [64, 32, 8192]  # inline and header puts
                assert tx.put_many(src, region.descriptor(), so, do, ln, notify_id=5, tag=b"pm", timeout_s=10) == 3
                notes = [rx.wait_notification(timeout_s=10) for _ in range(3)]
                assert [(n.offset, n.nbytes, n.tag) for n in notes] == [(d, k, b"pm") for d, k in zip(do, ln)]
                assert (target == _expected(target.size, src, so, do, ln)).all()
                _no_more_notes(rx)
                assert tx.statistics().extra["gathered_puts"] == 0
        finally:
            a.close()
            b.close()


def _hello(flags: int, conn_id: int = 3) -> bytes:
    return struct.pack("<4sHHI8sI", b"QLUX", 1, flags, conn_id, b"t" * 8, 4) + b"addr"


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    out = b""
    while len(out) < nbytes:
        chunk = sock.recv(nbytes - len(out))
        assert chunk, "the peer hung up"
        out += chunk
    return out


@pytest.mark.parametrize("old_flags, server", [(0, True), (boot.FLAG_PEER_ERRORS, True), (0, False)],
                         ids=["old-client", "old-client-peer-errors", "old-listener"])
def test_the_hello_flag_is_in_force_only_when_both_sides_offer_it(old_flags, server):
    """Against a hello from a qlink that predates vectored puts (version 1, bit 1 clear, its
    answer masked to bit 0) the handshake succeeds without the flag; with it on both sides, it is on."""
    for peer_flags, want in ((old_flags, old_flags), (old_flags | boot.FLAG_PUTV, old_flags | boot.FLAG_PUTV)):
        ours, theirs = socket.socketpair()
        with ours, theirs:
            got = {}
            if server:  # we answer; the peer is a client whose hello is already there
                theirs.sendall(_hello(peer_flags))
            else:  # we speak first; the peer answers as a listener does
                def answer():
                    _recv_exact(theirs, 24 + 4)
                    theirs.sendall(_hello(peer_flags))
                t = threading.Thread(target=answer, daemon=True)
                t.start()
            got["r"] = boot.handshake(ours, conn_id=5, token=b"o" * 8, flags=boot.FLAG_PUTV, address=b"mine",
                                      deadline=None, server=server)
            if server:
                reply = struct.unpack("<4sHHI8sI", _recv_exact(theirs, 24))
                assert reply[1] == 1 and reply[2] == want  # version 1: an older client accepts the answer
            else:
                t.join(5)
            assert got["r"][1] == want
