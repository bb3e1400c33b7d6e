"""``qlink bench kv``: KV-cache transfer bandwidth between two processes, beside its floor and peers.

For a request of N tokens (all layers, K and V) of a preset model (Llama-3-8B by
default: 131,072 B per token, so 512 / 4096 / 32768 tokens are 64 MiB / 512 MiB / 4 GiB),
in one run:

* **qlink** — a :class:`~qlink.ai.KVReceiver` here, a :class:`~qlink.ai.KVSender` in a
  spawned process, over each transport asked for (one-sided put where the transport has
  it); time from the sender's submit to the receiver's last layer ready
  (``TransferRecord.submit_to_last_us``, one host's monotonic clock). Over ``shm`` a layer
  is one ``put_many`` and, by default, deferred: the sender posts the descriptors and the
  receiver copies the blocks out of the sender's cache while it waits for them
  (``moved_by`` says which side copied: the receiver's ``pulled_bytes`` grew by the
  request's bytes, or not);
* **NIXL** — the same blocks moved by NIXL's UCX backend between two processes
  (:mod:`qlink.ai.nixl_backend`, its own process pair after the others);
* **floor** — a NumPy copy of the same bytes here, layer by layer between distinct
  memfd-backed buffers (one layer's K+V per copy, as the engine moves them; at most
  ``FLOOR_NBYTES`` of buffers, cycled when a request is larger, each layer still far
  beyond any CPU cache then), timed in the receiving process right before every transfer
  round, so a busy machine slows both alike: each measured row's ``x_memcpy`` is the median
  of its rounds' ratios, and the floor row the median of every round's copy;
* **overhead** — ``zlib.crc32`` over the same per-layer buffers: what end-to-end
  checksums (``KVSender(checksum=True)``) add on each side, beside the memcpy floor;
* **modeled** — the same bytes over NVLink 4, PCIe 5 x16 and a 400 Gb/s NIC from
  :mod:`qlink.links` (``basis="modeled"``, never measured).

Block lists are ``contiguous`` (one descriptor per layer) and/or ``scattered`` (a random
permutation: one descriptor per block and plane), so the per-block cost of descriptor
preparation and submission shows (``prep_us_per_block``, ``submit_us_per_block``:
amortized over layers x planes x blocks; submission is what the sender's thread spends
issuing the layers: with a copy at submission it includes the copy, with deferred puts
and NIXL it does not). Every measured row also carries its ratio to the memcpy floor of
the same size.

**Goals** (:func:`kv_goals`, one row each: ``goal``, ``measured``, ``target``, ``met``; the
CLI prints them and writes ``kv_goals.{json,csv}``): at each token count and block pattern,
qlink over ``shm`` at least ``GOAL_SHM_X_MEMCPY`` (0.8) x the memcpy of the same bytes and
at least NIXL's UCX backend moving the same blocks (``measured`` = shm / NIXL bandwidth,
target 1), and descriptor preparation + submission over ``shm`` at most
``GOAL_PREP_SUBMIT_US_PER_BLOCK`` (1 us) per block, amortized. ``met`` is None where a
figure is missing (NIXL not installed, a transport skipped).

Memory: each of the two processes holds one cache sized for the largest N that fits
``memory_budget_nbytes`` (both caches together); a larger N is reported as skipped. The
floor's buffers (``FLOOR_NBYTES``, 1 GiB at most) come on top, in the receiving process.
32,768 tokens of Llama-3-8B need 4 GiB per process, 8 GiB in all: inside the default
10 GiB budget, 9 GiB with the floor, inside a 24 GiB machine with room to spare.

On a 2-core machine the sender and the receiver each busy-poll a core during a transfer.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import numpy as np

from ._stats import ratio

__all__ = ["run_kv_bench", "kv_goals", "memcpy_layers_s", "crc32_layers_s", "modeled_rows", "main_from_cli",
           "LINK_NAMES", "FLOOR_NBYTES", "GOAL_SHM_X_MEMCPY", "GOAL_SHM_X_NIXL", "GOAL_PREP_SUBMIT_US_PER_BLOCK"]

# Modeled links, from the cited catalog in qlink.links: NVLink 4 (900 GB/s bidirectional,
# 450 GB/s per direction), PCIe 5.0 x16 (~64 GB/s per direction), a 400 Gb/s NIC (50 GB/s).
LINK_NAMES = {"nvlink4": "NVLink 4 (modeled)", "pcie5-x16": "PCIe 5 x16 (modeled)", "ib-ndr": "400 Gb/s NIC (modeled)"}

#: What qlink's KV movement aims for (see the module docstring).
GOAL_SHM_X_MEMCPY = 0.8
GOAL_SHM_X_NIXL = 1.0
GOAL_PREP_SUBMIT_US_PER_BLOCK = 1.0
#: Source and destination buffers of the memcpy floor together, at most.
FLOOR_NBYTES = 1 << 30


class _MemcpyFloor:
    """Layer-sized NumPy copies between distinct memfd-backed buffers, for timing beside
    each transfer round: two buffers of ``FLOOR_NBYTES / 2`` carved into layer slots (as
    many distinct slots as fit, up to one per layer; cycled when the request is larger)."""

    def __init__(self, *, max_layer_nbytes: int, num_layers: int, total_nbytes: int = FLOOR_NBYTES):
        from qlink.memory import alloc

        side = max(max_layer_nbytes, min(num_layers * max_layer_nbytes, total_nbytes // 2))
        self.src = alloc(side, dtype=np.uint8)
        self.dst = alloc(side, dtype=np.uint8)
        self.src.fill(1)  # fault every page in before timing
        self.dst.fill(0)

    def copy_s(self, *, layer_nbytes: int, num_layers: int) -> float:
        """Seconds to copy ``num_layers`` layers of ``layer_nbytes``, one NumPy copy each.

        >>> f = _MemcpyFloor(max_layer_nbytes=1 << 16, num_layers=4)
        >>> f.copy_s(layer_nbytes=1 << 12, num_layers=4) > 0
        True
        """
        slots = max(1, min(num_layers, self.src.size // layer_nbytes))
        src, dst = self.src, self.dst
        t0 = time.perf_counter_ns()
        for k in range(num_layers):
            at = (k % slots) * layer_nbytes
            np.copyto(dst[at:at + layer_nbytes], src[at:at + layer_nbytes])
        return (time.perf_counter_ns() - t0) / 1e9


def memcpy_layers_s(*, layer_nbytes: int, num_layers: int, repeats: int = 3) -> float:
    """Median seconds to copy ``num_layers`` distinct source buffers of ``layer_nbytes`` into
    ``num_layers`` distinct destinations with NumPy: the same bytes, buffers and page
    footprint as one request moved layer by layer (no cache-hot reuse of one pair)."""
    from qlink.memory import alloc

    src = [alloc(layer_nbytes, dtype=np.uint8) for _ in range(num_layers)]
    dst = [alloc(layer_nbytes, dtype=np.uint8) for _ in range(num_layers)]
    for s, d in zip(src, dst):  # fault every page in before timing
        s.fill(1)
        d.fill(0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for s, d in zip(src, dst):
            np.copyto(d, s)
        times.append((time.perf_counter_ns() - t0) / 1e9)
    return float(np.median(times))


def crc32_layers_s(*, layer_nbytes: int, num_layers: int, repeats: int = 3) -> float:
    """Median seconds for ``zlib.crc32`` over ``num_layers`` distinct ``layer_nbytes`` buffers:
    what ``KVSender(checksum=True)`` adds on each side of a request of that size.

    >>> crc32_layers_s(layer_nbytes=1 << 16, num_layers=2, repeats=1) > 0
    True
    """
    import zlib

    from qlink.memory import alloc

    bufs = [alloc(layer_nbytes, dtype=np.uint8) for _ in range(num_layers)]
    for b in bufs:
        b.fill(1)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for b in bufs:
            zlib.crc32(b)
        times.append((time.perf_counter_ns() - t0) / 1e9)
    return float(np.median(times))


def modeled_rows(nbytes: int, *, tokens: int, memcpy_GBps: float | None = None) -> list[dict]:
    """Modeled transfer of ``nbytes`` over the links of :data:`LINK_NAMES` (one message)."""
    from qlink.links import LINKS

    rows = []
    for key, label in LINK_NAMES.items():
        link = LINKS[key]
        t_s = link.transfer_time_ns(nbytes) / 1e9
        gbps = nbytes / t_s / 1e9
        rows.append({"case": label, "basis": "modeled", "tokens": tokens, "nbytes": nbytes, "pattern": "",
                     "p50_ms": round(t_s * 1e3, 3), "GBps": round(gbps, 2),
                     "x_memcpy": ratio(gbps, memcpy_GBps) if memcpy_GBps else None, "source": link.citation})
    return rows


def _blocks(pattern: str, nblocks: int, capacity: int, rng) -> tuple[np.ndarray, np.ndarray]:
    if pattern == "contiguous":
        ids = np.arange(nblocks)
        return ids, ids
    if pattern == "scattered":
        return rng.permutation(capacity)[:nblocks], rng.permutation(capacity)[:nblocks]
    raise ValueError(f"pattern must be 'contiguous' or 'scattered', got {pattern!r}")


def _measure_backend(scheme: str, backend: str, spec, token_list, patterns, repeats: int, say,
                     floor: _MemcpyFloor, copies_s: dict) -> list[dict]:
    """Transfer rounds of one backend, each right after a memcpy of the same bytes here
    (its seconds go into ``copies_s[tokens]``)."""
    from qlink.ai.peer import open_link

    rows = []
    rng = np.random.default_rng(7)
    with open_link(scheme, spec, seed=0, backend=backend, fill="touch") as (rx, cache, peer):
        for a in cache.layers:  # fault the receiver's pages in before any timing
            a.view(np.uint8).fill(0)
        rid = 0
        for n_tokens in token_list:
            nblocks = spec.blocks_for(num_tokens=n_tokens)
            layer_nbytes = 2 * nblocks * spec.block_nbytes
            for pattern in patterns:
                src, dst = _blocks(pattern, nblocks, spec.num_blocks, rng)
                times_us, subs, pulled, ratios, copy_gbps = [], [], [], [], []
                for rep in range(repeats + 1):  # the first is a warm-up
                    rid += 1
                    copy_s = floor.copy_s(layer_nbytes=layer_nbytes, num_layers=spec.num_layers)
                    before = _pulled_bytes(rx)
                    sub, rec = peer.transfer(rx, rid, src, dst, timeout_s=600)
                    if rep:
                        times_us.append(rec.submit_to_last_us)
                        subs.append(sub)
                        pulled.append(_pulled_bytes(rx) - before >= rec.nbytes)
                        copies_s.setdefault(n_tokens, []).append(copy_s)
                        copy_gbps.append(rec.nbytes / copy_s / 1e9)
                        ratios.append((rec.nbytes / (rec.submit_to_last_us * 1e3)) / copy_gbps[-1])
                nbytes = rec.nbytes
                t_us = float(np.median(times_us))
                gbps = nbytes / (t_us * 1e3)
                blocks = 2 * nblocks * spec.num_layers
                label = "NIXL UCX" if backend == "nixl" else f"qlink {scheme} {sub.mode}"
                rows.append({
                    "case": label, "basis": "measured", "tokens": n_tokens, "nbytes": nbytes, "pattern": pattern,
                    "p50_ms": float(f"{t_us / 1e3:.4g}"), "GBps": float(f"{gbps:.4g}"),
                    "x_memcpy": float(f"{np.median(ratios):.3g}"),
                    "memcpy_GBps": float(f"{np.median(copy_gbps):.4g}"),
                    "num_descs": rec.num_descs, "transport": rec.transport,
                    "moved_by": "NIXL" if backend == "nixl" else "receiver" if all(pulled) else "sender",
                    "prep_us_per_block": round(float(np.median([s.plan_us for s in subs])) / blocks, 4),
                    "submit_us_per_block": round(float(np.median([s.submit_us for s in subs])) / blocks, 4),
                    "repeats": repeats,
                })
                say(f"  {label:<18} {n_tokens:>6} tok {pattern:<10} {gbps:7.2f} GB/s  {rec.num_descs} descriptors  "
                    f"x{np.median(ratios):.2f} memcpy")
    return rows


def _pulled_bytes(rx) -> int:
    """Bytes the receiver's endpoint has copied out of the sender's memory (deferred puts)."""
    ep = getattr(rx, "endpoint", None)
    return int(ep.statistics().extra.get("pulled_bytes", 0)) if ep is not None else 0


def run_kv_bench(*, transports: Iterable[str] = ("shm", "tcp", "ucx"), tokens: Iterable[int] = (512, 4096, 32768),
                 preset: str = "llama-3-8b", repeats: int = 3, patterns: Iterable[str] = ("contiguous", "scattered"),
                 nixl: bool = True, memory_budget_nbytes: int = 10 << 30,
                 progress: Callable[[str], None] = print) -> list[dict]:
    """Measure KV transfers of ``tokens``-token requests (see the module docstring); one dict per row.

    Rows carry ``case``, ``basis`` (measured / floor / overhead / modeled / skipped / error), ``tokens``,
    ``nbytes``, ``pattern``, ``p50_ms``, ``GBps``, ``x_memcpy`` and, when measured,
    ``num_descs``, ``transport``, ``moved_by``, ``prep_us_per_block``, ``submit_us_per_block``.
    """
    from qlink.ai import preset as _preset
    from qlink.ai.peer import transport_unavailable

    base = _preset(preset)
    token_list = sorted(set(int(t) for t in tokens))
    if not token_list or token_list[0] <= 0:
        raise ValueError(f"tokens must be positive integers, got {tokens!r}")
    patterns = tuple(patterns)
    per_cache = memory_budget_nbytes // 2
    fits = [t for t in token_list if base.kv_nbytes(num_tokens=t) <= per_cache]
    rows: list[dict] = []
    for t in token_list:
        if t not in fits:
            rows.append({"case": "all", "basis": "skipped", "tokens": t, "nbytes": base.kv_nbytes(num_tokens=t),
                         "note": f"two caches of {base.kv_nbytes(num_tokens=t) / 2**30:.1f} GiB exceed "
                                 f"memory_budget_nbytes={memory_budget_nbytes}"})
    if not fits:
        return rows
    spec = base.with_blocks(base.blocks_for(num_tokens=fits[-1]))
    progress(f"KV bench: {preset}, {spec.bytes_per_token} B/token, caches of {spec.nbytes / 2**20:.0f} MiB "
             f"in each of two processes")

    backends = [(s, "transport") for s in transports]
    if nixl:
        backends.append((None, "nixl"))
    floor = _MemcpyFloor(max_layer_nbytes=base.kv_nbytes(num_tokens=fits[-1]) // spec.num_layers,
                         num_layers=spec.num_layers)
    copies_s: dict[int, list[float]] = {}
    measured: list[dict] = []
    for scheme, backend in backends:
        if backend == "nixl":
            from qlink.ai.nixl_backend import nixl_available

            scheme = next((s for s in ("shm", "tcp") if not transport_unavailable(s)), None)
            why = None if nixl_available() else "nixl-cu12 is not installed"
            why = why or (None if scheme else "no shm/tcp transport to carry the NIXL handshake")
            name = "NIXL UCX"
        else:
            why = transport_unavailable(scheme)
            name = f"qlink {scheme}"
        if why:
            measured.append({"case": name, "basis": "skipped", "note": why})
            progress(f"  {name}: skipped ({why})")
            continue
        progress(f"{name}: {', '.join(map(str, fits))} tokens, {repeats} repeats + 1 warm-up, each beside a memcpy")
        try:
            measured.extend(_measure_backend(scheme, backend, spec, fits, patterns, repeats, progress, floor,
                                             copies_s))
        except Exception as e:  # a failing backend is reported in the rows, the others still run
            measured.append({"case": name, "basis": "error", "note": f"{type(e).__name__}: {e}"})
            progress(f"  {name}: error {type(e).__name__}: {e}")

    for t in fits:
        nb = base.kv_nbytes(num_tokens=t)
        layer_nbytes = nb // spec.num_layers
        samples = copies_s.get(t) or [floor.copy_s(layer_nbytes=layer_nbytes, num_layers=spec.num_layers)
                                      for _ in range(max(repeats, 3))]  # nothing measured: the floor alone
        s = float(np.median(samples))
        memcpy_GBps = nb / s / 1e9
        rows.append({"case": "numpy memcpy", "basis": "floor", "tokens": t, "nbytes": nb, "pattern": "per layer",
                     "p50_ms": round(s * 1e3, 3), "GBps": round(memcpy_GBps, 3), "x_memcpy": 1.0,
                     "repeats": len(samples)})
    del floor  # its buffers go before the checksum buffers come
    for t in fits:
        nb = base.kv_nbytes(num_tokens=t)
        memcpy_GBps = next(r["GBps"] for r in rows if r["basis"] == "floor" and r["tokens"] == t)
        c = crc32_layers_s(layer_nbytes=nb // spec.num_layers, num_layers=spec.num_layers, repeats=max(repeats, 3))
        rows.append({"case": "CRC-32 (checksum=True, each side)", "basis": "overhead", "tokens": t, "nbytes": nb,
                     "pattern": "per layer", "p50_ms": round(c * 1e3, 3), "GBps": round(nb / c / 1e9, 3),
                     "x_memcpy": ratio(nb / c / 1e9, memcpy_GBps)})
        rows.extend(modeled_rows(nb, tokens=t, memcpy_GBps=memcpy_GBps))
    return rows + measured


def kv_goals(rows: list[dict]) -> list[dict]:
    """One row per goal of the module docstring: the figure measured in this run, the goal,
    and whether it was met (None where a figure is missing).

    >>> rows = [{"case": "qlink shm put", "basis": "measured", "tokens": 512, "pattern": "scattered",
    ...          "GBps": 9.0, "x_memcpy": 0.85, "prep_us_per_block": 0.01, "submit_us_per_block": 0.02},
    ...         {"case": "NIXL UCX", "basis": "measured", "tokens": 512, "pattern": "scattered", "GBps": 6.0}]
    >>> [(g["goal"], g["measured"], g["met"]) for g in kv_goals(rows)]  # doctest: +NORMALIZE_WHITESPACE
    [('shm >= 0.8 x memcpy at 512 tokens (scattered)', 0.85, True),
     ('shm >= NIXL UCX at 512 tokens (scattered)', 1.5, True),
     ('shm prep + submit <= 1 us/block at 512 tokens (scattered)', 0.03, True)]
    """
    out: list[dict] = []

    def add(goal: str, measured, target: float, higher_is_better: bool) -> None:
        ok = measured is not None and measured == measured
        met = None if not ok else (measured >= target if higher_is_better else measured <= target)
        out.append({"goal": goal, "measured": measured if ok else None, "target": target, "met": met})

    def find(case_start: str, t, pattern):
        return next((r for r in rows if r.get("basis") == "measured" and r["case"].startswith(case_start)
                     and r.get("tokens") == t and r.get("pattern") == pattern), None)

    keys = sorted({(r["tokens"], r["pattern"]) for r in rows
                   if r.get("basis") == "measured" and r.get("pattern") and r.get("tokens") is not None})
    for t, pattern in keys:
        shm, nixl = find("qlink shm", t, pattern), find("NIXL", t, pattern)
        where = f"at {t} tokens ({pattern})"
        add(f"shm >= {GOAL_SHM_X_MEMCPY:g} x memcpy {where}", shm and shm.get("x_memcpy"), GOAL_SHM_X_MEMCPY, True)
        add(f"shm >= NIXL UCX {where}", ratio(shm["GBps"], nixl["GBps"]) if shm and nixl else None,
            GOAL_SHM_X_NIXL, True)
        per_block = None if shm is None else round(shm["prep_us_per_block"] + shm["submit_us_per_block"], 4)
        add(f"shm prep + submit <= {GOAL_PREP_SUBMIT_US_PER_BLOCK:g} us/block {where}", per_block,
            GOAL_PREP_SUBMIT_US_PER_BLOCK, False)
    return out


def main_from_cli(args, *, say: Callable[[str], None] = print) -> list[dict]:
    """``qlink bench kv [--quick] [--out DIR]``: run, print a table, write JSON/CSV."""
    from pathlib import Path

    from .report import format_table, write_results

    quick = bool(getattr(args, "quick", False))
    tokens = (512, 4096) if quick else (512, 4096, 32768)
    repeats = 2 if quick else 3
    rows = run_kv_bench(tokens=tokens, repeats=repeats, progress=say)
    goals = kv_goals(rows)
    out = Path(getattr(args, "out", "results/bench"))
    meta = {"tokens": list(tokens), "repeats": repeats, "preset": "llama-3-8b"}
    write_results(rows, out_dir=out, name="kv", meta=meta)
    write_results(goals, out_dir=out, name="kv_goals", meta=meta)
    cols = ["case", "basis", "tokens", "pattern", "GBps", "x_memcpy", "p50_ms", "num_descs", "moved_by",
            "prep_us_per_block", "submit_us_per_block", "note"]
    print("\nKV-cache transfer, Llama-3-8B layout, two processes (modeled rows are link models, not measurements)")
    print(format_table(rows, columns=cols))
    print("\nKV goals (measured in this run; met is empty where a figure is missing)")
    print(format_table(goals))
    print(f"\nwritten: {out}/kv.{{json,csv}}, {out}/kv_goals.{{json,csv}}")
    return rows
