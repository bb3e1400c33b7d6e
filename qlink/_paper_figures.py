"""Figures of the cross-domain latency paper, shared with the notebooks.

Every function takes results as the scenarios return them and gives back a
:class:`matplotlib.figure.Figure` built without pyplot: it draws the same in a
script (save it with ``fig.savefig``) and inline in a notebook (the figure is the
cell's value), and never switches the matplotlib backend under a notebook's feet.

>>> from qlink.links import LINKS
>>> fig = fig_link_times({"nvlink4": LINKS["nvlink4"]}, nbytes=[1 << 10, 1 << 20])
>>> [line.get_label() for line in fig.axes[0].lines]
['nvlink4 (modeled)']
"""

from __future__ import annotations

import numpy as np

from .bench.plots import new_figure as _figure

__all__ = ["fig_reaction_cdf", "fig_backlog", "fig_ler_deadline", "fig_stage_shares", "fig_kv_exposed",
           "fig_kv_bandwidth", "fig_layer_arrival", "fig_link_times"]

STAGE_ORDER = ("send", "wire_in", "queue", "decode", "respond", "wire_out", "apply")


def fig_reaction_cdf(results: dict, *, title: str = ""):
    """Empirical CDF of the reaction time (last round out → correction applied), one line
    per :class:`~qlink.qec.loop.LoopResult` in ``results`` (label → result). Measured."""
    fig, ax = _figure()
    for name, res in results.items():
        r = np.sort(res.controller.reaction_ns[res.controller.reaction_ns >= 0]) / 1e3
        if r.size:
            ax.plot(r, np.arange(1, r.size + 1) / r.size, label=f"{name} (p50 {np.median(r):.3g} µs)")
    ax.set_xscale("log")
    ax.set_xlabel("reaction time: last round → correction applied (µs, measured)")
    ax.set_ylabel("fraction of shots")
    ax.set_title(title or "Reaction-time distribution", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig


def fig_backlog(results: dict, *, title: str = ""):
    """Decoder backlog over time (rounds emitted − rounds answered) per result."""
    fig, ax = _figure()
    for name, res in results.items():
        t, b = res.backlog_trace
        ax.plot(np.asarray(t) / 1e3, b, label=name, lw=1)
    ax.set_xlabel("time since the first round (µs)")
    ax.set_ylabel("rounds emitted − rounds answered")
    ax.set_title(title or "Decoder backlog", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def fig_ler_deadline(results: dict, *, deadline_ns: float | None = None, title: str = ""):
    """LER(t) = P(wrong, missing, or later than t) against the deadline t, per result."""
    fig, ax = _figure()
    grid_ns = np.geomspace(1_000, 1e9, 121)
    for name, res in results.items():
        ax.plot(grid_ns / 1e3, res.ler_at(grid_ns.astype(np.int64)), label=name)
    if deadline_ns:
        ax.axvline(deadline_ns / 1e3, color="k", ls=":", label=f"deadline {deadline_ns / 1e3:g} µs")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("deadline t (µs)")
    ax.set_ylabel("LER(t)")
    ax.set_title(title or "Logical error rate under a deadline", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig


def fig_stage_shares(results: dict, *, title: str = ""):
    """Per result, the mean reaction time split into its stages (stacked bar, µs, measured)."""
    fig, ax = _figure(7, 0.6 * len(results) + 2)
    names = list(results)
    left = np.zeros(len(names))
    for k, stage in enumerate(STAGE_ORDER):
        vals = np.array([results[n].stage_breakdown.get("stages", {}).get(stage, {}).get("mean_us", 0.0) or 0.0
                         for n in names])
        if not vals.any():
            continue
        ax.barh(names, vals, left=left, label=stage, color=f"C{k}")
        left += vals
    ax.set_xlabel("mean time per shot in each stage (µs, measured)")
    ax.set_title(title or "Where the reaction time goes", fontsize=9)
    ax.legend(fontsize=7, ncols=4, loc="lower right")
    ax.invert_yaxis()
    return fig


def fig_kv_exposed(rows: list[dict], *, ttft_ms: float = 250.0, kv_target_ms: float = 30.0):
    """Disaggregated serving (rows of ``scenarios/kv_disagg.py``): exposed KV transfer vs
    prompt length (measured, and modeled over NVLink 4 / a 400 Gb/s NIC) and each
    request's TTFT split into queue, prefill compute (modeled) and exposed transfer."""
    fig, (ax1, ax2) = _figure(11, 4, ncols=2)
    if rows:
        tok = np.array([r["prompt_tokens"] for r in rows])
        ax1.scatter(tok, [r["exposed_transfer_ms"] for r in rows], s=14, label=f"measured ({rows[0]['transport']})")
        ax1.scatter(tok, [r["exposed_ms_400g_nic_modeled"] for r in rows], s=10, marker="x",
                    label="400 Gb/s NIC (modeled)")
        ax1.scatter(tok, [r["exposed_ms_nvlink4_modeled"] for r in rows], s=10, marker="+",
                    label="NVLink 4 (modeled)")
        ids = [r["request_id"] for r in rows]
        q = np.array([r["queue_ms"] for r in rows])
        c = np.array([r["prefill_compute_ms"] for r in rows])
        e = np.array([r["exposed_transfer_ms"] for r in rows])
        ax2.bar(ids, q, label="queue", color="#bbbbbb")
        ax2.bar(ids, c, bottom=q, label="prefill compute (modeled)", color="#4c72b0")
        ax2.bar(ids, e, bottom=q + c, label="exposed KV transfer (measured)", color="#dd8452")
    ax1.axhline(kv_target_ms, color="grey", ls="--", lw=1, label=f"KV-transfer target {kv_target_ms:g} ms")
    ax1.axhline(ttft_ms, color="red", ls=":", lw=1, label=f"TTFT SLO {ttft_ms:g} ms")
    ax1.set_yscale("symlog", linthresh=0.01)
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("exposed transfer (ms)")
    ax1.set_title("KV transfer not hidden under prefill compute", fontsize=9)
    ax1.legend(fontsize=7)
    ax2.axhline(ttft_ms, color="red", ls=":", lw=1, label=f"TTFT SLO {ttft_ms:g} ms")
    ax2.set_xlabel("request")
    ax2.set_ylabel("ms from arrival")
    ax2.set_title("TTFT as seen by the decode worker", fontsize=9)
    ax2.legend(fontsize=7)
    return fig


def fig_vllm_requests(rows: list[dict]):
    """Real engines (rows of :func:`qlink.scenarios.kv_disagg.run_vllm`: vLLM prefill and decode
    engines, the qlink connector between them): per request, the prefill engine's time to its
    one token, the decode engine's time to first token with the KV moved, and the
    connector's transfer inside it, against the prompt length; hollow markers where the
    decode tokens differed from the decode engine computing the prompt itself."""
    fig, ax = _figure(6, 4)
    if rows:
        tok = np.array([r["prompt_tokens"] for r in rows])
        same = np.array([bool(r.get("tokens_match")) for r in rows])
        for key, label, marker in (("prefill_ms", "prefill engine: its one token", "o"),
                                   ("decode_ttft_ms", "decode engine: first token, KV moved", "s"),
                                   ("transfer_ms", "qlink connector: pull asked -> last layer landed", "^")):
            y = np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)
            dots = ax.scatter(tok[same], y[same], s=22, marker=marker, label=label)
            if (~same).any():
                ax.scatter(tok[~same], y[~same], s=22, marker=marker, facecolors="none",
                           edgecolors=dots.get_facecolor())
        ax.set_title(f"vLLM on this CPU (tiny random Llama), qlink over {rows[0].get('transport', '?')}", fontsize=9)
        ax.legend(fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms")
    return fig


def fig_kv_bandwidth(rows: list[dict]):
    """KV-transfer bandwidth per case (rows of :func:`qlink.bench.kv.run_kv_bench`):
    measured bars solid, the memcpy floor grey, modeled links hatched."""
    rows = [r for r in rows if r.get("GBps") and r.get("basis") in ("measured", "floor", "modeled")]
    fig, ax = _figure(7, 0.35 * len(rows) + 1.5)
    labels = [f"{r['case']} · {r.get('tokens', '')} tok{' · ' + r['pattern'] if r.get('pattern') else ''}"
              for r in rows]
    colors = {"measured": "tab:blue", "floor": "tab:gray", "modeled": "white"}
    bars = ax.barh(labels, [r["GBps"] for r in rows], color=[colors[r["basis"]] for r in rows],
                   edgecolor="black", linewidth=0.5)
    for b, r in zip(bars, rows):
        if r["basis"] == "modeled":
            b.set_hatch("//")
    ax.set_xscale("log")
    ax.set_xlabel("GB/s — solid: measured here; grey: memcpy floor; hatched: modeled")
    ax.set_title("KV-cache transfer bandwidth", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    return fig


def fig_layer_arrival(records: dict, *, layer_compute_us: float | None = None):
    """When each layer of one request became ready at the receiver (µs after the sender's
    submit), one line per :class:`~qlink.ai.TransferRecord` in ``records`` (label → record);
    with ``layer_compute_us`` also the time each layer's prefill compute would end."""
    fig, ax = _figure()
    for name, rec in records.items():
        ready = np.asarray(rec.layer_ready_us)
        ax.plot(np.arange(len(ready)), ready / 1e3, "o-", ms=3, label=f"{name} ({rec.mode}, measured)")
        n = len(ready)
    if layer_compute_us and records:
        ax.plot(np.arange(n), (np.arange(n) + 1) * layer_compute_us / 1e3, "k--", lw=1,
                label="layer compute ends (modeled)")
    ax.set_xlabel("layer")
    ax.set_ylabel("ready at the receiver (ms after submit)")
    ax.set_title("Layer-by-layer KV arrival", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def fig_link_times(links: dict, *, nbytes, measured: dict | None = None):
    """Modeled transfer time against message size for each link (name → LinkModel), with
    optional measured points (label → (nbytes array, seconds array))."""
    fig, ax = _figure()
    nb = np.asarray(nbytes, dtype=np.float64)
    for name, link in links.items():
        ax.plot(nb, [link.transfer_time_ns(int(n)) / 1e9 for n in nb], "--", label=f"{name} (modeled)")
    for name, (x, y) in (measured or {}).items():
        ax.plot(x, y, "o-", label=f"{name} (measured)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes")
    ax.set_ylabel("transfer time (s)")
    ax.set_title("Transfer time by link", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig
