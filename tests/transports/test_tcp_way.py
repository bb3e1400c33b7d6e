"""Which way a large deferred tcp put goes (:mod:`transports._tcp_way`): measured between two
processes on this host unless ``QLINK_TCP_SPLICE`` forces it, inherited by the processes
started afterwards, and followed by every tcp endpoint; either way the bytes land bit-exact."""

from __future__ import annotations

import numpy as np
import pytest

from transports import _tcp_splice, _tcp_way, tcp

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not _tcp_splice.built(), reason="transports._tcpc is not built here")]


@pytest.fixture
def fresh(monkeypatch):
    """No way chosen yet in this process, none inherited, none forced."""
    monkeypatch.setattr(_tcp_way, "_chosen", None)
    monkeypatch.delenv(_tcp_way.FORCE_ENV, raising=False)
    monkeypatch.delenv(_tcp_way.MEASURED_ENV, raising=False)


def test_the_measurement_times_both_ways_between_two_processes_and_keeps_the_faster(fresh):
    w = _tcp_way.measure(listen=tcp.listen, nbytes=8 << 20, piece_nbytes=1 << 20, rounds=3)
    assert w.basis == "measured", w.reason
    assert w.splice_GBps > 0 and w.copy_GBps > 0
    assert w.kind == "copy" or w.splice_GBps > _tcp_way.SPLICE_MARGIN * w.copy_GBps  # splice only by a margin
    assert w.kind in w.describe() and "GB/s" in w.describe()


def test_the_first_choice_is_kept_and_left_to_the_processes_started_later(fresh, monkeypatch):
    import os

    calls = []

    def once(**kw):
        calls.append(kw)
        return _tcp_way.Way("copy", "measured", 1.5, 3.25)

    monkeypatch.setattr(_tcp_way, "measure", once)
    assert tcp.deferred_put_way() == tcp.deferred_put_way() == _tcp_way.Way("copy", "measured", 1.5, 3.25)
    assert len(calls) == 1
    assert os.environ[_tcp_way.MEASURED_ENV] == "copy 1.5 3.25"
    monkeypatch.setattr(_tcp_way, "_chosen", None)  # as a process started now finds it
    assert tcp.deferred_put_way() == _tcp_way.Way("copy", "inherited", 1.5, 3.25) and len(calls) == 1


@pytest.mark.parametrize("text", ["", "fast 1 2", "copy x 2", "splice 1"])
def test_an_inherited_way_that_does_not_parse_is_measured_again(text):
    assert _tcp_way.Way.from_env(text) is None


@pytest.mark.parametrize("forced, kind", [("1", "splice"), ("0", "copy")])
def test_qlink_tcp_splice_forces_the_way_and_every_endpoint_follows_it(fresh, monkeypatch, forced, kind):
    monkeypatch.setenv(_tcp_way.FORCE_ENV, forced)
    monkeypatch.setattr(_tcp_way, "measure", lambda **kw: pytest.fail("a forced way is not measured"))
    assert tcp.deferred_put_way() == _tcp_way.Way(kind, "forced", reason=f"QLINK_TCP_SPLICE={forced}")
    with tcp.listen("tcp://127.0.0.1:0") as lis:
        with tcp.connect(lis.url, timeout_s=5) as client, lis.accept(timeout_s=5) as server:
            assert client.defers_puts_in_place == client.defers_puts == (kind == "splice")
            src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
            target = np.zeros(src.size, np.uint8)
            region = server.register(target)
            client.put_many(src, region.descriptor(), [0], [0], [src.size], timeout_s=10, defer=True)
            server.wait_notification(timeout_s=10)
            client.flush(timeout_s=10)
            assert (target == src).all()
            assert client.statistics().extra["spliced_puts"] == (1 if kind == "splice" else 0)


def test_bad_measurement_sizes_are_refused():
    with pytest.raises(ValueError, match="multiple of piece_nbytes"):
        _tcp_way.measure(listen=tcp.listen, nbytes=3 << 20, piece_nbytes=2 << 20)
    with pytest.raises(ValueError, match="positive"):
        _tcp_way.measure(listen=tcp.listen, rounds=0)


def test_a_measurement_whose_reader_never_comes_gives_copies_and_says_why():
    class Elsewhere:  # a listener whose url sends the reading process where nobody listens
        def __init__(self, url):
            self._lis = tcp.listen(url)
            with tcp.listen("tcp://127.0.0.1:0") as gone:
                self.url = gone.url

        def accept(self, **kw):
            return self._lis.accept(**kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._lis.close()

    w = _tcp_way.measure(listen=Elsewhere, nbytes=1 << 20, piece_nbytes=1 << 20, rounds=1, timeout_s=2)
    assert (w.kind, w.basis, w.splice_GBps, w.copy_GBps) == ("copy", "failed", None, None)
    assert "measurement broke" in w.reason and "nobody listens" in w.reason  # the reader's own error with it
