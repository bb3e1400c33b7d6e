"""The decoder service's per-frame path in Python (the ``"python"`` engine of
:class:`~qlink.qec.service.DecoderService`): a frame's validation, its shots' accumulation
and queueing, the decoder call over the queued shots, and the staged answers, each frame
read with two unpacks of :mod:`qlink.wire`'s layouts and anything unusual sent through
:func:`qlink.wire.decode_request`, which names the fault.

:class:`ServiceFrames` holds the methods; its state is the service's (``__slots__`` of
:class:`~qlink.qec.service.DecoderService`), which owns configuration, the serve loop and
the report. The native engine's path is :mod:`qlink.qec.hotpath`'s C core.
"""

from __future__ import annotations


import numpy as np

from qlink import wire
from qlink.clock import now_ns, ptp_now_ns
from qlink.errors import BrokenLinkError, ClosedError, WouldBlock
from qlink.wire import FrameError, Status

from ._decoder_state import _Decoder

__all__ = ["ServiceFrames"]

_MAX_FRAME_NBYTES = wire.enqueue_syndromes_nbytes(wire.MAX_SYNDROME_BITS)
# A message longer than any frame is read (and answered BAD_REQUEST) up to this size; a stream
# announcing more is refused from its header alone: a close frame, and the session ends.
_OVERSIZE_READ_NBYTES = 4 * _MAX_FRAME_NBYTES
# Response header fields after the magic (status, result_len, request_id, ptp_timestamp):
# the layout of qlink.wire's response header, patched in place on the hot path.
_RESP_FIELDS, _RESP_FIELDS_OFFSET = wire.RESPONSE_FIELDS, wire.RESPONSE_FIELDS_OFFSET
# The request header and the fixed payload fields of the two hot calls (qlink.wire's
# layout): a well-formed frame is read with two unpacks; anything unusual goes through
# wire.decode_request, which names the fault.
_REQ_HEADER = wire.REQUEST_HEADER
_ENQ_FIXED = wire.ENQUEUE_FIXED
_GET_FIXED = wire.GET_CORRECTIONS_PAYLOAD
_HDR = wire.HEADER_NBYTES
_ENQ_BITS_OFFSET = _HDR + wire.ENQUEUE_SYNDROMES_FIXED_NBYTES
_REQUEST_MAGIC, _ENQ_ID, _GET_ID = wire.REQUEST_MAGIC, wire.ENQUEUE_SYNDROMES, wire.GET_CORRECTIONS
_MAX_BITS, _MAX_CORR_BITS, _MAX_DEC = wire.MAX_SYNDROME_BITS, wire.MAX_CORRECTION_BITS, wire.MAX_DECODERS
_ENQ_MIN_ARG, _GET_ARG = wire.ENQUEUE_SYNDROMES_FIXED_NBYTES, wire.GET_CORRECTIONS_PAYLOAD_NBYTES
_STATUS_NAMES = {int(st): st.name for st in Status}

# staged-response kinds
_PLAIN, _CORRECTIONS, _REPLAY = 0, 1, 2  # (_REPLAY: a kept answer, sent again as it was)
# what a staged answer answers (_FN_TAKE: a get_corrections that consumed, whose answer is kept)
_FN_ENQ, _FN_GET, _FN_RESET, _FN_BAD, _FN_TAKE = 0, 1, 2, 3, 4


class _SessionRefused(Exception):
    """serve(): the peer announced a message too long to read; the session ends (close frame sent)."""


class ServiceFrames:
    """The Python per-frame path of :class:`~qlink.qec.service.DecoderService` (its state lives there)."""

    __slots__ = ()

    # ------------------------------------------------------------------ staging
    def _stage(self, kind: int, status: int, rid: int, ptp: int, t_in: int, fn: int,
               dec: int = 0, seq: int = 0, bits: int = 0) -> None:
        i = self._n_staged
        # a consuming get's answer gets a place among the kept ones now (filled at the flush), so a
        # repeat of it in this very batch finds it
        keep = self._decoders[dec].keep(rid, ptp) if fn == _FN_TAKE else -1
        self._staged[i] = (kind, status, rid, ptp, t_in, fn, dec, seq, bits, self._peer, keep)
        self._n_staged = i + 1

    def _refuse(self, fault: str, status: int, rid: int, ptp: int, t_in: int, fn: int) -> None:
        self.faults[fault] += 1
        if fn != _FN_ENQ or self._ack_errors:
            self._stage(_PLAIN, status, rid, ptp, t_in, fn)
        else:
            self.statuses[f"{Status(status).name}_unsent"] += 1

    # ------------------------------------------------------------------ handlers
    def _handle(self, n: int, t_in: int) -> None:
        """One frame, ``self._rx[:n]``: the hot calls read straight off the buffer."""
        self._n_requests += 1
        rx = self._rx
        if n >= _HDR + _GET_ARG:
            magic, fid, arg_len, rid, ptp = _REQ_HEADER.unpack_from(rx)
            if magic == _REQUEST_MAGIC and arg_len <= n - _HDR:
                if arg_len < n - _HDR and self._several(n, _HDR + arg_len, t_in):
                    return
                if fid == _ENQ_ID:
                    if arg_len >= _ENQ_MIN_ARG:
                        did, counter, mapping, nbits = _ENQ_FIXED.unpack_from(rx, _HDR)
                        if (0 <= did < _MAX_DEC and counter >= 0 and 1 <= nbits <= _MAX_BITS
                                and arg_len == _ENQ_MIN_ARG + ((nbits + 7) >> 3)):
                            if ptp:  # the sender's wall-clock (PTP) send stamp
                                self._rec_wire_in(ptp_now_ns() - ptp)
                            self._enqueue(did, counter, mapping, nbits, rid, ptp, t_in)
                            self._t_ready = t = now_ns()
                            self._rec_parse(t - t_in)
                            return
                elif fid == _GET_ID:
                    if arg_len == _GET_ARG:
                        did, rs, reset = _GET_FIXED.unpack_from(rx, _HDR)
                        if 0 <= did < _MAX_DEC and 0 <= rs <= _MAX_CORR_BITS and reset <= 1:
                            if ptp:
                                self._rec_wire_in(ptp_now_ns() - ptp)
                            self._get(did, rs, reset == 1, rid, ptp, t_in)
                            self._t_ready = t = now_ns()
                            self._rec_parse(t - t_in)
                            return
        self._handle_checked(self._rx_mv[:n], t_in)

    def _several(self, n: int, k: int, t_in: int) -> bool:
        """A message of several whole frames back to back (a datagram that carries a shot's last
        round and its get): when a request header lies right behind the first frame (``k``
        bytes), each frame is handled as if it came alone; else False (the frame as it is)."""
        rx = self._rx_mv
        if n - k < _HDR or _REQ_HEADER.unpack_from(rx, k)[0] != _REQUEST_MAGIC:
            return False
        self._n_requests -= 1  # (counted per frame below)
        self._counts["frames_packed"] += 1  # (the frame behind the first)
        rest = bytes(rx[k:n])
        self._handle(k, t_in)
        rx[:n - k] = rest
        self._handle(n - k, t_in)
        return True

    def _handle_checked(self, mv: memoryview, t_in: int) -> None:
        """Any other frame: validated by qlink.wire, which names what is wrong with it."""
        try:
            req = wire.decode_request(mv)
        except FrameError as e:
            self.faults[e.fault.value] += 1
            self._counts["frames_refused"] += 1
            if e.request_id is not None:
                self._stage(_PLAIN, int(e.fault.status), e.request_id, e.ptp_timestamp or 0, t_in, _FN_BAD)
            else:
                self._counts["frames_unanswerable"] += 1
            return
        ptp = req.ptp_timestamp
        if ptp:
            self._rec_wire_in(ptp_now_ns() - ptp)
        fid = req.function_id
        p = req.payload
        if fid == wire.ENQUEUE_SYNDROMES:  # (a valid frame the fast path passed on: never, but cheap to keep)
            self._enqueue(p.decoder_id, p.counter, p.syndrome_mapping_id, p.num_syndromes, req.request_id, ptp,
                          t_in, bits=p.syndromes_bits_packed)
        elif fid == wire.GET_CORRECTIONS:
            self._get(p.decoder_id, p.return_size, p.reset, req.request_id, ptp, t_in)
        elif fid == wire.RESET_DECODER:
            self._reset(p, req.request_id, ptp, t_in)
        else:  # registered elsewhere (another qlink function) but not served here
            self.faults["function_not_served"] += 1
            self._stage(_PLAIN, int(Status.BAD_REQUEST), req.request_id, ptp, t_in, _FN_BAD)
            return
        self._t_ready = t = now_ns()
        self._rec_parse(t - t_in)

    def _enqueue(self, decoder_id: int, counter: int, mapping_id: int, n: int, rid: int, ptp: int, t_in: int,
                 bits: memoryview | None = None) -> None:
        """``n`` syndrome bits (``bits``, else at their place in the receive buffer)."""
        self._n_enqueue += 1
        d = self._decoders[decoder_id]
        if d is None:
            return self._refuse("decoder_not_configured", Status.INVALID_DECODER, rid, ptp, t_in, _FN_ENQ)
        if mapping_id != 0:
            return self._refuse("syndrome_mapping_id", Status.BAD_REQUEST, rid, ptp, t_in, _FN_ENQ)
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
            self._counts["frames_lost"] += counter - nxt
            self._realign(d, counter - nxt)
            d.next_counter = counter  # the lost frames are accounted for, whatever becomes of this one
        if d.discard_frames:
            d.discard_frames -= 1
            d.next_counter = counter + 1
            self._counts["frames_discarded"] += 1
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
                self._counts["shots_refused_busy"] += whole
                self._drop_busy(d, whole, counter, frames_left=0)
                return self._refuse("queue_full", Status.BUSY, rid, ptp, t_in, _FN_ENQ)
            raw = None if bits is None else np.frombuffer(bits, np.uint8)
            self._enqueue_whole_shots(d, raw, whole, rid, ptp, t_in)
            d.next_counter = counter + 1
            if self._ack_all:
                self._stage(_PLAIN, int(Status.OK), rid, ptp, t_in, _FN_ENQ)
            return
        if not d.filling:
            if d.occupancy >= d.capacity:  # no room for a new shot: it is dropped, its other frames discarded
                self._counts["shots_refused_busy"] += 1
                F = d.frames_per_shot or 1
                self._drop_busy(d, 1, counter, frames_left=F - 1 if n < nd else 0)
                return self._refuse("queue_full", Status.BUSY, rid, ptp, t_in, _FN_ENQ)
            if n == nd:  # exactly one whole shot: its bytes go straight into its ring slot
                slot = d.cmp % d.capacity
                d.drops_before[slot] = d.pending_drops
                d.pending_drops = 0
                nbd = d.nbd
                base = slot * nbd
                src = self._rx_mv[_ENQ_BITS_OFFSET:_ENQ_BITS_OFFSET + nbd] if bits is None else bits[:nbd]
                d.syn_mv[base:base + nbd] = src
                if nd & 7:  # pad bits of the last byte are not syndrome bits
                    d.syn_mv[base + nbd - 1] &= (1 << (nd & 7)) - 1
                d.complete(1, rid, ptp, t_in, self._t_ready, now_ns())
                if d.frames_per_shot is None:
                    d.frames_per_shot = 1
                self._n_completed += 1
                d.next_counter = counter + 1
                if self._ack_all:
                    self._stage(_PLAIN, int(Status.OK), rid, ptp, t_in, _FN_ENQ)
                return
            self._start_shot(d)
        self._append(d, self._rx_mv[_ENQ_BITS_OFFSET:] if bits is None else bits, 0, n)
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
        self._counts["shots_dropped"] += shots

    def _enqueue_whole_shots(self, d: _Decoder, raw: np.ndarray | None, whole: int, rid: int, ptp: int,
                             t_in: int) -> None:
        """A frame carrying ``whole`` complete shots (``raw``: its packed bits onwards, else
        they are in the receive buffer): into the ring in one go."""
        nd, nbd, cap = d.num_det, d.nbd, d.capacity
        a = d.cmp % cap
        c = min(whole, cap - a)
        if nd & 7 == 0 and raw is None:  # whole bytes per shot: the frame's bytes are the ring's rows
            d.syn_mv[a * nbd:(a + c) * nbd] = self._rx_mv[_ENQ_BITS_OFFSET:_ENQ_BITS_OFFSET + c * nbd]
            if c < whole:  # the ring wraps
                d.syn_mv[:(whole - c) * nbd] = self._rx_mv[_ENQ_BITS_OFFSET + c * nbd:_ENQ_BITS_OFFSET + whole * nbd]
        else:
            if raw is None:
                raw = self._rx_np[_ENQ_BITS_OFFSET:]
            if nd & 7 == 0:
                rows = raw[:whole * nbd].reshape(whole, nbd)
            else:
                bits = np.unpackbits(raw[:(whole * nd + 7) >> 3], count=whole * nd, bitorder="little")
                rows = np.packbits(bits.reshape(whole, nd), axis=1, bitorder="little")
            d.syn[a:a + c] = rows[:c]
            if c < whole:
                d.syn[:whole - c] = rows[c:]
        d.drops_before[a:a + c] = [0] * c
        if c < whole:
            d.drops_before[:whole - c] = [0] * (whole - c)
        d.drops_before[a] = d.pending_drops
        d.pending_drops = 0
        d.complete(whole, rid, ptp, t_in, self._t_ready, now_ns())
        d.shots_per_frame = whole
        if d.frames_per_shot is None:
            d.frames_per_shot = 1
        self._n_completed += whole

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
        d.complete(1, rid, ptp, t_in, self._t_ready, now_ns())
        d.filling = False
        if d.frames_per_shot is None:
            d.frames_per_shot = d.frames_in_shot
        self._n_completed += 1

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
                self._counts["shots_dropped"] += 1
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
            self._counts["shots_dropped"] += gap * d.shots_per_frame
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
        self._counts["shots_dropped"] += new_drops

    def _get(self, decoder_id: int, rs: int, consume: bool, rid: int, ptp: int, t_in: int) -> None:
        """``get_corrections`` of ``rs`` bits; ``consume``: the request's reset flag."""
        self._n_get += 1
        d = self._decoders[decoder_id]
        if d is None:
            return self._refuse("decoder_not_configured", Status.INVALID_DECODER, rid, ptp, t_in, _FN_GET)
        if d.replay:
            slot = d.replay.get(rid)
            if slot is not None and (not consume or (ptp and d.replay_ptp[slot] == ptp)):
                # a retransmission (a peek repeating the request_id, or the very same request
                # again): the answer kept for it, nothing consumed
                self._counts["get_corrections_replayed"] += 1
                return self._stage(_REPLAY, 0, rid, ptp, t_in, _FN_GET, d.id, slot)
        # a consuming get's answer is kept for a retransmission (at the flush, once written)
        fn = _FN_TAKE if consume else _FN_GET
        no = d.num_obs
        if rs <= no:
            m = 1
        elif no and rs % no == 0 and rs // no <= d.capacity:
            m = rs // no  # the corrections of the m oldest shots, one after the other
        else:
            d.forget(rid)
            return self._refuse("return_size", Status.BAD_REQUEST, rid, ptp, t_in, _FN_GET)
        cap = d.capacity
        if m > 1:
            if d.drops_total:
                return self._get_window_with_drops(d, m, rs, consume, rid, ptp, t_in)
            if d.cmp - d.ret < m:
                return self._not_ready(d, rid, ptp, t_in)
            self._stage(_CORRECTIONS, int(Status.OK), rid, ptp, t_in, fn, d.id, d.ret, rs)
            if consume:
                d.ret += m
            return
        if d.ret < d.cmp:
            slot = d.ret % cap
            if d.drops_before[slot] > 0:
                if consume:
                    d.drops_before[slot] -= 1
                    d.drops_total -= 1
                self._stage(_PLAIN, int(Status.SYNDROMES_DROPPED), rid, ptp, t_in, fn, d.id)
                return
            self._stage(_CORRECTIONS, int(Status.OK), rid, ptp, t_in, fn, d.id, d.ret, rs)
            if consume:
                d.ret += 1
            return
        if d.filling and d.drops_before[d.cmp % cap] > 0:
            if consume:
                d.drops_before[d.cmp % cap] -= 1
                d.drops_total -= 1
            self._stage(_PLAIN, int(Status.SYNDROMES_DROPPED), rid, ptp, t_in, fn, d.id)
        elif not d.filling and d.pending_drops > 0:
            if consume:
                d.pending_drops -= 1
                d.drops_total -= 1
            self._stage(_PLAIN, int(Status.SYNDROMES_DROPPED), rid, ptp, t_in, fn, d.id)
        else:
            self._not_ready(d, rid, ptp, t_in)

    def _not_ready(self, d: _Decoder, rid: int, ptp: int, t_in: int) -> None:
        # a retransmission of this request_id must not find an older request's answer
        if d.replay:
            d.forget(rid)
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
                    return self._not_ready(d, rid, ptp, t_in)
        i = self._n_staged
        self._stage(_CORRECTIONS, int(Status.OK), rid, ptp, t_in, _FN_TAKE if consume else _FN_GET, d.id, d.ret, rs)
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
        self._counts["reset_decoder"] += 1
        d = self._decoder(p.decoder_id)
        if d is None:
            return self._refuse("decoder_not_configured", Status.INVALID_DECODER, rid, ptp, t_in, _FN_RESET)
        self._flush()  # answers staged so far refer to the state before the reset
        d.reset()
        self._stage(_PLAIN, int(Status.OK), rid, ptp, t_in, _FN_RESET)

    def _reset_all(self) -> None:
        """A new peer: what the last one left in every decoder means nothing to it."""
        for d in self._active:
            if d.next_counter is not None or d.cmp != d.free or d.filling or d.drops_total:
                self._counts["decoders_reset_for_new_peer"] += 1
            d.reset()

    # ------------------------------------------------------------------ decode + answer
    def _decode_pending(self, d: _Decoder) -> None:
        """Every complete shot not yet decoded, in one decoder call (more only where the ring
        wraps or ``max_decode_batch`` is reached)."""
        cap = d.capacity
        u_end = d.u_end
        rec_queue = self._rec_queue
        while d.dec < d.cmp:
            a = d.dec % cap
            n = min(d.cmp - d.dec, cap - a, self.max_decode_batch)
            t0 = now_ns()
            try:
                out = d.decode(d.syn[a:a + n])
                if out.shape != (n, d.nbo):
                    raise ValueError(f"decoder returned shape {out.shape}, expected {(n, d.nbo)}")
                d.corr[a:a + n, :d.nbo] = out
                status = 0
            except Exception:  # a decoder failure is answered INTERNAL_ERROR, never crashes the service
                status = int(Status.INTERNAL_ERROR)
                self.faults["decoder_exception"] += 1
            t1 = now_ns()
            if status or d.any_failed:
                d.slot_status[a:a + n] = status
                d.any_failed = True
            self._rec_decode(t1 - t0)
            self._rec_decode_per_shot((t1 - t0) // n)
            d.dec += n
            # the units this call finished: one queue sample each (a frame's shots complete together)
            u = d.units_decoded
            while u < d.units and u_end[u % cap] <= d.dec:
                j = u % cap
                d.u_dec0[j] = t0
                d.u_dec1[j] = t1
                d.u_batch[j] = n
                rec_queue(t0 - d.u_done[j])
                u += 1
            d.units_decoded = u
            self._batch_log2[n.bit_length()] += 1
            self._n_decode_calls += 1
            self._n_decoded += n

    def _flush(self) -> None:
        for d in self._active:
            if d.dec < d.cmp:
                self._decode_pending(d)
        ep = self._ep
        sendto = self._sendto
        tx, mv = self._tx, self._tx_mv
        hdr = _HDR
        staged = self._staged
        statuses = self.statuses
        n_ok = 0
        for i in range(self._n_staged):
            kind, status, rid, ptp, t_in, fn, dec, seq, bits, peer, keep = staged[i]
            if kind == _REPLAY:
                self._send_replay(self._decoders[dec], seq, rid, peer, t_in)
                continue
            nbytes = hdr
            d = None
            m = 1
            if kind == _CORRECTIONS:
                d = self._decoders[dec]
                slot = seq % d.capacity
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
                    status = int(d.slot_status[slot]) if d.any_failed else 0
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
                sendto(mv[:nbytes], peer)
            elif ep is not None:
                ep.send(mv[:nbytes])
            t_out = now_ns()
            if status == 0:
                n_ok += 1
            else:
                statuses[_STATUS_NAMES.get(status, str(status))] += 1
            if fn == _FN_TAKE:
                self._decoders[dec].store(keep, rid, bytes(mv[:nbytes]))
                self._rec_residence(t_out - t_in)
            elif fn == _FN_GET:
                self._rec_residence(t_out - t_in)
            if d is not None and status == 0:
                # one sample per answer: its shots share a frame, a decoder call and this send
                cap = d.capacity
                self._rec_respond(t_out - d.u_dec1[d.unit_of[(slot + m - 1) % cap] % cap])
                self._rec_shot_service(t_out - d.u_in[d.unit_of[slot] % cap])
                if self._keep:
                    self._record_shots(d, seq, m, t_out)
        if n_ok:
            statuses["OK"] += n_ok
        self._n_staged = 0
        for d in self._active:
            d.free = d.ret
        self.stages.settle_some()
        self._t_ready = now_ns()  # back at receiving: what arrives from now on waits for nothing

    def _send_replay(self, d: _Decoder, slot: int, rid: int, peer, t_in: int) -> None:
        """The kept answer to ``rid``, sent again byte for byte (its echoed ptp_timestamp is the
        first request's: a sender tells a replay from a fresh answer by it)."""
        answer = d.kept_answer(slot, rid)
        if answer is None:  # (its place was taken before this flush: more answers kept than it holds)
            self.faults["replay_lost"] += 1
            return
        if self._sendto is not None:
            self._sendto(answer, peer)
        elif self._ep is not None:
            self._ep.send(answer)
        self.statuses["replayed"] += 1
        self._rec_residence(now_ns() - t_in)

    def _many_corrections(self, d: _Decoder, slot: int, m: int, bits: int) -> int:
        """Write the corrections of ``m`` shots from ``slot`` on into the answer; return its status."""
        cap = d.capacity
        if slot + m <= cap:
            rows = d.corr[slot:slot + m]
            if d.any_failed and d.slot_status[slot:slot + m].any():
                return int(Status.INTERNAL_ERROR)
        else:  # the window wraps around the ring
            rows = np.concatenate((d.corr[slot:], d.corr[:slot + m - cap]))
            if d.any_failed and (d.slot_status[slot:].any() or d.slot_status[:slot + m - cap].any()):
                return int(Status.INTERNAL_ERROR)
        no = d.num_obs
        k = (bits + 7) >> 3
        if no == 1:  # one flip per shot, in bit 0 of its byte
            packed = np.packbits(rows[:, 0], bitorder="little")
        elif no & 7 == 0:
            packed = rows[:, :d.nbo].reshape(-1)
        else:
            flat = np.unpackbits(rows[:, :d.nbo], axis=1, count=no, bitorder="little").reshape(-1)
            packed = np.packbits(flat[:bits], bitorder="little")
        self._tx_np[_HDR:_HDR + k] = packed[:k]
        return 0

    def _record_shots(self, d: _Decoder, seq: int, m: int, t_out: int) -> None:
        """Keep the raw timestamps of an answer's ``m`` shots from shot ``seq`` on (while
        ``keep_samples`` has room): one row per unit they belong to (its shots share every
        timestamp), so a frame of many shots is one row."""
        shots = self.shots
        cap = d.capacity
        u_first, u_last = d.unit_of[seq % cap], d.unit_of[(seq + m - 1) % cap]
        end = seq + m
        lo = seq
        for u in range(u_first, u_last + 1):  # units are numbered in shot order
            j = u % cap
            hi = min(d.u_end[j], end)
            if len(shots) >= shots.capacity:
                shots.dropped += end - lo
                return
            shots.append(d.u_rid[j], d.u_ptp[j], d.u_in[j], d.u_done[j], d.u_dec0[j], d.u_dec1[j], t_out,
                         d.u_batch[j], 0, hi - lo, d.u_ready[j])
            lo = hi

    def _oversized(self, ep, needed: int, t_in: int) -> None:
        """A message larger than any valid frame: read it, count it, answer if its header allows.
        One announcing more than ``_OVERSIZE_READ_NBYTES`` over a stream is not read at all:
        the answers so far go out, then a close frame, and the session ends (_SessionRefused)."""
        self._n_requests += 1
        self._counts["frames_refused"] += 1
        self.faults["oversized_frame"] += 1
        if needed > _OVERSIZE_READ_NBYTES and self._sendto is None:
            from .sessions import CloseReason, encode_close_frame

            self._flush()
            self._counts["sessions_refused_oversized"] += 1
            try:
                ep.send_nowait(encode_close_frame(CloseReason.OVERSIZED_FRAME,
                                                  f"a message of {needed} bytes was announced; the longest frame "
                                                  f"this service takes is {_OVERSIZE_READ_NBYTES} bytes"))
            except (WouldBlock, BrokenLinkError, ClosedError):
                pass
            raise _SessionRefused(needed)
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
            magic, fid, arg_len, rid, ptp = wire.REQUEST_HEADER.unpack_from(data)
            self._stage(_PLAIN, int(Status.BAD_REQUEST), rid, ptp, t_in, _FN_BAD)
            return
        self._counts["frames_unanswerable"] += 1
