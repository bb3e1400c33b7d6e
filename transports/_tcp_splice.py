"""A deferred tcp put_many's pieces into the socket without a copy (and, on the receiving side,
any put_many's pieces out of it straight into place): ``vmsplice`` maps the
caller's pages into a pipe and ``splice`` hands them from the pipe to TCP (Linux, the C
module ``transports._tcpc``). Over loopback the receiver's read is then the only copy
of the bytes, where ``sendmsg`` makes two.

The pages stay the caller's until the receiver has read them, which is what a deferred
put promises (``put_many(..., defer=True)``: the source stays unchanged until ``flush``
returns); the last PUTV frame of such a put asks the peer to say when it has read it (the
flag ACK, answered by a PUTV_ACK frame, protocol version 3), and the tcp endpoint's ``flush``
waits for those answers.

>>> p = SplicePipe.open()
>>> p is None or p.nbytes >= 4096
True
>>> p is None or p.close() is None
True
"""

from __future__ import annotations

import fcntl
import os

import numpy as np

try:
    from . import _tcpc
except ImportError:  # not built (not Linux, or no compiler at install): deferred puts are copied
    _tcpc = None

__all__ = ["PIPE_NBYTES", "ZERO_COPY_MIN_NBYTES", "SplicePipe", "built", "recv_pieces", "rest_of", "splice_pieces"]

PIPE_NBYTES = 1 << 20  # the pipe's size (pipe-max-size, 1 MiB by default, is what a user may ask for)
ZERO_COPY_MIN_NBYTES = 256 << 10  # a put_many smaller than this is copied: the copy costs less than the calls
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def built() -> bool:
    """Whether the C module is there (splice and the pieces' reader can run at all). Whether
    tcp endpoints do send deferred pieces by splice is :func:`transports.tcp.deferred_put_way`'s
    choice: measured on the host, or forced by ``QLINK_TCP_SPLICE``."""
    return _tcpc is not None


class SplicePipe:
    """One pipe between a tcp endpoint's sender and its socket; :meth:`open` gives None
    where splice is not available."""

    __slots__ = ("r", "w", "nbytes")

    def __init__(self, r: int, w: int, nbytes: int) -> None:
        self.r, self.w, self.nbytes = r, w, nbytes

    @classmethod
    def open(cls) -> SplicePipe | None:
        if _tcpc is None:
            return None
        r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            nbytes = fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_NBYTES)
        except OSError:  # a lower pipe-max-size: take the pipe as it is
            nbytes = 65536
        return cls(r, w, int(nbytes))

    def drain(self, nbytes: int) -> bytes:
        """Read back ``nbytes`` left in the pipe (a send that ran out of time keeps them)."""
        parts, left = [], nbytes
        while left > 0:
            b = os.read(self.r, left)
            if not b:
                break
            parts.append(b)
            left -= len(b)
        return b"".join(parts)

    def close(self) -> None:
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.r = self.w = -1


def splice_pieces(sock_fd: int, pipe: SplicePipe, src, so: np.ndarray, ln: np.ndarray, state: np.ndarray) -> int:
    """Write as much of the pieces ``src[so[i]:so[i] + ln[i]]`` to ``sock_fd`` as it takes now,
    going on from ``state`` (int64[3]: piece, bytes of it in the pipe, bytes waiting in the pipe;
    updated); returns the bytes written. Done when ``state[0] == len(ln)`` and ``state[2] == 0``."""
    return _tcpc.splice_pieces(sock_fd, pipe.r, pipe.w, pipe.nbytes, src, so, ln, state)


#: ``recv_pieces(sock_fd, region, dst_offsets, nbytes, state) -> bytes read (-1: end of stream)``:
#: a PUTV frame's pieces read straight into their places, many a ``recvmsg`` (None without the C module)
recv_pieces = None if _tcpc is None else _tcpc.recv_pieces


def rest_of(pipe: SplicePipe, src, so: np.ndarray, ln: np.ndarray, state: np.ndarray) -> bytes:
    """What is still to be written, as bytes: the pipe's content, then the pieces not yet in it."""
    i, at, inpipe = (int(x) for x in state[:3])
    parts = [pipe.drain(inpipe)] if inpipe and pipe is not None else []
    for j in range(i, len(ln)):
        s, k = int(so[j]) + (at if j == i else 0), int(ln[j]) - (at if j == i else 0)
        if k > 0:
            parts.append(bytes(src[s:s + k]))
    return b"".join(parts)
