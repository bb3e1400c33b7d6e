"""qlink sweep beside sinter collect on the same circuits: both count every shot, their
logical error rates agree, and the wall-time row names the chunk size qlink chose."""

from __future__ import annotations

import pytest

from qlink.bench.sinter_peer import compare_with_sinter
from qlink.qec.controller import wilson_interval
from qlink.sweep import QecGrid

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_same_grid_same_shots_and_rates_that_agree():
    grid = QecGrid(distances=(3,), ps=(0.01, 0.02), num_shots=40_000, chunk_shots=1)
    rows = compare_with_sinter(grid=grid, rounds=2, progress=lambda _: None)
    walls = {r["tool"]: r for r in rows if r["case"] == "wall time"}
    assert set(walls) == {"sinter collect", "qlink sweep"}
    assert walls["qlink sweep"]["seconds"] > 0 and walls["sinter collect"]["seconds"] > 0
    assert walls["qlink sweep"]["chunk_shots"] >= 100
    for w in walls.values():  # the best of two rounds, each round's time given
        rounds = [float(x) for x in w["rounds_s"].split(",")]
        assert len(rounds) == 2 and abs(min(rounds) - w["seconds"]) < 0.06
    lers = [r for r in rows if r["case"] == "logical error rate"]
    assert sorted(r["p"] for r in lers) == [0.01, 0.02]
    for r in lers:
        assert r["sinter_shots"] == r["qlink_shots"] == 2 * 40_000  # both rounds' shots pooled
        # independent samples of one rate: 99.9 % intervals overlap unless something differs
        a = wilson_interval(r["sinter_errors"], r["sinter_shots"], z=3.29)
        b = wilson_interval(r["qlink_errors"], r["qlink_shots"], z=3.29)
        assert a[0] <= b[1] and b[0] <= a[1], r
    assert lers[0]["qlink_errors"] < lers[1]["qlink_errors"]  # more noise, more logical errors


def test_wilson_interval_holds_the_rate_and_narrows_with_shots():
    lo, hi = wilson_interval(50, 1000)
    assert lo < 0.05 < hi
    lo2, hi2 = wilson_interval(500, 10_000)
    assert hi2 - lo2 < hi - lo
    assert wilson_interval(0, 100)[0] == 0.0 and wilson_interval(0, 0) == (0.0, 1.0)
