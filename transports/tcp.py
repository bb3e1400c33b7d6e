"""``tcp://host:port``: framed messages and software-emulated puts over one TCP socket.

Each message travels as one frame (see :mod:`transports.framing`): a 32-byte
header packed into a preallocated buffer, then the payload. Small payloads are
copied behind the header and leave in one ``send``; large ones go out with
``sendmsg`` straight from the caller's buffer and are read with ``recv_into``
straight into the receiver's buffer, so big payloads are never copied in user space.

One-sided ``put`` is emulated in software, the way UCX emulates RMA over active
messages: the initiator sends a PUT frame, and the target writes its payload into
the registered region during its own progress (any ``recv_into`` /
``wait_notification`` / ``send`` call), then queues the :class:`Notification`.
Messages and notifications that arrive interleaved each go to their own queue.

* The listener binds ``127.0.0.1`` unless another host is named; port 0 picks a
  free port and ``Listener.url`` reports the real one.
* A connection opens with a handshake (magic ``QLTC`` + protocol version); a
  listener thread answers it, refusing a client that speaks anything else with a
  readable reason, without disturbing other clients.
* A blocking call busy-polls for ``busy_poll_s`` (50 µs by default), then sleeps in
  ``poll`` for the rest of its timeout. A peer that closes, crashes or is killed
  shows up as :class:`~qlink.errors.BrokenLinkError` as soon as its kernel closes
  the socket, after the messages it sent before have been received.
* One thread may send (``send``/``put``) while another receives
  (``recv_into``/``wait_notification``) on the same endpoint.
* ``put_many`` (vectored put) sends ONE frame for all its pieces: a PUTV frame (kind 5;
  the header's ``offset`` field holds the number of pieces) whose payload is a table of
  ``u64 dst_offset, u64 nbytes`` per piece followed by the pieces themselves, handed to
  ``socket.sendmsg`` as a list of views of the caller's buffer (scatter-gather, no
  copy). The target reads the payload into one staging buffer and scatters it into
  the region with NumPy (one call where the pieces share a row size, e.g. KV blocks;
  see :mod:`transports._pieces`), then queues ONE Notification spanning every piece
  (``put_many_gathers``). A put_many beyond the 1 GiB frame limit goes as several PUTV
  frames in a row, all but the last flagged MORE (header ``flags`` bit 0); the
  notification comes after the last.
* Protocol version 2 is version 1 plus the PUTV frame. A client opens with the
  version-1 hello and hello flag bit 0 ("I take PUTV"), so a version-1 listener still
  accepts it; a version-2 listener answers with version 2 when the client set that
  flag. Each side sends PUTV frames only when the other said it takes them (the client:
  a version-2 reply; the listener: the hello flag), else ``put_many`` is one PUT frame
  per piece, which a version-1 peer reads as before.
* A listener made with ``token=`` admits only clients that prove they hold the same
  shared token: such a client sets hello flag bit 1 and sends, right after the hello, a
  32-byte HMAC-SHA256 of the hello under the token (the token itself never travels). A
  client without it is refused with a readable reason; ``refused_by_reason`` counts
  refused handshakes by why. Without ``token=`` the handshake is byte for byte as before.
* ``read_ahead_nbytes`` bounds each endpoint's read-ahead buffer (256 KiB by default).
* ``statistics().extra`` counts ``staged_messages`` (messages that had to be parked
  in an internal buffer: they arrived while the caller waited for a notification,
  or a receive left mid-message), ``puts_rejected`` (puts into a region the
  target no longer has, counted and dropped) and ``gathered_puts`` (put_many calls
  sent as PUTV frames).

>>> from transports import tcp
>>> with tcp.listen("tcp://127.0.0.1:0") as lis:
...     with tcp.connect(lis.url, timeout_s=5) as client, lis.accept(timeout_s=5) as server:
...         client.send(b"syndrome round")
...         buf = bytearray(64)
...         n = server.recv_into(buf, timeout_s=5)
...         bytes(buf[:n])
b'syndrome round'
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import itertools
import math
import os
import select
import socket
import threading
import time
from collections import Counter, deque

import numpy as np

from qlink.access import token_bytes
from qlink.errors import (BrokenLinkError, CapabilityError, ClosedError, QlinkTimeoutError, RegistrationError, WireError,
                          WouldBlock)
from qlink.memory import Region, RemoteRegion, as_byte_view

from . import framing as fr
from ._address import split_host_port
from ._accept import AcceptQueue
from ._pieces import check_pieces, copy_pieces, message_groups, span
from ._base import (MAX_TAG_BYTES, BufferTooSmallError, Capabilities, Endpoint, Listener, Notification, Statistics,
                    check_put_target, deadline_of)

__all__ = ["CAPABILITIES", "listen", "connect", "TcpEndpoint", "TcpListener"]

CAPABILITIES = Capabilities(
    name="tcp",
    one_sided=True,
    zero_copy_put=False,  # the target's progress copies each put from the socket into the region
    cross_process=True,
    cross_host=True,
    max_message_bytes=fr.MAX_FRAME_PAYLOAD,
)

_DEFAULT_BUSY_POLL_S = 50e-6
_HANDSHAKE_TIMEOUT_S = 5.0
_RBUF_NBYTES = 256 << 10  # read-ahead buffer: many small frames per recv syscall
_DIRECT_MIN = 32 << 10  # a payload remainder at least this large is read straight into its destination
_SMALL_SEND = 64 << 10  # payloads up to this are copied behind the header and sent in one call
_CLOSE_LINGER_S = 1.0

_pack_header = fr.HEADER.pack_into
_unpack_header = fr.HEADER.unpack_from
_NOTHING = -1  # _pump: no more bytes for now
_NOTE = -2  # _pump: a notification was queued

# protocol version 2: the vectored put frame (see the module docstring)
_KIND_PUTV = 5
_PUTV_MORE = 1  # header flags of a PUTV frame: more frames of the same put_many follow
_HELLO_PUTV = 1  # hello flags: this client takes PUTV frames
_PUTV_VERSION = 2
_HELLO_AUTH = 2  # hello flags: a 32-byte HMAC-SHA256 of the hello under the shared token follows
_AUTH_NBYTES = 32
_AUTH_LABEL = b"qlink-tcp-hello-v1"
_STATUS_UNAUTHORIZED = 3  # handshake reply status: this listener wants a token the client did not prove
_PIECE_NBYTES = 16  # u64 dst_offset, u64 nbytes per piece in a PUTV table
_MAX_PIECE_NBYTES = fr.MAX_FRAME_PAYLOAD - _PIECE_NBYTES
_MAX_STAGE_KEEP = 256 << 20  # a PUTV staging buffer up to this size is kept for the next frame
try:
    _IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX"), 1024))
except (ValueError, OSError, AttributeError):
    _IOV_MAX = 1024

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)
_PEEK_FLAGS = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)


def _poller(sock: socket.socket, events: int):
    p = select.poll()
    p.register(sock, events)
    return p


def _random_key() -> int:
    return int.from_bytes(os.urandom(8), "little")


def _ms(left_s: float | None):
    return None if left_s is None else max(0, math.ceil(left_s * 1000))


def _url_of(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class TcpEndpoint(Endpoint):
    """One side of a ``tcp://`` connection (made by :func:`connect` or ``TcpListener.accept``)."""

    capabilities = CAPABILITIES

    def __init__(self, sock: socket.socket, *, url: str, local_key: int, peer_key: int,
                 busy_poll_s: float = _DEFAULT_BUSY_POLL_S, peer_takes_putv: bool = False,
                 read_ahead_nbytes: int = _RBUF_NBYTES) -> None:
        super().__init__()
        #: put_many sends one PUTV frame and the target sees one Notification (the peer takes
        #: PUTV frames, protocol version 2); else one PUT frame and one Notification per piece
        self.put_many_gathers = bool(peer_takes_putv)
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
        # receive side (guarded by _rlock)
        self._rlock = threading.Lock()
        self._rbuf = bytearray(read_ahead_nbytes)
        self._rmv = memoryview(self._rbuf)
        self._rpos = 0
        self._rend = 0
        self._cur: tuple | None = None  # (kind, region_id, nbytes, offset, notify_id, tag) of the frame in progress
        self._cur_dst: memoryview | None = None
        self._cur_got = 0
        self._cur_direct = False  # _cur_dst is the caller's buffer (must be detached if we leave early)
        self._cur_flags = 0  # header flags of the frame in progress (PUTV: MORE)
        self._stage: np.ndarray | None = None  # PUTV payloads land here, then scatter into the region
        self._vspan: list | None = None  # [lo, hi, accepted] over the PUTV frames of one put_many so far
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
        self._sbuf = bytearray(fr.HEADER.size + MAX_TAG_BYTES + _SMALL_SEND)
        self._smv = memoryview(self._sbuf)
        self._pending: memoryview | None = None  # committed frame bytes still to write
        # a poll object must not be used by two threads at once: the receive side
        # (under _rlock) and the send side (under _slock) each have their own
        self._poll_in = _poller(sock, _POLLIN)
        self._poll_in_out = _poller(sock, _POLLIN | _POLLOUT)
        self._poll_peek = _poller(sock, _POLLIN)
        self._poll_out = _poller(sock, _POLLOUT)
        self._poll_out_in = _poller(sock, _POLLIN | _POLLOUT)

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
        raise BrokenLinkError(f"tcp link {self.local_address} -> {self.peer_address} is broken ({what}); {doing} cannot complete") from cause

    # ----- receive engine (caller holds _rlock) ----------------------------------
    def _fill(self) -> bool:
        """Read what the socket has into the read-ahead buffer; False when nothing came.

        Reading goes on after a send found the link dead: what the peer sent before it
        went away is still delivered."""
        if self._rpos == self._rend:
            self._rpos = self._rend = 0
        elif self._rpos and len(self._rbuf) - self._rend < len(self._rbuf) // 2:
            left = self._rend - self._rpos
            self._rbuf[:left] = self._rmv[self._rpos:self._rend]
            self._rpos, self._rend = 0, left
        try:
            n = self._sock.recv_into(self._rmv[self._rend:])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            self._mark_dead(f"{os.strerror(e.errno) if e.errno else e} while receiving", e)
            return False
        if n == 0:
            self._mark_eof()
            return False
        self._rend += n
        return True

    def _put_target(self, region_id: int, offset: int, nbytes: int) -> memoryview | None:
        entry = self._regions.get(region_id)
        if entry is None or offset + nbytes > entry[0].nbytes:
            self._puts_rejected += 1  # deregistered while the put was in flight, or a bad peer
            self._counters.errors += 1
            return None
        return entry[1][offset:offset + nbytes]

    def _bad_frame(self, err: WireError) -> None:
        self._counters.errors += 1
        self._mark_dead(f"the peer sent a malformed frame: {err}", err)
        self._rpos = self._rend = 0
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _pump(self, out: memoryview | None) -> int:
        """Progress incoming frames without blocking.

        Returns the size of a message delivered into ``out``, ``_NOTE`` when a
        notification was queued, ``_NOTHING`` when the socket has no more for now.
        """
        rmv = self._rmv
        hsize = fr.HEADER.size
        while True:
            cur = self._cur
            if cur is None:
                avail = self._rend - self._rpos
                if avail < hsize:
                    if not self._fill():
                        return _NOTHING
                    continue
                kind, flags, tag_n, rid, n, off, nid = _unpack_header(rmv, self._rpos)
                if kind != fr.KIND_MSG or tag_n or n > fr.MAX_FRAME_PAYLOAD:
                    try:
                        if kind == _KIND_PUTV:
                            _check_putv_header(flags, tag_n, n, off)
                        else:
                            kind, tag_n, rid, n, off, nid = fr.parse_header(rmv, self._rpos)
                    except WireError as e:
                        self._bad_frame(e)
                        return _NOTHING
                if avail < hsize + tag_n:
                    if not self._fill():
                        return _NOTHING
                    continue
                tag = bytes(rmv[self._rpos + hsize:self._rpos + hsize + tag_n]) if tag_n else b""
                self._rpos += hsize + tag_n
                if kind == fr.KIND_DEREG:
                    self._withdrawn.add(rid)
                    continue
                if kind == fr.KIND_BYE:
                    self._peer_said_bye = True
                    continue
                cur = self._cur = (kind, rid, n, off, nid, tag)
                self._cur_got = 0
                self._cur_direct = False
                self._cur_flags = flags
                if kind == fr.KIND_PUT:
                    self._cur_dst = self._put_target(rid, off, n)
                elif kind == _KIND_PUTV:
                    self._cur_dst = self._staging(n)
                else:
                    self._cur_dst = None
            kind, rid, n, off, nid, tag = cur
            dst = self._cur_dst
            if kind == fr.KIND_MSG and out is not None and not self._msgq and n > len(out):
                raise BufferTooSmallError(
                    f"next tcp message is {n} bytes but the buffer holds {len(out)}; the message stays "
                    f"queued, call again with a buffer of at least {n} bytes", needed_nbytes=n)
            if kind == fr.KIND_MSG and dst is None:
                if out is not None and not self._msgq:
                    dst = self._cur_dst = out[:n]
                    self._cur_direct = True
                else:
                    dst = self._cur_dst = memoryview(bytearray(n))
                    self._staged += 1
            got = self._cur_got
            while got < n:
                avail = self._rend - self._rpos
                if avail:
                    k = min(avail, n - got)
                    if dst is not None:
                        dst[got:got + k] = rmv[self._rpos:self._rpos + k]
                    self._rpos += k
                    got += k
                elif dst is not None and n - got >= _DIRECT_MIN:
                    try:
                        k = self._sock.recv_into(dst[got:], n - got)
                    except (BlockingIOError, InterruptedError):
                        k = -1
                    except OSError as e:
                        self._mark_dead(f"{os.strerror(e.errno) if e.errno else e} while receiving", e)
                        k = -1
                    if k == 0:
                        self._mark_eof()
                        k = -1
                    if k < 0:
                        self._cur_got = got
                        return _NOTHING
                    got += k
                elif not self._fill():
                    self._cur_got = got
                    return _NOTHING
            self._cur = None
            self._cur_dst = None
            self._cur_got = 0
            if kind == fr.KIND_MSG:
                if self._cur_direct:
                    self._cur_direct = False
                    self._counters.messages_received += 1
                    self._counters.bytes_received += n
                    return n
                self._msgq.append(dst)
                if out is not None:
                    return self._deliver_queued(self._msgq, out)
            elif kind == _KIND_PUTV:
                note = self._land_putv(rid, n, off, nid, tag, dst)
                if note is not None:
                    self._noteq.append(note)
                    return _NOTE
                if self._dead is not None:
                    return _NOTHING
            elif dst is not None:  # an accepted put: its bytes are in place, now announce it
                self._noteq.append(Notification(region_id=rid, offset=off, nbytes=n, notify_id=nid, tag=tag))
                return _NOTE

    def _staging(self, nbytes: int) -> memoryview:
        st = self._stage
        if st is None or st.size < nbytes:
            st = np.empty(nbytes, dtype=np.uint8)
            if nbytes <= _MAX_STAGE_KEEP:
                self._stage = st
        return memoryview(st)[:nbytes]

    def _land_putv(self, rid: int, n: int, count: int, nid: int, tag: bytes, staged: memoryview):
        """A whole PUTV frame is in ``staged``: check its table, scatter its pieces into the
        region; the Notification when this was the last frame of its put_many, else None."""
        tab_n = count * _PIECE_NBYTES
        table = np.frombuffer(staged, dtype="<u8", count=2 * count).reshape(count, 2)
        do, ln = table[:, 0], table[:, 1]
        if (ln > fr.MAX_FRAME_PAYLOAD).any() or int(ln.sum()) != n - tab_n:
            self._bad_frame(WireError(f"PUTV frame of {n} bytes: its {count} pieces add up to {int(ln.sum())} "
                                      f"bytes, not the {n - tab_n} after the table"))
            self._vspan = None
            return None
        entry = self._regions.get(rid)
        limit = 0 if entry is None else entry[0].nbytes
        ok = entry is not None and not ((do > limit) | (ln > limit - np.minimum(do, limit))).any()
        if ok:
            do, ln = do.astype(np.int64), ln.astype(np.int64)
            so = np.cumsum(ln) - ln + tab_n
            copy_pieces(np.frombuffer(entry[1], dtype=np.uint8), np.frombuffer(staged, dtype=np.uint8), so, do, ln)
            lo, hi = span(do, ln)
        else:
            self._puts_rejected += 1  # deregistered while the put was in flight, or a bad peer
            self._counters.errors += 1
            lo, hi = 0, 0
        sp = self._vspan
        if sp is None:
            sp = self._vspan = [lo, hi, ok]
        else:
            sp[0], sp[1], sp[2] = min(sp[0], lo), max(sp[1], hi), sp[2] and ok
        if self._cur_flags & _PUTV_MORE:
            return None
        self._vspan = None
        if not sp[2]:
            return None  # some piece was refused: the put_many is never announced
        return Notification(region_id=rid, offset=sp[0], nbytes=sp[1] - sp[0], notify_id=nid, tag=tag)

    def _detach(self) -> None:
        """Leaving a receive early: move a half-received message out of the caller's buffer."""
        if self._cur_direct:
            staged = memoryview(bytearray(self._cur[2]))
            staged[:self._cur_got] = self._cur_dst[:self._cur_got]
            self._cur_dst = staged
            self._cur_direct = False
            self._staged += 1

    def _recv_once(self, out: memoryview) -> int:
        if self._msgq:
            return self._deliver_queued(self._msgq, out)
        while True:
            r = self._pump(out)
            if r != _NOTE:
                return r

    def _note_once(self) -> Notification | None:
        if not self._noteq and self._pump(None) != _NOTE:
            return None
        self._counters.notifications += 1
        return self._noteq.popleft()

    def _drain_background(self) -> None:
        """Progress incoming frames for a thread that is not receiving (stage messages, apply puts)."""
        if self._rlock.acquire(blocking=False):
            try:
                while self._pump(None) != _NOTHING:
                    pass
            finally:
                self._rlock.release()

    def _wait_readable(self, deadline: float | None, what: str, timeout_s: float | None, spin_until: float) -> None:
        """Between two receive attempts: spin until ``spin_until``, then sleep in poll (caller holds _rlock)."""
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise self._timed_out(what, timeout_s)
        if now < spin_until:
            return
        left = None if deadline is None else deadline - now
        if self._pending is not None and not self._slock.locked():
            self._poll_in_out.poll(_ms(left))
            self._flush_background()
        else:
            self._poll_in.poll(_ms(left))

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

    def _receive_wait(self, attempt, what: str, timeout_s: float | None, deadline: float | None):
        spin_until = time.monotonic() + self._busy_poll_s
        while True:
            if self._dead is not None:
                self._raise_broken(what)
            self._wait_readable(deadline, what, timeout_s, spin_until)
            self._check_open()
            r = attempt()
            if r is not None:
                return r

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

    # ----- send engine (caller holds _slock) -------------------------------------
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
                return self._sock.send(parts[0], _SEND_FLAGS)
            return self._sock.sendmsg(parts, (), _SEND_FLAGS)
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
        self._check_open()
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise self._timed_out(what, timeout_s)
        left = None if deadline is None else deadline - now
        if self._rlock.locked():  # a receiving thread drains the incoming side
            self._poll_out.poll(_ms(left))
            return
        events = self._poll_out_in.poll(_ms(left))
        if events and events[0][1] & ~_POLLOUT:
            self._drain_background()  # keep reading so two peers sending large messages cannot deadlock
        if self._dead is not None:
            self._raise_broken(what)

    def _send_frame(self, kind: int, src, *, region_id: int = 0, offset: int = 0, notify_id: int = 0,
                    tag: bytes = b"", deadline: float | None, timeout_s, nowait: bool, what: str) -> None:
        n = len(src)
        hsize = fr.HEADER.size + len(tag)
        sbuf = self._sbuf
        _pack_header(sbuf, 0, kind, 0, len(tag), region_id, n, offset, notify_id)
        if tag:
            sbuf[fr.HEADER.size:hsize] = tag
        if n <= _SMALL_SEND:
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

    def put_many(self, data, remote: RemoteRegion, src_offsets, dst_offsets, nbytes, *, notify_id: int = 0,
                 tag: bytes = b"", timeout_s: float | None = None, defer: bool = False) -> int:
        """Write pieces of ``data`` into the peer's region: one PUTV frame for all of them
        and ONE Notification spanning them, returning 1 (see the module docstring and
        :meth:`transports.Endpoint.put_many`). Every piece is checked before anything is
        sent. A peer that speaks protocol version 1 gets one PUT per piece instead (and
        one Notification per piece; ``put_many_gathers`` is False then). ``defer`` changes
        nothing: the call returns once the bytes are handed to the socket (or kept).
        """
        if not self.put_many_gathers:
            return super().put_many(data, remote, src_offsets, dst_offsets, nbytes, notify_id=notify_id, tag=tag,
                                    timeout_s=timeout_s, defer=defer)
        self._check_open()
        remote, tag, notify_id = check_put_target(remote, notify_id=notify_id, tag=tag)
        src = _byte_view(data)
        so, do, ln = check_pieces(src_offsets, dst_offsets, nbytes, src_nbytes=len(src), region_nbytes=remote.nbytes,
                                  region_id=remote.region_id)
        if int(ln.max()) > _MAX_PIECE_NBYTES:
            raise ValueError(f"put_many piece of {int(ln.max())} bytes exceeds the tcp frame limit of "
                             f"{_MAX_PIECE_NBYTES} bytes per piece; split it")
        self._check_target(remote)
        deadline = deadline_of(timeout_s)
        groups = _frame_groups(ln)
        with self._slock:
            for g, (a, b) in enumerate(groups):
                last = g == len(groups) - 1
                self._send_putv(src, remote.region_id, so[a:b], do[a:b], ln[a:b], notify_id=notify_id,
                                tag=tag if last else b"", flags=0 if last else _PUTV_MORE, deadline=deadline,
                                timeout_s=timeout_s)
        self._gathered += 1
        self._counters.puts += int(ln.size)
        self._counters.put_bytes += int(ln.sum())
        return 1

    def _send_putv(self, src: memoryview, region_id: int, so, do, ln, *, notify_id: int, tag: bytes, flags: int,
                   deadline: float | None, timeout_s) -> None:
        """One PUTV frame: header and tag, the piece table, then the pieces as views of ``src``."""
        count = int(ln.size)
        table = np.empty((count, 2), dtype="<u8")
        table[:, 0], table[:, 1] = do, ln
        payload = count * _PIECE_NBYTES + int(ln.sum())
        hsize = fr.HEADER.size + len(tag)
        _pack_header(self._sbuf, 0, _KIND_PUTV, flags, len(tag), region_id, payload, count, notify_id)
        if tag:
            self._sbuf[fr.HEADER.size:hsize] = tag
        parts = [self._smv[:hsize], memoryview(table.reshape(-1).view(np.uint8))]
        parts += [src[s:s + k] for s, k in zip(so.tolist(), ln.tolist()) if k]
        self._send_parts(parts, hsize + payload, deadline=deadline, timeout_s=timeout_s, what="put_many")

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


def _check_putv_header(flags: int, tag_nbytes: int, nbytes: int, count: int) -> None:
    """Validate the header of a PUTV frame (``count``: the pieces in its table)."""
    if flags & ~_PUTV_MORE:
        raise WireError(f"PUTV frame carries unknown flags 0x{flags:02x}")
    if nbytes > fr.MAX_FRAME_PAYLOAD:
        raise WireError(f"PUTV frame announces {nbytes} payload bytes, more than the {fr.MAX_FRAME_PAYLOAD} allowed")
    if tag_nbytes > MAX_TAG_BYTES:
        raise WireError(f"PUTV frame announces a {tag_nbytes}-byte tag, more than MAX_TAG_BYTES={MAX_TAG_BYTES}")
    if count < 1 or count * _PIECE_NBYTES > nbytes:
        raise WireError(f"PUTV frame announces {count} pieces but only {nbytes} payload bytes (16 per table entry)")


def _frame_groups(ln: np.ndarray) -> list[tuple[int, int]]:
    """Split the pieces of a put_many into runs whose table and bytes fit one frame."""
    return message_groups(ln, entry_nbytes=_PIECE_NBYTES, max_nbytes=fr.MAX_FRAME_PAYLOAD)


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


class TcpListener(Listener):
    """Listens on a TCP address; a background thread answers handshakes so ``connect`` never waits for ``accept``."""

    def __init__(self, sock: socket.socket, *, busy_poll_s: float, handshake_timeout_s: float,
                 token: bytes | None = None, read_ahead_nbytes: int = _RBUF_NBYTES) -> None:
        self._sock = sock
        self._token = token
        self._read_ahead_nbytes = read_ahead_nbytes
        #: refused handshakes by reason: bad_hello, no_token, bad_token, hung_up, handshake_timeout
        self.refused_by_reason: Counter = Counter()
        host, port = sock.getsockname()[:2]
        self.url = _url_of(host, port)
        self.refused_handshakes = 0  # wrong magic/version, hung up or silent during the handshake
        self.accepted_handshakes = 0
        self._busy_poll_s = busy_poll_s
        self._handshake_timeout_s = handshake_timeout_s
        self._queue = AcceptQueue(self.url)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name=f"qlink-tcp-listener {self.url}", daemon=True)
        self._thread.start()

    @property
    def _closed(self) -> bool:
        return self._queue.closed

    def __repr__(self) -> str:
        return f"<TcpListener {self.url} {'closed' if self._closed else 'listening'}>"

    def _serve(self) -> None:
        try:
            self._serve_loop()
        except BaseException as e:  # surface in accept() rather than dying silently
            self._queue.fail(e)

    def _serve_loop(self) -> None:
        poller = select.poll()
        poller.register(self._sock, _POLLIN)
        poller.register(self._wake_r, _POLLIN)
        lfd, wfd = self._sock.fileno(), self._wake_r.fileno()
        pending: dict[int, list] = {}  # fd -> [sock, hello buffer, bytes got, deadline]
        try:
            while True:
                now = time.monotonic()
                wait_ms = _ms(min(p[3] for p in pending.values()) - now) if pending else None
                for fd, _ev in poller.poll(wait_ms):
                    if fd == wfd:
                        return
                    if fd == lfd:
                        self._accept_all(poller, pending)
                        continue
                    entry = pending.get(fd)
                    if entry is not None:
                        self._read_hello(poller, pending, fd, entry)
                now = time.monotonic()
                for fd in [fd for fd, p in pending.items() if p[3] <= now]:
                    self._drop(poller, pending, fd, "handshake_timeout")
        finally:
            for fd in list(pending):
                self._drop(poller, pending, fd)

    def _accept_all(self, poller, pending) -> None:
        while True:
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors: try again on the next wake-up
                return
            conn.setblocking(False)
            poller.register(conn, _POLLIN)
            pending[conn.fileno()] = [conn, bytearray(fr.HELLO.size + _AUTH_NBYTES), 0,
                                      time.monotonic() + self._handshake_timeout_s]

    def _drop(self, poller, pending, fd, reason: str = "hung_up") -> None:
        conn = pending.pop(fd)[0]
        poller.unregister(fd)
        self.refused_by_reason[reason] += 1
        self.refused_handshakes += 1  # counted before the hang-up the client can observe
        conn.close()

    def _hello_nbytes(self, buf: bytearray, got: int) -> int:
        """How long this client's hello is: the hello, and its proof when it says one follows."""
        if got >= fr.HELLO.size and fr.HELLO.unpack_from(buf, 0)[2] & _HELLO_AUTH:
            return fr.HELLO.size + _AUTH_NBYTES
        return fr.HELLO.size

    def _read_hello(self, poller, pending, fd, entry) -> None:
        conn, buf, got, _deadline = entry
        want = self._hello_nbytes(buf, got)
        try:
            k = conn.recv_into(memoryview(buf)[got:], want - got)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            k = 0
        if k == 0:
            self._drop(poller, pending, fd)
            return
        entry[2] = got = got + k
        if got < self._hello_nbytes(buf, got):
            return
        del pending[fd]
        poller.unregister(fd)
        status, peer_key, reason = fr.check_hello(buf)
        why = "bad_hello"
        if status == fr.STATUS_OK and self._token is not None:
            status, why, reason = _check_proof(self._token, buf, got)
        if status != fr.STATUS_OK:
            self.refused_handshakes += 1
            self.refused_by_reason[why] += 1
            _refuse(conn, status, reason)
            return
        local_key = _random_key()
        takes_putv = bool(fr.HELLO.unpack_from(buf, 0)[2] & _HELLO_PUTV)
        try:
            conn.send(_accept_reply(local_key, putv=takes_putv), _SEND_FLAGS)
            ep = TcpEndpoint(conn, url=self.url, local_key=local_key, peer_key=peer_key, busy_poll_s=self._busy_poll_s,
                             peer_takes_putv=takes_putv, read_ahead_nbytes=self._read_ahead_nbytes)
        except OSError:
            self.refused_handshakes += 1
            conn.close()
            return
        if not self._queue.offer(ep):
            ep.close()
            return
        self.accepted_handshakes += 1

    def accept(self, *, timeout_s: float | None = None) -> TcpEndpoint:
        """The next connected peer whose handshake succeeded (QlinkTimeoutError after timeout_s)."""
        return self._queue.take(timeout_s=timeout_s)

    def close(self) -> None:
        ready = self._queue.close()
        if ready is None:
            return
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=2.0)
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()
        for ep in ready:
            ep.close()


def _hello_proof(token: bytes, hello: bytes) -> bytes:
    """What a client sends after a hello with flag bit 1: HMAC-SHA256 of the hello under the token."""
    return hmac.new(token, _AUTH_LABEL + bytes(hello), hashlib.sha256).digest()


def _check_proof(token: bytes, buf: bytearray, got: int) -> tuple[int, str, str]:
    """``(status, reason key, reason text)`` of a hello sent to a listener that wants a token."""
    flags = fr.HELLO.unpack_from(buf, 0)[2]
    if not flags & _HELLO_AUTH or got < fr.HELLO.size + _AUTH_NBYTES:
        return _STATUS_UNAUTHORIZED, "no_token", ("this tcp listener admits only clients holding its shared token; "
                                                 "connect with token=... (the same token the service was given)")
    proof = bytes(buf[fr.HELLO.size:fr.HELLO.size + _AUTH_NBYTES])
    if not hmac.compare_digest(proof, _hello_proof(token, buf[:fr.HELLO.size])):
        return _STATUS_UNAUTHORIZED, "bad_token", ("the token this client proved is not the listener's; "
                                                  "connect with the service's shared token")
    return fr.STATUS_OK, "", ""


def _accept_reply(region_key: int, *, putv: bool) -> bytes:
    """The listener's acceptance: version 2 when the client said it takes PUTV frames
    (version 1 clients do not look at the reply's version)."""
    return fr.REPLY.pack(fr.MAGIC, _PUTV_VERSION if putv else fr.PROTOCOL_VERSION, fr.STATUS_OK, region_key, 0)


def _refuse(conn: socket.socket, status: int, reason: str) -> None:
    """Tell a client that speaks another protocol why it is refused, then hang up without a reset."""
    try:
        conn.setblocking(True)
        conn.settimeout(0.5)
        conn.sendall(fr.pack_reply(status, 0, reason), _SEND_FLAGS)
        conn.shutdown(socket.SHUT_WR)
        conn.setblocking(False)
        while conn.recv(65536):  # read what the client sent on so close() does not reset the connection
            pass
    except OSError:
        pass
    finally:
        conn.close()


def listen(url: str, *, busy_poll_s: float = _DEFAULT_BUSY_POLL_S, backlog: int = 128,
           handshake_timeout_s: float = _HANDSHAKE_TIMEOUT_S, token: str | bytes | None = None,
           read_ahead_nbytes: int = _RBUF_NBYTES) -> TcpListener:
    """Listen on ``tcp://host:port`` (host defaults to 127.0.0.1, port 0 picks a free one; see ``.url``).

    ``token``: admit only clients that prove they hold this shared secret (see the module
    docstring); ``read_ahead_nbytes``: each accepted endpoint's read-ahead buffer."""
    token = token_bytes(token)
    if not isinstance(read_ahead_nbytes, int) or read_ahead_nbytes < 4096:
        raise ValueError(f"read_ahead_nbytes must be an int >= 4096, got {read_ahead_nbytes!r}")
    host, port = split_host_port(url, scheme="tcp", for_listen=True)
    infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    family, stype, proto, _canon, addr = infos[0]
    sock = socket.socket(family, stype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(errno.EADDRINUSE, f"{_url_of(host, port)} is already in use; close the other listener "
                                                "or listen on port 0 for a free one") from None
            raise
        sock.listen(backlog)
        sock.setblocking(False)
        return TcpListener(sock, busy_poll_s=busy_poll_s, handshake_timeout_s=handshake_timeout_s, token=token,
                           read_ahead_nbytes=read_ahead_nbytes)
    except BaseException:
        sock.close()
        raise


def connect(url: str, *, timeout_s: float | None = 10.0, busy_poll_s: float = _DEFAULT_BUSY_POLL_S,
            token: str | bytes | None = None) -> TcpEndpoint:
    """Connect to a qlink tcp listener and complete the handshake (proving ``token`` when given).

    BrokenLinkError when nobody listens there, WireError when the listener refuses
    the handshake (its reason is in the message), QlinkTimeoutError after timeout_s.
    """
    token = token_bytes(token)
    host, port = split_host_port(url, scheme="tcp", for_listen=False)
    where = _url_of(host, port)
    deadline = deadline_of(timeout_s)

    def left() -> float | None:
        if deadline is None:
            return None
        rest = deadline - time.monotonic()
        if rest <= 0:
            raise QlinkTimeoutError(f"tcp: connecting to {where} did not complete within timeout_s={timeout_s}")
        return rest

    try:
        sock = socket.create_connection((host, port), timeout=left())
    except ConnectionRefusedError as e:
        raise BrokenLinkError(f"nobody listens on {where} (connection refused)") from e
    except TimeoutError as e:
        raise QlinkTimeoutError(f"tcp: connecting to {where} did not complete within timeout_s={timeout_s}") from e
    except OSError as e:
        raise BrokenLinkError(f"cannot connect to {where}: {e}") from e
    try:
        local_key = _random_key()
        sock.settimeout(left())
        if token is None:
            sock.sendall(fr.HELLO.pack(fr.MAGIC, fr.PROTOCOL_VERSION, _HELLO_PUTV, local_key))  # v1 hello + "takes PUTV"
        else:
            hello = fr.HELLO.pack(fr.MAGIC, fr.PROTOCOL_VERSION, _HELLO_PUTV | _HELLO_AUTH, local_key)
            sock.sendall(hello + _hello_proof(token, hello))
        head = _recv_exact(sock, fr.REPLY.size, left, where)
        version, status, peer_key, reason_n = fr.parse_reply(head)
        reason = _recv_exact(sock, reason_n, left, where).decode("utf-8", "replace") if reason_n else ""
        if status != fr.STATUS_OK:
            raise WireError(reason or f"the tcp listener at {where} refused the handshake (status {status})")
        return TcpEndpoint(sock, url=where, local_key=local_key, peer_key=peer_key, busy_poll_s=busy_poll_s,
                           peer_takes_putv=version >= _PUTV_VERSION)
    except TimeoutError as e:
        sock.close()
        raise QlinkTimeoutError(f"tcp: handshake with {where} did not complete within timeout_s={timeout_s}") from e
    except OSError as e:
        sock.close()
        raise BrokenLinkError(f"tcp handshake with {where} failed: {e}") from e
    except BaseException:
        sock.close()
        raise


def _recv_exact(sock: socket.socket, nbytes: int, left, where: str) -> bytes:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        sock.settimeout(left())
        k = sock.recv_into(view[got:])
        if k == 0:
            raise BrokenLinkError(f"the tcp listener at {where} hung up during the handshake")
        got += k
    return bytes(buf)
