"""Graphlike view of a DEM, kept folded: loop bodies stored once, expanded by detector range.

Every ``^``-separated component of a DEM error is an edge between at most two
detectors (one detector: an edge to the boundary) with an observable bitmask.
Stim folds a long memory experiment into ``repeat N { ...; shift_detectors K }``;
:class:`DemEdgeIndex` keeps each top-level loop body's edges once and answers
"the edges whose first detector lies in ``[lo, hi)``" with array arithmetic, so a
sliding window over 10^6 rounds never materialises 10^6 rounds of edges.

Merging: identical edges (same detectors and observables) combine into one with
the probability that an odd number fire, ``(1 - prod(1 - 2 p)) / 2``; parallel
edges that flip different observables combine the same way, labelled by the
likelier one. All copies of an edge share its first detector, so merging inside
a detector range is exact.

>>> import stim
>>> dem = stim.DetectorErrorModel('''
...     error(0.1) D0 D1 ^ D1 D2 L0
...     repeat 3 {
...         error(0.2) D0 D1
...         shift_detectors 1
...     }
... ''')
>>> index = DemEdgeIndex(dem)
>>> a, b, mask, p = index.edges_in_range(0, 2)
>>> a.tolist(), b.tolist(), mask.tolist(), [round(float(x), 2) for x in p]
([0, 1], [1, 2], [0, 0], [0.26, 0.26])
>>> dem_to_graph(dem).endpoints.tolist()
[[0, 1], [1, 2], [2, 3]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DemGraph", "DemEdgeIndex", "dem_to_graph"]


@dataclass(frozen=True)
class DemGraph:
    """A graphlike DEM: one row per edge, ``endpoints[:, 1] == -1`` for boundary edges."""

    endpoints: np.ndarray  # (num_edges, 2) int64, sorted; endpoints[:, 0] < endpoints[:, 1] unless -1
    observable_masks: np.ndarray  # (num_edges,) uint64 bitmask of flipped observables
    probabilities: np.ndarray  # (num_edges,) float64
    num_detectors: int
    num_observables: int

    @property
    def num_edges(self) -> int:
        return len(self.probabilities)


def _error_rows(inst, offset: int) -> list[tuple[int, int, int, float]]:
    prob = inst.args_copy()[0]
    if prob <= 0.0:
        return []
    rows, dets, obs = [], [], []
    for t in inst.targets_copy() + [None]:
        if t is None or t.is_separator():
            odd = sorted(d for d in set(dets) if dets.count(d) % 2)
            if len(odd) > 2:
                raise ValueError(
                    f"error component flips {len(odd)} detectors {[d + offset for d in odd]}; a graphlike "
                    "DEM is needed (build it with detector_error_model(decompose_errors=True))")
            if odd:
                mask = 0
                for o in obs:
                    mask ^= 1 << o
                rows.append((odd[0] + offset, odd[1] + offset if len(odd) == 2 else -1, mask, prob))
            dets, obs = [], []
        elif t.is_relative_detector_id():
            dets.append(t.val)
        elif t.is_logical_observable_id():
            obs.append(t.val)
    return rows


def _as_arrays(rows) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint64), np.zeros(0, np.float64)
    a, b, m, p = zip(*rows)
    return np.array(a, np.int64), np.array(b, np.int64), np.array(m, np.uint64), np.array(p, np.float64)


def _walk(block, *, fold_top_level: bool):
    """Rows of ``block`` relative to its start. Returns (segments, total detector shift).

    A segment is ``(a, b, mask, p, base, shift, reps)``: rows for iteration k sit at
    ``+ base + k * shift``. Nested loops are expanded; top-level ones stay folded
    when ``fold_top_level``.
    """
    import stim

    segments, rows, offset = [], [], 0

    def flush():
        if rows:
            segments.append((*_as_arrays(rows), 0, 0, 1))
            rows.clear()

    for inst in block:
        if isinstance(inst, stim.DemRepeatBlock):
            flush()
            body, shift = _walk(inst.body_copy(), fold_top_level=False)
            a, b, m, p = (body[0][k] for k in range(4)) if body else _as_arrays([])
            reps = inst.repeat_count
            if shift == 0:  # every iteration hits the same detectors: merge the copies now
                p, reps = (1.0 - (1.0 - 2.0 * np.minimum(p, 0.5)) ** reps) / 2.0, 1
            if fold_top_level:
                segments.append((a, b, m, p, offset, shift, reps))
            else:
                offs = offset + shift * np.arange(reps, dtype=np.int64)
                segments.append(((a[None, :] + offs[:, None]).ravel(),
                                 np.where(b[None, :] >= 0, b[None, :] + offs[:, None], -1).ravel(),
                                 np.tile(m, reps), np.tile(p, reps), 0, 0, 1))
            offset += shift * inst.repeat_count
        elif inst.type == "shift_detectors":
            offset += int(inst.targets_copy()[0])
        elif inst.type == "error":
            rows.extend(_error_rows(inst, offset))
    flush()
    if not fold_top_level and len(segments) > 1:
        segments = [(*(np.concatenate([sg[k] for sg in segments]) for k in range(4)), 0, 0, 1)]
    return segments, offset


def _group_starts(*sorted_keys: np.ndarray) -> np.ndarray:
    n = len(sorted_keys[0])
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for k in sorted_keys:
        change[1:] |= k[1:] != k[:-1]
    return np.flatnonzero(change)


def _xor_merge_groups(p: np.ndarray, starts: np.ndarray) -> np.ndarray:
    if len(p) == 0:
        return p
    logs = np.add.reduceat(np.log1p(-2.0 * np.minimum(p, 0.5 - 1e-15)), starts)
    return (1.0 - np.exp(logs)) / 2.0


def merge_edges(a, b, mask, p):
    """Merge identical then parallel edges; returns arrays sorted by (a, b)."""
    order = np.lexsort((mask, b, a))
    a, b, mask, p = a[order], b[order], mask[order], p[order]
    starts = _group_starts(a, b, mask)
    a, b, mask, p = a[starts], b[starts], mask[starts], _xor_merge_groups(p, starts)
    starts = _group_starts(a, b)
    ends = np.append(starts[1:], len(a)).astype(np.int64)
    group = np.repeat(np.arange(len(starts)), ends - starts)
    best = np.lexsort((p, group))[ends - 1] if len(a) else ends  # likeliest member of each group
    return a[starts], b[starts], mask[best], _xor_merge_groups(p, starts)


class DemEdgeIndex:
    """The graphlike edges of a DEM, loop bodies stored once; see the module docstring."""

    def __init__(self, dem):
        import stim

        if not isinstance(dem, stim.DetectorErrorModel):
            raise TypeError(f"expected a stim.DetectorErrorModel, got {type(dem).__name__}")
        if dem.num_observables > 64:
            raise ValueError(f"at most 64 observables are supported, the DEM has {dem.num_observables}")
        self.num_detectors, self.num_observables = dem.num_detectors, dem.num_observables
        self._segments, _ = _walk(dem, fold_top_level=True)
        spans = [np.max(np.where(sg[1] >= 0, sg[1] - sg[0], 0), initial=0) for sg in self._segments]
        self.max_span = int(max(spans, default=0))  # largest b - a of any edge

    def rows_in_range(self, lo: int, hi: int):
        """Unmerged edges whose first detector is in ``[lo, hi)``."""
        parts = []
        for a, b, m, p, base, shift, reps in self._segments:
            first = a + base
            if reps == 1:
                sel = np.flatnonzero((first >= lo) & (first < hi))
                parts.append((first[sel], np.where(b[sel] >= 0, b[sel] + base, -1), m[sel], p[sel]))
                continue
            kmin = np.maximum(-((first - lo) // shift), 0)
            kmax = np.minimum((hi - 1 - first) // shift, reps - 1)
            cnt = np.maximum(kmax - kmin + 1, 0)
            idx = np.repeat(np.arange(len(a)), cnt)
            k = kmin[idx] + np.arange(len(idx)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            shift_k = base + k * shift
            parts.append((a[idx] + shift_k, np.where(b[idx] >= 0, b[idx] + shift_k, -1), m[idx], p[idx]))
        if not parts:
            return _as_arrays([])
        return tuple(np.concatenate([pt[k] for pt in parts]) for k in range(4))

    def edges_in_range(self, lo: int, hi: int):
        """Merged edges ``(a, b, mask, p)`` whose first detector is in ``[lo, hi)``, sorted by (a, b)."""
        return merge_edges(*self.rows_in_range(lo, hi))

    def graph(self) -> DemGraph:
        a, b, m, p = self.edges_in_range(0, max(self.num_detectors, 1))
        return DemGraph(np.stack([a, b], axis=1).reshape(-1, 2), m, p, self.num_detectors, self.num_observables)


def dem_to_graph(dem) -> DemGraph:
    """Graphlike view of ``dem``: each ``^`` component is an edge (at most two detectors).

    Raises ``ValueError`` if a component flips more than two detectors: build the
    DEM with ``decompose_errors=True``.
    """
    return DemEdgeIndex(dem).graph()
