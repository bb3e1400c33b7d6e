"""Syndrome sources described as plain data (*source specs*), and building them.

A spec crosses a process boundary as numbers and names only; each side rebuilds the
same circuit and DEM from it::

    {"kind": "stim", "code": "surface_code:rotated_memory_z", "distance": 5,
     "rounds": 5, "p": 0.001}

>>> spec = source_spec(distance=3, rounds=3, p=0.001)
>>> src = build_source(spec)
>>> src.dem.num_detectors, int(np.asarray(src.round_of_detector).max())
(24, 3)
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ._checks import knob as _knob

__all__ = ["source_spec", "build_source"]

_SOURCE_KEYS = {"kind", "code", "distance", "rounds", "p", "noise"}


def source_spec(*, distance: int, rounds: int | None = None, p: float = 0.001,
                code: str = "surface_code:rotated_memory_z", noise: str = "uniform", kind: str = "stim") -> dict:
    """A plain-data syndrome-source spec (``rounds`` defaults to ``distance``).

    >>> source_spec(distance=5)["rounds"]
    5
    """
    _knob("distance", distance, 2)
    if rounds is not None:
        _knob("rounds", rounds, 1)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 0.5:  # (NaN fails the comparison)
        raise ValueError(f"p must lie in [0, 0.5), got {p!r}")
    return {"kind": kind, "code": code, "distance": int(distance), "rounds": int(rounds or distance),
            "p": float(p), "noise": noise}


def _check_spec(spec: Mapping[str, Any]) -> dict:
    if not isinstance(spec, Mapping):
        raise TypeError(f"a source spec is a dict of plain values, got {type(spec).__name__}")
    unknown = set(spec) - _SOURCE_KEYS
    if unknown:
        raise ValueError(f"unknown source spec keys {sorted(unknown)}; allowed: {sorted(_SOURCE_KEYS)}")
    for k, v in spec.items():
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise TypeError(f"source spec values must be str/int/float, got {k}={v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"source spec values must be finite numbers, got {k}={v!r}")
    return dict(spec)


class _BoundSource:
    """A :class:`~qlink.qec.sources.SyndromeSource` with the DEM a decoder needs bound to it."""

    def __init__(self, source) -> None:
        self.source = source
        self.dem = source.detector_error_model(decompose_errors=True)
        self.round_of_detector = np.asarray(source.detector_rounds, dtype=np.int64)

    def sample(self, num_shots: int, *, seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        b = self.source.sample(num_shots, seed=seed)
        return b.detection_events.view(np.uint8), b.observable_flips.view(np.uint8)


_CODES = {"surface_code:rotated_memory_z": "Z", "surface_code:rotated_memory_x": "X"}


def build_source(spec: Mapping[str, Any]):
    """Build the syndrome source a spec describes (``kind`` ``"stim"`` or ``"cudaq"``,
    a rotated surface-code memory): an object with ``dem``, ``round_of_detector`` and
    ``sample(num_shots, seed=...) -> (detectors, observables)``."""
    spec = _check_spec(spec)
    kind = spec.get("kind", "stim")
    code = spec.get("code", "surface_code:rotated_memory_z")
    if code not in _CODES:
        raise ValueError(f"code {code!r} is not supported; use one of {sorted(_CODES)}")
    if spec.get("noise", "uniform") != "uniform":
        raise ValueError(f"noise model {spec['noise']!r} is not supported; use 'uniform'")
    if "distance" not in spec or "p" not in spec:
        raise ValueError("a source spec needs 'distance' and 'p'")
    kw = dict(distance=int(spec["distance"]), rounds=int(spec.get("rounds", spec["distance"])),
              p=float(spec["p"]), basis=_CODES[code])
    if kind == "stim":
        from .sources import StimSource

        return _BoundSource(StimSource.surface_code(**kw))
    if kind == "cudaq":
        from .sources import CudaqSource

        return _BoundSource(CudaqSource.surface_code(**kw))
    raise ValueError(f"source kind {kind!r} is unknown; use 'stim' or 'cudaq'")
