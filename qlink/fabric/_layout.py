"""What one shot of a rotated surface-code memory puts on the wire, frame by frame.

A memory experiment of ``rounds`` QEC rounds at distance ``d`` has ``rounds + 1``
detector rounds, as stim generates it: the first and the final (data-qubit readout)
round compare ``(d² - 1) / 2`` stabilizers, every round between them all ``d² - 1``.
Round ``r`` exists at cycle tick ``r + 1`` of its shot; a frame carrying rounds up
to ``r`` leaves at that tick. Each frame is one CUDA-Q realtime ``enqueue_syndromes``
request: 24-byte header + 32-byte payload header + the bit-packed detectors.

>>> [(f.num_bits, f.last_round, f.nbytes) for f in shot_frames(3, 3)]
[(4, 0, 57), (8, 1, 57), (8, 2, 57), (4, 3, 57)]
>>> [(f.num_bits, f.last_round) for f in shot_frames(5, 5, rounds_per_frame=0)]
[(120, 5)]
>>> detectors_per_round(17), round_frame_nbytes(17)
(288, 92)
"""

from __future__ import annotations

from dataclasses import dataclass

from qlink import wire

__all__ = ["FrameSpec", "shot_frames", "detectors_per_round", "round_frame_nbytes",
           "GET_CORRECTIONS_NBYTES", "corrections_response_nbytes"]

GET_CORRECTIONS_NBYTES = wire.HEADER_NBYTES + wire.GET_CORRECTIONS_PAYLOAD_NBYTES  # 41 B


@dataclass(frozen=True)
class FrameSpec:
    """One frame of a shot: its detector bits, the last round it carries, its rounds, its size."""

    num_bits: int
    first_round: int
    last_round: int

    @property
    def num_rounds(self) -> int:
        return self.last_round - self.first_round + 1

    @property
    def nbytes(self) -> int:
        return wire.enqueue_syndromes_nbytes(self.num_bits)


def detectors_per_round(distance: int) -> int:
    """Stabilizers measured per full round of a distance-``distance`` rotated surface code."""
    _check_distance(distance)
    return distance * distance - 1


def round_frame_nbytes(distance: int) -> int:
    """Bytes of one full round's ``enqueue_syndromes`` frame."""
    return wire.enqueue_syndromes_nbytes(detectors_per_round(distance))


def corrections_response_nbytes(num_observables: int = 1) -> int:
    """Bytes of the ``get_corrections`` answer carrying ``num_observables`` bits."""
    return wire.corrections_nbytes(num_observables)


def _check_distance(distance: int) -> None:
    if isinstance(distance, bool) or not isinstance(distance, int) or distance < 2:
        raise ValueError(f"distance must be an integer >= 2, got {distance!r}")


def shot_frames(distance: int, rounds: int | None = None, *, rounds_per_frame: int = 1) -> list[FrameSpec]:
    """The frames of one shot (``rounds`` defaults to ``distance``; ``rounds_per_frame`` 0 = one frame)."""
    _check_distance(distance)
    rounds = distance if rounds is None else rounds
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    if isinstance(rounds_per_frame, bool) or not isinstance(rounds_per_frame, int) or rounds_per_frame < 0:
        raise ValueError(f"rounds_per_frame must be an integer >= 0 (0 = whole shot), got {rounds_per_frame!r}")
    full = detectors_per_round(distance)
    bits = [full // 2] + [full] * (rounds - 1) + [full // 2]
    n = len(bits)
    w = n if rounds_per_frame == 0 else rounds_per_frame
    return [FrameSpec(sum(bits[a:min(a + w, n)]), a, min(a + w, n) - 1) for a in range(0, n, w)]
