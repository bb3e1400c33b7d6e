"""The send side of a ``tcp://`` endpoint: pack a frame's header into a preallocated buffer,
copy a small payload behind it (one ``send``) or hand a large one to ``sendmsg`` as it is (no
copy), a PUTV frame as its table and views of the caller's pieces (or, deferred, the pieces'
pages by splice: :mod:`transports._tcp_splice`); keep a frame that left in part and finish it
before anything else; tell the peer which of its spliced frames were read (PUTV_ACK).

:class:`TcpSendSide` is a part of :class:`~transports._tcp_endpoint.TcpEndpoint`; every method
runs with the endpoint's send lock held (``_flush_background`` takes it if it is free).
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from qlink.errors import QlinkTimeoutError, WouldBlock

from . import framing as fr
from ._tcp_frames import KIND_PUTV, KIND_PUTV_ACK, PIECE_NBYTES, PUTV_ACK, SEND_FLAGS
from ._tcp_splice import SplicePipe, rest_of, splice_pieces

__all__ = ["TcpSendSide", "SMALL_SEND"]

SMALL_SEND = 64 << 10  # payloads up to this are copied behind the header and sent in one call
HEAD_IN_PIPE_MAX = 64 << 10  # a spliced frame's header and table up to this go into the pipe, ahead of the pieces
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
        """Write what is left of a half-written frame (no thread of this side is sending),
        then the PUTV_ACK it held back. Acks owed otherwise go when the socket runs dry
        (``_pump``), or after the frame another thread is sending."""
        if self._pending is not None and self._slock.acquire(blocking=False):
            try:
                k = self._write([self._pending])
                if k > 0:
                    self._pending = self._pending[k:] if k < len(self._pending) else None
                self._answer_ack_locked()
            finally:
                self._slock.release()

    def _answer_ack_locked(self) -> None:
        """Tell the peer how many of its PUTV frames flagged ACK this side has read, once no
        frame is half written (the caller holds _slock). What the socket does not take now
        goes as the pending bytes."""
        count = self._ack_read
        if count <= self._ack_told or self._pending is not None or self._dead is not None:
            return
        self._ack_told = count
        ack = bytearray(fr.HEADER.size)
        _pack_header(ack, 0, KIND_PUTV_ACK, 0, 0, 0, 0, count, 0)
        k = self._write([ack])
        if 0 <= k < len(ack):
            self._pending = memoryview(ack)[k:]

    def _answer_ack(self) -> None:
        """Answer a PUTV frame flagged ACK just read (the receive side calls this): now if no
        other thread is sending, else that thread answers once its frame is out."""
        if self._slock.acquire(blocking=False):
            try:
                self._answer_ack_locked()
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

    def _before_frame(self, deadline: float | None, timeout_s, nowait: bool, what: str) -> None:
        """What must go before a new frame (the caller holds _slock): the rest of a
        half-written one, then an owed PUTV_ACK; then the check that the peer is still there."""
        if self._pending is not None:
            self._flush_pending(deadline, timeout_s, nowait, what)
        if self._ack_read > self._ack_told:
            self._answer_ack_locked()
            if self._pending is not None:
                self._flush_pending(deadline, timeout_s, nowait, what)
        self._check_peer(what)

    def _pipe(self) -> SplicePipe | None:
        """The endpoint's splice pipe, opened on first use (None where splice is not built)."""
        if self._splice_pipe is None:
            self._splice_pipe = SplicePipe.open()
        return self._splice_pipe

    def _send_parts(self, parts: list, total: int, *, deadline: float | None, timeout_s, what: str,
                    nowait: bool = False, ends_frame: bool = True) -> None:
        """Write one frame given as a list of buffers (sendmsg, at most IOV_MAX at a time);
        the caller holds _slock. Nothing sent yet: a timeout (or, ``nowait``, a full socket)
        raises. Once the first byte left the frame is committed: the rest is kept (copied,
        the caller may reuse its buffers) in _pending and written before anything else;
        any later call on this endpoint flushes it. An owed PUTV_ACK goes before the frame,
        and after it unless ``ends_frame`` is False (a spliced frame's pieces follow)."""
        self._before_frame(deadline, timeout_s, nowait, what)
        i, sent = 0, 0
        while True:
            batch = parts[i:i + _IOV_MAX]
            k = self._write(batch)
            if k < 0:
                self._raise_broken(what)
            sent += k
            if sent >= total:
                if ends_frame and self._ack_read > self._ack_told:  # a PUTV_ACK came due while this frame went
                    self._answer_ack_locked()
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
                   deadline: float | None, timeout_s, splice: bool = False) -> None:
        """One PUTV frame: header and tag, the piece table, then the pieces as views of ``src``
        (``splice``: the pieces' pages, handed to the socket by splice)."""
        count = int(ln.size)
        table = np.empty((count, 2), dtype="<u8")
        table[:, 0], table[:, 1] = do, ln
        payload = count * PIECE_NBYTES + int(ln.sum())
        hsize = fr.HEADER.size + len(tag)
        _pack_header(self._sbuf, 0, KIND_PUTV, flags | (PUTV_ACK if splice and not flags else 0), len(tag), region_id,
                     payload, count, notify_id)
        if tag:
            self._sbuf[fr.HEADER.size:hsize] = tag
        parts = [self._smv[:hsize], memoryview(table.reshape(-1).view(np.uint8))]
        if splice:
            head = hsize + count * PIECE_NBYTES
            if head <= HEAD_IN_PIPE_MAX and self._head_into_pipe(parts, head, deadline=deadline,
                                                                  timeout_s=timeout_s):
                if not flags:  # the put_many's last frame: the peer answers once it has read it
                    self._ack_asked += 1
                self._splice_rest(src, so, ln, deadline=deadline, timeout_s=timeout_s, head=head,
                                  asked=not flags)
                return
            self._send_parts(parts, head, deadline=deadline, timeout_s=timeout_s,
                             what="put_many", ends_frame=False)  # (the pieces follow: no ack between)
            if not flags:
                self._ack_asked += 1
            self._splice_rest(src, so, ln, deadline=deadline, timeout_s=timeout_s)
            return
        parts += [src[s:s + k] for s, k in zip(so.tolist(), ln.tolist()) if k]
        self._send_parts(parts, hsize + payload, deadline=deadline, timeout_s=timeout_s, what="put_many")

    def _head_into_pipe(self, parts: list, head: int, *, deadline: float | None, timeout_s) -> bool:
        """Write a spliced frame's header and table into the splice pipe (copied there),
        so one ``splice`` hands TCP the header and the first pieces together: no
        ``sendmsg`` of its own for the header, which on loopback cost a whole trip through
        the TCP stack per KV layer. What goes before any frame goes first (a half-written
        frame's rest, an owed PUTV_ACK: :meth:`_before_frame`); False (nothing of this frame
        written) where there is no pipe or the write was interrupted: the header then goes by
        ``sendmsg``. The pipe is empty between frames (what a frame out of time leaves in it
        is taken back out), so it takes all of it at once; a pipe that does not breaks the
        link (BrokenLinkError) rather than let bytes go out of order."""
        self._before_frame(deadline, timeout_s, False, "put_many")
        pipe = self._pipe()
        if pipe is None:
            return False
        try:
            k = os.writev(pipe.w, parts)
        except InterruptedError:
            return False  # (nothing written)
        except BlockingIOError:
            k = 0
        if k != head:  # only a pipe holding bytes already could: the stream's order is lost
            self._mark_dead(f"the splice pipe took {k} of a {head}-byte frame header; it was not empty", None)
            self._raise_broken("put_many")
        return True

    def _splice_rest(self, src: memoryview, so, ln, *, deadline: float | None, timeout_s, head: int = 0,
                     asked: bool = False) -> None:
        """The pieces of a PUTV frame whose header and table went (or wait in the pipe:
        ``head`` bytes, :meth:`_head_into_pipe`): their pages by splice.
        While the socket keeps taking bytes the loop retries at once (for up to the
        endpoint's ``busy_poll_s`` after the last bytes went: a sleeping sender costs the
        receiver a wake-up each time it makes room), then waits for room as a send does.
        Out of time after the frame began, the rest is kept as pending bytes (copied), as
        :meth:`_send_parts` keeps it; out of time before any byte of it went (the header
        still whole in the pipe), nothing is kept and the timeout is raised, as a send
        that sent nothing raises it (``asked``: the frame asked for an ack, not owed now)."""
        so = np.ascontiguousarray(so, dtype=np.int64)
        ln = np.ascontiguousarray(ln, dtype=np.int64)
        if self._pending is not None:  # the header itself did not all go: the pieces follow it, copied
            self._pending = memoryview(bytes(self._pending) + rest_of(None, src, so, ln, np.zeros(3, np.int64)))
            return
        pipe = self._pipe()
        state = np.zeros(3, dtype=np.int64)
        state[2] = head
        fd = self._sock.fileno()
        spin_ns, spin_until = int(self._busy_poll_s * 1e9), 0
        went = 0
        while True:
            try:
                k = splice_pieces(fd, pipe, src, so, ln, state)
            except OSError as e:
                self._mark_dead(f"{os.strerror(e.errno) if e.errno else e} while sending", e)
                self._raise_broken("put_many")
            if state[0] >= ln.size and state[2] == 0:
                if self._ack_read > self._ack_told:  # a PUTV_ACK came due while this frame went
                    self._answer_ack_locked()
                return
            now = time.perf_counter_ns()
            if k:
                spin_until = now + spin_ns
                went += k
            if now < spin_until:
                continue
            try:
                self._wait_writable(deadline, "put_many", timeout_s)
            except QlinkTimeoutError:
                if head and not went:  # nothing of this frame left: it was never sent
                    pipe.drain(int(state[2]))
                    if asked:
                        self._ack_asked -= 1
                    raise
                self._pending = memoryview(rest_of(pipe, src, so, ln, state))
                return
