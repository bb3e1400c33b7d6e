"""Serving a CUDA-Q ``multi_decoder_config`` with qlink's decoders (re-exported by
:mod:`qlink.qec.cudaq_config`).

Each entry's ``type`` maps onto a qlink decoder compiled for the entry's own
detector error model (rebuilt from ``H_sparse`` / ``O_sparse`` / ``error_rate_vec``,
or read from ``stim_dem_path``):

==================  ==========================================================
``pymatching``      ``"pymatching"`` (PyMatching over the same graph and weights;
                    without ``error_rate_vec`` every edge weighs 1, as in CUDA-Q)
``single_error_lut`` ``"cudaq-single_error_lut"`` (CUDA-Q QEC's own table)
``multi_error_lut`` ``"cudaq-multi_error_lut"`` (``lut_error_depth``)
``sliding_window``  :class:`~qlink.qec.decoders.SlidingWindowDecoder` (matching;
                    ``window_size``, ``step_size`` and ``num_syndromes_per_round``
                    in rounds of detectors)
``chromobius``      ``"chromobius"`` (needs ``stim_dem_path``: a DEM with the
                    4th detector coordinate)
``nv-qldpc-decoder`` ``"cudaq-nv-qldpc-decoder"`` (NVIDIA GPU only)
==================  ==========================================================

The compiled decoder is wrapped in a :class:`~qlink.qec.decoders.MeasurementDecoder`
with the entry's ``D_sparse``, so the service takes the raw measurement record
(``num_detectors`` = measurements per shot) and answers the observable flips,
as CUDA-Q's realtime ``get_corrections`` does. An identity ``D_sparse`` skips the
wrapper.

>>> import stim
>>> from qlink.qec.cudaq_config import multi_decoder_config_from_circuit
>>> c = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=2,
...                            after_clifford_depolarization=0.01)
>>> configs = decoder_configs_from_cudaq(multi_decoder_config_from_circuit(c, id=3))
>>> sorted(configs), configs[3].num_detectors == c.num_measurements
([3], True)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import scipy.sparse as sp

from ._cudaq_config_check import sparse_to_rows
from .decoders import CompiledDecoder

__all__ = ["decoder_configs_from_cudaq", "compile_cudaq_entry", "decoder_config_from_spec",
           "service_specs_from_cudaq"]

_QLINK_NAME = {"pymatching": "pymatching", "single_error_lut": "cudaq-single_error_lut",
               "multi_error_lut": "cudaq-multi_error_lut", "nv-qldpc-decoder": "cudaq-nv-qldpc-decoder",
               "chromobius": "chromobius", "sliding_window": None}
# an edge weight of 1 (CUDA-Q's matching without error_rate_vec) is the prior 1 / (1 + e)
_UNIT_WEIGHT_P = 1.0 / (1.0 + math.e)


def _csc(rows: list[list[int]], num_cols: int) -> sp.csc_matrix:
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(r) for r in rows])
    idx = np.fromiter((c for r in rows for c in r), dtype=np.int64, count=int(indptr[-1]))
    return sp.csr_matrix((np.ones(len(idx), np.uint8), idx, indptr), shape=(len(rows), num_cols)).tocsc()


def _entry_dem(entry: Mapping[str, Any], *, base_dir: Path | None):
    """The entry's DEM as a ``stim.DetectorErrorModel`` and its D_sparse rows."""
    import stim

    from ._cudaq_source import stim_dem_from_matrices
    from ._cudaq_config_check import CudaqConfigError

    where = f"decoders[id={entry['id']}]"
    d_rows = sparse_to_rows(entry["D_sparse"], field=f"{where}.D_sparse")
    if "stim_dem_path" in entry and "H_sparse" not in entry:
        path = Path(entry["stim_dem_path"])
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise CudaqConfigError(f"{where}.stim_dem_path", f"no such file: {path} (a relative path is read from "
                                                             "the config file's folder)")
        dem = stim.DetectorErrorModel.from_file(str(path))
        if len(d_rows) != dem.num_detectors:
            raise CudaqConfigError(f"{where}.D_sparse", f"has {len(d_rows)} rows; the DEM at {path} has "
                                                        f"{dem.num_detectors} detectors")
        return dem, d_rows
    block = entry["block_size"]
    h = _csc(sparse_to_rows(entry["H_sparse"]), block)
    o_rows = sparse_to_rows(entry["O_sparse"])
    o = _csc(o_rows, block)
    rates = entry.get("decoder_custom_args", {}).get("error_rate_vec")
    p = np.full(block, _UNIT_WEIGHT_P) if rates is None else np.asarray(rates, dtype=np.float64)
    return stim_dem_from_matrices(h, o, p), d_rows


class _WindowCompiled(CompiledDecoder):
    """A :class:`~qlink.qec.decoders.SlidingWindowDecoder` behind the compiled-decoder interface."""

    def __init__(self, window):
        self.window = window
        self.num_detectors, self.num_observables = window.num_detectors, window.num_observables

    def _decode_unpacked(self, dets: np.ndarray) -> np.ndarray:
        return self.window.decode_batch(dets)


def _sliding_window(dem, args: Mapping[str, Any], where: str):
    from ._cudaq_config_check import CudaqConfigError
    from .decoders import SlidingWindowDecoder

    inner = args.get("inner_decoder_name", "pymatching")
    if inner != "pymatching":
        raise CudaqConfigError(f"{where}.decoder_custom_args.inner_decoder_name",
                               f"qlink's sliding window matches (pymatching) inside each window, got {inner!r}")
    per_round = int(args.get("num_syndromes_per_round") or 0)
    if per_round < 1 or dem.num_detectors % per_round:
        raise CudaqConfigError(f"{where}.decoder_custom_args.num_syndromes_per_round",
                               f"must divide the {dem.num_detectors} detectors into rounds, got {per_round or None}")
    rounds = np.arange(dem.num_detectors) // per_round
    num_rounds = int(rounds[-1]) + 1
    window = int(args.get("window_size") or num_rounds)
    step = int(args.get("step_size") or 1)
    if not 1 <= step <= window:
        raise CudaqConfigError(f"{where}.decoder_custom_args.step_size",
                               f"need 1 <= step_size <= window_size, got step_size={step}, window_size={window}")
    return _WindowCompiled(SlidingWindowDecoder(dem, detector_rounds=rounds, window_rounds=window,
                                                commit_rounds=step))


def _cudaq_table_or_bp(entry: Mapping[str, Any], dem, args: Mapping[str, Any], dtype: str):
    """qlink's CUDA-Q decoder wrapper over exactly this entry: the entry's own check matrix (its
    columns in its order) and exactly its custom arguments, none of qlink's defaults added (an
    omitted ``lut_error_depth`` is CUDA-Q's default, as in CUDA-Q's realtime path)."""
    from .decoders import DecoderUnavailableError, DemMatrices, dem_to_matrices, get_decoder

    registered = get_decoder(_QLINK_NAME[dtype])
    reason = registered.unavailable_reason()
    if reason is not None:
        raise DecoderUnavailableError(reason)
    if "H_sparse" in entry:
        block = entry["block_size"]
        rates = args.get("error_rate_vec")
        mats = DemMatrices(check_matrix=_csc(sparse_to_rows(entry["H_sparse"]), block),
                           observables_matrix=_csc(sparse_to_rows(entry["O_sparse"]), block),
                           priors=np.full(block, _UNIT_WEIGHT_P) if rates is None else np.asarray(rates, float))
    else:
        mats = dem_to_matrices(dem)
    return registered.compile_for_matrices(mats, **dict(args))


def compile_cudaq_entry(entry: Mapping[str, Any], *, base_dir=None, measurement_level: bool = True):
    """A compiled decoder (``decode_shots_bit_packed``) for one ``decoders`` entry; with
    ``measurement_level`` (default) it takes the measurement record through ``D_sparse``."""
    from ._cudaq_config_check import CudaqConfigError
    from .decoders import MeasurementDecoder, get_decoder
    from .decoders import DecoderUnavailableError

    where = f"decoders[id={entry['id']}]"
    dtype = entry["type"]
    args = dict(entry.get("decoder_custom_args", {}))
    dem, d_rows = _entry_dem(entry, base_dir=None if base_dir is None else Path(base_dir))
    if dtype == "sliding_window":
        inner = _sliding_window(dem, args, where)
    elif dtype == "pymatching":
        inner = get_decoder("pymatching").compile_for_dem(dem)
    elif dtype == "chromobius":
        if "stim_dem_path" not in entry:
            raise CudaqConfigError(f"{where}.stim_dem_path", "chromobius needs the DEM with each detector's 4th "
                                                             "coordinate (basis and colour): give stim_dem_path")
        inner = get_decoder("chromobius").compile_for_dem(dem)
    else:
        try:
            inner = _cudaq_table_or_bp(entry, dem, args, dtype)
        except DecoderUnavailableError as exc:
            raise DecoderUnavailableError(f"{where}.type {dtype!r}: {exc}") from exc
    if not measurement_level:
        return inner
    nm = 1 + max((c for r in d_rows for c in r), default=-1)
    identity = nm == len(d_rows) and all(r == [i] for i, r in enumerate(d_rows))
    return inner if identity else MeasurementDecoder(inner, _csc(d_rows, nm).tocsr())


def decoder_configs_from_cudaq(source, *, capacity_shots: int = 1024, frames_per_shot: int | None = None,
                               measurement_level: bool = True, base_dir=None,
                               use_cudaq_schema: bool | None = None) -> dict:
    """``{decoder_id: qlink.qec.service.DecoderConfig}`` from a ``multi_decoder_config``
    (a path, YAML/JSON text or a mapping; validated first). Each decoder is compiled
    here (see the module docstring); a relative ``stim_dem_path`` is read from the
    file's folder (or ``base_dir``); ``use_cudaq_schema`` as in
    :func:`~qlink.qec.cudaq_config.validate_multi_decoder_config`."""
    from ._cudaq_config_io import config_file, load_multi_decoder_config
    from .service import DecoderConfig

    doc = load_multi_decoder_config(source, use_cudaq_schema=use_cudaq_schema)
    path = config_file(source)
    if base_dir is None and path is not None:
        base_dir = path.resolve().parent
    out = {}
    for entry in doc["decoders"]:
        compiled = compile_cudaq_entry(entry, base_dir=base_dir, measurement_level=measurement_level)
        out[int(entry["id"])] = DecoderConfig(decoder=compiled, num_detectors=compiled.num_detectors,
                                              num_observables=compiled.num_observables,
                                              capacity_shots=capacity_shots, frames_per_shot=frames_per_shot)
    return out


def service_specs_from_cudaq(source, *, capacity_shots: int = 1024, base_dir=None) -> dict:
    """Plain-data decoder specs for :func:`qlink.qec.start_service_process`:
    ``{decoder_id: {"multi_decoder_config": <that decoder's document>, ...}}``; the child
    compiles each with :func:`decoder_config_from_spec`."""
    from ._cudaq_config_io import config_file, load_multi_decoder_config

    doc = load_multi_decoder_config(source)
    path = config_file(source)
    if base_dir is None and path is not None:
        base_dir = path.resolve().parent
    return {int(e["id"]): {"multi_decoder_config": {"decoders": [e]}, "capacity_shots": int(capacity_shots),
                           "base_dir": None if base_dir is None else str(base_dir)}
            for e in doc["decoders"]}


def decoder_config_from_spec(spec: Mapping[str, Any]):
    """The :class:`~qlink.qec.service.DecoderConfig` of one spec made by :func:`service_specs_from_cudaq`."""
    allowed = {"multi_decoder_config", "capacity_shots", "frames_per_shot", "base_dir"}
    unknown = set(spec) - allowed
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} in a multi_decoder_config spec; allowed: {sorted(allowed)}")
    # the document was checked against CUDA-Q's schema where the spec was made (service_specs_from_cudaq):
    # qlink's own checks again here, without importing CUDA-Q into the service process (seconds on a busy host)
    configs = decoder_configs_from_cudaq(spec["multi_decoder_config"], capacity_shots=spec.get("capacity_shots", 1024),
                                         frames_per_shot=spec.get("frames_per_shot"), base_dir=spec.get("base_dir"),
                                         use_cudaq_schema=False)
    if len(configs) != 1:
        raise ValueError(f"a service spec holds one decoder, got {len(configs)}")
    return next(iter(configs.values()))
