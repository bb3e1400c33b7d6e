"""The conditions a run was measured under: host, load before and after, CPU floor.

Latency figures on a shared machine swing by large factors with the load of the host,
so every result file carries the conditions of the run that produced it:

* ``host``: CPU model, logical CPUs, the CPUs this process may use, Python, platform;
* ``load_before`` / ``load_after``: the 1, 5 and 15-minute load averages when the run
  started and when the result was written;
* ``cpu_floor``: :func:`qlink.bench.floor.cpu_availability` measured at the start of
  the run (two pinned clock-reading processes for ~0.3 s): the share of wall time a
  busy process really ran. On idle dedicated cores it is close to 100 %.

A floor under :data:`BUSY_FLOOR_PCT` means the host is busy: :func:`begin` prints one
warning line, and the conditions say ``busy: true`` so nobody mistakes a loaded run
for a figure.

A command calls :func:`begin` once before it measures; :func:`qlink.bench.report.write_results`
then stamps :func:`current` into every JSON (``conditions``) and CSV (``host_*``,
``load_*``, ``cpu_floor_pct`` columns). Where no command called :func:`begin`, the first
result written measures the conditions then.

>>> c = RunConditions(host={"cpu_model": "x", "num_cpus": 2, "usable_cpus": 2},
...                   load_before=(1.0, 0.5, 0.2), cpu_floor={"ran_share": 0.62, "held_off_per_s": 80.0})
>>> c.busy, round(c.floor_pct, 1)
(True, 62.0)
>>> print(c.warning())
warning: the host is busy: a busy process got 62 % of a core (floor under 90 %), load 1.00 on 2 CPUs; figures from this run are not comparable with an idle host's
>>> sorted(c.csv_columns(load_after=(1.5, 0.6, 0.2)))
['cpu_floor_pct', 'host_cpu', 'host_cpus', 'load_after_1m', 'load_before_1m', 'run_busy']
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass, field

__all__ = ["RunConditions", "BUSY_FLOOR_PCT", "host_facts", "load_average", "measure", "begin", "current",
           "reset"]

BUSY_FLOOR_PCT = 90.0
_FLOOR_S = 0.3


def host_facts() -> dict:
    """CPU model, logical CPUs, usable CPUs, Python and platform of this host.

    >>> h = host_facts()
    >>> h["num_cpus"] >= 1 and h["usable_cpus"] >= 1
    True
    """
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    return {"cpu_model": cpu or "unknown", "num_cpus": os.cpu_count() or 1, "usable_cpus": usable,
            "python": sys.version.split()[0], "platform": platform.platform()}


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15-minute load averages (NaNs where the OS has none)."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (OSError, AttributeError):
        return (float("nan"),) * 3


@dataclass(frozen=True)
class RunConditions:
    """What a run was measured under (see the module docstring)."""

    host: dict
    load_before: tuple[float, float, float]
    cpu_floor: dict | None = None  # cpu_availability's summary; None when it could not be measured
    started_utc: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    floor_error: str | None = None

    @property
    def floor_pct(self) -> float:
        """Share of wall time a busy process got, in percent (NaN when not measured)."""
        return 100.0 * self.cpu_floor["ran_share"] if self.cpu_floor else float("nan")

    @property
    def busy(self) -> bool:
        """True when the measured floor is under :data:`BUSY_FLOOR_PCT`."""
        return bool(self.cpu_floor) and self.floor_pct < BUSY_FLOOR_PCT

    def warning(self) -> str | None:
        """One line saying the host is busy, or None."""
        if not self.busy:
            return None
        return (f"warning: the host is busy: a busy process got {self.floor_pct:.0f} % of a core (floor under "
                f"{BUSY_FLOOR_PCT:.0f} %), load {self.load_before[0]:.2f} on {self.host.get('usable_cpus')} CPUs; "
                f"figures from this run are not comparable with an idle host's")

    def summary(self) -> str:
        """One line for the console: CPU, load before and now, floor.

        >>> RunConditions(host={"cpu_model": "x", "usable_cpus": 2}, load_before=(0.5, 0.4, 0.3),
        ...               cpu_floor={"ran_share": 0.99}).summary().startswith("conditions: x, 2 CPUs; load 0.50 at start")
        True
        """
        floor = f"{self.floor_pct:.0f} %" if self.cpu_floor else f"not measured ({self.floor_error})"
        now = load_average()[0]
        return (f"conditions: {self.host.get('cpu_model')}, {self.host.get('usable_cpus')} CPUs; load "
                f"{self.load_before[0]:.2f} at start, {now:.2f} at the end; CPU floor {floor}"
                f"{' (BUSY: figures not comparable)' if self.busy else ''}")

    def as_dict(self, *, load_after: tuple | None = None) -> dict:
        """The JSON form; ``load_after`` defaults to the load now."""
        after = tuple(load_after) if load_after is not None else load_average()
        return {"host": dict(self.host), "started_utc": self.started_utc, "load_before": list(self.load_before),
                "load_after": list(after), "cpu_floor_pct": None if not self.cpu_floor else round(self.floor_pct, 1),
                "cpu_floor": self.cpu_floor, "cpu_floor_error": self.floor_error,
                "busy_floor_pct": BUSY_FLOOR_PCT, "busy": self.busy, "warning": self.warning()}

    def csv_columns(self, *, load_after: tuple | None = None) -> dict:
        """The flat columns appended to every CSV row."""
        after = tuple(load_after) if load_after is not None else load_average()
        return {"host_cpu": self.host.get("cpu_model"), "host_cpus": self.host.get("usable_cpus"),
                "load_before_1m": self.load_before[0], "load_after_1m": after[0],
                "cpu_floor_pct": None if not self.cpu_floor else round(self.floor_pct, 1), "run_busy": self.busy}


def measure(*, floor_s: float = _FLOOR_S, floor: bool = True) -> RunConditions:
    """Measure the conditions now: host facts, load, and (unless ``floor=False``) the CPU floor."""
    load = load_average()
    cpu_floor, err = None, None
    if floor:
        try:
            from .floor import cpu_availability

            sides = 2 if (os.cpu_count() or 1) >= 2 else 1
            a = cpu_availability(duration_s=floor_s, sides=sides)
            cpu_floor = {"ran_share": round(a["ran_share"], 4), "held_off_per_s": round(a["held_off_per_s"], 1),
                         "longest_gap_us": round(a["longest_gap_us"], 1), "duration_s": floor_s, "sides": sides}
        except Exception as e:  # the result still carries host and load
            err = f"{type(e).__name__}: {e}"
    return RunConditions(host=host_facts(), load_before=load, cpu_floor=cpu_floor, floor_error=err)


_current: RunConditions | None = None


def begin(*, floor_s: float = _FLOOR_S, floor: bool = True, warn=None) -> RunConditions:
    """Measure the conditions at the start of a run and make them :func:`current`.

    When the host is busy, ``warn`` (default: print to stderr) gets one warning line.
    """
    global _current
    _current = measure(floor_s=floor_s, floor=floor)
    w = _current.warning()
    if w:
        (warn or (lambda m: print(m, file=sys.stderr, flush=True)))(w)
    return _current


def current(*, measure_if_missing: bool = True) -> RunConditions | None:
    """The conditions of the run in progress (measured now by :func:`begin`, once, if none was begun)."""
    if _current is None and measure_if_missing:
        return begin()
    return _current


def reset() -> None:
    """Forget the current run's conditions (the next :func:`current` measures again)."""
    global _current
    _current = None
