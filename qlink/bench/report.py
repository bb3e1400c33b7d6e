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

__all__ = ["format_table", "format_goals", "wrap", "write_results", "environment", "CONSOLE_WIDTH"]

CONSOLE_WIDTH = 100  # what a console printout fits in; the wide tables go to the JSON/CSV files


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


def _fit(widths: list[int], cells: list[list[str]], columns: list[str], movable: list[bool], max_width: int) -> None:
    """Narrow the widest movable columns (cells cut with "…") until a line fits ``max_width``."""
    while sum(widths) + 2 * (len(widths) - 1) > max_width:
        cands = [i for i, m in enumerate(movable) if m and widths[i] > max(len(columns[i]), 8)]
        if not cands:
            return
        i = max(cands, key=lambda i: widths[i])
        widths[i] -= 1
        for row in cells:
            if len(row[i]) > widths[i]:
                row[i] = row[i][:widths[i] - 1] + "…"


def format_table(rows: list[dict], *, columns: list[str] | None = None, max_width: int | None = None,
                 right: tuple = ()) -> str:
    """Align ``rows`` (dicts) into a text table; numbers, and the ``right`` columns, right-aligned.

    With ``max_width``, the widest text columns are cut (ending in "…") until every line fits.

    >>> print(format_table([{"what": "a rather long description", "us": 1.5}], max_width=14))
    what      us
    --------  ----
    a rathe…  1.50
    """
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
    numeric = [c in right or all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows)
               for c in columns]
    if max_width is not None:
        _fit(widths, cells, columns, [not n for n in numeric], max_width)
    def line(vals):
        out = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)]
        return "  ".join(out).rstrip()
    return "\n".join([line(columns), "  ".join("-" * w for w in widths), *(line(r) for r in cells)])


def wrap(text: str, *, width: int = CONSOLE_WIDTH, indent: str = "  ") -> str:
    """``text`` wrapped to ``width`` columns, continuation lines indented.

    >>> print(wrap("note: one two three four", width=14, indent="    "))
    note: one two
        three four
    """
    import textwrap

    return "\n".join(textwrap.fill(part, width=width, subsequent_indent=indent, break_on_hyphens=False,
                                   break_long_words=False) or part
                     for part in str(text).split("\n"))


def format_goals(goals: list[dict], *, value: str = "measured", target: str = "target", note: str = "floor",
                 width: int = CONSOLE_WIDTH) -> str:
    """Goals as ``met  figure  target  goal (note)``, the goal text wrapped under itself so
    that no line passes ``width`` columns.

    >>> print(format_goals([{"goal": "shm p99 <= 4.0 us and a long explanation of why that is the goal",
    ...                      "measured": 1.38, "target": 4.0, "met": True, "floor": "CPU floor 19%"}], width=60))
    met  figure  target  goal
    ---  ------  ------  ----
    yes    1.38    4.00  shm p99 <= 4.0 us and a long explanation of
                         why that is the goal (CPU floor 19%)
    """
    import textwrap

    if not goals:
        return "(no goals)"
    cells = [("" if g.get("met") is None else _fmt(bool(g.get("met"))), _fmt(g.get(value)), _fmt(g.get(target)),
              str(g.get("goal", "")) + (f" ({g[note]})" if g.get(note) else "")) for g in goals]
    w = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(("met", "figure", "target"))]
    indent = sum(w) + 2 * 3
    out = [f"{'met':<{w[0]}}  {'figure':>{w[1]}}  {'target':>{w[2]}}  goal",
           f"{'-' * w[0]}  {'-' * w[1]}  {'-' * w[2]}  ----"]
    for met, fig, tgt, text in cells:
        head = f"{met:<{w[0]}}  {fig:>{w[1]}}  {tgt:>{w[2]}}  "
        out += textwrap.wrap(text, width=width, initial_indent=head, subsequent_indent=" " * indent,
                             break_on_hyphens=False) or [head.rstrip()]
    return "\n".join(out)


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
