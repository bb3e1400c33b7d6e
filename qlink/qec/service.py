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
* ``reset_decoder`` forgets the decoder's partial shot, queue and counter.
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

import operator
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from qlink import wire
from qlink.clock import now_ns, ptp_now_ns
from qlink.errors import BrokenLinkError, ClosedError, WouldBlock
from qlink.wire import FrameError, Status
from transports._base import Backoff, BufferTooSmallError

from ._decoder_state import _Decoder, _decode_packed, compile_decoder
from .timeline import SERVICE_SHOT_FIELDS, ShotRecords, StageRecorder, record_values

__all__ = [
    "DecoderConfig",
    "DecoderService",
    "SERVICE_STAGES",
    "compile_decoder",
    "run_service_process",
    "ServiceProcess",
    "start_service_process",
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
_MAX_FRAME_NBYTES = wire.enqueue_syndromes_nbytes(wire.MAX_SYNDROME_BITS)
# Response header fields after the magic (status, result_len, request_id, ptp_timestamp):
# the layout of qlink.wire's response header, patched in place on the hot path.
_RESP_FIELDS = struct.Struct("<iIIQ")
_RESP_FIELDS_OFFSET = 4

_STATUS_NAMES = {int(st): st.name for st in Status}

# staged-response kinds
_PLAIN, _CORRECTIONS = 0, 1
_FN_ENQ, _FN_GET, _FN_RESET, _FN_BAD = 0, 1, 2, 3


@dataclass(frozen=True)
class DecoderConfig:
    """How one decoder of the service is built (in-process; nothing of it crosses the wire).

    ``decoder``: a decoder name, decoder object or compiled decoder; ``dem``: the
    ``stim.DetectorErrorModel`` it decodes (its detector count is the shot size);
    ``capacity_shots``: the bounded queue; ``frames_per_shot``: how many
    ``enqueue_syndromes`` frames make one shot, used to realign exactly after lost
    frames (when ``None`` it is learned from the first clean shot).
    """

    decoder: Any = "pymatching"
    dem: Any = None
    num_detectors: int | None = None
    num_observables: int | None = None
    capacity_shots: int = 1024
    frames_per_shot: int | None = None

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
        from .loop import build_source

        spec = dict(spec)
        src = spec.pop("source", None)
        if src is None:
            raise ValueError("a decoder spec needs a 'source' entry (code, distance, rounds, p ...)")
        allowed = {"decoder", "capacity_shots", "frames_per_shot"}
        unknown = set(spec) - allowed
        if unknown:
            raise ValueError(f"unknown decoder spec keys {sorted(unknown)}; allowed: {sorted(allowed | {'source'})}")
        return cls(dem=build_source(src).dem, **spec)


class DecoderService:
    """Serves up to 32 decoders over one endpoint at a time (see the module docstring).

    ``max_batch_requests``: frames drained from the transport before the pending
    shots are decoded and the answers sent; ``keep_samples``: how many shots' raw
    timestamps to keep (0: histograms only).
    """

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
        self.ack_enqueue = ack_enqueue
        self._ack_all = ack_enqueue == "all"
        self._ack_errors = ack_enqueue != "none"
        self.max_batch_requests = int(max_batch_requests)
        self.max_decode_batch = int(max_decode_batch)
        self._rx = bytearray(_MAX_FRAME_NBYTES)
        self._rx_mv = memoryview(self._rx)
        # room for the largest answer: get_corrections of many shots (return_size up to the wire's cap)
        self._tx = bytearray(wire.HEADER_NBYTES + (wire.MAX_CORRECTION_BITS + 7) // 8)
        self._tx_mv = memoryview(self._tx)
        self._tx_np = np.frombuffer(self._tx, np.uint8)
        wire.encode_response_header_into(self._tx, status=Status.OK, result_len=0, request_id=0)
        # staged answers of the current batch (preallocated)
        m = self.max_batch_requests + 1
        self._st_kind = [0] * m
        self._st_status = [0] * m
        self._st_rid = [0] * m
        self._st_ptp = [0] * m
        self._st_dec = [0] * m
        self._st_seq = [0] * m
        self._st_bits = [0] * m
        self._st_tin = [0] * m
        self._st_fn = [0] * m
        self._st_peer = [None] * m  # sender of each staged frame, for any-peer (datagram) endpoints
        self._st_plan: list = [None] * m  # a window's shots when it holds dropped ones
        self._peer = None
        self._n_staged = 0
        self._ep = None
        self._sendto = None
        self.stages = StageRecorder(SERVICE_STAGES)
        for name in SERVICE_STAGES:  # bound record methods for the hot path
            setattr(self, f"_rec_{name}", self.stages.histogram(name).record)
        self.shots = ShotRecords(SERVICE_SHOT_FIELDS, capacity=int(keep_samples))
        self.counts: Counter = Counter()
        self.faults: Counter = Counter()
        self.statuses: Counter = Counter()
        self.batch_sizes = np.zeros(65, np.int64)  # log2 buckets of shots per decoder call

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

    def _decoder(self, decoder_id: int):
        return self._decoders[decoder_id] if 0 <= decoder_id < wire.MAX_DECODERS else None

    # ------------------------------------------------------------------ staging
    def _stage(self, kind: int, status: int, rid: int, ptp: int, t_in: int, fn: int,
               dec: int = 0, seq: int = 0, bits: int = 0) -> None:
        i = self._n_staged
        self._st_kind[i] = kind
        self._st_status[i] = status
        self._st_rid[i] = rid
        self._st_ptp[i] = ptp
        self._st_tin[i] = t_in
        self._st_fn[i] = fn
        self._st_dec[i] = dec
        self._st_seq[i] = seq
        self._st_bits[i] = bits
        self._st_peer[i] = self._peer
        self._st_plan[i] = None
        self._n_staged = i + 1

    def _refuse(self, fault: str, status: int, rid: int, ptp: int, t_in: int, fn: int) -> None:
        self.faults[fault] += 1
        if fn != _FN_ENQ or self._ack_errors:
            self._stage(_PLAIN, status, rid, ptp, t_in, fn)
        else:
            self.statuses[f"{Status(status).name}_unsent"] += 1

    # ------------------------------------------------------------------ handlers
    def _handle(self, mv: memoryview, t_in: int) -> None:
        self.counts["requests"] += 1
        try:
            req = wire.decode_request(mv)
        except FrameError as e:
            self.faults[e.fault.value] += 1
            self.counts["frames_refused"] += 1
            if e.request_id is not None:
                self._stage(_PLAIN, int(e.fault.status), e.request_id, e.ptp_timestamp or 0, t_in, _FN_BAD)
            else:
                self.counts["frames_unanswerable"] += 1
            return
        ptp = req.ptp_timestamp
        if ptp:  # the sender's wall-clock (PTP) send stamp
            self._rec_wire_in(ptp_now_ns() - ptp)
        fid = req.function_id
        if fid == wire.ENQUEUE_SYNDROMES:
            self._enqueue(req.payload, req.request_id, ptp, t_in)
        elif fid == wire.GET_CORRECTIONS:
            self._get(req.payload, req.request_id, ptp, t_in)
        elif fid == wire.RESET_DECODER:
            self._reset(req.payload, req.request_id, ptp, t_in)
        else:  # registered elsewhere (another qlink function) but not served here
            self.faults["function_not_served"] += 1
            self._stage(_PLAIN, int(Status.BAD_REQUEST), req.request_id, ptp, t_in, _FN_BAD)
            return
        self._rec_parse(now_ns() - t_in)

    def _enqueue(self, p, rid: int, ptp: int, t_in: int) -> None:
        self.counts["enqueue"] += 1
        d = self._decoder(p.decoder_id)
        if d is None:
            return self._refuse("decoder_not_configured", Status.INVALID_DECODER, rid, ptp, t_in, _FN_ENQ)
        if p.syndrome_mapping_id != 0:
            return self._refuse("syndrome_mapping_id", Status.BAD_REQUEST, rid, ptp, t_in, _FN_ENQ)
        n = p.num_syndromes
        counter = p.counter
        nxt = d.next_counter
        if nxt is not None and counter != nxt:
            if counter < nxt:
                return self._refuse("counter_backwards", Status.BAD_REQUEST, rid, ptp, t_in, _FN_ENQ)
            if counter - nxt > d.capacity * (d.frames_per_shot or 1) * d.shots_per_frame:
                if counter != d.jump_candidate + 1:
                    # More frames lost than the queue could ever hold: more likely a corrupt counter
                    # than a real loss. Refuse it (nothing changes); its successor confirms a jump.
                    d.jump_candidate = counter
                    return self._refuse("counter_jump", Status.BAD_REQUEST, rid, ptp, t_in, _FN_ENQ)
                # Confirmed: the sender renumbered. Only the refused frame is lost.
                self.faults["counter_resync"] += 1
                nxt = d.next_counter = counter - 1
            # Lost frames: check the frame fits before touching state, then realign.
            self.faults["counter_gap"] += 1
            self.counts["frames_lost"] += counter - nxt
            self._realign(d, counter - nxt)
            d.next_counter = counter  # the lost frames are accounted for, whatever becomes of this one
        if d.discard_frames:
            d.discard_frames -= 1
            d.next_counter = counter + 1
            self.counts["frames_discarded"] += 1
            if self._ack_all:
                self._stage(_PLAIN, int(Status.SYNDROMES_DROPPED), rid, ptp, t_in, _FN_ENQ)
            return
        filled = d.filled if d.filling else 0
        nd = d.num_det
        if filled + n > nd:
            # Whole shots in one frame are fine when the frame starts a shot.
            if filled or n % nd:
                return self._refuse("syndrome_count", Status.BAD_REQUEST, rid, ptp, t_in, _FN_ENQ)
            whole = n // nd
            if d.occupancy + whole > d.capacity:  # no room: these shots are dropped, and say so
                self.counts["shots_refused_busy"] += whole
                self._drop_busy(d, whole, counter, frames_left=0)
                return self._refuse("queue_full", Status.BUSY, rid, ptp, t_in, _FN_ENQ)
            self._enqueue_whole_shots(d, p.syndromes_bits_packed, whole, rid, ptp, t_in)
            d.next_counter = counter + 1
            if self._ack_all:
                self._stage(_PLAIN, int(Status.OK), rid, ptp, t_in, _FN_ENQ)
            return
        if not d.filling:
            if d.occupancy >= d.capacity:  # no room for a new shot: it is dropped, its other frames discarded
                self.counts["shots_refused_busy"] += 1
                F = d.frames_per_shot or 1
                self._drop_busy(d, 1, counter, frames_left=F - 1 if n < nd else 0)
                return self._refuse("queue_full", Status.BUSY, rid, ptp, t_in, _FN_ENQ)
            self._start_shot(d)
        self._append(d, p.syndromes_bits_packed, 0, n)
        self._finish_frame(d, rid, ptp, t_in)
        d.next_counter = counter + 1
        if self._ack_all:
            self._stage(_PLAIN, int(Status.OK), rid, ptp, t_in, _FN_ENQ)

    def _drop_busy(self, d: _Decoder, shots: int, counter: int, *, frames_left: int) -> None:
        """A frame refused BUSY: its shots count as dropped (answered SYNDROMES_DROPPED in turn)
        and its counter is used up, so nothing waits on a frame that will never come."""
        d.pending_drops += shots
        d.drops_total += shots
        d.discard_frames = frames_left
        d.next_counter = counter + 1
        self.counts["shots_dropped"] += shots

    def _enqueue_whole_shots(self, d: _Decoder, packed: memoryview, whole: int, rid: int, ptp: int,
                             t_in: int) -> None:
        """A frame carrying ``whole`` complete shots: copy them into the ring in one go."""
        nd, nbd, cap = d.num_det, d.nbd, d.capacity
        raw = np.frombuffer(packed, np.uint8)
        if nd & 7 == 0:
            rows = raw[:whole * nbd].reshape(whole, nbd)
        else:
            bits = np.unpackbits(raw, count=whole * nd, bitorder="little").reshape(whole, nd)
            rows = np.packbits(bits, axis=1, bitorder="little")
        t_done = now_ns()
        done = 0
        while done < whole:
            a = (d.cmp + done) % cap
            c = min(whole - done, cap - a)
            d.syn[a:a + c] = rows[done:done + c]
            d.drops_before[a:a + c] = [0] * c
            d.rid_last[a:a + c] = [rid] * c
            d.ptp_last[a:a + c] = [ptp] * c
            d.t_in_last[a:a + c] = [t_in] * c
            d.t_complete[a:a + c] = [t_done] * c
            done += c
        d.drops_before[d.cmp % cap] = d.pending_drops
        d.pending_drops = 0
        d.cmp += whole
        d.shots_per_frame = whole
        if d.frames_per_shot is None:
            d.frames_per_shot = 1
        self.counts["shots_completed"] += whole

    def _start_shot(self, d: _Decoder) -> None:
        # No need to zero the row: appends start at bit 0 and each writes whole bytes
        # (zeros above its bits), so no stale bit of an earlier shot survives.
        slot = d.cmp % d.capacity
        d.drops_before[slot] = d.pending_drops
        d.pending_drops = 0
        d.filling = True
        d.filled = 0
        d.frames_in_shot = 0

    @staticmethod
    def _append(d: _Decoder, packed: memoryview, bit_offset: int, n: int) -> None:
        """OR ``n`` bits of ``packed`` starting at ``bit_offset`` into the filling shot."""
        v = int.from_bytes(packed[bit_offset >> 3:(bit_offset + n + 7) >> 3], "little")
        if bit_offset & 7:
            v >>= bit_offset & 7
        if n & 7 or bit_offset & 7:
            v &= (1 << n) - 1  # pad bits (and the next shot's bits) are not this shot's syndrome
        f = d.filled
        o, b = f & 7, f >> 3
        k = (o + n + 7) >> 3
        base = (d.cmp % d.capacity) * d.nbd + b
        if o:
            v = (v << o) | d.syn_mv[base]
        d.syn_mv[base:base + k] = v.to_bytes(k, "little")
        d.filled = f + n

    def _finish_frame(self, d: _Decoder, rid: int, ptp: int, t_in: int) -> None:
        d.frames_in_shot += 1
        if d.filled < d.num_det:
            return
        slot = d.cmp % d.capacity
        d.rid_last[slot] = rid
        d.ptp_last[slot] = ptp
        d.t_in_last[slot] = t_in
        d.t_complete[slot] = now_ns()
        d.cmp += 1
        d.filling = False
        if d.frames_per_shot is None:
            d.frames_per_shot = d.frames_in_shot
        self.counts["shots_completed"] += 1

    @staticmethod
    def _abandon_filling(d: _Decoder) -> None:
        """Give up the shot being filled; the drops that preceded it stay pending."""
        d.filling = False
        d.pending_drops += d.drops_before[d.cmp % d.capacity]
        d.drops_before[d.cmp % d.capacity] = 0

    def _realign(self, d: _Decoder, gap: int) -> None:
        """Account for ``gap`` lost frames: drop every shot they touched."""
        F = d.frames_per_shot
        if F is None:  # layout unknown: drop the shot in progress, restart at this frame
            if d.filling:
                self._abandon_filling(d)
                d.pending_drops += 1
                d.drops_total += 1
                self.counts["shots_dropped"] += 1
            return
        discarding = d.discard_frames > 0
        was_filling = d.filling
        if d.filling:
            q = d.frames_in_shot
            self._abandon_filling(d)
        elif discarding:
            q = F - d.discard_frames
        else:
            q = 0
        if F == 1 and d.shots_per_frame > 1 and not was_filling and not discarding:
            # frames of several whole shots each: every lost frame took that many shots
            d.pending_drops += gap * d.shots_per_frame
            d.drops_total += gap * d.shots_per_frame
            self.counts["shots_dropped"] += gap * d.shots_per_frame
            return
        k, r = divmod(q + gap, F)
        new_drops = 0
        if k >= 1:
            new_drops += k - (1 if discarding else 0)
            if r:
                new_drops += 1
                d.discard_frames = F - r
            else:
                d.discard_frames = 0
        else:
            if not discarding:
                new_drops += 1
            d.discard_frames = F - r
        d.pending_drops += new_drops
        d.drops_total += new_drops
        self.counts["shots_dropped"] += new_drops

    def _get(self, p, rid: int, ptp: int, t_in: int) -> None:
        self.counts["get_corrections"] += 1
        d = self._decoder(p.decoder_id)
        if d is None:
            return self._refuse("decoder_not_configured", Status.INVALID_DECODER, rid, ptp, t_in, _FN_GET)
        rs, no = p.return_size, d.num_obs
        if rs <= no:
            m = 1
        elif no and rs % no == 0 and rs // no <= d.capacity:
            m = rs // no  # the corrections of the m oldest shots, one after the other
        else:
            return self._refuse("return_size", Status.BAD_REQUEST, rid, ptp, t_in, _FN_GET)
        consume = p.reset
        cap = d.capacity
        if m > 1:
            if d.drops_total:
                return self._get_window_with_drops(d, m, rs, consume, rid, ptp, t_in)
            if d.cmp - d.ret < m:
                self._stage(_PLAIN, int(Status.NOT_READY), rid, ptp, t_in, _FN_GET)
                return
            self._stage(_CORRECTIONS, int(Status.OK), rid, ptp, t_in, _FN_GET, d.id, d.ret, rs)
            if consume:
                d.ret += m
            return
        if d.ret < d.cmp:
            slot = d.ret % cap
            if d.drops_before[slot] > 0:
                if consume:
                    d.drops_before[slot] -= 1
                    d.drops_total -= 1
                self._stage(_PLAIN, int(Status.SYNDROMES_DROPPED), rid, ptp, t_in, _FN_GET)
                return
            self._stage(_CORRECTIONS, int(Status.OK), rid, ptp, t_in, _FN_GET, d.id, d.ret, rs)
            if consume:
                d.ret += 1
            return
        if d.filling and d.drops_before[d.cmp % cap] > 0:
            if consume:
                d.drops_before[d.cmp % cap] -= 1
                d.drops_total -= 1
            self._stage(_PLAIN, int(Status.SYNDROMES_DROPPED), rid, ptp, t_in, _FN_GET)
        elif not d.filling and d.pending_drops > 0:
            if consume:
                d.pending_drops -= 1
                d.drops_total -= 1
            self._stage(_PLAIN, int(Status.SYNDROMES_DROPPED), rid, ptp, t_in, _FN_GET)
        else:
            self._stage(_PLAIN, int(Status.NOT_READY), rid, ptp, t_in, _FN_GET)

    def _get_window_with_drops(self, d: _Decoder, m: int, rs: int, consume: bool, rid: int, ptp: int,
                               t_in: int) -> None:
        """The m oldest shots when some were dropped: in order, each a queued shot or a drop.
        Answered once all m are known (else NOT_READY): SYNDROMES_DROPPED with the flips of
        the decoded ones and a mask of the dropped ones, or OK if none in the window was."""
        cap = d.capacity
        plan: list[int] = []  # shot sequence numbers, -1 for a dropped shot
        taken: list[tuple[int, int]] = []  # (slot, drops consumed before it)
        seq = d.ret
        tail_take = 0
        while len(plan) < m:
            if seq < d.cmp:
                slot = seq % cap
                take = min(d.drops_before[slot], m - len(plan))
                if take:
                    plan += [-1] * take
                    taken.append((slot, take))
                if len(plan) == m:
                    break
                plan.append(seq)
                seq += 1
            else:
                avail = d.drops_before[d.cmp % cap] if d.filling else d.pending_drops
                tail_take = min(avail, m - len(plan))
                plan += [-1] * tail_take
                if len(plan) < m:
                    self._stage(_PLAIN, int(Status.NOT_READY), rid, ptp, t_in, _FN_GET)
                    return
        i = self._n_staged
        self._stage(_CORRECTIONS, int(Status.OK), rid, ptp, t_in, _FN_GET, d.id, d.ret, rs)
        self._st_plan[i] = plan
        if consume:
            for slot, take in taken:
                d.drops_before[slot] -= take
            if tail_take:
                if d.filling:
                    d.drops_before[d.cmp % cap] -= tail_take
                else:
                    d.pending_drops -= tail_take
            d.drops_total -= sum(t for _, t in taken) + tail_take
            d.ret = seq

    def _planned_corrections(self, d: _Decoder, plan: list[int], bits: int) -> tuple[int, int]:
        """Write a window's answer (flips, then the dropped mask if any); return (status, result bytes)."""
        m = len(plan)
        cap = d.capacity
        kept = [q for q in plan if q >= 0]
        if any(d.slot_status[q % cap] for q in kept):
            return int(Status.INTERNAL_ERROR), 0
        rows = np.zeros((m, d.nbo), np.uint8)
        idx = np.array([j for j, q in enumerate(plan) if q >= 0], dtype=np.int64)
        if idx.size:
            rows[idx] = d.corr[np.array([q % cap for q in kept], dtype=np.int64), :d.nbo]
        flat = np.unpackbits(rows, axis=1, count=d.num_obs, bitorder="little").reshape(-1)[:bits]
        out = np.packbits(flat, bitorder="little")
        k = out.size
        hdr = wire.HEADER_NBYTES
        self._tx_np[hdr:hdr + k] = out
        dropped = np.array([q < 0 for q in plan], dtype=np.uint8)
        if not dropped.any():
            return 0, k
        mask = np.packbits(dropped, bitorder="little")
        self._tx_np[hdr + k:hdr + k + mask.size] = mask
        return int(Status.SYNDROMES_DROPPED), k + mask.size

    def _reset(self, p, rid: int, ptp: int, t_in: int) -> None:
        self.counts["reset_decoder"] += 1
        d = self._decoder(p.decoder_id)
        if d is None:
            return self._refuse("decoder_not_configured", Status.INVALID_DECODER, rid, ptp, t_in, _FN_RESET)
        self._flush()  # answers staged so far refer to the state before the reset
        d.reset()
        self._stage(_PLAIN, int(Status.OK), rid, ptp, t_in, _FN_RESET)

    # ------------------------------------------------------------------ decode + answer
    def _decode_pending(self, d: _Decoder) -> None:
        while d.dec < d.cmp:
            a = d.dec % d.capacity
            n = min(d.cmp - d.dec, d.capacity - a, self.max_decode_batch)
            t0 = now_ns()
            try:
                out = _decode_packed(d.compiled, d.syn[a:a + n])
                if out.shape != (n, d.nbo):
                    raise ValueError(f"decoder returned shape {out.shape}, expected {(n, d.nbo)}")
                d.corr[a:a + n, :d.nbo] = out
                status = 0
            except Exception:  # a decoder failure is answered INTERNAL_ERROR, never crashes the service
                status = int(Status.INTERNAL_ERROR)
                self.faults["decoder_exception"] += 1
            t1 = now_ns()
            d.slot_status[a:a + n] = [status] * n
            d.t_dec_start[a:a + n] = [t0] * n
            d.t_dec_end[a:a + n] = [t1] * n
            d.batch[a:a + n] = [n] * n
            self._rec_decode(t1 - t0)
            self._rec_decode_per_shot((t1 - t0) // n)
            if n > 8:
                # one sample per frame of whole shots (they completed together)
                record_values(self.stages.histogram("queue"), t0 - np.unique(np.asarray(d.t_complete[a:a + n])))
            else:
                rec_queue = self._rec_queue
                tc = d.t_complete
                for i in range(a, a + n):
                    rec_queue(t0 - tc[i])
            self.batch_sizes[int(n).bit_length()] += 1
            self.counts["decode_calls"] += 1
            self.counts["shots_decoded"] += n
            d.dec += n

    def _flush(self) -> None:
        for d in self._active:
            if d.dec < d.cmp:
                self._decode_pending(d)
        ep = self._ep
        sendto = self._sendto
        tx, mv = self._tx, self._tx_mv
        hdr = wire.HEADER_NBYTES
        for i in range(self._n_staged):
            status = self._st_status[i]
            rid, ptp = self._st_rid[i], self._st_ptp[i]
            nbytes = hdr
            d = None
            m = 1
            if self._st_kind[i] == _CORRECTIONS:
                d = self._decoders[self._st_dec[i]]
                slot = self._st_seq[i] % d.capacity
                bits = self._st_bits[i]
                plan = self._st_plan[i]
                if plan is not None:
                    self._st_plan[i] = None
                    m = len(plan)
                    status, k = self._planned_corrections(d, plan, bits)
                    nbytes = hdr + k if status in (0, int(Status.SYNDROMES_DROPPED)) else hdr
                    d = None  # per-shot records only for the plain path
                elif bits > d.num_obs:
                    m = bits // d.num_obs
                    status = self._many_corrections(d, slot, m, bits)
                    nbytes = hdr + ((bits + 7) >> 3) if status == 0 else hdr
                else:
                    status = d.slot_status[slot]
                    if status == 0:
                        k = (bits + 7) >> 3
                        if k:
                            off = slot * d.corr.shape[1]
                            mv[hdr:hdr + k] = d.corr_mv[off:off + k]
                            if bits & 7:
                                tx[hdr + k - 1] &= (1 << (bits & 7)) - 1
                        nbytes = hdr + k
            _RESP_FIELDS.pack_into(tx, _RESP_FIELDS_OFFSET, status, nbytes - hdr, rid, ptp)
            if sendto is not None:
                sendto(mv[:nbytes], self._st_peer[i])
            elif ep is not None:
                ep.send(mv[:nbytes])
            t_out = now_ns()
            self.statuses[_STATUS_NAMES.get(status, str(status))] += 1
            if self._st_fn[i] == _FN_GET:
                self._rec_residence(t_out - self._st_tin[i])
            if d is not None and status == 0:
                slot = self._st_seq[i] % d.capacity
                if m == 1:
                    self._rec_respond(t_out - d.t_dec_end[slot])
                    self._rec_shot_service(t_out - d.t_in_last[slot])
                    if self.shots.capacity:
                        self.shots.append(d.rid_last[slot], d.ptp_last[slot], d.t_in_last[slot],
                                          d.t_complete[slot], d.t_dec_start[slot], d.t_dec_end[slot], t_out,
                                          d.batch[slot], status)
                else:
                    self._record_many(d, slot, m, t_out)
        self._n_staged = 0
        for d in self._active:
            d.free = d.ret

    @staticmethod
    def _ring_slices(d: _Decoder, slot: int, m: int) -> list[tuple[int, int]]:
        first = min(m, d.capacity - slot)
        return [(slot, slot + first)] + ([(0, m - first)] if first < m else [])

    def _many_corrections(self, d: _Decoder, slot: int, m: int, bits: int) -> int:
        """Write the corrections of ``m`` shots from ``slot`` on into the answer; return its status."""
        parts = self._ring_slices(d, slot, m)
        if any(any(d.slot_status[a:b]) for a, b in parts):
            return int(Status.INTERNAL_ERROR)
        rows = d.corr[parts[0][0]:parts[0][1], :d.nbo] if len(parts) == 1 else \
            np.concatenate([d.corr[a:b, :d.nbo] for a, b in parts])
        if d.num_obs & 7 == 0:
            packed = rows.reshape(-1)
        else:
            flat = np.unpackbits(rows, axis=1, count=d.num_obs, bitorder="little").reshape(-1)
            packed = np.packbits(flat[:bits], bitorder="little")
        k = (bits + 7) >> 3
        self._tx_np[wire.HEADER_NBYTES:wire.HEADER_NBYTES + k] = packed[:k]
        return 0

    def _record_many(self, d: _Decoder, slot: int, m: int, t_out: int) -> None:
        cols = {name: np.concatenate([np.asarray(getattr(d, name)[a:b], np.int64)
                                      for a, b in self._ring_slices(d, slot, m)])
                for name in ("t_dec_end", "t_in_last")}
        # one sample per answer (its shots share a frame, a decoder call and this send)
        self._rec_respond(t_out - int(cols["t_dec_end"].max()))
        self._rec_shot_service(t_out - int(cols["t_in_last"].min()))
        if self.shots.capacity and len(self.shots) < self.shots.capacity:
            c = {name: np.concatenate([np.asarray(getattr(d, name)[a:b], np.int64)
                                       for a, b in self._ring_slices(d, slot, m)])
                 for name in ("rid_last", "ptp_last", "t_in_last", "t_complete", "t_dec_start", "t_dec_end",
                              "batch")}
            self.shots.extend(m, last_request_id=c["rid_last"], ptp_last_ns=c["ptp_last"], in_last_ns=c["t_in_last"],
                              complete_ns=c["t_complete"], decode_start_ns=c["t_dec_start"],
                              decode_end_ns=c["t_dec_end"], out_ns=t_out, batch_shots=c["batch"], status=0)
        else:
            self.shots.dropped += m

    def _oversized(self, ep, needed: int, t_in: int) -> None:
        """A message larger than any valid frame: read it, count it, answer if its header allows."""
        self.counts["requests"] += 1
        self.counts["frames_refused"] += 1
        self.faults["oversized_frame"] += 1
        data = ep.recv(max_nbytes=needed, timeout_s=1.0)
        if self._sendto is not None:
            self._peer = getattr(ep, "last_peer", None)
        try:
            wire.decode_request(data)
        except FrameError as e:
            self.faults[e.fault.value] += 1
            if e.request_id is not None:
                self._stage(_PLAIN, int(e.fault.status), e.request_id, e.ptp_timestamp or 0, t_in, _FN_BAD)
                return
        else:  # a valid header cannot describe a frame this long; answer anyway
            magic, fid, arg_len, rid, ptp = struct.unpack_from("<IIIIQ", data)
            self._stage(_PLAIN, int(Status.BAD_REQUEST), rid, ptp, t_in, _FN_BAD)
            return
        self.counts["frames_unanswerable"] += 1

    # ------------------------------------------------------------------ loop
    def serve(self, endpoint, *, stop_event: threading.Event | None = None, max_requests: int | None = None,
              timeout_s: float | None = None, idle_timeout_s: float | None = None, spin: int = 20000) -> dict:
        """Serve requests from ``endpoint`` (busy-poll) until the peer leaves, ``stop_event``
        is set, ``max_requests`` have been handled, or ``timeout_s`` has passed.

        ``spin``: empty polls before the loop starts to sleep between polls (up to
        0.2 ms), so an idle service does not burn a core forever. Returns
        :meth:`report`. A peer that closes ends the loop normally; any other
        transport failure propagates.
        """
        if max_requests is not None and max_requests < 1:
            raise ValueError(f"max_requests must be >= 1 or None, got {max_requests}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._ep = endpoint
        rx, rx_mv = self._rx, self._rx_mv
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
        self.counts["serve_calls"] += 1
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
                        self._oversized(endpoint, e.needed_nbytes, now_ns())
                    else:
                        handle(rx_mv[:n], now_ns())
                    n_batch += 1
                    if max_requests is not None and handled + n_batch >= max_requests:
                        break
                if n_batch:
                    handled += n_batch
                    self._flush()
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
            self.counts["peer_closed"] += 1
            self._n_staged = 0
        finally:
            self._ep = None
            self._sendto = None
            self._peer = None
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


# The process helpers live in their own module; re-exported here.
from ._service_process import ServiceProcess, run_service_process, start_service_process  # noqa: E402
