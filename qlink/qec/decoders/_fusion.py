"""``"fusion-blossom"``: Yue Wu's fusion-blossom MWPM solver (``fusion-blossom``), through sinter's wrapper.

sinter's ``fusion_blossom`` decoder builds the solver's graph from a graphlike DEM
(errors decomposed) and decodes bit-packed shots; this adapter gives it qlink's
interface (one-shot ``decode``, ``decode_batch``, width checks). Minimum-weight
matching, like PyMatching, so the two agree except on ties and weight rounding.

>>> import stim
>>> from qlink.qec.decoders import BUILT_IN_DECODERS
>>> dem = stim.DetectorErrorModel("error(0.1) D0 L0\\nerror(0.1) D0 D1\\nerror(0.1) D1")
>>> BUILT_IN_DECODERS["fusion-blossom"].compile_for_dem(dem).decode([1, 0]).tolist()
[1]
"""

from __future__ import annotations

import numpy as np

from ...errors import missing
from ._base import Decoder, PackedCompiledDecoder

__all__ = ["FusionBlossomDecoder", "CompiledFusionBlossomDecoder"]


def _sinter_fusion():
    try:
        import fusion_blossom  # noqa: F401
    except ImportError as exc:
        raise missing("fusion-blossom", extra="decoders", feature="the fusion-blossom decoder") from exc
    import sinter

    return sinter.BUILT_IN_DECODERS["fusion_blossom"]


class CompiledFusionBlossomDecoder(PackedCompiledDecoder):
    """sinter's compiled fusion-blossom decoder for ``dem``."""

    def __init__(self, dem):
        self.num_detectors, self.num_observables = dem.num_detectors, dem.num_observables
        self.decoder = _sinter_fusion().compile_decoder_for_dem(dem=dem)

    def _decode_packed(self, dets: np.ndarray) -> np.ndarray:
        return self.decoder.decode_shots_bit_packed(bit_packed_detection_event_data=dets)


class FusionBlossomDecoder(Decoder):
    """No options; the DEM must be graphlike (``decompose_errors=True``)."""

    name = "fusion-blossom"

    def unavailable_reason(self) -> str | None:
        try:
            _sinter_fusion()
        except ImportError:
            return "needs the 'fusion-blossom' package (pip install 'qlink[decoders]')"
        return None

    def compile_for_dem(self, dem) -> CompiledFusionBlossomDecoder:
        return CompiledFusionBlossomDecoder(dem)
