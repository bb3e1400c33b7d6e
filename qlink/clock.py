"""Clocks: one monotonic nanosecond clock for latencies, one wall clock for
``ptp_timestamp`` fields, and ping-pong offset estimation between two hosts.

:func:`now_ns` is ``time.monotonic_ns``: system-wide and never going backwards
(``CLOCK_MONOTONIC`` on Linux, ``mach_absolute_time`` on macOS,
``QueryPerformanceCounter`` on Windows), so stamps taken in two processes of one
host are directly comparable — a controller process and a decoder process can
subtract each other's stamps. (On Linux ``time.perf_counter_ns`` reads the same
clock, but Python documents only ``monotonic`` as system-wide.) It is *not*
comparable across hosts; for that, estimate the offset with
:func:`estimate_offset`, or use :func:`ptp_now_ns` on hosts whose wall clocks are
disciplined by PTP.

:func:`ptp_now_ns` is ``time.time_ns`` (``CLOCK_REALTIME``, ns since the Unix
epoch), the clock a PTP daemon (ptp4l + phc2sys) steers; it fills the wire's
``ptp_timestamp`` fields. It can step, so never take latencies from it on one host.

>>> a = now_ns(); b = now_ns()
>>> b >= a
True
>>> ptp_now_ns() > 1_600_000_000 * 10**9  # after September 2020
True
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

__all__ = ["now_ns", "ptp_now_ns", "Stopwatch", "OffsetEstimate", "estimate_offset"]

now_ns: Callable[[], int] = time.monotonic_ns
"""Monotonic, system-wide nanoseconds (see the module docstring)."""

ptp_now_ns: Callable[[], int] = time.time_ns
"""Wall-clock nanoseconds since the Unix epoch, for ``ptp_timestamp`` fields."""


class Stopwatch:
    """Elapsed nanoseconds on :func:`now_ns`, started at construction.

    ``clock`` may be any callable returning integer ns (a fake clock in tests).

    >>> ticks = iter([100, 250, 400, 1000])
    >>> sw = Stopwatch(clock=lambda: next(ticks))
    >>> sw.elapsed_ns()
    150
    >>> sw.lap_ns()      # elapsed, then restart from now
    300
    >>> sw.elapsed_ns()
    600
    """

    __slots__ = ("_clock", "start_ns")

    def __init__(self, *, clock: Callable[[], int] = now_ns) -> None:
        self._clock = clock
        self.start_ns = clock()

    def elapsed_ns(self) -> int:
        """Nanoseconds since the start (or the last :meth:`lap_ns` / :meth:`restart`)."""
        return self._clock() - self.start_ns

    def lap_ns(self) -> int:
        """Elapsed nanoseconds, and restart from this instant."""
        t = self._clock()
        elapsed = t - self.start_ns
        self.start_ns = t
        return elapsed

    def restart(self) -> None:
        self.start_ns = self._clock()

    def __repr__(self) -> str:
        return f"Stopwatch(start_ns={self.start_ns})"


class OffsetEstimate(NamedTuple):
    """``peer_clock - local_clock`` (ns) and a bound on its error (ns).

    The true offset lies in ``[offset_ns - error_bound_ns, offset_ns + error_bound_ns]``
    provided the peer stamped its reply between our send and our receive, which
    holds for any real ping. Convert a peer stamp to local time with
    ``peer_ns - offset_ns``.
    """

    offset_ns: int
    error_bound_ns: int


def estimate_offset(
    ping_fn: Callable[[], int], *, num_samples: int, clock: Callable[[], int] = now_ns
) -> OffsetEstimate:
    """Estimate the offset of a peer's clock by ping-pong midpoints (Cristian's method).

    Each sample stamps ``t0 = clock()``, calls ``ping_fn()`` — which must make one
    round trip to the peer and return the peer's clock reading taken while it
    answered — and stamps ``t1 = clock()``. The peer's reading ``tp`` was taken
    somewhere in ``[t0, t1]`` of local time, so the offset is ``tp - (t0 + t1) / 2``
    within half the round trip. The sample with the smallest round trip is kept
    (queueing and scheduling only ever add delay), so the error bound is half the
    minimum RTT (rounded up). Asymmetric paths bias the estimate inside that bound.

    A scripted peer that runs 5 µs ahead, with three round trips of 100, 40 and
    300 ns (the 40 ns sample wins):

    >>> local = iter([0, 100, 1_000, 1_040, 2_000, 2_300])
    >>> peer = iter([5_050, 6_020, 7_150])
    >>> estimate_offset(lambda: next(peer), num_samples=3, clock=lambda: next(local))
    OffsetEstimate(offset_ns=5000, error_bound_ns=20)
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    best_rtt = best_t0 = best_t1 = best_peer = -1
    for _ in range(num_samples):
        t0 = clock()
        peer_ns = ping_fn()
        t1 = clock()
        if isinstance(peer_ns, bool) or not isinstance(peer_ns, int):
            try:
                peer_ns = int(peer_ns.__index__())  # numpy integers
            except (AttributeError, TypeError):
                raise TypeError(
                    f"ping_fn must return the peer's clock as integer ns, got {peer_ns!r}"
                ) from None
        rtt = t1 - t0
        if rtt < 0:
            raise ValueError(f"the local clock went backwards ({t0} -> {t1}); use a monotonic clock")
        if best_rtt < 0 or rtt < best_rtt:
            best_rtt, best_t0, best_t1, best_peer = rtt, t0, t1, peer_ns
    # True offset lies in [peer - t1, peer - t0]; the floor midpoint is within ceil(rtt / 2).
    return OffsetEstimate(best_peer - (best_t0 + best_t1) // 2, (best_rtt + 1) // 2)
