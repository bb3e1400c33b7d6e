"""The cross-domain budget table: a QEC loop and an LLM serving step on the same
transports, each set against its own budget, measured and modeled kept apart.

Rows (each one figure against one budget, with its basis):

* **QEC** — surface-code memory at d = 5 and 11 through the full wire path
  (controller → transport → decoder service → back), in lock-step (each shot's
  correction applied before the next shot starts, as a feed-forward step needs):
  reaction time p50/p99 against the reaction budget; decode time per syndrome round
  against the 1.1 µs cycle; the feed-forward decision (last round → correction
  applied) against NVQLink's round trip. Sustained streaming throughput at the cycle is
  ``qlink bench qec``'s job.
* **AI** — Llama-3-8B and 70B KV transfer of a 4k-token request against TTFT and
  DistServe's KV-transfer target; one layer's transfer against one layer's prefill compute.
* **measured** rows ran here over ``shm``/``tcp``/``ucx``; **modeled** rows put the same
  bytes on NVLink 4 / PCIe 5 / IB NDR / the NVQLink path from :mod:`qlink.links`. A
  modeled QEC reaction time uses the decode time measured here as an *input* (named in
  the row) — the output is modeled, never added to a measured figure.

>>> from qlink.crossdomain import qec_frame_nbytes
>>> qec_frame_nbytes(num_detectors=24)   # 24-byte header + 32-byte payload header + 3 bytes
59
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .budget import BUDGETS, BudgetLine, Figure, assess, budget_rows, layer_compute_budget
from .links import LINKS

__all__ = ["CrossDomainResult", "run_cross_domain", "qec_frame_nbytes", "plot_cross_domain",
           "PREFILL_ACHIEVED_FLOPS", "MODEL_PARAMS"]

# Prefill compute model, shared with scenarios/kv_disagg.py: H100 SXM BF16 dense peak
# 989 TFLOP/s (NVIDIA H100 datasheet) at an assumed 50 % model-FLOPs utilization.
PREFILL_ACHIEVED_FLOPS = 989e12 * 0.5
PREFILL_CITATION = "2*params*tokens FLOPs at 50 % of H100 BF16 dense peak (989 TFLOP/s, NVIDIA datasheet)"
MODEL_PARAMS = {"llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9}
QEC_MODELED_LINKS = ("nvqlink", "pcie5-x16", "ib-ndr", "roce-400g")
KV_MODELED_LINKS = ("nvlink4", "pcie5-x16", "ib-ndr")


def qec_frame_nbytes(*, num_detectors: int) -> int:
    """Bytes of one enqueue_syndromes frame carrying ``num_detectors`` bits (CUDA-Q realtime layout)."""
    return 24 + 32 + (num_detectors + 7) // 8


@dataclass
class CrossDomainResult:
    lines: list[BudgetLine] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    qec: list[dict] = field(default_factory=list)
    kv: list[dict] = field(default_factory=list)

    def rows(self) -> list[dict]:
        return budget_rows(self.lines)


def _qec(res: CrossDomainResult, transports: Iterable[str], distances: Iterable[int], *, num_shots: int,
         seed: int, say: Callable[[str], None]) -> None:
    from .qec.loop import run_loop, source_spec

    decode_inputs: dict[int, float] = {}
    for d in distances:
        for t in transports:
            say(f"QEC loop: surface code d={d}, {num_shots} shots in lock-step (each correction applied "
                f"before the next shot) over {t}")
            try:
                r = run_loop(transport=t, source=source_spec(distance=d, p=0.001), num_shots=num_shots,
                             warmup_shots=min(200, num_shots), seed=seed,
                             feed_forward_deadline_ns=int(BUDGETS["qec.reaction"].limit_ns), pin_cpus=True)
            except Exception as e:  # report and go on: one transport failing must not hide the others
                res.notes.append(f"QEC d={d} over {t}: not measured ({type(e).__name__}: {e})")
                continue
            s = r.summary()
            res.qec.append(s)
            name = r.transport
            rounds = r.num_rounds
            res.lines.append(assess(Figure(f"QEC d={d} reaction time", r.reaction_p50_ns, "measured", name, "p50"),
                                    BUDGETS["qec.reaction"]))
            res.lines.append(assess(Figure(f"QEC d={d} reaction time", r.reaction_p99_ns, "measured", name, "p99"),
                                    BUDGETS["qec.reaction"]))
            dec_us = r.stage_breakdown.get("stages", {}).get("decode", {}).get("p50_us")
            if dec_us is not None and rounds:
                res.lines.append(assess(Figure(f"QEC d={d} decode time per round (one shot per call)",
                                               float(dec_us) * 1e3 / rounds, "measured", name, "p50"),
                                        BUDGETS["qec.cycle"]))
            res.lines.append(assess(Figure(f"QEC d={d} feed-forward decision", r.reaction_p50_ns, "measured", name,
                                           "p50"), BUDGETS["qec.feedforward"]))
            dec = r.stage_breakdown.get("stages", {}).get("decode", {}).get("p50_us")
            if dec is not None and d not in decode_inputs:
                decode_inputs[d] = float(dec) * 1e3
            # frame size for the modeled rows
            res.qec[-1]["frame_nbytes"] = qec_frame_nbytes(num_detectors=_detectors_per_round(d))
            res.qec[-1]["rounds"] = rounds
    for d, decode_ns in decode_inputs.items():
        frame = qec_frame_nbytes(num_detectors=_detectors_per_round(d))
        for ln in QEC_MODELED_LINKS:
            link = LINKS[ln]
            # last round's frame out + get_corrections request, correction response back.
            wire = link.transfer_time_ns(frame) + link.round_trip_ns(24 + 17, 24 + 1)
            res.lines.append(assess(Figure(f"QEC d={d} reaction time (link + measured decode p50 "
                                           f"{decode_ns / 1e3:.1f} us as input)", wire + decode_ns, "modeled", ln,
                                           "p50"), BUDGETS["qec.reaction"]))
            res.lines.append(assess(Figure(f"QEC d={d} feed-forward wire time (no decode)", wire, "modeled", ln,
                                           "nominal"), BUDGETS["qec.feedforward"]))


def _detectors_per_round(d: int) -> int:
    return d * d - 1  # rotated surface code: d^2 - 1 stabilizers measured per round


def _kv(res: CrossDomainResult, transports: Iterable[str], presets: Iterable[str], *, tokens: int,
        say: Callable[[str], None]) -> None:
    from .ai import preset as kv_preset
    from .bench.kv import run_kv_bench

    for name in presets:
        spec = kv_preset(name)
        nbytes = spec.kv_nbytes(num_tokens=tokens)
        layer_budget = layer_compute_budget(model=name, num_layers=spec.num_layers, num_tokens=tokens,
                                            params=MODEL_PARAMS[name], achieved_flops=PREFILL_ACHIEVED_FLOPS,
                                            citation=PREFILL_CITATION)
        say(f"KV transfer: {name}, {tokens} tokens = {nbytes / 2**20:.0f} MiB, over {', '.join(transports)}")
        rows = run_kv_bench(transports=tuple(transports), tokens=(tokens,), preset=name, repeats=1,
                            patterns=("contiguous",), nixl=False, memory_budget_nbytes=8 << 30, progress=say)
        for r in rows:
            r["preset"] = name
        res.kv.extend(rows)
        for r in rows:
            if r.get("basis") in ("skipped", "error"):
                res.notes.append(f"KV {name} {r.get('case')}: {r.get('basis')} ({r.get('note', '')})")
                continue
            if r.get("basis") != "measured" or r.get("p50_ms") is None:
                continue
            t_ns = float(r["p50_ms"]) * 1e6
            label = r.get("transport") or r["case"]
            _kv_lines(res, name, tokens, t_ns, "measured", label, spec.num_layers, layer_budget)
        for ln in KV_MODELED_LINKS:
            t_ns = LINKS[ln].transfer_time_ns(nbytes)
            _kv_lines(res, name, tokens, t_ns, "modeled", ln, spec.num_layers, layer_budget,
                      per_layer_ns=LINKS[ln].transfer_time_ns(nbytes // spec.num_layers))


def _kv_lines(res, name, tokens, t_ns, basis, transport, num_layers, layer_budget, *, per_layer_ns=None):
    what = f"{name} KV transfer, {_tokens_label(tokens)} tokens"
    res.lines.append(assess(Figure(what, t_ns, basis, transport, "p50"), BUDGETS["ai.ttft"]))
    res.lines.append(assess(Figure(what, t_ns, basis, transport, "p50"), BUDGETS["ai.kv_transfer"]))
    per_layer = per_layer_ns if per_layer_ns is not None else t_ns / num_layers
    res.lines.append(assess(Figure(f"{name} one layer's KV transfer, {_tokens_label(tokens)} tokens", per_layer, basis,
                                   transport, "p50" if basis == "measured" else "nominal"), layer_budget))


def _tokens_label(tokens: int) -> str:
    """``4096`` -> ``"4k"``, ``1536`` -> ``"1536"``."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def run_cross_domain(*, transports=("shm", "tcp", "ucx"), distances=(5, 11), presets=("llama-3-8b", "llama-3-70b"),
                     kv_tokens: int = 4096, num_shots: int = 2000, seed: int = 0,
                     say: Callable[[str], None] = print) -> CrossDomainResult:
    """Measure both domains on ``transports`` and set every figure against its budget."""
    res = CrossDomainResult()
    _qec(res, transports, distances, num_shots=num_shots, seed=seed, say=say)
    _kv(res, transports, presets, tokens=kv_tokens, say=say)
    return res


def plot_cross_domain(rows: list[dict], path) -> Path:
    """A horizontal bar chart of budget share (log scale), measured solid, modeled hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["share_pct"] > 0 and math.isfinite(r["share_pct"])]
    labels = [f"{r['what']} [{r['stat']}] — {r['transport']}" for r in rows]
    fig, ax = plt.subplots(figsize=(11, max(3, 0.28 * len(rows) + 1)))
    colors = ["tab:blue" if r["domain"] == "qec" else "tab:orange" for r in rows]
    hatches = ["" if r["basis"] == "measured" else "//" for r in rows]
    y = range(len(rows))
    bars = ax.barh(list(y), [r["share_pct"] for r in rows], color=colors, edgecolor="black", linewidth=0.4)
    for b, h in zip(bars, hatches):
        b.set_hatch(h)
    ax.axvline(100, color="red", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("share of budget (%) — red line: budget; hatched: modeled; blue: QEC, orange: AI")
    ax.set_title("qlink cross-domain latency budgets (same transports, both domains)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
