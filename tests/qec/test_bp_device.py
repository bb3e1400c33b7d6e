"""``qlink-bp``'s ``decode_device``: shots decoded where they lie (NumPy here, CuPy on a GPU),
with the same predictions as ``decode_batch``."""

from __future__ import annotations

import numpy as np
import pytest

stim = pytest.importorskip("stim")

from qlink.qec.decoders import compile_decoder  # noqa: E402

_CIRCUIT = stim.Circuit.generated("surface_code:rotated_memory_z", distance=3, rounds=3,
                                  after_clifford_depolarization=0.01)


def _shots(n: int = 400):
    dets, _ = _CIRCUIT.compile_detector_sampler(seed=11).sample(n, separate_observables=True)
    return dets.astype(np.uint8)


def test_decode_device_on_numpy_matches_decode_batch():
    dem = _CIRCUIT.detector_error_model(decompose_errors=True)
    bp = compile_decoder("qlink-bp", dem, device="cpu")
    dets = _shots()
    want = bp.decode_batch(dets)
    got = bp.decode_device(dets)
    assert isinstance(got, np.ndarray) and got.dtype == np.uint8 and got.shape == want.shape
    assert (got == want).all() and want.any()
    assert (bp.decode_device(dets.astype(bool)) == want).all()


def test_decode_device_checks_the_shape():
    bp = compile_decoder("qlink-bp", _CIRCUIT.detector_error_model(decompose_errors=True), device="cpu")
    with pytest.raises(ValueError, match="num_shots"):
        bp.decode_device(np.zeros((2, bp.num_detectors + 1), dtype=np.uint8))
    with pytest.raises(ValueError, match="num_shots"):
        bp.decode_device(np.zeros(bp.num_detectors, dtype=np.uint8))


@pytest.mark.gpu
def test_decode_device_on_cupy_stays_on_the_gpu_and_matches_cpu():
    import cupy

    dem = _CIRCUIT.detector_error_model(decompose_errors=True)
    cpu = compile_decoder("qlink-bp", dem, device="cpu", dtype="float64")
    gpu = compile_decoder("qlink-bp", dem, device="gpu", dtype="float64")
    dets = _shots()
    got = gpu.decode_device(cupy.asarray(dets))
    assert isinstance(got, cupy.ndarray)
    assert (cupy.asnumpy(got) == cpu.decode_batch(dets)).all()
