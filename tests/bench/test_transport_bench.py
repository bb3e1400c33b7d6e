"""``qlink bench transport`` on tiny settings: every row present, ratios taken against the
floor and the memcpy measured in the same run, and the goal rows computed from them."""

import math

import pytest

from qlink.ai.peer import transport_unavailable
from qlink.bench.transport import put_bandwidth, round_trip_ns, transport_goals


@pytest.mark.timeout(120)
def test_round_trip_and_interleaved_put_bandwidth_between_two_processes():
    if transport_unavailable("shm"):
        pytest.skip("shm transport unavailable on this machine")
    rt = round_trip_ns("shm", nbytes=64, num_round_trips=200, warmup=20)
    assert rt.shape == (200,) and (rt > 0).all()
    rows = put_bandwidth("shm", sizes=(4096, 1 << 20), budget_bytes=8 << 20, repeats=2)
    assert [r["nbytes"] for r in rows] == [4096, 1 << 20]
    for r in rows:
        assert r["bandwidth_Bps"] > 0 and r["memcpy_Bps"] > 0
        assert r["puts_per_batch"] * r["nbytes"] * 2 <= 8 << 20 or r["puts_per_batch"] == 1
        assert math.isfinite(r["x_memcpy_median_of_rounds"]) and r["x_memcpy_median_of_rounds"] > 0


def test_goals_follow_the_measured_rows():
    rt = [{"case": "floor (shm spin)", "p50_us": 1.0, "p99_us": 1.2, "x_floor_p50": 1.0, "ucxx_asyncio_over_this": 200.0},
          {"case": "qlink shm", "p50_us": 1.6, "p99_us": 5.0, "x_floor_p50": 1.6, "ucxx_asyncio_over_this": 125.0}]
    bw = [{"case": "numpy memcpy", "nbytes": 4096, "x_memcpy": 1.0},
          {"case": "qlink shm put", "nbytes": 4096, "x_memcpy": 0.5},
          {"case": "qlink shm put", "nbytes": 1 << 20, "x_memcpy": 0.8}]
    got = {g["goal"]: g["met"] for g in transport_goals(rt, bw)}
    assert got == {"shm p50 <= 1.5 x floor p50": False, "shm p99 <= 4.0 us": False,
                   "UCXX asyncio p50 >= 50 x shm p50": True,
                   "shm put >= 0.7 x memcpy at 4096 B": False, "shm put >= 0.7 x memcpy at 1048576 B": True}
    # a figure that was not measured is neither met nor failed
    none = {g["goal"]: g["met"] for g in transport_goals([], [])}
    assert set(none.values()) == {None}
