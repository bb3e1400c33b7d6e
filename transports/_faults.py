"""Fault injection for the emulated transport: dropped, duplicated, reordered, delayed and
corrupted messages (and puts), seeded and counted.

A :class:`FaultSpec` says what may go wrong on the messages *this side sends*; a
:class:`FaultInjector` draws, for each eligible message, at most one of *drop*, *dup*,
*reorder*, *corrupt* (one uniform draw against the cumulative probabilities, so their
sum must not exceed 1) and, independently, an extra *delay*. The draws come from a
NumPy generator seeded by ``seed``, so a run is reproducible message for message.

* **drop** -- the message never leaves (the sender believes it sent it).
* **dup** -- it leaves twice, back to back.
* **reorder** -- it is held and leaves right after the next eligible message (an
  adjacent swap); if none follows within ``hold_ns`` it leaves on its own at the next
  call on the endpoint, and at ``close()`` at the latest. The next eligible message
  passes unfaulted either way, so the faults drawn never depend on timing.
* **corrupt** -- one bit of the payload, chosen uniformly, is flipped (a copy: the
  caller's buffer is never touched). Nothing marks the message as corrupt: this models
  an error that slipped past the link's own checks and reaches the application.
* **delay** -- ``delay_ns`` is added to the message's modeled arrival time (with
  probability ``delay``, 1 by default). On an ordered link later messages queue
  behind it.

Which messages are *eligible*: those of ``min_nbytes <= size <= max_nbytes`` (so one
kind of traffic can be targeted by its size, e.g. syndrome frames but not
``get_corrections``) whose index among eligible messages lies in
``[fault_start, fault_stop)`` (a burst, or a clean tail). ``puts=False`` leaves
one-sided puts alone, ``messages=False`` two-sided messages; ``injector.enabled = False``
(``endpoint.faults_enabled``) heals the link for a while. Every fault is counted by kind, and the last ``log_capacity`` are
logged as :class:`FaultEvent` (index, kind, size, flipped bit).

In a URL: ``emulated+tcp://127.0.0.1:0?link=ib-ndr&drop=0.01&dup=0.01&reorder=0.01
&delay_ns=50000&corrupt=0.001&seed=3`` (see :data:`QUERY_KEYS`).

>>> spec = FaultSpec.from_query("drop=0.5&seed=3&min_nbytes=48")
>>> spec.drop, spec.seed, spec.min_nbytes, spec.active
(0.5, 3, 48, True)
>>> inj = FaultInjector(spec)
>>> [inj.decide(64)[0] for _ in range(6)], inj.decide(10)[0]
(['none', 'none', 'none', 'drop', 'drop', 'drop'], 'none')
>>> inj.counts["message"]["drop"], inj.eligible
(3, 6)
>>> FaultSpec(drop=0.7, dup=0.5)
Traceback (most recent call last):
...
ValueError: fault probabilities drop + dup + reorder + corrupt must not exceed 1 (one fault per message), got 1.2
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple
from urllib.parse import parse_qs, urlencode

import numpy as np

__all__ = ["FaultSpec", "FaultInjector", "FaultEvent", "FAULT_KINDS", "QUERY_KEYS", "faults_from_query"]

FAULT_KINDS = ("drop", "dup", "reorder", "corrupt", "delay")
_EXCLUSIVE = ("drop", "dup", "reorder", "corrupt")

#: URL query keys understood as faults (everything else goes to the inner transport).
QUERY_KEYS = ("drop", "dup", "reorder", "corrupt", "delay", "delay_ns", "min_nbytes", "max_nbytes",
              "fault_start", "fault_stop", "fault_puts", "fault_messages", "hold_ns", "log_capacity")
_QUERY_FIELD = {"fault_start": "start", "fault_stop": "stop", "fault_puts": "puts", "fault_messages": "messages"}
_FIELD_QUERY = {v: k for k, v in _QUERY_FIELD.items()}


class FaultEvent(NamedTuple):
    """One injected fault: ``index`` among eligible messages (or puts), ``what`` is
    ``"message"`` or ``"put"``, ``bit`` the flipped payload bit (-1 unless corrupt),
    ``delay_ns`` the extra delay (0 unless delayed)."""

    index: int
    what: str
    kind: str
    nbytes: int
    bit: int
    delay_ns: int


def _prob(name: str, v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"fault probability {name} must be a number in [0, 1], got {v!r}") from None
    if not math.isfinite(f) or not 0.0 <= f <= 1.0:
        raise ValueError(f"fault probability {name} must be a finite number in [0, 1], got {v!r}")
    return f


def _count(name: str, v, *, allow_none: bool = False, low: int = 0):
    if v is None and allow_none:
        return None
    if isinstance(v, bool):
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    if isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            raise ValueError(f"{name} must be a finite whole number >= {low}, got {v!r}")
        v = int(v)
    try:
        i = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}") from None
    if i < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    return i


@dataclass(frozen=True)
class FaultSpec:
    """What may go wrong on the messages one side sends (see the module docstring)."""

    drop: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    corrupt: float = 0.0
    delay: float = 1.0  # probability that a message gets delay_ns (only matters when delay_ns > 0)
    delay_ns: int = 0
    seed: int = 0
    min_nbytes: int = 0
    max_nbytes: int | None = None
    start: int = 0  # first eligible message index that may be faulted
    stop: int | None = None  # one past the last (None: no end)
    puts: bool = True  # one-sided puts are subject to faults too
    messages: bool = True  # two-sided messages are subject to faults
    hold_ns: int = 20_000_000  # a reordered message with nothing after it leaves after this long
    log_capacity: int = 4096

    def __post_init__(self):
        for name in ("drop", "dup", "reorder", "corrupt", "delay"):
            object.__setattr__(self, name, _prob(name, getattr(self, name)))
        total = sum(getattr(self, k) for k in _EXCLUSIVE)
        if total > 1.0 + 1e-12:
            raise ValueError("fault probabilities drop + dup + reorder + corrupt must not exceed 1 "
                             f"(one fault per message), got {total:.6g}")
        for name in ("delay_ns", "seed", "min_nbytes", "start", "hold_ns", "log_capacity"):
            object.__setattr__(self, name, _count(name, getattr(self, name)))
        for name in ("max_nbytes", "stop"):
            object.__setattr__(self, name, _count(name, getattr(self, name), allow_none=True))
        if self.max_nbytes is not None and self.max_nbytes < self.min_nbytes:
            raise ValueError(f"max_nbytes={self.max_nbytes} is below min_nbytes={self.min_nbytes}: no message "
                             "would be eligible")
        if self.stop is not None and self.stop < self.start:
            raise ValueError(f"fault window [start={self.start}, stop={self.stop}) is empty")
        for name in ("puts", "messages"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def active(self) -> bool:
        """True when any fault can happen at all."""
        return any(getattr(self, k) > 0 for k in _EXCLUSIVE) or (self.delay_ns > 0 and self.delay > 0)

    @property
    def may_lose(self) -> bool:
        """Messages may go missing or arrive damaged (the link is no longer ``reliable``)."""
        return self.drop > 0 or self.corrupt > 0

    @property
    def may_reorder(self) -> bool:
        return self.reorder > 0 or self.dup > 0

    # ----- URL form -------------------------------------------------------------
    @classmethod
    def from_query(cls, query: str | dict) -> "FaultSpec":
        """Parse ``drop=0.01&dup=...`` (or a parse_qs dict); unknown keys are a ValueError."""
        q = parse_qs(query, keep_blank_values=True) if isinstance(query, str) else dict(query)
        known = set(QUERY_KEYS) | {"seed"}
        unknown = set(q) - known
        if unknown:
            raise ValueError(f"unknown fault option(s) {sorted(unknown)}; known: {sorted(known)}")
        kw = {}
        for k, v in q.items():
            v = v[-1] if isinstance(v, list) else v
            name = _QUERY_FIELD.get(k, k)
            if name in ("puts", "messages"):
                if str(v).lower() not in ("0", "1", "true", "false"):
                    raise ValueError(f"{k} must be 0/1/true/false, got {v!r}")
                kw[name] = str(v).lower() in ("1", "true")
            elif name in ("drop", "dup", "reorder", "corrupt", "delay"):
                kw[name] = v
            else:
                kw[name] = _count(k, _num(k, v), low=0)
        return cls(**kw)

    def to_query(self) -> str:
        """The non-default fields as a URL query (``from_query`` reads it back).

        >>> FaultSpec(drop=0.01, seed=3).to_query()
        'drop=0.01&seed=3'
        """
        default = FaultSpec()
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v != getattr(default, f.name):
                out[_FIELD_QUERY.get(f.name, f.name)] = (int(v) if isinstance(v, bool) else v)
        return urlencode(out)

    def as_dict(self) -> dict:
        return asdict(self)


def _num(name: str, v):
    if isinstance(v, (int, float)):
        return v
    try:
        return int(str(v))
    except ValueError:
        pass
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"fault option {name} must be a number, got {v!r}") from None


def faults_from_query(query: dict) -> FaultSpec | None:
    """Pop the fault keys out of a ``parse_qs`` dict (in place); a FaultSpec if any was there."""
    picked = {k: query.pop(k) for k in list(query) if k in QUERY_KEYS}
    if not picked:
        return None
    seed = query.get("seed")
    if seed is not None:
        picked["seed"] = seed
    return FaultSpec.from_query(picked)


class FaultInjector:
    """Draws and counts the faults of one side (see the module docstring).

    ``decide(nbytes, what="message")`` returns ``(kind, delay_ns, bit)`` where kind is
    ``"none"``, ``"drop"``, ``"dup"``, ``"reorder"`` or ``"corrupt"`` and ``bit`` the
    payload bit to flip (-1 unless corrupt).
    """

    def __init__(self, spec: FaultSpec, *, extra_drop: float = 0.0, stream: int = 0):
        if not isinstance(spec, FaultSpec):
            raise TypeError(f"faults must be a FaultSpec, got {type(spec).__name__}")
        self.spec = spec
        # a link model's own loss is a drop probability too (combined with the spec's)
        drop = 1.0 - (1.0 - spec.drop) * (1.0 - _prob("link loss", extra_drop))
        self._cum = np.cumsum([drop, spec.dup, spec.reorder, spec.corrupt])
        self._rng = np.random.default_rng([spec.seed, 0xFA17, stream])
        self._delay_on = spec.delay_ns > 0 and spec.delay > 0
        self.counts = {"message": dict.fromkeys(FAULT_KINDS, 0), "put": dict.fromkeys(FAULT_KINDS, 0)}
        self.eligible = 0  # eligible messages seen
        self.eligible_puts = 0
        # reordered messages / puts that left on their own after hold_ns (nothing overtook them)
        self.reorders_expired = {"message": 0, "put": 0}
        self.log: deque[FaultEvent] = deque(maxlen=spec.log_capacity)
        self.enabled = True  # False: nothing is faulted (nor counted as eligible) until set again

    def applies_to(self, what: str) -> bool:
        """Whether messages (``"message"``) or puts (``"put"``) are subject to faults right now."""
        return self.enabled and (self.spec.puts if what == "put" else self.spec.messages)

    def eligible_size(self, nbytes: int) -> bool:
        s = self.spec
        return nbytes >= s.min_nbytes and (s.max_nbytes is None or nbytes <= s.max_nbytes)

    def decide(self, nbytes: int, *, what: str = "message") -> tuple[str, int, int]:
        s = self.spec
        if not self.applies_to(what) or not self.eligible_size(nbytes):
            return "none", 0, -1
        if what == "put":
            index = self.eligible_puts
            self.eligible_puts += 1
        else:
            index = self.eligible
            self.eligible += 1
        if index < s.start or (s.stop is not None and index >= s.stop):
            return "none", 0, -1
        u = self._rng.random()
        k = int(np.searchsorted(self._cum, u, side="right"))
        kind = _EXCLUSIVE[k] if k < len(_EXCLUSIVE) else "none"
        bit = -1
        if kind == "corrupt":
            if nbytes == 0:
                kind = "none"  # nothing to flip in an empty message
            else:
                bit = int(self._rng.integers(0, 8 * nbytes))
        delay = 0
        if self._delay_on and kind != "drop" and (s.delay >= 1.0 or self._rng.random() < s.delay):
            delay = s.delay_ns
        counts = self.counts[what]
        if kind != "none":
            counts[kind] += 1
            self.log.append(FaultEvent(index, what, kind, nbytes, bit, delay))
        if delay:
            counts["delay"] += 1
            if kind == "none":
                self.log.append(FaultEvent(index, what, "delay", nbytes, -1, delay))
        return kind, delay, bit

    def statistics(self) -> dict:
        """Injected counts by kind, for messages and for puts, and how many were eligible."""
        return {"faults": dict(self.counts["message"]), "put_faults": dict(self.counts["put"]),
                "fault_eligible_messages": self.eligible, "fault_eligible_puts": self.eligible_puts,
                "reorders_expired": self.reorders_expired["message"],
                "put_reorders_expired": self.reorders_expired["put"]}


def flip_bit(data, bit: int) -> bytearray:
    """A copy of ``data`` with payload bit ``bit`` (LSB-first within each byte) flipped.

    >>> bytes(flip_bit(b"\\x00\\x00", 9))
    b'\\x00\\x02'
    """
    out = bytearray(memoryview(data).cast("B"))
    out[bit >> 3] ^= 1 << (bit & 7)
    return out
