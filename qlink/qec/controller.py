"""The QPU-controller emulator: plays syndrome rounds on a cycle clock, asks a decoder
service for corrections over the wire, applies them to a Pauli frame.

For each shot the controller emits each round's detection events at the cycle
cadence (``cycle_ns``, default 1100 ns — Google Willow's 1.1 µs surface-code
cycle, arXiv:2408.13687), ``rounds_per_frame`` rounds per ``enqueue_syndromes``
frame, busy-waiting to each tick; a frame sent more than one cycle after its tick
is counted as *late* (the controller itself fell behind). After a shot's last round
it sends ``get_corrections`` and, between ticks, polls the answers; an answer is
XORed into the tracked Pauli frame and compared with the true observable flip. The
loop is pipelined: shots follow each other back to back while earlier shots are
still being decoded. With ``feed_forward_deadline_ns`` set, the controller instead
waits after every shot for its correction before a conditional operation (a
feed-forward), counting the waits that exceed the deadline, and starts the next
shot on the next tick after it.

Measured per shot: reaction time (last round's tick → correction applied), the
stages of it (see :mod:`qlink.qec.timeline`), whether it was right. The controller's
own analog delays are *modeled*, never added to measured figures: trigger
distribution 212 ns and analog in → out 364 ns (Qblox documentation).

>>> import numpy as np
>>> s = SyndromeStream(detectors=np.zeros((2, 6), np.uint8), observables=np.zeros((2, 1), np.uint8),
...                    round_of_detector=np.array([0, 0, 1, 1, 2, 2]))
>>> s.num_rounds, [(f.first_bit, f.num_bits, f.last_round) for f in s.frames(rounds_per_frame=2)]
(3, [(0, 4, 1), (4, 2, 2)])
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qlink import wire
from qlink.clock import now_ns, ptp_now_ns
from qlink.errors import QlinkError, QlinkTimeoutError, WouldBlock
from qlink.wire import Status

from .timeline import CONTROLLER_SHOT_FIELDS, ShotRecords, StageRecorder

__all__ = [
    "SyndromeStream",
    "FrameLayout",
    "Controller",
    "ControllerResult",
    "CONTROLLER_STAGES",
    "DEFAULT_CYCLE_NS",
    "MODELED_TRIGGER_NS",
    "MODELED_ANALOG_IN_OUT_NS",
    "ler_under_deadline",
    "wilson_interval",
]

DEFAULT_CYCLE_NS = 1100  # Google Willow surface-code cycle, arXiv:2408.13687
MODELED_TRIGGER_NS = 212  # Qblox docs: trigger distribution to all sequencers
MODELED_ANALOG_IN_OUT_NS = 364  # Qblox docs: analog in -> analog out

CONTROLLER_STAGES = (
    "emit_lag",  # a frame's cycle tick -> the controller started sending it
    "send",  # last round's tick -> last frame handed to the transport
    "get_round_trip",  # get_corrections sent -> the answer that resolved the shot received
    "apply",  # answer received -> applied to the Pauli frame
    "reaction",  # last round's tick -> correction applied (the headline figure)
)

# Offsets inside an enqueue_syndromes frame (qlink.wire layout): the controller encodes
# one template per frame position with wire.encode_enqueue_syndromes_into and patches
# these fields in place for every shot.
_HDR_IDS = struct.Struct("<IQ")  # request_id, ptp_timestamp
_HDR_IDS_OFFSET = 12
_COUNTER = struct.Struct("<q")
_COUNTER_OFFSET = wire.HEADER_NBYTES + 8
_BITS_OFFSET = wire.HEADER_NBYTES + wire.ENQUEUE_SYNDROMES_FIXED_NBYTES

_GET_BIT = 0x80000000  # request ids of get_corrections; enqueue ids stay below


@dataclass(frozen=True)
class FrameLayout:
    """One ``enqueue_syndromes`` frame position of a shot: which bits, up to which round."""

    first_bit: int
    num_bits: int
    first_round: int
    last_round: int


@dataclass(frozen=True)
class SyndromeStream:
    """Detection events of ``num_shots`` shots, the true observable flips, and the
    round each detector belongs to (non-decreasing in detector order)."""

    detectors: np.ndarray  # (num_shots, num_detectors) 0/1
    observables: np.ndarray  # (num_shots, num_observables) 0/1
    round_of_detector: np.ndarray  # (num_detectors,) int

    def __post_init__(self):
        d = np.asarray(self.detectors)
        o = np.asarray(self.observables)
        r = np.asarray(self.round_of_detector, dtype=np.int64)
        if d.ndim != 2 or o.ndim != 2 or d.shape[0] != o.shape[0]:
            raise ValueError(f"detectors {d.shape} and observables {o.shape} must be 2-D with one row per shot")
        if r.shape != (d.shape[1],):
            raise ValueError(f"round_of_detector has shape {r.shape}; expected ({d.shape[1]},), one per detector")
        if r.size and (r[0] < 0 or np.any(np.diff(r) < 0)):
            raise ValueError("round_of_detector must be non-negative and non-decreasing in detector order "
                             "(frames carry contiguous detector ranges)")
        object.__setattr__(self, "detectors", d.astype(np.uint8, copy=False))
        object.__setattr__(self, "observables", o.astype(np.uint8, copy=False))
        object.__setattr__(self, "round_of_detector", r)

    @property
    def num_shots(self) -> int:
        return int(self.detectors.shape[0])

    @property
    def num_detectors(self) -> int:
        return int(self.detectors.shape[1])

    @property
    def num_observables(self) -> int:
        return int(self.observables.shape[1])

    @property
    def num_rounds(self) -> int:
        """Rounds per shot (the last one usually holds the final data-qubit readout)."""
        return int(self.round_of_detector[-1]) + 1 if self.round_of_detector.size else 0

    def frames(self, *, rounds_per_frame: int) -> list[FrameLayout]:
        """The frame positions of one shot for a window of ``rounds_per_frame`` rounds
        (``0``: the whole shot in one frame). Rounds without detectors are skipped."""
        if rounds_per_frame < 0:
            raise ValueError(f"rounds_per_frame must be >= 0 (0 = whole shot), got {rounds_per_frame}")
        R = self.num_rounds
        w = R if rounds_per_frame == 0 else rounds_per_frame
        r = self.round_of_detector
        out = []
        for first in range(0, R, w):
            last = min(first + w, R) - 1
            lo = int(np.searchsorted(r, first, side="left"))
            hi = int(np.searchsorted(r, last, side="right"))
            if hi > lo:
                out.append(FrameLayout(lo, hi - lo, first, last))
        return out

    def take(self, num_shots: int) -> "SyndromeStream":
        return SyndromeStream(self.detectors[:num_shots], self.observables[:num_shots], self.round_of_detector)

    @classmethod
    def from_source(cls, source: Any, *, num_shots: int, seed: int | None = None) -> "SyndromeStream":
        """Sample ``num_shots`` from a syndrome source (see :func:`qlink.qec.loop.build_source`)."""
        from .loop import sample_stream

        return sample_stream(source, num_shots=num_shots, seed=seed)


def wilson_interval(errors: int, shots: int, *, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial rate (95 % by default).

    >>> lo, hi = wilson_interval(10, 1000)
    >>> round(lo, 4), round(hi, 4)
    (0.0054, 0.0183)
    """
    if shots <= 0:
        return (0.0, 1.0)
    p = errors / shots
    den = 1 + z * z / shots
    mid = (p + z * z / (2 * shots)) / den
    half = z * math.sqrt(p * (1 - p) / shots + z * z / (4 * shots * shots)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def ler_under_deadline(correct: np.ndarray, reaction_ns: np.ndarray, deadlines_ns) -> np.ndarray:
    """LER(t) = P(the shot's correction was wrong, missing, or applied later than t).

    ``correct`` is 1/0 per shot (−1 for shots that got no correction: dropped or
    unanswered); ``reaction_ns`` the reaction time per shot (< 0 when none).

    >>> ler_under_deadline(np.array([1, 1, 0, -1]), np.array([10, 30, 5, -1]), [20, 40]).tolist()
    [0.75, 0.5]
    """
    c = np.asarray(correct)
    r = np.asarray(reaction_ns)
    t = np.asarray(deadlines_ns, dtype=np.int64).reshape(-1)
    if c.shape != r.shape:
        raise ValueError(f"correct {c.shape} and reaction_ns {r.shape} must have the same shape")
    if c.size == 0:
        return np.full(t.shape, np.nan)
    ok = c == 1
    ok_times = np.sort(r[ok])
    n_ok_in_time = np.searchsorted(ok_times, t, side="right")
    return 1.0 - n_ok_in_time / c.size


@dataclass(frozen=True)
class ControllerResult:
    """What one controller run measured. Times in ns unless named otherwise."""

    num_shots: int
    num_rounds: int  # rounds per shot
    frames_per_shot: int
    cycle_ns: int
    shots_ok: int  # answered with a correction
    logical_errors: int  # answered, and frame ^ correction != true flip
    shots_dropped: int  # answered SYNDROMES_DROPPED
    shots_failed: int  # answered INTERNAL_ERROR
    late_frames: int  # frames sent more than one cycle after their tick
    throttled: int  # shots held back by max_in_flight_shots
    max_lag_ns: int
    deadline_misses: int  # feed-forward waits past the deadline
    duration_ns: int  # first tick -> last answer
    statuses: dict  # enqueue / get answers by status name
    stages: dict  # {stage: LatencyHistogram.to_dict()}
    correct: np.ndarray = field(repr=False)  # per shot: 1 right, 0 wrong, -1 no correction
    reaction_ns: np.ndarray = field(repr=False)  # per shot, -1 when no correction
    backlog_t_ns: np.ndarray = field(repr=False)  # sample times (from the first tick)
    backlog_rounds: np.ndarray = field(repr=False)  # rounds emitted - rounds resolved
    corrections: np.ndarray | None = field(default=None, repr=False)  # (shots, ceil(obs/8)) as received
    shot_records: np.ndarray | None = field(default=None, repr=False)
    modeled_controller_ns: dict = field(default_factory=lambda: {
        "trigger_ns": MODELED_TRIGGER_NS, "analog_in_out_ns": MODELED_ANALOG_IN_OUT_NS})
    pauli_frame: int = 0  # XOR of every applied correction (observable bits)

    @property
    def logical_error_rate(self) -> float:
        return self.logical_errors / self.shots_ok if self.shots_ok else float("nan")

    def ler_interval(self, *, z: float = 1.96) -> tuple[float, float]:
        return wilson_interval(self.logical_errors, self.shots_ok, z=z)

    def reaction_percentiles_ns(self, ps=(50, 99, 99.9)) -> list[int]:
        from qlink.histogram import LatencyHistogram

        h = LatencyHistogram.from_dict(self.stages["reaction"])
        return h.percentiles(ps) if h.count else [float("nan")] * len(ps)

    def ler_at(self, deadlines_ns) -> np.ndarray:
        """LER(t) at each deadline (see :func:`ler_under_deadline`)."""
        return ler_under_deadline(self.correct, self.reaction_ns, deadlines_ns)

    @property
    def decoded_rounds_per_s(self) -> float:
        """Rounds whose correction came back, per second of run."""
        return self.shots_ok * self.num_rounds / (self.duration_ns / 1e9) if self.duration_ns > 0 else float("nan")


class Controller:
    """Drives one decoder (``decoder_id``) of a service on ``endpoint`` with ``stream``.

    Options: ``cycle_ns``; ``rounds_per_frame`` (0 = the whole shot in one frame);
    ``gap_cycles`` idle cycles between shots; ``poll_interval_ns`` before asking
    again after ``NOT_READY``; ``feed_forward_deadline_ns`` (None: pipelined);
    ``keep_samples`` shots of raw timestamps; ``max_in_flight_shots`` holds a new
    shot back while that many await their answers (the schedule then restarts from
    the next tick, and the hold is counted in ``throttled``: for throughput and
    LER runs, not for cycle-time figures).
    """

    def __init__(self, endpoint, stream: SyndromeStream, *, decoder_id: int = 0, cycle_ns: int = DEFAULT_CYCLE_NS,
                 rounds_per_frame: int = 1, gap_cycles: int = 0, poll_interval_ns: int = 2_000,
                 feed_forward_deadline_ns: int | None = None, keep_samples: int = 0,
                 start_delay_ns: int = 200_000, backlog_samples: int = 4096, counter_start: int = 0,
                 request_id_start: int = 0, max_in_flight_shots: int | None = None,
                 trigger_ns: int = MODELED_TRIGGER_NS, analog_in_out_ns: int = MODELED_ANALOG_IN_OUT_NS) -> None:
        if not 0 <= decoder_id < wire.MAX_DECODERS:
            raise ValueError(f"decoder_id must be in [0, {wire.MAX_DECODERS}), got {decoder_id}")
        if cycle_ns < 1:
            raise ValueError(f"cycle_ns must be >= 1, got {cycle_ns}")
        if gap_cycles < 0 or poll_interval_ns < 0 or start_delay_ns < 0:
            raise ValueError("gap_cycles, poll_interval_ns and start_delay_ns must be >= 0")
        if feed_forward_deadline_ns is not None and feed_forward_deadline_ns <= 0:
            raise ValueError(f"feed_forward_deadline_ns must be > 0 or None, got {feed_forward_deadline_ns}")
        if max_in_flight_shots is not None and max_in_flight_shots < 1:
            raise ValueError(f"max_in_flight_shots must be >= 1 or None, got {max_in_flight_shots}")
        if stream.num_shots < 1 or stream.num_detectors < 1:
            raise ValueError("the syndrome stream needs at least one shot and one detector")
        self.ep = endpoint
        self.stream = stream
        self.decoder_id = int(decoder_id)
        self.cycle_ns = int(cycle_ns)
        self.layout = stream.frames(rounds_per_frame=rounds_per_frame)
        self.rounds_per_frame = rounds_per_frame
        self.gap_cycles = int(gap_cycles)
        self.poll_interval_ns = int(poll_interval_ns)
        self.ff_deadline_ns = feed_forward_deadline_ns
        self.start_delay_ns = int(start_delay_ns)
        self.modeled = {"trigger_ns": int(trigger_ns), "analog_in_out_ns": int(analog_in_out_ns)}
        self._keep = int(keep_samples)
        self.max_in_flight_shots = max_in_flight_shots
        self.spin_guard_ns = 3_000  # stop polling for answers this close to a tick
        self._backlog_cap = max(1, int(backlog_samples))
        self._counter = int(counter_start)  # enqueue counter: continues across runs on one connection
        self._rid = int(request_id_start) & 0x7FFFFFFF
        self._prepare()

    @property
    def counter(self) -> int:
        """The next enqueue ``counter`` (pass it as ``counter_start`` to a later controller)."""
        return self._counter

    @property
    def next_request_id(self) -> int:
        return self._rid

    def _prepare(self) -> None:
        s = self.stream
        F = len(self.layout)
        # per frame position: the packed bits of every shot, and a template frame
        self._packed = []
        self._templates = []
        for fl in self.layout:
            bits = s.detectors[:, fl.first_bit:fl.first_bit + fl.num_bits]
            packed = np.ascontiguousarray(np.packbits(bits, axis=1, bitorder="little"))
            self._packed.append(memoryview(packed.reshape(-1)))
            buf = bytearray(wire.enqueue_syndromes_nbytes(fl.num_bits))
            wire.encode_enqueue_syndromes_into(buf, request_id=0, decoder_id=self.decoder_id, counter=0,
                                               syndrome_mapping_id=0, syndromes_bits_packed=bytes(packed.shape[1]),
                                               num_syndromes=fl.num_bits)
            self._templates.append(buf)
        self._nbytes = [(fl.num_bits + 7) >> 3 for fl in self.layout]
        self._last_round = [fl.last_round for fl in self.layout]
        self._get = bytearray(wire.HEADER_NBYTES + wire.GET_CORRECTIONS_PAYLOAD_NBYTES)
        wire.encode_get_corrections_into(self._get, request_id=0, decoder_id=self.decoder_id,
                                         return_size=s.num_observables, reset=True)
        obs_packed = np.packbits(s.observables, axis=1, bitorder="little")
        self._truth = [int.from_bytes(row.tobytes(), "little") for row in obs_packed]
        self._frames_per_shot = F
        self._shot_period_cycles = s.num_rounds + self.gap_cycles

    # ------------------------------------------------------------------ helpers
    def _send(self, mv, deadline_ns: int) -> None:
        """Send without ever blocking on a full transport while answers wait to be read."""
        ep = self.ep
        while True:
            try:
                ep.send_nowait(mv)
                return
            except WouldBlock:
                self._poll_once()
                if now_ns() > deadline_ns:
                    raise QlinkTimeoutError("the controller could not send a frame before its run deadline "
                                            "(the transport stayed full: is the decoder service reading?)")

    def run(self, *, timeout_s: float = 60.0) -> ControllerResult:
        """Play every shot of the stream and wait for every answer (at most ``timeout_s``)."""
        s = self.stream
        N, F, R = s.num_shots, self._frames_per_shot, s.num_rounds
        cyc = self.cycle_ns
        period = self._shot_period_cycles
        last_round = self._last_round
        templates = self._templates
        tmpl_mv = [memoryview(t) for t in templates]
        packed = self._packed
        nbytes = self._nbytes
        ff = self.ff_deadline_ns
        dec_id = self.decoder_id
        self.stages = stages = StageRecorder(CONTROLLER_STAGES)
        rec_lag = stages.histogram("emit_lag").record
        rec_send = stages.histogram("send").record
        self._rec_reaction = stages.histogram("reaction").record
        self._rec_apply = stages.histogram("apply").record
        self._rec_rtt = stages.histogram("get_round_trip").record
        self.records = ShotRecords(CONTROLLER_SHOT_FIELDS, capacity=self._keep)
        # per-shot state
        # per-shot state as Python lists (cheaper to index than NumPy scalars on the hot path)
        self._emit_last = [0] * N
        self._sent_last = [0] * N
        self._get_sent = [0] * N
        self._rid_last = [0] * N
        self._polls = [0] * N
        self._correct = [-1] * N
        self._reaction = [-1] * N
        self._status = [-1] * N
        self._nbo = (s.num_observables + 7) >> 3
        self._corrections = np.zeros((N, self._nbo), np.uint8)
        self._corr_mv = memoryview(self._corrections.reshape(-1))
        self._bl_t = np.zeros(self._backlog_cap, np.int64)
        self._bl_v = np.zeros(self._backlog_cap, np.int64)
        self._bl_n = 0
        self._bl_every = max(1, -(-N // self._backlog_cap))
        self._statuses: dict[str, int] = {}
        self._resolved = 0  # shots answered (OK / dropped / failed), in order
        self._asked = 0  # shots whose get_corrections went out
        self._gets_in_flight = 0
        self._repoll_due = 0  # time the next re-poll may go (0: none pending)
        self._repolls_pending = 0
        self._ok = self._errors = self._dropped = self._failed = 0
        self._frame = 0
        self._rx = bytearray(wire.HEADER_NBYTES + ((s.num_observables + 7) >> 3) + 64)
        self._rx_mv = memoryview(self._rx)
        self._get_rid = 0
        late = 0
        spin_guard = self.spin_guard_ns
        throttled = 0
        inflight_cap = self.max_in_flight_shots
        max_lag = 0
        misses = 0
        t_start = now_ns()
        deadline = t_start + int(timeout_s * 1e9)
        self._deadline = deadline
        t0 = t_start + self.start_delay_ns
        self._t0 = t0
        shot_base = t0  # tick 0 of the current shot
        shot, f = 0, 0
        due = shot_base + (last_round[0] + 1) * cyc
        counter = self._counter
        rid = self._rid
        send = self._send
        poll = self._poll_once
        while self._resolved < N:
            now = now_ns()
            if now > deadline:
                raise QlinkTimeoutError(
                    f"controller run exceeded timeout_s={timeout_s}: {self._resolved}/{N} shots answered, "
                    f"{shot}/{N} shots emitted")
            if shot < N and due - now < spin_guard:
                # the next tick is close: stop polling and watch the clock alone
                while now < due:
                    now = now_ns()
                if f == 0 and inflight_cap is not None and shot - self._resolved >= inflight_cap:
                    # hold the new shot back until an answer frees a place, then restart the clock
                    throttled += 1
                    while shot - self._resolved >= inflight_cap:
                        poll()
                        if now_ns() > deadline:
                            raise QlinkTimeoutError(
                                f"controller run exceeded timeout_s={timeout_s} waiting for answers "
                                f"({self._resolved}/{N} shots answered)")
                    tnow = now_ns()
                    shot_base = t0 + -(-(tnow - t0) // cyc) * cyc
                    due = shot_base + (last_round[0] + 1) * cyc
                    continue
                lag = now - due
                if lag > cyc:
                    late += 1
                if lag > max_lag:
                    max_lag = lag
                rec_lag(lag)
                nb = nbytes[f]
                t = templates[f]
                t[_BITS_OFFSET:_BITS_OFFSET + nb] = packed[f][shot * nb:(shot + 1) * nb]
                _COUNTER.pack_into(t, _COUNTER_OFFSET, counter)
                _HDR_IDS.pack_into(t, _HDR_IDS_OFFSET, rid, ptp_now_ns())
                send(tmpl_mv[f], deadline)
                counter += 1
                if f == F - 1:
                    t_sent = now_ns()
                    self._emit_last[shot] = due
                    self._sent_last[shot] = t_sent
                    self._rid_last[shot] = rid
                    rec_send(t_sent - due)
                    self._send_get(shot, t_sent)
                    self._asked = shot + 1
                    if shot % self._bl_every == 0:
                        self._sample_backlog(t_sent, (shot + 1) * R)
                    if ff is not None:
                        # feed-forward: wait for this shot's correction before the conditional op
                        limit = due + ff
                        while self._resolved <= shot:
                            poll()
                            tw = now_ns()
                            if tw > deadline:
                                raise QlinkTimeoutError(
                                    f"no correction for shot {shot} within the run's timeout_s={timeout_s}")
                        if self._reaction[shot] < 0 or self._emit_last[shot] + self._reaction[shot] > limit:
                            misses += 1
                        tnow = now_ns()
                        # next shot starts on the next tick after the conditional operation
                        shot_base = max(shot_base + period * cyc, t0 + -(-(tnow - t0) // cyc) * cyc)
                    else:
                        shot_base += period * cyc
                    shot += 1
                    f = 0
                else:
                    f += 1
                rid = (rid + 1) & 0x7FFFFFFF
                if shot < N:
                    due = shot_base + (last_round[f] + 1) * cyc
                continue
            poll()
        self._counter = counter
        self._rid = rid
        t_end = now_ns()
        self._sample_backlog(t_end, N * R)
        return ControllerResult(
            num_shots=N, num_rounds=R, frames_per_shot=F, cycle_ns=cyc, shots_ok=self._ok,
            logical_errors=self._errors, shots_dropped=self._dropped, shots_failed=self._failed,
            late_frames=late, throttled=throttled, max_lag_ns=int(max_lag), deadline_misses=misses, duration_ns=int(t_end - t0),
            statuses=dict(self._statuses), stages=stages.to_dict(), correct=np.array(self._correct, np.int8),
            reaction_ns=np.array(self._reaction, np.int64), backlog_t_ns=self._bl_t[:self._bl_n] - t0,
            backlog_rounds=self._bl_v[:self._bl_n].copy(),
            corrections=self._corrections, shot_records=self.records.array().copy() if self._keep else None,
            modeled_controller_ns=dict(self.modeled), pauli_frame=self._frame,
        )

    def _sample_backlog(self, t: int, rounds_emitted: int) -> None:
        i = self._bl_n
        if i < self._backlog_cap:
            self._bl_t[i] = t
            self._bl_v[i] = rounds_emitted - self._resolved * self.stream.num_rounds
            self._bl_n = i + 1

    def _send_get(self, shot: int, t: int) -> None:
        rid = _GET_BIT | self._get_rid
        self._get_rid = (self._get_rid + 1) & 0x7FFFFFFF
        _HDR_IDS.pack_into(self._get, _HDR_IDS_OFFSET, rid, ptp_now_ns())
        self._send(self._get, self._deadline)
        self._gets_in_flight += 1
        if self._get_sent[shot] == 0:
            self._get_sent[shot] = t
        self._polls[shot] += 1

    def _count(self, kind: str, status) -> None:
        name = f"{kind}.{status.name if isinstance(status, Status) else status}"
        self._statuses[name] = self._statuses.get(name, 0) + 1

    def _poll_once(self) -> None:
        """Handle at most one answer; send a pending re-poll when it is due."""
        if self._repolls_pending and now_ns() >= self._repoll_due and self._resolved < self._asked:
            self._repolls_pending -= 1
            self._send_get(self._resolved, now_ns())
        try:
            n = self.ep.recv_into_nowait(self._rx)
        except WouldBlock:
            return
        t_resp = now_ns()
        resp = wire.decode_response(self._rx_mv[:n])
        status = resp.status
        if not resp.request_id & _GET_BIT:
            self._count("enqueue", status)
            return
        self._count("get_corrections", status)
        self._gets_in_flight -= 1
        if status == Status.NOT_READY:
            self._repolls_pending += 1
            self._repoll_due = t_resp + self.poll_interval_ns
            return
        if status not in (Status.OK, Status.SYNDROMES_DROPPED, Status.INTERNAL_ERROR):
            raise QlinkError(
                f"the decoder service refused get_corrections with {status!r} (request {resp.request_id}): "
                "check that decoder_id and return_size match the service's configuration")
        shot = self._resolved
        self._resolved = shot + 1
        self._status[shot] = int(status)
        if status == Status.OK:
            res = resp.result
            corr = int.from_bytes(res, "little")
            k = min(len(res), self._nbo)
            self._corr_mv[shot * self._nbo:shot * self._nbo + k] = res[:k]
            self._frame ^= corr
            t_applied = now_ns()
            right = corr == self._truth[shot]
            self._ok += 1
            if not right:
                self._errors += 1
            self._correct[shot] = 1 if right else 0
            reaction = t_applied - self._emit_last[shot]
            self._reaction[shot] = reaction
            self._rec_reaction(reaction)
            self._rec_apply(t_applied - t_resp)
            self._rec_rtt(t_resp - self._get_sent[shot])
        else:
            t_applied = 0
            if status == Status.SYNDROMES_DROPPED:
                self._dropped += 1
            else:
                self._failed += 1
        if self._keep:
            self.records.append(shot, self._rid_last[shot], self._emit_last[shot], self._sent_last[shot],
                                self._get_sent[shot], t_resp, t_applied, self._polls[shot], int(status),
                                self._correct[shot])
