"""CUDA-Q QEC decoders: ``"cudaq-single_error_lut"``, ``"cudaq-multi_error_lut"``,
``"cudaq-nv-qldpc-decoder"``.

``cudaq_qec.get_decoder(name, H, ...)`` consumes the DEM's check matrix ``H``
(detectors x error mechanisms, from :func:`~qlink.qec.decoders._dem.dem_to_matrices`)
and returns, per syndrome, a result with ``.converged`` and ``.result``: a soft
(0.0 / 1.0) guess of which error mechanisms fired. Observable flips are
``O @ e mod 2`` with ``O`` the DEM's observables matrix. A shot the decoder does
not converge on still gets the (possibly empty) correction it returned; the
count of such shots is kept in ``num_not_converged``.

``nv-qldpc-decoder`` runs only on an NVIDIA GPU; elsewhere compiling it raises
:class:`~qlink.qec.decoders.DecoderUnavailableError` (it is never emulated).
"""

from __future__ import annotations

import numpy as np

from ...errors import optional_import
from ._base import CompiledDecoder, Decoder, DecoderUnavailableError
from ._dem import dem_to_matrices

__all__ = ["CudaqDecoder", "CompiledCudaqDecoder"]


def _import_cudaq_qec(feature: str):
    """``cudaq_qec`` (its ``get_decoder``), or, where the full package does not load (a GPU
    host with the cudaq-qec wheel and a CUDA runtime but without CUDA-Q itself), the wheel's
    own decoders-only module: the same ``get_decoder``, the same decoder plugins."""
    try:
        import cudaq_qec

        return cudaq_qec
    except ImportError:
        pass
    try:
        import _qec_decoders_standalone

        return _qec_decoders_standalone.qecrt
    except ImportError:
        return optional_import("cudaq_qec", package="cudaq-qec-cu12", extra="quantum", feature=feature)


def _gpu_present() -> bool:
    try:
        import cudaq

        return cudaq.num_available_gpus() > 0
    except Exception:
        pass
    try:  # (a host with the decoders-only module and CuPy)
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


class CompiledCudaqDecoder(CompiledDecoder):
    """A ``cudaq_qec`` decoder over the DEM's check matrix; predictions via ``O @ e``."""

    def __init__(self, decoder, matrices, *, name: str):
        self._decoder = decoder
        self._obs = matrices.observables_matrix.tocsr().astype(np.int32)
        self.num_detectors = matrices.num_detectors
        self.num_observables = matrices.num_observables
        self.name = name
        self.num_not_converged = 0
        self._per_shot = False  # the decoder refused a batch call (nv-qldpc without use_sparsity)

    def _decode_unpacked(self, dets: np.ndarray) -> np.ndarray:
        if dets.shape[0] == 0:
            return np.zeros((0, self.num_observables), dtype=np.uint8)
        syndromes = dets.astype(np.float64)
        if not self._per_shot:
            try:
                res = self._decoder.decode_batch(syndromes)
            except RuntimeError as exc:  # nv-qldpc batches only with use_sparsity: then shot by shot
                if "use_sparsity" not in str(exc):
                    raise
                self._per_shot = True
        if self._per_shot:
            res = [self._decoder.decode(row) for row in syndromes]
            results, converged = [r.result for r in res], [r.converged for r in res]
        else:
            results, converged = res.result, res.converged
        errors = (np.asarray(results, dtype=np.float64) > 0.5).astype(np.int32)
        self.num_not_converged += int(np.count_nonzero(~np.asarray(converged, dtype=bool)))
        return (np.asarray(self._obs @ errors.T).T & 1).astype(np.uint8)


class CudaqDecoder(Decoder):
    """A CUDA-Q QEC decoder by its ``cudaq_qec`` name; options are passed to ``get_decoder``.

    ``multi_error_lut`` defaults to ``lut_error_depth=2`` (all pairs of errors), ``nv-qldpc-decoder``
    to ``use_sparsity=True`` (the GPU decoder's batch call needs it; a configuration that leaves
    it out is decoded shot by shot);
    every decoder gets ``error_rate_vec`` from the DEM priors unless given.
    """

    _DEFAULTS = {"multi_error_lut": {"lut_error_depth": 2}, "nv-qldpc-decoder": {"use_sparsity": True}}

    def __init__(self, cudaq_name: str):
        self.cudaq_name = cudaq_name
        self.name = f"cudaq-{cudaq_name}"
        self._needs_gpu = cudaq_name == "nv-qldpc-decoder"

    def unavailable_reason(self) -> str | None:
        try:
            _import_cudaq_qec(f"the {self.name} decoder")
        except ImportError:
            return "needs the 'cudaq-qec-cu12' package (pip install 'qlink[quantum]')"
        if self._needs_gpu and not _gpu_present():
            return f"{self.cudaq_name} needs an NVIDIA GPU and none is available here"
        return None

    def compile_for_dem(self, dem, **options) -> CompiledCudaqDecoder:
        matrices = dem_to_matrices(dem)
        kwargs = {**self._DEFAULTS.get(self.cudaq_name, {}), **options}
        kwargs.setdefault("error_rate_vec", matrices.priors.tolist())
        return self.compile_for_matrices(matrices, **kwargs)

    def compile_for_matrices(self, matrices, **cudaq_args) -> CompiledCudaqDecoder:
        """CUDA-Q's decoder over exactly ``matrices`` (a :class:`~qlink.qec.decoders.DemMatrices`)
        with exactly ``cudaq_args``: none of qlink's defaults added (a CUDA-Q config entry's way)."""
        qec = _import_cudaq_qec(f"the {self.name} decoder")
        if self._needs_gpu and not _gpu_present():
            raise DecoderUnavailableError(
                f"{self.name} runs only on an NVIDIA GPU and none is available here; "
                "use 'qlink-bp' or 'bposd' for a CPU belief-propagation decoder"
            )
        try:
            decoder = qec.get_decoder(self.cudaq_name, matrices.check_matrix.tocsr(), **cudaq_args)
        except RuntimeError as exc:
            if "GPU" in str(exc):
                raise DecoderUnavailableError(f"{self.name} cannot run here: {exc}") from exc
            raise
        return CompiledCudaqDecoder(decoder, matrices, name=self.name)
