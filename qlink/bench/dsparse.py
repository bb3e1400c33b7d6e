"""What measurement-level syndromes (CUDA-Q's ``D_sparse``) cost qlink per shot beside detection events.

CUDA-Q's realtime ``enqueue_syndromes`` carries raw measurements; qlink maps them to
detectors (:class:`~qlink.qec.decoders.MeasurementDecoder`) before decoding. On the same
shots of a stim surface-code memory (``distance`` rounds), two decoders compiled from
two ``multi_decoder_config`` documents of the same circuit, one measurement-level
(``D_sparse`` the circuit's detectors) and one detector-level, are timed against each
other in the same run:

* **offline**: ``decode_shots_bit_packed`` in calls of ``b`` shots (1: a service answering
  one shot at a time; 64; all), every call timed on its own, the two decoders called in
  turn on the same shots; the median call per shot (the best repeat where a call is the
  whole batch), the added µs (the median of the paired differences) and the ratio, and
  the mapping alone (``detectors_bit_packed``);
* **through the service** (per engine, one whole-shot frame per shot, one shot in
  flight): the service's decode time per shot (p50) and the reaction time (p50), and
  the same differences;
* ``identical``: the two paths' corrections are equal shot by shot.

>>> res = measurement_overhead(distance=3, num_shots=200, batch_sizes=(1, 64), engines=(), repeats=1)
>>> res["identical"], sorted(res["offline"])
(True, ['batch_1', 'batch_64'])
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["measurement_overhead", "overhead_rows"]


def _surface(distance: int, p: float):
    import stim

    return stim.Circuit.generated("surface_code:rotated_memory_z", distance=distance, rounds=distance,
                                  after_clifford_depolarization=p, after_reset_flip_probability=p,
                                  before_measure_flip_probability=p, before_round_data_depolarization=p)


def _interleaved_us_per_shot(fns: dict, inputs: dict, batch: int, repeats: int) -> dict:
    """µs per shot of each ``fns[k]`` over ``inputs[k]`` in calls of ``batch`` shots: every call
    timed on its own, the functions called in turn on the same slice (each sees the same host),
    ``repeats`` passes; the median call over the batch. A call is microseconds, so a busy host's
    time slices (milliseconds) interrupt few of them and the median is the call's own cost, where a
    mean over a loop would take in every preemption. ``"<k>_minus_<first>"``: the median of the
    per-call differences to the first function (paired on the same slice)."""
    keys = list(fns)
    n = (min(len(v) for v in inputs.values()) // batch) * batch
    calls = n // batch
    t = {k: np.empty(calls * max(1, repeats), np.int64) for k in keys}
    clock = time.perf_counter_ns
    j = 0
    for _ in range(max(1, repeats)):
        for i in range(0, n, batch):
            for k in keys:
                fn, x = fns[k], inputs[k][i:i + batch]
                t0 = clock()
                fn(x)
                t[k][j] = clock() - t0
            j += 1
    # a call of milliseconds (a whole batch) is preempted as often as not: its best repeat instead
    stat = np.median if calls >= 8 else np.min
    out = {k: float(stat(v)) / batch / 1e3 for k, v in t.items()}
    for k in keys[1:]:
        out[f"{k}_minus_{keys[0]}"] = (float(np.median(t[k] - t[keys[0]])) / batch / 1e3 if calls >= 8
                                       else out[k] - out[keys[0]])
    return out


def _hist_p50_us(hist_dict) -> float:
    if not hist_dict or not hist_dict.get("count"):
        return float("nan")
    from qlink.histogram import LatencyHistogram

    return LatencyHistogram.from_dict(hist_dict).percentiles([50])[0] / 1e3


def _native_map(decoder, records: np.ndarray, want: np.ndarray, *, repeats: int) -> dict:
    """The native service's measurement -> detector map on its own (``_hotcore.map_records``, the
    code a measurement-level shot goes through in the service core) over every record: ns per
    shot, the best of ``repeats`` passes, and whether it gave the detectors stim's converter did."""
    from qlink.qec.hotpath import available

    why = available()
    dmap = decoder.byte_table() if hasattr(decoder, "byte_table") else None
    if why is not None or dmap is None:
        return {"note": f"skipped: {why or 'the map is an index matrix here, not a table'}"}
    from qlink.qec import _hotcore

    table, nd = dmap
    recs = np.ascontiguousarray(records, dtype=np.uint8)
    got = np.zeros((len(recs), table.shape[1]), np.uint64)
    best = min(_hotcore.map_records(table, int(nd), recs, got) for _ in range(int(repeats)))
    same = bool(np.array_equal(got.view(np.uint8)[:, :want.shape[1]], want))
    return {"ns_per_shot": best / len(recs), "shots": len(recs), "identical": same}


def measurement_overhead(*, distance: int = 5, p: float = 0.001, num_shots: int = 4096, batch_sizes=(1, 64, None),
                         engines=("python", "native"), transport: str = "shm", seed: int = 1, cycle_ns: int = 20_000,
                         repeats: int = 7, service_shots: int = 2000, service_rounds: int = 3, say=None) -> dict:
    """Measurement-level vs detector-level decoding of the same shots (see the module docstring).
    ``batch_sizes``: shots per offline call (None: all of them); ``engines``: the service's
    engines to run through (``native`` where it is built), on the first ``service_shots`` shots,
    ``service_rounds`` times each, the two levels in turn (a fresh service every round): each
    level's decode p50 is the median over its rounds, the added cost the median of the rounds'
    paired differences (a busy moment of the host falls on one round, not on the figure), the
    reaction p50/p99 the lowest of the rounds. With ``native``, the service core's map alone
    (``native_map``: ns per shot over every shot, and whether it matches stim's detectors)."""
    from qlink.qec.cudaq_config import compile_cudaq_entry, dump_multi_decoder_config, multi_decoder_config_from_circuit

    from .cudaq_peer import serve_records

    say = say or (lambda msg: None)
    circuit = _surface(distance, p)
    meas = circuit.compile_sampler(seed=seed).sample(num_shots)
    dets, obs = circuit.compile_m2d_converter().convert(measurements=meas, separate_observables=True)
    docs = {"measurements": multi_decoder_config_from_circuit(circuit),
            "detectors": multi_decoder_config_from_circuit(circuit, measurement_level=False)}
    inputs = {"measurements": meas.astype(np.uint8), "detectors": dets.astype(np.uint8)}
    out = {"distance": distance, "rounds": distance, "p": p, "num_shots": num_shots, "transport": transport,
           "num_measurements": int(meas.shape[1]), "num_detectors": int(dets.shape[1]), "offline": {},
           "service": {}}
    compiled = {k: compile_cudaq_entry(d["decoders"][0]) for k, d in docs.items()}
    packed = {k: np.packbits(v, axis=1, bitorder="little") for k, v in inputs.items()}
    preds = {k: compiled[k].decode_shots_bit_packed(packed[k]) for k in docs}
    single = {k: np.concatenate([compiled[k].decode_shots_bit_packed(packed[k][i:i + 1]) for i in range(num_shots)])
              for k in docs}
    out["identical_offline"] = bool(np.array_equal(preds["measurements"], preds["detectors"])
                                    and np.array_equal(single["measurements"], preds["detectors"])
                                    and np.array_equal(single["detectors"], preds["detectors"]))
    fns = {"detectors": compiled["detectors"].decode_shots_bit_packed,
           "measurements": compiled["measurements"].decode_shots_bit_packed,
           "mapping": compiled["measurements"].detectors_bit_packed}
    timed_inputs = {"detectors": packed["detectors"], "measurements": packed["measurements"],
                    "mapping": packed["measurements"]}
    for b in batch_sizes:
        b = int(b or num_shots)
        say(f"D_sparse overhead offline: calls of {b} shot(s), {repeats} interleaved repeats")
        us = _interleaved_us_per_shot(fns, timed_inputs, b, repeats)
        out["offline"][f"batch_{b}"] = {"batch": b, "detectors_us_per_shot": us["detectors"],
                                        "measurements_us_per_shot": us["measurements"],
                                        "mapping_us_per_shot": us["mapping"],
                                        "added_us_per_shot": us["measurements_minus_detectors"],
                                        "ratio": us["measurements"] / us["detectors"]}
    identical = out["identical_offline"]
    with tempfile.TemporaryDirectory(prefix="qlink-msyn-") as tmp:
        paths = {}
        for k, doc in docs.items():
            paths[k] = Path(tmp) / f"{k}.yaml"
            dump_multi_decoder_config(doc, paths[k])
        ns = min(num_shots, int(service_shots))
        out["service_shots"] = ns
        for engine in engines:
            if engine == "native":
                from qlink.qec.hotpath import available

                why = available()
                if why is not None:
                    out["service"][engine] = {"note": f"skipped: {why}"}
                    continue
            row, corr, same = {}, {}, True
            per_round: dict[str, list] = {"detectors": [], "measurements": []}
            rounds = max(1, int(service_rounds))
            for r in range(rounds):  # the two in turn, each round a fresh service: the best round of each
                for k in ("detectors", "measurements"):
                    say(f"D_sparse overhead through the {engine} service over {transport}: {k}, {ns} shots, "
                        f"round {r + 1}/{rounds}")
                    res, report = serve_records(paths[k], inputs[k][:ns], obs[:ns].astype(np.uint8),
                                                np.zeros(inputs[k].shape[1], np.int64), transport=transport,
                                                cycle_ns=cycle_ns, engine=engine)
                    if k in corr:
                        same &= bool(np.array_equal(corr[k], res.corrections))
                    corr[k] = res.corrections
                    p50, p99 = res.reaction_percentiles_ns((50, 99))
                    dec = _hist_p50_us(report.get("stages", {}).get("decode_per_shot"))
                    per_round[k].append(dec)
                    for name, v in (("reaction_p50_us", p50 / 1e3), ("reaction_p99_us", p99 / 1e3)):
                        key = f"{k}_{name}"
                        row[key] = min(row.get(key, math.inf), v)
            row["rounds"] = rounds
            for k, v in per_round.items():  # each level's decode p50: the median over its rounds
                row[f"{k}_decode_per_shot_p50_us"] = float(np.median(v))
            row["added_reaction_p50_us"] = row["measurements_reaction_p50_us"] - row["detectors_reaction_p50_us"]
            # the added cost: the median over rounds of each round's difference (the two levels ran
            # back to back in every round, so a slow stretch of the host falls on both)
            row["added_decode_per_shot_p50_us"] = float(np.median(np.subtract(per_round["measurements"],
                                                                              per_round["detectors"])))
            row["decode_per_shot_p50_us_rounds"] = {k: [round(x, 3) for x in v] for k, v in per_round.items()}
            row["decode_ratio"] = row["measurements_decode_per_shot_p50_us"] / row["detectors_decode_per_shot_p50_us"]
            row["identical"] = bool(same and np.array_equal(corr["measurements"], corr["detectors"])
                                    and np.array_equal(corr["detectors"], preds["detectors"][:ns]))
            identical &= row["identical"]
            out["service"][engine] = row
    if "native" in engines:
        out["native_map"] = _native_map(compiled["measurements"], packed["measurements"], packed["detectors"],
                                        repeats=max(3, repeats))
        identical &= out["native_map"].get("identical", True)
    out["identical"] = identical
    out["load_avg_1m"] = os.getloadavg()[0]
    out["cpu_count"] = os.cpu_count()
    return out


def overhead_rows(res: dict) -> list[dict]:
    """The table rows of a :func:`measurement_overhead` result: one per offline batch size and
    one per service engine, each with the added µs per shot and the ratio to detector level."""
    d = res["distance"]
    rows = []
    for o in res["offline"].values():
        rows.append({"d": d, "path": f"offline, calls of {o['batch']} shot(s)",
                     "detectors_us": o["detectors_us_per_shot"],
                     "measurements_us": o["measurements_us_per_shot"], "added_us": o["added_us_per_shot"],
                     "ratio": o["ratio"], "mapping_us": o["mapping_us_per_shot"],
                     "identical": res["identical_offline"], "goal_added_le_1us": o["added_us_per_shot"] <= 1.0})
    nm = res.get("native_map")
    if nm is not None and "ns_per_shot" in nm:
        rows.append({"d": d, "path": "native service core's map alone (measurements -> detectors, per shot)",
                     "added_us": nm["ns_per_shot"] / 1e3, "identical": nm["identical"],
                     "goal_added_le_1us": nm["ns_per_shot"] <= 1000.0})
    for engine, s in res["service"].items():
        if "note" in s:
            rows.append({"d": d, "path": f"{engine} service ({res['transport']})", "note": s["note"]})
            continue
        rows.append({"d": d, "path": f"{engine} service ({res['transport']}), decode per shot p50",
                     "detectors_us": s["detectors_decode_per_shot_p50_us"],
                     "measurements_us": s["measurements_decode_per_shot_p50_us"],
                     "added_us": s["added_decode_per_shot_p50_us"], "ratio": s["decode_ratio"],
                     "reaction_det_p50_us": s["detectors_reaction_p50_us"],
                     "reaction_meas_p50_us": s["measurements_reaction_p50_us"], "identical": s["identical"],
                     "goal_added_le_1us": s["added_decode_per_shot_p50_us"] <= 1.0})
    return rows
