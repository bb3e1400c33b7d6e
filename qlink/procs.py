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

__all__ = ["die_with_parent", "pin_to_cpu", "pinned", "wait_ready"]


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


def wait_ready(q, proc, what: str, *, timeout_s: float = 120.0):
    """The first item the child ``proc`` puts on the queue ``q``. RuntimeError at once, with
    its exit code, if it exits first; TimeoutError after ``timeout_s``.

    >>> import multiprocessing as mp
    >>> q = mp.get_context("spawn").Queue()
    >>> class Gone:
    ...     exitcode = 3
    ...     def is_alive(self):
    ...         return False
    >>> wait_ready(q, Gone(), "test peer", timeout_s=1)
    Traceback (most recent call last):
    ...
    RuntimeError: the test peer process exited with code 3 before it was ready; its stderr says why
    """
    import queue
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the {what} process exited with code {proc.exitcode} before it was ready; "
                                   "its stderr says why") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {what} process was not ready within {timeout_s} s") from None
