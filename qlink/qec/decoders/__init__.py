"""QEC decoders behind one interface, registered by name (sinter-style).

``BUILT_IN_DECODERS[name].compile_for_dem(dem, **options)`` returns a
:class:`CompiledDecoder` with ``decode`` (one shot), ``decode_batch`` (many,
optionally bit-packed in) and ``decode_shots_bit_packed`` (bit-packed in and
out, the hot path). Names:

- ``"pymatching"``: sparse-blossom matching, the reference.
- ``"cudaq-single_error_lut"``, ``"cudaq-multi_error_lut"``: CUDA-Q QEC lookup tables.
- ``"cudaq-nv-qldpc-decoder"``: CUDA-Q QEC GPU BP(+OSD); needs an NVIDIA GPU.
- ``"bposd"``: ldpc's BP+OSD.
- ``"qlink-bp"``: qlink's batched min-sum BP (NumPy, or CuPy on a GPU).

:class:`SlidingWindowDecoder` streams long experiments round by round.

>>> import stim
>>> from qlink.qec.decoders import BUILT_IN_DECODERS, compile_decoder
>>> sorted(BUILT_IN_DECODERS)[:3]
['bposd', 'cudaq-multi_error_lut', 'cudaq-nv-qldpc-decoder']
>>> circuit = stim.Circuit.generated("surface_code:rotated_memory_z", distance=3, rounds=3,
...                                  after_clifford_depolarization=0.001)
>>> dem = circuit.detector_error_model(decompose_errors=True)
>>> dets, obs = circuit.compile_detector_sampler(seed=7).sample(1000, separate_observables=True)
>>> pred = compile_decoder("pymatching", dem).decode_batch(dets)
>>> pred.shape, pred.dtype
((1000, 1), dtype('uint8'))
>>> bool((pred != obs).mean() < 0.01)
True
"""

from __future__ import annotations

import time

import numpy as np

from ._base import CompiledDecoder, Decoder, DecoderUnavailableError
from ._bp import BeliefPropagationDecoder
from ._bposd import BpOsdDecoder
from ._cudaq import CudaqDecoder
from ._dem import DemGraph, DemMatrices, dem_to_graph, dem_to_matrices
from ._matching import MatchingDecoder
from ._measurement import MeasurementDecoder
from .window import SlidingWindowDecoder, WindowStatistics

__all__ = [
    "BUILT_IN_DECODERS",
    "Decoder",
    "CompiledDecoder",
    "DecoderUnavailableError",
    "get_decoder",
    "compile_decoder",
    "offline_throughput",
    "dem_to_matrices",
    "dem_to_graph",
    "DemMatrices",
    "DemGraph",
    "SlidingWindowDecoder",
    "WindowStatistics",
    "MeasurementDecoder",
]

BUILT_IN_DECODERS: dict[str, Decoder] = {
    d.name: d
    for d in (
        MatchingDecoder(),
        CudaqDecoder("single_error_lut"),
        CudaqDecoder("multi_error_lut"),
        CudaqDecoder("nv-qldpc-decoder"),
        BpOsdDecoder(),
        BeliefPropagationDecoder(),
    )
}


def get_decoder(name: str) -> Decoder:
    """The registered decoder called ``name``; ``ValueError`` lists the known names otherwise.

    >>> get_decoder("nope")
    Traceback (most recent call last):
    ...
    ValueError: unknown decoder 'nope'; known decoders: bposd, cudaq-multi_error_lut, ...
    """
    try:
        return BUILT_IN_DECODERS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(BUILT_IN_DECODERS))
        raise ValueError(f"unknown decoder {name!r}; known decoders: {known}") from None


def compile_decoder(name: str, dem, **options) -> CompiledDecoder:
    """``get_decoder(name).compile_for_dem(dem, **options)``."""
    return get_decoder(name).compile_for_dem(dem, **options)


def offline_throughput(compiled: CompiledDecoder, shots_bit_packed, *, repeat: int = 1) -> float:
    """Shots per second of ``compiled.decode_shots_bit_packed`` over ``shots_bit_packed``
    (``(num_shots, ceil(num_detectors / 8))`` uint8), best of ``repeat`` timed calls.

    >>> import numpy as np, stim
    >>> dem = stim.DetectorErrorModel("error(0.1) D0 L0\\nerror(0.1) D0 D1")
    >>> rate = offline_throughput(compile_decoder("pymatching", dem), np.zeros((100, 1), np.uint8))
    >>> rate > 0
    True
    """
    shots = np.ascontiguousarray(shots_bit_packed, dtype=np.uint8)
    if shots.ndim != 2 or shots.shape[0] == 0:
        raise ValueError(f"expected a non-empty (num_shots, bytes) array, got shape {shots.shape}")
    best = float("inf")
    for _ in range(max(1, int(repeat))):
        t0 = time.perf_counter_ns()
        compiled.decode_shots_bit_packed(shots)
        best = min(best, (time.perf_counter_ns() - t0) * 1e-9)
    return shots.shape[0] / max(best, 1e-12)
