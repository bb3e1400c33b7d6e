"""The ``tcp://`` endpoint (made by :func:`transports.tcp.connect` or
``TcpListener.accept``): its public calls, its state, its failure bookkeeping and its close.
The work is done by its parts: :mod:`transports._tcp_pump` receives, :mod:`transports._tcp_send`
sends, :mod:`transports._tcp_wait` waits."""

from __future__ import annotations

import array
import dataclasses
import itertools
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from qlink.errors import BrokenLinkError, CapabilityError, ClosedError, QlinkTimeoutError, RegistrationError, WouldBlock
from qlink.memory import Region, RemoteRegion, as_byte_view

from . import framing as fr
from ._base import (MAX_TAG_BYTES, Capabilities, Endpoint, Notification, Statistics, check_put_target,
                    deadline_of)
from ._pieces import check_pieces
from ._tcp_frames import MAX_PIECE_NBYTES, PUTV_MORE, frame_groups
from ._tcp_handshake import PUTV_VERSION, ACK_VERSION
from ._tcp_pump import TcpReceiveSide
from ._tcp_send import SMALL_SEND, TcpSendSide
from ._tcp_splice import ZERO_COPY_MIN_NBYTES
from ._tcp_wait import TcpRecvWait, TcpSendWait

__all__ = ["CAPABILITIES", "DEFAULT_BUSY_POLL_S", "RBUF_NBYTES", "TcpEndpoint"]

CAPABILITIES = Capabilities(
    name="tcp",
    one_sided=True,
    zero_copy_put=False,  # the target's progress copies each put from the socket into the region
    cross_process=True,
    cross_host=True,
    max_message_bytes=fr.MAX_FRAME_PAYLOAD,
)

DEFAULT_BUSY_POLL_S = 50e-6
RBUF_NBYTES = 256 << 10  # read-ahead buffer: many small frames per recv syscall
_CLOSE_LINGER_S = 1.0

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT


def _poller(sock: socket.socket, events: int):
    p = select.poll()
    p.register(sock, events)
    return p


class TcpEndpoint(TcpReceiveSide, TcpSendSide, Endpoint):
    """One side of a ``tcp://`` connection (made by :func:`connect` or ``TcpListener.accept``)."""

    capabilities = CAPABILITIES

    def __init__(self, sock: socket.socket, *, url: str, local_key: int, peer_key: int,
                 busy_poll_s: float = DEFAULT_BUSY_POLL_S, version: int = 1,
                 read_ahead_nbytes: int = RBUF_NBYTES, way_of_host: Callable[[], object] | None = None) -> None:
        super().__init__()
        #: the protocol version in force (1: PUT frames; 2: + PUTV; 3: + PUTV_ACK, the flush of
        #: deferred puts)
        self.version = int(version)
        #: put_many sends one PUTV frame and the target sees one Notification (the peer takes
        #: PUTV frames, protocol version 2); else one PUT frame and one Notification per piece
        self.put_many_gathers = self.version >= PUTV_VERSION
        self._in_place: bool | None = None  # defers_puts_in_place, decided when first asked
        self._way_of_host = way_of_host  # () -> the host's way for large deferred puts (.kind "splice"/"copy")
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self.url = url
        self.local_address = sock.getsockname()
        self.peer_address = sock.getpeername()
        self._key = local_key.to_bytes(8, "little")
        self._peer_key = peer_key.to_bytes(8, "little")
        self._busy_poll_s = float(busy_poll_s)
        self._pieces_spin_ns = int(self._busy_poll_s * 1e9)  # a frame's pieces: the C reader's wait for more
        # receive side (guarded by _rlock)
        self._rlock = threading.Lock()
        self._rbuf = bytearray(read_ahead_nbytes)
        self._rmv = memoryview(self._rbuf)
        self._inq = array.array("i", [0])  # FIONREAD: bytes the socket holds unread
        self._rpos = 0
        self._rend = 0
        self._ra_next = 0  # the next read-ahead's limit (0: the whole buffer)
        self._cur: tuple | None = None  # (kind, region_id, nbytes, offset, notify_id, tag) of the frame in progress
        self._cur_dst: memoryview | None = None
        self._cur_got = 0
        self._cur_direct = False  # _cur_dst is the caller's buffer (must be detached if we leave early)
        self._cur_flags = 0  # header flags of the frame in progress (PUTV: MORE)
        self._stage: np.ndarray | None = None  # a PUTV table, and the small pieces behind it, land here
        self._vspan: list | None = None  # [lo, hi, accepted] over the PUTV frames of one put_many so far
        self._vphase = 0  # the PUTV frame in progress: table, pieces in place, staged, read past
        self._vdo = self._vln = ()  # its pieces' destinations and sizes
        self._vstate = None  # the C reader's place in them (piece, bytes of it read)
        self._vi = 0  # the piece in progress (pieces in place)
        self._vlo = self._vhi = 0  # the span its pieces cover
        self._vregion: memoryview | None = None  # the region its staged pieces are scattered into
        self._gathered = 0
        self._msgq: deque = deque()
        self._noteq: deque = deque()
        self._dead: tuple[str, BaseException | None] | None = None
        self._peer_said_bye = False
        self._regions: dict[int, tuple[Region, memoryview]] = {}
        self._region_ids = itertools.count(1)
        self._withdrawn: set[int] = set()  # the peer's regions it deregistered
        self._staged = 0
        self._puts_rejected = 0
        # send side (guarded by _slock)
        self._slock = threading.Lock()
        self._sbuf = bytearray(fr.HEADER.size + MAX_TAG_BYTES + SMALL_SEND)
        self._smv = memoryview(self._sbuf)
        self._pending: memoryview | None = None  # committed frame bytes still to write
        self._splice_pipe = None  # made at the first spliced put_many
        self._spliced = 0  # put_many calls whose pieces went by splice
        self._ack_asked = 0  # spliced put_many calls sent, each asking the peer for a PUTV_ACK
        self._ack_heard = 0  # the highest count the peer's PUTV_ACKs gave (guarded by _rlock)
        self._ack_read = 0  # the peer's PUTV frames flagged ACK this side has read
        self._ack_told = 0  # the count this side last told the peer (guarded by _slock)
        # a poll object must not be used by two threads at once: the receive side
        # (under _rlock) and the send side (under _slock) each have their own
        self._poll_in = _poller(sock, _POLLIN)
        self._poll_in_out = _poller(sock, _POLLIN | _POLLOUT)
        self._poll_peek = _poller(sock, _POLLIN)
        self._poll_out = _poller(sock, _POLLOUT)
        self._poll_out_in = _poller(sock, _POLLIN | _POLLOUT)
        self._rwait = TcpRecvWait(self, spin_s=self._busy_poll_s)  # guarded by _rlock
        self._swait = TcpSendWait(self)  # guarded by _slock

    def native_socket(self) -> tuple[int, bytes]:
        """``(fd, leftover)``: the connected socket and the bytes already read from it, for
        native code that carries whole messages in this transport's framing
        (:mod:`transports.framing`; qlink's QEC hot path). From then on the caller owns the
        stream: this endpoint's own send/receive must not be used until the caller is done
        (it leaves the stream at a frame boundary), and ``close()`` still closes it.

        Raises :class:`~qlink.errors.CapabilityError` while a frame is half received, a
        message or notification is queued aside, or a send is half written.
        """
        with self._rlock, self._slock:
            if self._closed:
                raise ClosedError(f"tcp endpoint {self.local_address} was closed by this side")
            if self._cur is not None or self._msgq or self._noteq or self._pending is not None:
                raise CapabilityError("native_socket(): this endpoint is in the middle of a frame or holds queued "
                                      "messages; receive them first")
            left = bytes(self._rmv[self._rpos:self._rend])
            self._rpos = self._rend = 0
            return self._sock.fileno(), left

    def fileno(self) -> int:
        """The connected socket's file descriptor, to wait for input with ``select``/``epoll``
        beside other endpoints (readable: bytes or the end of the stream have arrived; bytes
        already read ahead are in :attr:`rx_buffered_nbytes`). Only for waiting: reading or
        writing it directly corrupts the stream."""
        return self._sock.fileno()

    @property
    def rx_buffered_nbytes(self) -> int:
        """Bytes received from the socket but not yet delivered: read ahead, or the part of a
        message still arriving. Non-zero after a receive said WouldBlock means a frame is half
        received (a service times such a frame out)."""
        return (self._rend - self._rpos) + (self._cur_got if self._cur is not None else 0)

    def check_peer(self) -> None:
        """Look at the peer now (without reading its data): raise
        :class:`~qlink.errors.BrokenLinkError` when it is gone."""
        self._check_open()
        self._check_peer("check_peer")

    def __repr__(self) -> str:
        return f"<TcpEndpoint {self.local_address} -> {self.peer_address} {'closed' if self._closed else 'open'}>"

    # ----- failure bookkeeping ---------------------------------------------------
    def _mark_dead(self, what: str, cause: BaseException | None = None) -> None:
        if self._dead is None:
            self._dead = (what, cause)

    def _mark_eof(self) -> None:
        eof = EOFError(f"the socket from {self.peer_address} reached end of stream")
        if self._peer_said_bye:
            self._mark_dead("the peer closed its endpoint", eof)
        else:
            self._mark_dead("the peer's socket closed without a goodbye (peer process exited or was killed?)", eof)

    def _raise_broken(self, doing: str):
        self._check_open()  # our own close() shut the socket: that is ClosedError, not a broken link
        what, cause = self._dead
        self._counters.errors += 1
        raise BrokenLinkError(f"tcp link {self.local_address} -> {self.peer_address} is broken ({what}); "
                              f"{doing} cannot complete") from cause

    def _receive(self, attempt, what: str, timeout_s: float | None):
        deadline = deadline_of(timeout_s)
        with self._rlock:
            try:
                r = attempt()
                if r is not None:
                    return r
                return self._receive_wait(attempt, what, timeout_s, deadline)
            finally:
                if self._cur_direct:
                    self._detach()

    # ----- two-sided -----------------------------------------------------------
    def recv_into(self, buf, *, timeout_s: float | None = None) -> int:
        """Receive the next message into ``buf`` (large payloads land there straight from the socket)."""
        if self._closed:
            self._check_open()
        out = _writable(buf)
        deadline = None if timeout_s is None else deadline_of(timeout_s)
        with self._rlock:
            try:
                r = self._recv_once(out)
                if r >= 0:
                    return r

                def attempt():
                    r = self._recv_once(out)
                    return None if r < 0 else r

                return self._receive_wait(attempt, "recv_into", timeout_s, deadline)
            finally:
                if self._cur_direct:
                    self._detach()

    def recv_into_nowait(self, buf) -> int:
        self._check_open()
        out = _writable(buf)
        if not self._rlock.acquire(blocking=False):
            raise WouldBlock("another thread is receiving on this tcp endpoint")
        try:
            self._flush_background()
            r = self._recv_once(out)
            if r >= 0:
                return r
            if self._dead is not None:
                self._raise_broken("recv_into_nowait")
            raise WouldBlock("no complete tcp message has arrived yet")
        finally:
            self._detach()
            self._rlock.release()

    def send(self, data, *, timeout_s: float | None = None) -> None:
        """Send one message; blocks (progressing incoming frames) while the socket is full."""
        if self._closed:
            self._check_open()
        src = _readable(data)
        deadline = None if timeout_s is None else deadline_of(timeout_s)
        with self._slock:
            self._send_frame(fr.KIND_MSG, src, deadline=deadline, timeout_s=timeout_s, nowait=False, what="send")
        self._counters.messages_sent += 1
        self._counters.bytes_sent += len(src)

    def send_nowait(self, data) -> None:
        """Send one message, or raise WouldBlock having sent none of it."""
        self._check_open()
        src = _readable(data)
        if not self._slock.acquire(blocking=False):
            raise WouldBlock("another thread is sending on this tcp endpoint")
        try:
            self._send_frame(fr.KIND_MSG, src, deadline=None, timeout_s=None, nowait=True, what="send_nowait")
        finally:
            self._slock.release()
        self._counters.messages_sent += 1
        self._counters.bytes_sent += len(src)

    # ----- one-sided -----------------------------------------------------------
    def register(self, array) -> Region:
        """Register a writable host buffer as a put target (any C-contiguous buffer; ``alloc()`` works too)."""
        self._check_open()
        region = Region.of(array, region_id=next(self._region_ids), key=self._key)
        if region.kind != "host":
            raise TypeError("tcp puts land in host memory; device arrays need a device-capable transport")
        self._regions[region.region_id] = (region, region.view)
        return region

    def deregister(self, region: Region) -> None:
        """Withdraw a region; the peer learns it in order with later frames, so later puts raise RegistrationError."""
        known = self._regions.pop(region.region_id, None)
        if known is None or self._closed or self._dead is not None:
            return
        try:
            with self._slock:
                self._send_frame(fr.KIND_DEREG, b"", region_id=region.region_id, deadline=deadline_of(_CLOSE_LINGER_S),
                                 timeout_s=_CLOSE_LINGER_S, nowait=False, what="deregister")
        except (BrokenLinkError, QlinkTimeoutError):
            pass  # the target rejects and counts any put that still arrives for it

    def _check_target(self, remote: RemoteRegion) -> None:
        """The region is the peer's and still registered there (else RegistrationError)."""
        if remote.key != self._peer_key:
            raise RegistrationError(f"region descriptor {remote.region_id} was not issued by this endpoint's peer; "
                                    "register on the peer and pass its descriptor")
        if remote.region_id in self._withdrawn:
            raise RegistrationError(f"the peer deregistered region {remote.region_id}; ask it for a current descriptor")

    def put(self, data, remote: RemoteRegion, *, offset: int = 0, notify_id: int = 0, tag: bytes = b"",
            timeout_s: float | None = None) -> None:
        """Send ``data`` to land in the peer's region at ``offset``; the peer gets a Notification."""
        self._check_open()
        remote, tag, notify_id = check_put_target(remote, notify_id=notify_id, tag=tag)
        src = _readable(data)
        n = len(src)
        if offset < 0 or offset + n > remote.nbytes:
            raise RegistrationError(
                f"put of {n} bytes at offset {offset} falls outside region {remote.region_id} of {remote.nbytes} bytes")
        self._check_target(remote)
        deadline = deadline_of(timeout_s)
        with self._slock:
            self._send_frame(fr.KIND_PUT, src, region_id=remote.region_id, offset=offset, notify_id=notify_id,
                             tag=tag, deadline=deadline, timeout_s=timeout_s, nowait=False, what="put")
        self._counters.puts += 1
        self._counters.put_bytes += n

    @property
    def defers_puts_in_place(self) -> bool:
        """``put_many(..., defer=True)`` of any source (registered or not) hands its pieces'
        pages to the socket by splice, without copying them, and :meth:`flush` waits for
        the peer to have read them: protocol version 3, the C module built, and splice the
        faster way on this host (:func:`transports.tcp.deferred_put_way`, measured once per
        process the first time an endpoint is asked)."""
        if self._in_place is None:
            self._in_place = (self.version >= ACK_VERSION and self._way_of_host is not None
                              and self._way_of_host().kind == "splice")
        return self._in_place

    @property
    def defers_puts(self) -> bool:
        return self.defers_puts_in_place

    def put_many(self, data, remote: RemoteRegion, src_offsets, dst_offsets, nbytes, *, notify_id: int = 0,
                 tag: bytes = b"", timeout_s: float | None = None, defer: bool = False) -> int:
        """Write pieces of ``data`` into the peer's region: one PUTV frame for all of them
        and ONE Notification spanning them, returning 1 (see the module docstring and
        :meth:`transports.Endpoint.put_many`). Every piece is checked before anything is
        sent. A peer that speaks protocol version 1 gets one PUT per piece instead (and
        one Notification per piece; ``put_many_gathers`` is False then). The call returns
        once the bytes are handed to the socket (or kept). With ``defer=True`` and
        :attr:`defers_puts_in_place`, a put_many of ``ZERO_COPY_MIN_NBYTES`` or more hands
        the socket its pieces' pages (splice) instead of copies: ``data`` must then stay
        unchanged until :meth:`flush` returns.
        """
        if not self.put_many_gathers:
            return super().put_many(data, remote, src_offsets, dst_offsets, nbytes, notify_id=notify_id, tag=tag,
                                    timeout_s=timeout_s, defer=defer)
        self._check_open()
        remote, tag, notify_id = check_put_target(remote, notify_id=notify_id, tag=tag)
        src = _byte_view(data)
        so, do, ln = check_pieces(src_offsets, dst_offsets, nbytes, src_nbytes=len(src), region_nbytes=remote.nbytes,
                                  region_id=remote.region_id)
        if int(ln.max()) > MAX_PIECE_NBYTES:
            raise ValueError(f"put_many piece of {int(ln.max())} bytes exceeds the tcp frame limit of "
                             f"{MAX_PIECE_NBYTES} bytes per piece; split it")
        self._check_target(remote)
        deadline = deadline_of(timeout_s)
        groups = frame_groups(ln)
        splice = defer and self.defers_puts_in_place and int(ln.sum()) >= ZERO_COPY_MIN_NBYTES
        with self._slock:
            for g, (a, b) in enumerate(groups):
                last = g == len(groups) - 1
                self._send_putv(src, remote.region_id, so[a:b], do[a:b], ln[a:b], notify_id=notify_id,
                                tag=tag if last else b"", flags=0 if last else PUTV_MORE, deadline=deadline,
                                timeout_s=timeout_s, splice=splice)
            if splice:
                self._spliced += 1
        self._gathered += 1
        self._counters.puts += int(ln.size)
        self._counters.put_bytes += int(ln.sum())
        return 1


    def flush(self, *, timeout_s: float | None = None) -> None:
        """Wait until the peer has read every spliced (deferred) put_many so far: the last
        frame of each asks the peer to say so (a PUTV_ACK, sent once the peer's socket runs
        dry). Returns at once when every such put_many was confirmed already."""
        self._check_open()
        if self._ack_heard >= self._ack_asked:
            return
        self._receive(self._acked_once, "flush", timeout_s)

    def wait_notification(self, *, timeout_s: float | None = None) -> Notification:
        self._check_open()
        return self._receive(self._note_once, "wait_notification", timeout_s)

    def poll_notification_nowait(self) -> Notification:
        self._check_open()
        if not self._rlock.acquire(blocking=False):
            raise WouldBlock("another thread is receiving on this tcp endpoint")
        try:
            self._flush_background()
            note = self._note_once()
            if note is not None:
                return note
            if self._dead is not None:
                self._raise_broken("poll_notification_nowait")
            raise WouldBlock("no put notification has arrived yet")
        finally:
            self._rlock.release()

    # ----- lifecycle -----------------------------------------------------------
    def statistics(self) -> Statistics:
        return dataclasses.replace(super().statistics(), extra={
            "staged_messages": self._staged,
            "puts_rejected": self._puts_rejected,
            "gathered_puts": self._gathered,
            "spliced_puts": self._spliced,
            "spliced_puts_confirmed": self._ack_heard,
        })

    def abort(self) -> None:
        """Close at once: bytes not yet written (a peer that does not read) are given up, no
        goodbye is waited for; what was already written still arrives before the end of stream."""
        self._mark_dead("closed by this side without waiting for unsent bytes")
        self.close()

    def close(self) -> None:
        """Orderly close: flush, say goodbye, shut the socket. The peer drains, then sees BrokenLinkError."""
        if self._closed:
            return
        self._closed = True
        sock = self._sock
        if self._dead is None and self._slock.acquire(timeout=0.1):  # a blocked sender thread is woken below
            try:
                deadline = deadline_of(_CLOSE_LINGER_S)
                while self._pending is not None and self._dead is None and time.monotonic() < deadline:
                    k = self._write([self._pending])
                    self._pending = None if k < 0 or k >= len(self._pending) else self._pending[k:]
                    if self._pending is not None:
                        self._poll_out.poll(50)
                if self._pending is None and self._dead is None:
                    fr.pack_header(self._sbuf, fr.KIND_BYE, nbytes=0)
                    self._write([self._smv[:fr.HEADER.size]])
            finally:
                self._slock.release()
        try:
            sock.shutdown(socket.SHUT_WR)  # FIN after everything sent so far
        except OSError:
            pass
        try:  # unread input at close() would make the kernel reset the connection and drop our unsent bytes
            scratch = bytearray(1 << 16)
            for _ in range(256):  # at most 16 MiB: a peer that keeps streaming does not hold close() up
                if not sock.recv_into(scratch):
                    break
        except OSError:
            pass
        try:
            sock.shutdown(socket.SHUT_RD)  # wakes a thread of ours that is blocked in poll
        except OSError:
            pass
        got_r = self._rlock.acquire(timeout=_CLOSE_LINGER_S)
        try:
            sock.close()
        finally:
            if got_r:
                self._rlock.release()
        self._regions.clear()
        if self._splice_pipe is not None and self._slock.acquire(timeout=_CLOSE_LINGER_S):
            try:
                self._splice_pipe.close()
                self._splice_pipe = None
            finally:
                self._slock.release()


def _byte_view(obj) -> memoryview:
    mv = memoryview(obj)
    if mv.ndim == 1 and mv.format == "B" and mv.c_contiguous:
        return mv
    return as_byte_view(obj)


def _readable(data) -> memoryview:
    src = _byte_view(data)
    if len(src) > fr.MAX_FRAME_PAYLOAD:
        raise ValueError(f"message of {len(src)} bytes exceeds max_message_bytes={fr.MAX_FRAME_PAYLOAD}")
    return src


def _writable(buf) -> memoryview:
    out = _byte_view(buf)
    if out.readonly:
        raise TypeError("recv_into needs a writable buffer (bytearray, numpy array...), got a read-only one")
    return out

