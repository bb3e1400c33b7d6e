"""The real-time figures of ``qlink bench qec``: the native per-frame path over shm, tcp and
ucx (where UCXX is installed) against its floors, measured in one run.

Rows (each with the floor it is held to, measured beside it):

* **wire floor** — the bare round trip of a 64-byte message over the same link the native
  path uses (shm: the rings through the ring C API; tcp: the socket in qlink's framing,
  written at once; ucx: the connection's tagged messages through UCP's own calls), two processes, one per core, warm, the best of 3 rounds of
  ``floor_round_trips``: p50 and p99.
* **single-shot decode** — the decoder's fastest call on one shot, as the service makes
  it (PyMatching: its matching graph on the fired detectors' indices), timed per call in
  this process over the run's shots (p50, p99), beside the amortized figure of one
  ``decode_shots_bit_packed`` call over all of them divided by their number (labelled
  as such: that is not what a lock-step reaction pays).
* **lock-step reaction** (d = ``distances[0]``, over each transport): each round its own frame on the 1.1 µs
  clock, ``get_corrections`` after the last, the next shot only after the correction
  is applied: p50, p99, p99.9, and its stages, with the wire (the floor's p50) split
  from qlink's own software time.
* **the floor under the lock-step tail** (:func:`lockstep_host_floor`): as many bare round
  trips as the lock-step run has shots, paced like its shots and each answer held as long as
  one of the decoder's own single-shot calls (timed above), each timed from when it was due
  -- the wire, the decoder's spread and the host's preemption, with no qlink software; its
  p99 stands beside the lock-step p99 goal.
* **at the cycle**, one frame per round, shots back to back: keeps up (flat backlog and
  ≥ 99 % of the cycle rate), the rate, reaction p50/p99 — for each distance over shm, and
  at the first distance over tcp and ucx.
* **flat out** (shm, the first two distances): one frame per shot at a 1 ns cycle, rounds
  answered per second beside the offline peer at its best on the same shots
  (:func:`offline_rounds_per_s`), in 5 interleaved pairs: best ÷ best (goal ≥ 95 %), and
  the median of the pairs' ratios; the service decodes its backlog in calls of up to 4096
  shots, the offline peer's batch size, and takes its frames in on a thread of its own (a
  pipelined run, ``service_ingest_cpu``); the single-threaded service's ratio beside it.
* **udp** (:mod:`qlink.bench._qec_long`) — the kernel floor (a raw ``sendmmsg`` →
  ``recvmmsg`` pair in C on loopback, datagrams per second), then the native path over udp:
  one round per datagram at 1.2 × the floor's period, and at the cycle with the fewest
  rounds per datagram the floor allows (each shot's get in its last frame's datagram).
* **long experiment** — 10^4 and 10^6 rounds at the first distance, one round per frame at
  the cycle, sliding windows with commit: final round → final correction p50 at each length.
* the CPU floor of the run (two pinned busy loops: the share of wall time they ran) and
  the load average before and after.

The goal table (:data:`GOALS`) compares each figure with its target; the full rows go to
JSON/CSV.

>>> sorted(GOALS)[:2]
['cycle_keeps_up', 'cycle_p50_le_10us']
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from typing import Callable, Iterable

import numpy as np

__all__ = ["run_hot_bench", "link_floor_ns", "lockstep_host_floor", "single_shot_decode_ns", "offline_rounds_per_s", "GOALS", "goal_rows", "write_trace"]

GOALS = {
    "lockstep_p50_le_3us": "lock-step reaction p50 at d=5 over shm <= 3 us",
    "lockstep_p50_le_floor_sum": "lock-step p50 <= bare round trip p50 + single-shot decode p50 + 1 us",
    "lockstep_p99_le_15us": "lock-step reaction p99 <= 15 us",
    "cycle_keeps_up": "one frame per round at 1.1 us keeps up (flat backlog, >= 99 % of the cycle rate)",
    "cycle_p50_le_10us": "at the cycle, reaction p50 <= 10 us (d=5)",
    "cycle_p99_le_100us": "at the cycle, reaction p99 <= 100 us (d=5)",
    "flat_ge_95pct_offline": "flat-out wire throughput >= 95 % of offline decode_batch",
    "udp_floor": "udp kernel floor: sendmmsg (paced, batches <= 32) -> recvmmsg on loopback, datagrams/s",
    "udp_rpf1_keeps_up": "udp, one round per datagram, keeps up at a cycle of 1.2 x the floor's period",
    "udp_cycle_keeps_up": "udp at the 1.1 us cycle keeps up with the fewest rounds per datagram the floor allows",
    "long_flat": "long experiment d=5, sliding windows: final-round -> final-correction p50 within 20 % "
                 "between the shortest and longest",
}


def _echo_child(url: str, n: int, hold_ns=0) -> None:
    import transports
    from qlink.procs import die_with_parent, pin_to_cpu

    from qlink.qec.hotpath import link_round_trip_ns

    die_with_parent()
    pin_to_cpu(1)
    ep = transports.connect(url, timeout_s=30)
    try:
        link_round_trip_ns(ep, num_round_trips=n, echo=True, hold_ns=hold_ns)
    finally:
        ep.close()


def link_floor_ns(scheme: str = "shm", *, num_round_trips: int = 20000, rounds: int = 3,
                  nbytes: int = 64, hold_ns: int = 0, pause_ns: int = 0) -> np.ndarray:
    """The bare round trip over the native link of ``scheme`` (``shm``, ``tcp``, ``ucx``), two
    processes pinned one per core, warm; the round of the lowest p50 of ``rounds``.

    With ``hold_ns`` and ``pause_ns`` (see :func:`qlink.qec.hotpath.link_round_trip_ns`)
    the round trips take the lock-step loop's shape (the answer held as long as a decoder
    call, a pause as long as a shot's rounds between them): the host's floor under a
    lock-step reaction's tail (:func:`lockstep_host_floor`)."""
    import transports
    from qlink.procs import pinned

    from qlink.qec.hotpath import link_round_trip_ns

    warm = 2000
    url = f"shm://qlink-floor-{os.getpid()}-{time.monotonic_ns()}" if scheme == "shm" else f"{scheme}://127.0.0.1:0"
    lis = transports.listen(url)
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_echo_child, args=(lis.url, warm + rounds * num_round_trips, hold_ns), daemon=True)
    child.start()
    try:
        ep = lis.accept(timeout_s=60)
        try:
            with pinned(0):
                link_round_trip_ns(ep, num_round_trips=warm, nbytes=nbytes)
                best = None
                for _ in range(rounds):
                    rt = link_round_trip_ns(ep, num_round_trips=num_round_trips, nbytes=nbytes, pause_ns=pause_ns)
                    if best is None or np.median(rt) < np.median(best):
                        best = rt
        finally:
            ep.close()
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
        lis.close()
    return best


def single_shot_decode_ns(decoder: str, dem, detectors: np.ndarray, *, repeats: int = 3) -> dict:
    """Per-call time of the decoder's single-shot call (as the native service makes it), and
    the amortized time per shot of one batch call over the same shots."""
    from qlink.qec.decoders import compile_decoder
    from qlink.qec.hotpath import single_shot_decoder

    one = single_shot_decoder(decoder, dem)
    clock = time.perf_counter_ns
    if one.kind == "fired":
        args = [np.flatnonzero(r).astype(np.uint64) for r in detectors]
        fn = one.fn
    else:
        args = [np.packbits(r, bitorder="little").reshape(1, -1) for r in detectors]
        f = one.fn

        def fn(row):
            return f(bit_packed_detection_event_data=row)
    best = None
    for _ in range(repeats):
        t = np.empty(len(args), np.int64)
        for i, a in enumerate(args):
            t0 = clock()
            fn(a)
            t[i] = clock() - t0
        if best is None or np.median(t) < np.median(best):
            best = t
    # the timer's own cost, subtracted: two back-to-back clock reads
    tc = np.empty(2000, np.int64)
    for i in range(len(tc)):
        t0 = clock()
        tc[i] = clock() - t0
    timer = float(np.median(tc))
    packed = np.packbits(detectors, axis=1, bitorder="little")
    compiled = compile_decoder(decoder, dem)
    batch = math.inf
    for _ in range(repeats):
        t0 = clock()
        compiled.decode_shots_bit_packed(bit_packed_detection_event_data=packed)
        batch = min(batch, clock() - t0)
    return {"single_p50_ns": float(np.median(best)) - timer, "single_p99_ns": float(np.percentile(best, 99)) - timer,
            "batch_per_shot_ns": batch / len(detectors), "single_call": one.label,
            "single_ns": np.maximum(best - int(timer), 0)}


def _wire_split(res, floor_p50_ns: float) -> dict:
    st = res.stage_breakdown.get("stages", {})
    if not st:
        return {}
    p50 = {k: v["p50_us"] * 1e3 for k, v in st.items()}
    # the wire both ways: what the bare round trip costs; the rest of send/wire_in/wire_out
    # (stamping, the ring call, the spin that sees the frame) is qlink's software
    transport = p50["send"] + p50["wire_in"] + p50["wire_out"]
    software = transport - floor_p50_ns + p50["queue"] + p50["respond"] + p50["apply"]
    return {"stage_wire_us": floor_p50_ns / 1e3, "stage_software_us": software / 1e3,
            "stage_decode_us": p50["decode"] / 1e3,
            **{f"stage_{k}_us": v / 1e3 for k, v in p50.items() if k in ("send", "wire_in", "queue", "decode",
                                                                        "respond", "wire_out", "apply")}}


def _transport_rows(t: str, distances: tuple, *, decode: dict, load0: float, avail: dict, p: float, decoder: str,
                    cycle_ns: int, seed: int, lockstep_shots: int, cycle_rounds: int, floor_round_trips: int,
                    flat_rounds: int, trace_path, say) -> list[dict]:
    """The rows of one transport: its bare round trip, then each distance (shm) or the first."""
    d0 = distances[0]
    rows = []
    rt = link_floor_ns(t, num_round_trips=floor_round_trips)
    floor = {"p50_ns": float(np.median(rt)), "p99_ns": float(np.percentile(rt, 99))}
    say(f"bare {t} round trip (native link, 64 B): p50 {floor['p50_ns'] / 1e3:.2f} us, "
        f"p99 {floor['p99_ns'] / 1e3:.2f} us")
    for d in (distances if t == "shm" else distances[:1]):
        dec = decode[d]
        row = {"row": f"{t} d={d}", "transport": t, "d": d, "rounds": d, "host_load_1m_before": load0,
               "cpu_floor_ran_share": avail["ran_share"], "cpu_floor_held_off_per_s": avail["held_off_per_s"],
               "cpu_floor_gap_us": avail["gap_us"], "cpu_floor_longest_gap_us": avail["longest_gap_us"], "floor_rt_p50_us": floor["p50_ns"] / 1e3,
               "floor_rt_p99_us": floor["p99_ns"] / 1e3, "decode_single_p50_us": dec["single_p50_ns"] / 1e3,
               "decode_single_p99_us": dec["single_p99_ns"] / 1e3,
               "decode_batch_amortized_us": dec["batch_per_shot_ns"] / 1e3, "decode_single_call": dec["single_call"]}
        row.update(_measure(t, d, p=p, decoder=decoder, cycle_ns=cycle_ns, seed=seed, floor=floor,
                            hold_ns=dec["single_ns"],
                            lockstep_shots=lockstep_shots if d == d0 else 0, cycle_rounds=cycle_rounds,
                            trace_path=trace_path if d == d0 else None, say=say))
        if t == "shm" and d in distances[:2]:
            row.update(_flat_out(t, d, p=p, decoder=decoder, seed=seed, flat_rounds=flat_rounds, say=say))
        rows.append(row)
    return rows


def _native_transports() -> tuple[str, ...]:
    """shm and tcp, and ucx where UCXX is installed."""
    import importlib.util

    return ("shm", "tcp") + (("ucx",) if importlib.util.find_spec("ucxx") is not None else ())


def run_hot_bench(*, distances: Iterable[int] = (5, 7, 9), transports: Iterable[str] | None = None,
                  p: float = 0.001, cycle_ns: int = 1100, lockstep_shots: int = 20000, cycle_rounds: int = 1_000_000,
                  floor_round_trips: int = 20000, flat_rounds: int = 1_500_000, decoder: str = "pymatching",
                  seed: int = 1, trace_path=None, progress: Callable[[str], None] | None = None, udp: bool = True,
                  udp_rounds: int = 300_000, udp_floor_datagrams: int = 200_000,
                  long_lengths: Iterable[int] = (10_000, 1_000_000), long_max_total_rounds: int = 3_000_000) -> dict:
    """Measure the rows of the module docstring; returns ``{"rows": [...], "goals": [...]}``.

    One row per (transport, distance): every distance over shm, the first over the others
    (tcp, and ucx where UCXX is installed, unless ``transports`` names them)."""
    from qlink.qec.hotpath import available
    from qlink.qec.loop import build_source, sample_stream, source_spec

    from .floor import cpu_availability

    say = progress or (lambda msg: None)
    why = available()
    if why is not None:
        return {"rows": [{"row": "native path", "note": f"skipped: {why}"}], "goals": []}
    distances = tuple(int(d) for d in distances)
    transports = _native_transports() if transports is None else tuple(transports)
    load0 = os.getloadavg()[0]
    avail = cpu_availability(duration_s=1.0, gap_ns=40_000)
    say(f"CPU floor: two pinned busy loops ran {avail['ran_share']:.0%} of wall time (load {load0:.2f})")
    decode = {}
    for d in distances:
        src = build_source(source_spec(distance=d, p=p))
        probe = sample_stream(src, num_shots=5000, seed=seed + 100 + d)
        decode[d] = single_shot_decode_ns(decoder, src.dem, probe.detectors)
        say(f"d={d}: single-shot {decode[d]['single_call']}: p50 {decode[d]['single_p50_ns'] / 1e3:.2f} us "
            f"(batch call, amortized per shot: {decode[d]['batch_per_shot_ns'] / 1e3:.2f} us)")
    rows = []
    d0 = distances[0]
    for t in transports:
        try:
            rows += _transport_rows(t, distances, decode=decode, load0=load0, avail=avail, p=p, decoder=decoder,
                                    cycle_ns=cycle_ns, seed=seed, lockstep_shots=lockstep_shots,
                                    cycle_rounds=cycle_rounds, floor_round_trips=floor_round_trips,
                                    flat_rounds=flat_rounds, trace_path=trace_path if t == transports[0] else None,
                                    say=say)
        except Exception as e:  # one link that fails (a UCX without transports) is listed, not fatal
            if t == "shm":
                raise
            rows.append({"row": f"{t} d={distances[0]}", "transport": t, "d": distances[0],
                         "error": f"{type(e).__name__}: {e}"})
            say(f"  {t}: the native rows failed: {type(e).__name__}: {e}")
    if udp:
        from ._qec_long import udp_floor, udp_rows

        fl = udp_floor(num_datagrams=udp_floor_datagrams)
        say(f"udp kernel floor (sendmmsg -> recvmmsg, loopback, pinned): {fl['floor_datagrams_per_s'] / 1e3:.0f} k "
            f"datagrams/s ({fl['floor_period_ns']:.0f} ns per datagram)")
        row = {"row": f"udp d={d0}", "transport": "udp", "d": d0, "host_load_1m_before": load0,
               "cpu_floor_ran_share": avail["ran_share"], "udp_floor_runs": fl["floor_runs"]}
        row.update(udp_rows(floor=fl, d=d0, p=p, decoder=decoder, cycle_ns=cycle_ns, rounds=udp_rounds, seed=seed,
                            say=say))
        rows.append(row)
    if long_lengths:
        from ._qec_long import long_experiment_rows

        row = {"row": "long experiment", "transport": "shm", "host_load_1m_before": load0,
               "cpu_floor_ran_share": avail["ran_share"], "long_lengths": list(long_lengths)}
        row.update(long_experiment_rows(lengths=tuple(long_lengths), d=d0, p=p, cycle_ns=cycle_ns, seed=seed,
                                        max_total_rounds=long_max_total_rounds, say=say))
        rows.append(row)
    load1 = os.getloadavg()[0]
    for r in rows:
        r["host_load_1m_after"] = load1
    return {"rows": rows, "goals": goal_rows(rows, distance=d0)}


def offline_rounds_per_s(decoder: str, dem, packed: np.ndarray, *, num_rounds: int, repeats: int = 3) -> dict:
    """The offline peer at its best: the same shots decoded in one process with no wire, by
    the decoder's batch call (the one the service uses) in chunks of 256 and 4096 shots and
    in one call over all of them, and by its compiled ``decode_shots_bit_packed`` over all of
    them — the fastest of these, best of ``repeats`` each (rounds per second), and which it was."""
    from qlink.qec.decoders import compile_decoder, offline_throughput
    from qlink.qec.hotpath import single_shot_decoder

    one = single_shot_decoder(decoder, dem)
    n = len(packed)
    ways = {"decode_shots_bit_packed, all shots": (compile_decoder(decoder, dem), None)}
    if one.batch_fn is not None:
        for chunk in (256, 4096, n):
            ways[f"batch call, {min(chunk, n)} shots per call"] = (one.batch_fn, chunk)
    rates = {way: offline_throughput(fn, packed, repeat=repeats, chunk_shots=chunk) for way, (fn, chunk) in ways.items()}
    best_way = max(rates, key=rates.__getitem__)
    return {"rounds_per_s": rates[best_way] * num_rounds, "way": best_way}


_FLAT_BATCH = 4096  # flat out, the service decodes a backlog of up to this many shots in one call


def _flat_out(t: str, d: int, *, p: float, decoder: str, seed: int, flat_rounds: int, say, pairs: int = 5) -> dict:
    """Flat out (a 1 ns cycle), one frame per shot: rounds answered per second through the
    wire, beside the offline peer at its best on the same shots (:func:`offline_rounds_per_s`),
    in ``pairs`` interleaved triples (a slow minute of the host weighs on every side alike).
    The service decodes its backlog in calls of up to ``_FLAT_BATCH`` shots, the batch size
    the offline peer's best way uses (``max_batch_requests``; the real-time rows keep 256),
    and takes its frames in on a thread of its own (``service_ingest_cpu``: a CPU of its own
    where the host has a third, else the controller's) so that its decoder never waits for
    frames to be parsed -- the pipelined run the goal's ratio is of (best ÷ best; the median
    of the pairs' own ratios stands beside it). The single-threaded service's ratio is
    measured in the same triples and reported beside it."""
    from qlink.qec.loop import build_source, run_loop, sample_stream, source_spec

    spec = source_spec(distance=d, p=p)
    src = build_source(spec)
    stream = sample_stream(src, num_shots=max(1000, int(flat_rounds) // (d + 1)), seed=seed + 7 * d)
    packed = np.packbits(stream.detectors, axis=1, bitorder="little")
    ingest_cpu = 2 if (os.cpu_count() or 1) > 2 else 0  # (pin_cpus: the controller on 0, the service on 1)
    offs, runs, singles = [], [], []

    def wire_rate(cpu):
        return run_loop(transport=t, source=spec, decoder=decoder, engine="native", stream=stream,
                        num_shots=stream.num_shots, cycle_ns=1, rounds_per_frame=0, warmup_shots=500,
                        pin_cpus=True, keep_samples=0, capacity_shots=_FLAT_BATCH, max_batch_requests=_FLAT_BATCH,
                        timeout_s=600, service_ingest_cpu=cpu).decoded_rounds_per_s

    for _ in range(max(1, int(pairs))):
        offs.append(offline_rounds_per_s(decoder, src.dem, packed, num_rounds=stream.num_rounds, repeats=2))
        runs.append(wire_rate(ingest_cpu))
        singles.append(wire_rate(None))
    off = max(offs, key=lambda o: o["rounds_per_s"])
    offline = off["rounds_per_s"]
    best = max(runs)
    paired = float(np.median([r / o["rounds_per_s"] for r, o in zip(runs, offs)]))
    single = max(singles)
    say(f"  {t} d={d} flat out, one frame per shot, {stream.num_shots} shots: {best / 1e6:.2f} M rounds/s = "
        f"{best / offline:.0%} of offline ({offline / 1e6:.2f} M rounds/s: {off['way']}); median of {len(runs)} "
        f"pairs {paired:.0%}; frames taken in on CPU {ingest_cpu}; single-threaded service {single / offline:.0%}")
    return {"flat_rounds_per_s": best, "offline_rounds_per_s": offline, "offline_way": off["way"],
            "flat_vs_offline": best / offline, "flat_vs_offline_paired_median": paired, "flat_pairs": len(runs),
            "flat_shots": stream.num_shots, "flat_max_batch_shots": _FLAT_BATCH, "flat_ingest_cpu": ingest_cpu,
            "flat_single_thread_rounds_per_s": single, "flat_single_thread_vs_offline": single / offline}


def lockstep_host_floor(t: str, *, num_shots: int, hold_ns, pause_ns: int) -> dict:
    """The floor under a lock-step reaction's tail: as many bare round trips as the run has
    shots, over the same link, each answer held as long as one decoder call (``hold_ns``: the
    decoder's own single-shot call times, in turn, or one figure) and ``pause_ns`` between
    them (a shot's rounds on the cycle), each timed from when it was due -- the loop's shape
    with the wire, the decoder's own spread and this host's preemption (vCPU steal, the
    timer tick) in it, and no qlink software. p50 / p99 / p99.9 in µs.

    >>> import numpy as np
    >>> f = lockstep_host_floor("shm", num_shots=200, hold_ns=np.array([500, 900]), pause_ns=2000)
    >>> f["host_floor_p50_us"] > 0.5, f["host_floor_hold_p50_us"]
    (True, 0.7)
    """
    rt = link_floor_ns(t, num_round_trips=int(num_shots), rounds=1, hold_ns=hold_ns, pause_ns=pause_ns)
    p50, p99, p999 = np.percentile(rt, (50, 99, 99.9)) / 1e3
    holds = np.atleast_1d(np.asarray(hold_ns, np.float64))
    return {"host_floor_p50_us": float(p50), "host_floor_p99_us": float(p99), "host_floor_p999_us": float(p999),
            "host_floor_hold_p50_us": float(np.median(holds)) / 1e3,
            "host_floor_hold_p99_us": float(np.percentile(holds, 99)) / 1e3, "host_floor_pause_us": pause_ns / 1e3}


def _measure(t: str, d: int, *, p: float, decoder: str, cycle_ns: int, seed: int, floor: dict, lockstep_shots: int,
             cycle_rounds: int, trace_path, say, hold_ns=0) -> dict:
    from qlink.qec.loop import run_loop, source_spec

    spec = source_spec(distance=d, p=p)
    row: dict = {}
    if lockstep_shots:
        row.update(lockstep_host_floor(t, num_shots=lockstep_shots, hold_ns=hold_ns, pause_ns=spec["rounds"] * cycle_ns))
        say(f"  {t} d={d} floor under the tail (bare round trips, each held as long as one of the decoder's own "
            f"calls, paced like the shots): p50 {row['host_floor_p50_us']:.2f} us, p99 {row['host_floor_p99_us']:.2f} us")
        ff = run_loop(transport=t, source=spec, decoder=decoder, engine="native", num_shots=lockstep_shots,
                      feed_forward_deadline_ns=63_000, warmup_shots=500, pin_cpus=True, seed=seed,
                      keep_samples=lockstep_shots, cycle_ns=cycle_ns, timeout_s=600)
        row.update({"lockstep_p50_us": ff.reaction_p50_ns / 1e3, "lockstep_p99_us": ff.reaction_p99_ns / 1e3,
                    "lockstep_p999_us": ff.reaction_p999_ns / 1e3, "lockstep_shots": ff.shots_ok,
                    "lockstep_ler": ff.logical_error_rate, **_wire_split(ff, floor["p50_ns"])})
        say(f"  {t} d={d} lock-step (one frame per round): reaction p50 {row['lockstep_p50_us']:.2f} us, p99 "
            f"{row['lockstep_p99_us']:.2f} us (wire {row.get('stage_wire_us', math.nan):.2f}, decode "
            f"{row.get('stage_decode_us', math.nan):.2f}, qlink software {row.get('stage_software_us', math.nan):.2f})")
        if trace_path is not None:
            write_trace(ff, trace_path, max_shots=200)
            say(f"  trace of the first 200 lock-step shots: {trace_path}")
    shots = -(-int(cycle_rounds) // (spec["rounds"] + 1))  # (rounds + 1 frames: the final readout too)
    cyc = run_loop(transport=t, source=spec, decoder=decoder, engine="native", num_shots=shots,
                   warmup_shots=500, pin_cpus=True, seed=seed + d, keep_samples=min(shots, 50_000),
                   cycle_ns=cycle_ns, timeout_s=600)
    row.update({"cycle_rounds": shots * cyc.num_rounds, "cycle_keeps_up": cyc.keeps_up,
                "cycle_backlog_flat": cyc.backlog_flat, "cycle_rounds_per_s": cyc.decoded_rounds_per_s,
                "cycle_rate_share": cyc.decoded_rounds_per_s * cycle_ns / 1e9,
                "cycle_p50_us": cyc.reaction_p50_ns / 1e3, "cycle_p99_us": cyc.reaction_p99_ns / 1e3,
                "cycle_p999_us": cyc.reaction_p999_ns / 1e3, "cycle_late_frames": cyc.late_frames,
                "cycle_backlog_max_rounds": cyc.backlog_max_rounds, "cycle_ler": cyc.logical_error_rate,
                "cycle_cpu_service": _ratio(cyc.service.get("serve_cpu_s"), cyc.service.get("serve_wall_s"))})
    say(f"  {t} d={d} at the {cycle_ns} ns cycle, one frame per round, {row['cycle_rounds']} rounds: keeps up "
        f"{cyc.keeps_up} ({row['cycle_rate_share']:.1%} of the cycle rate), reaction p50 "
        f"{row['cycle_p50_us']:.2f} us p99 {row['cycle_p99_us']:.2f} us")
    return row


def _ratio(a, b) -> float:
    return a / b if a is not None and b else math.nan


def _joined(r: dict, key: str) -> str:
    """A udp row's note on its controller behind its clock: the share of frames that went
    late, joined to the datagram before them, and the p99 emit lag ('' where none did)."""
    share = r.get(f"{key}_frames_joined_share", 0.0)
    if not share:
        return ""
    return f"; the controller behind its clock: {share:.0%} of frames joined a datagram, emit lag p99 " \
           f"{r[f'{key}_emit_lag_p99_us']:.0f} us"


def goal_rows(rows: list[dict], *, distance: int = 5) -> list[dict]:
    """One row per goal: the goal, the figure, the floor it is held to, met or not."""
    out = []
    first = next((r for r in rows if r.get("d") == distance and r.get("transport", "shm") == "shm"), None)
    if first is not None and "lockstep_p50_us" in first:
        p50, p99 = first["lockstep_p50_us"], first["lockstep_p99_us"]
        bound = first["floor_rt_p50_us"] + first["decode_single_p50_us"] + 1.0
        out += [
            {"goal": GOALS["lockstep_p50_le_3us"], "figure_us": p50, "target_us": 3.0, "met": p50 <= 3.0},
            {"goal": GOALS["lockstep_p50_le_floor_sum"], "figure_us": p50, "target_us": bound, "met": p50 <= bound,
             "floor": f"rt {first['floor_rt_p50_us']:.2f} + decode {first['decode_single_p50_us']:.2f} + 1"},
            {"goal": GOALS["lockstep_p99_le_15us"], "figure_us": p99, "target_us": 15.0, "met": p99 <= 15.0,
             **({"floor": f"floor p99 {first['host_floor_p99_us']:.2f} us: bare round trips paced like the shots, "
                          f"each held as long as one decoder call (p50 {first['host_floor_hold_p50_us']:.2f}, p99 "
                          f"{first['host_floor_hold_p99_us']:.2f} us); CPU floor {first['cpu_floor_ran_share']:.0%}"}
                if "host_floor_p99_us" in first else {})},
        ]
        out += [
            {"goal": GOALS["cycle_p50_le_10us"], "figure_us": first["cycle_p50_us"], "target_us": 10.0,
             "met": first["cycle_p50_us"] <= 10.0},
            {"goal": GOALS["cycle_p99_le_100us"], "figure_us": first["cycle_p99_us"], "target_us": 100.0,
             "met": first["cycle_p99_us"] <= 100.0,
             **({"floor": f"the host held a pinned core off > {first['cpu_floor_gap_us']:.0f} us "
                          f"{first['cpu_floor_held_off_per_s']:.0f} times a second, the longest "
                          f"{first['cpu_floor_longest_gap_us']:.0f} us; CPU floor {first['cpu_floor_ran_share']:.0%}"}
                if "cpu_floor_held_off_per_s" in first else {})},
        ]
    for r in rows:
        if "cycle_keeps_up" in r:
            out.append({"goal": f"{GOALS['cycle_keeps_up']}, {r.get('transport', 'shm')} d={r['d']}",
                        "figure_us": math.nan,
                        "target_us": math.nan, "met": bool(r["cycle_keeps_up"]),
                        "floor": f"{r['cycle_rate_share']:.1%} of the cycle rate, backlog max "
                                 f"{r['cycle_backlog_max_rounds']} rounds"})
    for r in rows:
        if "flat_vs_offline" in r:
            out.append({"goal": f"{GOALS['flat_ge_95pct_offline']}, {r['transport']} d={r['d']}",
                        "figure_us": math.nan, "target_us": math.nan, "met": bool(r["flat_vs_offline"] >= 0.95),
                        "floor": f"{r['flat_vs_offline']:.0%} of {r['offline_rounds_per_s'] / 1e6:.2f} M rounds/s"
                                 + (f", best of {r['flat_pairs']} interleaved pairs (their median ratio "
                                    f"{r['flat_vs_offline_paired_median']:.0%})" if "flat_pairs" in r else "")
                                 + (f"; frames taken in on CPU {r['flat_ingest_cpu']}, a single-threaded service "
                                    f"{r['flat_single_thread_vs_offline']:.0%}" if "flat_ingest_cpu" in r else "")})
    for r in rows:
        if "udp_floor_datagrams_per_s" in r:
            out.append({"goal": GOALS["udp_floor"], "figure_us": r["udp_floor_period_ns"] / 1e3, "target_us": math.nan,
                        "met": True, "floor": f"{r['udp_floor_datagrams_per_s'] / 1e3:.0f} k datagrams/s (measured)"})
            out.append({"goal": GOALS["udp_rpf1_keeps_up"], "figure_us": r["udp_rpf1_cycle_ns"] / 1e3,
                        "target_us": math.nan, "met": bool(r["udp_rpf1_keeps_up"]),
                        "floor": f"{r['udp_rpf1_rate_share']:.1%} of its cycle rate, backlog max "
                                 f"{r['udp_rpf1_backlog_max_rounds']} rounds" + _joined(r, "udp_rpf1")})
            out.append({"goal": GOALS["udp_cycle_keeps_up"], "figure_us": math.nan, "target_us": math.nan,
                        "met": bool(r["udp_cycle_keeps_up"]),
                        "floor": f"{r['udp_cycle_rounds_per_datagram']} rounds/datagram"
                                 + ("" if r["udp_cycle_datagrams_per_s_needed"] <= r["udp_floor_datagrams_per_s"]
                                    else f" (even so {r['udp_cycle_datagrams_per_s_needed'] / 1e3:.0f} k/s needed: "
                                         "above the floor)")
                                 + f", {r['udp_cycle_rate_share']:.1%} of the cycle rate" + _joined(r, "udp_cycle")})
        if "long_lengths" in r:
            ls = r["long_lengths"]
            a, b = (r.get(f"long_{n}_final_reaction_p50_us", math.nan) for n in (ls[0], ls[-1]))
            out.append({"goal": GOALS["long_flat"], "figure_us": b, "target_us": 1.2 * a,
                        "met": bool(b <= 1.2 * a and a <= 1.2 * b),
                        "floor": f"{ls[0]} rounds: {a:.1f} us, {ls[-1]} rounds: {b:.1f} us (medians of "
                                 f"{r.get(f'long_{ls[0]}_experiments')} and {r.get(f'long_{ls[-1]}_experiments')})"})
    for g in out:
        g.setdefault("floor", f"CPU floor {rows[0]['cpu_floor_ran_share']:.0%}")
    return out


def write_trace(res, path, *, max_shots: int = 200) -> None:
    """Write the first ``max_shots`` shots' stages as a Chrome / Perfetto trace (trace-event
    JSON: one complete event per stage, the controller and the service as two processes on
    the shared monotonic clock, in µs). Open it at ui.perfetto.dev or chrome://tracing."""
    import json

    from qlink.qec.timeline import SERVICE_SHOT_FIELDS, ShotRecords

    c = res.controller.shot_records
    if c is None or "shots" not in res.service:
        raise ValueError("the run kept no per-shot records (keep_samples=0, or a service of its own)")
    s = ShotRecords.from_dict(SERVICE_SHOT_FIELDS, res.service["shots"])
    by_rid = {int(r): i for i, r in enumerate(s["last_request_id"])}
    c = c[(c["status"] == 0) & (c["applied_ns"] > 0)][:max_shots]
    t0 = int(c["emit_last_ns"][0]) if len(c) else 0
    ev = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "controller"}},
          {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "decoder service"}}]

    def span(name, pid, a, b, shot):
        if b >= a > 0:
            ev.append({"name": name, "ph": "X", "pid": pid, "tid": 1, "ts": (a - t0) / 1e3, "dur": (b - a) / 1e3,
                       "args": {"shot": shot}})

    for row in c:
        shot = int(row["shot"])
        span("reaction", 1, int(row["emit_last_ns"]), int(row["applied_ns"]), shot)
        span("send", 1, int(row["emit_last_ns"]), int(row["sent_last_ns"]), shot)
        span("apply", 1, int(row["response_ns"]), int(row["applied_ns"]), shot)
        i = by_rid.get(int(row["last_request_id"]))
        if i is None:
            continue
        m = s[i]
        span("wire_in", 2, int(row["sent_last_ns"]), int(m["in_last_ns"]), shot)
        span("queue", 2, int(m["in_last_ns"]), int(m["decode_start_ns"]), shot)
        span("decode", 2, int(m["decode_start_ns"]), int(m["decode_end_ns"]), shot)
        span("respond", 2, int(m["decode_end_ns"]), int(m["out_ns"]), shot)
        span("wire_out", 1, int(m["out_ns"]), int(row["response_ns"]), shot)
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": ev, "displayTimeUnit": "ns"}, f)
