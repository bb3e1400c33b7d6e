"""``qlink bench transport``: round trips and put bandwidth, each beside its floor.

Measured side by side in one run, between two processes:

* 64-byte round trip p50/p99/p99.9 for every transport asked for (``shm``, ``tcp``,
  ``ucx``), beside the *floor* (two processes spinning on a word in shared memory),
  plain Python TCP sockets, and UCXX's own asyncio API used directly.
* one-sided put bandwidth, 4 KiB … 64 MiB, into memory the target registered
  (``qlink.alloc``), beside a NumPy memcpy of the same size in the same run, on equal
  terms: each reuses one source and one destination buffer (the put writes at offset 0
  of the target region every time), every page is faulted in before timing (the memcpy's
  by a warm-up copy, the put's by the initiator's populated mapping and a discarded
  warm-up batch), each timing moves at least 64 MiB, and both report the median timing.

Each transport figure is also given as a ratio to its floor or peer, which is what
is comparable across machines. Both processes busy-poll, each pinned to its own CPU
(floor and transports alike): on a 2-core machine they take both cores while measuring.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Callable, Iterable

import numpy as np

from qlink.procs import die_with_parent, pin_to_cpu, pinned, wait_ready
from transports import loopback_url
from ._stats import ratio, summarize_ns

__all__ = ["run_transport_bench", "round_trip_ns", "put_bandwidth", "DEFAULT_PUT_SIZES"]

DEFAULT_PUT_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
_MIN_BATCH_NBYTES = 64 << 20  # each timed batch of puts moves at least this much, as each memcpy timing does
_ACK = b"k"


def _echo_child(url: str, q, nbytes: int, num: int) -> None:
    import transports

    die_with_parent()
    pin_to_cpu(1)
    with transports.listen(url) as lis:
        q.put(lis.url)
        with lis.accept(timeout_s=30) as ep:
            buf = bytearray(max(nbytes, 1))
            mv = memoryview(buf)
            for _ in range(num):
                n = ep.recv_into(mv, timeout_s=30)
                ep.send(mv[:n], timeout_s=30)
            ep.recv_into(mv, timeout_s=30)  # the parent's goodbye


def round_trip_ns(scheme: str, *, nbytes: int = 64, num_round_trips: int = 20000, warmup: int = 2000) -> np.ndarray:
    """Per-round-trip latency (ns) of ``nbytes`` messages over ``scheme`` between two processes."""
    import transports

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_echo_child, args=(loopback_url(scheme, tag="bench-rt"), q, nbytes, num_round_trips + warmup), daemon=True)
    p.start()
    try:
        url = wait_ready(q, p, "benchmark's peer", timeout_s=60)
        out = np.empty(num_round_trips, dtype=np.int64)
        msg = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        back = bytearray(max(nbytes, 1))
        with transports.connect(url, timeout_s=30) as ep, pinned(0):
            clock = time.perf_counter_ns
            for i in range(warmup + num_round_trips):
                t0 = clock()
                ep.send(msg, timeout_s=30)
                ep.recv_into(back, timeout_s=30)
                t1 = clock()
                if i >= warmup:
                    out[i - warmup] = t1 - t0
            if bytes(back[:nbytes]) != msg.tobytes():
                raise AssertionError(f"{scheme}: echoed bytes differ from the bytes sent")
            ep.send(b"bye", timeout_s=30)
        p.join(30)
        return out
    finally:
        if p.is_alive():
            p.kill()
        p.join(5)


def _put_target_child(url: str, q, nbytes: int, num_puts: int) -> None:
    import numpy as _np

    die_with_parent()
    pin_to_cpu(1)
    import transports
    from qlink.memory import alloc

    with transports.listen(url) as lis:
        q.put(lis.url)
        with lis.accept(timeout_s=30) as ep:
            region = ep.register(alloc(nbytes, dtype=_np.uint8))
            ep.send(region.descriptor().to_bytes(), timeout_s=30)
            while True:
                cmd = ep.recv(timeout_s=60)
                if cmd == b"bye":
                    break
                count = int(cmd)
                for _ in range(count):
                    ep.wait_notification(timeout_s=60)
                ep.send(_ACK, timeout_s=30)


def put_bandwidth(scheme: str, *, sizes: Iterable[int] = DEFAULT_PUT_SIZES, budget_bytes: int = 1 << 30,
                  repeats: int = 5) -> list[dict]:
    """Put bandwidth into a registered remote region, interleaved with its memcpy floor.

    For each size, ``repeats`` rounds (after one untimed warm-up round) each time a NumPy
    memcpy batch of the same bytes in the initiating process and then a batch of puts
    (at least 64 MiB each, within ``budget_bytes``), the put batch timed from the first
    put until the target acknowledges the last notification. Taking the two side by side,
    round after round, lets a busy machine slow both alike. Returns one row per size with
    the median batch bandwidth of each (bytes/s) and the median of the per-round ratios.
    """
    import transports
    from qlink.memory import RemoteRegion

    sizes = list(sizes)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_put_target_child, args=(loopback_url(scheme, tag="bench-put"), q, max(sizes), 0), daemon=True)
    p.start()
    rows = []
    clock = time.perf_counter_ns
    try:
        url = wait_ready(q, p, "benchmark's peer", timeout_s=60)
        with transports.connect(url, timeout_s=30) as ep, pinned(0):
            remote = RemoteRegion.from_bytes(ep.recv(timeout_s=30))
            src = np.random.default_rng(1).integers(0, 256, max(sizes), dtype=np.uint8)
            dst = np.empty_like(src)
            np.copyto(dst, src)  # fault every page in before timing
            for nbytes in sizes:
                count = int(max(1, min(max(1000, _MIN_BATCH_NBYTES // nbytes), budget_bytes // (nbytes * repeats))))
                view, copy_to = src[:nbytes], dst[:nbytes]
                put_rates, copy_rates = [], []
                for _ in range(repeats + 1):
                    t0 = clock()
                    for _i in range(count):
                        np.copyto(copy_to, view)
                    copy_rates.append(nbytes * count / (max(clock() - t0, 1) / 1e9))
                    ep.send(str(count).encode(), timeout_s=30)
                    t0 = clock()
                    for i in range(count):
                        ep.put(view, remote, offset=0, notify_id=i, timeout_s=60)
                    ep.recv(timeout_s=120)
                    put_rates.append(nbytes * count / (max(clock() - t0, 1) / 1e9))
                ratios = [pr / cr for pr, cr in zip(put_rates[1:], copy_rates[1:])]
                rows.append({"nbytes": nbytes, "puts_per_batch": count,
                             "bandwidth_Bps": float(np.median(put_rates[1:])),
                             "memcpy_Bps": float(np.median(copy_rates[1:])),
                             "x_memcpy_median_of_rounds": float(np.median(ratios))})
            ep.send(b"bye", timeout_s=30)
        p.join(30)
        return rows
    finally:
        if p.is_alive():
            p.kill()
        p.join(5)


def _try(label: str, fn: Callable, errors: list):
    try:
        return fn()
    except Exception as e:  # a missing stack or a failing peer is reported, not fatal
        errors.append(f"{label}: {type(e).__name__}: {e}")
        return None


def run_transport_bench(*, schemes=("shm", "tcp", "ucx"), nbytes: int = 64, num_round_trips: int = 20000,
                        put_sizes=DEFAULT_PUT_SIZES, put_schemes=("shm",), progress: Callable[[str], None] = print
                        ) -> dict:
    """Run the whole transport benchmark; returns ``{"round_trip": rows, "bandwidth": rows, "errors": [...]}``."""
    from . import floor, peers

    errors: list[str] = []
    rt_rows: list[dict] = []

    def add(case: str, kind: str, samples):
        if samples is not None:
            rt_rows.append({"case": case, "kind": kind, "nbytes": nbytes, **summarize_ns(samples)})

    progress("floor: two processes spinning on a word in shared memory")
    add("floor (shm spin)", "floor", _try("floor", lambda: floor.spin_round_trip_ns(num_round_trips=num_round_trips, warmup=2000), errors))
    for s in schemes:
        progress(f"{s}: {nbytes} B round trip through qlink transports")
        add(f"qlink {s}", "transport", _try(s, lambda s=s: round_trip_ns(s, nbytes=nbytes, num_round_trips=num_round_trips), errors))
    progress("peer: plain Python TCP sockets")
    add("python socket (tcp)", "peer", _try("socket", lambda: peers.socket_round_trip_ns(nbytes=nbytes, num_round_trips=min(num_round_trips, 5000), warmup=500), errors))
    progress("peer: UCXX asyncio API used directly")
    add("ucxx asyncio (direct)", "peer", _try("ucxx", lambda: peers.ucxx_asyncio_round_trip_ns(nbytes=nbytes, num_round_trips=min(num_round_trips, 2000), warmup=200), errors))

    floor_p50 = next((r["p50_us"] for r in rt_rows if r["kind"] == "floor"), float("nan"))
    ucxx_p50 = next((r["p50_us"] for r in rt_rows if r["case"].startswith("ucxx")), float("nan"))
    for r in rt_rows:
        r["x_floor_p50"] = ratio(r["p50_us"], floor_p50)
        r["ucxx_asyncio_over_this"] = ratio(ucxx_p50, r["p50_us"])

    bw_rows: list[dict] = []
    for s in put_schemes:
        progress(f"{s}: one-sided put bandwidth {min(put_sizes)}..{max(put_sizes)} B, each round beside a memcpy")
        res = _try(f"put {s}", lambda s=s: put_bandwidth(s, sizes=put_sizes), errors) or []
        for row in res:
            if not any(r["case"] == "numpy memcpy" and r["nbytes"] == row["nbytes"] for r in bw_rows):
                bw_rows.append({"nbytes": row["nbytes"], "case": "numpy memcpy",
                                "GBps": round(row["memcpy_Bps"] / 1e9, 3), "x_memcpy": 1.0})
            bw_rows.append({"nbytes": row["nbytes"], "case": f"qlink {s} put",
                            "GBps": round(row["bandwidth_Bps"] / 1e9, 3),
                            "x_memcpy": round(row["x_memcpy_median_of_rounds"], 3)})
    bw_rows.sort(key=lambda r: (r["nbytes"], r["case"]))
    goals = transport_goals(rt_rows, bw_rows)
    return {"round_trip": rt_rows, "bandwidth": bw_rows, "goals": goals, "errors": errors}


#: The figures the transport core aims for (shm against its floor and its peers).
GOAL_SHM_P50_X_FLOOR = 1.5
GOAL_SHM_P99_US = 4.0
GOAL_UCXX_OVER_SHM = 50.0
GOAL_PUT_X_MEMCPY = 0.70


def transport_goals(rt_rows: list[dict], bw_rows: list[dict]) -> list[dict]:
    """One row per goal: the figure measured in this run, the goal, and whether it was met.

    >>> rt = [{"case": "qlink shm", "p50_us": 1.2, "p99_us": 3.0, "x_floor_p50": 1.3,
    ...        "ucxx_asyncio_over_this": 180.0}]
    >>> bw = [{"case": "qlink shm put", "nbytes": 4096, "x_memcpy": 0.9}]
    >>> [(g["goal"], g["met"]) for g in transport_goals(rt, bw)]  # doctest: +NORMALIZE_WHITESPACE
    [('shm p50 <= 1.5 x floor p50', True), ('shm p99 <= 4.0 us', True),
     ('UCXX asyncio p50 >= 50 x shm p50', True), ('shm put >= 0.7 x memcpy at 4096 B', True)]
    """
    out: list[dict] = []
    shm = next((r for r in rt_rows if r["case"] == "qlink shm"), None)

    def add(goal: str, measured, target: float, higher_is_better: bool) -> None:
        met = None if measured is None or measured != measured else (
            measured >= target if higher_is_better else measured <= target)
        out.append({"goal": goal, "measured": measured, "target": target, "met": met})

    add(f"shm p50 <= {GOAL_SHM_P50_X_FLOOR} x floor p50", shm and shm.get("x_floor_p50"), GOAL_SHM_P50_X_FLOOR, False)
    add(f"shm p99 <= {GOAL_SHM_P99_US} us", shm and shm.get("p99_us"), GOAL_SHM_P99_US, False)
    add(f"UCXX asyncio p50 >= {GOAL_UCXX_OVER_SHM:g} x shm p50", shm and shm.get("ucxx_asyncio_over_this"),
        GOAL_UCXX_OVER_SHM, True)
    for r in bw_rows:
        if r["case"] == "qlink shm put":
            add(f"shm put >= {GOAL_PUT_X_MEMCPY} x memcpy at {r['nbytes']} B", r.get("x_memcpy"), GOAL_PUT_X_MEMCPY, True)
    return out
