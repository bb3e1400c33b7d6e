"""The endpoint of an ``shm://`` connection (:mod:`transports.shm` documents the
transport): its state, two-sided messages over the two rings of one shared memfd (the C
fast path when ``transports._ringc`` is built), the peer's liveness, and close. The
one-sided half is :class:`~transports._shm_put.ShmPutSide`."""

from __future__ import annotations

import mmap
import os
import socket
import time
import weakref
from collections import deque
from dataclasses import replace

from qlink.errors import BrokenLinkError, CapabilityError, ClosedError, QlinkTimeoutError, RingFullError, WouldBlock
from qlink.memory import as_byte_view

from . import _ring
from . import _shm_rendezvous as _rv
from ._base import BufferTooSmallError, Capabilities, Endpoint, Notification, deadline_of
from ._shm_regions import LocalRegions, PeerRegions
from ._ring import KIND_MSG, KIND_MSG_CONT, RELEASED, SEND_OK, SEND_PEER_CLOSED
from ._shm_put import ShmPutSide
from ._shm_records import C_NOTES, KEY, OFFER, OFFER_MAGIC, _ringc, space_needed
from ._shm_wait import ShmWait

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
_NOWAIT_SOCKET_CHECK_S = 1e-3
_PEER_CHECK_NS = 5_000_000  # a send or put that fits the ring still looks at the peer this often

# ----------------------------------------------------------------------------- endpoint


class ShmEndpoint(ShmPutSide, Endpoint):
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
                    w = ShmWait(self, "send", timeout_s)
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
        w = ShmWait(self, "send", timeout_s)
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
            w = ShmWait(self, what, timeout_s)
        w.pause()
        return w

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
