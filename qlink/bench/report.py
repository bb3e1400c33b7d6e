"""Writing benchmark results: JSON + CSV side by side, and a plain-text table.

>>> rows = [{"case": "shm", "p50_us": 0.81}, {"case": "tcp", "p50_us": 61.0, "note": "loopback"}]
>>> print(format_table(rows))
case  p50_us  note
----  ------  --------
shm     0.81
tcp    61.00  loopback
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

__all__ = ["format_table", "write_results", "environment"]


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-2):
            return f"{v:.3g}"
        return f"{v:.2f}"
    return str(v)


def format_table(rows: list[dict], *, columns: list[str] | None = None) -> str:
    """Align ``rows`` (dicts) into a text table; numbers right-aligned."""
    if not rows:
        return "(no rows)"
    if columns is None:
        columns = []
        for r in rows:
            for k in r:
                if k not in columns:
                    columns.append(k)
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in columns]
    def line(vals):
        out = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)]
        return "  ".join(out).rstrip()
    return "\n".join([line(columns), "  ".join("-" * w for w in widths), *(line(r) for r in cells)])


def environment() -> dict:
    """Facts about the machine a result was measured on (for the JSON header)."""
    from .conditions import host_facts

    host = host_facts()
    return {
        "python": host["python"],
        "platform": host["platform"],
        "cpu": host["cpu_model"],
        "num_cpus": host["num_cpus"],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_results(rows: list[dict], *, out_dir, name: str, meta: dict | None = None,
                  conditions=None) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>.json`` (rows + environment + conditions + meta) and ``<name>.csv``.

    ``conditions`` (a :class:`qlink.bench.conditions.RunConditions`; default: the current
    run's, measured now if no command began one) goes into the JSON as ``conditions`` and
    into every CSV row as the ``host_cpu``, ``host_cpus``, ``load_before_1m``,
    ``load_after_1m``, ``cpu_floor_pct`` and ``run_busy`` columns (after the row's own).
    """
    from .conditions import current, load_average

    cond = conditions if conditions is not None else current()
    after = load_average()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath, cpath = out / f"{name}.json", out / f"{name}.csv"
    with open(jpath, "w") as f:
        json.dump({"name": name, "environment": environment(), "conditions": cond.as_dict(load_after=after),
                   "meta": meta or {}, "rows": rows}, f, indent=2, default=str)
    extra = cond.csv_columns(load_after=after)
    columns: list[str] = []
    for r in rows:
        for k in r:
            if k not in columns:
                columns.append(k)
    columns += [k for k in extra if k not in columns]
    with open(cpath, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({**extra, **r})
    return jpath, cpath
