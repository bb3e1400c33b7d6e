"""``qlink bench sweep``: ``qlink sweep qec`` with its defaults beside ``sinter collect``.

The same grid (surface-code memory, d = 3, 5 × p = 0.002, 0.005, PyMatching, 4 × 10^6 shots
a point; ``--quick``: 4 × 10^5) is collected by both tools on this machine, in the same run, in
rounds that alternate between them (two by default); each tool's wall time is its best round:

* **sinter** — ``sinter.collect(num_workers=2, ...)`` on the very circuits qlink samples
  (its own process pool and batching; ``max_shots`` per point, no error cap), the way its
  users call it. Wall time from the call to its return.
* **qlink** — :func:`qlink.sweep.run_sweep` on a ``LocalCluster`` of two workers with the
  command line's defaults: the chunk size chosen by timing the slowest point
  (:func:`qlink.sweep.auto_chunk_shots`, timed while the cluster starts), a fresh CSV. Wall time from before the
  chunk size is chosen (the cluster's start included, as the command line pays it) to the
  return.

Rows: the wall time of each (every round's too) and their ratio (goal: qlink ≤ 1.2 × sinter),
and per point the two logical error rates (every round's shots pooled) with their Wilson
intervals and whether the intervals overlap.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

__all__ = ["compare_with_sinter", "main_from_cli"]

GOAL_RATIO = 1.2


def _grid(quick: bool):
    from qlink.sweep import QecGrid

    return QecGrid(distances=(3, 5), ps=(0.002, 0.005), decoders=("pymatching",), transports=("offline",),
                   num_shots=400_000 if quick else 4_000_000, chunk_shots=1)


def _sinter_once(sinter_tasks, *, num_workers: int, num_shots: int) -> tuple[float, dict]:
    import sinter

    t0 = time.perf_counter()
    stats = sinter.collect(num_workers=num_workers, tasks=sinter_tasks, decoders=["pymatching"],
                           max_shots=int(num_shots), max_errors=None)
    seconds = time.perf_counter() - t0
    theirs: dict[str, tuple[int, int]] = {}
    for s in stats:
        sid = s.json_metadata["id"]
        e, n = theirs.get(sid, (0, 0))
        theirs[sid] = (e + s.errors, n + s.shots)
    return seconds, theirs


def _qlink_once(grid, *, num_workers: int):
    import csv

    from qlink.sweep import read_done_chunks, run_sweep

    with tempfile.TemporaryDirectory(prefix="qlink-bench-sweep-") as tmp:
        csv_path = Path(tmp) / "sweep.csv"
        t0 = time.perf_counter()
        res = run_sweep(grid, csv_path=csv_path, num_workers=num_workers, progress=False, say=lambda m: None,
                        auto_chunks=True)
        seconds = time.perf_counter() - t0
        ours: dict[str, tuple[int, int]] = {}
        with open(csv_path) as f:
            for row in csv.DictReader(f, skipinitialspace=True):
                sid = row["strong_id"].strip()
                e, n = ours.get(sid, (0, 0))
                ours[sid] = (e + int(row["errors"]), n + int(row["shots"]))
        assert read_done_chunks(csv_path).count() == res.chunks_total
    return seconds, ours, res


def compare_with_sinter(*, quick: bool = False, num_workers: int = 2, rounds: int = 2,
                        progress: Callable[[str], None] = print, grid=None) -> list[dict]:
    """Run both on the same grid ``rounds`` times, in turn (sinter, qlink, sinter, qlink, …), so
    that a slow minute of the host weighs on both alike; each tool's wall time is its best
    round (see the module notes). The logical error rates pool every round's shots."""
    import sinter

    from qlink.qec.controller import wilson_interval
    from qlink.qec.loop import build_source

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    grid = grid or _grid(quick)
    tasks = grid.tasks()
    by_id = {t.strong_id: t for t in tasks}
    sinter_tasks = [sinter.Task(circuit=build_source(t.work["source"]).source.circuit, json_metadata={"id": sid})
                    for sid, t in by_id.items()]
    times: dict[str, list[float]] = {"sinter": [], "qlink": []}
    theirs: dict[str, tuple[int, int]] = {}
    ours: dict[str, tuple[int, int]] = {}
    res = None

    def pool(into: dict, got: dict) -> None:
        for sid, (e, n) in got.items():
            e0, n0 = into.get(sid, (0, 0))
            into[sid] = (e0 + e, n0 + n)

    for r in range(rounds):
        progress(f"round {r + 1}/{rounds}: sinter collect, {len(sinter_tasks)} points x {grid.num_shots} shots on "
                 f"{num_workers} processes")
        sec, got = _sinter_once(sinter_tasks, num_workers=num_workers, num_shots=grid.num_shots)
        times["sinter"].append(sec)
        pool(theirs, got)
        progress(f"  sinter: {sec:.1f} s; qlink sweep: the same points on a LocalCluster of {num_workers} workers, "
                 "chunk size auto")
        sec, got, res = _qlink_once(grid, num_workers=num_workers)
        times["qlink"].append(sec)
        pool(ours, got)
        progress(f"  qlink: {sec:.1f} s ({res.chunk_choice.describe()})")
    sinter_s, qlink_s = min(times["sinter"]), min(times["qlink"])
    ratio = qlink_s / sinter_s if sinter_s > 0 else float("nan")
    each = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    rows = [{"case": "wall time", "tool": "sinter collect", "seconds": round(sinter_s, 2), "x_sinter": 1.0,
             "rounds_s": each(times["sinter"]),
             "note": f"{num_workers} processes, max_shots {grid.num_shots} a point; best of {rounds}"},
            {"case": "wall time", "tool": "qlink sweep", "seconds": round(qlink_s, 2), "x_sinter": round(ratio, 3),
             "rounds_s": each(times["qlink"]), "chunk_shots": res.chunk_choice.chunk_shots,
             "goal": f"<= {GOAL_RATIO}", "met": ratio <= GOAL_RATIO,
             "note": f"{num_workers} Dask workers, cluster start and chunk sizing included; {res.chunks_total} "
                     f"chunks; best of {rounds}"}]
    for sid, t in by_id.items():
        m = t.json_metadata
        (e1, n1), (e2, n2) = theirs.get(sid, (0, 0)), ours.get(sid, (0, 0))
        i1, i2 = wilson_interval(e1, n1), wilson_interval(e2, n2)
        rows.append({"case": "logical error rate", "d": m["d"], "p": m["p"], "sinter_shots": n1, "sinter_errors": e1,
                     "sinter_ler": e1 / n1 if n1 else None, "qlink_shots": n2, "qlink_errors": e2,
                     "qlink_ler": e2 / n2 if n2 else None,
                     "intervals_overlap": bool(i1[0] <= i2[1] and i2[0] <= i1[1])})
    return rows


def main_from_cli(args, *, say: Callable[[str], None] = print) -> list[dict]:
    """``qlink bench sweep [--quick] [--out DIR]``: run, print the tables, write JSON/CSV."""
    from .report import format_table, write_results

    quick = bool(getattr(args, "quick", False))
    out = Path(getattr(args, "out", "results/bench"))
    rows = compare_with_sinter(quick=quick, progress=say)
    write_results(rows, out_dir=out, name="sweep_vs_sinter", meta={"quick": quick})
    print("\nqlink sweep (defaults) beside sinter collect, same grid, same machine, same run: each tool's best "
          "round (the rounds alternate between the tools)")
    print(format_table([r for r in rows if r["case"] == "wall time"],
                       columns=["tool", "seconds", "rounds_s", "x_sinter", "chunk_shots", "goal", "met"]))
    print(format_table([r for r in rows if r["case"] != "wall time"],
                       columns=["d", "p", "sinter_shots", "sinter_errors", "qlink_shots", "qlink_errors",
                                "intervals_overlap"]))
    print(f"\nwritten: {out}/sweep_vs_sinter.{{json,csv}}")
    return rows
