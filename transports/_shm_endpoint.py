"""The endpoint of an ``shm://`` connection (:mod:`transports.shm` documents the
transport): two-sided messages and one-sided puts over the two rings of one shared
memfd, the C fast path when ``transports._ringc`` is built."""

from __future__ import annotations

import mmap
import operator
import os
import socket
import time
import weakref
from collections import deque
from dataclasses import replace

import numpy as np

from qlink.errors import (
    BrokenLinkError,
    CapabilityError,
    ClosedError,
    QlinkTimeoutError,
    RingFullError,
    WouldBlock,
)
from qlink.memory import Region, RemoteRegion, as_byte_view

from . import _ring
from . import _shm_rendezvous as _rv
from ._waiting import SpinThenSleep
from ._base import MAX_TAG_BYTES, BufferTooSmallError, Capabilities, Endpoint, Notification, deadline_of
from ._base import check_notify_id as _check_notify_id
from ._base import check_tag as _check_tag
from ._pieces import check_pieces
from ._shm_regions import LocalRegions, PeerRegions
from ._ring import (
    KIND_CORRUPT,
    KIND_MSG,
    KIND_MSG_CONT,
    KIND_PUT_DONE,
    KIND_PUT_INLINE,
    KIND_PUT_PULL,
    RELEASED,
    SEND_OK,
    SEND_PEER_CLOSED,
    SEND_TOO_BIG,
)

from ._shm_records import (C_NOTES, DONE, INLINE, KEY, OFFER, OFFER_MAGIC, PIECE_NBYTES, PULL, PULL_LAST, _ringc,
                           fast_note, space_needed)

__all__ = ["ShmEndpoint", "CAPABILITIES"]

CAPABILITIES = Capabilities(
    name="shm",
    one_sided=True,
    zero_copy_put=True,
    device_memory=False,
    cross_process=True,
    cross_host=False,
)

# Polls per C call (~20 ns each): the first call of a receive spins ~10 us, which covers a
# prompt peer; after that the Python wait loop checks the deadline and yields the CPU
# between calls, so two endpoints that share one CPU still take turns.
_SPIN_ITERS = 500
_WAIT_SPIN_ITERS = 500
# Yield only after this long without progress: a yield hands the CPU to whatever else is
# runnable, and on a busy machine that costs a time slice; short waits (a streamed chunk,
# a prompt reply) should not pay it.
_YIELD_AFTER_S = 100e-6
_MIN_SLEEP_S = 5e-6
_MAX_SLEEP_S = 1e-3
_NOWAIT_SOCKET_CHECK_S = 1e-3
_PEER_CHECK_NS = 5_000_000  # a send or put that fits the ring still looks at the peer this often

# ----------------------------------------------------------------------------- waiting


class _Wait(SpinThenSleep):
    """The shm endpoint's wait (:class:`~transports._waiting.SpinThenSleep`): each idle moment
    also polls the peer's socket, so a peer that died is seen within a sleep."""

    __slots__ = ("ep",)

    def __init__(self, ep: "ShmEndpoint", what: str, timeout_s: float | None) -> None:
        self.ep = ep
        super().__init__(timeout_s=timeout_s, spin_s=ep._spin_s, what=what, yield_after_s=_YIELD_AFTER_S,
                         min_sleep_s=_MIN_SLEEP_S, max_sleep_s=_MAX_SLEEP_S)

    def timed_out(self) -> Exception:
        return self.ep._timed_out(self.what, self.timeout_s)

    def idle(self) -> bool:
        self.ep._poll_socket()
        return self.ep._peer_gone is not None  # the caller sees it and raises once nothing is left to deliver


# ----------------------------------------------------------------------------- endpoint


class ShmEndpoint(Endpoint):
    """One side of an ``shm://`` connection (made by :func:`connect` or ``accept``)."""

    capabilities = CAPABILITIES
    put_many_gathers = True  # one Notification per put_many, after every piece

    def __init__(self, *, url: str, sock: socket.socket, mm: mmap.mmap, side: int, ring_nbytes: int, token: int,
                 ring_cls, spin_s: float) -> None:
        super().__init__()
        self.url = url
        self._sock = sock
        self._mm = mm
        self._side = side
        self._spin_s = float(spin_s)
        whole = memoryview(mm)
        region = _ring.ring_region_nbytes(ring_nbytes)
        tx_off, rx_off = _rv.ring_offset(side, ring_nbytes), _rv.ring_offset(1 - side, ring_nbytes)
        self._tx = ring_cls(whole[tx_off:tx_off + region])
        self._rx = ring_cls(whole[rx_off:rx_off + region])
        whole.release()
        self._rx_data = self._rx.data
        tables = memoryview(mm)[_rv.table_offset(0, ring_nbytes):_rv.table_offset(2, ring_nbytes)].cast("Q")
        half = len(tables) // 2
        self._x = dict(zero_copy_puts=0, inline_puts=0, gathered_puts=0, deferred_puts=0, pulled_bytes=0,
                       queued_messages=0, aborted_messages=0, bad_records=0, zero_copy_unavailable=0)
        self._pull_seq = 0  # deferred puts posted; the peer publishes the last one it pulled in the ring header
        self._local = LocalRegions(tables[side * half:(side + 1) * half], key=KEY.pack(token, side))
        self._peer = PeerRegions(tables[(1 - side) * half:(2 - side) * half], key=KEY.pack(token, 1 - side),
                                 counters=self._x)
        self._tables = tables
        me = weakref.ref(self)  # no reference cycle: a dropped endpoint is freed (its socket closed) at once

        def collect_offers() -> None:
            ep = me()
            if ep is not None:
                ep._drain_socket()

        self._peer.before_map = collect_offers
        self._clean = True  # no queued message and no half-received one: the fast path may run
        self._msgq: deque = deque()  # whole messages moved aside (oldest first)
        self._notes: deque = deque()  # notifications moved aside
        self._partial: bytearray | None = None  # a streamed message being received off the fast path
        self._partial_filled = 0
        self._gone: str | None = None
        self._sock_eof = False
        self._peer_cause: BaseException | None = None
        self._last_socket_check = 0.0
        self._next_peer_check_ns = 0
        # the hot paths call these bound methods directly
        self._send_msg = self._tx.try_send_msg
        self._try_recv = self._rx.try_recv
        self._fast = None
        if _ringc is not None and ring_cls is _ringc.Ring:
            # send / recv_into entirely in C when the ring can serve them, else our _*_slow methods
            self._fast = fp = _ringc.FastPath(self._tx, self._rx, self, ShmEndpoint._send_slow, ShmEndpoint._recv_slow,
                                              _SPIN_ITERS)
            self.send, self.send_nowait = fp.send, fp.send_nowait
            self.recv_into, self.recv_into_nowait = fp.recv_into, fp.recv_into_nowait
            if C_NOTES:
                # put / put_many / notifications in C once a region is mapped, else the Python methods
                fp.enable_one_sided(self._peer.words, self._local.c_table, Notification, self._notes, ShmEndpoint.put,
                                    ShmEndpoint.put_many, ShmEndpoint.wait_notification,
                                    ShmEndpoint.poll_notification_nowait, ShmEndpoint._finish_put)
                self._peer.on_unmap = fp.forget_remote
                self.put, self.put_many = fp.put, fp.put_many
                self.wait_notification, self.poll_notification_nowait = fp.wait_notification, fp.poll_notification_nowait

    def native_rings(self):
        """``(tx, rx)``: this endpoint's C rings, for native code that moves whole messages
        through them with the ring's C API (``transports/_ring_api.h``; qlink's QEC hot
        path). The caller must not use this endpoint's own send/receive meanwhile.

        Raises :class:`~qlink.errors.CapabilityError` where the rings are the pure-Python
        ones (the C accelerator is not built) or a message is already queued aside on
        the Python side (it would be skipped).
        """
        if _ringc is None or not isinstance(self._tx, _ringc.Ring):
            raise CapabilityError("native_rings() needs the C ring (transports._ringc), which this endpoint does not "
                                  "use: build it with 'python setup.py build_ext --inplace' or reinstall qlink")
        if not self._rx_clean:
            raise CapabilityError("native_rings(): a message is queued aside on the Python side; receive it first")
        if self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        return self._tx, self._rx

    def check_peer(self) -> None:
        """Look at the peer now: raise :class:`~qlink.errors.BrokenLinkError` when it is gone
        (for native code driving :meth:`native_rings`, which sees only the rings' flags, not
        a peer that died without closing)."""
        if self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        self._poll_socket()
        if self._peer_flags() is not None:
            raise self._broken("peer check")

    def __repr__(self) -> str:
        return f"<ShmEndpoint {self.url} side={self._side} ring={self._tx.impl} {'closed' if self._closed else 'open'}>"

    @property
    def _peer_gone(self) -> str | None:
        """Why the peer is gone (None while it is there); setting it also stops the C put path."""
        return self._gone

    @_peer_gone.setter
    def _peer_gone(self, why: str | None) -> None:
        self._gone = why
        if self._fast is not None:
            self._fast.peer_gone = why is not None

    def statistics(self):
        s = super().statistics()
        tx, rx = self._tx, self._rx
        x = dict(self._x)
        if self._fast is not None:
            puts, put_bytes, zc, gathered, notes, pulled, deferred = self._fast.counters()
            x["zero_copy_puts"] += zc
            x["gathered_puts"] += gathered
            x["pulled_bytes"] += pulled
            x["deferred_puts"] += deferred
            s = replace(s, puts=s.puts + puts, put_bytes=s.put_bytes + put_bytes,
                        notifications=s.notifications + notes)
        return replace(
            s,
            messages_sent=s.messages_sent + tx.messages,
            bytes_sent=s.bytes_sent + tx.message_bytes,
            messages_received=s.messages_received + rx.messages,
            bytes_received=s.bytes_received + rx.message_bytes,
            extra={"ring_impl": tx.impl, "ring_nbytes": tx.nbytes, "spin_s": self._spin_s, **x},
        )

    # ----- peer state -------------------------------------------------------------
    def _peer_flags(self) -> str | None:
        if self._peer_gone is None and (self._rx.producer_closed or self._tx.consumer_closed):
            self._peer_gone = "the peer closed its endpoint"
        return self._peer_gone

    def _look_at_peer(self) -> None:
        """Poll the peer's socket if it was not looked at in the last millisecond: a send or
        put that fits the ring still learns of a dead peer (the C path routes a call here at
        most every 5 ms; the Python path does the same through ``_next_peer_check``)."""
        if self._peer_gone is None and time.monotonic() - self._last_socket_check > _NOWAIT_SOCKET_CHECK_S:
            self._poll_socket()

    def _poll_socket(self) -> None:
        """Non-blocking look at the connection socket: EOF or a reset means the peer is gone."""
        self._last_socket_check = time.monotonic()
        if self._peer_gone is not None or self._closed:
            return
        self._drain_socket()

    def _drain_socket(self) -> None:
        """Read what the peer sent on the connection socket: memfds of regions it registered
        (kept for mapping them), then EOF or an error once it is gone."""
        if self._closed or self._sock_eof:
            return
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self._sock, 64, 4, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._sock_eof = True
                if self._peer_gone is None:
                    self._peer_cause = e
                    self._peer_gone = (f"the connection to the peer failed ({e.strerror or e}); "
                                       "the peer process probably died")
                    self._tx.set_consumer_closed()
                return
            if not msg and not fds:
                self._sock_eof = True
                if self._peer_flags() is None:
                    self._peer_cause = EOFError("EOF on the shm connection socket")
                    self._peer_gone = ("the peer's endpoint went away without close() "
                                       "(its process exited or was killed, or it dropped the endpoint)")
                    self._tx.set_consumer_closed()  # the peer will never read again: sends now fail fast, even in C
                return
            if len(msg) == OFFER.size and len(fds) == 1 and msg[:8] == OFFER_MAGIC:
                self._peer.offer_fd(OFFER.unpack(msg)[1], fds[0])
            else:  # nothing else is ever sent after the handshake: drop and count
                for fd in fds:
                    os.close(fd)
                self._x["bad_records"] += 1

    def _broken(self, what: str) -> BrokenLinkError:
        self._counters.errors += 1
        err = BrokenLinkError(f"{self.url}: {what}: {self._peer_gone}")
        err.__cause__ = self._peer_cause
        return err

    def _check_send_code(self, r: int, what: str) -> None:
        if r == RELEASED or self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        if r == SEND_PEER_CLOSED:
            self._peer_flags()
            raise self._broken(what)

    # ----- two-sided: send ----------------------------------------------------------
    def send(self, data, *, timeout_s: float | None = None) -> None:
        """Send one message; waits (up to ``timeout_s``) while the ring is full. Messages
        larger than one record stream through the ring while the peer drains it."""
        if timeout_s is not None and not timeout_s >= 0:
            deadline_of(timeout_s)  # raises ValueError
        if self._peer_check_due() or self._send_msg(data) != SEND_OK:
            self._send_slow(data, timeout_s, False)

    def send_nowait(self, data) -> None:
        """Send one message now or raise RingFullError having sent nothing."""
        if self._peer_check_due() or self._send_msg(data) != SEND_OK:
            self._send_slow(data, None, True)

    def _peer_check_due(self) -> bool:
        """(Python ring path; the C path keeps its own clock.) True at most every 5 ms."""
        now = time.monotonic_ns()
        if now < self._next_peer_check_ns:
            return False
        self._next_peer_check_ns = now + _PEER_CHECK_NS
        return True

    def _send_slow(self, data, timeout_s: float | None, nowait: bool) -> None:
        self._check_open()
        mv = as_byte_view(data)
        n = len(mv)
        if n > CAPABILITIES.max_message_bytes:
            raise ValueError(f"message of {n} bytes exceeds max_message_bytes={CAPABILITIES.max_message_bytes}")
        self._look_at_peer()
        if self._peer_flags() is not None:
            raise self._broken("send")
        tx = self._tx
        if n <= tx.max_payload:
            w = None
            while True:
                r = self._send_msg(mv)
                if r == SEND_OK:
                    return
                self._check_send_code(r, "send")
                if nowait:
                    self._nowait_check("send")
                    raise RingFullError(f"shm ring to the peer is full ({tx.free_nbytes()} of {tx.nbytes} bytes free); "
                                        "nothing was sent, retry once the peer has received")
                if self._peer_gone is not None:
                    raise self._broken("send")
                if w is None:
                    w = _Wait(self, "send", timeout_s)
                w.pause()
        if nowait:
            self._send_whole_nowait(mv)
        else:
            self._stream(mv, timeout_s)
        self._counters.messages_sent += 1
        self._counters.bytes_sent += n

    def _chunks(self, total: int):
        step = self._tx.max_payload
        return [(off, min(step, total - off)) for off in range(0, total, step)]

    def _send_whole_nowait(self, mv: memoryview) -> None:
        tx = self._tx
        chunks = self._chunks(len(mv))
        need = space_needed(tx.producer_head, tx.nbytes, [c for _, c in chunks])
        if need > tx.nbytes:
            raise RingFullError(
                f"message of {len(mv)} bytes needs {need} bytes of ring but the ring holds {tx.nbytes}; send_nowait "
                "cannot take it in one go: use send(), which streams it, or connect with a larger ring_nbytes"
            )
        if tx.free_nbytes() < need:
            self._nowait_check("send")
            raise RingFullError(f"shm ring to the peer has {tx.free_nbytes()} bytes free, the message needs {need}; "
                                "nothing was sent, retry once the peer has received")
        for off, c in chunks:
            r = tx.try_send(KIND_MSG if off == 0 else KIND_MSG_CONT, len(mv) if off == 0 else off, mv[off:off + c])
            if r != SEND_OK:  # only a concurrent close can get here: the space was checked
                self._check_send_code(r, "send")
                raise RuntimeError(f"shm ring refused a record after its space was checked (code {r})")

    def _stream(self, mv: memoryview, timeout_s: float | None) -> None:
        tx = self._tx
        total = len(mv)
        w = _Wait(self, "send", timeout_s)
        chunks = self._chunks(total)
        i = 0
        try:
            while i < len(chunks):
                off, c = chunks[i]
                r = tx.try_send(KIND_MSG if i == 0 else KIND_MSG_CONT, total if i == 0 else off, mv[off:off + c])
                if r == SEND_OK:
                    i += 1
                    w.progressed()
                    continue
                self._check_send_code(r, "send")
                if self._peer_gone is not None:
                    raise self._broken("send")
                w.pause()
        except BaseException:
            if i:  # the receiver drops the part that went out when the next message starts
                self._x["aborted_messages"] += 1
            raise

    # ----- two-sided: receive ---------------------------------------------------------
    def recv_into(self, buf, *, timeout_s: float | None = None) -> int:
        """Receive the next message into ``buf``; return its size in bytes."""
        if timeout_s is not None and not timeout_s >= 0:
            deadline_of(timeout_s)
        if self._clean:
            n = self._try_recv(buf, _SPIN_ITERS)
            if n >= 0:
                return n
        return self._recv_slow(buf, timeout_s, False)

    def recv_into_nowait(self, buf) -> int:
        """Receive the next message if one is ready, else raise WouldBlock."""
        if self._clean:
            n = self._try_recv(buf, 0)
            if n >= 0:
                return n
        return self._recv_slow(buf, None, True)

    @property
    def _rx_clean(self) -> bool:
        return self._clean

    @_rx_clean.setter
    def _rx_clean(self, value: bool) -> None:
        self._clean = value
        if self._fast is not None:
            self._fast.rx_clean = value

    def _set_clean(self) -> None:
        self._rx_clean = not self._msgq and self._partial is None

    def _recv_slow(self, buf, timeout_s: float | None, nowait: bool) -> int:
        self._check_open()
        out = as_byte_view(buf)
        if out.readonly:
            raise TypeError("recv_into needs a writable buffer (bytearray, numpy array...), got a read-only one")
        w = None
        rx = self._rx
        while True:
            if self._msgq:
                n = self._deliver_queued(self._msgq, out)
                self._set_clean()
                return n
            rec = rx.peek()
            if rec is None:
                w = self._idle(w, "recv_into", timeout_s, nowait)
                continue
            kind, n, aux, off = rec
            if kind == KIND_MSG and self._partial is None:
                if aux > len(out):
                    raise BufferTooSmallError(
                        f"next shm message is {aux} bytes but the buffer holds {len(out)}; the message stays "
                        f"queued, call again with a buffer of at least {aux} bytes",
                        needed_nbytes=aux,
                    )
                out[:n] = self._rx_data[off:off + n]
                rx.consume()
                if n == aux:
                    self._counters.messages_received += 1
                    self._counters.bytes_received += n
                    return n
                got = self._recv_rest(out, aux, n, w, timeout_s, nowait)
                if got is not None:
                    return got
            elif kind in (KIND_MSG, KIND_MSG_CONT):
                self._stash(kind, n, aux, off)
            else:
                self._side_record(kind, n, aux, off)
                if nowait and self._notes:
                    # a put completed on the way to the message: hand control back so the caller
                    # sees that completion now, not after every put queued before the message
                    raise WouldBlock("shm: a put completed before the next message; poll its notification, "
                                     "then receive again")

    def _recv_rest(self, out: memoryview, total: int, filled: int, w, timeout_s, nowait) -> int | None:
        """Receive the later chunks of a streamed message straight into the caller's buffer."""
        rx, data = self._rx, self._rx_data
        while filled < total:
            rec = rx.peek()
            if rec is None:
                try:
                    w = self._idle(w, "recv_into", timeout_s, nowait, mid_message=True)
                except (QlinkTimeoutError, WouldBlock):  # keep what arrived; the next call goes on from here
                    self._partial = bytearray(total)
                    self._partial[:filled] = out[:filled]
                    self._partial_filled = filled
                    self._rx_clean = False
                    raise
                continue
            kind, n, aux, off = rec
            if kind == KIND_MSG_CONT:
                if aux != filled or n > total - filled:
                    self._x["bad_records"] += 1
                    self._counters.errors += 1
                else:
                    out[filled:filled + n] = data[off:off + n]
                    filled += n
                rx.consume()
            elif kind == KIND_MSG:  # the sender gave up on this message (its send timed out)
                self._x["aborted_messages"] += 1
                return None
            else:
                self._side_record(kind, n, aux, off)
        self._counters.messages_received += 1
        self._counters.bytes_received += total
        return total

    def _stash(self, kind: int, n: int, aux: int, off: int) -> None:
        """Move a message record off the ring into the receive-side queue."""
        data = self._rx_data
        if kind == KIND_MSG:
            if self._partial is not None:
                self._x["aborted_messages"] += 1
                self._partial = None
            if n == aux:
                self._msgq.append(bytes(data[off:off + n]))
                self._x["queued_messages"] += 1
            else:
                self._partial = bytearray(aux)
                self._partial[:n] = data[off:off + n]
                self._partial_filled = n
        else:  # KIND_MSG_CONT
            p = self._partial
            if p is None or aux != self._partial_filled or n > len(p) - aux:
                self._x["bad_records"] += 1
                self._counters.errors += 1
            else:
                p[aux:aux + n] = data[off:off + n]
                self._partial_filled += n
                if self._partial_filled == len(p):
                    self._msgq.append(p)
                    self._x["queued_messages"] += 1
                    self._partial = None
        self._rx.consume()
        self._set_clean()

    def _nowait_check(self, what: str) -> None:
        """In a ``*_nowait`` call that found nothing: look at the socket at most every millisecond."""
        self._look_at_peer()
        if self._peer_flags() is not None and what == "send":
            raise self._broken(what)

    def _idle(self, w, what: str, timeout_s, nowait: bool, *, mid_message: bool = False):
        """Nothing to read: spin, back off, or raise (closed, broken, timed out, would block)."""
        if self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        if self._rx.poll(_WAIT_SPIN_ITERS if (w is not None or mid_message) else 0):
            return w
        if nowait:
            self._nowait_check(what)
        if self._peer_flags() is not None:
            if not self._rx.poll(0):  # everything sent before the peer went away has been delivered
                if mid_message:
                    self._peer_gone += " in the middle of a message"
                raise self._broken(what)
            return w
        if nowait:
            raise WouldBlock(f"shm: nothing for {what} has arrived yet")
        if w is None:
            w = _Wait(self, what, timeout_s)
        w.pause()
        return w

    # ----- records other than messages ---------------------------------------------------
    def _take_put_done(self, n: int, off: int) -> Notification | None:
        """Consume the PUT_DONE record at the head of the ring; its Notification, or None if bad."""
        note = None
        if n >= DONE.size:
            data = self._rx_data
            rid, tag_len, offset, nbytes, notify_id = DONE.unpack_from(data, off)
            entry = self._local.get(rid)
            if DONE.size + tag_len == n and entry is not None and offset + nbytes <= entry[0].nbytes:
                note = fast_note(rid, offset, nbytes, notify_id, bytes(data[off + DONE.size:off + n]) if tag_len else b"")
        if note is None:  # not a put into a region registered here (deregistered meanwhile?)
            self._x["bad_records"] += 1
            self._counters.errors += 1
        self._rx.consume()
        return note

    def _apply_pull(self, n: int, off: int) -> Notification | None:
        """Copy the pieces of the PUT_PULL record at the head of the ring out of the peer's
        region into ours, consume it; the Notification when it was the put's last record."""
        data, note, ok, seq, last = self._rx_data, None, False, 0, False
        if n >= PULL.size:
            dst_rid, src_rid, k, tag_len, nid, seq, span_off, span_n, flags, _ = PULL.unpack_from(data, off)
            last = bool(flags & PULL_LAST)
            entry = self._local.get(dst_rid)
            source = self._peer.source(src_rid)
            if (tag_len <= MAX_TAG_BYTES and PULL.size + tag_len + k * PIECE_NBYTES == n and entry is not None
                    and source is not None):
                dview, (state, sview) = entry[1], source
                at = off + PULL.size + tag_len
                raw = np.frombuffer(data, dtype="<u8", count=3 * k, offset=at).reshape(k, 3)
                q = raw.astype(np.int64)
                s_, d_, l_ = q[:, 0], q[:, 1], q[:, 2]
                lim = len(dview)
                if ((raw < 1 << 62).all() and (l_ <= len(sview)).all() and (s_ <= len(sview) - l_).all()
                        and (l_ <= lim).all() and (d_ <= lim - l_).all() and (not last or span_off + span_n <= lim)):
                    for a, b, c in q.tolist():
                        dview[b:b + c] = sview[a:a + c]
                    self._x["pulled_bytes"] += int(l_.sum())
                    if self._fast is not None:
                        self._fast.cache_source(src_rid, state, sview)  # later records of it are pulled in C
                    ok = True
                    if last:
                        tag = bytes(data[off + PULL.size:off + PULL.size + tag_len]) if tag_len else b""
                        note = fast_note(dst_rid, span_off, span_n, nid, tag)
        if not ok:  # the source or the target region is gone, or the record is malformed
            self._x["bad_records"] += 1
            self._counters.errors += 1
        self._rx.consume()
        if last:
            self._rx.set_pulled(seq)  # after the copies: the initiator may reuse its source
        return note

    def _side_record(self, kind: int, n: int, aux: int, off: int) -> None:
        rx, data = self._rx, self._rx_data
        if kind == KIND_PUT_DONE:
            note = self._take_put_done(n, off)
            if note is not None:
                self._notes.append(note)
        elif kind == KIND_PUT_INLINE:
            ok = False
            if n >= INLINE.size:
                rid, _, offset = INLINE.unpack_from(data, off)
                entry = self._local.get(rid)
                c = n - INLINE.size
                if entry is not None and offset + c <= entry[0].nbytes:
                    entry[1][offset:offset + c] = data[off + INLINE.size:off + n]
                    ok = True
            if not ok:
                self._x["bad_records"] += 1
                self._counters.errors += 1
            rx.consume()
        elif kind == KIND_PUT_PULL:
            done = self._fast.pull_head() if self._fast is not None and C_NOTES else None
            note = self._apply_pull(n, off) if done is None else None if done is True else done
            if note is not None:
                self._notes.append(note)
        elif kind == KIND_CORRUPT:
            self._peer_gone = (f"the ring from the peer holds a record of {n} bytes that does not fit it "
                               "(memory corrupted); the connection cannot continue")
            raise self._broken("receive")
        else:
            self._x["bad_records"] += 1
            self._counters.errors += 1
            rx.consume()

    # ----- one-sided ------------------------------------------------------------------
    def register(self, array) -> Region:
        """Register ``array`` (writable, C-contiguous host memory) as a put target.

        Puts into :func:`qlink.memory.alloc` memory are zero-copy (the initiator writes
        it directly); any other array is written by this side as it progresses.
        """
        self._check_open()
        region = self._local.register(array)
        fd = self._local.shared_fd(region.region_id)
        if fd is not None:  # hand the memfd over: the peer maps it even if this process is gone by then
            try:
                socket.send_fds(self._sock, [OFFER.pack(OFFER_MAGIC, region.region_id)], [fd], socket.MSG_DONTWAIT)
            except OSError:
                pass  # the peer maps it through /proc instead
        return region

    def deregister(self, region: Region) -> None:
        """Forget a region; later puts into it raise RegistrationError on the initiator."""
        self._local.deregister(region, publish=not self._closed)

    def put(self, data, remote: RemoteRegion, *, offset: int = 0, notify_id: int = 0, tag: bytes = b"",
            timeout_s: float | None = None) -> None:
        """Write ``data`` into the peer's region at ``offset``; the peer then gets a Notification.

        Validation failures (unknown region, out of range) raise RegistrationError
        before anything is written.
        """
        if self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        if timeout_s is not None and not timeout_s >= 0:
            deadline_of(timeout_s)
        if not isinstance(remote, RemoteRegion):
            remote = RemoteRegion.from_bytes(remote)
        if type(offset) is not int:
            offset = operator.index(offset)
        tag = _check_tag(tag)
        notify_id = _check_notify_id(notify_id)
        try:
            src = memoryview(data)
        except TypeError:
            src = None
        if src is None or src.format != "B" or src.ndim != 1 or not src.c_contiguous:
            src = as_byte_view(data)  # casts, or says what is wrong with the buffer
        n = len(src)
        state, _, dst = self._peer.entry(remote, offset=offset, nbytes=n)  # raises before anything is written
        self._look_at_peer()
        if self._peer_gone is not None or self._tx.consumer_closed:
            self._peer_flags()
            raise self._broken("put")  # never write into memory the peer may have moved on from
        rid = remote.region_id
        w = None
        if dst is not None:
            if n:
                dst[offset:offset + n] = src
            self._x["zero_copy_puts"] += 1
            if self._fast is not None:
                self._fast.cache_remote(remote, rid, state, len(dst), dst)  # later puts into it run in C
        else:
            w = _Wait(self, "put", timeout_s)
            self._put_inline(rid, src, offset, w)
            self._x["inline_puts"] += 1
        self._finish_put(DONE.pack(rid, len(tag), offset, n, notify_id), tag, timeout_s, w)
        self._counters.puts += 1
        self._counters.put_bytes += n

    def put_many(self, data, remote: RemoteRegion, src_offsets, dst_offsets, nbytes, *, notify_id: int = 0,
                 tag: bytes = b"", timeout_s: float | None = None, defer: bool = False) -> int:
        """Write pieces of ``data`` into the peer's region and publish ONE Notification for all.

        Piece ``i`` is ``data[src_offsets[i]:src_offsets[i] + nbytes[i]]`` and lands at
        ``dst_offsets[i]`` (later pieces win where destinations overlap). The target's
        Notification covers the smallest range holding every piece (``offset`` = the lowest
        destination, ``nbytes`` = up to the end of the highest) and is published after the
        last byte. Every piece is checked before any is written. Returns 1, the number of
        Notifications the target will see (see :meth:`transports.Endpoint.put_many`).
        Offsets and sizes as int64 NumPy arrays take the C path; any integer sequences work.

        ``defer=True`` with ``data`` inside alloc() memory registered on this endpoint: only
        the list of pieces is sent, and the target copies them out of that memory itself as
        it progresses (in ``wait_notification`` / ``poll_notification_nowait`` / receives),
        so the call returns in microseconds however many bytes move; ``data`` must then stay
        unchanged until :meth:`flush` returns (or the Notification was seen). Elsewhere
        ``defer`` changes nothing.
        """
        if self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        if timeout_s is not None and not timeout_s >= 0:
            deadline_of(timeout_s)
        if not isinstance(remote, RemoteRegion):
            remote = RemoteRegion.from_bytes(remote)
        tag = _check_tag(tag)
        notify_id = _check_notify_id(notify_id)
        src = as_byte_view(data)
        so, do, ln = check_pieces(src_offsets, dst_offsets, nbytes, src_nbytes=len(src), region_nbytes=remote.nbytes,
                                  region_id=remote.region_id)
        lo, hi = int(do.min()), int((do + ln).max())
        state, region_nbytes, dst = self._peer.entry(remote, offset=lo, nbytes=hi - lo)
        self._look_at_peer()
        if self._peer_gone is not None or self._tx.consumer_closed:
            self._peer_flags()
            raise self._broken("put_many")
        rid = remote.region_id
        if self._fast is not None:
            self._fast.cache_remote(remote, rid, state, region_nbytes, dst)  # later put_many into it run in C
        if defer and len(src) and self._tx.max_payload - PULL.size - len(tag) >= PIECE_NBYTES:
            home = self._local.containing(np.frombuffer(src, dtype=np.uint8).ctypes.data, len(src))
            if home is not None:
                self._post_pull(home, rid, so, do, ln, lo, hi, notify_id, tag, timeout_s)
                return 1
        w = None
        pieces = zip(so.tolist(), do.tolist(), ln.tolist())
        if dst is not None:
            for s, d, n in pieces:
                dst[d:d + n] = src[s:s + n]
            self._x["zero_copy_puts"] += len(ln)
        else:
            w = _Wait(self, "put_many", timeout_s)
            for s, d, n in pieces:
                self._put_inline(rid, src[s:s + n], d, w)
            self._x["inline_puts"] += len(ln)
        self._finish_put(DONE.pack(rid, len(tag), lo, hi - lo, notify_id), tag, timeout_s, w)
        self._x["gathered_puts"] += 1
        self._counters.puts += len(ln)
        self._counters.put_bytes += int(ln.sum())
        return 1

    def _post_pull(self, home: tuple[int, int], rid: int, so, do, ln, lo: int, hi: int, notify_id: int, tag: bytes,
                   timeout_s: float | None) -> None:
        """PUT_PULL records naming the pieces; the target copies them out of our region ``home``."""
        src_rid, base = home
        pieces = np.empty((len(ln), 3), dtype="<u8")
        pieces[:, 0], pieces[:, 1], pieces[:, 2] = so + base, do, ln
        per_record = (self._tx.max_payload - PULL.size - len(tag)) // PIECE_NBYTES
        seq, w = self._next_pull_seq(), None
        for start in range(0, len(pieces), per_record):
            part = pieces[start:start + per_record]
            last = start + per_record >= len(pieces)
            head = PULL.pack(rid, src_rid, len(part), len(tag), notify_id, seq, lo, hi - lo,
                              PULL_LAST if last else 0, 0) + tag
            body = memoryview(part).cast("B")
            if self._tx.try_send(KIND_PUT_PULL, 0, head, body) != SEND_OK:
                w = w or _Wait(self, "put_many", timeout_s)
                self._send_record(KIND_PUT_PULL, head, body, w, "put_many")
        self._x["deferred_puts"] += 1
        self._x["gathered_puts"] += 1
        self._counters.puts += len(ln)
        self._counters.put_bytes += int(ln.sum())
        if self._fast is not None:
            self._fast.cache_home(src_rid)  # the next deferred put from there is posted in C

    def _next_pull_seq(self) -> int:
        if self._fast is not None:
            self._fast.pull_seq += 1
            return self._fast.pull_seq
        self._pull_seq += 1
        return self._pull_seq

    def flush(self, *, timeout_s: float | None = None) -> None:
        """Wait until the peer has copied every deferred put (``put_many(..., defer=True)``);
        their sources may change from then on. BrokenLinkError if the peer goes away first."""
        self._check_open()
        deadline_of(timeout_s)
        w = None
        posted = self._fast.pull_seq if self._fast is not None else self._pull_seq
        while self._tx.pulled < posted:
            if self._peer_flags() is not None:
                raise self._broken("flush")
            if w is None:
                w = _Wait(self, "flush", timeout_s)
            w.pause()

    def _put_inline(self, rid: int, src: memoryview, offset: int, w: "_Wait") -> None:
        """PUT_INLINE records carrying ``src`` for the target to apply at ``offset``."""
        n = len(src)
        step = self._tx.max_payload - INLINE.size
        for pos in range(0, n, step):
            c = min(step, n - pos)
            self._send_record(KIND_PUT_INLINE, INLINE.pack(rid, 0, offset + pos), src[pos:pos + c], w, "put")

    def _finish_put(self, done: bytes, tag: bytes, timeout_s: float | None, w: "_Wait | None" = None) -> None:
        """Publish a put's PUT_DONE record, waiting (up to ``timeout_s``) while the ring is full."""
        if self._tx.try_send(KIND_PUT_DONE, 0, done, tag) != SEND_OK:
            self._send_record(KIND_PUT_DONE, done, tag, w or _Wait(self, "put", timeout_s), "put")

    def _send_record(self, kind: int, part1, part2, w: _Wait, what: str) -> None:
        tx = self._tx
        while True:
            r = tx.try_send(kind, 0, part1, part2)
            if r == SEND_OK:
                w.progressed()
                return
            self._check_send_code(r, what)
            if r == SEND_TOO_BIG:  # cannot happen: records are sized below max_payload
                raise RuntimeError(f"shm record of kind {kind} exceeds the ring's max payload")
            if self._peer_gone is not None:
                raise self._broken(what)
            w.pause()

    def wait_notification(self, *, timeout_s: float | None = None) -> Notification:
        """Wait for the next put completion targeted at this side (applying inline puts on the way)."""
        if not self._notes and not self._closed and (timeout_s is None or timeout_s >= 0):
            rec = self._rx.peek()  # fast path: a completion is at the head of the ring
            if rec is not None and rec[0] == KIND_PUT_DONE:
                note = self._take_put_done(rec[1], rec[3])
                if note is not None:
                    self._counters.notifications += 1
                    return note
        return self._next_note(timeout_s, False)

    def poll_notification_nowait(self) -> Notification:
        """The next put completion if one has arrived, else raise WouldBlock."""
        return self._next_note(None, True)

    def _next_note(self, timeout_s: float | None, nowait: bool) -> Notification:
        self._check_open()
        if self._notes:
            self._counters.notifications += 1
            return self._notes.popleft()
        w = None
        rx = self._rx
        what = "poll_notification_nowait" if nowait else "wait_notification"
        if not nowait:
            deadline_of(timeout_s)
        while True:
            if self._notes:
                self._counters.notifications += 1
                return self._notes.popleft()
            rec = rx.peek()
            if rec is None:
                w = self._idle(w, what, timeout_s, nowait)
                continue
            kind, n, aux, off = rec
            if kind in (KIND_MSG, KIND_MSG_CONT):
                self._stash(kind, n, aux, off)
            else:
                self._side_record(kind, n, aux, off)

    # ----- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Close this side: the peer receives what was already sent, then BrokenLinkError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._tx.set_producer_closed()
        self._rx.set_consumer_closed()
        self._tx.release()
        self._rx.release()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._fast is not None:
            self._fast.disable_one_sided()  # drops its mappings and table views before they go
        self._peer.close()
        self._local.clear()
        self._msgq.clear()
        self._partial = None
        self._tables.release()
        self._rx_data = None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
