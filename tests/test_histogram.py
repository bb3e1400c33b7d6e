"""qlink.histogram.LatencyHistogram: accuracy against numpy, constant memory, merge,
serialisation and edge cases."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from qlink.histogram import EmptyHistogramError, HistogramSummary, LatencyHistogram

PS = [0, 1, 10, 25, 50, 75, 90, 99, 99.9, 99.99, 100]


def _distributions(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {
        "uniform_us": rng.integers(1_000, 50_000, n),
        "small_exact": rng.integers(0, 2_048, n),
        "exponential": np.rint(rng.exponential(20_000, n)).astype(np.int64),
        "lognormal": np.rint(rng.lognormal(np.log(5_000), 1.0, n)).astype(np.int64),
        "pareto_heavy_tail": np.rint(1_000 * (1 + rng.pareto(1.1, n))).clip(max=10**12).astype(np.int64),
        "bimodal": np.concatenate([rng.integers(800, 900, n // 2), rng.integers(10**9, 2 * 10**9, n - n // 2)]),
        "constant": np.full(n, 123_456_789, dtype=np.int64),
    }


def _order_statistic(data: np.ndarray, p: float) -> int:
    """The nearest-rank percentile, rank ceil(n * p / 100) in exact arithmetic."""
    rank = max(math.ceil(len(data) * Fraction(repr(float(p))) / 100), 1)
    return int(np.sort(data)[rank - 1])


def _assert_close(h: LatencyHistogram, data: np.ndarray, ps=PS) -> None:
    expected = [_order_statistic(data, p) for p in ps]
    got = h.percentiles(ps)
    for p, g, e in zip(ps, got, expected):
        assert isinstance(g, int)
        assert abs(g - e) <= h.relative_error * abs(e), (p, g, e)


@pytest.mark.parametrize("seed", [0, 1])
def test_percentiles_match_numpy_within_relative_error(seed):
    rng = np.random.default_rng(seed)
    for name, data in _distributions(rng, 50_000).items():
        h = LatencyHistogram()
        h.record_many(data)
        assert h.count == data.size and h.min == data.min() and h.max == data.max(), name
        assert h.mean == pytest.approx(data.mean(), rel=1e-12), name
        _assert_close(h, data)


def test_agrees_with_numpy_inverted_cdf_where_numpy_has_no_rounding_artefact():
    # For these p, n * p / 100 is exact in binary floating point too.
    ps = [0, 12.5, 25, 50, 75, 87.5, 100]
    rng = np.random.default_rng(4)
    for name, data in _distributions(rng, 40_000).items():
        h = LatencyHistogram()
        h.record_many(data)
        expected = np.percentile(data, ps, method="inverted_cdf")
        for p, got, e in zip(ps, h.percentiles(ps), expected):
            assert abs(got - e) <= h.relative_error * abs(e), (name, p, got, e)


def test_rank_is_exact_decimal():
    h = LatencyHistogram()
    h.record_many(np.arange(1, 1_001))
    assert h.percentile(99.9) == 999  # numpy's float rank picks 1000 here
    assert int(np.percentile(np.arange(1, 1_001), 99.9, method="inverted_cdf")) == 1000


def test_relative_error_is_under_a_tenth_of_a_percent():
    h = LatencyHistogram()
    assert h.relative_error == 2**-11 < 1e-3


def test_every_bucket_is_narrow_enough():
    h = LatencyHistogram()
    low, width = h._bucket_low_width(np.arange(h.nbuckets))
    assert low[0] == 0 and (np.diff(low) == width[:-1]).all()  # contiguous, no gaps
    big = low >= 2 ** (h.sub_bucket_bits + 1)
    assert (width[big] / low[big] <= 2.0**-h.sub_bucket_bits).all()
    assert (width[low < 2 ** (h.sub_bucket_bits + 1)] == 1).all()  # small values are exact
    assert low[-1] <= h.highest_trackable_ns < low[-1] + width[-1]


def test_scalar_and_vectorised_recording_agree():
    rng = np.random.default_rng(7)
    data = np.concatenate([
        rng.integers(0, 10**12, 5_000), rng.integers(0, 5_000, 5_000),
        2 ** np.arange(41) - 1, 2 ** np.arange(41), 2 ** np.arange(41) + 1,
    ])
    a, b = LatencyHistogram(), LatencyHistogram()
    for v in data.tolist():
        a.record(v)
    b.record_many(data)
    np.testing.assert_array_equal(a.counts, b.counts)
    assert a.to_dict() == b.to_dict()


def test_small_samples_use_inverted_cdf_ranks():
    h = LatencyHistogram()
    h.record_many([1, 2, 3, 4])
    assert h.percentiles([0, 25, 50, 50.1, 75, 76, 100]) == [1, 1, 2, 3, 3, 4, 4]
    assert h.percentile(50) == int(np.percentile([1, 2, 3, 4], 50, method="inverted_cdf"))


def test_memory_is_constant():
    h = LatencyHistogram()
    counts = h.counts
    nbytes, address = counts.nbytes, counts.__array_interface__["data"][0]
    rng = np.random.default_rng(3)
    for _ in range(10):
        h.record_many(rng.integers(0, 10**13, 100_000))
    for v in range(10_000):
        h.record(v * 997)
    after = h.counts
    assert h.count == 1_010_000
    assert after.nbytes == nbytes == 8 * h.nbuckets < 300_000
    assert after.__array_interface__["data"][0] == address  # the same memory, never reallocated
    assert int(after.sum()) == h.count
    with pytest.raises(ValueError):
        h.counts[0] = 5  # read-only view


@pytest.mark.slow
def test_ten_million_samples_keep_memory_and_accuracy():
    h = LatencyHistogram()
    nbytes = h.counts.nbytes
    rng = np.random.default_rng(11)
    last = None
    for _ in range(10):
        last = np.rint(rng.lognormal(np.log(3_000), 0.8, 1_000_000)).astype(np.int64)
        h.record_many(last)
    assert h.count == 10**7 and h.counts.nbytes == nbytes
    only_last = LatencyHistogram()
    only_last.record_many(last)
    _assert_close(only_last, last)


def test_merge_equals_recording_both():
    rng = np.random.default_rng(5)
    x = rng.integers(-10, 10**6, 20_000)
    y = np.rint(rng.pareto(1.5, 20_000) * 1e9).astype(np.int64)  # some overflow 10**12
    a, b, both = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    a.record_many(x)
    b.record_many(y)
    both.record_many(np.concatenate([x, y]))
    assert a.merge(b) is a
    assert a.to_dict() == both.to_dict()
    assert a.percentiles(PS) == both.percentiles(PS)
    assert a.overflow_count == both.overflow_count > 0 and a.underflow_count == both.underflow_count > 0


def test_merge_edge_cases():
    a, empty = LatencyHistogram(), LatencyHistogram()
    a.record(50)
    assert a.merge(empty).count == 1 and a.min == a.max == 50
    assert empty.merge(a).to_dict() == a.to_dict()
    with pytest.raises(ValueError, match="share a layout"):
        a.merge(LatencyHistogram(sub_bucket_bits=8))
    with pytest.raises(TypeError):
        a.merge({"count": 1})
    clone = a.copy()
    clone.record(7)
    assert a.count == 1 and clone.count == 2


def test_json_round_trip_and_merge_from_several_processes():
    rng = np.random.default_rng(9)
    parts = [rng.integers(0, 10**7, 1_000) for _ in range(3)]
    texts = []
    for part in parts:  # as if written by three processes
        h = LatencyHistogram()
        h.record_many(part)
        texts.append(json.dumps(h.to_dict()))
    merged = LatencyHistogram()
    for text in texts:
        merged.merge(LatencyHistogram.from_dict(json.loads(text)))
    direct = LatencyHistogram()
    direct.record_many(np.concatenate(parts))
    assert merged.to_dict() == direct.to_dict()
    empty = LatencyHistogram.from_dict(json.loads(json.dumps(LatencyHistogram().to_dict())))
    assert empty.count == 0 and empty.min is None


def test_from_dict_rejects_bad_data():
    h = LatencyHistogram()
    h.record_many([1, 2, 3])
    good = h.to_dict()
    with pytest.raises(ValueError, match="format"):
        LatencyHistogram.from_dict({**good, "format": "other"})
    with pytest.raises(ValueError, match="format"):
        LatencyHistogram.from_dict([1, 2])
    with pytest.raises(ValueError, match="lacks the field 'count'"):
        LatencyHistogram.from_dict({k: v for k, v in good.items() if k != "count"})
    with pytest.raises(ValueError, match="inconsistent"):
        LatencyHistogram.from_dict({**good, "count": 4})
    with pytest.raises(ValueError, match="indices"):
        LatencyHistogram.from_dict({**good, "buckets": {"index": [10**9], "count": [3]}})
    with pytest.raises(ValueError, match="positive counts"):
        LatencyHistogram.from_dict({**good, "buckets": {"index": [1, 2], "count": [4, -1]}})
    with pytest.raises(ValueError, match="equal length"):
        LatencyHistogram.from_dict({**good, "buckets": {"index": [1, 2], "count": [3]}})
    with pytest.raises(ValueError, match="null exactly"):
        LatencyHistogram.from_dict({**good, "min_ns": None})


def test_empty_histogram():
    h = LatencyHistogram()
    assert (h.count, h.min, h.max, h.mean) == (0, None, None, None)
    with pytest.raises(EmptyHistogramError, match="empty"):
        h.percentile(50)
    with pytest.raises(ValueError):  # EmptyHistogramError is a ValueError
        h.percentiles([50, 99])
    s = h.summary()
    assert s == HistogramSummary(0, None, None, None, None, None, None, None, 0, 0)
    json.dumps(s.to_dict())
    assert "count=0" in repr(h)
    h.record_many(np.array([], dtype=np.int64))
    assert h.count == 0


def test_zero_and_out_of_range_values():
    h = LatencyHistogram(highest_trackable_ns=10_000)
    h.record(0)
    assert h.percentiles([0, 50, 100]) == [0, 0, 0]
    h.record_many(np.array([20_000, 10**15, 10_000]))
    h.record(-5)
    assert (h.count, h.overflow_count, h.underflow_count) == (5, 2, 1)
    assert (h.min, h.max) == (-5, 10**15)  # exact extremes, out-of-range ones included
    assert h.percentile(100) == 10**15 and h.percentile(0) == -5
    # Overflowed samples sit in the top bucket: high percentiles are near the top of the range.
    assert abs(h.percentile(70) - 10_000) <= 10_000 * h.relative_error  # rank 4 of 5
    assert h.mean == (0 + 10_000 + 10_000 + 10_000 + 0) / 5  # clamped values


def test_summary_is_frozen_and_consistent():
    h = LatencyHistogram()
    h.record_many(np.arange(1, 1_001))
    s = h.summary()
    assert (s.count, s.min_ns, s.max_ns, s.mean_ns) == (1000, 1, 1000, 500.5)
    assert [s.p50_ns, s.p90_ns, s.p99_ns, s.p999_ns] == h.percentiles([50, 90, 99, 99.9]) == [500, 900, 990, 999]
    with pytest.raises(AttributeError):
        s.count = 3
    assert json.loads(json.dumps(s.to_dict()))["p99_ns"] == 990


def test_input_types():
    h = LatencyHistogram()
    h.record(np.int32(7))
    h.record(7.6)  # rounded
    h.record(True)
    h.record_many([1.4, 2.6])  # rounded
    h.record_many(np.array([3], dtype=np.uint8))
    h.record_many(np.array([2**64 - 1], dtype=np.uint64))  # beyond int64: overflow
    h.record_many(np.array([True, False]))
    h.record_many(range(3))
    assert h.count == 12 and h.overflow_count == 1
    assert sorted(h.to_dict()["buckets"]["index"])[:4] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="finite"):
        h.record(math.nan)
    with pytest.raises(ValueError, match="NaN"):
        h.record_many(np.array([1.0, np.inf]))
    with pytest.raises(TypeError):
        h.record("5")
    with pytest.raises(TypeError):
        h.record_many(np.array(["a"]))
    assert h.count == 12  # refused input counted nothing


def test_percentile_and_layout_argument_errors():
    h = LatencyHistogram()
    h.record(1)
    for bad in (-0.1, 100.1, math.nan):
        with pytest.raises(ValueError, match=r"\[0, 100\]"):
            h.percentile(bad)
    with pytest.raises(ValueError, match="sub_bucket_bits"):
        LatencyHistogram(sub_bucket_bits=0)
    with pytest.raises(ValueError, match="highest_trackable_ns"):
        LatencyHistogram(highest_trackable_ns=0)


def test_coarse_layout_keeps_its_stated_error():
    h = LatencyHistogram(highest_trackable_ns=10**9, sub_bucket_bits=3)
    assert h.relative_error == 1 / 16 and h.nbuckets < 300
    data = np.random.default_rng(2).integers(0, 10**9, 10_000)
    h.record_many(data)
    _assert_close(h, data)


def test_reset_keeps_memory():
    h = LatencyHistogram()
    address = h.counts.__array_interface__["data"][0]
    h.record_many([1, 2, 3])
    h.reset()
    assert h.count == 0 and h.min is None and not h.counts.any()
    assert h.counts.__array_interface__["data"][0] == address
