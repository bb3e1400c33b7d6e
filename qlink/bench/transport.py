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

from ._procs import die_with_parent, pin_to_cpu, pinned
from ._stats import ratio, summarize_ns

__all__ = ["run_transport_bench", "round_trip_ns", "put_bandwidth", "DEFAULT_PUT_SIZES"]

DEFAULT_PUT_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
_MIN_BATCH_NBYTES = 64 << 20  # each timed batch of puts moves at least this much, as each memcpy timing does
_ACK = b"k"


def _url_for(scheme: str, tag: str) -> str:
    if scheme in ("tcp", "ucx", "udp"):
        return f"{scheme}://127.0.0.1:0"
    import os

    return f"{scheme}://bench-{tag}-{os.getpid()}"


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
    p = ctx.Process(target=_echo_child, args=(_url_for(scheme, "rt"), q, nbytes, num_round_trips + warmup), daemon=True)
    p.start()
    try:
        url = q.get(timeout=60)
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
    """Put bandwidth into a registered remote region: for each size, ``repeats`` batches of
    puts (at least 64 MiB each, within ``budget_bytes``), each batch timed from the first put
    until the target acknowledges the last notification, after one untimed warm-up batch.
    Returns one row per size with the median batch bandwidth (bytes/s)."""
    import transports
    from qlink.memory import RemoteRegion

    sizes = list(sizes)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_put_target_child, args=(_url_for(scheme, "put"), q, max(sizes), 0), daemon=True)
    p.start()
    rows = []
    try:
        url = q.get(timeout=60)
        with transports.connect(url, timeout_s=30) as ep, pinned(0):
            remote = RemoteRegion.from_bytes(ep.recv(timeout_s=30))
            src = np.random.default_rng(1).integers(0, 256, max(sizes), dtype=np.uint8)
            for nbytes in sizes:
                count = int(max(1, min(max(1000, _MIN_BATCH_NBYTES // nbytes), budget_bytes // (nbytes * repeats))))
                view = src[:nbytes]
                rates = []
                for _ in range(repeats + 1):
                    ep.send(str(count).encode(), timeout_s=30)
                    t0 = time.perf_counter_ns()
                    for i in range(count):
                        ep.put(view, remote, offset=0, notify_id=i, timeout_s=60)
                    ep.recv(timeout_s=120)
                    dt = time.perf_counter_ns() - t0
                    rates.append(nbytes * count / (dt / 1e9))
                rows.append({"nbytes": nbytes, "puts_per_batch": count, "bandwidth_Bps": float(np.median(rates[1:]))})
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
    for nb in put_sizes:
        progress(f"memcpy floor: {nb} B")
        rate = _try("memcpy", lambda nb=nb: floor.memcpy_bandwidth(nb, repeats=7, reduce="median"), errors)
        bw_rows.append({"nbytes": nb, "case": "numpy memcpy", "GBps": None if rate is None else round(rate / 1e9, 3)})
    for s in put_schemes:
        progress(f"{s}: one-sided put bandwidth {min(put_sizes)}..{max(put_sizes)} B")
        res = _try(f"put {s}", lambda s=s: put_bandwidth(s, sizes=put_sizes), errors) or []
        for row in res:
            bw_rows.append({"nbytes": row["nbytes"], "case": f"qlink {s} put", "GBps": round(row["bandwidth_Bps"] / 1e9, 3)})
    memcpy = {r["nbytes"]: r["GBps"] for r in bw_rows if r["case"] == "numpy memcpy"}
    for r in bw_rows:
        base = memcpy.get(r["nbytes"])
        r["x_memcpy"] = ratio(r["GBps"], base) if (r["GBps"] is not None and base) else None
    bw_rows.sort(key=lambda r: (r["nbytes"], r["case"]))
    return {"round_trip": rt_rows, "bandwidth": bw_rows, "errors": errors}
