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
    """PyMatching's ``Matching`` built from a graphlike DEM; batch calls go straight to its core.

    One shot (a one-row ``decode_shots_bit_packed``, the service's call when shots arrive one
    at a time) goes to the matching graph's own call on the fired detectors' indices, taken
    from the row as one Python int (what ``Matching.decode`` does after converting its input;
    PyMatching's batch call costs more for one row); :meth:`decode_detectors_int` is that
    call for detectors already held as an int (:class:`~qlink.qec.decoders.MeasurementDecoder`
    makes them so). A one-shot answer is a read-only row, shared by the shots with that answer.
    """

    def __init__(self, dem, *, enable_correlations: bool = False):
        import pymatching

        self.num_detectors = dem.num_detectors
        self.num_observables = dem.num_observables
        self._correlations = bool(enable_correlations)
        kwargs = {"enable_correlations": True} if enable_correlations else {}
        self.matching = pymatching.Matching.from_detector_error_model(dem, **kwargs)
        # PyMatching sizes its output by the observables that appear in some error.
        self._num_fault_ids = self.matching.num_fault_ids
        self._graph_decode = self.matching._matching_graph.decode
        self._nbd = (self.num_detectors + 7) // 8
        self._answers: dict[bytes, np.ndarray] = {}  # one read-only packed row per distinct prediction

    def decode_detectors_int(self, detectors: int) -> np.ndarray:
        """One shot whose detection events are the bits of ``detectors`` (bit i: detector i)
        -> its ``(1, ceil(num_observables / 8))`` packed prediction (read-only, shared)."""
        fired = []
        while detectors:
            low = detectors & -detectors
            fired.append(low.bit_length() - 1)
            detectors ^= low
        pred = self._graph_decode(np.array(fired, dtype=np.uint64))[0]
        key = pred.tobytes()
        out = self._answers.get(key)
        if out is None:
            out = np.zeros((1, (self.num_observables + 7) // 8), np.uint8)
            packed = np.packbits(pred.astype(np.uint8), bitorder="little")
            out[0, :len(packed)] = packed
            out.flags.writeable = False
            if len(self._answers) < 4096:  # (few observables: every answer kept; many: the first ones)
                self._answers[key] = out
        return out

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
        if dets.shape[0] == 1 and not self._correlations and dets.dtype == np.uint8:
            return self.decode_detectors_int(int.from_bytes(dets.tobytes(), "little"))
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
