"""The ``qlink`` command line.

``qlink run`` is the main job (the default end-to-end scenario on one machine);
``qlink bench transport|qec|kv|soak|crosshost|gpu|vllm|all`` measures figures beside their floors and peers;
``qlink info`` says which optional stacks are installed; ``qlink sweep qec|kv|speedup``
runs parameter sweeps on Dask into a resumable sinter CSV.

>>> from qlink.cli import build_parser
>>> build_parser().parse_args(["bench", "transport", "--quick"]).quick
True
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

__all__ = ["main", "build_parser"]

_OPTIONAL = {
    "stim": "stim", "pymatching": "pymatching", "sinter": "sinter", "ldpc": "ldpc",
    "cudaq": "cuda-quantum-cu12", "cudaq_qec": "cudaq-qec-cu12", "ucxx": "ucxx-cu12",
    "nixl_cu12": "nixl-cu12", "cupy": "cupy-cuda12x", "dask.distributed": "dask[distributed]",
    "nbclient": "nbclient",
}


def _say(msg: str) -> None:
    print(f"[qlink {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _cmd_info(args) -> int:
    from ._version_info import versions

    for mod, pkg in _OPTIONAL.items():
        v = versions().get(mod)
        print(f"{pkg:22s} {v if v else 'not installed'}")
    try:
        import transports._ringc  # noqa: F401

        print("shm ring accelerator   C extension built")
    except ImportError:
        print("shm ring accelerator   not built (pure-Python ring in use)")
    return 0


def _bench_transport(args) -> dict:
    from .bench._report import format_table, write_results
    from .bench.transport import run_transport_bench

    n = 5000 if args.quick else 50000
    sizes = (4 << 10, 1 << 20, 16 << 20) if args.quick else (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
    res = run_transport_bench(num_round_trips=n, put_sizes=sizes, progress=_say)
    out = Path(args.out)
    write_results(res["round_trip"], out_dir=out, name="transport_round_trip", meta={"num_round_trips": n})
    write_results(res["bandwidth"], out_dir=out, name="transport_bandwidth", meta={"sizes": list(sizes)})
    write_results(res["goals"], out_dir=out, name="transport_goals", meta={"num_round_trips": n})
    print("\n64-byte round trip between two processes (both busy-poll: 2 cores in use)")
    print(format_table(res["round_trip"]))
    print("\nOne-sided put bandwidth into a registered remote region, beside numpy memcpy")
    print(format_table(res["bandwidth"]))
    print("\nGoals (each figure from this run)")
    print(format_table(res["goals"]))
    for e in res["errors"]:
        print(f"  not measured: {e}")
    print(f"\nwritten: {out}/transport_round_trip.{{json,csv}}, {out}/transport_bandwidth.{{json,csv}}, "
          f"{out}/transport_goals.{{json,csv}}")
    return res


def _bench_module(name: str, args):
    mod = importlib.import_module(f"qlink.bench.{name}")
    return mod.main_from_cli(args, say=_say)


def _cmd_bench(args) -> int:
    which = ["transport", "qec", "kv"] if args.what == "all" else [args.what]
    for w in which:
        _say(f"bench {w}")
        if w == "transport":
            _bench_transport(args)
        else:
            _bench_module(w, args)
    return 0


def _cmd_budget(args) -> int:
    from .bench._report import write_results
    from .crossdomain import plot_cross_domain, run_cross_domain
    from .run import print_cross_domain_tables

    transports = tuple(args.transports.split(","))
    res = run_cross_domain(transports=transports, distances=(5,) if args.quick else (5, 11),
                           presets=("llama-3-8b",) if args.quick else ("llama-3-8b", "llama-3-70b"),
                           num_shots=500 if args.quick else 2000, say=_say)
    rows = res.rows()
    out = Path(args.out)
    write_results(rows, out_dir=out, name="cross_domain", meta={"notes": res.notes})
    png = plot_cross_domain(rows, out / "cross_domain.png")
    print_cross_domain_tables(rows, notes=res.notes)
    print(f"\nwritten: {out}/cross_domain.{{json,csv}}, {png}")
    return 0


def _cmd_run(args) -> int:
    from .config import RunConfig, load_run_config
    from .errors import ConfigError
    from .run import main_job

    base = RunConfig.quick() if args.quick else RunConfig()
    try:
        config = load_run_config(args.config, base=base) if args.config else base
    except ConfigError as e:
        print(f"qlink run: {e}", file=sys.stderr)
        return 2
    return main_job(out_dir=Path(args.out), config=config, say=_say)


def _cmd_paper(args) -> int:
    from .paper import main_from_cli

    return main_from_cli(args, say=_say)


def _cmd_sweep(args) -> int:
    from .sweep._cli import run_from_cli

    return run_from_cli(args, say=_say)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qlink", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the default end-to-end scenario (QEC loop + KV transfer + budget table)")
    r.add_argument("--out", default="results/run", help="output directory (default: results/run)")
    r.add_argument("--quick", action="store_true", help="smaller settings (about a minute)")
    r.add_argument("--config", metavar="FILE.toml", help="settings from a TOML file over the defaults "
                   "(or over --quick's): [qec] transports, distances, num_shots; [kv] presets, tokens; "
                   "[run] seed, scenarios")
    r.set_defaults(func=_cmd_run)
    b = sub.add_parser("bench", help="measure figures beside their floors and peers; writes JSON/CSV")
    b.add_argument("what", choices=["transport", "qec", "kv", "soak", "crosshost", "gpu", "vllm", "all"])
    b.add_argument("--out", default="results/bench", help="output directory (default: results/bench)")
    b.add_argument("--quick", action="store_true", help="fewer samples (for a smoke run)")
    b.add_argument("--distances", default=None, metavar="D,D,...",
                   help="qec: code distances (default 5,7,11,17; --quick 5,7)")
    b.add_argument("--transports", default=None, metavar="T,T,...", help="qec: transports (default shm,tcp,ucx,udp)")
    b.set_defaults(func=_cmd_bench)
    bu = sub.add_parser("budget", help="the cross-domain budget table: QEC and KV figures on the same transports, "
                                      "each against its own budget (measured and modeled apart); writes a plot")
    bu.add_argument("--out", default="results/budget", help="output directory (default: results/budget)")
    bu.add_argument("--transports", default="shm,tcp,ucx", help="comma-separated (default: shm,tcp,ucx)")
    bu.add_argument("--quick", action="store_true", help="d=5 and Llama-3-8B only, fewer shots")
    bu.set_defaults(func=_cmd_budget)
    i = sub.add_parser("info", help="which optional stacks are installed")
    i.set_defaults(func=_cmd_info)
    s = sub.add_parser("sweep", help="parameter sweeps on Dask into a resumable sinter CSV (qec, kv) or the "
                                     "1-vs-2-worker timing (speedup)")
    from .sweep._cli import add_arguments

    add_arguments(s)
    s.set_defaults(func=_cmd_sweep)
    pp = sub.add_parser("paper", help="build the cross-domain latency paper's artifact: figures (PNG, PDF), tables "
                                      "(CSV, LaTeX) and a manifest with hashes")
    pp.add_argument("action", choices=["build"])
    pp.add_argument("--quick", action="store_true", help="smaller settings (a few minutes on 2 cores)")
    pp.add_argument("--profile", choices=["test", "quick", "full"], default=None,
                    help="settings by name (overrides --quick; default full, or quick with --quick)")
    pp.add_argument("--out", default=None, help="output directory (default: papers/cross-domain-latency/build)")
    pp.add_argument("--seed", type=int, default=1, help="seed of every scenario (default 1)")
    pp.set_defaults(func=_cmd_paper)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
