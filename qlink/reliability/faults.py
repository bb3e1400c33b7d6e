"""Fault runs: the QEC loop and the KV engine over emulated links that drop, duplicate,
reorder, delay or corrupt what one side sends, with every shot and request accounted for.

Both runs keep the two sides in one process (the decoder service in a thread, the KV
sender in a thread) over a real inner transport (``inproc``, ``shm``, ``tcp``), so a
whole fault matrix runs in seconds. Faults hit the controller -> service direction
(``enqueue_syndromes`` frames only: they are the frames of at least
:data:`SYNDROME_FRAME_MIN_NBYTES`; ``get_corrections`` is 41 bytes) and the KV sender's
puts. The last ``clean_tail_shots`` shots (and the KV marker request) are left clean, so
a frame lost at the very end is still noticed by the counter of the one after it.

What each run returns is a plain dict (one row of the report): what was injected, what
each side counted, and the accounting: every shot is *decoded* (answered OK) or
*reported lost* (answered ``SYNDROMES_DROPPED`` with its shot index known to the
controller), every KV request *completes*, *fails with a typed error*, or is *reported
incomplete* -- ``accounted_pct`` is the share that is one of those, which must be 100.

>>> FAULTS
('drop', 'dup', 'reorder', 'corrupt', 'delay')
>>> sorted(field_of_offset(o) for o in (0, 13, 33, 60))
['counter', 'magic', 'request_id', 'syndrome_bits']
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np

__all__ = ["FAULTS", "SYNDROME_FRAME_MIN_NBYTES", "qec_fault_run", "kv_fault_run", "field_of_offset",
           "DETECTABLE_FIELDS"]

FAULTS = ("drop", "dup", "reorder", "corrupt", "delay")
SYNDROME_FRAME_MIN_NBYTES = 48  # an enqueue_syndromes frame is >= 57 B; get_corrections is 41 B

# enqueue_syndromes frame layout (qlink.wire): byte offset ranges of each field
_FIELDS = (
    (0, 4, "magic"), (4, 8, "function_id"), (8, 12, "arg_len"), (12, 16, "request_id"),
    (16, 24, "ptp_timestamp"), (24, 32, "decoder_id"), (32, 40, "counter"),
    (40, 48, "syndrome_mapping_id"), (48, 56, "num_syndromes"),
)
#: fields whose corruption the service must refuse and count (one refusal per frame)
DETECTABLE_FIELDS = ("magic", "function_id", "arg_len", "decoder_id", "syndrome_mapping_id", "num_syndromes")


def field_of_offset(offset: int) -> str:
    """The ``enqueue_syndromes`` field holding byte ``offset`` of the frame."""
    for lo, hi, name in _FIELDS:
        if lo <= offset < hi:
            return name
    return "syndrome_bits"


def _spec_for(fault: str, rate: float, *, seed: int, delay_ns: int, stop: int | None, start: int = 0,
              min_nbytes: int = 0):
    from transports.emulated import FaultSpec

    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    kw: dict[str, Any] = {"seed": seed, "min_nbytes": min_nbytes, "start": start, "stop": stop}
    if fault == "delay":
        kw.update(delay=rate, delay_ns=delay_ns)
    else:
        kw[fault] = rate
    return FaultSpec(**kw)


class _ServiceThread:
    """A DecoderService serving one endpoint accepted on ``url`` in a daemon thread."""

    def __init__(self, service, url: str, *, faults=None):
        import transports

        self.service = service
        self.listener = transports.listen(url, faults=faults) if faults is not None else transports.listen(url)
        self.endpoint = None
        self.url = self.listener.url
        self.report: dict = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qlink-fault-service", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            ep = self.listener.accept(timeout_s=30)
            self.endpoint = ep
            try:
                self.report = self.service.serve(ep, stop_event=self._stop)
            finally:
                ep.close()
        except BaseException as e:  # noqa: BLE001 - surfaced by close()
            self.error = e

    def close(self) -> dict:
        self._thread.join(10)
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(10)
        self.listener.close()
        return self.report or self.service.report()


def _controller_options(**options) -> dict:
    """The options this Controller accepts (older ones have no loss handling)."""
    import inspect

    from qlink.qec.controller import Controller

    params = inspect.signature(Controller.__init__).parameters
    return {k: v for k, v in options.items() if k in params}


def _classify_corruptions(log) -> dict:
    out = {"detectable": 0, "counter": 0, "benign": 0, "undetectable": 0}
    for ev in log:
        if ev.kind != "corrupt":
            continue
        f = field_of_offset(ev.bit >> 3)
        if f in DETECTABLE_FIELDS:
            out["detectable"] += 1
        elif f == "counter":
            out["counter"] += 1
        elif f in ("request_id", "ptp_timestamp"):
            out["benign"] += 1
        else:
            out["undetectable"] += 1
    return out


def qec_fault_run(fault: str, *, rate: float, transport: str = "tcp", num_shots: int = 400, distance: int = 3,
                  rounds_per_frame: int = 0, cycle_ns: int = 20_000, delay_ns: int = 20_000_000, seed: int = 1,
                  clean_tail_shots: int = 2, link: str = "ib-ndr", timeout_s: float = 60.0,
                  direction: str = "to_service", get_timeout_ns: int = 50_000_000, p: float = 0.001,
                  window: tuple[int, int | None] | None = None) -> dict:
    """The QEC loop (controller here, decoder service in a thread) with ``fault`` injected at
    ``rate``; returns the accounting (see the module docstring).

    ``direction="to_service"`` faults the syndrome frames (controller -> service);
    ``"to_controller"`` faults every answer of the service (service -> controller), which
    the controller meets with re-asks after ``get_timeout_ns``. ``rounds_per_frame=0``
    sends each shot in one frame; 1 sends one frame per round. A run that does not finish
    (a shot never answered) raises the controller's QlinkTimeoutError. ``window``
    (first, stop) overrides which frames may be faulted; ``p`` is the circuit noise.
    """
    import transports
    from qlink.qec.controller import Controller
    from qlink.qec.loop import build_source, sample_stream, source_spec
    from qlink.qec.service import DecoderConfig, DecoderService

    src = build_source(source_spec(distance=distance, rounds=distance, p=p))
    stream = sample_stream(src, num_shots=num_shots, seed=seed)
    frames_per_shot = len(stream.frames(rounds_per_frame=rounds_per_frame))
    service = DecoderService({0: DecoderConfig(decoder="pymatching", dem=src.dem, frames_per_shot=frames_per_shot)},
                             ack_enqueue="errors")
    if direction not in ("to_service", "to_controller"):
        raise ValueError(f"direction must be 'to_service' or 'to_controller', got {direction!r}")
    start, stop = window if window is not None else (0, (num_shots - clean_tail_shots) * frames_per_shot)
    if direction == "to_service":
        spec = _spec_for(fault, rate, seed=seed, delay_ns=delay_ns, start=start, stop=stop,
                         min_nbytes=SYNDROME_FRAME_MIN_NBYTES)
        service_faults = None
    else:
        spec = None
        service_faults = _spec_for(fault, rate, seed=seed, delay_ns=delay_ns, stop=None)
    base = f"emulated+{transports.loopback_url(transport, tag='qlink-fault')}?link={link}"
    st = _ServiceThread(service, base, faults=service_faults)
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)  # two busy-polling threads under one GIL: take turns often
    ep = None
    t0 = time.monotonic()
    try:
        ep = transports.connect(st.url.split("?", 1)[0] + f"?link={link}", faults=spec, timeout_s=10)
        ctl = Controller(ep, stream, cycle_ns=cycle_ns, rounds_per_frame=rounds_per_frame,
                         **_controller_options(get_timeout_ns=get_timeout_ns))
        res = ctl.run(timeout_s=timeout_s)
        faulty = ep if direction == "to_service" else st.endpoint
        stats = faulty.statistics()
        log = faulty.fault_log()
    finally:
        sys.setswitchinterval(old_switch)
        if ep is not None:
            ep.close()
        rep = st.close()
    elapsed = time.monotonic() - t0
    # a reordered frame that nothing overtook within hold_ns (a sender held off that long) left
    # in order: no reorder happened
    expired = stats.extra.get("reorders_expired", 0) if fault == "reorder" else 0
    injected = stats.extra["faults"][fault] - expired
    # every shot answered OK must carry *its own* correction: the offline decode of the same shot
    from qlink.qec.decoders import compile_decoder

    packed = np.packbits(stream.detectors, axis=1, bitorder="little")
    offline = np.asarray(compile_decoder("pymatching", src.dem).decode_shots_bit_packed(
        bit_packed_detection_event_data=packed), np.uint8)
    answered = res.correct >= 0
    misattributed = int((res.corrections[answered] != offline[answered]).any(axis=1).sum())
    counts, faults = rep.get("counts", {}), rep.get("faults", {})
    accounted = res.shots_ok + res.shots_dropped + res.shots_failed
    row = {
        "component": "qec", "direction": direction, "fault": fault, "transport": transport, "rate": rate, "frames_per_shot": frames_per_shot,
        "shots": num_shots, "frames_sent": stats.messages_sent, "injected": injected, "reorders_expired": expired,
        "decoded": res.shots_ok, "reported_lost": res.shots_dropped, "failed": res.shots_failed,
        "accounted_pct": 100.0 * accounted / num_shots, "logical_errors": res.logical_errors,
        "not_its_own_correction": misattributed,
        "service_decoded": counts.get("shots_decoded", 0), "service_dropped": counts.get("shots_dropped", 0),
        "frames_lost": counts.get("frames_lost", 0), "frames_refused": counts.get("frames_refused", 0),
        "counter_gap": faults.get("counter_gap", 0), "counter_backwards": faults.get("counter_backwards", 0),
        "service_faults": dict(faults), "controller_statuses": dict(res.statuses), "elapsed_s": elapsed,
        "gets_presumed_lost": getattr(ctl, "gets_presumed_lost", None),
        "answer_faults": dict(res.answer_faults),  # answers counted and ignored (duplicate, unknown, undecodable)
        "lost_shot_ids": [int(i) for i in np.flatnonzero(res.correct < 0)],
        "fault_indices": [e.index for e in log if e.kind == fault],
    }
    if rep.get("error") or st.error is not None:
        row["service_error"] = rep.get("error") or repr(st.error)
    if fault == "drop":
        row.update(detected=counts.get("frames_lost", 0), bound="next frame (counter gap)")
    elif fault == "dup":
        row.update(detected=faults.get("counter_backwards", 0), bound="on arrival (counter repeats)")
    elif fault == "reorder":
        row.update(detected=min(faults.get("counter_gap", 0), faults.get("counter_backwards", 0)),
                   bound="on arrival (gap, then counter backwards)")
    elif fault == "corrupt":
        cls = _classify_corruptions(log)
        refused = counts.get("frames_refused", 0) + faults.get("decoder_not_configured", 0) + \
            faults.get("syndrome_mapping_id", 0)
        row.update(corrupt_fields=cls, refused=refused, detected=refused + min(cls["counter"], faults.get(
            "counter_gap", 0) + faults.get("counter_backwards", 0) + faults.get("counter_jump", 0)),
            detectable=cls["detectable"] + cls["counter"], undetectable=cls["undetectable"], benign=cls["benign"],
            bound="on arrival (validation) / next frame (counter)")
    else:
        wire_in = rep.get("stages", {}).get("wire_in", {})
        wire_max = wire_in.get("max_ns") or 0
        row.update(wire_in_max_us=wire_max / 1e3, detected=injected if wire_max >= delay_ns else 0,
                   bound=f"service wire_in stage (ptp stamp -> parsed) >= delay_ns={delay_ns}")
    return row


# ------------------------------------------------------------------------------ KV


def kv_fault_run(fault: str, *, rate: float, transport: str = "tcp", num_requests: int = 60, seed: int = 1,
                 delay_ns: int = 2_000_000, num_blocks: int = 16, blocks_per_request: int = 4,
                 link: str = "ib-ndr", timeout_s: float = 30.0, checksum: bool = True) -> dict:
    """KV requests (``tiny`` preset, one-sided put) from a sender thread whose puts suffer
    ``fault``; the receiver here waits for a clean marker request, then classifies every
    request: complete and bit-exact, complete but corrupt (would need ``checksum=False``:
    no end-to-end check), failed with a typed error, or incomplete (its missing layers
    never reported)."""
    import transports
    from qlink.ai import KVCache, KVReceiver, KVSender, preset
    from qlink.ai import TransferAbortedError
    from qlink.errors import QlinkError

    spec = preset("tiny", num_blocks=num_blocks)
    rx_blocks = num_requests * blocks_per_request + 1  # every request lands in blocks of its own (+ the marker's)
    tx_cache, rx_cache = KVCache.allocate(spec), KVCache.allocate(spec.with_blocks(rx_blocks))
    tx_cache.fill_random(seed=seed)
    rng = np.random.default_rng(seed)
    dst_all = rng.permutation(np.arange(1, rx_blocks))
    reqs = []
    for i in range(num_requests):
        src = rng.choice(num_blocks, blocks_per_request, replace=False)
        reqs.append((src, dst_all[i * blocks_per_request:(i + 1) * blocks_per_request]))
    base = f"emulated+{transports.loopback_url(transport, tag='qlink-fault')}?link={link}"
    lis = transports.listen(base)
    # faults on the sender's puts only (its hello must arrive); the marker request is sent healed
    fspec = replace(_spec_for(fault, rate, seed=seed, delay_ns=delay_ns, stop=None), messages=False)
    sender_err: list = []
    marker = num_requests + 1
    t0 = time.monotonic()
    a = transports.connect(lis.url.split("?", 1)[0] + f"?link={link}", faults=fspec, timeout_s=10)
    b = lis.accept(timeout_s=10)
    rx = KVReceiver(b, rx_cache)
    tx = KVSender(a, tx_cache, mode="put", checksum=checksum)
    ids = list(range(1, num_requests + 1))

    def send_all():
        try:
            for rid, (src, dst) in zip(ids, reqs):
                tx.send_request(rid, src, dst, timeout_s=timeout_s)
            a.faults_enabled = False
            tx.send_request(marker, [0], [0], timeout_s=timeout_s)
        except BaseException as e:  # noqa: BLE001 - reported in the row
            sender_err.append(e)

    th = threading.Thread(target=send_all, name="qlink-fault-kv-sender", daemon=True)
    th.start()
    outcome = {"complete_exact": 0, "complete_corrupt": 0, "failed_typed": 0, "incomplete": 0}
    partial_layer_reported = 0
    try:
        rx.wait_request(marker, timeout_s=timeout_s)
        th.join(timeout_s)
        rx.progress()
        for rid, (src, dst) in zip(ids, reqs):
            try:
                rec = rx.wait_request(rid, timeout_s=0)
            except TransferAbortedError:
                outcome["failed_typed"] += 1
                ready = rx.ready_layers(rid)
            except QlinkError:
                outcome["incomplete"] += 1
                ready = rx.ready_layers(rid)
            else:
                exact = bool((rx_cache.block_checksums(dst) == tx_cache.block_checksums(src)).all())
                outcome["complete_exact" if exact else "complete_corrupt"] += 1
                continue
            # layers reported ready before the failure must be whole and exact
            for layer in range(ready):
                if fault == "corrupt" and not checksum:
                    continue  # a flipped bit inside a whole layer is the 'no end-to-end check' case
                if not (rx_cache.block_checksums(dst, layers=[layer]) ==
                        tx_cache.block_checksums(src, layers=[layer])).all():
                    partial_layer_reported += 1
            rx.release(rid)
        stats = a.statistics().extra
        rstats = rx.statistics()
    finally:
        rx.close()
        a.close()
        b.close()
        lis.close()
    injected = stats["put_faults"][fault] - (stats.get("put_reorders_expired", 0) if fault == "reorder" else 0)
    accounted = sum(outcome.values())
    row = {
        "component": "kv", "fault": fault, "transport": transport, "rate": rate, "requests": num_requests,
        "puts": stats.get("fault_eligible_puts", 0), "injected": injected, **outcome,
        "accounted_pct": 100.0 * accounted / num_requests, "partial_layers_reported": partial_layer_reported,
        "bad_frames": rstats.bad_frames, "requests_failed": rstats.requests_failed,
        "checksum": checksum, "crc_mismatches": rx.crc_mismatches,
        "elapsed_s": time.monotonic() - t0,
    }
    if sender_err:
        row["sender_error"] = f"{type(sender_err[0]).__name__}: {sender_err[0]}"
    if fault == "drop":
        row.update(detected=outcome["incomplete"], bound="never completes (missing part); seen at a timeout")
    elif fault == "dup":
        row.update(detected=outcome["failed_typed"], bound="on arrival (more parts than declared)")
    elif fault == "corrupt":
        if checksum:
            row.update(detected=outcome["failed_typed"], undetectable=outcome["complete_corrupt"],
                       bound="on arrival (the part's CRC-32 does not match)")
        else:
            row.update(detected=0, undetectable=outcome["complete_corrupt"],
                       bound="not detected (checksum=False: no end-to-end check)")
    elif fault == "reorder":
        row.update(detected=0, bound="harmless: parts complete a layer in any order")
    else:
        row.update(detected=0, bound="latency only")
    return row
