"""``inproc://name``: two endpoints in one process, handing messages over by reference.

The reference transport: no sockets, no shared memory, just two queues and a
condition variable per direction. It serves tests, notebooks and loops that keep
the controller and the decoder in one process (one thread each).

* ``send`` keeps a reference to an immutable ``bytes`` message and copies anything
  mutable (the caller may reuse its buffer as soon as ``send`` returns);
  ``recv_into`` copies the message into the receiver's buffer once.
* ``put`` copies straight into the target's registered array (one memcpy, done by
  the initiator, no work on the target side) and then queues the notification, so
  a notification is never seen before its bytes. ``put_many`` copies every piece the
  same way (NumPy, one call for all pieces where it can: see :mod:`transports._pieces`)
  and queues ONE notification after the last (``put_many_gathers``).
* A sender thread and a receiver thread may use one endpoint at the same time.

>>> import numpy as np
>>> from transports import inproc
>>> with inproc.listen("inproc://doc-inproc") as lis:
...     a = inproc.connect(lis.url)
...     b = lis.accept(timeout_s=1)
...     target = np.zeros(8, dtype=np.uint8)
...     region = b.register(target)
...     a.put(b"\\x01\\x02", region.descriptor(), offset=3, notify_id=9)
...     note = b.wait_notification(timeout_s=1)
...     (note.offset, note.nbytes, note.notify_id), target.tolist()
((3, 2, 9), [0, 0, 0, 1, 2, 0, 0, 0])
>>> a.close(); b.close()
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from collections import deque
from urllib.parse import urlsplit

import numpy as np

from qlink.errors import BrokenLinkError, RegistrationError, WouldBlock
from qlink.memory import Region, RemoteRegion, as_byte_view

from ._accept import AcceptQueue
from ._pieces import check_pieces, copy_pieces, span
from ._base import Capabilities, Endpoint, Listener, Notification, check_put_target, deadline_of

__all__ = ["CAPABILITIES", "listen", "connect", "InprocEndpoint", "InprocListener"]

CAPABILITIES = Capabilities(
    name="inproc",
    one_sided=True,
    zero_copy_put=True,
    device_memory=False,
    cross_process=False,
    cross_host=False,
)

_registry_lock = threading.Lock()
_listeners: dict[str, "InprocListener"] = {}
_tokens = itertools.count(1)


def _name_of(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "inproc":
        raise ValueError(f"inproc transport needs a URL like 'inproc://name', got {url!r}")
    name = (parts.netloc + parts.path).strip("/")
    if not name:
        raise ValueError(f"inproc URL needs a name after 'inproc://', got {url!r}")
    return name


class _Direction:
    """One direction of a connection: a message queue, a notification queue, one condition."""

    __slots__ = ("cond", "messages", "notes", "closed_by_sender")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.messages: deque = deque()
        self.notes: deque = deque()
        self.closed_by_sender = False


class InprocEndpoint(Endpoint):
    """One side of an ``inproc://`` connection (made by :func:`connect` / ``accept``)."""

    capabilities = CAPABILITIES

    def __init__(self, *, url: str, incoming: _Direction, outgoing: _Direction) -> None:
        super().__init__()
        self.url = url
        self._in = incoming
        self._out = outgoing
        self._peer: InprocEndpoint | None = None
        self._token = next(_tokens).to_bytes(8, "little") + os.getpid().to_bytes(4, "little")
        self._regions: dict[int, Region] = {}
        self._regions_lock = threading.Lock()
        self._next_region = itertools.count(1)

    def __repr__(self) -> str:
        return f"<InprocEndpoint {self.url} {'closed' if self._closed else 'open'}>"

    # ----- two-sided -----------------------------------------------------------
    @staticmethod
    def _snapshot(data):
        if isinstance(data, bytes):
            return data  # immutable: keep the reference, copy once on the receiving side
        return bytes(as_byte_view(data))  # the caller may reuse a mutable buffer after send returns

    def send(self, data, *, timeout_s: float | None = None) -> None:
        """Queue one message for the peer (never blocks: the queue is unbounded)."""
        deadline_of(timeout_s)
        self.send_nowait(data)

    def send_nowait(self, data) -> None:
        self._check_open()
        msg = self._snapshot(data)
        if len(msg) > self.capabilities.max_message_bytes:
            raise ValueError(f"message of {len(msg)} bytes exceeds max_message_bytes={self.capabilities.max_message_bytes}")
        d = self._out
        with d.cond:
            if self._peer is None or self._peer._closed:
                self._counters.errors += 1
                raise BrokenLinkError(f"inproc peer of {self.url} has closed its endpoint; nothing more can be sent")
            d.messages.append(msg)
            d.cond.notify_all()
        self._counters.messages_sent += 1
        self._counters.bytes_sent += len(msg)

    def _wait(self, queue_name: str, what: str, timeout_s: float | None):
        """The non-empty incoming ``messages`` or ``notes`` queue, waiting up to timeout_s.

        The caller holds ``self._in.cond``."""
        deadline = deadline_of(timeout_s)
        d = self._in
        while True:
            self._check_open()
            q = getattr(d, queue_name)
            if q:
                return q
            if d.closed_by_sender:
                self._counters.errors += 1
                raise BrokenLinkError(f"inproc peer closed the connection; no more {what} results will arrive")
            if deadline is None:
                d.cond.wait()
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timed_out(what, timeout_s)
                d.cond.wait(left)

    def recv_into(self, buf, *, timeout_s: float | None = None) -> int:
        """Receive the next message into ``buf`` (copied once); return its size in bytes."""
        self._check_open()
        _check_writable(buf)
        d = self._in
        with d.cond:
            q = self._wait("messages", "recv_into", timeout_s)
            return self._deliver_queued(q, as_byte_view(buf))

    def recv_into_nowait(self, buf) -> int:
        self._check_open()
        _check_writable(buf)
        d = self._in
        with d.cond:
            if d.messages:
                return self._deliver_queued(d.messages, as_byte_view(buf))
            if d.closed_by_sender:
                self._counters.errors += 1
                raise BrokenLinkError("inproc peer closed the connection; no more messages will arrive")
            raise WouldBlock("no inproc message is queued yet")

    # ----- one-sided -----------------------------------------------------------
    def register(self, array) -> Region:
        """Register ``array`` (any writable, C-contiguous host buffer) as a put target."""
        self._check_open()
        with self._regions_lock:
            rid = next(self._next_region)
            region = Region.of(array, region_id=rid, key=self._token)
            if region.kind != "host":
                raise TypeError("inproc registers host memory only; device arrays need a device-capable transport")
            self._regions[rid] = region
        return region

    def deregister(self, region: Region) -> None:
        with self._regions_lock:
            self._regions.pop(region.region_id, None)

    def _check_put(self, remote, notify_id: int, tag) -> tuple[RemoteRegion, bytes]:
        """Checks shared by put and put_many (nothing written yet)."""
        self._check_open()
        remote, tag, _ = check_put_target(remote, notify_id=notify_id, tag=tag)
        return remote, tag

    def _write_peer(self, remote: RemoteRegion, lo: int, hi: int, write) -> None:
        """Call ``write(region view)`` under the peer's region lock once ``[lo, hi)`` of the
        peer's region is known to be valid."""
        peer = self._peer
        if peer is None or peer._closed:
            self._counters.errors += 1
            raise BrokenLinkError(f"inproc peer of {self.url} has closed its endpoint; the put was not done")
        if remote.key != peer._token:
            raise RegistrationError(
                f"region descriptor {remote.region_id} was not issued by this endpoint's peer; "
                "register on the peer and pass its descriptor"
            )
        with peer._regions_lock:
            region = peer._regions.get(remote.region_id)
            if region is None:
                raise RegistrationError(f"region {remote.region_id} is not registered at the peer (deregistered?)")
            if hi > region.nbytes:
                raise RegistrationError(
                    f"put of {hi - lo} bytes at offset {lo} falls outside region {remote.region_id} of "
                    f"{region.nbytes} bytes")
            write(region.view)

    def _notify(self, remote: RemoteRegion, offset: int, nbytes: int, notify_id: int, tag: bytes) -> None:
        d = self._out
        with d.cond:
            d.notes.append(Notification(region_id=remote.region_id, offset=offset, nbytes=nbytes, notify_id=notify_id,
                                        tag=tag))
            d.cond.notify_all()

    def put(self, data, remote: RemoteRegion, *, offset: int = 0, notify_id: int = 0, tag: bytes = b"",
            timeout_s: float | None = None) -> None:
        """Copy ``data`` into the peer's registered region, then queue its Notification."""
        deadline_of(timeout_s)
        remote, tag = self._check_put(remote, notify_id, tag)
        src = as_byte_view(data)
        n = len(src)
        if offset < 0 or offset + n > remote.nbytes:
            raise RegistrationError(
                f"put of {n} bytes at offset {offset} falls outside region {remote.region_id} of {remote.nbytes} bytes"
            )

        def write(view) -> None:
            if n:
                view[offset:offset + n] = src

        self._write_peer(remote, offset, offset + n, write)
        self._notify(remote, offset, n, notify_id, tag)
        self._counters.puts += 1
        self._counters.put_bytes += n

    put_many_gathers = True  # one Notification per put_many, after every piece

    def put_many(self, data, remote: RemoteRegion, src_offsets, dst_offsets, nbytes, *, notify_id: int = 0,
                 tag: bytes = b"", timeout_s: float | None = None, defer: bool = False) -> int:
        """Copy pieces of ``data`` into the peer's region, then queue ONE Notification whose
        ``offset``/``nbytes`` span every piece; return 1 (see :meth:`transports.Endpoint.put_many`).

        Every piece is checked before any is written; the copies are NumPy calls (one for
        all pieces where they share a row size, see :mod:`transports._pieces`). ``defer``
        changes nothing here: the copy is done when the call returns.
        """
        deadline_of(timeout_s)
        remote, tag = self._check_put(remote, notify_id, tag)
        src = as_byte_view(data)
        so, do, ln = check_pieces(src_offsets, dst_offsets, nbytes, src_nbytes=len(src), region_nbytes=remote.nbytes,
                                  region_id=remote.region_id)
        lo, hi = span(do, ln)
        src_u8 = np.frombuffer(src, dtype=np.uint8)

        def write(view) -> None:
            copy_pieces(np.frombuffer(view, dtype=np.uint8), src_u8, so, do, ln)

        self._write_peer(remote, lo, hi, write)
        self._notify(remote, lo, hi - lo, notify_id, tag)
        self._counters.puts += int(ln.size)
        self._counters.put_bytes += int(ln.sum())
        return 1

    def _pop_note(self, q) -> Notification:
        note = q.popleft()
        self._counters.notifications += 1
        return note

    def wait_notification(self, *, timeout_s: float | None = None) -> Notification:
        self._check_open()
        d = self._in
        with d.cond:
            return self._pop_note(self._wait("notes", "wait_notification", timeout_s))

    def poll_notification_nowait(self) -> Notification:
        self._check_open()
        d = self._in
        with d.cond:
            if d.notes:
                return self._pop_note(d.notes)
            if d.closed_by_sender:
                self._counters.errors += 1
                raise BrokenLinkError("inproc peer closed the connection; no more notifications will arrive")
            raise WouldBlock("no inproc put notification is queued yet")

    # ----- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        """Close this side. The peer drains what was sent, then gets BrokenLinkError."""
        if self._closed:
            return
        self._closed = True
        with self._out.cond:
            self._out.closed_by_sender = True
            self._out.cond.notify_all()  # the peer drains what is queued, then sees a broken link
        with self._in.cond:
            self._in.cond.notify_all()  # our own waiters wake up and raise ClosedError
        with self._regions_lock:
            self._regions.clear()

    def _orphan(self) -> None:
        """The listener went away before accepting us: the client side sees a broken link."""
        self.close()


def _check_writable(buf) -> None:
    if as_byte_view(buf).readonly:
        raise TypeError("recv_into needs a writable buffer (bytearray, numpy array...), got a read-only one")


class InprocListener(Listener):
    """Accepts ``inproc://name`` connections made by :func:`connect` in this process."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.url = f"inproc://{name}"
        self._queue = AcceptQueue(self.url)

    @property
    def _closed(self) -> bool:
        return self._queue.closed

    def __repr__(self) -> str:
        return f"<InprocListener {self.url} {'closed' if self._closed else 'listening'}>"

    def _offer(self, server_side: InprocEndpoint) -> bool:
        return self._queue.offer(server_side)

    def accept(self, *, timeout_s: float | None = None) -> InprocEndpoint:
        return self._queue.take(timeout_s=timeout_s)

    def close(self) -> None:
        pending = self._queue.close()
        if pending is None:
            return
        with _registry_lock:
            if _listeners.get(self.name) is self:
                del _listeners[self.name]
        for ep in pending:
            ep._orphan()


def listen(url: str, **options) -> InprocListener:
    """Listen on ``inproc://name``; the name must not be listening already in this process."""
    if options:
        raise TypeError(f"inproc.listen takes no options, got {sorted(options)}")
    name = _name_of(url)
    with _registry_lock:
        if name in _listeners:
            raise OSError(errno.EADDRINUSE,
                          f"inproc://{name} is already listening in this process; close that listener or pick another name")
        lis = InprocListener(name)
        _listeners[name] = lis
    return lis


def connect(url: str, *, timeout_s: float | None = 10.0, **options) -> InprocEndpoint:
    """Connect to the listener on ``inproc://name``; BrokenLinkError if nobody listens there."""
    if options:
        raise TypeError(f"inproc.connect takes no options, got {sorted(options)}")
    deadline_of(timeout_s)
    name = _name_of(url)
    with _registry_lock:
        lis = _listeners.get(name)
    if lis is None:
        raise BrokenLinkError(f"nobody listens on inproc://{name} in this process (inproc does not cross processes)")
    a_to_b, b_to_a = _Direction(), _Direction()
    client = InprocEndpoint(url=f"inproc://{name}", incoming=b_to_a, outgoing=a_to_b)
    server = InprocEndpoint(url=f"inproc://{name}", incoming=a_to_b, outgoing=b_to_a)
    client._peer, server._peer = server, client
    if not lis._offer(server):
        raise BrokenLinkError(f"inproc listener {lis.url} closed while connecting")
    return client
