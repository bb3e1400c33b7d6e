"""Per-stage timestamps of the QEC loop: stage histograms and per-shot records.

Two kinds of record, both constant-memory on the hot path:

* :class:`StageRecorder` keeps one :class:`~qlink.histogram.LatencyHistogram` per
  named stage (``decode``, ``queue``, ``wire_in`` …), so a run of 10^6 shots costs the
  same memory as a run of ten.
* :class:`ShotRecords` keeps the raw timestamps of the first ``capacity`` shots in a
  preallocated NumPy structured array (the controller's side and the service's side
  each keep one). :func:`join_shots` matches the two sides on the request id of a
  shot's last syndrome frame and splits every shot's reaction time into stages that
  add up exactly (both processes read the same monotonic clock).

>>> rec = ShotRecords(SERVICE_SHOT_FIELDS, capacity=2)
>>> rec.append(7, 100, 150, 150, 160, 170, 190, 1, 0, 1, 140)
>>> rec.append(8, 200, 250, 250, 260, 270, 290, 1, 0, 1, 240)
>>> rec.append(9, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0)    # past capacity: counted, not stored
>>> len(rec), rec.dropped
(2, 1)
>>> rec.array()["in_last_ns"].tolist()
[150, 250]
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "StageRecorder",
    "ShotRecords",
    "SERVICE_SHOT_FIELDS",
    "CONTROLLER_SHOT_FIELDS",
    "REACTION_STAGES",
    "REACTION_PARTS",
    "join_shots",
    "stage_summary",
    "histogram_summary",
    "record_values",
]

# Service side, one row per answered shot — or per frame of whole shots answered together,
# which share every timestamp (timestamps in ns of the shared monotonic clock).
SERVICE_SHOT_FIELDS = (
    ("last_request_id", np.int64),  # request_id of the frame that completed the shot
    ("ptp_last_ns", np.int64),  # that frame's ptp_timestamp (the controller's send time)
    ("in_last_ns", np.int64),  # that frame received by the service
    ("complete_ns", np.int64),  # shot complete, queued for decoding
    ("decode_start_ns", np.int64),
    ("decode_end_ns", np.int64),
    ("out_ns", np.int64),  # its corrections handed to the transport
    ("batch_shots", np.int64),  # shots decoded in the same decoder call
    ("status", np.int64),  # wire.Status answered
    ("shots", np.int64),  # shots the row stands for
    ("ready_ns", np.int64),  # the service back at receiving, its earlier work done, before that frame
)

# Controller side, one row per shot.
CONTROLLER_SHOT_FIELDS = (
    ("shot", np.int64),
    ("last_request_id", np.int64),
    ("emit_last_ns", np.int64),  # the cycle tick at which the last round's syndrome existed
    ("frame_due_ns", np.int64),  # the tick its last frame was due (later with several shots per frame)
    ("sent_last_ns", np.int64),  # last frame handed to the transport
    ("get_sent_ns", np.int64),  # first get_corrections sent
    ("response_ns", np.int64),  # the answer that resolved the shot received
    ("applied_ns", np.int64),  # correction XORed into the Pauli frame
    ("polls", np.int64),  # get_corrections sent for this shot
    ("status", np.int64),
    ("correct", np.int64),  # 1 when frame ^ correction matched the true observable flip
)

# The stages a shot's reaction time splits into, in order (they add up exactly).
REACTION_STAGES = ("send", "wire_in", "queue", "decode", "respond", "wire_out", "apply")
# Parts of two of them, reported beside them: the wait for a frame's later shots (part of
# send) and the wait for a service busy with earlier work (part of wire_in).
REACTION_PARTS = {"batch": "send", "ring_wait": "wire_in"}


# Below this many values, recording one by one beats a vectorised pass (numpy's fixed
# cost per call is a few microseconds).
_SHORT = 24


def _histogram_class():
    from qlink.histogram import LatencyHistogram

    return LatencyHistogram


class StageRecorder:
    """One latency histogram per stage.

    ``record`` counts one duration at once. On a hot path, :meth:`adder` and
    :meth:`extender` give bound ``list.append`` / ``list.extend`` calls that only
    park the samples (tens of ns each); they are counted, vectorised, by
    :meth:`settle` — which every query (``histogram``, ``count``, ``to_dict``,
    ``summary``) runs first, so a reader never sees a parked sample missing.

    >>> r = StageRecorder(["decode", "queue"])
    >>> for v in (1000, 2000, 3000):
    ...     r.record("decode", v)
    >>> add = r.adder("queue"); add(500); add(700)
    >>> r.count("decode"), r.count("queue")
    (3, 2)
    >>> sorted(r.to_dict())
    ['decode', 'queue']
    """

    __slots__ = ("_hists", "_pending", "_order", "_next")

    def __init__(self, stages: Iterable[str]) -> None:
        cls = _histogram_class()
        self._hists = {str(s): cls() for s in stages}
        if not self._hists:
            raise ValueError("StageRecorder needs at least one stage name")
        self._pending: dict[str, list] = {s: [] for s in self._hists}
        self._order = tuple(self._hists)
        self._next = 0

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(self._hists)

    def _known(self, stage: str) -> str:
        if stage not in self._hists:
            raise KeyError(f"unknown stage {stage!r}; stages are {sorted(self._hists)}")
        return stage

    def histogram(self, stage: str):
        """The :class:`~qlink.histogram.LatencyHistogram` of ``stage`` (parked samples counted)."""
        self._settle_stage(self._known(stage))
        return self._hists[stage]

    def adder(self, stage: str):
        """A hot-path ``add(value_ns)`` for one stage: parks the sample until :meth:`settle`."""
        return self._pending[self._known(stage)].append

    def extender(self, stage: str):
        """A hot-path ``extend(values_ns)`` (a list of ints) for one stage; see :meth:`adder`."""
        return self._pending[self._known(stage)].extend

    def _settle_stage(self, stage: str) -> None:
        pending = self._pending[stage]
        if pending:
            record_values(self._hists[stage], pending)
            pending.clear()

    def settle(self) -> None:
        """Count every parked sample into its histogram."""
        for stage in self._order:
            self._settle_stage(stage)

    def settle_some(self, *, min_pending: int = 1024) -> None:
        """Count the parked samples of at most one stage (the next in turn) once it holds
        ``min_pending``: a bounded, small piece of work a busy loop can afford each pass."""
        i = self._next
        stage = self._order[i]
        self._next = i + 1 if i + 1 < len(self._order) else 0
        if len(self._pending[stage]) >= min_pending:
            self._settle_stage(stage)

    def record(self, stage: str, value_ns: int) -> None:
        """Add one duration; negative values (clock reads out of order) are clamped to 0."""
        self._hists[stage].record(value_ns if value_ns > 0 else 0)

    def count(self, stage: str) -> int:
        return int(self.histogram(stage).count)

    def to_dict(self) -> dict:
        """``{stage: histogram.to_dict()}`` — plain data, JSON-able."""
        self.settle()
        return {name: h.to_dict() for name, h in self._hists.items()}

    def summary(self) -> dict:
        """``{stage: {n, p50_us, p99_us, p999_us, max_us}}`` of the stages that saw samples."""
        self.settle()
        return {name: histogram_summary(h) for name, h in self._hists.items() if h.count}


def record_values(hist, values) -> None:
    """Record many durations (an array or a list of ints): one by one for short ones,
    where numpy's per-call cost would exceed the values' own, else vectorised.

    >>> from qlink.histogram import LatencyHistogram
    >>> h = LatencyHistogram(); record_values(h, np.array([5, 7])); record_values(h, np.arange(1000))
    >>> h.count
    1002
    """
    if len(values) > _SHORT:
        try:
            arr = np.asarray(values, dtype=np.int64)
        except OverflowError:  # a value beyond int64 (a peer's garbage timestamp): count it one by one
            pass
        else:
            hist.record_many(arr)
            return
    rec = hist.record
    for v in (values.tolist() if isinstance(values, np.ndarray) else values):
        rec(int(v))


def histogram_summary(hist) -> dict:
    """p50/p99/p99.9/max in µs and the count of a LatencyHistogram (or its ``to_dict``)."""
    if isinstance(hist, dict):
        hist = _histogram_class().from_dict(hist)
    n = int(hist.count)
    if n == 0:
        nan = float("nan")
        return {"n": 0, "p50_us": nan, "p99_us": nan, "p999_us": nan, "max_us": nan}
    p50, p99, p999 = (float(v) for v in hist.percentiles((50.0, 99.0, 99.9)))
    return {"n": n, "p50_us": p50 / 1e3, "p99_us": p99 / 1e3, "p999_us": p999 / 1e3,
            "max_us": float(hist.max) / 1e3}


class ShotRecords:
    """A preallocated table of per-shot timestamps; rows past ``capacity`` are counted only."""

    __slots__ = ("_data", "_cols", "_n", "dropped", "capacity")

    def __init__(self, fields: Sequence[tuple[str, type]], *, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 shots, got {capacity}")
        self.capacity = int(capacity)
        self._data = np.zeros(self.capacity, dtype=np.dtype(list(fields)))
        self._cols = [self._data[name] for name, _ in fields]
        self._n = 0
        self.dropped = 0

    def append(self, *values: int) -> None:
        i = self._n
        if i >= self.capacity:
            self.dropped += 1
            return
        for col, v in zip(self._cols, values):
            col[i] = v
        self._n = i + 1

    def extend(self, num_rows: int, **columns) -> int:
        """Append ``num_rows`` rows at once: each column an array of at least that many
        values, or a scalar for all rows; rows past ``capacity`` are counted in
        ``dropped``. Returns the rows stored.

        >>> rec = ShotRecords((("a", np.int64), ("b", np.int64)), capacity=3)
        >>> rec.extend(2, a=np.array([1, 2]), b=7), rec.extend(2, a=np.array([3, 4]), b=8), rec.dropped
        (2, 1, 1)
        >>> rec.array()["b"].tolist()
        [7, 7, 8]
        """
        i = self._n
        n = max(0, min(num_rows, self.capacity - i))
        if n:
            data = self._data
            for name, v in columns.items():
                col = data[name]
                col[i:i + n] = v[:n] if isinstance(v, (np.ndarray, list)) else v
        self._n = i + n
        self.dropped += num_rows - n
        return n

    def __len__(self) -> int:
        return self._n

    def array(self) -> np.ndarray:
        """The filled rows (a view)."""
        return self._data[: self._n]

    def to_dict(self) -> dict:
        """Column lists, JSON-able."""
        a = self.array()
        return {name: a[name].tolist() for name in a.dtype.names}

    @staticmethod
    def from_dict(fields: Sequence[tuple[str, type]], data: dict) -> np.ndarray:
        """Rebuild the structured array that :meth:`to_dict` wrote."""
        names = [n for n, _ in fields]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"shot records lack columns {missing}")
        n = len(data[names[0]]) if names else 0
        out = np.zeros(n, dtype=np.dtype(list(fields)))
        for name in names:
            col = data[name]
            if len(col) != n:
                raise ValueError(f"column {name!r} has {len(col)} rows, expected {n}")
            out[name] = col
        return out


def join_shots(controller: np.ndarray, service: np.ndarray) -> dict[str, np.ndarray]:
    """Per-shot stage durations (ns) of the shots both sides recorded.

    Shots are matched on ``last_request_id`` (a service row may stand for all the shots
    of its frame); only answered shots (service status OK with a correction applied) are
    kept. The stages of :data:`REACTION_STAGES` add up to ``reaction`` (= applied −
    emitted) exactly:

    send (emitted → sent) · wire_in (sent → service received the last frame) ·
    queue (received → decode start) · decode · respond (decode end → corrections
    sent; includes waiting for the get_corrections request) · wire_out (sent →
    controller received) · apply (received → applied to the Pauli frame).

    Two of them have a part reported beside them (:data:`REACTION_PARTS`): ``batch``,
    the part of send spent waiting for the frame's later shots (emitted → the tick the
    frame was due; 0 with one shot per frame), and ``ring_wait``, the part of wire_in
    during which the service was still busy with earlier work (sent → the service back
    at receiving, when that came later): a frame waiting in the transport's buffer for
    a busy service is queueing, not transport.

    >>> c = np.zeros(1, dtype=list(CONTROLLER_SHOT_FIELDS))
    >>> s = np.zeros(1, dtype=list(SERVICE_SHOT_FIELDS))
    >>> c[0] = (0, 5, 1000, 1040, 1100, 1150, 1900, 1950, 1, 0, 1)
    >>> s[0] = (5, 1100, 1300, 1300, 1400, 1600, 1700, 1, 0, 1, 1230)
    >>> st = join_shots(c, s)
    >>> [int(st[k][0]) for k in REACTION_STAGES], int(st["reaction"][0])
    ([100, 200, 100, 200, 100, 200, 50], 950)
    >>> int(st["batch"][0]), int(st["ring_wait"][0])
    (40, 130)
    """
    c = controller[(controller["status"] == 0) & (controller["applied_ns"] > 0)]
    s = service[service["status"] == 0]
    if len(c) == 0 or len(s) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return {k: empty for k in (*REACTION_STAGES, *REACTION_PARTS, "reaction", "shot")}
    order = np.argsort(s["last_request_id"], kind="stable")
    s_sorted = s[order]
    pos = np.searchsorted(s_sorted["last_request_id"], c["last_request_id"])
    pos = np.clip(pos, 0, len(s_sorted) - 1)
    hit = s_sorted["last_request_id"][pos] == c["last_request_id"]
    c, m = c[hit], s_sorted[pos[hit]]
    out = {
        "send": c["sent_last_ns"] - c["emit_last_ns"],
        "batch": c["frame_due_ns"] - c["emit_last_ns"],
        "wire_in": m["in_last_ns"] - c["sent_last_ns"],
        # the service busy with earlier work when the frame was sent: that wait is queueing
        "ring_wait": np.clip(m["ready_ns"] - c["sent_last_ns"], 0, m["in_last_ns"] - c["sent_last_ns"]),
        "queue": m["decode_start_ns"] - m["in_last_ns"],
        "decode": m["decode_end_ns"] - m["decode_start_ns"],
        "respond": m["out_ns"] - m["decode_end_ns"],
        "wire_out": c["response_ns"] - m["out_ns"],
        "apply": c["applied_ns"] - c["response_ns"],
        "reaction": c["applied_ns"] - c["emit_last_ns"],
        "shot": c["shot"].copy(),
    }
    return {k: np.asarray(v, dtype=np.int64) for k, v in out.items()}


def stage_summary(stages: dict[str, np.ndarray]) -> dict:
    """Per stage (and part): p50 (µs) and share of the mean reaction time; shares sum to 1.

    The headline shares: ``transport`` (send + wire_in + wire_out, less their parts
    batch and ring_wait), ``queue`` (ring_wait + queue: waiting for the busy service,
    then for the decoder) and ``decode``; ``batch`` is the wait for a frame's later
    shots (0 with one shot per frame); ``other`` is the service's and controller's own
    work (respond, apply).
    """
    n = len(stages.get("reaction", ()))
    nan = float("nan")
    if n == 0:
        return {"n": 0, "stages": {},
                "shares": {"batch": nan, "transport": nan, "queue": nan, "decode": nan, "other": nan}}
    total = float(np.mean(stages["reaction"]))
    per = {}
    for k in (*REACTION_STAGES, *REACTION_PARTS):
        a = stages[k]
        per[k] = {"p50_us": float(np.percentile(a, 50)) / 1e3, "mean_us": float(np.mean(a)) / 1e3,
                  "share": float(np.mean(a)) / total if total > 0 else nan}
    shares = {
        "batch": per["batch"]["share"],
        "transport": sum(per[k]["share"] for k in ("send", "wire_in", "wire_out")) - per["batch"]["share"]
        - per["ring_wait"]["share"],
        "queue": per["ring_wait"]["share"] + per["queue"]["share"],
        "decode": per["decode"]["share"],
        "other": per["respond"]["share"] + per["apply"]["share"],
    }
    if not all(math.isfinite(v) for v in shares.values()):
        shares = {k: nan for k in shares}
    return {"n": n, "stages": per, "shares": shares}
