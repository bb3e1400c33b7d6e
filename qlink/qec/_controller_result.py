"""What a controller run measured (:class:`ControllerResult`) and the statistics read from it:
the logical error rate with its Wilson interval, and the rate under a feed-forward deadline.
The controller's modeled analog delays (never added to measured figures) live here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from qlink.wire import Status

__all__ = ["ControllerResult", "MODELED_ANALOG_IN_OUT_NS", "MODELED_TRIGGER_NS", "ler_under_deadline",
           "wilson_interval"]

MODELED_TRIGGER_NS = 212  # Qblox docs: trigger distribution to all sequencers
MODELED_ANALOG_IN_OUT_NS = 364  # Qblox docs: analog in -> analog out
_STATUS_NAMES = {int(st): st.name for st in Status}


def _status_name(status) -> str:
    return _STATUS_NAMES.get(status, str(status))


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
    cpu_ns: int = 0  # CPU time the run got (busy-polling, it should be close to duration_ns: else descheduled)
    # answers ignored (bad_frame.<fault>, unknown_request_id, echo_mismatch, status_length_mismatch),
    # held for an older get's answer, and gets asked again (reasked, reask_found_nothing_kept, ...)
    answer_faults: dict = field(default_factory=dict)
    # datagrams: frames sent behind another frame in one datagram (a controller behind its clock
    # catching up: whole frames back to back, each still stamped at its own emit)
    frames_joined: int = 0

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
