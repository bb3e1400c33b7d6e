"""The two ends of the serving-engine KV link (qlink.ai._vllm_link) without vLLM: a prefill
server over a paged cache in vLLM's CPU layout (one K+V slab per block) and a decode
client, over real transports. Bytes are compared block by block."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from qlink.ai import KVCache, KVCacheSpec
from qlink.ai.peer import transport_unavailable
from transports import loopback_url
url_for = loopback_url
from qlink.ai._vllm_link import DecodeClient, PrefillServer, pack_expect, pack_pull, unpack_expect, unpack_pull
from qlink.errors import WireError

pytestmark = pytest.mark.timeout(120)

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_size=32, block_size=32, dtype_name="float32", num_blocks=24,
                   num_planes=1)


def _results(client, n, timeout_s=30.0):
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += client.take_results()
        time.sleep(0.002)
    assert len(out) == n, f"{len(out)} of {n} loads finished within {timeout_s} s"
    return {r.key: r for r in out}


@contextlib.contextmanager
def _link_ends(scheme: str, *, seed: int):
    """A prefill server over a random cache and a decode client over an empty one; closed after."""
    src = KVCache.allocate(SPEC, shared=False)
    src.fill_random(seed=seed)
    dst = KVCache.allocate(SPEC, shared=False)
    server = PrefillServer(loopback_url(scheme), src)
    client = DecodeClient(dst, load_timeout_s=20)
    try:
        yield src, dst, server, client
    finally:
        client.close()
        server.close()


@pytest.fixture(params=["shm", "tcp", "ucx"])
def scheme(request):
    why = transport_unavailable(request.param)
    if why:
        pytest.skip(why)
    return request.param


def test_vllm_cpu_layout_spec():
    assert SPEC.layer_shape == (24, 2, 32, 64)
    assert SPEC.block_nbytes == 2 * 32 * 2 * 32 * 4 and SPEC.layer_nbytes == 24 * SPEC.block_nbytes
    assert KVCacheSpec.from_bytes(SPEC.to_bytes()) == SPEC
    two = KVCacheSpec(num_layers=3, num_kv_heads=2, head_size=32, block_size=32, dtype_name="float32", num_blocks=24)
    assert two.bytes_per_token == SPEC.bytes_per_token and two.layer_nbytes == SPEC.layer_nbytes
    with pytest.raises(ValueError, match="num_planes"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_size=32, num_planes=3)


def test_pull_frame_round_trip_and_bad_frames():
    f = pack_pull(9, xfer_id=4, src_block_ids=[1, 2, 3], dst_block_ids=[7, 8, 9])
    assert unpack_pull(f) == (9, 4, [1, 2, 3], [7, 8, 9])
    with pytest.raises(WireError):
        unpack_pull(f[:-4])
    with pytest.raises(ValueError, match="as many destination"):
        pack_pull(1, xfer_id=1, src_block_ids=[1, 2], dst_block_ids=[1])


def test_offer_pull_push_bit_exact(scheme):
    with _link_ends(scheme, seed=3) as (src, dst, server, client):
        server.offer(1, [4, 5, 11], key="a")
        server.offer(2, [0, 20], key="b")
        client.load("a", url=server.url, xfer_id=1, src_block_ids=[4, 5, 11], dst_block_ids=[2, 3, 9])
        client.load("b", url=server.url, xfer_id=2, src_block_ids=[20], dst_block_ids=[17])  # a suffix: ok
        res = _results(client, 2)
        assert res["a"].ok and res["b"].ok, (res["a"].error, res["b"].error)
        assert res["a"].nbytes == 3 * SPEC.num_layers * SPEC.block_nbytes
        assert (dst.block_checksums([2, 3, 9]) == src.block_checksums([4, 5, 11])).all()
        assert (dst.block_checksums([17]) == src.block_checksums([20])).all()
        assert not dst.layers[0][0].any(), "a block nobody pulled into was written"
        deadline = time.monotonic() + 5
        done = []
        while len(done) < 2 and time.monotonic() < deadline:
            done += server.take_done()
            time.sleep(0.002)
        assert sorted(done) == ["a", "b"]


def test_pull_of_blocks_not_offered_fails_clearly():
    src, dst = KVCache.allocate(SPEC, shared=False), KVCache.allocate(SPEC, shared=False)
    server = PrefillServer(loopback_url("tcp"), src)
    client = DecodeClient(dst, load_timeout_s=20)
    try:
        server.offer(1, [4, 5], key="a")
        client.load("a", url=server.url, xfer_id=1, src_block_ids=[4, 6], dst_block_ids=[0, 1])
        r = _results(client, 1)["a"]
        assert not r.ok and "did not offer" in r.error
        assert server.refused == 1
        server.offer(2, [4, 5], key="b")  # the link is still good for the next request
        client.load("b", url=server.url, xfer_id=2, src_block_ids=[4, 5], dst_block_ids=[0, 1])
        assert _results(client, 1)["b"].ok
    finally:
        client.close()
        server.close()


def test_prefill_gone_fails_the_load_and_the_next_url_still_serves():
    src, dst = KVCache.allocate(SPEC, shared=False), KVCache.allocate(SPEC, shared=False)
    src.fill_random(seed=5)
    doomed = PrefillServer(loopback_url("tcp"), src)
    good = PrefillServer(loopback_url("tcp"), src)
    client = DecodeClient(dst, load_timeout_s=10)
    try:
        doomed.offer(1, [1], key="warm")
        client.load("warm", url=doomed.url, xfer_id=1, src_block_ids=[1], dst_block_ids=[1])
        assert _results(client, 1)["warm"].ok  # the link is open
        url = doomed.url
        doomed.close()  # the prefill side goes away with the link open
        client.load("lost", url=url, xfer_id=2, src_block_ids=[2], dst_block_ids=[2])
        r = _results(client, 1)["lost"]
        assert not r.ok and r.error, r
        good.offer(7, [3], key="next")
        client.load("next", url=good.url, xfer_id=7, src_block_ids=[3], dst_block_ids=[3])
        assert _results(client, 1)["next"].ok
        assert (dst.block_checksums([3]) == src.block_checksums([3])).all()
    finally:
        client.close()
        good.close()


def test_load_that_never_comes_times_out():
    src, dst = KVCache.allocate(SPEC, shared=False), KVCache.allocate(SPEC, shared=False)
    server = PrefillServer(loopback_url("tcp"), src)
    client = DecodeClient(dst, load_timeout_s=0.5)
    try:
        client.load("x", url=server.url, xfer_id=99, src_block_ids=[1], dst_block_ids=[1])  # never offered
        r = _results(client, 1, timeout_s=10)["x"]
        assert not r.ok and "load_timeout_s" in r.error
    finally:
        client.close()
        server.close()


def test_layout_mismatch_is_refused():
    src = KVCache.allocate(SPEC, shared=False)
    other = KVCache.allocate(KVCacheSpec(num_layers=3, num_kv_heads=2, head_size=32, block_size=32,
                                         dtype_name="float32", num_blocks=24), shared=False)  # two planes
    server = PrefillServer(loopback_url("tcp"), src)
    client = DecodeClient(other, load_timeout_s=5)
    try:
        server.offer(1, [1], key="a")
        client.load("a", url=server.url, xfer_id=1, src_block_ids=[1], dst_block_ids=[1])
        r = _results(client, 1)["a"]
        assert not r.ok and "num_planes" in r.error
    finally:
        client.close()
        server.close()
    assert np.all(other.layers[1] == 0)


class _DiesMidPush(PrefillServer):
    """Pushes the first two layers of the first pull it serves, then the process dies."""

    def _serve_pull(self, link, frame, *, requeue):
        import os

        from qlink.ai._vllm_link import unpack_pull

        rid, xfer_id, src, dst = unpack_pull(frame)
        req = link.sender.begin_request(rid, src, dst, timeout_s=10)
        req.send_layer(0, timeout_s=10)
        req.send_layer(1, timeout_s=10)
        link.sender.flush(timeout_s=10)
        os._exit(0)  # SIGKILL-like: nothing closed, layers 2.. never sent


def _dying_prefill(url_q):
    src = KVCache.allocate(SPEC, shared=False)
    src.fill_random(seed=5)
    server = _DiesMidPush(loopback_url("tcp"), src)
    server.offer(1, [1, 2, 3], key="a")
    url_q.put(server.url)
    time.sleep(60)


def test_prefill_process_dies_mid_transfer():
    """The prefill process dies after pushing 2 of 3 layers: the load fails with a clear
    error (no hang), nothing is reported landed, and the next load from another prefill
    side lands bit-exact."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_dying_prefill, args=(q,), daemon=True)
    proc.start()
    dst = KVCache.allocate(SPEC, shared=False)
    client = DecodeClient(dst, load_timeout_s=20)
    good_src = KVCache.allocate(SPEC, shared=False)
    good_src.fill_random(seed=6)
    good = PrefillServer(loopback_url("tcp"), good_src)
    try:
        url = q.get(timeout=30)
        client.load("a", url=url, xfer_id=1, src_block_ids=[1, 2, 3], dst_block_ids=[4, 5, 6])
        r = _results(client, 1, timeout_s=15)["a"]
        assert not r.ok and "went away mid-transfer" in r.error, r
        proc.join(10)
        assert proc.exitcode == 0  # it died where the test made it die
        good.offer(2, [7], key="b")
        client.load("b", url=good.url, xfer_id=2, src_block_ids=[7], dst_block_ids=[8])
        assert _results(client, 1)["b"].ok
        assert (dst.block_checksums([8]) == good_src.block_checksums([7])).all()
    finally:
        client.close()
        good.close()
        if proc.is_alive():
            proc.kill()


def test_pull_into_blocks_the_decode_cache_lacks_fails_at_once():
    src = KVCache.allocate(SPEC, shared=False)
    dst = KVCache.allocate(SPEC.with_blocks(8), shared=False)
    server = PrefillServer(loopback_url("tcp"), src)
    client = DecodeClient(dst, load_timeout_s=20)
    try:
        server.offer(1, [3], key="a")
        t0 = time.monotonic()
        client.load("a", url=server.url, xfer_id=1, src_block_ids=[3], dst_block_ids=[12])  # dst has 8 blocks
        r = _results(client, 1)["a"]
        assert not r.ok and "BlockIdError" in r.error and time.monotonic() - t0 < 10, r
        assert server.failed == 1
    finally:
        client.close()
        server.close()


def _wait(cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


def test_expect_frame_round_trip_and_bad_frames():
    f = pack_expect(5, xfer_id=1 << 31, skip_blocks=2, dst_block_ids=[3, 1])
    assert unpack_expect(f) == (5, 1 << 31, 2, [3, 1])
    with pytest.raises(WireError):
        unpack_expect(f[:-1])
    with pytest.raises(ValueError, match="destination blocks"):
        pack_expect(1, xfer_id=1, skip_blocks=0, dst_block_ids=[])


def test_layers_stream_out_while_the_forward_pass_runs(scheme):
    """An expectation sent before the prefill computes: each layer leaves as it is written
    (before the pass ends), the decode side's blocks are bit-exact, the offer that follows
    is done at once; an expectation that arrives after the pass is served from the offer."""
    src = KVCache.allocate(SPEC, shared=False)
    dst = KVCache.allocate(SPEC, shared=False)
    server = PrefillServer(url_for(scheme), src)
    client = DecodeClient(dst, load_timeout_s=20)
    try:
        client.load("early", url=server.url, xfer_id=100, src_block_ids=None, dst_block_ids=[7, 8, 2], skip_blocks=1)
        _wait(lambda: server.num_expected == 1)
        rng = np.random.default_rng(9)
        server.begin_stream(100, [5, 6, 9, 10], key="early")
        for k in range(SPEC.num_layers):  # the "forward pass": write layer k, then say so
            src.layers[k][[5, 6, 9, 10]] = rng.standard_normal(src.layers[k][[5, 6, 9, 10]].shape)
            server.stream_layer(k)
            time.sleep(0.05)  # the next layer's compute
        server.end_streams()
        r = _results(client, 1)["early"]
        assert r.ok, r.error
        assert (dst.block_checksums([7, 8, 2]) == src.block_checksums([6, 9, 10])).all()  # after the first block
        _wait(lambda: len(server.stream_log) == 1)
        log = list(server.stream_log)
        assert len(log) == 1 and log[0]["streamed"] and [k for k, _ in log[0]["sent_ns"]] == [0, 1, 2]
        assert all(t < log[0]["ended_ns"] for _, t in log[0]["sent_ns"][:-1]), log  # left during the pass
        server.offer(100, [5, 6, 9, 10], key="early")
        _wait(lambda: "early" in server.take_done())
        assert server.streamed == 1
        # too late for its forward pass: served from the offer afterwards
        server.begin_stream(101, [1, 3], key="late")
        for k in range(SPEC.num_layers):
            server.stream_layer(k)
        server.end_streams()
        server.offer(101, [1, 3], key="late")
        # the pass is over only once the serve thread has taken its commands (a loaded host may
        # not have run it yet; an expectation read before that would still catch the pass)
        _wait(lambda: not server._cmds)
        client.load("late", url=server.url, xfer_id=101, src_block_ids=None, dst_block_ids=[11, 12])
        r = _results(client, 1)["late"]
        assert r.ok, r.error
        assert (dst.block_checksums([11, 12]) == src.block_checksums([1, 3])).all()
        _wait(lambda: len(server.stream_log) == 2)  # (the link thread logs it after the answer)
        assert server.streamed == 1 and len(server.stream_log) == 2 and not server.stream_log[-1]["streamed"]
    finally:
        client.close()
        server.close()


def test_a_link_thread_with_nothing_outstanding_waits_on_its_wake_event():
    import threading

    from qlink.ai import _vllm_link as vl

    wake = threading.Event()
    idle = vl._Idle(wake)
    t0 = time.monotonic()
    idle.pause(frames_due=False)
    assert time.monotonic() - t0 >= 0.5 * vl._QUIET_WAIT_S, "nothing outstanding: the long wait"
    t0 = time.monotonic()
    for _ in range(50):
        idle.pause(frames_due=True)
    assert time.monotonic() - t0 < 25 * vl._QUIET_WAIT_S, "frames due: short sleeps, never the long wait"
    t0 = time.monotonic()
    for _ in range(3):
        idle.pause(frames_due=False, work_held=True)
    assert time.monotonic() - t0 < 3 * vl._QUIET_WAIT_S, "work held: the engine's wake or the short wait"
    threading.Timer(0.01, wake.set).start()  # work handed over mid-wait: the wait ends, the event is taken
    idle.pause(frames_due=False)
    assert not wake.is_set()


def test_loads_after_a_quiet_spell_land_bit_exact(scheme):
    from qlink.ai._vllm_link import _QUIET_WAIT_S

    with _link_ends(scheme, seed=5) as (src, dst, server, client):
        for i, (s, d) in enumerate((([1, 2], [5, 6]), ([7], [9])), start=1):
            time.sleep(3 * _QUIET_WAIT_S)  # both threads in their quiet wait (the first time: no link open yet)
            server.offer(i, s, key=f"r{i}")
            client.load(f"r{i}", url=server.url, xfer_id=i, src_block_ids=s, dst_block_ids=d)
            res = _results(client, 1)
            assert res[f"r{i}"].ok, res[f"r{i}"].error
            assert (dst.block_checksums(d) == src.block_checksums(s)).all()
