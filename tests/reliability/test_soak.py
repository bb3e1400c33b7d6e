"""Load and soak: a decoder slower than the cycle meets a bounded queue (BUSY, dropped and
reported, never unbounded memory); sustained traffic loses nothing, keeps memory flat and
leaks no descriptor, memfd, /dev/shm entry or rendezvous socket."""

from __future__ import annotations

import pytest

from qlink.reliability.soak import backpressure_run, resource_counts, rss_kib, run_soak

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_decoder_slower_than_the_cycle_meets_a_bounded_queue(transport):
    r = backpressure_run(transport=transport, capacity_shots=32, num_shots=1500, cycle_ns=2_000, decode_sleep_s=0.002)
    assert r["busy_answers"] > 0  # the controller is told: BUSY
    assert r["busy_answers"] == r["service_queue_full"] == r["reported_lost"]  # ... and each refused shot is reported
    assert r["max_decode_batch"] <= r["capacity_shots"]  # never more queued than the bound
    assert r["accounted_pct"] == 100.0 and r["decoded"] + r["reported_lost"] == r["shots"]
    # the backlog grows while the QPU emits: it ends above half of all emitted rounds, whatever it
    # was at the first sample (a loaded host can take that sample hundreds of rounds in)
    assert r["backlog_max_rounds"] > max(r["backlog_first_rounds"], r["emitted_rounds"] // 2)
    assert r["backlog_slope_rounds_per_s"] > 0
    assert r["rss_growth_kib"] < 64 * 1024


def _check(r: dict, *, max_growth_kib: int) -> None:
    q, k = r["qec"], r["kv"]
    assert q["service_error"] is None
    assert r["unaccounted_frames"] == 0 and r["correction_mismatches"] == 0
    assert q["frames_taken_by_service"] == q["shots_decoded_by_service"] == q["corrections_checked"] == q["frames"]
    assert q["endpoint_messages_reconciled"] and q["refused"] == 0 and q["windows_unanswered"] == 0
    assert r["unaccounted_kv"] == 0 and k["parts_reconciled"] and k["bytes_reconciled"]
    assert k["receiver"]["completed"] == k["transfers"] and k["receiver"]["bad_frames"] == 0
    assert r["leaks"] == {}, r["leaks"]
    for part in (q, k):
        for proc, g in part["rss"].items():
            assert g["rss_growth_kib"] < max_growth_kib, (proc, g)
            assert g["fds_max"] - g["fds_min"] <= 2, (proc, g)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_short_soak_loses_nothing_and_leaks_nothing(transport):
    r = run_soak(num_frames=20_000, num_kv_transfers=200, transport=transport, sample_every_s=0.2)
    _check(r, max_growth_kib=64 * 1024)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_soak(transport):
    """2x10^5 syndrome frames and 2x10^3 KV transfers; RSS sampled every half second after warm-up."""
    r = run_soak(num_frames=200_000, num_kv_transfers=2_000, transport=transport, sample_every_s=0.5)
    _check(r, max_growth_kib=16 * 1024)


def test_resource_counting_sees_what_it_counts():
    import numpy as np

    from qlink.memory import alloc

    before = resource_counts()
    a = alloc(4096, dtype=np.uint8)
    assert resource_counts()["memfds"] > before["memfds"]  # the memfd (and mmap's own duplicate of it)
    del a
    import gc

    gc.collect()
    assert resource_counts()["memfds"] == before["memfds"]
    assert rss_kib() > 0
