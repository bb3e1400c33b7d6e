"""``qlink bench hostile``: the cases take turns and pool their turns, a control of busy loops
stands beside the hostile clients; the attackers can run under SCHED_IDLE (a stand-in for
attackers on hosts of their own)."""

from __future__ import annotations

import os
import socket

import pytest

from qlink.bench._hostile_clients import HostileProcess
from qlink.bench.hostile import run_hostile_bench

pytestmark = pytest.mark.timeout(240)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this platform")
def test_an_idle_attacker_runs_under_sched_idle():
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    try:
        with HostileProcess("udp_garbage", f"udp://127.0.0.1:{sink.getsockname()[1]}", idle=True) as h:
            assert os.sched_getscheduler(h.process.pid) == os.SCHED_IDLE
            sink.settimeout(30)
            assert sink.recv(2048)  # it still runs (this host has idle time between tests)
            seen = h.stop()
        assert seen.get("datagrams_sent", 0) > 0
    finally:
        sink.close()


@pytest.mark.parametrize("engine, controller, controls", [("python", "python", False), ("native", "native", True)])
def test_the_cases_take_turns_and_pool_them(engine, controller, controls):
    rows = run_hostile_bench(transports=("udp",), num_shots=300, hostile_counts=(0, 1), controllers=(),
                             rounds=2, time_limit_s=60.0, engines=(engine,), controller=controller,
                             busy_controls=controls)
    busy = [r for r in rows if r["busy_loops"]]
    none, one = [r for r in rows if not r["busy_loops"]]
    assert (none["hostile_clients"], one["hostile_clients"]) == (0, 1)
    assert none["engine"] == one["engine"] == engine and none["controller"] == controller
    for r in rows:
        assert r["sessions"] == 2 and r["rounds"] == 2  # one session a turn, pooled
        assert r["shots"] == 300 and r["bit_identical"]
        assert r["p50_us"] <= r["p99_us"] <= r["max_us"]
    assert one["p99_vs_none"] == pytest.approx(one["p99_us"] / none["p99_us"])
    assert "datagrams_sent" in one["hostile_saw"]
    if not controls:
        assert not busy and one["p99_vs_busy_control"] is None
        return
    (ctl,) = busy  # the control: one process that only spins, sending nothing; no goal of its own
    assert ctl["hostile_clients"] == 0 and ctl["busy_loops"] == 1 and ctl["meets_goal"] is None
    assert "busy_spins" in ctl["hostile_saw"] and "datagrams" not in ctl["hostile_saw"]
    assert one["p99_vs_busy_control"] == pytest.approx(one["p99_us"] / ctl["p99_us"])
    assert ctl["p99_vs_none"] == pytest.approx(ctl["p99_us"] / none["p99_us"])
