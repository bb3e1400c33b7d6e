"""The KV movement engine: bit-exact blocks over every transport, layer order, run
merging, and every kind of bad input answered with a typed error."""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest

import transports
from qlink.ai import (
    BlockIdError,
    KVCache,
    KVCacheSpec,
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    SubmitRecord,
    TransferAbortedError,
    TransferRecord,
    plan_transfer,
    preset,
)
from qlink.ai.peer import DecodeStation, open_link, transport_unavailable
from transports import loopback_url
from qlink.errors import BrokenLinkError, CapabilityError, ClosedError, QlinkTimeoutError, RegistrationError, WireError

pytestmark = pytest.mark.timeout(120)

SCHEMES = ("inproc", "shm", "tcp", "ucx")
SEED = 11
RX_BLOCKS, TX_BLOCKS = 48, 64


def _spec(num_blocks):
    return preset("tiny", num_blocks=num_blocks)


def _skip_reason(scheme: str, mode: str) -> str | None:
    why = transport_unavailable(scheme)
    if why:
        return why
    if mode == "put" and not transports.capabilities(scheme).one_sided:
        return f"transport {scheme!r} has no one-sided put"
    return None


@pytest.fixture(scope="module", params=[(s, m) for s in SCHEMES for m in ("put", "send")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def link(request):
    scheme, mode = request.param
    why = _skip_reason(scheme, mode)
    if why:
        pytest.skip(why)
    with open_link(scheme, _spec(RX_BLOCKS), _spec(TX_BLOCKS), seed=SEED, mode=mode) as (rx, cache, peer):
        yield scheme, mode, rx, cache, peer


_ids = iter(range(1, 1 << 30))


def _patterns(rng):
    """Block-id lists: contiguous, strided, shuffled, repeated sources, single, all."""
    yield np.arange(5, 15), np.arange(0, 10)
    yield np.arange(0, 40, 3), rng.permutation(RX_BLOCKS)[:14]
    yield rng.permutation(np.arange(20, 30)), np.arange(30, 40)
    yield rng.integers(0, TX_BLOCKS, 12), rng.choice(RX_BLOCKS, 12, replace=False)
    yield np.array([TX_BLOCKS - 1]), np.array([0])
    yield rng.choice(TX_BLOCKS, RX_BLOCKS, replace=False), np.arange(RX_BLOCKS)


def test_blocks_arrive_bit_exact(link):
    scheme, mode, rx, cache, peer = link
    rng = np.random.default_rng(1)
    for src, dst in _patterns(rng):
        rid = next(_ids)
        sub, rec = peer.transfer(rx, rid, src, dst, timeout_s=30)
        want = peer.call("checksums", src, None)
        got = cache.block_checksums(dst)
        assert (got == want).all(), f"{scheme}/{mode}: blocks differ after request {rid}"
        plan = plan_transfer(src, dst, src_num_blocks=TX_BLOCKS, dst_num_blocks=RX_BLOCKS,
                             block_nbytes=cache.spec.block_nbytes)
        nl = cache.spec.num_layers
        assert isinstance(sub, SubmitRecord) and isinstance(rec, TransferRecord)
        assert rec.num_descs == sub.num_descs == plan.num_descs * nl
        assert rec.nbytes == sub.nbytes == 2 * len(src) * cache.spec.block_nbytes * nl
        assert rec.transport == sub.transport == scheme
        assert rec.mode == sub.mode == mode
        assert len(rec.layer_ready_us) == nl
        assert list(rec.layer_ready_us) == sorted(rec.layer_ready_us)  # layer k ready no later than k + 1
        assert rec.submit_to_last_us == max(rec.layer_ready_us) >= 0


def test_scattered_layers_are_one_notification_each_where_the_endpoint_gathers(link):
    scheme, mode, rx, cache, peer = link
    if mode != "put":
        pytest.skip("notifications come with one-sided puts")
    src, dst = np.arange(0, 40, 3), np.random.default_rng(5).permutation(RX_BLOCKS)[:14]
    plan = plan_transfer(src, dst, src_num_blocks=TX_BLOCKS, dst_num_blocks=RX_BLOCKS,
                         block_nbytes=cache.spec.block_nbytes)
    assert plan.num_descs > 1
    before = rx.endpoint.statistics().notifications
    sub, rec = peer.transfer(rx, next(_ids), src, dst, timeout_s=30)
    notes = rx.endpoint.statistics().notifications - before
    nl = cache.spec.num_layers
    assert notes == (nl if rx.endpoint.put_many_gathers else plan.num_descs * nl)
    assert rec.num_descs == sub.num_descs == plan.num_descs * nl  # descriptors are counted either way
    assert (cache.block_checksums(dst) == peer.call("checksums", src, None)).all()


@pytest.mark.parametrize("defer", [True, False])
def test_over_shm_the_receiver_copies_the_blocks_unless_the_sender_copies_them(defer):
    why = transport_unavailable("shm")
    if why:
        pytest.skip(why)
    with transports.listen(loopback_url("shm")) as lis:
        a = transports.connect(lis.url, timeout_s=5)
        b = lis.accept(timeout_s=5)
        with a, b:
            rx_cache, tx_cache = KVCache.allocate(_spec(RX_BLOCKS)), KVCache.allocate(_spec(TX_BLOCKS))
            tx_cache.fill_random(seed=SEED)
            rx, tx = KVReceiver(b, rx_cache), KVSender(a, tx_cache, defer=defer)
            src, dst = np.array([3, 9, 10, 11, 40]), np.array([0, 7, 6, 5, 30])
            before = rx_cache.block_checksums(dst)
            sub = tx.send_request(1, src, dst, timeout_s=5)  # this thread: the receiver has not progressed
            moved = not (rx_cache.block_checksums(dst) == before).all()
            assert moved != defer  # deferred: nothing has moved until the receiver looks
            rec = rx.wait_request(1, timeout_s=5)
            assert (rx_cache.block_checksums(dst) == tx_cache.block_checksums(src)).all()
            tx.flush(timeout_s=5)
            nl = tx_cache.spec.num_layers
            assert a.statistics().extra["deferred_puts"] == (nl if defer else 0)
            assert b.statistics().extra["pulled_bytes"] == (rec.nbytes if defer else 0)
            assert sub.num_descs == rec.num_descs
            exposed = [r.descriptor() for r in tx._src_regions]
            assert len(exposed) == (nl if defer else 0)
            tx.close()
            rx.close()
            for d in exposed[:1]:  # close() withdrew the sender's cache
                with pytest.raises(RegistrationError, match="not registered"):
                    b.put(b"x", d)


def test_tracker_takes_each_layers_own_number_of_parts():
    from qlink.ai._tracker import RequestTracker

    t = RequestTracker(num_layers=3, transport="shm", mode="put")
    assert t.on_part(1, 5, 1, 0, 3, 3, 3, 300, 100, now_ns=10)  # layer 1 in 3 parts
    assert t.on_part(1, 5, 0, 0, 3, 1, 3, 300, 300, now_ns=11)  # layer 0 gathered: one part
    assert (t.ready_ns(1, 0), t.ready_ns(1, 1)) == (11, 0)
    t.on_part(1, 5, 1, 0, 3, 3, 3, 300, 100, now_ns=12)
    t.on_part(1, 5, 2, 0, 3, 1, 3, 300, 300, now_ns=13)  # layer 2 complete, but layer 1 is not yet
    assert t.ready_layers(1) == 1
    t.on_part(1, 5, 1, 0, 3, 3, 3, 300, 100, now_ns=14)
    assert [t.ready_ns(1, k) for k in range(3)] == [11, 14, 14] and t.record(1).nbytes == 900
    # within one layer every part must agree on how many parts make it
    assert t.on_part(2, 5, 0, 0, 3, 2, 3, 300, 150, now_ns=20)
    assert not t.on_part(2, 5, 0, 0, 3, 3, 3, 300, 100, now_ns=21)
    with pytest.raises(TransferAbortedError, match="disagrees"):
        t.ready_ns(2, 0)
    assert t.bad_frames == 1 and t.failed == 1


def test_same_blocks_again_and_request_ids_reused(link):
    scheme, mode, rx, cache, peer = link
    rid = next(_ids)
    for src in (np.arange(0, 8), np.arange(8, 16), np.arange(16, 24)):  # same destinations, new contents
        peer.transfer(rx, rid, src, np.arange(40, 48), timeout_s=30)  # wait_request releases the id
        assert (cache.block_checksums(np.arange(40, 48)) == peer.call("checksums", src, None)).all()


def test_layer_subset_moves_only_those_layers(link):
    scheme, mode, rx, cache, peer = link
    rid = next(_ids)
    before = cache.block_checksums([1, 2])
    peer.submit("send", rid, [60, 61], [1, 2], range(1, 3))
    rec = rx.wait_request(rid, timeout_s=30, release=False)
    peer.result()
    assert rec.num_layers == 2 and len(rec.layer_ready_us) == 2
    after = cache.block_checksums([1, 2])
    want = peer.call("checksums", [60, 61], range(1, 3))
    assert (after[1:3] == want).all()
    assert (after[[0, 3]] == before[[0, 3]]).all()
    with pytest.raises(ValueError, match="not part of it"):
        rx.wait_layer(rid, 0, timeout_s=1)
    rx.release(rid)


class _CallCounter:
    """The sender's endpoint, counting the calls the engine makes on it per layer."""

    def __init__(self, ep):
        self._ep = ep
        self.calls = {"put": 0, "put_many": 0, "send": 0}

    def __getattr__(self, name):
        attr = getattr(self._ep, name)
        if name in self.calls:
            def counted(*a, **k):
                self.calls[name] += 1
                return attr(*a, **k)
            return counted
        return attr


@pytest.mark.parametrize("mode", ["put", "send"])
@pytest.mark.parametrize("scheme", ["inproc", "shm", "tcp", "ucx"])
def test_a_layer_is_one_transport_call_however_scattered_its_blocks(scheme, mode):
    """No per-descriptor calls on the hot path: one put_many per layer (put), or one frame
    and one message per layer (send), for 28 descriptors per layer."""
    why = transport_unavailable(scheme)
    if why:
        pytest.skip(why)
    with transports.listen(loopback_url(scheme)) as lis:
        a = transports.connect(lis.url, timeout_s=5)
        b = lis.accept(timeout_s=5)
        with a, b:
            rx_cache, tx_cache = KVCache.allocate(_spec(RX_BLOCKS)), KVCache.allocate(_spec(TX_BLOCKS))
            tx_cache.fill_random(seed=SEED)
            rx = KVReceiver(b, rx_cache)
            spy = _CallCounter(a)
            tx = KVSender(spy, tx_cache, mode=mode)
            # only an endpoint that defers copies (shm; ucx with RMA opted in: the target reads a share)
            # gets the sender's cache registered
            defers = scheme == "shm" or (scheme == "ucx" and a.rma)
            assert bool(tx._src_regions) == (defers and mode == "put")
            src, dst = np.arange(0, 42, 3), np.random.default_rng(4).permutation(RX_BLOCKS)[:14]
            tx.handshake(timeout_s=5)
            before = dict(spy.calls)
            sub = tx.send_request(1, src, dst, timeout_s=10)
            rec = rx.wait_request(1, timeout_s=10)
            nl = tx_cache.spec.num_layers
            assert sub.num_descs == 28 * nl and rec.num_layers == nl
            made = {k: v - before[k] for k, v in spy.calls.items()}
            assert made == ({"put": 0, "put_many": nl, "send": 0} if mode == "put" else
                            {"put": 0, "put_many": 0, "send": 2 * nl})
            assert (rx_cache.block_checksums(dst) == tx_cache.block_checksums(src)).all()
            tx.close(), rx.close()


@pytest.mark.parametrize("checksum", [False, True])
def test_two_sided_layers_past_the_message_limit_go_in_several_parts(pair, checksum):
    tx, rx, src_cache, dst_cache = pair(mode="send")
    tx.checksum = checksum
    tx._max_desc_nbytes = 3 * src_cache.spec.block_nbytes + 12  # three blocks and their row ids per message
    src, dst = np.random.default_rng(8).permutation(TX_BLOCKS)[:10], np.arange(10, 20)
    tx.send_request(2, src, dst, timeout_s=5)
    rec = rx.wait_request(2, timeout_s=5)
    assert rec.nbytes == 2 * 10 * src_cache.spec.block_nbytes * src_cache.spec.num_layers
    assert rx.statistics().parts == 7 * src_cache.spec.num_layers  # 20 rows in parts of 3
    assert (dst_cache.block_checksums(dst) == src_cache.block_checksums(src)).all()


def test_a_two_sided_part_naming_rows_outside_the_layer_fails_its_request_only(pair):
    from qlink.ai import frames as fr

    tx, rx, src_cache, dst_cache = pair(mode="send")
    tx.handshake(timeout_s=5)
    spec = dst_cache.spec
    bn = spec.block_nbytes
    rows = np.array([1, 2 * RX_BLOCKS], "<u4")  # the second row is past the V plane
    tx.endpoint.send(fr.pack_rows(4, 0, layer=0, layer_lo=0, layer_hi=spec.num_layers, num_parts=1, num_descs=2,
                                  layer_nbytes=2 * bn, num_rows=2, row_nbytes=bn))
    tx.endpoint.send(rows.tobytes() + bytes(2 * bn))
    before = dst_cache.layers[0].copy()
    with pytest.raises(TransferAbortedError, match="outside the layer"):
        rx.wait_request(4, timeout_s=5)
    assert (dst_cache.layers[0] == before).all()  # nothing of the refused part was written
    tx.send_request(5, [3], [1], timeout_s=5)
    rx.wait_request(5, timeout_s=5)
    assert (dst_cache.block_checksums([1]) == src_cache.block_checksums([3])).all()


# ----- layer by layer, in one process ------------------------------------------------


@pytest.fixture
def pair():
    """KVSender and KVReceiver on two ends of one inproc connection, in this thread."""
    why = transport_unavailable("inproc")
    if why:
        pytest.skip(why)
    made = []

    def make(rx_spec=_spec(RX_BLOCKS), tx_spec=_spec(TX_BLOCKS), *, mode="auto", seed=SEED, scheme="inproc"):
        why = transport_unavailable(scheme)
        if why:
            pytest.skip(why)
        lis = transports.listen(loopback_url(scheme))
        a = transports.connect(lis.url, timeout_s=5)
        b = lis.accept(timeout_s=5)
        made.extend([a, b, lis])
        rx_cache, tx_cache = KVCache.allocate(rx_spec), KVCache.allocate(tx_spec)
        tx_cache.fill_random(seed=seed)
        rx = KVReceiver(b, rx_cache)
        tx = KVSender(a, tx_cache, mode=mode)
        return tx, rx, tx_cache, rx_cache

    yield make
    for x in made:
        x.close()


@pytest.mark.parametrize("mode", ["put", "send"])
def test_layer_k_is_readable_while_later_layers_move(pair, mode):
    tx, rx, src_cache, dst_cache = pair(mode=mode)
    src, dst = [3, 4, 9], [0, 1, 2]
    req = tx.begin_request(5, src, dst)
    req.send_layer(0)
    t0 = rx.wait_layer(5, 0, timeout_s=5)
    assert t0 > 0
    assert (dst_cache.block_checksums(dst, layers=[0]) == src_cache.block_checksums(src, layers=[0])).all()
    assert not dst_cache.layers[1].any()  # layer 1 has not been sent
    with pytest.raises(QlinkTimeoutError):
        rx.wait_layer(5, 1, timeout_s=0.05)
    req.send_layer(2)  # out of order: layer 2 complete, but not ready before layer 1
    assert rx.ready_layers(5) == 1
    with pytest.raises(QlinkTimeoutError):
        rx.wait_layer(5, 2, timeout_s=0.05)
    req.send_layer(1)
    t2 = rx.wait_layer(5, 2, timeout_s=5)
    t1 = rx.wait_layer(5, 1, timeout_s=5)
    assert t0 <= t1 <= t2
    assert rx.ready_layers(5) == 3
    req.send_layer(3)
    rec = rx.wait_request(5, timeout_s=5)
    assert rec.mode == mode and list(rec.layer_ready_us) == sorted(rec.layer_ready_us)
    assert (dst_cache.block_checksums(dst) == src_cache.block_checksums(src)).all()
    with pytest.raises(ValueError, match="already sent"):
        req.send_layer(3)


# 32 KiB blocks, 4 MiB per layer: a layer takes a while to move between processes
_BIG = KVCacheSpec(num_layers=4, num_kv_heads=8, head_size=128, block_size=16, num_blocks=64)


def test_over_tcp_the_layers_go_by_splice_unregistered_and_flush_waits_for_the_reader(monkeypatch):
    """A cache's layers over tcp (version 3, splice asked for: ``QLINK_TCP_SPLICE=1``) are
    deferred in place: nothing is registered on the sender, each layer's pages go to the
    socket by splice, the blocks land bit-exact, and the sender's flush returns once the
    receiver has read them all."""
    from transports import _tcp_splice

    if not _tcp_splice.built():
        pytest.skip("transports._tcpc is not built here")
    monkeypatch.setenv("QLINK_TCP_SPLICE", "1")
    with transports.listen("tcp://127.0.0.1:0") as lis:
        a = transports.connect(lis.url, timeout_s=5)
        b = lis.accept(timeout_s=5)
        with a, b:
            rx_cache, tx_cache = KVCache.allocate(_BIG), KVCache.allocate(_BIG)
            tx_cache.fill_random(seed=SEED)
            rx, tx = KVReceiver(b, rx_cache), KVSender(a, tx_cache)
            assert tx._defer and not tx._src_regions
            src, dst = np.random.default_rng(3).permutation(64)[:40], np.arange(40)
            tx.handshake(timeout_s=5)
            got = {}
            t = threading.Thread(target=lambda: got.setdefault("rec", rx.wait_request(5, timeout_s=30)))
            t.start()
            tx.send_request(5, src, dst, timeout_s=30)
            tx.flush(timeout_s=30)
            t.join(30)
            assert got["rec"].num_layers == _BIG.num_layers
            stats = a.statistics().extra
            assert stats["spliced_puts"] == stats["spliced_puts_confirmed"] == _BIG.num_layers
            assert (rx_cache.block_checksums(dst) == tx_cache.block_checksums(src)).all()
            tx.close(), rx.close()


@pytest.mark.parametrize("scheme", ["shm", "tcp", "ucx"])
def test_layer_0_is_read_in_another_process_while_later_layers_are_still_moving(scheme):
    """The sender (another process) sends a layer only when told, so which layers are out
    is certain: layer 0 is checksummed here after wait_layer(0) while layer 1 is on its
    way and layers 2 and 3 have not left, and it is already whole."""
    why = transport_unavailable(scheme)
    if why:
        pytest.skip(why)
    with open_link(scheme, _BIG, seed=SEED) as (rx, cache, peer):
        nl, rid = _BIG.num_layers, 7
        src, dst = np.random.default_rng(3).permutation(64), np.random.default_rng(4).permutation(64)
        want = peer.call("checksums", src, None)
        plan = plan_transfer(src, dst, src_num_blocks=64, dst_num_blocks=64, block_nbytes=_BIG.block_nbytes)
        assert peer.call("paced", rid, src, dst) == plan.num_descs > 100  # scattered: few runs merge
        peer.submit("go", 0)
        rx.wait_layer(rid, 0, timeout_s=30)
        assert peer.result(timeout_s=30) == 0
        peer.submit("go", 1)  # layer 1 (4 MiB) leaves the sender ...
        got0 = cache.block_checksums(dst, layers=[0])  # ... while this process reads layer 0
        ready = rx.ready_layers(rid)
        assert 1 <= ready < nl
        assert (got0 == want[:1]).all()
        assert not cache.layers[2].any() and not cache.layers[3].any()  # not sent: nothing of them landed
        rx.wait_layer(rid, 1, timeout_s=30)
        assert peer.result(timeout_s=30) == 1 and rx.ready_layers(rid) == 2
        for k in range(2, nl):
            peer.submit("go", k)
            rx.wait_layer(rid, k, timeout_s=30)
            assert peer.result(timeout_s=30) == k
        rec = rx.wait_request(rid, timeout_s=30)
        assert rec.num_layers == nl and list(rec.layer_ready_us) == sorted(rec.layer_ready_us)
        assert (cache.block_checksums(dst) == want).all()


def test_bad_block_ids_are_refused_and_the_engine_keeps_serving(pair):
    tx, rx, src_cache, dst_cache = pair()
    bad = [
        ([TX_BLOCKS], [0], "src_block_ids contains block id 64"),
        ([0], [RX_BLOCKS], "dst_block_ids contains block id 48"),  # past the receiver's cache, not the sender's
        ([0, 1], [0], "one to one"),
        ([0, 1], [2, 2], "more than once"),
        ([], [], "at least one"),
    ]
    for src, dst, match in bad:
        with pytest.raises(BlockIdError, match=match):
            tx.send_request(1, src, dst)
    with pytest.raises(ValueError, match="request_id"):
        tx.send_request(-1, [0], [0])
    with pytest.raises(ValueError, match="layers"):
        tx.send_request(1, [0], [0], layers=range(2, 9))
    assert rx.ready_layers(1) == 0  # nothing of the refused requests was sent
    tx.send_request(1, [7, 8], [5, 6])
    rx.wait_request(1, timeout_s=5)
    assert (dst_cache.block_checksums([5, 6]) == src_cache.block_checksums([7, 8])).all()
    assert rx.statistics().bad_frames == 0


@pytest.mark.parametrize("field, value", [("num_layers", 3), ("num_kv_heads", 4), ("head_size", 8),
                                          ("block_size", 8), ("dtype_name", "float16")])
def test_layout_mismatch_fails_on_both_sides(pair, field, value):
    tx, rx, _, _ = pair(tx_spec=dataclasses.replace(_spec(TX_BLOCKS), **{field: value}))
    with pytest.raises(LayoutMismatchError) as e:
        tx.send_request(1, [0], [0])
    assert e.value.field == field
    with pytest.raises(LayoutMismatchError) as e:
        rx.handshake(timeout_s=5)
    assert e.value.field == field


@pytest.mark.parametrize("scheme, field, value", [("inproc", "num_kv_heads", 4), ("shm", "dtype_name", "float16"),
                                                  ("tcp", "block_size", 8), ("ucx", "head_size", 8)])
def test_after_a_layout_mismatch_the_decode_side_serves_a_matching_sender(scheme, field, value):
    """A sender of another layout is refused on both sides (typed error naming the field);
    the decode process keeps its cache and its listener, and the next sender, of the
    right layout, moves blocks bit for bit."""
    why = transport_unavailable(scheme)
    if why:
        pytest.skip(why)
    cache = KVCache.allocate(_spec(RX_BLOCKS))
    with DecodeStation(scheme, cache) as station:
        rx, peer = station.attach(dataclasses.replace(_spec(TX_BLOCKS), **{field: value}), seed=SEED)
        with pytest.raises(LayoutMismatchError) as e:
            rx.handshake(timeout_s=10)
        assert e.value.field == field
        with pytest.raises(RuntimeError, match="LayoutMismatchError"):
            peer.call("send", 1, [0], [0], "all")
        rx, peer = station.attach(_spec(TX_BLOCKS), seed=SEED)
        src, dst = [5, 6, 7, 30], [9, 10, 11, 0]
        _sub, rec = peer.transfer(rx, 1, src, dst, timeout_s=30)
        assert rec.num_layers == cache.spec.num_layers
        assert (cache.block_checksums(dst) == peer.call("checksums", src, None)).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_put_into_a_deregistered_layer_never_reports_it(pair, scheme):
    """A put into a deregistered region fails at the initiator (the engine aborts the
    request) or is refused at the target (the layer never lands). Either way no layer from
    the refused one on is ever reported ready, and the engine serves the next request."""
    tx, rx, src_cache, dst_cache = pair(mode="put", scheme=scheme)
    tx.handshake(timeout_s=5)
    rx.handshake(timeout_s=5)
    rx.endpoint.deregister(rx._regions[2])  # layer 2 is no longer a valid target
    try:
        tx.send_request(9, [1, 2], [3, 4])
        told_initiator = False
    except RegistrationError:
        told_initiator = True
    assert rx.wait_layer(9, 1, timeout_s=5)  # layers 0 and 1 landed whole
    if told_initiator:
        with pytest.raises(TransferAbortedError, match="aborted by the sender at layer 2") as e:
            rx.wait_layer(9, 2, timeout_s=5)
        assert e.value.request_id == 9
        with pytest.raises(TransferAbortedError):
            rx.wait_request(9, timeout_s=5)
        assert rx.statistics().requests_failed == 1
    else:
        with pytest.raises(QlinkTimeoutError):
            rx.wait_layer(9, 2, timeout_s=0.5)
        with pytest.raises(QlinkTimeoutError):
            rx.wait_request(9, timeout_s=0.1)
    assert rx.ready_layers(9) == 2
    rx.release(9)
    tx.send_request(10, [1, 2], [3, 4], layers=range(0, 2))  # the engine serves the next request
    assert rx.wait_request(10, timeout_s=5).num_layers == 2


def test_garbage_from_the_peer_is_counted_not_fatal(pair):
    tx, rx, src_cache, dst_cache = pair(mode="put")
    tx.handshake(timeout_s=5)
    ep = tx.endpoint
    region = tx._peer.regions[0]
    ep.put(b"\x00" * 16, region, offset=0, notify_id=3, tag=b"not a kv frame")
    ep.send(b"garbage that is no frame")
    ep.send(b"RQUC" + bytes(60))  # right magic, wrong lengths
    rx.progress()
    assert rx.statistics().bad_frames == 3
    tx.send_request(3, [0], [0])
    rec = rx.wait_request(3, timeout_s=5)
    assert rec.nbytes == 2 * dst_cache.spec.block_nbytes * dst_cache.spec.num_layers
    assert (dst_cache.block_checksums([0]) == src_cache.block_checksums([0])).all()


def test_a_second_sender_is_refused(pair):
    tx, rx, src_cache, _ = pair()
    lis = transports.listen(loopback_url("inproc"))
    try:
        a = transports.connect(lis.url, timeout_s=5)
        b = lis.accept(timeout_s=5)
        KVSender(b, src_cache)  # two senders face each other
        other = KVSender(a, src_cache)
        with pytest.raises(WireError, match="KVSender where a KVReceiver was expected"):
            other.handshake(timeout_s=5)
        a.close()
        b.close()
    finally:
        lis.close()


def test_read_is_a_capability_error(pair):
    tx, rx, _, _ = pair()
    with pytest.raises(CapabilityError, match="one-sided get"):
        tx.read_request(1, [0], [0])
    with pytest.raises(CapabilityError, match="one-sided get"):
        rx.read_request(1, [0], [0])


def test_records_are_frozen(pair):
    tx, rx, _, _ = pair()
    sub = tx.send_request(4, [0, 1], [0, 1])
    rec = rx.wait_request(4, timeout_s=5)
    for r in (sub, rec):
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.nbytes = 0
    assert sub.us_per_block > 0 and sub.num_layers == rec.num_layers == 4


def test_bad_constructor_arguments():
    lis = transports.listen(loopback_url("inproc"))
    try:
        a = transports.connect(lis.url, timeout_s=5)
        cache = KVCache.allocate(_spec(4))
        with pytest.raises(ValueError, match="mode"):
            KVSender(a, cache, mode="teleport")
        with pytest.raises(TypeError, match="KVCache"):
            KVSender(a, np.zeros(4))
        a.close()
    finally:
        lis.close()


# ----- a peer that dies mid-transfer -----------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_peer_dying_mid_transfer_never_reports_a_partial_layer_and_the_next_sender_is_served(scheme):
    why = transport_unavailable(scheme)
    if why:
        pytest.skip(why)
    cache = KVCache.allocate(_spec(RX_BLOCKS))
    with DecodeStation(scheme, cache) as station:
        rx, peer = station.attach(_spec(TX_BLOCKS), seed=SEED)
        src, dst = [0, 1, 5, 9], [0, 1, 2, 3]  # 3 descriptors per plane: 6 per layer
        peer.call("send", 1, [2], [7], "all")  # an earlier, small request completes normally
        # (landed before the peer dies: over ucx between processes of one host the receiver reads
        # deferred layers out of the sender's memory, which dies with it)
        assert rx.wait_request(1, timeout_s=30, release=False).num_layers == 4
        peer.call("partial", 2, src, dst, 1, 3)  # layer 0 whole, 3 of 6 parts of layer 1, then gone
        assert rx.wait_layer(2, 0, timeout_s=30) > 0
        with pytest.raises(BrokenLinkError):
            rx.wait_layer(2, 1, timeout_s=30)
        with pytest.raises(BrokenLinkError):
            rx.wait_request(2, timeout_s=5)
        assert rx.wait_request(1, timeout_s=5).num_layers == 4  # completed before the death: still reported
        if peer.proc is not None:
            peer.proc.join(10)
            assert peer.proc.exitcode == 0
        assert rx.statistics().requests_failed >= 1
        old = rx
        # a new sender connects to the same decode process; the same blocks (half-written by
        # the dead request) and the same request id come back whole
        rx, peer = station.attach(_spec(TX_BLOCKS), seed=SEED + 1)
        with pytest.raises(ClosedError):
            old.progress()
        src = [40, 41, 42, 3, 17, 60]
        dst = [0, 1, 2, 3, 20, 21]
        _sub, rec = peer.transfer(rx, 2, src, dst, timeout_s=30)
        assert rec.num_layers == 4 and rx.statistics().requests_failed == 0
        assert (cache.block_checksums(dst) == peer.call("checksums", src, None)).all()


def test_cross_process_peer_really_is_another_process():
    scheme = next((s for s in ("shm", "tcp") if not transport_unavailable(s)), None)
    if scheme is None:
        pytest.skip("no cross-process transport (shm, tcp) available")
    with open_link(scheme, _spec(RX_BLOCKS)) as (rx, cache, peer):
        assert peer.proc is not None and peer.proc.pid != os.getpid()


@pytest.mark.parametrize("mode", ["put", "send"])
@pytest.mark.parametrize("scheme", ["inproc", "shm"])
def test_checksummed_parts_arrive_and_a_bad_crc_fails_only_its_request(mode, scheme):
    """KVSender(checksum=True) puts a CRC-32 of every part in its frame; the receiver
    compares the bytes as they landed. A part whose CRC does not match (forged here by
    hand on the same link) fails its request, counted, and the next request completes."""
    from qlink.ai import frames as fr

    why = transport_unavailable(scheme)
    if why:
        pytest.skip(why)
    spec = _spec(RX_BLOCKS)
    with transports.listen(loopback_url(scheme)) as lis:
        a = transports.connect(lis.url, timeout_s=5)
        b = lis.accept(timeout_s=5)
        tx_cache, rx_cache = KVCache.allocate(_spec(TX_BLOCKS)), KVCache.allocate(spec)
        tx_cache.fill_random(seed=SEED)
        rx = KVReceiver(b, rx_cache)
        tx = KVSender(a, tx_cache, mode=mode, checksum=True)
        tx.send_request(1, [5, 6, 40], [0, 1, 7], timeout_s=5)
        rx.wait_request(1, timeout_s=5)
        assert (rx_cache.block_checksums([0, 1, 7]) == tx_cache.block_checksums([5, 6, 40])).all()
        assert rx.crc_mismatches == 0
        # a forged part of request 2 whose CRC does not match its bytes
        part = np.full(spec.block_nbytes, 7, np.uint8)
        if mode == "send":
            a.send(fr.pack_data(2, 0, layer=0, layer_lo=0, layer_hi=spec.num_layers, num_parts=1, num_descs=1,
                                layer_nbytes=spec.layer_nbytes, part_nbytes=part.nbytes, dst_offset=0, crc32=1))
            a.send(part)
        else:
            tag = fr._WRITE_FULL.pack(fr.MAGIC_REQUEST, fr.FN_WRITE, fr.WRITE_ARG_NBYTES, 2, 0, 0, 0, spec.num_layers,
                                      1, 1, 1, spec.layer_nbytes, part.nbytes)
            a.put(part, tx._peer.regions[0], offset=0, notify_id=2, tag=tag)
        with pytest.raises(TransferAbortedError, match="CRC-32"):
            rx.wait_request(2, timeout_s=5)
        assert rx.crc_mismatches == 1
        tx.send_request(3, [9], [9], timeout_s=5)
        rx.wait_request(3, timeout_s=5)
        assert (rx_cache.block_checksums([9]) == tx_cache.block_checksums([9])).all()
        rx.close(), a.close(), b.close()

