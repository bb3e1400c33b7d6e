"""The closed loop: controller -> transport -> decoder service (another process) -> controller.

Corrections that travel the wire must be bit-identical to the same decoder called
directly on the same shots, on every transport and for every decoder that runs here;
below threshold the logical error rate through the loop falls with the distance.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import transports
from qlink.qec.controller import SyndromeStream, ler_under_deadline, wilson_interval
from qlink.qec.decoders import BUILT_IN_DECODERS, compile_decoder
from qlink.qec.loop import build_source, run_loop, sample_stream, source_spec
from qlink.qec import start_service_process

pytestmark = pytest.mark.timeout(240)


def _transports():
    out = [pytest.param("inproc", id="inproc"), pytest.param("shm", id="shm"), pytest.param("tcp", id="tcp")]
    ucx = importlib.util.find_spec("ucxx") is not None
    out.append(pytest.param("ucx", id="ucx", marks=[pytest.mark.slow] + ([] if ucx else [
        pytest.mark.skip(reason="ucxx is not installed (pip install 'qlink[ucx]')")])))
    return out


def _decoders():
    out = []
    for name, dec in sorted(BUILT_IN_DECODERS.items()):
        reason = dec.unavailable_reason()
        if name == "chromobius":  # colour codes only (4th detector coordinate); the loop's sources are surface codes
            reason = "chromobius decodes colour codes; tests/qec/test_decoders.py runs it on one"
        out.append(pytest.param(name, id=name, marks=[pytest.mark.skip(reason=reason)] if reason else []))
    return out


def _direct(spec, stream, decoder="pymatching"):
    src = build_source(spec)
    packed = np.packbits(stream.detectors, axis=1, bitorder="little")
    return np.asarray(compile_decoder(decoder, src.dem).decode_shots_bit_packed(packed))


@pytest.mark.parametrize("transport", _transports())
def test_corrections_through_the_loop_are_bit_identical(transport):
    spec = source_spec(distance=3, rounds=3, p=0.01)
    stream = sample_stream(build_source(spec), num_shots=300, seed=11)
    res = run_loop(transport=transport, source=spec, stream=stream, num_shots=300, rounds_per_frame=1,
                   warmup_shots=20, max_in_flight_shots=128, timeout_s=120)
    assert res.transport == transports.capabilities(transport).name
    assert res.shots_ok == 300 and res.shots_dropped == 0
    expected = _direct(spec, stream)
    assert expected.any(), "the sample should exercise non-trivial corrections"
    assert np.array_equal(res.controller.corrections, expected)
    truth = np.packbits(stream.observables, axis=1, bitorder="little")
    assert res.logical_errors == int((expected != truth).any(axis=1).sum())
    # the service decoded the warm-up shots too, and only answered shots
    assert res.service["counts"]["shots_decoded"] == 320


@pytest.mark.parametrize("decoder", _decoders())
def test_every_decoder_that_runs_here_gives_the_same_bits_over_the_wire(decoder):
    spec = source_spec(distance=3, rounds=3, p=0.01)
    stream = sample_stream(build_source(spec), num_shots=120, seed=5)
    res = run_loop(transport="inproc", source=spec, stream=stream, num_shots=120, decoder=decoder,
                   rounds_per_frame=0, warmup_shots=0, max_in_flight_shots=64, timeout_s=180)
    assert res.decoder == decoder and res.shots_ok == 120
    assert np.array_equal(res.controller.corrections, _direct(spec, stream, decoder))


def test_many_shots_per_frame_give_the_same_bits_in_fewer_decoder_calls():
    spec = source_spec(distance=3, rounds=3, p=0.01)
    stream = sample_stream(build_source(spec), num_shots=1000, seed=8)
    res = run_loop(transport="shm", source=spec, stream=stream, num_shots=1000, rounds_per_frame=0,
                   shots_per_frame=64, warmup_shots=0, max_in_flight_shots=256, timeout_s=120)
    assert res.shots_ok == 1000 and res.shots_per_frame == 64
    assert np.array_equal(res.controller.corrections, _direct(spec, stream))
    counts = res.service["counts"]
    assert counts["enqueue"] == 16 and counts["get_corrections"] == 16  # 15 x 64 shots + 40
    assert counts["decode_calls"] <= 16
    # a shot waits for its frame's later shots: that wait is its own stage, not transport
    st = res.stage_breakdown["stages"]
    assert st["batch"]["mean_us"] > 0 and res.shares["batch"] > 0
    assert res.stage_breakdown["n"] == 1000  # every shot joined to its frame's service row
    assert sum(res.shares.values()) == pytest.approx(1.0, abs=1e-9)
    # the first shot of a full frame waits 63 shots x 4 rounds x 1.1 us for the last one
    first = res.controller.shot_records[0]
    assert first["frame_due_ns"] - first["emit_last_ns"] == 63 * 4 * 1100


def test_answers_cover_many_shots_only_while_the_decoder_is_behind():
    spec = source_spec(distance=3, rounds=3, p=0.01)
    stream = sample_stream(build_source(spec), num_shots=600, seed=12)
    # flat out with one shot per frame and one ask outstanding: asks pile up behind it, so
    # each answer carries every shot sent meanwhile (up to 32)
    res = run_loop(transport="shm", source=spec, stream=stream, num_shots=600, rounds_per_frame=0, cycle_ns=1,
                   warmup_shots=0, max_in_flight_shots=128, timeout_s=120,
                   controller_options={"max_gets_in_flight": 1, "get_window_shots": 32})
    assert res.shots_ok == 600 and np.array_equal(res.controller.corrections, _direct(spec, stream))
    counts = res.service["counts"]
    assert counts["enqueue"] == 600 and counts["get_corrections"] < 600
    assert res.controller.shot_records["polls"].sum() == counts["get_corrections"]
    # an answer spanning several frames keeps one service row per frame: every shot still joins
    assert res.stage_breakdown["n"] == 600 and len(res.service["shots"]["shots"]) == 600
    # when every answer is back before the next shot (lock-step), every shot gets its own ask
    slow = run_loop(transport="shm", source=spec, stream=stream, num_shots=50, rounds_per_frame=0,
                    feed_forward_deadline_ns=10**10, warmup_shots=0, timeout_s=120,
                    controller_options={"max_gets_in_flight": 1, "get_window_shots": 32})
    assert slow.service["counts"]["get_corrections"] == 50 and slow.shots_ok == 50


def test_a_full_decoder_queue_drops_shots_and_every_shot_is_accounted_for():
    spec = source_spec(distance=3, rounds=3, p=0.01)
    stream = sample_stream(build_source(spec), num_shots=1500, seed=9)
    res = run_loop(transport="shm", source=spec, stream=stream, num_shots=1500, rounds_per_frame=0,
                   shots_per_frame=32, cycle_ns=1, capacity_shots=96, warmup_shots=0, timeout_s=120)
    assert res.shots_dropped > 0, "a controller at full speed should overrun a 96-shot queue"
    assert res.shots_ok + res.shots_dropped == 1500
    answered = res.controller.correct >= 0
    assert np.array_equal(res.controller.corrections[answered], _direct(spec, stream)[answered])
    assert res.service["counts"]["shots_dropped"] == res.shots_dropped
    assert res.controller.statuses.get("enqueue.BUSY", 0) > 0


def test_frames_and_requests_lost_on_a_lossy_link_are_dropped_shots_never_wrong_ones():
    import os

    spec = source_spec(distance=3, rounds=3, p=0.01)
    stream = sample_stream(build_source(spec), num_shots=500, seed=4)
    # the controller's sends (syndrome frames and get_corrections) cross a modeled link losing 2 %
    res = run_loop(transport=f"emulated+shm://qlink-lossy-{os.getpid()}?link=nvqlink", source=spec, stream=stream,
                   num_shots=500, rounds_per_frame=1, warmup_shots=0, max_in_flight_shots=64, timeout_s=120,
                   controller_query="drop=0.02&seed=5", controller_options={"get_timeout_ns": 20_000_000})
    assert res.transport.startswith("emulated") and res.basis == "modeled"
    assert res.shots_dropped > 0 and res.shots_ok + res.shots_dropped == 500
    answered = res.controller.correct >= 0
    assert np.array_equal(res.controller.corrections[answered], _direct(spec, stream)[answered])
    assert res.service["counts"]["frames_lost"] > 0


def test_loop_result_reports_stages_backlog_and_ler_under_a_deadline():
    spec = source_spec(distance=3, rounds=3, p=0.01)
    # the Python engine's report (its service stages: parse, residence ...); the native engine's: test_hotpath
    res = run_loop(transport="tcp", source=spec, num_shots=400, seed=2, rounds_per_frame=2, warmup_shots=20,
                   timeout_s=120, engine="python")
    assert res.transport == "tcp" and res.num_shots == 400 and res.frames_per_shot == 2 and res.engine == "python"
    assert 0 < res.reaction_p50_ns <= res.reaction_p99_ns <= res.reaction_p999_ns
    shares = res.shares
    assert set(shares) == {"batch", "transport", "queue", "decode", "other"}
    assert shares["batch"] == 0  # one shot per frame: no shot waits for a later one
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-9)
    assert all(v >= 0 for k, v in res.stage_breakdown["stages"].items() if k != "apply" for v in [v["mean_us"]])
    assert res.stage_breakdown["n"] == 400  # every shot joined between the two sides
    t, backlog = res.backlog_trace
    assert len(t) == len(backlog) > 1 and np.all(np.diff(t) >= 0) and backlog[-1] == 0
    deadlines = np.array([0, res.reaction_p50_ns, 10**12])
    ler_t = res.ler_at(deadlines)
    assert ler_t[0] == 1.0 and ler_t[2] == pytest.approx(res.logical_error_rate)
    assert np.all(np.diff(ler_t) <= 0)
    assert res.required_rounds_per_s == pytest.approx(1e9 / 1100)
    summary = res.summary()
    assert summary["transport"] == "tcp" and summary["shots"] == 400
    # keeping up needs a flat backlog and rounds answered at the cycle rate; the controller's
    # own tick jitter is reported apart
    assert res.keeps_up == (res.backlog_flat and res.decoded_rounds_per_s >= 0.99 * res.required_rounds_per_s)
    frame_ns = res.cycle_ns * res.num_rounds * max(1, res.shots_per_frame) / max(1, res.frames_per_shot)
    assert res.clock_on_time == (res.emit_lag_p99_ns <= frame_ns)
    assert summary["clock_on_time"] == res.clock_on_time
    svc = res.service_stage_summary()
    assert {"decode", "queue", "residence"} <= set(svc)


def test_feed_forward_waits_for_each_correction_and_counts_missed_deadlines():
    spec = source_spec(distance=3, rounds=3, p=0.01)
    tight = run_loop(transport="shm", source=spec, num_shots=60, seed=3, rounds_per_frame=0, warmup_shots=5,
                     feed_forward_deadline_ns=1, timeout_s=60)
    assert tight.deadline_misses == 60  # no decoder answers within 1 ns
    loose = run_loop(transport="inproc", source=spec, num_shots=60, seed=3, rounds_per_frame=0, warmup_shots=5,
                     feed_forward_deadline_ns=10**10, timeout_s=60)
    assert loose.deadline_misses == 0
    # lock-step: never more than one shot in flight, so the backlog never exceeds one shot
    assert loose.backlog_max_rounds <= loose.num_rounds
    assert loose.logical_errors == tight.logical_errors  # same shots, same decoder


@pytest.mark.slow
def test_below_threshold_the_ler_through_the_loop_falls_with_distance():
    # p = 0.001, well below this noise model's ~0.7 % threshold. LER per shot (d rounds) is
    # about 6e-4, 1.4e-4 and 1.6e-5 at d = 3, 5, 7: these shot counts give Wilson 95 %
    # intervals that separate (d = 7 sees ~6 errors in 4x10^5 shots), every shot through the
    # controller -> shm -> decoder service loop.
    rates = {}
    for d, n in ((3, 100_000), (5, 400_000), (7, 400_000)):
        res = run_loop(transport="shm", source=source_spec(distance=d, p=0.001), num_shots=n, seed=d,
                       rounds_per_frame=0, shots_per_frame=512, cycle_ns=1, warmup_shots=0,
                       max_in_flight_shots=4 * 512, capacity_shots=8192, keep_samples=0, timeout_s=600)
        assert res.shots_ok == n
        rates[d] = (res.logical_errors, res.shots_ok)
    iv = {d: wilson_interval(*rates[d]) for d in rates}
    assert iv[3][0] > iv[5][1], (rates, iv)
    assert iv[5][0] > iv[7][1], (rates, iv)


def test_ler_under_deadline_counts_late_wrong_and_missing_shots():
    correct = np.array([1, 1, 1, 0, -1])
    reaction = np.array([10, 20, 30, 5, -1])
    assert ler_under_deadline(correct, reaction, [0, 10, 25, 100]).tolist() == [1.0, 0.8, 0.6, 0.4]


def test_syndrome_stream_splits_rounds_into_frames():
    src = build_source(source_spec(distance=3, rounds=3, p=0.01))
    s = sample_stream(src, num_shots=2, seed=1)
    assert [f.num_bits for f in s.frames(rounds_per_frame=1)] == [4, 8, 8, 4]
    assert [f.num_bits for f in s.frames(rounds_per_frame=3)] == [20, 4]
    assert [f.num_bits for f in s.frames(rounds_per_frame=0)] == [24]
    with pytest.raises(ValueError, match="non-decreasing"):
        SyndromeStream(detectors=np.zeros((1, 3)), observables=np.zeros((1, 1)), round_of_detector=[1, 0, 2])


def test_a_bad_service_spec_fails_fast_with_the_reason():
    with pytest.raises(RuntimeError, match="unknown decoder"):
        start_service_process("tcp://127.0.0.1:0", {0: {"source": source_spec(distance=3), "decoder": "nope"}})
    with pytest.raises(ValueError, match="unknown source spec keys"):
        build_source({"distance": 3, "p": 0.001, "pickle": "no"})


def test_a_service_process_serves_controllers_one_after_another_each_from_reset_decoders():
    from qlink.qec.controller import Controller

    spec = source_spec(distance=3, rounds=3, p=0.01)
    src = build_source(spec)
    stream = sample_stream(src, num_shots=40, seed=5)
    expected = _direct(spec, stream)
    configs = {0: {"source": spec, "decoder": "pymatching"}}
    with start_service_process("tcp://127.0.0.1:0", configs, service_options={"ack_enqueue": "errors"}) as svc:
        for peer in (1, 2, 3):
            ep = transports.connect(svc.url, timeout_s=10)
            try:
                # a fresh controller each time, counters from 0; the second leaves the first frame
                # of one more shot behind, and no reset_decoder
                ctl = Controller(ep, stream, cycle_ns=20_000, rounds_per_frame=1)
                res = ctl.run(timeout_s=30)
                if peer == 2:
                    ep.send(_first_frame_of_a_shot(stream, counter=ctl.counter))
            finally:
                ep.close()
            assert res.shots_ok == 40 and np.array_equal(res.corrections, expected)
            rep = svc.report(timeout_s=30)
            assert rep["peers_served"] == peer and not rep["final"] and "error" not in rep
            assert rep["counts"]["shots_decoded"] == 40 * peer and not rep["faults"]
        assert svc.process.is_alive()  # still listening for the next one
    assert not svc.process.is_alive()
    # max_peers=1: one controller, one report, and the child is gone
    with start_service_process("tcp://127.0.0.1:0", configs, max_peers=1) as svc:
        ep = transports.connect(svc.url, timeout_s=10)
        Controller(ep, stream.take(5), cycle_ns=20_000).run(timeout_s=30)
        ep.close()
        rep = svc.report(timeout_s=30)
        assert rep["final"] and rep["peers_served"] == 1
        assert svc.process.exitcode == 0 and svc.report(timeout_s=1) is rep
    with pytest.raises(ValueError, match="max_peers"):
        start_service_process("tcp://127.0.0.1:0", configs, max_peers=0)


def _first_frame_of_a_shot(stream, *, counter):
    from qlink import wire

    half = stream.frames(rounds_per_frame=1)[0]
    bits = stream.detectors[0, half.first_bit:half.first_bit + half.num_bits]
    buf = bytearray(wire.enqueue_syndromes_nbytes(half.num_bits))
    wire.encode_enqueue_syndromes_into(buf, request_id=1, decoder_id=0, counter=counter, syndrome_mapping_id=0,
                                       syndromes=bits.tolist())
    return buf


def _scenario(name):
    import importlib

    return importlib.import_module(f"qlink.scenarios.{name}")


def test_qec_memory_scenario_writes_a_sinter_csv_that_resumes(tmp_path):
    import sinter

    mod = _scenario("qec_memory")
    rows = mod.run(transport="shm", out=tmp_path, distances=(3,), ps=(0.01,), num_shots=300, progress=False)
    assert [r["path"] for r in rows] == ["wire", "offline"]
    assert rows[0]["matches_offline"] and rows[0]["errors"] == rows[1]["errors"]
    csv = tmp_path / mod.CSV_NAME
    assert csv.read_text().splitlines()[0] == sinter.CSV_HEADER
    stats = sinter.read_stats_from_csv_files(csv)
    assert sorted(s.decoder for s in stats) == ["pymatching@offline", "pymatching@wire"]
    assert all(s.shots == 300 for s in stats) and stats[0].json_metadata["d"] == 3
    assert (tmp_path / "threshold.png").stat().st_size > 0
    again = mod.run(transport="shm", out=tmp_path, distances=(3,), ps=(0.01,), num_shots=300, progress=False)
    assert [r["errors"] for r in again] == [r["errors"] for r in rows]
    assert len(csv.read_text().splitlines()) == 3, "a finished task is not run again"


def test_realtime_loop_scenario_reports_both_modes_and_plots(tmp_path):
    import json

    mod = _scenario("realtime_loop")
    rep = mod.run(transport="shm", out=tmp_path, distance=3, rounds=5, num_shots=200, progress=False)
    assert set(rep["modes"]) == {"streaming", "feed_forward"}
    for s in rep["modes"].values():
        assert s["shots"] == 200 and s["reaction_p50_us"] > 0
    saved = json.loads((tmp_path / "realtime_loop.json").read_text())
    assert saved["config"]["distance"] == 3 and len(saved["ler_deadline"]["t_us"]) > 10
    for png in ("backlog.png", "ler_deadline.png", "reaction_cdf.png"):
        assert (tmp_path / png).stat().st_size > 0


def test_the_loop_runs_over_raw_udp_datagrams():
    """UDP (one CUDA-Q frame per datagram, nothing added): lock-step shots on loopback come back
    bit-identical to direct decoding, and the service ends the run after the datagram peer goes quiet."""
    spec = source_spec(distance=3, rounds=3, p=0.01)
    stream = sample_stream(build_source(spec), num_shots=200, seed=5)
    res = run_loop(transport="udp", source=spec, stream=stream, num_shots=200, warmup_shots=20,
                   feed_forward_deadline_ns=10_000_000, timeout_s=120)
    assert res.transport == "udp"
    assert res.shots_ok + res.shots_dropped == 200
    assert res.shots_ok >= 190, "loopback lock-step should lose (almost) nothing"
    if res.shots_dropped == 0:
        assert np.array_equal(res.controller.corrections, _direct(spec, stream))
