"""Argument checks shared by the QEC loop's modules (private to :mod:`qlink.qec`)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["knob"]


def knob(name: str, value, minimum: float, *, above: bool = False, or_none: bool = False):
    """``value`` checked as a loop parameter: a finite number ``>= minimum`` (``> minimum``
    with ``above``), or None where ``or_none``. NaN and infinities are refused by name first
    (a comparison lets NaN through, and ``int()`` of it fails with no name).

    >>> knob("cycle_ns", float("nan"), 1)
    Traceback (most recent call last):
    ...
    ValueError: cycle_ns must be a finite number >= 1, got nan
    """
    if value is None and or_none:
        return None
    what = f"a finite number {'>' if above else '>='} {minimum}{' or None' if or_none else ''}"
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    if not (isinstance(value, (int, np.integer)) or math.isfinite(value)) or value < minimum or (
            above and value == minimum):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value

