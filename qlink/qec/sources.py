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
from dataclasses import dataclass

import numpy as np

from ..errors import QlinkError

__all__ = [
    "SyndromeBatch",
    "SyndromeSource",
    "StimSource",
    "CudaqSource",
    "CircuitError",
    "rounds_from_coordinates",
    "rounds_from_tick_layers",
]


# A circuit's detector error model is built whole; beyond this many detectors (16.7 M) it
# would take minutes and gigabytes. Long experiments stream through SlidingWindowDecoder.
MAX_DETECTORS = 1 << 24

class CircuitError(QlinkError, ValueError):
    """A circuit (or its ``.stim`` file) is malformed or has non-deterministic detectors."""


@dataclass(frozen=True)
class SyndromeBatch:
    """Shots from a source: bool arrays ``(num_shots, num_detectors)`` / ``(num_shots, num_observables)``."""

    detection_events: np.ndarray
    observable_flips: np.ndarray

    @property
    def num_shots(self) -> int:
        return self.detection_events.shape[0]

    def bit_packed_detection_events(self) -> np.ndarray:
        return np.packbits(self.detection_events, axis=1, bitorder="little")

    def bit_packed_observable_flips(self) -> np.ndarray:
        return np.packbits(self.observable_flips, axis=1, bitorder="little")


def _validate_rounds(rounds, num_detectors: int) -> np.ndarray:
    r = np.asarray(rounds, dtype=np.int64)
    if r.shape != (num_detectors,):
        raise ValueError(f"detector_rounds needs one entry per detector ({num_detectors}), got shape {r.shape}")
    if num_detectors and r.min() < 0:
        raise ValueError("detector_rounds must be non-negative")
    return r


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


class SyndromeSource:
    """Base: a sampler of detection events plus its round mapping and DEM.

    Subclasses set ``num_detectors``, ``num_observables``, ``detector_rounds`` and
    implement ``_sample(num_shots, seed) -> (dets, obs)`` (bool or 0/1 uint8) and
    ``_make_dem(decompose_errors)``.
    """

    num_detectors: int
    num_observables: int
    detector_rounds: np.ndarray

    def _set_rounds(self, rounds) -> None:
        self.detector_rounds = _validate_rounds(rounds, self.num_detectors)
        self.num_rounds = int(self.detector_rounds.max()) + 1 if self.num_detectors else 0
        order = np.argsort(self.detector_rounds, kind="stable")
        ptr = np.searchsorted(self.detector_rounds[order], np.arange(self.num_rounds + 1))
        self._round_members = [order[ptr[r]:ptr[r + 1]] for r in range(self.num_rounds)]
        self._dems: dict[bool, object] = {}

    @property
    def rounds_are_ordered(self) -> bool:
        """True when detector indices are non-decreasing in round (each round a contiguous slice)."""
        return bool(np.all(np.diff(self.detector_rounds) >= 0))

    def round_detectors(self, round_index: int) -> np.ndarray:
        """Indices of the detectors that belong to round ``round_index``."""
        if not 0 <= round_index < self.num_rounds:
            raise IndexError(f"round {round_index} out of range: this source has {self.num_rounds} rounds")
        return self._round_members[round_index]

    @property
    def detectors_per_round(self) -> list[int]:
        return [len(m) for m in self._round_members]

    def iter_rounds(self, detection_events):
        """Yield ``(round, events[:, round_detectors(round)])`` for a batch of shots, in round order."""
        ev = np.asarray(detection_events)
        for r in range(self.num_rounds):
            yield r, ev[..., self._round_members[r]]

    def detector_error_model(self, *, decompose_errors: bool = True):
        """The ``stim.DetectorErrorModel`` matching these detection events (cached)."""
        if decompose_errors not in self._dems:
            self._dems[decompose_errors] = self._make_dem(decompose_errors)
        return self._dems[decompose_errors]

    def sample(self, num_shots: int, *, seed: int | None = None) -> SyndromeBatch:
        """``num_shots`` shots; the same ``seed`` gives the same shots."""
        if int(num_shots) < 0:
            raise ValueError(f"num_shots must be >= 0, got {num_shots}")
        dets, obs = self._sample(int(num_shots), seed)
        return SyndromeBatch(np.asarray(dets, dtype=bool), np.asarray(obs, dtype=bool))

    def sample_bit_packed(self, num_shots: int, *, seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(detection events, observable flips)`` bit-packed: ``(num_shots, ceil(n / 8))`` uint8 each."""
        b = self.sample(num_shots, seed=seed)
        return b.bit_packed_detection_events(), b.bit_packed_observable_flips()

    def _sample(self, num_shots: int, seed):  # pragma: no cover - abstract
        raise NotImplementedError

    def _make_dem(self, decompose_errors: bool):  # pragma: no cover - abstract
        raise NotImplementedError


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
    # CudaqSource lives in its own module (which imports this one); importing it does
    # not import cudaq.
    if name == "CudaqSource":
        from ._cudaq_source import CudaqSource

        return CudaqSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
