"""The cross-domain budget table: a QEC loop and an LLM serving step on the same
transports, each set against its own budget, measured and modeled kept apart.

Every row is one :class:`~qlink.budget.Figure` against one budget, with one basis:
*measured* (ran here, over ``shm``/``tcp``/``ucx``) or *modeled* (the same bytes on a
link of :mod:`qlink.links`: NVLink 4, PCIe 5, IB NDR, RoCE, the NVQLink path). A modeled
row takes no measured input, and no number adds a measured time to a modeled one.

**QEC** — surface-code memory at d = 5 and 11 through the full wire path (controller →
transport → decoder service → back), in lock-step (each shot's correction applied
before the next shot starts, as a feed-forward step needs). Measured, per transport:

* reaction time (last round's tick → correction applied) p50/p99 against the reaction budget;
* decode time per round (one decoder call per shot, over its rounds) against the 1.1 µs cycle;
* the *feed-forward decision latency* (:func:`feed_forward_decision_ns`): the reaction
  time less the decoder service's own work — the controller hands off the last
  syndrome frame, it crosses the transport, the correction crosses back and is XORed
  into the Pauli frame, ready for the conditional operation — against NVQLink's
  3.96 µs FPGA→GPU→FPGA round trip, which bounds the same path with no decoding;
* time per round answered, 1 / (rounds answered per second of the lock-step run),
  against the backlog rate (one round per cycle). A lock-step loop waits for every
  shot's correction, so this is the closed loop's rate, not the decoder's streaming
  capacity (``qlink bench qec`` measures that);
* per stage of the reaction time (send, wire_in, queue, decode, respond, wire_out,
  apply; means, which add up to the mean reaction time): share of the reaction budget
  and the headroom left after it.

Modeled, per link: the feed-forward round trip over the link (the last syndrome frame
and the ``get_corrections`` behind it in, the correction back; no decoding), against
the feed-forward budget and against the reaction budget, where its headroom is the
time decoding may take. The decode time measured here stands in its own measured rows
beside it; the two are never summed.

**AI** — Llama-3-8B and 70B KV transfers of a 4k-token request. Measured, per
transport: submit → last layer ready against TTFT and DistServe's KV-transfer target;
one layer's transfer p50/p99 (requests that each move one layer, as a layer-wise
prefill sends a layer when its compute ends: the sender's submit → that layer ready at
the receiver, the KV engine's own timestamps) against one layer's prefill compute; per
stage (sender's plan, first layer, the other layers) against TTFT. Modeled, per link:
the same bytes and one layer's bytes. NVQLink is an FPGA↔GPU path for control traffic,
not a GPU↔GPU KV path: its KV rows are a what-if at its catalog bandwidth, and say so.

>>> from qlink.crossdomain import qec_frame_nbytes
>>> qec_frame_nbytes(num_detectors=24)   # 24-byte header + 32-byte payload header + 3 bytes
59
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from .budget import (BUDGETS, Budget, BudgetLine, Figure, assess, budget_rows, figure_from_rate,
                     layer_compute_budget, stage_lines)
from .links import LINKS

__all__ = ["CrossDomainResult", "QecMeasurement", "KvMeasurement", "run_cross_domain", "build_lines",
           "feed_forward_decision_ns", "modeled_qec_round_trip", "qec_frame_nbytes", "plot_cross_domain",
           "PREFILL_ACHIEVED_FLOPS", "MODEL_PARAMS", "QEC_MODELED_LINKS", "KV_MODELED_LINKS", "AI_ENGINE"]

# Prefill compute model, shared with scenarios/kv_disagg.py: H100 SXM BF16 dense peak
# 989 TFLOP/s (NVIDIA H100 datasheet) at an assumed 50 % model-FLOPs utilization.
PREFILL_ACHIEVED_FLOPS = 989e12 * 0.5
PREFILL_CITATION = "2*params*tokens FLOPs at 50 % of H100 BF16 dense peak (989 TFLOP/s, NVIDIA datasheet)"
MODEL_PARAMS = {"llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9}
QEC_MODELED_LINKS = ("nvqlink", "nvlink4", "pcie5-x16", "ib-ndr", "roce-400g")
KV_MODELED_LINKS = ("nvlink4", "pcie5-x16", "ib-ndr", "nvqlink")
_NOT_A_KV_PATH = {"nvqlink": " (NVQLink FPGA-GPU path: a what-if at its catalog bandwidth)"}
_GET_CORRECTIONS_NBYTES = 24 + 17  # header + get_corrections payload
_CORRECTION_NBYTES = 24 + 1  # header + one byte of flips (one observable)
_QEC_STAGES = ("send", "wire_in", "queue", "decode", "respond", "wire_out", "apply")  # timeline.REACTION_STAGES
_KV_STAGES = ("plan", "first layer", "other layers")
_KV_MEMORY_BUDGET_NBYTES = 8 << 30  # both KV caches (sender's and receiver's) together
#: The ``engine`` of this module's AI rows: no serving engine, prefill compute modeled.
AI_ENGINE = "emulated"


def qec_frame_nbytes(*, num_detectors: int) -> int:
    """Bytes of one enqueue_syndromes frame carrying ``num_detectors`` bits (CUDA-Q realtime layout)."""
    return 24 + 32 + (num_detectors + 7) // 8


def _detectors_per_round(d: int) -> int:
    return d * d - 1  # rotated surface code: d^2 - 1 stabilizers measured per round


def _tokens_label(tokens: int) -> str:
    """``4096`` -> ``"4k"``, ``1536`` -> ``"1536"``."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def feed_forward_decision_ns(stages: dict) -> np.ndarray:
    """Per shot, the feed-forward decision latency (ns) from the loop's joined stage
    timestamps (:func:`qlink.qec.timeline.join_shots`): the reaction time less the
    decoder service's own work (``ring_wait + queue + decode + respond``), which is
    ``send + wire_in − ring_wait + wire_out + apply``: the controller hands off the last
    syndrome frame, it crosses the transport, the correction crosses back and is
    applied to the Pauli frame, where the conditional operation can branch on it.

    >>> st = {"reaction": np.array([950]), "ring_wait": np.array([130]), "queue": np.array([100]),
    ...       "decode": np.array([200]), "respond": np.array([100])}
    >>> feed_forward_decision_ns(st).tolist()
    [420]
    """
    service = stages["ring_wait"] + stages["queue"] + stages["decode"] + stages["respond"]
    return np.asarray(stages["reaction"] - service, dtype=np.int64)


def modeled_qec_round_trip(link: str, *, distance: int) -> Figure:
    """The modeled feed-forward round trip of one shot over ``link`` (no decoding): the
    last syndrome frame in, the ``get_corrections`` sent right behind it (its latency
    overlaps the frame's: it adds its serialization, as :mod:`transports.emulated`
    queues messages), the correction back. A :class:`Figure` sum of modeled parts.

    >>> f = modeled_qec_round_trip("nvqlink", distance=5)
    >>> f.basis, f.transport, round(f.value_ns, 1)   # within NVQLink's 3.96 us round trip
    ('modeled', 'nvqlink', 3952.5)
    """
    m = LINKS[link]
    frame = qec_frame_nbytes(num_detectors=_detectors_per_round(distance))
    frame_in = Figure("syndrome frame in", m.transfer_time_ns(frame), "modeled", link, "nominal")
    get_in = Figure("get_corrections behind it", _GET_CORRECTIONS_NBYTES / m.bandwidth_Bps * 1e9, "modeled", link,
                    "nominal")
    back = Figure("correction back", m.transfer_time_ns(_CORRECTION_NBYTES), "modeled", link, "nominal")
    return replace(frame_in + get_in + back, what=f"QEC d={distance} link round trip")


@dataclass(frozen=True)
class QecMeasurement:
    """What one lock-step QEC loop run measured (ns), the inputs of its measured rows."""

    distance: int
    transport: str  # the transport that carried the bytes
    num_rounds: int
    reaction_p50_ns: float
    reaction_p99_ns: float
    decode_p50_ns: float  # one decoder call: one shot, all its rounds (nan: not recorded)
    decision_p50_ns: float  # feed_forward_decision_ns (nan: no joined shot records)
    decision_p99_ns: float
    answered_rounds_per_s: float  # rounds answered per second over the lock-step run
    stage_mean_ns: dict = field(default_factory=dict)  # stage -> mean ns; they add up to the mean reaction

    @classmethod
    def from_loop(cls, r) -> "QecMeasurement":
        """From a :class:`~qlink.qec.loop.LoopResult` (both sides' shot records joined)."""
        from .qec.timeline import SERVICE_SHOT_FIELDS, ShotRecords, join_shots

        nan = float("nan")
        dec_p50 = dec_p99 = nan
        ctl, svc = r.controller.shot_records, r.service.get("shots")
        if ctl is not None and svc is not None:
            decision = feed_forward_decision_ns(join_shots(ctl, ShotRecords.from_dict(SERVICE_SHOT_FIELDS, svc)))
            if len(decision):
                dec_p50, dec_p99 = (float(v) for v in np.percentile(decision, (50, 99)))
        stages = r.stage_breakdown.get("stages", {})
        return cls(distance=int(r.source.get("distance")), transport=r.transport, num_rounds=int(r.num_rounds),
                   reaction_p50_ns=float(r.reaction_p50_ns), reaction_p99_ns=float(r.reaction_p99_ns),
                   decode_p50_ns=float(stages.get("decode", {}).get("p50_us", nan)) * 1e3,
                   decision_p50_ns=dec_p50, decision_p99_ns=dec_p99,
                   answered_rounds_per_s=float(r.decoded_rounds_per_s),
                   stage_mean_ns={k: float(stages[k]["mean_us"]) * 1e3 for k in _QEC_STAGES if k in stages})


@dataclass(frozen=True)
class KvMeasurement:
    """What the KV transfers of one request size over one transport measured (ns)."""

    preset: str
    tokens: int
    transport: str
    nbytes: int
    num_layers: int
    transfer_p50_ns: float  # whole request: submit -> last layer ready at the receiver, median over repeats
    layer_p50_ns: float  # one layer sent alone: submit -> that layer ready, p50 over the layers sent
    layer_p99_ns: float
    stage_ns: dict = field(default_factory=dict)  # plan / first layer / other layers of the median repeat

    @classmethod
    def from_records(cls, *, preset: str, tokens: int, submits: Sequence, records: Sequence,
                     layer_records: Sequence) -> "KvMeasurement":
        """From the KV engine's own records: the sender's :class:`~qlink.ai.SubmitRecord`
        and the receiver's :class:`~qlink.ai.TransferRecord` of each whole-request repeat,
        and the TransferRecords of requests that each moved one layer."""
        if not records or len(submits) != len(records):
            raise ValueError(f"need one submit record per transfer record, got {len(submits)} and {len(records)}")
        if not layer_records or any(r.num_layers != 1 for r in layer_records):
            raise ValueError("layer_records must be records of one-layer requests (at least one)")
        totals = np.array([rec.submit_to_last_us for rec in records]) * 1e3
        mid = int(np.argsort(totals)[(len(totals) - 1) // 2])
        ready = np.asarray(records[mid].layer_ready_us, dtype=np.float64) * 1e3
        stage_ns = {"plan": float(submits[mid].plan_us) * 1e3, "first layer": float(ready[0]),
                    "other layers": float(ready[-1] - ready[0])}
        one = np.array([r.submit_to_last_us for r in layer_records]) * 1e3
        rec = records[mid]
        return cls(preset=preset, tokens=int(tokens), transport=rec.transport, nbytes=int(rec.nbytes),
                   num_layers=int(rec.num_layers), transfer_p50_ns=float(np.median(totals)),
                   layer_p50_ns=float(np.percentile(one, 50)), layer_p99_ns=float(np.percentile(one, 99)),
                   stage_ns=stage_ns)


def _finite(v) -> bool:
    """A usable time: a finite number >= 0 (a run that recorded nothing leaves nan, and its row out)."""
    return isinstance(v, (int, float)) and math.isfinite(v) and v >= 0


def _qec_lines(m: QecMeasurement) -> list[BudgetLine]:
    d, t = m.distance, m.transport
    out = [assess(Figure(f"QEC d={d} reaction time", v, "measured", t, stat), BUDGETS["qec.reaction"])
           for stat, v in (("p50", m.reaction_p50_ns), ("p99", m.reaction_p99_ns)) if _finite(v)]
    if _finite(m.decode_p50_ns) and m.num_rounds:
        out.append(assess(Figure(f"QEC d={d} decode time per round (one shot per call)",
                                 m.decode_p50_ns / m.num_rounds, "measured", t, "p50"), BUDGETS["qec.cycle"]))
    what = f"QEC d={d} feed-forward decision latency (reaction less the decoder service's work)"
    for stat, v in (("p50", m.decision_p50_ns), ("p99", m.decision_p99_ns)):
        if _finite(v):
            out.append(assess(Figure(what, v, "measured", t, stat), BUDGETS["qec.feedforward"]))
    if _finite(m.answered_rounds_per_s) and m.answered_rounds_per_s > 0:
        out.append(assess(figure_from_rate(f"QEC d={d} time per round answered (lock-step run: 1 / rounds per s)",
                                           per_s=m.answered_rounds_per_s, basis="measured", transport=t),
                          BUDGETS["qec.backlog_rate"]))
    stages = {k: Figure(f"QEC d={d} reaction time, stage {k}", m.stage_mean_ns[k], "measured", t, "mean")
              for k in _QEC_STAGES if _finite(m.stage_mean_ns.get(k))}
    if stages:
        out += stage_lines(stages, BUDGETS["qec.reaction"], total_what=f"QEC d={d} reaction time, sum of stages")
    return out


def _qec_modeled_lines(d: int) -> list[BudgetLine]:
    out = []
    for ln in QEC_MODELED_LINKS:
        rt = modeled_qec_round_trip(ln, distance=d)
        out.append(assess(replace(rt, what=f"QEC d={d} feed-forward round trip over the link (no decode)"),
                          BUDGETS["qec.feedforward"]))
        out.append(assess(replace(rt, what=f"QEC d={d} reaction time, link part only (headroom: time left to "
                                            f"decode)"), BUDGETS["qec.reaction"]))
    return out


def _layer_budget(name: str, tokens: int) -> tuple[Budget, object]:
    from .ai import preset as kv_preset

    spec = kv_preset(name)
    return layer_compute_budget(model=name, num_layers=spec.num_layers, num_tokens=tokens, params=MODEL_PARAMS[name],
                                achieved_flops=PREFILL_ACHIEVED_FLOPS, citation=PREFILL_CITATION), spec


def _kv_lines(m: KvMeasurement) -> list[BudgetLine]:
    layer_budget, _ = _layer_budget(m.preset, m.tokens)
    tok = _tokens_label(m.tokens)
    what = f"{m.preset} KV transfer, {tok} tokens"
    f = Figure(what, m.transfer_p50_ns, "measured", m.transport, "p50")
    out = [assess(f, BUDGETS["ai.ttft"]), assess(f, BUDGETS["ai.kv_transfer"]),
           *(assess(Figure(f"{m.preset} one layer's KV transfer, {tok} tokens (one layer sent alone)", v, "measured",
                           m.transport, stat), layer_budget)
             for stat, v in (("p50", m.layer_p50_ns), ("p99", m.layer_p99_ns)) if _finite(v))]
    stages = {k: Figure(f"{what}, stage {k}", m.stage_ns[k], "measured", m.transport, "median run")
              for k in _KV_STAGES if _finite(m.stage_ns.get(k))}
    if stages:
        out += stage_lines(stages, BUDGETS["ai.ttft"], total_what=f"{what}, sum of stages")
    return out


def _kv_modeled_lines(name: str, tokens: int) -> list[BudgetLine]:
    layer_budget, spec = _layer_budget(name, tokens)
    nbytes = spec.kv_nbytes(num_tokens=tokens)
    tok = _tokens_label(tokens)
    out = []
    for ln in KV_MODELED_LINKS:
        note = _NOT_A_KV_PATH.get(ln, "")
        f = Figure(f"{name} KV transfer, {tok} tokens{note}", LINKS[ln].transfer_time_ns(nbytes), "modeled", ln,
                   "nominal")
        out += [assess(f, BUDGETS["ai.ttft"]), assess(f, BUDGETS["ai.kv_transfer"]),
                assess(Figure(f"{name} one layer's KV transfer, {tok} tokens{note}",
                              LINKS[ln].transfer_time_ns(nbytes // spec.num_layers), "modeled", ln, "nominal"),
                       layer_budget)]
    return out


def build_lines(*, qec: Iterable[QecMeasurement] = (), kv: Iterable[KvMeasurement] = (),
                distances: Iterable[int] = (), presets: Iterable[str] = (), kv_tokens: int = 4096
                ) -> list[BudgetLine]:
    """The table's lines: measured ones from the measurements given, modeled ones for
    ``distances`` and ``presets`` at ``kv_tokens`` from the link catalog alone (so no
    measured input can move a modeled figure). Grouped by distance, then by model.

    >>> lines = build_lines(distances=(5,))
    >>> sorted({ln.transport for ln in lines}) == sorted(QEC_MODELED_LINKS), {ln.basis for ln in lines}
    (True, {'modeled'})
    """
    qec, kv = list(qec), list(kv)
    out: list[BudgetLine] = []
    for d in dict.fromkeys([*distances, *(m.distance for m in qec)]):
        for m in qec:
            if m.distance == d:
                out += _qec_lines(m)
        out += _qec_modeled_lines(d)
    for name in dict.fromkeys([*presets, *(m.preset for m in kv)]):
        for m in kv:
            if m.preset == name:
                out += _kv_lines(m)
        out += _kv_modeled_lines(name, kv_tokens)
    return out


@dataclass
class CrossDomainResult:
    """The table's lines, what could not be measured (``notes``), and the raw results behind them."""

    lines: list[BudgetLine] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    qec: list[dict] = field(default_factory=list)  # per loop run: LoopResult.summary() and the decision latency
    kv: list[dict] = field(default_factory=list)  # per transport: bench-style rows (floor, modeled, measured)
    qec_measurements: list[QecMeasurement] = field(default_factory=list)
    kv_measurements: list[KvMeasurement] = field(default_factory=list)
    vllm: list[dict] = field(default_factory=list)  # per request through real vLLM engines (the vLLM leg)
    vllm_note: str = ""  # what the vLLM leg ran, or why it did not ("" where it was not asked for)

    def rows(self) -> list[dict]:
        """Table rows; each AI row's ``engine`` says what produced it (qlink's KV engine moving
        the blocks with prefill compute modeled, or the real engine of the vLLM leg, whose rows
        stand beside the other AI rows, before the stage rows)."""
        from ._vllm_leg import vllm_rows

        rows = [dict(r, engine=AI_ENGINE if r["domain"] == "ai" else "") for r in budget_rows(self.lines)]
        at = next((i for i, r in enumerate(rows) if r.get("stage")), len(rows))
        rows[at:at] = vllm_rows(self.vllm)
        return rows


def _measure_qec(res: CrossDomainResult, transports: Iterable[str], distances: Iterable[int], *, num_shots: int,
                 seed: int, say: Callable[[str], None]) -> None:
    from .qec.loop import run_loop, source_spec

    for d in distances:
        for t in transports:
            say(f"QEC loop: surface code d={d}, {num_shots} shots in lock-step (each correction applied "
                f"before the next shot) over {t}")
            try:
                r = run_loop(transport=t, source=source_spec(distance=d, p=0.001), num_shots=num_shots,
                             warmup_shots=min(200, num_shots), seed=seed,
                             feed_forward_deadline_ns=int(BUDGETS["qec.reaction"].limit_ns), pin_cpus=True)
                m = QecMeasurement.from_loop(r)
            except Exception as e:  # report and go on: one transport failing must not hide the others
                res.notes.append(f"QEC d={d} over {t}: not measured ({type(e).__name__}: {e})")
                continue
            if not _finite(m.decision_p50_ns):
                res.notes.append(f"QEC d={d} over {t}: no joined shot records, so no feed-forward decision row")
            res.qec_measurements.append(m)
            res.qec.append({**r.summary(), "frame_nbytes": qec_frame_nbytes(num_detectors=_detectors_per_round(d)),
                            "decision_p50_us": m.decision_p50_ns / 1e3, "decision_p99_us": m.decision_p99_ns / 1e3})


def _measure_kv_link(scheme: str, spec, *, tokens: int, repeats: int, max_layer_requests: int = 32):
    """Whole requests (``repeats`` after a warm-up), then one request per layer for up to
    ``max_layer_requests`` layers spread over the model, each moving that layer alone, as a
    layer-wise prefill sends a layer when its compute ends."""
    from .ai.peer import open_link

    ids = np.arange(spec.blocks_for(num_tokens=tokens))
    layers = np.unique(np.linspace(0, spec.num_layers - 1, min(spec.num_layers, max_layer_requests)).round()).astype(int)
    submits, records, layer_records = [], [], []
    with open_link(scheme, spec, seed=0, fill="touch") as (rx, cache, peer):
        for a in cache.layers:  # fault the receiver's pages in before any timing
            a.view(np.uint8).fill(0)
        rid = 0
        for rep in range(repeats + 1):  # the first is a warm-up
            rid += 1
            sub, rec = peer.transfer(rx, rid, ids, ids, timeout_s=600)
            if rep:
                submits.append(sub)
                records.append(rec)
        for layer in layers.tolist():
            rid += 1
            layer_records.append(peer.transfer(rx, rid, ids, ids, layer, timeout_s=600)[1])
    return submits, records, layer_records


def _measure_kv(res: CrossDomainResult, transports: Iterable[str], presets: Iterable[str], *, tokens: int,
                repeats: int, say: Callable[[str], None]) -> None:
    from .ai import preset as kv_preset
    from .ai.peer import transport_unavailable
    from .bench.kv import memcpy_layers_s, modeled_rows

    for name in presets:
        base = kv_preset(name)
        nbytes = base.kv_nbytes(num_tokens=tokens)
        if 2 * nbytes > _KV_MEMORY_BUDGET_NBYTES:
            res.notes.append(f"KV {name}: two caches of {nbytes / 2**30:.1f} GiB exceed "
                             f"{_KV_MEMORY_BUDGET_NBYTES >> 30} GiB; not measured")
            continue
        spec = base.with_blocks(base.blocks_for(num_tokens=tokens))
        say(f"KV transfer: {name}, {tokens} tokens = {nbytes / 2**20:.0f} MiB, over {', '.join(transports)}")
        memcpy_s = memcpy_layers_s(layer_nbytes=nbytes // spec.num_layers, num_layers=spec.num_layers)
        res.kv.append({"preset": name, "case": "numpy memcpy", "basis": "floor", "tokens": tokens, "nbytes": nbytes,
                       "pattern": "per layer", "p50_ms": round(memcpy_s * 1e3, 3),
                       "GBps": round(nbytes / memcpy_s / 1e9, 3)})
        res.kv += [{"preset": name, **r} for r in modeled_rows(nbytes, tokens=tokens, memcpy_GBps=nbytes / memcpy_s / 1e9)]
        for t in transports:
            why = transport_unavailable(t)
            if why:
                res.notes.append(f"KV {name} over {t}: skipped ({why})")
                continue
            try:
                submits, records, layer_records = _measure_kv_link(t, spec, tokens=tokens, repeats=repeats)
                m = KvMeasurement.from_records(preset=name, tokens=tokens, submits=submits, records=records,
                                               layer_records=layer_records)
            except Exception as e:  # one transport failing must not hide the others
                res.notes.append(f"KV {name} over {t}: not measured ({type(e).__name__}: {e})")
                continue
            res.kv_measurements.append(m)
            gbps = m.nbytes / m.transfer_p50_ns
            res.kv.append({"preset": name, "case": f"qlink {t} {submits[0].mode}", "basis": "measured",
                           "tokens": tokens, "nbytes": m.nbytes, "pattern": "contiguous",
                           "p50_ms": float(f"{m.transfer_p50_ns / 1e6:.4g}"), "GBps": float(f"{gbps:.4g}"),
                           "x_memcpy": round(gbps / (nbytes / memcpy_s / 1e9), 3), "num_descs": records[0].num_descs,
                           "transport": m.transport, "layer_p50_ms": float(f"{m.layer_p50_ns / 1e6:.4g}"),
                           "layer_p99_ms": float(f"{m.layer_p99_ns / 1e6:.4g}"),
                           "first_layer_ms": float(f"{m.stage_ns['first layer'] / 1e6:.4g}"), "repeats": repeats})
            say(f"  {name} over {m.transport}: {m.transfer_p50_ns / 1e6:.1f} ms, one layer p50 "
                f"{m.layer_p50_ns / 1e3:.0f} us ({gbps:.2f} GB/s)")


def run_cross_domain(*, transports=("shm", "tcp", "ucx"), distances=(5, 11), presets=("llama-3-8b", "llama-3-70b"),
                     kv_tokens: int = 4096, num_shots: int = 2000, seed: int = 0, kv_repeats: int = 1,
                     vllm_requests: int = 0, vllm_out_dir=None,
                     say: Callable[[str], None] = print) -> CrossDomainResult:
    """Measure both domains on ``transports`` and set every figure against its budget
    (:func:`build_lines`); what could not be measured is said in ``notes``.

    ``vllm_requests`` > 0 also runs the vLLM leg (:func:`qlink._vllm_leg.run_vllm_leg`: that
    many requests through real vLLM engines, the qlink connector over shm between them, in
    the vLLM environment's interpreter; its CSV in ``vllm_out_dir``, a temporary folder
    when None); its rows join the table, and its note (what ran, or why not) ``notes``."""
    res = CrossDomainResult()
    _measure_qec(res, transports, distances, num_shots=num_shots, seed=seed, say=say)
    _measure_kv(res, transports, presets, tokens=kv_tokens, repeats=kv_repeats, say=say)
    if vllm_requests > 0:
        from ._vllm_leg import run_vllm_leg

        res.vllm, res.vllm_note = run_vllm_leg(vllm_out_dir, transport="shm", num_requests=vllm_requests, seed=seed,
                                               say=say)
        say(f"  {res.vllm_note}")
        res.notes.append(res.vllm_note)
    res.lines = build_lines(qec=res.qec_measurements, kv=res.kv_measurements, distances=distances, presets=presets,
                            kv_tokens=kv_tokens)
    return res


def plot_cross_domain(rows: list[dict], path, *, stages: bool = False) -> Path:
    """Draw :func:`qlink._budget_figure.fig_cross_domain` of ``rows`` to ``path`` (PNG, or
    what the suffix names): both domains' figures against their budgets on one log time
    axis; the per-stage panel only with ``stages=True`` (the stage rows stand in the table)."""
    from ._budget_figure import fig_cross_domain

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig_cross_domain(rows, stages=stages).savefig(path, dpi=200)
    return path
