"""Rows of ``qlink bench qec`` beyond the shm/tcp ones: the udp kernel floor and the native
path over udp against it, and the long memory experiment with sliding windows.

* **udp floor** — a raw C pair on loopback, two processes pinned one per core: a sender
  with ``sendmmsg`` (batches up to 32; flat out and paced) and a ``recvmmsg`` receiver;
  the most datagrams per second the receiver took in any of the runs.
* **udp keeps up** — the native path over udp, one round per datagram, at a cycle of
  1.2 × the floor's period; and at the 1.1 µs cycle with the fewest rounds per datagram the
  floor allows (datagrams no faster than the floor). Each shot's ``get_corrections`` rides in
  the datagram of its last ``enqueue_syndromes`` (two whole frames back to back, sent on the
  same tick), so a shot costs as many datagrams as it has frames; the frames' bytes unchanged.
* **long experiment** — one memory experiment of ``rounds`` rounds at d=5, one round per
  frame on the cycle over shm, decoded by sliding windows with commit as the rounds land
  (:func:`qlink.qec.hotpath.window_plan`); the service runs in a thread of this process
  (its per-frame work holds no lock the controller's C loop needs): the final round →
  final correction reaction, p50 over the experiments played.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import socket
import threading
import time

import numpy as np

__all__ = ["udp_floor", "udp_rows", "long_experiment_rows"]


def _sink_child(q, n: int) -> None:
    from qlink.procs import die_with_parent, pin_to_cpu
    from qlink.qec import _hotcore

    die_with_parent()
    pin_to_cpu(1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.bind(("127.0.0.1", 0))
    s.setblocking(False)
    q.put(s.getsockname()[1])
    q.put(_hotcore.udp_sink(s.fileno(), n, 50_000_000))
    s.close()


def udp_floor(*, num_datagrams: int = 200_000, nbytes: int = 64, periods_ns=(0, 2000, 3000, 4000)) -> dict:
    """The kernel floor of loopback udp here: datagrams per second a ``recvmmsg`` receiver
    takes from a ``sendmmsg`` sender (batches up to 32), the best of flat out and paced runs."""
    from qlink.procs import pinned
    from qlink.qec import _hotcore

    ctx = mp.get_context("spawn")
    runs = []
    for period in periods_ns:
        q = ctx.Queue()
        child = ctx.Process(target=_sink_child, args=(q, num_datagrams), daemon=True)
        child.start()
        try:
            port = q.get(timeout=60)
            c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            c.connect(("127.0.0.1", port))
            with pinned(0):
                sent, t0, t1, _ = _hotcore.udp_blast(c.fileno(), num_datagrams, nbytes, period, 32)
            got, first, last, batches = q.get(timeout=60)
            c.close()
        finally:
            child.join(10)
            if child.is_alive():
                child.kill()
        rate = (got - 1) / ((last - first) / 1e9) if got > 1 and last > first else 0.0
        runs.append({"period_ns": period, "sent_per_s": sent / ((t1 - t0) / 1e9), "received_per_s": rate,
                     "delivered": got / sent, "datagrams_per_recvmmsg": got / max(1, batches)})
    best = max(runs, key=lambda r: r["received_per_s"])
    return {"floor_datagrams_per_s": best["received_per_s"], "floor_period_ns": 1e9 / best["received_per_s"],
            "floor_runs": runs}


def _behind(key: str, r) -> dict:
    """How far a udp run's controller fell behind its clock: the frames it sent late joined
    the datagram before them (``frames_joined``), and its p99 emit lag."""
    frames = max(1, r.num_shots * r.frames_per_shot)
    return {f"{key}_frames_joined_share": r.controller.frames_joined / frames,
            f"{key}_emit_lag_p99_us": r.emit_lag_p99_ns / 1e3, f"{key}_clock_on_time": r.clock_on_time}


def udp_rows(*, floor: dict, d: int = 5, p: float = 0.001, decoder: str = "pymatching", cycle_ns: int = 1100,
             rounds: int = 300_000, seed: int = 1, say=lambda m: None) -> dict:
    """The native path over udp against the floor: one round per datagram at 1.2 × the floor's
    period, and at ``cycle_ns`` with the fewest rounds per datagram the floor allows."""
    from qlink.qec.loop import run_loop, source_spec

    spec = source_spec(distance=d, p=p)
    ticks = spec["rounds"] + 1  # (the final readout: a round of its own on the wire)
    per_dgram_ns = floor["floor_period_ns"]
    # one round per datagram, each shot's get riding in its last frame's datagram (two whole
    # frames): ticks datagrams a shot, one per tick at 1.2 x the floor's period
    cyc1 = int(math.ceil(1.2 * per_dgram_ns))
    row: dict = {"udp_floor_datagrams_per_s": floor["floor_datagrams_per_s"],
                 "udp_floor_period_ns": per_dgram_ns, "udp_rpf1_cycle_ns": cyc1}
    r1 = run_loop(transport="udp", source=spec, decoder=decoder, engine="native", num_shots=max(100, rounds // ticks // 3),
                  cycle_ns=cyc1, rounds_per_frame=1, warmup_shots=200, pin_cpus=True, seed=seed, keep_samples=20_000,
                  timeout_s=600)
    row.update({"udp_rpf1_keeps_up": r1.keeps_up, "udp_rpf1_rate_share": r1.decoded_rounds_per_s * cyc1 / 1e9,
                "udp_rpf1_p50_us": r1.reaction_p50_ns / 1e3, "udp_rpf1_p99_us": r1.reaction_p99_ns / 1e3,
                "udp_rpf1_backlog_max_rounds": r1.backlog_max_rounds, "udp_rpf1_dropped": r1.shots_dropped,
                **_behind("udp_rpf1", r1)})
    say(f"  udp d={d}, one round per datagram at {cyc1} ns (1.2 x the floor's period): keeps up {r1.keeps_up} "
        f"({row['udp_rpf1_rate_share']:.1%} of its cycle rate), reaction p50 {row['udp_rpf1_p50_us']:.1f} us; "
        f"{row['udp_rpf1_frames_joined_share']:.0%} of frames joined a datagram, emit lag p99 "
        f"{row['udp_rpf1_emit_lag_p99_us']:.1f} us")
    # at the cycle: the fewest rounds per datagram whose datagrams fit under the floor (the gets
    # ride in the last frames' datagrams)
    rpf = ticks
    for k in range(1, ticks + 1):
        if -(-ticks // k) / (ticks * cycle_ns * 1e-9) <= floor["floor_datagrams_per_s"]:
            rpf = k
            break
    need = -(-ticks // rpf) / (ticks * cycle_ns * 1e-9)
    r2 = run_loop(transport="udp", source=spec, decoder=decoder, engine="native", num_shots=max(100, rounds // ticks),
                  cycle_ns=cycle_ns, rounds_per_frame=rpf, warmup_shots=200, pin_cpus=True, seed=seed + 1,
                  keep_samples=20_000, timeout_s=600)
    row.update({"udp_cycle_rounds_per_datagram": rpf, "udp_cycle_datagrams_per_s_needed": need,
                "udp_cycle_keeps_up": r2.keeps_up, "udp_cycle_rate_share": r2.decoded_rounds_per_s * cycle_ns / 1e9,
                "udp_cycle_p50_us": r2.reaction_p50_ns / 1e3, "udp_cycle_p99_us": r2.reaction_p99_ns / 1e3,
                "udp_cycle_backlog_max_rounds": r2.backlog_max_rounds, "udp_cycle_dropped": r2.shots_dropped,
                **_behind("udp_cycle", r2)})
    say(f"  udp d={d} at {cycle_ns} ns, {rpf} rounds per datagram ({need / 1e3:.0f} k datagrams/s needed, floor "
        f"{floor['floor_datagrams_per_s'] / 1e3:.0f} k): keeps up {r2.keeps_up} ({row['udp_cycle_rate_share']:.1%}), "
        f"reaction p50 {row['udp_cycle_p50_us']:.1f} us; {row['udp_cycle_frames_joined_share']:.0%} of frames joined "
        f"a datagram, emit lag p99 {row['udp_cycle_emit_lag_p99_us']:.1f} us")
    return row


def _long_stream(d: int, rounds: int, p: float, num_shots: int, seed: int):
    """A memory experiment of ``rounds`` rounds (stim), its folded DEM and its detectors'
    rounds (from a short circuit of the same code: the bulk rounds repeat)."""
    import stim

    from qlink.qec.stream import SyndromeStream

    def circ(r):
        return stim.Circuit.generated("surface_code:rotated_memory_z", distance=d, rounds=r,
                                      after_clifford_depolarization=p, before_measure_flip_probability=p,
                                      after_reset_flip_probability=p, before_round_data_depolarization=p)

    small = circ(3)
    coords = small.get_detector_coordinates()
    per = np.bincount([int(coords[i][-1]) for i in range(small.num_detectors)])  # rounds 0..3
    counts = np.concatenate([[per[0]], np.full(rounds - 1, per[1]), [per[-1]]]).astype(np.int64)
    det_rounds = np.repeat(np.arange(rounds + 1, dtype=np.int64), counts)
    c = circ(rounds)
    if c.num_detectors != len(det_rounds):
        raise RuntimeError("the long circuit's detectors do not follow its short twin's rounds")
    dets, obs = c.compile_detector_sampler(seed=seed).sample(num_shots, separate_observables=True)
    stream = SyndromeStream(detectors=dets.view(np.uint8), observables=obs.view(np.uint8), round_of_detector=det_rounds)
    return stream, c.detector_error_model(decompose_errors=True), det_rounds


def long_experiment_rows(*, lengths=(10_000, 1_000_000), d: int = 5, p: float = 0.001, cycle_ns: int = 1100,
                         window_rounds: int = 110, commit_rounds: int = 100, max_total_rounds: int = 2_000_000,
                         min_experiments: int = 10, seed: int = 1, say=lambda m: None) -> dict:
    """Final round → final correction of a long memory experiment at the cycle, one round per
    frame over shm, sliding windows with commit decoded as the rounds land, at each length
    (after a warm-up batch of the shortest, not recorded);
    ``max_total_rounds`` bounds the rounds played per length, but each length plays at least
    ``min_experiments`` experiments: the final window's decode differs from one experiment to
    the next (its syndromes do), and a median of three moved by a quarter between runs."""
    import transports

    from qlink.qec.decoders import SlidingWindowDecoder
    from qlink.qec.hotpath import NativeController, NativeDecoderService
    from qlink.qec.service import DecoderConfig

    row: dict = {"long_d": d, "long_window_rounds": window_rounds, "long_commit_rounds": commit_rounds}
    # the shortest length played once first, not recorded: the first batch after the process
    # (or the rows before it) started ran ~20 % slower than the same experiments played again
    plays = [(min(lengths), False)] + [(n, True) for n in lengths] if lengths else []
    for n_rounds, recorded in plays:
        shots = max(int(min_experiments), min(20, max_total_rounds // n_rounds))
        t0 = time.perf_counter()
        stream, dem, det_rounds = _long_stream(d, n_rounds, p, shots, seed + n_rounds)
        win = SlidingWindowDecoder(dem, detector_rounds=det_rounds, window_rounds=window_rounds,
                                   commit_rounds=commit_rounds)
        svc = NativeDecoderService({0: DecoderConfig(decoder=win, dem=dem, capacity_shots=4,
                                                     frames_per_shot=n_rounds + 1)}, keep_samples=shots)
        lis = transports.listen(f"shm://qlink-long-{os.getpid()}-{n_rounds}-{int(recorded)}")
        stop = threading.Event()
        out: dict = {}

        def serve():
            peer = lis.accept(timeout_s=60)
            try:
                out.update(svc.serve(peer, stop_event=stop))
            finally:
                peer.close()

        th = threading.Thread(target=serve, daemon=True)
        th.start()
        ep = transports.connect(lis.url, timeout_s=30)
        try:
            ctl = NativeController(ep, stream, cycle_ns=cycle_ns, rounds_per_frame=1, gap_cycles=100)
            setup_s = time.perf_counter() - t0
            res = ctl.run(timeout_s=600)
        finally:
            ep.close()
            th.join(30)
            stop.set()
            lis.close()
        if not recorded:
            say(f"  long experiment d={d}: a warm-up batch of {n_rounds} rounds x {shots} played (not recorded)")
            continue
        ok = res.reaction_ns[res.reaction_ns >= 0]
        lag = res.max_lag_ns
        key = f"long_{n_rounds}"
        q25, q75 = (float(np.percentile(ok, q)) / 1e3 if len(ok) else math.nan for q in (25, 75))
        row.update({f"{key}_experiments": shots, f"{key}_final_reaction_p50_us": float(np.median(ok)) / 1e3 if len(ok) else math.nan,
                    f"{key}_final_reaction_p25_us": q25, f"{key}_final_reaction_p75_us": q75,
                    f"{key}_final_reaction_max_us": float(ok.max()) / 1e3 if len(ok) else math.nan,
                    f"{key}_windows": out.get("counts", {}).get("windows_decoded", 0),
                    f"{key}_backlog_max_rounds": int(res.backlog_rounds.max()) if len(res.backlog_rounds) else 0,
                    f"{key}_late_frames": res.late_frames, f"{key}_max_emit_lag_us": lag / 1e3,
                    f"{key}_logical_errors": res.logical_errors, f"{key}_setup_s": setup_s})
        say(f"  long experiment d={d}, {n_rounds} rounds x {shots}, windows {window_rounds}/{commit_rounds}: final-round "
            f"-> final correction p50 {row[f'{key}_final_reaction_p50_us']:.1f} us (p25-p75 {q25:.1f}-{q75:.1f}, max "
            f"{row[f'{key}_final_reaction_max_us']:.1f}), logical errors {res.logical_errors}")
    return row
