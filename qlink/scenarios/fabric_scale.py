"""Fabric scale: reaction time and decoder backlog as logical qubits grow (modeled).

N QPU controllers (one logical qubit each: a distance-d surface-code memory, one
syndrome frame per 1.1 µs cycle — Google Willow's cycle, arXiv:2408.13687) share M
decoders over a fabric link from the catalog (NVQLink, RoCE 400G, InfiniBand NDR,
TCP over 100G Ethernet; every number cited in ``qlink.links``). Decode times per
batch size are measured here from the real decoder (PyMatching through
``qlink.qec.decoders``) and drive a discrete-event model (``qlink.fabric``) for
N = 1, 10, 100, 1000. Every figure is *modeled* (``basis="modeled"``); each row names
the measured decode-time table it used (decoder, distance, host, time). The model is
first checked against the real closed loop on this machine (``--no-validate`` skips).

Writes ``fabric_scale.csv`` / ``.json``, ``fabric_scale.png`` (reaction-time p99 vs N,
one line per fabric, one panel per decoder count) and ``fabric_backlog.png`` (the
decoders' queue over time at the largest N) into ``--out``.

    python scenarios/fabric_scale.py --quick --out results/fabric_scale
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

__all__ = ["run", "main", "decoders_for", "FABRICS", "CONTROLLERS", "DECODERS", "QUICK", "FULL"]

FABRICS = ("nvqlink", "roce-400g", "ib-ndr", "tcp-100g")
CONTROLLERS = (1, 10, 100, 1000)
DECODERS = ("16", "N/4")  # a fixed pool of 16 decoders, and one decoder per 4 logical qubits
QUICK = {"shots": 100, "repeats": 30}
FULL = {"shots": 400, "repeats": 100}
_SUMMARY_COLUMNS = ["fabric", "decoders_spec", "num_controllers", "num_decoders", "reaction_p50_us",
                    "reaction_p99_us", "reaction_p999_us", "utilization_bound", "mean_batch",
                    "queue_slope_shots_per_s", "stable"]


def decoders_for(spec: str, num_controllers: int) -> int:
    """Decoders for a spec: ``"16"`` (a fixed pool, at most one per controller) or ``"N/4"``.

    >>> decoders_for("16", 10), decoders_for("16", 1000), decoders_for("N/4", 10), decoders_for("N/4", 1)
    (10, 16, 3, 1)
    """
    s = str(spec).strip().replace(" ", "")
    try:
        if s.upper().startswith("N/"):
            k = int(s[2:])
            if k < 1:
                raise ValueError
            return max(1, -(-num_controllers // k))
        m = int(s)
        if m < 1:
            raise ValueError
        return min(m, num_controllers)
    except ValueError:
        raise ValueError(f"decoder spec {spec!r} is neither a positive count ('16') nor 'N/k' ('N/4')") from None


def _load_service(service, *, distance: int, rounds: int, p: float, decoder: str, repeats: int, seed: int):
    from qlink.fabric import ServiceTimes, measure_service_times

    if isinstance(service, ServiceTimes):
        return service
    if service is not None:
        with open(service) as f:
            return ServiceTimes.from_dict(json.load(f))
    return measure_service_times(distance, p, (1, 2, 4, 8, 16, 32, 64, 128, 256), rounds=rounds, decoder=decoder,
                                 repeats=repeats, seed=seed)


def run(*, out: str | Path | None = "results/fabric_scale", quick: bool = False, fabrics=FABRICS,
        controllers=CONTROLLERS, decoders=DECODERS, distance: int = 5, rounds: int | None = None, p: float = 0.001,
        cycle_ns: float = 1100.0, rounds_per_frame: int = 1, batch_size: int = 256, shots: int | None = None,
        decoder: str = "pymatching", service=None, phase: str = "random", seed: int = 1, validate: bool = True,
        progress: bool = True) -> dict:
    """Sweep fabrics x decoder specs x N; return ``{"rows", "meta", "validation", "results"}``.

    ``service``: a :class:`~qlink.fabric.ServiceTimes`, a JSON file written by
    ``ServiceTimes.to_dict`` (e.g. the ``service_times.json`` of an earlier run), or
    ``None`` to measure now. With ``out`` writes the CSV/JSON and the plots there.
    """
    from qlink.bench.report import environment, write_results
    from qlink.fabric import FabricConfig, simulate
    from qlink.links import link

    from qlink import checks

    preset = QUICK if quick else FULL
    # None means "the default" (rounds: the distance); 0 is refused, never taken for it
    distance = checks.distance(distance, where="distance")
    rounds = checks.count(distance if rounds is None else rounds, where="rounds")
    shots = checks.count(preset["shots"] if shots is None else shots, where="shots")
    p = checks.probability(p, where="p")
    decoder = checks.decoder(decoder, where="decoder")
    svc = _load_service(service, distance=distance, rounds=rounds, p=p, decoder=decoder,
                        repeats=preset["repeats"], seed=seed)
    validation = None
    if validate:
        from qlink.fabric import validate_against_loop

        validation = validate_against_loop(transport="shm", seed=seed)
    cases = [(f, spec, n) for spec in decoders for f in fabrics for n in controllers]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(cases), desc="fabric model", unit="run", file=sys.stderr)
    rows, results = [], {}
    try:
        for fab, spec, n in cases:
            cfg = FabricConfig(num_controllers=n, num_decoders=decoders_for(spec, n), link=link(fab), service=svc,
                               distance=distance, rounds=rounds, rounds_per_frame=rounds_per_frame,
                               cycle_ns=cycle_ns, num_shots=shots, batch_size=batch_size, phase=phase,
                               warmup_shots=max(1, shots // 10) if shots > 1 else 0)
            res = simulate(cfg, seed=seed)
            results[(fab, spec, n)] = res
            rows.append({"decoders_spec": spec, **res.row()})
            if bar:
                bar.update()
    finally:
        if bar:
            bar.close()
    meta = {
        "basis": "modeled",
        "what": "reaction time (last round's tick -> correction applied at the controller) and decoder queue",
        "config": {"fabrics": list(fabrics), "controllers": list(controllers), "decoders": list(decoders),
                   "distance": distance, "rounds": rounds, "p": p, "cycle_ns": cycle_ns,
                   "rounds_per_frame": rounds_per_frame, "batch_size": batch_size, "shots_per_controller": shots,
                   "decoder": decoder, "phase": phase, "seed": seed, "quick": quick},
        "service_times": svc.describe(),
        "links": {f: results[next(k for k in results if k[0] == f)].inputs["link"] for f in fabrics},
        "validation": None if validation is None else {**validation.row(), "inputs": validation.inputs,
                                                       "loop": validation.loop_summary},
        "environment": environment(),
    }
    report = {"rows": rows, "meta": meta, "validation": validation, "results": results}
    if out is not None:
        out = Path(out)
        write_results(rows, out_dir=out, name="fabric_scale", meta=meta)
        with open(out / "service_times.json", "w") as f:
            json.dump(svc.to_dict(), f)
        _plots(report, out)
    return report


def _plots(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report["meta"]["config"]
    results = report["results"]
    specs = cfg["decoders"]
    title = (f"d={cfg['distance']}, {cfg['rounds']} rounds/shot, cycle {cfg['cycle_ns']:g} ns, "
             f"batch <= {cfg['batch_size']}, {cfg['decoder']} decode times measured here — modeled")
    fig, axes = plt.subplots(1, len(specs), figsize=(5.2 * len(specs), 4.2), squeeze=False, sharey=True)
    for ax, spec in zip(axes[0], specs):
        for fab in cfg["fabrics"]:
            ns = [n for n in cfg["controllers"] if (fab, spec, n) in results]
            p99 = [results[(fab, spec, n)].reaction_p99_ns / 1e3 for n in ns]
            stable = [results[(fab, spec, n)].stable for n in ns]
            line, = ax.plot(ns, p99, marker="o", label=fab)
            bad = [(n, v) for n, v, s in zip(ns, p99, stable) if not s]
            if bad:
                ax.scatter(*zip(*bad), marker="x", s=70, color=line.get_color(), zorder=3)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("logical qubits N (controllers)")
        ax.set_title(f"M = {spec} decoders" + (" (one per 4 qubits)" if spec.upper() == "N/4" else ""),
                     fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("reaction time p99 (µs, modeled)")
    axes[0][0].legend(title="fabric (x: backlog grows)", fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fabric_scale.png", dpi=120)
    plt.close(fig)

    n_max = max(cfg["controllers"])
    fig, axes = plt.subplots(1, len(specs), figsize=(5.2 * len(specs), 4.0), squeeze=False)
    for ax, spec in zip(axes[0], specs):
        for fab in cfg["fabrics"]:
            res = results.get((fab, spec, n_max))
            if res is not None:
                ax.plot(res.backlog_t_ns / 1e3, res.queue_shots, label=f"{fab} (M={res.config.num_decoders})")
        ax.set_xlabel("time (µs)")
        ax.set_ylabel("shots waiting for a decoder (all decoders)")
        ax.set_title(f"N = {n_max}, M = {spec}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Decoder queue over time — modeled", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "fabric_backlog.png", dpi=120)
    plt.close(fig)


def _summary(rows: list[dict]) -> str:
    from qlink.bench.report import format_table

    table = []
    for r in rows:
        table.append({c: (round(r[c], 2) if isinstance(r[c], float) and math.isfinite(r[c]) else r[c])
                      for c in _SUMMARY_COLUMNS})
    return format_table(table, columns=_SUMMARY_COLUMNS)


def _decoder_spec(value, *, where):
    from qlink import checks

    try:
        decoders_for(value, 1)
    except ValueError as e:
        raise checks.UsageError(f"{where}: {e}") from None
    return str(value).strip()


def _fabric(value, *, where):
    from qlink import checks
    from qlink.links import LINKS

    return checks.one_of(value, tuple(LINKS), what="link", where=where)


def main(argv: list[str] | None = None) -> int:
    from qlink import checks
    from qlink._argparse import ListAction, Parser, checked

    def listed(check):
        return dict(action=ListAction, check=lambda v, where: checks.list_of(check, v, where=where))

    ap = Parser(description=__doc__.split("\n\n")[0],
                examples="python scenarios/fabric_scale.py --quick\n"
                         "python scenarios/fabric_scale.py --fabrics nvqlink,ib-ndr --controllers 10,100 --decoders N/4")
    ap.add_argument("--out", default="results/fabric_scale", help="output directory (CSV, JSON, PNGs)",
                    **checked(checks.out_dir))
    ap.add_argument("--quick", action="store_true", help=f"{QUICK['shots']} shots per controller (< 1 min)")
    ap.add_argument("--fabrics", default=FABRICS, metavar="LINK", help="link names from qlink.links",
                    **listed(_fabric))
    ap.add_argument("--controllers", default=CONTROLLERS, metavar="N", help="controller counts", **listed(checks.count))
    ap.add_argument("--decoders", default=DECODERS, metavar="SPEC",
                    help="decoder counts: a number (a fixed pool) or N/k (one per k qubits)", **listed(_decoder_spec))
    ap.add_argument("--distance", default=5, help="code distance, odd >= 3", **checked(checks.distance))
    ap.add_argument("--rounds", default=None, help="QEC rounds per shot (default: the distance)",
                    **checked(checks.count))
    ap.add_argument("--p", default=0.001, help="physical error rate, in (0, 0.5)", **checked(checks.probability))
    ap.add_argument("--cycle-ns", default=1100.0, help="syndrome cycle", **checked(checks.number, lo=0, lo_open=True))
    ap.add_argument("--rounds-per-frame", default=1, help="rounds per frame (0: the whole shot)",
                    **checked(checks.non_negative))
    ap.add_argument("--batch-size", default=256, help="most shots one decoder call takes", **checked(checks.count))
    ap.add_argument("--shots", default=None, help=f"shots per controller (default {FULL['shots']})",
                    **checked(checks.count))
    ap.add_argument("--decoder", default="pymatching", help="a decoder of qlink.qec.decoders.BUILT_IN_DECODERS",
                    **checked(checks.decoder))
    ap.add_argument("--service-json", default=None, help="decode-time table from an earlier run (service_times.json)",
                    **checked(checks.in_file))
    ap.add_argument("--phase", default="random", choices=("random", "cycle", "aligned"),
                    help="controllers' clocks: independent (random), skewed within one cycle, or in step")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-validate", action="store_true", help="skip the check against the real loop")
    args = ap.parse_args(argv)
    fabrics, controllers, decoders = list(args.fabrics), list(args.controllers), list(args.decoders)
    rep = run(out=args.out, quick=args.quick, fabrics=fabrics, controllers=controllers, decoders=decoders,
              distance=args.distance, rounds=args.rounds, p=args.p, cycle_ns=args.cycle_ns,
              rounds_per_frame=args.rounds_per_frame, batch_size=args.batch_size, shots=args.shots,
              decoder=args.decoder, service=args.service_json, phase=args.phase, seed=args.seed,
              validate=not args.no_validate)
    v = rep["validation"]
    if v is not None:
        print(f"validation vs the real loop ({v.transport}, d=3, one controller): predicted p50 "
              f"{v.predicted_p50_ns / 1e3:.1f} us, measured {v.measured_p50_ns / 1e3:.1f} us "
              f"({100 * v.rel_error:+.0f} %; allowed +/- {v.allowed_ns / 1e3:.1f} us): "
              f"{'within' if v.within else 'OUTSIDE'} tolerance")
    src = rep["meta"]["service_times"]["source"]
    print(f"decode times: {src.get('kind')} {src.get('decoder', '')} d={src.get('distance', '')} "
          f"on {src.get('cpu', '?')} at {src.get('time_utc', '?')}; all figures below are modeled")
    print(_summary(rep["rows"]))
    print(f"written: {Path(args.out)}/fabric_scale.csv, fabric_scale.json, fabric_scale.png, fabric_backlog.png")
    return 0


if __name__ == "__main__":
    from qlink._argparse import run_main

    sys.exit(run_main(main))
