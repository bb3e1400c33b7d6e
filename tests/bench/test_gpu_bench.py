"""``qlink bench gpu``: a clear skipped result without a GPU, and the harness itself checked
on NumPy (``device="cpu"``: host regions over cuda_ipc's shm path, NumPy BP), which is the
same code the GPU run takes with CuPy."""

from __future__ import annotations

import json

import pytest

from qlink.bench import gpu
from qlink.cli import main

pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(gpu.gpu_unavailable() is None, reason="a GPU is present: the bench runs instead of skipping")
def test_cli_without_a_gpu_exits_0_with_a_skipped_row(tmp_path, capsys):
    assert main(["bench", "gpu", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "skipped: no GPU" in printed
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert doc["meta"]["ran"] is False
    assert [r["basis"] for r in doc["rows"]] == ["skipped"]
    assert doc["rows"][0]["note"].startswith("skipped: no GPU (")
    assert (tmp_path / "gpu.csv").read_text().splitlines()[0].startswith("section,case,basis")


def test_bandwidth_harness_on_numpy_checks_the_bytes():
    rows = gpu.measure_bandwidth(device="cpu", sizes=(4096, 1 << 20), repeats=3, progress=lambda _: None)
    puts = [r for r in rows if r["case"] == "cuda_ipc put"]
    copies = [r for r in rows if r["case"] == "numpy copy"]
    assert [r["nbytes"] for r in puts] == [4096, 1 << 20] and len(copies) == 2
    assert all(r["bit_exact"] is True and r["GBps"] > 0 and r["basis"] == "measured" for r in puts)
    assert all(r["x_copy"] == 1.0 for r in copies) and all(r["device"].startswith("cpu") for r in rows)


def test_kv_harness_on_numpy_moves_blocks_bit_exact():
    rows = gpu.measure_kv(device="cpu", preset="tiny", tokens=(8, 32), repeats=1, progress=lambda _: None)
    moved = [r for r in rows if r["case"].startswith("cuda_ipc KV")]
    assert [r["tokens"] for r in moved] == [8, 32]
    assert all(r["bit_exact"] is True and r["case"] == "cuda_ipc KV put" and r["GBps"] > 0 for r in moved)


def test_qec_harness_on_numpy_answers_every_shot_like_the_offline_decoder():
    from qlink.qec.decoders import BUILT_IN_DECODERS

    rows = gpu.measure_qec(device="cpu", distances=(3,), num_shots=40, progress=lambda _: None)
    measured = [r for r in rows if r["basis"] == "measured"]
    qldpc = "cudaq-nv-qldpc-decoder, syndromes in host memory, decode_batch"
    runs_here = BUILT_IN_DECODERS["cudaq-nv-qldpc-decoder"].unavailable_reason() is None  # (a GPU host)
    assert [r["case"] for r in measured] == ["qlink-bp, syndromes in host memory, decode_device",
                                             "qlink-bp, syndromes in host memory, decode_batch"] + [qldpc] * runs_here
    assert all(r["bit_identical"] is True and r["p50_us"] > 0 and r["distance"] == 3 for r in measured)
    skipped = [r for r in rows if r["basis"] == "skipped"]
    assert [r["case"] for r in skipped] == [qldpc] * (not runs_here)
    # it says why: no GPU here, or (where cudaq-qec is not installed) the missing package
    assert runs_here or "GPU" in skipped[0]["note"] or "cudaq-qec" in skipped[0]["note"]


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError):
        gpu.measure_bandwidth(device="cpu", sizes=(0,))
    with pytest.raises(ValueError):
        gpu.measure_kv(device="tpu")


@pytest.mark.gpu
def test_gpu_bench_runs_every_section_bit_exact(tmp_path):
    rows = gpu.run_gpu_bench(sizes=(1 << 20, 16 << 20), repeats=3, kv_tokens=(64, 512), kv_repeats=1,
                             distances=(3,), num_shots=60, progress=lambda _: None)
    assert not [r for r in rows if r["basis"] == "error"], rows
    assert all(r["bit_exact"] for r in rows if "bit_exact" in r)
    assert all(r["bit_identical"] for r in rows if "bit_identical" in r)
    assert {r["section"] for r in rows} == {"bandwidth", "kv", "qec"}
    assert not any(r["device"].startswith("cpu") for r in rows)
