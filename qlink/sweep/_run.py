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

Stopping, as sinter's ``collect`` does: Ctrl-C (``KeyboardInterrupt``) lets the chunks
already running finish for up to :data:`GRACE_S` seconds (a second Ctrl-C cuts that
short), writes them, cancels the rest and raises :class:`SweepInterrupted`; the CSV
then holds every finished chunk and the same call resumes from it. The workers of the
``LocalCluster`` a sweep starts ignore SIGINT, so the terminal's Ctrl-C reaches the
sweep alone and in-flight chunks are not lost with their workers. A worker that dies
is reported on the progress line; Dask runs its chunk again elsewhere, and a chunk that
kills :data:`ALLOWED_FAILURES` + 1 workers fails (``KilledWorker``) and is reported with
the other failures. With no worker connected for ``no_worker_timeout_s`` the sweep
stops with a :class:`SweepError` instead of waiting forever.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
import dataclasses
from dataclasses import dataclass, field

from ._csv import CsvAppender, SweepError
from ._grid import SweepTask, expand
from ._work import run_chunk

__all__ = ["run_sweep", "SweepResult", "SweepInterrupted", "pending_chunks", "GRACE_S", "ALLOWED_FAILURES"]

GRACE_S = 1.0  # after Ctrl-C, chunks that finish within this are still written
ALLOWED_FAILURES = 3  # worker deaths one chunk may cause before it fails (Dask's default)
_POLL_S = 0.05


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
    num_workers: int = 0  # workers connected at any time during the call
    transports_used: dict = field(default_factory=dict)  # requested name -> transport that carried the bytes
    workers_lost: int = 0  # workers that left (died, or were stopped) while the sweep ran
    interrupted: bool = False  # Ctrl-C stopped it; the finished chunks are in the CSV
    chunk_choice: object = None  # with auto_chunks: the ChunkChoice (its describe() says why that size)

    @property
    def complete(self) -> bool:
        return self.chunks_left == 0


class SweepInterrupted(SweepError):
    """Ctrl-C stopped a sweep; ``result`` (a :class:`SweepResult`) says what the CSV holds."""

    def __init__(self, result: "SweepResult"):
        self.result = result
        super().__init__(f"interrupted: {result.chunks_run} chunk(s) written by this run, "
                         f"{result.chunks_total - result.chunks_left} of {result.chunks_total} in "
                         f"{result.csv_path}; run the same sweep again to resume")


def _chunk_cost(task: SweepTask) -> float:
    """A rough cost of one chunk of ``task``, only to order them: a QEC point's detectors
    times its rounds, more for a noisier one (more defects to match); a KV point's tokens."""
    m = task.json_metadata
    if "d" in m:
        return float(m["d"]) ** 2 * float(m.get("r", m["d"])) * (float(m.get("p", 0.0)) + 0.001)
    return float(m.get("tokens", 0))


def pending_chunks(tasks: list[SweepTask], done: dict) -> list[tuple[SweepTask, int]]:
    """The (task, chunk) pairs not in ``done`` (``{strong_id: {chunk: shots}}``), round-robin,
    the costliest task first in each round: the workers then end on the cheap chunks, and
    the last slow chunk does not run alone while the other workers wait.

    Raises :class:`SweepError` when a done chunk holds a different number of shots than
    the task's chunks (the CSV was written with another chunk size).

    >>> from qlink.sweep._grid import QecGrid
    >>> a, b = QecGrid(distances=(3,), ps=(0.001, 0.002), num_shots=300, chunk_shots=100).tasks()
    >>> [(t is a, c) for t, c in pending_chunks([a, b], {a.strong_id: {0: 100, 2: 100}})]
    [(False, 0), (False, 1), (True, 1), (False, 2)]
    """
    for t in tasks:
        for c, shots in done.get(t.strong_id, {}).items():
            if shots != t.chunk_shots:
                raise SweepError(
                    f"the CSV holds chunk {c} of task {t.decoder} {t.json_metadata} with {shots} shots, but this "
                    f"grid's chunks hold {t.chunk_shots}; rerun with the chunk size the file was written with "
                    f"({shots}) or write to a new CSV")
    out = []
    ordered = sorted(tasks, key=_chunk_cost, reverse=True)  # (stable: equal costs keep the grid's order)
    for c in range(max(t.num_chunks for t in tasks)):
        for t in ordered:
            if c < t.num_chunks and c not in done.get(t.strong_id, {}):
                out.append((t, c))
    return out


def _local_cluster(num_workers: int):
    import dask
    from distributed import LocalCluster

    # the worker's statistical profiler samples every thread 100 times a second: on a 2-core
    # machine that is CPU taken from the chunks, for a profile nobody reads here
    with dask.config.set({"distributed.worker.daemon": False,
                          "distributed.scheduler.allowed-failures": ALLOWED_FAILURES,
                          "distributed.worker.profile.enabled": False,
                          # each worker imports what chunks use while it starts (see _preload)
                          "distributed.worker.preload": ["qlink.sweep._preload"]}):
        return LocalCluster(n_workers=num_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                            dashboard_address="127.0.0.1:0", silence_logs=40)


def _ignore_sigint_plugin():
    """A worker plugin: the worker process ignores SIGINT (the terminal's Ctrl-C is the sweep's to handle)."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class IgnoreSigint(WorkerPlugin):
        name = "qlink-ignore-sigint"

        def setup(self, worker):
            import signal
            import threading

            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.SIG_IGN)

    return IgnoreSigint()


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
        client = Client(cluster)
        try:
            client.register_plugin(_ignore_sigint_plugin())
        except Exception:  # noqa: BLE001 - an older distributed: Ctrl-C then also reaches the workers
            pass
        return client, cluster
    if isinstance(scheduler, str):
        return Client(scheduler, timeout="30s"), None
    raise TypeError(f"scheduler must be None (start a LocalCluster) or an address like 'tcp://host:8786', "
                    f"got {type(scheduler).__name__}")


def _size_chunks(grid, *, csv_path, scheduler, num_workers: int, client):
    """``(grid with its chunk size chosen, ChunkChoice, client, cluster)``: the chunk size timed
    by :func:`~qlink.sweep.auto_chunk_shots` in a thread while the cluster starts here (a
    ``LocalCluster`` starts in a second or two, mostly its processes importing: time the probe
    would otherwise add), or at once where the CSV fixes it or a client is given."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from ._chunking import auto_chunk_shots
    from ._grid import QecGrid

    if not isinstance(grid, QecGrid):
        raise TypeError(f"auto_chunks sizes a QecGrid's chunks; got {type(grid).__name__} (give its chunk size)")
    cluster = None
    if client is not None or Path(csv_path).exists():
        choice = auto_chunk_shots(grid, csv_path=csv_path, num_workers=num_workers)
    else:
        with ThreadPoolExecutor(1, thread_name_prefix="qlink-chunk-probe") as pool:
            probe = pool.submit(auto_chunk_shots, grid, csv_path=csv_path, num_workers=num_workers)
            try:
                client, cluster = _connect(scheduler, num_workers)
            except BaseException:
                probe.cancel()
                raise
            try:
                choice = probe.result()
            except BaseException:
                client.close()
                if cluster is not None:
                    cluster.close()
                raise
    return dataclasses.replace(grid, chunk_shots=choice.chunk_shots), choice, client, cluster


def run_sweep(grid, *, csv_path, scheduler: str | None = None, num_workers: int = 2, max_chunks: int | None = None,
              progress: bool = True, in_flight_per_thread: int = 2, client=None, no_worker_timeout_s: float = 60.0,
              auto_chunks: bool = False, say=None) -> SweepResult:
    """Run every chunk of ``grid`` the CSV at ``csv_path`` does not hold yet; return a summary.

    ``grid``: a :class:`~qlink.sweep.QecGrid`, :class:`~qlink.sweep.KvGrid`,
    :class:`~qlink.sweep.SweepTask`, or a list of them. ``scheduler``: None starts a
    ``LocalCluster`` of ``num_workers`` processes (one thread each); an address uses that
    cluster. ``client``: an existing ``distributed.Client`` (overrides both).
    ``max_chunks``: stop after submitting that many chunks (the rest wait for the next
    call). Chunks that fail are reported together in a :class:`SweepError` after every
    other chunk has been written; rerunning retries only what is missing. Ctrl-C raises
    :class:`SweepInterrupted` once the chunks running then are written (see the module
    docstring). ``auto_chunks``: a :class:`~qlink.sweep.QecGrid`'s chunk size is chosen
    from the time a shot takes here (:func:`~qlink.sweep.auto_chunk_shots`, timed while the
    cluster starts; the result's ``chunk_choice`` says what was chosen and why) instead of
    its ``chunk_shots``. ``say``: where worker arrivals and departures are reported
    (default: above the progress bar, or stderr).
    """
    if max_chunks is not None and (isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 0):
        raise ValueError(f"max_chunks must be None or an int >= 0, got {max_chunks!r}")
    if isinstance(in_flight_per_thread, bool) or not isinstance(in_flight_per_thread, int) or in_flight_per_thread < 1:
        raise ValueError(f"in_flight_per_thread must be an int >= 1, got {in_flight_per_thread!r}")
    if isinstance(no_worker_timeout_s, bool) or not isinstance(no_worker_timeout_s, (int, float)) \
            or not no_worker_timeout_s > 0:
        raise ValueError(f"no_worker_timeout_s must be a number > 0, got {no_worker_timeout_s!r}")
    t_start = time.perf_counter()
    own = client is None
    cluster = choice = None
    if auto_chunks:
        grid, choice, client, cluster = _size_chunks(grid, csv_path=csv_path, scheduler=scheduler,
                                                     num_workers=num_workers, client=client)
    try:
        res = _run_connected(grid, csv_path=csv_path, scheduler=scheduler, num_workers=num_workers,
                             max_chunks=max_chunks, progress=progress, in_flight_per_thread=in_flight_per_thread,
                             client=client, no_worker_timeout_s=no_worker_timeout_s, say=say, t_start=t_start)
    finally:
        if own and cluster is not None:  # (started by _size_chunks)
            client.close()
            cluster.close()
    return res if choice is None else dataclasses.replace(res, chunk_choice=choice)


def _run_connected(grid, *, csv_path, scheduler, num_workers, max_chunks, progress, in_flight_per_thread, client,
                   no_worker_timeout_s, say, t_start) -> SweepResult:
    tasks = expand(grid)
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
                          in_flight_per_thread=in_flight_per_thread, t_start=t_start, csv_path=csv_path,
                          no_worker_timeout_s=float(no_worker_timeout_s), say=say)
        finally:
            if own:
                client.close()
                if cluster is not None:
                    cluster.close()


class _Workers:
    """Which workers the scheduler has, checked about once a second: arrivals and departures."""

    def __init__(self, client, say):
        self.client, self.say = client, say
        self.now = set(client.scheduler_info().get("workers", {}))
        self.seen = set(self.now)
        self.lost = 0
        self.none_since = None if self.now else time.monotonic()
        self._next = time.monotonic() + 1.0

    def threads(self) -> int:
        info = self.client.scheduler_info().get("workers", {})
        return sum(int(w.get("nthreads", 1)) for w in info.values()) or 1

    def check(self) -> None:
        t = time.monotonic()
        if t < self._next:
            return
        self._next = t + 1.0
        try:
            now = set(self.client.scheduler_info().get("workers", {}))
        except Exception:  # noqa: BLE001 - the scheduler itself is gone: no workers
            now = set()
        gone, new = self.now - now, now - self.now
        if gone:
            self.lost += len(gone)
            self.say(f"sweep: {len(gone)} worker(s) left ({', '.join(sorted(gone))}); their running chunks "
                     "run again on the others")
        if new and self.seen:
            self.say(f"sweep: {len(new)} worker(s) joined")
        self.seen |= now
        self.now = now
        self.none_since = (self.none_since or t) if not now else None


def _drive(client, tasks, todo, out, *, total, before, progress, in_flight_per_thread, t_start, csv_path,
           no_worker_timeout_s, say):
    from distributed import as_completed

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=before, desc="sweep", unit="chunk", file=sys.stderr, dynamic_ncols=True)
    if say is None:
        say = bar.write if bar is not None else (lambda m: print(m, file=sys.stderr, flush=True))
    workers = _Workers(client, say)
    window = max(2, workers.threads() * in_flight_per_thread)
    queue = iter(todo)
    owners = {}
    futures = as_completed()
    stats = {"run": 0, "shots": 0, "errors": 0}
    failures = []
    used: dict = {}

    def submit_next() -> bool:
        item = next(queue, None)
        if item is None:
            return False
        task, chunk = item
        fut = client.submit(run_chunk, task.work, shots=task.chunk_shots, seed=task.seed(chunk),
                            key=f"qlink-sweep-{task.strong_id[:24]}-{chunk}-{os.getpid()}-{next(_keys)}", pure=False)
        owners[fut.key] = (task, chunk, fut)
        futures.add(fut)
        return True

    def finished(fut) -> None:
        task, chunk, _ = owners.pop(fut.key)
        if fut.status in ("lost", "pending"):
            # it finished on a worker that died before its result was fetched: the scheduler runs
            # it again (same chunk, same seed) and it is waited for once more, counted once
            say(f"sweep: chunk {chunk} of {_short(task.json_metadata)} was lost with its worker; it runs again")
            owners[fut.key] = (task, chunk, fut)
            futures.add(fut)
            return
        if fut.status == "finished":
            counts = fut.result()
            out.append(strong_id=task.strong_id, decoder=task.decoder, json_metadata=task.json_metadata,
                       chunk=chunk, counts=counts)
            stats["run"] += 1
            stats["shots"] += int(counts["shots"])
            stats["errors"] += int(counts["errors"])
            if "transport_used" in counts:
                used[task.work.get("transport")] = counts["transport_used"]
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{stats['errors']} errors in {stats['shots']} shots; "
                                    f"{len(workers.now)} worker(s); last {task.decoder} {_short(task.json_metadata)}",
                                    refresh=False)
        elif fut.status == "cancelled":
            failures.append((task.strong_id, chunk, "cancelled"))
        else:
            exc = fut.exception()
            msg = f"{type(exc).__name__}: {exc}"
            if type(exc).__name__ == "KilledWorker":
                msg = (f"KilledWorker: the chunk's worker died {ALLOWED_FAILURES + 1} times running it "
                       f"(a crash in the chunk, or memory); {exc}")
            failures.append((task.strong_id, chunk, msg))
        fut.release()

    for _ in range(window):
        if not submit_next():
            break
    stop = _StopOnSigint()
    interrupted = False
    try:
        with stop:
            while futures.count() and not stop.count:
                if futures.has_ready():
                    for fut in futures.next_batch(block=False):
                        finished(fut)
                        if not stop.count:
                            submit_next()
                    continue
                time.sleep(_POLL_S)
                workers.check()
                if workers.none_since is not None and time.monotonic() - workers.none_since > no_worker_timeout_s:
                    client.cancel([f for _, _, f in owners.values()])
                    raise SweepError(f"no Dask worker has been connected for {no_worker_timeout_s:g} s "
                                     f"({client.scheduler.address}); {stats['run']} chunk(s) of this run are in "
                                     f"{csv_path}; start workers, then run the same sweep again to resume")
            if stop.count:
                interrupted = True
                _finish_in_flight(futures, finished, owners, stop)
    except KeyboardInterrupt:  # raised where no handler could be installed (not the main thread), or a third Ctrl-C
        interrupted = True
    finally:
        if interrupted:
            client.cancel([f for _, _, f in owners.values()])
        if bar is not None:
            bar.close()
    result = SweepResult(csv_path=str(csv_path), num_tasks=len(tasks), chunks_total=total, chunks_before=before,
                         chunks_run=stats["run"], chunks_left=total - before - stats["run"],
                         failures=tuple(failures),
                         seconds=time.perf_counter() - t_start, scheduler=client.scheduler.address,
                         num_workers=len(workers.seen), transports_used=used, workers_lost=workers.lost,
                         interrupted=interrupted)
    if interrupted:
        raise SweepInterrupted(result)
    if failures:
        shown = "; ".join(f"chunk {c} of {sid[:12]}…: {msg}" for sid, c, msg in failures[:3])
        err = SweepError(f"{len(failures)} chunk(s) failed ({shown}); every other chunk is in {csv_path}; "
                         "rerun the same sweep to retry only the missing chunks")
        err.result = result
        raise err
    return result


class _StopOnSigint:
    """While active (main thread only), Ctrl-C is counted instead of raised, so a row being
    written is never cut; the third Ctrl-C raises ``KeyboardInterrupt`` as usual."""

    def __init__(self):
        self.count = 0
        self._old = None

    def _handler(self, signum, frame):
        self.count += 1
        if self.count >= 3:
            raise KeyboardInterrupt

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        import signal

        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def _finish_in_flight(futures, finished, owners, stop) -> None:
    """After Ctrl-C: write the chunks that finish within :data:`GRACE_S` (a second Ctrl-C stops at once)."""
    deadline = time.monotonic() + GRACE_S
    while futures.count() and time.monotonic() < deadline and stop.count < 2:
        if futures.has_ready():
            for fut in futures.next_batch(block=False):
                if fut.key in owners:
                    finished(fut)
        else:
            time.sleep(0.02)


_keys = itertools.count()


def _short(meta: dict) -> str:
    keys = ("d", "p", "tokens", "transport")
    return " ".join(f"{k}={meta[k]}" for k in keys if k in meta)
