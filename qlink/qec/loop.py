"""The closed QEC loop in two processes: a decoder service and a controller emulator.

:func:`run_loop` starts :func:`~qlink.qec.run_service_process` in a spawned
child listening on the transport URL (a thread instead, for transports that cannot
cross processes, such as ``inproc``), connects a :class:`~qlink.qec.controller.Controller`,
plays ``num_shots`` shots at the cycle time, gathers both sides' stage histograms
(the child sends its report back as JSON) and returns a frozen :class:`LoopResult`:
the logical error rate with its interval, reaction-time percentiles, the per-stage
shares (transport / queue / decode), the backlog trace, and the transport that
actually carried the bytes.

The syndrome source is described by plain data (a *source spec*), so the child can
rebuild the same DEM without anything but numbers crossing the process boundary::

    {"kind": "stim", "code": "surface_code:rotated_memory_z", "distance": 5,
     "rounds": 5, "p": 0.001}

or a user's own circuit: ``run_loop(source="memory.stim")`` (or a ``stim.Circuit``; see
:func:`~qlink.qec.specs.circuit_spec`), the file read by both sides and refused, with a
:class:`~qlink.qec.sources.CircuitError` naming it, when it is missing, is not a circuit,
or lacks detectors or observables.

>>> spec = source_spec(distance=3, rounds=3, p=0.001)
>>> src = build_source(spec)
>>> src.dem.num_detectors, int(np.asarray(src.round_of_detector).max())
(24, 3)
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from qlink.errors import BrokenLinkError

from ._checks import knob as _knob
from .controller import DEFAULT_CYCLE_NS, Controller, ControllerResult
from .specs import build_source, circuit_spec, source_spec, spec_and_source
from .stream import SyndromeStream, sample_stream
from .timeline import SERVICE_SHOT_FIELDS, ShotRecords, histogram_summary, join_shots, stage_summary

__all__ = [
    "source_spec",
    "circuit_spec",
    "build_source",
    "sample_stream",
    "run_loop",
    "LoopResult",
    "resolve_url",
]



def resolve_url(transport: str) -> str:
    """A URL for a transport name or URL: ``"tcp"`` → ``tcp://127.0.0.1:0``, ``"shm"`` →
    a fresh ``shm://`` name (:func:`transports.loopback_url`); a full URL is returned unchanged.

    >>> resolve_url("tcp"), resolve_url("tcp://127.0.0.1:5555")
    ('tcp://127.0.0.1:0', 'tcp://127.0.0.1:5555')
    """
    import transports

    return transports.loopback_url(transport, tag="qlink-loop")


@dataclass(frozen=True)
class LoopResult:
    """One closed-loop run. Times in ns; ``*_us`` in µs; every figure *measured* on this
    machine except ``modeled_controller_ns`` (cited controller delays, never added in)."""

    transport: str  # the transport that carried the bytes (from the endpoint)
    basis: str  # "measured", or "modeled" when the transport delivers at modeled link times
    url: str
    decoder: str
    source: dict
    num_shots: int
    num_rounds: int
    cycle_ns: int
    rounds_per_frame: int
    frames_per_shot: int
    shots_per_frame: int
    shots_ok: int
    logical_errors: int
    shots_dropped: int
    logical_error_rate: float
    ler_interval: tuple
    reaction_p50_ns: float
    reaction_p99_ns: float
    reaction_p999_ns: float
    shares: dict  # batch / transport / queue / decode / other: fractions of the mean reaction time
    stage_breakdown: dict  # per stage p50 and share (joined per-shot records)
    late_frames: int
    max_lag_ns: int
    deadline_misses: int
    decoded_rounds_per_s: float
    required_rounds_per_s: float
    backlog_final_rounds: int
    backlog_max_rounds: int
    backlog_slope_rounds_per_s: float  # fitted over the second half of the emission
    backlog_growth_rounds: float  # that slope times that half's duration
    emit_lag_p99_ns: float  # how late the controller sent its frames (p99)
    keeps_up: bool  # the loop sustained the cycle: backlog_flat (flat and bounded), and >= 99 % of the cycle rate
    controller: ControllerResult = field(repr=False)
    service: dict = field(repr=False)
    modeled_controller_ns: dict = field(default_factory=dict)
    backlog_flat: bool = False  # the decoder side alone: nothing dropped, the backlog did not grow over the
    # second half of the emission and never exceeded max(16 frames' rounds, 10 ms of the cycle's rounds)
    clock_on_time: bool = False  # the controller's own p99 tick lag within one frame interval (its jitter)
    engine: str = "python"  # "native": the per-frame path in C (qlink.qec.hotpath); "python"

    @property
    def backlog_trace(self) -> tuple[np.ndarray, np.ndarray]:
        """(time since the first tick in ns, rounds emitted − rounds answered)."""
        return self.controller.backlog_t_ns, self.controller.backlog_rounds

    def ler_at(self, deadlines_ns) -> np.ndarray:
        """LER(t): P(wrong, missing, or applied later than t) per deadline."""
        return self.controller.ler_at(deadlines_ns)

    def service_stage_summary(self) -> dict:
        return {k: histogram_summary(v) for k, v in self.service.get("stages", {}).items() if v.get("count")}

    def summary(self) -> dict:
        """The headline figures as a flat JSON-able dict."""
        lo, hi = self.ler_interval
        out = {
            "transport": self.transport, "engine": self.engine, "basis": self.basis, "decoder": self.decoder, "distance": self.source.get("distance"),
            "rounds": self.num_rounds, "p": self.source.get("p"), "shots": self.num_shots, "cycle_ns": self.cycle_ns,
            "rounds_per_frame": self.rounds_per_frame, "shots_per_frame": self.shots_per_frame,
            "ler": self.logical_error_rate, "ler_lo": lo, "ler_hi": hi,
            "errors": self.logical_errors, "dropped": self.shots_dropped,
            "reaction_p50_us": self.reaction_p50_ns / 1e3, "reaction_p99_us": self.reaction_p99_ns / 1e3,
            "reaction_p999_us": self.reaction_p999_ns / 1e3,
            "share_batch": self.shares.get("batch"),
            "share_transport": self.shares.get("transport"), "share_queue": self.shares.get("queue"),
            "share_decode": self.shares.get("decode"), "share_other": self.shares.get("other"),
            "late_frames": self.late_frames, "decoded_rounds_per_s": self.decoded_rounds_per_s,
            "required_rounds_per_s": self.required_rounds_per_s, "backlog_max_rounds": self.backlog_max_rounds,
            "backlog_slope_rounds_per_s": self.backlog_slope_rounds_per_s,
            "backlog_growth_rounds": self.backlog_growth_rounds, "emit_lag_p99_us": self.emit_lag_p99_ns / 1e3,
            "keeps_up": self.keeps_up, "backlog_flat": self.backlog_flat, "clock_on_time": self.clock_on_time,
            "deadline_misses": self.deadline_misses,
            "frames_joined": self.controller.frames_joined,  # sent behind another frame, the controller behind its clock
        }
        if self.source.get("kind") in ("stim_file", "stim_circuit"):  # a user's own circuit
            out["circuit"] = self.source.get("path", "stim.Circuit")
        return out


def _serve_in_thread(url: str, configs_spec, service_options, ready: list, out: dict, started: threading.Event):
    import transports

    from .service import DecoderConfig, DecoderService

    try:
        configs = {int(k): DecoderConfig.from_spec(v) for k, v in configs_spec.items()}
        svc = DecoderService(configs, **service_options)
        lis = transports.listen(url)
    except Exception as exc:  # reported to the caller through `out`
        out["error"] = f"{type(exc).__name__}: {exc}"
        started.set()
        return
    ready.append(lis.url)
    started.set()
    try:
        ep = lis.accept(timeout_s=30)
        try:
            rep = svc.serve(ep)
            rep["transport"] = ep.capabilities.name
            out.update(rep)
        finally:
            ep.close()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        lis.close()


def _service_fate(proc, thread_out: dict) -> str:
    if proc is None:
        return thread_out.get("error", "the service thread reported no error")
    proc.process.join(2)
    if proc.process.is_alive():
        return "the service process is still running"
    try:
        rep = proc.report(timeout_s=1)
    except Exception:
        return f"the service process exited with code {proc.process.exitcode} and sent no report"
    return f"the service process exited with code {proc.process.exitcode}: {rep.get('error', 'no error reported')}"


def _slope(t_ns: np.ndarray, v: np.ndarray) -> float:
    if len(t_ns) < 4:
        return 0.0
    half = len(t_ns) // 2
    t = t_ns[half:].astype(np.float64) / 1e9
    y = v[half:].astype(np.float64)
    if np.ptp(t) <= 0:
        return 0.0
    return float(np.polyfit(t, y, 1)[0])


def _p99(hist_dict) -> float:
    from qlink.histogram import LatencyHistogram

    if not hist_dict or not hist_dict.get("count"):
        return 0.0
    return float(LatencyHistogram.from_dict(hist_dict).percentile(99))


def run_loop(*, transport: str = "tcp", source, decoder: str = "pymatching",
             num_shots: int = 1000, cycle_ns: int = DEFAULT_CYCLE_NS, rounds_per_frame: int = 1,
             shots_per_frame: int = 1,
             seed: int | None = None, decoder_id: int = 0, feed_forward_deadline_ns: int | None = None,
             ack_enqueue: str = "errors", capacity_shots: int = 1024, keep_samples: int = 100_000,
             warmup_shots: int = 200, gap_cycles: int = 0, timeout_s: float = 300.0,
             stream: SyndromeStream | None = None, max_batch_requests: int = 256,
             max_in_flight_shots: int | None = None, controller_query: str | None = None,
             controller_options: Mapping[str, Any] | None = None, pin_cpus: bool = False,
             service_url: str | None = None, engine: str = "auto", service_ingest_cpu: int | None = None) -> LoopResult:
    """Run the closed loop: service in a child process (or thread), controller here.

    ``transport`` is a name (``tcp``, ``shm``, ``ucx``, ``udp``, ``inproc``) or a URL;
    ``source`` a source spec (see :func:`source_spec`), or a user's own circuit: a ``.stim``
    path or a ``stim.Circuit`` (its detectors streamed in the rounds their coordinates or
    TICK layers give, see :class:`~qlink.qec.sources.StimSource`); ``shots_per_frame`` > 1 sends
    that many whole shots per frame and asks their corrections at once (throughput
    for reaction time); ``warmup_shots`` extra shots
    played first (a separate stream, excluded from every figure) so imports and
    caches are warm; ``max_in_flight_shots`` throttles the controller to the
    decoder (for LER and throughput runs: it bends the cycle clock);
    ``controller_query`` is appended to the URL the controller connects with (for an
    ``emulated+…`` transport: faults on the controller's sends only, e.g.
    ``"drop=0.01&seed=3"``); ``controller_options`` go to the
    :class:`~qlink.qec.controller.Controller` (``get_timeout_ns``, ``poll_interval_ns`` …);
    ``pin_cpus`` puts the service process and the controller on different CPUs for
    the run (both busy-poll).

    ``service_url`` drives a decoder service that is already running instead of starting
    one: any server that speaks the CUDA-Q realtime decoder RPC on that transport (a
    ``udp://host:port`` one need not be qlink's), with decoder ``decoder_id`` configured
    for the DEM of ``source``, its counter at 0. The controller connects there (``transport``
    is then taken from the URL); the result holds the controller's figures only
    (``service`` is empty, and so are the stage shares that need the service's records).

    ``engine="native"`` runs both sides' per-frame work in C (:mod:`qlink.qec.hotpath`;
    shm, tcp and udp, one shot per frame group, no ``max_in_flight_shots``): each round its own
    frame on the cycle (``rounds_per_frame``), the shot decoded the moment its last round
    lands, and with ``feed_forward_deadline_ns`` the lock-step (feed-forward) loop.
    With ``service_ingest_cpu`` (native, shm) the service takes frames in on a thread of its own
    pinned to that CPU while its first thread only decodes (a throughput run's pipeline; see
    :class:`~qlink.qec.hotpath.NativeDecoderService`).
    ``"python"`` runs the Python service and controller (every transport and option);
    ``"auto"`` (the default) takes the native engine wherever it can serve the run over shm,
    tcp and udp (``result.engine`` says which ran).
    """
    import transports

    from ._service_process import start_service_process

    # checked before a service starts (the Controller checks the rest, and these again)
    _knob("timeout_s", timeout_s, 0, above=True)
    _knob("cycle_ns", cycle_ns, 1)
    if service_url is not None and (not isinstance(service_url, str) or "://" not in service_url):
        raise ValueError(f"service_url must be a transport URL such as 'udp://127.0.0.1:5000', got {service_url!r}")
    url = resolve_url(transport if service_url is None else service_url)
    if engine not in ("auto", "python", "native"):
        raise ValueError(f"engine must be 'auto', 'python' or 'native', got {engine!r}")
    refusal = _native_refusal(url, shots_per_frame=shots_per_frame, max_in_flight_shots=max_in_flight_shots,
                              controller_query=controller_query, service_url=service_url)
    if engine == "auto":  # (the Python engine's own controller options and whole-shot frames keep it)
        engine = "native" if refusal is None and rounds_per_frame >= 1 and not controller_options else "python"
    if engine == "native" and refusal is not None:
        raise ValueError(refusal)
    if service_ingest_cpu is not None and engine != "native":
        raise ValueError(f"service_ingest_cpu={service_ingest_cpu!r} needs engine='native' (the ingest thread is the "
                         f"native service's)")
    spec, src = spec_and_source(source)
    if stream is None:
        stream = sample_stream(src, num_shots=num_shots, seed=seed)
    elif stream.num_shots < num_shots:
        raise ValueError(f"stream has {stream.num_shots} shots, fewer than num_shots={num_shots}")
    elif (stream.num_detectors, stream.num_observables) != (src.dem.num_detectors, src.dem.num_observables):
        raise ValueError(f"stream shots have {stream.num_detectors} detectors and {stream.num_observables} "
                         f"observables; the source's circuit has {src.dem.num_detectors} and "
                         f"{src.dem.num_observables}: sample the stream from the same source (sample_stream)")
    stream = stream.take(num_shots)
    caps = transports.capabilities(url)
    # as the controller will cut them: no frame larger than one message of the transport
    frames_per_shot = len(stream.frames(rounds_per_frame=0 if shots_per_frame > 1 else rounds_per_frame,
                                        max_frame_nbytes=caps.max_message_bytes))
    configs_spec = {decoder_id: {"source": spec, "decoder": decoder, "capacity_shots": int(capacity_shots),
                                 "frames_per_shot": frames_per_shot}}
    service_options = {"ack_enqueue": ack_enqueue, "keep_samples": int(keep_samples) + int(warmup_shots),
                       "max_batch_requests": int(max_batch_requests)}
    if engine == "native":
        service_options["engine"] = "native"
        if service_ingest_cpu is not None:
            service_options["ingest_cpu"] = service_ingest_cpu
    proc = thread = None
    thread_out: dict = {}
    if service_url is not None:
        bound = url  # a service already running: nothing to start
        thread_out["error"] = f"no report: the service at {url} was not started by run_loop"
    elif caps.cross_process:
        proc = start_service_process(url, configs_spec, service_options=service_options, max_peers=1,
                                     timeout_s=timeout_s + 60, pin_cpu=1 if pin_cpus else None)
        bound = proc.url
    else:
        ready: list = []
        started = threading.Event()
        thread = threading.Thread(target=_serve_in_thread, name="qlink-decoder-service", daemon=True,
                                  args=(url, configs_spec, service_options, ready, thread_out, started))
        thread.start()
        started.wait(60)
        if not ready:
            raise RuntimeError(f"the decoder service failed to start: {thread_out.get('error', 'no reason given')}")
        bound = ready[0]
    # Service and controller as two threads of one process busy-poll under one GIL: switch
    # between them every 20 us rather than every 5 ms while the loop runs.
    old_switch = sys.getswitchinterval()
    if thread is not None:
        sys.setswitchinterval(2e-5)
    pinned_before = None
    if pin_cpus and proc is not None:
        from qlink.procs import pin_to_cpu

        pinned_before = pin_to_cpu(0)
    try:
        connect_url = bound
        if controller_query:
            connect_url += ("&" if "?" in bound else "?") + controller_query.lstrip("?&")
        ep = transports.connect(connect_url, timeout_s=30)
        try:
            ctl_kw = dict(decoder_id=decoder_id, cycle_ns=cycle_ns, rounds_per_frame=rounds_per_frame,
                          shots_per_frame=shots_per_frame,
                          gap_cycles=gap_cycles, feed_forward_deadline_ns=feed_forward_deadline_ns,
                          max_in_flight_shots=max_in_flight_shots, **dict(controller_options or {}))
            counter, rid, get_rid = 0, 0, 0
            make = Controller
            if engine == "native":
                from .hotpath import NativeController

                make = NativeController
                ctl_kw = dict(decoder_id=decoder_id, cycle_ns=cycle_ns, rounds_per_frame=rounds_per_frame,
                              gap_cycles=gap_cycles, feed_forward_deadline_ns=feed_forward_deadline_ns,
                              **dict(controller_options or {}))
            if engine == "native":  # built first (its frames prebuilt), played right after the warm-up
                ctl = make(ep, stream, keep_lag_frames=min(stream.num_shots * frames_per_shot, 4_000_000), **ctl_kw)
            if warmup_shots > 0:
                warm_stream = sample_stream(src, num_shots=warmup_shots,
                                            seed=None if seed is None else seed + 7919)
                warm = make(ep, warm_stream, **ctl_kw)
                warm.run(timeout_s=timeout_s)
                counter, rid, get_rid = warm.counter, warm.next_request_id, warm.next_get_request_id
                if engine == "native":
                    ctl.continue_after(warm)
            if engine != "native":
                ctl = Controller(ep, stream, keep_samples=keep_samples, counter_start=counter,
                                 request_id_start=rid, get_request_id_start=get_rid, **ctl_kw)
            try:
                cres = ctl.run(timeout_s=timeout_s)
            except BrokenLinkError as exc:
                raise BrokenLinkError(f"the decoder service went away mid-run: {_service_fate(proc, thread_out)}") \
                    from exc
            transport_name = ep.capabilities.name
        finally:
            ep.close()
        if proc is not None:
            srep = proc.report(timeout_s=60)
        elif thread is not None:
            thread.join(60)
            srep = thread_out
        else:
            srep = {}  # a service of its own: it reports nothing here
    finally:
        sys.setswitchinterval(old_switch)
        if pinned_before is not None:
            os.sched_setaffinity(0, pinned_before)
        if proc is not None:
            proc.close()
    if "error" in srep and not srep.get("counts"):
        raise RuntimeError(f"the decoder service failed: {srep['error']}")
    return _assemble(cres, srep, transport_name=transport_name, url=bound, decoder=decoder, spec=spec,
                     rounds_per_frame=rounds_per_frame, shots_per_frame=shots_per_frame, engine=engine)


def _native_refusal(url: str, *, shots_per_frame, max_in_flight_shots, controller_query, service_url) -> str | None:
    """Why the native engine cannot serve this run (None: it can)."""
    from .hotpath import available

    why = available()
    if why is not None:
        return f"engine='native' is not available here: {why}"
    if not url.startswith(("shm://", "tcp://", "udp://", "ucx://")):
        return (f"engine='native' runs over shm://, tcp://, udp:// and ucx:// only, got {url!r} (use engine='python' "
                "for it)")
    for name, v, ok in (("shots_per_frame", shots_per_frame, shots_per_frame == 1),
                        ("max_in_flight_shots", max_in_flight_shots, max_in_flight_shots is None),
                        ("controller_query", controller_query, controller_query is None),
                        ("service_url", service_url, service_url is None)):
        if not ok:
            return f"engine='native' does not take {name}={v!r} (the Python engine does)"
    return None


def _assemble(cres: ControllerResult, srep: dict, *, transport_name: str, url: str, decoder: str, spec: dict,
              rounds_per_frame: int, shots_per_frame: int, engine: str = "python") -> LoopResult:
    if cres.shot_records is not None and "shots" in srep:
        svc_shots = ShotRecords.from_dict(SERVICE_SHOT_FIELDS, srep["shots"])
        breakdown = stage_summary(join_shots(cres.shot_records, svc_shots))
    else:
        breakdown = stage_summary({})
    p50, p99, p999 = (float(v) for v in cres.reaction_percentiles_ns((50, 99, 99.9)))
    bl_t, bl_v = cres.backlog_t_ns, cres.backlog_rounds
    # Backlog samples are taken as frames go out, plus one after the last answer: fit the
    # second half of the emission (the last sample is after it).
    em_t, em_v = (bl_t[:-1], bl_v[:-1]) if len(bl_t) > 1 else (bl_t, bl_v)
    slope = _slope(em_t, em_v)
    required = 1e9 / cres.cycle_ns
    spf = max(1, shots_per_frame)
    frame_interval_ns = cres.cycle_ns * cres.num_rounds * spf / max(1, cres.frames_per_shot)
    lag_p99 = _p99(cres.stages.get("emit_lag"))
    half_s = (em_t[-1] - em_t[len(em_t) // 2]) / 1e9 if len(em_t) > 1 else 0.0
    growth = max(0.0, slope) * half_s
    # Keeping up (sustaining the cycle): nothing dropped; a backlog that grew, over the
    # second half of the emission, by no more than 4 frames' worth of rounds plus 5 % of
    # the rounds emitted meanwhile; and every round answered at >= 99 % of the cycle rate
    # over the whole run. Apart from it, whether the controller (the QPU emulator) also
    # sent 99 % of its frames within one frame interval of their tick: its own jitter,
    # which on shared vCPUs is the host's preemption (qlink.bench.floor.cpu_availability)
    # more than the loop's -- a late frame is sent at once and the schedule does not slip.
    # ... and a backlog bounded all along, not only flat at the end: at most 16 frames' worth
    # of rounds or 10 ms of the cycle's rounds, whichever is more (a backlog of 178 k rounds
    # built in the first half and carried flat is not keeping up).
    bound = max(16 * spf * cres.num_rounds, 0.010 * required)
    backlog_max = int(bl_v.max()) if len(bl_v) else 0
    backlog_flat = bool(cres.shots_dropped == 0 and growth <= 4 * spf * cres.num_rounds + 0.05 * required * half_s
                        and backlog_max <= bound)
    keeps_up = backlog_flat and cres.decoded_rounds_per_s >= 0.99 * required
    clock_on_time = bool(lag_p99 <= frame_interval_ns)
    return LoopResult(
        transport=transport_name, basis="modeled" if transport_name.startswith("emulated") else "measured",
        url=url, decoder=decoder, source=dict(spec), num_shots=cres.num_shots,
        num_rounds=cres.num_rounds, cycle_ns=cres.cycle_ns, rounds_per_frame=rounds_per_frame,
        frames_per_shot=cres.frames_per_shot, shots_per_frame=shots_per_frame, shots_ok=cres.shots_ok, logical_errors=cres.logical_errors,
        shots_dropped=cres.shots_dropped, logical_error_rate=cres.logical_error_rate,
        ler_interval=cres.ler_interval(), reaction_p50_ns=p50, reaction_p99_ns=p99, reaction_p999_ns=p999,
        shares=breakdown["shares"], stage_breakdown=breakdown, late_frames=cres.late_frames,
        max_lag_ns=cres.max_lag_ns, deadline_misses=cres.deadline_misses,
        decoded_rounds_per_s=cres.decoded_rounds_per_s, required_rounds_per_s=required,
        backlog_final_rounds=int(bl_v[-1]) if len(bl_v) else 0, backlog_max_rounds=int(bl_v.max()) if len(bl_v) else 0,
        backlog_slope_rounds_per_s=slope, backlog_growth_rounds=growth, emit_lag_p99_ns=lag_p99,
        keeps_up=keeps_up, backlog_flat=backlog_flat, clock_on_time=clock_on_time, controller=cres, service=srep,
        modeled_controller_ns=dict(cres.modeled_controller_ns), engine=engine,
    )
