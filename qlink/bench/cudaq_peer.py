"""CUDA-Q's realtime decoding beside qlink's decoder service, on the same measurement records.

:func:`compare_with_cudaq` writes one ``multi_decoder_config`` file for a memory
experiment, runs CUDA-Q's realtime kernel with decoders configured from it
(:func:`qlink.qec.cudaq_realtime.run_cudaq_realtime`), then plays the very same
measurement records through qlink's decoder service (a spawned
:func:`~qlink.qec.start_service_process` configured from the same file, one
``enqueue_syndromes`` frame per round, over each transport) and compares the
corrections shot by shot. Figures (a dict, also what the bench writes):

- CUDA-Q: wall time per shot of one launch looping over ``num_shots`` shots (the
  launch's compile cost removed by a second, shorter launch: ``(t_N - t_n) / (N - n)``;
  ``cudaq_launch_per_shot_us`` keeps it: ``t_N / N``),
  and the same for the circuit without the realtime calls (the simulation floor); their
  difference is what the realtime decoding adds per shot in CUDA-Q's simulation path.
- qlink, per transport: reaction time (last frame out -> correction applied) p50/p99,
  the service's decode time per shot, and per shot of the whole run.
- ``identical``: corrections equal shot by shot, and the logical error rates.

:func:`cudaq_decoder_timings` reads CUDA-Q's own per-call decoder timings (its
``[DecoderStats]`` log lines at ``CUDAQ_LOG_LEVEL=info``, in a child process: the
logging slows the launch, so it is a run of its own). :func:`measurement_overhead`
(:mod:`qlink.bench.dsparse`) measures what measurement-level syndromes (``D_sparse``)
cost qlink per shot beside detection events, offline and through the service.

>>> # figures = compare_with_cudaq(code="repetition", distance=5, rounds=5, num_shots=500)
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np


__all__ = ["compare_with_cudaq", "serve_records", "cudaq_decoder_timings", "bench_rows",
           "main_from_cli"]


def _layout(code: str, distance: int, rounds: int):
    from qlink.qec.cudaq_realtime import repetition_layout, surface_layout

    if code == "repetition":
        return repetition_layout(distance=distance, rounds=rounds)
    if code == "surface":
        return surface_layout(distance=distance, rounds=rounds)
    raise ValueError(f"code must be 'repetition' or 'surface', got {code!r}")


def serve_records(config_path, measurements: np.ndarray, true_flips: np.ndarray, round_of_measurement, *,
                  transport: str = "shm", decoder_id: int = 0, cycle_ns: int = 20_000, timeout_s: float = 120.0,
                  max_in_flight_shots: int | None = 1, engine: str = "python"):
    """Play measurement records through a qlink decoder service started from ``config_path``
    (one frame per round; by default one shot in flight at a time, so the reaction time is a
    shot's own, not a backlog's); ``engine`` the per-frame paths' (``"python"``, or
    ``"native"``: the service's in C, and with one shot in flight the controller's too, its
    lock-step loop in C); returns ``(ControllerResult, service report)``."""
    import transports

    from qlink.qec.controller import Controller, SyndromeStream
    from qlink.qec.cudaq_config import service_specs_from_cudaq
    from qlink.qec.loop import resolve_url
    from qlink.qec import start_service_process

    specs = service_specs_from_cudaq(config_path)
    stream = SyndromeStream(detectors=measurements, observables=true_flips, round_of_detector=round_of_measurement)
    with start_service_process(resolve_url(transport), specs, max_peers=1, timeout_s=timeout_s + 30,
                               start_timeout_s=180.0,  # (a busy host: the child's imports alone take a minute)
                               service_options={"engine": engine, "keep_samples": len(measurements)}) as proc:
        ep = transports.connect(proc.url, timeout_s=30)
        try:
            if engine == "native" and max_in_flight_shots == 1:
                from qlink.qec.hotpath import NativeController

                ctl = NativeController(ep, stream, decoder_id=decoder_id, cycle_ns=cycle_ns, rounds_per_frame=1,
                                       lockstep=True)
            else:
                ctl = Controller(ep, stream, decoder_id=decoder_id, cycle_ns=cycle_ns, rounds_per_frame=1,
                                 max_in_flight_shots=max_in_flight_shots)
            res = ctl.run(timeout_s=timeout_s)
        finally:
            ep.close()
        report = proc.report(timeout_s=60)
    return res, report


def _per_shot_s(run_fn, n_small: int, n_large: int) -> tuple[float, object]:
    """Per-shot seconds of a launch with the launch cost removed: two launches, the difference
    (NaN where the difference is not positive: a host too busy to tell)."""
    small = run_fn(n_small)
    large = run_fn(n_large)
    diff = large.wall_s - small.wall_s  # not positive: the host stalled the short launch more than the long one
    return (diff / (n_large - n_small) if diff > 0 else float("nan")), large


def compare_with_cudaq(*, code: str = "repetition", distance: int = 5, rounds: int | None = None, p: float = 0.01,
                       num_shots: int = 1000, transports=("shm", "tcp"), seed: int = 1, decoder_type: str = "pymatching",
                       cycle_ns: int = 20_000, config_path=None, decoder_timings: bool = True,
                       engines=("python",), say=None) -> dict:
    """Run CUDA-Q's realtime decoding and qlink's service on the same records; a dict of figures
    (with ``decoder_timings``, also CUDA-Q's in-kernel per-call timings: :func:`cudaq_decoder_timings`).
    qlink's service runs over each of ``transports`` with each of ``engines`` (``"native"``:
    its per-frame path in C, where built); ``out["transports"]`` is keyed by the transport
    for the Python engine and ``"<transport>/native"`` for the native one."""
    from qlink.qec.controller import wilson_interval
    from qlink.qec.cudaq_config import dump_multi_decoder_config, stim_measurement_matrices
    from qlink.qec.cudaq_realtime import config_for_layout, layout_stim_circuit, run_cudaq_realtime

    say = say or (lambda msg: None)
    rounds = int(rounds or distance)
    layout = _layout(code, distance, rounds)
    tmp = None
    if config_path is None:
        tmp = tempfile.TemporaryDirectory(prefix="qlink-cudaq-peer-")
        config_path = Path(tmp.name) / "decoders.yaml"
    try:
        dump_multi_decoder_config(config_for_layout(layout, p=p, decoder_type=decoder_type), config_path)
        n_small = max(1, num_shots // 10)
        say(f"CUDA-Q realtime: {layout.name}, p={p}, {n_small} + {num_shots} shots in two launches")
        per_shot, run = _per_shot_s(lambda n: run_cudaq_realtime(layout, p=p, num_shots=n, config=config_path,
                                                                  seed=seed), n_small, num_shots)
        floor, _ = _per_shot_s(lambda n: run_cudaq_realtime(layout, p=p, num_shots=n, decode=False, seed=seed),
                               n_small, num_shots)
        _, m2o = stim_measurement_matrices(layout_stim_circuit(layout, p=p))
        flips = (np.asarray((m2o @ run.measurements.T.astype(np.int64)).T) & 1).astype(np.uint8)
        cudaq_errors = int((flips ^ run.corrections).any(axis=1).sum())
        out = {"code": code, "distance": distance, "rounds": rounds, "p": p, "num_shots": num_shots,
               "decoder": decoder_type, "num_measurements": layout.num_measurements,
               "cudaq_per_shot_us": per_shot * 1e6, "cudaq_simulation_floor_per_shot_us": floor * 1e6,
               "cudaq_decoding_added_per_shot_us": (per_shot - floor) * 1e6,
               "cudaq_launch_s": run.wall_s, "cudaq_launch_per_shot_us": run.wall_s * 1e6 / num_shots, "cudaq_logical_errors": cudaq_errors,
               "cudaq_ler": cudaq_errors / num_shots, "cudaq_ler_interval": wilson_interval(cudaq_errors, num_shots),
               "raw_flip_rate": float(flips.any(axis=1).mean()), "transports": {}}
        rounds_of = layout.measurement_rounds()
        identical_all = True
        runs = [(tr, eng) for tr in transports for eng in engines]
        for tr, eng in runs:
            if eng == "native":
                from qlink.qec.hotpath import available

                if available() is not None:
                    continue
            say(f"qlink service ({eng}) over {tr}: the same {num_shots} records, one frame per round")
            t0 = time.perf_counter()
            res, report = serve_records(config_path, run.measurements, flips, rounds_of, transport=tr,
                                        cycle_ns=cycle_ns, engine=eng)
            wall = time.perf_counter() - t0
            corr = np.unpackbits(res.corrections, axis=1, count=1, bitorder="little")
            answered = res.correct >= 0
            identical = bool(answered.all() and np.array_equal(corr, run.corrections))
            identical_all &= identical
            p50, p99 = res.reaction_percentiles_ns((50, 99))
            stages = report.get("stages", {})
            dps = stages.get("decode_per_shot", {})
            out["transports"][tr if eng == "python" else f"{tr}/{eng}"] = {
                "engine": eng, "identical": identical, "mismatches": int((corr != run.corrections).any(axis=1).sum()),
                "unanswered": int((~answered).sum()), "logical_errors": int(res.logical_errors),
                "reaction_p50_us": p50 / 1e3, "reaction_p99_us": p99 / 1e3,
                "decode_per_shot_p50_us": _hist_p50_us(dps),
                "run_per_shot_us": res.duration_ns / 1e3 / num_shots, "wall_s": wall,
                "transport": report.get("transport", tr)}
        out["identical"] = identical_all
        if decoder_timings:
            say("CUDA-Q in-kernel decoder timings ([DecoderStats], a launch of its own)")
            try:
                out["cudaq_in_kernel"] = cudaq_decoder_timings(code=code, distance=distance, rounds=rounds, p=p,
                                                               num_shots=min(num_shots, 500), seed=seed)
            except (RuntimeError, OSError) as exc:
                out["cudaq_in_kernel"] = {"error": str(exc)[:500]}
        out["host"] = os.uname().nodename
        out["cpu_count"] = os.cpu_count()
        out["load_avg_1m"] = os.getloadavg()[0]
        return out
    finally:
        if tmp is not None:
            tmp.cleanup()


def _hist_p50_us(hist_dict) -> float:
    if not hist_dict:
        return float("nan")
    from qlink.histogram import LatencyHistogram

    h = LatencyHistogram.from_dict(hist_dict)
    return h.percentiles([50])[0] / 1e3 if h.count else float("nan")


_DUR = None


def cudaq_decoder_timings(*, code: str = "repetition", distance: int = 5, rounds: int | None = None,
                          p: float = 0.01, num_shots: int = 200, seed: int = 1, timeout_s: float = 300.0) -> dict:
    """CUDA-Q's in-kernel decoder timings per call, from its ``[DecoderStats]`` log lines:
    ``map`` (measurements -> detectors through ``D_sparse``), ``decode``, ``corrections``
    (observable flips accumulated), and their sum: from the last ``enqueue_syndromes`` of a
    shot to its corrections being ready. p50/p99 in µs over ``num_shots`` calls."""
    import re
    import subprocess
    import sys

    global _DUR
    _DUR = _DUR or re.compile(r"Dur1:([0-9.]+)us Dur2:([0-9.]+)us Dur3:([0-9.]+)us")
    code_text = ("import sys; from qlink.qec.cudaq_realtime import *; "
                 f"lay = {'repetition' if code == 'repetition' else 'surface'}_layout(distance={int(distance)}, "
                 f"rounds={int(rounds or distance)}); "
                 f"run_cudaq_realtime(lay, p={float(p)!r}, num_shots={int(num_shots)}, seed={int(seed)})")
    env = dict(os.environ, CUDAQ_LOG_LEVEL="info")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code_text], env=env, capture_output=True, text=True,
                         timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"the CUDA-Q timing run failed: {out.stderr[-2000:]}")
    rows = np.array([[float(x) for x in m.groups()] for m in _DUR.finditer(out.stdout + out.stderr)])
    if rows.size == 0:
        raise RuntimeError("CUDA-Q printed no [DecoderStats] timings (is CUDAQ_LOG_LEVEL honoured by this build?)")
    res = {"calls": int(len(rows))}
    for name, col in (("map", rows[:, 0]), ("decode", rows[:, 1]), ("corrections", rows[:, 2]),
                      ("total", rows.sum(axis=1))):
        res[f"{name}_p50_us"] = float(np.percentile(col, 50))
        res[f"{name}_p99_us"] = float(np.percentile(col, 99))
    return res


def bench_rows(*, quick: bool = False, transports=("shm", "tcp"), engines=("python", "native"),
               say=None) -> list[dict]:
    """The rows of ``qlink bench cudaq``, one per (code, path): CUDA-Q's realtime simulation path
    (in-process) and qlink's service per transport and engine, on the same records, with the
    ratio of each qlink latency to CUDA-Q's own enqueue -> corrections time in the same run.
    Needs cudaq-qec; each row says what it measured."""
    shots = 300 if quick else 2000
    rows: list[dict] = []
    for code, d, p in (("repetition", 5, 0.01), ("surface", 5, 0.003)):
        r = compare_with_cudaq(code=code, distance=d, p=p, num_shots=shots, transports=transports, engines=engines,
                               say=say)
        ik = r.get("cudaq_in_kernel", {})
        ref = ik.get("total_p50_us")
        rows.append({"code": code, "d": d, "path": "CUDA-Q realtime (stim target, in-process)",
                     "shots": shots, "identical": r["identical"], "logical_errors": r["cudaq_logical_errors"],
                     "per_shot_us": r["cudaq_per_shot_us"],
                     "sim_floor_per_shot_us": r["cudaq_simulation_floor_per_shot_us"],
                     "decoding_added_per_shot_us": r["cudaq_decoding_added_per_shot_us"],
                     "decode_p50_us": ik.get("decode_p50_us"), "last_syndrome_to_corrections_p50_us": ref,
                     "last_syndrome_to_corrections_p99_us": ik.get("total_p99_us"),
                     "vs_cudaq_p50": 1.0 if ref else None,
                     "load_1m": r["load_avg_1m"], **({"note": ik["error"][:200]} if "error" in ik else {})})
        for key, t in r["transports"].items():
            rows.append({"code": code, "d": d, "path": f"qlink service, {t['engine']} engine, over {t['transport']}",
                         "shots": shots, "identical": t["identical"], "logical_errors": t["logical_errors"],
                         "per_shot_us": t["run_per_shot_us"], "decode_p50_us": t["decode_per_shot_p50_us"],
                         "last_syndrome_to_corrections_p50_us": t["reaction_p50_us"],
                         "last_syndrome_to_corrections_p99_us": t["reaction_p99_us"],
                         "vs_cudaq_p50": t["reaction_p50_us"] / ref if ref else None, "load_1m": r["load_avg_1m"]})
    return rows


COLUMNS = ["code", "d", "path", "shots", "identical", "logical_errors", "per_shot_us", "sim_floor_per_shot_us",
           "decoding_added_per_shot_us", "decode_p50_us", "last_syndrome_to_corrections_p50_us",
           "last_syndrome_to_corrections_p99_us", "vs_cudaq_p50", "load_1m", "note"]


def main_from_cli(args, *, say=print) -> list[dict]:
    """``qlink bench cudaq [--quick] [--transports shm,tcp] [--out DIR]``: the table, JSON and CSV."""
    from qlink.errors import missing

    from .report import format_table, write_results

    try:
        import cudaq_qec  # noqa: F401
    except ImportError as exc:
        raise missing("cudaq-qec-cu12", extra="quantum", feature="qlink bench cudaq") from exc
    quick = bool(getattr(args, "quick", False))
    given = getattr(args, "transports", None)
    transports = tuple(x.strip() for x in str(given).split(",") if x.strip()) if given else ("shm", "tcp")
    rows = bench_rows(quick=quick, transports=transports, say=say)
    out = Path(getattr(args, "out", "results/bench"))
    meta = {"quick": quick, "transports": list(transports),
            "peer": "CUDA-Q QEC realtime decoding (cudaq_qec, stim target) on the same records, same run",
            "cudaq_timing": "per_shot_us: one kernel launch looping over the shots, launch cost removed by a "
                            "shorter second launch; last_syndrome_to_corrections: its [DecoderStats] "
                            "map+decode+corrections per call",
            "qlink_timing": "last_syndrome_to_corrections: the controller's reaction time (last frame sent -> "
                            "correction applied), the transport both ways included; decode_p50: the service's "
                            "decode time per shot"}
    write_results(rows, out_dir=out, name="cudaq", meta=meta)
    print("\nCUDA-Q realtime decoding beside qlink's decoder service, the same measurement records and one "
          "multi_decoder_config (measured here; vs_cudaq_p50: qlink's last syndrome -> corrections p50 over "
          "CUDA-Q's in-kernel one)")
    print(format_table(rows, columns=[c for c in COLUMNS if any(r.get(c) is not None for r in rows)]))
    print(f"\nwritten: {out}/cudaq.{{json,csv}}")
    return rows
