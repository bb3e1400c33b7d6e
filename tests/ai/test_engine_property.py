"""Random block-id lists (Hypothesis) move bit for bit over shm: any sources (repeats
allowed), any distinct destinations, any contiguous range of layers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import transports  # noqa: E402
from qlink.ai import KVCache, KVReceiver, KVSender, preset  # noqa: E402
from qlink.ai.peer import transport_unavailable
from transports import loopback_url  # noqa: E402

pytestmark = pytest.mark.timeout(120)

RX_BLOCKS, TX_BLOCKS = 40, 56
NUM_LAYERS = preset("tiny").num_layers


@pytest.fixture(scope="module")
def shm_link():
    why = transport_unavailable("shm")
    if why:
        pytest.skip(why)
    with transports.listen(loopback_url("shm")) as lis:
        a = transports.connect(lis.url, timeout_s=5)
        b = lis.accept(timeout_s=5)
        with a, b:
            rx_cache = KVCache.allocate(preset("tiny", num_blocks=RX_BLOCKS))
            tx_cache = KVCache.allocate(preset("tiny", num_blocks=TX_BLOCKS))
            tx_cache.fill_random(seed=5)
            rx, tx = KVReceiver(b, rx_cache), KVSender(a, tx_cache)
            yield rx, tx, rx_cache, tx_cache, itertools.count(1)
            tx.close(), rx.close()


@st.composite
def requests(draw):
    n = draw(st.integers(1, RX_BLOCKS))
    src = draw(st.lists(st.integers(0, TX_BLOCKS - 1), min_size=n, max_size=n))
    dst = draw(st.lists(st.integers(0, RX_BLOCKS - 1), min_size=n, max_size=n, unique=True))
    lo = draw(st.integers(0, NUM_LAYERS - 1))
    hi = draw(st.integers(lo + 1, NUM_LAYERS))
    return src, dst, range(lo, hi)


@settings(max_examples=30, deadline=None)
@given(req=requests())
def test_random_block_lists_arrive_bit_exact_over_shm(shm_link, req):
    rx, tx, rx_cache, tx_cache, ids = shm_link
    src, dst, layers = req
    for a in rx_cache.layers:
        a[:, dst] = 0  # whatever an earlier example left there must be overwritten
    rid = next(ids)
    sub = tx.send_request(rid, src, dst, layers=layers, timeout_s=10)
    rec = rx.wait_request(rid, timeout_s=10)
    assert rec.num_layers == sub.num_layers == len(layers)
    assert rec.nbytes == 2 * len(src) * rx_cache.spec.block_nbytes * len(layers)
    got = rx_cache.block_checksums(dst, layers=layers)
    want = tx_cache.block_checksums(src, layers=layers)
    assert (got == want).all()
    untouched = [k for k in range(NUM_LAYERS) if k not in layers]
    for k in untouched:
        assert not rx_cache.layers[k][:, dst].any()
