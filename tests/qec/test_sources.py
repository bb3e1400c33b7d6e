"""Syndrome sources: shapes, seeds, noiseless circuits, round mapping, bad files, and
CUDA-Q vs stim logical error rates for the same code and noise."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import stim

from qlink.errors import MissingDependencyError, QlinkError
from qlink.qec.decoders import compile_decoder
from qlink.qec.sources import (
    CircuitError,
    CudaqSource,
    StimSource,
    rounds_from_tick_layers,
)

HAVE_CUDAQ = importlib.util.find_spec("cudaq") is not None and importlib.util.find_spec("cudaq_qec") is not None
needs_cudaq = pytest.mark.skipif(not HAVE_CUDAQ, reason="cuda-quantum-cu12 / cudaq-qec-cu12 not installed")


def _two_proportion_z(k1: int, n1: int, k2: int, n2: int) -> float:
    pooled = (k1 + k2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    return (k1 / n1 - k2 / n2) / se if se > 0 else 0.0


def _logical_errors(source, batch) -> int:
    pred = compile_decoder("pymatching", source.detector_error_model()).decode_batch(batch.detection_events)
    return int(np.count_nonzero(np.any(pred != batch.observable_flips, axis=1)))


def _without_single_qubit_depolarization(circuit: stim.Circuit) -> stim.Circuit:
    out = stim.Circuit()
    for op in circuit:
        if isinstance(op, stim.CircuitRepeatBlock):
            out.append(stim.CircuitRepeatBlock(op.repeat_count, _without_single_qubit_depolarization(op.body_copy())))
        elif op.name != "DEPOLARIZE1":
            out.append(op)
    return out


# -- stim ---------------------------------------------------------------------------------

@pytest.mark.parametrize("basis", ["Z", "X"])
@pytest.mark.parametrize("distance,rounds", [(3, 3), (5, 2)])
def test_stim_surface_code_shapes_and_rounds(distance, rounds, basis):
    src = StimSource.surface_code(distance=distance, rounds=rounds, p=0.001, basis=basis)
    half = (distance * distance - 1) // 2
    assert src.num_observables == 1
    assert src.rounds_from == "coordinates"
    assert src.num_rounds == rounds + 1
    assert src.detectors_per_round == [half] + [2 * half] * (rounds - 1) + [half]
    assert src.num_detectors == sum(src.detectors_per_round)
    assert src.rounds_are_ordered
    batch = src.sample(17, seed=3)
    assert batch.detection_events.shape == (17, src.num_detectors)
    assert batch.observable_flips.shape == (17, 1)
    assert batch.detection_events.dtype == np.bool_
    dem = src.detector_error_model()
    assert dem.num_detectors == src.num_detectors and dem.num_observables == 1
    # every detector appears in exactly one round, rounds reassemble the shot
    members = np.concatenate([src.round_detectors(r) for r in range(src.num_rounds)])
    assert sorted(members.tolist()) == list(range(src.num_detectors))
    rebuilt = np.zeros_like(batch.detection_events)
    for r, ev in src.iter_rounds(batch.detection_events):
        rebuilt[:, src.round_detectors(r)] = ev
    assert (rebuilt == batch.detection_events).all()


def test_stim_seed_determinism_and_bit_packing():
    src = StimSource.surface_code(distance=3, rounds=4, p=0.01)
    a, b, c = src.sample(300, seed=11), src.sample(300, seed=11), src.sample(300, seed=12)
    assert (a.detection_events == b.detection_events).all()
    assert (a.observable_flips == b.observable_flips).all()
    assert not (a.detection_events == c.detection_events).all()
    dets, obs = src.sample_bit_packed(300, seed=11)
    assert dets.shape == (300, (src.num_detectors + 7) // 8) and dets.dtype == np.uint8
    assert (np.unpackbits(dets, axis=1, count=src.num_detectors, bitorder="little") == a.detection_events).all()
    assert (np.unpackbits(obs, axis=1, count=1, bitorder="little") == a.observable_flips).all()
    assert (a.bit_packed_detection_events() == dets).all()


def test_noiseless_stim_source_has_no_detection_events():
    batch = StimSource.surface_code(distance=5, rounds=5, p=0.0).sample(200, seed=1)
    assert not batch.detection_events.any()
    assert not batch.observable_flips.any()


def test_detection_event_rate_grows_with_noise():
    rates = [StimSource.surface_code(distance=3, rounds=3, p=p).sample(4000, seed=2).detection_events.mean()
             for p in (0.001, 0.01)]
    assert 0 < rates[0] < rates[1] < 0.5


def test_user_circuit_and_file(tmp_path):
    circuit = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=4,
                                     before_round_data_depolarization=0.05)
    path = tmp_path / "rep.stim"
    path.write_text(str(circuit))
    src = StimSource.from_file(path)
    assert src.name == str(path)
    assert src.num_detectors == circuit.num_detectors
    assert src.detectors_per_round == [2, 2, 2, 2, 2]
    batch = src.sample(500, seed=5)
    assert batch.detection_events.any()


def test_malformed_stim_file_names_the_file(tmp_path):
    path = tmp_path / "broken.stim"
    path.write_text("H 0\nCNOT 0\nNOT_A_GATE 3\n")
    with pytest.raises(CircuitError) as info:
        StimSource.from_file(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, QlinkError) and isinstance(info.value, ValueError)


def test_non_deterministic_detector_is_a_circuit_error():
    with pytest.raises(CircuitError, match="detector error model"):
        StimSource(stim.Circuit("H 0\nM 0\nDETECTOR rec[-1]"))


def test_rounds_fallback_without_coordinates():
    text = "R 0 1 2\nTICK\nCX 0 1\nTICK\nMR 1\nDETECTOR rec[-1]\nTICK\nCX 0 1\nTICK\nMR 1\nDETECTOR rec[-1] rec[-2]\nM 0\n"
    src = StimSource(stim.Circuit(text))
    assert src.rounds_from == "tick layers"
    assert src.detector_rounds.tolist() == [0, 1]
    assert rounds_from_tick_layers(stim.Circuit("M 0\nDETECTOR rec[-1]")).tolist() == [0]
    given = StimSource(stim.Circuit(text), detector_rounds=[0, 0])
    assert given.rounds_from == "given" and given.num_rounds == 1
    with pytest.raises(ValueError, match="one entry per detector"):
        StimSource(stim.Circuit(text), detector_rounds=[0])
    with pytest.raises(IndexError, match="out of range"):
        src.round_detectors(2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="basis"):
        StimSource.surface_code(distance=3, rounds=3, basis="Y")
    with pytest.raises(ValueError, match="distance"):
        StimSource.surface_code(distance=1, rounds=3)
    with pytest.raises(TypeError, match="stim.Circuit"):
        StimSource("H 0")
    with pytest.raises(ValueError, match="num_shots"):
        StimSource.surface_code(distance=3, rounds=1).sample(-1)


# -- CUDA-Q -------------------------------------------------------------------------------

def test_cudaq_missing_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cudaq", None)  # makes `import cudaq` raise ImportError
    with pytest.raises(MissingDependencyError, match="cuda-quantum-cu12") as info:
        CudaqSource.surface_code(distance=3, rounds=3, p=0.001)
    assert "qlink[quantum]" in str(info.value)


@needs_cudaq
@pytest.mark.timeout(120)
@pytest.mark.parametrize("basis", ["Z", "X"])
def test_cudaq_surface_code_shapes_seed_and_noiseless(basis):
    src = CudaqSource.surface_code(distance=3, rounds=3, p=0.01, basis=basis)
    assert src.num_detectors == 16 and src.num_observables == 1
    assert src.detectors_per_round == [4, 4, 4, 4] and src.rounds_are_ordered
    a, b = src.sample(500, seed=9), src.sample(500, seed=9)
    assert a.detection_events.shape == (500, 16) and a.observable_flips.shape == (500, 1)
    assert (a.detection_events == b.detection_events).all() and (a.observable_flips == b.observable_flips).all()
    assert a.detection_events.any()
    dem = src.detector_error_model()
    assert isinstance(dem, stim.DetectorErrorModel) and dem.num_detectors == 16
    quiet = CudaqSource.surface_code(distance=3, rounds=3, p=0.0, basis=basis).sample(200, seed=1)
    assert not quiet.detection_events.any() and not quiet.observable_flips.any()


@needs_cudaq
@pytest.mark.timeout(120)
def test_cudaq_and_stim_logical_error_rates_agree():
    """Same code (rotated surface code, d=3, 3 rounds, Z memory) and the same noise:
    two-qubit depolarization p after every CNOT and nothing else (stim's generated
    circuit with its single-qubit DEPOLARIZE1 removed; CUDA-Q's Depolarization2(p) on
    every CNOT). The circuits still differ in CNOT order and ancilla layout, so the
    compared quantity is the per-shot logical error rate after PyMatching on each
    source's own DEM; a two-proportion z test must not reject equality (|z| < 4)."""
    d, p, n = 3, 0.01, 30000
    cq = CudaqSource.surface_code(distance=d, rounds=d, p=p)
    st = StimSource(_without_single_qubit_depolarization(
        StimSource.surface_code(distance=d, rounds=d, after_clifford_depolarization=p).circuit))
    k_cq = _logical_errors(cq, cq.sample(n, seed=21))
    k_st = _logical_errors(st, st.sample(n, seed=22))
    assert k_cq > 100 and k_st > 100  # errors do occur (LER ~ 0.019)
    z = _two_proportion_z(k_cq, n, k_st, n)
    assert abs(z) < 4, (k_cq, k_st, z)


@needs_cudaq
@pytest.mark.timeout(120)
def test_cudaq_kernel_source_matches_its_dem():
    from qlink.qec._cudaq_source import depolarizing_cnot_noise, repetition_code_kernel

    kernel = repetition_code_kernel()
    src = CudaqSource.from_kernel(kernel, 3, 4, noise_model=depolarizing_cnot_noise(0.02))
    assert src.num_detectors == 10 and src.num_observables == 1 and src.num_measurements == 13
    assert src.detectors_per_round == [2, 2, 2, 2, 2]
    n = 20000
    a = src.sample(n, seed=4)
    assert (a.detection_events == src.sample(n, seed=4).detection_events).all()
    # Per-detector firing rates agree with the DEM's (stim samples the DEM itself):
    # this fails if measurement order and the measurement->detector matrix disagree.
    dem = src.detector_error_model()
    ref = dem.compile_sampler(seed=1).sample(n)[0].mean(axis=0)
    got = a.detection_events.mean(axis=0)
    se = np.sqrt(ref * (1 - ref) * 2 / n)
    assert np.all(np.abs(got - ref) < 5 * se + 1e-3), (got, ref)
    # Decoding with the DEM corrects most logical flips.
    k = _logical_errors(src, a)
    assert k < 0.5 * a.observable_flips.sum()
    quiet = CudaqSource.from_kernel(kernel, 3, 4).sample(100, seed=1)
    assert not quiet.detection_events.any() and not quiet.observable_flips.any()
