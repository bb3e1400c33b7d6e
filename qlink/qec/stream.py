"""A run's syndromes and how a shot is cut into ``enqueue_syndromes`` frames.

:class:`SyndromeStream` holds the detection events of a run, the true observable
flips and the round of every detector; :meth:`SyndromeStream.frames` gives the frame
layout of one shot (a round per frame, a window of rounds, or the whole shot), cut
between rounds so that no frame exceeds the wire's 2^20 bits or one message of the
transport. Both the Python controller and the native one build their frames from it.

>>> s = SyndromeStream(detectors=np.zeros((2, 6), np.uint8), observables=np.zeros((2, 1), np.uint8),
...                    round_of_detector=np.array([0, 0, 1, 1, 2, 2]))
>>> s.num_rounds, [(f.first_bit, f.num_bits, f.last_round) for f in s.frames(rounds_per_frame=2)]
(3, [(0, 4, 1), (4, 2, 2)])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qlink import wire
from qlink.errors import QlinkError

__all__ = ["SyndromeStream", "FrameLayout", "FrameTooLargeError", "sample_stream"]


class FrameTooLargeError(QlinkError, ValueError):
    """An ``enqueue_syndromes`` frame cannot be made to fit one message of the endpoint
    (one round's detectors alone, or the whole shots asked for in one frame, exceed it)."""

    def __init__(self, message: str, *, nbytes: int, max_nbytes: int):
        super().__init__(message)
        self.nbytes = nbytes
        self.max_nbytes = max_nbytes


def _max_frame_bits(max_frame_nbytes: int | None) -> int:
    """The most syndrome bits one frame may carry: the wire's 2^20, or fewer where a frame
    of more would not fit ``max_frame_nbytes``."""
    if max_frame_nbytes is None:
        return wire.MAX_SYNDROME_BITS
    return min(wire.MAX_SYNDROME_BITS, (int(max_frame_nbytes) - wire.enqueue_syndromes_nbytes(0)) * 8)


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

    def frames(self, *, rounds_per_frame: int, max_frame_nbytes: int | None = None) -> list[FrameLayout]:
        """The frame positions of one shot for a window of ``rounds_per_frame`` rounds
        (``0``: the whole shot in one frame). Rounds without detectors are skipped.

        A window whose frame would carry more than the wire's 2^20 syndrome bits, or be
        larger than ``max_frame_nbytes`` (one message of the transport: a UDP datagram
        holds 65,507 bytes), is split at round boundaries into several frames, each a
        complete ``enqueue_syndromes`` request (the service appends a shot's frames in
        counter order); a single round too large for one frame raises
        :class:`FrameTooLargeError`.

        >>> s = SyndromeStream(detectors=np.zeros((1, 24), np.uint8), observables=np.zeros((1, 1), np.uint8),
        ...                    round_of_detector=np.repeat([0, 1, 2], 8))   # 8 detectors per round
        >>> [(f.first_round, f.last_round, f.num_bits) for f in s.frames(rounds_per_frame=0, max_frame_nbytes=58)]
        [(0, 1, 16), (2, 2, 8)]
        >>> s.frames(rounds_per_frame=0, max_frame_nbytes=56)
        Traceback (most recent call last):
        ...
        qlink.qec.stream.FrameTooLargeError: round 0 alone has 8 syndrome bits: ...
        """
        if rounds_per_frame < 0:
            raise ValueError(f"rounds_per_frame must be >= 0 (0 = whole shot), got {rounds_per_frame}")
        max_bits = _max_frame_bits(max_frame_nbytes)
        R = self.num_rounds
        w = R if rounds_per_frame == 0 else rounds_per_frame
        r = self.round_of_detector
        out = []
        for first in range(0, R, w):
            last = min(first + w, R) - 1
            lo = int(np.searchsorted(r, first, side="left"))
            hi = int(np.searchsorted(r, last, side="right"))
            if hi - lo > max_bits:
                out += self._split_window(first, last, lo, hi, max_bits, max_frame_nbytes)
            elif hi > lo:
                out.append(FrameLayout(lo, hi - lo, first, last))
        return out

    def _split_window(self, first: int, last: int, lo: int, hi: int, max_bits: int,
                      max_frame_nbytes: int | None) -> list[FrameLayout]:
        """Rounds ``first..last`` (bits ``lo..hi``) as frames of at most ``max_bits`` each, cut
        between rounds: each frame takes as many whole rounds as fit."""
        r = self.round_of_detector
        ends = np.searchsorted(r, np.arange(first, last + 1), side="right")  # bit end of each round
        out = []
        start_bit, start_round = lo, first
        prev_end = lo
        for i, end in enumerate(ends.tolist()):
            rnd = first + i
            if end - start_bit > max_bits:
                if end - prev_end > max_bits:  # this round alone does not fit one frame
                    nbits = end - prev_end
                    limit = (f"max_message_bytes={max_frame_nbytes}"
                             if max_bits < wire.MAX_SYNDROME_BITS else f"{wire.MAX_SYNDROME_BITS} bits per frame")
                    raise FrameTooLargeError(
                        f"round {rnd} alone has {nbits} syndrome bits: an enqueue_syndromes frame of "
                        f"{wire.enqueue_syndromes_nbytes(nbits)} bytes, over this endpoint's {limit} "
                        f"(at most {max_bits} bits per frame); a frame is cut only between rounds, so use a "
                        "transport with larger messages (tcp://, shm://) or a larger max_message_bytes",
                        nbytes=wire.enqueue_syndromes_nbytes(nbits),
                        max_nbytes=wire.enqueue_syndromes_nbytes(max_bits) if max_frame_nbytes is None
                        else int(max_frame_nbytes))
                out.append(FrameLayout(start_bit, prev_end - start_bit, start_round, rnd - 1))
                start_bit, start_round = prev_end, rnd
            prev_end = end
        if hi > start_bit:
            out.append(FrameLayout(start_bit, hi - start_bit, start_round, last))
        return out

    def take(self, num_shots: int) -> "SyndromeStream":
        return SyndromeStream(self.detectors[:num_shots], self.observables[:num_shots], self.round_of_detector)

    @classmethod
    def from_source(cls, source: Any, *, num_shots: int, seed: int | None = None) -> "SyndromeStream":
        """Sample ``num_shots`` from a syndrome source (see :func:`qlink.qec.specs.build_source`)."""
        return sample_stream(source, num_shots=num_shots, seed=seed)


def sample_stream(source, *, num_shots: int, seed: int | None = None) -> SyndromeStream:
    """Sample ``num_shots`` shots of ``source`` into a :class:`SyndromeStream`."""
    if num_shots < 1:
        raise ValueError(f"num_shots must be >= 1, got {num_shots}")
    dets, obs = source.sample(num_shots, seed=seed)
    return SyndromeStream(detectors=dets, observables=obs, round_of_detector=np.asarray(source.round_of_detector))
