"""The controller's per-frame loop in Python (:class:`~qlink.qec.controller.Controller`'s hot
path): frames prebuilt from templates and patched in place, sent on the cycle clock, answers
matched to their gets by request id, corrections applied to the Pauli frame, gaps revealed
and lost answers asked for again; every shot stamped into preallocated rows.

:class:`ControllerLoop` holds the methods; its state is the controller's, which owns the
configuration and :meth:`~qlink.qec.controller.Controller.run`. The native controller's loop
is :mod:`qlink.qec.hotpath`'s C core.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from qlink import wire
from qlink.clock import now_ns, ptp_now_ns
from qlink.errors import QlinkError, QlinkTimeoutError, WouldBlock
from qlink.wire import FrameError, Status

from ._controller_result import ControllerResult, _status_name
from .timeline import CONTROLLER_SHOT_FIELDS, ShotRecords, StageRecorder

_FULL_NAP_S = 20e-6  # between tries to send into a full transport (see Controller._send)

__all__ = ["CONTROLLER_STAGES", "ControllerLoop"]

CONTROLLER_STAGES = (
    "emit_lag",  # a frame's cycle tick -> the controller started sending it
    "send",  # last round's tick -> last frame handed to the transport
    "get_round_trip",  # get_corrections sent -> the answer that resolved the shot received
    "apply",  # answer received -> applied to the Pauli frame
    "reaction",  # last round's tick -> correction applied (the headline figure)
)

# Fields the controller patches in place in its prebuilt frames (qlink.wire's layouts): one
# template per frame position is encoded with wire.encode_enqueue_syndromes_into.
_HDR_IDS, _HDR_IDS_OFFSET = wire.REQUEST_IDS, wire.REQUEST_IDS_OFFSET  # request_id, ptp_timestamp
_COUNTER, _COUNTER_OFFSET = wire.ENQUEUE_COUNTER, wire.ENQUEUE_COUNTER_OFFSET
_GET_RETURN, _GET_RETURN_OFFSET = wire.GET_RETURN_SIZE, wire.GET_RETURN_SIZE_OFFSET
_BITS_OFFSET = wire.HEADER_NBYTES + wire.ENQUEUE_SYNDROMES_FIXED_NBYTES

_PTP, _PTP_OFFSET = wire.PTP_FIELD, wire.PTP_OFFSET  # ptp_timestamp, stamped into a prebuilt frame at its tick
_RESP = wire.RESPONSE_HEADER  # magic, status, result_len, request_id, ptp_timestamp
_RESP_NBYTES = wire.HEADER_NBYTES
_RESPONSE_MAGIC = wire.RESPONSE_MAGIC
_OK, _NOT_READY = int(Status.OK), int(Status.NOT_READY)
_DROPPED, _FAILED = int(Status.SYNDROMES_DROPPED), int(Status.INTERNAL_ERROR)
_WINDOW_DROPPED = -_DROPPED  # an answer's status: a window of shots, some of them dropped (mask follows)
_STATUS_NAMES = {int(st): st.name for st in Status}
_GET_BIT = 0x80000000  # request ids of get_corrections; enqueue ids stay below


class ControllerLoop:
    """The per-frame loop of :class:`~qlink.qec.controller.Controller` (its state lives there)."""

    def _template(self, num_bits: int) -> bytearray:
        buf = bytearray(wire.enqueue_syndromes_nbytes(num_bits))
        wire.encode_enqueue_syndromes_into(buf, request_id=0, decoder_id=self.decoder_id, counter=0,
                                           syndrome_mapping_id=0, syndromes_bits_packed=bytes((num_bits + 7) >> 3),
                                           num_syndromes=num_bits)
        return buf

    def _frame_block(self, bits: np.ndarray, first_frame: np.ndarray) -> tuple[np.ndarray, memoryview, int]:
        """Whole ``enqueue_syndromes`` frames, one per row of ``bits`` (0/1, one frame's syndrome
        bits each): header, counter and request id filled in; the ptp stamp is written at the tick.
        ``first_frame`` is each row's frame index in the run (its counter and request id offset)."""
        rows, num_bits = bits.shape
        nb = wire.enqueue_syndromes_nbytes(num_bits)
        block = np.empty((rows, nb), np.uint8)
        block[:] = np.frombuffer(self._template(num_bits), np.uint8)
        block[:, _BITS_OFFSET:] = np.packbits(bits, axis=1, bitorder="little")
        counters = (self._counter_first + first_frame).astype("<i8")
        block[:, _COUNTER_OFFSET:_COUNTER_OFFSET + 8] = counters.view(np.uint8).reshape(rows, 8)
        rids = ((self._rid_first + first_frame) & 0x7FFFFFFF).astype("<u4")
        block[:, _HDR_IDS_OFFSET:_HDR_IDS_OFFSET + 4] = rids.view(np.uint8).reshape(rows, 4)
        return block, memoryview(block.reshape(-1)), nb

    def _prepare(self) -> None:
        """Every frame of the run, built up front: at a tick the controller stamps the send
        time and hands a view to the transport."""
        s = self.stream
        N, k = s.num_shots, self.shots_per_frame
        R = s.num_rounds
        period = R + self.gap_cycles
        self._counter_first, self._rid_first = self._counter, self._rid
        self._extra_frames = 0  # frames sent beyond the prebuilt ones (revealing a lost tail)
        # Emission units ("groups"): one shot in len(layout) frames, or k whole shots in one frame.
        # Per frame position of a group: (block, its flat view, frame bytes, due in cycles from the group's tick 0).
        self._frames = []
        if k == 1:
            F = len(self.layout)
            for f, fl in enumerate(self.layout):
                bits = s.detectors[:, fl.first_bit:fl.first_bit + fl.num_bits]
                block, mv, nb = self._frame_block(bits, np.arange(N, dtype=np.int64) * F + f)
                self._frames.append((block, mv, nb, fl.last_round + 1))
            self._num_groups = N
            self._tail = None
            self._last_due_cycles = self.layout[-1].last_round + 1
        else:
            G = -(-N // k)
            full = (N // k) * k
            nd = s.num_detectors
            if full:
                block, mv, nb = self._frame_block(s.detectors[:full].reshape(N // k, k * nd),
                                                  np.arange(N // k, dtype=np.int64))
                self._frames.append((block, mv, nb, (k - 1) * period + R))
            self._tail = None
            if full < N:  # the last, smaller group
                m = N - full
                block, mv, nb = self._frame_block(s.detectors[full:].reshape(1, m * nd),
                                                  np.array([N // k], dtype=np.int64))
                self._tail = (block, mv, nb, (m - 1) * period + R)
                if not full:
                    self._frames.append(self._tail)
            self._num_groups = G
            self._last_due_cycles = R
        self._get = bytearray(wire.HEADER_NBYTES + wire.GET_CORRECTIONS_PAYLOAD_NBYTES)
        wire.encode_get_corrections_into(self._get, request_id=0, decoder_id=self.decoder_id,
                                         return_size=s.num_observables, reset=True)
        self._reget = bytearray(self._get)  # the same ask as a peek (reset=0): a re-ask consumes nothing
        wire.encode_get_corrections_into(self._reget, request_id=0, decoder_id=self.decoder_id,
                                         return_size=s.num_observables, reset=False)
        self._truth_packed = np.ascontiguousarray(np.packbits(s.observables, axis=1, bitorder="little"))
        self._no = s.num_observables
        self._period_cycles = period
        self._prepared = True

    # ------------------------------------------------------------------ helpers
    def _send(self, mv, deadline_ns: int) -> None:
        """Send without ever blocking on a full transport while answers wait to be read.

        While the transport stays full the loop naps ``_FULL_NAP_S`` between tries: the service
        is a whole transport's worth of frames behind, and a service thread in this process (an
        ``inproc`` or threaded service) would otherwise get the GIL back only once per switch
        interval per call it makes."""
        ep = self.ep
        while True:
            try:
                ep.send_nowait(mv)
                return
            except WouldBlock:
                self._poll_once()
                time.sleep(_FULL_NAP_S)
                if now_ns() > deadline_ns:
                    raise QlinkTimeoutError("the controller could not send a frame before its run deadline "
                                            "(the transport stayed full: is the decoder service reading?)")

    def _run(self, timeout_s: float) -> ControllerResult:
        s = self.stream
        N, R = s.num_shots, s.num_rounds
        k = self.shots_per_frame
        G = self._num_groups
        cyc = self.cycle_ns
        period = self._period_cycles
        frames = self._frames
        F = len(frames) if k == 1 else 1
        tail = self._tail
        ff = self.ff_deadline_ns
        self.stages = stages = StageRecorder(CONTROLLER_STAGES)
        # Logs filled by index into lists sized up front (growing a long list mid-run copies it:
        # a stall of a few hundred µs on some tick); counted into the histograms at the end.
        lags = [0] * (G * F)  # per frame: its tick -> the controller started sending it
        sends = [0] * G  # per group: its last tick -> its last frame handed to the transport
        nf = 0
        # per group: its tick 0 and when its last frame was handed to the transport
        self._g_base = g_base = [0] * G
        self._g_sent = g_sent = [0] * G
        # per get_corrections sent: (first shot, shots, sent at); per answer that resolved shots,
        # in order: (first shot, shots, status, received, applied, offset of its result bytes)
        self._asks: list = [None] * N
        self._n_asks = 0
        self._answers: list = [None] * N
        self._n_answers = 0
        nbo = (s.num_observables + 7) >> 3
        self._a_bytes = bytearray(N * nbo + 2 * N + ((N * s.num_observables + N) >> 3) + 64)
        self._a_bytes_n = 0
        self._bl_t = np.zeros(self._backlog_cap, np.int64)
        self._bl_v = np.zeros(self._backlog_cap, np.int64)
        self._bl_n = 0
        self._bl_every = max(1, -(-G // self._backlog_cap))
        self._st_enq: dict = {}
        self._st_get: dict = {}  # statuses of get answers other than OK (those are counted at the end)
        self._resolved = 0  # shots answered (OK / dropped / failed), in order
        self._asked = 0  # shots whose syndromes have all been sent
        self._claimed = 0  # shots covered by get_corrections in flight
        # get_corrections in flight, in the order they were sent (the order the service answers
        # them in): request_id -> (shots covered, sent at, its ptp stamp, last asked at)
        self._gets: dict[int, tuple[int, int, int, int]] = {}
        self._order: deque = deque()  # their request ids, oldest first (a dict's first key costs a scan)
        self._reasked: dict[int, int] = {}  # request_id -> ptp stamp of its latest re-ask (kept to the run's end)
        self._early: dict[int, tuple] = {}  # answers waiting for an older get's answer
        self._faults: dict[str, int] = {}  # answers ignored or held back, and re-asks, by why
        self.gets_presumed_lost = 0
        self._repoll_due = 0
        self._stall_since = 0
        self._gap_revealed = False
        self._frame = 0
        self._last_ok = False  # was the last shot resolved answered with a correction?
        self._last_applied = 0
        w = max(k, self.get_window_shots)
        self._rx = bytearray(wire.HEADER_NBYTES + ((w * s.num_observables + 7) >> 3) + ((w + 7) >> 3) + 64)
        self._rx_mv = memoryview(self._rx)
        late = 0
        spin_guard = self.spin_guard_ns
        late_poll = self.late_poll_ns
        last_poll = 0
        throttled = 0
        inflight_cap = self.max_in_flight_shots
        max_lag = 0
        misses = 0
        t_start = now_ns()
        deadline = t_start + int(timeout_s * 1e9)
        self._deadline = deadline
        t0 = t_start + self.start_delay_ns
        self._t0 = t0
        group_base = t0  # tick 0 of the current group's first shot
        g, f = 0, 0
        a, b = 0, min(k, N)  # shots of the current group
        if k == 1 or b - a == k:
            block, mv, nb, due_c = frames[0]
            row = 0
        else:
            block, mv, nb, due_c = tail
            row = -1  # the tail block holds one frame
        due = group_base + due_c * cyc
        send = self._send
        poll = self._poll_once
        while self._resolved < N:
            now = now_ns()
            if now > deadline:
                raise QlinkTimeoutError(
                    f"controller run exceeded timeout_s={timeout_s}: {self._resolved}/{N} shots answered, "
                    f"{a}/{N} shots emitted")
            if g < G and due - now < spin_guard:
                if now - last_poll > late_poll and now > due and self._gets:
                    poll()  # behind schedule with answers to come
                    last_poll = now
                    continue
                # the next tick is close: stop polling and watch the clock alone
                while now < due:
                    now = now_ns()
                if f == 0 and inflight_cap is not None and a - self._resolved >= inflight_cap:
                    # hold the new group back until answers free a place, then restart the clock
                    throttled += 1
                    while a - self._resolved >= inflight_cap:
                        poll()
                        if now_ns() > deadline:
                            raise QlinkTimeoutError(
                                f"controller run exceeded timeout_s={timeout_s} waiting for answers "
                                f"({self._resolved}/{N} shots answered)")
                    group_base = t0 + -(-(now_ns() - t0) // cyc) * cyc
                    due = group_base + due_c * cyc
                    continue
                lag = now - due
                if lag > cyc:
                    late += 1
                if lag > max_lag:
                    max_lag = lag
                lags[nf] = lag
                nf += 1
                off = g * nb if row >= 0 else 0  # (with one shot per group, g is the shot)
                _PTP.pack_into(mv, off + _PTP_OFFSET, ptp_now_ns())
                send(mv[off:off + nb], deadline)
                if f == F - 1:  # the group's syndromes are all out
                    t_sent = now_ns()
                    g_base[g] = group_base
                    g_sent[g] = t_sent
                    sends[g] = t_sent - due
                    self._asked = b
                    self._top_up(t_sent)
                    if g % self._bl_every == 0:
                        self._sample_backlog(t_sent, b * R)
                    if ff is not None:
                        # feed-forward: wait for these corrections before the conditional operation
                        while self._resolved < b:
                            poll()
                            if now_ns() > deadline:
                                raise QlinkTimeoutError(
                                    f"no correction for shot {self._resolved} within the run's timeout_s={timeout_s}")
                        # due is the last shot's emission tick
                        if not self._last_ok or self._last_applied - due > ff:
                            misses += 1
                        # the next group starts on the next tick after the conditional operation
                        group_base = max(group_base + (b - a) * period * cyc,
                                         t0 + -(-(now_ns() - t0) // cyc) * cyc)
                    else:
                        group_base += (b - a) * period * cyc
                    g += 1
                    f = 0
                    a, b = b, min(b + k, N)
                else:
                    f += 1
                if g < G:
                    if k == 1 or b - a == k:
                        block, mv, nb, due_c = frames[f]
                        row = 0
                    else:
                        block, mv, nb, due_c = tail
                        row = -1
                    due = group_base + due_c * cyc
                continue
            poll()
            last_poll = now
        t_end = now_ns()
        self._counter = self._counter_first + G * F + self._extra_frames
        self._rid = (self._rid_first + G * F + self._extra_frames) & 0x7FFFFFFF
        self._sample_backlog(t_end, N * R)
        stages.histogram("emit_lag").record_many(np.array(lags[:nf], np.int64))
        stages.histogram("send").record_many(np.array(sends[:g], np.int64))
        return self._result(t_end, late=late, throttled=throttled, max_lag=max_lag, misses=misses)

    def _result(self, t_end: int, *, late: int, throttled: int, max_lag: int, misses: int) -> ControllerResult:
        """The run's per-shot figures, computed once, vectorised, from what the answers left."""
        s = self.stream
        N, R, k = s.num_shots, s.num_rounds, self.shots_per_frame
        no, cyc = s.num_observables, self.cycle_ns
        A = self._n_answers
        ans = np.array(self._answers[:A], np.int64).reshape(A, 7)
        first, num, a_status, a_resp, a_applied, boff, a_get = ans.T
        applied_ok = (a_status == _OK) | (a_status == _WINDOW_DROPPED)  # answers applied: one sample each
        self.stages.histogram("apply").record_many(a_applied[applied_ok] - a_resp[applied_ok])
        self.stages.histogram("get_round_trip").record_many(a_resp[applied_ok] - a_get[applied_ok])
        shot_answer = np.repeat(np.arange(A), num)  # answers resolve shots in order: 0 .. resolved-1
        resolved = int(num.sum())
        shots = np.arange(resolved)
        status = np.where(a_status[shot_answer] == _WINDOW_DROPPED, 0, a_status[shot_answer])
        has_bits = (a_status == 0) | (a_status == _WINDOW_DROPPED)
        # each shot's flips: bit (shot - first) * no + o of its answer's result bytes
        bits_all = np.unpackbits(np.frombuffer(self._a_bytes, np.uint8, count=self._a_bytes_n), bitorder="little")
        pos = (boff * 8 - first * no)[shot_answer] + shots * no
        take = has_bits[shot_answer]
        flips = np.zeros((resolved, no), np.uint8)
        if take.any():
            flips[take] = bits_all[pos[take, None] + np.arange(no)]
        for i in np.flatnonzero(a_status == _WINDOW_DROPPED):  # windows with dropped shots: their mask
            m = int(num[i])
            mask_at = int(boff[i]) * 8 + ((m * no + 7) >> 3) * 8
            dropped = bits_all[mask_at:mask_at + m].astype(bool)
            lo = int(first[i])
            status[lo:lo + m][dropped] = int(Status.SYNDROMES_DROPPED)
            flips[lo:lo + m][dropped] = 0
        corrections = np.zeros((N, (no + 7) >> 3), np.uint8)
        corrections[:resolved] = np.packbits(flips, axis=1, bitorder="little") if no else 0
        ok = status == 0
        group = shots // k
        emit = np.array(self._g_base, np.int64)[group] + ((shots - group * k) * self._period_cycles
                                                           + self._last_due_cycles) * cyc
        applied = a_applied[shot_answer]
        reaction = np.full(N, -1, np.int64)
        reaction[:resolved][ok] = applied[ok] - emit[ok]
        correct = np.full(N, -1, np.int8)
        correct[:resolved][ok] = (corrections[:resolved][ok] == self._truth_packed[:resolved][ok]).all(axis=1)
        self.stages.histogram("reaction").record_many(reaction[:resolved][ok])
        n_ok = int(ok.sum())
        n_drop = int((status == Status.SYNDROMES_DROPPED).sum())
        records = None
        if self._keep:
            n = min(resolved, self._keep)
            F = len(self._frames) if k == 1 else 1
            rid_last = (self._rid_first + group[:n] * F + F - 1) & 0x7FFFFFFF
            resp = a_resp[shot_answer[:n]]
            # each shot's first ask, and how many asked for it
            asks = np.array(self._asks[:self._n_asks], np.int64).reshape(-1, 3)
            u, m, t_ask = asks.T
            ends = u + m
            before = np.maximum.accumulate(np.concatenate(([0], ends[:-1])))
            fresh = np.maximum(ends - np.maximum(u, before), 0)  # shots a get was the first to ask for
            get_sent = np.zeros(N, np.int64)
            covered = np.repeat(t_ask, fresh)
            get_sent[:len(covered)] = covered
            polls = np.zeros(N, np.int64)
            np.add.at(polls, u, 1)
            self.records = rec = ShotRecords(CONTROLLER_SHOT_FIELDS, capacity=self._keep)
            # the tick each shot's frame was due: its group's last shot's emission
            last_of_group = np.minimum((group[:n] + 1) * k, N) - 1
            frame_due = emit[:n] + (last_of_group - shots[:n]) * self._period_cycles * cyc
            rec.extend(n, shot=shots[:n], last_request_id=rid_last, emit_last_ns=emit[:n], frame_due_ns=frame_due,
                       sent_last_ns=np.array(self._g_sent, np.int64)[group[:n]], get_sent_ns=get_sent[:n],
                       response_ns=resp, applied_ns=np.where(ok[:n], applied[:n], 0), polls=polls[:n],
                       status=status[:n], correct=correct[:n])
            records = rec.array().copy()
        statuses = {f"enqueue.{_status_name(st)}": c for st, c in self._st_enq.items()}
        n_ok_answers = int((a_status == _OK).sum())
        if n_ok_answers:
            statuses["get_corrections.OK"] = n_ok_answers
        statuses.update({f"get_corrections.{_status_name(st)}": c for st, c in self._st_get.items()})
        return ControllerResult(
            num_shots=N, num_rounds=R, frames_per_shot=self.frames_per_shot, cycle_ns=cyc, shots_ok=n_ok,
            logical_errors=int((correct == 0).sum()), shots_dropped=n_drop, shots_failed=resolved - n_ok - n_drop,
            late_frames=late, throttled=throttled, max_lag_ns=int(max_lag), deadline_misses=misses,
            duration_ns=int(t_end - self._t0), statuses=statuses, stages=self.stages.to_dict(),
            correct=correct, reaction_ns=reaction,
            backlog_t_ns=self._bl_t[:self._bl_n] - self._t0, backlog_rounds=self._bl_v[:self._bl_n].copy(),
            corrections=corrections, shot_records=records,
            modeled_controller_ns=dict(self.modeled), pauli_frame=self._frame, answer_faults=dict(self._faults),
        )

    def _reveal_gap(self) -> None:
        block, mv, nb, _ = self._frames[0]
        t = bytearray(mv[:nb])
        k = self._num_groups * (len(self._frames) if self.shots_per_frame == 1 else 1) + self._extra_frames
        _COUNTER.pack_into(t, _COUNTER_OFFSET, self._counter_first + k)
        _HDR_IDS.pack_into(t, _HDR_IDS_OFFSET, (self._rid_first + k) & 0x7FFFFFFF, ptp_now_ns())
        try:
            self.ep.send_nowait(t)  # (called from a poll: never wait; the stall repeats it)
        except WouldBlock:
            return
        self._extra_frames += 1
        self._gap_revealed = True

    def _sample_backlog(self, t: int, rounds_emitted: int) -> None:
        """Rounds the QPU has produced by ``t`` and no correction has answered yet.

        On the plain schedule (no throttle, no feed-forward) that counts every round whose
        tick has passed, sent or not: a controller held back by a full transport, or late,
        does not make the backlog look smaller than the QPU's."""
        i = self._bl_n
        if i < self._backlog_cap:
            R = self.stream.num_rounds
            produced = rounds_emitted
            if self.ff_deadline_ns is None and self.max_in_flight_shots is None:
                cyc = self.cycle_ns
                ticked = (t - self._t0 - R * cyc) // (self._period_cycles * cyc) + 1  # shots whose last round is out
                produced = max(produced, min(max(ticked, 0), self.stream.num_shots) * R)
            self._bl_t[i] = t
            self._bl_v[i] = produced - self._resolved * R
            self._bl_n = i + 1

    def _top_up(self, t: int) -> None:
        """Keep every shot whose syndromes are out covered by a get_corrections in flight.

        Never waits: with the transport full, the ask waits for the next poll (waiting here
        would mean polling here, and a poll tops up)."""
        if t < self._repoll_due:
            return
        k = self.get_window_shots
        limit = self.max_gets_in_flight
        while self._claimed < self._asked - self._resolved:
            if limit is not None and len(self._gets) >= limit:
                return
            u = self._resolved + self._claimed
            m = min(k, self._asked - u)
            rid = _GET_BIT | self._get_rid
            ptp = ptp_now_ns()
            _GET_RETURN.pack_into(self._get, _GET_RETURN_OFFSET, m * self._no)
            _HDR_IDS.pack_into(self._get, _HDR_IDS_OFFSET, rid, ptp)
            try:
                self.ep.send_nowait(self._get)
            except WouldBlock:
                return
            self._get_rid = (self._get_rid + 1) & 0x7FFFFFFF
            self._gets[rid] = (m, t, ptp, t)
            self._order.append(rid)
            self._claimed += m
            i = self._n_asks
            if i == len(self._asks):  # asks beyond one per shot (after NOT_READY): rare
                self._asks.extend([None] * len(self._asks))
            self._asks[i] = (u, m, t)
            self._n_asks = i + 1

    def _poll_once(self) -> None:
        """Handle at most one answer; send a due re-poll; ask again for an answer that is late.

        Answers are taken in the order their gets were sent, which is the order the service
        consumed shots for them: an answer that overtakes an older get's is held until that
        one is taken. Each is matched to its get by request_id and checked against it (the
        echoed ptp_timestamp, a result length that fits the status); a frame that fails, or
        an answer to no get in flight (a duplicate, a replay after the answer came), is
        counted and ignored."""
        if self._claimed < self._asked - self._resolved:
            self._top_up(now_ns())
        rx = self._rx
        if self._early and self._order and self._order[0] in self._early:  # a held answer whose turn has come
            t_resp, held = self._early.pop(self._order[0])
            n = len(held)
            rx[:n] = held
        else:
            try:
                n = self.ep.recv_into_nowait(rx)
            except WouldBlock:
                if self._order:
                    rid0 = self._order[0]
                    t = now_ns()
                    if t - self._gets[rid0][3] > self.get_timeout_ns:
                        # No answer: the ask or its answer was lost (or is very late). Ask again.
                        if self._reask(rid0, t):
                            self.gets_presumed_lost += 1
                return
            t_resp = now_ns()
        if n >= _RESP_NBYTES:
            magic, status, result_len, rid, ptp = _RESP.unpack_from(rx)
        if n < _RESP_NBYTES or magic != _RESPONSE_MAGIC or result_len != n - _RESP_NBYTES:
            return self._bad_frame(n)
        if not rid & _GET_BIT:
            self._st_enq[status] = self._st_enq.get(status, 0) + 1
            return
        entry = self._gets.pop(rid, None)
        if entry is None:  # answered already (a duplicate, a replay of an answer that came), or never asked
            return self._fault("unknown_request_id")
        m, t_get, ptp0, t_ask = entry
        no = self._no
        k = (m * no + 7) >> 3  # flip bytes of m shots
        if status or ptp != ptp0 or rid != self._order[0] or result_len != k:
            # anything but an OK answer to the oldest get: a result length that fits the status?
            if status == _OK:
                fits = result_len == k
            elif status == _DROPPED and m > 1:  # the window's flips, then its dropped mask
                fits = result_len == k + ((m + 7) >> 3)
            else:
                fits = result_len == 0
            if ptp != ptp0 or not fits or rid != self._order[0] or (
                    status != _OK and status != _NOT_READY and status != _DROPPED and status != _FAILED):
                self._gets[rid] = entry  # (the order is kept in self._order)
                if not self._odd_answer(rid, entry, status, ptp, fits, n, t_resp):
                    return
                self._gets.pop(rid)
                status = _NOT_READY  # a fresh peek: the first ask consumed nothing
        self._order.popleft()
        self._claimed -= m
        if status:
            self._st_get[status] = self._st_get.get(status, 0) + 1
        if status == _NOT_READY:
            self._repoll_due = t_resp + self.poll_interval_ns
            if self._asked == self.stream.num_shots:
                # Everything is out yet a shot is not complete: its last frame was lost, and
                # only a later frame can show the service the gap. Send one that starts a
                # shot nobody will finish (again if the stall goes on).
                if self._stall_since == 0:
                    self._stall_since = t_resp
                elif t_resp - self._stall_since > self.reveal_gap_after_ns:
                    self._reveal_gap()
                    self._stall_since = t_resp
            return
        self._stall_since = 0
        r = self._resolved
        ok = status == _OK
        t_applied = j = 0
        if ok or (status == _DROPPED and m > 1):
            # apply: XOR the flips into the Pauli frame (a window with dropped shots carries
            # the flips of all m, zeros for the dropped, then their mask)
            if not ok:
                status = _WINDOW_DROPPED
            flips = int.from_bytes(self._rx_mv[_RESP_NBYTES:_RESP_NBYTES + k], "little")
            if no == 1:
                self._frame ^= (flips & ((1 << m) - 1)).bit_count() & 1  # (pad bits are not flips)
            else:
                mask = (1 << no) - 1
                for _ in range(m):
                    self._frame ^= flips & mask
                    flips >>= no
            t_applied = now_ns()
            j = self._a_bytes_n
            self._a_bytes[j:j + result_len] = self._rx_mv[_RESP_NBYTES:n]
            self._a_bytes_n = j + result_len
            self._last_applied = t_applied
            if not ok:  # was the window's last shot dropped?
                mask_bits = int.from_bytes(self._rx_mv[_RESP_NBYTES + k:_RESP_NBYTES + k + ((m + 7) >> 3)], "little")
                ok = not (mask_bits >> (m - 1)) & 1
        i = self._n_answers
        self._answers[i] = (r, m, status, t_resp, t_applied, j, t_get)  # (at most one per shot)
        self._n_answers = i + 1
        self._last_ok = ok
        self._resolved = r + m
        if self._claimed < self._asked - self._resolved:
            self._top_up(now_ns())

    def _odd_answer(self, rid: int, entry: tuple, status: int, ptp: int, fits: bool, n: int, t_resp: int) -> bool:
        """An answer off the plain path: ignored (False), held for its turn (False), or the
        answer to a re-ask that found nothing kept, to be taken now as 'nothing consumed' (True)."""
        m, t_get, ptp0, t_ask = entry
        fresh = ptp != ptp0
        if fresh and self._reasked.get(rid) != ptp:
            # neither the ask's echo nor its re-ask's: a flipped bit, or an older request's answer
            self._fault("echo_mismatch")
            return False
        if not fits:
            self._fault("status_length_mismatch")
            return False
        if status and status != _NOT_READY and status != _DROPPED and status != _FAILED:
            if fresh:  # refused twice: the request itself is wrong
                raise QlinkError(
                    f"the decoder service refused get_corrections with {_status_name(status)} (request {rid}): "
                    "check that decoder_id and return_size match the service's configuration")
            # refused once: believed when a peek of the same request is refused too (a flipped
            # status bit can look like a refusal)
            self._fault("refused_once")
            self._reask(rid, t_resp)
            return False
        if rid != self._order[0]:
            # an older get's answer is missing: this one waits for it, and each older get asked
            # before this one was is asked again (its answer was lost, or the ask was)
            self._early[rid] = (t_resp, bytes(self._rx_mv[:n]))
            self._fault("held_for_an_older_answer")
            self._reask_older(rid, t_ask if fresh else t_get, t_resp)
            return False
        # The re-ask's own answer, its turn come: the service kept no answer of the first ask,
        # so that consumed nothing (an ask that consumes has its answer kept): it was not
        # ready, or never arrived. Its shots are asked for again.
        self._fault("reask_found_nothing_kept")
        return True

    def _fault(self, what: str) -> None:
        self._faults[what] = self._faults.get(what, 0) + 1

    def _bad_frame(self, n: int) -> None:
        """A frame that is not a whole response: counted by what qlink.wire finds wrong with it."""
        try:
            wire.decode_response(self._rx_mv[:n])
        except FrameError as e:
            self._fault(f"bad_frame.{e.fault.value}")
        else:  # (a valid header whose result_len is shorter than the frame)
            self._fault("bad_frame.length_mismatch")

    def _reask(self, rid: int, now: int) -> bool:
        """Ask again for the answer to get ``rid``: the same request_id, as a peek. The service
        answers a repeated request_id from the answers it keeps, byte for byte (the first
        ask's ptp_timestamp echoed); without one kept, the peek consumes nothing and its
        answer, echoing the re-ask's own stamp, says the first ask consumed nothing either."""
        m, t_get, ptp0, _ = self._gets[rid]
        ptp = ptp_now_ns()
        if ptp == ptp0:
            ptp += 1
        _GET_RETURN.pack_into(self._reget, _GET_RETURN_OFFSET, m * self._no)
        _HDR_IDS.pack_into(self._reget, _HDR_IDS_OFFSET, rid, ptp)
        try:
            self.ep.send_nowait(self._reget)  # (called from a poll: never wait; the next poll asks)
        except WouldBlock:
            return False
        self._gets[rid] = (m, t_get, ptp0, now)
        self._reasked[rid] = ptp
        self._fault("reasked")
        return True

    def _reask_older(self, rid: int, t_asked: int, now: int) -> None:
        """Answers come back in the order of the asks: every get in flight before ``rid`` whose
        latest ask went out before the one just answered (at ``t_asked``) lost its answer."""
        late = []
        gets = self._gets
        for r in self._order:
            if r == rid:
                break
            if gets[r][3] < t_asked and r not in self._early:
                late.append(r)
        for r in late:
            if self._reask(r, now):
                self.gets_presumed_lost += 1
