"""CUDA-Q's own realtime decoding and qlink's decoder service, configured from one
multi_decoder_config file, give the same corrections shot by shot on the same records."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cudaq_qec")

from qlink.qec.cudaq_config import compile_cudaq_entry, dump_multi_decoder_config, stim_measurement_matrices  # noqa: E402
from qlink.qec.cudaq_realtime import (config_for_layout, layout_stim_circuit, repetition_layout,  # noqa: E402
                                      run_cudaq_realtime, surface_layout)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout, p, decoder_type", [
    (repetition_layout(distance=5, rounds=5), 0.02, "pymatching"),
    (surface_layout(distance=3, rounds=3), 0.006, "pymatching"),
    (repetition_layout(distance=5, rounds=3), 0.02, "multi_error_lut"),
], ids=["repetition", "surface", "repetition-lut"])
def test_cudaq_realtime_and_qlink_service_agree_shot_by_shot(tmp_path, layout, p, decoder_type):
    from qlink.bench.cudaq_peer import serve_records

    path = tmp_path / "decoders.yaml"
    doc = config_for_layout(layout, p=p, decoder_type=decoder_type)
    dump_multi_decoder_config(doc, path)
    run = run_cudaq_realtime(layout, p=p, num_shots=300, config=path, seed=7)
    _, m2o = stim_measurement_matrices(layout_stim_circuit(layout, p=p))
    flips = ((m2o @ run.measurements.T.astype(np.int64)).T & 1).astype(np.uint8)
    assert flips.any(), "the noise must flip some shots, or agreement says nothing"
    assert run.corrections.any(), "CUDA-Q's decoder must correct some shots"
    # CUDA-Q's corrections lower the error rate (the decoder really ran on these records)
    assert (flips ^ run.corrections).sum() < flips.sum()
    # qlink's decoder compiled from the same file, offline
    offline = compile_cudaq_entry(doc["decoders"][0]).decode_batch(run.measurements)
    assert np.array_equal(offline, run.corrections)
    # and qlink's service, over shared memory and TCP, one frame per round
    for transport in ("shm", "tcp"):
        res, report = serve_records(path, run.measurements, flips, layout.measurement_rounds(), transport=transport)
        assert (res.correct >= 0).all()
        got = np.unpackbits(res.corrections, axis=1, count=1, bitorder="little")
        assert np.array_equal(got, run.corrections), transport
        assert report["counts"]["shots_decoded"] == 300


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compare_with_cudaq_reports_both_paths():
    from qlink.bench.cudaq_peer import compare_with_cudaq

    res = compare_with_cudaq(code="repetition", distance=3, rounds=2, p=0.02, num_shots=100, transports=("shm",))
    assert res["identical"] and res["transports"]["shm"]["identical"]
    assert res["transports"]["shm"]["unanswered"] == 0
    assert res["cudaq_launch_per_shot_us"] > 0 and res["transports"]["shm"]["reaction_p50_us"] > 0
    # CUDA-Q's own per-call log: one decode per shot of the timing launch
    assert res["cudaq_in_kernel"]["calls"] == 100


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_measurement_and_detector_level_service_give_the_same_corrections():
    from qlink.bench.dsparse import measurement_overhead

    res = measurement_overhead(distance=3, p=0.004, num_shots=300, batch_sizes=(1, 16), engines=("python",))
    assert res["identical_offline"] and res["service"]["python"]["identical"]
    assert res["num_measurements"] > res["num_detectors"]
    assert set(res["offline"]) == {"batch_1", "batch_16"}
