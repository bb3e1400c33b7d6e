"""``scenarios/kv_disagg.py --engine vllm``: real prefill and decode engines, the qlink
connector between them, every decode checked against the decode engine computing alone."""

from __future__ import annotations

import csv

import pytest

from qlink.scenarios import kv_disagg

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_vllm_engine_leg(tmp_path):
    rows = kv_disagg.run_vllm(transport="tcp", num_requests=3, seed=2, quick=True, out_dir=tmp_path, max_tokens=6)
    assert len(rows) == 3
    assert all(r["tokens_match"] and r["loaded"] for r in rows), rows
    assert all(r["kv_bytes"] == -(-r["prompt_tokens"] // 32) * 4 * 4 * 32 * 2 * 64 * 4 for r in rows)
    with open(tmp_path / "kv_disagg_vllm.csv") as f:
        assert len(list(csv.DictReader(f))) == 3
    assert "every decode equals" in kv_disagg._summary_vllm(rows)
