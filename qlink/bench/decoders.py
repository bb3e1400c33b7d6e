"""``qlink bench decoders``: every registered decoder against PyMatching on the same shots.

For a rotated surface-code memory (uniform circuit noise ``p``, ``rounds = distance``)
one batch of shots is sampled once, and each decoder that runs here decodes all of
it in one ``decode_shots_bit_packed`` call: logical errors with their Wilson
interval, µs per shot, and both as ratios to PyMatching on the very same shots
(the peer measured in the same run). Chromobius decodes colour codes only, so it
gets its own rows on the distance-3 colour-code memory, beside PyMatching on the
same colour-code shots.

A second table (:mod:`qlink.bench.dsparse`) gives what measurement-level syndromes
(CUDA-Q's ``D_sparse``) add per shot at d = 5, offline and through the service, as the
ratio to detector-level decoding of the same shots in the same run.

>>> rows = run_decoder_bench(distances=(3,), p=0.005, num_shots=200, decoders=("pymatching", "fusion-blossom"))
>>> [r["decoder"] for r in rows], rows[0]["ler_vs_pymatching"]
(['pymatching', 'fusion-blossom'], 1.0)
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

__all__ = ["run_decoder_bench", "main_from_cli"]

# slow decoders get fewer shots (a fraction of num_shots), so a bench run stays minutes long
_SLOW = {"tesseract": 0.2, "cudaq-multi_error_lut": 0.5, "bposd": 0.1}


def _surface(distance: int, p: float):
    import stim

    return stim.Circuit.generated("surface_code:rotated_memory_z", distance=distance, rounds=distance,
                                  after_clifford_depolarization=p, after_reset_flip_probability=p,
                                  before_measure_flip_probability=p, before_round_data_depolarization=p)


def _decode_row(name: str, dem, packed: np.ndarray, obs: np.ndarray, *, code: str, distance: int, p: float,
                reference: dict | None) -> dict:
    from qlink.qec.controller import wilson_interval
    from qlink.qec.decoders import compile_decoder

    compiled = compile_decoder(name, dem)
    compiled.decode_shots_bit_packed(packed[:8])  # warm
    t0 = time.perf_counter()
    pred = compiled.decode_shots_bit_packed(packed)
    dt = time.perf_counter() - t0
    bits = np.unpackbits(pred, axis=1, count=obs.shape[1], bitorder="little")
    errors = int((bits != obs).any(axis=1).sum())
    n = len(packed)
    lo, hi = wilson_interval(errors, n)
    row = {"code": code, "distance": distance, "p": p, "decoder": name, "shots": n, "errors": errors,
           "ler": errors / n, "ler_lo": lo, "ler_hi": hi, "us_per_shot": dt * 1e6 / n}
    if reference is not None:
        ref_bits = reference["bits"][:n]
        ref_errors = int((ref_bits != obs).any(axis=1).sum())
        row["pymatching_errors"] = ref_errors
        row["ler_vs_pymatching"] = errors / ref_errors if ref_errors else float("nan")
        row["time_vs_pymatching"] = row["us_per_shot"] / reference["us_per_shot"]
        row["agree_with_pymatching_pct"] = 100.0 * float((ref_bits == bits).all(axis=1).mean())
    row["_bits"] = bits
    return row


def run_decoder_bench(*, distances=(5,), p: float = 0.005, num_shots: int = 5000, decoders=None, seed: int = 1,
                      say: Callable[[str], None] | None = None) -> list[dict]:
    """One row per (code, decoder): LER with its 95 % Wilson interval, µs per shot, and the
    ratios to PyMatching on the same shots. ``decoders``: names (default: every registered
    one that runs here)."""
    from qlink.qec.decoders import BUILT_IN_DECODERS
    from qlink.qec.decoders import steane_color_code_circuit

    say = say or (lambda msg: None)
    names = list(decoders) if decoders is not None else sorted(BUILT_IN_DECODERS)
    names = [n for n in names if BUILT_IN_DECODERS[n].unavailable_reason() is None]
    if "pymatching" in names:
        names.remove("pymatching")
    rows: list[dict] = []
    cases = [("surface", d, _surface(d, p)) for d in distances]
    if "chromobius" in names:
        cases.append(("colour", 3, steane_color_code_circuit(rounds=3, p=p)))
    for code, d, circuit in cases:
        dets, obs = circuit.compile_detector_sampler(seed=seed).sample(num_shots, separate_observables=True)
        packed = np.packbits(dets, axis=1, bitorder="little")
        obs = obs.astype(np.uint8)
        try:
            dem = circuit.detector_error_model(decompose_errors=True)
        except ValueError:  # colour codes: matching needs a decomposition stim may not find
            dem = None
        ref = None
        if dem is not None:
            say(f"decoders: {code} d={d} p={p}: pymatching, {num_shots} shots")
            ref_row = _decode_row("pymatching", dem, packed, obs, code=code, distance=d, p=p, reference=None)
            ref = {"bits": ref_row["_bits"], "us_per_shot": ref_row["us_per_shot"]}
            ref_row.update(pymatching_errors=ref_row["errors"], ler_vs_pymatching=1.0, time_vs_pymatching=1.0,
                           agree_with_pymatching_pct=100.0)
            rows.append(ref_row)
        for name in names:
            if (name == "chromobius") != (code == "colour"):
                continue
            n = max(50, int(num_shots * _SLOW.get(name, 1.0)))
            say(f"decoders: {code} d={d} p={p}: {name}, {n} shots")
            use_dem = circuit.detector_error_model() if name == "chromobius" else dem
            if use_dem is None:
                continue
            try:
                rows.append(_decode_row(name, use_dem, packed[:n], obs[:n], code=code, distance=d, p=p,
                                        reference=ref))
            except Exception as exc:  # one decoder failing leaves the others' rows
                rows.append({"code": code, "distance": d, "p": p, "decoder": name, "error": f"{type(exc).__name__}: {exc}"})
    for r in rows:
        r.pop("_bits", None)
    return rows


def main_from_cli(args, *, say: Callable[[str], None] = print) -> list[dict]:
    """``qlink bench decoders [--quick] [--distances 5,7] [--out DIR]``: the table, JSON and CSV."""
    from pathlib import Path

    from .report import format_table, write_results

    quick = bool(getattr(args, "quick", False))
    dist = getattr(args, "distances", None)
    distances = tuple(int(x) for x in dist.split(",")) if dist else ((5,) if quick else (5, 7))
    shots = 1000 if quick else 10000
    rows = run_decoder_bench(distances=distances, p=0.005, num_shots=shots, say=say)
    out = Path(getattr(args, "out", "results/bench"))
    meta = {"num_shots": shots, "distances": list(distances), "p": 0.005, "host": os.uname().nodename,
            "cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "peer": "pymatching on the same shots, same run"}
    write_results(rows, out_dir=out, name="decoders", meta=meta)
    cols = ["code", "distance", "decoder", "shots", "errors", "ler", "ler_lo", "ler_hi", "us_per_shot",
            "ler_vs_pymatching", "time_vs_pymatching", "agree_with_pymatching_pct"]
    print(f"\nDecoders on the same shots (p={meta['p']}, load {meta['load_avg_1m']:.2f} on {meta['cores']} cores); "
          "LER with its 95 % Wilson interval")
    print(format_table(rows, columns=cols + (["error"] if any("error" in r for r in rows) else [])))
    print(f"\nwritten: {out}/decoders.{{json,csv}}")
    rows += _dsparse_table(out=out, quick=quick, say=say)
    return rows


def _dsparse_table(*, out, quick: bool, say) -> list[dict]:
    """The measurement-level (D_sparse) overhead at d = 5: its table, JSON and CSV."""
    from .report import format_table, write_results
    from .dsparse import measurement_overhead, overhead_rows

    res = measurement_overhead(distance=5, num_shots=1000 if quick else 4096, repeats=5 if quick else 10, say=say)
    rows = overhead_rows(res)
    meta = {k: res[k] for k in ("distance", "rounds", "p", "num_shots", "num_measurements", "num_detectors",
                                "transport", "identical", "load_avg_1m", "cpu_count")}
    meta["peer"] = "detector-level decoding of the same shots (PyMatching), same run"
    write_results(rows, out_dir=out, name="decoders_dsparse", meta=meta)
    print(f"\nMeasurement-level syndromes (D_sparse: {res['num_measurements']} measurements -> {res['num_detectors']} "
          f"detectors, surface code d={res['distance']}, p={res['p']}) beside detection events on the same shots "
          f"(load {res['load_avg_1m']:.2f} on {res['cpu_count']} cores; goal: added <= 1 us per shot)")
    cols = ["path", "detectors_us", "measurements_us", "added_us", "ratio", "mapping_us", "reaction_det_p50_us",
            "reaction_meas_p50_us", "identical", "goal_added_le_1us", "note"]
    print(format_table(rows, columns=[c for c in cols if any(r.get(c) is not None for r in rows)]))
    print(f"\nwritten: {out}/decoders_dsparse.{{json,csv}}")
    return rows
