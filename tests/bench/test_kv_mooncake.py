"""The Mooncake peer of ``qlink bench kv`` moves the request's pieces between its two
processes and catches pieces that did not land. Skipped where Mooncake cannot run."""

from __future__ import annotations

import numpy as np
import pytest

from qlink.ai import plan_transfer, preset
from qlink.bench._kv_mooncake import MooncakePair, mooncake_unavailable

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(mooncake_unavailable() is not None, reason=str(mooncake_unavailable()))]


def test_a_batch_write_lands_and_a_missing_piece_is_caught():
    spec = preset("tiny", num_blocks=32)
    plan = plan_transfer([3, 9, 10, 11, 30], [0, 5, 6, 7, 31], src_num_blocks=32, dst_num_blocks=32,
                         block_nbytes=spec.block_nbytes, num_planes=spec.num_planes)
    with MooncakePair(spec, slice_nbytes=65536) as pair:
        assert pair.write(plan, range(spec.num_layers)) > 0
        # a piece the initiator never wrote (its layers moved, this one's offset not): caught
        wrong = plan_transfer([3], [20], src_num_blocks=32, dst_num_blocks=32, block_nbytes=spec.block_nbytes,
                              num_planes=spec.num_planes)
        lying = type(plan)(src_offsets=wrong.src_offsets, dst_offsets=wrong.dst_offsets + spec.block_nbytes,
                           nbytes=wrong.nbytes, num_blocks=1, block_nbytes=spec.block_nbytes,
                           num_planes=spec.num_planes)
        pair._i.send(("write", wrong.src_offsets, wrong.dst_offsets, wrong.nbytes, (0,)))
        pair._answer(pair._i)
        pair._t.send(("check", lying.dst_offsets, (0,), 0))
        _, bad = pair._answer(pair._t)
        assert bad == int(np.asarray(lying.dst_offsets).size)


def test_a_request_of_more_runs_than_one_batch_takes_goes_as_several_calls_and_lands():
    spec = preset("tiny", num_blocks=32)
    plan = plan_transfer([3, 9, 12, 20, 30], [0, 5, 8, 17, 31], src_num_blocks=32, dst_num_blocks=32,
                         block_nbytes=spec.block_nbytes, num_planes=spec.num_planes)
    assert np.asarray(plan.nbytes).size * spec.num_layers > 3
    with MooncakePair(spec, slice_nbytes=65536, max_batch_entries=3) as pair:  # several calls per request
        assert pair.write(plan, range(spec.num_layers)) > 0  # and the target found every piece in place


def test_bench_kv_takes_mooncake_rounds_between_qlink_tcp_rounds(monkeypatch):
    from qlink.ai.peer import transport_unavailable
    from qlink.bench.kv import kv_goals, run_kv_bench

    if transport_unavailable("tcp"):
        pytest.skip("tcp transport unavailable")
    monkeypatch.setenv("QLINK_TCP_SPLICE", "0")  # (one way, forced: no second qlink tcp leg beside Mooncake's)
    rows = run_kv_bench(transports=("tcp",), tokens=(16, 64), preset="tiny", repeats=2, nixl=False, mooncake=True,
                        memory_budget_nbytes=1 << 20, progress=lambda _: None)
    moon = [r for r in rows if r["case"].startswith("Mooncake") and r["basis"] == "measured"]
    tcp = [r for r in rows if r["case"].startswith("qlink tcp") and r["basis"] == "measured"]
    assert len(moon) == 2 * 2 * 2 and len(tcp) == 2 * 2  # two slice sizes x tokens x patterns
    for r in moon:
        assert r["note"].startswith("a round right before each qlink tcp round") and r["transfers"] >= 2
        assert r["GBps"] > 0 and r["nbytes"] == r["tokens"] * 512
    goals = [g for g in kv_goals(rows) if g["goal"].startswith("tcp >= 2 x Mooncake")]
    assert len(goals) == 4 and all(g["measured"] is not None for g in goals)


def test_bench_kv_measures_mooncake_in_rounds_of_its_own_where_its_caches_beside_qlinks_exceed_the_budget(monkeypatch):
    from qlink.ai.peer import transport_unavailable
    from qlink.bench.kv import run_kv_bench

    if transport_unavailable("tcp"):
        pytest.skip("tcp transport unavailable")
    spec_nbytes = 64 * 512  # the tiny preset's cache at 64 tokens
    monkeypatch.setenv("QLINK_TCP_SPLICE", "0")  # (one way, forced: no second qlink tcp leg)
    rows = run_kv_bench(transports=("tcp",), tokens=(16, 64), preset="tiny", repeats=1, nixl=False, mooncake=True,
                        memory_budget_nbytes=3 * spec_nbytes, progress=lambda _: None)  # 2 caches fit, 4 more do not
    moon = [r for r in rows if r["case"].startswith("Mooncake") and r["basis"] == "measured"]
    tcp = [r for r in rows if r["case"].startswith("qlink tcp") and r["basis"] == "measured"]
    assert len(moon) == 2 * 2 * 2 and len(tcp) == 2 * 2
    assert all(r["note"].startswith("rounds of its own") for r in moon)
