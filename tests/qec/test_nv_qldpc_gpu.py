"""CUDA-Q QEC's GPU decoder (``nv-qldpc-decoder``) served by qlink from a ``multi_decoder_config``:
the corrections through the service equal CUDA-Q's own decoder called directly on the same
shots, and decoding lowers the logical error rate. Runs only where an NVIDIA GPU and
cudaq-qec are present (``make gpu-check``); skipped elsewhere with the reason."""

from __future__ import annotations

import numpy as np
import pytest
import stim

from qlink.qec.decoders import BUILT_IN_DECODERS

pytestmark = pytest.mark.gpu


def _need_gpu_decoder():
    reason = BUILT_IN_DECODERS["cudaq-nv-qldpc-decoder"].unavailable_reason()
    if reason:
        pytest.skip(reason)


def _circuit(d=3, p=0.004):
    return stim.Circuit.generated("surface_code:rotated_memory_z", distance=d, rounds=d,
                                  after_clifford_depolarization=p, before_measure_flip_probability=p)


_ARGS = {"max_iterations": 50, "use_osd": True, "osd_order": 3, "osd_method": 1, "use_sparsity": True}


def _direct(dem, dets):
    """CUDA-Q's decoder called directly on the DEM's check matrix (``get_decoder`` itself, no qlink
    code between): the observable flips, ``O @ e mod 2``."""
    from qlink.qec.decoders import dem_to_matrices
    from qlink.qec.decoders._cudaq import _import_cudaq_qec

    m = dem_to_matrices(dem)
    dec = _import_cudaq_qec("the direct call").get_decoder("nv-qldpc-decoder", m.check_matrix.tocsr(),
                                                          error_rate_vec=m.priors.tolist(), **_ARGS)
    res = dec.decode_batch(dets.astype(np.float64))
    rows = res.result if hasattr(res, "result") else [r.result for r in res]
    errors = (np.asarray(rows, dtype=np.float64) > 0.5).astype(np.int64)
    return (np.asarray(m.observables_matrix.tocsr() @ errors.T).T & 1).astype(np.uint8)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["python", "native"])
def test_served_nv_qldpc_equals_its_direct_call_and_lowers_the_error_rate(engine, tmp_path):
    _need_gpu_decoder()
    if engine == "native":
        from qlink.qec.hotpath import available

        if available() is not None:
            pytest.skip(available())
    from qlink.bench.cudaq_peer import serve_records
    from qlink.qec.cudaq_config import dump_multi_decoder_config, multi_decoder_config_from_circuit

    c = _circuit()
    doc = multi_decoder_config_from_circuit(c, type="nv-qldpc-decoder", measurement_level=False, custom_args=_ARGS)
    path = tmp_path / "qldpc.yaml"
    dump_multi_decoder_config(doc, path)
    dets, obs = c.compile_detector_sampler(seed=11).sample(400, separate_observables=True)
    want = _direct(c.detector_error_model(decompose_errors=True), dets)
    res, report = serve_records(path, dets.astype(np.uint8), obs.astype(np.uint8),
                                np.zeros(dets.shape[1], np.int64), engine=engine)
    np.testing.assert_array_equal(np.asarray(res.corrections, np.uint8).reshape(want.shape), want)
    undecoded = int(np.count_nonzero(obs.any(axis=1)))
    decoded = int(np.count_nonzero((want != obs).any(axis=1)))
    assert undecoded > 10 and decoded < undecoded / 2, (decoded, undecoded)
