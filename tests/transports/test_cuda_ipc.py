"""``cuda_ipc://``: the host-region path checked like shm's, the typed errors of the device
path on a machine without CUDA, and (marked ``gpu``) device puts between two processes.

The device tests need an NVIDIA GPU with CuPy; elsewhere they skip and say so. CuPy cannot
allocate without CUDA, so the no-GPU checks use a real ``cupy.ndarray`` over memory CUDA
never allocated (CuPy builds the object without asking the driver): registering it, or
putting from it, must fail with a typed error before anything touches the pointer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import zlib
from pathlib import Path

import numpy as np
import pytest

import transports
from qlink.errors import BrokenLinkError, CapabilityError, MissingDependencyError, RegistrationError, WouldBlock
from qlink.memory import RemoteRegion, alloc
from transports import cuda_ipc
from transports._cuda_key import DeviceKey

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]
_N = 1 << 20

# The initiator, in its own process: takes the target's descriptor, puts a seeded payload into
# it (one put, then a put_many of scattered pieces), says "sent", then waits for "bye".
_INITIATOR = textwrap.dedent("""
    import sys, numpy as np, transports
    url, src_kind = sys.argv[1], sys.argv[2]
    ep = transports.connect(url, timeout_s=30)
    desc = ep.recv(timeout_s=30)
    payload = np.random.default_rng(5).integers(0, 256, size=int(sys.argv[3]), dtype=np.uint8)
    if src_kind == "device":
        import cupy
        payload = cupy.asarray(payload)
    ep.send(b"ready")
    if ep.recv(timeout_s=30) == b"go":
        n = len(payload)
        ep.put(payload[: n // 2], desc, offset=0, notify_id=41, tag=b"first-half")
        half, step = n // 2, n // 8
        src = list(range(half, n, step))
        ep.put_many(payload, desc, src, src, [step] * len(src), notify_id=42, tag=b"pieces")
        ep.send(b"sent")
    ep.recv(timeout_s=30)
""")


def _expected(n: int) -> np.ndarray:
    return np.random.default_rng(5).integers(0, 256, size=n, dtype=np.uint8)


def _start_initiator(url: str, src_kind: str, n: int = _N) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.Popen([sys.executable, "-c", _INITIATOR, url, src_kind, str(n)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    proc.stdout.close()


@pytest.fixture
def url() -> str:
    return f"cuda_ipc://t-{uuid.uuid4().hex[:10]}"


def _receive_puts(ep, region_array, n: int, proc) -> list:
    """Drive the initiator through its puts; return the two notifications."""
    assert ep.recv(timeout_s=30) == b"ready", proc
    ep.send(b"go")
    notes = [ep.wait_notification(timeout_s=30), ep.wait_notification(timeout_s=30)]
    assert ep.recv(timeout_s=30) == b"sent"
    ep.send(b"bye")
    return notes


def _check_notes(notes, region_id: int, n: int) -> None:
    first, pieces = notes
    assert (first.region_id, first.offset, first.nbytes, first.notify_id, first.tag) == \
        (region_id, 0, n // 2, 41, b"first-half")
    assert (pieces.region_id, pieces.offset, pieces.nbytes, pieces.notify_id, pieces.tag) == \
        (region_id, n // 2, n - n // 2, 42, b"pieces")


# ----- declarations and URLs ------------------------------------------------------------------


def test_scheme_is_registered_and_declares_device_memory():
    caps = transports.capabilities("cuda_ipc")
    assert caps is cuda_ipc.CAPABILITIES and caps.name == "cuda_ipc"
    assert caps.device_memory and caps.one_sided and caps.cross_process and not caps.cross_host
    assert "cuda_ipc" in transports.schemes()


@pytest.mark.parametrize("bad", ["cuda_ipc://", "cuda_ipc://-x", "shm://x", "cuda_ipc://a b"])
def test_bad_urls_are_value_errors(bad):
    with pytest.raises(ValueError):
        cuda_ipc.listen(bad)


# ----- host regions: the shm path, between two processes ---------------------------------------


def test_host_region_put_between_processes_lands_bit_exact_with_its_notifications(url):
    with transports.listen(url) as lis:
        proc = _start_initiator(lis.url, "host")
        try:
            ep = lis.accept(timeout_s=30)
            target = alloc(_N, dtype=np.uint8)
            region = ep.register(target)
            assert region.kind == "host"
            ep.send(region.descriptor().to_bytes())
            notes = _receive_puts(ep, target, _N, proc)
            _check_notes(notes, region.region_id, _N)
            assert zlib.crc32(target) == zlib.crc32(_expected(_N))
            assert ep.statistics().transport == "cuda_ipc"
            ep.close()
        finally:
            _reap(proc)


def test_dead_peer_is_a_broken_link_within_1s(url):
    with transports.listen(url) as lis:
        proc = _start_initiator(lis.url, "host")
        try:
            ep = lis.accept(timeout_s=30)
            ep.send(ep.register(alloc(64, dtype=np.uint8)).descriptor().to_bytes())
            assert ep.recv(timeout_s=30) == b"ready"
            proc.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(BrokenLinkError):
                ep.wait_notification(timeout_s=None)
            assert time.monotonic() - killed_at < 1.0
            with pytest.raises(BrokenLinkError):
                ep.send(b"hello?", timeout_s=1)
            ep.close()
        finally:
            _reap(proc)


# ----- the device path's checks, on any machine ------------------------------------------------


def _unallocated_cupy_array(nbytes: int):
    """A real cupy.ndarray over an address CUDA never allocated (never dereferenced here)."""
    cupy = pytest.importorskip("cupy", reason="needs the cupy package to build a CuPy array")
    mem = cupy.cuda.UnownedMemory(0x7F00_0000_0000, nbytes, None, device_id=0)
    return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


@pytest.fixture
def pair(url):
    lis = transports.listen(url)
    a = transports.connect(url, timeout_s=5)
    b = lis.accept(timeout_s=5)
    yield a, b
    a.close()
    b.close()
    lis.close()


@pytest.mark.skipif(cuda_ipc.cuda_unavailable() is None, reason="CUDA runs here; checks the error raised without it")
def test_cupy_region_without_a_gpu_is_a_typed_error(pair):
    a, b = pair
    arr = _unallocated_cupy_array(256)
    with pytest.raises(CapabilityError, match="NVIDIA GPU"):
        b.register(arr)
    host = b.register(alloc(256, dtype=np.uint8))
    with pytest.raises(CapabilityError, match="NVIDIA GPU"):  # a device source into a host region
        a.put(arr, host.descriptor())
    assert b.statistics().extra["device_regions"] == 0  # nothing half-registered is left behind
    a.put(b"still fine", host.descriptor(), notify_id=3)
    assert b.wait_notification(timeout_s=5).notify_id == 3


def _device_descriptor(region, *, nbytes: int, bus_id: str = "0000:00:00.0") -> RemoteRegion:
    """A device descriptor as a GPU peer would send it, around one of ``region``'s ids and keys."""
    key = DeviceKey(device=0, nonce=1, address=0x7F00_0000_0000, alloc_offset=0, nbytes=nbytes, bus_id=bus_id,
                    handle=bytes(64), notify_key=region.key)
    return RemoteRegion(region_id=region.region_id, nbytes=nbytes, kind="device", key=key.pack())


def test_device_put_checks_come_before_any_copy(pair):
    a, b = pair
    host = b.register(alloc(64, dtype=np.uint8))
    desc = _device_descriptor(host, nbytes=64)
    with pytest.raises(RegistrationError, match="falls outside"):  # region too small
        a.put(np.zeros(65, dtype=np.uint8), desc)
    with pytest.raises(RegistrationError, match="falls outside"):
        a.put_many(np.zeros(64, dtype=np.uint8), desc, [0], [32], [40])
    with pytest.raises(RegistrationError, match="key says"):  # descriptor and key disagree
        a.put(b"x", RemoteRegion(region_id=desc.region_id, nbytes=32, kind="device", key=desc.key))
    with pytest.raises(RegistrationError, match="bad magic"):
        a.put(b"x", RemoteRegion(region_id=desc.region_id, nbytes=64, kind="device", key=b"X" * 200))
    foreign = _device_descriptor(host, nbytes=64)
    foreign = RemoteRegion(region_id=foreign.region_id + 1, nbytes=64, kind="device", key=foreign.key)
    with pytest.raises(RegistrationError, match="not registered"):  # no such region at the peer
        a.put(b"x", foreign)
    b.deregister(host)
    with pytest.raises(RegistrationError, match="not registered"):  # deregistered by the peer
        a.put(b"x", desc)
    b.close()
    with pytest.raises(BrokenLinkError):  # the peer is gone: nothing is copied
        a.put(b"x", desc)


def test_device_put_of_no_bytes_only_notifies(pair):
    """Everything of a device put but the copy: checks, then one notification with the span."""
    a, b = pair
    host = b.register(alloc(64, dtype=np.uint8))
    desc = _device_descriptor(host, nbytes=64)
    a.put(b"", desc, offset=10, notify_id=5, tag=b"empty")
    a.put_many(b"", desc, [0, 0], [8, 40], [0, 0], notify_id=6)
    first, second = b.wait_notification(timeout_s=5), b.wait_notification(timeout_s=5)
    assert (first.region_id, first.offset, first.nbytes, first.notify_id, first.tag) == \
        (host.region_id, 10, 0, 5, b"empty")
    assert (second.offset, second.nbytes, second.notify_id) == (8, 32, 6)
    s = a.statistics()
    assert s.extra["device_notifications"] == 2 and s.put_bytes == 0 and s.extra["opened_ipc_handles"] == 0


@pytest.mark.skipif(cuda_ipc.cuda_unavailable() is None, reason="CUDA runs here; checks the error raised without it")
def test_device_put_without_cuda_is_a_typed_error_after_the_checks(pair):
    a, b = pair
    desc = _device_descriptor(b.register(alloc(64, dtype=np.uint8)), nbytes=64)
    with pytest.raises((CapabilityError, MissingDependencyError)):
        a.put(b"x", desc)
    assert b.statistics().notifications == 0
    with pytest.raises(WouldBlock):
        b.poll_notification_nowait()  # no completion was published


def test_device_key_round_trip_and_malformed_keys():
    k = DeviceKey(device=1, nonce=2, address=3, alloc_offset=4, nbytes=5, bus_id="0000:65:00.0", handle=b"h" * 64,
                  notify_key=b"k" * 9)
    assert DeviceKey.unpack(k.pack()) == k
    desc = RemoteRegion(region_id=9, nbytes=5, kind="device", key=k.pack())
    assert DeviceKey.unpack(RemoteRegion.from_bytes(desc.to_bytes()).key) == k
    raw = k.pack()
    for bad in (raw[:50], b"XXXX" + raw[4:], raw + b"extra", raw[:4] + b"\x09\x00" + raw[6:]):
        with pytest.raises(RegistrationError):
            DeviceKey.unpack(bad)
    with pytest.raises(ValueError):
        DeviceKey(device=0, nonce=0, address=0, alloc_offset=0, nbytes=0, bus_id="x", handle=b"short",
                  notify_key=b"").pack()


def test_device_completion_rides_the_control_path_as_one_notification(pair):
    """The notification half of a device put, which needs no GPU: a zero-byte gathered put into
    the target's host stand-in reports the device put's span, in order with messages."""
    a, b = pair
    stand_in_array = cuda_ipc._stand_in(1 << 30)  # address space only
    stand_in = b._shm.register(stand_in_array)
    remote = RemoteRegion(region_id=stand_in.region_id, nbytes=stand_in.nbytes, kind="host", key=stand_in.key)
    a._notify(remote, 4096, (1 << 30) - 4096, 77, b"layer-3", 5)
    a.send(b"after")
    a._notify(remote, 10, 0, 78, b"", 5)
    note = b.wait_notification(timeout_s=5)
    assert (note.region_id, note.offset, note.nbytes, note.notify_id, note.tag) == \
        (stand_in.region_id, 4096, (1 << 30) - 4096, 77, b"layer-3")
    assert b.recv(timeout_s=5) == b"after"
    note = b.wait_notification(timeout_s=5)
    assert (note.offset, note.nbytes, note.notify_id) == (10, 0, 78)
    s = a.statistics()
    assert s.puts == 0 and s.extra["device_notifications"] == 2 and s.extra["inline_puts"] == 0


# ----- on an NVIDIA GPU ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["device", "host"])
def test_put_into_a_device_region_between_processes_is_bit_exact(url, source):
    """The initiator's source in device memory (device to device) or in host memory."""
    import cupy

    with transports.listen(url) as lis:
        proc = _start_initiator(lis.url, source)
        try:
            ep = lis.accept(timeout_s=30)
            target = cupy.zeros(_N, dtype=cupy.uint8)
            region = ep.register(target)
            assert region.kind == "device" and region.nbytes == _N
            ep.send(region.descriptor().to_bytes())
            _check_notes(_receive_puts(ep, target, _N, proc), region.region_id, _N)
            assert zlib.crc32(cupy.asnumpy(target)) == zlib.crc32(_expected(_N))
            ep.close()
        finally:
            _reap(proc)


@pytest.mark.gpu
def test_device_descriptor_round_trip_and_same_process_put(pair):
    import cupy

    a, b = pair
    pool_neighbour = cupy.ones(1000, dtype=cupy.uint8)  # the region sits inside a larger pool allocation
    target = cupy.zeros((64, 4), dtype=cupy.float32)
    region = b.register(target)
    desc = RemoteRegion.from_bytes(region.descriptor().to_bytes())
    key = DeviceKey.unpack(desc.key)
    assert desc.kind == "device" and desc.nbytes == target.nbytes == key.nbytes
    assert key.address == target.data.ptr and key.device == target.device.id
    assert key.bus_id == cupy.cuda.runtime.deviceGetPCIBusId(target.device.id)
    src = cupy.arange(64 * 4, dtype=cupy.float32)
    a.put(src[:8], desc, offset=16, notify_id=5)
    note = b.wait_notification(timeout_s=5)
    assert (note.region_id, note.offset, note.nbytes, note.notify_id) == (region.region_id, 16, 32, 5)
    assert cupy.asnumpy(target).reshape(-1)[4:12].tolist() == list(range(8))
    assert int(pool_neighbour.sum()) == 1000
    stats = a.statistics()
    assert stats.puts == 1 and stats.put_bytes == 32 and stats.extra["device_puts"] == 1
    b.deregister(region)
    with pytest.raises(RegistrationError):
        a.put(src[:8], desc)


@pytest.mark.gpu
def test_descriptor_naming_an_unseen_gpu_is_a_device_mismatch(pair):
    import cupy

    a, b = pair
    region = b.register(cupy.zeros(64, dtype=cupy.uint8))
    key = DeviceKey.unpack(region.descriptor().key)
    alien = DeviceKey(device=key.device, nonce=key.nonce ^ 1, address=key.address, alloc_offset=key.alloc_offset,
                      nbytes=key.nbytes, bus_id="00ff:ff:1f.7", handle=key.handle, notify_key=key.notify_key)
    desc = RemoteRegion(region_id=region.region_id, nbytes=64, kind="device", key=alien.pack())
    with pytest.raises(cuda_ipc.DeviceMismatchError, match="cannot see"):
        a.put(cupy.ones(8, dtype=cupy.uint8), desc)
    with pytest.raises(RegistrationError):  # DeviceMismatchError is a RegistrationError
        a.put(cupy.ones(8, dtype=cupy.uint8), desc)


@pytest.mark.gpu
def test_kv_engine_moves_device_caches_over_cuda_ipc():
    from qlink.ai import preset
    from qlink.ai.peer import open_link

    spec = preset("tiny", num_blocks=16)
    with open_link("cuda_ipc", spec, device="gpu") as (rx, cache, peer):
        assert cache.device == "gpu"
        src, dst = [3, 4, 5, 9, 12], [0, 1, 2, 3, 4]
        sub, rec = peer.transfer(rx, 1, src, dst, timeout_s=30)
        assert rec.transport == "cuda_ipc" and rec.mode == "put"
        theirs = peer.call("checksums", src, None)
        assert (cache.block_checksums(dst) == theirs).all()


@pytest.mark.gpu
def test_deferred_device_puts_publish_in_order_once_copied_and_before_a_later_message(pair):
    import cupy

    a, b = pair
    mib = 1 << 20
    target = cupy.zeros(8 * mib, dtype=cupy.uint8)
    region = b.register(target)
    desc = RemoteRegion.from_bytes(region.descriptor().to_bytes())
    src = cupy.asarray(np.random.default_rng(8).integers(0, 256, size=8 * mib, dtype=np.uint8))
    for i in range(8):  # queued, not waited for: each returns once its copy is on the stream
        a.put_many(src, desc, [i * mib], [i * mib], [mib], notify_id=i, tag=b"L%d" % i, defer=True)
    assert a.statistics().extra["deferred_device_puts"] == 8
    a.send(b"after")  # never overtakes a completion queued before it
    assert b.recv(timeout_s=10) == b"after"
    notes = [b.poll_notification_nowait() for _ in range(8)]  # already there: they came first
    assert [(n.notify_id, n.offset, n.nbytes, n.tag) for n in notes] == \
        [(i, i * mib, mib, b"L%d" % i) for i in range(8)]
    assert zlib.crc32(cupy.asnumpy(target)) == zlib.crc32(cupy.asnumpy(src))
    src[:mib] = 7
    a.put_many(src, desc, [0], [0], [mib], notify_id=99, defer=True)
    a.flush(timeout_s=10)  # publishes what is still queued
    assert b.wait_notification(timeout_s=10).notify_id == 99
    assert int((target[:mib] == 7).sum()) == mib
