"""The QPU-controller emulator: plays syndrome rounds on a cycle clock, asks a decoder
service for corrections over the wire, applies them to a Pauli frame.

For each shot the controller emits each round's detection events at the cycle
cadence (``cycle_ns``, default 1100 ns — Google Willow's 1.1 µs surface-code
cycle, arXiv:2408.13687), ``rounds_per_frame`` rounds per ``enqueue_syndromes``
frame, busy-waiting to each tick; a frame sent more than one cycle after its tick
is counted as *late* (the controller itself fell behind). Every frame of the run is
built before the first tick (header, counter, request id, packed bits), so at a tick
the controller only stamps the send time and hands a view to the transport. After a
shot's last round it sends ``get_corrections`` and, between ticks, polls the
answers; an answer is XORed into the tracked Pauli frame (its *application*, timed)
and kept; comparing it with the true observable flip and every per-shot figure are
bookkeeping, done once, vectorised, when the run ends. The loop is pipelined: shots follow each other back to back while earlier shots are
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

import dataclasses
import gc
import time


from qlink import wire

from ._checks import knob as _knob
from ._controller_loop import CONTROLLER_STAGES, ControllerLoop
from ._controller_result import (MODELED_ANALOG_IN_OUT_NS, MODELED_TRIGGER_NS, ControllerResult, ler_under_deadline,
                                 wilson_interval)
from .stream import FrameLayout, FrameTooLargeError, SyndromeStream, _max_frame_bits

__all__ = [
    "SyndromeStream",
    "FrameLayout",
    "FrameTooLargeError",
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

class Controller(ControllerLoop):
    """Drives one decoder (``decoder_id``) of a service on ``endpoint`` with ``stream``.

    Options: ``cycle_ns``; ``rounds_per_frame`` (0 = the whole shot in one frame;
    a frame larger than one message of the endpoint, ``capabilities.max_message_bytes``,
    is cut between rounds into several, and one that cannot be cut to fit raises
    :class:`FrameTooLargeError`); ``shots_per_frame`` > 1 packs that many whole shots into one frame (sent after
    the last round of the last of them) and asks their corrections in one
    ``get_corrections`` — the batching that lets a decoder keep up, paid for in
    reaction time; ``gap_cycles`` idle cycles between shots; ``poll_interval_ns``
    before asking again after ``NOT_READY``; ``feed_forward_deadline_ns`` (None:
    pipelined); ``keep_samples`` shots of raw timestamps; ``max_in_flight_shots``
    holds new shots back while that many await their answers (the schedule then
    restarts from the next tick and the hold is counted in ``throttled``: for
    throughput and LER runs, not for cycle-time figures).

    Asking: by default each group of shots (one shot, or ``shots_per_frame``) gets
    its own ``get_corrections`` as soon as its last frame is out. With
    ``max_gets_in_flight`` set, no more than that many are outstanding, and a new one
    asks for every shot out and not yet asked for, up to ``get_window_shots``: while
    the decoder keeps up each group still gets its own; when it falls behind, one
    answer carries many shots, sparing the service a request and an answer per shot.

    On a lossy link every correction stays with its shot. Answers are matched to their
    ``get_corrections`` by request_id and taken in the order the gets were sent (the
    order the service consumed shots for them); an answer that overtakes an older get's
    waits for it. A get whose answer is missing (a later get's answer came first, or
    none came for ``get_timeout_ns``) is asked again with the same request_id as a peek:
    the service answers a repeated request_id with the answer it kept, consuming nothing
    more, and the echoed ``ptp_timestamp`` tells that replay from a fresh peek (no answer
    kept: the first ask consumed nothing, and its shots are asked for anew). Duplicates,
    answers to no get in flight, frames that fail :func:`qlink.wire.decode_response`
    and answers whose echo or length do not fit are counted in
    ``ControllerResult.answer_faults`` and ignored; a refusal is believed once a peek of
    the same request is refused too. When every frame is out but the service keeps
    answering ``NOT_READY`` for ``reveal_gap_after_ns`` (the last frame was lost, and
    only a later frame shows the gap), the controller sends one more frame. Request ids
    go on across runs (``request_id_start``, ``get_request_id_start``, and
    :attr:`next_request_id` / :attr:`next_get_request_id` for a later controller).
    """

    def __init__(self, endpoint, stream: SyndromeStream, *, decoder_id: int = 0, cycle_ns: int = DEFAULT_CYCLE_NS,
                 rounds_per_frame: int = 1, shots_per_frame: int = 1, gap_cycles: int = 0,
                 poll_interval_ns: int = 2_000, feed_forward_deadline_ns: int | None = None, keep_samples: int = 0,
                 start_delay_ns: int = 200_000, backlog_samples: int = 4096, counter_start: int = 0,
                 request_id_start: int = 0, get_request_id_start: int = 0, max_in_flight_shots: int | None = None,
                 max_gets_in_flight: int | None = None, get_window_shots: int | None = None,
                 get_timeout_ns: int = 500_000_000, reveal_gap_after_ns: int = 2_000_000,
                 trigger_ns: int = MODELED_TRIGGER_NS, analog_in_out_ns: int = MODELED_ANALOG_IN_OUT_NS) -> None:
        if not 0 <= decoder_id < wire.MAX_DECODERS:
            raise ValueError(f"decoder_id must be in [0, {wire.MAX_DECODERS}), got {decoder_id}")
        # every number is checked finite before it is compared or made an int, and named
        for name, value, minimum in (("cycle_ns", cycle_ns, 1), ("rounds_per_frame", rounds_per_frame, 0),
                                     ("shots_per_frame", shots_per_frame, 1), ("gap_cycles", gap_cycles, 0),
                                     ("poll_interval_ns", poll_interval_ns, 0), ("keep_samples", keep_samples, 0),
                                     ("start_delay_ns", start_delay_ns, 0), ("backlog_samples", backlog_samples, 0),
                                     ("counter_start", counter_start, 0), ("request_id_start", request_id_start, 0),
                                     ("get_request_id_start", get_request_id_start, 0),
                                     ("get_timeout_ns", get_timeout_ns, 1),
                                     ("reveal_gap_after_ns", reveal_gap_after_ns, 0), ("trigger_ns", trigger_ns, 0),
                                     ("analog_in_out_ns", analog_in_out_ns, 0)):
            _knob(name, value, minimum)
        _knob("feed_forward_deadline_ns", feed_forward_deadline_ns, 0, above=True, or_none=True)
        _knob("max_in_flight_shots", max_in_flight_shots, 1, or_none=True)
        _knob("max_gets_in_flight", max_gets_in_flight, 1, or_none=True)
        _knob("get_window_shots", get_window_shots, 1, or_none=True)
        if stream.num_shots < 1 or stream.num_detectors < 1:
            raise ValueError("the syndrome stream needs at least one shot and one detector")
        if shots_per_frame > 1 and rounds_per_frame not in (0, stream.num_rounds):
            raise ValueError("shots_per_frame > 1 sends whole shots: use rounds_per_frame=0")
        if shots_per_frame * stream.num_detectors > wire.MAX_SYNDROME_BITS:
            raise ValueError(f"shots_per_frame={shots_per_frame} x {stream.num_detectors} detectors exceeds the "
                             f"wire's {wire.MAX_SYNDROME_BITS} bits per frame")
        # one frame is one message of the transport: frames are cut to fit it (see SyndromeStream.frames)
        max_msg = getattr(getattr(endpoint, "capabilities", None), "max_message_bytes", None)
        self.max_frame_nbytes = None if max_msg is None else int(max_msg)
        if shots_per_frame > 1 and max_msg is not None:
            nbytes = wire.enqueue_syndromes_nbytes(shots_per_frame * stream.num_detectors)
            if nbytes > max_msg:
                fit = _max_frame_bits(max_msg) // stream.num_detectors
                raise FrameTooLargeError(
                    f"shots_per_frame={shots_per_frame} whole shots of {stream.num_detectors} detectors make an "
                    f"enqueue_syndromes frame of {nbytes} bytes, over this endpoint's max_message_bytes={max_msg}; "
                    + (f"use shots_per_frame <= {fit}" if fit >= 1 else
                       "one shot alone does not fit: send it by rounds (shots_per_frame=1)"),
                    nbytes=nbytes, max_nbytes=int(max_msg))
        if shots_per_frame * stream.num_observables > wire.MAX_CORRECTION_BITS:
            raise ValueError("shots_per_frame x observables exceeds the wire's correction bits per answer")
        window = shots_per_frame if get_window_shots is None else get_window_shots
        if window < 1 or window * stream.num_observables > wire.MAX_CORRECTION_BITS:
            raise ValueError(f"get_window_shots must be >= 1 and at most {wire.MAX_CORRECTION_BITS} correction bits "
                             f"({stream.num_observables} per shot), got {get_window_shots}")
        self.ep = endpoint
        self.stream = stream
        self.decoder_id = int(decoder_id)
        self.cycle_ns = int(cycle_ns)
        self.shots_per_frame = int(shots_per_frame)
        self.layout = stream.frames(rounds_per_frame=0 if shots_per_frame > 1 else rounds_per_frame,
                                    max_frame_nbytes=self.max_frame_nbytes)
        self.rounds_per_frame = rounds_per_frame
        self.gap_cycles = int(gap_cycles)
        self.poll_interval_ns = int(poll_interval_ns)
        self.ff_deadline_ns = feed_forward_deadline_ns
        self.start_delay_ns = int(start_delay_ns)
        self.modeled = {"trigger_ns": int(trigger_ns), "analog_in_out_ns": int(analog_in_out_ns)}
        self._keep = int(keep_samples)
        self.max_in_flight_shots = max_in_flight_shots
        self.max_gets_in_flight = max_gets_in_flight
        self.get_window_shots = int(window)
        self.spin_guard_ns = 3_000  # stop polling for answers this close to a tick
        # Behind schedule every frame is already due, so the loop would never reach its
        # polls: read answers anyway, at most once per this long (a real controller reads
        # them on hardware of its own; an answer must not wait for the emission to end).
        self.late_poll_ns = 20_000
        self.reveal_gap_after_ns = int(reveal_gap_after_ns)  # NOT_READY this long after the last frame
        self.get_timeout_ns = int(get_timeout_ns)  # a get_corrections unanswered this long is asked again
        self._backlog_cap = max(1, int(backlog_samples))
        self._counter = int(counter_start)  # enqueue counter: continues across runs on one connection
        self._rid = int(request_id_start) & 0x7FFFFFFF
        # get_corrections request ids (with the top bit set) go on across runs: an answer kept
        # by the service, or late on the way, is never taken for a later request's
        self._get_rid = int(get_request_id_start) & 0x7FFFFFFF
        self.gets_presumed_lost = 0  # (per run) gets whose answer did not come and were asked again
        self._prepare()

    @property
    def counter(self) -> int:
        """The next enqueue ``counter`` (pass it as ``counter_start`` to a later controller)."""
        return self._counter

    @property
    def next_request_id(self) -> int:
        """The next enqueue request id (pass it as ``request_id_start`` to a later controller)."""
        return self._rid

    @property
    def next_get_request_id(self) -> int:
        """The next get_corrections request id, less its top bit (``get_request_id_start``)."""
        return self._get_rid

    @property
    def frames_per_shot(self) -> int:
        """Frames one shot takes on the wire (1 when several shots share a frame)."""
        return len(self.layout)

    def run(self, *, timeout_s: float = 60.0) -> ControllerResult:
        """Play every shot of the stream and wait for every answer (at most ``timeout_s``)."""
        _knob("timeout_s", timeout_s, 0, above=True)
        if not self._prepared:  # a second run continues the counters: build its frames anew
            self._prepare()
        self._prepared = False
        gc_was_enabled = gc.isenabled()
        gc.freeze()  # what exists now outlives the run: no collector pass over it mid-run
        gc.disable()  # the run allocates no cycles; a collector pause would land on a tick
        cpu0 = time.thread_time_ns()
        try:
            res = self._run(timeout_s)
            return dataclasses.replace(res, cpu_ns=time.thread_time_ns() - cpu0)
        finally:
            if gc_was_enabled:
                gc.enable()
