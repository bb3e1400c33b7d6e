"""``ucx://`` with device (CuPy) buffers: typed errors where UCX or CUDA cannot move them,
and (marked ``gpu``) sends, receives and puts of GPU memory with ``UCX_TLS`` loading
UCX's CUDA transports.

The GPU test runs in a fresh interpreter: UCX reads ``UCX_TLS`` once per process, when the
first context is made, and this test process may already hold one made with the default.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import transports
from qlink.errors import CapabilityError
from qlink.memory import alloc
from transports import _ucx_device

pytestmark = pytest.mark.timeout(120)
REPO_ROOT = Path(__file__).resolve().parents[2]


def _unallocated_cupy_array(nbytes: int):
    """A real cupy.ndarray over an address CUDA never allocated (never dereferenced here)."""
    cupy = pytest.importorskip("cupy", reason="needs the cupy package to build a CuPy array")
    mem = cupy.cuda.UnownedMemory(0x7F00_0000_0000, nbytes, None, device_id=0)
    return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


def test_ucx_tls_values_that_load_a_cuda_transport():
    assert not _ucx_device.tls_moves_device_memory("tcp,sm,self")
    assert _ucx_device.tls_moves_device_memory("tcp,cuda")
    assert _ucx_device.tls_moves_device_memory(_ucx_device.CUDA_UCX_TLS)
    assert not _ucx_device.tls_moves_device_memory("^cuda_copy")
    assert not _ucx_device.tls_moves_device_memory("")


def test_device_buffers_without_cuda_are_typed_errors_and_the_link_survives():
    pytest.importorskip("ucxx", reason="the ucx:// transport needs the optional 'ucxx' package")
    from transports.cuda import cuda_unavailable

    if cuda_unavailable() is None:
        pytest.skip("CUDA runs here; this checks the errors raised without it")
    arr = _unallocated_cupy_array(8192)
    with transports.listen("ucx://127.0.0.1:0") as lis:
        a = transports.connect(lis.url, timeout_s=10)
        b = lis.accept(timeout_s=10)
        try:
            for call in (lambda: b.register(arr), lambda: a.send(arr, timeout_s=1), lambda: a.send_nowait(arr),
                         lambda: b.recv_into(arr, timeout_s=0.1)):
                with pytest.raises(CapabilityError, match="NVIDIA GPU"):
                    call()
            region = b.register(alloc(8192, dtype=np.uint8))
            with pytest.raises(CapabilityError):
                a.put(arr, region.descriptor(), timeout_s=1)
            a.send(b"still here", timeout_s=5)
            assert b.recv(timeout_s=5) == b"still here"
            assert a.statistics().messages_sent == 1
        finally:
            a.close()
            b.close()


# Two processes, each with UCX_TLS loading UCX's CUDA transports: the server receives device
# messages into device buffers and registers a device region; the client sends from device
# memory and puts into that region (a small put rides inline, a large one leaves from the GPU).
_GPU_SERVER = textwrap.dedent("""
    import sys, numpy as np, cupy, transports
    sizes = (64, 1 << 20)
    rng = np.random.default_rng(3)
    want = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]
    with transports.listen("ucx://127.0.0.1:0") as lis:
        print(lis.url, flush=True)
        b = lis.accept(timeout_s=60)
        assert "cuda" in b.statistics().extra["ucx_tls"], b.statistics().extra
        for n, w in zip(sizes, want):
            dst = cupy.zeros(n, dtype=cupy.uint8)
            assert b.recv_into(dst, timeout_s=30) == n
            assert bool((cupy.asnumpy(dst) == w).all()), n
        region_mem = cupy.zeros(2 * sum(sizes), dtype=cupy.uint8)
        region = b.register(region_mem)
        assert region.kind == "device"
        b.send(region.descriptor().to_bytes())
        off = 0
        for n, w in zip(sizes, want):
            note = b.wait_notification(timeout_s=30)
            assert (note.offset, note.nbytes, note.notify_id) == (off, n, n), note
            assert bool((cupy.asnumpy(region_mem[off:off + n]) == w).all()), n
            off += n
        assert int(region_mem[off:].sum()) == 0
        b.send(b"bye")
        b.recv(timeout_s=30)
        b.close()
    print("GPU-UCX-OK", flush=True)
""")

_GPU_CLIENT = textwrap.dedent("""
    import sys, numpy as np, cupy, transports
    sizes = (64, 1 << 20)
    rng = np.random.default_rng(3)
    src = [cupy.asarray(rng.integers(0, 256, size=n, dtype=np.uint8)) for n in sizes]
    a = transports.connect(sys.argv[1], timeout_s=30)
    for s in src:
        a.send(s, timeout_s=30)
    desc = a.recv(timeout_s=30)
    off = 0
    for s in src:
        a.put(s, desc, offset=off, notify_id=len(s), timeout_s=30)
        off += len(s)
    assert a.recv(timeout_s=30) == b"bye"
    a.send(b"ok")
    a.close()
""")


@pytest.mark.gpu
def test_device_send_recv_and_put_over_ucx_with_cuda_tls():
    pytest.importorskip("ucxx", reason="the ucx:// transport needs the optional 'ucxx' package")
    env = dict(os.environ, UCX_TLS=_ucx_device.CUDA_UCX_TLS)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    server = subprocess.Popen([sys.executable, "-c", _GPU_SERVER], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    client = None
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("ucx://"), url + server.stdout.read()
        client = subprocess.Popen([sys.executable, "-c", _GPU_CLIENT, url], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        c_out, _ = client.communicate(timeout=90)
        s_out, _ = server.communicate(timeout=30)
        assert client.returncode == 0, c_out
        assert server.returncode == 0 and "GPU-UCX-OK" in s_out, s_out
    finally:
        for p in (server, client):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
