"""How much faster a CPU-bound sweep runs on 2 Dask workers than on 1.

:func:`sweep_speedup` runs the same grid once per worker count, each on its own
``LocalCluster`` (started, and every worker warmed up with the imports a chunk needs,
before the clock starts), each into its own CSV, and reports wall time per worker count,
the speedup over one worker, and whether both runs wrote the same rows (they must:
seeds depend only on task and chunk). On a 2-core machine two workers busy both cores;
anything else running on the machine shows up as noise, so the load average before
and after is part of the result.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

__all__ = ["sweep_speedup", "default_speedup_grid", "machine_parallel_speedup"]


def default_speedup_grid():
    """The grid :func:`sweep_speedup` times unless given another (CPU-bound, offline decoding)."""
    from ._grid import QecGrid

    # d=7 and d=9 memories at p around the threshold region: sampling + matching dominate,
    # a chunk takes a fraction of a second, 32 chunks in all.
    return QecGrid(distances=(7, 9), ps=(0.004, 0.008), decoders=("pymatching",), transports=("offline",),
                   num_shots=64_000, chunk_shots=8_000)


def _rows(path) -> list[tuple]:
    import csv
    import json

    with open(path) as f:
        r = csv.DictReader(f)
        r.fieldnames = [x.strip() for x in r.fieldnames]
        return sorted((row["strong_id"], int(row["shots"]), int(row["errors"]), int(row["discards"]),
                       json.dumps(json.loads(row["custom_counts"] or "{}"), sort_keys=True)) for row in r)


def _spin(n: int) -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x += i * i
    return time.perf_counter() - t0


def machine_parallel_speedup(*, processes: int = 2, loop_iterations: int = 5_000_000) -> float:
    """What the machine gives right now: (processes × one loop alone) / (processes loops at once).

    The same pure-Python loop run once in one process, then once in each of ``processes``
    spawned processes at the same time; an idle machine with that many cores gives
    about ``processes``, a busy one less. The ceiling a sweep's speedup is read against.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(processes) as pool:
        pool.map(_spin, [10_000] * processes)  # workers up and warm
        alone = min(pool.apply(_spin, (loop_iterations,)) for _ in range(2))
        t0 = time.perf_counter()
        pool.map(_spin, [loop_iterations] * processes, chunksize=1)
        together = time.perf_counter() - t0
    return processes * alone / together


def sweep_speedup(*, grid=None, workers=(1, 2), repeats: int = 1, out_dir=None, progress: bool = False) -> dict:
    """Time ``grid`` (default: a CPU-bound offline QEC grid) on each worker count, best of ``repeats``.

    Returns ``{"seconds": {n: s}, "speedup": {n: s_fewest / s_n}, "chunks": ..., "rows_identical": bool,
    "machine_parallel_speedup": ..., "cpu_count": ..., "loadavg_before": ..., "loadavg_after": ...}``.
    Timing covers submission to the last row written; cluster start-up and worker imports
    are outside it. ``machine_parallel_speedup`` (:func:`machine_parallel_speedup` with as
    many processes as the most workers, measured before each repeat, best kept) says how
    much parallelism the machine offered at the time: read the sweep's speedup against it.
    """
    from distributed import Client

    from ._grid import expand
    from ._run import _local_cluster, run_sweep
    from ._work import warm_worker

    grid = default_speedup_grid() if grid is None else grid
    tasks = expand(grid)
    counts = sorted({int(n) for n in workers})
    if not counts or counts[0] < 1:
        raise ValueError(f"workers must hold ints >= 1, got {workers!r}")
    tmp = tempfile.TemporaryDirectory(prefix="qlink-sweep-speedup-") if out_dir is None else None
    out = Path(tmp.name if tmp else out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    load_before = os.getloadavg()
    seconds: dict = {}
    rows: dict = {}
    ceilings = []
    with contextlib.ExitStack() as stack:
        if tmp is not None:
            stack.callback(tmp.cleanup)
        clients = {}
        for n in counts:  # every cluster up and warm before any timing; idle ones cost no CPU
            cluster = _local_cluster(n)
            stack.callback(cluster.close)
            client = Client(cluster)
            stack.callback(client.close)
            client.wait_for_workers(n, timeout=60)
            client.run(warm_worker)
            clients[n] = client
        # Interleave the worker counts, repeat after repeat, so a change in the machine's
        # load touches them alike; keep each count's best time.
        for _ in range(repeats):
            if counts[-1] > 1:
                ceilings.append(machine_parallel_speedup(processes=counts[-1]))
            for n in counts:
                path = out / f"speedup_{n}w.csv"
                if path.exists():
                    path.unlink()
                t0 = time.perf_counter()
                res = run_sweep(tasks, csv_path=path, client=clients[n], progress=progress)
                took = time.perf_counter() - t0
                seconds[n] = min(seconds.get(n, took), took)
                if not res.complete:
                    raise RuntimeError(f"the {n}-worker run left {res.chunks_left} chunks undone")
                rows[n] = _rows(path)
    ceiling = max(ceilings) if ceilings else 1.0
    base = seconds[counts[0]]
    return {
        "seconds": {n: round(s, 3) for n, s in seconds.items()},
        "speedup": {n: round(base / s, 3) for n, s in seconds.items()},
        "chunks": sum(t.num_chunks for t in tasks),
        "shots": sum(t.num_chunks * t.chunk_shots for t in tasks),
        "rows_identical": all(r == rows[counts[0]] for r in rows.values()),
        "repeats": repeats,
        "machine_parallel_speedup": round(ceiling, 3),
        "cpu_count": os.cpu_count(),
        "loadavg_before": tuple(round(x, 2) for x in load_before),
        "loadavg_after": tuple(round(x, 2) for x in os.getloadavg()),
    }
