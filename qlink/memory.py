"""Registered memory: host (NumPy) and device (CuPy) regions and their descriptors.

A *region* is a contiguous buffer an endpoint has registered; its *descriptor*
(:class:`RemoteRegion`) is a small fixed-layout byte string a peer can target with a
one-sided ``put``. Descriptors are packed with :mod:`struct`, never pickled.

:func:`alloc` returns host memory that can be shared with another process (a
``memfd`` mapping), the analogue of ``ucp_mem_map(ALLOCATE)``: a shared-memory
transport can ``put`` into it with a single memcpy and no help from the target.

>>> import numpy as np
>>> from qlink.memory import alloc, RemoteRegion
>>> a = alloc((4, 16), dtype=np.uint8)
>>> a.shape, a.dtype, int(a.sum())
((4, 16), dtype('uint8'), 0)
>>> d = RemoteRegion(region_id=7, nbytes=64, kind="host", key=b"abc")
>>> RemoteRegion.from_bytes(d.to_bytes()) == d
True
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from .errors import RegistrationError

__all__ = ["alloc", "Region", "RemoteRegion", "shared_fd_of", "as_byte_view", "is_device_array"]

_DESC = struct.Struct("<4sIQB3xI")  # magic, region_id, nbytes, kind, key_len
_DESC_MAGIC = b"QLRG"
_KINDS = {"host": 0, "device": 1}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_MAX_KEY = 4096


@dataclass(frozen=True)
class RemoteRegion:
    """What a peer needs to target a registered region: id, size, kind and a
    transport-specific key (an address, a memfd identity, a UCX rkey...)."""

    region_id: int
    nbytes: int
    kind: str = "host"
    key: bytes = b""

    def to_bytes(self) -> bytes:
        """Pack into a fixed little-endian layout (header + key)."""
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {self.kind!r}")
        return _DESC.pack(_DESC_MAGIC, self.region_id, self.nbytes, _KINDS[self.kind], len(self.key)) + bytes(self.key)

    @classmethod
    def from_bytes(cls, data) -> "RemoteRegion":
        """Parse a descriptor produced by :meth:`to_bytes`; raises RegistrationError if malformed."""
        mv = memoryview(data).cast("B")
        if len(mv) < _DESC.size:
            raise RegistrationError(f"region descriptor is {len(mv)} bytes, shorter than its {_DESC.size}-byte header")
        magic, rid, nbytes, kind, key_len = _DESC.unpack_from(mv, 0)
        if magic != _DESC_MAGIC:
            raise RegistrationError(f"region descriptor has bad magic {magic!r}, expected {_DESC_MAGIC!r}")
        if kind not in _KIND_NAMES:
            raise RegistrationError(f"region descriptor has unknown memory kind {kind}")
        if key_len > _MAX_KEY or _DESC.size + key_len != len(mv):
            raise RegistrationError(
                f"region descriptor key length {key_len} does not match the {len(mv) - _DESC.size} bytes that follow"
            )
        return cls(region_id=rid, nbytes=nbytes, kind=_KIND_NAMES[kind], key=bytes(mv[_DESC.size:]))


def is_device_array(obj) -> bool:
    """True when ``obj`` exposes ``__cuda_array_interface__`` (CuPy, Torch CUDA...)."""
    return hasattr(obj, "__cuda_array_interface__")


def as_byte_view(obj) -> memoryview:
    """A flat, writable-if-possible ``uint8`` memoryview over a host buffer (no copy).

    Raises ``TypeError`` for device arrays (use a device-capable transport) and
    ``ValueError`` for non-contiguous buffers.
    """
    if is_device_array(obj) and not hasattr(obj, "__array_interface__"):
        raise TypeError("device array given where host memory is needed; use a transport with device_memory capability")
    mv = memoryview(obj)
    if not mv.contiguous:
        raise ValueError("buffer must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


_shared_lock = threading.Lock()
_shared_blocks: dict[int, tuple[int, int]] = {}  # base address -> (memfd, nbytes)
# Blocks whose memory is gone, not yet forgotten. A block is released by a weakref finalizer,
# which the garbage collector may run in any thread at any allocation -- also in a thread
# that holds _shared_lock (inside shared_fd_of, say): waiting for the lock there would
# deadlock that thread. So the finalizer only notes the address (list.append is atomic) and
# forgets the block itself only if it gets the lock at once; otherwise the next holder does.
_released: list[tuple[int, int]] = []  # (base address, memfd)


def _forget_released() -> None:
    """Close the memfds of released blocks (the caller holds _shared_lock). A block is
    forgotten only if its entry still names that memfd: the address may already belong
    to a newer block (the memfd, still open until here, cannot)."""
    while _released:
        address, fd = _released.pop()
        entry = _shared_blocks.get(address)
        if entry is not None and entry[0] == fd:
            del _shared_blocks[address]
        try:
            os.close(fd)
        except OSError:
            pass


def _release_block(address: int, fd: int) -> None:
    _released.append((address, fd))
    if _shared_lock.acquire(blocking=False):
        try:
            _forget_released()
        finally:
            _shared_lock.release()


def alloc(shape, dtype=np.uint8) -> np.ndarray:
    """Allocate zeroed host memory that another process can map (memfd-backed).

    Use it for regions a peer will ``put`` into over ``shm://``: the put is then a
    single memcpy by the initiator, with no copy on the target side. The memfd is
    closed when the last view of the memory is gone.
    """
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(x) for x in shape)
    if any(x < 0 for x in shape):
        raise ValueError(f"shape must be non-negative, got {shape!r}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    fd = os.memfd_create("qlink-region", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        mm = mmap.mmap(fd, max(nbytes, 1))
    except BaseException:
        os.close(fd)
        raise
    base = np.frombuffer(mm, dtype=np.uint8)
    address = base.ctypes.data
    with _shared_lock:
        _forget_released()  # (a block released earlier may have had this very address)
        _shared_blocks[address] = (fd, nbytes)
    weakref.finalize(mm, _release_block, address, fd)
    return base[:nbytes].view(dtype).reshape(shape)


def shared_fd_of(array) -> tuple[int, int, int] | None:
    """For an array inside :func:`alloc` memory: ``(fd, offset, block_nbytes)``; else None."""
    if not hasattr(array, "__array_interface__"):
        return None
    addr = array.__array_interface__["data"][0]
    nbytes = array.nbytes
    with _shared_lock:
        _forget_released()
        blocks = list(_shared_blocks.items())
    for base, (fd, size) in blocks:
        if base <= addr and addr + nbytes <= base + max(size, 1):
            return fd, addr - base, size
    return None


@dataclass
class Region:
    """A locally registered buffer. ``array`` is the caller's object (kept alive);
    ``view`` a flat uint8 view of it (host) or the array itself (device)."""

    region_id: int
    array: object
    nbytes: int
    kind: str
    address: int
    key: bytes = b""

    @property
    def view(self):
        if self.kind == "device":
            return self.array
        return as_byte_view(self.array)

    def descriptor(self) -> RemoteRegion:
        """The descriptor to send to the peer (as bytes: ``region.descriptor().to_bytes()``)."""
        return RemoteRegion(region_id=self.region_id, nbytes=self.nbytes, kind=self.kind, key=self.key)

    @classmethod
    def of(cls, array, *, region_id: int, key: bytes = b"") -> "Region":
        if is_device_array(array) and not hasattr(array, "__array_interface__"):
            cai = array.__cuda_array_interface__
            nbytes = int(array.nbytes)
            return cls(region_id, array, nbytes, "device", int(cai["data"][0]), key)
        mv = as_byte_view(array)
        if mv.readonly:
            raise ValueError("cannot register a read-only buffer as a put target")
        addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data if len(mv) else 0
        return cls(region_id, array, len(mv), "host", addr, key)
