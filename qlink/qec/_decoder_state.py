"""One decoder's state inside the decoder service: the shot being filled and a ring of
completed shots (private to :mod:`qlink.qec.service`); decoders are compiled by
:func:`qlink.qec.decoders.compile_decoder`.

>>> import stim
>>> dem = stim.DetectorErrorModel("error(0.1) D0 L0\\nerror(0.1) D0 D1")
>>> compiled = compile_decoder("pymatching", dem)
>>> compiled.decode_shots_bit_packed(bit_packed_detection_event_data=np.array([[1]], np.uint8)).tolist()
[[1]]
"""

from __future__ import annotations

import numpy as np

from qlink import wire

from .decoders import compile_decoder

__all__ = ["compile_decoder"]


class _Decoder:
    """One decoder's state: the shot being filled and a ring of completed shots.

    Shot sequence numbers grow monotonically; the ring slot is ``seq % capacity``.
    ``free <= ret <= dec <= cmp``: [free, ret) answered but not yet sent, [ret, dec)
    decoded, [dec, cmp) complete and waiting for the decoder, ``cmp`` filling.
    Timestamps are kept per *unit* — one completion: a frame's whole shots, or a shot
    its last frame completed — in a ring of Python lists indexed ``unit % capacity``
    (at most ``capacity`` units are live: each holds a shot); each shot slot names
    its unit, so a frame of many shots costs one slice write, not one per field.
    """

    __slots__ = ("id", "compiled", "_decode_bit_packed", "num_det", "num_obs", "nbd", "nbo", "capacity",
                 "frames_cfg", "syn", "syn_mv", "corr", "corr_mv", "drops_before", "slot_status", "any_failed",
                 "unit_of", "u_end", "u_rid", "u_ptp", "u_in", "u_ready", "u_done", "u_dec0", "u_dec1", "u_batch",
                 "units", "units_decoded", "free", "ret", "dec", "cmp", "filling", "filled", "frames_in_shot",
                 "pending_drops", "discard_frames", "drops_total", "shots_per_frame", "next_counter",
                 "jump_candidate", "frames_per_shot", "replay", "replay_rid", "replay_ptp", "replay_answer",
                 "replay_next")

    def __init__(self, decoder_id: int, cfg: DecoderConfig, *, compiled=None) -> None:
        self.id = decoder_id
        # (``compiled``: another state's decoder, reused: compiled once, one state per session)
        self.compiled = compile_decoder(cfg.decoder, cfg.dem) if compiled is None else compiled
        self._decode_bit_packed = self.compiled.decode_shots_bit_packed
        nd = cfg.num_detectors if cfg.num_detectors is not None else cfg.dem.num_detectors
        no = cfg.num_observables if cfg.num_observables is not None else cfg.dem.num_observables
        if nd < 1 or nd > wire.MAX_SYNDROME_BITS * 64:
            raise ValueError(f"decoder {decoder_id}: {nd} detectors per shot is out of range")
        self.num_det, self.num_obs = int(nd), int(no)
        self.nbd, self.nbo = (self.num_det + 7) >> 3, (self.num_obs + 7) >> 3
        cap = self.capacity = cfg.capacity_shots
        self.frames_cfg = cfg.frames_per_shot
        self.syn = np.zeros((cap, self.nbd), np.uint8)
        self.syn_mv = memoryview(self.syn.reshape(-1))
        self.corr = np.zeros((cap, max(self.nbo, 1)), np.uint8)
        self.corr_mv = memoryview(self.corr.reshape(-1))
        # dropped-shot bookkeeping, read one slot at a time: a Python list is cheaper to index
        self.drops_before = [0] * cap
        self.slot_status = np.zeros(cap, np.int32)  # decoder failures (INTERNAL_ERROR); see any_failed
        self.any_failed = False
        self.unit_of = [0] * cap  # per shot slot: its unit
        self.u_end = [0] * cap  # per unit slot: the shot sequence after its last shot
        self.u_rid = [0] * cap  # request_id of the frame that completed it
        self.u_ptp = [0] * cap  # that frame's ptp_timestamp
        self.u_in = [0] * cap  # that frame received
        self.u_ready = [0] * cap  # the service back at receiving (its earlier work done) before that frame
        self.u_done = [0] * cap  # complete, queued for decoding
        self.u_dec0 = [0] * cap  # the decoder call that finished it: start, end, shots in it
        self.u_dec1 = [0] * cap
        self.u_batch = [0] * cap
        self.units = 0  # units completed so far
        self.units_decoded = 0
        # The answers of the last `capacity` consuming get_corrections, for a retransmission: a
        # ring of (request_id, its ptp_timestamp, answer bytes) and a dict naming each
        # request_id's place in it.
        self.replay: dict[int, int] = {}
        self.replay_rid: list = [None] * cap
        self.replay_ptp: list = [0] * cap
        self.replay_answer: list = [None] * cap
        self.replay_next = 0
        self.reset()

    def complete(self, num_shots: int, rid: int, ptp: int, t_in: int, t_ready: int, t_done: int) -> None:
        """``num_shots`` shots from ``cmp`` on are complete (one unit): stamp it, queue them."""
        cap = self.capacity
        u = self.units
        j = u % cap
        a = self.cmp % cap
        if num_shots == 1:
            self.unit_of[a] = u
        else:
            c = min(num_shots, cap - a)
            self.unit_of[a:a + c] = [u] * c
            if c < num_shots:
                self.unit_of[:num_shots - c] = [u] * (num_shots - c)
        self.cmp += num_shots
        self.u_end[j] = self.cmp
        self.u_rid[j] = rid
        self.u_ptp[j] = ptp
        self.u_in[j] = t_in
        self.u_ready[j] = t_ready
        self.u_done[j] = t_done
        self.units = u + 1

    def decode(self, packed: np.ndarray) -> np.ndarray:
        """One decoder call over bit-packed shots (rows); bit-packed observable flips back."""
        return np.asarray(self._decode_bit_packed(bit_packed_detection_event_data=packed), dtype=np.uint8)

    def keep(self, rid: int, ptp: int) -> int:
        """A place for the answer of a get_corrections that consumes shots (filled by
        :meth:`store` once written); the oldest kept answer makes room."""
        i = self.replay_next
        replay = self.replay
        old = self.replay_rid[i]
        if old is not None and replay.get(old) == i:
            del replay[old]
        self.replay_rid[i] = rid
        self.replay_ptp[i] = ptp
        self.replay_answer[i] = None
        replay[rid] = i
        self.replay_next = i + 1 if i + 1 < self.capacity else 0
        return i

    def store(self, slot: int, rid: int, answer: bytes) -> None:
        if self.replay_rid[slot] == rid:
            self.replay_answer[slot] = answer

    def kept_answer(self, slot: int, rid: int) -> bytes | None:
        """The answer kept at ``slot`` for ``rid`` (None once its place went to another)."""
        return self.replay_answer[slot] if self.replay_rid[slot] == rid else None

    def forget(self, rid: int) -> None:
        self.replay.pop(rid, None)

    def reset(self) -> None:
        self.replay.clear()  # (their answers concern shots that are gone)
        self.free = self.ret = self.dec = self.cmp = getattr(self, "cmp", 0)  # (unset on the first reset)
        self.units_decoded = self.units
        self.filling = False
        self.filled = 0
        self.frames_in_shot = 0
        self.pending_drops = 0
        self.discard_frames = 0
        self.drops_total = 0  # dropped shots not yet answered (fast path when 0)
        self.shots_per_frame = 1  # learned from frames carrying several whole shots
        self.next_counter: int | None = None
        self.jump_candidate = -2  # a counter refused as too far ahead (confirmed by its successor)
        self.frames_per_shot = self.frames_cfg

    @property
    def occupancy(self) -> int:
        return self.cmp + (1 if self.filling else 0) - self.free
