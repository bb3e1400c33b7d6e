"""Whole processes SIGKILLed mid-run: the survivor learns it within a stated bound (measured
from the kill, asserted generously), nothing already delivered is lost, nothing partial is
reported, and the work goes on against a new peer.

Bounds: a SIGKILLed peer is seen as BrokenLinkError within ``KILL_BOUND_S`` = 1 s over shm
and tcp (the transport contract in ``transports/_base.py``), counted from the moment the
kernel has ended the peer (its sockets closed): on an idle machine that is milliseconds after
the SIGKILL, but on a loaded one the dying process itself waits for a core, which no
transport controls (the runs report both parts: ``exit_s`` and ``detection_after_exit_s``).
"""

from __future__ import annotations

import importlib.util

import pytest

import transports
from qlink.reliability.crash import (
    kv_receiver_kill_run,
    kv_sender_kill_run,
    qec_controller_kill_run,
    qec_service_kill_run,
    sender_kill_run,
)

pytestmark = [pytest.mark.timeout(180)]

KILL_BOUND_S = 1.0
CROSS = ("shm", "tcp")
#: the QEC loop's kills also over ucx, where UCXX is installed (the native core's kills over ucx: tests/qec/test_hotpath.py)
QEC_CROSS = (*CROSS, pytest.param("ucx", marks=pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'qlink[ucx]')")))


def _detected_within_the_bound(r: dict) -> None:
    """The survivor raised after the kill, within the bound of the peer's end."""
    assert r["detection_s"] is not None and r["exit_s"] is not None, r  # it was detected, and the peer did die
    assert 0 <= r["detection_after_exit_s"] <= r["detection_s"], r
    assert r["detection_after_exit_s"] < KILL_BOUND_S, r


@pytest.mark.parametrize("transport", QEC_CROSS)
def test_decoder_service_killed_mid_run_the_controller_knows_and_the_run_resumes(transport):
    r = qec_service_kill_run(transport=transport, num_shots=3000, chunk_shots=200)
    assert r["killed"]
    _detected_within_the_bound(r)
    assert r["services_started"] == 2  # resumed against a fresh service, the experiment never restarted
    # shots answered before the kill are kept; the shots in flight are reported lost, by id
    assert r["lost_in_flight"] == r["chunk_shots"] == len(r["lost_shot_ids"])
    assert r["decoded"] == r["shots"] - r["lost_in_flight"]
    assert r["accounted_pct"] == 100.0


@pytest.mark.parametrize("transport", QEC_CROSS)
def test_controller_killed_mid_run_the_service_knows_and_serves_the_next_one(transport):
    r = qec_controller_kill_run(transport=transport, reset_first=True, kill_after_s=0.3)
    assert r["service_saw"] == "closed" and r["service_alive"]
    _detected_within_the_bound(r)
    assert r["first_controller_requests"] > 0  # it really was killed mid-run
    assert r["reset_status"] == 0
    assert r["next_ok"] == r["next_shots"] and r["next_logical_errors"] <= 2
    assert r["second_closed"] == "closed"


@pytest.mark.slow
def test_the_next_controller_needs_no_reset_after_a_crash():
    r = qec_controller_kill_run(transport="tcp", reset_first=False, kill_after_s=0.3, timeout_s=10)
    assert r["next_ok"] == r["next_shots"], r.get("next_error")


def test_run_service_process_accepts_a_next_controller():
    from qlink.qec.loop import source_spec
    from qlink.qec import start_service_process

    spec = source_spec(distance=3, rounds=3, p=0.001)
    with start_service_process("tcp://127.0.0.1:0", {0: {"source": spec, "decoder": "pymatching"}}) as svc:
        first = transports.connect(svc.url, timeout_s=10)
        first.send(b"\x00" * 24)  # a malformed frame, answered or not, then the controller goes away
        first.close()
        svc.report(timeout_s=30)
        second = transports.connect(svc.url, timeout_s=5)
        second.close()


@pytest.mark.parametrize("transport", CROSS)
def test_kv_receiver_killed_mid_transfer_the_sender_knows(transport):
    r = kv_receiver_kill_run(transport=transport, num_blocks=32, kill_after_s=0.5, give_up_s=3.0)
    assert r["broken_link"], r
    _detected_within_the_bound(r)
    assert r["requests_sent"] >= 1


def test_a_slow_tcp_sender_learns_of_a_killed_peer_within_the_bound():
    r = sender_kill_run(transport="tcp", interval_s=0.001, give_up_s=3.0)
    assert r["broken_link"], r
    _detected_within_the_bound(r)


@pytest.mark.slow
def test_a_slow_shm_sender_learns_of_a_killed_peer_within_the_bound():
    r = sender_kill_run(transport="shm", interval_s=0.001, give_up_s=2.0)
    assert r["broken_link"], r
    _detected_within_the_bound(r)


@pytest.mark.parametrize("transport", CROSS)
def test_kv_sender_killed_mid_transfer_the_receiver_gets_a_typed_error_and_no_partial_layer(transport):
    r = kv_sender_kill_run(transport=transport, num_blocks=8, kill_at_layer=3)
    assert not r["completed"] and r["error"] == "BrokenLinkError", r
    _detected_within_the_bound(r)
    assert 3 <= r["ready_layers"] < r["layers"]  # killed mid-transfer
    assert r["partial_layers_reported"] == 0  # every layer reported ready is whole and exact
