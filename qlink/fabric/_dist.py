"""Measured durations as empirical distributions, and block-drawn random numbers.

An :class:`EmpiricalDistribution` holds sorted samples (ns) of something measured —
a transport's one-way time, a service's per-message handling cost — with a plain-data
``source`` saying what was measured, where and when. A draw at quantile ``u`` picks the
sample of rank ``floor(u * n)``, so drawing with uniform ``u`` resamples the
measurement (the empirical bootstrap).

>>> d = EmpiricalDistribution.from_samples("one-way", [300, 100, 200, 400], source={"kind": "measured"})
>>> d.samples_ns.tolist(), d.quantile_ns(0.0), d.quantile_ns(0.5), d.quantile_ns(0.999)
([100.0, 200.0, 300.0, 400.0], 100.0, 300.0, 400.0)
>>> d.median_ns
300.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

__all__ = ["EmpiricalDistribution"]

_BLOCK = 65_536


@dataclass(frozen=True, eq=False)
class EmpiricalDistribution:
    """Sorted samples of a duration (ns), drawn by quantile; ``source`` records their origin."""

    name: str
    samples_ns: np.ndarray = field(repr=False)
    source: dict = field(default_factory=dict)

    def __post_init__(self):
        a = np.sort(np.asarray(self.samples_ns, dtype=np.float64).ravel())
        if a.size == 0:
            raise ValueError(f"{self.name!r}: an empirical distribution needs at least one sample")
        if not np.isfinite(a).all() or a[0] < 0:
            raise ValueError(f"{self.name!r}: samples must be finite durations >= 0 ns")
        a.flags.writeable = False
        object.__setattr__(self, "samples_ns", a)
        object.__setattr__(self, "source", dict(self.source))

    @classmethod
    def from_samples(cls, name: str, samples_ns: Iterable[float], *, source: dict | None = None
                     ) -> "EmpiricalDistribution":
        if not isinstance(samples_ns, (np.ndarray, list, tuple)):
            samples_ns = list(samples_ns)
        return cls(name, np.asarray(samples_ns, dtype=np.float64), dict(source or {}))

    @classmethod
    def from_histogram(cls, name: str, hist, *, source: dict | None = None, max_samples: int = 2000
                       ) -> "EmpiricalDistribution":
        """From a :class:`~qlink.histogram.LatencyHistogram` (or its ``to_dict``): its percentiles at
        ``min(count, max_samples)`` evenly spaced ranks (exact to the histogram's resolution).

        >>> from qlink.histogram import LatencyHistogram
        >>> h = LatencyHistogram(); h.record_many([1000, 1000, 5000])
        >>> EmpiricalDistribution.from_histogram("parse", h.to_dict()).samples_ns.tolist()
        [1000.0, 1000.0, 5000.0]
        """
        from qlink.histogram import LatencyHistogram

        if isinstance(hist, dict):
            hist = LatencyHistogram.from_dict(hist)
        if hist.count == 0:
            raise ValueError(f"{name!r}: the histogram is empty; nothing to draw from")
        n = min(int(hist.count), int(max_samples))
        ranks = (np.arange(n) + 0.5) / n * 100.0
        return cls(name, np.asarray(hist.percentiles(ranks.tolist()), dtype=np.float64), dict(source or {}))

    @property
    def count(self) -> int:
        return int(self.samples_ns.size)

    @property
    def median_ns(self) -> float:
        return self.quantile_ns(0.5)

    @property
    def mean_ns(self) -> float:
        return float(self.samples_ns.mean())

    def quantile_ns(self, u: float) -> float:
        """The sample of rank ``floor(u * n)`` (``0 <= u < 1``; 1 gives the largest)."""
        a = self.samples_ns
        return float(a[min(int(u * a.size), a.size - 1)])

    def describe(self) -> dict:
        """Name, count, p50/p99 in µs and the source, JSON-able."""
        a = self.samples_ns
        return {"name": self.name, "n": int(a.size), "p50_us": self.quantile_ns(0.5) / 1e3,
                "p99_us": self.quantile_ns(0.99) / 1e3, "source": dict(self.source)}


class _BlockDraws:
    """Scalar draws taken one at a time from blocks that ``fill(n)`` (a generator's vectorised
    call) makes: cheap scalar draws, the same numbers as the vectorised call's."""

    __slots__ = ("_fill", "_buf", "_i")

    def __init__(self, fill) -> None:
        self._fill = fill
        self._buf: list = []
        self._i = 0

    def next(self) -> float:
        i = self._i
        if i >= len(self._buf):
            self._buf = self._fill(_BLOCK).tolist()
            i = 0
        self._i = i + 1
        return self._buf[i]


def _Uniforms(rng: np.random.Generator) -> _BlockDraws:
    """Uniform [0, 1) draws."""
    return _BlockDraws(rng.random)


def _HalfNormals(rng: np.random.Generator) -> _BlockDraws:
    """``|N(0, 1)|`` draws."""
    return _BlockDraws(lambda n: np.abs(rng.standard_normal(n)))


def _finite_positive(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return v
