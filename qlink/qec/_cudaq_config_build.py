"""Writing a CUDA-Q ``multi_decoder_config`` from a qlink source (re-exported by
:mod:`qlink.qec.cudaq_config`).

A decoder entry carries the detector error model as matrices: ``H_sparse``
(detectors x error mechanisms) and ``O_sparse`` (observables x error mechanisms)
from :func:`~qlink.qec.decoders.dem_to_matrices`, the priors as
``decoder_custom_args.error_rate_vec`` where the type takes them, and ``D_sparse``
(detectors x measurements): the measurements whose XOR is each detector. From a
stim circuit, ``D_sparse`` is read off its ``DETECTOR`` instructions
(:func:`stim_measurement_matrices`), so the decoder takes the raw measurement
record, as CUDA-Q's realtime ``enqueue_syndromes`` sends it; from a bare DEM it is
the identity (one "measurement" per detector: detection events in, as qlink's
controller sends them).

>>> import stim
>>> c = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=2,
...                            after_clifford_depolarization=0.01)
>>> doc = multi_decoder_config_from_circuit(c)
>>> e = doc["decoders"][0]
>>> e["type"], e["syndrome_size"], max(e["D_sparse"]) + 1 == c.num_measurements
('pymatching', 6, True)
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
import scipy.sparse as sp

from .decoders import dem_to_matrices, xor_merge

__all__ = ["decoder_entry", "multi_decoder_config_from_dem", "multi_decoder_config_from_circuit",
           "multi_decoder_config_from_source", "stim_measurement_matrices"]

# types whose matrices must be graphlike (one or two detectors per column): each ^-component its own column
_GRAPHLIKE = {"pymatching", "sliding_window"}
# types whose custom args take the priors
_TAKES_RATES = {"pymatching", "sliding_window", "nv-qldpc-decoder"}


def _rows_of(matrix) -> list[list[int]]:
    m = sp.csr_matrix(matrix)
    m.eliminate_zeros()
    m.sort_indices()
    return [m.indices[m.indptr[i]:m.indptr[i + 1]].tolist() for i in range(m.shape[0])]


def _sparse(matrix) -> list[int]:
    from ._cudaq_config_check import rows_to_sparse

    return rows_to_sparse(_rows_of(matrix))


def _graphlike_columns(h: sp.csc_matrix, o: sp.csc_matrix, p: np.ndarray):
    """Merge columns with the same detectors (parallel edges that differ in observables):
    CUDA-Q's matching refuses them. The most likely one's observables are kept; the
    probability is that of an odd number of them firing."""
    keys: dict[tuple, int] = {}
    keep, probs = [], []
    for j in range(h.shape[1]):
        key = tuple(h.indices[h.indptr[j]:h.indptr[j + 1]].tolist())
        k = keys.get(key)
        if k is None:
            keys[key] = len(keep)
            keep.append(j)
            probs.append(float(p[j]))
        else:
            if p[j] > p[keep[k]]:
                keep[k] = j
            probs[k] = float(xor_merge(probs[k], p[j]))
    idx = np.asarray(keep, dtype=np.int64)
    return h[:, idx], o[:, idx], np.asarray(probs)


def decoder_entry(dem, *, id: int = 0, type: str = "pymatching", measurement_to_detectors=None,
                  custom_args: Mapping[str, Any] | None = None) -> dict:
    """One ``decoders`` entry for ``dem`` (a ``stim.DetectorErrorModel``).

    ``measurement_to_detectors``: the detectors x measurements 0/1 matrix (``D_sparse``);
    None: the identity. ``custom_args`` are added to ``decoder_custom_args`` (which holds
    ``error_rate_vec`` for the types that take priors; ``sliding_window`` also gets
    ``inner_decoder_name: pymatching`` unless given).
    """
    mats = dem_to_matrices(dem, split_components=type in _GRAPHLIKE)
    h, o, p = mats.check_matrix.tocsc(), mats.observables_matrix.tocsc(), mats.priors
    if type in _GRAPHLIKE:
        h, o, p = _graphlike_columns(h, o, p)
    nd = dem.num_detectors
    d = sp.identity(nd, dtype=np.uint8, format="csr") if measurement_to_detectors is None \
        else sp.csr_matrix(measurement_to_detectors)
    if d.shape[0] != nd:
        raise ValueError(f"measurement_to_detectors has {d.shape[0]} rows; the DEM has {nd} detectors")
    args: dict[str, Any] = {}
    if type in _TAKES_RATES:
        args["error_rate_vec"] = [float(x) for x in np.clip(p, 1e-12, 0.5)]
    if type == "sliding_window":
        args["inner_decoder_name"] = "pymatching"
    args.update(dict(custom_args or {}))
    entry = {"id": int(id), "type": type, "block_size": int(h.shape[1]), "syndrome_size": int(nd),
             "H_sparse": _sparse(h), "O_sparse": _sparse(o), "D_sparse": _sparse(d)}
    if args:
        entry["decoder_custom_args"] = args
    return entry


def multi_decoder_config_from_dem(dem, *, id: int = 0, type: str = "pymatching", measurement_to_detectors=None,
                                  custom_args: Mapping[str, Any] | None = None) -> dict:
    """A one-decoder document for ``dem`` (see :func:`decoder_entry`), validated."""
    from ._cudaq_config_io import validate_multi_decoder_config

    doc = {"decoders": [decoder_entry(dem, id=id, type=type, measurement_to_detectors=measurement_to_detectors,
                                      custom_args=custom_args)]}
    validate_multi_decoder_config(doc, use_cudaq_schema=False)
    return doc


def stim_measurement_matrices(circuit) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """``(measurement_to_detectors, measurement_to_observables)`` of a stim circuit, as
    0/1 CSR matrices (detectors x measurements, observables x measurements).

    ``ValueError`` when a detector or observable is not a plain parity of measurements
    that is 0 without noise (its noiseless parity 1, or an observable including Pauli
    targets): ``D_sparse`` cannot say that.

    >>> import stim
    >>> c = stim.Circuit("M 0 1\\nDETECTOR rec[-1] rec[-2]\\nM 1\\nDETECTOR rec[-1] rec[-2]\\nOBSERVABLE_INCLUDE(0) rec[-1]")
    >>> d, o = stim_measurement_matrices(c)
    >>> d.toarray().tolist(), o.toarray().tolist()
    ([[1, 1, 0], [0, 1, 1]], [[0, 0, 1]])
    """
    import stim

    det_rows: list[list[int]] = []
    obs_rows: dict[int, set] = {}
    count = 0
    for inst in circuit.flattened():
        name = inst.name
        if name == "DETECTOR" or name == "OBSERVABLE_INCLUDE":
            recs = set()
            for t in inst.targets_copy():
                if not t.is_measurement_record_target:
                    raise ValueError(f"{name} {inst} includes a non-measurement target; D_sparse / O_sparse "
                                     "hold parities of measurements only")
                recs ^= {count + t.value}
            if name == "DETECTOR":
                det_rows.append(sorted(recs))
            else:
                obs_rows.setdefault(int(inst.gate_args_copy()[0]), set()).symmetric_difference_update(recs)
        elif stim.gate_data(name).produces_measurements:
            count += len(inst.target_groups())
    if count != circuit.num_measurements:  # pragma: no cover - a stim gate this walk does not know
        raise ValueError(f"counted {count} measurements, stim says {circuit.num_measurements}")
    d = _rows_to_csr(det_rows, count)
    o = _rows_to_csr([sorted(obs_rows.get(k, ())) for k in range(circuit.num_observables)], count)
    ref = np.asarray(circuit.reference_sample(), dtype=np.int64)
    if count:
        for what, m in (("detector", d), ("observable", o)):
            parity = (m @ ref) & 1
            bad = np.flatnonzero(parity)
            if bad.size:
                raise ValueError(f"{what} {int(bad[0])} has parity 1 without noise; D_sparse / O_sparse "
                                 "cannot express an inverted parity (flip the circuit's reference)")
    return d, o


def _rows_to_csr(rows: list[list[int]], num_cols: int) -> sp.csr_matrix:
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(r) for r in rows])
    indices = np.fromiter((c for r in rows for c in r), dtype=np.int64, count=int(indptr[-1]))
    return sp.csr_matrix((np.ones(len(indices), np.uint8), indices, indptr), shape=(len(rows), num_cols))


def multi_decoder_config_from_circuit(circuit, *, id: int = 0, type: str = "pymatching",
                                      measurement_level: bool = True,
                                      custom_args: Mapping[str, Any] | None = None) -> dict:
    """A one-decoder document for a stim circuit: its DEM (errors decomposed), and with
    ``measurement_level`` its ``DETECTOR`` definitions as ``D_sparse`` (else the identity)."""
    dem = circuit.detector_error_model(decompose_errors=True)
    m2d = stim_measurement_matrices(circuit)[0] if measurement_level else None
    return multi_decoder_config_from_dem(dem, id=id, type=type, measurement_to_detectors=m2d,
                                         custom_args=custom_args)


def multi_decoder_config_from_source(source, *, id: int = 0, type: str = "pymatching",
                                     measurement_level: bool = True,
                                     custom_args: Mapping[str, Any] | None = None) -> dict:
    """A one-decoder document for any qlink source: a ``stim.Circuit``, a ``.stim`` path,
    a source spec (:func:`qlink.qec.loop.source_spec`), a
    :class:`~qlink.qec.sources.StimSource`, or a :class:`~qlink.qec.sources.CudaqSource`
    (a user's kernel gives its measurement matrix; CUDA-Q QEC's surface code gives
    detection events, identity ``D_sparse``).

    >>> doc = multi_decoder_config_from_source({"kind": "stim", "distance": 3, "rounds": 3, "p": 0.001})
    >>> doc["decoders"][0]["syndrome_size"]
    24
    """
    import stim

    kw = dict(id=id, type=type, custom_args=custom_args)
    if isinstance(source, (str, os.PathLike)):
        source = stim.Circuit.from_file(str(source))
    if isinstance(source, stim.Circuit):
        return multi_decoder_config_from_circuit(source, measurement_level=measurement_level, **kw)
    if isinstance(source, Mapping):
        from .specs import build_source

        source = build_source(source).source
    inner = getattr(source, "source", None)  # a bound source (qlink.qec.loop.build_source)
    if inner is not None and hasattr(inner, "detector_error_model"):
        source = inner
    circuit = getattr(source, "circuit", None)
    if isinstance(circuit, stim.Circuit):
        return multi_decoder_config_from_circuit(circuit, measurement_level=measurement_level, **kw)
    if hasattr(source, "detector_error_model"):
        dem = source.detector_error_model(decompose_errors=True)
        m2d = getattr(source, "_m2d", None) if measurement_level else None
        return multi_decoder_config_from_dem(dem, measurement_to_detectors=m2d, **kw)
    raise TypeError(f"cannot build a multi_decoder_config from {source.__class__.__name__}; pass a stim.Circuit, "
                    "a .stim path, a source spec dict, a StimSource or a CudaqSource")
