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
- ``"tesseract"``: Tesseract search decoder, the accuracy reference (slow).
- ``"chromobius"``: Möbius colour-code decoder (needs the 4th detector coordinate).
- ``"fusion-blossom"``: fusion-blossom MWPM (through sinter's wrapper).

:class:`MeasurementDecoder` wraps any of them to take raw measurement records
(CUDA-Q realtime's ``D_sparse``). ``sinter_decoders()`` gives them all as sinter
``custom_decoders``.

:class:`SlidingWindowDecoder` streams long experiments round by round.

>>> import stim
>>> from qlink.qec.decoders import BUILT_IN_DECODERS, compile_decoder
>>> sorted(BUILT_IN_DECODERS)[:3]
['bposd', 'chromobius', 'cudaq-multi_error_lut']
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
from ._dem import DemGraph, DemMatrices, dem_to_graph, dem_to_matrices, xor_merge
from ._chromobius import ChromobiusDecoder, steane_color_code_circuit
from ._fusion import FusionBlossomDecoder
from ._matching import MatchingDecoder
from ._measurement import MeasurementDecoder
from ._tesseract import TesseractDecoder
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
    "xor_merge",
    "steane_color_code_circuit",
    "SlidingWindowDecoder",
    "WindowStatistics",
    "MeasurementDecoder",
    "sinter_decoders",
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
        TesseractDecoder(),
        ChromobiusDecoder(),
        FusionBlossomDecoder(),
    )
}


def sinter_decoders(*, available_only: bool = True) -> dict[str, Decoder]:
    """qlink's decoders as a ``sinter.collect(custom_decoders=...)`` mapping (each has sinter's
    ``compile_decoder_for_dem``), names prefixed ``qlink-`` where sinter has its own of that name.

    >>> "qlink-pymatching" in sinter_decoders() and "tesseract" in sinter_decoders(available_only=False)
    True
    """
    out = {}
    for name, dec in BUILT_IN_DECODERS.items():
        if available_only and dec.unavailable_reason() is not None:
            continue
        out[name if name.startswith("qlink-") or name not in {"pymatching"} else f"qlink-{name}"] = dec
    return out


def get_decoder(name: str) -> Decoder:
    """The registered decoder called ``name``; ``ValueError`` lists the known names otherwise.

    >>> get_decoder("nope")
    Traceback (most recent call last):
    ...
    ValueError: unknown decoder 'nope'; known decoders: bposd, chromobius, cudaq-multi_error_lut, ...
    """
    try:
        return BUILT_IN_DECODERS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(BUILT_IN_DECODERS))
        raise ValueError(f"unknown decoder {name!r}; known decoders: {known}") from None


def compile_decoder(decoder, dem, **options) -> CompiledDecoder:
    """A compiled decoder (with ``decode_shots_bit_packed``) for ``dem``.

    ``decoder`` is a name in :data:`BUILT_IN_DECODERS` (then sinter's built-in decoders),
    a decoder object (``compile_for_dem`` / sinter's ``compile_decoder_for_dem``), or a
    decoder already compiled (returned as it is). ``options`` go to ``compile_for_dem``.

    >>> import stim
    >>> dem = stim.DetectorErrorModel("error(0.1) D0 L0\\nerror(0.1) D0 D1")
    >>> compile_decoder("pymatching", dem).decode_shots_bit_packed(np.array([[1]], np.uint8)).tolist()
    [[1]]
    """
    if hasattr(decoder, "decode_shots_bit_packed"):
        return decoder
    obj = decoder
    if isinstance(decoder, str):
        obj = BUILT_IN_DECODERS.get(decoder)
        if obj is None:
            try:
                import sinter

                obj = sinter.BUILT_IN_DECODERS.get(decoder)
                known = set(BUILT_IN_DECODERS) | set(sinter.BUILT_IN_DECODERS)
            except ImportError:
                known = set(BUILT_IN_DECODERS)
            if obj is None:
                raise ValueError(f"unknown decoder {decoder!r}; known decoders: {', '.join(sorted(known))}")
    if dem is None:
        raise ValueError("compiling a decoder needs a detector error model (dem=)")
    if hasattr(obj, "compile_for_dem"):
        return obj.compile_for_dem(dem, **options)
    if hasattr(obj, "compile_decoder_for_dem"):
        return obj.compile_decoder_for_dem(dem=dem, **options)
    raise TypeError(f"decoder {decoder!r} is neither a decoder name, an object with compile_for_dem/"
                    "compile_decoder_for_dem, nor a compiled decoder with decode_shots_bit_packed")


def offline_throughput(compiled, shots_bit_packed, *, repeat: int = 1, chunk_shots: int | None = None) -> float:
    """Shots per second of ``compiled.decode_shots_bit_packed`` (or of ``compiled`` itself when
    it is a plain callable, e.g. a decoder's batch call) over ``shots_bit_packed``
    (``(num_shots, ceil(num_detectors / 8))`` uint8), in calls of ``chunk_shots`` shots
    (default: one call over all of them), best of ``repeat`` timed passes. The offline peer
    every decoder figure of the service is held against.

    >>> import numpy as np, stim
    >>> dem = stim.DetectorErrorModel("error(0.1) D0 L0\\nerror(0.1) D0 D1")
    >>> rate = offline_throughput(compile_decoder("pymatching", dem), np.zeros((100, 1), np.uint8))
    >>> rate > 0
    True
    """
    shots = np.ascontiguousarray(shots_bit_packed, dtype=np.uint8)
    if shots.ndim != 2 or shots.shape[0] == 0:
        raise ValueError(f"expected a non-empty (num_shots, bytes) array, got shape {shots.shape}")
    decode = getattr(compiled, "decode_shots_bit_packed", compiled)
    n = shots.shape[0]
    step = n if chunk_shots is None else int(chunk_shots)
    if step <= 0:
        raise ValueError(f"chunk_shots must be a positive number of shots, got {chunk_shots!r}")
    best = float("inf")
    for _ in range(max(1, int(repeat))):
        t0 = time.perf_counter_ns()
        if step >= n:
            decode(shots)
        else:
            for i in range(0, n, step):
                decode(shots[i:i + step])
        best = min(best, (time.perf_counter_ns() - t0) * 1e-9)
    return n / max(best, 1e-12)
