"""The disaggregated prefill -> decode scenario runs end to end and writes its CSV and plot."""

from __future__ import annotations

import csv

import pytest

from qlink.ai.peer import transport_unavailable

from qlink.scenarios import kv_disagg


@pytest.mark.timeout(180)
def test_quick_run_on_a_tiny_model(tmp_path):
    scheme = next((s for s in ("shm", "tcp") if not transport_unavailable(s)), None)
    if scheme is None:
        pytest.skip("no cross-process transport (shm, tcp) available")
    rows = kv_disagg.run(transport=scheme, num_requests=6, seed=3, quick=True, out_dir=tmp_path, preset="tiny",
                         max_prompt_tokens=256, pool_tokens=1024, progress=False, mfu=0.25)
    assert [r["request_id"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert r["blocks_verified"] is True
        assert r["transport"] == scheme
        assert r["kv_bytes"] == -(-r["prompt_tokens"] // 4) * 4 * 512  # whole blocks of the tiny layout
        assert r["exposed_transfer_ms"] >= 0 and r["ttft_ms"] >= r["exposed_transfer_ms"]
        assert r["exposed_share_ttft"] == pytest.approx(r["exposed_transfer_ms"] / 250, abs=1e-3)
        assert r["prefill_mfu_assumed"] == 0.25  # the assumption travels with the figures
    with open(tmp_path / kv_disagg.CSV_NAME) as f:
        written = list(csv.DictReader(f))
        assert len(written) == 6 and {r["prefill_mfu_assumed"] for r in written} == {"0.25"}
    assert (tmp_path / kv_disagg.PNG_NAME).stat().st_size > 1000


def test_same_seed_same_requests():
    a = kv_disagg._requests(20, seed=1, median=512, sigma=0.8, max_tokens=4096, rate_per_s=4)
    b = kv_disagg._requests(20, seed=1, median=512, sigma=0.8, max_tokens=4096, rate_per_s=4)
    assert a == b and all(32 <= t <= 4096 for _, t, _ in a)


def test_prefill_cost_and_modeled_exposure():
    from qlink.links import LINKS

    per_tok = kv_disagg.prefill_ns_per_token()
    assert 30_000 < per_tok < 35_000  # 2 * 8.03e9 / (989e12 * 0.5) s
    assert kv_disagg.prefill_ns_per_token(mfu=0.25) == pytest.approx(2 * per_tok)  # MFU is an assumption to set
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="mfu"):
            kv_disagg.prefill_ns_per_token(mfu=bad)
    # a layer that moves faster than it computes leaves only the last layer's transfer exposed
    e = kv_disagg.modeled_exposed_ns(layer_compute_ns=1e6, layer_nbytes=1 << 20, num_layers=8, link=LINKS["nvlink4"])
    assert e == pytest.approx(LINKS["nvlink4"].transfer_time_ns(1 << 20))
    # a slow link piles up: exposure grows with the number of layers
    slow = kv_disagg.modeled_exposed_ns(layer_compute_ns=1e3, layer_nbytes=1 << 20, num_layers=8, link=LINKS["ib-ndr"])
    assert slow > 7 * LINKS["ib-ndr"].transfer_time_ns(1 << 20) - 8e3


def test_the_cli_takes_mfu_and_refuses_one_outside_0_1(capsys):
    with pytest.raises(SystemExit):
        kv_disagg.main(["--mfu", "0", "--transport", "shm"])
    assert "--mfu must be a number in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --mfu parsed, then the transport refused before anything runs
        kv_disagg.main(["--mfu", "0.4", "--transport", "inproc"])
    err = capsys.readouterr().err
    assert "cannot cross processes" in err and "--mfu" not in err


def test_inproc_is_refused():
    with pytest.raises(ValueError, match="cannot cross processes"):
        kv_disagg.run(transport="inproc", num_requests=1, progress=False)
