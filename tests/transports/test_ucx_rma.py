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


def _no_more_notes(ep) -> None:
    with pytest.raises(QlinkTimeoutError):
        ep.wait_notification(timeout_s=0.1)


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
    b = transports.connect(url, timeout_s=10)
    target = np.zeros(n, np.uint8)
    b.send(b.register(target).descriptor().to_bytes())
    note = b.wait_notification(timeout_s=30)
    conn.send((note.offset, note.nbytes, int(target.astype(np.uint64).sum()), bytes(target[:16])))
    b.close()


def test_an_rma_put_many_into_another_process_lands_bit_exact():
    lis = transports.listen("ucx://127.0.0.1:0")
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
