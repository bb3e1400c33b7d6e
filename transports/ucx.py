"""``ucx://host:port``: messages and one-sided put over UCX, through UCXX's core API.

The endpoint drives a UCX worker from the caller's thread (``progress`` + tag probes in a
bounded busy-poll, then backoff): no event loop and no progress thread sit on the path.

How a connection is made and watched
    ``listen`` binds a small TCP *bootstrap* socket (``127.0.0.1`` unless another address is
    given; port 0 picks a free port, ``Listener.url`` names it). ``connect`` opens it, both
    sides swap a hello (magic, version, connection id, token, UCX worker address) and each
    creates a UCX endpoint to the other's worker address. The bootstrap socket then stays
    open as a liveness wire: a peer that exits or is killed closes it, and every wait checks
    it at least every ``liveness_interval_s`` (20 ms), so a dead peer surfaces as
    :class:`~qlink.errors.BrokenLinkError` well within a second. (UCXX's own listener binds
    every interface, which is why the bootstrap socket is ours.)

Transports
    ``UCX_TLS`` from the environment wins; otherwise the contexts made here use
    ``tcp,sm,self`` (:data:`DEFAULT_UCX_TLS`). For a loopback address the TCP transport is
    also kept on the loopback device (``NET_DEVICES=lo``) unless ``UCX_NET_DEVICES`` is set.
    By default endpoints use UCX's error-handling mode *none*, which lets UCX pick shared
    memory (sysv/posix eager, CMA rendezvous) between processes on one host; failures are
    caught by the bootstrap socket. ``peer_error_handling=True`` asks UCX for mode *peer*
    (UCX then detects failures itself and calls our endpoint error callback), which on UCX
    1.21 rules out the shared-memory transports and runs over TCP.

Wire (all tags carry the receiver's 24-bit connection id, so one worker per process
serves every endpoint)
    tag = kind << 56 | connection id << 32 | sequence. Kind 0x10: a message (its length is
    the UCX message length, found by ``tag_probe`` before receiving, so a buffer that is too
    small raises :class:`BufferTooSmallError` and the message stays queued). Kind 0x11:
    a control frame (40-byte header + put tag + inline put bytes): put-inline, put-header,
    region revoked, close. Kind 0x20: the bytes of a large put, received by the target
    straight into its registered region.

One-sided put
    UCXX 0.52's Python API exposes no memory registration or remote keys, so put is done in
    software: small puts travel inline in a control frame and are copied into the region;
    larger ones send a header, then the bytes, which the target receives directly into the
    region during its progress (``zero_copy_put=False``: the target must be calling into its
    endpoint). The notification is queued only when the bytes are in place.

Sends are staged: the caller's bytes are copied into endpoint-owned memory before UCX sees
them, so ``send`` returns while a large message waits for the receiver (like a socket
buffer; ``send_buffer_nbytes`` bounds it, then ``send`` blocks and ``send_nowait`` raises
WouldBlock). ``zero_copy_send_nbytes=N`` sends messages of at least N bytes from the
caller's buffer instead, and ``send`` then waits until the receiver has taken them.

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
import ipaddress
import itertools
import os
import select
import socket
import struct
import threading
import time
import weakref
from urllib.parse import urlsplit

import numpy as np

from qlink.errors import (
    BrokenLinkError,
    ClosedError,
    QlinkTimeoutError,
    RegistrationError,
    WireError,
    WouldBlock,
    missing,
)
from qlink.memory import Region, RemoteRegion, as_byte_view, is_device_array

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

__all__ = ["CAPABILITIES", "DEFAULT_UCX_TLS", "listen", "connect", "UcxEndpoint", "UcxListener", "ucx_config"]

CAPABILITIES = Capabilities(
    name="ucx",
    one_sided=True,
    zero_copy_put=False,  # software put: the target receives the bytes during its progress
    device_memory=False,  # host buffers only (UCXX could carry CuPy arrays; not wired up here)
    cross_process=True,
    cross_host=True,
)

DEFAULT_UCX_TLS = "tcp,sm,self"
"""UCX transports used when ``UCX_TLS`` is not set in the environment."""

# UCXX's import sets UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows and warns about.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

_MAGIC = b"QLUX"
_VERSION = 1
_HELLO = struct.Struct("<4sHHI8sI")  # magic, version, flags, connection id, token, address length
_FLAG_PEER_ERRORS = 1
_MAX_ADDRESS = 1 << 16

_K_MSG, _K_CTRL, _K_DATA = 0x10, 0x11, 0x20
_KIND_SHIFT, _CONN_SHIFT = 56, 32
_CONN_MASK = 0xFFFFFF
_MASK_MSG_OR_CTRL = (0xFE << _KIND_SHIFT) | (_CONN_MASK << _CONN_SHIFT) | 0xFFFFFFFF
_MASK_FULL = (1 << 64) - 1

_CTRL = struct.Struct("<B3xIQQQIH2x")  # op, region id, offset, nbytes, notify id, put seq, tag length
_OP_PUT_INLINE, _OP_PUT_HEADER, _OP_REVOKE, _OP_CLOSE, _OP_WIREUP = 1, 2, 3, 4, 5
_INLINE_PUT_MAX = 4096
_CTRL_MAX = _CTRL.size + MAX_TAG_BYTES + _INLINE_PUT_MAX

_SMALL = 8192  # messages up to this size are staged in fixed slots with cached UCXX arrays
_LIVENESS_INTERVAL_S = 0.02
_LINGER_MAX_S = 30.0


# ----- UCXX, imported lazily -------------------------------------------------------------
_ucx_mod = None


def _ucxx():
    """(libucxx, Array) from UCXX, imported on first use with a helpful error if absent."""
    global _ucx_mod
    if _ucx_mod is None:
        try:
            import ucxx._lib.libucxx as lib
            from ucxx._lib.arr import Array
        except ImportError as e:
            raise missing("ucxx-cu12", extra="ucx", feature="the ucx:// transport") from e
        _ucx_mod = (lib, Array)
    return _ucx_mod


def ucx_config(*, loopback: bool) -> dict[str, str]:
    """UCX options the contexts made here add to the environment's (the environment wins).

    >>> import os
    >>> cfg = ucx_config(loopback=True)
    >>> cfg.get("TLS", os.environ.get("UCX_TLS")) is not None
    True
    """
    cfg = {}
    if "UCX_TLS" not in os.environ:
        cfg["TLS"] = DEFAULT_UCX_TLS
    if loopback and "UCX_NET_DEVICES" not in os.environ:
        cfg["NET_DEVICES"] = "lo"
    return cfg


class _Worker:
    """One UCX context + worker per process and scope ('lo' or 'any'), shared by endpoints."""

    def __init__(self, scope: str) -> None:
        lib, _ = _ucxx()
        self.scope = scope
        self.pid = os.getpid()
        self.config = ucx_config(loopback=scope == "lo")
        self.context = lib.UCXContext(self.config, feature_flags=(lib.Feature.TAG,))
        self.worker = lib.UCXWorker(self.context)
        self.address = self.worker.address.tobytes()
        self.tls = self.context.config.get("TLS", "?")
        self._conn_ids = itertools.count(1)
        self.lingering: list = []  # closed endpoints whose staged sends are still in flight
        self.lock = threading.Lock()

    def next_conn_id(self) -> int:
        while True:
            cid = next(self._conn_ids) & _CONN_MASK
            if cid:
                return cid

    def reap_lingering(self, *, force: bool = False) -> None:
        now = time.monotonic()
        keep = []
        for ep in self.lingering:
            if not ep._finish_linger(now, force=force):
                keep.append(ep)
        self.lingering = keep


_workers: dict[str, _Worker] = {}
_workers_lock = threading.Lock()


def _worker_for(scope: str) -> _Worker:
    with _workers_lock:
        w = _workers.get(scope)
        if w is None or w.pid != os.getpid():
            w = _workers[scope] = _Worker(scope)
        return w


@atexit.register
def _close_lingering() -> None:
    for w in list(_workers.values()):
        if w.pid == os.getpid():
            w.reap_lingering(force=True)


# ----- URLs and the bootstrap handshake ----------------------------------------------------
def _split(url: str, *, for_listen: bool) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "ucx":
        raise ValueError(f"ucx transport needs a URL like 'ucx://127.0.0.1:0', got {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"ucx URL {url!r} has a port that is not a number in 0..65535") from None
    host = parts.hostname or ("127.0.0.1" if for_listen else "")
    if not host:
        raise ValueError(f"ucx URL {url!r} needs a host, e.g. 'ucx://127.0.0.1:5555'")
    if port is None:
        raise ValueError(f"ucx URL {url!r} needs a port, e.g. 'ucx://{host}:0' (0 picks a free one when listening)")
    if port == 0 and not for_listen:
        raise ValueError(f"cannot connect to port 0 in {url!r}; use the port from the listener's url")
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"ucx URL {url!r} takes only host and port, no path or query")
    return host, port


def _scope_of(host: str) -> str:
    if host == "localhost":
        return "lo"
    try:
        return "lo" if ipaddress.ip_address(host).is_loopback else "any"
    except ValueError:
        return "any"


def _url_of(host: str, port: int) -> str:
    return f"ucx://[{host}]:{port}" if ":" in host else f"ucx://{host}:{port}"


def _recv_exact(sock: socket.socket, n: int, deadline: float | None, what: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise QlinkTimeoutError(f"ucx: {what} did not arrive in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(out))
        except socket.timeout:
            raise QlinkTimeoutError(f"ucx: {what} did not arrive in time") from None
        if not chunk:
            raise BrokenLinkError(f"ucx: the peer closed the bootstrap connection during the {what}")
        out += chunk
    return bytes(out)


def _handshake(sock: socket.socket, *, conn_id: int, token: bytes, flags: int, address: bytes,
               deadline: float | None, server_flags: int | None = None) -> tuple[int, int, bytes, bytes]:
    """Swap hellos. Returns (peer conn id, effective flags, peer token, peer worker address)."""
    def hello(fl: int) -> bytes:
        return _HELLO.pack(_MAGIC, _VERSION, fl, conn_id, token, len(address)) + address

    if server_flags is None:  # client speaks first
        sock.sendall(hello(flags))
    head = _recv_exact(sock, _HELLO.size, deadline, "handshake")
    magic, version, peer_flags, peer_conn, peer_token, addr_len = _HELLO.unpack(head)
    if magic != _MAGIC:
        raise WireError(f"ucx: the peer is not a qlink ucx endpoint (hello magic {magic!r}, expected {_MAGIC!r})")
    if version != _VERSION:
        raise WireError(f"ucx: the peer speaks handshake version {version}, this side speaks {_VERSION}")
    if not 0 < addr_len <= _MAX_ADDRESS or not 0 < peer_conn <= _CONN_MASK:
        raise WireError(f"ucx: bad hello (worker address of {addr_len} bytes, connection id {peer_conn})")
    peer_addr = _recv_exact(sock, addr_len, deadline, "handshake")
    if server_flags is not None:  # server answers with the flags both sides will use
        flags = (peer_flags | server_flags) & _FLAG_PEER_ERRORS
        sock.sendall(hello(flags))
    else:
        flags = peer_flags & _FLAG_PEER_ERRORS
    return peer_conn, flags, peer_token, peer_addr


# ----- the endpoint ------------------------------------------------------------------------
class _Stage:
    """Endpoint-owned send memory: fixed small slots with cached UCXX arrays, pooled large buffers."""

    __slots__ = ("slots", "free", "arrays", "large")

    def __init__(self) -> None:
        self.slots: list[np.ndarray] = []
        self.free: list[int] = []
        self.arrays: dict[int, object] = {}
        self.large: dict[int, list[np.ndarray]] = {}

    def small(self, src, n: int):
        """Copy ``src`` into a free slot; returns (slot index, UCXX array of exactly n bytes)."""
        if self.free:
            i = self.free.pop()
        else:
            i = len(self.slots)
            self.slots.append(np.empty(_SMALL, dtype=np.uint8))
        slot = self.slots[i]
        if n:
            slot.data[:n] = src
        key = i * (_SMALL + 1) + n
        arr = self.arrays.get(key)
        if arr is None:
            if len(self.arrays) > 4096:
                self.arrays.clear()
            arr = self.arrays[key] = _ucxx()[1](slot[:n])
        return i, arr

    def big(self, src, n: int):
        cls = 1 << (n - 1).bit_length()
        pool = self.large.get(cls)
        buf = pool.pop() if pool else np.empty(cls, dtype=np.uint8)
        buf.data[:n] = src
        return buf, _ucxx()[1](buf[:n])

    def release(self, item) -> None:
        if isinstance(item, int):
            self.free.append(item)
        elif isinstance(item, np.ndarray):
            pool = self.large.setdefault(len(item), [])
            if len(pool) < 2 and len(item) <= 1 << 26:
                pool.append(item)


class UcxEndpoint(Endpoint):
    """One side of a ``ucx://`` connection (made by :func:`connect` or ``UcxListener.accept``)."""

    capabilities = CAPABILITIES

    def __init__(self, *, url: str, sock: socket.socket, box: _Worker, conn_id: int, token: bytes,
                 peer_conn_id: int, peer_token: bytes, peer_address: bytes, peer_error_handling: bool,
                 send_buffer_nbytes: int, zero_copy_send_nbytes: int | None, linger_s: float) -> None:
        super().__init__()
        lib, Array = _ucxx()
        self.url = url
        sock.setblocking(False)  # from here on only peeked at for EOF
        self._sock = sock
        self._box = box
        self._worker = box.worker
        self._token = token
        self._peer_token = peer_token
        self._peer_error_handling = peer_error_handling
        self._send_budget = int(send_buffer_nbytes)
        self._zero_copy_min = zero_copy_send_nbytes
        self._linger_s = float(linger_s)
        try:
            self._ep = self._worker.create_endpoint_from_worker_address(
                lib.UCXAddress.create_from_buffer(peer_address), peer_error_handling)
        except Exception as e:  # UCXUnreachableError and friends
            raise BrokenLinkError(f"ucx: cannot reach the peer's UCX worker ({e}); check UCX_TLS on both sides") from e
        me = weakref.ref(self)
        try:
            self._ep.set_close_callback(_on_ucx_error, cb_args=(me,))
        except Exception:  # pragma: no cover - older UCXX
            pass
        tag = lib.UCXXTag
        self._tx_msg = tag((_K_MSG << _KIND_SHIFT) | (peer_conn_id << _CONN_SHIFT))
        self._tx_ctrl = tag((_K_CTRL << _KIND_SHIFT) | (peer_conn_id << _CONN_SHIFT))
        self._tx_data_base = (_K_DATA << _KIND_SHIFT) | (peer_conn_id << _CONN_SHIFT)
        self._rx_msg = tag((_K_MSG << _KIND_SHIFT) | (conn_id << _CONN_SHIFT))
        self._rx_ctrl = tag((_K_CTRL << _KIND_SHIFT) | (conn_id << _CONN_SHIFT))
        self._rx_data_base = (_K_DATA << _KIND_SHIFT) | (conn_id << _CONN_SHIFT)
        self._mask_any = lib.UCXXTagMask(_MASK_MSG_OR_CTRL)
        self._mask_full = lib.UCXXTagMask(_MASK_FULL)
        self._ctrl_kind_value = _K_CTRL
        self._tag_cls, self._Array = tag, Array
        # receive side
        self._rx_lock = threading.Lock()
        self._ctrl_buf = np.empty(_CTRL_MAX, dtype=np.uint8)
        self._ctrl_arr = Array(self._ctrl_buf)
        self._rx_small = np.empty(_SMALL, dtype=np.uint8)
        self._rx_small_arr = Array(self._rx_small)
        self._rx_cache = (None, 0, None)  # (numpy buffer, nbytes, UCXX array) of the last recv buffer
        self._put_pending: collections.deque = collections.deque()  # (request or None, Notification, target ref)
        self._notes: collections.deque = collections.deque()
        self._regions: dict[int, Region] = {}
        self._next_region = itertools.count(1)
        self._revoked: set[int] = set()
        self._put_seq = 0
        self._scratch = np.empty(1, dtype=np.uint8)
        self._bad_frames = 0
        # send side
        self._tx_lock = threading.RLock()
        self._stage = _Stage()
        self._tx_pending: collections.deque = collections.deque()  # (request, staged item, nbytes)
        self._tx_bytes = 0
        # link state
        self._peer_closed = False  # the peer sent CLOSE: it will send nothing more
        self._broken: str | None = None  # why the link is unusable (peer died, UCX error...)
        self._ucx_error = False
        self._next_check = time.monotonic() + _LIVENESS_INTERVAL_S
        self._linger_deadline = 0.0
        self._wired = False
        self._ep_closed = False

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

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        return f"<UcxEndpoint {self.url} {state}>"

    # ----- link watching ---------------------------------------------------------------------
    def _check_link(self, now: float) -> None:
        """Every liveness_interval: has the bootstrap socket seen EOF (peer gone)?"""
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
        """One progress round. Handles control frames; returns a probe of the next message or None."""
        w = self._worker
        w.progress_once()
        if self._tx_pending and self._tx_lock.acquire(blocking=False):
            try:
                self._reap_tx()
            finally:
                self._tx_lock.release()
        if self._put_pending:
            self._reap_puts()
        if self._box.lingering:
            self._box.reap_lingering()
        tag = self._rx_msg if want_msg else self._rx_ctrl
        mask = self._mask_any if want_msg else self._mask_full
        while True:
            p = w.tag_probe(tag, mask, remove=False)
            if not p.matched:
                return None
            if want_msg and (p.sender_tag.value >> _KIND_SHIFT) != _K_CTRL:
                return p
            self._take_ctrl(p.length)

    def _wait_request(self, req, deadline: float | None, what: str, timeout_s) -> None:
        """Progress until ``req`` completes (a receive already under way or a zero-copy send)."""
        w = self._worker
        backoff = Backoff()
        while not req.completed:
            w.progress_once()
            now = time.monotonic()
            if now >= self._next_check:
                self._check_link(now)
                if self._broken is not None:
                    self._abort_ep()
                    raise self._broken_error(f"{what} could not finish")
            if deadline is not None and now >= deadline:
                self._fail(f"a {what} was cut off by its timeout mid-transfer")
                self._abort_ep()
                raise self._timed_out(f"{what} (the transfer had started; the link is now closed)", timeout_s)
            backoff.pause()
        try:
            req.check_error()
        except Exception as e:
            self._fail(f"UCX failed a {what}: {e}")
            raise self._broken_error(f"{what} failed") from e

    def _abort_ep(self) -> None:
        """Close the UCX endpoint now (cancels its requests, so UCX stops touching our buffers)."""
        if self._ep_closed:
            return
        self._ep_closed = True
        try:
            if not self._ep.alive:  # UCX closed it already (error callback); close() would return no request
                return
            req = self._ep.close()
            t_end = time.monotonic() + 0.5
            while not req.completed and time.monotonic() < t_end:
                self._worker.progress()
        except Exception:
            pass

    # ----- two-sided: send -------------------------------------------------------------------
    def _reap_tx(self) -> None:
        pend = self._tx_pending
        while pend and pend[0][0].completed:
            req, item, n = pend.popleft()
            self._tx_bytes -= n
            self._stage.release(item)
            try:
                req.check_error()
            except Exception as e:
                self._fail(f"UCX failed a send: {e}")

    def _post(self, src, n: int, tag) -> None:
        """Stage ``src`` (n bytes) and post it; the caller holds _tx_lock and has made room."""
        if n <= _SMALL:
            item, arr = self._stage.small(src, n)
        else:
            item, arr = self._stage.big(src, n)
        req = self._ep.tag_send(arr, tag)
        if req.completed:
            self._stage.release(item)
            try:
                req.check_error()
            except Exception as e:
                self._fail(f"UCX failed a send: {e}")
                raise self._broken_error("the message was not sent") from e
        else:
            self._tx_pending.append((req, item, n))
            self._tx_bytes += n

    def _room(self, n: int, deadline: float | None, nowait: bool, what: str, timeout_s) -> None:
        """Wait until n more staged bytes fit the send budget (the caller holds _tx_lock)."""
        if self._tx_bytes + n <= self._send_budget or not self._tx_pending:
            return
        backoff = Backoff()
        while True:
            self._worker.progress_once()
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

    def _check_sendable(self, what: str) -> None:
        self._check_open()
        if self._broken is not None or self._peer_closed:
            raise self._broken_error(f"{what} was not sent")

    def send(self, data, *, timeout_s: float | None = None) -> None:
        """Send one message; returns once it is staged (or, zero-copy, once the peer took it)."""
        self._send(data, timeout_s, nowait=False)

    def send_nowait(self, data) -> None:
        """Send one message or raise WouldBlock (send buffer full) without sending any of it."""
        self._send(data, None, nowait=True)

    def _send(self, data, timeout_s, *, nowait: bool) -> None:
        deadline = deadline_of(timeout_s)
        self._check_sendable("the message")
        src = data if isinstance(data, bytes) else as_byte_view(data)
        n = len(src)
        if n > CAPABILITIES.max_message_bytes:
            raise ValueError(f"message of {n} bytes exceeds max_message_bytes={CAPABILITIES.max_message_bytes}")
        with self._tx_lock:
            if self._zero_copy_min is not None and n >= self._zero_copy_min and not nowait:
                req = self._ep.tag_send(self._Array(src), self._tx_msg)
                self._wait_request(req, deadline, "zero-copy send", timeout_s)
            else:
                self._room(n, deadline, nowait, "the message", timeout_s)
                self._post(src, n, self._tx_msg)
        self._counters.messages_sent += 1
        self._counters.bytes_sent += n

    # ----- two-sided: receive ----------------------------------------------------------------
    def recv_into(self, buf, *, timeout_s: float | None = None) -> int:
        """Receive the next message into ``buf``; return its size in bytes."""
        self._check_open()
        deadline = deadline_of(timeout_s)
        with self._rx_lock:
            p = self._poll(True)
        if p is None:
            p = self._wait_msg(deadline, timeout_s)
        return self._take_msg(p, buf, deadline, timeout_s)

    def recv_into_nowait(self, buf) -> int:
        """Receive the next message if one is ready, else raise WouldBlock."""
        self._check_open()
        with self._rx_lock:
            p = self._poll(True)
        if p is None:
            now = time.monotonic()
            if now >= self._next_check:
                self._check_link(now)
            if self._broken is not None or self._peer_closed:
                with self._rx_lock:
                    p = self._poll(True)
                if p is None:
                    self._counters.errors += 1
                    raise self._broken_error("no more messages will arrive")
            else:
                raise WouldBlock("no ucx message has arrived yet")
        return self._take_msg(p, buf, None, None)

    def _wait_msg(self, deadline: float | None, timeout_s):
        backoff = Backoff()
        while True:
            self._check_open()
            with self._rx_lock:
                p = self._poll(True)
            if p is not None:
                return p
            if self._peer_closed or self._broken is not None:
                self._counters.errors += 1
                raise self._broken_error("no more messages will arrive")
            now = time.monotonic()
            if now >= self._next_check:
                self._check_link(now)
            if deadline is not None and now >= deadline:
                raise self._timed_out("recv_into", timeout_s)
            backoff.pause()

    def _take_msg(self, p, buf, deadline, timeout_s) -> int:
        n = p.length
        cached, cap, arr = self._rx_cache
        if cached is not buf:
            if is_device_array(buf) and not hasattr(buf, "__array_interface__"):
                raise TypeError("ucx endpoint receives into host memory only; pass a NumPy array or bytearray")
            view = as_byte_view(buf)
            if view.readonly:
                raise ValueError("recv_into needs a writable buffer")
            cap = len(view)
            arr = None
            if isinstance(buf, np.ndarray):  # NumPy buffers are usually reused: keep their UCXX array
                arr = self._Array(view)
                self._rx_cache = (buf, cap, arr)
        if n > cap:
            raise BufferTooSmallError(
                f"next ucx message is {n} bytes but the buffer holds {cap}; the message stays queued, "
                f"call again with a buffer of at least {n} bytes",
                needed_nbytes=n,
            )
        with self._rx_lock:
            if arr is not None:
                req = self._ep.tag_recv(arr, self._rx_msg)
            elif n <= _SMALL:
                req = self._ep.tag_recv(self._rx_small_arr, self._rx_msg)
            else:
                req = self._ep.tag_recv(self._Array(view), self._rx_msg)
        if not req.completed:
            self._wait_request(req, deadline, "message receive", timeout_s)
        else:
            try:
                req.check_error()
            except Exception as e:
                self._fail(f"UCX failed a receive: {e}")
                raise self._broken_error("the message was lost") from e
        if arr is None and n <= _SMALL and n:
            view[:n] = self._rx_small.data[:n]
        self._counters.messages_received += 1
        self._counters.bytes_received += n
        return n

    # ----- control frames --------------------------------------------------------------------
    def _take_ctrl(self, length: int) -> None:
        """Receive the control frame at the head of the queue and act on it (caller holds _rx_lock)."""
        req = self._ep.tag_recv(self._ctrl_arr, self._rx_ctrl)
        w = self._worker
        t_end = time.monotonic() + 1.0
        while not req.completed and time.monotonic() < t_end:
            w.progress_once()
        try:
            req.check_error()
        except Exception:
            self._bad_frames += 1  # too long (truncated) or failed: counted and dropped
            self._counters.errors += 1
            return
        if length < _CTRL.size:
            self._bad_frames += 1
            return
        op, rid, offset, nbytes, notify_id, seq, tag_len = _CTRL.unpack_from(self._ctrl_buf, 0)
        if op == _OP_CLOSE:
            self._peer_closed = True
        elif op == _OP_WIREUP:
            self._wired = True
        elif op == _OP_REVOKE:
            self._revoked.add(rid)
        elif op in (_OP_PUT_INLINE, _OP_PUT_HEADER):
            inline = nbytes if op == _OP_PUT_INLINE else 0
            if tag_len > MAX_TAG_BYTES or _CTRL.size + tag_len + inline != length:
                self._bad_frames += 1
                self._counters.errors += 1
                if op == _OP_PUT_HEADER:
                    self._discard_data(seq)
                return
            tag = bytes(self._ctrl_buf[_CTRL.size:_CTRL.size + tag_len])
            region = self._regions.get(rid)
            if region is None or offset + nbytes > region.nbytes:
                self._bad_frames += 1  # unknown/deregistered region or out of bounds: counted, dropped
                self._counters.errors += 1
                if op == _OP_PUT_HEADER:
                    self._discard_data(seq)
                return
            note = Notification(region_id=rid, offset=offset, nbytes=nbytes, notify_id=notify_id, tag=tag)
            if op == _OP_PUT_INLINE:
                if nbytes:
                    start = _CTRL.size + tag_len
                    region.view[offset:offset + nbytes] = self._ctrl_buf.data[start:start + nbytes]
                self._put_pending.append((None, note, None))
            else:
                target = self._Array(region.view[offset:offset + nbytes])
                req = self._ep.tag_recv(target, self._tag_cls(self._rx_data_base | seq))
                self._put_pending.append((req, note, target))
            self._reap_puts()
        else:
            self._bad_frames += 1
            self._counters.errors += 1

    def _discard_data(self, seq: int) -> None:
        # a 1-byte receive truncates (and so consumes) the put bytes that follow a rejected header
        req = self._ep.tag_recv(self._Array(self._scratch), self._tag_cls(self._rx_data_base | seq))
        self._put_pending.append((req, None, None))

    def _reap_puts(self) -> None:
        pend = self._put_pending
        while pend and (pend[0][0] is None or pend[0][0].completed):
            req, note, _ = pend.popleft()
            if req is not None:
                try:
                    req.check_error()
                except Exception:
                    if note is not None:
                        self._bad_frames += 1
                        self._counters.errors += 1
                    continue
            if note is not None:
                self._notes.append(note)

    def _send_ctrl(self, op: int, *, rid: int = 0, offset: int = 0, nbytes: int = 0, notify_id: int = 0,
                   seq: int = 0, tag: bytes = b"", inline=None) -> None:
        frame = bytearray(_CTRL.size + len(tag) + (nbytes if inline is not None else 0))
        _CTRL.pack_into(frame, 0, op, rid, offset, nbytes, notify_id, seq, len(tag))
        frame[_CTRL.size:_CTRL.size + len(tag)] = tag
        if inline is not None and nbytes:
            frame[_CTRL.size + len(tag):] = inline
        self._post(frame, len(frame), self._tx_ctrl)

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
        src = data if isinstance(data, bytes) else as_byte_view(data)
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
                self._room(n, deadline, False, "the put", timeout_s)
                self._send_ctrl(_OP_PUT_INLINE, rid=remote.region_id, offset=offset, nbytes=n,
                                notify_id=notify_id, tag=tag, inline=src)
            else:
                self._room(n, deadline, False, "the put", timeout_s)
                self._put_seq = (self._put_seq + 1) & 0xFFFFFFFF
                seq = self._put_seq
                self._send_ctrl(_OP_PUT_HEADER, rid=remote.region_id, offset=offset, nbytes=n,
                                notify_id=notify_id, seq=seq, tag=tag)
                data_tag = self._tag_cls(self._tx_data_base | seq)
                if self._zero_copy_min is not None and n >= self._zero_copy_min:
                    req = self._ep.tag_send(self._Array(src), data_tag)
                    self._wait_request(req, deadline, "zero-copy put", timeout_s)
                else:
                    self._post(src, n, data_tag)
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
            if self._broken is None:
                try:
                    self._send_ctrl(_OP_CLOSE)
                except QlinkTimeoutError:
                    pass
                except BrokenLinkError:
                    pass
            t_end = time.monotonic() + self._linger_s
            while self._tx_pending and self._broken is None and time.monotonic() < t_end:
                self._worker.progress_once()
                self._reap_tx()
        with self._rx_lock:
            self._regions.clear()
            self._notes.clear()
        if self._tx_pending and self._broken is None:
            self._linger_deadline = time.monotonic() + _LINGER_MAX_S
            self._box.lingering.append(self)
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
        try:
            self._ep.remove_close_callback()
        except Exception:
            pass
        self._abort_ep()
        self._tx_pending.clear()
        try:
            self._sock.close()
        except OSError:
            pass
        return True


def _on_ucx_error(ref) -> None:
    ep = ref()
    if ep is not None:
        ep._ucx_error = True
        ep._next_check = 0.0  # look at the link on the next wait


# ----- listener and connect ----------------------------------------------------------------
_OPTIONS = ("peer_error_handling", "send_buffer_nbytes", "zero_copy_send_nbytes", "linger_s", "handshake_timeout_s")


def _options(opts: dict, where: str) -> dict:
    unknown = sorted(set(opts) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"{where} got unknown options {unknown}; known: {list(_OPTIONS)}")
    out = dict(peer_error_handling=False, send_buffer_nbytes=256 << 20, zero_copy_send_nbytes=None,
               linger_s=1.0, handshake_timeout_s=5.0)
    out.update(opts)
    if out["send_buffer_nbytes"] <= 0:
        raise ValueError(f"send_buffer_nbytes must be positive, got {out['send_buffer_nbytes']}")
    z = out["zero_copy_send_nbytes"]
    if z is not None and z <= _SMALL:
        raise ValueError(f"zero_copy_send_nbytes must be None or above {_SMALL}, got {z}")
    return out


class UcxListener(Listener):
    """Accepts ``ucx://host:port`` connections (bootstrap over TCP, data over UCX).

    A small daemon thread answers handshakes as clients arrive (like a kernel accept
    backlog), so ``connect`` completes even before ``accept`` is called.
    """

    def __init__(self, host: str, port: int, opts: dict) -> None:
        self._opts = opts
        self.rejected = 0  # connections that failed the handshake (counted, never fatal)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
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
        self.url = _url_of(host, self._sock.getsockname()[1])
        self._box = _worker_for(_scope_of(host))
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
                ep = self._admit(conn, time.monotonic() + self._opts["handshake_timeout_s"])
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

    def _admit(self, conn: socket.socket, deadline: float) -> UcxEndpoint:
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        box = self._box
        conn_id, token = box.next_conn_id(), os.urandom(8)
        flags = _FLAG_PEER_ERRORS if self._opts["peer_error_handling"] else 0
        peer_conn, flags, peer_token, peer_addr = _handshake(
            conn, conn_id=conn_id, token=token, flags=flags, address=box.address, deadline=deadline,
            server_flags=flags)
        return _make_endpoint(self.url, conn, box, conn_id, token, peer_conn, peer_token, peer_addr, flags,
                              self._opts, deadline)

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


def _make_endpoint(url, sock, box, conn_id, token, peer_conn, peer_token, peer_addr, flags, opts,
                   deadline) -> UcxEndpoint:
    ep = UcxEndpoint(
        url=url, sock=sock, box=box, conn_id=conn_id, token=token, peer_conn_id=peer_conn,
        peer_token=peer_token, peer_address=peer_addr, peer_error_handling=bool(flags & _FLAG_PEER_ERRORS),
        send_buffer_nbytes=opts["send_buffer_nbytes"], zero_copy_send_nbytes=opts["zero_copy_send_nbytes"],
        linger_s=opts["linger_s"],
    )
    try:
        ep._wireup(deadline)
    except BaseException:
        ep._closed = True
        ep._finish_linger(0.0, force=True)
        raise
    return ep


def listen(url: str, **options) -> UcxListener:
    """Listen on ``ucx://host:port`` (host defaults to 127.0.0.1; port 0 picks a free port).

    Options: ``peer_error_handling`` (UCX error mode *peer*; default False, see the module
    notes), ``send_buffer_nbytes`` (staged bytes in flight before send blocks, 256 MiB),
    ``zero_copy_send_nbytes`` (send messages this big from the caller's buffer; None),
    ``linger_s`` (how long close waits for staged sends, 1 s), ``handshake_timeout_s`` (5 s).
    """
    host, port = _split(url, for_listen=True)
    return UcxListener(host, port, _options(options, "ucx.listen"))


def connect(url: str, *, timeout_s: float | None = 10.0, **options) -> UcxEndpoint:
    """Connect to a listener at ``ucx://host:port``; BrokenLinkError if nobody listens there."""
    host, port = _split(url, for_listen=False)
    opts = _options(options, "ucx.connect")
    deadline = deadline_of(timeout_s)
    box = _worker_for(_scope_of(host))
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.gaierror as e:
        raise BrokenLinkError(f"ucx: cannot resolve host {host!r} in {url!r} ({e})") from e
    except socket.timeout:
        raise QlinkTimeoutError(f"ucx: connecting to {url} did not complete within timeout_s={timeout_s}") from None
    except OSError as e:
        raise BrokenLinkError(f"ucx: nobody listens on {url} ({e.strerror or e})") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn_id, token = box.next_conn_id(), os.urandom(8)
        flags = _FLAG_PEER_ERRORS if opts["peer_error_handling"] else 0
        try:
            peer_conn, flags, peer_token, peer_addr = _handshake(
                sock, conn_id=conn_id, token=token, flags=flags, address=box.address, deadline=deadline)
        except WireError as e:
            raise BrokenLinkError(f"ucx: {url} did not answer as a qlink ucx listener: {e}") from e
        except QlinkTimeoutError:
            raise
        except OSError as e:
            raise BrokenLinkError(f"ucx: the connection to {url} failed during the handshake ({e})") from e
        return _make_endpoint(_url_of(host, port), sock, box, conn_id, token, peer_conn, peer_token, peer_addr,
                              flags, opts, deadline)
    except BaseException:
        sock.close()
        raise
