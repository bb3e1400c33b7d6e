"""Syndrome sources: shots of detection events, the round of each detector, and the DEM.

Every source gives, for a number of shots:

- detection events ``(num_shots, num_detectors)`` and observable flips
  ``(num_shots, num_observables)`` (:meth:`SyndromeSource.sample`), or both
  bit-packed little-endian as stim and sinter use (:meth:`SyndromeSource.sample_bit_packed`);
- the detector -> round mapping (``detector_rounds``, ``round_detectors(r)``), so a
  controller can stream a shot round by round;
- a ``stim.DetectorErrorModel`` for the decoder (:meth:`SyndromeSource.detector_error_model`).

Sources: :class:`StimSource` (a generated rotated surface-code memory, or any
``stim.Circuit`` / ``.stim`` file) and :class:`CudaqSource` (CUDA-Q QEC's surface
code memory circuit, or a user's CUDA-Q kernel, sampled on CUDA-Q's ``stim`` target).

>>> src = StimSource.surface_code(distance=3, rounds=3, p=0.001)
>>> src.num_detectors, src.num_observables, src.num_rounds
(24, 1, 4)
>>> [len(src.round_detectors(r)) for r in range(src.num_rounds)]
[4, 8, 8, 4]
>>> batch = src.sample(5, seed=1)
>>> batch.detection_events.shape, batch.observable_flips.shape
((5, 24), (5, 1))
>>> dets, obs = src.sample_bit_packed(5, seed=1)
>>> dets.shape, bool((np.unpackbits(dets, axis=1, count=24, bitorder="little") == batch.detection_events).all())
((5, 3), True)
"""

from __future__ import annotations

import os

import numpy as np

from ._source_base import CircuitError, SyndromeBatch, SyndromeSource

__all__ = [
    "SyndromeBatch",
    "SyndromeSource",
    "StimSource",
    "CudaqSource",
    "CircuitError",
    "rounds_from_coordinates",
    "rounds_from_tick_layers",
]

for _cls in (CircuitError, SyndromeBatch, SyndromeSource):
    _cls.__module__ = __name__  # documented (and raised) as qlink.qec.sources.*


# A circuit's detector error model is built whole; beyond this many detectors (16.7 M) it
# would take minutes and gigabytes. Long experiments stream through SlidingWindowDecoder.
MAX_DETECTORS = 1 << 24

def rounds_from_coordinates(coords: dict[int, list[float]], num_detectors: int) -> np.ndarray | None:
    """Rounds from detector coordinates: the *last* coordinate is time (stim's
    ``(x, y, t)`` / ``(x, t)`` convention); distinct times, sorted, become rounds 0, 1, ...

    Returns ``None`` unless every detector has at least two coordinates (a lone
    coordinate could be space or time).

    >>> rounds_from_coordinates({0: [1, 0], 1: [3, 0], 2: [1, 1.5]}, 3).tolist()
    [0, 0, 1]
    >>> rounds_from_coordinates({0: [1, 0], 1: []}, 2) is None
    True
    """
    if num_detectors == 0:
        return np.zeros(0, dtype=np.int64)
    if any(len(coords.get(i, ())) < 2 for i in range(num_detectors)):
        return None
    t = np.array([coords[i][-1] for i in range(num_detectors)], dtype=np.float64)
    return np.unique(t, return_inverse=True)[1].astype(np.int64).reshape(-1)


def rounds_from_tick_layers(circuit) -> np.ndarray:
    """Fallback rounds for a circuit without detector coordinates: a detector's round
    is the TICK-delimited layer of the *last* measurement it references, layers
    renumbered 0, 1, ... in order (a circuit with no TICK is one round).

    >>> import stim
    >>> c = stim.Circuit("M 0 1\\nDETECTOR rec[-1]\\nDETECTOR rec[-2]\\nTICK\\nM 0\\nDETECTOR rec[-1] rec[-3]")
    >>> rounds_from_tick_layers(c).tolist()
    [0, 0, 1]
    """
    layer_of_meas: list[int] = []
    det_layer: list[int] = []
    tick = 0
    for op in circuit.flattened():
        if op.name == "TICK":
            tick += 1
        elif op.name == "DETECTOR":
            recs = [len(layer_of_meas) + t.value for t in op.targets_copy() if t.is_measurement_record_target]
            det_layer.append(max((layer_of_meas[m] for m in recs), default=tick))
        elif op.name not in ("OBSERVABLE_INCLUDE", "SHIFT_COORDS", "QUBIT_COORDS"):
            layer_of_meas.extend([tick] * op.num_measurements)
    if not det_layer:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.array(det_layer), return_inverse=True)[1].astype(np.int64).reshape(-1)


class StimSource(SyndromeSource):
    """Detection events from a ``stim.Circuit`` (any circuit with DETECTOR / OBSERVABLE_INCLUDE).

    Rounds come from the detectors' coordinates (last coordinate = time) when every
    detector has two or more; otherwise from TICK layers (:func:`rounds_from_tick_layers`);
    ``detector_rounds=`` overrides both.
    """

    def __init__(self, circuit, *, detector_rounds=None, name: str | None = None,
                 max_detectors: int = MAX_DETECTORS):
        import stim

        if not isinstance(circuit, stim.Circuit):
            raise TypeError(f"expected a stim.Circuit, got {type(circuit).__name__}; use StimSource.from_file for a path")
        self.circuit = circuit
        self.name = name or "stim circuit"
        if circuit.num_detectors > max_detectors:  # stim counts REPEAT blocks arithmetically: cheap
            raise CircuitError(f"{self.name}: {circuit.num_detectors} detectors is more than max_detectors="
                               f"{max_detectors}; split the experiment (SlidingWindowDecoder streams long ones) "
                               "or raise max_detectors")
        self.num_detectors = circuit.num_detectors
        self.num_observables = circuit.num_observables
        try:
            self._dems_probe = circuit.detector_error_model(decompose_errors=False)
        except ValueError as exc:
            raise CircuitError(f"{self.name}: stim cannot build a detector error model: {exc}") from exc
        if detector_rounds is None:
            detector_rounds = rounds_from_coordinates(circuit.get_detector_coordinates(), self.num_detectors)
            self.rounds_from = "coordinates"
            if detector_rounds is None:
                detector_rounds = rounds_from_tick_layers(circuit)
                self.rounds_from = "tick layers"
        else:
            self.rounds_from = "given"
        self._set_rounds(detector_rounds)
        self._dems[False] = self._dems_probe

    @classmethod
    def surface_code(cls, *, distance: int, rounds: int, p: float = 0.0, basis: str = "Z",
                     after_clifford_depolarization: float | None = None,
                     before_round_data_depolarization: float | None = None,
                     before_measure_flip_probability: float | None = None,
                     after_reset_flip_probability: float | None = None) -> "StimSource":
        """Stim's generated rotated surface-code memory in ``basis`` "Z" or "X".

        ``p`` sets all four noise knobs (stim's standard circuit noise); a knob given
        explicitly overrides ``p`` for that knob.
        """
        import stim

        if basis not in ("Z", "X"):
            raise ValueError(f"basis must be 'Z' or 'X', got {basis!r}")
        if distance < 2 or rounds < 1:
            raise ValueError(f"need distance >= 2 and rounds >= 1, got distance={distance}, rounds={rounds}")
        knobs = {
            "after_clifford_depolarization": after_clifford_depolarization,
            "before_round_data_depolarization": before_round_data_depolarization,
            "before_measure_flip_probability": before_measure_flip_probability,
            "after_reset_flip_probability": after_reset_flip_probability,
        }
        knobs = {k: (p if v is None else v) for k, v in knobs.items()}
        circuit = stim.Circuit.generated(f"surface_code:rotated_memory_{basis.lower()}",
                                         distance=distance, rounds=rounds, **knobs)
        src = cls(circuit, name=f"rotated surface code d={distance} r={rounds} p={p} basis={basis}")
        src.distance, src.rounds, src.basis = distance, rounds, basis
        return src

    @classmethod
    def from_file(cls, path, *, detector_rounds=None) -> "StimSource":
        """Load a ``.stim`` circuit file; a malformed file raises :class:`CircuitError` naming it."""
        import stim

        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as exc:
            raise CircuitError(f"{path}: not a UTF-8 text stim circuit ({exc.reason} at byte {exc.start})") from exc
        try:
            circuit = stim.Circuit(text)
        except ValueError as exc:
            raise CircuitError(f"{path}: not a valid stim circuit: {exc}") from exc
        return cls(circuit, detector_rounds=detector_rounds, name=path)

    def _sample(self, num_shots: int, seed):
        sampler = self.circuit.compile_detector_sampler(seed=seed)
        return sampler.sample(num_shots, separate_observables=True)

    def sample_bit_packed(self, num_shots: int, *, seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        sampler = self.circuit.compile_detector_sampler(seed=seed)
        return sampler.sample(int(num_shots), separate_observables=True, bit_packed=True)

    def _make_dem(self, decompose_errors: bool):
        try:
            return self.circuit.detector_error_model(decompose_errors=decompose_errors)
        except ValueError as exc:
            raise CircuitError(f"{self.name}: stim cannot decompose its errors into graphlike edges "
                               f"(use detector_error_model(decompose_errors=False) with a non-matching "
                               f"decoder): {exc}") from exc


def __getattr__(name: str):
    # CudaqSource lives in its own module; importing it does not import cudaq.
    if name == "CudaqSource":
        from ._cudaq_source import CudaqSource

        return CudaqSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
