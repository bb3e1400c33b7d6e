"""Run a grid's chunks on Dask distributed, append each to the CSV as it finishes, resume.

By default :func:`run_sweep` starts a ``LocalCluster`` of ``num_workers`` worker
processes with one thread each (workers may start child processes: the wire path runs
the decoder service in one), on the loopback interface (its dashboard too, on a free port). Give
``scheduler`` (``"tcp://host:8786"``) to run on an existing cluster instead; its
workers need qlink installed and, for wire-path or KV tasks, must be allowed children
(``DASK_DISTRIBUTED__WORKER__DAEMON=False``).

Chunks are submitted round-robin over the tasks (chunk 0 of every task, then chunk 1,
…), at most a few per worker thread at a time, so a sweep that stops early covers the
grid evenly; each is written to the CSV the moment it finishes.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass, field

from ._csv import CsvAppender, SweepError
from ._grid import SweepTask, expand
from ._work import run_chunk

__all__ = ["run_sweep", "SweepResult", "pending_chunks"]


@dataclass(frozen=True)
class SweepResult:
    """What one :func:`run_sweep` call did."""

    csv_path: str
    num_tasks: int
    chunks_total: int  # chunks the grid asks for
    chunks_before: int  # of those, already in the CSV when the call began
    chunks_run: int  # written by this call
    chunks_left: int  # still missing (max_chunks stopped early, or failures)
    failures: tuple = ()  # (strong_id, chunk, "Type: message")
    seconds: float = 0.0
    scheduler: str = ""
    num_workers: int = 0
    transports_used: dict = field(default_factory=dict)  # requested name -> transport that carried the bytes

    @property
    def complete(self) -> bool:
        return self.chunks_left == 0


def pending_chunks(tasks: list[SweepTask], done: dict) -> list[tuple[SweepTask, int]]:
    """The (task, chunk) pairs not in ``done`` (``{strong_id: {chunk: shots}}``), round-robin.

    Raises :class:`SweepError` when a done chunk holds a different number of shots than
    the task's chunks (the CSV was written with another chunk size).

    >>> from qlink.sweep._grid import QecGrid
    >>> a, b = QecGrid(distances=(3,), ps=(0.001, 0.002), num_shots=300, chunk_shots=100).tasks()
    >>> [(t is a, c) for t, c in pending_chunks([a, b], {a.strong_id: {0: 100, 2: 100}})]
    [(False, 0), (True, 1), (False, 1), (False, 2)]
    """
    for t in tasks:
        for c, shots in done.get(t.strong_id, {}).items():
            if shots != t.chunk_shots:
                raise SweepError(
                    f"the CSV holds chunk {c} of task {t.decoder} {t.json_metadata} with {shots} shots, but this "
                    f"grid's chunks hold {t.chunk_shots}; rerun with the chunk size the file was written with "
                    f"({shots}) or write to a new CSV")
    out = []
    for c in range(max(t.num_chunks for t in tasks)):
        for t in tasks:
            if c < t.num_chunks and c not in done.get(t.strong_id, {}):
                out.append((t, c))
    return out


def _local_cluster(num_workers: int):
    import dask
    from distributed import LocalCluster

    with dask.config.set({"distributed.worker.daemon": False}):
        return LocalCluster(n_workers=num_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                            dashboard_address="127.0.0.1:0", silence_logs=40)


def _connect(scheduler, num_workers: int):
    try:
        from distributed import Client
    except ImportError:
        from qlink.errors import missing

        raise missing("dask[distributed]", extra="dask", feature="qlink sweeps") from None
    if scheduler is None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        cluster = _local_cluster(num_workers)
        return Client(cluster), cluster
    if isinstance(scheduler, str):
        return Client(scheduler, timeout="30s"), None
    raise TypeError(f"scheduler must be None (start a LocalCluster) or an address like 'tcp://host:8786', "
                    f"got {type(scheduler).__name__}")


def run_sweep(grid, *, csv_path, scheduler: str | None = None, num_workers: int = 2, max_chunks: int | None = None,
              progress: bool = True, in_flight_per_thread: int = 2, client=None) -> SweepResult:
    """Run every chunk of ``grid`` the CSV at ``csv_path`` does not hold yet; return a summary.

    ``grid``: a :class:`~qlink.sweep.QecGrid`, :class:`~qlink.sweep.KvGrid`,
    :class:`~qlink.sweep.SweepTask`, or a list of them. ``scheduler``: None starts a
    ``LocalCluster`` of ``num_workers`` processes (one thread each); an address uses that
    cluster. ``client``: an existing ``distributed.Client`` (overrides both).
    ``max_chunks``: stop after submitting that many chunks (the rest wait for the next
    call). Chunks that fail are reported together in a :class:`SweepError` after every
    other chunk has been written; rerunning retries only what is missing.
    """
    if max_chunks is not None and (isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 0):
        raise ValueError(f"max_chunks must be None or an int >= 0, got {max_chunks!r}")
    if isinstance(in_flight_per_thread, bool) or not isinstance(in_flight_per_thread, int) or in_flight_per_thread < 1:
        raise ValueError(f"in_flight_per_thread must be an int >= 1, got {in_flight_per_thread!r}")
    tasks = expand(grid)
    t_start = time.perf_counter()
    with CsvAppender(csv_path) as out:
        todo = pending_chunks(tasks, out.done.chunks)
        total = sum(t.num_chunks for t in tasks)
        before = total - len(todo)
        if max_chunks is not None:
            todo = todo[:max_chunks]
        if not todo:
            return SweepResult(csv_path=str(csv_path), num_tasks=len(tasks), chunks_total=total, chunks_before=before,
                               chunks_run=0, chunks_left=total - before, seconds=time.perf_counter() - t_start)
        own = client is None
        cluster = None
        if own:
            client, cluster = _connect(scheduler, num_workers)
        try:
            return _drive(client, tasks, todo, out, total=total, before=before, progress=progress,
                          in_flight_per_thread=in_flight_per_thread, t_start=t_start, csv_path=csv_path)
        finally:
            if own:
                client.close()
                if cluster is not None:
                    cluster.close()


def _drive(client, tasks, todo, out, *, total, before, progress, in_flight_per_thread, t_start, csv_path):
    from distributed import as_completed

    info = client.scheduler_info()
    workers = info.get("workers", {})
    threads = sum(int(w.get("nthreads", 1)) for w in workers.values()) or 1
    window = max(2, threads * in_flight_per_thread)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=before, desc="sweep", unit="chunk", file=sys.stderr, dynamic_ncols=True)
    queue = iter(todo)
    owners = {}
    futures = as_completed()

    def submit_next() -> bool:
        item = next(queue, None)
        if item is None:
            return False
        task, chunk = item
        fut = client.submit(run_chunk, task.work, shots=task.chunk_shots, seed=task.seed(chunk),
                            key=f"qlink-sweep-{task.strong_id[:24]}-{chunk}-{os.getpid()}-{next(_keys)}", pure=False)
        owners[fut.key] = (task, chunk)
        futures.add(fut)
        return True

    for _ in range(window):
        if not submit_next():
            break
    run = 0
    failures = []
    used: dict = {}
    try:
        for fut in futures:
            task, chunk = owners.pop(fut.key)
            if fut.status == "finished":
                counts = fut.result()
                out.append(strong_id=task.strong_id, decoder=task.decoder, json_metadata=task.json_metadata,
                           chunk=chunk, counts=counts)
                run += 1
                if "transport_used" in counts:
                    used[task.work.get("transport")] = counts["transport_used"]
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(f"{task.decoder} {_short(task.json_metadata)}", refresh=False)
            else:
                exc = fut.exception()
                failures.append((task.strong_id, chunk, f"{type(exc).__name__}: {exc}"))
            fut.release()
            submit_next()
    finally:
        if bar is not None:
            bar.close()
    result = SweepResult(csv_path=str(csv_path), num_tasks=len(tasks), chunks_total=total, chunks_before=before,
                         chunks_run=run, chunks_left=total - before - run, failures=tuple(failures),
                         seconds=time.perf_counter() - t_start, scheduler=client.scheduler.address,
                         num_workers=len(workers), transports_used=used)
    if failures:
        shown = "; ".join(f"chunk {c} of {sid[:12]}…: {msg}" for sid, c, msg in failures[:3])
        err = SweepError(f"{len(failures)} chunk(s) failed ({shown}); every other chunk is in {csv_path}; "
                         "rerun the same sweep to retry only the missing chunks")
        err.result = result
        raise err
    return result


_keys = itertools.count()


def _short(meta: dict) -> str:
    keys = ("d", "p", "tokens", "transport")
    return " ".join(f"{k}={meta[k]}" for k in keys if k in meta)
