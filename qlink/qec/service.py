"""The decoder service: CUDA-Q realtime decoder RPC served over any qlink transport.

One message on the endpoint is one frame (24-byte header + payload, see
:mod:`qlink.wire`). The service holds up to 32 decoders (``decoder_id`` 0..31),
each configured in-process with a compiled decoder and the number of syndrome
bits one shot carries (the DEM's detector count):

* ``enqueue_syndromes`` appends a round (or a window of rounds) of detection events
  to the decoder's current shot. ``counter`` must grow by one per request and
  decoder: a gap means frames were lost, and the shots they touched are *dropped*
  (answered ``SYNDROMES_DROPPED`` later, counted); a jump further than the queue
  could ever hold is taken for a corrupt counter and refused, unless the next frame
  continues from it (a renumbering: only the refused frame counts as lost). A request that does not fit the
  shot (more bits than the shot has left, or a multi-shot window that is not whole
  shots) is ``BAD_REQUEST`` and changes nothing, so the sender may retry it with the
  same counter. Only ``syndrome_mapping_id`` 0 (identity) is known.
* A shot whose bits have all arrived is queued; the service decodes every queued
  shot in one ``decode_shots_bit_packed`` call as soon as it has drained the
  frames waiting on the transport (batching is what keeps up with the cycle).
* ``get_corrections`` answers the oldest completed shot's observable flips, packed
  LSB first (``return_size`` bits, at most the decoder's observable count);
  ``NOT_READY`` while no shot is complete; ``SYNDROMES_DROPPED`` for a dropped shot.
  ``reset=1`` consumes the shot, ``reset=0`` only peeks at it.
* Retransmission (a qlink extension, so a lost answer costs no shot): the answers of
  the decoder's last ``capacity_shots`` consuming ``get_corrections`` are kept by
  ``request_id``. A peek (``reset=0``) repeating one of those request ids, or the very
  same request again (same request_id and the same non-zero ``ptp_timestamp``: a
  duplicate on the way), is answered with the kept answer byte for byte, its first
  ``ptp_timestamp`` echoed (so a sender tells a replay from a fresh peek), and
  consumes nothing. A request_id answered ``NOT_READY`` or refused keeps no answer; a
  sender that numbers nothing (request_id repeated, ptp_timestamp 0) sees no
  difference unless it peeks.
* ``reset_decoder`` forgets the decoder's partial shot, queue and counter; a new peer
  (:meth:`DecoderService.serve` handed an endpoint other than the last) starts with
  every decoder reset, whatever the controller before it left behind.
* The queue is bounded (``capacity_shots``): a shot that finds it full is refused
  with ``BUSY`` and dropped (its counter is used up, its later frames discarded,
  ``get_corrections`` answers ``SYNDROMES_DROPPED`` for it); memory never grows
  with load.
* A frame may carry several whole shots, and ``get_corrections`` with
  ``return_size`` = m × observables answers the m oldest shots at once (their
  flips one after the other). A window holding dropped shots (a qlink extension
  of the protocol) is answered ``SYNDROMES_DROPPED`` with a result: the flips of
  the m shots (zeros for the dropped ones), then an m-bit mask of the dropped
  ones, each part packed LSB first and byte-padded.

Corrupt frames get ``BAD_REQUEST`` (``INVALID_DECODER`` for a decoder id out of
range) where the header's ``request_id`` could be read; every refusal is counted by
its fault. ``request_id`` and ``ptp_timestamp`` are echoed. In CUDA-Q realtime
``enqueue_syndromes`` may be fire-and-forget: ``ack_enqueue`` chooses whether the
service answers every enqueue (``"all"``), only refused ones (``"errors"``) or none.

>>> import stim, transports
>>> from qlink import wire
>>> from qlink.qec.service import DecoderConfig, DecoderService
>>> dem = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=2,
...                              after_clifford_depolarization=0.01).detector_error_model()
>>> svc = DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem)})
>>> svc.decoder_shape(0)                     # (syndrome bits per shot, observables)
(6, 1)
>>> lis = transports.listen("inproc://doc-service")
>>> client = transports.connect("inproc://doc-service"); server = lis.accept(timeout_s=1)
>>> buf = bytearray(128)
>>> n = wire.encode_enqueue_syndromes_into(buf, request_id=1, decoder_id=0, counter=0,
...         syndrome_mapping_id=0, syndromes=[1, 0, 0, 0, 0, 0])
>>> client.send(buf[:n])
>>> n = wire.encode_get_corrections_into(buf, request_id=2, decoder_id=0, return_size=1, reset=True)
>>> client.send(buf[:n])
>>> report = svc.serve(server, max_requests=2, timeout_s=5)
>>> [wire.decode_response(client.recv(timeout_s=1)).status for _ in range(2)]
[<Status.OK: 0>, <Status.OK: 0>]
>>> report["counts"]["shots_decoded"]
1
>>> client.close(); server.close(); lis.close()
"""

from __future__ import annotations

import gc
import operator
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from qlink import wire
from qlink.clock import now_ns
from qlink.errors import BrokenLinkError, ClosedError, WouldBlock
from qlink.wire import Status
from transports import Backoff, BufferTooSmallError

from ._decoder_state import _Decoder, compile_decoder
from ._service_frames import _MAX_FRAME_NBYTES, ServiceFrames, _SessionRefused
from .timeline import SERVICE_SHOT_FIELDS, ShotRecords, StageRecorder

__all__ = [
    "DecoderConfig",
    "DecoderService",
    "SERVICE_STAGES",
    "compile_decoder",
]

# Stages the service times (ns), one histogram each.
SERVICE_STAGES = (
    "wire_in",  # request ptp_timestamp (sender's wall/PTP clock) -> parsed here (same clock)
    "parse",  # received -> validated and queued / applied
    "queue",  # shot complete -> its decode starts
    "decode",  # one decoder call (a batch of shots)
    "decode_per_shot",  # decoder call time / shots in it
    "respond",  # decode end -> corrections handed to the transport
    "residence",  # get_corrections received -> answer handed to the transport
    "shot_service",  # last syndrome frame received -> its corrections sent
)
# Samples are per shot, except where several whole shots share a frame and an answer:
# then queue, respond and shot_service take one sample per frame / answer.

_ACK_MODES = ("all", "errors", "none")
# counts kept in plain attributes on the hot path, folded into ``counts`` when read
_HOT_COUNTS = (("requests", "_n_requests"), ("enqueue", "_n_enqueue"), ("get_corrections", "_n_get"),
               ("shots_completed", "_n_completed"), ("decode_calls", "_n_decode_calls"),
               ("shots_decoded", "_n_decoded"))




@dataclass(frozen=True)
class DecoderConfig:
    """How one decoder of the service is built (in-process; nothing of it crosses the wire).

    ``decoder``: a decoder name, decoder object or compiled decoder; ``dem``: the
    ``stim.DetectorErrorModel`` it decodes (its detector count is the shot size);
    ``capacity_shots``: the bounded queue; ``frames_per_shot``: how many
    ``enqueue_syndromes`` frames make one shot, used to realign exactly after lost
    frames (when ``None`` it is learned from the first clean shot). ``shared``: where the
    service serves many controllers at once (:mod:`qlink.qec.sessions`), every session
    feeds this one decoder state (say, each controller streams its own decoder id);
    by default each session has a state of its own (the compiled decoder is shared).
    """

    decoder: Any = "pymatching"
    dem: Any = None
    num_detectors: int | None = None
    num_observables: int | None = None
    capacity_shots: int = 1024
    frames_per_shot: int | None = None
    shared: bool = False

    def __post_init__(self):
        for name in ("capacity_shots", "frames_per_shot", "num_detectors", "num_observables"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                try:
                    object.__setattr__(self, name, operator.index(v))
                except TypeError:
                    raise TypeError(f"{name} must be an integer, got {v!r}") from None
        if not isinstance(self.capacity_shots, int) or self.capacity_shots < 1:
            raise ValueError(f"capacity_shots must be a positive int, got {self.capacity_shots!r}")
        if self.frames_per_shot is not None and (not isinstance(self.frames_per_shot, int) or self.frames_per_shot < 1):
            raise ValueError(f"frames_per_shot must be a positive int or None, got {self.frames_per_shot!r}")
        if self.dem is None and (self.num_detectors is None or self.num_observables is None):
            raise ValueError("DecoderConfig needs dem= (or num_detectors= and num_observables= with a compiled decoder)")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "DecoderConfig":
        """Build from plain data: ``{"source": {...}, "decoder": "pymatching", ...}``.

        ``source`` is a syndrome-source spec (see :func:`qlink.qec.loop.build_source`);
        the DEM is rebuilt here, never shipped.
        """
        from .specs import build_source

        spec = dict(spec)
        src = spec.pop("source", None)
        if src is None:
            raise ValueError("a decoder spec needs a 'source' entry (code, distance, rounds, p ...)")
        allowed = {"decoder", "capacity_shots", "frames_per_shot", "shared"}
        unknown = set(spec) - allowed
        if unknown:
            raise ValueError(f"unknown decoder spec keys {sorted(unknown)}; allowed: {sorted(allowed | {'source'})}")
        return cls(dem=build_source(src).dem, **spec)


class DecoderService(ServiceFrames):
    """Serves up to 32 decoders over one endpoint at a time (see the module docstring).

    ``max_batch_requests``: frames drained from the transport before the pending
    shots are decoded and the answers sent; ``keep_samples``: how many rows of raw
    timestamps to keep, one per answered shot or per frame of whole shots answered
    together (0: histograms only). The hot path does no per-shot Python work: a
    frame's shots are copied, stamped and answered with NumPy slices, decoded in one
    call, and stage samples are parked and counted in bulk.
    """

    __slots__ = ("_decoders", "_active", "_home", "_configs", "ack_enqueue", "_ack_all", "_ack_errors", "max_batch_requests",
                 "max_decode_batch", "_rx", "_rx_mv", "_rx_np", "_tx", "_tx_mv", "_tx_np", "_staged", "_st_plan",
                 "_peer", "_n_staged", "_ep", "_sendto", "stages", "shots", "_keep", "_counts", "faults", "statuses",
                 "_batch_log2", "_serve_wall_s", "_serve_cpu_s", "_t_ready", "_busy_ns", "_served",
                 *(f"_rec_{name}" for name in SERVICE_STAGES), *(attr for _, attr in _HOT_COUNTS))

    def __init__(self, configs: Mapping[int, DecoderConfig], *, ack_enqueue: str = "all",
                 max_batch_requests: int = 256, max_decode_batch: int = 4096, keep_samples: int = 0) -> None:
        if ack_enqueue not in _ACK_MODES:
            raise ValueError(f"ack_enqueue must be one of {_ACK_MODES}, got {ack_enqueue!r}")
        if not configs:
            raise ValueError("DecoderService needs at least one decoder config")
        if max_batch_requests < 1 or max_decode_batch < 1:
            raise ValueError("max_batch_requests and max_decode_batch must be >= 1")
        self._decoders: list[_Decoder | None] = [None] * wire.MAX_DECODERS
        for did, cfg in configs.items():
            if not isinstance(did, int) or not 0 <= did < wire.MAX_DECODERS:
                raise ValueError(f"decoder ids must be ints in [0, {wire.MAX_DECODERS}), got {did!r}")
            if not isinstance(cfg, DecoderConfig):
                raise TypeError(f"configs[{did}] must be a DecoderConfig, got {type(cfg).__name__}")
            self._decoders[did] = _Decoder(did, cfg)
        self._active = [d for d in self._decoders if d is not None]
        self._configs = dict(configs)
        self._home = (self._decoders, self._active)  # the service's own states (sessions bring theirs)
        self.ack_enqueue = ack_enqueue
        self._ack_all = ack_enqueue == "all"
        self._ack_errors = ack_enqueue != "none"
        self.max_batch_requests = int(max_batch_requests)
        self.max_decode_batch = int(max_decode_batch)
        self._rx = bytearray(_MAX_FRAME_NBYTES)
        self._rx_mv = memoryview(self._rx)
        self._rx_np = np.frombuffer(self._rx, np.uint8)
        # room for the largest answer: get_corrections of many shots (return_size up to the wire's cap)
        self._tx = bytearray(wire.HEADER_NBYTES + (wire.MAX_CORRECTION_BITS + 7) // 8)
        self._tx_mv = memoryview(self._tx)
        self._tx_np = np.frombuffer(self._tx, np.uint8)
        wire.encode_response_header_into(self._tx, status=Status.OK, result_len=0, request_id=0)
        # staged answers of the current batch (preallocated)
        m = self.max_batch_requests + 1
        # one tuple per answer: (kind, status, request_id, ptp, t_in, function, decoder, shot seq,
        # bits, peer — the sender, for any-peer (datagram) endpoints, place among the kept answers)
        self._staged: list = [None] * m
        self._st_plan: list = [None] * m  # a window's shots when it holds dropped ones
        self._peer = None
        self._n_staged = 0
        self._ep = None
        self._sendto = None
        self.stages = StageRecorder(SERVICE_STAGES)
        for name in SERVICE_STAGES:  # hot-path adders: samples parked, counted in bulk (see StageRecorder)
            setattr(self, f"_rec_{name}", self.stages.adder(name))
        self.shots = ShotRecords(SERVICE_SHOT_FIELDS, capacity=int(keep_samples))
        self._keep = self.shots.capacity > 0
        self._counts: Counter = Counter()
        for _, attr in _HOT_COUNTS:
            setattr(self, attr, 0)
        self.faults: Counter = Counter()
        self.statuses: Counter = Counter()
        self._batch_log2 = [0] * 65  # log2 buckets of shots per decoder call
        self._serve_wall_s = self._serve_cpu_s = 0.0
        self._t_ready = 0  # when the service last came back to receiving (its earlier work done)
        self._busy_ns = 0  # wall time from each batch's first frame in to its answers out
        self._served = None  # the endpoint served last (a new one means a new peer: see serve)

    @property
    def counts(self) -> Counter:
        """Requests, frames and shots counted so far, by what became of them."""
        c = self._counts
        for name, attr in _HOT_COUNTS:
            v = getattr(self, attr)
            if v:
                c[name] += v
                setattr(self, attr, 0)
        return c

    @property
    def batch_sizes(self) -> np.ndarray:
        """Decoder calls by shots per call, in log2 buckets (bucket i: 2**(i-1) <= n < 2**i)."""
        return np.array(self._batch_log2, np.int64)

    # ------------------------------------------------------------------ queries
    def decoder_shape(self, decoder_id: int) -> tuple[int, int]:
        """``(syndrome bits per shot, observables)`` of a configured decoder."""
        d = self._decoder(decoder_id)
        if d is None:
            raise KeyError(f"decoder {decoder_id} is not configured")
        return d.num_det, d.num_obs

    def backlog_shots(self, decoder_id: int) -> int:
        """Shots queued (complete, not yet answered) in a decoder."""
        d = self._decoders[decoder_id]
        return 0 if d is None else d.cmp - d.ret

    def max_frame_nbytes(self) -> int:
        """The longest request this service's decoders can use: an ``enqueue_syndromes`` of a
        whole queue of the largest decoder's shots (capped by the wire's 2^20 bits). A
        stream that announces more is refused from its header (see :mod:`qlink.qec.sessions`)."""
        return wire.longest_enqueue_nbytes((d.num_det, d.capacity) for d in self._home[1])

    def _session_states(self) -> tuple[list, list]:
        """Decoder states for a new session: its own, reusing each compiled decoder, except
        for decoders configured ``shared`` (every session feeds the service's one)."""
        decs: list = [None] * wire.MAX_DECODERS
        for d in self._home[1]:
            cfg = self._configs[d.id]
            decs[d.id] = d if cfg.shared else _Decoder(d.id, cfg, compiled=d.compiled)
        return decs, [x for x in decs if x is not None]

    def _use_states(self, decoders: list, active: list) -> None:
        self._decoders = decoders
        self._active = active

    def _decoder(self, decoder_id: int):
        return self._decoders[decoder_id] if 0 <= decoder_id < wire.MAX_DECODERS else None

    # ------------------------------------------------------------------ loop
    def serve(self, endpoint, *, stop_event: threading.Event | None = None, max_requests: int | None = None,
              timeout_s: float | None = None, idle_timeout_s: float | None = None, spin: int = 20000) -> dict:
        """Serve requests from ``endpoint`` (busy-poll) until the peer leaves, ``stop_event``
        is set, ``max_requests`` have been handled, or ``timeout_s`` has passed.

        An endpoint other than the one served last is a new peer: every decoder is reset
        first (counter, partial shot, queued answers), as ``reset_decoder`` would, so a
        controller that follows one that died needs no reset of its own. Serving the same
        endpoint again continues where the last call stopped.

        ``spin``: empty polls before the loop starts to sleep between polls (up to
        0.2 ms), so an idle service does not burn a core forever. Returns
        :meth:`report`. A peer that closes ends the loop normally; any other
        transport failure propagates.
        """
        if max_requests is not None and max_requests < 1:
            raise ValueError(f"max_requests must be >= 1 or None, got {max_requests}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if endpoint is not self._served:
            if self._served is not None:
                self._reset_all()
            self._served = endpoint  # (held, not its id: a closed endpoint's id may come back)
        self._ep = endpoint
        rx = self._rx
        recv = endpoint.recv_into_nowait
        # An any-peer endpoint (a datagram socket serving many controllers) answers each
        # frame's own sender: receive with recvfrom, answer with sendto.
        recvfrom = getattr(endpoint, "recvfrom_into_nowait", None)
        self._sendto = getattr(endpoint, "sendto", None) if recvfrom is not None else None
        if self._sendto is None:
            recvfrom = None
        handle = self._handle
        limit = self.max_batch_requests
        backoff = Backoff(spin=spin, max_sleep_s=2e-4)
        handled = 0
        idle_since = None
        self._counts["serve_calls"] += 1
        # What exists now lives as long as the service: keep the cyclic collector off it
        # (a full collection over every imported module is a pause of milliseconds).
        gc.freeze()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            while True:
                n_batch = 0
                while n_batch < limit:
                    try:
                        if recvfrom is None:
                            n = recv(rx)
                        else:
                            n, self._peer = recvfrom(rx)
                    except WouldBlock:
                        break
                    except BufferTooSmallError as e:
                        t = now_ns()
                        self._oversized(endpoint, e.needed_nbytes, t)
                    else:
                        t = now_ns()
                        handle(n, t)
                    if not n_batch:
                        t_busy = t  # the first frame of this batch is in: busy from here to the flush's end
                    n_batch += 1
                    if max_requests is not None and handled + n_batch >= max_requests:
                        break
                if n_batch:
                    handled += n_batch
                    self._flush()
                    self._busy_ns += self._t_ready - t_busy
                    backoff.reset()
                    idle_since = None
                    if max_requests is not None and handled >= max_requests:
                        break
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    continue
                if stop_event is not None and stop_event.is_set():
                    break
                if not backoff.spinning:  # idle for a while: now the clock reads are cheap
                    t = time.monotonic()
                    if idle_since is None:
                        idle_since = t
                    if deadline is not None and t >= deadline:
                        break
                    if idle_timeout_s is not None and t - idle_since >= idle_timeout_s:
                        break
                backoff.pause()
        except (BrokenLinkError, ClosedError):
            self._counts["peer_closed"] += 1
            self._n_staged = 0
            self._st_plan = [None] * len(self._st_plan)
        except _SessionRefused:
            self._n_staged = 0
        finally:
            self._ep = None
            self._sendto = None
            self._peer = None
            self.stages.settle()
            # CPU time beside wall time: a busy-polling service that got much less CPU than
            # wall time was descheduled (a loaded machine), and its figures say so
            self._serve_wall_s += time.perf_counter() - wall0
            self._serve_cpu_s += time.thread_time() - cpu0
        return self.report()

    # ------------------------------------------------------------------ results
    def report(self) -> dict:
        """Everything the service measured, as plain JSON-able data."""
        out = {
            "counts": dict(self.counts),
            "faults": dict(self.faults),
            "statuses": dict(self.statuses),
            "stages": self.stages.to_dict(),
            "decode_batch_log2_histogram": self.batch_sizes.tolist(),
            "ack_enqueue": self.ack_enqueue,
            "serve_wall_s": self._serve_wall_s,
            "serve_cpu_s": self._serve_cpu_s,
            "serve_busy_s": self._busy_ns / 1e9,  # of the wall time: handling, decoding, answering
            "decoders": {
                str(d.id): {"num_detectors": d.num_det, "num_observables": d.num_obs, "capacity_shots": d.capacity,
                            "frames_per_shot": d.frames_per_shot, "backlog_shots": d.cmp - d.ret}
                for d in self._active
            },
        }
        for k in ("shots_decoded", "shots_completed", "shots_dropped", "requests"):
            out["counts"].setdefault(k, 0)
        if self.shots.capacity:
            out["shots"] = self.shots.to_dict()
            out["shots_not_kept"] = self.shots.dropped
        return out
