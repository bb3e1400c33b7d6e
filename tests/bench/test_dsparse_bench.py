"""The measurement-level (D_sparse) overhead bench: the same corrections on both paths, every figure present."""

from __future__ import annotations

import math

import pytest

from qlink.bench.dsparse import measurement_overhead, overhead_rows


@pytest.mark.timeout(300)
def test_measurement_and_detector_level_give_the_same_corrections_offline_and_through_both_engines():
    res = measurement_overhead(distance=3, p=0.004, num_shots=300, batch_sizes=(1, 16, None), repeats=1)
    assert res["identical_offline"] and res["identical"]
    assert res["num_measurements"] > res["num_detectors"]
    assert set(res["offline"]) == {"batch_1", "batch_16", "batch_300"}
    for engine, s in res["service"].items():
        if "note" in s:  # the native engine is not built here: said so, not silently dropped
            assert engine == "native" and s["note"].startswith("skipped")
            continue
        assert s["identical"], engine
        assert s["detectors_decode_per_shot_p50_us"] > 0 and s["measurements_decode_per_shot_p50_us"] > 0
    nm = res["native_map"]  # the service core's own map, alone: the very code a measurement-level shot runs
    if "note" not in nm:
        assert nm["identical"] and nm["ns_per_shot"] > 0 and nm["shots"] == 300
    rows = overhead_rows(res)
    assert len(rows) == 3 + len(res["service"]) + ("note" not in nm)
    for r in rows[:3]:
        assert r["ratio"] > 0 and math.isfinite(r["added_us"]) and r["mapping_us"] > 0
