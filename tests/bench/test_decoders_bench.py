"""``qlink bench decoders``: every decoder that runs here, beside PyMatching on the same shots."""

from __future__ import annotations

import json

import pytest

from qlink.cli import main
from qlink.qec.decoders import BUILT_IN_DECODERS


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_decoders_writes_one_row_per_decoder(tmp_path, capsys):
    assert main(["bench", "decoders", "--quick", "--distances", "3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decoders.json").read_text())
    rows = data["rows"]
    runs_here = {n for n, d in BUILT_IN_DECODERS.items() if d.unavailable_reason() is None}
    assert {r["decoder"] for r in rows} == runs_here
    for r in rows:
        assert "error" not in r, r
        assert r["ler_lo"] <= r["ler"] <= r["ler_hi"] and r["us_per_shot"] > 0
        if r["decoder"] == "pymatching":
            assert r["ler_vs_pymatching"] == 1.0 and r["agree_with_pymatching_pct"] == 100.0
    # minimum-weight matching by another solver agrees with PyMatching on nearly every shot
    fb = [r for r in rows if r["decoder"] == "fusion-blossom"]
    assert not fb or fb[0]["agree_with_pymatching_pct"] > 95
    assert data["meta"]["peer"].startswith("pymatching")
    assert "Wilson" in capsys.readouterr().out
