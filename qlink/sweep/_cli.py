"""``qlink sweep qec|kv|speedup``: the sweep command line.

>>> import argparse
>>> p = argparse.ArgumentParser(); add_arguments(p)
>>> a = p.parse_args(["qec", "--distances", "3,5", "--ps", "0.001,0.002", "--transports", "offline,tcp"])
>>> a.distances, a.ps, a.transports, a.csv
((3, 5), (0.001, 0.002), ('offline', 'tcp'), None)
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

__all__ = ["add_arguments", "run_from_cli"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``sweep`` arguments to ``p``."""
    p.add_argument("what", choices=["qec", "kv", "speedup"],
                   help="qec: distance x p x decoder x transport; kv: prompt tokens x transport; "
                        "speedup: time one CPU-bound grid on 1 and 2 workers")
    p.add_argument("--csv", default=None, help="sinter CSV to append to and resume from "
                                               "(default: results/sweep/<what>.csv)")
    p.add_argument("--scheduler", default=None, help="Dask scheduler address (default: start a LocalCluster)")
    p.add_argument("--workers", type=int, default=2, help="LocalCluster worker processes (default: 2)")
    p.add_argument("--max-chunks", type=int, default=None, help="stop after this many chunks (resume later)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    q = p.add_argument_group("qec")
    q.add_argument("--distances", type=_ints, default=(3, 5))
    q.add_argument("--ps", type=_floats, default=(0.001, 0.002, 0.004))
    q.add_argument("--decoders", type=_names, default=("pymatching",))
    q.add_argument("--transports", type=_names, default=None,
                   help="qec: offline and/or shm,tcp,ucx,inproc (default offline); kv: shm,tcp,ucx,inproc,nixl "
                        "(default shm,tcp)")
    q.add_argument("--rounds", type=int, default=None, help="rounds per shot (default: the distance)")
    q.add_argument("--shots", type=int, default=10_000, help="shots per grid point (whole chunks)")
    q.add_argument("--chunk-shots", type=int, default=1_000)
    k = p.add_argument_group("kv")
    k.add_argument("--tokens", type=_ints, default=(512, 4096))
    k.add_argument("--preset", default="llama-3-8b")
    k.add_argument("--transfers", type=int, default=20, help="transfers per grid point")
    k.add_argument("--chunk-transfers", type=int, default=5)
    k.add_argument("--budget-ms", type=float, default=30.0, help="a transfer slower than this counts as an error")


def run_from_cli(args, *, say: Callable[[str], None] = print) -> int:
    """Run ``qlink sweep`` with parsed ``args``."""
    from . import KvGrid, QecGrid, run_sweep, sweep_speedup

    if args.what == "speedup":
        say("timing the default CPU-bound grid on 1 and 2 workers (cluster start-up excluded)")
        res = sweep_speedup(progress=not args.no_progress)
        print(json.dumps(res, indent=2))
        return 0
    if args.what == "qec":
        grid = QecGrid(distances=args.distances, ps=args.ps, decoders=args.decoders,
                       transports=args.transports or ("offline",), rounds=args.rounds, num_shots=args.shots,
                       chunk_shots=args.chunk_shots)
    else:
        grid = KvGrid(tokens=args.tokens, transports=args.transports or ("shm", "tcp"), preset=args.preset,
                      num_transfers=args.transfers, chunk_transfers=args.chunk_transfers, budget_ms=args.budget_ms)
    csv_path = args.csv or f"results/sweep/{args.what}.csv"
    res = run_sweep(grid, csv_path=csv_path, scheduler=args.scheduler, num_workers=args.workers,
                    max_chunks=args.max_chunks, progress=not args.no_progress)
    say(f"{res.chunks_run} chunk(s) run, {res.chunks_before} already there, {res.chunks_left} left "
        f"of {res.chunks_total}; {res.seconds:.1f} s on {res.num_workers or 'no'} worker(s)")
    say(f"written: {csv_path}  (read with sinter.read_stats_from_csv_files, or: "
        f"sinter plot --in {csv_path} --x_func m.{'p' if args.what == 'qec' else 'tokens'} "
        f"--group_func m.{'d' if args.what == 'qec' else 'transport'})")
    return 0
