"""Same-host copies of ``ucx://`` RMA puts, many pieces per system call.

Between two processes of one host UCX moves an RMA piece with its CMA transport: one
``process_vm_writev`` (put) or ``process_vm_readv`` (get) per piece. A KV layer scattered in
32 KiB blocks is then one system call per 32 KiB, and the calls, not the copy, take most of
the time: 2.1 GB/s for one reader of 32 KiB pieces at one call each on the 2-core VM, 4.4 GB/s
at 64 pieces per call. So where both endpoints offer it (hello flag ``FLAG_CMA``, beside
``FLAG_RMA``), qlink makes those same calls itself, up to 1024 pieces each, in C
(``transports._cmac``), and UCX carries everything else (the frames, and the bytes to a
peer on another host).

Each side tells the other its process id and where a 16-byte random nonce lies in its
memory (``OP_CMA``). The other side reads the nonce back with ``process_vm_readv``: only if
it finds it are the peer's pieces moved this way (same host, same pid namespace, and the
kernel lets this process read that one: same user, ptrace allowed); otherwise UCX moves them
as before. Reading a peer's memory this way never aborts the process: a peer that has
exited is an error (``ProcessLookupError``, then :class:`~qlink.errors.BrokenLinkError`),
found by polling a pidfd of it before each call, so a pid the kernel has handed to another
process is never written to.

``QLINK_UCX_CMA=0`` turns it off (the pieces then go by UCX, one call each).

>>> IDENTITY.size
28
"""

from __future__ import annotations

import ctypes
import os
import struct

import numpy as np

from qlink.errors import BrokenLinkError

try:
    from . import _cmac
except ImportError:  # no C build: UCX moves the pieces
    _cmac = None

__all__ = ["IDENTITY", "built", "offered", "identity", "CmaPeer"]

#: OP_CMA's inline payload: pid, address of the nonce, the nonce
IDENTITY = struct.Struct("<IQ16s")

_nonce = None


def built() -> bool:
    """Whether ``transports._cmac`` was built."""
    return _cmac is not None


def offered() -> bool:
    """Whether this process offers same-host CMA (built, Linux, ``QLINK_UCX_CMA`` not ``0``)."""
    return built() and os.environ.get("QLINK_UCX_CMA", "") != "0"


def identity() -> bytes:
    """This process's OP_CMA payload: its pid and where its nonce lies."""
    global _nonce
    if _nonce is None:
        _nonce = ctypes.create_string_buffer(os.urandom(16), 16)
    return IDENTITY.pack(os.getpid(), ctypes.addressof(_nonce), _nonce.raw)


class CmaPeer:
    """The peer process, proven reachable by CMA: :meth:`move` copies pieces to or from it."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid, self._pidfd = pid, pidfd
        self.moved_bytes = 0

    @classmethod
    def verify(cls, payload: bytes) -> tuple["CmaPeer | None", str]:
        """``(peer, "")`` when the nonce named in ``payload`` (the peer's :func:`identity`) reads
        back from the peer's memory; ``(None, why)`` otherwise."""
        if not built():
            return None, "transports._cmac is not built"
        if len(payload) != IDENTITY.size:
            return None, f"an identity of {len(payload)} bytes (expected {IDENTITY.size})"
        pid, addr, nonce = IDENTITY.unpack(payload)
        if pid <= 0 or not addr:
            return None, f"pid {pid} / address {addr:#x} cannot be the peer's"
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError) as e:
            return None, f"pidfd_open({pid}): {e}"
        got = ctypes.create_string_buffer(16)
        one = np.zeros(1, dtype=np.int64)
        try:
            _cmac.cma_pieces(pid, pidfd, False, ctypes.addressof(got), one, addr, one, np.full(1, 16, np.int64))
        except OSError as e:
            os.close(pidfd)
            return None, f"reading the peer's nonce: {e}"
        if got.raw != nonce:
            os.close(pidfd)
            return None, f"process {pid} here is not the peer (its nonce did not read back)"
        return cls(pid, pidfd), ""

    def move(self, *, write: bool, local_addr: int, local_offsets, remote_addr: int, remote_offsets, nbytes,
             what: str) -> int:
        """Write (``write``) or read every piece; the bytes moved. BrokenLinkError when the peer has
        exited or a piece cannot be reached (``what`` names the operation)."""
        if self._pidfd < 0:
            raise BrokenLinkError(f"ucx: {what}: the peer's CMA handle is closed")
        lo, ro, ln = (np.ascontiguousarray(x, dtype=np.int64) for x in (local_offsets, remote_offsets, nbytes))
        try:
            n = _cmac.cma_pieces(self.pid, self._pidfd, write, local_addr, lo, remote_addr, ro, ln)
        except ProcessLookupError:
            raise BrokenLinkError(f"ucx: {what}: the peer process {self.pid} has exited") from None
        except OSError as e:
            raise BrokenLinkError(f"ucx: {what}: {e}") from None
        self.moved_bytes += n
        return n

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
