"""The chunk size of a QEC sweep, chosen from the time one shot takes here.

A chunk is the unit a Dask worker runs and the CSV records, so its size trades overhead
(each chunk costs a few milliseconds of scheduling, and a row) against granularity (a
progress bar that moves, an interrupt that loses little, both workers busy to the end).
:func:`auto_chunk_shots` aims for chunks of about ``target_s`` seconds on the grid's
slowest point: it times a probe of that point in this process (its decoder compiled
first, so only sampling and decoding are timed), then rounds down to 1, 2 or 5 × 10^k
shots, at least ``min_shots`` and no more than a point's ``num_shots``; where the grid as a
whole would be fewer chunks than two per worker, smaller, so no worker sits idle. A CSV
that already holds chunks of the grid's points fixes the size: chunks are seeded by index,
so a resumed sweep must cut the shots as the file did.

>>> nice_floor(3_700), nice_floor(1_000), nice_floor(19)
(2000, 1000, 10)
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

__all__ = ["auto_chunk_shots", "nice_floor", "ChunkChoice"]

TARGET_CHUNK_S = 2.0


def nice_floor(n: float) -> int:
    """The largest 1, 2 or 5 × 10^k that is <= ``n`` (at least 1)."""
    if n < 1:
        return 1
    k = 10 ** int(math.floor(math.log10(n)))
    return max(m * k for m in (1, 2, 5) if m * k <= n)


@dataclasses.dataclass(frozen=True)
class ChunkChoice:
    """The chosen ``chunk_shots`` and why: ``basis`` is ``"csv"`` (the file's size) or
    ``"measured"`` (from ``seconds_per_shot`` of the probed point)."""

    chunk_shots: int
    basis: str
    seconds_per_shot: float | None = None
    probed: dict | None = None

    def describe(self) -> str:
        if self.basis == "csv":
            return f"chunks of {self.chunk_shots} shots, as the CSV already holds"
        where = " ".join(f"{k}={self.probed[k]}" for k in ("d", "p", "decoder", "transport") if k in self.probed)
        est = self.chunk_shots * self.seconds_per_shot
        return (f"chunks of {self.chunk_shots} shots (about {est:.2g} s each on the slowest point, {where}: "
                f"{self.seconds_per_shot * 1e6:.3g} us a shot here)")


def auto_chunk_shots(grid, *, csv_path=None, num_workers: int = 2, target_s: float = TARGET_CHUNK_S,
                     min_shots: int = 100, probe_shots: int | None = None) -> ChunkChoice:
    """Choose ``chunk_shots`` for ``grid`` (a :class:`~qlink.sweep.QecGrid`); see the module notes."""
    from ._csv import read_done_chunks
    from ._work import run_chunk

    if not target_s > 0 or num_workers < 1 or min_shots < 1:
        raise ValueError(f"target_s must be > 0, num_workers and min_shots >= 1; got {target_s}, {num_workers}, "
                         f"{min_shots}")
    tasks = dataclasses.replace(grid, chunk_shots=1).tasks()
    if csv_path is not None and Path(csv_path).exists():
        done = read_done_chunks(csv_path, repair=False).chunks
        for t in tasks:
            for shots in done.get(t.strong_id, {}).values():
                return ChunkChoice(chunk_shots=int(shots), basis="csv")
    slowest = max(tasks, key=lambda t: (t.json_metadata["d"] * t.json_metadata["r"], t.json_metadata["p"],
                                        t.work["transport"] != "offline"))
    offline = slowest.work["transport"] == "offline"
    n = int(probe_shots or (2_000 if offline else 200))
    run_chunk(slowest.work, shots=min(n, 100), seed=1)  # compiles the decoder (and warms the wire path)
    t0 = time.perf_counter()
    counts = run_chunk(slowest.work, shots=n, seed=2)
    per_shot = max(float(counts.get("seconds") or 0.0), time.perf_counter() - t0 if offline else 0.0) / n
    per_shot = max(per_shot, 1e-9)
    want = target_s / per_shot
    total = int(grid.num_shots) * len(tasks)
    want = min(want, int(grid.num_shots), total / (2 * num_workers))
    return ChunkChoice(chunk_shots=max(int(min_shots), nice_floor(want)), basis="measured", seconds_per_shot=per_shot,
                       probed=dict(slowest.json_metadata))
