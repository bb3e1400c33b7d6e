"""Surface-code memory: logical error rate vs physical error rate and distance, through the wire.

Every shot travels the full path: the controller emulator streams its detection
events as CUDA-Q realtime ``enqueue_syndromes`` frames over the chosen transport to
the decoder service in another process, asks ``get_corrections``, and applies the
answer to its Pauli frame. The same shots are also decoded offline (the decoder
called directly) and written beside, so any difference would show.

Results are a sinter-compatible CSV (``shots,errors,discards,seconds,decoder,
strong_id,json_metadata,custom_counts``; read it back with
``sinter.read_stats_from_csv_files``; ``discards`` are shots the service answered
``SYNDROMES_DROPPED``) and a threshold plot (PNG). A rerun with the same ``--out``
skips the tasks the CSV already holds.

    python scenarios/qec_memory.py --quick --transport shm --out results/qec_memory
    python scenarios/qec_memory.py --stim memory.stim --shots 5000   # one task: a circuit of your own
"""

from __future__ import annotations

import collections
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["run", "main", "plot_threshold", "QUICK", "FULL"]

QUICK = {"distances": (3, 5), "ps": (0.004, 0.008, 0.012), "num_shots": 2_000}
FULL = {"distances": (3, 5, 7), "ps": (0.001, 0.002, 0.003, 0.005, 0.007, 0.01), "num_shots": 20_000}
CSV_NAME = "qec_memory.csv"


def _task_stats(*, strong_id, decoder, metadata, shots, errors, discards, seconds, custom):
    import sinter

    return sinter.TaskStats(strong_id=strong_id, decoder=decoder, json_metadata=metadata, shots=int(shots),
                            errors=int(errors), discards=int(discards), seconds=float(seconds),
                            custom_counts=collections.Counter({k: int(v) for k, v in custom.items() if v}))


def _strong_id(source, decoder: str, metadata: dict) -> str:
    import sinter

    task = sinter.Task(circuit=source.source.circuit, decoder=decoder, detector_error_model=source.dem,
                       json_metadata=metadata)
    return task.strong_id()


def _done(csv_path: Path) -> dict:
    if not csv_path.exists() or csv_path.stat().st_size == 0:
        return {}
    import sinter

    return {(s.strong_id, s.decoder): s for s in sinter.read_stats_from_csv_files(csv_path)}


def run(*, transport: str = "shm", out: str | Path | None = "results/qec_memory", distances=None, ps=None,
        num_shots: int | None = None, seed: int = 1, decoder: str = "pymatching", quick: bool = False,
        rounds_per_frame: int = 0, progress: bool = True, plot: bool = True,
        stim: str | Path | None = None) -> list[dict]:
    """Run every (distance, p) task through the loop; return one row per task and path.

    Rows have the sinter columns plus ``d``, ``p``, ``path`` (``wire`` or ``offline``),
    ``transport``, ``ler`` and its Wilson interval. With ``out`` the CSV (appended,
    resumable) and ``threshold.png`` are written there.

    ``stim``: one task, a ``.stim`` circuit of one's own (with detectors and observables)
    instead of the (distance, p) grid; its rows have ``circuit`` set and ``d``, ``p`` empty,
    and no threshold plot is drawn.
    """
    from qlink.qec.controller import wilson_interval
    from qlink.qec.decoders import compile_decoder
    from qlink.qec.loop import build_source, run_loop, sample_stream, source_spec
    from qlink.qec.specs import spec_and_source

    from qlink import checks

    preset = QUICK if quick else FULL
    if stim is not None:
        for name, v in (("distances", distances), ("ps", ps)):
            if v is not None:
                raise checks.UsageError(f"{name}: does not apply to a circuit of your own (stim={stim}); leave it out")
        stim = checks.stim_file(stim, where="stim")
        distances, ps = (None,), (None,)
    # None means "the preset's"; an empty list or 0 is refused, never taken for the default
    else:
        distances = checks.distances(preset["distances"] if distances is None else distances, where="distances")
        ps = checks.list_of(checks.probability, preset["ps"] if ps is None else ps, where="ps")
    num_shots = checks.count(preset["num_shots"] if num_shots is None else num_shots, where="num_shots")
    decoder = checks.decoder(decoder, where="decoder")
    transport = checks.transport(transport, where="transport", urls=True)
    rounds_per_frame = checks.non_negative(rounds_per_frame, where="rounds_per_frame")
    csv_path = None
    done: dict = {}
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        csv_path = out / CSV_NAME
        done = _done(csv_path)
    tasks = [(d, p) for d in distances for p in ps]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(tasks), desc=f"LER over {transport}", unit="task", file=sys.stderr)
    rows = []
    try:
        for i, (d, p) in enumerate(tasks):
            if stim is not None:
                spec, src = spec_and_source(stim)
                base = {"d": None, "r": int(src.round_of_detector[-1]) + 1, "p": None, "circuit": stim,
                        "sha256": spec["sha256"], "seed": seed + i}
            else:
                spec = source_spec(distance=d, rounds=d, p=p)
                src = build_source(spec)
                base = {"d": d, "r": d, "p": p, "code": spec["code"], "noise": "uniform", "seed": seed + i}
            meta_wire = {**base, "path": "wire", "transport": transport, "rounds_per_frame": rounds_per_frame}
            meta_off = {**base, "path": "offline"}
            wire_name, off_name = f"{decoder}@wire", f"{decoder}@offline"
            sid_wire = _strong_id(src, wire_name, meta_wire)
            sid_off = _strong_id(src, off_name, meta_off)
            prev = done.get((sid_wire, wire_name))
            if prev is not None and prev.shots >= num_shots:
                rows.append(_row(prev, meta_wire, wilson_interval))
                if (sid_off, off_name) in done:
                    rows.append(_row(done[(sid_off, off_name)], meta_off, wilson_interval))
                if bar:
                    bar.update()
                continue
            stream = sample_stream(src, num_shots=num_shots, seed=seed + i)
            t0 = time.perf_counter()
            res = run_loop(transport=transport, source=spec, stream=stream, num_shots=num_shots, decoder=decoder,
                           rounds_per_frame=rounds_per_frame, cycle_ns=1, max_in_flight_shots=512,
                           warmup_shots=0, keep_samples=0, timeout_s=max(120.0, num_shots * 0.01))
            t_wire = time.perf_counter() - t0
            wire_stats = _task_stats(strong_id=sid_wire, decoder=wire_name, metadata=meta_wire,
                                     shots=res.num_shots, errors=res.logical_errors, discards=res.shots_dropped,
                                     seconds=t_wire, custom={"failed": res.controller.shots_failed})
            t0 = time.perf_counter()
            packed = np.packbits(stream.detectors, axis=1, bitorder="little")
            pred = compile_decoder(decoder, src.dem).decode_shots_bit_packed(packed)
            truth = np.packbits(stream.observables, axis=1, bitorder="little")
            off_errors = int((np.asarray(pred) != truth).any(axis=1).sum())
            off_stats = _task_stats(strong_id=sid_off, decoder=off_name, metadata=meta_off, shots=num_shots,
                                    errors=off_errors, discards=0, seconds=time.perf_counter() - t0, custom={})
            if csv_path is not None:
                new = not csv_path.exists() or csv_path.stat().st_size == 0
                with open(csv_path, "a") as f:
                    if new:
                        import sinter

                        f.write(sinter.CSV_HEADER + "\n")
                    f.write(wire_stats.to_csv_line() + "\n")
                    f.write(off_stats.to_csv_line() + "\n")
            row = _row(wire_stats, meta_wire, wilson_interval)
            row["transport_used"] = res.transport
            row["matches_offline"] = bool(np.array_equal(res.controller.corrections, np.asarray(pred)))
            rows.append(row)
            rows.append(_row(off_stats, meta_off, wilson_interval))
            if bar:
                bar.update()
                bar.set_postfix(d=d, p=p, ler=f"{row['ler']:.2e}")
    finally:
        if bar:
            bar.close()
    if out is not None and plot and stim is None:
        plot_threshold(rows, out / "threshold.png", transport=transport)
    return rows


def _row(stats, meta: dict, wilson) -> dict:
    kept = stats.shots - stats.discards
    lo, hi = wilson(stats.errors, kept) if kept else (math.nan, math.nan)
    return {"d": meta["d"], "p": meta["p"], **({"circuit": meta["circuit"]} if "circuit" in meta else {}),
            "path": meta["path"], "transport": meta.get("transport", ""),
            "shots": stats.shots, "errors": stats.errors, "discards": stats.discards,
            "seconds": round(stats.seconds, 3), "decoder": stats.decoder,
            "ler": stats.errors / kept if kept else math.nan, "ler_lo": lo, "ler_hi": hi}


def plot_threshold(rows: list[dict], path, *, transport: str = "") -> Path:
    """LER vs p, one line per distance (wire path solid with 95 % Wilson bands, offline dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for k, d in enumerate(sorted({r["d"] for r in rows})):
        color = f"C{k}"
        for path_name, style in (("wire", "-o"), ("offline", "--")):
            rs = sorted((r for r in rows if r["d"] == d and r["path"] == path_name), key=lambda r: r["p"])
            if not rs:
                continue
            p = np.array([r["p"] for r in rs])
            y = np.array([r["ler"] for r in rs])
            label = f"d={d} ({'through ' + transport if path_name == 'wire' else 'offline'})"
            ax.plot(p, np.where(y > 0, y, np.nan), style, label=label, color=color,
                    alpha=1.0 if path_name == "wire" else 0.6)
            if path_name == "wire":
                ax.fill_between(p, [r["ler_lo"] for r in rs], [r["ler_hi"] for r in rs], alpha=0.2, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("physical error rate p (uniform circuit noise)")
    ax.set_ylabel("logical error rate per shot (d rounds)")
    ax.set_title("Rotated surface-code memory, decoded over the wire")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from qlink import checks
    from qlink._argparse import ListAction, Parser, checked

    ap = Parser(description=__doc__.split("\n\n")[0],
                examples="python scenarios/qec_memory.py --quick\n"
                         "python scenarios/qec_memory.py --distances 3,5,7 --ps 0.002,0.005 --shots 5000")
    ap.add_argument("--transport", default="shm", help="shm, tcp, ucx, udp, inproc or a URL",
                    **checked(checks.transport, urls=True))
    ap.add_argument("--out", default="results/qec_memory", help="output directory (CSV + PNG)",
                    **checked(checks.out_dir))
    ap.add_argument("--quick", action="store_true", help="d=3,5 and three p values, 2000 shots (< 1 min)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shots", default=None, help=f"shots per task (default {FULL['num_shots']})",
                    **checked(checks.count))
    ap.add_argument("--distances", action=ListAction, check=checks.distances, default=None, metavar="D",
                    help=f"odd distances >= 3, '3,5' or '3 5' (default {','.join(map(str, FULL['distances']))})")
    ap.add_argument("--ps", action=ListAction, metavar="P", default=None,
                    check=lambda v, where: checks.list_of(checks.probability, v, where=where),
                    help=f"physical error rates in (0, 0.5) (default {','.join(map(str, FULL['ps']))})")
    ap.add_argument("--decoder", default="pymatching", help="a decoder of qlink.qec.decoders.BUILT_IN_DECODERS",
                    **checked(checks.decoder))
    ap.add_argument("--rounds-per-frame", default=0, help="rounds per frame (0: a whole shot)",
                    **checked(checks.non_negative))
    ap.add_argument("--stim", default=None, metavar="FILE.stim",
                    help="one task: a stim circuit of your own (with DETECTOR and OBSERVABLE_INCLUDE) instead of "
                         "the distance x p grid (--distances and --ps do not apply)", **checked(checks.stim_file))
    args = ap.parse_args(argv)
    rows = run(transport=args.transport, out=args.out, distances=args.distances, ps=args.ps, num_shots=args.shots,
               seed=args.seed, decoder=args.decoder, quick=args.quick, rounds_per_frame=args.rounds_per_frame,
               stim=args.stim)
    for r in rows:
        print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}))
    print(f"written: {Path(args.out) / CSV_NAME}" + ("" if args.stim else f", {Path(args.out) / 'threshold.png'}"))
    return 0


if __name__ == "__main__":
    from qlink._argparse import run_main

    sys.exit(run_main(main))
