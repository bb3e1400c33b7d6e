"""The plots the benchmarks write beside their tables: each series where its rows are, the
faster of several ways, nothing invented where a figure is missing."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("matplotlib")

from qlink.bench.plots import KV_SERIES, fig_kv_peers, fig_vllm_connectors, save_figure  # noqa: E402


def _kv(case, basis, tokens, pattern, gbps):
    return {"case": case, "basis": basis, "tokens": tokens, "pattern": pattern, "GBps": gbps}


def _bars(ax):
    return {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}


def test_kv_plot_sets_each_transport_beside_its_floor_and_peer_and_takes_the_faster_way(tmp_path):
    rows = [_kv("memcpy floor (warm, same blocks)", "floor", 512, "contiguous", 16.0),
            _kv("qlink shm put", "measured", 512, "contiguous", 13.5),
            _kv("qlink tcp put", "measured", 512, "contiguous", 4.7),
            _kv("qlink tcp put (spliced)", "measured", 512, "contiguous", 2.0),
            _kv("TCP socket floor (loopback, same bytes)", "floor", 512, "per layer", 5.2),
            _kv("Mooncake TE TCP, slice 64 KiB", "measured", 512, "contiguous", 1.8),
            _kv("Mooncake TE TCP, slice 1024 KiB", "measured", 512, "contiguous", 1.7),
            _kv("qlink shm put", "measured", 4096, "scattered", 12.0),
            _kv("NVLink 4", "modeled", 512, "contiguous", 450.0)]  # a model is no measured peer
    bars = _bars(fig_kv_peers(rows).axes[0])
    assert set(bars) == {"memcpy floor", "qlink shm", "qlink tcp", "TCP socket floor", "Mooncake TCP"}
    assert bars["qlink tcp"][0] == 4.7 and bars["Mooncake TCP"][0] == 1.8  # the faster way, the faster slice
    assert bars["qlink shm"] == [13.5, 12.0] and bars["TCP socket floor"][0] == 5.2
    assert math.isnan(bars["qlink tcp"][1])  # 4096 scattered: not measured, no bar
    assert {label for label, _, _ in KV_SERIES} >= set(bars)
    assert save_figure(fig_kv_peers([]), tmp_path / "empty.png").stat().st_size > 0


def test_vllm_plot_draws_each_case_and_the_exposed_transfer_only_where_there_is_one(tmp_path):
    rows = [{"case": c, "prompt_tokens": n, "decode_ttft_ms": t, "exposed_ms": e}
            for c, n, t, e in (("recompute", 128, 22.0, None), ("qlink-shm-push", 128, 9.0, 0.0),
                               ("nixl", 128, 14.5, 9.1), ("nixl", 512, 15.0, 9.6), ("recompute", 512, 52.0, None))]
    ax = fig_vllm_connectors(rows).axes[0]
    bars = _bars(ax)
    assert bars["recompute"] == [22.0, 52.0] and bars["nixl"] == [14.5, 15.0]
    assert bars["qlink-shm-push"][0] == 9.0 and math.isnan(bars["qlink-shm-push"][1])
    assert bars["exposed transfer (in the TTFT)"] == [9.1, 9.6]  # nixl's; the push flow's 0 draws nothing
    assert [t.get_text() for t in ax.get_xticklabels()] == ["128 prompt tokens", "512 prompt tokens"]
    path = save_figure(fig_vllm_connectors(rows), tmp_path / "sub" / "vllm.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
