"""Floors to measure transports against: a bare shared-memory spin and a memcpy.

* :func:`spin_round_trip_ns`: two processes ping-pong through two 8-byte words in
  one shared block (each on its own cache line), spinning on NumPy reads; no ring,
  no framing, no checks. Any shared-memory transport written in Python pays at least
  this per round trip, so its round trip is reported as a multiple of it.
* :func:`memcpy_bandwidth`: a NumPy copy between two preallocated arrays of the same
  size; a one-sided put of that size cannot beat it.
* :func:`cpu_availability`: two processes, each pinned to its own core, doing nothing
  but read the clock: the share of wall time each really ran, and how often it was
  held off longer than a given interval. Two busy-polling sides of a loop (controller
  and decoder service) cannot run more than this; on a virtual machine whose vCPUs
  are shared it can be well below 1, and every cycle-keeping figure is bounded by it.

The spin floor uses both cores of a 2-core machine for as long as it runs.

>>> rt = spin_round_trip_ns(num_round_trips=200, warmup=20)
>>> rt.shape, bool((rt > 0).all())
((200,), True)
>>> memcpy_bandwidth(1 << 16, repeats=3) > 0
True
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import signal
import time

import numpy as np

from qlink.procs import die_with_parent, pin_to_cpu, pinned

__all__ = ["spin_round_trip_ns", "memcpy_bandwidth", "cpu_availability"]

_PING, _PONG = 0, 8  # u64 word indices: 64 bytes apart, one cache line each
_STOP = np.iinfo(np.int64).min


def _echo(parent_pid: int, fd: int, nbytes: int) -> None:
    die_with_parent()
    pin_to_cpu(1)
    if os.getppid() != parent_pid:
        return
    f = os.open(f"/proc/{parent_pid}/fd/{fd}", os.O_RDWR)
    try:
        mm = mmap.mmap(f, nbytes)
    finally:
        os.close(f)
    w = np.frombuffer(mm, dtype=np.int64)
    w[_PONG] = -1  # ready
    last = 0
    while True:
        v = w[_PING]
        if v != last:
            if v == _STOP:
                break
            w[_PONG] = v
            last = v
    del w
    mm.close()


def spin_round_trip_ns(*, num_round_trips: int = 20000, warmup: int = 2000, timeout_s: float = 60.0) -> np.ndarray:
    """Per-round-trip latency in ns of a ping-pong through shared memory between two processes.

    The child is started with ``spawn`` and maps the parent's memfd through
    ``/proc/<pid>/fd``; no named shared-memory segment is created. Returns an int64
    array of ``num_round_trips`` samples (``time.perf_counter_ns`` around each).
    """
    if num_round_trips < 1 or warmup < 0:
        raise ValueError(f"need num_round_trips >= 1 and warmup >= 0, got {num_round_trips} and {warmup}")
    nbytes = 4096
    fd = os.memfd_create("qlink-floor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        w = np.frombuffer(mm, dtype=np.int64)
        p = mp.get_context("spawn").Process(target=_echo, args=(os.getpid(), fd, nbytes), daemon=True)
        p.start()
        try:
            deadline = time.monotonic() + timeout_s
            while w[_PONG] != -1:
                if not p.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the floor's echo process did not start")
                time.sleep(1e-3)
            out = np.empty(num_round_trips, dtype=np.int64)
            clock = time.perf_counter_ns
            with pinned(0):
                for i in range(1, warmup + num_round_trips + 1):
                    t0 = clock()
                    w[_PING] = i
                    while w[_PONG] != i:
                        pass
                    t1 = clock()
                    if i > warmup:
                        out[i - warmup - 1] = t1 - t0
            w[_PING] = _STOP
            p.join(timeout_s)
            return out
        finally:
            if p.is_alive():
                p.kill()
            p.join(5)
            del w
            mm.close()
    finally:
        os.close(fd)


def memcpy_bandwidth(nbytes: int, *, repeats: int = 7, reduce: str = "max") -> float:
    """Bytes per second of ``np.copyto`` between two preallocated ``nbytes`` arrays.

    Each of ``repeats`` timings copies at least ~64 MiB in total (small sizes repeat
    the copy), after one warm-up copy. ``reduce`` picks the best (``"max"``, the
    floor) or the ``"median"`` repeat.
    """
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"need nbytes >= 1 and repeats >= 1, got {nbytes} and {repeats}")
    if reduce not in ("max", "median"):
        raise ValueError(f"reduce must be 'max' or 'median', got {reduce!r}")
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    inner = max(1, (64 << 20) // nbytes)
    rates = np.empty(repeats)
    clock = time.perf_counter_ns
    for r in range(repeats):
        t0 = clock()
        for _ in range(inner):
            np.copyto(dst, src)
        rates[r] = nbytes * inner / max(clock() - t0, 1) * 1e9
    return float(rates.max() if reduce == "max" else np.median(rates))


def _clock_spin(duration_ns: int, gap_ns: int) -> dict:
    """Read the clock for ``duration_ns``: time lost in gaps > 2 µs, and gaps > ``gap_ns``."""
    clock = time.perf_counter_ns
    t0 = last = clock()
    end = t0 + duration_ns
    lost = held = longest = 0
    while last < end:
        now = clock()
        g = now - last
        if g > 2000:
            lost += g
            if g > gap_ns:
                held += 1
            if g > longest:
                longest = g
        last = now
    wall = last - t0
    return {"ran_share": 1.0 - lost / wall, "held_off": held, "held_off_per_s": held * 1e9 / wall,
            "longest_gap_us": longest / 1e3}


def _spin_child(slot: int, duration_ns: int, gap_ns: int, conn) -> None:
    die_with_parent()
    pin_to_cpu(slot)
    conn.recv()  # start together
    conn.send(_clock_spin(duration_ns, gap_ns))


def cpu_availability(*, duration_s: float = 1.0, gap_ns: int = 40_000, sides: int = 2) -> dict:
    """What ``sides`` busy processes (one per core, as the loop's two sides) actually get.

    Returns ``{"ran_share": min over sides, "held_off_per_s": max over sides,
    "longest_gap_us": max, "sides": [...]}`` where ``ran_share`` is the share of wall
    time a side ran (1.0 on idle dedicated cores) and ``held_off_per_s`` how many times
    per second it was held off for longer than ``gap_ns``.

    >>> a = cpu_availability(duration_s=0.05, sides=1)
    >>> 0.0 < a["ran_share"] <= 1.0 and a["held_off_per_s"] >= 0
    True
    """
    if not duration_s > 0 or not 1 <= sides <= 2:
        raise ValueError(f"need duration_s > 0 and sides in 1..2, got {duration_s} and {sides}")
    duration_ns, ctx = int(duration_s * 1e9), mp.get_context("spawn")
    procs, conns = [], []
    try:
        for slot in range(sides):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_spin_child, args=(slot, duration_ns, gap_ns, b), daemon=True)
            p.start()
            procs.append(p)
            conns.append(a)
        for c in conns:
            c.send("go")
        res = []
        for c in conns:
            if not c.poll(duration_s + 60):
                raise RuntimeError("a cpu_availability spinner did not report")
            res.append(c.recv())
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return {"ran_share": min(r["ran_share"] for r in res), "held_off_per_s": max(r["held_off_per_s"] for r in res),
            "longest_gap_us": max(r["longest_gap_us"] for r in res), "gap_us": gap_ns / 1e3, "sides": res}
