"""A constant-memory log-linear latency histogram of integer nanoseconds (HDR-style).

Values ``0 … 2**sub_bucket_bits - 1`` get one bucket each; above that every power
of two ``[2**e, 2**(e+1))`` is split into ``2**sub_bucket_bits`` equal buckets. With
the default ``sub_bucket_bits=10`` a bucket is at most 1/1024 of its lowest value
wide, and a percentile is reported as its bucket's midpoint, so it is within
``relative_error = 2**-11`` (≈ 0.05 %, over three significant digits) of the exact
order statistic. The default range 0 … 10**12 ns (1000 s) takes 31,559 buckets:
252 KiB, fixed at construction whatever the number of samples.

Out-of-range samples are never dropped: a value above ``highest_trackable_ns`` is
counted in the top bucket and in ``overflow_count``; a negative value is counted
in bucket 0 and in ``underflow_count``. ``min`` and ``max`` are the exact extremes
seen (out-of-range ones included); ``mean`` is the mean of the values as counted
(clamped into range).

Percentile ``p`` is the sample of rank ``ceil(count * p / 100)`` (at least 1), the
nearest-rank definition that ``numpy.percentile(..., method="inverted_cdf")`` also
uses. The rank is computed exactly, with ``p`` read as the decimal it prints as, so
p99.9 of 1000 samples is the 999th (numpy's float product 999.0000000000001 picks
the 1000th). The smallest and largest samples are reported exactly; any other rank
as its bucket's midpoint clamped to ``[min, max]``. An empty histogram
has no percentiles: asking raises :class:`EmptyHistogramError`; its ``min``,
``max`` and ``mean`` are ``None``.

>>> h = LatencyHistogram()
>>> h.record_many(range(1, 10_001))
>>> h.count, h.min, h.max, h.mean
(10000, 1, 10000, 5000.5)
>>> h.percentiles([50, 99, 99.9])
[5002, 9900, 9988]
>>> h.summary().p99_ns
9900
"""

from __future__ import annotations

import array
import math
import numbers
from fractions import Fraction
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import numpy as np

from .errors import QlinkError

__all__ = ["LatencyHistogram", "HistogramSummary", "EmptyHistogramError"]

_FORMAT = "qlink.LatencyHistogram/1"
_MAX_SUB_BUCKET_BITS = 16
_CHUNK = 1 << 20  # samples per vectorised pass (bounds the temporaries)


class EmptyHistogramError(QlinkError, ValueError):
    """A percentile was asked of a histogram with no samples."""


@dataclass(frozen=True)
class HistogramSummary:
    """A frozen snapshot of a :class:`LatencyHistogram` (ns; ``None`` when empty)."""

    count: int
    min_ns: int | None
    max_ns: int | None
    mean_ns: float | None
    p50_ns: int | None
    p90_ns: int | None
    p99_ns: int | None
    p999_ns: int | None
    overflow_count: int
    underflow_count: int

    def to_dict(self) -> dict:
        """Plain, JSON-able data."""
        return asdict(self)


def _as_int(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise ValueError(f"latency must be a finite number of ns, got {value!r}")
        return int(round(value))
    raise TypeError(f"latency must be a number of ns, got {type(value).__name__} {value!r}")


class LatencyHistogram:
    """Log-linear histogram of integer ns latencies with constant memory.

    ``record`` is the hot-path call (pure Python, no allocation); ``record_many``
    takes a whole numpy array at once.
    """

    __slots__ = (
        "_bits",
        "_bits_plus_1",
        "_highest",
        "_counts",
        "_counts_np",
        "_count",
        "_sum",
        "_min",
        "_max",
        "_overflow",
        "_underflow",
    )

    def __init__(self, *, highest_trackable_ns: int = 10**12, sub_bucket_bits: int = 10) -> None:
        if not isinstance(sub_bucket_bits, int) or not 1 <= sub_bucket_bits <= _MAX_SUB_BUCKET_BITS:
            raise ValueError(
                f"sub_bucket_bits must be an int in [1, {_MAX_SUB_BUCKET_BITS}], got {sub_bucket_bits!r}"
            )
        if not isinstance(highest_trackable_ns, int) or not 1 <= highest_trackable_ns < 2**52:
            raise ValueError(
                f"highest_trackable_ns must be an int in [1, 2**52), got {highest_trackable_ns!r}"
            )
        self._bits = sub_bucket_bits
        self._bits_plus_1 = sub_bucket_bits + 1
        self._highest = highest_trackable_ns
        nbuckets = self._index(highest_trackable_ns) + 1
        # array.array: fast scalar increments; the numpy view over the same memory
        # serves the vectorised paths. An exported buffer cannot be resized, which
        # also pins the memory.
        self._counts = array.array("q", bytes(8 * nbuckets))
        self._counts_np = np.frombuffer(self._counts, dtype=np.int64)
        self._count = 0
        self._sum = 0
        self._min: int | None = None
        self._max: int | None = None
        self._overflow = 0
        self._underflow = 0

    # ------------------------------------------------------------------ layout

    def _index(self, v: int) -> int:
        shift = v.bit_length() - self._bits_plus_1
        if shift < 0:
            shift = 0
        return (shift << self._bits) + (v >> shift)

    def _bucket_low_width(self, index: np.ndarray | int):
        shift = np.maximum((np.asarray(index) >> self._bits) - 1, 0)
        low = (np.asarray(index) - (shift << self._bits)) << shift
        return low, np.left_shift(1, shift)

    @property
    def highest_trackable_ns(self) -> int:
        return self._highest

    @property
    def sub_bucket_bits(self) -> int:
        return self._bits

    @property
    def relative_error(self) -> float:
        """Bound on ``|reported - exact| / exact`` of a percentile (in-range values)."""
        return 2.0 ** -(self._bits + 1)

    @property
    def nbuckets(self) -> int:
        return len(self._counts)

    @property
    def counts(self) -> np.ndarray:
        """The bucket counts (a read-only view; its size never changes)."""
        view = self._counts_np.view()
        view.flags.writeable = False
        return view

    # --------------------------------------------------------------- recording

    def record(self, value_ns: int) -> None:
        """Count one latency (integer ns; floats are rounded).

        >>> h = LatencyHistogram(highest_trackable_ns=1000)
        >>> for v in (0, 5, 5000, -3):
        ...     h.record(v)
        >>> h.count, h.overflow_count, h.underflow_count, h.min, h.max
        (4, 1, 1, -3, 5000)
        """
        v = value_ns if type(value_ns) is int else _as_int(value_ns)
        n = self._count
        self._count = n + 1
        if n:
            if v < self._min:
                self._min = v
            elif v > self._max:
                self._max = v
        else:
            self._min = self._max = v
        if v < 0:
            self._underflow += 1
            v = 0
        elif v > self._highest:
            self._overflow += 1
            v = self._highest
        self._sum += v
        shift = v.bit_length() - self._bits_plus_1
        if shift < 0:
            shift = 0
        self._counts[(shift << self._bits) + (v >> shift)] += 1

    def record_many(self, values_ns: Any) -> None:
        """Count every latency of an array (or iterable) of ns at once, vectorised.

        >>> h = LatencyHistogram()
        >>> h.record_many(np.array([10, 20, 30], dtype=np.int64))
        >>> h.count, h.percentile(50)
        (3, 20)
        """
        if isinstance(values_ns, range):
            values_ns = np.arange(values_ns.start, values_ns.stop, values_ns.step, dtype=np.int64)
        arr = np.asarray(values_ns)
        if arr.dtype == object:
            arr = np.asarray([_as_int(v) for v in arr.ravel()], dtype=np.int64)
        arr = arr.ravel()
        if arr.size == 0:
            return
        if arr.dtype.kind == "b":
            arr = arr.astype(np.int64)
        elif arr.dtype.kind == "f":
            if not np.isfinite(arr).all():
                raise ValueError("latencies must be finite numbers of ns; the array holds NaN or inf")
            arr = np.rint(arr)
            lo, hi = float(arr.min()), float(arr.max())
            if lo < -(2.0**63) or hi >= 2.0**63:
                raise ValueError(f"latencies {lo:g}..{hi:g} ns do not fit in int64")
            arr = arr.astype(np.int64)
        elif arr.dtype.kind == "u":
            if arr.dtype.itemsize == 8 and int(arr.max()) > np.iinfo(np.int64).max:
                arr = np.minimum(arr, np.uint64(self._highest + 1))  # all of them overflow anyway
            arr = arr.astype(np.int64)
        elif arr.dtype.kind != "i":
            raise TypeError(f"latencies must be numbers of ns, got an array of {arr.dtype}")
        else:
            arr = arr.astype(np.int64, copy=False)

        lo, hi = int(arr.min()), int(arr.max())
        if self._count:
            self._min = min(self._min, lo)
            self._max = max(self._max, hi)
        else:
            self._min, self._max = lo, hi
        self._count += int(arr.size)
        counts = self._counts_np
        bits, bits1, highest = self._bits, self._bits_plus_1, self._highest
        # The bucket index grows with the value, so every index lies between those of the
        # (clamped) extremes: count over that span only, not over all the buckets.
        first = self._index(min(max(lo, 0), highest))
        span = self._index(min(max(hi, 0), highest)) - first + 1
        chunk = max(1, min(_CHUNK, (2**62) // max(highest, 1)))
        for start in range(0, arr.size, chunk):
            part = arr[start : start + chunk]
            if lo < 0:
                self._underflow += int(np.count_nonzero(part < 0))
            if hi > highest:
                self._overflow += int(np.count_nonzero(part > highest))
            v = np.clip(part, 0, highest) if (lo < 0 or hi > highest) else part
            self._sum += int(v.sum(dtype=np.int64))
            _, exp = np.frexp(v.astype(np.float64))  # exp == bit_length, exact below 2**53
            shift = np.maximum(exp - bits1, 0).astype(np.int64)
            idx = (shift << bits) + (v >> shift)
            if first:
                idx -= first
            counts[first : first + span] += np.bincount(idx, minlength=span)

    def merge(self, other: "LatencyHistogram") -> "LatencyHistogram":
        """Add ``other``'s samples into this histogram (same layout required); returns self.

        >>> a, b = LatencyHistogram(), LatencyHistogram()
        >>> a.record(100); b.record(300)
        >>> a.merge(b).count, a.max
        (2, 300)
        """
        if not isinstance(other, LatencyHistogram):
            raise TypeError(f"can only merge a LatencyHistogram, got {type(other).__name__}")
        if (other._highest, other._bits) != (self._highest, self._bits):
            raise ValueError(
                "histograms must share a layout to merge: this one has highest_trackable_ns="
                f"{self._highest}, sub_bucket_bits={self._bits}; the other "
                f"{other._highest}, {other._bits}"
            )
        if other._count == 0:
            return self
        self._counts_np += other._counts_np
        if self._count:
            self._min = min(self._min, other._min)
            self._max = max(self._max, other._max)
        else:
            self._min, self._max = other._min, other._max
        self._count += other._count
        self._sum += other._sum
        self._overflow += other._overflow
        self._underflow += other._underflow
        return self

    def reset(self) -> None:
        """Forget every sample (the memory stays)."""
        self._counts_np[:] = 0
        self._count = self._sum = self._overflow = self._underflow = 0
        self._min = self._max = None

    def copy(self) -> "LatencyHistogram":
        clone = LatencyHistogram(highest_trackable_ns=self._highest, sub_bucket_bits=self._bits)
        return clone.merge(self)

    # ----------------------------------------------------------------- queries

    @property
    def count(self) -> int:
        return self._count

    @property
    def min(self) -> int | None:
        return self._min

    @property
    def max(self) -> int | None:
        return self._max

    @property
    def mean(self) -> float | None:
        return self._sum / self._count if self._count else None

    @property
    def overflow_count(self) -> int:
        return self._overflow

    @property
    def underflow_count(self) -> int:
        return self._underflow

    def percentile(self, p: float) -> int:
        """The ``p``-th percentile (0 ≤ p ≤ 100) in ns; see the module docstring."""
        return self.percentiles([p])[0]

    def percentiles(self, ps: Iterable[float]) -> list[int]:
        """Several percentiles at once (one pass over the buckets)."""
        ps = [float(p) for p in ps]
        for p in ps:
            if not 0.0 <= p <= 100.0:
                raise ValueError(f"percentiles must lie in [0, 100], got {p}")
        if self._count == 0:
            raise EmptyHistogramError(
                "the histogram is empty: no percentile exists until a sample is recorded "
                "(check .count first)"
            )
        cumulative = np.cumsum(self._counts_np)
        out = []
        for p in ps:
            # Exact rank: p is taken as the decimal it prints as (99.9, not 99.90000000000000568).
            rank = min(max(math.ceil(self._count * Fraction(repr(p)) / 100), 1), self._count)
            if rank == 1:
                out.append(self._min)  # the extremes are known exactly
                continue
            if rank == self._count:
                out.append(self._max)
                continue
            index = int(np.searchsorted(cumulative, rank, side="left"))
            low, width = self._bucket_low_width(index)
            value = int(low) + int(width) // 2
            out.append(min(max(value, self._min), self._max))
        return out

    def summary(self) -> HistogramSummary:
        """A frozen snapshot: count, min, max, mean, p50/p90/p99/p99.9, out-of-range counts.

        >>> LatencyHistogram().summary().p99_ns is None
        True
        """
        if self._count == 0:
            return HistogramSummary(0, None, None, None, None, None, None, None, 0, 0)
        p50, p90, p99, p999 = self.percentiles([50, 90, 99, 99.9])
        return HistogramSummary(
            self._count, self._min, self._max, self.mean, p50, p90, p99, p999,
            self._overflow, self._underflow,
        )

    # ---------------------------------------------------------- serialisation

    def to_dict(self) -> dict:
        """Plain, JSON-able data (sparse buckets), for result files and for merging
        histograms written by several processes.

        >>> h = LatencyHistogram(); h.record_many([5, 5, 5000])
        >>> d = h.to_dict(); d["buckets"]
        {'index': [5, 3298], 'count': [2, 1]}
        >>> LatencyHistogram.from_dict(d).percentiles([50, 100])
        [5, 5000]
        """
        nonzero = np.flatnonzero(self._counts_np)
        return {
            "format": _FORMAT,
            "highest_trackable_ns": self._highest,
            "sub_bucket_bits": self._bits,
            "count": self._count,
            "sum_ns": self._sum,
            "min_ns": self._min,
            "max_ns": self._max,
            "overflow_count": self._overflow,
            "underflow_count": self._underflow,
            "buckets": {"index": nonzero.tolist(), "count": self._counts_np[nonzero].tolist()},
        }

    @classmethod
    def from_dict(cls, data: dict) -> "LatencyHistogram":
        """Rebuild a histogram from :meth:`to_dict` output, checking it is consistent."""
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a histogram written by to_dict: format is {got!r}, expected {_FORMAT!r}")
        try:
            hist = cls(highest_trackable_ns=data["highest_trackable_ns"], sub_bucket_bits=data["sub_bucket_bits"])
            index = np.asarray(data["buckets"]["index"], dtype=np.int64)
            counts = np.asarray(data["buckets"]["count"], dtype=np.int64)
            count, total = int(data["count"]), int(data["sum_ns"])
            lo, hi = data["min_ns"], data["max_ns"]
            overflow, underflow = int(data["overflow_count"]), int(data["underflow_count"])
        except KeyError as exc:
            raise ValueError(f"histogram dict lacks the field {exc.args[0]!r}") from None
        if index.shape != counts.shape or index.ndim != 1:
            raise ValueError("histogram buckets: 'index' and 'count' must be lists of equal length")
        if index.size and (index.min() < 0 or index.max() >= hist.nbuckets or (counts <= 0).any()):
            raise ValueError(
                f"histogram buckets must have indices in [0, {hist.nbuckets}) and positive counts"
            )
        if int(counts.sum()) != count or min(overflow, underflow) < 0 or overflow + underflow > count:
            raise ValueError(
                f"histogram dict is inconsistent: buckets hold {int(counts.sum())} samples, count says "
                f"{count} (overflow {overflow}, underflow {underflow})"
            )
        if (count == 0) != (lo is None) or (count == 0) != (hi is None):
            raise ValueError("histogram dict: min_ns/max_ns must be null exactly when count is 0")
        np.add.at(hist._counts_np, index, counts)
        hist._count, hist._sum = count, total
        hist._min, hist._max = (None, None) if count == 0 else (int(lo), int(hi))
        hist._overflow, hist._underflow = overflow, underflow
        return hist

    def __repr__(self) -> str:
        if not self._count:
            return f"LatencyHistogram(count=0, highest_trackable_ns={self._highest})"
        p50, p99 = self.percentiles([50, 99])
        return f"LatencyHistogram(count={self._count}, min={self._min}, p50={p50}, p99={p99}, max={self._max})"
