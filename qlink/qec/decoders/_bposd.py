"""``"bposd"``: belief propagation with ordered-statistics post-processing (``ldpc.BpOsdDecoder``).

The check matrix and priors come from the DEM (:func:`~qlink.qec.decoders._dem.dem_to_matrices`);
observable flips are ``O @ e mod 2``. ldpc decodes one shot per call, so
``decode_batch`` skips the all-zero shots (the answer is "no flip") and calls
ldpc only for the rest.

>>> import stim
>>> from qlink.qec.decoders import BUILT_IN_DECODERS
>>> circuit = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=2,
...                                  before_round_data_depolarization=0.01)
>>> compiled = BUILT_IN_DECODERS["bposd"].compile_for_dem(circuit.detector_error_model())
>>> compiled.decode([0, 1, 0, 0, 0, 0]).tolist()
[1]
"""

from __future__ import annotations

import numpy as np

from ...errors import missing
from ._base import CompiledDecoder, Decoder
from ._dem import dem_to_matrices

__all__ = ["BpOsdDecoder", "CompiledBpOsdDecoder"]


class CompiledBpOsdDecoder(CompiledDecoder):
    def __init__(self, dem, *, max_iter: int, bp_method: str, ms_scaling_factor: float,
                 osd_method: str, osd_order: int):
        try:
            import ldpc
        except ImportError as exc:  # pragma: no cover - ldpc is a core dependency
            raise missing("ldpc", extra="all", feature="the bposd decoder") from exc
        m = dem_to_matrices(dem)
        self.num_detectors = m.num_detectors
        self.num_observables = m.num_observables
        self._obs = m.observables_matrix.tocsr().astype(np.int32)
        self._bposd = ldpc.BpOsdDecoder(
            m.check_matrix.tocsr(),
            error_channel=np.clip(m.priors, 1e-12, 0.5).tolist(),
            max_iter=max_iter,
            bp_method=bp_method,
            ms_scaling_factor=ms_scaling_factor,
            osd_method=osd_method,
            osd_order=osd_order,
        )

    def _decode_unpacked(self, dets: np.ndarray) -> np.ndarray:
        out = np.zeros((dets.shape[0], self.num_observables), dtype=np.uint8)
        if self.num_observables == 0:
            return out
        for i in np.flatnonzero(dets.any(axis=1)):
            e = self._bposd.decode(dets[i])
            out[i] = np.asarray(self._obs @ e.astype(np.int32)).ravel() & 1
        return out


class BpOsdDecoder(Decoder):
    """Options (ldpc's names): ``max_iter=30``, ``bp_method="minimum_sum"``,
    ``ms_scaling_factor=0.625``, ``osd_method="osd_cs"``, ``osd_order=7``."""

    name = "bposd"

    def compile_for_dem(self, dem, *, max_iter: int = 30, bp_method: str = "minimum_sum",
                        ms_scaling_factor: float = 0.625, osd_method: str = "osd_cs",
                        osd_order: int = 7) -> CompiledBpOsdDecoder:
        return CompiledBpOsdDecoder(dem, max_iter=max_iter, bp_method=bp_method,
                                    ms_scaling_factor=ms_scaling_factor,
                                    osd_method=osd_method, osd_order=osd_order)
