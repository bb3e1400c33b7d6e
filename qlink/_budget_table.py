"""The cross-domain console summary: the grouped view of the budget rows in at most 100 columns.

The full table (one row per figure, statistic and budget, every number) goes to
``cross_domain.csv``/``.json``; the console gets :func:`summary_text`: per domain, the
figures measured here, then those modeled from the link catalog, one line per transport
or link with its p50, p99, budget and share of the budget (a multiple past 200 %),
then one line per measured timeline saying which stages its time goes to.

>>> from qlink.budget import BUDGETS, Figure, assess, budget_rows
>>> rows = budget_rows([assess(Figure("QEC d=5 reaction time", v, "measured", "shm", s), BUDGETS["qec.reaction"])
...                     for s, v in (("p50", 3_340), ("p99", 24_680))])
>>> print(summary_text(rows))
QEC — measured here
figure              via      p50      p99  budget          share
------------------  ---  -------  -------  --------------  -----
reaction time, d=5  shm  3.34 µs  24.7 µs  reaction 63 µs    5 %
"""

from __future__ import annotations

import math

from ._budget_view import format_share, format_us, group_rows, model_label
from .bench.report import CONSOLE_WIDTH as WIDTH
from .bench.report import format_table, wrap

__all__ = ["summary_text", "stage_summary"]

_DOMAINS = {"qec": "QEC", "ai": "LLM serving"}
_TABLE_BUDGET = {"reaction (Willow)": "reaction", "KV transfer": "KV", "NVQLink round trip": "NVQLink RT"}


def _budget_cell(budgets) -> str:
    return " · ".join(f"{_TABLE_BUDGET.get(n, n)} {format_us(b)}" for n, b in budgets)


def summary_text(rows: list[dict], *, width: int = WIDTH) -> str:
    """The grouped budget summary of ``rows`` (:func:`qlink.budget.budget_rows`), ``width`` columns at most."""
    lines = group_rows(rows)
    blocks = []
    domains = list(dict.fromkeys(ln.domain for ln in lines))
    for dom in domains:
        for basis, heading in (("measured", "measured here"), ("modeled", "modeled from the link catalog")):
            table = []
            for ln in (x for x in lines if x.domain == dom):
                series = [s for s in ln.series if (s.basis == "measured") == (basis == "measured")]
                for k, s in enumerate(series):
                    center = s.center_us if math.isfinite(s.center_us) else s.tail_us
                    shares = " · ".join(format_share(100 * center / b) for _, b in ln.budgets)
                    table.append({"figure": ln.label if k == 0 else "", "via": s.name,
                                  "p50": format_us(s.center_us) if s.center_stat != "mean" else
                                  f"{format_us(s.center_us)}*",
                                  "p99": format_us(s.tail_us) if math.isfinite(s.tail_us) else "",
                                  "budget": _budget_cell(ln.budgets) if k == 0 else "", "share": shares})
            if table:
                title = f"{_DOMAINS.get(dom, dom)} — {heading}"
                blocks.append(title + "\n" + format_table(table, columns=["figure", "via", "p50", "p99", "budget",
                                                                           "share"], max_width=width,
                                                           right=("p50", "p99", "share")))
    if any(s.center_stat == "mean" for ln in lines for s in ln.series):
        blocks.append("* a mean (the time per round answered: 1 / rounds answered per second)")
    return "\n\n".join(blocks)


def _timeline_label(what: str) -> str:
    """``"QEC d=5 reaction time"`` -> ``"reaction time, d=5"``; a KV transfer -> its model and prompt."""
    import re

    m = re.match(r"^QEC d=(\d+) (.*)$", what)
    if m:
        return f"{m[2]}, d={m[1]}"
    m = re.match(r"^(\S+) KV transfer, (\S+) tokens$", what)
    if m:
        return f"{model_label(m[1])}, {m[2]} prompt"
    return what


def stage_summary(rows: list[dict], *, width: int = WIDTH, top: int = 3) -> str:
    """One line per measured timeline: its total and the ``top`` stages it spends most in.

    >>> from qlink.budget import BUDGETS, Figure, stage_lines, budget_rows
    >>> st = {k: Figure(f"QEC d=5 reaction time, stage {k}", v, "measured", "shm", "mean") for k, v in (("wire_in", 6_000), ("decode", 3_000),
    ...                                                              ("apply", 500), ("send", 500))}
    >>> print(stage_summary(budget_rows(stage_lines(st, BUDGETS["qec.reaction"], total_what="QEC d=5 reaction time,"
    ...                                                                                     " sum of stages")), top=2))
    reaction time, d=5 · shm: mean 10 µs, 16 % of its budget: wire_in 60 %, decode 30 %, rest 10 %
    """
    groups: dict = {}
    for r in rows:
        if r.get("stage") and r.get("basis") == "measured":
            what = str(r["what"]).split(", stage")[0].split(", sum of stages")[0]
            groups.setdefault((what, r["transport"]), []).append(r)
    out = []
    for (what, transport), rs in groups.items():
        total = next((r for r in rs if r["stage"] == "total"), None)
        parts = sorted((r for r in rs if r["stage"] != "total"), key=lambda r: -r["value_us"])
        if total is None or not parts or total["value_us"] <= 0:
            continue
        shown = [f"{r['stage']} {100 * r['value_us'] / total['value_us']:.0f} %" for r in parts[:top]]
        rest = sum(r["value_us"] for r in parts[top:])
        if rest > 0:
            shown.append(f"rest {100 * rest / total['value_us']:.0f} %")
        stat = str(total.get("stat", "")).replace("median run", "median")
        line = (f"{_timeline_label(what)} · {transport}: {stat} {format_us(total['value_us'])}, "
                f"{format_share(total['share_pct'])} of its budget: {', '.join(shown)}")
        out.append(wrap(line, width=width, indent="    "))
    return "\n".join(out)
