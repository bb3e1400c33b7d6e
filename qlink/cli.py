"""The ``qlink`` command line.

``qlink run`` is the main job (the default end-to-end scenario on one machine);
``qlink bench transport|qec|kv|soak|crosshost|gpu|decoders|cudaq|hostile|vllm|sweep|all`` measures figures beside their floors and peers;
``qlink budget`` draws the cross-domain budget table; ``qlink serve --decoder-config FILE`` serves the
decoders of a CUDA-Q QEC ``multi_decoder_config``; ``qlink doctor`` says what is installed
and what to install; ``qlink sweep qec|kv|speedup`` runs parameter sweeps on Dask into a
resumable sinter CSV; ``qlink paper build`` builds the paper (PDF, figures, tables, manifest).

Every value is checked before anything runs (:mod:`qlink.checks`): a bad one is one line
on stderr and exit status 2. Ctrl-C (SIGINT) or SIGTERM stops a command within seconds,
ends its child processes, and exits 130 or 143.

>>> from qlink.cli import build_parser
>>> build_parser().parse_args(["bench", "transport", "--quick"]).quick
True
>>> build_parser().parse_args(["bench", "qec", "--distances", "5", "7"]).distances
(5, 7)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from . import __version__, checks
from ._argparse import CheckedAction, ListAction, Parser

__all__ = ["main", "build_parser"]


def _say(msg: str) -> None:
    """A progress line, wrapped to 100 columns (continuation lines indented under the message)."""
    from .bench.report import wrap

    print(wrap(f"[qlink {time.strftime('%H:%M:%S')}] {msg}", indent=" " * 19), flush=True)


def _begin_conditions():
    """Measure the host's load and CPU floor before a measuring command (one warning line when busy)."""
    from .bench.conditions import begin

    return begin(warn=lambda m: _say(m))


def _end_conditions(cond) -> None:
    from .bench.report import wrap

    print(wrap(cond.summary(), indent="  "))


def _out(value, *, where):
    return str(checks.out_dir(value, where=where))


def _in_file(value, *, where):
    return str(checks.in_file(value, where=where))


# ----- commands ------------------------------------------------------------------------------


def _cmd_info(args) -> int:
    from .doctor import report

    return report(full=bool(getattr(args, "doctor", False)))


def _bench_transport(args, failures: list[str]) -> dict:
    from .bench.report import format_table, write_results
    from .bench.transport import run_transport_bench

    n = 5000 if args.quick else 50000
    sizes = (4 << 10, 1 << 20, 16 << 20) if args.quick else (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
    schemes = tuple(getattr(args, "transports", None) or ("shm", "tcp", "ucx"))
    res = run_transport_bench(schemes=schemes, num_round_trips=n, put_sizes=sizes, progress=_say)
    out = Path(args.out)
    write_results(res["round_trip"], out_dir=out, name="transport_round_trip", meta={"num_round_trips": n})
    write_results(res["bandwidth"], out_dir=out, name="transport_bandwidth", meta={"sizes": list(sizes)})
    write_results(res["goals"], out_dir=out, name="transport_goals", meta={"num_round_trips": n})
    from .bench.report import format_goals, wrap

    rt_cols = {"case": "case", "p50_us": "p50 µs", "p99_us": "p99 µs", "p999_us": "p99.9 µs",
               "x_floor_p50": "× floor p50", "ucxx_asyncio_over_this": "UCXX asyncio ×"}
    print("\n64-byte round trip between two processes (both busy-poll: 2 cores in use)")
    print(format_table([{rt_cols[k]: r.get(k) for k in rt_cols} for r in res["round_trip"]],
                       columns=list(rt_cols.values()), max_width=100))
    print("\nOne-sided put bandwidth into a registered remote region, beside numpy memcpy")
    print(format_table(res["bandwidth"], max_width=100))
    print("\nGoals (each figure from this run)")
    print(format_goals(res["goals"]))
    for e in res["errors"]:
        print(f"  not measured: {e}")
        failures.append(f"bench transport: {e}")
    print(wrap(f"\nwritten under {out}/: transport_round_trip, transport_bandwidth, transport_goals (.json, "
               ".csv; every column)"))
    return res


_BENCH_MODULES = {"cudaq": "cudaq_peer", "sweep": "sinter_peer"}  # a bench whose module is not named after it
_RELIABILITY = ("soak",)


def _bench_module(name: str, args, failures: list[str]):
    import argparse
    import importlib

    # the reliability harnesses run under `qlink bench` too; they live in qlink.reliability
    package = "qlink.reliability" if name in _RELIABILITY else "qlink.bench"
    mod = importlib.import_module(f"{package}.{_BENCH_MODULES.get(name, name)}")
    # the bench modules read lists as comma-separated text
    ns = argparse.Namespace(**{k: (",".join(map(str, v)) if isinstance(v, tuple) else v)
                               for k, v in vars(args).items()})
    rows = mod.main_from_cli(ns, say=_say)
    for r in rows if isinstance(rows, list) else ():
        if not isinstance(r, dict):
            continue
        note = str(r.get("note") or "")
        err = r.get("error") or (note if note.startswith("error") else None)
        if err:
            what = ", ".join(str(r[k]) for k in ("transport", "case", "distance", "d") if r.get(k) is not None)
            failures.append(f"bench {name} ({what}): {err}")
    return rows


def _finish(cmd: str, failures: list[str], keep_going: bool) -> int:
    """Exit status of a measuring command: 0, or 1 when a measurement failed (listed)."""
    if not failures:
        return 0
    print(f"\n{cmd}: {len(failures)} measurement(s) failed{' (--keep-going)' if keep_going else ''}:",
          file=sys.stderr)
    for f in failures:
        print(f"  - {f}", file=sys.stderr)
    return 1


def _cmd_bench(args) -> int:
    if getattr(args, "stim", None) and (getattr(args, "distances", None) or getattr(args, "native_only", False)):
        print("qlink bench qec: error: --distances and --native-only do not apply with --stim (the circuit is "
              "your own; its rows run on the per-transport table)", file=sys.stderr)
        return 2
    which = ["transport", "qec", "kv"] if args.what == "all" else [args.what]
    cond = _begin_conditions()
    failures: list[str] = []
    for w in which:
        _say(f"bench {w}")
        n_before = len(failures)
        try:
            if w == "transport":
                _bench_transport(args, failures)
            else:
                _bench_module(w, args, failures)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 - one failed bench is reported; --keep-going runs the next
            failures.append(f"bench {w}: {type(e).__name__}: {e}")
        if len(failures) > n_before and not args.keep_going:
            break
    _end_conditions(cond)
    return _finish(f"qlink bench {args.what}", failures, args.keep_going)


def _cmd_budget(args) -> int:
    from .bench.report import write_results
    from .crossdomain import plot_cross_domain, run_cross_domain
    from .run import print_cross_domain_tables

    cond = _begin_conditions()
    res = run_cross_domain(transports=tuple(args.transports), distances=(5,) if args.quick else (5, 11),
                           presets=("llama-3-8b",) if args.quick else ("llama-3-8b", "llama-3-70b"),
                           num_shots=500 if args.quick else 2000, say=_say)
    rows = res.rows()
    out = Path(args.out)
    write_results(rows, out_dir=out, name="cross_domain", meta={"notes": res.notes})
    png = plot_cross_domain(rows, out / "cross_domain.png")
    print_cross_domain_tables(rows, notes=res.notes)
    from .bench.report import wrap

    print(wrap(f"\nwritten: {out}/cross_domain.{{json,csv}} (every row), {png}"))
    _end_conditions(cond)
    # "not measured (Error: ...)" is a measurement that failed; a size skipped on purpose says why
    failures = [f"qlink budget: {n}" for n in res.notes if "not measured (" in n]
    return _finish("qlink budget", failures, args.keep_going)


def _cmd_run(args) -> int:
    from .config import RunConfig, load_run_config
    from .run import main_job

    base = RunConfig.quick() if args.quick else RunConfig()
    config = load_run_config(args.config, base=base) if args.config else base  # ConfigError: exit 2
    cond = _begin_conditions()
    failures: list[str] = []
    rc = main_job(out_dir=Path(args.out), config=config, say=_say, failures=failures,
                  keep_going=args.keep_going)
    _end_conditions(cond)
    return max(rc, _finish("qlink run", failures, args.keep_going))


def _cmd_paper(args) -> int:
    from .paper import main_from_cli

    return main_from_cli(args, say=_say)


def _cmd_sweep(args) -> int:
    from .sweep.cli import run_from_cli
    from .sweep import SweepError

    try:
        return run_from_cli(args, say=_say)
    except SweepError as e:  # the CSV: another sweep's, not a sinter CSV, a damaged row
        print(f"qlink sweep: error: {e}", file=sys.stderr)
        return 2


def _cmd_serve(args) -> int:
    from .qec.cudaq_config import CudaqConfigError, service_specs_from_cudaq
    from .qec import run_service_process

    source = args.decoder_config
    try:
        if args.stim:
            import stim

            from .qec.cudaq_config import dump_multi_decoder_config, multi_decoder_config_from_source

            try:
                circuit = stim.Circuit.from_file(args.stim)
            except (OSError, ValueError) as e:
                print(f"qlink serve: cannot read the stim circuit {args.stim}: {e}", file=sys.stderr)
                return 2
            source = multi_decoder_config_from_source(circuit, type=args.decoder_type)
            if args.write_config:
                dump_multi_decoder_config(source, args.write_config)
                _say(f"wrote {args.write_config} (cudaq_qec.configure_decoders_from_file reads it too)")
        specs = service_specs_from_cudaq(source, capacity_shots=args.capacity_shots)
    except (CudaqConfigError, ValueError) as e:
        print(f"qlink serve: {e}", file=sys.stderr)
        return 2

    class _Say:  # the service's ready / report queue, printed
        def put(self, msg):
            _say(f"decoder service: {msg}" if not msg.startswith("{") else f"session report: {msg[:400]}")

    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            print(f"qlink serve: --token-env {args.token_env}: that environment variable is not set or empty; "
                  f"put the shared token there (e.g. export {args.token_env}=$(python -c 'import secrets; "
                  "print(secrets.token_hex(16))'))", file=sys.stderr)
            return 2
    from .access import InsecureBindError, check_bind

    try:
        check_bind(args.url, token=token, insecure=args.insecure)
    except InsecureBindError as e:
        print(f"qlink serve: {e}", file=sys.stderr)
        return 2
    _say(f"serving decoders {sorted(specs)} of {args.decoder_config or args.stim} on {args.url}")
    report = run_service_process(args.url, specs, ready_queue=_Say(), result_queue=_Say(),
                                 accept_timeout_s=args.accept_timeout_s,
                                 max_peers=None if args.max_peers == 0 else args.max_peers,
                                 token=token, insecure=args.insecure, service_options={"engine": args.engine})
    return 1 if "error" in report else 0


# ----- the parser ----------------------------------------------------------------------------


def _add_common_measure(p: Parser, *, out: str, quick_help: str) -> None:
    p.add_argument("--out", default=out, action=CheckedAction, check=_out, help="output directory")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--keep-going", action="store_true",
                   help="when a measurement fails, go on with the others and list the failures at the end "
                        "(the exit status is still 1)")


_BENCH = {
    "transport": ("64-byte round trip and one-sided put bandwidth beside the shared-memory spin and memcpy floors",
                  "qlink bench transport --quick\nqlink bench transport --transports shm,tcp"),
    "qec": ("the decoder service over the wire vs the 1.1 us cycle and offline decode_batch",
            "qlink bench qec --quick\nqlink bench qec --distances 5,7 --transports shm"),
    "kv": ("KV-cache block transfers beside memcpy, NIXL, Mooncake and modeled links",
           "qlink bench kv --quick\nqlink bench kv --quick --transports shm --no-peers"),
    "soak": ("faults injected and detected, fuzzing, and a soak run", "qlink bench soak --quick"),
    "crosshost": ("the loop across two network namespaces (needs root)", "qlink bench crosshost --quick"),
    "gpu": ("GPU paths (CuPy; NumPy stand-ins on a CPU)", "qlink bench gpu --quick"),
    "decoders": ("every registered decoder beside PyMatching on the same shots: LER with Wilson intervals, us/shot",
                 "qlink bench decoders --quick"),
    "cudaq": ("CUDA-Q QEC's realtime decoding (stim target, in-process) beside qlink's decoder service on the same "
              "records and one multi_decoder_config: per-shot and last syndrome -> corrections latency (needs "
              "cudaq-qec)", "qlink bench cudaq --quick\nqlink bench cudaq --transports shm"),
    "hostile": ("a well-behaved controller's reaction beside 0, 1 and 4 hostile clients (tcp, udp), and 4 "
                "controllers at once beside one alone", "qlink bench hostile --quick"),
    "vllm": ("vLLM decode-side TTFT and exposed KV transfer: the qlink connector over shm/tcp/ucx beside vLLM's "
             "ExampleConnector, NixlConnector and recompute (needs vLLM: make bench-vllm)", "qlink bench vllm --quick"),
    "sweep": ("qlink sweep qec with its defaults beside sinter collect on 2 processes, same grid: wall time "
              "(goal <= 1.2x) and LERs within Wilson intervals", "qlink bench sweep --quick"),
    "all": ("transport, qec and kv in turn", "qlink bench all --quick --keep-going"),
}


def build_parser() -> Parser:
    """The ``qlink`` argument parser."""
    p = Parser(prog="qlink",
               description="qlink: a quantum-classical interconnect sandbox. QEC decoder loops and KV-cache\n"
                           "movement on one transport core, each figure against its own budget.\n"
                           "Bad input is one line and exit status 2; Ctrl-C stops a run cleanly (exit 130).",
               examples="qlink run --quick              # about a minute: QEC loop + KV transfer + budget table\n"
                        "qlink doctor                   # what is installed, what to install\n"
                        "qlink bench qec --quick        # the decoder service vs the 1.1 us cycle\n"
                        "qlink paper build --quick      # paper.pdf, figures, tables, manifest")
    p.add_argument("--version", action="version",
                   version=f"qlink {__version__} (Python {sys.version.split()[0]})")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="the default end-to-end scenario (QEC loop + KV transfer + budget table)",
                       description="The main job: the QEC closed loop and the KV transfers on the same transports, "
                                   "the cross-domain budget table, then the quick scenarios.",
                       examples="qlink run --quick\nqlink run --config scenarios/run.toml --out results/mine")
    _add_common_measure(r, out="results/run", quick_help="smaller settings (about a minute)")
    r.add_argument("--config", metavar="FILE.toml", action=CheckedAction, check=_in_file,
                   help="settings from a TOML file over the defaults (or over --quick's): [qec] transports, "
                        "distances, num_shots; [kv] presets, tokens; [run] seed, scenarios")
    r.set_defaults(func=_cmd_run)

    b = sub.add_parser("bench", help="measure figures beside their floors and peers; writes JSON/CSV",
                       description="Measure figures beside their floors and peers; each writes JSON and CSV "
                                   "with the host, load and CPU floor of the run.",
                       examples="\n".join(e.split("\n")[0] for _, e in _BENCH.values()))
    bsub = b.add_subparsers(dest="what", required=True, metavar="WHAT")
    for name, (helptext, examples) in _BENCH.items():
        bb = bsub.add_parser(name, help=helptext, description=helptext, examples=examples)
        _add_common_measure(bb, out="results/bench", quick_help="fewer samples (a smoke run)")
        if name == "transport":
            bb.add_argument("--transports", action=ListAction, default=("shm", "tcp", "ucx"), metavar="T",
                            check=lambda v, where: checks.list_of(
                                lambda x, where: checks.transport(x, where=where,
                                                                  choices=checks.ROUND_TRIP_TRANSPORTS),
                                v, where=where),
                            help=f"round-trip transports, of {','.join(checks.ROUND_TRIP_TRANSPORTS)}")
        if name == "kv":
            bb.add_argument("--transports", action=ListAction, default=None, metavar="T",
                            check=lambda v, where: checks.list_of(
                                lambda x, where: checks.transport(x, where=where, choices=("shm", "tcp", "ucx")),
                                v, where=where),
                            help="qlink's transports, of shm,tcp,ucx (default all three)")
            bb.add_argument("--no-peers", action="store_true",
                            help="skip NIXL and Mooncake (the memcpy floor is always measured)")
        if name == "cudaq":
            bb.add_argument("--transports", action=ListAction, default=None, metavar="T",
                            check=lambda v, where: checks.list_of(
                                lambda x, where: checks.transport(x, where=where, choices=("shm", "tcp")),
                                v, where=where),
                            help="qlink's transports, of shm,tcp (default shm,tcp)")
        if name == "hostile":
            bb.add_argument("--attacker-nice", default=0, metavar="N", action=CheckedAction,
                            check=lambda v, where: checks.integer(v, where=where, lo=0, hi=19),
                            help="run the hostile clients at this nice level, 0..19 (default 0: the same priority "
                                 "as the service; on a host of few cores a higher one stands in for attackers on "
                                 "hosts of their own, whose CPU is not the service's)")
            bb.add_argument("--attacker-idle", action="store_true",
                            help="run the hostile clients under SCHED_IDLE: they get a CPU only when nothing "
                                 "else wants it, the closer stand-in for attackers on hosts of their own")
            bb.add_argument("--engines", action=ListAction, default=None, metavar="E",
                            check=lambda v, where: checks.list_of(
                                lambda x, where: checks.one_of(x, ("python", "native"), what="service engine",
                                                               where=where), v, where=where),
                            help="the decoder service's engines, of python,native (default both: the same clients "
                                 "against each)")
            bb.add_argument("--controller", default="native", choices=("native", "python"),
                            help="the well-behaved controllers' engine: native (default: lock-step, a frame per "
                                 "round, its per-frame work in C) or python (a frame per shot from plain Python, "
                                 "whose own time is most of its reaction)")
            bb.add_argument("--no-controls", action="store_true",
                            help="skip the control cases (beside n hostile clients, n processes that only spin on "
                                 "a CPU and send nothing; about a third of the run)")
        if name == "decoders":
            bb.add_argument("--distances", action=ListAction, check=checks.distances, default=None, metavar="D",
                            help="code distances, odd >= 3 (default 3,5; --quick 3)")
        if name == "qec":
            bb.add_argument("--distances", action=ListAction, check=checks.distances, default=None, metavar="D",
                            help="code distances, odd >= 3 (default 5,7,11,17; --quick 5,7)")
            bb.add_argument("--transports", action=ListAction, default=None, metavar="T",
                            check=lambda v, where: checks.list_of(
                                lambda x, where: checks.transport(x, where=where,
                                                                  choices=checks.ROUND_TRIP_TRANSPORTS),
                                v, where=where),
                            help=f"of {','.join(checks.ROUND_TRIP_TRANSPORTS)} (default shm,tcp,ucx,udp)")
            bb.add_argument("--trace", default=None, metavar="FILE.json",
                            help="write the native lock-step run's first 200 shots as a Chrome/Perfetto trace")
            bb.add_argument("--native-only", action="store_true",
                            help="only the native real-time rows and their goal table (skip the per-transport table)")
            bb.add_argument("--stim", default=None, metavar="FILE.stim", action=CheckedAction, check=checks.stim_file,
                            help="a stim circuit of your own (with DETECTOR and OBSERVABLE_INCLUDE): the per-transport "
                                 "table for it instead of the generated surface codes (--distances does not apply)")
        bb.set_defaults(func=_cmd_bench)

    bu = sub.add_parser("budget", help="the cross-domain budget table and its plot",
                        description="QEC and KV figures on the same transports, each against its own budget "
                                    "(measured and modeled apart); writes a plot.",
                        examples="qlink budget --quick\nqlink budget --transports shm,tcp")
    _add_common_measure(bu, out="results/budget", quick_help="d=5 and Llama-3-8B only, fewer shots")
    bu.add_argument("--transports", action=ListAction, default=("shm", "tcp", "ucx"), metavar="T",
                    check=lambda v, where: checks.list_of(
                        lambda x, where: checks.transport(x, where=where, choices=("shm", "tcp", "ucx")),
                        v, where=where),
                    help="transports, of shm,tcp,ucx")
    bu.set_defaults(func=_cmd_budget)

    for name, full in (("doctor", True), ("info", False)):
        d = sub.add_parser(name, help="versions, CPU, load, GPU, accelerators and optional stacks; what to install"
                           if full else "which optional stacks are installed (qlink doctor says more)",
                           examples=f"qlink {name}")
        d.set_defaults(func=_cmd_info, doctor=full)

    sv = sub.add_parser("serve", help="serve the decoders of a CUDA-Q QEC multi_decoder_config (YAML/JSON) over a "
                                      "qlink transport, measurement-level syndromes mapped through D_sparse",
                        examples="qlink serve --decoder-config decoders.yaml --url tcp://127.0.0.1:5000\n"
                                 "qlink serve --stim memory.stim --write-config decoders.yaml")
    what = sv.add_mutually_exclusive_group(required=True)
    what.add_argument("--decoder-config", metavar="FILE", help="a CUDA-Q QEC multi_decoder_config file")
    what.add_argument("--stim", metavar="FILE.stim", help="a stim circuit: its decoder (id 0) takes the circuit's "
                      "measurement record, detectors as its DETECTOR instructions define them")
    sv.add_argument("--decoder-type", default="pymatching", help="with --stim: the decoder type")
    sv.add_argument("--write-config", metavar="OUT.yaml", help="with --stim: also write the multi_decoder_config, "
                    "so the same decoders can be configured in CUDA-Q")
    sv.add_argument("--url", default="tcp://127.0.0.1:0", help="where to listen (shm://NAME for shared memory)")
    sv.add_argument("--max-peers", type=int, default=1, help="controller sessions to serve (all at once), then exit "
                    "(0: until stopped)")
    sv.add_argument("--engine", default="python", choices=("python", "native"),
                    help="the service's per-frame path: python (default) or native (in C; several controllers "
                         "at once each get a C core of their own, with the same limits)")
    sv.add_argument("--capacity-shots", type=int, default=1024, help="each decoder's queue of shots")
    sv.add_argument("--accept-timeout-s", type=float, default=300.0,
                    help="how long to wait for the first controller")
    sv.add_argument("--token-env", metavar="NAME", help="the environment variable holding a shared token: tcp "
                    "clients must prove it in the handshake, udp datagrams carry its HMAC (needed to listen beyond "
                    "loopback)")
    sv.add_argument("--insecure", action="store_true", help="listen beyond loopback without a token: anyone who "
                    "can reach the address is served")
    sv.set_defaults(func=_cmd_serve)

    s = sub.add_parser("sweep", help="parameter sweeps on Dask into a resumable sinter CSV (qec, kv) or the "
                                     "1-vs-2-worker timing (speedup)",
                       examples="qlink sweep qec --distances 3,5 --ps 0.001,0.002\n"
                                "qlink sweep kv --tokens 512,4096 --transports shm,tcp")
    from .sweep.cli import add_arguments

    add_arguments(s)
    s.set_defaults(func=_cmd_sweep)

    pp = sub.add_parser("paper", help="build the cross-domain latency paper: paper.pdf, figures (PNG, PDF), tables "
                                      "(CSV, LaTeX) and a manifest with hashes",
                        examples="qlink paper build --quick\nqlink paper build --profile test --out /tmp/paper")
    pp.add_argument("action", choices=["build"])
    pp.add_argument("--quick", action="store_true", help="smaller settings (a few minutes on 2 cores)")
    pp.add_argument("--profile", choices=["test", "quick", "full"], default=None,
                    help="settings by name (overrides --quick; default full, or quick with --quick)")
    pp.add_argument("--out", default=None, action=CheckedAction, check=_out,
                    help="output directory (default: papers/cross-domain-latency/build)")
    pp.add_argument("--seed", type=int, default=1, help="seed of every scenario")
    pp.set_defaults(func=_cmd_paper)
    return p


# commands that start processes: they run under a supervisor that stops them cleanly (qlink._supervise)
_SUPERVISED = {"run", "bench", "budget", "paper"}


def main(argv: list[str] | None = None) -> int:
    """Run ``qlink`` with ``argv``; returns the exit status."""
    from .errors import ConfigError, MissingDependencyError

    from ._supervise import WORKER_ENV, become_worker, supervise

    args = build_parser().parse_args(argv)  # bad input: one line, exit 2, before anything starts
    prog = f"qlink {args.cmd}"
    if os.environ.get(WORKER_ENV):
        become_worker()
    elif argv is None and args.cmd in _SUPERVISED:
        rc = supervise(sys.argv[1:], prog=prog)  # the command runs in a worker; Ctrl-C stops it cleanly
        if rc >= 0:
            return rc
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:  # a bad value found after parsing (a config file, a grid)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except MissingDependencyError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback; QLINK_TRACEBACK=1 shows it
        if os.environ.get("QLINK_TRACEBACK"):
            raise
        print(f"{prog}: failed: {type(e).__name__}: {e} (QLINK_TRACEBACK=1 shows where)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
