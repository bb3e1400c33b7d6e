"""The directly-used peers of the transport benchmark run between two processes and
return one positive latency per round trip, with metadata saying how they were taken."""

import importlib.util

import numpy as np
import pytest

from qlink.bench import peers


@pytest.mark.timeout(60)
def test_socket_peer_returns_one_sample_per_round_trip():
    s = peers.socket_round_trip_ns(nbytes=64, num_round_trips=50, warmup=10)
    assert isinstance(s, peers.PeerSamples) and s.dtype == np.int64 and s.shape == (50,)
    assert (s > 0).all()
    assert s.meta["processes"] == 2 and s.meta["nbytes"] == 64


@pytest.mark.timeout(90)
@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="needs ucxx-cu12 (pip install 'qlink[ucx]')")
def test_ucxx_asyncio_peer_returns_one_sample_per_round_trip():
    s = peers.ucxx_asyncio_round_trip_ns(nbytes=64, num_round_trips=30, warmup=5)
    assert s.shape == (30,) and (s > 0).all()
    assert s.meta["processes"] == 2 and s.meta["api"].startswith("ucxx.create_listener")
    assert s.meta["ucx_tls"]


def test_bad_counts_are_rejected_before_spawning():
    with pytest.raises(ValueError, match="nbytes"):
        peers.socket_round_trip_ns(nbytes=0, num_round_trips=5, warmup=0)
    with pytest.raises(ValueError, match="num_round_trips"):
        peers.ucxx_asyncio_round_trip_ns(nbytes=8, num_round_trips=0, warmup=0)
