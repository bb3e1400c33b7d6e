"""``ucx://host:port``: messages and one-sided put over UCX (UCXX), polled from the caller's thread.

The endpoint drives a UCX worker from the thread that calls it (progress + tag probes in a
bounded busy-poll, then backoff): no event loop and no progress thread sit on the path.
UCXX creates the context, worker and endpoints; the per-message calls go straight to UCP
on UCXX's handles (``hot_path="ucp"``, the default) or through UCXX's Python core API
(``hot_path="ucxx"``), see :mod:`transports._ucx_core`.

How a connection is made and watched
    ``listen`` binds a small TCP *bootstrap* socket (``127.0.0.1`` unless another address is
    given; port 0 picks a free port, ``Listener.url`` names it). ``connect`` opens it, both
    sides swap a hello (connection id, token, UCX worker address; see
    :mod:`transports._ucx_boot`), create a UCX endpoint to the other's worker and swap one
    control frame over UCX before returning, so the data path is up and proven. The
    bootstrap socket stays open as a liveness wire: a peer that exits or is killed closes
    it, and every wait looks at it at least every 20 ms, so a dead peer surfaces as
    :class:`~qlink.errors.BrokenLinkError` well within a second. (UCXX's own listener binds
    every interface and takes no address, which is why the bootstrap socket is ours.)

Transports
    ``UCX_TLS`` from the environment wins; otherwise the contexts made here use
    ``tcp,sm,self``. For a loopback address UCX's TCP transport also stays on the loopback
    device (``NET_DEVICES=lo``) unless ``UCX_NET_DEVICES`` is set. By default endpoints use
    UCX's error-handling mode *none*, which lets UCX pick shared memory between processes
    on one host (sysv/posix eager, CMA rendezvous); failures are caught by the bootstrap
    socket. ``peer_error_handling=True`` asks UCX for mode *peer* (UCX detects failures
    itself and calls the endpoint's error callback), which on UCX 1.21 rules out the
    shared-memory transports and runs over TCP.

Wire: tags carry the receiver's 24-bit connection id, so one worker per process serves
every endpoint; ``tag = kind << 56 | connection id << 32 | sequence``.
    Kind 0x10, a message: its length is the UCX message length, found by probing before
    receiving (a buffer that is too small raises :class:`BufferTooSmallError` and the
    message stays held for the next call). Kind 0x11, a control frame: 40-byte header
    (``u8 op, 3x, u32 region id, u64 offset, u64 nbytes, u64 notify id, u32 put sequence,
    u16 tag length, 2x``), then the put tag, then inline put bytes; ops put-inline,
    put-header, region revoked, close, wireup. Kind 0x20: the bytes of a large put, received
    by the target straight into its registered region.

One-sided put
    UCXX 0.52's Python API has no memory registration or remote keys, so put is done in
    software: puts up to 4 KiB travel inline in a control frame and are copied into the
    region; larger ones send a header, then the bytes, which the target receives directly
    into the region during its progress (``zero_copy_put=False``: the target must be calling
    into its endpoint). The notification is queued only once the bytes are in place.

Sends are staged: the caller's bytes are copied into endpoint-owned memory before UCX sees
them, so ``send`` returns while a large message waits for the receiver (like a socket
buffer; ``send_buffer_nbytes`` bounds it, then ``send`` blocks and ``send_nowait`` raises
WouldBlock). ``zero_copy_send_nbytes=N`` sends messages of at least N bytes from the
caller's buffer instead; ``send`` then waits until the receiver has taken them. A large
message leaves only while both sides make progress (they are inside a call on their
endpoints) unless UCX can read it directly (CMA between local processes).

>>> import transports
>>> with transports.listen("ucx://127.0.0.1:0") as lis:
...     a = transports.connect(lis.url, timeout_s=5)
...     b = lis.accept(timeout_s=5)
...     a.send(b"ping")
...     b.recv(timeout_s=5)
b'ping'
>>> a.close(); b.close()
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import select
import socket
import struct
import threading
import time
import weakref

import numpy as np

from qlink.errors import BrokenLinkError, ClosedError, QlinkTimeoutError, RegistrationError, WireError, WouldBlock
from qlink.memory import Region, RemoteRegion, as_byte_view, is_device_array

from . import _ucx_boot as boot
from . import _ucx_core as core
from ._base import (
    MAX_TAG_BYTES,
    Backoff,
    BufferTooSmallError,
    Capabilities,
    Endpoint,
    Listener,
    Notification,
    Statistics,
    deadline_of,
)

__all__ = ["CAPABILITIES", "DEFAULT_UCX_TLS", "HOT_PATHS", "listen", "connect", "UcxEndpoint", "UcxListener"]

CAPABILITIES = Capabilities(
    name="ucx",
    one_sided=True,
    zero_copy_put=False,  # software put: the target receives the bytes during its progress
    device_memory=False,  # host buffers only (UCX could carry CuPy arrays; not wired up here)
    cross_process=True,
    cross_host=True,
)

DEFAULT_UCX_TLS = core.DEFAULT_UCX_TLS
HOT_PATHS = tuple(core.HOT_PATHS)

_K_MSG, _K_CTRL, _K_DATA = 0x10, 0x11, 0x20
_KIND_SHIFT, _CONN_SHIFT = 56, 32
_MASK_MSG_OR_CTRL = (0xFE << _KIND_SHIFT) | (0xFFFFFF << _CONN_SHIFT) | 0xFFFFFFFF
_MASK_FULL = (1 << 64) - 1

_CTRL = struct.Struct("<B3xIQQQIH2x")
_OP_PUT_INLINE, _OP_PUT_HEADER, _OP_REVOKE, _OP_CLOSE, _OP_WIREUP = 1, 2, 3, 4, 5
_INLINE_PUT_MAX = 4096
_CTRL_MAX = _CTRL.size + MAX_TAG_BYTES + _INLINE_PUT_MAX

_SMALL = 8192  # messages up to this size are staged in fixed slots
_LIVENESS_INTERVAL_S = 0.02
_LINGER_MAX_S = 30.0
_IN_PROGRESS = core.IN_PROGRESS

atexit.register(core.close_lingering)


class _Stage:
    """Endpoint-owned send memory: fixed small slots and pooled large buffers (NumPy uint8)."""

    __slots__ = ("slots", "views", "free", "large")

    def __init__(self) -> None:
        self.slots: list[np.ndarray] = []
        self.views: list[memoryview] = []
        self.free: list[int] = []
        self.large: dict[int, list[np.ndarray]] = {}

    def small(self, src, n: int) -> tuple[int, np.ndarray]:
        if self.free:
            i = self.free.pop()
        else:
            i = len(self.slots)
            self.slots.append(np.empty(_SMALL, dtype=np.uint8))
            self.views.append(memoryview(self.slots[i]))
        if n:
            self.views[i][:n] = src
        return i, self.slots[i]

    def big(self, src, n: int) -> tuple[np.ndarray, np.ndarray]:
        size = 1 << (n - 1).bit_length()
        pool = self.large.get(size)
        buf = pool.pop() if pool else np.empty(size, dtype=np.uint8)
        buf.data[:n] = src
        return buf, buf

    def release(self, item) -> None:
        if isinstance(item, int):
            self.free.append(item)
        else:
            pool = self.large.setdefault(len(item), [])
            if len(pool) < 2 and len(item) <= 1 << 26:
                pool.append(item)


def _flat_u8(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, dtype=np.uint8)


class UcxEndpoint(Endpoint):
    """One side of a ``ucx://`` connection (made by :func:`connect` or ``UcxListener.accept``)."""

    capabilities = CAPABILITIES

    def __init__(self, *, url: str, sock: socket.socket, box: core.Worker, conn_id: int, token: bytes,
                 peer_conn_id: int, peer_token: bytes, peer_address: bytes, opts: dict, flags: int) -> None:
        super().__init__()
        lib, _ = core.ucxx()
        self.url = url
        sock.setblocking(False)  # from here on only peeked at for EOF
        self._sock = sock
        self._box = box
        self._token = token
        self._peer_token = peer_token
        self._peer_error_handling = bool(flags & boot.FLAG_PEER_ERRORS)
        self._send_budget = int(opts["send_buffer_nbytes"])
        self._zero_copy_min = opts["zero_copy_send_nbytes"]
        self._linger_s = float(opts["linger_s"])
        try:
            self._ep = box.worker.create_endpoint_from_worker_address(
                lib.UCXAddress.create_from_buffer(peer_address), self._peer_error_handling)
        except Exception as e:  # UCXUnreachableError and friends
            raise BrokenLinkError(f"ucx: cannot reach the peer's UCX worker ({e}); check UCX_TLS on both sides") from e
        self._ep_closed = False
        self._ucx_error = False
        self._ep.set_close_callback(_on_ucx_error, cb_args=(weakref.ref(self),))
        self._ops = core.make_ops(opts["hot_path"], box, self._ep)
        self._tx_msg = (_K_MSG << _KIND_SHIFT) | (peer_conn_id << _CONN_SHIFT)
        self._tx_ctrl = (_K_CTRL << _KIND_SHIFT) | (peer_conn_id << _CONN_SHIFT)
        self._tx_data = (_K_DATA << _KIND_SHIFT) | (peer_conn_id << _CONN_SHIFT)
        self._rx_msg = (_K_MSG << _KIND_SHIFT) | (conn_id << _CONN_SHIFT)
        self._rx_ctrl = (_K_CTRL << _KIND_SHIFT) | (conn_id << _CONN_SHIFT)
        self._rx_data = (_K_DATA << _KIND_SHIFT) | (conn_id << _CONN_SHIFT)
        # receive side (guarded by _rx_lock)
        self._rx_lock = threading.Lock()
        self._held = None  # a probed message taken off UCX's queue, not yet received
        self._ctrl_buf = np.empty(_CTRL_MAX, dtype=np.uint8)
        self._rx_small = np.empty(_SMALL, dtype=np.uint8)
        self._rx_small_view = memoryview(self._rx_small)
        self._rx_cache = (None, None)  # (NumPy buffer, its receive target) of the last recv_into
        self._put_pending: collections.deque = collections.deque()  # (request, Notification|None, target)
        self._notes: collections.deque = collections.deque()
        self._regions: dict[int, Region] = {}
        self._next_region = itertools.count(1)
        self._revoked: set[int] = set()
        self._scratch = np.empty(1, dtype=np.uint8)
        self._bad_frames = 0
        # send side (guarded by _tx_lock)
        self._tx_lock = threading.Lock()
        self._stage = _Stage()
        self._tx_pending: collections.deque = collections.deque()  # (request, staged item, nbytes)
        self._tx_bytes = 0
        self._put_seq = 0
        # link state
        self._wired = False
        self._peer_closed = False  # the peer sent CLOSE: it will send nothing more
        self._broken: str | None = None  # why the link is unusable (peer died, UCX error...)
        self._next_check = time.monotonic() + _LIVENESS_INTERVAL_S
        self._linger_deadline = 0.0

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        return f"<UcxEndpoint {self.url} {state} hot_path={self._ops.name}>"

    # ----- link watching ---------------------------------------------------------------------
    def _check_link(self, now: float) -> None:
        """Has the bootstrap socket seen EOF (peer gone), or did UCX report an error?"""
        self._next_check = now + _LIVENESS_INTERVAL_S
        if self._broken is not None:
            return
        try:
            data = self._sock.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            data = None
        except OSError as e:
            self._fail(f"the bootstrap connection failed ({e})")
            return
        if data == b"":
            if not self._peer_closed:
                self._fail("the peer process exited or dropped the connection without closing")
        elif data:
            self._sock.recv(len(data))  # nothing is sent here after the handshake: count and drop
            self._bad_frames += 1
        if self._ucx_error and self._broken is None and not self._peer_closed:
            self._fail("UCX reported an endpoint error (peer failure)")

    def _fail(self, why: str) -> None:
        if self._broken is None:
            self._broken = why
            self._counters.errors += 1

    def _broken_error(self, what: str) -> BrokenLinkError:
        if self._broken is not None:
            return BrokenLinkError(f"ucx link {self.url} is broken: {self._broken}; {what}")
        return BrokenLinkError(f"ucx peer of {self.url} closed the connection; {what}")

    # ----- progress ----------------------------------------------------------------------------
    def _poll(self, want_msg: bool):
        """One progress round (caller holds _rx_lock): handles control frames; returns the next
        message as (handle, length, sender tag), held until received, or None."""
        ops = self._ops
        ops.progress()
        if self._tx_pending and self._tx_lock.acquire(blocking=False):
            try:
                self._reap_tx()
            finally:
                self._tx_lock.release()
        if self._put_pending:
            self._reap_puts()
        if self._box.lingering:
            self._box.reap_lingering()
        if want_msg:
            if self._held is not None:
                return self._held
            while True:
                m = ops.probe(self._rx_msg, _MASK_MSG_OR_CTRL)
                if m is None:
                    return None
                if m[2] >> _KIND_SHIFT == _K_CTRL:
                    self._take_ctrl(m)
                    continue
                self._held = m
                return m
        while True:
            m = ops.probe(self._rx_ctrl, _MASK_FULL)
            if m is None:
                return None
            self._take_ctrl(m)

    def _wait_request(self, req, deadline: float | None, what: str, timeout_s, *, keep=None) -> None:
        """Progress until ``req`` completes (a receive already under way or a zero-copy send);
        ``keep`` is the buffer UCX writes or reads, held alive until then."""
        ops = self._ops
        backoff = Backoff()
        while True:
            st = ops.status(req)
            if st != _IN_PROGRESS:
                break
            ops.progress()
            now = time.monotonic()
            if now >= self._next_check:
                self._check_link(now)
            if self._broken is not None or (deadline is not None and now >= deadline):
                timed_out = self._broken is None
                self._fail(f"a {what} was cut off by its timeout mid-transfer")
                self._abandon(req, keep)
                if timed_out:
                    raise self._timed_out(f"{what} (the transfer had started; the link is now closed)", timeout_s)
                raise self._broken_error(f"{what} could not finish")
            backoff.pause()
        ops.release(req)
        if st < 0:
            self._fail(f"UCX failed a {what}: {core.status_text(st)}")
            raise self._broken_error(f"{what} failed")

    def _abandon(self, req, keep) -> None:
        """Give up on a request: cancel it, close the UCX endpoint, keep its buffer until UCX lets go."""
        self._ops.cancel(req)
        self._abort_ep()
        if self._ops.status(req) == _IN_PROGRESS:
            self._box.linger(_Orphan(self._ops, req, keep))
        else:
            self._ops.release(req)

    def _abort_ep(self) -> None:
        """Close the UCX endpoint now (UCX cancels its sends, so it stops reading our buffers)."""
        if self._ep_closed:
            return
        self._ep_closed = True
        try:
            if not self._ep.alive:  # UCX closed it already (error callback); close() would return no request
                return
            self._ep.remove_close_callback()
            req = self._ep.close()
            t_end = time.monotonic() + 0.5
            while not req.completed and time.monotonic() < t_end:
                self._box.worker.progress()
        except Exception:
            pass

    # ----- two-sided: send -------------------------------------------------------------------
    def _reap_tx(self) -> None:
        ops, pend = self._ops, self._tx_pending
        while pend:
            req, item, n = pend[0]
            st = ops.status(req)
            if st == _IN_PROGRESS:
                return
            pend.popleft()
            ops.release(req)
            self._tx_bytes -= n
            self._stage.release(item)
            if st < 0:
                self._fail(f"UCX failed a send: {core.status_text(st)}")

    def _post(self, src, n: int, tag: int) -> None:
        """Stage ``src`` (n bytes) and post it; the caller holds _tx_lock and has made room."""
        stage = self._stage
        item, base = stage.small(src, n) if n <= _SMALL else stage.big(src, n)
        try:
            req = self._ops.send(base, n, tag)
        except core.UcxStatus as e:
            stage.release(item)
            self._fail(f"UCX refused a send: {e}")
            raise self._broken_error("the message was not sent") from None
        if not req:  # UCP completed it at once (eager): the usual case for small messages
            stage.release(item)
            return
        st = self._ops.status(req)
        if st == _IN_PROGRESS:
            self._tx_pending.append((req, item, n))
            self._tx_bytes += n
            return
        self._ops.release(req)
        stage.release(item)
        if st < 0:
            self._fail(f"UCX failed a send: {core.status_text(st)}")
            raise self._broken_error("the message was not sent")

    def _room(self, n: int, deadline: float | None, nowait: bool, what: str, timeout_s) -> None:
        """Wait until n more staged bytes fit the send budget (the caller holds _tx_lock)."""
        if self._tx_bytes + n <= self._send_budget or not self._tx_pending:
            return
        backoff = Backoff()
        while True:
            self._ops.progress()
            self._reap_tx()
            if self._tx_bytes + n <= self._send_budget or not self._tx_pending:
                return
            now = time.monotonic()
            if now >= self._next_check:
                self._check_link(now)
            if self._broken is not None:
                raise self._broken_error(f"{what} was not sent")
            if nowait:
                raise WouldBlock(
                    f"ucx send buffer is full ({self._tx_bytes} of send_buffer_nbytes={self._send_budget} bytes "
                    "still in flight); the receiver has not taken them yet"
                )
            if deadline is not None and now >= deadline:
                raise self._timed_out(f"{what} (send buffer full, nothing sent)", timeout_s)
            backoff.pause()

    def _zero_copy(self, src, n: int, tag: int, deadline, what: str, timeout_s) -> None:
        base = _flat_u8(memoryview(src))
        try:
            req = self._ops.send(base, n, tag, cache=False)
        except core.UcxStatus as e:
            self._fail(f"UCX refused a send: {e}")
            raise self._broken_error(f"the {what} was not sent") from None
        self._wait_request(req, deadline, what, timeout_s, keep=src)

    def _check_sendable(self, what: str) -> None:
        self._check_open()
        if self._broken is not None or self._peer_closed:
            raise self._broken_error(f"{what} was not sent")

    def send(self, data, *, timeout_s: float | None = None) -> None:
        """Send one message; returns once it is staged (or, zero-copy, once the peer took it)."""
        self._send(data, timeout_s, False)

    def send_nowait(self, data) -> None:
        """Send one message or raise WouldBlock (send buffer full) without sending any of it."""
        self._send(data, None, True)

    def _send(self, data, timeout_s, nowait: bool) -> None:
        deadline = None if timeout_s is None else deadline_of(timeout_s)
        if self._closed or self._broken is not None or self._peer_closed:
            self._check_sendable("the message")
        src = data if type(data) is bytes else as_byte_view(data)
        n = len(src)
        if n > CAPABILITIES.max_message_bytes:
            raise ValueError(f"message of {n} bytes exceeds max_message_bytes={CAPABILITIES.max_message_bytes}")
        with self._tx_lock:
            if self._zero_copy_min is not None and n >= self._zero_copy_min and not nowait:
                self._room(0, deadline, False, "the message", timeout_s)
                self._zero_copy(src, n, self._tx_msg, deadline, "zero-copy send", timeout_s)
            else:
                if self._tx_pending:
                    self._room(n, deadline, nowait, "the message", timeout_s)
                self._post(src, n, self._tx_msg)
        c = self._counters
        c.messages_sent += 1
        c.bytes_sent += n

    # ----- two-sided: receive ----------------------------------------------------------------
    def recv_into(self, buf, *, timeout_s: float | None = None) -> int:
        """Receive the next message into ``buf``; return its size in bytes."""
        if self._closed:
            self._check_open()
        deadline = None if timeout_s is None else deadline_of(timeout_s)
        target = self._rx_target(buf)
        with self._rx_lock:
            m = self._poll(True)
            if m is not None:
                req = self._start_recv(m, target)
        if m is None:
            m, req = self._wait_msg(target, deadline, timeout_s)
        return self._finish_recv(req, m[1], target, deadline, timeout_s)

    def recv_into_nowait(self, buf) -> int:
        """Receive the next message if one is ready, else raise WouldBlock."""
        self._check_open()
        target = self._rx_target(buf)
        for attempt in range(2):
            with self._rx_lock:
                m = self._poll(True)
                if m is not None:
                    return self._finish_recv(self._start_recv(m, target), m[1], target, None, None)
            if attempt == 0:
                now = time.monotonic()
                if now >= self._next_check:
                    self._check_link(now)
                if self._broken is None and not self._peer_closed:
                    raise WouldBlock("no ucx message has arrived yet")
        self._counters.errors += 1
        raise self._broken_error("no more messages will arrive")

    def _wait_msg(self, target, deadline: float | None, timeout_s):
        backoff = Backoff()
        while True:
            self._check_open()
            with self._rx_lock:
                m = self._poll(True)
                if m is not None:
                    return m, self._start_recv(m, target)
            if self._peer_closed or self._broken is not None:
                self._counters.errors += 1
                raise self._broken_error("no more messages will arrive")
            now = time.monotonic()
            if now >= self._next_check:
                self._check_link(now)
            if deadline is not None and now >= deadline:
                raise self._timed_out("recv_into", timeout_s)
            backoff.pause()

    def _rx_target(self, buf):
        """(capacity, flat uint8 NumPy view or None, memoryview or None) of a receive buffer."""
        cache = self._rx_cache
        if cache[0] is buf:
            return cache[1]
        if is_device_array(buf) and not hasattr(buf, "__array_interface__"):
            raise TypeError("the ucx transport receives into host memory only; pass a NumPy array or bytearray")
        view = as_byte_view(buf)
        if view.readonly:
            raise TypeError("recv_into needs a writable buffer (bytearray, NumPy array...), got a read-only one")
        if isinstance(buf, np.ndarray):  # NumPy buffers are usually reused: remember their flat view
            target = (len(view), _flat_u8(view), None)
            self._rx_cache = (buf, target)
            return target
        return len(view), None, view

    def _start_recv(self, m, target):
        """Post the receive of held message ``m`` (caller holds _rx_lock); BufferTooSmallError keeps it held."""
        n = m[1]
        cap, base, view = target
        if n > cap:
            raise BufferTooSmallError(
                f"next ucx message is {n} bytes but the buffer holds {cap}; the message stays queued, "
                f"call again with a buffer of at least {n} bytes",
                needed_nbytes=n,
            )
        self._held = None
        try:
            if base is not None:
                return self._ops.recv_msg(m, base, n)
            if n <= _SMALL:
                return self._ops.recv_msg(m, self._rx_small, n)
            return self._ops.recv_msg(m, _flat_u8(view), n, cache=False)
        except core.UcxStatus as e:
            self._fail(f"UCX failed a receive: {e}")
            raise self._broken_error("the message was lost") from None

    def _finish_recv(self, req, n: int, target, deadline, timeout_s) -> int:
        ops = self._ops
        st = ops.status(req)
        if st == _IN_PROGRESS:
            self._wait_request(req, deadline, "message receive", timeout_s, keep=target)
        else:
            ops.release(req)
            if st < 0:
                self._fail(f"UCX failed a receive: {core.status_text(st)}")
                raise self._broken_error("the message was lost")
        if target[1] is None and n and n <= _SMALL:
            target[2][:n] = self._rx_small_view[:n]
        c = self._counters
        c.messages_received += 1
        c.bytes_received += n
        return n

    # ----- control frames --------------------------------------------------------------------
    def _take_ctrl(self, m) -> None:
        """Receive a probed control frame and act on it (caller holds _rx_lock)."""
        length = m[1]
        ops = self._ops
        try:
            req = ops.recv_msg(m, self._ctrl_buf, min(length, _CTRL_MAX))
        except core.UcxStatus:
            st = -1
        else:
            t_end = time.monotonic() + 1.0
            st = ops.status(req)
            while st == _IN_PROGRESS and time.monotonic() < t_end:
                ops.progress()
                st = ops.status(req)
            if st == _IN_PROGRESS:
                ops.cancel(req)
            ops.release(req)
        if st != 0 or length < _CTRL.size or length > _CTRL_MAX:
            self._bad_frame()
            return
        op, rid, offset, nbytes, notify_id, seq, tag_len = _CTRL.unpack_from(self._ctrl_buf, 0)
        if op == _OP_CLOSE:
            self._peer_closed = True
        elif op == _OP_WIREUP:
            self._wired = True
        elif op == _OP_REVOKE:
            self._revoked.add(rid)
        elif op in (_OP_PUT_INLINE, _OP_PUT_HEADER):
            self._take_put(op, rid, offset, nbytes, notify_id, seq, tag_len, length)
        else:
            self._bad_frame()

    def _bad_frame(self) -> None:
        self._bad_frames += 1
        self._counters.errors += 1

    def _take_put(self, op, rid, offset, nbytes, notify_id, seq, tag_len, length) -> None:
        inline = nbytes if op == _OP_PUT_INLINE else 0
        region = self._regions.get(rid)
        if (tag_len > MAX_TAG_BYTES or _CTRL.size + tag_len + inline != length
                or region is None or offset + nbytes > region.nbytes):
            self._bad_frame()  # malformed, unknown/deregistered region or out of bounds: counted, dropped
            if op == _OP_PUT_HEADER:  # a 1-byte receive truncates (so consumes) the bytes that follow
                self._put_pending.append((self._ops.recv_tag(self._scratch, 1, self._rx_data | seq), None, None))
            return
        tag = bytes(self._ctrl_buf[_CTRL.size:_CTRL.size + tag_len])
        note = Notification(region_id=rid, offset=offset, nbytes=nbytes, notify_id=notify_id, tag=tag)
        if op == _OP_PUT_INLINE:
            if nbytes:
                start = _CTRL.size + tag_len
                region.view[offset:offset + nbytes] = self._ctrl_buf.data[start:start + nbytes]
            self._put_pending.append((None, note, None))
        else:
            target = _flat_u8(region.view)[offset:offset + nbytes]
            self._put_pending.append((self._ops.recv_tag(target, nbytes, self._rx_data | seq), note, target))
        self._reap_puts()

    def _reap_puts(self) -> None:
        ops, pend = self._ops, self._put_pending
        while pend:
            req, note, _ = pend[0]
            st = ops.status(req)
            if st == _IN_PROGRESS:
                return
            pend.popleft()
            ops.release(req)
            if note is None:
                continue
            if st < 0:
                self._bad_frame()
            else:
                self._notes.append(note)

    def _send_ctrl(self, op: int, *, rid: int = 0, offset: int = 0, nbytes: int = 0, notify_id: int = 0,
                   seq: int = 0, tag: bytes = b"", inline=None) -> None:
        size = _CTRL.size + len(tag) + (nbytes if inline is not None else 0)
        frame = bytearray(size)
        _CTRL.pack_into(frame, 0, op, rid, offset, nbytes, notify_id, seq, len(tag))
        frame[_CTRL.size:_CTRL.size + len(tag)] = tag
        if inline is not None and nbytes:
            frame[_CTRL.size + len(tag):] = inline
        self._post(frame, size, self._tx_ctrl)

    def _wireup(self, deadline: float | None) -> None:
        """Swap one control frame over UCX so the data path is up (and proven) before use."""
        with self._tx_lock:
            self._send_ctrl(_OP_WIREUP)
        backoff = Backoff(spin=2000)
        while not (self._wired and not self._tx_pending):
            with self._rx_lock:
                self._poll(False)
            now = time.monotonic()
            if now >= self._next_check:
                self._check_link(now)
            if self._broken is not None:
                raise self._broken_error("the UCX connection could not be set up")
            if deadline is not None and now >= deadline:
                raise QlinkTimeoutError(f"ucx: the UCX data path to {self.url} did not come up in time")
            backoff.pause()

    # ----- one-sided -------------------------------------------------------------------------
    def register(self, array) -> Region:
        """Register ``array`` (writable, C-contiguous host memory) as a put target."""
        self._check_open()
        if is_device_array(array) and not hasattr(array, "__array_interface__"):
            raise TypeError("the ucx transport registers host memory only (device_memory=False)")
        with self._rx_lock:
            rid = next(self._next_region)
            region = Region.of(array, region_id=rid, key=self._token)
            self._regions[rid] = region
        return region

    def deregister(self, region: Region) -> None:
        """Forget a region; the peer is told, and its later puts into it raise RegistrationError."""
        with self._rx_lock:
            known = self._regions.pop(region.region_id, None)
        if known is not None and not self._closed and self._broken is None and not self._peer_closed:
            with self._tx_lock:
                self._send_ctrl(_OP_REVOKE, rid=region.region_id)

    def put(self, data, remote: RemoteRegion, *, offset: int = 0, notify_id: int = 0, tag: bytes = b"",
            timeout_s: float | None = None) -> None:
        """Write ``data`` into the peer's region at ``offset``; the peer gets a Notification."""
        deadline = deadline_of(timeout_s)
        self._check_sendable("the put")
        if not isinstance(remote, RemoteRegion):
            remote = RemoteRegion.from_bytes(remote)
        tag = bytes(tag)
        if len(tag) > MAX_TAG_BYTES:
            raise ValueError(f"put tag is {len(tag)} bytes; at most MAX_TAG_BYTES={MAX_TAG_BYTES}")
        if not 0 <= notify_id < 1 << 64:
            raise ValueError(f"notify_id must fit in 64 unsigned bits, got {notify_id}")
        src = data if type(data) is bytes else as_byte_view(data)
        n = len(src)
        if offset < 0 or offset + n > remote.nbytes:
            raise RegistrationError(
                f"put of {n} bytes at offset {offset} falls outside region {remote.region_id} of {remote.nbytes} bytes"
            )
        if remote.key != self._peer_token:
            raise RegistrationError(
                f"region descriptor {remote.region_id} was not issued by this endpoint's peer; "
                "register on the peer and pass its descriptor"
            )
        if self._rx_lock.acquire(blocking=False):  # learn of revoked regions before writing
            try:
                self._poll(False)
            finally:
                self._rx_lock.release()
        if remote.region_id in self._revoked:
            raise RegistrationError(f"region {remote.region_id} was deregistered by the peer; the put was not done")
        with self._tx_lock:
            if n <= _INLINE_PUT_MAX:
                if self._tx_pending:
                    self._room(n, deadline, False, "the put", timeout_s)
                self._send_ctrl(_OP_PUT_INLINE, rid=remote.region_id, offset=offset, nbytes=n,
                                notify_id=notify_id, tag=tag, inline=src)
            else:
                zero_copy = self._zero_copy_min is not None and n >= self._zero_copy_min
                self._room(0 if zero_copy else n, deadline, False, "the put", timeout_s)
                self._put_seq = (self._put_seq + 1) & 0xFFFFFFFF
                seq = self._put_seq
                self._send_ctrl(_OP_PUT_HEADER, rid=remote.region_id, offset=offset, nbytes=n,
                                notify_id=notify_id, seq=seq, tag=tag)
                if zero_copy:
                    self._zero_copy(src, n, self._tx_data | seq, deadline, "zero-copy put", timeout_s)
                else:
                    self._post(src, n, self._tx_data | seq)
        self._counters.puts += 1
        self._counters.put_bytes += n

    def wait_notification(self, *, timeout_s: float | None = None) -> Notification:
        """Wait for the next put completion targeted at this side (progressing puts meanwhile)."""
        self._check_open()
        deadline = deadline_of(timeout_s)
        backoff = Backoff()
        while True:
            note = self._next_note()
            if note is not None:
                return note
            now = time.monotonic()
            if now >= self._next_check:
                self._check_link(now)
            if (self._peer_closed or self._broken is not None) and not self._put_pending:
                note = self._next_note()
                if note is not None:
                    return note
                self._counters.errors += 1
                raise self._broken_error("no more put notifications will arrive")
            if deadline is not None and now >= deadline:
                raise self._timed_out("wait_notification", timeout_s)
            backoff.pause()
            self._check_open()

    def poll_notification_nowait(self) -> Notification:
        """The next put completion if one has arrived, else raise WouldBlock."""
        self._check_open()
        note = self._next_note()
        if note is not None:
            return note
        now = time.monotonic()
        if now >= self._next_check:
            self._check_link(now)
        if (self._peer_closed or self._broken is not None) and not self._put_pending:
            self._counters.errors += 1
            raise self._broken_error("no more put notifications will arrive")
        raise WouldBlock("no ucx put notification has arrived yet")

    def _next_note(self):
        with self._rx_lock:
            if not self._notes:
                self._poll(False)
            if self._notes:
                self._counters.notifications += 1
                return self._notes.popleft()
        return None

    # ----- lifecycle ---------------------------------------------------------------------------
    def statistics(self) -> Statistics:
        s = super().statistics()
        s.extra.update(
            ucx_tls=self._box.tls,
            ucx_lanes=None if self._ep_closed else core.ep_lanes(self._ep.handle),
            hot_path=self._ops.name,
            peer_error_handling=self._peer_error_handling,
            bad_frames=self._bad_frames,
            staged_bytes_in_flight=self._tx_bytes,
            ucx_error_reported=self._ucx_error,
            broken=self._broken,
        )
        return s

    def close(self) -> None:
        """Close this side. The peer receives what was sent, then gets BrokenLinkError.

        Staged messages the peer has not taken yet keep their memory (and the UCX endpoint)
        alive in the background for up to 30 s, progressed by this process's later calls.
        """
        if self._closed:
            return
        self._closed = True
        with self._tx_lock:
            if self._broken is None and not self._ep_closed:
                try:
                    self._send_ctrl(_OP_CLOSE)
                except BrokenLinkError:
                    pass
            t_end = time.monotonic() + self._linger_s
            while self._tx_pending and self._broken is None and time.monotonic() < t_end:
                self._ops.progress()
                self._reap_tx()
        if self._tx_pending and self._broken is None:
            self._linger_deadline = time.monotonic() + _LINGER_MAX_S
            self._box.linger(self)
        else:
            self._finish_linger(0.0, force=True)

    def _finish_linger(self, now: float, *, force: bool) -> bool:
        """Release the UCX endpoint once staged sends are done (or forced). True when released."""
        if self._tx_lock.acquire(blocking=False):
            try:
                self._reap_tx()
            finally:
                self._tx_lock.release()
        if self._tx_pending and not force and now < self._linger_deadline and self._broken is None:
            return False
        self._abort_ep()
        with self._rx_lock:
            ops = self._ops
            if self._held is not None:  # a message taken off the queue but never received: drain it
                try:
                    ops.release(ops.recv_msg(self._held, self._scratch, 1))
                except core.UcxStatus:
                    pass
                self._held = None
            for req, _, _ in self._put_pending:
                ops.cancel(req)
            for req, _, target in self._put_pending:
                if ops.status(req) == _IN_PROGRESS:
                    self._box.linger(_Orphan(ops, req, target))
                else:
                    ops.release(req)
            self._put_pending.clear()
            self._regions.clear()
            self._notes.clear()
        for req, item, _ in self._tx_pending:
            ops.release(req)  # UCP frees an unfinished send request when it completes (closed ep: canceled)
        self._tx_pending.clear()
        try:
            self._sock.close()
        except OSError:
            pass
        return True


class _Orphan:
    """A request UCX still owns after its endpoint gave up on it: keeps its buffer alive until done."""

    def __init__(self, ops, req, keep) -> None:
        self._ops, self._req, self._keep = ops, req, keep
        self._deadline = time.monotonic() + _LINGER_MAX_S

    def _finish_linger(self, now: float, *, force: bool) -> bool:
        if self._ops.status(self._req) == _IN_PROGRESS and not force and now < self._deadline:
            return False
        if self._ops.status(self._req) != _IN_PROGRESS:
            self._ops.release(self._req)
        return True  # still in progress when forced: leaked on purpose rather than freed under UCX


def _on_ucx_error(ref) -> None:
    ep = ref()
    if ep is not None:
        ep._ucx_error = True
        ep._next_check = 0.0  # look at the link on the next wait


# ----- listener and connect ----------------------------------------------------------------
_DEFAULTS = dict(peer_error_handling=False, send_buffer_nbytes=256 << 20, zero_copy_send_nbytes=None,
                 linger_s=1.0, handshake_timeout_s=5.0, hot_path="ucp")


def _options(opts: dict, where: str) -> dict:
    unknown = sorted(set(opts) - set(_DEFAULTS))
    if unknown:
        raise TypeError(f"{where} got unknown options {unknown}; known: {sorted(_DEFAULTS)}")
    out = {**_DEFAULTS, **opts}
    if out["send_buffer_nbytes"] <= 0:
        raise ValueError(f"send_buffer_nbytes must be positive, got {out['send_buffer_nbytes']}")
    z = out["zero_copy_send_nbytes"]
    if z is not None and z <= _SMALL:
        raise ValueError(f"zero_copy_send_nbytes must be None or above {_SMALL}, got {z}")
    if out["hot_path"] not in core.HOT_PATHS:
        raise ValueError(f"hot_path must be one of {sorted(core.HOT_PATHS)}, got {out['hot_path']!r}")
    return out


def _endpoint(url, sock, box, opts, deadline, *, server: bool) -> UcxEndpoint:
    """Handshake on a connected bootstrap socket, then build the endpoint and bring UCX up."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn_id, token = box.next_conn_id(), os.urandom(8)
    flags = boot.FLAG_PEER_ERRORS if opts["peer_error_handling"] else 0
    peer_conn, flags, peer_token, peer_addr = boot.handshake(
        sock, conn_id=conn_id, token=token, flags=flags, address=box.address, deadline=deadline, server=server)
    ep = UcxEndpoint(url=url, sock=sock, box=box, conn_id=conn_id, token=token, peer_conn_id=peer_conn,
                     peer_token=peer_token, peer_address=peer_addr, opts=opts, flags=flags)
    try:
        ep._wireup(deadline)
    except BaseException:
        ep._closed = True
        ep._finish_linger(0.0, force=True)
        raise
    return ep


class UcxListener(Listener):
    """Accepts ``ucx://host:port`` connections (bootstrap over TCP, data over UCX).

    A small daemon thread answers handshakes as clients arrive (like a kernel accept
    backlog), so ``connect`` completes even before ``accept`` is called.
    """

    def __init__(self, host: str, port: int, opts: dict) -> None:
        self._opts = opts
        self.rejected = 0  # connections that failed the handshake (counted, never fatal)
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(sockaddr)
        except OSError as e:
            self._sock.close()
            raise OSError(e.errno, f"ucx: cannot listen on {host}:{port} ({e.strerror}); "
                                   "pick a free port (0 picks one) on an address of this machine") from None
        self._sock.listen(64)
        self._sock.setblocking(False)
        self.url = boot.url_of(host, self._sock.getsockname()[1])
        self._box = core.worker_for(boot.scope_of(host))
        self._closed = False
        self._cond = threading.Condition()
        self._backlog: collections.deque[UcxEndpoint] = collections.deque()
        self._thread = threading.Thread(target=self._serve, name=f"qlink-ucx-accept {self.url}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<UcxListener {self.url} {'closed' if self._closed else 'listening'}>"

    def _serve(self) -> None:
        while not self._closed:
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.05)
                if not ready:
                    continue
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, ValueError):
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            try:
                conn.setblocking(True)
                ep = _endpoint(self.url, conn, self._box, self._opts,
                               time.monotonic() + self._opts["handshake_timeout_s"], server=True)
            except (WireError, BrokenLinkError, QlinkTimeoutError, OSError):
                self.rejected += 1  # a bad or vanished client never takes the listener down
                conn.close()
                continue
            with self._cond:
                if self._closed:
                    ep.close()
                    return
                self._backlog.append(ep)
                self._cond.notify_all()

    def accept(self, *, timeout_s: float | None = None) -> UcxEndpoint:
        """Wait for the next peer and return its connected endpoint."""
        deadline = deadline_of(timeout_s)
        with self._cond:
            while True:
                if self._closed:
                    raise ClosedError(f"ucx listener {self.url} was closed by this side")
                if self._backlog:
                    return self._backlog.popleft()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise QlinkTimeoutError(f"ucx: no connection to {self.url} within timeout_s={timeout_s}")
                self._cond.wait(left)

    def close(self) -> None:
        """Stop listening and release the port; connections not yet accepted are closed. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending = list(self._backlog)
            self._backlog.clear()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._opts["handshake_timeout_s"] + 1.0)
        self._sock.close()
        for ep in pending:
            ep.close()


def listen(url: str, **options) -> UcxListener:
    """Listen on ``ucx://host:port`` (host defaults to 127.0.0.1; port 0 picks a free port).

    Options: ``peer_error_handling`` (UCX error mode *peer*; default False, see the module
    notes), ``send_buffer_nbytes`` (staged bytes in flight before send blocks, 256 MiB),
    ``zero_copy_send_nbytes`` (send messages this big from the caller's buffer; None),
    ``linger_s`` (how long close waits for staged sends, 1 s), ``handshake_timeout_s`` (5 s),
    ``hot_path`` (``"ucp"``: UCP calls on UCXX's handles, default; ``"ucxx"``: UCXX's API).
    """
    host, port = boot.split_url(url, for_listen=True)
    return UcxListener(host, port, _options(options, "ucx.listen"))


def connect(url: str, *, timeout_s: float | None = 10.0, **options) -> UcxEndpoint:
    """Connect to a listener at ``ucx://host:port``; BrokenLinkError if nobody listens there.

    Takes the same options as :func:`listen`.
    """
    host, port = boot.split_url(url, for_listen=False)
    opts = _options(options, "ucx.connect")
    deadline = deadline_of(timeout_s)
    box = core.worker_for(boot.scope_of(host))
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.gaierror as e:
        raise BrokenLinkError(f"ucx: cannot resolve host {host!r} in {url!r} ({e})") from e
    except socket.timeout:
        raise QlinkTimeoutError(f"ucx: connecting to {url} did not complete within timeout_s={timeout_s}") from None
    except OSError as e:
        raise BrokenLinkError(f"ucx: nobody listens on {url} ({e.strerror or e})") from e
    try:
        return _endpoint(boot.url_of(host, port), sock, box, opts, deadline, server=False)
    except WireError as e:
        sock.close()
        raise BrokenLinkError(f"ucx: {url} did not answer as a qlink ucx listener: {e}") from e
    except (QlinkTimeoutError, BrokenLinkError):
        sock.close()
        raise
    except OSError as e:
        sock.close()
        raise BrokenLinkError(f"ucx: the connection to {url} failed during the handshake ({e})") from e
    except BaseException:
        sock.close()
        raise
