"""Process hygiene for every two-process run (the QEC loop, benchmarks): children that die with their parent, and CPU pinning.

Two busy-polling processes on a 2-core machine must not share a core: the scheduler
sometimes puts both on one CPU, where every round trip costs a time slice. Every
two-process measurement (the floor and each transport alike) pins its two sides to
different CPUs, so the comparison stays fair.

>>> from qlink.procs import pinned
>>> with pinned(0):
...     pass
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

__all__ = ["die_with_parent", "pin_to_cpu", "pinned"]


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (no orphan spinning)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def pin_to_cpu(slot: int) -> set[int] | None:
    """Pin this process to the ``slot``-th CPU it may run on (modulo their number).

    Returns the previous affinity (to restore), or None where pinning is not possible
    (one CPU, or no ``sched_setaffinity``)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None
    if len(cpus) < 2:
        return None
    try:
        os.sched_setaffinity(0, {cpus[slot % len(cpus)]})
    except OSError:
        return None
    return set(cpus)


@contextlib.contextmanager
def pinned(slot: int):
    """Pin this process for the ``with`` block, then restore its affinity."""
    before = pin_to_cpu(slot)
    try:
        yield
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
