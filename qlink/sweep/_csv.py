"""The sweep's CSV: sinter's own format, one row per finished chunk, resumable.

Rows are written with ``sinter.TaskStats.to_csv_line`` under ``sinter.CSV_HEADER``, so
``sinter.read_stats_from_csv_files`` and ``sinter plot --in`` read the file as it is
(merging a task's rows by strong id). Each row names its chunk in ``custom_counts`` as
``"chunk_<i>": 1``; merged stats therefore still show which chunks they hold.

On resume the file is read row by row (not merged) to learn, per strong id, which
chunks are done. A last line cut short by an interruption is cut off before anything
is appended; rows without a chunk key (written by other tools) are left alone and
counted as foreign.

>>> import os, tempfile, sinter
>>> path = os.path.join(tempfile.mkdtemp(), "s.csv")
>>> with CsvAppender(path) as out:
...     out.append(strong_id="abc", decoder="pymatching@offline", json_metadata={"d": 3}, chunk=0,
...                counts={"shots": 100, "errors": 2, "discards": 0, "seconds": 0.01, "custom_counts": {}})
>>> with open(path, "a") as f:
...     _ = f.write("       100,         1,")          # an interrupted write
>>> done = read_done_chunks(path)
>>> done.chunks, done.truncated_nbytes > 0
({'abc': {0: 100}}, True)
>>> [(s.shots, s.errors) for s in sinter.read_stats_from_csv_files(path)]
[(100, 2)]
"""

from __future__ import annotations

import collections
import csv
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from qlink.errors import QlinkError

__all__ = ["CHUNK_PREFIX", "SweepError", "DoneChunks", "read_done_chunks", "CsvAppender", "chunk_of"]

CHUNK_PREFIX = "chunk_"
_SINTER_FIELDS = ("shots", "errors", "discards", "seconds", "decoder", "strong_id", "json_metadata", "custom_counts")


class SweepError(QlinkError):
    """A sweep could not run as asked (a CSV it cannot resume, chunks that failed, a CSV in use)."""


def _sinter():
    from qlink.errors import optional_import

    return optional_import("sinter", package="sinter", extra="quantum", feature="the sweep CSV")


def chunk_of(custom_counts: dict) -> int | None:
    """The chunk index a row's ``custom_counts`` names, or None (a row from another tool).

    >>> chunk_of({"chunk_12": 1, "failed": 3}), chunk_of({"failed": 3})
    (12, None)
    """
    found = [k for k in custom_counts if k.startswith(CHUNK_PREFIX)]
    if not found:
        return None
    if len(found) > 1 or custom_counts[found[0]] != 1 or not found[0][len(CHUNK_PREFIX):].isdigit():
        raise SweepError(f"a row names chunks {found} (counts {[custom_counts[k] for k in found]}); a sweep row "
                         f"names exactly one, as '{CHUNK_PREFIX}<index>': 1")
    return int(found[0][len(CHUNK_PREFIX):])


@dataclass
class DoneChunks:
    """What a CSV already holds: ``chunks[strong_id][chunk] = shots``."""

    chunks: dict = field(default_factory=dict)
    rows: int = 0
    foreign_rows: int = 0
    truncated_nbytes: int = 0

    def count(self) -> int:
        return sum(len(v) for v in self.chunks.values())


def _cut_partial_last_line(path: Path) -> int:
    """Cut a last line without its newline (an interrupted append); return bytes cut."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        back = min(size, 1 << 16)
        while True:
            f.seek(size - back)
            tail = f.read(back)
            nl = tail.rfind(b"\n")
            if nl >= 0 or back == size:
                keep = size - back + nl + 1 if nl >= 0 else 0
                break
            back = min(size, back * 4)
        f.truncate(keep)
    return size - keep


def read_done_chunks(path, *, repair: bool = True) -> DoneChunks:
    """Read a sweep CSV row by row: which chunks of which strong ids are done.

    ``repair`` cuts a last line left without its newline by an interrupted write (the
    only damage an append can leave). A missing or empty file holds nothing. Raises
    :class:`SweepError` for a file that is not a sinter CSV or that holds a chunk twice.
    """
    path = Path(path)
    done = DoneChunks()
    if not path.exists() or path.stat().st_size == 0:
        return done
    if repair:
        done.truncated_nbytes = _cut_partial_last_line(path)
    text = path.read_text()
    if not text.strip():
        return done
    reader = csv.DictReader(io.StringIO(text))
    fields = tuple(f.strip() for f in (reader.fieldnames or ()))
    if set(fields) != set(_SINTER_FIELDS):
        raise SweepError(f"{path} is not a sinter CSV: its header names {list(fields)}, expected {list(_SINTER_FIELDS)}; "
                         "give run_sweep a new file or one it wrote")
    reader.fieldnames = list(fields)
    for line_no, row in enumerate(reader, start=2):
        try:
            custom = json.loads(row["custom_counts"]) if (row["custom_counts"] or "").strip() else {}
            shots = int(row["shots"])
            sid = row["strong_id"].strip()
        except (TypeError, ValueError, AttributeError) as e:
            raise SweepError(f"{path}, line {line_no}: unreadable row ({e}); fix or remove that line") from None
        done.rows += 1
        chunk = chunk_of(custom) if isinstance(custom, dict) else None
        if chunk is None:
            done.foreign_rows += 1
            continue
        have = done.chunks.setdefault(sid, {})
        if chunk in have:
            raise SweepError(f"{path}, line {line_no}: chunk {chunk} of task {sid[:12]}… appears twice; the file was "
                             "appended to by two sweeps at once or edited by hand")
        have[chunk] = shots
    return done


class CsvAppender:
    """Append finished chunks to a sweep CSV, holding an exclusive lock on it.

    On entry it reads what the file holds (:func:`read_done_chunks`, into ``.done``)
    and writes the header if the file is empty; every row is flushed as it is
    written, so an interrupted sweep loses at most the row being written (which
    :func:`read_done_chunks` cuts off). A second sweep on the same file is refused.
    """

    def __init__(self, path) -> None:
        self.path = Path(path)
        self._f = None
        self.done = DoneChunks()

    def __enter__(self) -> "CsvAppender":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise SweepError(f"{self.path} is being written by another sweep; wait for it or use another file") from None
        try:
            self.done = read_done_chunks(self.path)  # under the lock: nobody else is appending
            if self.path.stat().st_size == 0:
                f.write(_sinter().CSV_HEADER + "\n")
                f.flush()
        except BaseException:
            f.close()
            raise
        self._f = f
        return self

    def append(self, *, strong_id: str, decoder: str, json_metadata, chunk: int, counts: dict) -> None:
        """Write one chunk's row (``counts``: shots, errors, discards, seconds, custom_counts)."""
        sinter = _sinter()
        custom = collections.Counter({k: int(v) for k, v in counts.get("custom_counts", {}).items() if int(v)})
        custom[f"{CHUNK_PREFIX}{int(chunk)}"] = 1
        stats = sinter.TaskStats(strong_id=strong_id, decoder=decoder, json_metadata=json_metadata,
                                 shots=int(counts["shots"]), errors=int(counts["errors"]),
                                 discards=int(counts["discards"]), seconds=float(counts["seconds"]),
                                 custom_counts=custom)
        self._f.write(stats.to_csv_line() + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            try:
                os.fsync(self._f.fileno())
            finally:
                self._f.close()  # closing releases the lock
                self._f = None

    def __exit__(self, *exc) -> None:
        self.close()
