"""``qlink bench hostile``: a well-behaved controller's reaction while hostile clients attack
the decoder service, and several well-behaved controllers at once.

Two tables, for each engine of the decoder service (``python``, and ``native``: a C core per
session), each engine's from one service process (surface code d=5, PyMatching):

* **hostile**: over tcp and udp, a lock-step controller's reaction (the native one by default:
  its shot's last round frame emitted → its correction applied; see :func:`_play`) p50/p99
  with 0, 1 and 4 hostile clients attached (each in its own process, see
  :mod:`qlink.bench._hostile_clients`), and p99(hostile)/p99(none) against the goal ≤ 2,
  measured in the same run: the cases
  take turns three times, each with a third of the shots, and each case's figures pool its
  turns. Every correction is checked bit for bit against PyMatching on the same shots.
  Beside n hostile clients, a control case of n processes that only spin on a CPU at the
  attackers' priority and send nothing: on a host of few cores, what a hostile row owes to
  the CPU its clients take from the host rather than to their traffic.
* **controllers**: 1 and 4 well-behaved controllers at once (each its own process):
  per-controller reaction p50/p99 and the total frames per second, beside one alone.

Every row carries the run's conditions (:mod:`qlink.bench.conditions`): on a 2-core host
the service, the controller(s) and the hostile clients share two cores, which the ratios
(not the absolute figures) are meant to see through.

>>> HOSTILE_MIX["tcp"][:2], HOSTILE_MIX["udp"][:2]
(('tcp_flood', 'half_frame'), ('udp_flood', 'udp_garbage'))
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

__all__ = ["HOSTILE_MIX", "run_hostile_bench", "main_from_cli"]

SPEC = {"code": "surface_code:rotated_memory_z", "distance": 5, "rounds": 5, "p": 0.003}
# which hostile clients attack: the first n of the transport's mix (count: sockets per client)
HOSTILE_MIX = {"tcp": (("tcp_flood", "half_frame", "huge_header", "idle")),
               "udp": (("udp_flood", "udp_garbage", "udp_flood", "udp_garbage"))}
_COUNTS = {"idle": 50, "udp_garbage": 20}
_GOAL_RATIO = 2.0
_URLS = {"tcp": "tcp://127.0.0.1:0", "udp": "udp://127.0.0.1:0"}


def _code(num_shots: int, seed: int = 5):
    """``(dem, shots)``: the shots' detection events, true flips, the round of each detector, and
    PyMatching's corrections (what every answer must equal)."""
    import pymatching

    from qlink.qec.specs import build_source

    src = build_source(SPEC)
    dets, obs = src.sample(num_shots, seed=seed)
    dets = np.asarray(dets, dtype=np.uint8)
    expected = pymatching.Matching.from_detector_error_model(src.dem).decode_batch(dets).astype(np.uint8)
    return src.dem, _Shots(dets, np.asarray(obs, np.uint8), np.asarray(src.round_of_detector), expected)


class _Shots:
    """A run's shots (see :func:`_code`); ``shots[a:b]`` is a slice of them."""

    def __init__(self, dets, obs, rounds, expected) -> None:
        self.dets, self.obs, self.rounds, self.expected = dets, obs, rounds, expected

    def __len__(self) -> int:
        return len(self.dets)

    def __getitem__(self, sl: slice) -> "_Shots":
        return _Shots(self.dets[sl], self.obs[sl], self.rounds, self.expected[sl])


def _play(url: str, shots: _Shots, num_obs: int, *, controller: str = "native", warmup: int = 200,
          time_limit_s: float = 60.0) -> dict:
    """One lock-step controller session: its reactions (ns) and whether every correction matched.
    ``controller``: ``"native"`` (:class:`~qlink.qec.hotpath.NativeController`, lock-step, a
    frame per round: the loop's per-frame work in C, so the figures are the service's and the
    link's) or ``"python"`` (:class:`~qlink.bench._lockstep.LockstepController`, a frame per
    shot from plain Python: its own time is most of the reaction)."""
    if controller == "native":
        return _play_native(url, shots, warmup=warmup, time_limit_s=time_limit_s)
    from ._lockstep import LockstepController

    with LockstepController(url, num_observables=num_obs, timeout_s=30) as ctl:
        ctl.run(shots.dets[:warmup], time_limit_s=time_limit_s / 4)
        t0 = time.perf_counter()
        flips, statuses, reaction = ctl.run(shots.dets, time_limit_s=time_limit_s)
        wall = time.perf_counter() - t0
        retries = ctl.retries
    n = len(flips)
    return {"reaction_ns": reaction, "wall_s": wall, "frames": 2 * n, "retransmits": retries,
            "bit_identical": bool((statuses == 0).all() and np.array_equal(flips, shots.expected[:n]))}


def _play_native(url: str, shots: _Shots, *, warmup: int, time_limit_s: float) -> dict:
    import transports
    from qlink.qec.hotpath import NativeController
    from qlink.qec.stream import SyndromeStream

    ep = transports.connect(url, timeout_s=30)
    try:
        before = None
        if warmup:
            w = shots[:warmup]
            before = NativeController(ep, SyndromeStream(w.dets, w.obs, w.rounds), lockstep=True)
            before.run(timeout_s=4 * time_limit_s)
        ctl = NativeController(ep, SyndromeStream(shots.dets, shots.obs, shots.rounds), lockstep=True)
        if before is not None:
            ctl.continue_after(before)
        t0 = time.perf_counter()
        res = ctl.run(timeout_s=4 * time_limit_s)
        wall = time.perf_counter() - t0
    finally:
        ep.close()
    nbo = res.corrections.shape[1]
    want = np.packbits(shots.expected, axis=1, bitorder="little")[:, :nbo]
    ok = res.shots_ok == len(shots)
    faults = res.answer_faults or {}
    return {"reaction_ns": np.asarray(res.reaction_ns, np.int64)[res.reaction_ns >= 0], "wall_s": wall,
            "frames": len(shots) * (res.frames_per_shot + 1),
            "retransmits": int(faults.get("resent_gets", 0) + faults.get("resent_frames", 0)),
            "bit_identical": bool(ok and np.array_equal(res.corrections, want))}


def _summary(plays: list[dict]) -> dict:
    """The rows' figures over one or more sessions' reactions, pooled."""
    us = np.concatenate([p["reaction_ns"] for p in plays]) / 1e3
    return {"shots": len(us), "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "max_us": float(us.max()), "frames_per_s": sum(p["frames"] for p in plays) / sum(p["wall_s"] for p in plays),
            "bit_identical": all(p["bit_identical"] for p in plays), "retransmits": sum(p["retransmits"] for p in plays),
            "sessions": len(plays)}


def _controller_worker(url: str, num_shots: int, seed: int, num_obs: int, start, out, time_limit_s: float,
                       controller: str) -> None:
    """One controller in its own process (for the several-at-once rows)."""
    _dem, shots = _code(num_shots, seed=seed)
    start.wait(120)
    try:
        out.put(_summary([_play(url, shots, num_obs, controller=controller, warmup=50, time_limit_s=time_limit_s)]))
    except Exception as e:  # reported in the row
        out.put({"error": f"{type(e).__name__}: {e}"})


def _several(url: str, n: int, num_shots: int, num_obs: int, time_limit_s: float, controller: str) -> list[dict]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_controller_worker,
                         args=(url, num_shots, 100 + k, num_obs, start, out, time_limit_s, controller), daemon=True)
             for k in range(n)]
    for p in procs:
        p.start()
    time.sleep(3.0)  # let every worker import and sample before they start together
    start.set()
    res = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return res


def _merged(counters: list[dict]) -> dict:
    out: dict = {}
    for c in counters:
        for key, v in c.items():
            out[key] = out.get(key, 0) + v if isinstance(v, (int, float)) else v
    return out


def run_hostile_bench(*, transports=("tcp", "udp"), num_shots: int = 5000, hostile_counts=(0, 1, 4),
                      controllers=(1, 4), time_limit_s: float = 60.0, attacker_nice: int = 0, rounds: int = 3,
                      attacker_idle: bool = False, engines=("python", "native"), controller: str = "native",
                      busy_controls: bool = True, say: Callable[[str], None] | None = None) -> list[dict]:
    """The rows of both tables (see the module docstring); each measurement stops after
    ``num_shots`` or ``time_limit_s`` (a starved host), its row says how many shots it took.
    The hostile cases take turns ``rounds`` times, each time with a slice of the shots.
    ``attacker_nice``: the hostile clients' nice level (0: the service's own priority; on a
    host of two cores a flooding client at that priority takes a core from the service and
    the controller, which a real attacker, on a host of its own, does not). ``attacker_idle``:
    the hostile clients run under ``SCHED_IDLE``, only on a CPU nothing else wants: the closer
    stand-in for attackers on hosts of their own (a nice-19 process, once running, keeps its
    CPU for its time slice — milliseconds under the EEVDF scheduler — before a woken
    controller gets it, which is the host's delay, not the service's). ``engines``: the
    service's engines, each measured with the same clients (``"native"``: a C core per session,
    see :mod:`qlink.qec._native_sessions`). ``controller``: the well-behaved controllers'
    engine (see :func:`_play`). ``busy_controls``: beside n hostile clients, a control case of
    n processes that only spin on a CPU (same priority, no traffic): what the hostile rows owe
    to the CPU they take from the host rather than to what they send
    (``p99_vs_busy_control``)."""
    if controller not in ("native", "python"):
        raise ValueError(f"controller must be 'native' or 'python', got {controller!r}")

    from ._hostile_clients import HostileProcess

    say = say or (lambda msg: None)
    dem, shots = _code(num_shots)
    rows: list[dict] = []
    for engine in engines:
        for tr in transports:
            rows += _transport_rows(engine, tr, dem, shots, controller=controller, hostile_counts=hostile_counts,
                                    controllers=controllers, time_limit_s=time_limit_s, attacker_nice=attacker_nice,
                                    rounds=rounds, attacker_idle=attacker_idle, say=say,
                                    busy_controls=busy_controls)
    return rows


def _cases(tr: str, hostile_counts, busy_controls: bool) -> list[tuple]:
    """The cases that take turns: ``(n, kinds)`` for n hostile clients of the transport's
    mix, and, with ``busy_controls``, ``("busyN", kinds)`` for N processes that only spin
    (the control beside N hostile clients; each round's turns and the rows start with them).

    >>> _cases("tcp", (0, 1), True)
    [('busy1', ('busy_loop',)), (0, ()), (1, ('tcp_flood',))]
    """
    controls = [(f"busy{k}", ("busy_loop",) * k) for k in hostile_counts if k] if busy_controls else []
    return controls + [(k, tuple(HOSTILE_MIX[tr][:k])) for k in hostile_counts]


def _case_text(case, kinds) -> str:
    if isinstance(case, str):
        return f"control: {len(kinds)} busy loop(s), no traffic"
    return f"{case} hostile client(s) {list(kinds)}"


def _transport_rows(engine: str, tr: str, dem, shots: _Shots, *, controller: str, hostile_counts, controllers,
                    time_limit_s: float, attacker_nice: int, rounds: int, attacker_idle: bool,
                    say: Callable[[str], None], busy_controls: bool = True) -> list[dict]:
    """Both tables' rows of one engine over one transport, from one service process."""
    from qlink.qec import start_service_process

    from ._hostile_clients import HostileProcess

    num_obs = dem.num_observables
    num_shots = len(shots)
    rows: list[dict] = []
    with start_service_process(_URLS[tr], {0: {"source": SPEC, "decoder": "pymatching"}},
                               session_limits={"max_sessions": 256}, service_options={"engine": engine}) as svc:
        # the cases take turns, ``rounds`` times, each a slice of the shots: a drift of the
        # host's state over the run falls on every case alike, not on the one measured then
        cases = _cases(tr, hostile_counts, busy_controls)
        plays: dict = {c: [] for c, _ in cases}
        seen: dict = {c: [] for c, _ in cases}
        per = -(-num_shots // rounds)
        for r in range(rounds):
            chunk = slice(r * per, (r + 1) * per)
            for case, kinds in cases:
                say(f"bench hostile: {engine} engine, {tr}, {_case_text(case, kinds)}, round {r + 1} of {rounds}")
                attackers = [HostileProcess(kind, svc.url, count=_COUNTS.get(kind, 1), nice=attacker_nice,
                                            idle=attacker_idle) for kind in kinds]
                try:
                    time.sleep(0.5 if kinds else 0)
                    plays[case].append(_play(svc.url, shots[chunk], num_obs, controller=controller,
                                             warmup=200 if r == 0 else 50, time_limit_s=time_limit_s / rounds))
                finally:
                    seen[case].append([a.stop() for a in attackers])
        summaries = {case: _summary(plays[case]) for case, _ in cases}
        base = summaries[0]["p99_us"] if 0 in summaries else None
        for case, kinds in cases:
            m = summaries[case]
            busy = isinstance(case, str)
            k = len(kinds)
            row = {"table": "hostile", "engine": engine, "controller": controller, "transport": tr,
                   "hostile_clients": 0 if busy else k, "busy_loops": k if busy else 0,
                   "case": _case_text(case, kinds), "kinds": "+".join(kinds) or "-", "controllers": 1,
                   "attacker_nice": attacker_nice, "attacker_idle": attacker_idle, "rounds": rounds, **m}
            row["p99_vs_none"] = m["p99_us"] / base if base else float("nan")
            hostile = bool(k) and not busy
            row["goal"] = f"<= {_GOAL_RATIO:g}" if hostile else ""
            row["meets_goal"] = (row["p99_vs_none"] <= _GOAL_RATIO) if hostile else None
            ctl = summaries[f"busy{k}"]["p99_us"] if hostile and f"busy{k}" in summaries else None
            row["p99_vs_busy_control"] = m["p99_us"] / ctl if ctl else None
            row["hostile_saw"] = "; ".join(f"{kind}: {_merged([rs[i] for rs in seen[case]])}"
                                           for i, kind in enumerate(kinds)) or "-"
            rows.append(row)
        alone = None
        for n in controllers:
            say(f"bench hostile: {engine} engine, {tr}, {n} well-behaved controller(s) at once")
            res = _several(svc.url, n, max(500, num_shots // 2), num_obs, time_limit_s, controller)
            errs = [r["error"] for r in res if "error" in r]
            good = [r for r in res if "error" not in r]
            row = {"table": "controllers", "engine": engine, "controller": controller, "transport": tr,
                   "hostile_clients": 0, "controllers": n,
                   "shots": sum(r["shots"] for r in good),
                   "p50_us": max((r["p50_us"] for r in good), default=float("nan")),
                   "p99_us": max((r["p99_us"] for r in good), default=float("nan")),
                   "p50_us_best": min((r["p50_us"] for r in good), default=float("nan")),
                   "total_frames_per_s": sum(r["frames_per_s"] for r in good),
                   "bit_identical": bool(good) and all(r["bit_identical"] for r in good)}
            if n == 1:
                alone = row
            if alone is not None:
                row["frames_per_s_vs_one"] = row["total_frames_per_s"] / alone["total_frames_per_s"]
                row["p99_vs_one"] = row["p99_us"] / alone["p99_us"]
            if errs:
                row["error"] = errs[0]
            rows.append(row)
        svc.close()
    return rows


def main_from_cli(args, *, say: Callable[[str], None] = print) -> list[dict]:
    """``qlink bench hostile [--quick] [--out DIR]``: both tables, JSON and CSV."""
    import os
    from pathlib import Path

    from .report import CONSOLE_WIDTH, format_table, write_results

    quick = bool(getattr(args, "quick", False))
    shots = 6000 if quick else 15000
    nice = int(getattr(args, "attacker_nice", 0) or 0)
    idle = bool(getattr(args, "attacker_idle", False))
    given = getattr(args, "engines", None)  # (the CLI hands lists on as "a,b")
    engines = tuple(x.strip() for x in str(given).split(",") if x.strip()) if given else ("python", "native")
    controller = getattr(args, "controller", None) or "native"
    controls = not bool(getattr(args, "no_controls", False))
    rows = run_hostile_bench(num_shots=shots, time_limit_s=20.0 if quick else 60.0, attacker_nice=nice,
                             attacker_idle=idle, engines=engines, controller=controller, busy_controls=controls,
                             say=say)
    out = Path(getattr(args, "out", "results/bench"))
    meta = {"num_shots": shots, "code": SPEC, "goal": f"p99 with hostile clients <= {_GOAL_RATIO:g} x p99 without",
            "reaction": ("native lock-step controller, a frame per round: the last round's frame emitted -> its "
                         "correction applied" if controller == "native" else
                         "Python lock-step controller, a frame per shot: the frame handed to the transport -> its "
                         "correction received"),
            "rounds": 3,
            "host": os.uname().nodename, "cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "hostile_mix": {k: list(v) for k, v in HOSTILE_MIX.items()}, "attacker_nice": nice,
            "attacker_idle": idle, "engines": list(engines), "controller": controller, "busy_controls": controls}
    write_results(rows, out_dir=out, name="hostile", meta=meta)
    h = [r for r in rows if r["table"] == "hostile"]
    c = [r for r in rows if r["table"] == "controllers"]
    print(f"\nA well-behaved controller beside hostile clients (d=5, load {meta['load_avg_1m']:.2f} on "
          f"{meta['cores']} cores; {controller} controller; attackers at nice {nice}"
          f"{', SCHED_IDLE' if idle else ''}); goal p99 <= "
          f"{_GOAL_RATIO:g} x p99 without")
    def _shown(rows_: list[dict], names: dict) -> str:  # short headings: the console fits 100 columns
        return format_table([{v: r.get(k) for k, v in names.items()} for r in rows_], columns=list(names.values()),
                            max_width=CONSOLE_WIDTH)

    for r in h:
        r["clients"] = f"{r['busy_loops']} busy" if r.get("busy_loops") else r["hostile_clients"]
    print(_shown(h, {"engine": "engine", "transport": "transport", "clients": "hostile", "shots": "shots",
                     "p50_us": "p50 us", "p99_us": "p99 us", "p99_vs_none": "p99 x none",
                     "p99_vs_busy_control": "x busy", "meets_goal": "goal met", "bit_identical": "bit-exact",
                     "retransmits": "resent"}))
    print("  (\"n busy\": the control, n processes that only spin on a CPU at the attackers' priority, no\n"
          "   traffic; \"x busy\": a hostile row's p99 over its control's. The hostile mix of each row, and\n"
          "   every column, are in the JSON/CSV)")
    print("\nWell-behaved controllers at once (per-controller worst p50/p99; total frames/s)")
    print(_shown(c, {"engine": "engine", "transport": "transport", "controllers": "ctrls", "shots": "shots", "p50_us_best": "best p50",
                     "p50_us": "p50 us", "p99_us": "p99 us", "p99_vs_one": "p99 x one",
                     "total_frames_per_s": "frames/s", "frames_per_s_vs_one": "x one", "bit_identical": "bit-exact",
                     **({"error": "error"} if any("error" in r for r in c) else {})}))
    print(f"\nwritten: {out}/hostile.{{json,csv}}")
    return rows
