"""``qlink bench qec``: the decoder service over the wire against the cycle and against offline decoding.

For each transport and code distance, on the same sampled shots:

* **offline** — the decoder's ``decode_shots_bit_packed`` on all shots at once (the
  peer every wire figure is a ratio to), in rounds per second;
* **over the wire, flat out** — the controller sends as fast as the decoder answers
  (``cycle_ns=1``), many whole shots per frame and per answer: the decoder
  throughput the whole path sustains, and its ratio to offline (goal ≥ 80 %);
* **over the wire, at the cycle** — rounds emitted every ``cycle_ns`` (1.1 µs,
  Willow, arXiv:2408.13687; 1/1.1 µs = 909 k rounds/s needed), once with one shot
  per frame (columns ``*_1``: the latency configuration) and once with several
  shots per frame (the throughput configuration): does the backlog stay flat
  (``keeps_up``), the reaction time p50/p99/p99.9 (goal at d=5: p50 ≤ 63 µs,
  Willow's average), and the shares of transport / queue / decode in it;
* **lock-step** — the controller waits for each shot's correction before the next
  (a feed-forward with a 63 µs deadline): the reaction time without any backlog,
  and how many shots miss the deadline;
* beside them, the bare 64-byte round trip of the same transport (the floor).

A service batches every shot that is complete when it has drained the transport into
one decoder call: that is what lets it keep up when shots arrive faster than one
decoder call per shot could go. Both processes busy-poll: on a 2-core machine the
bench uses both cores.

>>> from qlink.bench.qec import BENCH_COLUMNS
>>> "wire_vs_offline" in BENCH_COLUMNS
True
"""

from __future__ import annotations

import importlib.util
import math
import time
from typing import Callable, Iterable

import numpy as np

__all__ = ["run_qec_bench", "main_from_cli", "offline_rounds_per_s", "BENCH_COLUMNS"]

BENCH_COLUMNS = [
    "transport", "d", "rounds", "shots", "floor_rt_p50_us", "offline_rounds_per_s", "flat_shots_per_frame",
    "wire_rounds_per_s", "wire_vs_offline", "required_rounds_per_s",
    # at the cycle, one shot per frame (the latency configuration)
    "keeps_up_1", "reaction_p50_us_1", "reaction_p99_us_1", "reaction_p999_us_1", "share_transport_1",
    "share_queue_1", "share_decode_1", "late_frames_1", "backlog_max_rounds_1",
    # at the cycle, several shots per frame (the throughput configuration)
    # lock-step: the controller waits for each shot's correction (feed-forward), no backlog
    "reaction_p50_us_ff", "reaction_p99_us_ff", "reaction_p999_us_ff", "deadline_misses_ff",
    "shots_per_frame", "keeps_up", "backlog_max_rounds", "backlog_growth_rounds", "emit_lag_p99_us",
    "late_frames",
    "reaction_p50_us", "reaction_p99_us", "share_transport", "share_queue", "share_decode",
    "decode_per_shot_p50_us", "mean_decode_batch", "ler", "note",
]


def _available(transport: str) -> str | None:
    if transport == "ucx" and importlib.util.find_spec("ucxx") is None:
        return "ucxx is not installed (pip install 'qlink[ucx]')"
    return None


def offline_rounds_per_s(compiled, packed: np.ndarray, *, num_rounds: int, repeat: int = 3) -> float:
    """Rounds per second of one ``decode_shots_bit_packed`` call over all shots (best of ``repeat``)."""
    best = math.inf
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter_ns()
        compiled.decode_shots_bit_packed(bit_packed_detection_event_data=packed)
        best = min(best, time.perf_counter_ns() - t0)
    return packed.shape[0] * num_rounds / (best / 1e9)


def _mean_batch(service_report: dict) -> float:
    c = service_report.get("counts", {})
    calls = c.get("decode_calls", 0)
    return c.get("shots_decoded", 0) / calls if calls else math.nan


def _cycle_figures(res, suffix: str) -> dict:
    return {
        f"keeps_up{suffix}": res.keeps_up, f"backlog_max_rounds{suffix}": res.backlog_max_rounds,
        f"late_frames{suffix}": res.late_frames, f"reaction_p50_us{suffix}": res.reaction_p50_ns / 1e3,
        f"reaction_p99_us{suffix}": res.reaction_p99_ns / 1e3, f"reaction_p999_us{suffix}": res.reaction_p999_ns / 1e3,
        f"share_transport{suffix}": res.shares.get("transport"), f"share_queue{suffix}": res.shares.get("queue"),
        f"share_decode{suffix}": res.shares.get("decode"),
    }


def run_qec_bench(*, transports: Iterable[str] = ("shm", "tcp", "ucx"), distances: Iterable[int] = (5, 7, 11, 17),
                  num_rounds: int | None = None, num_shots: int | None = None, emission_ms: float = 50.0,
                  p: float = 0.001, cycle_ns: int = 1100,
                  decoder: str = "pymatching", flat_shots_per_frame: int = 256,
                  cycle_shots_per_frame: int | None = None, frame_period_ns: int = 40_000,
                  max_in_flight_frames: int = 4, floor_round_trips: int = 2000, seed: int = 1,
                  feed_forward_deadline_ns: int = 63_000, ff_shots: int = 1000,
                  progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per (transport, distance); see the module docstring for what each measures.

    ``num_rounds`` rounds per shot (default: the distance); shots run back to back,
    so the decoder faces a continuous stream of rounds at the cycle time;
    ``num_shots`` (default: enough for ``emission_ms`` of rounds at the cycle). Flat out,
    ``flat_shots_per_frame`` shots share a frame (and an answer); at the cycle, the
    latency run sends one shot per frame and the throughput run
    ``cycle_shots_per_frame`` (default: enough shots to span ``frame_period_ns``).
    """
    from qlink.qec.decoders import compile_decoder
    from qlink.qec.loop import build_source, run_loop, sample_stream, source_spec
    from qlink import wire

    say = progress or (lambda msg: None)
    transports = tuple(transports)
    floors: dict[str, float] = {}
    rows = []
    for d in distances:
        r = int(num_rounds or d)
        spec = source_spec(distance=d, rounds=r, p=p)
        src = build_source(spec)
        shots = int(num_shots or -(-int(emission_ms * 1e6) // ((r + 1) * cycle_ns)))
        stream = sample_stream(src, num_shots=shots, seed=seed + d)
        R = stream.num_rounds
        nd = stream.num_detectors
        packed = np.packbits(stream.detectors, axis=1, bitorder="little")
        offline = offline_rounds_per_s(compile_decoder(decoder, src.dem), packed, num_rounds=R)
        k_flat = max(1, min(flat_shots_per_frame, wire.MAX_SYNDROME_BITS // nd, shots))
        k_cyc = cycle_shots_per_frame or max(1, -(-frame_period_ns // (R * cycle_ns)))
        k_cyc = max(1, min(k_cyc, wire.MAX_SYNDROME_BITS // nd, shots))
        say(f"d={d}: {R} rounds/shot, offline {decoder} decode_batch {offline / 1e6:.2f} M rounds/s "
            f"(needed at a {cycle_ns} ns cycle: {1e9 / cycle_ns / 1e6:.2f} M)")
        for t in transports:
            row = {"transport": t, "d": d, "rounds": R, "shots": shots, "offline_rounds_per_s": offline,
                   "required_rounds_per_s": 1e9 / cycle_ns, "flat_shots_per_frame": k_flat,
                   "shots_per_frame": k_cyc}
            why = _available(t)
            if why:
                row["note"] = f"skipped: {why}"
                rows.append(row)
                continue
            try:
                if t not in floors:
                    from .transport import round_trip_ns

                    floors[t] = float(np.percentile(round_trip_ns(t, num_round_trips=floor_round_trips,
                                                                  warmup=200), 50))
                row["floor_rt_p50_us"] = floors[t] / 1e3
                common = dict(transport=t, source=spec, stream=stream, num_shots=shots, decoder=decoder,
                              rounds_per_frame=0, timeout_s=300, pin_cpus=True)
                flat = run_loop(cycle_ns=1, shots_per_frame=k_flat, warmup_shots=2 * k_flat,
                                max_in_flight_shots=max_in_flight_frames * k_flat, keep_samples=0,
                                capacity_shots=max(1024, 2 * max_in_flight_frames * k_flat), **common)
                row["wire_rounds_per_s"] = flat.decoded_rounds_per_s
                row["wire_vs_offline"] = flat.decoded_rounds_per_s / offline
                lat = run_loop(cycle_ns=cycle_ns, shots_per_frame=1, warmup_shots=200, keep_samples=shots,
                               capacity_shots=max(1024, shots), **common)
                row.update(_cycle_figures(lat, "_1"))
                ff = run_loop(cycle_ns=cycle_ns, shots_per_frame=1, warmup_shots=50, keep_samples=0,
                              feed_forward_deadline_ns=feed_forward_deadline_ns,
                              **{**common, "num_shots": min(shots, ff_shots)})
                row.update({"reaction_p50_us_ff": ff.reaction_p50_ns / 1e3,
                            "reaction_p99_us_ff": ff.reaction_p99_ns / 1e3,
                            "reaction_p999_us_ff": ff.reaction_p999_ns / 1e3,
                            "deadline_misses_ff": ff.deadline_misses})
                cyc = run_loop(cycle_ns=cycle_ns, shots_per_frame=k_cyc, warmup_shots=max(200, 2 * k_cyc),
                               keep_samples=shots, capacity_shots=max(1024, shots), **common)
                row.update(_cycle_figures(cyc, ""))
                row.update({
                    "backlog_growth_rounds": cyc.backlog_growth_rounds, "emit_lag_p99_us": cyc.emit_lag_p99_ns / 1e3,
                    "backlog_slope_rounds_per_s": cyc.backlog_slope_rounds_per_s,
                    "decode_per_shot_p50_us": cyc.service_stage_summary().get("decode_per_shot", {}).get("p50_us"),
                    "mean_decode_batch": _mean_batch(cyc.service), "ler": cyc.logical_error_rate,
                    "transport_used": cyc.transport,
                })
                say(f"  {t}: flat out {row['wire_rounds_per_s'] / 1e3:.0f} k rounds/s "
                    f"({100 * row['wire_vs_offline']:.0f} % of offline, {k_flat} shots/frame); at the cycle: "
                    f"1 shot/frame keeps up {lat.keeps_up}, reaction p50 {row['reaction_p50_us_1']:.1f} us "
                    f"p99 {row['reaction_p99_us_1']:.1f} us; lock-step p50 {row['reaction_p50_us_ff']:.1f} us "
                    f"p99 {row['reaction_p99_us_ff']:.1f} us; {k_cyc} shots/frame keeps up {cyc.keeps_up}, "
                    f"reaction p50 {row['reaction_p50_us']:.1f} us")
            except Exception as e:  # one transport failing must not hide the others' figures
                row["note"] = f"error: {type(e).__name__}: {e}"
                say(f"  {t}: error {type(e).__name__}: {e}")
            rows.append(row)
    return rows


def main_from_cli(args, *, say: Callable[[str], None] = print) -> list[dict]:
    """``qlink bench qec [--quick] [--out DIR]``: run, print a table, write JSON/CSV."""
    from pathlib import Path

    from ._report import format_table, write_results

    quick = bool(getattr(args, "quick", False))
    kw = dict(distances=(5, 7), emission_ms=20.0, floor_round_trips=1000) if quick else {}
    rows = run_qec_bench(progress=say, **kw)
    out = Path(getattr(args, "out", "results/bench"))
    write_results(rows, out_dir=out, name="qec", meta={"quick": quick, **{k: list(v) if isinstance(v, tuple) else v
                                                                          for k, v in kw.items()}})
    print("\nQEC decoder service over the wire vs the 1.1 us cycle and offline decode_batch (measured here)")
    print(format_table(rows, columns=[c for c in BENCH_COLUMNS if any(c in r for r in rows)]))
    print(f"\nwritten: {out}/qec.{{json,csv}}")
    return rows
