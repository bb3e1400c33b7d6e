"""Decoder service times per batch size: measured from a real decoder, or stated outright.

A decoder call on a batch of ``k`` shots takes a time drawn from
:class:`ServiceTimes`: for each measured batch size the sorted call times (ns); a
batch size between two measured ones takes the same quantile of both and
interpolates linearly in ``k``; past the largest it extrapolates with the per-shot
slope of the two largest (never below the largest's time); below the smallest it
takes the smallest's.

:func:`measure_service_times` times the call the decoder service makes
(``decode_shots_bit_packed`` on a contiguous slice of bit-packed shots) on shots
sampled from the same surface-code memory the loop plays, and records what was
measured, on which machine, and when, in ``source``.

>>> st = ServiceTimes.linear(fixed_ns=5_000, per_shot_ns=700)
>>> st.sample_ns(1, 0.5), st.sample_ns(64, 0.5), st.per_shot_ns(64)
(5700.0, 49800.0, 778.125)
>>> ServiceTimes.constant(2_000).sample_ns(300, 0.9)
2000.0
>>> st = ServiceTimes({1: [4_000, 6_000], 4: [8_000, 12_000]}, source={"kind": "measured"})
>>> st.sample_ns(2, 0.0), st.sample_ns(2, 0.99), st.sample_ns(8, 0.0)
(5333.333333333333, 8000.0, 13333.333333333332)
"""

from __future__ import annotations

import bisect
import gc
import platform
import time
from typing import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["ServiceTimes", "measure_service_times"]


class ServiceTimes:
    """Decode time of one decoder call, per batch size (shots per call), as sorted samples."""

    __slots__ = ("batch_sizes", "_samples", "source", "_lists", "_n", "_pos")

    def __init__(self, samples_by_batch: Mapping[int, Iterable[float]], *, source: dict | None = None) -> None:
        if not isinstance(samples_by_batch, Mapping) or not samples_by_batch:
            raise ValueError("ServiceTimes needs a non-empty {batch_size: [call times in ns]} mapping")
        sizes = sorted(samples_by_batch)
        samples = []
        for k in sizes:
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
                raise ValueError(f"batch sizes must be integers >= 1, got {k!r}")
            a = np.sort(np.asarray(list(samples_by_batch[k]), dtype=np.float64).ravel())
            if a.size == 0 or not np.isfinite(a).all() or a[0] < 0:
                raise ValueError(f"batch size {k}: need at least one finite call time >= 0 ns, got {a.tolist()[:5]}")
            a.flags.writeable = False
            samples.append(a)
        self.batch_sizes = tuple(int(k) for k in sizes)
        self._samples = tuple(samples)
        self.source = dict(source or {"kind": "unspecified"})
        self._lists = [a.tolist() for a in samples]  # scalar draws index Python lists (faster)
        self._n = [a.size for a in samples]
        self._pos = {k: i for i, k in enumerate(self.batch_sizes)}

    # -------------------------------------------------------------- constructors
    @classmethod
    def constant(cls, call_ns: float, *, note: str = "") -> "ServiceTimes":
        """Every call takes ``call_ns`` whatever its batch (an assumption, not a measurement)."""
        return cls({1: [call_ns], 2: [call_ns]}, source={"kind": "assumed", "model": "constant",
                                                          "call_ns": float(call_ns), "note": note})

    @classmethod
    def linear(cls, *, fixed_ns: float, per_shot_ns: float, note: str = "") -> "ServiceTimes":
        """A call on ``k`` shots takes ``fixed_ns + k * per_shot_ns`` (an assumption)."""
        return cls({1: [fixed_ns + per_shot_ns], 2: [fixed_ns + 2 * per_shot_ns]},
                   source={"kind": "assumed", "model": "linear", "fixed_ns": float(fixed_ns),
                           "per_shot_ns": float(per_shot_ns), "note": note})

    # -------------------------------------------------------------- draws
    def samples_ns(self, batch: int) -> np.ndarray:
        """The measured call times of batch size ``batch`` (sorted, read-only)."""
        try:
            return self._samples[self._pos[batch]]
        except KeyError:
            raise ValueError(f"batch size {batch} was not measured; measured: {list(self.batch_sizes)}") from None

    def _q(self, i: int, u: float) -> float:
        n = self._n[i]
        j = int(u * n)
        return self._lists[i][j if j < n else n - 1]

    def sample_ns(self, batch: int, u: float) -> float:
        """The call time of a ``batch``-shot call at quantile ``u`` in [0, 1)."""
        pos = self._pos.get(batch)
        if pos is not None:
            return self._q(pos, u)
        sizes = self.batch_sizes
        j = bisect.bisect_left(sizes, batch)
        if j == 0:
            return self._q(0, u)
        if j == len(sizes):
            last = len(sizes) - 1
            q_last = self._q(last, u)
            if last == 0:
                return q_last * batch / sizes[0]
            q_prev = self._q(last - 1, u)
            slope = max(0.0, (q_last - q_prev) / (sizes[last] - sizes[last - 1]))
            return q_last + (batch - sizes[last]) * slope
        k0, k1 = sizes[j - 1], sizes[j]
        q0, q1 = self._q(j - 1, u), self._q(j, u)
        return q0 + (batch - k0) * (q1 - q0) / (k1 - k0)

    def median_ns(self, batch: int) -> float:
        return self.sample_ns(batch, 0.5)

    def per_shot_ns(self, batch: int) -> float:
        """Median call time per shot of a ``batch``-shot call."""
        return self.median_ns(batch) / batch

    def best_per_shot_ns(self, max_batch: int) -> tuple[float, int]:
        """The lowest median time per shot over batch sizes up to ``max_batch``, and that size."""
        cands = sorted({b for b in self.batch_sizes if b <= max_batch} | {1, int(max_batch)})
        return min((self.per_shot_ns(b), b) for b in cands)

    # -------------------------------------------------------------- records
    def describe(self) -> dict:
        """What these times are (``source``) and their medians per batch size, JSON-able."""
        return {"source": dict(self.source),
                "median_ns_by_batch": {str(k): self.median_ns(k) for k in self.batch_sizes}}

    def to_dict(self) -> dict:
        return {"format": "qlink.fabric.ServiceTimes/1", "source": dict(self.source),
                "samples_ns": {str(k): a.tolist() for k, a in zip(self.batch_sizes, self._samples)}}

    @classmethod
    def from_dict(cls, data: Mapping) -> "ServiceTimes":
        """Rebuild from :meth:`to_dict` output.

        >>> st = ServiceTimes.linear(fixed_ns=10, per_shot_ns=1)
        >>> ServiceTimes.from_dict(st.to_dict()).sample_ns(10, 0.5)
        20.0
        """
        if not isinstance(data, Mapping) or data.get("format") != "qlink.fabric.ServiceTimes/1":
            raise ValueError("not a ServiceTimes dict (expected format 'qlink.fabric.ServiceTimes/1')")
        return cls({int(k): v for k, v in data["samples_ns"].items()}, source=dict(data.get("source", {})))

    def __repr__(self) -> str:
        kind = self.source.get("kind", "?")
        return f"ServiceTimes({kind}, batch_sizes={list(self.batch_sizes)})"


def _environment() -> dict:
    from qlink.bench.report import environment

    env = environment()
    env["host"] = platform.node()
    return env


def measure_service_times(distance: int, p: float, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                          *, rounds: int | None = None, decoder: str = "pymatching", repeats: int = 40,
                          seed: int = 0, code: str = "surface_code:rotated_memory_z") -> ServiceTimes:
    """Time ``decoder``'s ``decode_shots_bit_packed`` per batch size on sampled shots.

    Shots come from the rotated surface-code memory (``distance``, ``rounds``
    (default ``distance``), circuit noise ``p``) that :func:`qlink.qec.loop.build_source`
    builds for the loop; each of ``repeats`` rounds times every batch size once on a
    fresh contiguous slice of shots (sizes interleaved, so machine noise spreads over
    all of them), after three untimed warm-up calls, with the garbage collector off.

    >>> st = measure_service_times(3, 0.001, (1, 8), repeats=3)
    >>> st.batch_sizes, st.source["kind"], st.source["decoder"], len(st.samples_ns(8))
    ((1, 8), 'measured', 'pymatching', 3)
    """
    from qlink.qec.decoders import compile_decoder
    from qlink.qec.loop import build_source, source_spec

    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes must be integers >= 1, got {list(batch_sizes)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    spec = source_spec(distance=distance, rounds=rounds, p=p, code=code)
    src = build_source(spec)
    pool = max(4 * sizes[-1], 1024)
    dets, _ = src.sample(pool, seed=seed)
    packed = np.ascontiguousarray(np.packbits(dets, axis=1, bitorder="little"))
    compiled = compile_decoder(decoder, src.dem)
    for _ in range(3):
        compiled.decode_shots_bit_packed(packed[: sizes[-1]])
    times: dict[int, list[float]] = {k: [] for k in sizes}
    clock = time.perf_counter_ns
    offset = 0
    gc_was_on = gc.isenabled()
    gc.disable()  # as timeit does: a collector pause is not the decoder's time
    try:
        for _ in range(repeats):
            for k in sizes:
                if offset + k > pool:
                    offset = 0
                batch = packed[offset:offset + k]
                t0 = clock()
                compiled.decode_shots_bit_packed(batch)
                times[k].append(float(clock() - t0))
                offset += k
    finally:
        if gc_was_on:
            gc.enable()
    source = {"kind": "measured", "decoder": decoder, "call": "decode_shots_bit_packed", "code": code,
              "distance": int(distance), "rounds": int(spec["rounds"]), "p": float(p),
              "num_detectors": int(src.dem.num_detectors), "repeats": int(repeats), "seed": int(seed),
              **_environment()}
    return ServiceTimes(times, source=source)

