"""``"pymatching"``: minimum-weight perfect matching (sparse blossom), the reference decoder.

>>> import stim
>>> from qlink.qec.decoders import BUILT_IN_DECODERS
>>> circuit = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=2,
...                                  before_round_data_depolarization=0.01)
>>> compiled = BUILT_IN_DECODERS["pymatching"].compile_for_dem(
...     circuit.detector_error_model(decompose_errors=True))
>>> compiled.decode([0, 0, 0, 0, 0, 0]).tolist()
[0]
"""

from __future__ import annotations

import numpy as np

from ._base import CompiledDecoder, Decoder

__all__ = ["MatchingDecoder", "CompiledMatchingDecoder"]


class CompiledMatchingDecoder(CompiledDecoder):
    """PyMatching's ``Matching`` built from a graphlike DEM; batch calls go straight to its core."""

    def __init__(self, dem, *, enable_correlations: bool = False):
        import pymatching

        self.num_detectors = dem.num_detectors
        self.num_observables = dem.num_observables
        self._correlations = bool(enable_correlations)
        kwargs = {"enable_correlations": True} if enable_correlations else {}
        self.matching = pymatching.Matching.from_detector_error_model(dem, **kwargs)
        # PyMatching sizes its output by the observables that appear in some error.
        self._num_fault_ids = self.matching.num_fault_ids

    def _pad(self, pred: np.ndarray, width: int) -> np.ndarray:
        if pred.shape[1] == width:
            return pred
        out = np.zeros((pred.shape[0], width), dtype=np.uint8)
        out[:, : pred.shape[1]] = pred
        return out

    def _decode_unpacked(self, dets: np.ndarray) -> np.ndarray:
        pred = self.matching.decode_batch(dets, enable_correlations=self._correlations)
        return self._pad(pred.astype(np.uint8, copy=False), self.num_observables)

    def decode_shots_bit_packed(self, bit_packed_detection_event_data) -> np.ndarray:
        dets = np.asarray(bit_packed_detection_event_data)
        if dets.ndim != 2:
            raise ValueError(f"expected a 2-D (num_shots, bytes) array, got shape {dets.shape}")
        self._check_width(dets.shape[1], bit_packed=True)
        pred = self.matching.decode_batch(
            dets.astype(np.uint8, copy=False),
            bit_packed_shots=True,
            bit_packed_predictions=True,
            enable_correlations=self._correlations,
        )
        return self._pad(pred, (self.num_observables + 7) // 8)


class MatchingDecoder(Decoder):
    """Options: ``enable_correlations`` (PyMatching's two-pass correlated matching)."""

    name = "pymatching"

    def compile_for_dem(self, dem, *, enable_correlations: bool = False) -> CompiledMatchingDecoder:
        return CompiledMatchingDecoder(dem, enable_correlations=enable_correlations)
