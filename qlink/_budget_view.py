"""The cross-domain budget rows regrouped for people: a few named figures per domain.

:func:`qlink.budget.budget_rows` gives one row per (figure, statistic, budget): the full
table, kept whole in the CSV/JSON. Readers want fewer, grouped lines: one per *thing*
(``reaction time, d=5``), carrying each transport's or link's p50 and p99 side by side
and every budget the thing is held to. :func:`group_rows` does that regrouping for the
figure (:mod:`qlink._budget_figure`) and the console summary (:mod:`qlink._budget_table`),
so both show the same lines in the same order.

>>> rows = [dict(domain="qec", what="QEC d=5 reaction time", transport="shm", basis="measured", stat=s,
...              value_us=v, budget="decoder reaction time (Willow real-time average, d=5)", budget_us=63.0,
...              share_pct=100 * v / 63, stage="") for s, v in (("p50", 20.0), ("p99", 70.0))]
>>> [line] = group_rows(rows)
>>> line.label, [(s.name, s.center_us, s.tail_us) for s in line.series], line.budgets
('reaction time, d=5', [('shm', 20.0, 70.0)], (('reaction (Willow)', 63.0),))
>>> format_us(0.4183), format_us(63.0), format_us(4157.09), format_us(497604.7)
('0.42 µs', '63 µs', '4.16 ms', '498 ms')
>>> format_share(0.05), format_share(38.02), format_share(258.4), format_share(501031.0)
('<1 %', '38 %', '2.6×', '>999×')
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

__all__ = ["Series", "ViewLine", "group_rows", "short_budget", "format_us", "format_share", "series_name", "model_label"]

# (regex on the row's "what", order within the domain, label template); a row matching none is shown under
# its own name. "reaction time, link part only" repeats the modeled round trip against another budget:
# it stays in the table files, not in the grouped view.
_QEC = re.compile(r"^QEC d=(?P<d>\d+) (?P<rest>.*)$")
_QEC_KINDS = (
    ("decode time per round", 0, "decode per round, d={d}"),
    ("time per round answered", 1, "time per round answered, d={d}"),
    ("feed-forward", 2, "feed-forward round trip, d={d}"),
    ("reaction time", 3, "reaction time, d={d}"),
)
_KV = re.compile(r"^(?P<model>\S+) (?P<kind>KV transfer|one layer's KV transfer), (?P<tok>\S+) tokens")
_SKIP = ("link part only",)

_BUDGET_SHORT = (  # prefix of Budget.name -> short label
    ("surface-code syndrome cycle", "cycle"),
    ("rounds answered per second", "cycle"),
    ("decoder reaction time", "reaction (Willow)"),
    ("feed-forward round trip", "NVQLink round trip"),
    ("time to first token", "TTFT"),
    ("time per output token", "TPOT"),
    ("KV transfer", "KV transfer"),
    ("per-layer prefill compute", "layer compute"),
)
_CENTER_STATS = ("p50", "nominal", "median run", "mean")


def short_budget(name: str) -> str:
    """A budget's short label (``"TTFT"``, ``"cycle"``…), for legends and narrow tables.

    >>> short_budget("time to first token (DistServe chatbot SLO)"), short_budget("something new")
    ('TTFT', 'something new')
    """
    for prefix, short in _BUDGET_SHORT:
        if name.startswith(prefix):
            return short
    return name if len(name) <= 18 else name[:17] + "…"


def format_us(us: float) -> str:
    """A time in µs, written with the unit that suits it and about three digits."""
    if us is None or not math.isfinite(us):
        return "—"
    for scale, unit in ((1e6, "s"), (1e3, "ms"), (1.0, "µs")):
        if abs(us) >= scale or unit == "µs":
            v = us / scale
            break
    if unit == "µs" and abs(us) < 1:
        return f"{us:.2f} µs"
    return f"{v:.3g} {unit}" if abs(v) < 1000 else f"{v:.0f} {unit}"


def format_share(pct: float) -> str:
    """A share of a budget: a percentage up to 200 %, then a multiple, capped at 999×."""
    if pct is None or not math.isfinite(pct):
        return "—"
    if pct < 1:
        return "<1 %"
    if pct < 200:
        return f"{pct:.0f} %"
    x = pct / 100
    return f"{x:.2g}×" if x < 10 else (f"{x:.0f}×" if x < 1000 else ">999×")


def model_label(name: str) -> str:
    """A model preset's display name.

    >>> model_label("llama-3-70b"), model_label("tiny")
    ('Llama-3-70B', 'tiny')
    """
    return re.sub(r"(\d)b$", r"\1B", name.replace("llama", "Llama", 1))


def series_name(row: dict) -> str:
    """What carried a figure: the transport or link, with the serving engine when a row names one."""
    engine = str(row.get("engine") or "")
    t = str(row.get("transport") or "")
    return f"{engine} {t}".strip() if engine and engine not in ("qlink", t) else t


@dataclass
class Series:
    """One transport's (measured) or link's (modeled) figure on one line."""

    name: str
    basis: str
    center_us: float = float("nan")  # p50, or the nominal / mean / median-run value
    tail_us: float = float("nan")  # p99 when measured
    center_stat: str = ""


@dataclass
class ViewLine:
    """One line of the grouped view: a thing, its series, and the budgets it is held to."""

    domain: str
    label: str
    order: tuple
    series: list = field(default_factory=list)
    budgets: tuple = ()  # ((short label, budget_us), ...), smallest first

    def series_for(self, name: str, basis: str) -> Series:
        for s in self.series:
            if s.name == name and s.basis == basis:
                return s
        s = Series(name, basis)
        self.series.append(s)
        return s


def _place(row: dict, first_seen: dict) -> tuple[str, tuple] | None:
    what = str(row.get("what", ""))
    if any(s in what for s in _SKIP):
        return None
    m = _QEC.match(what)
    if m:
        for key, order, label in _QEC_KINDS:
            if m["rest"].startswith(key):
                return label.format(d=m["d"]), (0, order, int(m["d"]))
    m = _KV.match(what)
    if m:
        model = first_seen.setdefault(("model", m["model"]), len(first_seen))
        one = m["kind"].startswith("one layer")
        label = f"{model_label(m['model'])}, {'one layer of ' if one else ''}{m['tok']} prompt"
        return label, (1, 0 if one else 1, model)
    short = re.sub(r"\s*\([^)]*\)", "", what).strip()
    short = short if len(short) <= 40 else short[:39] + "…"
    return short, (2, first_seen.setdefault(("what", short), len(first_seen)), 0)


def group_rows(rows: list[dict]) -> list[ViewLine]:
    """The rows' figures regrouped into view lines (stage rows left out), in display order:
    per domain (QEC first), by kind of figure, then by distance or model."""
    lines: dict[str, ViewLine] = {}
    budgets: dict[str, dict] = {}
    first_seen: dict = {}
    for r in rows:
        if r.get("stage"):
            continue
        v = r.get("value_us")
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            continue
        placed = _place(r, first_seen)
        if placed is None:
            continue
        label, order = placed
        line = lines.get(label)
        if line is None:
            line = lines[label] = ViewLine(domain=str(r.get("domain", "")), label=label, order=order)
            budgets[label] = {}
        s = line.series_for(series_name(r), str(r.get("basis", "")))
        stat = str(r.get("stat", ""))
        if stat == "p99":
            s.tail_us = float(v)
        elif stat in _CENTER_STATS and (not s.center_stat or
                                        _CENTER_STATS.index(stat) < _CENTER_STATS.index(s.center_stat)):
            s.center_us, s.center_stat = float(v), stat
        b_us = r.get("budget_us")
        if isinstance(b_us, (int, float)) and math.isfinite(b_us) and b_us > 0:
            budgets[label].setdefault(short_budget(str(r.get("budget", ""))), float(b_us))
    out = []
    for label, line in lines.items():
        line.series = [s for s in line.series if math.isfinite(s.center_us) or math.isfinite(s.tail_us)]
        line.budgets = tuple(sorted(budgets[label].items(), key=lambda kv: kv[1]))
        out.append(line)
    out.sort(key=lambda ln: (0 if ln.domain == "qec" else 1, ln.order))
    return out
