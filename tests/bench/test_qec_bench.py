"""The QEC bench runs end to end on a tiny code and returns well-formed rows (no speed asserted)."""

from __future__ import annotations

import math
import os

import pytest

from qlink.bench.qec import BENCH_COLUMNS, run_qec_bench


@pytest.mark.timeout(240)
def test_qec_bench_rows_on_a_tiny_code():
    rows = run_qec_bench(transports=("shm", "udp"), distances=(3,), cycle_rounds=1200,
                         flat_rounds=6000, flat_shots_per_frame=16, ff_shots=50, floor_round_trips=50,
                         keep_rows=500, progress=lambda _: None)
    by_t = {r["transport"]: r for r in rows}
    assert list(by_t) == ["shm", "udp"]
    for t, r in by_t.items():
        _check_row(r, t)


def _check_row(r, transport):
    assert "note" not in r or not r["note"].startswith("error"), r.get("note")
    assert set(r) - {"transport_used", "backlog_slope_rounds_per_s", "note"} <= set(BENCH_COLUMNS)
    assert r["d"] == 3 and r["rounds"] == 4 and r["cycle_rounds"] >= 1200 and r["transport_used"] == transport
    # the bare round trip beside the controller's own get_corrections round trip, in every run
    assert 0 < r["floor_rt_p50_us"] <= r["floor_rt_p99_us"]
    for suffix in ("", "_1", "_ff"):
        assert 0 < r[f"get_rt_p50_us{suffix}"] <= r[f"get_rt_p99_us{suffix}"]
    # lock-step, each shot's reaction (tick -> applied) holds its get_corrections round trip
    assert r["get_rt_p50_us_ff"] <= r["reaction_p50_us_ff"]
    # flat out over the wire and offline decode the same shots: a ratio of two positive rates
    assert r["flat_shots"] % 16 == 0 and r["flat_shots"] * 4 >= 6000
    assert r["wire_rounds_per_s"] > 0 and r["wire_vs_offline"] == pytest.approx(
        r["wire_rounds_per_s"] / r["offline_rounds_per_s"])
    for suffix in ("", "_1", "_ff"):
        assert 0 < r[f"reaction_p50_us{suffix}"] <= r[f"reaction_p99_us{suffix}"]
    shares = [r[f"share_{k}"] for k in ("batch", "transport", "queue", "decode", "other")]
    assert sum(shares) == pytest.approx(1.0, abs=1e-6)
    assert r["shots_per_frame"] >= 2 and r["share_batch"] > 0  # several shots per frame: some wait for the last
    assert r["shots_ff"] == 50 and 0 <= r["deadline_misses_ff"] <= 50
    assert 0 < r["cpu_service"] and 0 < r["cpu_controller"] and not math.isnan(r["load_1m"])
    assert isinstance(r["keeps_up"], bool) and isinstance(r["keeps_up_1"], bool)


def test_native_real_time_rows_and_goal_table(tmp_path):
    """qlink bench qec's real-time rows: the floors and the figures come from one run, each goal
    row names its figure and target, and the trace opens as trace-event JSON."""
    import json

    from qlink.bench.qec_hot import GOALS, run_hot_bench
    from qlink.qec.hotpath import available

    if available() is not None:
        pytest.skip(available())
    trace = tmp_path / "trace.json"
    out = run_hot_bench(distances=(3,), cycle_rounds=3000, lockstep_shots=300, floor_round_trips=500,
                        flat_rounds=20_000, trace_path=trace, udp_rounds=3000, udp_floor_datagrams=20_000,
                        long_lengths=(300, 3000), long_max_total_rounds=9000)
    by = {r["row"]: r for r in out["rows"]}  # shm d=3, tcp d=3 (ucx d=3 where UCXX is), udp d=3, the long experiment
    row, tcp_row, udp_row, long_row = by["shm d=3"], by["tcp d=3"], by["udp d=3"], by["long experiment"]
    if "ucx d=3" in by:  # the native path over ucx: the same rows as over tcp
        ucx_row = by["ucx d=3"]
        assert ucx_row["lockstep_shots"] == 300 and ucx_row["floor_rt_p50_us"] > 0 and ucx_row["cycle_rounds"] > 0
    assert udp_row["udp_floor_datagrams_per_s"] > 0 and udp_row["udp_rpf1_cycle_ns"] > 0
    assert isinstance(udp_row["udp_rpf1_keeps_up"], bool) and 1 <= udp_row["udp_cycle_rounds_per_datagram"] <= 4
    for n in (300, 3000):  # every experiment answered, every window of it decoded
        assert long_row[f"long_{n}_final_reaction_p50_us"] > 0 and long_row[f"long_{n}_windows"] > 0
    assert (row["transport"], tcp_row["transport"]) == ("shm", "tcp")
    assert tcp_row["lockstep_shots"] == 300 and tcp_row["floor_rt_p50_us"] > 0
    assert row["lockstep_shots"] == 300 and row["floor_rt_p50_us"] > 0 and row["decode_single_p50_us"] > 0
    # the floor under the tail: round trips held as long as the decoder's own calls, so at least that long
    assert row["host_floor_p50_us"] >= row["host_floor_hold_p50_us"] > 0
    assert row["host_floor_p99_us"] >= row["host_floor_p50_us"] and row["host_floor_pause_us"] == pytest.approx(3 * 1.1)
    p99_goal = next(g for g in out["goals"] if g["goal"] == GOALS["lockstep_p99_le_15us"])
    assert p99_goal["floor"].startswith(f"floor p99 {row['host_floor_p99_us']:.2f} us")
    # the split adds up: wire + decode + software = the stages' p50 sum (by construction of the split)
    parts = sum(row[f"stage_{k}_us"] for k in ("send", "wire_in", "queue", "decode", "respond", "wire_out", "apply"))
    assert row["stage_wire_us"] + row["stage_decode_us"] + row["stage_software_us"] == pytest.approx(parts, rel=1e-9)
    goals = {g["goal"] for g in out["goals"]}
    assert GOALS["lockstep_p50_le_3us"] in goals and any(g.startswith(GOALS["cycle_keeps_up"]) for g in goals)
    assert {GOALS["udp_floor"], GOALS["udp_rpf1_keeps_up"], GOALS["udp_cycle_keeps_up"], GOALS["long_flat"]} <= goals
    assert all(isinstance(g["met"], bool) for g in out["goals"])
    assert row["offline_rounds_per_s"] > 0 and row["flat_vs_offline"] > 0  # flat out beside offline
    # (pipelined: frames taken in on a CPU of the host; the single-threaded service beside it)
    assert 0 <= row["flat_ingest_cpu"] < (os.cpu_count() or 1) and row["flat_single_thread_vs_offline"] > 0
    ev = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in ev if e["ph"] == "X"} >= {"reaction", "decode", "wire_in", "wire_out"}
