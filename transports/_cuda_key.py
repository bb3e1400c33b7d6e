"""The key of a ``cuda_ipc://`` device-region descriptor: what a peer needs to write into it.

A device region's :class:`~qlink.memory.RemoteRegion` has ``kind="device"`` and this key,
packed little-endian with :mod:`struct` (never pickled)::

    4s  magic b"QLCI"        u16 version (1)       u16 exporter's device ordinal
    u64 exporter's process nonce (same process: the address is used as it is)
    u64 device address in the exporter      u64 offset of the region in its allocation
    u64 region nbytes        16s PCI bus id of the device ("0000:65:00.0", NUL padded)
    64s CUDA IPC handle of the allocation (``cudaIpcGetMemHandle``; zeros for 0 bytes)
    u16 length of the notification key, then that key: the key of the host stand-in the
        exporter registered on the ``shm`` control path (put completions travel there)

>>> k = DeviceKey(device=0, nonce=7, address=0x7f0000001000, alloc_offset=4096, nbytes=64,
...               bus_id="0000:65:00.0", handle=bytes(range(64)), notify_key=b"\\x01" * 9)
>>> DeviceKey.unpack(k.pack()) == k
True
>>> len(k.pack())
131
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from qlink.errors import RegistrationError

__all__ = ["DeviceKey", "HANDLE_NBYTES", "KEY_VERSION"]

_KEY = struct.Struct("<4sHHQQQQ16s64sH")
_MAGIC = b"QLCI"
KEY_VERSION = 1
HANDLE_NBYTES = 64  # sizeof(cudaIpcMemHandle_t)
_MAX_NOTIFY_KEY = 256


@dataclass(frozen=True)
class DeviceKey:
    """The fields of a device-region key (see the module notes)."""

    device: int
    nonce: int
    address: int
    alloc_offset: int
    nbytes: int
    bus_id: str
    handle: bytes
    notify_key: bytes

    def pack(self) -> bytes:
        """The key as bytes: a fixed header, then the notification key."""
        if len(self.handle) != HANDLE_NBYTES:
            raise ValueError(f"a CUDA IPC handle is {HANDLE_NBYTES} bytes, got {len(self.handle)}")
        bus = self.bus_id.encode("ascii")
        if len(bus) > 16:
            raise ValueError(f"PCI bus id {self.bus_id!r} is longer than 16 characters")
        if len(self.notify_key) > _MAX_NOTIFY_KEY:
            raise ValueError(f"notification key of {len(self.notify_key)} bytes; at most {_MAX_NOTIFY_KEY}")
        return _KEY.pack(_MAGIC, KEY_VERSION, self.device, self.nonce, self.address, self.alloc_offset, self.nbytes,
                         bus, self.handle, len(self.notify_key)) + bytes(self.notify_key)

    @classmethod
    def unpack(cls, data) -> "DeviceKey":
        """Parse :meth:`pack` output; RegistrationError names what is malformed."""
        mv = memoryview(data).cast("B")
        if len(mv) < _KEY.size:
            raise RegistrationError(f"cuda_ipc device key is {len(mv)} bytes, shorter than its {_KEY.size}-byte "
                                    "header; the descriptor was not made by a cuda_ipc endpoint's register()")
        magic, version, device, nonce, address, off, nbytes, bus, handle, key_len = _KEY.unpack_from(mv, 0)
        if magic != _MAGIC:
            raise RegistrationError(f"cuda_ipc device key has bad magic {magic!r}, expected {_MAGIC!r}")
        if version != KEY_VERSION:
            raise RegistrationError(f"cuda_ipc device key has version {version}; this side reads version "
                                    f"{KEY_VERSION} (both sides must run the same qlink)")
        if _KEY.size + key_len != len(mv):
            raise RegistrationError(f"cuda_ipc device key announces a {key_len}-byte notification key but "
                                    f"{len(mv) - _KEY.size} bytes follow its header")
        try:
            bus_id = bus.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise RegistrationError(f"cuda_ipc device key has a PCI bus id that is not ASCII: {bus!r}") from None
        return cls(device=device, nonce=nonce, address=address, alloc_offset=off, nbytes=nbytes, bus_id=bus_id,
                   handle=bytes(handle), notify_key=bytes(mv[_KEY.size:]))
