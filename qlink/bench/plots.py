"""The plots the benchmarks write beside their tables (``<name>.png`` next to ``<name>.csv``).

Each function takes a benchmark's rows as it writes them and returns a
:class:`matplotlib.figure.Figure` built without pyplot (no backend is switched); a row a
plot cannot use is left out, and no rows give an empty figure, never an error.

>>> fig = fig_kv_peers([{"case": "qlink shm put", "basis": "measured", "tokens": 512, "pattern": "contiguous",
...                      "GBps": 13.5},
...                     {"case": "memcpy floor (warm, same blocks)", "basis": "floor", "tokens": 512,
...                      "pattern": "contiguous", "GBps": 16.1}])
>>> sorted(t.get_text() for t in fig.axes[0].get_legend().get_texts())
['memcpy floor', 'qlink shm']
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["fig_kv_peers", "fig_vllm_connectors", "save_figure", "new_figure", "KV_SERIES"]

#: the bars of :func:`fig_kv_peers`, each a qlink transport beside its floor and its peer, in
#: that order: (label, case prefix, basis)
KV_SERIES = (("memcpy floor", "memcpy floor", "floor"), ("qlink shm", "qlink shm put", "measured"),
             ("NIXL UCX", "NIXL", "measured"), ("qlink ucx", "qlink ucx put", "measured"),
             ("TCP socket floor", "TCP socket floor", "floor"), ("qlink tcp", "qlink tcp put", "measured"),
             ("Mooncake TCP", "Mooncake", "measured"))


def new_figure(w: float = 6.0, h: float = 4.0, ncols: int = 1):
    """``(figure, axes)``: a constrained-layout :class:`matplotlib.figure.Figure` of ``w`` x ``h``
    inches and ``ncols`` axes side by side, made without pyplot (the paper's figures use it too)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), layout="constrained")
    return fig, fig.subplots(1, ncols)


def _grouped_axes(ax, x, ticks: list[str], *, ylabel: str, title: str, legend_below: float | None) -> None:
    """Groups of bars on a log axis: their ticks, labels and (with bars drawn) the legend under it."""
    ax.set_xticks(x, ticks, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if legend_below is not None:
        ax.legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -legend_below))


def _best(rows: list[dict], prefix: str, basis: str, tokens, pattern) -> float:
    """The fastest row of a series at one case (several qlink ucx/tcp ways, Mooncake's slices:
    the one its goal takes); the socket floor has one row per token count, whatever the pattern."""
    found = [r["GBps"] for r in rows if r.get("basis") == basis and str(r.get("case", "")).startswith(prefix)
             and r.get("tokens") == tokens and (r.get("pattern") == pattern or prefix == "TCP socket floor")
             and r.get("GBps")]
    return max(found) if found else np.nan


def fig_kv_peers(rows: list[dict]):
    """``qlink bench kv``: per token count and block pattern, each qlink transport's GB/s
    (median of its transfers; the faster way where it was taken two ways) beside its floor
    and its peer: shm beside the memcpy floor, ucx beside NIXL, tcp beside the bare socket
    and Mooncake (its faster slice). Log scale; a series not measured is left out."""
    cases = sorted({(r["tokens"], r["pattern"]) for r in rows
                    if r.get("basis") == "measured" and r.get("tokens") is not None and r.get("pattern")})
    fig, ax = new_figure(max(6.0, 1.6 * len(cases) + 2), 4.2)
    series = [(label, [_best(rows, prefix, basis, t, p) for t, p in cases]) for label, prefix, basis in KV_SERIES]
    series = [(label, v) for label, v in series if not np.all(np.isnan(v))]
    width = 0.8 / max(1, len(series))
    x = np.arange(len(cases))
    for i, (label, values) in enumerate(series):
        floor = label.endswith("floor")
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label,
               color="lightgrey" if floor else None, edgecolor="black", linewidth=0.4, hatch="//" if floor else None)
    _grouped_axes(ax, x, [f"{t} tok\n{p}" for t, p in cases], ylabel="GB/s (median; floors: best round)",
                  title="KV transfer between two processes: qlink beside its floors and peers",
                  legend_below=0.16 if series else None)
    return fig


def fig_vllm_connectors(rows: list[dict]):
    """``qlink bench vllm``: per prompt length, each case's decode-side TTFT (median over its
    prompts), the exposed transfer in it drawn dark; log scale (recomputing a long prompt
    takes 100 x longer than loading it)."""
    lengths = sorted({r["prompt_tokens"] for r in rows if r.get("decode_ttft_ms") is not None})
    cases = list(dict.fromkeys(r["case"] for r in rows if r.get("decode_ttft_ms") is not None))
    fig, ax = new_figure(max(6.0, 2.2 * len(lengths) + 2), 4.2)
    width = 0.8 / max(1, len(cases))
    x = np.arange(len(lengths))
    by = {(r["case"], r["prompt_tokens"]): r for r in rows}
    labelled = False
    for i, case in enumerate(cases):
        at = x + (i - (len(cases) - 1) / 2) * width
        ttft = [by.get((case, n), {}).get("decode_ttft_ms", np.nan) for n in lengths]
        ax.bar(at, ttft, width, label=case, edgecolor="black", linewidth=0.4)
        shown = [(a, by[(case, n)]["exposed_ms"]) for a, n in zip(at, lengths) if by.get((case, n), {}).get("exposed_ms")]
        if shown:
            ax.bar([a for a, _ in shown], [e for _, e in shown], width * 0.5, color="black", alpha=0.55,
                   label=None if labelled else "exposed transfer (in the TTFT)")
            labelled = True
    _grouped_axes(ax, x, [f"{n} prompt tokens" for n in lengths], ylabel="decode-side TTFT, ms (median)",
                  title="vLLM prefill -> decode on this CPU: each KV connector on the same prompts",
                  legend_below=0.12 if cases else None)
    return fig


def save_figure(fig, path) -> Path:
    """Write ``fig`` to ``path`` (PNG, or what the suffix names) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path
