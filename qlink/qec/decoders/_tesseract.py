"""``"tesseract"``: Google's Tesseract search decoder (``tesseract-decoder``), the accuracy reference.

A* search over error sets with a beam; slower than matching by orders of magnitude,
and more accurate (it decodes hyperedges and correlations matching has to drop).
Options are ``tesseract_decoder.tesseract.TesseractConfig``'s (``det_beam``,
``beam_climbing``, ``pqlimit``, ...).

>>> import stim
>>> from qlink.qec.decoders import BUILT_IN_DECODERS
>>> dem = stim.DetectorErrorModel("error(0.1) D0 L0\\nerror(0.1) D0 D1\\nerror(0.1) D1")
>>> BUILT_IN_DECODERS["tesseract"].compile_for_dem(dem).decode([1, 0]).tolist()
[1]
"""

from __future__ import annotations

import numpy as np

from ...errors import missing
from ._base import CompiledDecoder, Decoder

__all__ = ["TesseractDecoder", "CompiledTesseractDecoder"]


def _import_tesseract():
    try:
        from tesseract_decoder import tesseract
    except ImportError as exc:
        raise missing("tesseract-decoder", extra="decoders", feature="the tesseract decoder") from exc
    return tesseract


class CompiledTesseractDecoder(CompiledDecoder):
    """``TesseractDecoder(TesseractConfig(dem, **options))``; batches go to its ``decode_batch``."""

    def __init__(self, dem, **options):
        tesseract = _import_tesseract()
        self.num_detectors, self.num_observables = dem.num_detectors, dem.num_observables
        self.decoder = tesseract.TesseractDecoder(tesseract.TesseractConfig(dem, **options))

    def _decode_unpacked(self, dets: np.ndarray) -> np.ndarray:
        if dets.shape[0] == 0:
            return np.zeros((0, self.num_observables), np.uint8)
        pred = np.asarray(self.decoder.decode_batch(dets.view(np.bool_)))
        return pred.reshape(dets.shape[0], self.num_observables).astype(np.uint8)


class TesseractDecoder(Decoder):
    """Options: ``TesseractConfig`` keywords (``det_beam=5`` by default)."""

    name = "tesseract"

    def unavailable_reason(self) -> str | None:
        try:
            _import_tesseract()
        except ImportError:
            return "needs the 'tesseract-decoder' package (pip install 'qlink[decoders]')"
        return None

    def compile_for_dem(self, dem, **options) -> CompiledTesseractDecoder:
        return CompiledTesseractDecoder(dem, **options)
