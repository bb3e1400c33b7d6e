"""CUDA-Q syndrome source, sampled on CUDA-Q's ``stim`` target.

Two kinds, one class (:class:`CudaqSource`):

- ``CudaqSource.surface_code(distance=, rounds=, p=, basis=)``: CUDA-Q QEC's
  ``get_code("surface_code", distance=d)`` memory circuit. Shots come from
  ``z_sample_memory_circuit`` / ``x_sample_memory_circuit`` (detection events of
  the stabilizers of the memory basis: a first block from the initial round, one
  block per round-to-round transition, a final block from the data measurement;
  so ``rounds + 1`` detector rounds); observable flips are the data measurement
  parity on the code's logical operator. The DEM is ``z_dem_from_memory_circuit``
  / ``x_dem_from_memory_circuit``, converted to a ``stim.DetectorErrorModel``.
  ``p`` means two-qubit depolarization ``Depolarization2(p)`` after every CNOT
  (``noise_model=`` takes any ``cudaq.NoiseModel`` instead).
- ``CudaqSource.from_kernel(kernel, *args, noise_model=)``: a user's kernel. The
  expected shape (see :func:`repetition_code_kernel`): qubits allocated inside,
  syndrome measured with ``mz`` in a loop, detectors declared with
  ``cudaq.detectors(prev, cur)`` (detection event = XOR of consecutive syndrome
  measurements) or ``cudaq.detector(...)``, logical observables with
  ``cudaq.logical_observable(...)``, no branching on measurement results, no
  return value. The DEM comes from ``cudaq.dem_from_kernel``; each shot's
  measurement record (``cudaq.sample(..., explicit_measurements=True)``, in
  execution order) is turned into detection events and observable flips with
  the measurement->detector and measurement->observable matrices it returns.
  Rounds: ``detector_rounds=`` if given, else inferred from which earlier
  detector's measurement each detector compares against
  (:func:`rounds_from_measurement_dependencies`).

cudaq is imported only when a CudaqSource is built; without it the error says
what to install. Building or sampling selects the ``stim`` target
(``cudaq.set_target("stim")``), a process-wide CUDA-Q setting.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from ..errors import optional_import
from ._source_base import CircuitError, SyndromeSource

__all__ = ["CudaqSource", "repetition_code_kernel", "rounds_from_measurement_dependencies",
           "stim_dem_from_matrices"]


def _import_cudaq():
    return optional_import("cudaq", package="cuda-quantum-cu12", extra="quantum", feature="CudaqSource")


def _import_qec():
    return optional_import("cudaq_qec", package="cudaq-qec-cu12", extra="quantum", feature="CudaqSource.surface_code")


def _use_stim_target(cudaq) -> None:
    if cudaq.get_target().name != "stim":
        cudaq.set_target("stim")


def stim_dem_from_matrices(check_matrix, observables_matrix, error_rates):
    """A ``stim.DetectorErrorModel`` with one ``error(p)`` line per column.

    >>> dem = stim_dem_from_matrices(np.array([[1, 0], [1, 1]]), np.array([[0, 1]]), [0.1, 0.2])
    >>> dem.num_detectors, dem.num_observables, dem.num_errors
    (2, 1, 2)
    >>> [[str(t) for t in e.targets_copy()] for e in dem if e.type == "error"]
    [['D0', 'D1'], ['D1', 'L0']]
    """
    import stim

    h = sp.csc_matrix(np.asarray(check_matrix) if not sp.issparse(check_matrix) else check_matrix)
    o = sp.csc_matrix(np.asarray(observables_matrix) if not sp.issparse(observables_matrix) else observables_matrix)
    lines = []
    for j, p in enumerate(np.asarray(error_rates, dtype=np.float64)):
        if p <= 0:
            continue
        dets = h.indices[h.indptr[j]:h.indptr[j + 1]][h.data[h.indptr[j]:h.indptr[j + 1]] % 2 == 1]
        obs = o.indices[o.indptr[j]:o.indptr[j + 1]][o.data[o.indptr[j]:o.indptr[j + 1]] % 2 == 1]
        targets = [f"D{d}" for d in sorted(dets)] + [f"L{k}" for k in sorted(obs)]
        if targets:
            lines.append(f"error({float(p)!r}) " + " ".join(targets))
    nd, no = h.shape[0], o.shape[0]
    # Pin the sizes even when the last detectors / observables are never flipped.
    if nd:
        lines.append(f"detector D{nd - 1}")
    if no:
        lines.append(f"logical_observable L{no - 1}")
    return stim.DetectorErrorModel("\n".join(lines))


def rounds_from_measurement_dependencies(m2d) -> np.ndarray:
    """Rounds from a measurement->detector matrix (detectors x measurements).

    A detector's *earliest* measurement is its "previous syndrome": when that is
    the last measurement of an earlier detector ``i``, the detector is one round
    after ``i``. Rounds never decrease with the detector index. This fits kernels
    declaring ``cudaq.detectors(prev, cur)`` each round; pass ``detector_rounds=``
    for other layouts.

    >>> m2d = np.array([[1, 0, 1, 0, 0, 0], [0, 1, 0, 1, 0, 0], [0, 0, 1, 0, 1, 0], [0, 0, 0, 1, 0, 1]])
    >>> rounds_from_measurement_dependencies(m2d).tolist()
    [0, 0, 1, 1]
    """
    m = sp.csr_matrix(m2d)
    m.sort_indices()
    rounds = np.zeros(m.shape[0], dtype=np.int64)
    round_ending_on: dict[int, int] = {}
    current = 0
    for i in range(m.shape[0]):
        refs = m.indices[m.indptr[i]:m.indptr[i + 1]]
        if len(refs):
            prev = round_ending_on.get(int(refs[0]))
            if prev is not None:
                current = max(current, prev + 1)
        rounds[i] = current
        if len(refs):
            round_ending_on[int(refs[-1])] = current
    return rounds


def repetition_code_kernel():
    """An example kernel of the expected shape: a bit-flip repetition-code memory.

    Signature ``(distance: int, rounds: int)``: ``distance`` data qubits,
    ``distance - 1`` ancillas measuring neighbouring ZZ parities each round and
    reset, one detector per ancilla per round (XOR with the previous round), a
    final round of detectors from the data measurement, observable ``L0`` = data
    qubit 0. Build a source with ``CudaqSource.from_kernel(repetition_code_kernel(), 5, 10, noise_model=...)``.
    """
    cudaq = _import_cudaq()

    @cudaq.kernel
    def repetition_memory(distance: int, rounds: int):
        data = cudaq.qvector(distance)
        anc = cudaq.qvector(distance - 1)
        prev = mz(anc)  # noqa: F821 - CUDA-Q kernel builtins
        for _ in range(rounds):
            for i in range(distance - 1):
                x.ctrl(data[i], anc[i])  # noqa: F821
                x.ctrl(data[i + 1], anc[i])  # noqa: F821
            cur = mz(anc)  # noqa: F821
            cudaq.detectors(prev, cur)
            reset(anc)  # noqa: F821
            prev = cur
        final = mz(data)  # noqa: F821
        for i in range(distance - 1):
            cudaq.detector(prev[i], final[i], final[i + 1])
        cudaq.logical_observable(final[0])

    return repetition_memory


def depolarizing_cnot_noise(p: float):
    """A ``cudaq.NoiseModel`` with ``Depolarization2(p)`` after every CNOT (``x`` with one control)."""
    cudaq = _import_cudaq()
    noise = cudaq.NoiseModel()
    if p > 0:
        noise.add_all_qubit_channel("x", cudaq.Depolarization2(float(p)), 1)
    return noise


class CudaqSource(SyndromeSource):
    """Detection events from CUDA-Q (stim target). Build with :meth:`surface_code` or :meth:`from_kernel`."""

    def __init__(self, *, _kind: str, **state):
        self.kind = _kind
        self.__dict__.update(state)

    # -- CUDA-Q QEC surface code ----------------------------------------------
    @classmethod
    def surface_code(cls, *, distance: int, rounds: int, p: float = 0.0, basis: str = "Z",
                     noise_model=None) -> "CudaqSource":
        if basis not in ("Z", "X"):
            raise ValueError(f"basis must be 'Z' or 'X', got {basis!r}")
        if distance < 2 or rounds < 1:
            raise ValueError(f"need distance >= 2 and rounds >= 1, got distance={distance}, rounds={rounds}")
        cudaq = _import_cudaq()
        qec = _import_qec()
        _use_stim_target(cudaq)
        code = qec.get_code("surface_code", distance=distance)
        z = basis == "Z"
        noise = noise_model if noise_model is not None else depolarizing_cnot_noise(p)
        logical = np.asarray(code.get_observables_z() if z else code.get_observables_x(), dtype=np.uint8)
        n_stab = code.get_num_z_stabilizers() if z else code.get_num_x_stabilizers()
        src = cls(_kind="surface_code", _cudaq=cudaq, _qec=qec, _code=code, _noise=noise,
                  _op=qec.operation.prep0 if z else qec.operation.prepp,
                  _sample_fn=qec.z_sample_memory_circuit if z else qec.x_sample_memory_circuit,
                  _dem_fn=qec.z_dem_from_memory_circuit if z else qec.x_dem_from_memory_circuit,
                  _logical=logical, _n_stab=n_stab, distance=distance, rounds=rounds, p=p, basis=basis,
                  name=f"CUDA-Q QEC surface code d={distance} r={rounds} basis={basis}")
        src._dems = {}
        dem = src._make_dem(True)
        src.num_detectors, src.num_observables = dem.num_detectors, logical.shape[0]
        if src.num_detectors != (rounds + 1) * n_stab:
            raise CircuitError(f"{src.name}: expected {(rounds + 1) * n_stab} detectors "
                               f"({rounds + 1} rounds x {n_stab} stabilizers), CUDA-Q gave {src.num_detectors}")
        src._set_rounds(np.arange(src.num_detectors) // n_stab)
        src._dems[True] = dem
        return src

    # -- a user's kernel --------------------------------------------------------
    @classmethod
    def from_kernel(cls, kernel, *args, noise_model=None, detector_rounds=None,
                    name: str | None = None) -> "CudaqSource":
        cudaq = _import_cudaq()
        _use_stim_target(cudaq)
        src = cls(_kind="kernel", _cudaq=cudaq, _kernel=kernel, _args=args, _noise=noise_model,
                  name=name or f"CUDA-Q kernel {getattr(kernel, 'name', kernel)!s}")
        try:
            res = cudaq.dem_from_kernel(kernel, *args, noise_model=noise_model,
                                        decompose_errors=True, return_measurement_matrices=True)
        except RuntimeError as exc:
            raise CircuitError(f"{src.name}: CUDA-Q cannot build a detector error model "
                               f"(see the expected kernel shape in qlink.qec._cudaq_source): {exc}") from exc
        src._m2d = sp.csr_matrix(res.m2d_matrix, dtype=np.int32)
        src._m2o = sp.csr_matrix(res.m2o_matrix, dtype=np.int32)
        src.num_measurements = int(res.num_measurements)
        src.num_detectors, src.num_observables = int(res.num_detectors), int(res.num_observables)
        if src.num_detectors == 0:
            raise CircuitError(f"{src.name}: the kernel declares no detectors; declare them with "
                               "cudaq.detectors(prev, cur) / cudaq.detector(...)")
        import stim

        rounds = detector_rounds if detector_rounds is not None else rounds_from_measurement_dependencies(src._m2d)
        src._set_rounds(rounds)
        src._dems[True] = stim.DetectorErrorModel(res.dem)
        return src

    # -- sampling / DEM --------------------------------------------------------------
    def _sample(self, num_shots: int, seed):
        cudaq = self._cudaq
        _use_stim_target(cudaq)
        if num_shots == 0:
            return (np.zeros((0, self.num_detectors), bool), np.zeros((0, self.num_observables), bool))
        if seed is not None:
            cudaq.set_random_seed(int(seed))
        if self.kind == "surface_code":
            syn, data = self._sample_fn(self._code, self._op, num_shots, self.rounds, self._noise)
            dets = np.asarray(syn, dtype=np.uint8)
            obs = (np.asarray(data, dtype=np.int64) @ self._logical.T.astype(np.int64)) & 1
            return dets, obs
        res = cudaq.sample(self._kernel, *self._args, shots_count=num_shots,
                           noise_model=self._noise, explicit_measurements=True)
        seq = res.get_sequential_data()
        meas = np.frombuffer("".join(seq).encode("ascii"), dtype=np.uint8)
        if len(seq) != num_shots or meas.size != num_shots * self.num_measurements:
            raise CircuitError(f"{self.name}: expected {num_shots} shots of {self.num_measurements} "
                               f"measurements, CUDA-Q returned {len(seq)} shots, {meas.size} bits")
        meas = (meas.reshape(num_shots, self.num_measurements) - ord("0")).astype(np.int32)
        dets = np.asarray((self._m2d @ meas.T).T) & 1
        obs = np.asarray((self._m2o @ meas.T).T) & 1
        return dets, obs

    def _make_dem(self, decompose_errors: bool):
        if self.kind == "surface_code":
            try:
                d = self._dem_fn(self._code, self._op, self.rounds, self._noise,
                                 decompose_errors=decompose_errors)
            except RuntimeError as exc:
                if "no error mechanisms" not in str(exc):
                    raise
                # A noiseless circuit: no errors, the detectors and observables still exist.
                nd, no = (self.rounds + 1) * self._n_stab, self._logical.shape[0]
                return stim_dem_from_matrices(np.zeros((nd, 0)), np.zeros((no, 0)), [])
            return stim_dem_from_matrices(np.asarray(d.detector_error_matrix),
                                          np.asarray(d.observables_flips_matrix), d.error_rates)
        import stim

        res = self._cudaq.dem_from_kernel(self._kernel, *self._args, noise_model=self._noise,
                                          decompose_errors=decompose_errors,
                                          return_measurement_matrices=False)
        return stim.DetectorErrorModel(res.dem)
