"""The base of every syndrome source (:class:`SyndromeSource`), its batch and its error;
documented and re-exported by :mod:`qlink.qec.sources`. A module of its own so a source
in another module (:mod:`qlink.qec._cudaq_source`) builds on it without importing the
sources that build on it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import QlinkError


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
