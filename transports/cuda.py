"""CUDA pieces of the device-memory paths, on CuPy, imported only when device memory is met.

* :func:`cuda_unavailable` / :func:`require`: whether CUDA can run here, else a typed error
  (:class:`~qlink.errors.MissingDependencyError` without CuPy,
  :class:`~qlink.errors.CapabilityError` without a usable GPU).
* :func:`is_device` / :func:`device_span`: an object with ``__cuda_array_interface__`` (CuPy,
  PyTorch CUDA tensors...) and its ``(address, nbytes)``.
* :func:`export_region`: what a peer needs to open a device region with CUDA IPC
  (``cudaIpcGetMemHandle`` of the allocation holding it, the offset inside it, the device's
  PCI bus id); :class:`IpcMappings` opens each peer allocation once
  (``cudaIpcOpenMemHandle``) and closes them all at the end.
* :func:`copy_pieces`: ``cudaMemcpyAsync`` (``cudaMemcpyPeerAsync`` across devices) of
  pieces of a device or host source into device memory, on the current CuPy stream of the
  destination's device, synchronised before it returns.

Ordering: a copy is queued after the work already queued on the current CuPy stream of the
destination's device (where CuPy runs its own kernels); a source on another device has that
device's current stream synchronised first. Work on other streams is the caller's to finish.

CuPy's memory pool hands out pieces of larger ``cudaMalloc`` allocations, and an IPC handle
names a whole allocation: the allocation's base comes from the driver
(``cuMemGetAddressRange``, through :mod:`ctypes` on ``libcuda``), the region is then
``base + offset`` on both sides.

>>> is_device(bytearray(4)), cuda_unavailable() is None or isinstance(cuda_unavailable(), str)
(False, True)
"""

from __future__ import annotations

import ctypes
import functools
import secrets

import numpy as np

from qlink.errors import CapabilityError, RegistrationError, missing
from qlink.memory import as_byte_view, is_device_array

from ._cuda_key import HANDLE_NBYTES, DeviceKey

__all__ = ["PROCESS_NONCE", "DeviceMismatchError", "cuda_unavailable", "require", "is_device", "device_span",
           "device_of", "export_region", "IpcMappings", "copy_pieces", "queue_pieces", "to_host", "device_name"]

#: Tells this process's exports from another's (a PID may repeat across PID namespaces).
PROCESS_NONCE = secrets.randbits(64)


class DeviceMismatchError(RegistrationError):
    """A device-region descriptor names a GPU this process cannot reach (not visible here,
    e.g. hidden by ``CUDA_VISIBLE_DEVICES``, or from another machine); the put was not done."""


@functools.lru_cache(maxsize=1)
def cuda_unavailable() -> str | None:
    """None when CuPy can run on a visible NVIDIA GPU, else why not."""
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e})"
    except Exception as e:  # noqa: BLE001 - installed without its CUDA libraries
        return f"CuPy does not import here ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, or a driver too old for this CUDA runtime
        return f"CUDA finds no usable GPU here ({type(e).__name__}: {e})"
    return None if n > 0 else "CUDA reports 0 GPUs here"


def require(feature: str):
    """The ``cupy`` module, or a typed error saying why ``feature`` cannot run here."""
    why = cuda_unavailable()
    if why is None:
        import cupy

        return cupy
    if why.startswith("CuPy is not installed"):
        raise missing("cupy-cuda12x", extra="gpu", feature=feature)
    raise CapabilityError(f"{feature} needs an NVIDIA GPU that CUDA can use, and {why}; "
                          "use host (NumPy) memory on this machine")


def is_device(obj) -> bool:
    """True for device memory: ``__cuda_array_interface__`` and no host ``__array_interface__``.
    Asked of the type first, so a CuPy array's interface is not built just to be looked at."""
    t = type(obj)
    if hasattr(t, "__array_interface__"):
        return False
    if hasattr(t, "__cuda_array_interface__"):
        return True
    return is_device_array(obj) and not hasattr(obj, "__array_interface__")


def device_span(obj, *, writable: bool = False) -> tuple[int, int]:
    """``(address, nbytes)`` of a C-contiguous device array; ValueError otherwise."""
    ptr = getattr(getattr(obj, "data", None), "ptr", None)  # a CuPy array: no interface dict to build
    if type(ptr) is int and obj.flags.c_contiguous:
        return ptr, int(obj.nbytes)
    cai = obj.__cuda_array_interface__
    shape = tuple(int(x) for x in cai["shape"])
    itemsize = np.dtype(cai["typestr"]).itemsize
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    nbytes = count * itemsize
    strides = cai.get("strides")
    if strides is not None and count > 1:
        want, expect = tuple(int(s) for s in strides), []
        step = itemsize
        for dim in reversed(shape):
            expect.append(step)
            step *= dim
        if any(d > 1 and s != e for d, s, e in zip(shape, want, reversed(expect))):
            raise ValueError(f"device array must be C-contiguous, got shape {shape} strides {want}")
    address, readonly = cai["data"]
    if writable and readonly:
        raise ValueError("cannot register a read-only device array as a put target")
    return int(address), nbytes


def device_of(cp, obj, address: int) -> int:
    """The ordinal of the device holding ``obj`` (CuPy's ``.device.id``, else asked of CUDA)."""
    dev = getattr(getattr(obj, "device", None), "id", None)
    if isinstance(dev, int):
        return dev
    return int(cp.cuda.runtime.pointerGetAttributes(address).device)


def device_name(cp, device: int = 0) -> str:
    """The product name of device ``device`` (e.g. ``'NVIDIA H100 80GB HBM3'``)."""
    name = cp.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


# ----------------------------------------------------------------------------- export


@functools.lru_cache(maxsize=1)
def _get_address_range():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CapabilityError(f"the CUDA driver library libcuda.so.1 cannot be loaded ({e})") from None
    fn = lib.cuMemGetAddressRange_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return fn


def _allocation_range(cp, address: int) -> tuple[int, int]:
    """``(base, nbytes)`` of the ``cudaMalloc`` allocation holding ``address`` (current device)."""
    cp.cuda.runtime.free(0)  # makes the device's primary context current for the driver call below
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = _get_address_range()(ctypes.byref(base), ctypes.byref(size), address)
    if status != 0:
        raise RegistrationError(f"CUDA could not find the allocation holding device address {address:#x} "
                                f"(cuMemGetAddressRange returned CUresult {status})")
    return int(base.value), int(size.value)


def export_region(cp, obj, *, notify_key: bytes) -> DeviceKey:
    """Everything a peer process needs to write into device array ``obj`` (see :class:`DeviceKey`)."""
    rt = cp.cuda.runtime
    address, nbytes = device_span(obj, writable=True)
    if nbytes == 0:
        dev = rt.getDevice()
        return DeviceKey(device=dev, nonce=PROCESS_NONCE, address=address, alloc_offset=0, nbytes=0,
                         bus_id=rt.deviceGetPCIBusId(dev), handle=bytes(HANDLE_NBYTES), notify_key=notify_key)
    attrs = rt.pointerGetAttributes(address)
    if attrs.type != rt.memoryTypeDevice:
        raise RegistrationError(f"CUDA IPC exports device memory from cudaMalloc (CuPy's default allocator); this "
                                f"array's memory has CUDA memory type {attrs.type} (host or managed)")
    dev = int(attrs.device)
    with cp.cuda.Device(dev):
        base, size = _allocation_range(cp, address)
        if address + nbytes > base + size:
            raise RegistrationError(f"device array of {nbytes} bytes at {address:#x} runs past its allocation "
                                    f"({size} bytes at {base:#x})")
        try:
            handle = rt.ipcGetMemHandle(base)
        except rt.CUDARuntimeError as e:
            raise RegistrationError(f"CUDA could not export this device memory for IPC ({e}); memory from "
                                    "cudaMallocAsync pools or the virtual memory API needs another path") from None
    return DeviceKey(device=dev, nonce=PROCESS_NONCE, address=address, alloc_offset=address - base, nbytes=nbytes,
                     bus_id=rt.deviceGetPCIBusId(dev), handle=bytes(handle), notify_key=notify_key)


def _local_device(cp, bus_id: str) -> int:
    try:
        return int(cp.cuda.runtime.deviceGetByPCIBusId(bus_id))
    except cp.cuda.runtime.CUDARuntimeError as e:
        raise DeviceMismatchError(
            f"the region lives on the GPU at PCI bus id {bus_id!r}, which this process cannot see ({e}); both "
            "processes must see that device (check CUDA_VISIBLE_DEVICES), on the same machine"
        ) from None


class IpcMappings:
    """The peer's allocations this process has opened, each once, keyed by IPC handle."""

    def __init__(self) -> None:
        self._open: dict[bytes, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def target(self, cp, key: DeviceKey) -> tuple[int, int]:
        """``(device ordinal here, region address here)`` for a region described by ``key``."""
        if key.nonce == PROCESS_NONCE:  # exported by this very process: its address is valid as it is
            return _local_device(cp, key.bus_id), key.address
        hit = self._open.get(key.handle)
        if hit is None:
            dev = _local_device(cp, key.bus_id)
            rt = cp.cuda.runtime
            with cp.cuda.Device(dev):
                try:
                    base = int(rt.ipcOpenMemHandle(key.handle, rt.cudaIpcMemLazyEnablePeerAccess))
                except rt.CUDARuntimeError as e:
                    raise RegistrationError(f"CUDA could not open the peer's IPC handle on device {dev} ({e}); "
                                            "the peer may have freed the memory, or runs on another machine") from None
            hit = self._open[key.handle] = (dev, base)
        return hit[0], hit[1] + key.alloc_offset

    def close(self, cp) -> None:
        """Close every opened handle (the peer's memory stays the peer's)."""
        items, self._open = list(self._open.values()), {}
        for dev, base in items:
            try:
                with cp.cuda.Device(dev):
                    cp.cuda.runtime.ipcCloseMemHandle(base)
            except Exception:  # noqa: BLE001 - closing at the end: a failure leaves nothing to do
                pass


# ----------------------------------------------------------------------------- copies


def copy_pieces(cp, *, dst_address: int, dst_device: int, src, pieces) -> int:
    """Copy ``(src_offset, dst_offset, nbytes)`` pieces of ``src`` (a device array or a host
    buffer) to ``dst_address + dst_offset`` on ``dst_device``; return once every byte is in
    place (the stream is synchronised). Returns the bytes copied."""
    return _copy(cp, dst_address=dst_address, dst_device=dst_device, src=src, pieces=pieces, wait=True)[0]


def queue_pieces(cp, *, dst_address: int, dst_device: int, src, pieces) -> tuple[int, object, object]:
    """:func:`copy_pieces` without the wait: the copies are queued on the stream and
    ``(bytes, event, keep)`` returned, ``event`` a CUDA event recorded after the last piece
    (``event.done`` once every byte is in place) and ``keep`` what must stay alive until then."""
    return _copy(cp, dst_address=dst_address, dst_device=dst_device, src=src, pieces=pieces, wait=False)


def _copy(cp, *, dst_address: int, dst_device: int, src, pieces, wait: bool):
    rt = cp.cuda.runtime
    host = None
    total = 0
    with cp.cuda.Device(dst_device):
        stream = cp.cuda.get_current_stream()
        sp = stream.ptr
        if is_device(src):
            s_addr, _ = device_span(src)
            s_dev = device_of(cp, src, s_addr)
            if s_dev != dst_device:
                cp.cuda.get_current_stream(s_dev).synchronize()  # what was queued on the source is written
            for so, do, n in pieces:
                if n:
                    if s_dev == dst_device:
                        rt.memcpyAsync(dst_address + do, s_addr + so, n, rt.memcpyDeviceToDevice, sp)
                    else:
                        rt.memcpyPeerAsync(dst_address + do, dst_device, s_addr + so, s_dev, n, sp)
                    total += n
        else:
            host = np.frombuffer(as_byte_view(src), dtype=np.uint8)  # kept alive until the stream is done
            h_addr = host.ctypes.data if host.size else 0
            for so, do, n in pieces:
                if n:
                    rt.memcpyAsync(dst_address + do, h_addr + so, n, rt.memcpyHostToDevice, sp)
                    total += n
        if wait:
            stream.synchronize()
            return total, None, None
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
    return total, event, (src, host)


def to_host(cp, obj) -> np.ndarray:
    """A host copy of device array ``obj`` (flat ``uint8``), for paths that carry host bytes."""
    return cp.asnumpy(cp.asarray(obj)).reshape(-1).view(np.uint8)
