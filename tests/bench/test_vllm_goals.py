"""The goals ``qlink bench vllm`` prints: judged on qlink over shm's better flow, the other flow
beside it, and missing figures left unjudged, never counted as met."""

from __future__ import annotations

from qlink.bench.vllm import GOAL_EXPOSED_X_PREFILL, vllm_goals


def _row(case, n, exposed, ttft):
    return {"case": case, "prompt_tokens": n, "exposed_x_prefill": exposed, "ttft_x_best_peer": ttft}


def test_a_goal_is_judged_on_the_better_flow_and_names_it():
    goals = vllm_goals([_row("qlink-shm", 128, 0.32, 0.95), _row("qlink-shm-push", 128, 0.0, 0.63),
                        _row("nixl", 128, 0.41, 1.6), _row("qlink-tcp", 128, 0.01, 0.5)])
    exposed, ttft = goals
    assert (exposed["measured"], exposed["met"], exposed["by"]) == (0.0, True, "qlink-shm-push")
    assert "qlink-shm: 0.32" in exposed["note"]
    # qlink over tcp is not qlink over shm: its better figure does not count
    assert (ttft["measured"], ttft["by"]) == (0.63, "qlink-shm-push")


def test_a_miss_is_reported_as_a_miss():
    goals = vllm_goals([_row("qlink-shm", 512, 0.18, 1.08)])
    assert [(g["measured"], g["met"]) for g in goals] == [(0.18, False), (1.08, False)]
    assert goals[0]["target"] == GOAL_EXPOSED_X_PREFILL and "note" not in goals[0]


def test_a_missing_figure_is_left_unjudged():
    goals = vllm_goals([_row("qlink-shm", 2048, None, None), _row("nixl", 2048, 0.04, 1.0)])
    assert [(g["measured"], g["met"], g["by"]) for g in goals] == [(None, None, None), (None, None, None)]
    assert vllm_goals([]) == []
