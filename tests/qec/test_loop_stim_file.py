"""A user's own ``.stim`` circuit in the closed loop: ``run_loop(source="memory.stim")``.

The corrections that come back over the wire must be bit-identical to PyMatching called
directly on the same shots, with the DEM stim makes from the same file; a bad file is
refused with a :class:`~qlink.qec.sources.CircuitError` naming it, before any service starts.
"""

from __future__ import annotations

import importlib
import pathlib

import numpy as np
import pytest
import stim

from qlink.checks import UsageError
from qlink.qec import CircuitError, build_source, circuit_spec, run_loop
from qlink.qec.loop import sample_stream
from qlink.qec.service import DecoderConfig

pytestmark = pytest.mark.timeout(240)


def _memory(tmp_path, name="memory.stim", *, code="surface_code:rotated_memory_x", distance=3, rounds=3,
            p=0.01) -> tuple[pathlib.Path, stim.Circuit]:
    circuit = stim.Circuit.generated(code, distance=distance, rounds=rounds, after_clifford_depolarization=p,
                                     before_measure_flip_probability=p, after_reset_flip_probability=p)
    path = tmp_path / name
    circuit.to_file(str(path))
    return path, circuit


def _direct(circuit: stim.Circuit, detectors: np.ndarray) -> np.ndarray:
    import pymatching

    m = pymatching.Matching.from_detector_error_model(circuit.detector_error_model(decompose_errors=True))
    return np.packbits(m.decode_batch(detectors), axis=1, bitorder="little")


def _engines():
    from qlink.qec.hotpath import available

    why = available()
    return ["python", pytest.param("native", marks=[pytest.mark.skip(reason=why)] if why else [])]


@pytest.mark.parametrize("engine", _engines())
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_stim_file_through_the_loop_is_bit_identical_to_a_direct_decoder_call(tmp_path, transport, engine):
    path, circuit = _memory(tmp_path)
    n = 400
    res = run_loop(transport=transport, source=str(path), num_shots=n, seed=7, warmup_shots=20, cycle_ns=2000,
                   engine=engine, timeout_s=120)
    assert res.engine == engine and res.transport.startswith(transport)
    assert res.shots_ok == n and res.shots_dropped == 0
    # the same shots, sampled from the same file with the same seed, decoded directly
    stream = sample_stream(build_source(path), num_shots=n, seed=7)
    assert stream.num_detectors == circuit.num_detectors
    want = _direct(circuit, stream.detectors)
    assert want.any(), "the sample should exercise non-trivial corrections"
    assert np.array_equal(res.controller.corrections, want)
    truth = np.packbits(stream.observables, axis=1, bitorder="little")
    assert res.logical_errors == int((want != truth).any(axis=1).sum())
    assert res.summary()["circuit"] == str(path.resolve())
    assert res.source["kind"] == "stim_file" and res.source["path"] == str(path.resolve())


def test_a_stim_circuit_object_and_a_circuit_without_coordinates(tmp_path):
    """A ``stim.Circuit`` goes in as it is; without detector coordinates the rounds come from TICK layers."""
    _, circuit = _memory(tmp_path, code="repetition_code:memory", distance=5, rounds=4, p=0.03)
    bare = stim.Circuit()
    for inst in circuit.flattened():
        if inst.name == "DETECTOR":
            bare.append("DETECTOR", inst.targets_copy())
        elif inst.name not in ("QUBIT_COORDS", "SHIFT_COORDS"):
            bare.append(inst)
    assert not any(bare.get_detector_coordinates().values())
    src = build_source(bare)
    num_rounds = int(src.round_of_detector[-1]) + 1
    assert src.source.rounds_from == "tick layers" and num_rounds >= 4  # (the data readout may share a layer)
    res = run_loop(transport="tcp", source=bare, num_shots=300, seed=3, warmup_shots=10, cycle_ns=2000,
                   engine="python", timeout_s=120)
    stream = sample_stream(src, num_shots=300, seed=3)
    want = _direct(bare, stream.detectors)
    assert want.any() and np.array_equal(res.controller.corrections, want)
    assert res.frames_per_shot == num_rounds  # a frame per round


def _detector_moved_to_the_end(circuit: stim.Circuit) -> stim.Circuit:
    """The same circuit with its first detector declared last (same measurements, same coordinates):
    detector 0 of round 0 now has the last index."""
    flat = circuit.flattened()
    out = stim.Circuit()
    moved = None
    seen = 0
    for inst in flat:
        if inst.name == "DETECTOR" and moved is None:
            moved = (seen, inst)  # the measurements counted so far
            continue
        out.append(inst)
        seen += inst.num_measurements
    first_seen, inst = moved
    total = out.num_measurements
    targets = [stim.target_rec(t.value + first_seen - total) for t in inst.targets_copy()]
    out.append("DETECTOR", targets, inst.gate_args_copy())
    return out


def test_a_detector_listed_after_a_later_round_waits_for_that_round(tmp_path):
    _, circuit = _memory(tmp_path, code="surface_code:rotated_memory_z", p=0.01)
    moved = _detector_moved_to_the_end(circuit)
    path = tmp_path / "moved.stim"
    moved.to_file(str(path))
    src = build_source(path)
    assert src.source.detector_rounds[-1] == 0 and src.rounds_held_back == 1
    assert np.all(np.diff(src.round_of_detector) >= 0)
    res = run_loop(transport="shm", source=path, num_shots=300, seed=9, warmup_shots=10, cycle_ns=2000,
                   timeout_s=120)
    stream = sample_stream(src, num_shots=300, seed=9)
    want = _direct(moved, stream.detectors)
    assert want.any() and np.array_equal(res.controller.corrections, want)


def test_a_circuit_spec_is_plain_data_a_service_rebuilds(tmp_path):
    path, circuit = _memory(tmp_path)
    spec = circuit_spec(path)
    assert spec == {"kind": "stim_file", "path": str(path.resolve()), "sha256": spec["sha256"]}
    cfg = DecoderConfig.from_spec({"source": spec, "decoder": "pymatching"})
    assert cfg.dem == circuit.detector_error_model(decompose_errors=True)
    # the file changed after the spec was made: the other side refuses it
    path.write_text(str(circuit) + "\nTICK\n")
    with pytest.raises(CircuitError, match="changed since its source spec was made"):
        DecoderConfig.from_spec({"source": spec, "decoder": "pymatching"})


_NO_OBSERVABLE = "R 0\nX_ERROR(0.1) 0\nM 0\nDETECTOR rec[-1]\n"
_NO_DETECTOR = "R 0\nX_ERROR(0.1) 0\nM 0\nOBSERVABLE_INCLUDE(0) rec[-1]\n"


@pytest.mark.parametrize("make, what", [
    (lambda d: d / "missing.stim", "no such file"),
    (lambda d: d, "is a folder"),
    (lambda d: _write(d / "empty.stim", ""), "has no DETECTOR"),
    (lambda d: _write(d / "nodet.stim", _NO_DETECTOR), "has no DETECTOR"),
    (lambda d: _write(d / "noobs.stim", _NO_OBSERVABLE), "has no OBSERVABLE_INCLUDE"),
    (lambda d: _write(d / "dem.stim", "error(0.1) D0 L0\nerror(0.1) D0 D1\n"), "is a detector error model"),
    (lambda d: _write(d / "garbage.stim", "H 0\nCNOT banana\n"), "not a valid stim circuit"),
    (lambda d: _write(d / "random.stim", "H 0\nM 0\nDETECTOR rec[-1]\nOBSERVABLE_INCLUDE(0) rec[-1]\n"),
     "non-deterministic"),
    (lambda d: _write(d / "binary.stim", b"\xff\xfe\x00\x81"), "not a UTF-8"),
])
def test_a_bad_stim_file_is_a_circuit_error_naming_it_before_any_service_starts(tmp_path, make, what):
    path = make(tmp_path)
    with pytest.raises(CircuitError, match=what) as e:
        run_loop(transport="shm", source=str(path), num_shots=10, timeout_s=30)
    assert str(path) in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(CircuitError, match=what):
        circuit_spec(path)


def _write(path: pathlib.Path, content) -> pathlib.Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def test_a_stream_of_another_circuit_is_refused_by_its_shape(tmp_path):
    path, _ = _memory(tmp_path)
    other = build_source(_memory(tmp_path, "other.stim", code="repetition_code:memory")[0])
    with pytest.raises(ValueError, match="stream shots have 8 detectors and 1 observables; the source's circuit "
                                         "has 24"):
        run_loop(transport="shm", source=path, stream=sample_stream(other, num_shots=10), num_shots=10)


def test_a_source_of_the_wrong_type_or_spec_keys_is_refused():
    with pytest.raises(TypeError, match="a .stim path or a stim.Circuit"):
        build_source(42)
    with pytest.raises(ValueError, match="missing \\['path'\\]"):
        build_source({"kind": "stim_file"})
    with pytest.raises(ValueError, match="unknown \\['distance'\\]"):
        build_source({"kind": "stim_file", "path": "x.stim", "distance": 3})


def _scenario(name):
    return importlib.import_module(f"qlink.scenarios.{name}")


def test_realtime_loop_scenario_runs_a_stim_file(tmp_path):
    path, _ = _memory(tmp_path)
    mod = _scenario("realtime_loop")
    rep = mod.run(transport="shm", out=tmp_path / "out", num_shots=300, stim=str(path), cycle_ns=2000,
                  progress=False)
    assert rep["config"]["circuit"] == str(path) and rep["config"]["distance"] is None
    stream = sample_stream(build_source(path), num_shots=300, seed=1)
    want = _direct(stim.Circuit.from_file(str(path)), stream.detectors)
    assert set(rep["results"]) == {"streaming", "feed_forward"}
    for name, res in rep["results"].items():
        assert np.array_equal(res.controller.corrections, want), name
    assert (tmp_path / "out" / "realtime_loop.json").exists()
    with pytest.raises(UsageError, match="distance: does not apply"):
        mod.run(stim=str(path), distance=5, out=None, progress=False)


def test_qec_memory_scenario_runs_a_stim_file(tmp_path):
    path, circuit = _memory(tmp_path, code="repetition_code:memory", distance=5, rounds=5, p=0.03)
    mod = _scenario("qec_memory")
    rows = mod.run(transport="shm", out=tmp_path, num_shots=400, stim=str(path), progress=False)
    assert [r["path"] for r in rows] == ["wire", "offline"]
    assert rows[0]["circuit"] == str(path) and rows[0]["matches_offline"]
    assert rows[0]["errors"] == rows[1]["errors"] > 0
    assert (tmp_path / mod.CSV_NAME).exists() and not (tmp_path / "threshold.png").exists()


@pytest.mark.parametrize("argv", [["scenarios/realtime_loop.py", "--stim"], ["scenarios/qec_memory.py", "--stim"],
                                  ["-m", "qlink.cli", "bench", "qec", "--stim"]])
def test_a_bad_stim_file_on_the_command_line_is_one_line_and_exit_2(tmp_path, argv):
    import subprocess
    import sys

    bad = _write(tmp_path / "noobs.stim", _NO_OBSERVABLE)
    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, *argv, str(bad), "--out", str(tmp_path / "o")], capture_output=True,
                         text=True, timeout=120, cwd=root)
    assert out.returncode == 2, out.stderr
    assert "has no OBSERVABLE_INCLUDE" in out.stderr and str(bad) in out.stderr
    assert "Traceback" not in out.stderr
