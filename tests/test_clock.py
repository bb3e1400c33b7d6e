"""qlink.clock: the monotonic clock is shared across processes, the offset estimator
keeps the true offset inside its error bound."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from qlink import clock
from qlink.clock import OffsetEstimate, Stopwatch, estimate_offset

REPO = Path(__file__).resolve().parents[1]


def test_now_ns_is_monotonic_integer_ns():
    stamps = [clock.now_ns() for _ in range(10_000)]
    assert all(isinstance(s, int) for s in stamps[:10])
    assert all(b >= a for a, b in zip(stamps, stamps[1:]))
    t0 = clock.now_ns()
    time.sleep(0.01)
    assert clock.now_ns() - t0 >= 10_000_000


def test_now_ns_is_the_same_clock_in_another_process():
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = "from qlink.clock import now_ns; print(now_ns())"
    t0 = clock.now_ns()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    t1 = clock.now_ns()
    child = int(out.stdout.strip())
    assert t0 <= child <= t1  # stamped inside our window, on our timeline


def test_ptp_now_ns_is_wall_clock():
    a = time.time_ns()
    p = clock.ptp_now_ns()
    b = time.time_ns()
    assert a <= p <= b and 0 < p < 2**64


def test_stopwatch_real_clock():
    sw = Stopwatch()
    time.sleep(0.005)
    lap = sw.lap_ns()
    assert lap >= 5_000_000
    assert 0 <= sw.elapsed_ns() < lap + 1_000_000_000
    sw.restart()
    assert sw.elapsed_ns() >= 0 and "Stopwatch(start_ns=" in repr(sw)


# ------------------------------------------------------------ offset estimation


def _simulated_peer(true_offset_ns: int, rng: np.random.Generator):
    """A local clock and a ping over a path with random, asymmetric one-way delays."""
    sim = {"t": 1_000_000}

    def local_clock():
        sim["t"] += int(rng.integers(0, 5))  # reading the clock takes a few ns
        return sim["t"]

    def ping():
        sim["t"] += int(rng.exponential(2_000)) + 300  # request's one-way delay
        peer = sim["t"] + true_offset_ns
        sim["t"] += int(rng.exponential(8_000)) + 100  # reply's (slower, jittery) delay
        return peer

    return local_clock, ping


@pytest.mark.parametrize("seed", range(20))
def test_true_offset_within_bound_on_simulated_asymmetric_path(seed):
    rng = np.random.default_rng(seed)
    true_offset = int(rng.integers(-(10**12), 10**12))
    local_clock, ping = _simulated_peer(true_offset, rng)
    est = estimate_offset(ping, num_samples=int(rng.integers(1, 50)), clock=local_clock)
    assert isinstance(est, OffsetEstimate)
    assert abs(est.offset_ns - true_offset) <= est.error_bound_ns
    assert est.error_bound_ns >= 200  # half the smallest possible round trip (300 + 100)


def test_min_rtt_sample_is_selected():
    # RTTs 1000, 10, 500: the middle sample decides both numbers.
    local = iter([0, 1_000, 5_000, 5_010, 9_000, 9_500])
    peer = iter([777, 5_105, 123])
    est = estimate_offset(lambda: next(peer), num_samples=3, clock=lambda: next(local))
    assert est == OffsetEstimate(offset_ns=100, error_bound_ns=5)


def test_odd_rtt_rounds_bound_up():
    local = iter([0, 3])
    est = estimate_offset(lambda: 10, num_samples=1, clock=lambda: next(local))
    # peer stamp 10 was taken at local 0..3 -> true offset in [7, 10]
    assert est == OffsetEstimate(offset_ns=9, error_bound_ns=2)
    assert est.offset_ns - est.error_bound_ns <= 7 and 10 <= est.offset_ns + est.error_bound_ns


def test_in_process_peer_with_shifted_real_clock():
    shift = 3_600 * 10**9
    est = estimate_offset(lambda: clock.now_ns() + shift, num_samples=20)
    assert abs(est.offset_ns - shift) <= est.error_bound_ns
    assert est.error_bound_ns < 1_000_000_000


def test_numpy_integer_peer_stamps_are_accepted():
    local = iter([0, 2])
    est = estimate_offset(lambda: np.int64(50), num_samples=1, clock=lambda: next(local))
    assert est == (49, 1) and type(est.offset_ns) is int


def _echo_clock(conn) -> None:
    from qlink.clock import now_ns

    while conn.recv() is not None:
        conn.send(now_ns())
    conn.close()


@pytest.mark.timeout(120)
def test_peer_process_on_same_host_has_zero_offset_within_bound():
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_echo_clock, args=(theirs,), daemon=True)
    proc.start()
    try:
        def ping():
            ours.send(1)
            if not ours.poll(30):
                raise TimeoutError("clock peer did not answer within 30 s")
            return ours.recv()

        est = estimate_offset(ping, num_samples=50)
        assert abs(est.offset_ns) <= est.error_bound_ns  # one host, one clock
        assert 0 < est.error_bound_ns < 1_000_000_000
        ours.send(None)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        ours.close()


def test_estimate_offset_argument_errors():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_samples"):
            estimate_offset(lambda: 0, num_samples=bad)
    with pytest.raises(TypeError, match="integer ns"):
        estimate_offset(lambda: 1.5, num_samples=1)
    with pytest.raises(TypeError, match="integer ns"):
        estimate_offset(lambda: None, num_samples=1)
    backwards = iter([10, 5])
    with pytest.raises(ValueError, match="backwards"):
        estimate_offset(lambda: 0, num_samples=1, clock=lambda: next(backwards))
