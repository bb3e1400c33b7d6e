"""Same-host CMA for ucx:// RMA (transports._ucx_cma, transports._cmac): the pieces of an RMA
put_many between two processes of one host move by process_vm_writev/readv, up to 1024 per
call, bit-exact; a peer is used this way only once it has shown this side's random challenge
in its own memory; a peer that has exited is an error, never a crash; ``QLINK_UCX_CMA=0``
leaves the pieces to UCX."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os

import numpy as np
import pytest

import transports
from qlink.errors import BrokenLinkError, QlinkTimeoutError
from qlink.memory import RemoteRegion
from transports import _ucx_cma as cma
from transports import ucx  # noqa: F401 - before ucxx itself

pytest.importorskip("ucxx", reason="the ucx transport needs ucxx-cu12 (pip install 'qlink[ucx]')")
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not cma.built(), reason="transports._cmac is not built (no C compiler at install)")]


def _self_peer() -> cma.CmaPeer:
    """This very process as a peer (CMA works on oneself too), proven by the handshake."""
    a, b = cma.CmaHandshake(), cma.CmaHandshake()
    b.outbox.pop(0)  # (b's own challenge: not needed here)
    b.take(a.outbox.pop(0))  # b shows a's challenge...
    a.take(b.outbox.pop(0))  # ...and a reads it back
    peer = a.peer
    assert peer is not None and a.verdict == 1, a.refused
    a.peer = None
    b.close()
    return peer


@pytest.mark.parametrize("count", [1, 1023, 1024, 1025, 3000])
def test_the_c_loop_moves_every_piece_both_ways_bit_exact_across_batches(count):
    rng = np.random.default_rng(count)
    unit = 512
    src = rng.integers(0, 256, count * 2 * unit, dtype=np.uint8)
    dst = np.zeros_like(src)
    so = rng.permutation(count * 2)[:count] * unit
    do = rng.permutation(count * 2)[:count] * unit
    ln = rng.integers(0, unit + 1, count)  # some pieces empty
    peer = _self_peer()
    try:
        moved = peer.move(write=True, local_addr=src.ctypes.data, local_offsets=so, remote_addr=dst.ctypes.data,
                          remote_offsets=do, nbytes=ln, what="test write")
        want = np.zeros_like(src)
        for s, t, n in zip(so, do, ln):
            want[t:t + n] = src[s:s + n]
        assert moved == int(ln.sum()) and (dst == want).all()
        back = np.zeros_like(src)
        peer.move(write=False, local_addr=back.ctypes.data, local_offsets=so, remote_addr=dst.ctypes.data,
                  remote_offsets=do, nbytes=ln, what="test read")
        for s, t, n in zip(so, do, ln):
            assert (back[s:s + n] == src[s:s + n]).all()
        assert peer.moved_bytes == 2 * int(ln.sum())
    finally:
        peer.close()


def test_the_c_loop_checks_its_arguments():
    from transports import _cmac

    one = np.zeros(1, np.int64)
    with pytest.raises(TypeError):
        _cmac.cma_pieces(os.getpid(), -1, True, 1, one, 1, one)
    with pytest.raises(ValueError, match="one length"):
        _cmac.cma_pieces(os.getpid(), -1, True, 1, one, 1, np.zeros(2, np.int64), one)
    with pytest.raises(ValueError, match="negative"):
        _cmac.cma_pieces(os.getpid(), -1, True, 1, one, 1, one, np.array([-1], np.int64))
    with pytest.raises(ValueError, match="pid"):
        _cmac.cma_pieces(0, -1, True, 1, one, 1, one, one)
    buf = np.zeros(16, np.uint8)
    with pytest.raises(OSError) as e:  # a piece the kernel cannot reach: the errno, nothing else touched
        _cmac.cma_pieces(os.getpid(), -1, False, buf.ctypes.data, one, 8, one, np.array([8], np.int64))
    assert e.value.errno == 14 and (buf == 0).all()  # EFAULT


def test_a_proof_that_does_not_show_the_challenge_is_refused():
    """Only a process that holds this side's random challenge at the address it names passes:
    bytes that happen to be there (another challenge, a constant) do not, nor a bad pid or a
    malformed or repeated frame."""
    a, b = cma.CmaHandshake(), cma.CmaHandshake()
    other = cma.CmaHandshake()
    b.outbox.pop(0)
    b.take(other.outbox.pop(0))  # b answers someone else's challenge...
    proof = b.outbox.pop(0)
    assert a.take(proof)  # ...and shows that proof to a
    assert a.verdict == 0 and a.peer is None and "challenge" in a.refused
    assert not a.take(proof)  # the verdict is given once
    c = cma.CmaHandshake()
    assert not c.take(b"short")
    constant = ctypes.create_string_buffer(c.challenge[:8] + bytes(8), 16)  # not the whole challenge
    assert c.take(cma.IDENTITY.pack(os.getpid(), ctypes.addressof(constant), bytes(16)))
    assert c.verdict == 0
    peer, why = cma.CmaPeer.verify(0, 4096, bytes(16))
    assert peer is None and "pid 0" in why
    d = cma.CmaHandshake()
    assert d.take(a.outbox[0]) and not d.take(a.outbox[0])  # a challenge is answered once
    for h in (a, b, other, c, d):
        h.close()


def _child_target(url: str, n: int, conn) -> None:
    b = transports.connect(url, timeout_s=10, rma=True)
    target = np.zeros(n, np.uint8)
    b.send(b.register(target).descriptor().to_bytes())
    src = np.random.default_rng(9).integers(0, 256, n, dtype=np.uint8)
    b.send(b.register(src).descriptor().to_bytes())
    note = b.wait_notification(timeout_s=30)
    extra = b.statistics().extra
    conn.send((note.notify_id, bytes(target), extra["cma"], extra["cma_bytes"], extra["pulled_bytes"]))
    b.recv(timeout_s=30)
    b.close()


def test_between_two_processes_both_shares_go_by_cma_bit_exact():
    """A deferred put_many from a registered source: the target reads its share by
    process_vm_readv, the initiator writes the rest by process_vm_writev; every byte lands."""
    lis = transports.listen("ucx://127.0.0.1:0", rma=True)
    parent, child = mp.get_context("spawn").Pipe()
    n = 8 << 20
    p = mp.get_context("spawn").Process(target=_child_target, args=(lis.url, n, child), daemon=True)
    p.start()
    try:
        a = lis.accept(timeout_s=30)
        d = RemoteRegion.from_bytes(a.recv(timeout_s=30))
        a.recv(timeout_s=30)
        rng = np.random.default_rng(4)
        src = rng.integers(0, 256, n, dtype=np.uint8)
        a.register(src)
        k = n // 32768
        so, do = rng.permutation(k) * 32768, rng.permutation(k) * 32768
        ln = np.full(k, 32768)
        assert a.put_many(src, d, so, do, ln, notify_id=5, timeout_s=30, defer=True) == 1
        a.flush(timeout_s=30)
        notify_id, got, in_force, cma_bytes, pulled = parent.recv()
        want = np.zeros(n, np.uint8)
        for s, t, m in zip(so, do, ln):
            want[t:t + m] = src[s:s + m]
        extra = a.statistics().extra
        assert notify_id == 5 and got == want.tobytes()
        assert in_force and extra["cma"] and extra["cma_refused"] == ""
        assert 0 < pulled == cma_bytes < n  # the target read its share by CMA...
        assert extra["cma_bytes"] == n - pulled  # ...and this side wrote the rest by CMA
        a.send(b"bye")
        a.close()
    finally:
        p.join(timeout=30)
        lis.close()


def test_cma_off_leaves_the_pieces_to_ucx(monkeypatch):
    monkeypatch.setenv("QLINK_UCX_CMA", "0")
    lis = transports.listen("ucx://127.0.0.1:0", rma=True)
    a = transports.connect(lis.url, timeout_s=5, rma=True)
    b = lis.accept(timeout_s=5)
    try:
        assert a.rma and "cma" not in a.statistics().extra
        target = np.zeros(1 << 16, np.uint8)
        d = b.register(target).descriptor()
        a.put_many(np.full(1 << 16, 7, np.uint8), d, [0], [0], [1 << 16], notify_id=1, timeout_s=10)
        assert b.wait_notification(timeout_s=10).notify_id == 1 and (target == 7).all()
    finally:
        a.close()
        b.close()
        lis.close()


def _posts_then_dies(url: str, n: int) -> None:
    a = transports.connect(url, timeout_s=10, rma=True)
    d = RemoteRegion.from_bytes(a.recv(timeout_s=10))
    src = np.ones(n, np.uint8)
    a.register(src)
    a._pull_rate, a._put_rate = 1.0, 1e-9  # as if measured: the target is asked to read nearly all of it
    a.put_many(src, d, [0], [0], [n], notify_id=1, timeout_s=10, defer=True)
    os._exit(0)  # gone before the target has read its share (its OP_PULL is on the way)


def test_a_pull_from_a_peer_that_has_exited_is_refused_and_this_process_lives_on():
    """The target of a deferred put reads from a process that is gone: an error it survives
    (UCX's own CMA read of a dead process aborts the reader), and the put is never announced."""
    lis = transports.listen("ucx://127.0.0.1:0", rma=True)
    n = 64 << 20
    p = mp.get_context("spawn").Process(target=_posts_then_dies, args=(lis.url, n), daemon=True)
    p.start()
    try:
        b = lis.accept(timeout_s=30)
        target = np.zeros(n, np.uint8)
        b.send(b.register(target).descriptor().to_bytes())
        p.join(timeout=30)
        assert p.exitcode == 0
        with pytest.raises((BrokenLinkError, QlinkTimeoutError)):
            b.wait_notification(timeout_s=5)
        extra = b.statistics().extra
        assert extra["cma"] and extra["bad_frames"] >= 1 and extra["cma_bytes"] == 0
        b.close()
    finally:
        lis.close()


def _waits(conn) -> None:
    conn.recv()


def test_a_peer_gone_before_a_put_is_a_broken_link_found_by_its_pidfd():
    """Once the peer has exited its pidfd says so and nothing is moved: a pid the kernel may
    hand to another process is never written to. A closed handle refuses too."""
    parent, child_end = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=_waits, args=(child_end,), daemon=True)
    child.start()
    gone = cma.CmaPeer(child.pid, os.pidfd_open(child.pid))
    parent.send(None)
    child.join(timeout=30)
    buf = (ctypes.c_char * 8)()
    with pytest.raises(BrokenLinkError, match=f"process {child.pid} has exited"):
        gone.move(write=True, local_addr=ctypes.addressof(buf), local_offsets=[0], remote_addr=4096,
                  remote_offsets=[0], nbytes=[8], what="a put")
    gone.close()
    with pytest.raises(BrokenLinkError, match="closed"):
        gone.move(write=True, local_addr=ctypes.addressof(buf), local_offsets=[0], remote_addr=4096,
                  remote_offsets=[0], nbytes=[8], what="a put")
