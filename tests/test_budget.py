"""Budget arithmetic on hand-made timelines: known stage times give known shares and headroom."""

import math

import pytest

from qlink.budget import (BUDGETS, Budget, Figure, assess, budget_rows, figure_from_rate, layer_compute_budget,
                          stage_lines, stage_shares)


def test_assess_share_and_headroom_are_exact():
    b = Budget("t.x", "test budget", "qec", 10_000, "hand-made")
    line = assess(Figure("reaction", 2_500, basis="measured", transport="shm"), b)
    assert line.share == 0.25
    assert line.headroom_ns == 7_500
    assert line.within
    over = assess(Figure("reaction", 12_000, basis="measured", transport="tcp"), b)
    assert over.headroom_ns == -2_000 and not over.within and over.share == 1.2


def test_stage_shares_sum_to_total():
    b = Budget("t.y", "y", "ai", 1_000_000, "hand-made")
    stages = {"prefill": 600_000, "transfer": 150_000, "first decode step": 50_000}
    rows = stage_shares(stages, b, order=list(stages))
    assert [r[0] for r in rows] == ["prefill", "transfer", "first decode step", "total"]
    assert rows[1][2] == pytest.approx(0.15)
    assert rows[-1][1] == 800_000 and rows[-1][2] == pytest.approx(0.8)


def test_stage_shares_rejects_missing_and_negative_stages():
    b = BUDGETS["qec.cycle"]
    with pytest.raises(ValueError, match="not in the timeline"):
        stage_shares({"a": 1}, b, order=["a", "b"])
    with pytest.raises(ValueError, match="finite and >= 0"):
        stage_shares({"a": -1}, b)


def test_measured_and_modeled_never_mix():
    m = Figure("transport", 3_000, basis="measured", transport="shm")
    m2 = Figure("decode", 4_000, basis="measured", transport="shm")
    assert (m + m2).value_ns == 7_000 and (m + m2).basis == "measured"
    with pytest.raises(ValueError, match="never mix"):
        m + Figure("wire", 2_000, basis="modeled", transport="nvqlink")
    with pytest.raises(ValueError, match="basis"):
        Figure("x", 1, basis="guessed", transport="shm")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_figures_and_budgets_are_refused(bad):
    with pytest.raises(ValueError):
        Figure("x", bad, basis="measured", transport="shm")
    with pytest.raises(ValueError):
        Budget("k", "n", "qec", bad, "c")


def test_layer_compute_budget_follows_the_flops_model():
    b = layer_compute_budget(model="m", num_layers=10, num_tokens=1000, params=1e9, achieved_flops=1e12, citation="c")
    # 2 * 1e9 * 1000 / 1e12 = 2 s of prefill over 10 layers = 0.2 s per layer
    assert b.limit_ns == pytest.approx(0.2e9)
    with pytest.raises(ValueError, match="num_tokens"):
        layer_compute_budget(model="m", num_layers=10, num_tokens=0, params=1e9, achieved_flops=1e12, citation="c")


def test_budget_rows_keep_the_basis_beside_every_number():
    lines = [assess(Figure("kv 4k", 5e6, basis="modeled", transport="nvlink4"), BUDGETS["ai.ttft"]),
             assess(Figure("kv 4k", 9e6, basis="measured", transport="shm"), BUDGETS["ai.ttft"])]
    rows = budget_rows(lines)
    assert [r["basis"] for r in rows] == ["modeled", "measured"]
    assert rows[1]["share_pct"] == pytest.approx(3.6)
    assert all(math.isfinite(r["value_us"]) for r in rows)


def test_stage_lines_share_each_stage_and_count_headroom_down():
    b = Budget("t.z", "z", "qec", 10_000, "hand-made")
    stages = {k: Figure(k, v, basis="measured", transport="shm", statistic="mean")
              for k, v in (("wire", 2_000), ("decode", 5_000), ("apply", 1_000))}
    lines = stage_lines(stages, b, total_what="reaction")
    assert [ln.stage for ln in lines] == ["wire", "decode", "apply", "total"]
    assert [ln.share for ln in lines] == [0.2, 0.5, 0.1, 0.8]
    assert [ln.headroom_ns for ln in lines] == [8_000, 3_000, 2_000, 2_000]
    assert lines[-1].what == "reaction" and lines[-1].statistic == "mean"
    assert [r["stage"] for r in budget_rows(lines)] == ["wire", "decode", "apply", "total"]
    over = stage_lines({"a": Figure("a", 7_000, "measured", "shm"), "b": Figure("b", 6_000, "measured", "shm")}, b,
                       total_what="t")
    assert over[1].headroom_ns == -3_000 and not over[-1].within


def test_stage_lines_refuse_mixed_bases_and_no_stages():
    b = BUDGETS["qec.reaction"]
    with pytest.raises(ValueError, match="never mix"):
        stage_lines({"wire": Figure("wire", 2_000, "modeled", "nvqlink"),
                     "decode": Figure("decode", 5_000, "measured", "shm")}, b, total_what="t")
    with pytest.raises(ValueError, match="at least one"):
        stage_lines({}, b, total_what="t")
    with pytest.raises(TypeError, match="Figure"):
        stage_lines({"wire": 2_000}, b, total_what="t")


def test_backlog_rate_budget_is_one_round_per_cycle():
    b = BUDGETS["qec.backlog_rate"]
    assert b.limit_ns == BUDGETS["qec.cycle"].limit_ns and 1e9 / b.limit_ns == pytest.approx(909_091, abs=1)
    keeping_up = assess(figure_from_rate("rounds answered", per_s=1e6, basis="measured", transport="shm"), b)
    falling_behind = assess(figure_from_rate("rounds answered", per_s=8e5, basis="measured", transport="shm"), b)
    assert keeping_up.within and keeping_up.value_ns == pytest.approx(1_000)
    assert not falling_behind.within and falling_behind.headroom_ns == pytest.approx(-150)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="per_s"):
            figure_from_rate("r", per_s=bad, basis="measured", transport="shm")
