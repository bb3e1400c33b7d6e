"""ucx's one-sided put by UCX RMA: between two ends that both offer it, put_many writes the
pieces straight into the peer's mapped region (``ucp_put_nbx``, flushed) and announces them
with one ``OP_PUT_DONE``; bit-exact however the pieces lie, in order with tagged puts, and a
bad or stray ``OP_PUT_DONE`` is counted and never announced. A side that does not offer it
gets the vectored puts of tests/transports/test_ucx_put_many.py."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

import transports
from qlink.errors import QlinkTimeoutError, RegistrationError
from qlink.memory import RemoteRegion
from transports import _ucx_wire as wire
from transports import ucx  # noqa: F401 - before ucxx itself

pytest.importorskip("ucxx", reason="the ucx transport needs ucxx-cu12 (pip install 'qlink[ucx]')")
pytestmark = pytest.mark.timeout(60)


def _cma_built() -> bool:
    from transports import _ucx_cma

    return _ucx_cma.built()


@pytest.fixture(params=["cma", "ucx"])
def ucx_pair(request, monkeypatch):
    """A connected pair that opted in to RMA (``rma=True`` on both ends), its pieces moved by
    same-host CMA many per call (``cma``, where transports._cmac is built) or by UCX, one call
    each (``ucx``: ``QLINK_UCX_CMA=0``)."""
    from transports import _ucx_cma

    if request.param == "cma" and not _ucx_cma.built():
        pytest.skip("transports._cmac is not built")
    monkeypatch.setenv("QLINK_UCX_CMA", "1" if request.param == "cma" else "0")
    lis = transports.listen("ucx://127.0.0.1:0", rma=True)
    a = transports.connect(lis.url, timeout_s=5, rma=True)
    b = lis.accept(timeout_s=5)
    assert a.statistics().extra.get("cma", False) == (request.param == "cma")
    yield a, b
    a.close()
    b.close()
    lis.close()


def _pair(client_rma, server_rma):
    lis = transports.listen("ucx://127.0.0.1:0", rma=server_rma)
    a = transports.connect(lis.url, timeout_s=5, rma=client_rma)
    b = lis.accept(timeout_s=5)
    return lis, a, b


def _close(*things) -> None:
    for t in things:
        t.close()


@pytest.mark.skipif(not _cma_built(), reason="transports._cmac is not built")
def test_rma_is_in_force_by_default_between_processes_of_one_host_and_off_where_either_says_no(monkeypatch):
    monkeypatch.delenv("QLINK_UCX_RMA", raising=False)
    lis, a, b = _pair(None, None)  # the default: same host, both CMA verdicts yes
    try:
        assert a.rma and b.rma and a.statistics().extra["cma"] and len(b.register(np.zeros(64, np.uint8)).key) > 8
    finally:
        _close(a, b, lis)
    lis, a, b = _pair(True, None)  # anywhere on one side, same host on the other: same host
    try:
        assert a.rma and b.rma and b.statistics().extra["cma"]
    finally:
        _close(a, b, lis)
    for client, server in ((False, None), (None, False), (False, True)):
        lis, a, b = _pair(client, server)  # either side saying no turns it off
        try:
            assert not a.rma and not b.rma and len(b.register(np.zeros(64, np.uint8)).key) == 8
        finally:
            _close(a, b, lis)
    monkeypatch.setenv("QLINK_UCX_RMA", "0")  # the environment's no
    lis, a, b = _pair(None, None)
    try:
        assert not a.rma and not b.rma
    finally:
        _close(a, b, lis)


@pytest.mark.skipif(not _cma_built(), reason="transports._cmac is not built")
def test_where_one_side_cannot_read_the_other_neither_uses_rma_by_default(monkeypatch):
    """The verdicts differ (the listener's side could not read the client back, as under a
    ptrace policy that lets only one of the two read the other): both sides settle on no RMA,
    from the same two verdicts, and say why; puts go tagged and land."""
    import threading

    from transports import _ucx_cma

    real = _ucx_cma.CmaPeer.verify

    def verify(pid, addr, challenge):  # refused on the listener's side only (its handshakes run in its accept thread)
        if threading.current_thread().name.startswith("qlink-ucx-accept"):
            return None, "refused for the test"
        return real(pid, addr, challenge)

    monkeypatch.setattr(_ucx_cma.CmaPeer, "verify", staticmethod(verify))
    monkeypatch.delenv("QLINK_UCX_RMA", raising=False)
    lis, a, b = _pair(None, None)
    try:
        assert not a.rma and not b.rma
        assert b.statistics().extra["cma_refused"] == "refused for the test"
        assert "could not read this process back" in a.statistics().extra["cma_refused"]
        assert not a.statistics().extra["cma"] and not b.statistics().extra["cma"]
        target = np.zeros(1 << 16, np.uint8)
        d = b.register(target).descriptor()
        a.put_many(np.full(1 << 16, 3, np.uint8), d, [0, 100], [0, 100], [100, 1000], notify_id=1, timeout_s=10)
        assert b.wait_notification(timeout_s=10).notify_id == 1 and (target[:1100] == 3).all()
    finally:
        _close(a, b, lis)


def _no_more_notes(ep) -> None:
    with pytest.raises(QlinkTimeoutError):
        ep.wait_notification(timeout_s=0.1)


def _deferred_setup(a, b, *, seed: int, count: int, unit: int = 32768):
    """A target region on b, a registered source on a (so a's puts from it may be deferred), and
    ``count`` scattered pieces: ``(target, its descriptor, src, so, do, ln)``."""
    rng = np.random.default_rng(seed)
    target = np.zeros(2 * count * unit, np.uint8)
    d = b.register(target).descriptor()
    src = rng.integers(0, 256, 2 * count * unit, dtype=np.uint8)
    a.register(src)
    return (target, d, src) + tuple(_pieces(rng, count, unit, 2 * count))


def _pieces(rng, count: int, unit: int, slots: int):
    so = rng.permutation(slots)[:count] * unit
    do = rng.permutation(slots)[:count] * unit
    ln = rng.integers(1, unit + 1, count)
    return so, do, ln


@pytest.mark.parametrize("unit, count", [(32768, 64), (1 << 20, 2), (100, 300), (1, 1)])
def test_put_many_is_written_by_rma_and_announced_once_bit_exact(ucx_pair, unit, count):
    a, b = ucx_pair
    assert a.rma and b.rma  # both hellos offered RMA
    rng = np.random.default_rng(unit + count)
    slots = count * 2
    target = np.zeros(slots * unit, np.uint8)
    region = b.register(target)
    assert len(region.descriptor().key) > 16  # token, address and a packed remote key
    src = rng.integers(0, 256, slots * unit, dtype=np.uint8)
    so, do, ln = _pieces(rng, count, unit, slots)
    rma_before, gathered_before = a.statistics().extra["rma_puts"], a.statistics().extra["gathered_puts"]
    assert a.put_many(src, region.descriptor(), so, do, ln, notify_id=9, tag=b"rma", timeout_s=10) == 1
    note = b.wait_notification(timeout_s=10)
    lo, hi = int(do.min()), int((do + ln).max())
    assert (note.region_id, note.offset, note.nbytes, note.notify_id, note.tag) == (region.region_id, lo, hi - lo, 9,
                                                                                    b"rma")
    want = np.zeros_like(target)
    for s, d, n in zip(so, do, ln):
        want[d:d + n] = src[s:s + n]
    assert (target == want).all()
    _no_more_notes(b)
    assert a.statistics().extra["rma_puts"] == rma_before + 1
    assert a.statistics().extra["gathered_puts"] == gathered_before  # nothing was staged


def test_rma_puts_and_tagged_puts_are_announced_in_their_order(ucx_pair):
    a, b = ucx_pair
    target = np.zeros(1 << 20, np.uint8)
    d = b.register(target).descriptor()
    src = np.arange(1 << 20, dtype=np.uint64).view(np.uint8)[:1 << 20].copy()
    order = []
    for k in range(6):
        if k % 2:
            a.put(src[:300000], d, offset=k * 1000, notify_id=k)  # a tagged put (header, then the bytes)
        else:
            a.put_many(src, d, [k * 10], [k * 4096], [5000], notify_id=k)
        order.append(k)
    assert [b.wait_notification(timeout_s=10).notify_id for _ in order] == order


def test_a_stray_or_malformed_put_done_is_counted_and_never_announced(ucx_pair):
    a, b = ucx_pair
    region = b.register(np.zeros(4096, np.uint8))
    bad = b.statistics().extra["bad_frames"]
    with a._tx_lock:
        a._send_ctrl(wire.OP_PUT_DONE, rid=region.region_id + 50, offset=0, nbytes=10, notify_id=1)  # unknown region
        a._send_ctrl(wire.OP_PUT_DONE, rid=region.region_id, offset=4000, nbytes=100, notify_id=2)  # out of bounds
    _no_more_notes(b)
    assert b.statistics().extra["bad_frames"] == bad + 2
    a.put_many(np.ones(64, np.uint8), region.descriptor(), [0], [0], [64], notify_id=3)  # the link still works
    assert b.wait_notification(timeout_s=10).notify_id == 3


def test_a_deregistered_region_is_refused_before_anything_is_written(ucx_pair):
    import time

    a, b = ucx_pair
    target = np.zeros(8192, np.uint8)
    region = b.register(target)
    d = region.descriptor()
    b.deregister(region)
    time.sleep(0.2)  # the revocation reaches a; a's next put learns of it before writing
    with pytest.raises(RegistrationError):
        a.put_many(np.ones(64, np.uint8), d, [0], [0], [64], notify_id=1, timeout_s=5)
    assert not target.any()
    _no_more_notes(b)


def test_a_side_that_does_not_offer_rma_gets_vectored_puts():
    lis = transports.listen("ucx://127.0.0.1:0", rma=False)
    a = transports.connect(lis.url, timeout_s=5)
    b = lis.accept(timeout_s=5)
    try:
        assert not a.rma and not b.rma
        target = np.zeros(4096, np.uint8)
        region = b.register(target)
        assert region.descriptor().key == region.key and len(region.key) == 8  # the token alone: nothing mapped
        a.put_many(np.full(100, 7, np.uint8), region.descriptor(), [0, 50], [0, 1000], [50, 50], notify_id=4)
        assert b.wait_notification(timeout_s=10).notify_id == 4
        assert (target[:50] == 7).all() and (target[1000:1050] == 7).all()
        assert a.statistics().extra["rma_puts"] == 0 and a.statistics().extra["gathered_puts"] == 1
    finally:
        a.close()
        b.close()
        lis.close()


def _target(url: str, n: int, conn) -> None:
    b = transports.connect(url, timeout_s=10, rma=True)
    target = np.zeros(n, np.uint8)
    b.send(b.register(target).descriptor().to_bytes())
    note = b.wait_notification(timeout_s=30)
    conn.send((note.offset, note.nbytes, int(target.astype(np.uint64).sum()), bytes(target[:16])))
    b.close()


def test_an_rma_put_many_into_another_process_lands_bit_exact():
    lis = transports.listen("ucx://127.0.0.1:0", rma=True)
    parent, child = mp.get_context("spawn").Pipe()
    n = 4 << 20
    p = mp.get_context("spawn").Process(target=_target, args=(lis.url, n, child), daemon=True)
    p.start()
    try:
        a = lis.accept(timeout_s=30)
        d = RemoteRegion.from_bytes(a.recv(timeout_s=30))
        rng = np.random.default_rng(3)
        src = rng.integers(0, 256, n, dtype=np.uint8)
        k = n // 32768
        so, do = np.arange(k) * 32768, rng.permutation(k) * 32768
        ln = np.full(k, 32768)
        assert a.put_many(src, d, so, do, ln, notify_id=1, timeout_s=30) == 1
        assert a.rma and a.statistics().extra["rma_puts"] == 1
        off, nbytes, total, head = parent.recv()
        want = np.zeros(n, np.uint8)
        for s, t, m in zip(so, do, ln):
            want[t:t + m] = src[s:s + m]
        assert (off, nbytes) == (0, n) and total == int(want.astype(np.uint64).sum()) and head == bytes(want[:16])
        a.close()
    finally:
        p.join(timeout=30)
        lis.close()


@pytest.mark.parametrize("unit, count", [(32768, 64), (1 << 20, 1), (4096, 700)])
def test_a_deferred_put_many_is_shared_the_target_reads_part_of_it_bit_exact(ucx_pair, unit, count):
    a, b = ucx_pair
    rng = np.random.default_rng(count)
    slots = count * 2
    target = np.zeros(slots * unit, np.uint8)
    d = b.register(target).descriptor()
    src = rng.integers(0, 256, slots * unit, dtype=np.uint8)
    a.register(src)  # the source lies in a region of a's: the target may read out of it
    so, do, ln = _pieces(rng, count, unit, slots)
    pulled = b.statistics().extra["pulled_bytes"]
    assert a.put_many(src, d, so, do, ln, notify_id=8, tag=b"pull", timeout_s=10, defer=True) == 1
    note = b.wait_notification(timeout_s=10)
    lo, hi = int(do.min()), int((do + ln).max())
    assert (note.offset, note.nbytes, note.notify_id, note.tag) == (lo, hi - lo, 8, b"pull")
    want = np.zeros_like(target)
    for s, t, n in zip(so, do, ln):
        want[t:t + n] = src[s:s + n]
    assert (target == want).all()
    a.flush(timeout_s=10)  # every OP_PULL was confirmed
    got = b.statistics().extra["pulled_bytes"] - pulled
    assert 0 < got < int(ln.sum())  # the target read a share, the initiator wrote the rest
    assert a.statistics().extra["deferred_puts"] >= 1 and a.statistics().extra["pulls_refused"] == 0
    _no_more_notes(b)


def test_the_share_the_target_reads_follows_the_rates_both_sides_measured(ucx_pair):
    """After deferred put_many calls, the initiator knows both rates (the target's from its
    OP_PULLED reports) and the share it asks the target to read is theirs, within bounds; a
    target reported as 3 x faster is asked for 3/4 of the bytes, and gets them, bit-exact."""
    a, b = ucx_pair
    target, d, src, so, do, ln = _deferred_setup(a, b, seed=5, count=64)
    assert a._pull_share() == a.PULL_SHARE  # nothing measured yet
    for notify_id in (1, 2, 3):
        a.put_many(src, d, so, do, ln, notify_id=notify_id, timeout_s=10, defer=True)
        assert b.wait_notification(timeout_s=10).notify_id == notify_id
        a.flush(timeout_s=10)
    assert a._pull_rate > 0 and a._put_rate > 0
    lo, hi = a.PULL_SHARE_RANGE
    assert a._pull_share() == pytest.approx(min(hi, max(lo, a._pull_rate / (a._pull_rate + a._put_rate))))
    a._pull_rate, a._put_rate = 3.0, 1.0  # as if measured: the target 3 x faster
    a._take_pulled(0, 0, 0, 0)  # a report without a time (an older peer) changes nothing
    assert a._pull_share() == pytest.approx(0.75)
    target[:] = 0
    pulled = b.statistics().extra["pulled_bytes"]
    a.put_many(src, d, so, do, ln, notify_id=4, timeout_s=10, defer=True)
    assert b.wait_notification(timeout_s=10).notify_id == 4
    a.flush(timeout_s=10)
    share = (b.statistics().extra["pulled_bytes"] - pulled) / int(ln.sum())
    assert 0.70 <= share <= 0.80  # 3/4, cut at a 4 KiB step
    for s_, t, n in zip(so, do, ln):
        assert (target[t:t + n] == src[s_:s_ + n]).all()
    _no_more_notes(b)


def test_a_refused_pull_is_counted_confirmed_and_its_put_many_never_announced(ucx_pair):
    a, b = ucx_pair
    region = b.register(np.zeros(1 << 16, np.uint8))
    src = np.ones(1 << 16, np.uint8)
    a.register(src)
    bad = b.statistics().extra["bad_frames"]
    home = a._home_of(src)
    payload = wire.PULL_KEY.pack(len(home[2])) + home[2] + np.array([[0, (1 << 16) - 10, 100]], "<u8").tobytes()
    with a._tx_lock:  # a pull past the end of the target's region, then the OP_PUT_DONE of its put_many
        a._pull_seq += 1
        a._send_ctrl(wire.OP_PULL, rid=region.region_id, offset=home[0], nbytes=len(payload), seq=a._pull_seq,
                     inline=payload)
        a._send_ctrl(wire.OP_PUT_DONE, rid=region.region_id, offset=0, nbytes=100, notify_id=1)
    _no_more_notes(b)  # b takes both frames: the pull is refused, its put_many not announced
    a.flush(timeout_s=10)  # answered, though refused
    assert b.statistics().extra["bad_frames"] == bad + 1 and a.statistics().extra["pulls_refused"] == 1
    a.put_many(src, region.descriptor(), [0], [0], [64], notify_id=2, defer=True)  # the link still works
    assert b.wait_notification(timeout_s=10).notify_id == 2


def _dies_after_hello(url: str, n: int) -> None:
    import os

    b = transports.connect(url, timeout_s=10, rma=True)
    target = np.zeros(n, np.uint8)
    b.send(b.register(target).descriptor().to_bytes())
    b.recv(timeout_s=10)
    os._exit(0)  # no close: the process is simply gone


def test_an_rma_put_many_towards_a_dead_peer_raises_and_this_process_lives_on():
    from qlink.errors import BrokenLinkError

    lis = transports.listen("ucx://127.0.0.1:0", rma=True)
    n = 1 << 22
    p = mp.get_context("spawn").Process(target=_dies_after_hello, args=(lis.url, n), daemon=True)
    p.start()
    try:
        a = lis.accept(timeout_s=30)
        d = RemoteRegion.from_bytes(a.recv(timeout_s=30))
        assert a.rma
        a.send(b"die")
        p.join(timeout=30)
        with pytest.raises(BrokenLinkError, match="exited|dropped"):  # UCX would abort this process
            a.put_many(np.ones(n, np.uint8), d, [0], [0], [n], notify_id=1, timeout_s=10)
        a.close()
    finally:
        lis.close()


def test_the_c_loop_posts_every_piece_keeps_requests_in_progress_and_stops_at_an_error():
    """transports._ringc.rma_post, driven with a stand-in for ucp_put_nbx (a ctypes callback):
    one call per non-empty piece at the right addresses; requests handed back kept; the first
    error status stops the loop and says which piece."""
    import ctypes

    from transports._shm_records import _ringc

    if _ringc is None or not hasattr(_ringc, "rma_post"):
        pytest.skip("transports._ringc is not built (python setup.py build_ext --inplace)")
    calls = []
    answers = {}  # piece's local address -> what the call returns (0 done, a request, or an error status)

    @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64,
                      ctypes.c_void_p, ctypes.c_void_p)
    def fake_put(ep, buf, n, raddr, rkey, param):
        calls.append((ep, buf, n, raddr, rkey, param))
        return answers.get(buf, 0)

    fn = ctypes.cast(fake_put, ctypes.c_void_p).value
    lo = np.array([0, 100, 200, 300, 400], dtype=np.int64)
    ro = np.array([5000, 6000, 7000, 8000, 9000], dtype=np.int64)
    ln = np.array([10, 0, 30, 40, 50], dtype=np.int64)
    out = np.zeros(5, dtype=np.uint64)
    answers[1000 + 200] = 0xABC0  # in progress
    assert _ringc.rma_post(fn, 7, 1000, lo, 1 << 20, ro, ln, 9, 11, out) == (1, 0, -1)
    assert [(c[1], c[2], c[3]) for c in calls] == [(1000, 10, (1 << 20) + 5000), (1200, 30, (1 << 20) + 7000),
                                                    (1300, 40, (1 << 20) + 8000), (1400, 50, (1 << 20) + 9000)]
    assert {(c[0], c[4], c[5]) for c in calls} == {(7, 9, 11)} and out[0] == 0xABC0
    calls.clear()
    answers[1000 + 300] = (1 << 64) - 3  # UCS_ERR_NO_MESSAGE as a pointer: an error
    assert _ringc.rma_post(fn, 7, 1000, lo, 1 << 20, ro, ln, 9, 11, out) == (1, -3, 3)
    assert len(calls) == 3  # the piece after the error was never posted
    with pytest.raises(ValueError, match="negative"):
        _ringc.rma_post(fn, 7, 1000, -lo, 0, ro, ln, 0, 0, out)
    with pytest.raises(ValueError, match="one length"):
        _ringc.rma_post(fn, 7, 1000, lo[:2], 0, ro, ln, 0, 0, out)


def test_a_short_put_many_is_shared_as_a_long_one_is():
    """The share's cut, taken with plain integers for a few pieces, is the NumPy path's."""
    from transports import _ucx_put

    rng = np.random.default_rng(5)
    for _ in range(2000):
        k = int(rng.integers(1, 12))
        ln = rng.integers(0, 3, k) * int(rng.choice([1, 4096, 10_000, 1 << 20]))
        so = np.cumsum(ln) - ln
        share = float(rng.random())
        few = _ucx_put._share(so, so + 7, ln, share)
        saved, _ucx_put._FEW = _ucx_put._FEW, 0
        try:
            many = _ucx_put._share(so, so + 7, ln, share)
        finally:
            _ucx_put._FEW = saved
        assert few[3] == many[3]
        assert all(np.array_equal(a, b) for a, b in zip(few[:3], many[:3]))


def test_pulls_taken_in_one_progress_round_are_answered_by_one_pulled_frame(ucx_pair):
    """Three deferred put_many calls whose frames wait at the target together: it reads all
    three shares in one progress round and answers them with ONE OP_PULLED (the last seq, the
    bytes summed); the initiator's flush sees every pull confirmed."""
    a, b = ucx_pair
    target, d, src, so, do, ln = _deferred_setup(a, b, seed=11, count=16)
    sent = []
    real = b._send_ctrl

    def spy(op, **kw):
        sent.append((op, kw.get("seq"), kw.get("nbytes")))
        return real(op, **kw)

    b._send_ctrl = spy
    pulled = b.statistics().extra["pulled_bytes"]
    for notify_id in (1, 2, 3):
        a.put_many(src, d, so, do, ln, notify_id=notify_id, timeout_s=10, defer=True)
    import time

    time.sleep(0.2)  # every frame is at b before it looks
    assert [b.wait_notification(timeout_s=10).notify_id for _ in range(3)] == [1, 2, 3]
    a.flush(timeout_s=10)
    acks = [s for s in sent if s[0] == wire.OP_PULLED]
    assert len(acks) == 1 and acks[0][1] == a._pull_seq
    assert acks[0][2] == b.statistics().extra["pulled_bytes"] - pulled > 0
    for s_, t, n in zip(so, do, ln):
        assert (target[t:t + n] == src[s_:s_ + n]).all()
