"""``"chromobius"``: the Möbius colour-code decoder (``chromobius``).

Chromobius needs every detector's 4th coordinate: ``basis * 3 + colour`` (basis 0 = X,
1 = Z; colour 0, 1, 2 = red, green, blue), as stim's generated colour-code circuits
annotate them; a DEM without it (a surface code, say) is refused with a ``ValueError``.
Shots go bit-packed straight into ``predict_obs_flips_from_dets_bit_packed``.

>>> import stim
>>> from qlink.qec.decoders import BUILT_IN_DECODERS
>>> c = steane_color_code_circuit(rounds=3, p=0.001)
>>> compiled = BUILT_IN_DECODERS["chromobius"].compile_for_dem(c.detector_error_model())
>>> compiled.decode([0] * compiled.num_detectors).tolist()
[0]
"""

from __future__ import annotations

import numpy as np

from ...errors import optional_import
from ._base import Decoder, PackedCompiledDecoder

__all__ = ["ChromobiusDecoder", "CompiledChromobiusDecoder", "steane_color_code_circuit"]

# the distance-3 triangular colour code (Steane): three plaquettes, red, green, blue
_PLAQUETTES = ((0, 1, 2, 3), (1, 2, 4, 5), (2, 3, 5, 6))
_DATA_XY = ((0, 0), (2, 0), (1, 1), (0, 2), (4, 0), (3, 1), (2, 2))


def steane_color_code_circuit(*, rounds: int, p: float):
    """A Z-basis memory of the distance-3 colour code, its detectors annotated for chromobius
    (``x, y, t, basis * 3 + colour``): each round measures the three X and three Z plaquette
    checks with one ancilla each; ``DEPOLARIZE1(p)`` on the data before each round,
    ``DEPOLARIZE2(p)`` after each CNOT and ``X_ERROR(p)`` before each measurement.

    >>> c = steane_color_code_circuit(rounds=2, p=0.001)
    >>> c.num_detectors, c.num_observables, sorted({int(v[3]) for v in c.get_detector_coordinates().values()})
    (12, 1, [0, 1, 2, 3, 4, 5])
    """
    import stim

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    nd = 7
    ax, az = [7, 8, 9], [10, 11, 12]
    c = stim.Circuit()
    for q, (x, y) in enumerate(_DATA_XY):
        c.append("QUBIT_COORDS", [q], [x, y])
    c.append("R", list(range(13)))
    centre = [tuple(sum(_DATA_XY[q][i] for q in pl) / 4 for i in range(2)) for pl in _PLAQUETTES]
    for r in range(rounds):
        if p > 0:
            c.append("DEPOLARIZE1", list(range(nd)), p)
        c.append("H", ax)
        for colour, pl in enumerate(_PLAQUETTES):
            for q in pl:
                for pair in ([ax[colour], q], [q, az[colour]]):
                    c.append("CX", pair)
                    if p > 0:
                        c.append("DEPOLARIZE2", pair, p)
        c.append("H", ax)
        if p > 0:
            c.append("X_ERROR", ax + az, p)
        c.append("MR", ax + az)
        for k in range(6):  # ancillas in the record: ax (X checks), then az (Z checks)
            basis, colour = (0, k) if k < 3 else (1, k - 3)
            if basis == 0 and r == 0:
                continue  # X checks are random in the first round of a Z memory
            recs = [stim.target_rec(-6 + k)] + ([stim.target_rec(-12 + k)] if r > 0 else [])
            c.append("DETECTOR", recs, [*centre[colour], r, basis * 3 + colour])
    if p > 0:
        c.append("X_ERROR", list(range(nd)), p)
    c.append("M", list(range(nd)))
    for colour, pl in enumerate(_PLAQUETTES):
        recs = [stim.target_rec(-nd + q) for q in pl] + [stim.target_rec(-nd - 3 + colour)]
        c.append("DETECTOR", recs, [*centre[colour], rounds, 3 + colour])
    c.append("OBSERVABLE_INCLUDE", [stim.target_rec(-nd + q) for q in range(nd)], 0)
    return c


def _import_chromobius():
    return optional_import("chromobius", package="chromobius", extra="decoders", feature="the chromobius decoder")


class CompiledChromobiusDecoder(PackedCompiledDecoder):
    """``chromobius.compile_decoder_for_dem(dem)``, fed bit-packed shots."""

    def __init__(self, dem):
        chromobius = _import_chromobius()
        coords = dem.get_detector_coordinates()
        short = [d for d in range(dem.num_detectors) if len(coords.get(d, ())) < 4]
        if short:
            raise ValueError(f"chromobius needs a 4th coordinate (basis * 3 + colour) on every detector; detector "
                             f"{short[0]} has {list(coords.get(short[0], []))}: use a colour-code circuit annotated "
                             "like stim's generated color_code circuits")
        self.num_detectors, self.num_observables = dem.num_detectors, dem.num_observables
        self.decoder = chromobius.compile_decoder_for_dem(dem)

    def _decode_packed(self, dets: np.ndarray) -> np.ndarray:
        return self.decoder.predict_obs_flips_from_dets_bit_packed(dets)


class ChromobiusDecoder(Decoder):
    """No options; the DEM must carry the 4th detector coordinate."""

    name = "chromobius"

    def unavailable_reason(self) -> str | None:
        try:
            _import_chromobius()
        except ImportError:
            return "needs the 'chromobius' package (pip install 'qlink[decoders]')"
        return None

    def compile_for_dem(self, dem) -> CompiledChromobiusDecoder:
        return CompiledChromobiusDecoder(dem)
