"""Percentile summaries of latency samples, in the units benchmarks report.

>>> import numpy as np
>>> s = summarize_ns(np.array([1000, 2000, 3000, 4000], dtype=np.int64))
>>> s["p50_us"], s["n"]
(2.5, 4)
"""

from __future__ import annotations

import numpy as np

__all__ = ["summarize_ns", "ratio"]


def summarize_ns(samples_ns) -> dict:
    """p50/p99/p99.9/max (µs) and count of an array of nanosecond samples."""
    a = np.asarray(samples_ns, dtype=np.float64)
    if a.size == 0:
        return {"n": 0, "p50_us": float("nan"), "p99_us": float("nan"), "p999_us": float("nan"), "max_us": float("nan")}
    p50, p99, p999 = np.percentile(a, [50, 99, 99.9])
    return {
        "n": int(a.size),
        "p50_us": round(float(p50) / 1e3, 3),
        "p99_us": round(float(p99) / 1e3, 3),
        "p999_us": round(float(p999) / 1e3, 3),
        "max_us": round(float(a.max()) / 1e3, 3),
    }


def ratio(a: float, b: float) -> float:
    """``a / b`` rounded to 3 significant digits; NaN when undefined."""
    if not b or a != a or b != b:
        return float("nan")
    return float(f"{a / b:.3g}")
