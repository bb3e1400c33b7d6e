"""``qlink bench soak``: sustained load with nothing lost, memory flat, nothing leaked.

:func:`run_soak` pushes ``num_frames`` ``enqueue_syndromes`` frames (one whole shot of a
small surface code each, d=3 by default) to a decoder service in its own process and
asks their corrections in windows of ``window_shots`` shots, checking every correction
against the offline decode of the same shot; then ``num_kv_transfers`` KV requests
(``tiny`` preset) to a KV receiver process. Afterwards both sides' counts are
reconciled (frames sent = frames the service took = shots decoded = corrections
checked; requests sent = requests completed; messages and puts per endpoint), the RSS
of every process (``VmRSS`` from ``/proc/<pid>/status``) is reported from after the
warm-up to the end, and the file descriptors, memfds, ``/dev/shm`` entries and shm
rendezvous sockets are counted before and after (a leak is any difference).

The syndrome sender is a lean loop (a frame template per distinct shot, counter and
request id patched in place, ``send_nowait``), so the service and the transport are
what is measured; :func:`controller_rate` measures the full controller emulator's
rate for comparison (it does far more per shot: cycle clock, per-shot timelines).

:func:`main_from_cli` adds the fault matrix, the crash runs and a fuzz pass, prints one
table, and writes ``soak.json`` / ``soak.csv``.

>>> rss_kib() > 0, sorted(resource_counts())
(True, ['dev_shm_qlink', 'fds', 'memfds', 'shm_sockets'])

A small soak (a few seconds: it starts two processes)::

    r = run_soak(num_frames=20_000, num_kv_transfers=200, transport="shm")
    r["unaccounted_frames"], r["correction_mismatches"], r["unaccounted_kv"], r["leaks"]  # (0, 0, 0, {})
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time
from typing import Callable

import numpy as np

from qlink import wire

__all__ = ["run_soak", "controller_rate", "backpressure_run", "main_from_cli", "rss_kib", "resource_counts",
           "SOAK_COLUMNS"]

SOAK_COLUMNS = ["what", "case", "transport", "injected", "detected", "bound", "measured", "accounted_pct", "note"]

_GET_BIT = 0x80000000
_RESP = wire.RESPONSE_HEADER  # magic, status, result_len, request_id, ptp
_PATCH_RID, _PATCH_RID_OFFSET = wire.REQUEST_ID_FIELD, wire.REQUEST_ID_OFFSET
_PATCH_COUNTER, _PATCH_COUNTER_OFFSET = wire.ENQUEUE_COUNTER, wire.ENQUEUE_COUNTER_OFFSET


# ----------------------------------------------------------------------------- resources


def rss_kib(pid: int | None = None) -> int:
    """Resident set size (``VmRSS``, KiB) of ``pid`` (this process when None)."""
    path = "/proc/self/status" if pid is None else f"/proc/{pid}/status"
    with open(path) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _fds(pid: int | None = None) -> list[str]:
    d = "/proc/self/fd" if pid is None else f"/proc/{pid}/fd"
    out = []
    for name in os.listdir(d):
        try:
            out.append(os.readlink(os.path.join(d, name)))
        except OSError:
            pass  # closed meanwhile (e.g. the listdir's own fd)
    return out


def resource_counts(pid: int | None = None) -> dict:
    """Open fds, memfds among them, qlink entries in ``/dev/shm`` (qlink makes none: its
    shared memory is memfds), and the shm rendezvous sockets of this process's listeners
    (names carrying its pid, as the soak's do).

    >>> sorted(resource_counts())
    ['dev_shm_qlink', 'fds', 'memfds', 'shm_sockets']
    """
    fds = _fds(pid)
    try:
        dev_shm = len([n for n in os.listdir("/dev/shm") if "qlink" in n.lower()])
    except FileNotFoundError:
        dev_shm = 0
    try:
        from transports.shm import socket_dir

        d = socket_dir()  # shared by every process of this user: count the sockets of this process's listeners
        mine = f"-{os.getpid() if pid is None else pid}-"
        socks = len([n for n in os.listdir(d) if n.endswith(".sock") and mine in n]) if os.path.isdir(d) else 0
    except Exception:  # noqa: BLE001 - no shm transport here: nothing to count
        socks = 0
    return {"fds": len(fds), "memfds": sum(1 for f in fds if f.startswith("/memfd:")), "dev_shm_qlink": dev_shm,
            "shm_sockets": socks}


class _RssSampler:
    def __init__(self, pids: dict[str, int | None], every_s: float):
        self.pids = pids
        self.every_s = every_s
        self.samples: dict[str, list[tuple[float, int]]] = {k: [] for k in pids}
        self.fd_samples: dict[str, list[int]] = {k: [] for k in pids}
        self._next = 0.0
        self._t0 = time.monotonic()

    def maybe(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + self.every_s
        for name, pid in self.pids.items():
            try:
                self.samples[name].append((now - self._t0, rss_kib(pid)))
                self.fd_samples[name].append(len(_fds(pid)))
            except (OSError, ValueError):
                pass

    def growth(self, *, skip_frac: float = 0.1) -> dict:
        out = {}
        for name, s in self.samples.items():
            if len(s) < 2:
                continue
            # after the warm-up: the first sample is taken as the run starts, before the service
            # has built its buffers (a short run has only a few samples; 10 % of them is none)
            k = min(len(s) - 2, max(1, int(len(s) * skip_frac)))
            base, last, peak = s[k][1], s[-1][1], max(v for _, v in s[k:])
            fds = self.fd_samples[name]
            out[name] = {"rss_start_kib": base, "rss_end_kib": last, "rss_peak_kib": peak,
                         "rss_growth_kib": last - base, "samples": len(s),
                         "fds_min": min(fds[k:]), "fds_max": max(fds[k:])}
        return out


# ----------------------------------------------------------------------------- QEC soak


def _url(transport: str) -> str:
    import transports

    return transports.loopback_url(transport, tag="qlink-soak")


def _soak_frames(distance: int, num_distinct: int, seed: int):
    from qlink import wire
    from qlink.qec.decoders import compile_decoder
    from qlink.qec.loop import build_source, source_spec

    spec = source_spec(distance=distance, rounds=distance, p=0.001)
    src = build_source(spec)
    dets, _ = src.sample(num_distinct, seed=seed)
    nd = dets.shape[1]
    packed = np.packbits(dets, axis=1, bitorder="little")
    flips = np.asarray(compile_decoder("pymatching", src.dem).decode_shots_bit_packed(
        bit_packed_detection_event_data=packed), np.uint8)
    nbytes = wire.enqueue_syndromes_nbytes(nd)
    frames = bytearray(nbytes * num_distinct)
    for i in range(num_distinct):
        wire.encode_enqueue_syndromes_into(frames, request_id=0, decoder_id=0, counter=0, syndrome_mapping_id=0,
                                           syndromes_bits_packed=packed[i], num_syndromes=nd, offset=i * nbytes)
    return spec, src, frames, nbytes, flips, int(src.dem.num_observables)


def _qec_soak(*, num_frames: int, transport: str, distance: int, window_shots: int, max_windows: int, seed: int,
              sampler_every_s: float, say) -> dict:
    import transports
    from qlink import wire
    from qlink.errors import WouldBlock
    from qlink.qec import start_service_process

    P = 4096
    if P % window_shots:
        raise ValueError(f"window_shots must divide {P}, got {window_shots}")
    spec, src, frames, fnb, flips, nobs = _soak_frames(distance, P, seed)
    # expected answer of each window (the W shots' observable flips, packed one after the other)
    W = window_shots
    bits = np.unpackbits(flips, axis=1, count=nobs, bitorder="little").reshape(P // W, W * nobs)
    expected = [np.packbits(row, bitorder="little").tobytes() for row in bits]
    configs = {0: {"source": spec, "decoder": "pymatching", "frames_per_shot": 1,
                   "capacity_shots": max(4096, 2 * W * max_windows)}}
    svc = start_service_process(_url(transport), configs, service_options={"ack_enqueue": "errors"})
    ep = transports.connect(svc.url, timeout_s=30)
    sampler = _RssSampler({"controller": None, "service": svc.process.pid}, sampler_every_s)
    fmv = memoryview(frames)
    get = bytearray(wire.HEADER_NBYTES + wire.GET_CORRECTIONS_PAYLOAD_NBYTES)
    rx = bytearray(wire.HEADER_NBYTES + (W * nobs + 7) // 8 + 64)
    rx_mv = memoryview(rx)
    inflight: dict[int, int] = {}  # get request id -> window index (into `expected`)
    counts = {"frames_sent": 0, "gets_sent": 0, "answers": 0, "ok_windows": 0, "shots_checked": 0,
              "mismatch_windows": 0, "not_ready": 0, "other": 0, "would_block": 0}
    status_counts: dict[int, int] = {}
    send_nowait, recv = ep.send_nowait, ep.recv_into_nowait

    def send_get(window: int, shots: int, rid: int) -> None:
        wire.encode_get_corrections_into(get, request_id=rid, decoder_id=0, return_size=shots * nobs, reset=True)
        while True:
            try:
                send_nowait(get)
                break
            except WouldBlock:
                poll()
        counts["gets_sent"] += 1
        inflight[rid] = window

    def poll() -> int:
        try:
            n = recv(rx)
        except WouldBlock:
            return 0
        _, status, rlen, rid, _ = _RESP.unpack_from(rx, 0)
        counts["answers"] += 1
        status_counts[status] = status_counts.get(status, 0) + 1
        if not rid & _GET_BIT:
            counts["other"] += 1  # an enqueue refused (ack_enqueue="errors"): should never happen here
            return 1
        window = inflight.pop(rid)
        if status == 0:
            want = expected[window % (P // W)] if window >= 0 else last_expected[0]
            if rx_mv[wire.HEADER_NBYTES:wire.HEADER_NBYTES + rlen] == want:
                counts["ok_windows"] += 1
            else:
                counts["mismatch_windows"] += 1
            counts["shots_checked"] += (W if window >= 0 else last_expected[1])
        elif status == 4:  # NOT_READY: ask again
            counts["not_ready"] += 1
            send_get(window, W if window >= 0 else last_expected[1], rid)
        else:
            counts["other"] += 1
        return 1

    last_expected: list = [b"", 0]
    t0 = time.perf_counter()
    next_say = time.monotonic() + 10
    f = 0
    counter = 0
    while f < num_frames:
        slot = f % P
        off = slot * fnb
        _PATCH_COUNTER.pack_into(frames, off + _PATCH_COUNTER_OFFSET, counter)
        _PATCH_RID.pack_into(frames, off + _PATCH_RID_OFFSET, f & 0x7FFFFFFF)
        fr = fmv[off:off + fnb]
        while True:
            try:
                send_nowait(fr)
                break
            except WouldBlock:
                counts["would_block"] += 1
                if not poll():
                    sampler.maybe()
        counter += 1
        f += 1
        if f % W == 0:
            w = f // W - 1
            send_get(w, W, _GET_BIT | (w & 0x7FFFFFFF))
            while len(inflight) >= max_windows:
                if not poll():
                    pass
            if w % 256 == 0:
                sampler.maybe()
                if time.monotonic() > next_say:
                    rate = f / (time.perf_counter() - t0)
                    say(f"  soak: {f:,} frames, {rate / 1e3:.0f} k frames/s, "
                        f"service RSS {sampler.samples['service'][-1][1] / 1024:.0f} MiB")
                    next_say = time.monotonic() + 10
    rem = num_frames % W
    if rem:  # the last, shorter window
        start = (num_frames - rem) % P
        row = np.unpackbits(flips[start:start + rem], axis=1, count=nobs, bitorder="little").reshape(-1)
        last_expected[:] = [np.packbits(row, bitorder="little").tobytes(), rem]
        send_get(-1, rem, _GET_BIT | 0x7FFFFFFF)
    deadline = time.monotonic() + 60
    while inflight and time.monotonic() < deadline:
        poll()
    elapsed = time.perf_counter() - t0
    sampler.maybe(force=True)
    ep_stats = ep.statistics()
    ep.close()
    rep = svc.report(timeout_s=60)
    svc.close()
    sc = rep.get("counts", {})
    ts = rep.get("transport_statistics", {})
    frames_sent = num_frames
    unaccounted = abs(frames_sent - sc.get("enqueue", 0)) + abs(frames_sent - sc.get("shots_decoded", 0)) + \
        abs(frames_sent - counts["shots_checked"]) + len(inflight)
    msgs_ok = (ep_stats.messages_sent == ts.get("messages_received") and
               ep_stats.messages_received == ts.get("messages_sent"))
    return {
        "frames": frames_sent, "elapsed_s": elapsed, "frames_per_s": frames_sent / elapsed,
        "shots_decoded_by_service": sc.get("shots_decoded", 0), "frames_taken_by_service": sc.get("enqueue", 0),
        "corrections_checked": counts["shots_checked"], "correction_mismatches": counts["mismatch_windows"],
        "gets_sent": counts["gets_sent"], "answers": counts["answers"], "not_ready": counts["not_ready"],
        "refused": counts["other"], "would_block": counts["would_block"], "windows_unanswered": len(inflight),
        "unaccounted_frames": unaccounted, "endpoint_messages_reconciled": bool(msgs_ok),
        "service_decode_calls": sc.get("decode_calls", 0), "rss": sampler.growth(),
        "service_error": rep.get("error"),
    }


# ----------------------------------------------------------------------------- KV soak


def _kv_soak_receiver(url: str, spec_bytes: bytes, num_requests: int, conn) -> None:
    """Receive requests 1..num_requests (target of a spawned process); report counts."""
    import transports
    from qlink.ai import KVCache, KVCacheSpec, KVReceiver

    cache = KVCache.allocate(KVCacheSpec.from_bytes(spec_bytes))
    ep = transports.connect(url, timeout_s=30)
    rx = KVReceiver(ep, cache)
    conn.send(("ready", os.getpid()))
    failed = 0
    for rid in range(1, num_requests + 1):
        try:
            rx.wait_request(rid, timeout_s=60)
        except Exception as e:  # noqa: BLE001 - counted and reported
            failed += 1
            conn.send(("error", rid, f"{type(e).__name__}: {e}"))
            break
    st = rx.statistics()
    es = ep.statistics()
    conn.send(("done", {"completed": st.requests_completed, "failed": st.requests_failed + failed,
                        "parts": st.parts, "nbytes": st.nbytes, "bad_frames": st.bad_frames,
                        "notifications": es.notifications, "messages_received": es.messages_received}))
    conn.recv()  # wait for the sender to say bye before closing
    rx.close()
    ep.close()


def _kv_soak(*, num_transfers: int, transport: str, blocks_per_request: int, sampler_every_s: float, say) -> dict:
    import transports
    from qlink.ai import KVCache, KVSender, preset

    spec = preset("tiny", num_blocks=64)
    cache = KVCache.allocate(spec)
    cache.fill_random(seed=3)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    with transports.listen(_url(transport)) as lis:
        proc = ctx.Process(target=_kv_soak_receiver, args=(lis.url, spec.to_bytes(), num_transfers, child),
                           daemon=True, name="qlink-soak-kv-receiver")
        proc.start()
        child.close()
        try:
            ep = lis.accept(timeout_s=120)
            status, pid = parent.recv()
            tx = KVSender(ep, cache)
            tx.handshake(timeout_s=30)
            sampler = _RssSampler({"kv_sender": None, "kv_receiver": pid}, sampler_every_s)
            rng = np.random.default_rng(0)
            patterns = [(rng.choice(64, blocks_per_request, replace=False), rng.choice(64, blocks_per_request,
                                                                                       replace=False))
                        for _ in range(16)]
            t0 = time.perf_counter()
            next_say = time.monotonic() + 10
            nbytes = 0
            for rid in range(1, num_transfers + 1):
                src, dst = patterns[rid & 15]
                rec = tx.send_request(rid, src, dst, timeout_s=60)
                nbytes += rec.nbytes
                if rid % 512 == 0:
                    sampler.maybe()
                    if time.monotonic() > next_say:
                        say(f"  soak: {rid:,} KV transfers, {rid / (time.perf_counter() - t0):.0f} /s")
                        next_say = time.monotonic() + 10
            while not parent.poll(0.001):
                tx.progress()
            msg = parent.recv()
            elapsed = time.perf_counter() - t0
            sampler.maybe(force=True)
            es = ep.statistics()
            parent.send("bye")
            proc.join(30)
            ep.close()
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
            parent.close()
    rx_counts = msg[1] if msg[0] == "done" else {"completed": 0, "error": msg}
    unaccounted = abs(num_transfers - rx_counts.get("completed", 0)) + rx_counts.get("failed", 0)
    # every completion the receiver was notified of made one part; every byte put landed in a part
    # (an endpoint that gathers a layer's pieces into one put_many notifies once per layer)
    puts_ok = (rx_counts.get("parts") == rx_counts.get("notifications") and es.put_bytes == rx_counts.get("nbytes")) \
        if tx.mode == "put" else rx_counts.get("messages_received", 0) > 0
    return {"transfers": num_transfers, "mode": tx.mode, "elapsed_s": elapsed, "transfers_per_s": num_transfers / elapsed,
            "bytes": nbytes, "receiver": rx_counts, "sender_puts": es.puts, "sender_put_bytes": es.put_bytes,
            "unaccounted_kv": unaccounted,
            "parts_reconciled": bool(puts_ok), "bytes_reconciled": nbytes == rx_counts.get("nbytes"),
            "rss": sampler.growth()}


# ----------------------------------------------------------------------------- the soak


def run_soak(*, num_frames: int = 10_000_000, num_kv_transfers: int = 100_000, transport: str = "shm",
             distance: int = 3, window_shots: int = 64, max_windows_in_flight: int = 32, kv_blocks_per_request: int = 4,
             seed: int = 1, sample_every_s: float = 1.0, progress: Callable[[str], None] | None = None) -> dict:
    """The soak (see the module docstring); returns one dict with both parts, the RSS of all
    four processes, and the resource counts before/after (``leaks``: what differs)."""
    say = progress or (lambda msg: None)
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # Python's own helper process (one pipe for the process's life)
    gc.collect()
    before = resource_counts()
    out: dict = {"transport": transport, "distance": distance, "window_shots": window_shots}
    if num_frames:
        say(f"soak: {num_frames:,} syndrome frames (d={distance}, one shot each) over {transport}")
        out["qec"] = _qec_soak(num_frames=num_frames, transport=transport, distance=distance,
                               window_shots=window_shots, max_windows=max_windows_in_flight, seed=seed,
                               sampler_every_s=sample_every_s, say=say)
    if num_kv_transfers:
        say(f"soak: {num_kv_transfers:,} KV transfers (tiny preset, {kv_blocks_per_request} blocks) over {transport}")
        out["kv"] = _kv_soak(num_transfers=num_kv_transfers, transport=transport,
                             blocks_per_request=kv_blocks_per_request, sampler_every_s=sample_every_s, say=say)
    gc.collect()
    after = resource_counts()
    out["resources_before"], out["resources_after"] = before, after
    out["leaks"] = {k: after[k] - before[k] for k in before if after[k] != before[k]}
    q, k = out.get("qec", {}), out.get("kv", {})
    out["unaccounted_frames"] = q.get("unaccounted_frames", 0)
    out["correction_mismatches"] = q.get("correction_mismatches", 0)
    out["unaccounted_kv"] = k.get("unaccounted_kv", 0)
    return out


def controller_rate(*, transport: str = "shm", num_shots: int = 20_000, distance: int = 3) -> dict:
    """Frames per second of the full controller emulator (one shot per frame, flat out)."""
    from qlink.qec.loop import run_loop, source_spec

    spec = source_spec(distance=distance, rounds=distance, p=0.001)
    res = run_loop(transport=transport, source=spec, num_shots=num_shots, cycle_ns=1, rounds_per_frame=0,
                   warmup_shots=200, keep_samples=0, max_in_flight_shots=256, timeout_s=600)
    secs = res.controller.duration_ns / 1e9
    return {"shots": num_shots, "frames_per_s": num_shots / secs, "decoded": res.shots_ok}


# ----------------------------------------------------------------------------- backpressure


class _SlowDecoder:
    """A compiled decoder that takes at least ``sleep_s`` per call (a decoder slower than the cycle)."""

    def __init__(self, compiled, sleep_s: float, observe=None):
        self.compiled = compiled
        self.sleep_s = sleep_s
        self.observe = observe

    def decode_shots_bit_packed(self, *, bit_packed_detection_event_data):
        if self.observe is not None:
            self.observe(len(bit_packed_detection_event_data))
        time.sleep(self.sleep_s)
        return self.compiled.decode_shots_bit_packed(bit_packed_detection_event_data=bit_packed_detection_event_data)


def backpressure_run(*, transport: str = "tcp", capacity_shots: int = 32, num_shots: int = 2000,
                     cycle_ns: int = 2_000, decode_sleep_s: float = 0.002, seed: int = 1) -> dict:
    """A decoder slower than the cycle: the queue stays within ``capacity_shots`` (the
    service refuses BUSY and drops), the controller sees BUSY and a growing backlog, and
    every shot is still accounted for."""
    import sys

    import transports
    from qlink.qec.controller import Controller
    from qlink.qec.decoders import compile_decoder
    from qlink.qec.loop import build_source, sample_stream, source_spec
    from qlink.qec.service import DecoderConfig, DecoderService

    from .faults import _ServiceThread

    src = build_source(source_spec(distance=3, rounds=3, p=0.001))
    stream = sample_stream(src, num_shots=num_shots, seed=seed)
    seen: list[int] = []  # shots handed to each decoder call: everything that was queued
    slow = _SlowDecoder(compile_decoder("pymatching", src.dem), decode_sleep_s, observe=seen.append)
    svc = DecoderService({0: DecoderConfig(decoder=slow, dem=src.dem, frames_per_shot=1,
                                           capacity_shots=capacity_shots)}, ack_enqueue="errors")
    st = _ServiceThread(svc, _url(transport))
    old = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)
    rss0 = rss_kib()
    try:
        ep = transports.connect(st.url, timeout_s=10)
        res = Controller(ep, stream, cycle_ns=cycle_ns, rounds_per_frame=0).run(timeout_s=120)
        ep.close()
    finally:
        sys.setswitchinterval(old)
        rep = st.close()
    bl, bt = res.backlog_rounds, res.backlog_t_ns
    # the slope while the QPU is still emitting rounds: after the last tick the backlog can
    # only drain, and a controller held back by a full transport makes that tail long
    emitting = bt <= num_shots * stream.num_rounds * cycle_ns
    bl_e, bt_e = (bl[emitting], bt[emitting]) if emitting.sum() > 3 else (bl, bt)
    return {"shots": num_shots, "emitted_rounds": num_shots * stream.num_rounds,
            "capacity_shots": capacity_shots, "decoded": res.shots_ok,
            "reported_lost": res.shots_dropped, "failed": res.shots_failed,
            "busy_answers": res.statuses.get("enqueue.BUSY", 0), "max_decode_batch": max(seen) if seen else 0,
            "decode_calls": len(seen), "backlog_max_rounds": int(bl.max()) if bl.size else 0,
            "backlog_first_rounds": int(bl[0]) if bl.size else 0,
            "backlog_slope_rounds_per_s": float(np.polyfit(bt_e / 1e9, bl_e, 1)[0]) if bl_e.size > 3 else 0.0,
            "accounted_pct": 100.0 * (res.shots_ok + res.shots_dropped + res.shots_failed) / num_shots,
            "service_refused_busy": rep.get("counts", {}).get("shots_refused_busy", 0),
            "service_queue_full": rep.get("faults", {}).get("queue_full", 0),
            "rss_growth_kib": rss_kib() - rss0}


# ----------------------------------------------------------------------------- the report


def _fault_rows(transports_: tuple, *, quick: bool, say) -> tuple[list[dict], list[dict]]:
    from .faults import FAULTS, kv_fault_run, qec_fault_run

    rows, details = [], []
    qec_rate = {"drop": 0.03, "dup": 0.03, "reorder": 0.03, "corrupt": 0.03, "delay": 0.01}
    for t in transports_:
        for direction in ("to_service", "to_controller"):
            for fault in FAULTS:
                case = f"qec {fault}" + (" (answers)" if direction == "to_controller" else "")
                try:
                    r = qec_fault_run(fault, rate=qec_rate[fault], transport=t, num_shots=200 if quick else 400,
                                      direction=direction, p=0.01 if direction == "to_controller" else 0.001,
                                      timeout_s=30)
                except Exception as e:  # noqa: BLE001 - a run that breaks is a finding, reported as such
                    rows.append({"what": "fault", "case": case, "transport": t, "note": f"{type(e).__name__}: {e}"[:160]})
                    continue
                details.append(r)
                note = []
                if r.get("not_its_own_correction"):
                    note.append(f"{r['not_its_own_correction']} corrections applied to the wrong shot")
                if direction == "to_controller":
                    af = dict(r.get("answer_faults", {}))
                    note.append(f"re-asked {af.pop('reasked', 0)}, held behind an older answer "
                                f"{af.pop('held_for_an_older_answer', 0)}, ignored {sum(af.values())}")
                if fault == "corrupt" and direction == "to_service":
                    note.append(f"{r['undetectable']} in syndrome bits (no checksum on this wire), "
                                f"{r['benign']} in request_id/ptp")
                rows.append({"what": "fault", "case": case, "transport": t, "injected": r["injected"],
                             "detected": r.get("detected") if direction == "to_service" else
                             sum(v for k, v in r.get("answer_faults", {}).items() if k != "held_for_an_older_answer"),
                             "bound": r.get("bound", "") if direction == "to_service" else
                             "re-asked (same id) when a later answer arrives, or after 50 ms; duplicates and "
                             "undecodable answers counted and ignored",
                             "measured": f"{r['decoded']} decoded, {r['reported_lost']} reported lost",
                             "accounted_pct": r["accounted_pct"], "note": "; ".join(note)})
        for fault in FAULTS:
            try:
                r = kv_fault_run(fault, rate={"reorder": 0.05}.get(fault, 0.03 if fault != "delay" else 0.01),
                                 transport=t, num_requests=40 if quick else 60)
            except Exception as e:  # noqa: BLE001
                rows.append({"what": "fault", "case": f"kv {fault}", "transport": t, "note": f"{type(e).__name__}: {e}"})
                continue
            details.append(r)
            rows.append({"what": "fault", "case": f"kv {fault}", "transport": t, "injected": r["injected"],
                         "detected": r["detected"], "bound": r["bound"],
                         "measured": f"{r['complete_exact']} exact, {r['failed_typed']} failed, "
                                     f"{r['incomplete']} incomplete, {r['complete_corrupt']} corrupt",
                         "accounted_pct": r["accounted_pct"],
                         "note": f"partial layers reported: {r['partial_layers_reported']}"})
        say(f"  faults over {t}: done")
    return rows, details


def _crash_rows(transports_: tuple, *, say) -> tuple[list[dict], list[dict]]:
    from .crash import KILL_RUNS

    rows, details = [], []
    for t in transports_:
        for name, fn in KILL_RUNS.items():
            kw = {"give_up_s": 1.5} if name == "kv_receiver" else {}
            try:
                r = fn(transport=t, **kw)
            except Exception as e:  # noqa: BLE001
                rows.append({"what": "crash", "case": name, "transport": t, "note": f"{type(e).__name__}: {e}"[:160]})
                continue
            r.pop("lost_shot_ids", None)
            details.append(r)
            det = r.get("detection_s")
            note = ""
            if name == "qec_service":
                note = f"{r['lost_in_flight']} in-flight shots reported lost by id, resumed on a new service"
            elif name == "qec_controller":
                note = f"next controller (after reset_decoder): {r.get('next_ok')}/{r.get('next_shots')} decoded"
            elif name == "kv_sender":
                note = f"{r.get('ready_layers')} whole layers before the kill, partial reported: " \
                       f"{r.get('partial_layers_reported')}"
            elif det is None:
                note = "sender not told within the run"
            rows.append({"what": "crash", "case": f"{name} SIGKILL", "transport": t, "injected": 1,
                         "detected": int(det is not None), "bound": "< 1 s",
                         "measured": "" if det is None else f"{det * 1e3:.1f} ms",
                         "accounted_pct": r.get("accounted_pct"), "note": note})
        say(f"  crashes over {t}: done")
    return rows, details


def _fuzz_rows(*, quick: bool, say) -> tuple[list[dict], int]:
    from .fuzz import TARGETS, atheris_available, run_atheris, run_random

    rows, total = [], 0
    for target in sorted(TARGETS):
        r = run_random(target, num_cases=2_000 if quick else 50_000, seed=1)
        total += r["cases"]
        rows.append({"what": "fuzz", "case": f"{target} (mutation)", "measured": f"{r['cases']:,} cases",
                     "detected": r["crashes"], "note": f"crashes {r['crashes']}" + (
                         f": {r['first_crash'][:100]}" if r["first_crash"] else "")})
    if atheris_available():
        for target in ("wire_request", "wire_response", "kv_frames", "kv_spec", "remote_region"):
            r = run_atheris(target, runs=5_000 if quick else 200_000, seed=1)
            total += r["cases"]
            rows.append({"what": "fuzz", "case": f"{target} (atheris)", "measured": f"{r['cases']:,} cases",
                         "detected": r["crashes"], "note": f"crashes {r['crashes']}, coverage {r['coverage']}"})
    say(f"  fuzz: {total:,} cases")
    return rows, total


def main_from_cli(args, *, say: Callable[[str], None] = print) -> list[dict]:
    """``qlink bench soak [--quick] [--out DIR]``: faults, crashes, fuzz and the soak; one table, JSON/CSV.

    Sizes: 10^7 syndrome frames and 10^5 KV transfers (``--quick``: 2x10^5 and 2x10^3);
    ``QLINK_SOAK_FRAMES`` / ``QLINK_SOAK_KV`` override them.
    """
    import json
    from pathlib import Path

    from qlink.bench.report import environment, format_table, write_results

    quick = bool(getattr(args, "quick", False))
    frames = int(os.environ.get("QLINK_SOAK_FRAMES", 200_000 if quick else 10_000_000))
    kv = int(os.environ.get("QLINK_SOAK_KV", 2_000 if quick else 100_000))
    out = Path(getattr(args, "out", "results/bench"))
    t0 = time.monotonic()
    fault_t = ("tcp",) if quick else ("inproc", "shm", "tcp")
    rows, fault_details = _fault_rows(fault_t, quick=quick, say=say)
    crash_rows, crash_details = _crash_rows(("tcp",) if quick else ("shm", "tcp"), say=say)
    rows += crash_rows
    bp = backpressure_run()
    rows.append({"what": "load", "case": "decoder slower than the cycle", "transport": "tcp",
                 "injected": bp["shots"], "detected": bp["busy_answers"], "bound": "queue <= capacity_shots",
                 "measured": f"max decode batch {bp['max_decode_batch']} <= {bp['capacity_shots']}, "
                             f"backlog to {bp['backlog_max_rounds']} rounds",
                 "accounted_pct": bp["accounted_pct"], "note": f"RSS +{bp['rss_growth_kib'] / 1024:.1f} MiB"})
    fuzz_rows, fuzz_cases = _fuzz_rows(quick=quick, say=say)
    rows += fuzz_rows
    soak = run_soak(num_frames=frames, num_kv_transfers=kv, progress=say)
    q, k = soak.get("qec", {}), soak.get("kv", {})
    if q:
        rows.append({"what": "soak", "case": "syndrome frames (d=3, 1 shot each)", "transport": soak["transport"],
                     "measured": f"{q['frames']:,} in {q['elapsed_s']:.0f} s ({q['frames_per_s'] / 1e3:.1f} k/s)",
                     "accounted_pct": 100.0 * (q["frames"] - q["unaccounted_frames"]) / q["frames"],
                     "note": f"corrections checked {q['corrections_checked']:,}, mismatches {q['correction_mismatches']}"})
    if k:
        rows.append({"what": "soak", "case": "KV transfers (tiny)", "transport": soak["transport"],
                     "measured": f"{k['transfers']:,} in {k['elapsed_s']:.0f} s ({k['transfers_per_s']:.0f} /s)",
                     "accounted_pct": 100.0 * (k["transfers"] - k["unaccounted_kv"]) / k["transfers"],
                     "note": f"parts reconciled {k['parts_reconciled']}, bytes reconciled {k['bytes_reconciled']}"})
    for part in (q, k):
        for proc, g in part.get("rss", {}).items():
            rows.append({"what": "soak", "case": f"RSS growth {proc}",
                         "measured": f"{g['rss_growth_kib'] / 1024:+.1f} MiB ({g['rss_start_kib'] / 1024:.0f} -> "
                                     f"{g['rss_end_kib'] / 1024:.0f} MiB, {g['samples']} samples)",
                         "note": f"fds {g['fds_min']}..{g['fds_max']}"})
    rows.append({"what": "soak", "case": "leaks (fds, memfds, /dev/shm, shm sockets)",
                 "measured": json.dumps(soak["leaks"]) if soak["leaks"] else "none",
                 "note": f"before {soak['resources_before']}, after {soak['resources_after']}"})
    crashes = sum(int(r.get("detected") or 0) for r in fuzz_rows)
    rows.append({"what": "fuzz", "case": "total", "measured": f"{fuzz_cases:,} cases", "detected": crashes,
                 "note": f"crashes {crashes}"})
    meta = {"quick": quick, "frames": frames, "kv_transfers": kv, "elapsed_s": time.monotonic() - t0}
    write_results(rows, out_dir=out, name="soak", meta=meta)
    with open(out / "soak_details.json", "w") as f:
        json.dump({"environment": environment(), "meta": meta, "faults": fault_details, "crashes": crash_details,
                   "backpressure": bp, "soak": soak}, f, indent=2, default=str)
    print(f"\nReliability: faults injected and detected, crashes, load, fuzzing, soak "
          f"({frames:,} frames, {kv:,} KV transfers; measured here, link models modeled)")
    print(format_table(rows, columns=SOAK_COLUMNS))
    print(f"\nwritten: {out}/soak.{{json,csv}}, {out}/soak_details.json")
    return rows
