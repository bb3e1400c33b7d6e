"""The fabric model: exact where queueing theory is exact, deterministic with a seed,
and close to the real loop that runs on this machine."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from qlink import wire
from qlink.fabric import (
    EmpiricalDistribution,
    EventLoop,
    FabricConfig,
    ServiceTimes,
    measure_service_times,
    round_frame_nbytes,
    shot_frames,
    simulate,
)
from qlink.fabric._validate import (
    DEFAULT_TOLERANCE_ABS_NS,
    DEFAULT_TOLERANCE_REL,
    validate_against_loop,
)
from qlink.links import LINKS, LinkModel, link

# A link whose every number is an integer number of ns (1 byte per ns), so sums are exact in floats.
EXACT = LinkModel("exact", latency_ns=1_000, bandwidth_Bps=1e9, overhead_ns=200)


def _cfg(**kw) -> FabricConfig:
    base = dict(num_controllers=1, link=EXACT, service=ServiceTimes.constant(3_000), distance=3, rounds=3,
                cycle_ns=1_000, num_shots=50)
    base.update(kw)
    return FabricConfig(**base)


# ----------------------------------------------------------------------------- layout
@pytest.mark.parametrize("distance", [3, 5])
def test_frames_match_the_stim_memory_the_loop_plays(distance):
    from qlink.qec.loop import build_source, source_spec

    src = build_source(source_spec(distance=distance, rounds=distance, p=0.001))
    per_round = np.bincount(np.asarray(src.round_of_detector))
    frames = shot_frames(distance, distance)
    assert [f.num_bits for f in frames] == per_round.tolist()
    assert [f.nbytes for f in frames] == [wire.enqueue_syndromes_nbytes(int(n)) for n in per_round]
    whole = shot_frames(distance, distance, rounds_per_frame=0)
    assert len(whole) == 1 and whole[0].num_bits == src.dem.num_detectors
    assert round_frame_nbytes(distance) == 24 + 32 + (distance * distance - 1 + 7) // 8


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("poll", [False, True])
@pytest.mark.parametrize("shared_port", [False, True])
def test_zero_jitter_and_constant_service_give_the_analytic_reaction_time(poll, shared_port):
    cfg = _cfg(num_controllers=4, num_decoders=4, poll=poll, shared_port=shared_port)
    res = simulate(cfg, seed=3)
    last = shot_frames(3, 3)[-1].nbytes
    answer = wire.corrections_nbytes(1)
    wire_in = EXACT.overhead_ns + last + EXACT.latency_ns  # 1 byte per ns
    wire_out = EXACT.overhead_ns + answer + EXACT.latency_ns
    expected = wire_in + 3_000 + wire_out
    assert res.shots_answered == 4 * 50
    assert np.all(res.reaction_ns == expected)
    assert res.reaction_p50_ns == res.reaction_p999_ns == expected
    assert np.all(res.stages_ns["wire_in"] == wire_in) and np.all(res.stages_ns["queue"] == 0)
    assert np.all(res.stages_ns["decode"] == 3_000) and np.all(res.stages_ns["wire_out"] == wire_out)
    assert res.stable and res.queue_max_shots <= 4


def test_overloaded_single_decoder_queue_grows_by_the_deficit_every_shot():
    # D/D/1: a shot every 4 cycles (4000 ns), each taking 5000 ns to decode one at a time:
    # shot k waits k * 1000 ns.
    res = simulate(_cfg(service=ServiceTimes.constant(5_000), batch_size=1), seed=0)
    k = np.arange(50)
    assert np.array_equal(res.stages_ns["queue"], k * 1_000.0)
    assert not res.stable
    assert res.queue_slope_shots_per_s == pytest.approx(1e9 * (1 / 4_000 - 1 / 5_000), rel=0.1)


def test_shared_port_serializes_an_incast_in_arrival_order():
    slow = LinkModel("slow", latency_ns=1_000, bandwidth_Bps=1e9 / 100 * 57)  # one 57-byte frame: 100 ns
    kw = dict(num_controllers=5, num_decoders=1, link=slow, distance=3, rounds=3, rounds_per_frame=0, phase="aligned",
              service=ServiceTimes.constant(10), cycle_ns=10_000, num_shots=3)
    frame = shot_frames(3, 3, rounds_per_frame=0)[0].nbytes
    ser = frame / slow.bandwidth_Bps * 1e9
    shared = simulate(FabricConfig(**kw, shared_port=True), seed=0).stages_ns["wire_in"]
    alone = simulate(FabricConfig(**kw, shared_port=False), seed=0).stages_ns["wire_in"]
    np.testing.assert_allclose(np.sort(alone), np.full(15, 1_000 + ser))
    np.testing.assert_allclose(np.sort(shared), np.sort(np.tile(1_000 + ser * np.arange(1, 6), 3)))


# ----------------------------------------------------------------------------- load
@pytest.mark.parametrize("load", [0.8, 1.25])
def test_backlog_is_bounded_below_capacity_and_grows_above_it(load):
    # 10 controllers, one decoder, one shot per call. Offered load = N x (service time per round)
    # / cycle = N x S / (4 rounds x 1000 ns): the queue is bounded below 1 and grows above it.
    n, period = 10, 4 * 1_000
    service_ns = load * period / n
    res = simulate(_cfg(num_controllers=n, service=ServiceTimes.constant(service_ns), batch_size=1,
                        num_shots=300), seed=1)
    assert res.utilization_bound == pytest.approx(load)
    if load < 1:
        assert res.stable
        assert res.queue_max_shots <= n
        assert res.reaction_p99_ns < 5 * period
    else:
        assert not res.stable
        growth = n / period - 1 / service_ns  # shots per ns
        assert res.queue_slope_shots_per_s == pytest.approx(growth * 1e9, rel=0.15)
        assert res.queue_max_shots > 50


def test_batching_keeps_up_where_one_shot_per_call_cannot():
    svc = ServiceTimes.linear(fixed_ns=6_000, per_shot_ns=300)
    one = simulate(_cfg(num_controllers=8, service=svc, batch_size=1, num_shots=200), seed=2)
    many = simulate(_cfg(num_controllers=8, service=svc, batch_size=64, num_shots=200), seed=2)
    assert not one.stable and many.stable
    assert many.mean_batch > 1 and many.reaction_p99_ns < one.reaction_p99_ns


def test_littles_law_holds_on_the_decoder_queue():
    cfg = FabricConfig(num_controllers=40, num_decoders=4, link=link("roce-400g"), distance=5,
                       service=ServiceTimes.linear(fixed_ns=4_000, per_shot_ns=900), batch_size=32, num_shots=150)
    res = simulate(cfg, seed=5)
    lit = res.little
    assert lit["rel_err"] < 1e-9  # time-average queue (integrated) == throughput x mean sojourn
    assert lit["L_shots"] == pytest.approx(lit["lambda_shots_per_ns"] * lit["W_ns"], rel=1e-9)
    # and the sampled queue over the emission window agrees with the integrated average
    assert float(np.mean(res.queue_shots[len(res.queue_shots) // 4:])) == pytest.approx(lit["L_shots"], rel=0.25)


# ----------------------------------------------------------------------------- determinism
def test_same_seed_same_result_other_seed_other_result():
    cfg = FabricConfig(num_controllers=30, num_decoders=3, link=link("tcp-100g"), distance=5, num_shots=40,
                       service=ServiceTimes({1: [5_000, 6_000, 9_000], 8: [9_000, 10_000, 20_000]}), batch_size=8)
    a, b, c = simulate(cfg, seed=11), simulate(cfg, seed=11), simulate(cfg, seed=12)
    assert np.array_equal(a.reaction_ns, b.reaction_ns)
    ra, rb = a.row(), b.row()
    ra.pop("sim_wall_s"), rb.pop("sim_wall_s")
    assert ra == rb
    assert not np.array_equal(a.reaction_ns, c.reaction_ns)


def test_lost_messages_are_accounted_for():
    lossy = LinkModel("lossy", latency_ns=1_000, bandwidth_Bps=1e9, loss=0.05)
    for poll in (False, True):
        res = simulate(_cfg(link=lossy, num_controllers=5, num_shots=100, poll=poll), seed=4)
        assert res.shots_dropped > 0 and res.corrections_lost > 0
        assert res.shots_answered + res.shots_dropped + res.corrections_lost == 5 * 100


def test_rows_are_modeled_and_name_their_inputs():
    st = measure_service_times(3, 0.001, (1, 4), repeats=4)
    res = simulate(FabricConfig(num_controllers=2, link=link("ib-ndr"), service=st, distance=3, num_shots=20,
                                batch_size=4), seed=0)
    row = res.row()
    assert row["basis"] == "modeled" and row["fabric"] == "ib-ndr"
    assert row["service_kind"] == "measured" and row["service_decoder"] == "pymatching"
    assert row["service_distance"] == 3 and row["service_measured_at"] and row["service_host"] is not None
    assert row["link_citation"] == LINKS["ib-ndr"].citation
    assert np.all(st.samples_ns(4) > 0)
    assert st.source["num_detectors"] == 24


# ----------------------------------------------------------------------------- inputs
def test_service_times_interpolate_and_round_trip():
    st = ServiceTimes({1: [1_000, 3_000], 3: [2_000, 6_000]}, source={"kind": "measured", "where": "here"})
    assert st.sample_ns(2, 0.0) == 1_500 and st.sample_ns(2, 0.9) == 4_500
    assert st.sample_ns(5, 0.0) == 3_000  # extrapolated with the per-shot slope
    assert ServiceTimes.from_dict(st.to_dict()).sample_ns(2, 0.9) == 4_500
    assert st.best_per_shot_ns(3) == (2_000, 3)  # medians: 3000 at one shot, 6000 at three


def test_a_measured_link_draws_its_samples():
    d = EmpiricalDistribution.from_samples("m", [10_000, 20_000, 30_000])
    res = simulate(_cfg(link=d, downlink=EXACT, num_shots=200, shot_correlated=True), seed=0)
    out = EXACT.overhead_ns + wire.corrections_nbytes(1) + EXACT.latency_ns
    # reaction = one of the three uplink samples + 3000 decode (no queue: shots are 4000 ns apart
    # and the decode takes 3000) + the catalog downlink
    assert set(np.unique(res.stages_ns["wire_in"]).tolist()) <= {10_000.0, 20_000.0, 30_000.0}
    assert set(np.unique(res.reaction_ns - res.stages_ns["queue"]).tolist()) <= {
        v + 3_000 + out for v in (10_000.0, 20_000.0, 30_000.0)}


@pytest.mark.parametrize("bad, err", [
    (dict(num_controllers=0), ValueError),
    (dict(num_decoders=0), ValueError),
    (dict(phase="sideways"), ValueError),
    (dict(link="nvqlink"), TypeError),
    (dict(service=3_000), TypeError),
    (dict(warmup_shots=50), ValueError),
    (dict(cycle_ns=0), ValueError),
    (dict(distance=1), ValueError),
    (dict(ingest=-1), ValueError),
])
def test_bad_configs_are_refused_with_a_reason(bad, err):
    with pytest.raises(err):
        _cfg(**bad)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least one sample"):
        EmpiricalDistribution.from_samples("x", [])
    with pytest.raises(ValueError, match=">= 0"):
        EmpiricalDistribution.from_samples("x", [-5])
    with pytest.raises(ValueError, match="batch sizes"):
        ServiceTimes({0: [1]})
    with pytest.raises(ValueError):
        ServiceTimes({})
    loop = EventLoop()
    loop.schedule(10.0, lambda a: None)
    loop.run()
    with pytest.raises(ValueError, match="before the current time"):
        loop.schedule(5.0, lambda a: None)


# ----------------------------------------------------------------------------- the real loop
@pytest.mark.timeout(240)
def test_prediction_matches_the_real_loop_p50():
    """One controller and one decoder service over shm on this machine. The model gets the
    loop's measured one-way times and message-reading cost and decode times measured
    offline; it must predict the loop's reaction-time p50 within 35 % (or 15 µs): two
    busy-polling processes on a shared 2-core machine move the loop's own p50 by tens of
    percent from run to run.

    A host that takes the cores away mid-run (the controller's clock then falls ms behind,
    ``clock_on_time`` false) makes one real loop unlike the model's inputs drawn from it, so
    the loop is run up to three times with fresh seeds; a model that is wrong misses all three."""
    tries = []
    for attempt in range(3):
        v = validate_against_loop(transport="shm", distance=3, p=0.001, cycle_ns=10_000, rounds_per_frame=0,
                                  num_shots=400, warmup_shots=100, seed=1 + attempt)
        assert v.transport == "shm"
        assert v.tolerance_rel == DEFAULT_TOLERANCE_REL and v.tolerance_abs_ns == DEFAULT_TOLERANCE_ABS_NS
        assert math.isfinite(v.predicted_p50_ns) and v.measured_p50_ns > 0
        assert v.model.basis == "modeled" and v.inputs["uplink"]["source"]["kind"] == "measured"
        assert v.inputs["service"]["source"]["kind"] == "measured"
        tries.append(v)
        if v.within:
            break
    assert tries[-1].within, "; ".join(
        f"predicted p50 {v.predicted_p50_ns / 1e3:.1f} us vs measured {v.measured_p50_ns / 1e3:.1f} us "
        f"(allowed +/- {v.allowed_ns / 1e3:.1f} us, clock on time: {v.loop_summary.get('clock_on_time')})"
        for v in tries)


# ----------------------------------------------------------------------------- the scenario
@pytest.mark.timeout(120)
def test_scenario_sweep_writes_modeled_rows_and_plots(tmp_path):
    from qlink.scenarios import fabric_scale

    svc = ServiceTimes.linear(fixed_ns=5_000, per_shot_ns=700, note="test")
    rep = fabric_scale.run(out=tmp_path, fabrics=("nvqlink", "tcp-100g"), controllers=(1, 10), decoders=("2",),
                           shots=20, service=svc, validate=False, progress=False)
    assert len(rep["rows"]) == 4
    with open(tmp_path / "fabric_scale.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["fabric"] for r in rows} == {"nvqlink", "tcp-100g"}
    assert all(r["basis"] == "modeled" and r["service_kind"] == "assumed" for r in rows)
    assert [int(r["num_decoders"]) for r in rows] == [1, 2, 1, 2]
    for name in ("fabric_scale.png", "fabric_backlog.png"):
        assert (tmp_path / name).stat().st_size > 1000
    saved = json.loads((tmp_path / "service_times.json").read_text())
    assert ServiceTimes.from_dict(saved).sample_ns(3, 0.5) == 5_000 + 3 * 700
    with pytest.raises(ValueError, match="N/k"):
        fabric_scale.decoders_for("lots", 10)
