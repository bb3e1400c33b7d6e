"""Grids → sweep tasks: one :class:`SweepTask` per grid point, split into fixed-size chunks.

A task carries what sinter needs to file its rows (``strong_id``, the ``decoder``
column, ``json_metadata``) and what a worker needs to run one chunk (``work``: plain
data only, so nothing but numbers and names crosses to a worker). Chunk ``i`` of a
task always holds ``chunk_shots`` shots sampled from :func:`chunk_seed` of the task's
strong id and ``i``, so any chunk can be re-run, on any worker, with the same outcome.

>>> grid = QecGrid(distances=(3,), ps=(0.001, 0.002), num_shots=2500, chunk_shots=1000)
>>> tasks = grid.tasks()
>>> [(t.json_metadata["d"], t.json_metadata["p"], t.decoder, t.num_chunks) for t in tasks]
[(3, 0.001, 'pymatching@offline', 3), (3, 0.002, 'pymatching@offline', 3)]
>>> tasks[0].chunk_shots * tasks[0].num_chunks      # whole chunks: at least num_shots
3000
>>> chunk_seed(tasks[0].strong_id, 1) == chunk_seed(tasks[0].strong_id, 1) != chunk_seed(tasks[0].strong_id, 2)
True
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["SweepTask", "QecGrid", "KvGrid", "chunk_seed", "expand"]

# Transports a wire-path QEC task may name (the decoder service runs in its own process
# on the worker's host; inproc runs it in a thread of the worker).
QEC_TRANSPORTS = ("offline", "shm", "tcp", "ucx", "inproc")
KV_TRANSPORTS = ("shm", "tcp", "ucx", "inproc", "nixl")


def chunk_seed(strong_id: str, chunk: int) -> int:
    """The sampling seed of chunk ``chunk`` of the task ``strong_id``: 63 bits of
    SHA-256 over both, so it depends on nothing else (not the worker, not the order).

    >>> chunk_seed("abc", 0)
    3242986837054625128
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"chunk must be an int >= 0, got {chunk!r}")
    digest = hashlib.sha256(f"qlink.sweep/{strong_id}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class SweepTask:
    """One grid point: ``num_chunks`` chunks of ``chunk_shots`` shots each.

    ``decoder`` and ``json_metadata`` fill sinter's columns of the same names;
    ``strong_id`` identifies the task (a hash of everything that decides its
    statistics, never of the chunk size); ``work`` is the plain-data recipe a worker runs.
    """

    strong_id: str
    decoder: str
    json_metadata: dict
    work: dict
    chunk_shots: int
    num_chunks: int

    def __post_init__(self):
        for name in ("chunk_shots", "num_chunks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.strong_id, str) or not self.strong_id:
            raise ValueError("strong_id must be a non-empty string")

    def seed(self, chunk: int) -> int:
        """:func:`chunk_seed` of this task."""
        return chunk_seed(self.strong_id, chunk)


def _check_ints(name: str, values, *, lo: int) -> tuple[int, ...]:
    vals = tuple(values)
    if not vals:
        raise ValueError(f"{name} must name at least one value")
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must hold ints >= {lo}, got {v!r}")
    return vals


def _check_names(name: str, values, allowed) -> tuple[str, ...]:
    vals = tuple(values)
    if not vals:
        raise ValueError(f"{name} must name at least one value")
    for v in vals:
        if v not in allowed:
            raise ValueError(f"{name}: {v!r} is not one of {', '.join(allowed)}")
    return vals


def _chunks(num: int, chunk: int, what: str) -> int:
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"num_{what} must be an int >= 1, got {num!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk_{what} must be an int >= 1, got {chunk!r}")
    return math.ceil(num / chunk)


def _hash_id(kind: str, decoder: str, metadata: dict, extra: str = "") -> str:
    text = json.dumps({"kind": kind, "decoder": decoder, "metadata": metadata}, sort_keys=True) + extra
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class QecGrid:
    """Surface-code memory: distance × physical error rate × decoder × transport.

    ``transports`` holds ``"offline"`` (the chunk's shots decoded by calling the decoder
    directly) and/or a transport name (``shm``, ``tcp``, ``ucx``, ``inproc``): every shot
    then travels the full wire path, controller → decoder service (its own process on
    the worker's host) → controller, through :func:`qlink.qec.loop.run_loop`.
    ``rounds`` defaults to the distance. ``num_shots`` per point is rounded up to whole
    chunks of ``chunk_shots``. Wire-path options: ``rounds_per_frame``, ``cycle_ns``
    (1 runs as fast as the decoder answers) and ``max_in_flight_shots`` (throttles the
    controller to the decoder, so no shot is dropped for lack of queue room).
    """

    distances: tuple = (3, 5)
    ps: tuple = (0.001, 0.002)
    decoders: tuple = ("pymatching",)
    transports: tuple = ("offline",)
    rounds: int | None = None
    code: str = "surface_code:rotated_memory_z"
    source_kind: str = "stim"
    num_shots: int = 10_000
    chunk_shots: int = 1_000
    rounds_per_frame: int = 1
    cycle_ns: int = 1
    max_in_flight_shots: int = 512

    def tasks(self) -> list[SweepTask]:
        """One :class:`SweepTask` per (distance, p, decoder, transport), in that nesting order."""
        from qlink.qec.decoders import get_decoder
        from qlink.qec.loop import build_source, source_spec

        distances = _check_ints("distances", self.distances, lo=2)
        ps = tuple(self.ps)
        if not ps:
            raise ValueError("ps must name at least one physical error rate")
        decoders = tuple(self.decoders)
        if not decoders:
            raise ValueError("decoders must name at least one decoder")
        for name in decoders:
            get_decoder(name)  # ValueError listing the known names
        transports = _check_names("transports", self.transports, QEC_TRANSPORTS)
        n_chunks = _chunks(self.num_shots, self.chunk_shots, "shots")
        if self.rounds is not None:
            _check_ints("rounds", (self.rounds,), lo=1)
        for name in ("rounds_per_frame", "cycle_ns", "max_in_flight_shots"):
            _check_ints(name, (getattr(self, name),), lo=1)
        out = []
        for d in distances:
            for p in ps:
                spec = source_spec(distance=d, rounds=self.rounds or d, p=float(p), code=self.code,
                                   kind=self.source_kind)
                src = build_source(spec)
                for dec in decoders:
                    for tr in transports:
                        meta: dict[str, Any] = {"d": d, "r": spec["rounds"], "p": spec["p"], "code": spec["code"],
                                                "noise": spec["noise"], "source": spec["kind"],
                                                "decoder": dec, "transport": tr}
                        work: dict[str, Any] = {"kind": "qec", "source": spec, "decoder": dec, "transport": tr}
                        if tr != "offline":
                            wire = {"rounds_per_frame": int(self.rounds_per_frame), "cycle_ns": int(self.cycle_ns)}
                            meta.update(wire)
                            work.update(wire, max_in_flight_shots=int(self.max_in_flight_shots))
                        column = f"{dec}@{tr}"
                        out.append(SweepTask(strong_id=_qec_strong_id(src, column, meta), decoder=column,
                                             json_metadata=meta, work=work, chunk_shots=int(self.chunk_shots),
                                             num_chunks=n_chunks))
        return out


def _qec_strong_id(src, column: str, meta: dict) -> str:
    circuit = getattr(src.source, "circuit", None)
    try:
        import sinter
    except ImportError:
        sinter = None
    if sinter is not None and circuit is not None:
        return sinter.Task(circuit=circuit, decoder=column, detector_error_model=src.dem,
                           json_metadata=meta).strong_id()
    return _hash_id("qec", column, meta, str(src.dem))


@dataclass(frozen=True)
class KvGrid:
    """KV-cache movement: prompt length (tokens) × transport, for a preset model layout.

    Each "shot" is one transfer of a whole request's KV cache (every layer, K and V)
    between two processes on the worker's host (:mod:`qlink.ai`); an "error" is a
    transfer slower than ``budget_ms`` (default 30 ms: DistServe's KV-transfer target,
    met by > 95 % of requests in that paper). ``num_transfers`` per point, in chunks of
    ``chunk_transfers`` (each chunk opens its own link and makes one warm-up transfer
    first, not counted).
    """

    tokens: tuple = (512, 4096)
    transports: tuple = ("shm", "tcp")
    preset: str = "llama-3-8b"
    num_transfers: int = 20
    chunk_transfers: int = 5
    budget_ms: float = 30.0
    pattern: str = "contiguous"

    def tasks(self) -> list[SweepTask]:
        """One :class:`SweepTask` per (tokens, transport)."""
        from qlink.ai import preset as make_spec

        toks = _check_ints("tokens", self.tokens, lo=1)
        transports = _check_names("transports", self.transports, KV_TRANSPORTS)
        make_spec(self.preset)  # ValueError naming the known presets
        if self.pattern not in ("contiguous", "scattered"):
            raise ValueError(f"pattern must be 'contiguous' or 'scattered', got {self.pattern!r}")
        if not self.budget_ms > 0:
            raise ValueError(f"budget_ms must be > 0, got {self.budget_ms!r}")
        n_chunks = _chunks(self.num_transfers, self.chunk_transfers, "transfers")
        out = []
        for n in toks:
            for tr in transports:
                meta = {"kind": "kv", "tokens": n, "transport": tr, "preset": self.preset,
                        "pattern": self.pattern, "budget_ms": float(self.budget_ms)}
                work = {"kind": "kv", "tokens": n, "transport": tr, "preset": self.preset,
                        "pattern": self.pattern, "budget_ms": float(self.budget_ms)}
                column = f"kv@{tr}"
                out.append(SweepTask(strong_id=_hash_id("kv", column, meta), decoder=column, json_metadata=meta,
                                     work=work, chunk_shots=int(self.chunk_transfers), num_chunks=n_chunks))
        return out


def expand(grid) -> list[SweepTask]:
    """Tasks of a grid, a task, or an iterable mixing them; duplicates (same strong id) once.

    >>> len(expand([QecGrid(distances=(3,), ps=(0.001,)), QecGrid(distances=(3,), ps=(0.001,))]))
    1
    """
    items: Iterable = [grid] if isinstance(grid, (QecGrid, KvGrid, SweepTask)) else grid
    seen: dict[str, SweepTask] = {}
    try:
        iterator = iter(items)
    except TypeError:
        raise TypeError(f"grid must be a QecGrid, a KvGrid, a SweepTask or a list of them, got "
                        f"{type(grid).__name__}") from None
    for item in iterator:
        if isinstance(item, SweepTask):
            tasks = [item]
        elif isinstance(item, (QecGrid, KvGrid)):
            tasks = item.tasks()
        else:
            raise TypeError(f"grid items must be QecGrid, KvGrid or SweepTask, got {type(item).__name__}")
        for t in tasks:
            prev = seen.get(t.strong_id)
            if prev is not None and prev.chunk_shots != t.chunk_shots:
                raise ValueError(f"task {t.strong_id[:12]}… appears twice with different chunk sizes "
                                 f"({prev.chunk_shots} and {t.chunk_shots})")
            if prev is None or t.num_chunks > prev.num_chunks:
                seen[t.strong_id] = t
    if not seen:
        raise ValueError("the grid holds no tasks")
    return list(seen.values())
