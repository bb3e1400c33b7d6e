"""Crash runs: a peer SIGKILLed mid-run, how soon the other side knows, and what survives.

* :func:`qec_service_kill_run` -- the decoder service process dies while a controller
  streams shots to it. The controller sees :class:`~qlink.errors.BrokenLinkError`
  (detection time measured from the kill); the experiment resumes against a fresh
  service without restarting: shots answered before are kept, the shots in flight are
  reported lost by their ids. The controller runs in chunks (one
  :class:`~qlink.qec.controller.Controller` per chunk, the counter carried over),
  because ``Controller.run`` returns nothing when it raises: a chunk in flight at the
  kill is lost as a whole.
* :func:`qec_controller_kill_run` -- a controller process dies mid-run. The decoder
  service (one :class:`~qlink.qec.service.DecoderService` behind an accept loop, in its
  own process) sees the link break (time measured), keeps listening, and serves the next
  controller: with ``reset_first`` that controller sends ``reset_decoder`` before its
  shots.
* :func:`sender_kill_run` -- a peer dies while this side sends it a message now and then.
* :func:`kv_receiver_kill_run` / :func:`kv_sender_kill_run` -- one side of a KV transfer
  dies mid-transfer. The sender gets BrokenLinkError; the receiver gets a typed error and
  never reports a layer that did not land whole (checked bit for bit).

Times are ``time.monotonic_ns`` on one host (shared by its processes). Each run gives the
detection time from the kill (``detection_s``) and splits it in two: ``exit_s``, from the
SIGKILL until the kernel has ended the process (its sockets closed; on a loaded host the
dying process waits for a core like any other), and ``detection_after_exit_s``, from then
until the survivor raised: the transport's own part, which its contract bounds.

>>> sorted(KILL_RUNS)
['kv_receiver', 'kv_sender', 'qec_controller', 'qec_service', 'slow_sender']
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import signal
import threading
import time
from typing import Any

import numpy as np

from qlink.procs import wait_ready

__all__ = ["qec_service_kill_run", "qec_controller_kill_run", "kv_receiver_kill_run", "kv_sender_kill_run",
           "sender_kill_run", "KILL_RUNS", "serve_forever"]



def _url(transport: str) -> str:
    if transport not in ("shm", "tcp", "ucx"):
        raise ValueError(f"a crash run needs a cross-process transport (shm, tcp, ucx), got {transport!r}")
    import transports

    return transports.loopback_url(transport, tag="qlink-crash")


_exits: dict[int, tuple[threading.Thread, list]] = {}  # kill time -> (its exit watcher, [exit time])


def _kill(proc, *, at: list | None = None) -> int:
    """SIGKILL a child; return the monotonic time of the kill, also appended to ``at`` *before*
    the signal is sent (a survivor that notices the death at once, before this call returns
    on a loaded host, still finds it). A watcher notes when the process is gone
    (:func:`_exit_figures`)."""
    pid = proc.pid
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (old kernel): /proc is polled instead
        pidfd = None
    seen: list[int] = []
    watcher = threading.Thread(target=_watch_exit, args=(pid, pidfd, seen), daemon=True, name="qlink-exit-watch")
    watcher.start()  # it waits for the end; started first so that it is joinable once t is known
    t = time.monotonic_ns()
    _exits[t] = (watcher, seen)
    if at is not None:
        at.append(t)
    os.kill(pid, signal.SIGKILL)
    return t


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return True
    return s[s.rindex(")") + 2] in "ZX"


def _watch_exit(pid: int, pidfd: int | None, seen: list, *, timeout_s: float = 60.0) -> None:
    """Append the monotonic time at which ``pid`` ended (a pidfd turns readable then)."""
    try:
        if pidfd is not None:
            if select.select([pidfd], [], [], timeout_s)[0]:
                seen.append(time.monotonic_ns())
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if _gone(pid):
                seen.append(time.monotonic_ns())
                return
            time.sleep(0.0005)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _given_up(t_kill: int, give_up_s: float, *, longest_s: float = 60.0) -> bool:
    """True ``give_up_s`` after the killed process ended (or ``longest_s`` after the kill)."""
    now = time.monotonic_ns()
    seen = _exits.get(t_kill, (None, []))[1]
    if seen:
        return now - seen[0] > give_up_s * 1e9
    return now - t_kill > longest_s * 1e9


def _exit_figures(t_kill: int | None, t_detect: int | None) -> dict:
    """``exit_s`` (kill -> the process gone) and ``detection_after_exit_s`` (gone -> the
    survivor's error; 0 when the survivor was first to notice), None where unknown."""
    watcher, seen = _exits.pop(t_kill, (None, [])) if t_kill is not None else (None, [])
    if watcher is not None:
        watcher.join(60)
    if not seen:
        return {"exit_s": None, "detection_after_exit_s": None}
    return {"exit_s": (seen[0] - t_kill) / 1e9,
            "detection_after_exit_s": None if t_detect is None else max(0, t_detect - seen[0]) / 1e9}


def _wait_ready(q, proc, what: str, timeout_s: float = 120.0):
    """The first item a child puts on ``q``; fail fast (with its exit code) if it died first."""
    return wait_ready(q, proc, what, timeout_s=timeout_s)


def _reap(proc, timeout_s: float = 10.0) -> None:
    if proc is None:
        return
    if proc.is_alive():
        proc.kill()
    proc.join(timeout_s)


# ----------------------------------------------------------------------------- QEC


def _qec_setup(distance: int, num_shots: int, seed: int):
    from qlink.qec.loop import build_source, sample_stream, source_spec

    spec = source_spec(distance=distance, rounds=distance, p=0.001)
    stream = sample_stream(build_source(spec), num_shots=num_shots, seed=seed)
    configs = {0: {"source": spec, "decoder": "pymatching", "frames_per_shot": 1}}
    return spec, stream, configs


def qec_service_kill_run(*, transport: str = "tcp", num_shots: int = 4000, chunk_shots: int = 200,
                         cycle_ns: int = 20_000, kill_after_s: float = 0.002, kill_at_chunk: int | None = None,
                         distance: int = 3, seed: int = 1, timeout_s: float = 60.0) -> dict:
    """See the module docstring. The service is killed ``kill_after_s`` into chunk
    ``kill_at_chunk`` (default: the middle one). Returns the accounting and the measured
    detection time."""
    import transports
    from qlink.errors import BrokenLinkError
    from qlink.qec.controller import Controller
    from qlink.qec import start_service_process

    _, stream, configs = _qec_setup(distance, num_shots, seed)
    opts = {"ack_enqueue": "errors"}
    svc = start_service_process(_url(transport), configs, service_options=opts)
    services_started = 1
    ep = transports.connect(svc.url, timeout_s=30)
    status = np.full(num_shots, -1, np.int8)  # 1 decoded, 2 answered dropped/failed, 0 lost in flight
    kill_at: list[int] = []
    victim = svc.process
    timer = threading.Timer(kill_after_s, lambda: _kill(victim, at=kill_at))
    num_chunks = -(-num_shots // chunk_shots)
    kill_chunk = num_chunks // 2 if kill_at_chunk is None else kill_at_chunk
    detect_ns = None
    exit_fig = {"exit_s": None, "detection_after_exit_s": None}
    n_dropped = n_failed = 0
    lost_ids: list[int] = []
    counter = 0
    t_start = time.monotonic()
    try:
        lo = 0
        while lo < num_shots:
            hi = min(lo + chunk_shots, num_shots)
            if lo // chunk_shots == kill_chunk:
                timer.start()  # the kill lands in this chunk (or, on a slow machine, a later one)
            ctl = Controller(ep, _rows(stream, lo, hi),
                             cycle_ns=cycle_ns, rounds_per_frame=0, counter_start=counter,
                             start_delay_ns=20_000)
            try:
                res = ctl.run(timeout_s=timeout_s)
            except BrokenLinkError:
                t = time.monotonic_ns()
                if detect_ns is None and kill_at:
                    detect_ns = t - kill_at[0]
                    exit_fig = _exit_figures(kill_at[0], t)
                status[lo:hi] = 0
                lost_ids.extend(range(lo, hi))
                ep.close()
                svc.close()
                svc = start_service_process(_url(transport), configs, service_options=opts)  # resume: a new service
                services_started += 1
                ep = transports.connect(svc.url, timeout_s=30)
                counter = 0
                lo = hi
                continue
            status[lo:hi] = np.where(res.correct >= 0, 1, 2)  # decoded, or answered dropped / failed
            n_dropped += res.shots_dropped
            n_failed += res.shots_failed
            counter = ctl.counter
            if lo // chunk_shots >= kill_chunk and not kill_at and hi < num_shots:
                timer.join(30)  # a loaded host ran the chunk before the timer: the kill lands before the next
            lo = hi
    finally:
        timer.cancel()
        ep.close()
        svc.close()
    accounted = int((status >= 0).sum())
    return {
        "scenario": "qec_service_killed", "transport": transport, "shots": num_shots, "chunk_shots": chunk_shots,
        "killed": bool(kill_at), "detection_s": None if detect_ns is None else detect_ns / 1e9, **exit_fig,
        "decoded": int((status == 1).sum()), "reported_dropped": n_dropped,
        "failed": n_failed, "lost_in_flight": len(lost_ids), "lost_shot_ids": lost_ids,
        "services_started": services_started, "accounted_pct": 100.0 * accounted / num_shots,
        "elapsed_s": time.monotonic() - t_start,
    }


def _rows(stream, lo: int, hi: int):
    from qlink.qec.controller import SyndromeStream

    return SyndromeStream(stream.detectors[lo:hi], stream.observables[lo:hi], stream.round_of_detector)


def serve_forever(url: str, configs_spec: dict, ready, events, *, max_connections: int = 4,
                  service_options: dict | None = None) -> None:
    """An accept loop around one DecoderService (target of a spawned process): serve each
    controller until its link breaks or closes, report ``("closed", monotonic_ns, counts)``
    on ``events``, then accept the next one."""
    import transports
    from qlink.qec.service import DecoderConfig, DecoderService

    configs = {int(k): DecoderConfig.from_spec(v) for k, v in configs_spec.items()}
    service = DecoderService(configs, **dict(service_options or {}))
    with transports.listen(url) as lis:
        ready.put(lis.url)
        for _ in range(max_connections):
            ep = lis.accept(timeout_s=120)
            try:
                rep = service.serve(ep)
            except Exception as e:  # noqa: BLE001 - reported to the parent
                events.put(("error", time.monotonic_ns(), f"{type(e).__name__}: {e}"))
                continue
            finally:
                ep.close()
            events.put(("closed", time.monotonic_ns(), dict(rep["counts"])))


def _controller_child(url: str, distance: int, num_shots: int, cycle_ns: int, seed: int, ready) -> None:
    """A controller playing a long stream (target of a spawned process; it is killed mid-run)."""
    import transports
    from qlink.qec.controller import Controller

    _, stream, _ = _qec_setup(distance, num_shots, seed)
    ep = transports.connect(url, timeout_s=30)
    ctl = Controller(ep, stream, cycle_ns=cycle_ns, rounds_per_frame=1)
    ready.put(os.getpid())
    ctl.run(timeout_s=600)


def _reset_decoder(ep, decoder_id: int = 0, *, timeout_s: float = 5.0) -> int:
    from qlink import wire

    buf = bytearray(64)
    n = wire.encode_reset_decoder_into(buf, request_id=0x7FFF_FFF0, decoder_id=decoder_id)
    ep.send(buf[:n], timeout_s=timeout_s)
    return int(wire.decode_response(ep.recv(timeout_s=timeout_s)).status)


def qec_controller_kill_run(*, transport: str = "tcp", reset_first: bool = True, distance: int = 3,
                            num_shots: int = 300, cycle_ns: int = 20_000, kill_after_s: float = 0.3, seed: int = 1,
                            timeout_s: float = 30.0) -> dict:
    """See the module docstring. The second controller runs here; ``reset_first`` makes it
    send ``reset_decoder`` before its shots."""
    import queue

    import transports
    from qlink.errors import QlinkTimeoutError
    from qlink.qec.controller import Controller

    _, stream, configs = _qec_setup(distance, num_shots, seed)
    configs[0]["frames_per_shot"] = len(stream.frames(rounds_per_frame=1))
    ctx = mp.get_context("spawn")
    ready, events, cready = ctx.Queue(), ctx.Queue(), ctx.Queue()
    service = ctx.Process(target=serve_forever, args=(_url(transport), configs, ready, events),
                          kwargs=dict(service_options={"ack_enqueue": "errors"}), daemon=True,
                          name="qlink-crash-service")
    controller = None
    url_holder: list[str] = []
    out: dict[str, Any] = {"scenario": "qec_controller_killed", "transport": transport, "reset_first": reset_first}
    try:
        service.start()
        url = _wait_ready(ready, service, "decoder service")
        url_holder.append(url)
        controller = ctx.Process(target=_controller_child, args=(url, distance, 10**6, cycle_ns, seed + 1, cready),
                                 daemon=True, name="qlink-crash-controller")
        controller.start()
        _wait_ready(cready, controller, "controller")
        time.sleep(kill_after_s)
        t_kill = _kill(controller)
        kind, t_closed, counts = events.get(timeout=30)
        out["service_saw"] = kind
        out["detection_s"] = (t_closed - t_kill) / 1e9
        out.update(_exit_figures(t_kill, t_closed))
        out["first_controller_requests"] = counts.get("requests", 0)
        out["service_alive"] = service.is_alive()
        ep = transports.connect(url, timeout_s=30)
        try:
            if reset_first:
                out["reset_status"] = _reset_decoder(ep)
            try:
                res = Controller(ep, stream, cycle_ns=cycle_ns, rounds_per_frame=1).run(timeout_s=timeout_s)
                out.update(next_ok=res.shots_ok, next_dropped=res.shots_dropped, next_logical_errors=res.logical_errors,
                           next_statuses=dict(res.statuses))
            except QlinkTimeoutError as e:
                out.update(next_ok=0, next_error=str(e))
        finally:
            ep.close()
        try:
            out["second_closed"] = events.get(timeout=10)[0]
        except queue.Empty:
            out["second_closed"] = None
    finally:
        _reap(controller)
        _reap(service)
        if url_holder:
            from transports.shm import reclaim_after_exit

            reclaim_after_exit(url_holder[0])  # the killed service's listener socket
    out["next_shots"] = num_shots
    return out


# ------------------------------------------------------------------------------ KV


def _kv_receiver_child(url: str, spec_bytes: bytes, ready) -> None:
    """A KV receiver waiting on requests 1, 2, ... (target of a spawned process; killed mid-transfer)."""
    import transports
    from qlink.ai import KVCache, KVCacheSpec, KVReceiver

    cache = KVCache.allocate(KVCacheSpec.from_bytes(spec_bytes))
    ep = transports.connect(url, timeout_s=30)
    rx = KVReceiver(ep, cache)
    ready.put(os.getpid())
    rid = 1
    while True:
        rx.wait_request(rid, timeout_s=600)
        rid += 1


def kv_receiver_kill_run(*, transport: str = "tcp", num_blocks: int = 32, kill_after_s: float = 0.5,
                         give_up_s: float = 5.0, timeout_s: float = 30.0) -> dict:
    """The sender (here) pushes whole-cache requests of the ``llama-3-8b`` layout
    (``num_blocks`` blocks of 16 tokens) until the receiver process is SIGKILLed
    (``kill_after_s`` after the first request went out); returns
    how long the sender took to see BrokenLinkError (None if it still had not ``give_up_s``
    after the kill)."""
    import transports
    from qlink.ai import KVCache, KVSender, preset
    from qlink.errors import BrokenLinkError, QlinkError

    spec = preset("llama-3-8b", num_blocks=num_blocks)
    cache = KVCache.allocate(spec)
    for i, a in enumerate(cache.layers):
        a.view(np.uint8).fill(i + 1)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    out: dict[str, Any] = {"scenario": "kv_receiver_killed", "transport": transport,
                           "request_nbytes": spec.nbytes}
    proc = None
    with transports.listen(_url(transport)) as lis:
        try:
            proc = ctx.Process(target=_kv_receiver_child, args=(lis.url, spec.to_bytes(), ready), daemon=True,
                               name="qlink-crash-kv-receiver")
            proc.start()
            ep = lis.accept(timeout_s=120)
            try:
                _wait_ready(ready, proc, "KV receiver")
                tx = KVSender(ep, cache)
                tx.handshake(timeout_s=30)
                ids = list(range(num_blocks))
                kill_at: list[int] = []
                # the kill is timed from the first request sent, not from the start: on a loaded
                # host, start-up alone can take longer than kill_after_s
                timer = threading.Timer(kill_after_s, lambda: _kill(proc, at=kill_at))
                sent = 0
                err: BaseException | None = None
                try:
                    while True:
                        tx.send_request(sent + 1, ids, ids, timeout_s=timeout_s)
                        sent += 1
                        if sent == 1:
                            timer.start()
                        if kill_at and _given_up(kill_at[0], give_up_s):
                            break
                except QlinkError as e:
                    err = e
                t = time.monotonic_ns()
                timer.cancel()
                out.update(requests_sent=sent, error=type(err).__name__ if err else None,
                           broken_link=isinstance(err, BrokenLinkError),
                           detection_s=(t - kill_at[0]) / 1e9 if kill_at and err else None,
                           **_exit_figures(kill_at[0] if kill_at else None, t if err else None),
                           mode=tx.mode)
            finally:
                ep.close()
        finally:
            _reap(proc)
    return out


def _kv_sender_child(url: str, spec_bytes: bytes, seed: int, layer_gap_s: float, ready) -> None:
    """A KV sender that pushes one whole-cache request layer by layer, ``layer_gap_s`` apart
    (prefill producing its layers), then idles (target of a spawned process; killed mid-transfer)."""
    import transports
    from qlink.ai import KVCache, KVCacheSpec, KVSender

    spec = KVCacheSpec.from_bytes(spec_bytes)
    cache = KVCache.allocate(spec)
    cache.fill_random(seed=seed)
    ep = transports.connect(url, timeout_s=30)
    tx = KVSender(ep, cache)
    tx.handshake(timeout_s=30)
    ids = list(range(spec.num_blocks))
    req = tx.begin_request(7, ids, ids)
    ready.put(os.getpid())
    for layer in req.layers:
        req.send_layer(layer, timeout_s=60)
        time.sleep(layer_gap_s)
    time.sleep(600)


def _ready_layers_after(rx, rid: int, num_layers: int) -> int:
    """Layers of ``rid`` the receiver reported ready (asked one by one without waiting: a
    layer ready before the link broke stays ready)."""
    n = 0
    for layer in range(num_layers):
        try:
            rx.wait_layer(rid, layer, timeout_s=0)
        except Exception:  # noqa: BLE001 - the first layer that is not ready ends the count
            break
        n += 1
    return n


def kv_sender_kill_run(*, transport: str = "tcp", num_blocks: int = 8, seed: int = 5, layer_gap_s: float = 0.02,
                       kill_at_layer: int = 3, timeout_s: float = 30.0) -> dict:
    """A sender process pushes one request of the ``llama-3-8b`` layout layer by layer and is
    SIGKILLed once the receiver (here) has ``kill_at_layer`` layers; the receiver must raise
    a typed error, and every layer it reported ready must match the sender's bytes."""
    import transports
    from qlink.ai import KVCache, KVReceiver, preset
    from qlink.errors import QlinkError

    spec = preset("llama-3-8b", num_blocks=num_blocks)
    expected = KVCache.allocate(spec, shared=False)
    expected.fill_random(seed=seed)  # the sender's cache, rebuilt from its seed
    cache = KVCache.allocate(spec)
    ids = list(range(num_blocks))
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    out: dict[str, Any] = {"scenario": "kv_sender_killed", "transport": transport, "request_nbytes": spec.nbytes,
                           "layers": spec.num_layers}
    proc = None
    with transports.listen(_url(transport)) as lis:
        try:
            proc = ctx.Process(target=_kv_sender_child, args=(lis.url, spec.to_bytes(), seed, layer_gap_s, ready),
                               daemon=True, name="qlink-crash-kv-sender")
            proc.start()
            ep = lis.accept(timeout_s=120)
            try:
                rx = KVReceiver(ep, cache)
                _wait_ready(ready, proc, "KV sender")
                rx.wait_layer(7, kill_at_layer - 1, timeout_s=timeout_s)
                t_kill = _kill(proc)
                err = None
                try:
                    rx.wait_request(7, timeout_s=timeout_s, release=False)
                except QlinkError as e:
                    err = e
                t = time.monotonic_ns()
                ready_n = _ready_layers_after(rx, 7, spec.num_layers)
                bad = sum(int(not (cache.block_checksums(ids, layers=[k]) ==
                                   expected.block_checksums(ids, layers=[k])).all()) for k in range(ready_n))
                out.update(ready_layers=ready_n, error=type(err).__name__ if err else None,
                           detection_s=(t - t_kill) / 1e9 if err else None,
                           **_exit_figures(t_kill, t if err else None), partial_layers_reported=bad,
                           completed=err is None)
                rx.close()
            finally:
                ep.close()
        finally:
            _reap(proc)
    return out


def _idle_peer(url: str, ready) -> None:
    """Connect, say hello, then idle (target of a spawned process; killed)."""
    import transports

    ep = transports.connect(url, timeout_s=30)
    ep.send(b"hello")
    ready.put(os.getpid())
    time.sleep(600)


def sender_kill_run(*, transport: str = "tcp", interval_s: float = 0.001, give_up_s: float = 3.0,
                    message_nbytes: int = 100) -> dict:
    """A peer is SIGKILLed while this side sends it a message every ``interval_s`` (a slow,
    steady sender, such as a controller at a long cycle); returns how long until a send
    raised BrokenLinkError (None if none did within ``give_up_s`` of the peer's end)."""
    import transports
    from qlink.errors import BrokenLinkError, QlinkError

    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    out: dict[str, Any] = {"scenario": "peer_killed_under_slow_sends", "transport": transport,
                           "interval_s": interval_s}
    proc = None
    with transports.listen(_url(transport)) as lis:
        try:
            proc = ctx.Process(target=_idle_peer, args=(lis.url, ready), daemon=True, name="qlink-crash-idle-peer")
            proc.start()
            ep = lis.accept(timeout_s=120)
            try:
                ep.recv(timeout_s=60)
                _wait_ready(ready, proc, "idle peer")
                t_kill = _kill(proc)
                proc.join(5)
                msg = bytes(message_nbytes)
                sent, err = 0, None
                try:
                    while not _given_up(t_kill, give_up_s):
                        ep.send(msg, timeout_s=give_up_s)
                        sent += 1
                        time.sleep(interval_s)
                except QlinkError as e:
                    err = e
                t = time.monotonic_ns()
                out.update(sent_after_kill=sent, error=type(err).__name__ if err else None,
                           broken_link=isinstance(err, BrokenLinkError),
                           detection_s=(t - t_kill) / 1e9 if err else None,
                           **_exit_figures(t_kill, t if err else None))
            finally:
                ep.close()
        finally:
            _reap(proc)
    return out


KILL_RUNS = {"qec_service": qec_service_kill_run, "qec_controller": qec_controller_kill_run,
             "kv_receiver": kv_receiver_kill_run, "kv_sender": kv_sender_kill_run,
             "slow_sender": sender_kill_run}
