"""The send side of a ``tcp://`` endpoint: pack a frame's header into a preallocated buffer,
copy a small payload behind it (one ``send``) or hand a large one to ``sendmsg`` as it is (no
copy), a PUTV frame as its table and views of the caller's pieces; keep a frame that left in
part and finish it before anything else.

:class:`TcpSendSide` is a part of :class:`~transports._tcp_endpoint.TcpEndpoint`; every method
runs with the endpoint's send lock held (``_flush_background`` takes it if it is free).
"""

from __future__ import annotations

import os
import socket

import numpy as np

from qlink.errors import QlinkTimeoutError, WouldBlock

from . import framing as fr
from ._tcp_frames import KIND_PUTV, PIECE_NBYTES, SEND_FLAGS

__all__ = ["TcpSendSide", "SMALL_SEND"]

SMALL_SEND = 64 << 10  # payloads up to this are copied behind the header and sent in one call
_PEEK_FLAGS = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)
try:
    _IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX"), 1024))
except (ValueError, OSError, AttributeError):
    _IOV_MAX = 1024

_pack_header = fr.HEADER.pack_into


class TcpSendSide:
    """Frames out: the header buffer, the frame left half written, the peer check before a send."""

    def _check_peer(self, what: str) -> None:
        if self._dead is None and self._poll_peek.poll(0):  # readable: data, or the end of the stream?
            try:
                if not self._sock.recv(1, _PEEK_FLAGS):
                    self._mark_eof()
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                self._mark_dead(f"{os.strerror(e.errno) if e.errno else e}", e)
        if self._dead is not None:
            self._raise_broken(what)

    def _write(self, parts: list) -> int:
        try:
            if len(parts) == 1:
                return self._sock.send(parts[0], SEND_FLAGS)
            return self._sock.sendmsg(parts, (), SEND_FLAGS)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            self._mark_dead(f"{os.strerror(e.errno) if e.errno else e} while sending", e)
            return -1

    def _flush_pending(self, deadline: float | None, timeout_s, nowait: bool, what: str) -> None:
        while self._pending is not None:
            k = self._write([self._pending])
            if k < 0:
                self._raise_broken(what)
            self._pending = self._pending[k:] if k < len(self._pending) else None
            if self._pending is None:
                return
            if nowait:
                raise WouldBlock("the tcp socket is still full with an earlier message; nothing of this one was sent")
            self._wait_writable(deadline, what, timeout_s)

    def _flush_background(self) -> None:
        if self._pending is not None and self._slock.acquire(blocking=False):
            try:
                k = self._write([self._pending])
                if k > 0:
                    self._pending = self._pending[k:] if k < len(self._pending) else None
            finally:
                self._slock.release()

    def _wait_writable(self, deadline: float | None, what: str, timeout_s) -> None:
        """Wait for room in the socket by the endpoint's policy (:class:`~transports._tcp_wait.TcpSendWait`)."""
        self._check_open()
        wait = self._swait
        wait.restart(what, timeout_s, deadline)
        wait.pause()

    def _send_frame(self, kind: int, src, *, region_id: int = 0, offset: int = 0, notify_id: int = 0,
                    tag: bytes = b"", deadline: float | None, timeout_s, nowait: bool, what: str) -> None:
        n = len(src)
        hsize = fr.HEADER.size + len(tag)
        sbuf = self._sbuf
        _pack_header(sbuf, 0, kind, 0, len(tag), region_id, n, offset, notify_id)
        if tag:
            sbuf[fr.HEADER.size:hsize] = tag
        if n <= SMALL_SEND:
            self._smv[hsize:hsize + n] = src
            parts = [self._smv[:hsize + n]]
        else:
            parts = [self._smv[:hsize], src]
        self._send_parts(parts, hsize + n, deadline=deadline, timeout_s=timeout_s, nowait=nowait, what=what)

    def _send_parts(self, parts: list, total: int, *, deadline: float | None, timeout_s, what: str,
                    nowait: bool = False) -> None:
        """Write one frame given as a list of buffers (sendmsg, at most IOV_MAX at a time);
        the caller holds _slock. Nothing sent yet: a timeout (or, ``nowait``, a full socket)
        raises. Once the first byte left the frame is committed: the rest is kept (copied,
        the caller may reuse its buffers) in _pending and written before anything else;
        any later call on this endpoint flushes it."""
        if self._pending is not None:
            self._flush_pending(deadline, timeout_s, nowait, what)
        self._check_peer(what)
        i, sent = 0, 0
        while True:
            batch = parts[i:i + _IOV_MAX]
            k = self._write(batch)
            if k < 0:
                self._raise_broken(what)
            sent += k
            if sent >= total:
                return
            j = i
            while k:  # step over what was written: whole parts, then into a part
                p = parts[j]
                if k >= len(p):
                    k -= len(p)
                    j += 1
                else:
                    parts[j] = p[k:]
                    k = 0
            whole_batch = j >= i + len(batch)
            i = j
            if whole_batch:
                continue
            if nowait:
                if sent == 0:
                    raise WouldBlock("the tcp socket buffer is full; nothing of this message was sent")
                break
            try:
                self._wait_writable(deadline, what, timeout_s)
            except QlinkTimeoutError:
                if sent == 0:
                    raise
                break
        self._pending = memoryview(b"".join(bytes(p) for p in parts[i:]))

    def _send_putv(self, src: memoryview, region_id: int, so, do, ln, *, notify_id: int, tag: bytes, flags: int,
                   deadline: float | None, timeout_s) -> None:
        """One PUTV frame: header and tag, the piece table, then the pieces as views of ``src``."""
        count = int(ln.size)
        table = np.empty((count, 2), dtype="<u8")
        table[:, 0], table[:, 1] = do, ln
        payload = count * PIECE_NBYTES + int(ln.sum())
        hsize = fr.HEADER.size + len(tag)
        _pack_header(self._sbuf, 0, KIND_PUTV, flags, len(tag), region_id, payload, count, notify_id)
        if tag:
            self._sbuf[fr.HEADER.size:hsize] = tag
        parts = [self._smv[:hsize], memoryview(table.reshape(-1).view(np.uint8))]
        parts += [src[s:s + k] for s, k in zip(so.tolist(), ln.tolist()) if k]
        self._send_parts(parts, hsize + payload, deadline=deadline, timeout_s=timeout_s, what="put_many")
