"""The cross-domain budget table: which rows it has, that each row has one basis, and that
no measured input moves a modeled figure; the measurements behind the rows, from the
QEC loop's and the KV engine's own records."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from qlink.ai import SubmitRecord, TransferRecord
from qlink.budget import BUDGETS, Figure
from qlink.crossdomain import (KV_MODELED_LINKS, QEC_MODELED_LINKS, KvMeasurement, QecMeasurement, build_lines,
                               feed_forward_decision_ns, modeled_qec_round_trip, plot_cross_domain)
from qlink.links import LINKS

TRANSPORTS = ("shm", "tcp", "ucx")
STAGES = ("send", "wire_in", "queue", "decode", "respond", "wire_out", "apply")


def _qec(d: int, t: str, *, scale: float = 1.0) -> QecMeasurement:
    return QecMeasurement(distance=d, transport=t, num_rounds=d, reaction_p50_ns=40_000 * scale,
                          reaction_p99_ns=90_000 * scale, decode_p50_ns=5_000 * scale, decision_p50_ns=9_000 * scale,
                          decision_p99_ns=30_000 * scale, answered_rounds_per_s=50_000 / scale,
                          stage_mean_ns={k: (i + 1) * 1_000 * scale for i, k in enumerate(STAGES)})


def _kv(name: str, t: str, *, scale: float = 1.0) -> KvMeasurement:
    layers = {"llama-3-8b": 32, "llama-3-70b": 80}[name]
    per_token = {"llama-3-8b": 131_072, "llama-3-70b": 327_680}[name]
    return KvMeasurement(preset=name, tokens=4096, transport=t, nbytes=4096 * per_token, num_layers=layers,
                         transfer_p50_ns=60e6 * scale, layer_p50_ns=1.5e6 * scale, layer_p99_ns=3e6 * scale,
                         stage_ns={"plan": 0.2e6 * scale, "first layer": 2e6 * scale, "other layers": 58e6 * scale})


def _table(*, scale: float = 1.0):
    qec = [_qec(d, t, scale=scale) for d in (5, 11) for t in TRANSPORTS]
    kv = [_kv(n, t, scale=scale) for n in ("llama-3-8b", "llama-3-70b") for t in TRANSPORTS]
    return build_lines(qec=qec, kv=kv, distances=(5, 11), presets=("llama-3-8b", "llama-3-70b"), kv_tokens=4096)


def _find(lines, *, basis, transport, budget_key=None, what_has="", stat=None, stage=""):
    out = [ln for ln in lines if ln.basis == basis and ln.transport == transport and what_has in ln.what
           and ln.stage == stage and (budget_key is None or ln.budget == BUDGETS[budget_key].name)
           and (stat is None or ln.statistic == stat)]
    return out


def test_the_table_has_every_required_row():
    lines = _table()
    for t in TRANSPORTS:
        for d in (5, 11):
            assert _find(lines, basis="measured", transport=t, budget_key="qec.reaction",
                         what_has=f"QEC d={d} reaction time", stat="p50"), (t, d)
            assert _find(lines, basis="measured", transport=t, budget_key="qec.cycle", what_has=f"QEC d={d} decode"), (t, d)
            assert _find(lines, basis="measured", transport=t, budget_key="qec.feedforward",
                         what_has=f"QEC d={d} feed-forward decision", stat="p50"), (t, d)
            assert _find(lines, basis="measured", transport=t, budget_key="qec.backlog_rate",
                         what_has=f"QEC d={d} time per round answered"), (t, d)
        for name in ("llama-3-8b", "llama-3-70b"):
            assert _find(lines, basis="measured", transport=t, budget_key="ai.ttft",
                         what_has=f"{name} KV transfer, 4k tokens"), (t, name)
            per_layer = [ln for ln in _find(lines, basis="measured", transport=t, what_has=f"{name} one layer's")
                         if ln.budget.startswith("per-layer prefill compute")]
            assert {ln.statistic for ln in per_layer} == {"p50", "p99"}, (t, name)
    for ln_name in ("nvlink4", "pcie5-x16", "ib-ndr", "nvqlink"):
        assert ln_name in LINKS
        for d in (5, 11):
            assert _find(lines, basis="modeled", transport=ln_name, budget_key="qec.feedforward",
                         what_has=f"QEC d={d} "), (ln_name, d)
            assert _find(lines, basis="modeled", transport=ln_name, budget_key="qec.reaction",
                         what_has=f"QEC d={d} "), (ln_name, d)
        for name in ("llama-3-8b", "llama-3-70b"):
            assert _find(lines, basis="modeled", transport=ln_name, budget_key="ai.ttft",
                         what_has=f"{name} KV transfer, 4k tokens"), (ln_name, name)
            assert any(ln.budget.startswith("per-layer prefill compute")
                       for ln in _find(lines, basis="modeled", transport=ln_name, what_has=f"{name} one layer's"))


def test_every_row_has_exactly_one_basis():
    lines = _table()
    for ln in lines:
        assert ln.basis in ("measured", "modeled")
        assert "+" not in ln.transport  # a figure summed over two links or transports would say a+b
        if ln.basis == "modeled":
            assert ln.transport in LINKS and "measured" not in ln.what, ln
        else:
            assert ln.transport in TRANSPORTS and ln.statistic != "nominal", ln
    assert {ln.transport for ln in lines if ln.basis == "modeled"} == set(QEC_MODELED_LINKS) | set(KV_MODELED_LINKS)


def test_no_measured_input_moves_a_modeled_figure():
    before, after = _table(scale=1.0), _table(scale=7.0)  # every measured time 7x (decode time among them)
    modeled = lambda lines: [ln for ln in lines if ln.basis == "modeled"]  # noqa: E731
    assert modeled(before) == modeled(after) and modeled(before)
    measured_before = [ln.value_ns for ln in before if ln.basis == "measured"]
    measured_after = [ln.value_ns for ln in after if ln.basis == "measured"]
    assert measured_after != measured_before  # the change did reach the measured rows
    # and the modeled rows are the catalog's numbers: a link round trip, no decode in it
    rt = [ln for ln in modeled(before) if ln.transport == "nvqlink" and "QEC d=5" in ln.what]
    assert {ln.value_ns for ln in rt} == {modeled_qec_round_trip("nvqlink", distance=5).value_ns}


def test_the_modeled_round_trip_is_a_sum_of_modeled_parts_only():
    m = LINKS["ib-ndr"]
    f = modeled_qec_round_trip("ib-ndr", distance=11)
    frame = 24 + 32 + (11 * 11 - 1 + 7) // 8
    assert f.basis == "modeled" and f.transport == "ib-ndr"
    assert f.value_ns == pytest.approx(m.transfer_time_ns(frame) + 41 / m.bandwidth_Bps * 1e9 + m.transfer_time_ns(25))
    with pytest.raises(ValueError, match="never mix"):  # adding a measured decode time to it is refused
        f + Figure("decode", 5_000, basis="measured", transport="shm")


def test_stage_rows_are_measured_and_add_up_with_cumulative_headroom():
    lines = _table()
    stages = [ln for ln in lines if ln.stage]
    assert stages and all(ln.basis == "measured" for ln in stages)
    shm5 = [ln for ln in stages if ln.transport == "shm" and ln.what.startswith("QEC d=5 ")]
    assert [ln.stage for ln in shm5] == [*STAGES, "total"]
    assert shm5[-1].value_ns == sum(ln.value_ns for ln in shm5[:-1]) == 28_000
    assert shm5[3].share == pytest.approx(4_000 / 63_000)  # decode alone
    assert shm5[3].headroom_ns == pytest.approx(63_000 - (1 + 2 + 3 + 4) * 1_000)  # after send..decode
    kv = [ln for ln in stages if ln.transport == "tcp" and ln.what.startswith("llama-3-70b")]
    assert [ln.stage for ln in kv] == ["plan", "first layer", "other layers", "total"]
    assert kv[-1].value_ns == pytest.approx(60.2e6) and kv[-1].budget == BUDGETS["ai.ttft"].name


def test_backlog_row_is_the_time_per_round_answered():
    lines = build_lines(qec=[_qec(5, "shm")])
    (row,) = [ln for ln in lines if ln.budget == BUDGETS["qec.backlog_rate"].name]
    assert row.value_ns == pytest.approx(1e9 / 50_000) and row.limit_ns == 1_100 and not row.within


def test_figures_a_run_did_not_record_leave_their_rows_out():
    m = replace(_qec(5, "tcp"), decision_p50_ns=float("nan"), decision_p99_ns=float("nan"),
                reaction_p99_ns=float("nan"), stage_mean_ns={**_qec(5, "tcp").stage_mean_ns, "apply": -5.0})
    lines = build_lines(qec=[m])
    assert not [ln for ln in lines if "decision" in ln.what]
    reaction = [ln for ln in lines if ln.what == "QEC d=5 reaction time" and ln.basis == "measured"]
    assert [ln.statistic for ln in reaction] == ["p50"]
    assert [ln.stage for ln in lines if ln.stage] == [*STAGES[:-1], "total"]  # a negative stage time is left out


def test_feed_forward_decision_leaves_out_the_service_work():
    rng = np.random.default_rng(3)
    st = {k: rng.integers(0, 50_000, 100) for k in (*STAGES, "ring_wait")}
    st["ring_wait"] = np.minimum(st["ring_wait"], st["wire_in"])
    st["reaction"] = sum(st[k] for k in STAGES)
    dec = feed_forward_decision_ns(st)
    assert np.array_equal(dec, st["send"] + st["wire_in"] - st["ring_wait"] + st["wire_out"] + st["apply"])
    st2 = dict(st, decode=st["decode"] * 10, reaction=st["reaction"] + st["decode"] * 9)
    assert np.array_equal(feed_forward_decision_ns(st2), dec)  # a slower decoder leaves the decision latency alone


def _transfer(rid, ready_us, *, layers=None, nbytes=1 << 20):
    n = len(ready_us)
    return TransferRecord(request_id=rid, nbytes=nbytes * n, num_descs=n, num_layers=n, transport="shm", mode="put",
                          submit_to_last_us=float(max(ready_us)), layer_ready_us=tuple(ready_us))


def _submit(rid, plan_us):
    return SubmitRecord(request_id=rid, nbytes=0, num_descs=1, num_layers=4, transport="shm", mode="put",
                        plan_us=plan_us, submit_us=1.0, us_per_block=0.1)


def test_kv_measurement_comes_from_the_engine_records():
    records = [_transfer(1, [100, 200, 300, 400]), _transfer(2, [50, 900, 950, 1000]), _transfer(3, [80, 150, 220, 600])]
    submits = [_submit(1, 10), _submit(2, 20), _submit(3, 30)]
    layers = [_transfer(10 + i, [v]) for i, v in enumerate([90, 110, 100, 400, 95])]
    m = KvMeasurement.from_records(preset="llama-3-8b", tokens=4096, submits=submits, records=records,
                                   layer_records=layers)
    assert m.transfer_p50_ns == 600e3  # the median repeat: request 3
    assert m.stage_ns == {"plan": 30e3, "first layer": 80e3, "other layers": 520e3}
    assert m.layer_p50_ns == 100e3 and m.layer_p99_ns > 300e3
    assert m.num_layers == 4 and m.nbytes == 4 << 20
    with pytest.raises(ValueError, match="one-layer"):
        KvMeasurement.from_records(preset="llama-3-8b", tokens=4096, submits=submits, records=records,
                                   layer_records=records)
    with pytest.raises(ValueError, match="one submit record"):
        KvMeasurement.from_records(preset="llama-3-8b", tokens=4096, submits=submits[:1], records=records,
                                   layer_records=layers)


@pytest.mark.timeout(120)
def test_qec_measurement_from_a_real_loop():
    from qlink.qec.loop import run_loop, source_spec
    from qlink.qec.timeline import SERVICE_SHOT_FIELDS, ShotRecords, join_shots

    r = run_loop(transport="inproc", source=source_spec(distance=3, p=0.001), num_shots=40, warmup_shots=5, seed=1,
                 feed_forward_deadline_ns=63_000)
    m = QecMeasurement.from_loop(r)
    st = join_shots(r.controller.shot_records, ShotRecords.from_dict(SERVICE_SHOT_FIELDS, r.service["shots"]))
    assert len(st["reaction"]) == 40
    assert m.decision_p50_ns == pytest.approx(np.percentile(feed_forward_decision_ns(st), 50))
    # its own figure: the reaction time less the service's work, so below the reaction time
    assert m.decision_p50_ns < np.percentile(st["reaction"], 50)
    assert m.distance == 3 and m.num_rounds == r.num_rounds and set(m.stage_mean_ns) == set(STAGES)
    assert sum(m.stage_mean_ns.values()) == pytest.approx(np.mean(st["reaction"]), rel=1e-6)
    assert m.answered_rounds_per_s == r.decoded_rounds_per_s > 0


def test_the_plot_leaves_stage_rows_out_unless_asked(tmp_path):
    from qlink.budget import budget_rows

    rows = budget_rows(_table())
    small = plot_cross_domain(rows, tmp_path / "a.png")
    big = plot_cross_domain(rows, tmp_path / "b.png", stages=True)
    from matplotlib.image import imread

    assert imread(str(small)).shape[0] < imread(str(big)).shape[0]  # fewer bars, a shorter figure


def test_the_vllm_legs_rows_stand_with_the_ai_rows_before_the_stage_rows_and_name_their_engine():
    from qlink._vllm_leg import ENGINE
    from qlink.crossdomain import AI_ENGINE, CrossDomainResult

    reqs = [dict(transport="shm", prompt_tokens=n, prefill_ms=p, decode_ttft_ms=t, transfer_ms=x, loaded=True,
                 tokens_match=True) for n, p, t, x in ((100, 20.0, 9.0, 0.4), (300, 40.0, 11.0, 0.8))]
    plain = CrossDomainResult(lines=_table()).rows()
    rows = CrossDomainResult(lines=_table(), vllm=reqs).rows()
    assert len(rows) == len(plain) + 3
    engines = [r["engine"] for r in rows]
    first, last = engines.index(ENGINE), len(engines) - 1 - engines[::-1].index(ENGINE)
    assert last - first == 2 and all(not r["stage"] for r in rows[:last + 1])  # together, before any stage row
    assert rows[last + 1]["stage"]  # the stage rows follow
    assert {r["engine"] for r in rows if r["domain"] == "ai"} == {AI_ENGINE, ENGINE}
    assert {r["engine"] for r in rows if r["domain"] == "qec"} == {""}


def test_asking_for_the_vllm_leg_without_its_environment_says_why_and_measures_the_rest(tmp_path, monkeypatch):
    from qlink.crossdomain import run_cross_domain

    monkeypatch.setenv("QLINK_VLLM_PYTHON", str(tmp_path / "no-such-venv" / "bin" / "python"))
    said = []
    res = run_cross_domain(transports=("shm",), distances=(3,), presets=("llama-3-8b",), kv_tokens=16, num_shots=20,
                           vllm_requests=2, say=said.append)
    assert res.vllm == [] and res.vllm_note.startswith("vLLM leg skipped") and res.vllm_note in res.notes
    assert any(res.vllm_note in s for s in said)
    assert any(r["domain"] == "qec" and r["basis"] == "measured" for r in res.rows())
