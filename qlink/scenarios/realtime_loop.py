"""The closed QEC loop at the syndrome cycle: reaction time, decoder backlog, LER under a deadline.

A controller emulator plays surface-code rounds at the cycle time (1.1 µs, Google
Willow, arXiv:2408.13687) to the decoder service in another process over the chosen
transport, in two ways:

* **streaming** — shots back to back at the cycle cadence, corrections pipelined:
  does the decoder keep up (backlog over time), and what reaction time (last round
  out → correction applied) does it give at p50/p99/p99.9;
* **feed-forward** — after each shot the controller waits for its correction before
  a conditional operation, with a deadline (default 63 µs, Willow's d=5 average
  decoder latency), and counts the misses.

From the per-shot (correct?, reaction time) pairs it draws LER(t) = P(wrong, missing
or later than t). Every figure is measured on this machine; the controller's own
analog delays (Qblox: 212 ns trigger, 364 ns analog in → out) are reported
separately as *modeled*.

    python scenarios/realtime_loop.py --quick --transport shm --out results/realtime_loop
    python scenarios/realtime_loop.py --quick --stim memory.stim   # a circuit of your own
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

__all__ = ["run", "main", "QUICK", "FULL"]

QUICK = {"distance": 5, "rounds": 25, "num_shots": 2_000}
FULL = {"distance": 5, "rounds": 25, "num_shots": 20_000}
DEFAULT_DEADLINE_NS = 63_000  # Willow d=5 average real-time decoder latency, arXiv:2408.13687


def _mode_summary(res, *, deadline_ns: int) -> dict:
    from qlink.budget import BUDGETS, Figure, assess

    s = res.summary()
    lines = [assess(Figure(f"reaction {stat}", v, basis="measured", transport=res.transport, statistic=stat),
                    BUDGETS["qec.reaction"])
             for stat, v in (("p50", res.reaction_p50_ns), ("p99", res.reaction_p99_ns)) if math.isfinite(v)]
    s.update({
        "deadline_us": deadline_ns / 1e3,
        "ler_at_deadline": float(res.ler_at([deadline_ns])[0]),
        "budget_share_p50": lines[0].share if lines else math.nan,
        "modeled_controller_ns": res.modeled_controller_ns,
        "reaction_p50_plus_modeled_us": (res.reaction_p50_ns + sum(res.modeled_controller_ns.values())) / 1e3,
        "stage_p50_us": {k: v["p50_us"] for k, v in res.stage_breakdown.get("stages", {}).items()},
        "throttled": res.controller.throttled,
        "service_decode_per_shot_p50_us": res.service_stage_summary().get("decode_per_shot", {}).get("p50_us"),
    })
    return s


def run(*, transport: str = "shm", out: str | Path | None = "results/realtime_loop", distance: int | None = None,
        rounds: int | None = None, p: float = 0.001, num_shots: int | None = None, cycle_ns: int = 1100,
        rounds_per_frame: int = 1, shots_per_frame: int = 1, deadline_ns: int = DEFAULT_DEADLINE_NS, seed: int = 1,
        quick: bool = False,
        decoder: str = "pymatching", feed_forward: bool = True, progress: bool = True,
        service_url: str | None = None, stim: str | Path | None = None) -> dict:
    """Run the streaming loop (and the feed-forward loop); return their summaries and traces.

    ``rounds_per_frame`` 1 (the default) streams round by round, each round its own frame on its
    tick, as a QPU controller does; 0 sends each shot's rounds in one frame after its last round; ``shots_per_frame`` > 1 batches whole shots. With ``out`` writes ``realtime_loop.json`` and
    ``backlog.png``, ``ler_deadline.png``, ``reaction_cdf.png`` there.

    ``service_url`` drives a decoder server that is already running (any server speaking
    the CUDA-Q realtime decoder RPC there, e.g. ``udp://10.0.0.2:5000``, with decoder 0
    configured for this source's DEM and its counter at 0) instead of starting qlink's
    own; only the streaming loop runs then (one pass over a fresh counter), and the
    stage shares that need the service's own records are left out.

    ``stim`` runs a circuit of one's own instead of the generated surface code (a ``.stim``
    file with detectors and observables; ``distance``, ``rounds`` and ``p`` are then the
    circuit's own and are not used): its detectors are streamed in the rounds their
    coordinates (or TICK layers) give.
    """
    from qlink.qec.loop import build_source, run_loop, sample_stream, source_spec
    from qlink.qec.specs import spec_and_source

    from qlink import checks

    preset = QUICK if quick else FULL
    if stim is not None:
        for name, v in (("distance", distance), ("rounds", rounds)):
            if v is not None:
                raise checks.UsageError(f"{name}: does not apply to a circuit of your own (stim={stim}): "
                                        "it has its own; leave it out")
        # a bad file: one UsageError naming it; the spec (path and hash) and the source, built once
        spec, src = spec_and_source(checks.stim_file(stim, where="stim"))
        distance, p = None, None
        rounds = int(src.round_of_detector[-1]) + 1
    else:
        # None means "the preset's"; 0 is refused, never taken for the default
        distance = checks.distance(preset["distance"] if distance is None else distance, where="distance")
        rounds = checks.count(preset["rounds"] if rounds is None else rounds, where="rounds")
        p = checks.probability(p, where="p")
        spec = source_spec(distance=distance, rounds=rounds, p=p)
        src = build_source(spec)
    num_shots = checks.count(preset["num_shots"] if num_shots is None else num_shots, where="num_shots")
    decoder = checks.decoder(decoder, where="decoder")
    if service_url is None:
        transport = checks.transport(transport, where="transport", urls=True)
    stream = sample_stream(src, num_shots=num_shots, seed=seed)
    modes = [("streaming", None)] + ([("feed_forward", deadline_ns)] if feed_forward and service_url is None else [])
    bar = None
    if progress:
        from tqdm import tqdm

        what = f"d={distance}" if stim is None else Path(stim).name
        bar = tqdm(total=len(modes), desc=f"closed loop {what} over {transport}", unit="run", file=sys.stderr)
    results = {}
    try:
        for name, ff in modes:
            results[name] = run_loop(transport=transport, source=spec, stream=stream, num_shots=num_shots,
                                     decoder=decoder, cycle_ns=cycle_ns, rounds_per_frame=rounds_per_frame,
                                     shots_per_frame=shots_per_frame,
                                     feed_forward_deadline_ns=ff, warmup_shots=200, keep_samples=num_shots,
                                     timeout_s=max(120.0, num_shots * 0.05), service_url=service_url,
                                     # another server keeps no answers to replay (a qlink extension): never re-ask
                                     controller_options=None if service_url is None else {"get_timeout_ns": 30_000_000_000})
            if bar:
                bar.update()
    finally:
        if bar:
            bar.close()
    grid_ns = np.unique(np.concatenate([np.geomspace(1_000, 100_000_000, 81).astype(np.int64), [deadline_ns]]))
    report = {
        "config": {"transport": transport if service_url is None else service_url, "external_service": service_url is not None, "circuit": None if stim is None else str(stim), "distance": distance, "rounds": rounds, "p": p, "num_shots": num_shots,
                   "cycle_ns": cycle_ns, "rounds_per_frame": rounds_per_frame, "shots_per_frame": shots_per_frame,
                   "decoder": decoder,
                   "deadline_ns": deadline_ns, "seed": seed},
        "modes": {k: _mode_summary(v, deadline_ns=deadline_ns) for k, v in results.items()},
        "ler_deadline": {"t_us": (grid_ns / 1e3).tolist(),
                         **{k: v.ler_at(grid_ns).tolist() for k, v in results.items()}},
        "backlog": {k: {"t_us": (v.backlog_trace[0] / 1e3).tolist(), "rounds": v.backlog_trace[1].tolist()}
                    for k, v in results.items()},
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        from qlink.bench.conditions import current

        with open(out / "realtime_loop.json", "w") as f:
            json.dump({**report, "conditions": current().as_dict()}, f, indent=1, default=float)
        _plots(results, report, out)
    report["results"] = results
    return report


def _plots(results: dict, report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report["config"]
    code = f"d={cfg['distance']}" if cfg.get("circuit") is None else Path(cfg["circuit"]).name
    title = f"{code}, {cfg['rounds']} rounds/shot, cycle {cfg['cycle_ns']} ns, {cfg['transport']}"
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, res in results.items():
        t, b = res.backlog_trace
        ax.plot(t / 1e3, b, label=name)
    ax.set_xlabel("time since the first round (µs)")
    ax.set_ylabel("rounds emitted − rounds answered")
    ax.set_title(f"Decoder backlog — {title}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "backlog.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    t_us = np.array(report["ler_deadline"]["t_us"])
    for name in results:
        ax.plot(t_us, report["ler_deadline"][name], label=name)
    ax.axvline(cfg["deadline_ns"] / 1e3, color="k", ls=":", label=f"deadline {cfg['deadline_ns'] / 1e3:g} µs")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("deadline t (µs)")
    ax.set_ylabel("LER(t) = P(wrong or later than t)")
    ax.set_title(f"Logical error rate under a deadline — {title}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ler_deadline.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, res in results.items():
        r = np.sort(res.controller.reaction_ns[res.controller.reaction_ns >= 0]) / 1e3
        if r.size:
            ax.plot(r, np.arange(1, r.size + 1) / r.size, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("reaction time: last round → correction applied (µs, measured)")
    ax.set_ylabel("fraction of shots")
    ax.set_title(f"Reaction time — {title}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "reaction_cdf.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from qlink import checks
    from qlink._argparse import Parser, checked

    ap = Parser(description=__doc__.split("\n\n")[0],
                examples="python scenarios/realtime_loop.py --quick\n"
                         "python scenarios/realtime_loop.py --transport tcp --distance 7 --shots 5000\n"
                         "python scenarios/realtime_loop.py --quick --stim memory.stim")
    ap.add_argument("--transport", default="shm", help="shm, tcp, ucx, udp, inproc or a URL",
                    **checked(checks.transport, urls=True))
    ap.add_argument("--out", default="results/realtime_loop", help="output directory (JSON + PNGs)",
                    **checked(checks.out_dir))
    ap.add_argument("--quick", action="store_true", help=f"{QUICK['num_shots']} shots (< 1 min)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--distance", default=None, help=f"code distance, odd >= 3 (default {FULL['distance']})",
                    **checked(checks.distance))
    ap.add_argument("--rounds", default=None, help=f"rounds per shot (default {FULL['rounds']})",
                    **checked(checks.count))
    ap.add_argument("--p", default=0.001, help="physical error rate, in (0, 0.5)", **checked(checks.probability))
    ap.add_argument("--shots", default=None, help=f"shots (default {FULL['num_shots']}; --quick {QUICK['num_shots']})",
                    **checked(checks.count))
    ap.add_argument("--decoder", default="pymatching", help="a decoder of qlink.qec.decoders.BUILT_IN_DECODERS",
                    **checked(checks.decoder))
    ap.add_argument("--cycle-ns", default=1100, help="syndrome cycle", **checked(checks.count))
    ap.add_argument("--rounds-per-frame", default=1, help="rounds per frame (0: the whole shot)",
                    **checked(checks.non_negative))
    ap.add_argument("--shots-per-frame", default=1, **checked(checks.count),
                    help="whole shots per frame and per answer (throughput for reaction time)")
    ap.add_argument("--deadline-us", default=DEFAULT_DEADLINE_NS / 1e3, help="feed-forward deadline",
                    **checked(checks.number, lo=0, lo_open=True))
    ap.add_argument("--stim", default=None, metavar="FILE.stim",
                    help="a stim circuit of your own (with DETECTOR and OBSERVABLE_INCLUDE) instead of the "
                         "generated surface code; --distance, --rounds and --p do not apply",
                    **checked(checks.stim_file))
    ap.add_argument("--no-feed-forward", action="store_true", help="only the streaming loop")
    ap.add_argument("--service-url", default=None,
                    help="drive a decoder server already running there (any CUDA-Q realtime RPC server, "
                         "e.g. udp://host:port) instead of starting qlink's; streaming loop only",
                    **checked(checks.transport, choices=(), urls=True))
    args = ap.parse_args(argv)
    rep = run(transport=args.transport, out=args.out, distance=args.distance, rounds=args.rounds, p=args.p,
              num_shots=args.shots, cycle_ns=args.cycle_ns, rounds_per_frame=args.rounds_per_frame,
              shots_per_frame=args.shots_per_frame,
              deadline_ns=int(args.deadline_us * 1e3), seed=args.seed, quick=args.quick, decoder=args.decoder,
              feed_forward=not args.no_feed_forward, service_url=args.service_url, stim=args.stim)
    from qlink.bench.report import wrap

    for name, s in rep["modes"].items():
        print(wrap(f"[{name}] reaction p50 {s['reaction_p50_us']:.1f} us, p99 {s['reaction_p99_us']:.1f} us, "
              f"p99.9 {s['reaction_p999_us']:.1f} us (measured; +{sum(s['modeled_controller_ns'].values())} ns "
              f"modeled controller delay); LER {s['ler']:.2e}, LER(t={s['deadline_us']:g} us) "
              f"{s['ler_at_deadline']:.2e}; keeps up: {s['keeps_up']} (backlog max {s['backlog_max_rounds']} "
              f"rounds, growth {s['backlog_growth_rounds']:.0f}; controller lag p99 {s['emit_lag_p99_us']:.1f} us); shares transport {s['share_transport']:.2f} / queue "
              f"{s['share_queue']:.2f} / decode {s['share_decode']:.2f}; deadline misses {s['deadline_misses']}",
                   indent="    "))
    print(wrap(f"written: {Path(args.out)}/realtime_loop.json, backlog.png, ler_deadline.png, reaction_cdf.png"))
    return 0


if __name__ == "__main__":
    from qlink._argparse import run_main

    sys.exit(run_main(main))
