"""The KV bench runs end to end on a tiny layout and returns well-formed rows (no speed asserted)."""

from __future__ import annotations

import pytest

from qlink.ai._peer import transport_unavailable
from qlink.bench.kv import modeled_rows, run_kv_bench


@pytest.mark.timeout(120)
def test_kv_bench_rows_on_a_tiny_layout():
    scheme = next((s for s in ("shm", "tcp") if not transport_unavailable(s)), None)
    if scheme is None:
        pytest.skip("no cross-process transport (shm, tcp) available")
    rows = run_kv_bench(transports=(scheme, "nosuch"), tokens=(16, 64, 1 << 20), preset="tiny", repeats=1,
                        nixl=False, memory_budget_nbytes=1 << 20, progress=lambda _: None)
    by_basis = {}
    for r in rows:
        by_basis.setdefault(r["basis"], []).append(r)
    measured = by_basis["measured"]
    assert {(r["tokens"], r["pattern"]) for r in measured} == {(t, p) for t in (16, 64) for p in ("contiguous", "scattered")}
    for r in measured:
        assert r["case"].startswith(f"qlink {scheme}") and r["transport"] == scheme
        assert r["nbytes"] == r["tokens"] * 512 and r["GBps"] > 0 and r["num_descs"] >= 4
        assert r["x_memcpy"] > 0 and r["prep_us_per_block"] >= 0 and r["submit_us_per_block"] > 0
        assert r["moved_by"] == ("receiver" if scheme == "shm" else "sender")  # shm defers the copy to the receiver
    assert {r["tokens"] for r in by_basis["floor"]} == {16, 64}
    crc = by_basis["overhead"]  # what checksum=True adds per side, beside the memcpy floor
    assert {r["tokens"] for r in crc} == {16, 64} and all(r["GBps"] > 0 and r["x_memcpy"] > 0 for r in crc)
    assert len(by_basis["modeled"]) == 6
    skipped = {r["case"]: r for r in by_basis["skipped"]}
    assert skipped["all"]["tokens"] == 1 << 20  # too big for the memory budget
    assert "nosuch" in skipped["qlink nosuch"]["note"]


def test_modeled_rows_follow_the_link_catalog():
    rows = modeled_rows(450 * 10**9, tokens=1)
    nv = next(r for r in rows if r["case"].startswith("NVLink 4"))
    assert nv["basis"] == "modeled" and 0.99 < nv["p50_ms"] / 1e3 < 1.01  # 450 GB at 450 GB/s: about one second
    assert {r["case"] for r in rows} == {"NVLink 4 (modeled)", "PCIe 5 x16 (modeled)", "400 Gb/s NIC (modeled)"}
