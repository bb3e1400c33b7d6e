"""Parameter sweeps on Dask distributed, written as sinter-compatible CSV that resumes.

A grid (:class:`QecGrid`: distance × physical error rate × decoder × transport, or
:class:`KvGrid`: prompt length × transport) expands into tasks; each task into chunks of a
fixed shot count, each with a seed derived from the task's strong id and the chunk
index (:func:`chunk_seed`). :func:`run_sweep` runs the chunks the CSV does not hold yet
on a Dask ``LocalCluster`` (or any scheduler address) and appends one sinter row per
chunk as it finishes, so an interrupted sweep, run again, ends with exactly the rows one
uninterrupted run writes. Read the result with ``sinter.read_stats_from_csv_files`` or
plot it with ``sinter plot --in sweep.csv --x_func m.p --group_func m.d``.

``qlink sweep qec|kv|speedup`` is the command line; :func:`sweep_speedup` times one grid
on 1 and 2 workers.

>>> from qlink.sweep import QecGrid, pending_chunks
>>> tasks = QecGrid(distances=(3, 5), ps=(0.001,), num_shots=2000, chunk_shots=1000).tasks()
>>> len(pending_chunks(tasks, {}))
4

Running it (a LocalCluster of two worker processes; a few seconds)::

    result = run_sweep(QecGrid(distances=(3, 5), ps=(0.002, 0.004)), csv_path="ler.csv")
"""

from ._bench import default_speedup_grid, machine_parallel_speedup, sweep_speedup
from ._chunking import ChunkChoice, auto_chunk_shots
from ._csv import CHUNK_PREFIX, CsvAppender, DoneChunks, SweepError, chunk_of, read_done_chunks
from ._grid import KvGrid, QecGrid, SweepTask, chunk_seed, expand
from ._run import SweepInterrupted, SweepResult, pending_chunks, run_sweep
from ._work import run_chunk

__all__ = [
    "QecGrid",
    "KvGrid",
    "SweepTask",
    "chunk_seed",
    "expand",
    "run_sweep",
    "SweepResult",
    "SweepError",
    "SweepInterrupted",
    "pending_chunks",
    "run_chunk",
    "read_done_chunks",
    "DoneChunks",
    "CsvAppender",
    "chunk_of",
    "CHUNK_PREFIX",
    "auto_chunk_shots",
    "ChunkChoice",
    "sweep_speedup",
    "default_speedup_grid",
    "machine_parallel_speedup",
]
