"""Same-host copies of ``ucx://`` RMA puts, many pieces per system call.

Between two processes of one host UCX moves an RMA piece with its CMA transport: one
``process_vm_writev`` (put) or ``process_vm_readv`` (get) per piece. A KV layer scattered in
32 KiB blocks is then one system call per 32 KiB, and the calls, not the copy, take half the
time: one reader of 32 KiB pieces on the 2-core VM moved 1.65 GB/s at one call each and 2.89
GB/s at 64 pieces per call in qlink's memfd regions (2.1 and 4.4 GB/s in huge-page memory). So
where both endpoints offer it (hello flag ``FLAG_CMA``), qlink makes those same calls itself, up
to 1024 pieces each, in C (``transports._cmac``), and UCX carries everything else (the frames,
and the bytes to a peer on another host).

Each side proves to the other that the process it names is itself, by a challenge
(``OP_CMA`` frames, :class:`CmaHandshake`): it sends 16 random bytes; the other side writes
them into a buffer of its own and answers with its pid and that buffer's address; the first
reads them back there with ``process_vm_readv``. Only a process that holds the challenge in
its own memory passes (constant bytes of some other process do not), and only then are the
peer's pieces moved this way (same host, same pid namespace, and the kernel lets this process
read that one: same user, ptrace allowed); otherwise RMA is not used by default (tagged puts),
and where ``rma=True`` asked for it anyway, UCX moves the pieces. Reading a
peer's memory this way never aborts the process: a peer that has exited is an error
(``ProcessLookupError``, then :class:`~qlink.errors.BrokenLinkError`), found by polling a pidfd
of it before each call, so a pid the kernel has handed to another process is never written to.

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

__all__ = ["IDENTITY", "built", "offered", "CmaHandshake", "CmaPeer"]

#: an OP_CMA frame's inline payload: pid, address, 16 bytes. A challenge: pid 0, address 0, the
#: bytes the peer must show; a proof: this side's pid and where it wrote the peer's challenge
IDENTITY = struct.Struct("<IQ16s")


def built() -> bool:
    """Whether ``transports._cmac`` was built."""
    return _cmac is not None


def offered() -> bool:
    """Whether this process offers same-host CMA (built, Linux, ``QLINK_UCX_CMA`` not ``0``)."""
    return built() and os.environ.get("QLINK_UCX_CMA", "") != "0"


class CmaHandshake:
    """One endpoint's side of the challenge: :attr:`outbox` holds the OP_CMA payloads to send
    (the challenge first, the proof once the peer's challenge came); :meth:`take` handles the
    peer's frames; :attr:`verdict` (1 or 0) is set once the peer's proof was checked, with
    :attr:`peer` (a :class:`CmaPeer`, or None and :attr:`refused` saying why).

    >>> a, b = CmaHandshake(), CmaHandshake()
    >>> ca, cb = a.outbox.pop(0), b.outbox.pop(0)
    >>> b.take(ca), a.take(cb)  # the challenges cross
    (True, True)
    >>> a.take(b.outbox.pop(0)), b.take(a.outbox.pop(0))  # so do the proofs
    (True, True)
    >>> (a.verdict, b.verdict, a.peer.pid == b.peer.pid == os.getpid())  # one process: each reads itself
    (1, 1, True)
    >>> a.close(); b.close()
    """

    def __init__(self) -> None:
        self.challenge = os.urandom(16)
        self._echo = ctypes.create_string_buffer(16)  # where this side shows the peer's challenge
        self.outbox: list[bytes] = [IDENTITY.pack(0, 0, self.challenge)]
        self.peer: CmaPeer | None = None
        self.refused = ""
        self.verdict: int | None = None
        self._answered = False

    def take(self, payload: bytes) -> bool:
        """Handle one OP_CMA payload of the peer's; False for one that is malformed or unexpected."""
        if len(payload) != IDENTITY.size:
            return False
        pid, addr, data = IDENTITY.unpack(payload)
        if pid == 0 and addr == 0:  # its challenge: shown in this side's memory, then the proof sent
            if self._answered:
                return False
            ctypes.memmove(self._echo, data, 16)
            self.outbox.append(IDENTITY.pack(os.getpid(), ctypes.addressof(self._echo), bytes(16)))
            self._answered = True
            return True
        if self.verdict is not None:  # its proof, once
            return False
        self.peer, self.refused = CmaPeer.verify(pid, addr, self.challenge)
        self.verdict = int(self.peer is not None)
        return True

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None


class CmaPeer:
    """The peer process, proven reachable by CMA: :meth:`move` copies pieces to or from it."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid, self._pidfd = pid, pidfd
        self.moved_bytes = 0

    @classmethod
    def verify(cls, pid: int, addr: int, challenge: bytes) -> tuple["CmaPeer | None", str]:
        """``(peer, "")`` when ``challenge`` reads back from ``addr`` in process ``pid``;
        ``(None, why)`` otherwise."""
        if not built():
            return None, "transports._cmac is not built"
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
            return None, f"reading the peer's proof: {e}"
        if got.raw != challenge:
            os.close(pidfd)
            return None, f"process {pid} does not hold this side's challenge there: it is not the peer"
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
