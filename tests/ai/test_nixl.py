"""The KV engine over NIXL (UCX backend): WRITE from another process, READ, layer
order, status and error mapping. Skipped where nixl-cu12 is not installed."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import transports
from qlink.ai import BlockIdError, KVCache, LayoutMismatchError, plan_transfer, preset
from qlink.ai.peer import open_link, transport_unavailable
from transports import loopback_url
from qlink.ai.nixl_backend import NixlError, NixlKVReceiver, NixlKVSender, XferState, nixl_available
from qlink.errors import BrokenLinkError, MissingDependencyError, RegistrationError

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not nixl_available(), reason="nixl-cu12 is not installed (pip install 'qlink[nixl]')"),
]

RX_BLOCKS, TX_BLOCKS, SEED = 40, 56, 5


def _spec(n):
    return preset("tiny", num_blocks=n)


def _control_scheme() -> str:
    """The qlink transport that carries the NIXL handshake between two processes."""
    for s in ("shm", "tcp"):
        if not transport_unavailable(s):
            return s
    pytest.skip("no cross-process qlink transport (shm, tcp) to carry the NIXL handshake")


@pytest.fixture(scope="module")
def nixl_link():
    with open_link(_control_scheme(), _spec(RX_BLOCKS), _spec(TX_BLOCKS), seed=SEED, backend="nixl") as link:
        yield link


def test_write_from_another_process_is_bit_exact(nixl_link):
    rx, cache, peer = nixl_link
    rng = np.random.default_rng(3)
    cases = [
        (np.arange(10, 20), np.arange(0, 10)),
        (np.arange(0, 30, 2), rng.permutation(RX_BLOCKS)[:15]),
        (rng.integers(0, TX_BLOCKS, 9), rng.choice(RX_BLOCKS, 9, replace=False)),
    ]
    for rid, (src, dst) in enumerate(cases, start=100):
        sub, rec = peer.transfer(rx, rid, src, dst, timeout_s=30)
        assert (cache.block_checksums(dst) == peer.call("checksums", src, None)).all()
        plan = plan_transfer(src, dst, src_num_blocks=TX_BLOCKS, dst_num_blocks=RX_BLOCKS,
                             block_nbytes=cache.spec.block_nbytes)
        assert rec.num_descs == sub.num_descs == plan.num_descs * cache.spec.num_layers
        assert rec.transport == sub.transport == "nixl-ucx" and rec.mode == "nixl"
        assert list(rec.layer_ready_us) == sorted(rec.layer_ready_us)


def test_read_pulls_the_senders_blocks(nixl_link):
    rx, cache, peer = nixl_link
    src, dst = [50, 51, 52, 7], [30, 31, 32, 33]
    rec = rx.read_request(200, src, dst, timeout_s=30)
    assert rec.mode == "nixl-read" and rec.num_layers == cache.spec.num_layers
    assert (cache.block_checksums(dst) == peer.call("checksums", src, None)).all()
    with pytest.raises(BlockIdError, match="src_block_ids contains block id 56"):
        rx.read_request(201, [TX_BLOCKS], [0])
    with pytest.raises(BlockIdError, match="dst_block_ids contains block id 40"):
        rx.read_request(201, [0], [RX_BLOCKS])


def test_prepared_read_of_a_whole_request_is_bit_exact_and_notifies_the_sender():
    """Caches of one shape: the pull is ONE prepared READ over every (layer, plane, block)
    (vLLM's way), bit-exact for scattered blocks and a layer subset; the thread's CPU
    affinity is what it was before the agent started."""
    import os

    before = os.sched_getaffinity(0)
    with open_link(_control_scheme(), _spec(RX_BLOCKS), seed=SEED, backend="nixl") as (rx, cache, peer):
        assert os.sched_getaffinity(0) == before
        rng = np.random.default_rng(11)
        src, dst = rng.permutation(RX_BLOCKS)[:13], rng.permutation(RX_BLOCKS)[:13]
        rec = rx.read_request(400, src, dst, timeout_s=30)
        assert rec.mode == "nixl-read" and rec.num_descs == 13 * cache.spec.num_planes * cache.spec.num_layers
        assert (cache.block_checksums(dst) == peer.call("checksums", src, None)).all()
        untouched = [b for b in range(RX_BLOCKS) if b not in set(dst.tolist())][:2]
        was = cache.block_checksums(untouched, layers=range(0, 1))
        rec = rx.read_request(401, [3, 4], untouched, layers=range(1, 3), timeout_s=30)
        assert rec.num_layers == 2
        assert (cache.block_checksums(untouched, layers=range(1, 3)) == peer.call("checksums", [3, 4], range(1, 3))).all()
        assert (cache.block_checksums(untouched, layers=range(0, 1)) == was).all()  # layer 0 not pulled


def test_layer_subset(nixl_link):
    rx, cache, peer = nixl_link
    before = cache.block_checksums([36, 37])
    _, rec = peer.transfer(rx, 300, [1, 2], [36, 37], range(2, 4), timeout_s=30)
    assert rec.num_layers == 2
    after = cache.block_checksums([36, 37])
    assert (after[:2] == before[:2]).all()
    assert (after[2:] == peer.call("checksums", [1, 2], range(2, 4))).all()


def test_sender_dying_mid_request_fails_the_request():
    with open_link(_control_scheme(), _spec(RX_BLOCKS), _spec(TX_BLOCKS), seed=SEED, backend="nixl") as (rx, _, peer):
        rx.handshake(timeout_s=30)  # NIXL wires up to the sender's agent while it is alive
        peer.call("partial", 7, [0, 3], [0, 1], 2, 0)  # layers 0 and 1, then the process exits
        assert rx.wait_layer(7, 1, timeout_s=30) > 0
        with pytest.raises(BrokenLinkError):
            rx.wait_layer(7, 2, timeout_s=30)


@pytest.fixture
def local_pair():
    """A NIXL sender and receiver in this process, handshaking over a qlink transport."""
    scheme = next((s for s in ("inproc", "shm") if not transport_unavailable(s)), None)
    if scheme is None:
        pytest.skip("no in-process qlink transport")
    lis = transports.listen(loopback_url(scheme))
    a = transports.connect(lis.url, timeout_s=5)
    b = lis.accept(timeout_s=5)
    made = []

    def make(rx_spec=_spec(RX_BLOCKS), tx_spec=_spec(TX_BLOCKS)):
        rx_cache, tx_cache = KVCache.allocate(rx_spec), KVCache.allocate(tx_spec)
        tx_cache.fill_random(seed=SEED)
        rx = NixlKVReceiver(b, rx_cache)
        tx = NixlKVSender(a, tx_cache)
        made.extend([tx, rx])
        return tx, rx, tx_cache, rx_cache

    yield make
    for x in made:
        x.close()
    a.close()
    b.close()
    lis.close()


def test_layout_mismatch(local_pair):
    tx, rx, _, _ = local_pair(tx_spec=preset("tiny", num_blocks=TX_BLOCKS, block_size=8))
    with pytest.raises(LayoutMismatchError) as e:
        tx.handshake(timeout_s=5)
    assert e.value.field == "block_size"
    with pytest.raises(LayoutMismatchError):
        rx.handshake(timeout_s=5)


def test_unregistered_memory_is_a_registration_error(local_pair):
    tx, rx, tx_cache, _ = local_pair()
    tx.handshake(timeout_s=5)
    nx = tx._nx
    outside = np.zeros(4096, dtype=np.uint8)  # never registered with NIXL
    local = nx.descs(outside.ctypes.data, np.array([0]), np.array([256]))
    remote = nx.descs(int(tx._peer_addrs[0]), np.array([0]), np.array([256]))
    with pytest.raises(RegistrationError, match="not registered"):
        nx.start("WRITE", local, remote, tx._peer_name, b"", "a WRITE from unregistered memory")
    tx.send_request(1, [4], [4])  # the engine still works
    assert rx.wait_request(1, timeout_s=10).num_layers == tx_cache.spec.num_layers


def test_status_strings_become_enums_and_errors():
    assert XferState.of("DONE").done and not XferState.of("PROC").done
    with pytest.raises(NixlError, match="unknown transfer status"):
        XferState.of("MAYBE")
    from qlink.ai.nixl_backend import _check

    with pytest.raises(BrokenLinkError, match="ERR"):
        _check("ERR", "a test transfer")


def test_missing_nixl_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl_cu12._api", None)
    from qlink.ai.nixl_backend import _nixl

    with pytest.raises(MissingDependencyError, match=r"nixl-cu12.*qlink\[nixl\]"):
        _nixl()


_BENCH_THEN_NIXL = """
import json, sys
from qlink.bench.kv import run_kv_bench
if __name__ == "__main__":
    rows = run_kv_bench(transports=("ucx",), tokens=(16,), preset="tiny", repeats=1, patterns=("contiguous",),
                        nixl=True, mooncake=False, memory_budget_nbytes=1 << 22, progress=lambda _: None)
    keep = ("case", "basis", "ucx_env", "ucxx_in_process", "note", "rma_pieces_by")
    print(json.dumps({"ucxx_here": "ucxx" in sys.modules,
                      "rows": [{k: r.get(k) for k in keep} for r in rows if r.get("basis") in ("measured", "error")]}))
"""


def test_importing_ucxx_through_qlink_leaves_the_environment_to_nixl_and_the_bench_measures_nixl_apart(tmp_path):
    import importlib.util
    import json
    import os
    import subprocess

    if importlib.util.find_spec("ucxx") is None:  # not importorskip: a plain import of UCXX writes UCX_* options
        pytest.skip("ucxx is not installed")
    code = ("import os; from transports.ucx import require_ucxx; require_ucxx(); "
            "from transports import _ucx_core as c; w = c.Worker('lo'); "
            "print(sorted(k for k in os.environ if k.startswith('UCX_RNDV')), c.UCXX_IMPORT_OPTIONS.get('RNDV_THRESH'), "
            "w.context.config.get('RNDV_THRESH'))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}  # as a fresh shell has it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env=env).stdout.split()
    assert out[0] == "[]"  # nothing UCXX's import wrote is left in the environment for NIXL to read...
    assert out[1] == "8192" and "8K" in out[2]  # ...and qlink's own UCX context still has it ("intra:8K,inter:8K")
    if transport_unavailable("ucx"):
        pytest.skip(f"ucx:// cannot run here: {transport_unavailable('ucx')}")
    script = tmp_path / "bench_then_nixl.py"
    script.write_text(_BENCH_THEN_NIXL)
    got = json.loads(subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                                    check=True, env=env).stdout.splitlines()[-1])
    ucx = [r for r in got["rows"] if r["case"].startswith("qlink ucx")]
    nixl = [r for r in got["rows"] if r["case"].startswith("NIXL")]
    assert got["ucxx_here"] and ucx and ucx[0]["basis"] == "measured"  # UCXX ran in the bench's process...
    assert nixl and nixl[0]["basis"] == "measured", nixl
    assert nixl[0]["ucxx_in_process"] is False  # ...not in the one NIXL was measured in
    assert "UCX_RNDV_THRESH" not in (nixl[0]["ucx_env"] or "")  # and none of its options reached NIXL
    by = {r["case"]: r["rma_pieces_by"] for r in ucx}  # what moved each ucx row's pieces
    from transports import _ucx_cma

    assert by["qlink ucx put (tagged, rma=False)"] is None  # tagged puts
    assert by["qlink ucx put (UCX RMA, CMA off)"] == "UCX, one call per piece"
    assert by["qlink ucx put"] == ("CMA, up to 1024 pieces per call" if _ucx_cma.built() else None)
