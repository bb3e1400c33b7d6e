"""``qlink bench qec``: the decoder service over the wire against the cycle and against offline decoding.

For each transport and code distance:

* **offline** — the decoder's ``decode_shots_bit_packed`` on all the flat-out run's
  shots at once (the peer every wire figure is a ratio to), in rounds per second;
* **over the wire, flat out** — on the same shots (``flat_rounds`` rounds' worth), the
  controller sends as fast as the decoder answers (``cycle_ns=1``),
  ``flat_shots_per_frame`` whole shots per frame and per answer, at most
  ``max_in_flight_frames`` frames unanswered: the decoder throughput the whole path
  sustains (the best of ``flat_repeats`` runs, as offline is the best of its repeats;
  the median beside it), and its ratio to offline (goal ≥ 80 %);
* **over the wire, at the cycle** — ``cycle_rounds`` rounds (10^6 by default: Willow
  decoded up to 10^6 cycles, arXiv:2408.13687) emitted one every ``cycle_ns`` (1.1 µs;
  909 k rounds/s needed), once with one shot per frame (columns ``*_1``: the latency
  configuration; answers carry several shots only while the decoder is behind) and
  once with ``shots_per_frame`` shots per frame (enough to span ``frame_period_ns``:
  the throughput configuration). Does the backlog (rounds emitted − rounds answered)
  stay flat (``backlog_flat``: the decoder side) with rounds answered at the cycle rate
  (``keeps_up``), and did the controller send 99 % of its frames within a frame interval
  of their tick (``clock_on_time``: its own jitter; see :class:`qlink.qec.loop.LoopResult`);
  the reaction time
  (the tick of a shot's last round → its correction applied) p50/p99/p99.9 (goal at
  d=5: p50 ≤ 63 µs, Willow's average), and its shares: ``batch`` (waiting for the
  frame's later shots), ``transport`` (the controller's send and the wire both ways),
  ``queue`` (waiting for a busy service, then for the decoder), ``decode``;
* **lock-step** — the controller waits for each shot's correction before the next
  (a feed-forward with a 63 µs deadline): the reaction time without any backlog,
  and how many shots miss the deadline;
* the CPU floor (:func:`qlink.bench.floor.cpu_availability`, once per run): two
  processes pinned one per core that only read the clock — the share of wall time they
  really ran (``cpu_floor_ran_share``) and how often per second one was held off longer
  than ``frame_period_ns`` (``cpu_floor_held_off_per_s``). On a VM whose vCPUs are
  shared this is well below 1 and bounds every figure of two busy-polling sides: a
  controller held off longer than a frame period more than 1 % of frames cannot keep
  its clock at p99 (``clock_on_time``) however fast the loop is;
* beside them, the bare 64-byte round trip of the same transport (the floor: p50 and
  p99), the controller's own ``get_corrections`` round trip in each run (its
  ``get_round_trip`` stage: ask sent → the answer that resolved the shots received,
  decoding and queueing included; ``get_rt_*``), the
  machine's 1-minute load average when the row started (``load_1m``) and, for the
  throughput run, the CPU time each busy-polling side got over its wall time
  (``cpu_service``, ``cpu_controller``: well below 1, it was descheduled — these
  figures are only as good as the two cores were free), the share of its wall time
  the service was busy rather than polling (``service_busy``) and an estimate of the
  CPU time that took per round decoded (``service_cpu_ns_per_round``: what it needs
  of its core per round, beside the ``cycle_ns`` the cycle gives it).

Before these rows, the command line runs the native real-time path's goal table
(:mod:`qlink.bench.qec_hot`) and, with the default selection (no ``--transports`` or
``--distances``), two side studies: CUDA-Q's measurement-level syndromes (``D_sparse``)
through the native service beside detection events (a goal row: at most 1 µs more per
shot, with the service core's map timed on its own; ``qec_dsparse``), and, in a full run
where cudaq-qec is installed, CUDA-Q's realtime decoding beside qlink's service on the same
records (``qec_cudaq``, as ``qlink bench cudaq`` runs it).

A service batches every shot that is complete when it has drained the transport into
one decoder call: that is what lets it keep up when shots arrive faster than one
decoder call per shot could go. Both processes busy-poll, each pinned to its own
core: on a 2-core machine the bench uses both.

>>> from qlink.bench.qec import BENCH_COLUMNS
>>> "wire_vs_offline" in BENCH_COLUMNS
True
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Callable, Iterable

import numpy as np

__all__ = ["run_qec_bench", "main_from_cli", "BENCH_COLUMNS", "console_rows"]

BENCH_COLUMNS = [
    "transport", "d", "circuit", "rounds", "load_1m", "floor_rt_p50_us", "floor_rt_p99_us", "cpu_floor_ran_share",
    "cpu_floor_held_off_per_s",
    # flat out vs offline, on the same shots
    "flat_shots", "flat_shots_per_frame", "offline_rounds_per_s", "wire_rounds_per_s", "wire_rounds_per_s_median",
    "wire_vs_offline",
    # at the cycle, several shots per frame (the throughput configuration)
    "cycle_rounds", "required_rounds_per_s", "shots_per_frame", "keeps_up", "backlog_flat", "clock_on_time",
    "cycle_rounds_per_s",
    "backlog_max_rounds", "backlog_growth_rounds", "late_frames", "emit_lag_p99_us",
    "reaction_p50_us", "reaction_p99_us", "reaction_p999_us", "get_rt_p50_us", "get_rt_p99_us",
    "share_batch", "share_transport", "share_queue", "share_decode", "share_other",
    "mean_decode_batch", "decode_per_shot_p50_us", "cpu_service", "cpu_controller", "service_busy",
    "service_cpu_ns_per_round",
    "ler",
    # at the cycle, one shot per frame (the latency configuration)
    "keeps_up_1", "backlog_flat_1", "cycle_rounds_per_s_1", "backlog_max_rounds_1", "late_frames_1",
    "reaction_p50_us_1", "reaction_p99_us_1", "reaction_p999_us_1", "get_rt_p50_us_1", "get_rt_p99_us_1",
    "share_transport_1", "share_queue_1", "share_decode_1",
    # lock-step: the controller waits for each shot's correction (feed-forward), no backlog
    "reaction_p50_us_ff", "reaction_p99_us_ff", "reaction_p999_us_ff", "get_rt_p50_us_ff", "get_rt_p99_us_ff",
    "deadline_misses_ff", "shots_ff",
    "note",
]


def _available(transport: str) -> str | None:
    if transport == "ucx" and importlib.util.find_spec("ucxx") is None:
        return "ucxx is not installed (pip install 'qlink[ucx]')"
    return None


def _mean_batch(service_report: dict) -> float:
    c = service_report.get("counts", {})
    calls = c.get("decode_calls", 0)
    return c.get("shots_decoded", 0) / calls if calls else math.nan


def _get_round_trip(res, suffix: str) -> dict:
    """The controller's get_corrections round trip (its ``get_round_trip`` stage), p50 and p99 in µs."""
    from qlink.qec.timeline import histogram_summary

    h = res.controller.stages.get("get_round_trip")
    summary = histogram_summary(h) if h else {"p50_us": math.nan, "p99_us": math.nan}
    return {f"get_rt_p50_us{suffix}": summary["p50_us"], f"get_rt_p99_us{suffix}": summary["p99_us"]}


def _cycle_figures(res, suffix: str) -> dict:
    return {
        **_get_round_trip(res, suffix),
        f"keeps_up{suffix}": res.keeps_up, f"backlog_flat{suffix}": res.backlog_flat,
        f"clock_on_time{suffix}": res.clock_on_time,
        f"backlog_max_rounds{suffix}": res.backlog_max_rounds,
        f"cycle_rounds_per_s{suffix}": res.decoded_rounds_per_s,
        f"late_frames{suffix}": res.late_frames, f"reaction_p50_us{suffix}": res.reaction_p50_ns / 1e3,
        f"reaction_p99_us{suffix}": res.reaction_p99_ns / 1e3, f"reaction_p999_us{suffix}": res.reaction_p999_ns / 1e3,
        f"share_batch{suffix}": res.shares.get("batch"), f"share_transport{suffix}": res.shares.get("transport"),
        f"share_queue{suffix}": res.shares.get("queue"), f"share_decode{suffix}": res.shares.get("decode"),
        f"share_other{suffix}": res.shares.get("other"),
        f"backlog_growth_rounds{suffix}": res.backlog_growth_rounds, f"emit_lag_p99_us{suffix}": res.emit_lag_p99_ns / 1e3,
        # CPU time each busy-polling side got over its wall time: well below 1, it was descheduled
        f"cpu_service{suffix}": _ratio(res.service.get("serve_cpu_s"), res.service.get("serve_wall_s")),
        f"cpu_controller{suffix}": _ratio(res.controller.cpu_ns, res.controller.duration_ns),
        # the share of its wall time the service was busy (not polling an empty transport),
        # and the CPU that busy time took per round decoded, estimated as busy time x its CPU
        # share (warm-up on both sides of the ratio): below cycle_ns it could keep up given
        # its core, whatever the load did
        f"service_busy{suffix}": _ratio(res.service.get("serve_busy_s"), res.service.get("serve_wall_s")),
        f"service_cpu_ns_per_round{suffix}": _ratio(
            1e9 * (res.service.get("serve_busy_s") or 0)
            * _ratio(res.service.get("serve_cpu_s"), res.service.get("serve_wall_s")),
            res.service.get("counts", {}).get("shots_decoded", 0) * res.num_rounds),
    }


def _ratio(a, b) -> float:
    return a / b if a is not None and b else math.nan


def run_qec_bench(*, transports: Iterable[str] = ("shm", "tcp", "ucx", "udp"), distances: Iterable[int] = (5, 7, 11, 17),
                  num_rounds: int | None = None, cycle_rounds: int = 1_000_000, flat_rounds: int = 1_000_000,
                  p: float = 0.001, cycle_ns: int = 1100, decoder: str = "pymatching",
                  flat_shots_per_frame: int = 1024, cycle_shots_per_frame: int | None = None, flat_repeats: int = 3,
                  frame_period_ns: int = 40_000, max_in_flight_frames: int = 4, floor_round_trips: int = 2000,
                  seed: int = 1, feed_forward_deadline_ns: int = 63_000, ff_shots: int = 2000,
                  keep_rows: int = 50_000, max_gets_in_flight_1: int = 2, get_window_shots_1: int = 64,
                  stim: str | None = None, progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per (transport, distance); see the module docstring for what each measures.

    ``num_rounds`` rounds per shot (default: the distance); at the cycle, shots run back
    to back for ``cycle_rounds`` rounds, so the decoder faces a continuous stream. Flat
    out, frames of ``flat_shots_per_frame`` shots carry ``flat_rounds`` rounds (enough
    that filling and draining the pipeline, or one time slice lost, does not weigh). At
    the cycle the throughput run sends
    ``cycle_shots_per_frame`` shots per frame (default: enough to span
    ``frame_period_ns``); the latency run one, its answers covering up to
    ``get_window_shots_1`` shots with at most ``max_gets_in_flight_1`` asks
    outstanding. ``keep_rows`` bounds the raw timestamps kept for the shares.

    ``stim``: a ``.stim`` circuit of one's own instead of the generated surface codes (one
    row per transport; ``distances``, ``num_rounds`` and ``p`` do not apply, ``d`` is
    empty and ``circuit`` names the file).
    """
    from qlink import wire
    from qlink.qec.decoders import compile_decoder, offline_throughput
    from qlink.qec.loop import build_source, run_loop, sample_stream, source_spec

    from .floor import cpu_availability

    say = progress or (lambda msg: None)
    transports = tuple(transports)
    # the floor under every cycle-keeping figure: what two busy processes, one per core,
    # get of their cores on this machine right now (a VM's shared vCPUs can give far less
    # than 1), and how often per second one is held off longer than a frame period
    avail = cpu_availability(duration_s=1.0, gap_ns=frame_period_ns)
    say(f"CPU floor: two pinned busy loops ran {avail['ran_share']:.0%} of wall time; held off > "
        f"{frame_period_ns / 1e3:.0f} us {avail['held_off_per_s']:.0f} times/s (longest {avail['longest_gap_us']:.0f} us)")
    floors: dict[str, tuple[float, float]] = {}  # transport -> bare round trip p50, p99 (ns)
    rows = []
    if stim is not None:
        from qlink.qec.specs import spec_and_source

        cases = [(None, *spec_and_source(stim))]
    else:
        cases = [(d, spec, build_source(spec)) for d in distances
                 for spec in [source_spec(distance=d, rounds=int(num_rounds or d), p=p)]]
    for case_i, (d, spec, src) in enumerate(cases):
        probe = sample_stream(src, num_shots=1, seed=seed)
        R, nd = probe.num_rounds, probe.num_detectors
        k_flat = max(1, min(flat_shots_per_frame, wire.MAX_SYNDROME_BITS // nd))
        flat_frames = max(4 * max_in_flight_frames, -(-int(flat_rounds) // (R * k_flat)))
        flat_stream = sample_stream(src, num_shots=k_flat * flat_frames, seed=seed + 1000 + (d or case_i))
        packed = np.packbits(flat_stream.detectors, axis=1, bitorder="little")
        offline = offline_throughput(compile_decoder(decoder, src.dem), packed, repeat=3) * R
        shots = -(-int(cycle_rounds) // R)
        stream = sample_stream(src, num_shots=shots, seed=seed + (d or case_i))
        k_cyc = cycle_shots_per_frame or max(1, -(-frame_period_ns // (R * cycle_ns)))
        k_cyc = max(1, min(k_cyc, wire.MAX_SYNDROME_BITS // nd, shots))
        keep = min(shots, keep_rows)
        say(f"{'d=' + str(d) if stim is None else stim}: {R} rounds/shot, {nd} detectors/shot, "
            f"offline {decoder} decode_batch {offline / 1e6:.2f} M rounds/s "
            f"(needed at a {cycle_ns} ns cycle: {1e9 / cycle_ns / 1e6:.2f} M); {shots} shots "
            f"({shots * R} rounds) at the cycle")
        for t in transports:
            row = {"transport": t, "d": d, **({} if stim is None else {"circuit": str(stim)}), "rounds": R,
                   "load_1m": os.getloadavg()[0],
                   "cpu_floor_ran_share": avail["ran_share"], "cpu_floor_held_off_per_s": avail["held_off_per_s"],
                   "flat_shots": flat_stream.num_shots, "flat_shots_per_frame": k_flat,
                   "offline_rounds_per_s": offline, "cycle_rounds": shots * R,
                   "required_rounds_per_s": 1e9 / cycle_ns, "shots_per_frame": k_cyc}
            why = _available(t)
            if why:
                row["note"] = f"skipped: {why}"
                rows.append(row)
                continue
            try:
                # whole shots per frame: no more than one message of this transport holds
                import transports as _transports

                max_msg = _transports.capabilities(t).max_message_bytes
                fit = max(1, (max_msg - wire.enqueue_syndromes_nbytes(0)) * 8 // nd)
                kf, kc = min(k_flat, fit), min(k_cyc, fit)
                row.update(flat_shots_per_frame=kf, shots_per_frame=kc)
                if t not in floors:
                    from .transport import round_trip_ns

                    rt = round_trip_ns(t, num_round_trips=floor_round_trips, warmup=200)
                    floors[t] = tuple(float(v) for v in np.percentile(rt, (50, 99)))
                row["floor_rt_p50_us"], row["floor_rt_p99_us"] = (v / 1e3 for v in floors[t])
                # the Python engine on every transport (the native rows: qec_hot, above this table)
                common = dict(transport=t, source=spec, decoder=decoder, rounds_per_frame=0, timeout_s=600,
                              pin_cpus=True, engine="python")
                # best of flat_repeats, as the offline figure is the best of its repeats
                flats = [run_loop(cycle_ns=1, shots_per_frame=kf, warmup_shots=2 * kf, stream=flat_stream,
                                  num_shots=flat_stream.num_shots, max_in_flight_shots=max_in_flight_frames * kf,
                                  keep_samples=0, capacity_shots=max(1024, 2 * max_in_flight_frames * kf),
                                  **common) for _ in range(max(1, flat_repeats))]
                flat = max(flats, key=lambda x: x.decoded_rounds_per_s)
                row["wire_rounds_per_s"] = flat.decoded_rounds_per_s
                row["wire_rounds_per_s_median"] = float(np.median([x.decoded_rounds_per_s for x in flats]))
                row["wire_vs_offline"] = flat.decoded_rounds_per_s / offline
                cyc = run_loop(cycle_ns=cycle_ns, shots_per_frame=kc, warmup_shots=max(200, 2 * kc),
                               stream=stream, num_shots=shots, keep_samples=keep, capacity_shots=max(1024, shots),
                               **common)
                row.update(_cycle_figures(cyc, ""))
                row.update({
                    "decode_per_shot_p50_us": cyc.service_stage_summary().get("decode_per_shot", {}).get("p50_us"),
                    "mean_decode_batch": _mean_batch(cyc.service), "ler": cyc.logical_error_rate,
                    "transport_used": cyc.transport,
                })
                frames_per_s = 1e9 / (cycle_ns * R * kc)
                if not cyc.clock_on_time and avail["held_off_per_s"] > 0.005 * frames_per_s:
                    row["note"] = (f"the controller's p99 tick lag ({cyc.emit_lag_p99_ns / 1e3:.0f} us) is bounded by the "
                                   f"CPU floor: held off > {frame_period_ns / 1e3:.0f} us {avail['held_off_per_s']:.0f} "
                                   f"times/s against {frames_per_s:.0f} frames/s")
                starved = min(row["cpu_service"], row["cpu_controller"])
                if starved < 0.9:  # (NaN compares False: no figure, no note)
                    starved_note = (f"descheduled: a busy-polling side ran {starved:.0%} of its wall time at the cycle "
                                    f"(the CPU floor: {avail['ran_share']:.0%}; other load on the cores, or shared vCPUs)")
                    row["note"] = f"{row['note']}; {starved_note}" if row.get("note") else starved_note
                lat = run_loop(cycle_ns=cycle_ns, shots_per_frame=1, warmup_shots=200, stream=stream,
                               num_shots=shots, keep_samples=keep, capacity_shots=max(1024, shots),
                               controller_options={"max_gets_in_flight": max_gets_in_flight_1,
                                                   "get_window_shots": get_window_shots_1}, **common)
                row.update({k: v for k, v in _cycle_figures(lat, "_1").items() if k in BENCH_COLUMNS})
                n_ff = min(shots, ff_shots)
                ff = run_loop(cycle_ns=cycle_ns, shots_per_frame=1, warmup_shots=50, keep_samples=0,
                              feed_forward_deadline_ns=feed_forward_deadline_ns, stream=stream, num_shots=n_ff,
                              **common)
                row.update({"reaction_p50_us_ff": ff.reaction_p50_ns / 1e3,
                            "reaction_p99_us_ff": ff.reaction_p99_ns / 1e3,
                            "reaction_p999_us_ff": ff.reaction_p999_ns / 1e3,
                            "deadline_misses_ff": ff.deadline_misses, "shots_ff": n_ff, **_get_round_trip(ff, "_ff")})
                say(f"  {t}: flat out {row['wire_rounds_per_s'] / 1e6:.2f} M rounds/s "
                    f"({100 * row['wire_vs_offline']:.0f} % of offline); at the cycle, {kc} shots/frame keeps up "
                    f"{cyc.keeps_up} (reaction p50 {row['reaction_p50_us']:.1f} us, p99 {row['reaction_p99_us']:.1f} us), "
                    f"1 shot/frame {lat.keeps_up}; lock-step p50 {row['reaction_p50_us_ff']:.1f} us, "
                    f"p99 {row['reaction_p99_us_ff']:.1f} us (load {row['load_1m']:.1f})")
            except Exception as e:  # one transport failing must not hide the others' figures
                row["note"] = f"error: {type(e).__name__}: {e}"
                say(f"  {t}: error {type(e).__name__}: {e}")
            rows.append(row)
    return rows


def console_rows(rows: list[dict]) -> list[dict]:
    """The few columns of :data:`BENCH_COLUMNS` the console shows (the CSV keeps them all).

    >>> console_rows([{"transport": "shm", "d": 5, "wire_rounds_per_s": 2.0e6, "wire_vs_offline": 0.24,
    ...                "keeps_up": False}])[0]["M rounds/s"]
    2.0
    """
    def get(r, k, scale=1.0):
        v = r.get(k)
        return None if v is None else round(float(v) * scale, 3)

    return [{"transport": r.get("transport"), "d": r.get("d"), "M rounds/s": get(r, "wire_rounds_per_s", 1e-6),
             "x offline": get(r, "wire_vs_offline"), "keeps up": r.get("keeps_up"), "p50": get(r, "reaction_p50_us"),
             "p99": get(r, "reaction_p99_us"), "lock p50": get(r, "reaction_p50_us_ff"),
             "lock p99": get(r, "reaction_p99_us_ff")} for r in rows]


def main_from_cli(args, *, say: Callable[[str], None] = print) -> list[dict]:
    """``qlink bench qec [--quick] [--out DIR]``: run, print a table, write JSON/CSV."""
    from pathlib import Path

    from .report import format_goals, format_table, wrap, write_results

    from .qec_hot import run_hot_bench

    quick = bool(getattr(args, "quick", False))
    out = Path(getattr(args, "out", "results/bench"))
    stim = getattr(args, "stim", None)
    if stim:
        return _stim_from_cli(args, stim, quick=quick, out=out, say=say)
    # the real-time path first: native, over shm, each figure beside its floor
    hot_kw = dict(distances=(5, 7), cycle_rounds=100_000, lockstep_shots=3000, floor_round_trips=5000,
                  flat_rounds=600_000, udp_rounds=100_000, long_lengths=(10_000, 100_000)) if quick else {}
    given = getattr(args, "distances", None)
    if given:
        hot_kw["distances"] = tuple(int(x) for x in str(given).replace(" ", ",").split(",") if x.strip())
    named = getattr(args, "transports", None)
    if named:  # the native rows of the transports named (shm's also carry the long experiment)
        names = tuple(x.strip() for x in str(named).replace(" ", ",").split(",") if x.strip())
        hot_kw.update(transports=tuple(t for t in names if t in ("shm", "tcp", "ucx")), udp="udp" in names)
        if "shm" not in names:
            hot_kw["long_lengths"] = ()
    hot = run_hot_bench(progress=say, trace_path=getattr(args, "trace", None), **hot_kw)
    failed_native = [r for r in hot["rows"] if r.get("error")]
    # the side studies (D_sparse, CUDA-Q) run with the default selection: a run that names its
    # transports or distances asks for those rows only
    whole = not getattr(args, "transports", None) and not given
    ds_rows, ds_goal = _measurement_level(quick=quick, say=say) if whole else ([], [])
    hot["goals"] += ds_goal
    if ds_rows:
        write_results(ds_rows, out_dir=out, name="qec_dsparse", meta={"quick": quick})
    write_results(hot["rows"], out_dir=out, name="qec_native", meta={"quick": quick})
    write_results(hot["goals"], out_dir=out, name="qec_goals", meta={"quick": quick})
    print("\nReal-time path (native, shm / tcp / ucx / udp, one frame per round): goals, each figure from this run (µs)")
    print(format_goals(hot["goals"], value="figure_us", target="target_us", note="floor"))
    print(wrap(f"written under {out}/: qec_native (every figure), qec_goals (.json, .csv)"))
    if getattr(args, "native_only", False):
        return hot["rows"]
    for r in failed_native:
        print(wrap(f"  native {r['transport']} d={r.get('d')}: {r['error']}", indent="    "))
    cq = _cudaq_side_by_side(quick=quick, out=out, say=say) if whole and not quick else []
    kw = dict(distances=(5, 7), cycle_rounds=100_000, flat_rounds=300_000, floor_round_trips=1000,
              ff_shots=1000) if quick else {}
    for name, conv in (("distances", int), ("transports", str)):
        given = getattr(args, name, None)
        if given:
            try:
                kw[name] = tuple(conv(x.strip()) for x in str(given).split(",") if x.strip())
            except ValueError:
                raise SystemExit(f"qlink bench qec: --{name} takes a comma-separated list, got {given!r}") from None
    rows = run_qec_bench(progress=say, **kw)
    write_results(rows, out_dir=out, name="qec", meta={"quick": quick, **{k: list(v) if isinstance(v, tuple) else v
                                                                          for k, v in kw.items()}})
    print("\nQEC decoder service over the wire vs the 1.1 us cycle and offline decode_batch (measured here)")
    print(format_table(console_rows(rows), max_width=100))
    print("M rounds/s: flat out (x offline: of offline decode_batch on the same shots); keeps up, p50, p99:\n"
          "at the cycle, reaction time (µs); lock p50, lock p99: lock-step reaction time (µs)")
    for r in rows:
        if r.get("note"):
            print(wrap(f"  note ({r.get('transport')}, d={r.get('d')}): {r['note']}", indent="    "))
    print(wrap(f"\nwritten: {out}/qec.{{json,csv}} (all {len(BENCH_COLUMNS)} columns)"))
    if cq:
        from .cudaq_peer import COLUMNS as CQ_COLUMNS

        print("\nCUDA-Q realtime decoding (in-process, stim target) beside qlink's service on the same records and "
              "one multi_decoder_config (vs_cudaq_p50: qlink's last syndrome -> corrections p50 over CUDA-Q's)")
        cols = [c for c in ("code", "path", "identical", "decode_p50_us", "last_syndrome_to_corrections_p50_us",
                            "vs_cudaq_p50") if c in CQ_COLUMNS]
        print(format_table(cq, columns=cols, max_width=100))
        print(wrap(f"written: {out}/qec_cudaq.{{json,csv}}"))
    return rows + failed_native


def _measurement_level(*, quick: bool, say) -> tuple[list[dict], list[dict]]:
    """CUDA-Q's measurement-level syndromes (``D_sparse``) through the native service beside
    detection events, d = 5, one shot per frame and in flight (:mod:`qlink.bench.dsparse`,
    best of alternating rounds): its rows and its goal row (at most 1 µs more per shot)."""
    from .dsparse import measurement_overhead, overhead_rows

    try:
        res = measurement_overhead(distance=5, num_shots=1000 if quick else 4000, batch_sizes=(1,),
                                   engines=("native",), repeats=3, service_shots=1000 if quick else 2000,
                                   service_rounds=5 if quick else 9, say=say)
    except ImportError as e:  # (no cudaq-qec config support here: the goal row says so)
        return [], [{"goal": "D_sparse (measurement-level) syndromes cost <= 1 us more per shot than detector-level, "
                             "d=5, native service", "figure_us": float("nan"), "target_us": 1.0, "met": False,
                     "floor": f"not measured: {e}"}]
    rows = overhead_rows(res)
    svc = [r for r in rows if "decode per shot p50" in r["path"] and "added_us" in r]
    if not svc:
        return rows, []
    r = svc[0]
    nm = res.get("native_map", {})
    alone = nm.get("ns_per_shot", float("nan")) / 1e3
    return rows, [{"goal": "D_sparse (measurement-level) syndromes cost <= 1 us more per shot than detector-level, "
                           "d=5, native service decode per shot p50 (median of paired rounds)",
                   "figure_us": r["added_us"], "target_us": 1.0,
                   "met": bool(r["added_us"] <= 1.0 and alone <= 1.0 and res["identical"]),
                   "floor": f"{r['measurements_us']:.2f} vs {r['detectors_us']:.2f} us a shot; the map alone "
                            f"{alone * 1e3:.0f} ns a shot; corrections {'identical' if res['identical'] else 'DIFFER'}"}]


def _cudaq_side_by_side(*, quick: bool, out, say) -> list[dict]:
    """``qlink bench cudaq``'s rows (CUDA-Q's realtime path beside qlink's service on the same
    records) where cudaq-qec is installed, written as ``qec_cudaq``; [] where it is not."""
    import importlib.util

    if importlib.util.find_spec("cudaq_qec") is None:
        say("CUDA-Q realtime comparison skipped: cudaq-qec is not installed (pip install 'qlink[quantum]')")
        return []
    from .cudaq_peer import bench_rows
    from .report import write_results

    rows = bench_rows(quick=quick, transports=("shm", "tcp"), engines=("native",), say=say)
    write_results(rows, out_dir=out, name="qec_cudaq", meta={"quick": quick})
    return rows


def _stim_from_cli(args, stim: str, *, quick: bool, out, say) -> list[dict]:
    """``qlink bench qec --stim FILE``: the per-transport table for a circuit of one's own."""
    from .report import format_table, write_results

    kw = dict(cycle_rounds=100_000, flat_rounds=300_000, floor_round_trips=1000, ff_shots=1000) if quick else {}
    given = getattr(args, "transports", None)
    if given:
        kw["transports"] = tuple(x.strip() for x in str(given).split(",") if x.strip())
    rows = run_qec_bench(progress=say, stim=stim, **kw)
    write_results(rows, out_dir=out, name="qec_stim", meta={"quick": quick, "circuit": stim,
                                                            **{k: list(v) if isinstance(v, tuple) else v
                                                               for k, v in kw.items()}})
    print(f"\nQEC decoder service over the wire for {stim} vs the 1.1 us cycle and offline decode_batch "
          "(measured here)")
    print(format_table(rows, columns=[c for c in BENCH_COLUMNS if any(r.get(c) is not None for r in rows)]))
    print(f"\nwritten: {out}/qec_stim.{{json,csv}}")
    return rows
