"""The cross-domain figure: QEC and LLM-serving latencies against their budgets on one time axis.

One log time axis from a tenth of a microsecond to seconds, three parts stacked on it:

* a strip with the budgets of both domains (syndrome cycle, NVQLink round trip, Willow's
  reaction time; KV transfer, TPOT, TTFT), so the orders of magnitude between the two
  domains are the first thing a reader sees;
* the QEC lines and the LLM-serving lines (:func:`qlink._budget_view.group_rows`: one line
  per figure, e.g. ``reaction time, d=5``), each with its own budget as a black tick;
  measured figures are filled markers coloured by transport, modeled ones hollow grey
  markers shaped by link; a line from the p50 marker reaches the p99;
* one legend under it all.

``stages=True`` adds a panel of the measured per-stage means as a share of their budget.
The figure is built without pyplot (no backend switch under a notebook).

>>> from qlink.budget import BUDGETS, Figure, assess, budget_rows
>>> rows = budget_rows([assess(Figure("QEC d=5 reaction time", 20_000, "measured", "shm", "p50"),
...                            BUDGETS["qec.reaction"]),
...                     assess(Figure("llama-3-8b KV transfer, 4k tokens", 60e6, "modeled", "ib-ndr", "nominal"),
...                            BUDGETS["ai.kv_transfer"])])
>>> fig = fig_cross_domain(rows)
>>> [ax.get_title(loc="left").split(" — ")[0] for ax in fig.axes[1:3]]
['Quantum error correction', 'LLM serving']
"""

from __future__ import annotations

import math

import numpy as np

from ._budget_view import format_us, group_rows, short_budget

__all__ = ["fig_cross_domain", "TRANSPORT_COLORS", "LINK_MARKERS"]

TRANSPORT_COLORS = {"shm": "#1f77b4", "tcp": "#ff7f0e", "ucx": "#2ca02c", "nixl": "#9467bd", "inproc": "#8c564b",
                    "cuda_ipc": "#17becf"}
_MORE_COLORS = ("#e377c2", "#bcbd22", "#7f7f7f", "#d62728", "#17becf")
LINK_MARKERS = {"nvqlink": "D", "nvlink4": "s", "pcie5-x16": "^", "ib-ndr": "v", "roce-400g": "o"}
_MORE_MARKERS = ("P", "X", "h", "<", ">")
_X_MIN_US, _X_MAX_US = 0.1, 2e6
_PANEL_TITLES = {"qec": "Quantum error correction — surface-code memory, decoded through the wire",
                 "ai": "LLM serving — KV cache of one prompt, prefill → decode"}
_STAGE_COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
                 "#bab0ac")


def _decade_label(us: float) -> str:
    """``0.1`` -> ``"100 ns"``, ``1e6`` -> ``"1 s"``.

    >>> [_decade_label(v) for v in (0.01, 0.1, 1.0, 1e3, 1e5, 1e7)]
    ['10 ns', '100 ns', '1 µs', '1 ms', '100 ms', '10 s']
    """
    for scale, unit in ((1e6, "s"), (1e3, "ms"), (1.0, "µs"), (1e-3, "ns")):
        if us >= scale * 0.999:
            return f"{us / scale:.0f} {unit}"
    return f"{us * 1e3:g} ns"


def _budget_strip(ax, rows: list[dict]) -> None:
    """Both domains' named budgets on one lane each, with a band from the smallest to the largest."""
    from .budget import BUDGETS

    lanes = {"qec": ("qec.cycle", "qec.feedforward", "qec.reaction"), "ai": ("ai.kv_transfer", "ai.tpot", "ai.ttft")}
    names = {"qec": "QEC", "ai": "LLM"}
    colors = {"qec": "#3b6ea5", "ai": "#c2571a"}
    for y, dom in ((1, "qec"), (0, "ai")):
        vals = [BUDGETS[k].limit_ns / 1e3 for k in lanes[dom]]
        ax.plot([min(vals), max(vals)], [y, y], color=colors[dom], lw=7, alpha=0.25, solid_capstyle="butt")
        places = ((0.34, "right"), (-0.36, "center"), (0.34, "left")) if dom == "qec" else \
            ((-0.36, "right"), (0.34, "center"), (-0.36, "left"))
        for k, v, (off, ha) in zip(lanes[dom], vals, places):
            ax.plot([v, v], [y - 0.18, y + 0.18], color=colors[dom], lw=1.6)
            ax.text(v, y + off, f"{short_budget(BUDGETS[k].name)} {format_us(v)}", ha=ha, va="center",
                    fontsize=6.5, color=colors[dom])
    qec_max = BUDGETS["qec.reaction"].limit_ns / 1e3
    ai_min = BUDGETS["ai.kv_transfer"].limit_ns / 1e3
    ax.annotate("", xy=(ai_min / 1.15, 0.5), xytext=(qec_max * 1.15, 0.5),
                arrowprops=dict(arrowstyle="<->", color="#666666", lw=0.8))
    ax.text(math.sqrt(qec_max * ai_min), 0.5, f" ×{ai_min / qec_max:,.0f} ", ha="center", va="center", fontsize=6.5,
            color="#444444", backgroundcolor="white")
    ax.set_ylim(-0.75, 1.6)
    ax.set_yticks([1, 0], [f"{names[d]} budgets" for d in ("qec", "ai")], fontsize=7.5)
    for tick, dom in zip(ax.get_yticklabels(), ("qec", "ai")):
        tick.set_color(colors[dom])
    ax.tick_params(axis="y", length=0)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title("Latency budgets of both domains, one time axis", loc="left", fontsize=8.5)


def _style(names: list[str], table: dict, extra: tuple) -> dict:
    out, k = {}, 0
    for n in names:
        if n in table:
            out[n] = table[n]
        else:
            out[n] = extra[k % len(extra)]
            k += 1
    return out


def _lanes(extents: list[tuple[float, float]], *, gap: float) -> list[int]:
    """Greedy interval packing: the lane of each ``(lo, hi)`` extent (log10 µs) so that no two
    extents in one lane come closer than ``gap``; items far apart share a lane."""
    ends: list[float] = []
    out = [0] * len(extents)
    for i in sorted(range(len(extents)), key=lambda i: extents[i][0]):
        lo, hi = extents[i]
        for k, end in enumerate(ends):
            if lo >= end + gap:
                ends[k] = hi
                out[i] = k
                break
        else:
            ends.append(hi)
            out[i] = len(ends) - 1
    return out


def _offsets(lanes: list[int], span: tuple[float, float]) -> list[float]:
    n = max(lanes, default=0) + 1
    if n == 1:
        return [sum(span) / 2] * len(lanes)
    step = min(0.16, (span[1] - span[0]) / (n - 1))
    mid = sum(span) / 2
    return [mid + (k - (n - 1) / 2) * step for k in lanes]


def _extent(s) -> tuple[float, float]:
    vals = [math.log10(v) for v in (s.center_us, s.tail_us) if math.isfinite(v) and v > 0]
    return min(vals), max(vals)


def _panel(ax, lines, colors: dict, markers: dict, *, title: str) -> None:
    gap = 0.16  # decades: a marker's width at this figure size
    for y, line in enumerate(lines):
        if y % 2 == 0:
            ax.axhspan(y - 0.5, y + 0.5, color="#f3f3f3", zorder=0, lw=0)
        here_m = [s for s in line.series if s.basis == "measured"]
        here_o = [s for s in line.series if s.basis != "measured"]
        span_m = (-0.22, 0.04) if here_o else (-0.2, 0.3)
        span_o = (0.16, 0.4) if here_m else (-0.2, 0.3)
        for group, span in ((here_m, span_m), (here_o, span_o)):
            offs = _offsets(_lanes([_extent(s) for s in group], gap=gap), span)
            for s, dy in zip(group, offs):
                yy = y + dy
                if s.basis == "measured":
                    c = colors[s.name]
                    if math.isfinite(s.center_us) and math.isfinite(s.tail_us):
                        ax.plot([s.center_us, s.tail_us], [yy, yy], color=c, lw=1.4, zorder=3)
                        ax.plot([s.tail_us], [yy], marker="|", ms=6, mew=1.4, color=c, zorder=3)
                    x = s.center_us if math.isfinite(s.center_us) else s.tail_us
                    ax.plot([x], [yy], marker="o", ms=5.5, color=c, mec="black", mew=0.5, zorder=4)
                else:
                    ax.plot([s.center_us], [yy], marker=markers[s.name], ms=5.5, mfc="white", mec="#555555",
                            mew=1.1, zorder=4, ls="none")
        two = len(line.budgets) > 1
        for k, (name, b_us) in enumerate(line.budgets):
            ax.plot([b_us, b_us], [y - 0.45, y + 0.45], color="black", lw=1.8, zorder=5, solid_capstyle="butt")
            left = two and k == 0
            ax.text(b_us / 1.1 if left else b_us * 1.1, y - 0.47, f"{name} {format_us(b_us)}", fontsize=6,
                    va="top", ha="right" if left else "left", color="#222222", zorder=6)
    ax.set_yticks(range(len(lines)))
    ax.set_yticklabels([ln.label for ln in lines], fontsize=7.5)
    ax.set_ylim(len(lines) - 0.5, -0.5)
    ax.grid(axis="x", which="major", color="#dddddd", lw=0.6, zorder=1)
    ax.set_title(title, loc="left", fontsize=8.5)


def _stage_panel(ax, rows: list[dict]) -> None:
    groups: dict = {}
    for r in rows:
        if r.get("stage") and r["stage"] != "total" and r.get("basis") == "measured":
            what = str(r["what"]).split(", stage")[0].replace("QEC ", "")
            groups.setdefault(f"{what} · {r['transport']}", []).append(r)
    stage_names = list(dict.fromkeys(r["stage"] for g in groups.values() for r in g))
    labels = list(groups)
    for k, st in enumerate(stage_names):
        left = [sum(x["share_pct"] for x in groups[g][:[y["stage"] for y in groups[g]].index(st)])
                if st in [y["stage"] for y in groups[g]] else 0.0 for g in labels]
        vals = [next((x["share_pct"] for x in groups[g] if x["stage"] == st), 0.0) for g in labels]
        ax.barh(labels, vals, left=left, color=_STAGE_COLORS[k % len(_STAGE_COLORS)], label=st, height=0.7)
    ax.axvline(100, color="black", lw=1.5)
    ax.set_xlabel("measured mean per stage, share of the line's budget (%) — black line: the budget", fontsize=7.5)
    ax.tick_params(axis="both", labelsize=7)
    ax.invert_yaxis()
    ax.legend(fontsize=6.5, ncols=min(5, max(1, len(stage_names))), loc="lower center", bbox_to_anchor=(0.5, 1.0),
              frameon=False)
    ax.set_title("Where the time goes (measured means per stage)", loc="left", fontsize=8.5, pad=28)


def fig_cross_domain(rows: list[dict], *, stages: bool = False, title: str = ""):
    """The cross-domain figure from budget rows (:func:`qlink.budget.budget_rows`, or the
    ``cross_domain.csv`` rows read back as dicts); a :class:`matplotlib.figure.Figure`."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullFormatter

    lines = group_rows(rows)
    panels = [(dom, [ln for ln in lines if ln.domain == dom]) for dom in ("qec", "ai")]
    other = [ln for ln in lines if ln.domain not in ("qec", "ai")]
    if other:
        panels.append(("other", other))
    panels = [(d, ls) for d, ls in panels if ls] or [("qec", [])]
    measured = list(dict.fromkeys(s.name for ln in lines for s in ln.series if s.basis == "measured"))
    modeled = list(dict.fromkeys(s.name for ln in lines for s in ln.series if s.basis != "measured"))
    colors = _style(measured, TRANSPORT_COLORS, _MORE_COLORS)
    markers = _style(modeled, LINK_MARKERS, _MORE_MARKERS)
    has_stages = stages and any(r.get("stage") and r.get("basis") == "measured" for r in rows)
    n_stage = len({(str(r["what"]).split(", stage")[0], r["transport"]) for r in rows
                   if has_stages and r.get("stage") and r.get("basis") == "measured"})
    stage_h = 0.2 * n_stage + 0.9
    heights = [0.95] + [0.48 * max(1, len(ls)) + 0.45 for _, ls in panels]
    legend_h = 0.95
    fig = Figure(figsize=(7.2, sum(heights) + legend_h + 0.55 + (stage_h if has_stages else 0)), layout="constrained")
    ratios = heights + ([stage_h] if has_stages else [])
    axes = fig.subplots(len(ratios), 1, gridspec_kw={"height_ratios": ratios})
    axes = list(np.atleast_1d(axes))
    time_axes = axes[:1 + len(panels)]
    for ax in time_axes[1:]:
        ax.sharex(time_axes[0])
    _budget_strip(time_axes[0], rows)
    for ax, (dom, ls) in zip(time_axes[1:], panels):
        _panel(ax, ls, colors, markers, title=_PANEL_TITLES.get(dom, "Other figures"))
    vals = [v for ln in lines for s in ln.series for v in (s.center_us, s.tail_us) if math.isfinite(v) and v > 0]
    x_lo = min([_X_MIN_US, *(v / 1.6 for v in vals)])
    x_hi = max([_X_MAX_US, *(v * 1.6 for v in vals)])
    decades = 10.0 ** np.arange(math.ceil(math.log10(x_lo)), math.floor(math.log10(x_hi)) + 1)
    for ax in time_axes:
        ax.set_xscale("log")
        ax.set_xlim(x_lo, x_hi)
        ax.xaxis.set_major_locator(FixedLocator(decades))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelsize=7.5)
    for ax in time_axes[:-1]:
        ax.tick_params(axis="x", labelbottom=False)
    time_axes[-1].set_xticks(decades, [_decade_label(d) for d in decades])
    time_axes[-1].set_xlabel("time (log scale)", fontsize=8)
    handles = [Line2D([], [], marker="o", ls="none", color=colors[n], mec="black", mew=0.5, ms=6,
                      label=f"{n} (measured here)") for n in measured]
    handles += [Line2D([], [], marker=markers[n], ls="none", mfc="white", mec="#555555", mew=1.1, ms=6,
                       label=f"{n} (modeled)") for n in modeled]
    handles += [Line2D([], [], color="#444444", lw=1.4, marker="|", ms=7, label="p50 → p99 (measured)"),
                Line2D([], [], color="black", lw=1.8, marker="|", ms=12, ls="none", label="the line's budget")]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(4, len(handles)), fontsize=7, frameon=False)
    if has_stages:
        _stage_panel(axes[-1], rows)
    fig.suptitle(title or "Where QEC and LLM serving stand against their latency budgets (same transports)",
                 fontsize=9.5)
    return fig
