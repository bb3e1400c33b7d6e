"""The vLLM leg of ``qlink run``: skipped with a reason where there is no vLLM environment,
and, where there is one, real engines whose rows name their engine."""

from __future__ import annotations

import pytest

from qlink import _vllm_leg
from qlink.crossdomain import AI_ENGINE


def test_without_a_vllm_environment_the_leg_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("QLINK_VLLM_PYTHON", str(tmp_path / "no-such-venv" / "bin" / "python"))
    rows, note = _vllm_leg.run_vllm_leg(tmp_path / "out", say=lambda _: None)
    assert rows == [] and note.startswith("vLLM leg skipped") and "make vllm-env" in note


def test_an_interpreter_without_vllm_is_skipped_with_its_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("QLINK_VLLM_PYTHON", sys.executable)  # this environment: no vLLM
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here")
    rows, note = _vllm_leg.run_vllm_leg(tmp_path / "out", say=lambda _: None)
    assert rows == [] and "cannot import vllm" in note


def test_rows_carry_the_engine_and_budgets():
    reqs = [dict(transport="shm", prompt_tokens=n, prefill_ms=p, decode_ttft_ms=t, transfer_ms=x, loaded=True,
                 tokens_match=True) for n, p, t, x in ((100, 20.0, 9.0, 0.4), (300, 40.0, 11.0, 0.8),
                                                        (200, 30.0, 10.0, None))]
    rows = _vllm_leg.vllm_rows(reqs)
    assert [r["budget_us"] for r in rows] == [250_000.0, 250_000.0, 30_000.0]
    assert [r["value_us"] for r in rows] == [30000.0, 10000.0, 600.0]  # p50 of what was measured
    assert {r["engine"] for r in rows} == {_vllm_leg.ENGINE} and _vllm_leg.ENGINE != AI_ENGINE
    assert all(r["domain"] == "ai" and r["basis"] == "measured" and r["transport"] == "shm" for r in rows)
    assert _vllm_leg.vllm_rows([]) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_leg_runs_real_engines_where_the_vllm_environment_exists(tmp_path):
    if _vllm_leg.vllm_python() is None:
        pytest.skip("no .venv-vllm (make vllm-env)")
    rows, note = _vllm_leg.run_vllm_leg(tmp_path / "out", num_requests=2, say=lambda _: None)
    assert "failed" not in note and "skipped" not in note, note
    assert len(rows) == 2 and all(r["tokens_match"] and r["loaded"] for r in rows), rows
    assert {r["engine"] for r in _vllm_leg.vllm_rows(rows)} == {_vllm_leg.ENGINE}


def test_the_requests_figure_draws_every_figure_and_marks_a_differing_decode():
    pytest.importorskip("matplotlib")
    from qlink.paper import fig_vllm_requests

    reqs = [dict(transport="shm", prompt_tokens=n, prefill_ms=p, decode_ttft_ms=t, transfer_ms=x, tokens_match=m)
            for n, p, t, x, m in ((100, 20.0, 9.0, 0.4, True), (300, 40.0, 11.0, None, True),
                                  (200, 30.0, 10.0, 0.6, False))]
    fig = fig_vllm_requests(reqs)
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert len(labels) == 3 and any("qlink connector" in s for s in labels) and "over shm" in ax.get_title()
    filled = [c for c in ax.collections if len(c.get_facecolors())]
    hollow = [c for c in ax.collections if not len(c.get_facecolors())]
    assert sum(len(c.get_offsets()) for c in filled) == 3 * 2  # the matching requests, each figure
    assert sum(len(c.get_offsets()) for c in hollow) == 3  # the differing one, hollow
    assert len(fig_vllm_requests([]).axes) == 1  # no rows: an empty figure, not an error
