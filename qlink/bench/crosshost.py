"""The QEC loop across two hosts: decoder service on host A, controller on host B.

On one machine the two hosts are network namespaces joined by a veth pair
(:func:`qlink.netns.two_hosts`, root only): the decoder service listens on A's address
(``tcp://10.233.0.1:PORT`` or ``ucx://…``; UCX over its TCP transport on the veth), the
controller emulator in B streams syndrome rounds to it and times each correction. The
bytes cross a real (virtual) link with the kernel's full network stack on both sides,
as between two hosts; what they do not cross is a NIC, a cable or a switch.

:func:`run_crosshost_loop` returns the reaction-time percentiles, the logical errors,
whether every correction equals the decoder called directly on the same shots
(bit-identical), and the clock offset between the hosts estimated over the same
transport (:func:`qlink.clock.estimate_offset`, ping-pong midpoints). The namespaces
share the kernel's monotonic clock, so the true offset is 0: the estimate must lie
within its error bound of 0.

:func:`crosshost_bench` puts those figures beside the same loop over shared memory and
over TCP loopback, each a process pair in one namespace (:func:`qlink.qec.loop.run_loop`).

The functions ``serve_decoder``, ``run_controller``, ``clock_echo`` and ``clock_probe``
run inside the namespaces (started by :meth:`qlink.netns.Host.start`); their arguments
and results are JSON.
"""

from __future__ import annotations

import base64
import struct
from typing import Callable

import numpy as np

__all__ = ["run_crosshost_loop", "crosshost_bench", "main_from_cli", "serve_decoder", "run_controller",
           "clock_echo", "clock_probe", "transport_env"]

_NS = struct.Struct("<q")


def transport_env(transport: str, host) -> dict:
    """Environment for a process of ``host`` using ``transport``: UCX over TCP on the veth only."""
    if transport == "ucx":
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": host.ifname}
    return {}


# ---------------------------------------------------------------------- inside host A


class _Ready:
    """A ``ready_queue`` for :func:`~qlink.qec.run_service_process` that emits instead."""

    def __init__(self, emit: Callable) -> None:
        self._emit = emit

    def put(self, msg: str) -> None:
        self._emit({"ready": msg})


def serve_decoder(*, url: str, configs_spec: dict, service_options: dict, accept_timeout_s: float = 60.0,
                  emit: Callable) -> dict:
    """Run the decoder service on ``url`` for one controller; emit ``{"ready": bound_url}``; return its counts."""
    from qlink.qec import run_service_process

    rep = run_service_process(url, {int(k): v for k, v in configs_spec.items()}, ready_queue=_Ready(emit),
                              accept_timeout_s=accept_timeout_s, service_options=service_options,
                              # the address is on a veth pair between two private network
                              # namespaces of this run: nothing outside them can reach it
                              insecure=True)
    return {k: rep.get(k) for k in ("counts", "faults", "statuses", "transport", "error") if k in rep}


def clock_echo(*, url: str, accept_timeout_s: float = 60.0, emit: Callable) -> int:
    """Answer every 8-byte ping on ``url`` with this host's :func:`~qlink.clock.now_ns`; return pings answered."""
    import transports
    from qlink.clock import now_ns
    from qlink.errors import BrokenLinkError, ClosedError

    buf = bytearray(64)
    out = bytearray(_NS.size)
    answered = 0
    with transports.listen(url) as lis:
        emit({"ready": lis.url})
        ep = lis.accept(timeout_s=accept_timeout_s)
        try:
            while True:
                try:
                    ep.recv_into(buf, timeout_s=30)
                except (BrokenLinkError, ClosedError):
                    break
                _NS.pack_into(out, 0, now_ns())
                ep.send(out)
                answered += 1
        finally:
            ep.close()
    return answered


# ---------------------------------------------------------------------- inside host B


def clock_probe(*, url: str, num_samples: int = 200) -> dict:
    """Estimate host A's clock offset over ``url`` (Cristian's method, best of ``num_samples``)."""
    import transports
    from qlink.clock import estimate_offset

    ping = bytearray(_NS.size)
    buf = bytearray(64)
    with transports.connect(url, timeout_s=30) as ep:
        def ping_fn() -> int:
            ep.send(ping)
            ep.recv_into(buf, timeout_s=10)
            return _NS.unpack_from(buf)[0]

        for _ in range(20):  # warm the path before sampling
            ping_fn()
        est = estimate_offset(ping_fn, num_samples=int(num_samples))
        transport = ep.capabilities.name
    return {"offset_ns": int(est.offset_ns), "error_bound_ns": int(est.error_bound_ns), "transport": transport,
            "num_samples": int(num_samples)}


def run_controller(*, url: str, source: dict, num_shots: int, seed: int, cycle_ns: int, rounds_per_frame: int = 1,
                   warmup_shots: int = 200, max_in_flight_shots: int | None = None, timeout_s: float = 300.0) -> dict:
    """Play ``num_shots`` shots (after ``warmup_shots``) against the service at ``url``; return the figures."""
    import transports
    from qlink.qec.controller import Controller
    from qlink.qec.loop import build_source, sample_stream

    src = build_source(source)
    stream = sample_stream(src, num_shots=num_shots, seed=seed)
    kw = dict(cycle_ns=int(cycle_ns), rounds_per_frame=int(rounds_per_frame), max_in_flight_shots=max_in_flight_shots)
    with transports.connect(url, timeout_s=30) as ep:
        counter = rid = 0
        if warmup_shots > 0:
            warm = Controller(ep, sample_stream(src, num_shots=warmup_shots, seed=seed + 7919), **kw)
            warm.run(timeout_s=timeout_s)
            counter, rid = warm.counter, warm.next_request_id
        ctl = Controller(ep, stream, counter_start=counter, request_id_start=rid, **kw)
        res = ctl.run(timeout_s=timeout_s)
        transport = ep.capabilities.name
    p50, p99, p999 = (float(v) for v in res.reaction_percentiles_ns((50, 99, 99.9)))
    corr = np.ascontiguousarray(res.corrections, dtype=np.uint8)
    return {
        "transport": transport, "num_shots": res.num_shots, "shots_ok": res.shots_ok,
        "logical_errors": res.logical_errors, "shots_dropped": res.shots_dropped, "shots_failed": res.shots_failed,
        "late_frames": res.late_frames, "reaction_p50_ns": p50, "reaction_p99_ns": p99, "reaction_p999_ns": p999,
        "answered": (res.correct >= 0).astype(np.uint8).tobytes().hex(),
        "corrections_shape": list(corr.shape), "corrections_b64": base64.b64encode(corr.tobytes()).decode(),
    }


# ---------------------------------------------------------------------- the parent


def _direct_corrections(source: dict, decoder: str, *, num_shots: int, seed: int) -> np.ndarray:
    from qlink.qec.decoders import compile_decoder
    from qlink.qec.loop import build_source, sample_stream

    src = build_source(source)
    stream = sample_stream(src, num_shots=num_shots, seed=seed)
    packed = np.packbits(stream.detectors, axis=1, bitorder="little")
    return np.asarray(compile_decoder(decoder, src.dem).decode_shots_bit_packed(packed), dtype=np.uint8)


def run_crosshost_loop(hosts, *, transport: str = "tcp", source: dict | None = None, decoder: str = "pymatching",
                       num_shots: int = 2000, seed: int = 1, cycle_ns: int | None = None, rounds_per_frame: int = 1,
                       warmup_shots: int = 200, max_in_flight_shots: int | None = 1, clock_samples: int = 200,
                       timeout_s: float = 300.0) -> dict:
    """Decoder service in ``hosts.a``, controller in ``hosts.b``, over ``transport`` (``tcp`` or ``ucx``).

    ``hosts``: a :class:`qlink.netns.TwoHosts`. ``max_in_flight_shots`` (default 1: each
    shot's correction arrives before the next shot starts, so the reaction time is the
    path's, not a queue's; None plays the cycle clock regardless). Returns the controller's figures, the
    service's counts, ``bit_identical`` (every answered correction equals direct decoding
    of the same shots), ``answered`` and the clock-offset estimate (``offset_ns``,
    ``error_bound_ns``) over the same transport between the same two hosts.
    """
    from qlink.qec.controller import DEFAULT_CYCLE_NS
    from qlink.qec.loop import build_source, sample_stream, source_spec

    if transport not in ("tcp", "ucx"):
        raise ValueError(f"transport must be 'tcp' or 'ucx' across hosts, got {transport!r}")
    source = dict(source or source_spec(distance=3, rounds=3, p=0.001))
    cycle_ns = DEFAULT_CYCLE_NS if cycle_ns is None else int(cycle_ns)
    frames = len(sample_stream(build_source(source), num_shots=1, seed=0).frames(rounds_per_frame=rounds_per_frame))
    configs = {"0": {"source": source, "decoder": decoder, "capacity_shots": 1024, "frames_per_shot": frames}}
    env_a, env_b = transport_env(transport, hosts.a), transport_env(transport, hosts.b)
    url = f"{transport}://{hosts.a.address}:0"

    svc = hosts.a.start("qlink.bench.crosshost:serve_decoder", dict(
        url=url, configs_spec=configs, service_options={"ack_enqueue": "errors", "keep_samples": 0}), env=env_a)
    try:
        bound = svc.receive(timeout_s=120)["ready"]
        if bound.startswith("error:"):
            raise RuntimeError(f"the decoder service in {hosts.a.name} failed to start: {bound[7:]}")
        ctl = hosts.b.call("qlink.bench.crosshost:run_controller", dict(
            url=bound, source=source, num_shots=num_shots, seed=seed, cycle_ns=cycle_ns,
            rounds_per_frame=rounds_per_frame, warmup_shots=warmup_shots, max_in_flight_shots=max_in_flight_shots,
            timeout_s=timeout_s),
            env=env_b, timeout_s=timeout_s + 60)
        service = svc.result(timeout_s=60)
    finally:
        svc.close()

    echo = hosts.a.start("qlink.bench.crosshost:clock_echo", {"url": url}, env=env_a)
    try:
        echo_url = echo.receive(timeout_s=120)["ready"]
        clock = hosts.b.call("qlink.bench.crosshost:clock_probe", {"url": echo_url, "num_samples": clock_samples},
                             env=env_b, timeout_s=120)
        echo.result(timeout_s=30)
    finally:
        echo.close()

    corr = np.frombuffer(base64.b64decode(ctl.pop("corrections_b64")), dtype=np.uint8).reshape(
        ctl.pop("corrections_shape"))
    answered = np.frombuffer(bytes.fromhex(ctl.pop("answered")), dtype=np.uint8).astype(bool)
    direct = _direct_corrections(source, decoder, num_shots=num_shots, seed=seed)
    identical = bool(answered.all() and np.array_equal(corr, direct))
    return {**ctl, "url": bound, "host_a": hosts.a.name, "host_b": hosts.b.name, "decoder": decoder,
            "source": source, "cycle_ns": cycle_ns, "max_in_flight_shots": max_in_flight_shots,
            "bit_identical": identical,
            "answered_shots": int(answered.sum()), "service": service, "clock": clock}


def crosshost_bench(*, transports=("tcp", "ucx"), distance: int = 3, p: float = 0.001, num_shots: int = 5000,
                    seed: int = 1, decoder: str = "pymatching", baselines=("shm", "tcp"),
                    max_in_flight_shots: int | None = 1, progress: Callable[[str], None] = print) -> list[dict]:
    """Reaction time across two namespaces per transport, beside one-namespace process pairs.

    One row per case: ``case``, ``transport``, ``reaction_p50_us``, ``reaction_p99_us``,
    ``reaction_p999_us``, ``logical_errors``, ``bit_identical`` (cross-host rows),
    ``clock_offset_ns`` and ``clock_error_bound_ns`` (cross-host rows). Both ends
    busy-poll: on a 2-core machine the two processes fill both cores. Every case runs
    with the same ``max_in_flight_shots`` (default 1: path latency, no queueing).
    """
    from qlink.netns import two_hosts
    from qlink.qec.loop import run_loop, source_spec

    source = source_spec(distance=distance, rounds=distance, p=p)
    rows = []
    for name in baselines:
        progress(f"baseline: {name}, one namespace, {num_shots} shots")
        res = run_loop(transport=name, source=source, decoder=decoder, num_shots=num_shots, seed=seed,
                       max_in_flight_shots=max_in_flight_shots)
        rows.append({"case": f"{name} (one host)", "transport": res.transport,
                     "reaction_p50_us": round(res.reaction_p50_ns / 1e3, 2),
                     "reaction_p99_us": round(res.reaction_p99_ns / 1e3, 2),
                     "reaction_p999_us": round(res.reaction_p999_ns / 1e3, 2),
                     "logical_errors": res.logical_errors, "shots": res.num_shots})
    with two_hosts() as hosts:
        for tr in transports:
            progress(f"across namespaces: {tr}, {num_shots} shots")
            try:
                r = run_crosshost_loop(hosts, transport=tr, source=source, decoder=decoder, num_shots=num_shots,
                                       seed=seed, max_in_flight_shots=max_in_flight_shots)
            except Exception as e:  # one transport failing leaves the others' rows
                rows.append({"case": f"{tr} (two namespaces)", "transport": tr, "error": f"{type(e).__name__}: {e}"})
                continue
            rows.append({"case": f"{tr} (two namespaces)", "transport": r["transport"],
                         "reaction_p50_us": round(r["reaction_p50_ns"] / 1e3, 2),
                         "reaction_p99_us": round(r["reaction_p99_ns"] / 1e3, 2),
                         "reaction_p999_us": round(r["reaction_p999_ns"] / 1e3, 2),
                         "logical_errors": r["logical_errors"], "shots": r["num_shots"],
                         "bit_identical": r["bit_identical"], "clock_offset_ns": r["clock"]["offset_ns"],
                         "clock_error_bound_ns": r["clock"]["error_bound_ns"], "url": r["url"]})
    return rows


def main_from_cli(args, *, say: Callable[[str], None] = print) -> list[dict]:
    """``qlink bench crosshost [--quick] [--out DIR]``: run, print a table, write JSON/CSV
    (needs root for the namespaces; says why and writes nothing where they cannot be made)."""
    from pathlib import Path

    from qlink.netns import netns_unavailable

    from .report import format_table, write_results

    why = netns_unavailable()
    if why:
        say(f"crosshost: skipped ({why})")
        return []
    quick = bool(getattr(args, "quick", False))
    num_shots = 1000 if quick else 5000
    rows = crosshost_bench(num_shots=num_shots, progress=say)
    out = Path(getattr(args, "out", "results/bench"))
    write_results(rows, out_dir=out, name="crosshost", meta={"num_shots": num_shots, "distance": 3, "p": 0.001,
                                                             "max_in_flight_shots": 1})
    print("\nQEC reaction time, decoder service and controller in two network namespaces (veth) vs one host")
    print(format_table(rows, columns=["case", "transport", "reaction_p50_us", "reaction_p99_us", "reaction_p999_us",
                                      "bit_identical", "clock_offset_ns", "clock_error_bound_ns", "error"]))
    print(f"\nwritten: {out}/crosshost.{{json,csv}}")
    return rows
