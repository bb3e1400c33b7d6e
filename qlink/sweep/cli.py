"""``qlink sweep qec|kv|speedup``: the sweep command line.

>>> from qlink._argparse import Parser
>>> p = Parser(prog="qlink sweep"); add_arguments(p)
>>> a = p.parse_args(["qec", "--distances", "3,5", "--ps", "0.001", "0.002", "--transports", "offline,tcp"])
>>> a.distances, a.ps, a.transports, a.csv
((3, 5), (0.001, 0.002), ('offline', 'tcp'), None)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

__all__ = ["add_arguments", "run_from_cli"]


def _qec_transport(value, *, where):
    from qlink import checks

    from ._grid import QEC_TRANSPORTS

    return checks.one_of(value, QEC_TRANSPORTS, what="transport", where=where)


def _kv_transport(value, *, where):
    from qlink import checks

    from ._grid import KV_TRANSPORTS

    return checks.one_of(value, KV_TRANSPORTS, what="transport", where=where)


def _preset(value, *, where):
    from qlink import checks
    from qlink.ai import PRESETS

    return checks.one_of(value, tuple(PRESETS), what="KV preset", where=where)


def _chunk_shots(value, *, where):
    from qlink import checks

    return "auto" if str(value).strip().lower() == "auto" else checks.count(value, where=where)


def _list(check):
    from qlink import checks

    return lambda v, where: checks.list_of(check, v, where=where)


def _common(p) -> None:
    from qlink import checks
    from qlink._argparse import CheckedAction

    p.add_argument("--csv", default=None, help="sinter CSV to append to and resume from "
                                               "(default: results/sweep/<what>.csv)")
    p.add_argument("--scheduler", default=None, help="Dask scheduler address (default: start a LocalCluster)")
    p.add_argument("--workers", default=2, action=CheckedAction, check=checks.count,
                   help="LocalCluster worker processes")
    p.add_argument("--max-chunks", default=None, action=CheckedAction, check=checks.count,
                   help="stop after this many chunks (resume later)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``sweep`` subcommands (``qec``, ``kv``, ``speedup``) and their options to ``p``.

    Each subcommand takes only its own options; lists are written ``3,5`` or ``3 5``.
    """
    from qlink import checks
    from qlink._argparse import CheckedAction, ListAction

    sub = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    q = sub.add_parser("qec", help="distance x p x decoder x transport")
    _common(q)
    q.add_argument("--distances", action=ListAction, check=checks.distances, default=(3, 5), metavar="D")
    q.add_argument("--ps", action=ListAction, check=_list(checks.probability), default=(0.001, 0.002, 0.004),
                   metavar="P", help="physical error rates, each in (0, 0.5)")
    q.add_argument("--decoders", action=ListAction, check=_list(checks.decoder), default=("pymatching",),
                   metavar="NAME", help="decoders of qlink.qec.decoders.BUILT_IN_DECODERS")
    q.add_argument("--transports", action=ListAction, check=_list(_qec_transport), default=("offline",),
                   metavar="T", help="offline and/or shm,tcp,ucx,inproc")
    q.add_argument("--rounds", default=None, action=CheckedAction, check=checks.count,
                   help="rounds per shot (default: the distance)")
    q.add_argument("--shots", default=10_000, action=CheckedAction, check=checks.count,
                   help="shots per grid point (whole chunks)")
    q.add_argument("--chunk-shots", default="auto", action=CheckedAction, check=_chunk_shots,
                   help="shots per chunk, or auto (the default): chunks of about 2 s on the grid's slowest point, "
                        "timed here first; a CSV that already holds chunks keeps its size")
    k = sub.add_parser("kv", help="prompt tokens x transport")
    _common(k)
    k.add_argument("--tokens", action=ListAction, check=_list(checks.count), default=(512, 4096), metavar="N")
    k.add_argument("--transports", action=ListAction, check=_list(_kv_transport), default=("shm", "tcp"),
                   metavar="T", help="of shm,tcp,ucx,inproc,nixl")
    k.add_argument("--preset", default="llama-3-8b", action=CheckedAction, check=_preset,
                   help="KV layout preset of qlink.ai.PRESETS")
    k.add_argument("--transfers", default=20, action=CheckedAction, check=checks.count,
                   help="transfers per grid point")
    k.add_argument("--chunk-transfers", default=5, action=CheckedAction, check=checks.count)
    k.add_argument("--budget-ms", default=30.0, action=CheckedAction,
                   check=lambda v, where: checks.number(v, where=where, lo=0, lo_open=True),
                   help="a transfer slower than this counts as an error")
    sp = sub.add_parser("speedup", help="time one CPU-bound grid on 1 and 2 workers")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_from_cli(args, *, say: Callable[[str], None] = print) -> int:
    """Run ``qlink sweep`` with parsed ``args``."""
    from . import KvGrid, QecGrid, SweepInterrupted, run_sweep, sweep_speedup

    if args.what == "speedup":
        say("timing the default CPU-bound grid on 1 and 2 workers (cluster start-up excluded)")
        res = sweep_speedup(progress=not args.no_progress)
        print(json.dumps(res, indent=2))
        return 0
    csv_path = args.csv or f"results/sweep/{args.what}.csv"
    if args.what == "qec":
        auto = args.chunk_shots == "auto"
        grid = QecGrid(distances=args.distances, ps=args.ps, decoders=args.decoders,
                       transports=args.transports, rounds=args.rounds, num_shots=args.shots,
                       chunk_shots=1_000 if auto else args.chunk_shots)
        if auto:
            say("timing one chunk of the grid's slowest point to size the chunks (while the cluster starts)")
    else:
        auto = False
        grid = KvGrid(tokens=args.tokens, transports=args.transports, preset=args.preset,
                      num_transfers=args.transfers, chunk_transfers=args.chunk_transfers, budget_ms=args.budget_ms)
    try:
        res = run_sweep(grid, csv_path=csv_path, scheduler=args.scheduler, num_workers=args.workers,
                        max_chunks=args.max_chunks, progress=not args.no_progress, auto_chunks=auto)
    except SweepInterrupted as e:
        print(f"qlink sweep: {e}", file=sys.stderr)
        return 130
    if res.chunk_choice is not None:
        say(res.chunk_choice.describe())
    lost = f"; {res.workers_lost} worker(s) lost on the way" if res.workers_lost else ""
    say(f"{res.chunks_run} chunk(s) run, {res.chunks_before} already there, {res.chunks_left} left "
        f"of {res.chunks_total}; {res.seconds:.1f} s on {res.num_workers or 'no'} worker(s){lost}")
    say(f"written: {csv_path}  (read with sinter.read_stats_from_csv_files, or: "
        f"sinter plot --in {csv_path} --x_func m.{'p' if args.what == 'qec' else 'tokens'} "
        f"--group_func m.{'d' if args.what == 'qec' else 'transport'})")
    return 0
