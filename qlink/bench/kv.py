"""``qlink bench kv``: KV-cache transfer bandwidth between two processes, beside its floor and peers.

For a request of N tokens (all layers, K and V) of a preset model (Llama-3-8B by
default: 131,072 B per token, so 512 / 4096 / 32768 tokens are 64 MiB / 512 MiB / 4 GiB),
in one run:

* **qlink** — a :class:`~qlink.ai.KVReceiver` here, a :class:`~qlink.ai.KVSender` in a
  spawned process, over each transport asked for (one-sided put where the transport has
  it); time from the sender's submit to the receiver's last layer ready
  (``TransferRecord.submit_to_last_us``, one host's monotonic clock). Over ``shm`` a layer
  is one ``put_many`` and, by default, deferred: the sender posts the descriptors and the
  receiver copies the blocks out of the sender's cache while it waits for them, one C
  loop over the pieces straight into its cache, the only copy (``moved_by`` says which
  side copied: the receiver's ``pulled_bytes`` grew by the request's bytes, by part of them
  (``both``: ucx RMA's deferred puts, the share in ``read_by_receiver``), or not;
  ``pull_copy`` how the receiver copied: glibc's ``memcpy`` or the streaming copy,
  whichever its own large pulls have shown faster on this host, with both rates; over
  ``tcp``, ``tcp_way`` how the sender sent a layer: its pages lent to the socket by splice
  or copied by ``sendmsg``, as this host measured it between two processes when the bench
  began, with both rates: :func:`transports.tcp.deferred_put_way`); qlink's tcp is also
  taken the other way (``QLINK_TCP_SPLICE``), as Mooncake is at both its slice sizes: that
  measurement takes one minute of a host whose loopback rate moves by 2 x over tens of
  seconds, and it chose splice in slow minutes where the copy won the rest of the run;
* **NIXL** — the same blocks moved by NIXL's UCX backend between two processes, set up
  as vLLM's ``NixlConnector`` runs it (:mod:`qlink.ai.nixl_backend`): UCX choosing its own
  transports, one registered region per layer cache, descriptor lists of every block
  prepared once, the decode side pulling a whole request with ONE prepared ``READ``
  (``make_prepped_xfer``) and a notification, the progress thread pausing 100 µs between
  progress calls (NIXL's Python API busy-polls a core with 0) and the thread's CPU
  affinity restored after NIXL's start-up pinned it; the moved bytes are checked. NIXL's
  receiving side runs in a process of its own that never loaded UCXX, and no UCXX option
  reaches it: with ``UCX_RNDV_THRESH=8192`` (UCXX's import sets it) NIXL's reads fell from
  zero-copy CMA to software emulation over TCP, 5-7 x slower (``ucx_env`` in its rows
  says what UCX options it read). qlink's ucx is taken three ways: as shipped (RMA between two
  processes of one host, the pieces moved by qlink itself by CMA, up to 1024 per
  ``process_vm_writev``/``readv``: :mod:`transports._ucx_cma`), with RMA whose every piece is
  UCX's, one call each, as NIXL's are (``QLINK_UCX_RMA=1 QLINK_UCX_CMA=0``), and with no RMA
  (``QLINK_UCX_RMA=0``: tagged messages); ``rma_pieces_by`` says which;
* **Mooncake** — the Mooncake Transfer Engine over TCP with ``P2PHANDSHAKE`` metadata,
  one ``batch_transfer_sync_write`` of the request's merged block runs, at its default
  TCP slice size (64 KiB) and at the 1 MiB its users set (:mod:`._kv_mooncake`); where
  qlink's tcp is measured too, one Mooncake round at each slice size is taken right before
  each qlink tcp round (so ``tcp >= 2 x Mooncake`` compares the same minutes), else in a
  phase of its own; skipped, with the reason, where it cannot run (it needs libibverbs1,
  libnl-3-200 and libnl-route-3-200);
* **floor** — the same pieces (merged descriptors, same block layout) copied inside the
  receiver's warm cache, one C loop per layer with glibc's ``memcpy`` and with a streaming
  copy, the faster of the two, best of every round (one right before each transfer round
  of every backend; a copy taken up to 5 times in its round, until 0.3 s have gone): a busy
  moment never lowers it. Each layer is copied out of the layer half the cache away, so no
  source is still in the CPU's cache when it is written next (out of the *next* layer, each
  copy's destination was the previous copy's source, just read: the copy skipped a third of
  its memory traffic, and a 512-token contiguous floor read 1.75 x a copy out of a separate
  cache), and also out of a source apart from the receiver's cache, as the sender's is: a
  third cache where one fits (``memory_budget_nbytes`` beside the two caches, or the host's
  available memory with ``FLOOR_MARGIN_NBYTES`` to spare), else layer buffers of the
  sender's layout taken in turn, only where a copy reads enough of them before it reads the
  same bytes again that none is still in the CPU's cache (a copy out of the layer half the
  cache away read 15-25 % below one out of a separate buffer on the 2-core VM); the faster
  source counts;
* **TCP socket floor** — where ``tcp`` or Mooncake is measured: the same bytes, layer by
  layer, over a bare loopback TCP socket between two processes, with blocking calls, with
  busy-polling ones, and with the sender's pages spliced into the socket as qlink's deferred
  tcp puts do (:mod:`._kv_tcp_floor`), the fastest, best of its own rounds and of
  one round right before each qlink tcp transfer round (the host's loopback rate drifts by
  tens of per cent between minutes, so a floor taken only in its own phase set qlink's tcp
  rows against another minute's host); every TCP
  row carries ``x_tcp_floor``, its best round (Mooncake's: its median) over it. It bounds what
  the tcp goal can show: qlink at most this floor, so ``tcp >= 2 x Mooncake`` can hold only
  where Mooncake runs below half of it;
* **overhead** — ``zlib.crc32`` over the same per-layer buffers: what end-to-end
  checksums (``KVSender(checksum=True)``) add on each side, beside the memcpy floor;
* **modeled** — the same bytes over NVLink 4, PCIe 5 x16 and a 400 Gb/s NIC from
  :mod:`qlink.links` (``basis="modeled"``, never measured).

Block lists are ``contiguous`` (one descriptor per layer) and/or ``scattered`` (a random
permutation: one descriptor per block and plane), so the per-block cost of descriptor
preparation and submission shows (``prep_us_per_block``, ``submit_us_per_block``:
amortized over layers x planes x blocks; submission is what the sender's thread spends
issuing the layers: with a copy at submission it includes the copy, with deferred puts
it does not). Every measured row carries its ratio to the floor of the same tokens and
pattern (``x_memcpy``), every qlink row its ratio to NIXL (``x_nixl``) and to Mooncake's
faster slice size (``x_mooncake``), all from the same run.

Like for like: the floor is a best of rounds (a busy moment never lowers it), so
``x_memcpy`` sets each transfer's best round (``best_GBps``) against it, best against best,
not the transfer's median (``GBps``, ``p50_ms``) against the floor's best. The floor it is set
against is the best of the floor rounds taken beside that backend's own transfer rounds
(``floor_GBps_same_minutes``): the host's copy rate drifts between minutes (the same row's floor
read 4.6-5.4 GB/s between two runs), and a backend measured in a busy minute was otherwise set
against the quietest minute of a twelve-minute run. ``x_memcpy_run_best`` keeps the ratio to the
run's best floor round, and the floor rows report that best; ``x_memcpy_paired`` the median over
rounds of each round's best transfer over that round's own floor copy (the same seconds: what a
drifting host does to both sides cancels, where best against best can pick each side's luckiest
second and read above 1). A transfer is
taken in its round as many times as the floor's fastest kind of copy was in its round, for
no longer than that kind took (``transfers`` counts them): a best of 2 transfers set against
a best of dozens of copies read a 64 MiB request 5-10 % low, and a transfer given as many
samples as all four kinds of copy together had four times the chances of the copy it is set
against. The floor still has more samples (it takes a round before each transfer round of
every backend, and its best kind is the best of four), so the ratio still leans the floor's
way. Neither side's warm-up round is recorded. The cases (token counts x patterns) take
their rounds in turn, round 1 of every case, then round 2: slow spells of this shared host
last seconds, and with each case's rounds back to back one spell took every round of one
case (a 4096-token shm row read 0.60 x its floor in one run, 0.97 in the next, the transfers
of the low one all within five seconds). Between peers (``x_nixl``, ``x_mooncake``) medians
are set against medians.

**Goals** (:func:`kv_goals`, one row each: ``goal``, ``measured``, ``target``, ``met``; the
CLI prints them and writes ``kv_goals.{json,csv}``): at each token count and block pattern,
qlink over ``shm`` at least ``GOAL_SHM_X_MEMCPY`` (0.9) x the warm memcpy floor; qlink over
``ucx`` at least NIXL's UCX backend moving the same blocks between the same two processes;
qlink over ``tcp`` at least ``GOAL_TCP_X_MOONCAKE`` (2) x Mooncake over TCP; descriptor
preparation + submission over ``shm`` at most ``GOAL_PREP_SUBMIT_US_PER_BLOCK`` (1 us)
per block, amortized. ``met`` is None where a figure is missing (a peer not installed,
a transport skipped). A tcp goal row carries ``host_bound``, the bare socket's rate over
Mooncake's in the same run: where it is below 2, the row says that no TCP sender could have
met the goal on that host in that run.

Memory: each of the two processes holds one cache sized for the largest N that fits
``memory_budget_nbytes`` (both caches together); a larger N is reported as skipped.
32,768 tokens of Llama-3-8B need 4 GiB per process, 8 GiB in all: inside the default
10 GiB budget and a 24 GiB machine.

On a 2-core machine the sender and the receiver each busy-poll a core during a transfer,
except over ``shm``: there the sender posts the layers' descriptors (microseconds) and goes
back to waiting on its control pipe, and the receiver makes the one copy on its own core,
as the floor's single process does.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterable

import numpy as np

from ._stats import ratio

__all__ = ["run_kv_bench", "kv_goals", "memcpy_layers_s", "crc32_layers_s", "modeled_rows", "main_from_cli",
           "LINK_NAMES", "GOAL_SHM_X_MEMCPY", "GOAL_UCX_X_NIXL", "GOAL_TCP_X_MOONCAKE",
           "GOAL_PREP_SUBMIT_US_PER_BLOCK"]

# Modeled links, from the cited catalog in qlink.links: NVLink 4 (900 GB/s bidirectional,
# 450 GB/s per direction), PCIe 5.0 x16 (~64 GB/s per direction), a 400 Gb/s NIC (50 GB/s).
LINK_NAMES = {"nvlink4": "NVLink 4 (modeled)", "pcie5-x16": "PCIe 5 x16 (modeled)", "ib-ndr": "400 Gb/s NIC (modeled)"}

#: What qlink's KV movement aims for (see the module docstring).
GOAL_SHM_X_MEMCPY = 0.9
GOAL_UCX_X_NIXL = 1.0
GOAL_TCP_X_MOONCAKE = 2.0
GOAL_PREP_SUBMIT_US_PER_BLOCK = 1.0


class _Floor:
    """The memcpy floor of a request: the same pieces (the request's merged descriptors, the
    same block layout) copied into the receiving process's warm cache, each layer's pieces
    into this layer's destination pieces, in one C loop per layer
    (``transports._ringc.copy_pieces``) with glibc's ``memcpy`` and with the streaming
    (non-temporal) copy qlink's shm target may use, out of two sources:

    * the layer half the cache away (a distinct source region per layer, none read shortly
      before it is written: no cache-hot reuse);
    * a source apart from the receiver's cache, as a sender's is, where ``spare_nbytes`` holds
      one: a separate cache of the same size, or, where that does not fit, layer-sized
      buffers backed all through as a sender's cache is, each piece at its own source offset
      (one buffer per layer, or as many as fit, taken in turn, when a copy reads
      ``REUSE_MIN_NBYTES`` out of them before it reads the same bytes again: no cache-hot
      reuse either).

    The second source matters: on the 2-core EPYC VM a copy out of the layer half the cache
    away read 15-25 % below the same copy out of a separate buffer, round after round, and
    qlink's own pull (out of the sender's memory) read above a floor that had only the first.
    The floor is the fastest of these, best of every round (``best[(tokens, pattern)]``), so
    a busy moment never lowers it. ``last_copies`` is how many copies of *each kind* the last
    round made (the transfer beside it takes as many samples: a best of N against a best of
    N, where counting every kind's copies gave the transfer four times the floor's chances)."""

    #: each copy kind is repeated within a round until it has taken ROUND_S (at most
    #: MAX_COPIES_PER_ROUND times), and the transfer beside it as often: a 64 MiB request's
    #: floor is a best of 5 copies per round, a 512 MiB one's of 3, a 4 GiB one's of 1 (with
    #: 0.03 s and 3, a 512 MiB row was a best of 3 transfers in all, and two runs of the same
    #: code read it at 0.60 and 0.97 x its floor)
    ROUND_S = 0.3
    MAX_COPIES_PER_ROUND = 5
    #: source buffers taken in turn: a copy must read at least this much out of them (the
    #: CPU's last-level cache several times over) before it reads the same bytes again
    REUSE_MIN_NBYTES = 256 << 20

    def __init__(self, *, spare_nbytes: int = 0):
        self.best: dict[tuple, tuple[float, str]] = {}  # (tokens, pattern) -> (seconds, which copy)
        self.rounds: dict[tuple, int] = {}
        self.best_since_mark: dict[tuple, float] = {}  # the same, of the rounds since mark() (one backend's)
        self.last_copies, self.last_spent_s = 0, 0.0  # copies of each kind in the last round, the fastest's seconds
        self.spare_nbytes = int(spare_nbytes)
        self._shadow = None
        self._separate: list | None = None
        self._apart: list | None = None  # layer-sized buffers, every page faulted in

    def release(self) -> None:
        """Let the sources kept for the next request go (before a peer's processes take their
        memory); they are made again when next needed."""
        self._shadow = self._separate = self._apart = None

    def mark(self) -> None:
        """Start :attr:`best_since_mark` over: the floor of the rounds taken from here on, beside
        one backend's transfer rounds (the same minutes as its transfers)."""
        self.best_since_mark = {}

    def _separate_cache(self, layers: list) -> list | None:
        """A source cache apart from ``layers`` with the same layer sizes (made once, its pages
        faulted in), or None where it would not fit ``spare_nbytes``."""
        sizes = [v.size for v in layers]
        if self._separate is not None and [v.size for v in self._separate] == sizes:
            return self._separate
        self._separate = None
        if sum(sizes) > self.spare_nbytes:
            return None
        self._separate = [_faulted_in(n) for n in sizes]
        return self._separate

    def _apart_source(self, layer_nbytes: int, num_layers: int, read_nbytes: int = 0) -> list | None:
        """A source apart from the receiver's cache, in the sender's very layout, where a whole
        separate cache does not fit: buffers as large as a source layer, every page faulted in
        (a sender's cache is backed all through: its other blocks hold other requests' KV), each
        piece at its own source offset. One buffer per layer, or fewer (taken in turn) where
        all would not fit ``spare_nbytes``, as long as the bytes a copy reads out of them
        before it reads the same ones again (``read_nbytes`` a layer) pass ``REUSE_MIN_NBYTES``;
        None where even that does not fit. The buffers are kept for the next request.

        (The bytes read, not the buffers' span: 16 buffers of 128 MiB taken in turn for 32
        layers passed a span rule, yet a 512-token request reads 2 MiB of each, so every piece
        was read twice 32 MiB apart, the CPU's last-level cache still holding much of it. That
        floor read 13.69 GB/s at the median of six alternated rounds, against 12.53 for a
        separate cache of 32 layers, 512 tokens scattered on the 2-core EPYC VM; 15.98 against
        14.97 contiguous; at 4,096 tokens, 16 MiB a layer, the two were equal.)

        (Two sources were denser than a sender's, and read high: the pieces packed into pages
        of their own, 4-8 % faster at 512 tokens scattered; and the pieces at their own offsets
        with only the pages under them faulted in, the memory between them unbacked, 4 %
        faster at 512 tokens scattered on the 2-core EPYC VM, 13.28 against 12.72 GB/s at the
        median of six alternated rounds, the same at 512 contiguous.)

        >>> f = _Floor(spare_nbytes=1 << 20)
        >>> bufs = f._apart_source(65536, 4)
        >>> len(bufs), bufs[0].size, int(bufs[0].min()), len({id(b) for b in bufs})
        (4, 65536, 1, 4)
        >>> _Floor(spare_nbytes=4096)._apart_source(65536, 4) is None
        True
        >>> f = _Floor(spare_nbytes=2 * 65536)
        >>> f.REUSE_MIN_NBYTES = 131072  # (as if the last-level cache were 128 KiB / a few)
        >>> len(f._apart_source(65536, 4)), f._apart_source(65536, 4, read_nbytes=4096) is None
        (4, True)
        """
        count = min(num_layers, self.spare_nbytes // max(layer_nbytes, 1))
        read = min(int(read_nbytes) or layer_nbytes, layer_nbytes)
        if count < 1 or (count < num_layers and count * read < self.REUSE_MIN_NBYTES):
            self._apart = None
            return None
        bufs = self._apart if self._apart is not None and self._apart[0].size == layer_nbytes else []
        self._apart = None  # (the buffers dropped go before new ones are made)
        bufs = bufs[:count]
        while len(bufs) < count:
            bufs.append(_faulted_in(layer_nbytes))
        self._apart = bufs
        return [bufs[k % count] for k in range(num_layers)]

    def copy_s(self, cache, plan, *, key: tuple, record: bool = True) -> float:
        """Seconds of the fastest copy of ``plan``'s pieces into every layer of ``cache`` (each
        out of the layer half the cache away, and out of a source apart from the cache where
        one fits); recorded under ``key`` when it beats the best so far (``record`` False: a
        warm-up round, beside the transfer's own warm-up, counted in neither).

        >>> from qlink.ai import KVCache, preset
        >>> from qlink.ai import plan_transfer
        >>> spec = preset("tiny", num_blocks=8)
        >>> cache = KVCache.allocate(spec)
        >>> plan = plan_transfer([0, 3], [5, 1], src_num_blocks=8, dst_num_blocks=8, block_nbytes=spec.block_nbytes)
        >>> f = _Floor()
        >>> f.copy_s(cache, plan, key=(8, "scattered")) > 0, f.rounds[(8, "scattered")]
        (True, 1)
        """
        layers = [a.view(np.uint8).reshape(-1) for a in cache.layers]
        so = np.ascontiguousarray(plan.src_offsets, dtype=np.int64)
        do = np.ascontiguousarray(plan.dst_offsets, dtype=np.int64)
        ln = np.ascontiguousarray(plan.nbytes, dtype=np.int64)
        if len(layers) == 1:  # no other layer to copy from: one more buffer like it
            if self._shadow is None or self._shadow.size != layers[0].size:
                self._shadow = _faulted_in(layers[0].size)
            srcs = [self._shadow]
        else:  # half the cache away: never a source the CPU's cache still holds when it is written
            half = len(layers) // 2
            srcs = layers[half:] + layers[:half]
        sources = {"the layer half the cache away": (srcs, so)}
        separate = self._separate_cache(layers)
        if separate is not None:
            sources["a separate cache"] = (separate, so)
        else:
            apart = self._apart_source(layers[0].size, len(layers), int(ln.sum()))
            if apart is not None:
                sources["layers apart, in the sender's layout"] = (apart, so)
        times, counts, spent_by = {}, {}, {}
        for where, (srcs, offsets) in sources.items():
            for kind in ("memcpy", "streamed"):
                which, spent = f"{kind} copy out of {where}", 0.0
                for _ in range(self.MAX_COPIES_PER_ROUND):  # a short copy is taken a few times: one busy
                    t0 = time.perf_counter_ns()            # moment on a shared host must not set the figure
                    for src, dst in zip(srcs * len(layers), layers):
                        _copy_pieces(dst, src, offsets, do, ln, kind == "streamed")
                    t = (time.perf_counter_ns() - t0) / 1e9
                    times[which] = min(times.get(which, t), t)
                    counts[which] = counts.get(which, 0) + 1
                    spent += t
                    if spent >= self.ROUND_S:
                        break
                spent_by[which] = spent
        kind = min(times, key=times.get)
        self.last_copies, self.last_spent_s = counts[kind], spent_by[kind]
        if not record:
            return times[kind]
        self.best_since_mark[key] = min(self.best_since_mark.get(key, times[kind]), times[kind])
        self.rounds[key] = self.rounds.get(key, 0) + 1
        if key not in self.best or times[kind] < self.best[key][0]:
            self.best[key] = (times[kind], kind)
        return times[kind]


def _available_nbytes() -> int:
    """The memory this host can still give (``MemAvailable``; the free pages where that is
    not to be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


#: memory left to the host beside the bench's caches and the floor's separate cache
FLOOR_MARGIN_NBYTES = 4 << 30


def _floor_spare_nbytes(cache_nbytes: int, memory_budget_nbytes: int) -> int:
    """The memory the floor may take for a source apart from the receiver's cache: what the
    budget leaves beside the two caches, and at least a whole third cache (the sender's very
    layout: every layer its own memory) where the host has room for it beside the two and
    ``FLOOR_MARGIN_NBYTES``. (Fewer buffers taken in turn read some pieces twice: see
    :meth:`_Floor._apart_source`.)

    >>> _floor_spare_nbytes(1 << 20, 10 << 20)
    8388608
    """
    spare = memory_budget_nbytes - 2 * cache_nbytes
    if spare < cache_nbytes and _available_nbytes() >= 3 * cache_nbytes + FLOOR_MARGIN_NBYTES:
        spare = cache_nbytes
    return spare


def _faulted_in(nbytes: int, *, value: int = 1) -> np.ndarray:
    """``nbytes`` of :func:`qlink.memory.alloc` memory (as the KV caches are), every page
    faulted in (filled with ``value``) before anything is timed on it."""
    from qlink.memory import alloc

    buf = alloc(nbytes, dtype=np.uint8)
    buf.fill(value)
    return buf


def _copy_pieces(dst, src, so, do, ln, streaming: bool) -> None:
    try:
        from transports._ringc import copy_pieces
    except ImportError:  # no C extension built: NumPy per piece (slower: the floor is then lower)
        for a, b, n in zip(so.tolist(), do.tolist(), ln.tolist()):
            np.copyto(dst[b:b + n], src[a:a + n])
        return
    copy_pieces(dst, src, so, do, ln, streaming)


def memcpy_layers_s(*, layer_nbytes: int, num_layers: int, repeats: int = 3) -> float:
    """Best seconds of ``repeats`` rounds (after one untimed round: a warm destination) to
    copy ``num_layers`` distinct source buffers of ``layer_nbytes`` into ``num_layers``
    distinct destinations with NumPy: the same bytes, buffers and page footprint as one
    request moved layer by layer (no cache-hot reuse of one pair). The best round, so a
    busy moment never lowers the floor a transfer is set against."""
    src = [_faulted_in(layer_nbytes) for _ in range(num_layers)]  # every page faulted in before timing
    dst = [_faulted_in(layer_nbytes, value=0) for _ in range(num_layers)]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter_ns()
        for s, d in zip(src, dst):
            np.copyto(d, s)
        times.append((time.perf_counter_ns() - t0) / 1e9)
    return float(min(times[1:]))


def crc32_layers_s(*, layer_nbytes: int, num_layers: int, repeats: int = 3) -> float:
    """Median seconds for ``zlib.crc32`` over ``num_layers`` distinct ``layer_nbytes`` buffers:
    what ``KVSender(checksum=True)`` adds on each side of a request of that size.

    >>> crc32_layers_s(layer_nbytes=1 << 16, num_layers=2, repeats=1) > 0
    True
    """
    import zlib

    bufs = [_faulted_in(layer_nbytes) for _ in range(num_layers)]
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


def _plan(spec, src, dst):
    """The transfer plan of blocks ``src`` -> ``dst`` between two caches of ``spec``'s layout."""
    from qlink.ai import plan_transfer

    return plan_transfer(src, dst, src_num_blocks=spec.num_blocks, dst_num_blocks=spec.num_blocks,
                         block_nbytes=spec.block_nbytes, num_planes=spec.num_planes)


def _measure_backend(scheme: str, backend: str, spec, token_list, patterns, repeats: int, say,
                     floor: _Floor, *, variant: str = "", tcp_floor: dict | None = None,
                     mooncake: dict | None = None) -> list[dict]:
    """Transfer rounds of one backend, each right after a floor copy of the same pieces in
    the receiver's cache. qlink: the peer sends, the receiver here waits for the last layer;
    NIXL: the receiver here pulls the request with one prepared READ (vLLM's way). Over tcp,
    with ``tcp_floor`` given, also a bare-socket round (:class:`._kv_tcp_floor.TcpFloorPair`)
    right before each transfer round, its best per token count recorded there; with ``mooncake``
    given, also a Mooncake round at each slice size (:data:`._kv_mooncake.SLICE_SIZES`) right
    before each transfer round, its seconds listed there by ``(slice, tokens, pattern)``."""
    import contextlib

    from ._kv_tcp_floor import TcpFloorPair

    rng = np.random.default_rng(7)
    sock, moon = None, []
    with contextlib.ExitStack() as stack:
        if scheme == "tcp" and backend == "transport":
            if tcp_floor is not None:
                sock = stack.enter_context(TcpFloorPair(
                    max_layer_nbytes=spec.kv_nbytes(num_tokens=max(token_list)) // spec.num_layers,
                    num_layers=spec.num_layers))
            if mooncake is not None:
                from ._kv_mooncake import SLICE_SIZES, MooncakePair

                moon = [stack.enter_context(MooncakePair(spec, slice_nbytes=n)) for n in SLICE_SIZES]
        rows = _measure_rounds(scheme, backend, spec, token_list, patterns, repeats, say, floor, variant, rng,
                               sock, tcp_floor, moon, mooncake)
    return rows


def _measure_rounds(scheme, backend, spec, token_list, patterns, repeats, say, floor, variant, rng, sock,
                    tcp_floor, moon=(), moon_times=None) -> list[dict]:
    """The rounds of :func:`_measure_backend`, over one link. The cases (token counts x patterns)
    take their rounds in turn (round 1 of every case, then round 2...), not all of one case's
    rounds back to back: a slow spell of the shared host (seconds long, here) then costs one
    round of several cases, which their best round leaves out, instead of every round of one."""
    from qlink.ai.peer import open_link

    from ._kv_tcp_floor import modes as floor_modes

    nixl = backend == "nixl"
    sock_modes = floor_modes()
    floor.mark()
    cases = []
    for n_tokens in token_list:
        nblocks = spec.blocks_for(num_tokens=n_tokens)
        for pattern in patterns:
            src, dst = _blocks(pattern, nblocks, spec.num_blocks, rng)
            cases.append({"tokens": n_tokens, "pattern": pattern, "nblocks": nblocks, "src": src, "dst": dst,
                          "plan": _plan(spec, src, dst), "times_us": [], "subs": [], "pulled": [], "pairs": []})
    with open_link(scheme, spec, seed=0, backend=backend, fill="touch") as (rx, cache, peer):
        for a in cache.layers:  # fault the receiver's pages in before any timing
            a.view(np.uint8).fill(0)
        rid = 0
        for rep in range(repeats + 1):  # the first is a warm-up
            for case in cases:
                rid = _one_round(case, rep, rid, spec=spec, rx=rx, cache=cache, peer=peer, nixl=nixl, floor=floor,
                                 sock=sock, sock_modes=sock_modes, tcp_floor=tcp_floor, moon=moon,
                                 moon_times=moon_times, say=say)
                if nixl:  # the bytes really moved: the sender fills layer k with k % 251 + 1
                    _check_landed(cache, case["plan"])
            if rep:
                say(f"  {'NIXL UCX READ' if nixl else f'qlink {scheme}{variant}'}: round {rep} of {repeats} done")
        rows = [_round_row(case, scheme=scheme, nixl=nixl, variant=variant, spec=spec, floor=floor, rx=rx,
                           repeats=repeats, say=say)
                for case in cases]
    return rows


def _one_round(case: dict, rep: int, rid: int, *, spec, rx, cache, peer, nixl: bool, floor: _Floor, sock,
               sock_modes, tcp_floor, moon, moon_times, say):
    """One round of one case: the floor's copies of its pieces, the bare socket's and each
    Mooncake pair's rounds where given, then as many transfers as the floor's fastest kind of
    copy took samples (``rep`` 0: one warm-up of each, nothing recorded); the recorded ones go
    into ``case``. Returns the last request id used."""
    n_tokens, pattern, plan = case["tokens"], case["pattern"], case["plan"]
    floor_s = floor.copy_s(cache, plan, key=(n_tokens, pattern), record=bool(rep))
    if sock is not None and rep:  # as many samples as the transfer takes (below), per end kind
        for k in range(len(sock_modes) * max(1, floor.last_copies)):  # each kind of ends in turn
            sec = sock.round_s(spec.kv_nbytes(num_tokens=n_tokens) // spec.num_layers,
                               mode=sock_modes[k % len(sock_modes)])
            tcp_floor[n_tokens] = min(tcp_floor.get(n_tokens, sec), sec)
    for pair in list(moon):  # the first round of each is its warm-up, as the transfer's
        try:
            sec = pair.write(plan, range(spec.num_layers))
        except (RuntimeError, TimeoutError, OSError, EOFError) as e:  # the peer's failure, not qlink's
            moon.remove(pair)  # measured no further; qlink's rounds go on
            moon_times.setdefault((pair.slice_nbytes, n_tokens, pattern), []).append(
                f"{type(e).__name__}: {e}")
            say(f"  Mooncake, slice {pair.slice_nbytes // 1024} KiB, {n_tokens} tok {pattern}: "
                f"{type(e).__name__}: {e}; not measured further in this run")
            continue
        if rep:
            moon_times.setdefault((pair.slice_nbytes, n_tokens, pattern), []).append(sec)
    spent_s, round_us = 0.0, []
    for _ in range(floor.last_copies if rep else 1):  # as many samples as the floor's round
        rid += 1
        before = _pulled_bytes(rx)
        if nixl:
            sub, rec = None, rx.read_request(rid, case["src"], case["dst"], timeout_s=600)
        else:
            sub, rec = peer.transfer(rx, rid, case["src"], case["dst"], timeout_s=600)
        if not rep:
            break
        round_us.append(rec.submit_to_last_us)
        case["rec"] = rec
        case["subs"].append(sub)
        case["pulled"].append((_pulled_bytes(rx) - before) / max(1, rec.nbytes))
        spent_s += rec.submit_to_last_us / 1e6
        if spent_s >= floor.last_spent_s:  # and no longer than they took (a slow peer: fewer)
            break
    if rep:  # this round's floor beside this round's best transfer: the same seconds
        case["times_us"] += round_us
        case["pairs"].append((floor_s, min(round_us) / 1e6))
    return rid


def _round_row(case: dict, *, scheme, nixl: bool, variant: str, spec, floor: _Floor, rx, repeats: int,
               say) -> dict:
    """The row of one case once its rounds are done (GB/s: median and best of its transfers)."""
    n_tokens, pattern, times_us, subs, pulled = (case[k] for k in ("tokens", "pattern", "times_us", "subs", "pulled"))
    rec, sub = case["rec"], subs[-1]  # the last recorded transfer
    nbytes = rec.nbytes
    t_us = float(np.median(times_us))
    gbps = nbytes / (t_us * 1e3)
    best_gbps = nbytes / (min(times_us) * 1e3)
    blocks = 2 * case["nblocks"] * spec.num_layers
    label = "NIXL UCX READ" if nixl else f"qlink {scheme} {sub.mode}{variant}"
    row = {
        "case": label, "basis": "measured", "tokens": n_tokens, "nbytes": nbytes, "pattern": pattern,
        "p50_ms": float(f"{t_us / 1e3:.4g}"), "GBps": float(f"{gbps:.4g}"),
        "best_GBps": float(f"{best_gbps:.4g}"),
        "num_descs": rec.num_descs, "transport": rec.transport,
        "moved_by": "NIXL" if nixl else "receiver" if min(pulled) >= 1 else
        "both" if max(pulled) > 0 else "sender",
        "read_by_receiver": None if nixl else round(float(np.median(pulled)), 3),
        "prep_us_per_block": None if nixl else
        round(float(np.median([s.plan_us for s in subs])) / blocks, 4),
        "submit_us_per_block": None if nixl else
        round(float(np.median([s.submit_us for s in subs])) / blocks, 4),
        "repeats": repeats, "transfers": len(times_us),
    }
    same = floor.best_since_mark.get((n_tokens, pattern))
    row["floor_GBps_same_minutes"] = float(f"{nbytes / same / 1e9:.4g}") if same else None
    if case["pairs"]:  # round by round: each round's best transfer over that round's floor
        row["x_memcpy_paired"] = float(f"{np.median([f / t for f, t in case['pairs']]):.3g}")
    if scheme == "shm" and not nixl:
        row["pull_copy"] = _pull_copy()
    if scheme == "tcp" and not nixl:
        row["tcp_way"] = _tcp_way()
    if scheme == "ucx" and not nixl:
        row["rma_pieces_by"] = _rma_pieces_by(rx)
    say(f"  {label:<18} {n_tokens:>6} tok {pattern:<10} {gbps:7.2f} GB/s (best {best_gbps:.2f})  "
        f"{rec.num_descs} descriptors")
    return row


#: the ucx rows beside the default one (RMA between two processes of one host, its pieces moved
#: by same-host CMA many per call: :mod:`transports._ucx_cma`), each with the environment it runs in:
#: every piece by UCX RMA, one call each, as NIXL's UCX backend moves them; and no RMA at all
#: (tagged messages, the way to a peer on another host unless ``rma=True``)
UCX_VARIANTS = {
    "transport-rma-ucx": (" (UCX RMA, CMA off)", {"QLINK_UCX_RMA": "1", "QLINK_UCX_CMA": "0"}),
    "transport-tagged": (" (tagged, rma=False)", {"QLINK_UCX_RMA": "0"}),
}

#: the tcp row beside the default one: large deferred puts the way the host's measurement did
#: not choose (see the module docstring), by the environment that forces it
TCP_OTHER_WAY = {"splice": (" (copied)", {"QLINK_TCP_SPLICE": "0"}),
                 "copy": (" (spliced)", {"QLINK_TCP_SPLICE": "1"})}


def _with_env(run, env: dict):
    """``run()`` with ``env`` in the environment: the ucx:// endpoints made here and in the
    processes started meanwhile read it."""
    import os

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return run()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _nixl_leg(scheme: str, spec_bytes: bytes, fits, patterns, repeats: int, spare_nbytes: int):
    """The NIXL rows measured in this (fresh) process, with the floor rounds taken beside them."""
    from qlink.ai import KVCacheSpec

    lines: list[str] = []
    floor = _Floor(spare_nbytes=spare_nbytes)
    rows = _measure_backend(scheme, "nixl", KVCacheSpec.from_bytes(spec_bytes), fits, patterns, repeats,
                            lines.append, floor)
    import sys

    from qlink.ai.nixl_backend import ucx_environment

    env = ucx_environment()
    for r in rows:  # the conditions NIXL ran under: the UCX options it read, and UCXX not loaded beside it
        r["ucx_env"] = " ".join(f"{k}={v}" for k, v in sorted(env.items())) or None
        r["ucxx_in_process"] = "ucxx" in sys.modules
    return rows, floor.best, floor.rounds, lines


def _measure_nixl_apart(scheme: str, spec, fits, patterns, repeats: int, say, floor: _Floor) -> list[dict]:
    """NIXL's receiving side in a spawned process of its own, as in a vLLM decode worker: a
    process whose UCX is NIXL's alone (this one has loaded UCXX once qlink's ucx rows ran).
    Its rows record the ``UCX_*`` options NIXL read (``ucx_env``; UCXX's import-time
    ``UCX_RNDV_THRESH=8192`` cost NIXL 5-7 x here until qlink stopped passing it on, see
    :func:`qlink.ai.nixl_backend.ucx_environment`). The floor rounds taken there join this
    process's floor (best of both)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as ex:
        rows, best, rounds, lines = ex.submit(_nixl_leg, scheme, spec.to_bytes(), list(fits), tuple(patterns),
                                              repeats, floor.spare_nbytes).result()
    for line in lines:
        say(line)
    for key, (sec, kind) in best.items():
        floor.rounds[key] = floor.rounds.get(key, 0) + rounds.get(key, 0)
        if key not in floor.best or sec < floor.best[key][0]:
            floor.best[key] = (sec, kind)
    return rows


def _tcp_floor_rows(spec, fits, repeats: int, measured: list[dict], progress,
                    interleaved: dict | None = None) -> list[dict]:
    """The bare-socket floor of each token count (:mod:`._kv_tcp_floor`): the best of its own
    rounds and of those taken between qlink's tcp rounds (``interleaved``: tokens -> seconds);
    and each TCP row's ``x_tcp_floor``: its best round over it (the floor is a best of rounds too)."""
    from ._kv_tcp_floor import modes, tcp_socket_floor_s

    rows = []
    interleaved = interleaved or {}
    for t in fits:
        nb = spec.kv_nbytes(num_tokens=t)
        try:
            sec = tcp_socket_floor_s(layer_nbytes=nb // spec.num_layers, num_layers=spec.num_layers,
                                     repeats=max(repeats, 3))
        except Exception as e:  # reported in its row; the transfers' rows stand
            rows.append({"case": "TCP socket floor", "basis": "error", "tokens": t, "note": f"{type(e).__name__}: {e}"})
            continue
        sec = min(sec, interleaved.get(t, sec))
        gbps = nb / sec / 1e9
        progress(f"  TCP socket floor {t:>6} tok: {gbps:.2f} GB/s (loopback, the fastest of {', '.join(modes())} ends)")
        rows.append({"case": "TCP socket floor (loopback, same bytes)", "basis": "floor", "tokens": t, "nbytes": nb,
                     "pattern": "per layer", "p50_ms": round(sec * 1e3, 3), "GBps": round(gbps, 3),
                     "repeats": max(repeats, 3),
                     "note": "two processes, each layer sent and received with blocking calls, with "
                             "non-blocking calls in busy loops, or sent by splice (no copy) to a busy-polling "
                             "receiver (the fastest of those this host runs: " + ", ".join(modes()) + "): no framing, "
                             "no notification; the least any TCP transport pays for these bytes here; best of its "
                             "own rounds and of one round before each qlink tcp round"
                             + ("" if t in interleaved else " (none taken here)")})
        for r in measured:
            if r.get("basis") == "measured" and r.get("tokens") == t and r["case"].startswith(("qlink tcp", "Mooncake")):
                r["x_tcp_floor"] = float(f"{r.get('best_GBps', r['GBps']) / gbps:.3g}")
    return rows


def _tcp_way() -> str:
    """How this process's tcp senders (and the senders it starts) move large deferred puts:
    by splice or copied, and on what basis (:func:`transports.tcp.deferred_put_way`)."""
    from transports.tcp import deferred_put_way

    return deferred_put_way().describe()


def _pull_copy() -> str | None:
    """How this process's shm endpoints copy large deferred puts (``transports._ringc.pull_copy``):
    ``"auto"`` with the rate each copy has shown, or the fixed kind; None without the C ring."""
    try:
        from transports._ringc import pull_copy
    except ImportError:
        return None
    kind, memcpy_gbps, streamed_gbps, _, _ = pull_copy()
    if kind != "auto":
        return kind
    rate = {k: g for k, g in (("memcpy", memcpy_gbps), ("streamed", streamed_gbps)) if g}
    if not rate:
        return "auto"
    return f"auto: {max(rate, key=rate.get)} ({', '.join(f'{k} {g:.2f} GB/s' for k, g in rate.items())})"


def _check_landed(cache, plan) -> None:
    for k, a in enumerate(cache.layers):
        v = a.view(np.uint8).reshape(-1)
        if np.any(v[plan.dst_offsets] != k % 251 + 1):
            raise RuntimeError(f"layer {k}: the moved blocks do not hold the sender's bytes")


def _measure_mooncake(spec, token_list, patterns, repeats: int, say) -> list[dict]:
    """Mooncake TE over TCP, one process pair per slice size (see :mod:`._kv_mooncake`)."""
    from ._kv_mooncake import SLICE_SIZES, MooncakePair

    rows = []
    for slice_nbytes in SLICE_SIZES:
        rng = np.random.default_rng(7)
        label = f"Mooncake TE TCP, slice {slice_nbytes // 1024} KiB"
        with MooncakePair(spec, slice_nbytes=slice_nbytes) as pair:
            for n_tokens in token_list:
                nblocks = spec.blocks_for(num_tokens=n_tokens)
                for pattern in patterns:
                    src, dst = _blocks(pattern, nblocks, spec.num_blocks, rng)
                    plan = _plan(spec, src, dst)
                    nbytes = plan.layer_nbytes * spec.num_layers
                    try:
                        secs = [pair.write(plan, range(spec.num_layers)) for _ in range(repeats + 1)][1:]
                    except (RuntimeError, TimeoutError, OSError, EOFError) as e:
                        rows.append({"case": label, "basis": "error", "tokens": n_tokens, "nbytes": nbytes,
                                     "pattern": pattern, "note": f"{type(e).__name__}: {e}"})
                        say(f"  {label:<18} {n_tokens:>6} tok {pattern:<10} {type(e).__name__}: {e}")
                        continue
                    t = float(np.median(secs))
                    rows.append({"case": label, "basis": "measured", "tokens": n_tokens, "nbytes": nbytes,
                                 "pattern": pattern, "p50_ms": float(f"{t * 1e3:.4g}"),
                                 "GBps": float(f"{nbytes / t / 1e9:.4g}"),
                                 "num_descs": plan.num_descs * spec.num_layers, "transport": "mooncake-tcp",
                                 "moved_by": "Mooncake", "repeats": repeats, "slice_nbytes": slice_nbytes,
                                 "best_GBps": float(f"{nbytes / min(secs) / 1e9:.4g}"),
                                 "note": "rounds of its own, not beside qlink tcp's (its caches there would "
                                         "exceed the memory budget, or qlink tcp did not run)"})
                    say(f"  {label:<18} {n_tokens:>6} tok {pattern:<10} {nbytes / t / 1e9:7.2f} GB/s")
    return rows


def _mooncake_rows(spec, times: dict, repeats: int, say) -> list[dict]:
    """Mooncake's rows from rounds taken right before each of qlink's tcp rounds:
    ``times[(slice, tokens, pattern)]`` lists their seconds."""
    rows = []
    for (slice_nbytes, n_tokens, pattern), secs in sorted(times.items()):
        label = f"Mooncake TE TCP, slice {slice_nbytes // 1024} KiB"
        nbytes = spec.kv_nbytes(num_tokens=n_tokens)
        failed = [x for x in secs if isinstance(x, str)]
        secs = [x for x in secs if not isinstance(x, str)]
        if failed or not secs:
            rows.append({"case": label, "basis": "error", "tokens": n_tokens, "nbytes": nbytes, "pattern": pattern,
                         "note": failed[0] if failed else "no round was measured"})
            continue
        t = float(np.median(secs))
        rows.append({"case": label, "basis": "measured", "tokens": n_tokens, "nbytes": nbytes, "pattern": pattern,
                     "p50_ms": float(f"{t * 1e3:.4g}"), "GBps": float(f"{nbytes / t / 1e9:.4g}"),
                     "best_GBps": float(f"{nbytes / min(secs) / 1e9:.4g}"), "transport": "mooncake-tcp",
                     "moved_by": "Mooncake", "repeats": repeats, "transfers": len(secs), "slice_nbytes": slice_nbytes,
                     "note": "a round right before each qlink tcp round"})
        say(f"  {label:<18} {n_tokens:>6} tok {pattern:<10} {nbytes / t / 1e9:7.2f} GB/s (beside qlink tcp)")
    return rows


def _rma_pieces_by(rx) -> str | None:
    """What moved a ucx row's pieces: same-host CMA, many per call, or UCX, one call each (None:
    no RMA, tagged puts)."""
    ep = rx.endpoint
    if not getattr(ep, "rma", False):
        return None
    return "CMA, up to 1024 pieces per call" if ep.statistics().extra.get("cma") else "UCX, one call per piece"


def _pulled_bytes(rx) -> int:
    """Bytes the receiver's endpoint has copied out of the sender's memory (deferred puts)."""
    ep = getattr(rx, "endpoint", None)
    return int(ep.statistics().extra.get("pulled_bytes", 0)) if ep is not None else 0


def run_kv_bench(*, transports: Iterable[str] = ("shm", "tcp", "ucx"), tokens: Iterable[int] = (512, 4096, 32768),
                 preset: str = "llama-3-8b", repeats: int = 3, patterns: Iterable[str] = ("contiguous", "scattered"),
                 nixl: bool = True, mooncake: bool = True, memory_budget_nbytes: int = 10 << 30,
                 progress: Callable[[str], None] = print) -> list[dict]:
    """Measure KV transfers of ``tokens``-token requests (see the module docstring); one dict per row.

    Rows carry ``case``, ``basis`` (measured / floor / overhead / modeled / skipped / error), ``tokens``,
    ``nbytes``, ``pattern``, ``p50_ms``, ``GBps``, ``x_memcpy`` and, when measured, ``best_GBps``,
    ``num_descs``, ``transport``, ``moved_by``, ``prep_us_per_block``, ``submit_us_per_block``
    (over ``shm``, ``pull_copy``);
    qlink rows also ``x_nixl`` and ``x_mooncake`` (its bandwidth over that peer's, same
    tokens and pattern; Mooncake at its faster slice size).
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
    moon_times: dict | None = None  # Mooncake rounds taken between qlink's tcp rounds, where both run
    if "ucx" in transports:  # and with UCX RMA, which ucx:// leaves off unless asked (see transports.ucx)
        at = backends.index(("ucx", "transport")) + 1
        backends[at:at] = [("ucx", variant) for variant in UCX_VARIANTS]
    if nixl:
        backends.append((None, "nixl"))
    if mooncake:
        backends.append((None, "mooncake"))
    variants = dict(UCX_VARIANTS)
    if ("tcp", "transport") in backends:  # measured here, before any sender starts: the senders inherit it
        from transports.tcp import deferred_put_way

        way = deferred_put_way()
        progress(f"tcp: large deferred puts go by {way.describe()}")
        if way.basis in ("measured", "inherited"):  # (not forced by the user, and splice built)
            variants["transport-tcp-other-way"] = TCP_OTHER_WAY[way.kind]
            at = backends.index(("tcp", "transport")) + 1
            backends[at:at] = [("tcp", "transport-tcp-other-way")]
    floor = _Floor(spare_nbytes=_floor_spare_nbytes(spec.nbytes, memory_budget_nbytes))
    tcp_floor: dict[int, float] = {}  # tokens -> best bare-socket round taken between qlink's tcp rounds
    measured: list[dict] = []
    for scheme, backend in backends:
        if backend == "nixl":
            from qlink.ai.nixl_backend import nixl_available

            scheme = next((s for s in ("shm", "tcp") if not transport_unavailable(s)), None)
            why = None if nixl_available() else "nixl-cu12 is not installed"
            why = why or (None if scheme else "no shm/tcp transport to carry the NIXL handshake")
            name = "NIXL UCX READ"
        elif backend == "mooncake":
            from ._kv_mooncake import mooncake_unavailable

            why, name = mooncake_unavailable(), "Mooncake TE TCP"
            if not why and moon_times:  # measured already, round by round beside qlink's tcp
                measured.extend(_mooncake_rows(spec, moon_times, repeats, progress))
                continue
        else:
            why = transport_unavailable(scheme)
            name = f"qlink {scheme}" + variants.get(backend, ("",))[0]
        if why:
            measured.append({"case": name, "basis": "skipped", "note": why})
            progress(f"  {name}: skipped ({why})")
            continue
        progress(f"{name}: {', '.join(map(str, fits))} tokens, {repeats} repeats + 1 warm-up")
        if backend in ("nixl", "mooncake"):  # (their processes hold caches of their own)
            floor.release()
        try:
            if backend == "mooncake":
                measured.extend(_measure_mooncake(spec, fits, patterns, repeats, progress))
            elif backend == "nixl":
                measured.extend(_measure_nixl_apart(scheme, spec, fits, patterns, repeats, progress, floor))
            elif backend in variants:
                variant, env = variants[backend]
                measured.extend(_with_env(lambda: _measure_backend(
                    scheme, "transport", spec, fits, patterns, repeats, progress, floor, variant=variant), env))
            else:
                if scheme == "tcp" and mooncake:
                    from ._kv_mooncake import SLICE_SIZES, mooncake_unavailable

                    # beside qlink's rounds only where the Mooncake pairs' caches (two processes per
                    # slice size) fit the budget too; else Mooncake takes rounds of its own afterwards
                    fits_beside = 2 * len(SLICE_SIZES) * spec.nbytes <= memory_budget_nbytes
                    moon_times = {} if mooncake_unavailable() is None and fits_beside else None
                measured.extend(_measure_backend(scheme, backend, spec, fits, patterns, repeats, progress, floor,
                                                 tcp_floor=tcp_floor, mooncake=moon_times))
        except Exception as e:  # a failing backend is reported in the rows, the others still run
            measured.append({"case": name, "basis": "error", "note": f"{type(e).__name__}: {e}"})
            progress(f"  {name}: error {type(e).__name__}: {e}")

    if not floor.best:  # nothing measured beside it: the floor alone, in a cache of its own
        from qlink.ai import KVCache

        cache = KVCache.allocate(spec)
        for a in cache.layers:
            a.view(np.uint8).fill(1)
        rng = np.random.default_rng(7)
        for t in fits:
            for pattern in patterns:
                src, dst = _blocks(pattern, spec.blocks_for(num_tokens=t), spec.num_blocks, rng)
                plan = _plan(spec, src, dst)
                for _ in range(max(repeats, 3)):
                    floor.copy_s(cache, plan, key=(t, pattern))
        del cache
    floor_gbps = {}
    for (t, pattern), (s, kind) in sorted(floor.best.items()):
        nb = base.kv_nbytes(num_tokens=t)
        floor_gbps[(t, pattern)] = nb / s / 1e9
        rows.append({"case": "memcpy floor (warm, same blocks)", "basis": "floor", "tokens": t, "nbytes": nb,
                     "pattern": pattern, "p50_ms": round(s * 1e3, 3), "GBps": round(nb / s / 1e9, 3),
                     "x_memcpy": 1.0, "repeats": floor.rounds[(t, pattern)],
                     "note": f"best of {floor.rounds[(t, pattern)]} rounds: {kind}"})
    _add_ratios(measured, floor_gbps)
    if "tcp" in transports or mooncake:
        rows.extend(_tcp_floor_rows(spec, fits, repeats, measured, progress, tcp_floor))
    for t in fits:
        nb = base.kv_nbytes(num_tokens=t)
        memcpy_GBps = max((g for (tt, _), g in floor_gbps.items() if tt == t), default=None)
        c = crc32_layers_s(layer_nbytes=nb // spec.num_layers, num_layers=spec.num_layers, repeats=max(repeats, 3))
        rows.append({"case": "CRC-32 (checksum=True, each side)", "basis": "overhead", "tokens": t, "nbytes": nb,
                     "pattern": "per layer", "p50_ms": round(c * 1e3, 3), "GBps": round(nb / c / 1e9, 3),
                     "x_memcpy": ratio(nb / c / 1e9, memcpy_GBps) if memcpy_GBps else None})
        rows.extend(modeled_rows(nb, tokens=t, memcpy_GBps=memcpy_GBps))
    return rows + measured


def _add_ratios(measured: list[dict], floor_gbps: dict) -> None:
    """Each measured row's ``x_memcpy`` (its best round over the best floor round of its tokens and
    pattern taken beside its own rounds, the same minutes), ``x_memcpy_run_best`` (over the run's best
    floor round), and each qlink row's ``x_nixl`` / ``x_mooncake`` (over that peer's best row of its
    tokens and pattern)."""
    def peer(prefix: str, t, pattern):
        g = [r["GBps"] for r in measured if r.get("basis") == "measured" and r["case"].startswith(prefix)
             and r["tokens"] == t and r["pattern"] == pattern]
        return max(g) if g else None

    for r in measured:
        if r.get("basis") != "measured":
            continue
        best = r.get("best_GBps", r["GBps"])
        f = floor_gbps.get((r["tokens"], r["pattern"]))  # the run's best floor round
        r["x_memcpy_run_best"] = float(f"{best / f:.3g}") if f else None
        f = r.get("floor_GBps_same_minutes") or f  # the best floor round beside this row's own rounds
        r["x_memcpy"] = float(f"{best / f:.3g}") if f else None
        if r["x_memcpy"] is not None and r["x_memcpy"] > 1.0:
            r["note"] = _above_floor(r)
        if r["case"].startswith("qlink"):
            for key, prefix in (("x_nixl", "NIXL"), ("x_mooncake", "Mooncake")):
                g = peer(prefix, r["tokens"], r["pattern"])
                r[key] = float(f"{r['GBps'] / g:.3g}") if g else None


def _above_floor(row: dict) -> str:
    """Why a row moved its bytes faster than the floor (one core's memcpy), where that is known.

    >>> _above_floor({"case": "NIXL UCX READ", "moved_by": "NIXL"}).split(": ")[1]
    "NIXL's worker threads read on both cores at once; the floor is one core's"
    >>> _above_floor({"case": "qlink shm put", "moved_by": "receiver", "x_memcpy_paired": 0.97})
    "above the floor's best round only: the best rounds of each came in different seconds; round by round (each round's floor beside its own transfers) the transfer read 0.97 x the floor"
    """
    if row.get("moved_by") == "NIXL":
        why = "NIXL's worker threads read on both cores at once"
    elif row.get("moved_by") == "both":
        why = "both processes copy at once (the target reads a share while the sender writes the rest)"
    elif row.get("x_memcpy_paired") is not None and row["x_memcpy_paired"] <= 1.0:
        return ("above the floor's best round only: the best rounds of each came in different seconds; round by "
                f"round (each round's floor beside its own transfers) the transfer read {row['x_memcpy_paired']:.2f} "
                "x the floor")
    else:
        return "above one core's memcpy of the same pieces, and not explained: suspect the measurement"
    return f"above one core's memcpy of the same pieces: {why}; the floor is one core's"


def kv_goals(rows: list[dict]) -> list[dict]:
    """One row per goal of the module docstring: the figure measured in this run, the goal,
    and whether it was met (None where a figure is missing).

    >>> rows = [{"case": "qlink shm put", "basis": "measured", "tokens": 512, "pattern": "scattered",
    ...          "GBps": 9.0, "x_memcpy": 0.95, "prep_us_per_block": 0.01, "submit_us_per_block": 0.02},
    ...         {"case": "qlink ucx put", "basis": "measured", "tokens": 512, "pattern": "scattered", "GBps": 4.0},
    ...         {"case": "qlink tcp put", "basis": "measured", "tokens": 512, "pattern": "scattered", "GBps": 3.0},
    ...         {"case": "NIXL UCX READ", "basis": "measured", "tokens": 512, "pattern": "scattered", "GBps": 5.0},
    ...         {"case": "Mooncake TE TCP, slice 1024 KiB", "basis": "measured", "tokens": 512,
    ...          "pattern": "scattered", "GBps": 1.0}]
    >>> [(g["goal"], g["measured"], g["met"]) for g in kv_goals(rows)]  # doctest: +NORMALIZE_WHITESPACE
    [('shm >= 0.9 x memcpy at 512 tokens (scattered)', 0.95, True),
     ('ucx >= NIXL UCX at 512 tokens (scattered)', 0.8, False),
     ('tcp >= 2 x Mooncake TCP at 512 tokens (scattered)', 3.0, True),
     ('shm prep + submit <= 1 us/block at 512 tokens (scattered)', 0.03, True)]
    """
    out: list[dict] = []

    def add(goal: str, measured, target: float, higher_is_better: bool) -> None:
        ok = measured is not None and measured == measured
        met = None if not ok else (measured >= target if higher_is_better else measured <= target)
        out.append({"goal": goal, "measured": measured if ok else None, "target": target, "met": met})

    def best(case_start: str, t, pattern):
        found = [r for r in rows if r.get("basis") == "measured" and r["case"].startswith(case_start)
                 and r.get("tokens") == t and r.get("pattern") == pattern]
        return max(found, key=lambda r: r["GBps"]) if found else None

    keys = sorted({(r["tokens"], r["pattern"]) for r in rows
                   if r.get("basis") == "measured" and r.get("pattern") and r.get("tokens") is not None})
    for t, pattern in keys:
        shm, ucx, tcp = best("qlink shm", t, pattern), best("qlink ucx", t, pattern), best("qlink tcp", t, pattern)
        nixl, moon = best("NIXL", t, pattern), best("Mooncake", t, pattern)
        where = f"at {t} tokens ({pattern})"
        add(f"shm >= {GOAL_SHM_X_MEMCPY:g} x memcpy {where}", shm and shm.get("x_memcpy"), GOAL_SHM_X_MEMCPY, True)
        if shm and shm.get("x_memcpy_run_best") is not None and shm.get("floor_GBps_same_minutes"):
            out[-1]["floor"] = (f"the floor beside its rounds: {shm['floor_GBps_same_minutes']:.2f} GB/s; "
                                f"against the run's best floor round: {shm['x_memcpy_run_best']:.2f}"
                                + (f"; round by round: {shm['x_memcpy_paired']:.2f}"
                                   if shm.get("x_memcpy_paired") is not None else ""))
        add(f"ucx >= NIXL UCX {where}", ratio(ucx["GBps"], nixl["GBps"]) if ucx and nixl else None,
            GOAL_UCX_X_NIXL, True)
        if ucx and ucx["case"] != "qlink ucx put":
            out[-1]["by"] = ucx["case"]  # the faster qlink ucx row is not the default one
        add(f"tcp >= {GOAL_TCP_X_MOONCAKE:g} x Mooncake TCP {where}",
            ratio(tcp["GBps"], moon["GBps"]) if tcp and moon else None, GOAL_TCP_X_MOONCAKE, True)
        if tcp and tcp["case"] != "qlink tcp put":
            out[-1]["by"] = tcp["case"]  # the way the host's measurement did not choose was faster
        sock = next((r for r in rows if r.get("basis") == "floor" and r["case"].startswith("TCP socket floor")
                     and r.get("tokens") == t), None)
        if sock and moon:  # what the host allows: no TCP transport beats the bare socket
            bound = sock["GBps"] / moon["GBps"]
            out[-1]["host_bound"] = round(bound, 3)
            out[-1]["floor"] = (f"the bare TCP socket moves these bytes at {sock['GBps']:.2f} GB/s here, "
                               f"{bound:.2f} x Mooncake" + ("" if bound >= GOAL_TCP_X_MOONCAKE else
                                                            ": below the goal, which no TCP sender could meet "
                                                            "on this host in this run"))
        per_block = None if shm is None else round(shm["prep_us_per_block"] + shm["submit_us_per_block"], 4)
        add(f"shm prep + submit <= {GOAL_PREP_SUBMIT_US_PER_BLOCK:g} us/block {where}", per_block,
            GOAL_PREP_SUBMIT_US_PER_BLOCK, False)
    return out


def main_from_cli(args, *, say: Callable[[str], None] = print) -> list[dict]:
    """``qlink bench kv [--quick] [--out DIR] [--transports T,..] [--no-peers]``: run, print a
    table, write JSON/CSV (``--no-peers``: no NIXL, no Mooncake; the floor is always measured)."""
    from pathlib import Path

    from .report import CONSOLE_WIDTH, format_goals, format_table, wrap, write_results

    quick = bool(getattr(args, "quick", False))
    tokens = (512, 4096) if quick else (512, 4096, 32768)
    repeats = 2 if quick else 3
    given = getattr(args, "transports", None)  # comma-separated text from the CLI, or a sequence
    transports = tuple(t.strip() for t in given.split(",") if t.strip()) if isinstance(given, str) else \
        tuple(given or ("shm", "tcp", "ucx"))
    peers = not getattr(args, "no_peers", False)
    rows = run_kv_bench(transports=transports, tokens=tokens, repeats=repeats, nixl=peers, mooncake=peers,
                        progress=say)
    goals = kv_goals(rows)
    out = Path(getattr(args, "out", "results/bench"))
    meta = {"tokens": list(tokens), "repeats": repeats, "preset": "llama-3-8b", "transports": list(transports),
            "peers": peers}
    write_results(rows, out_dir=out, name="kv", meta=meta)
    write_results(goals, out_dir=out, name="kv_goals", meta=meta)
    shown = {"case": "case", "basis": "basis", "tokens": "tokens", "pattern": "pattern", "GBps": "GB/s",
             "best_GBps": "best GB/s", "x_memcpy": "x memcpy (best)", "x_nixl": "x nixl", "x_mooncake": "x mooncake", "x_tcp_floor": "x tcp floor", "p50_ms": "p50 ms",
             "num_descs": "descs"}
    print("\nKV-cache transfer, Llama-3-8B layout, two processes (modeled rows are link models, not measurements)")
    print(format_table([{v: r.get(k) for k, v in shown.items()} for r in rows], columns=list(shown.values()),
                       max_width=CONSOLE_WIDTH))
    for r in rows:
        if r.get("note"):
            print(wrap(f"  note ({r.get('case')}, {r.get('tokens')} tokens): {r['note']}", indent="    "))
    print("\nKV goals (measured in this run; met is empty where a figure is missing)")
    print(format_goals(goals))
    from .plots import fig_kv_peers, save_figure

    save_figure(fig_kv_peers(rows), out / "kv.png")
    print(wrap(f"\nwritten under {out}/: kv (every column), kv_goals (.json, .csv), kv.png (each transport "
               "beside its floor and peer)"))
    return rows
