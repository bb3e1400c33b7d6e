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
