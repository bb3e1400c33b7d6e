"""Detector error model -> matrices: the one conversion every decoder shares.

Two views of a :class:`stim.DetectorErrorModel`:

- :func:`dem_to_matrices` gives the *check-matrix* view used by BP, BP+OSD and
  the CUDA-Q decoders: ``H`` (detectors x error mechanisms), ``O`` (observables
  x error mechanisms) and the prior probability of each mechanism. A decomposed
  error ``error(p) D0 D1 ^ D2 L0`` is one mechanism whose detectors and
  observables are the XOR (symmetric difference) of its components. Mechanisms
  with identical columns are merged into one, with the probability that an odd
  number of them fire: ``p = p1 (1 - p2) + p2 (1 - p1)``. Mechanisms that flip
  nothing, or only observables (undetectable by construction), are dropped.
- :func:`dem_to_graph` gives the *graphlike* view used by matching and the
  sliding-window decoder: every ``^``-separated component is an edge between
  at most two detectors (one detector: an edge to the boundary), with an
  observable bitmask, parallel edges merged the same way.

>>> import stim
>>> dem = stim.DetectorErrorModel('''
...     error(0.1) D0 D1 ^ D1 D2 L0
...     error(0.2) D0 D2 L0
...     error(0.05) D2
... ''')
>>> m = dem_to_matrices(dem)
>>> m.check_matrix.toarray()
array([[1, 0],
       [0, 0],
       [1, 1]], dtype=uint8)
>>> m.observables_matrix.toarray()
array([[1, 0]], dtype=uint8)
>>> [round(float(p), 2) for p in m.priors]
[0.26, 0.05]
>>> dem_to_matrices(dem, split_components=True).num_errors
4
>>> g = dem_to_graph(dem)
>>> g.num_edges, g.endpoints.tolist()
(4, [[0, 1], [0, 2], [1, 2], [2, -1]])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

__all__ = ["DemMatrices", "DemGraph", "dem_to_matrices", "dem_to_graph", "xor_merge"]

from ._dem_graph import DemGraph, dem_to_graph  # noqa: E402  (re-exported)


@dataclass(frozen=True)
class DemMatrices:
    """A DEM as matrices: ``H e = syndrome``, ``O e = observable flips`` (mod 2)."""

    check_matrix: sp.csc_matrix  # (num_detectors, num_errors) uint8
    observables_matrix: sp.csc_matrix  # (num_observables, num_errors) uint8
    priors: np.ndarray  # (num_errors,) float64

    @property
    def num_detectors(self) -> int:
        return self.check_matrix.shape[0]

    @property
    def num_observables(self) -> int:
        return self.observables_matrix.shape[0]

    @property
    def num_errors(self) -> int:
        return self.check_matrix.shape[1]


def xor_merge(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Probability that exactly one of two independent events with probabilities p, q fires."""
    return p * (1.0 - q) + q * (1.0 - p)


def _iter_errors(dem):
    """Yield (probability, [component: (detectors, observables)]) for each error."""
    for inst in dem.flattened():
        if inst.type != "error":
            continue
        p = inst.args_copy()[0]
        comps: list[tuple[list[int], list[int]]] = [([], [])]
        for t in inst.targets_copy():
            if t.is_separator():
                comps.append(([], []))
            elif t.is_relative_detector_id():
                comps[-1][0].append(t.val)
            elif t.is_logical_observable_id():
                comps[-1][1].append(t.val)
        yield p, comps


def _merge_keys(keys: list, probs: list[float]) -> tuple[list, np.ndarray]:
    merged: dict = {}
    for key, p in zip(keys, probs):
        merged[key] = p if key not in merged else float(xor_merge(merged[key], p))
    return list(merged), np.fromiter(merged.values(), dtype=np.float64, count=len(merged))


def _require_dem(dem) -> None:
    import stim

    if not isinstance(dem, stim.DetectorErrorModel):
        raise TypeError(f"expected a stim.DetectorErrorModel, got {type(dem).__name__}")


def dem_to_matrices(dem, *, split_components: bool = False) -> DemMatrices:
    """Check-matrix view of ``dem`` (duplicate columns merged).

    By default a decomposed error is one column, the XOR of its components.
    With ``split_components=True`` every ``^`` component is its own column (the
    DEM's suggested decomposition, as matching uses it): lighter columns, lower
    check degrees, correlations between components dropped.
    """
    _require_dem(dem)
    keys, probs = [], []
    for p, comps in _iter_errors(dem):
        if p <= 0.0:
            continue
        for group in ([[c] for c in comps] if split_components else [comps]):
            dets: set[int] = set()
            obs: set[int] = set()
            for d, o in group:
                dets.symmetric_difference_update(d)
                obs.symmetric_difference_update(o)
            if dets:
                keys.append((tuple(sorted(dets)), tuple(sorted(obs))))
                probs.append(p)
    keys, priors = _merge_keys(keys, probs)
    nd, no, ne = dem.num_detectors, dem.num_observables, len(keys)
    return DemMatrices(
        check_matrix=_columns_to_csc([k[0] for k in keys], nd, ne),
        observables_matrix=_columns_to_csc([k[1] for k in keys], no, ne),
        priors=priors,
    )


def _columns_to_csc(columns: list[tuple[int, ...]], num_rows: int, num_cols: int) -> sp.csc_matrix:
    indptr = np.zeros(num_cols + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(c) for c in columns])
    indices = np.fromiter((i for c in columns for i in c), dtype=np.int64, count=int(indptr[-1]))
    data = np.ones(len(indices), dtype=np.uint8)
    return sp.csc_matrix((data, indices, indptr), shape=(num_rows, num_cols))
