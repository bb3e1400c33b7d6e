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
measures what measurement-level syndromes (``D_sparse``) cost qlink per shot beside
detection events, offline and through the service, on the same shots.

>>> # figures = compare_with_cudaq(code="repetition", distance=5, rounds=5, num_shots=500)
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["compare_with_cudaq", "serve_records", "measurement_overhead", "cudaq_decoder_timings", "bench_rows"]


def _layout(code: str, distance: int, rounds: int):
    from qlink.qec.cudaq_realtime import repetition_layout, surface_layout

    if code == "repetition":
        return repetition_layout(distance=distance, rounds=rounds)
    if code == "surface":
        return surface_layout(distance=distance, rounds=rounds)
    raise ValueError(f"code must be 'repetition' or 'surface', got {code!r}")


def serve_records(config_path, measurements: np.ndarray, true_flips: np.ndarray, round_of_measurement, *,
                  transport: str = "shm", decoder_id: int = 0, cycle_ns: int = 20_000, timeout_s: float = 120.0,
                  max_in_flight_shots: int | None = 1):
    """Play measurement records through a qlink decoder service started from ``config_path``
    (one frame per round; by default one shot in flight at a time, so the reaction time is a
    shot's own, not a backlog's); returns ``(ControllerResult, service report)``."""
    import transports

    from qlink.qec.controller import Controller, SyndromeStream
    from qlink.qec.cudaq_config import service_specs_from_cudaq
    from qlink.qec.loop import resolve_url
    from qlink.qec import start_service_process

    specs = service_specs_from_cudaq(config_path)
    stream = SyndromeStream(detectors=measurements, observables=true_flips, round_of_detector=round_of_measurement)
    with start_service_process(resolve_url(transport), specs, max_peers=1, timeout_s=timeout_s + 30) as proc:
        ep = transports.connect(proc.url, timeout_s=30)
        try:
            ctl = Controller(ep, stream, decoder_id=decoder_id, cycle_ns=cycle_ns, rounds_per_frame=1,
                             max_in_flight_shots=max_in_flight_shots)
            res = ctl.run(timeout_s=timeout_s)
        finally:
            ep.close()
        report = proc.report(timeout_s=60)
    return res, report


def _per_shot_s(run_fn, n_small: int, n_large: int) -> tuple[float, object]:
    """Per-shot seconds of a launch with the launch cost removed: two launches, the difference."""
    small = run_fn(n_small)
    large = run_fn(n_large)
    return max(large.wall_s - small.wall_s, 0.0) / (n_large - n_small), large


def compare_with_cudaq(*, code: str = "repetition", distance: int = 5, rounds: int | None = None, p: float = 0.01,
                       num_shots: int = 1000, transports=("shm", "tcp"), seed: int = 1, decoder_type: str = "pymatching",
                       cycle_ns: int = 20_000, config_path=None, decoder_timings: bool = True, say=None) -> dict:
    """Run CUDA-Q's realtime decoding and qlink's service on the same records; a dict of figures
    (with ``decoder_timings``, also CUDA-Q's in-kernel per-call timings: :func:`cudaq_decoder_timings`)."""
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
        for tr in transports:
            say(f"qlink service over {tr}: the same {num_shots} records, one frame per round")
            t0 = time.perf_counter()
            res, report = serve_records(config_path, run.measurements, flips, rounds_of, transport=tr,
                                        cycle_ns=cycle_ns)
            wall = time.perf_counter() - t0
            corr = np.unpackbits(res.corrections, axis=1, count=1, bitorder="little")
            answered = res.correct >= 0
            identical = bool(answered.all() and np.array_equal(corr, run.corrections))
            identical_all &= identical
            p50, p99 = res.reaction_percentiles_ns((50, 99))
            stages = report.get("stages", {})
            dps = stages.get("decode_per_shot", {})
            out["transports"][tr] = {
                "identical": identical, "mismatches": int((corr != run.corrections).any(axis=1).sum()),
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


def _time_per_shot(fn, shots: np.ndarray, batch: int, repeat: int = 3) -> float:
    """Best-of-``repeat`` µs per shot of ``fn`` called on consecutive slices of ``batch`` shots."""
    best = float("inf")
    n = (len(shots) // batch) * batch
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for i in range(0, n, batch):
            fn(shots[i:i + batch])
        best = min(best, (time.perf_counter_ns() - t0) / n / 1e3)
    return best


def measurement_overhead(*, distance: int = 5, p: float = 0.001, num_shots: int = 2000, batch_sizes=(1, 64),
                         transports=("shm",), seed: int = 1, cycle_ns: int = 20_000, say=None) -> dict:
    """What measurement-level syndromes cost qlink per shot beside detection events, on the same
    shots of a stim surface-code memory (d rounds): offline (``decode_shots_bit_packed`` of the
    measurement-level decoder vs the detector-level one, per batch size) and through the
    service (one whole-shot frame per shot, one shot in flight), with the corrections of the
    two paths compared shot by shot (``identical``)."""
    import stim

    from qlink.qec.cudaq_config import (compile_cudaq_entry, dump_multi_decoder_config,
                                        multi_decoder_config_from_circuit)

    say = say or (lambda msg: None)
    circuit = stim.Circuit.generated("surface_code:rotated_memory_z", distance=distance, rounds=distance,
                                     after_clifford_depolarization=p, after_reset_flip_probability=p,
                                     before_measure_flip_probability=p, before_round_data_depolarization=p)
    meas = circuit.compile_sampler(seed=seed).sample(num_shots)
    dets, obs = circuit.compile_m2d_converter().convert(measurements=meas, separate_observables=True)
    docs = {"measurements": multi_decoder_config_from_circuit(circuit),
            "detectors": multi_decoder_config_from_circuit(circuit, measurement_level=False)}
    inputs = {"measurements": meas.astype(np.uint8), "detectors": dets.astype(np.uint8)}
    out = {"distance": distance, "rounds": distance, "p": p, "num_shots": num_shots,
           "num_measurements": int(meas.shape[1]), "num_detectors": int(dets.shape[1]), "offline": {}, "service": {}}
    compiled = {k: compile_cudaq_entry(d["decoders"][0]) for k, d in docs.items()}
    packed = {k: np.packbits(v, axis=1, bitorder="little") for k, v in inputs.items()}
    preds = {k: compiled[k].decode_shots_bit_packed(packed[k]) for k in docs}
    out["identical_offline"] = bool(np.array_equal(preds["measurements"], preds["detectors"]))
    for b in batch_sizes:
        us = {k: _time_per_shot(compiled[k].decode_shots_bit_packed, packed[k], int(b)) for k in docs}
        out["offline"][f"batch_{b}"] = {"detectors_us_per_shot": us["detectors"],
                                        "measurements_us_per_shot": us["measurements"],
                                        "added_us_per_shot": us["measurements"] - us["detectors"]}
    identical = out["identical_offline"]
    with tempfile.TemporaryDirectory(prefix="qlink-msyn-") as tmp:
        for tr in transports:
            row = {}
            corr = {}
            for k, doc in docs.items():
                path = Path(tmp) / f"{k}.yaml"
                dump_multi_decoder_config(doc, path)
                say(f"measurement overhead: {k}-level syndromes over {tr}, {num_shots} shots")
                res, report = serve_records(path, inputs[k], obs.astype(np.uint8),
                                            np.zeros(inputs[k].shape[1], np.int64), transport=tr, cycle_ns=cycle_ns)
                corr[k] = res.corrections
                p50, p99 = res.reaction_percentiles_ns((50, 99))
                row[f"{k}_reaction_p50_us"] = p50 / 1e3
                row[f"{k}_reaction_p99_us"] = p99 / 1e3
                row[f"{k}_decode_per_shot_p50_us"] = _hist_p50_us(report.get("stages", {}).get("decode_per_shot", {}))
            row["added_reaction_p50_us"] = row["measurements_reaction_p50_us"] - row["detectors_reaction_p50_us"]
            row["added_decode_per_shot_p50_us"] = (row["measurements_decode_per_shot_p50_us"]
                                                   - row["detectors_decode_per_shot_p50_us"])
            row["identical"] = bool(np.array_equal(corr["measurements"], corr["detectors"]))
            identical &= row["identical"]
            out["service"][tr] = row
    out["identical"] = identical
    out["load_avg_1m"] = os.getloadavg()[0]
    out["cpu_count"] = os.cpu_count()
    return out


def bench_rows(*, quick: bool = False, transports=("shm", "tcp"), say=None) -> list[dict]:
    """The rows ``qlink bench qec`` prints for this comparison, one per (code, path): CUDA-Q's
    realtime simulation path and qlink's service per transport on the same records, then the
    measurement-level overhead at d = 5. Needs cudaq-qec; each row says what it measured."""
    shots = 300 if quick else 2000
    rows: list[dict] = []
    for code, d, p in (("repetition", 5, 0.01), ("surface", 5, 0.003)):
        r = compare_with_cudaq(code=code, distance=d, p=p, num_shots=shots, transports=transports, say=say)
        ik = r.get("cudaq_in_kernel", {})
        rows.append({"code": code, "distance": d, "path": "CUDA-Q realtime (stim sim, in-process)",
                     "shots": shots, "identical": r["identical"], "logical_errors": r["cudaq_logical_errors"],
                     "per_shot_us": r["cudaq_per_shot_us"], "sim_floor_per_shot_us": r["cudaq_simulation_floor_per_shot_us"],
                     "decode_p50_us": ik.get("decode_p50_us"), "last_syndrome_to_corrections_p50_us": ik.get("total_p50_us"),
                     "last_syndrome_to_corrections_p99_us": ik.get("total_p99_us")})
        for tr, t in r["transports"].items():
            rows.append({"code": code, "distance": d, "path": f"qlink service over {t['transport']}", "shots": shots,
                         "identical": t["identical"], "logical_errors": t["logical_errors"],
                         "per_shot_us": t["run_per_shot_us"], "decode_p50_us": t["decode_per_shot_p50_us"],
                         "last_syndrome_to_corrections_p50_us": t["reaction_p50_us"],
                         "last_syndrome_to_corrections_p99_us": t["reaction_p99_us"]})
    m = measurement_overhead(distance=5, num_shots=shots, transports=transports[:1], say=say)
    for b, o in m["offline"].items():
        rows.append({"code": "surface", "distance": 5, "path": f"D_sparse overhead offline, {b.replace('_', ' ')}",
                     "shots": shots, "identical": m["identical_offline"],
                     "per_shot_us": o["measurements_us_per_shot"], "added_per_shot_us": o["added_us_per_shot"]})
    for tr, o in m["service"].items():
        rows.append({"code": "surface", "distance": 5, "path": f"D_sparse overhead through the service ({tr})",
                     "shots": shots, "identical": o["identical"],
                     "decode_p50_us": o["measurements_decode_per_shot_p50_us"],
                     "added_per_shot_us": o["added_decode_per_shot_p50_us"],
                     "last_syndrome_to_corrections_p50_us": o["measurements_reaction_p50_us"]})
    return rows
