"""The contract every transport implements: Listener, Endpoint, Capabilities, Statistics.

A transport module registers itself by URL scheme (see ``transports/__init__.py``) and
provides ``listen(url, **opts) -> Listener`` and ``connect(url, *, timeout_s, **opts) -> Endpoint``.

Endpoint semantics (identical across transports; the conformance suite checks them):

* **Two-sided**: ``send(data)`` delivers one message (any size from 0 bytes up to
  ``capabilities.max_message_bytes``) and ``recv_into(buf)`` receives the next one,
  in order, returning its size. A receive into a buffer that is too small raises
  :class:`BufferTooSmallError` and leaves the message queued (nothing is lost).
* **One-sided**: the target ``register(array)``\\ s a region and sends
  ``region.descriptor().to_bytes()`` to the initiator, which calls
  ``put(data, remote, offset=..., notify_id=..., tag=...)``. When the bytes have landed,
  the target sees a :class:`Notification` from ``wait_notification()``; the notification
  is never delivered before every byte of its put is in place.
  ``put_many(data, remote, src_offsets, dst_offsets, nbytes, ...)`` writes many pieces of
  one source buffer in one call. Where the endpoint gathers them (``put_many_gathers``)
  the target sees ONE Notification, never before the last byte of the last piece, whose
  ``offset``/``nbytes`` cover every piece; elsewhere (the default: one ``put`` per piece)
  it sees one Notification per piece, each never before its own bytes. The call returns
  how many Notifications it will cause.
* **Waiting**: every blocking call takes ``timeout_s`` (``None`` waits without limit but
  still watches the peer) and raises :class:`~qlink.errors.QlinkTimeoutError`; each has a
  ``*_nowait`` twin that raises :class:`~qlink.errors.WouldBlock`.
* **Failure**: a dead peer raises :class:`~qlink.errors.BrokenLinkError` within 1 s;
  using an endpoint after ``close()`` raises :class:`~qlink.errors.ClosedError`.
"""

from __future__ import annotations

import abc
import operator
import time
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from qlink.errors import ClosedError, QlinkError, QlinkTimeoutError, WouldBlock
from qlink.memory import Region, RemoteRegion

from ._waiting import Backoff, deadline_of  # (re-exported: every transport imports them from here)

__all__ = [
    "Capabilities",
    "Statistics",
    "Notification",
    "Endpoint",
    "Listener",
    "BufferTooSmallError",
    "MAX_TAG_BYTES",
    "Backoff",
]

MAX_TAG_BYTES = 256


def check_tag(tag) -> bytes:
    """A put's tag as bytes; ValueError past :data:`MAX_TAG_BYTES`."""
    if not tag:
        return b""
    tag = bytes(tag)
    if len(tag) > MAX_TAG_BYTES:
        raise ValueError(f"put tag is {len(tag)} bytes; at most MAX_TAG_BYTES={MAX_TAG_BYTES}")
    return tag


def check_notify_id(notify_id) -> int:
    """A put's notify_id as an int; ValueError unless it fits in 64 unsigned bits."""
    if type(notify_id) is not int:
        notify_id = operator.index(notify_id)
    if not 0 <= notify_id < 1 << 64:
        raise ValueError(f"notify_id must fit in 64 unsigned bits, got {notify_id}")
    return notify_id


def check_put_target(remote, *, notify_id, tag) -> tuple[RemoteRegion, bytes, int]:
    """The checks every put makes before anything is written: the target as a
    :class:`~qlink.memory.RemoteRegion` (its descriptor bytes are accepted), the tag, the notify_id."""
    if not isinstance(remote, RemoteRegion):
        remote = RemoteRegion.from_bytes(remote)
    return remote, check_tag(tag), check_notify_id(notify_id)


class BufferTooSmallError(QlinkError, ValueError):
    """``recv_into`` was given a buffer smaller than the next message; the message stays queued."""

    def __init__(self, message: str, *, needed_nbytes: int):
        super().__init__(message)
        self.needed_nbytes = needed_nbytes


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do; scenarios refuse a transport that cannot serve them."""

    name: str
    two_sided: bool = True
    one_sided: bool = False  # put into a registered remote region with a notification
    zero_copy_put: bool = False  # the put lands without a copy by the target
    device_memory: bool = False
    cross_process: bool = True
    cross_host: bool = False
    reliable: bool = True  # no loss (UDP is not)
    ordered: bool = True
    max_message_bytes: int = 1 << 30


@dataclass(frozen=True)
class Notification:
    """Completion of a one-sided put, as seen by the target. For a gathered ``put_many``,
    ``offset``/``nbytes`` span every piece (the lowest offset to the end of the highest)."""

    region_id: int
    offset: int
    nbytes: int
    notify_id: int = 0
    tag: bytes = b""


@dataclass
class _Counters:
    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    puts: int = 0
    put_bytes: int = 0
    notifications: int = 0
    timeouts: int = 0
    errors: int = 0


@dataclass(frozen=True)
class Statistics:
    """A frozen snapshot of an endpoint's counters (``endpoint.statistics()``)."""

    transport: str
    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    puts: int = 0
    put_bytes: int = 0
    notifications: int = 0
    timeouts: int = 0
    errors: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # read-only, so a snapshot cannot be changed after it was taken
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))


class Endpoint(abc.ABC):
    """One side of a connection. Subclasses implement the ``_``-prefixed hooks;
    the blocking wrappers, counters and checks live here once."""

    capabilities: Capabilities

    def __init__(self) -> None:
        self._closed = False
        self._counters = _Counters()

    # ----- two-sided -----------------------------------------------------------
    @abc.abstractmethod
    def send(self, data, *, timeout_s: float | None = None) -> None:
        """Send one message (a buffer-protocol object). Blocks while the transport is full."""

    @abc.abstractmethod
    def send_nowait(self, data) -> None:
        """Send one message or raise WouldBlock (e.g. a full ring) without sending any of it."""

    @abc.abstractmethod
    def recv_into(self, buf, *, timeout_s: float | None = None) -> int:
        """Receive the next message into ``buf``; return its size in bytes."""

    @abc.abstractmethod
    def recv_into_nowait(self, buf) -> int:
        """Receive the next message if one is ready, else raise WouldBlock."""

    def recv(self, *, timeout_s: float | None = None, max_nbytes: int | None = None) -> bytes:
        """Receive the next message as ``bytes`` (allocates; for convenience, not the hot path)."""
        cap = max_nbytes if max_nbytes is not None else 1 << 16
        while True:
            buf = bytearray(cap)
            try:
                n = self.recv_into(buf, timeout_s=timeout_s)
            except BufferTooSmallError as e:
                if max_nbytes is not None:
                    raise
                cap = e.needed_nbytes
                continue
            return bytes(buf[:n])

    # ----- one-sided -----------------------------------------------------------
    def register(self, array) -> Region:
        """Register ``array`` as a put target; send ``region.descriptor().to_bytes()`` to the peer."""
        from qlink.errors import CapabilityError

        raise CapabilityError(f"transport {self.capabilities.name!r} does not support one-sided put")

    def deregister(self, region: Region) -> None:
        """Forget a region; later puts into it raise RegistrationError on the initiator."""

    def put(self, data, remote: RemoteRegion, *, offset: int = 0, notify_id: int = 0, tag: bytes = b"",
            timeout_s: float | None = None) -> None:
        """Write ``data`` into the peer's region at ``offset``; the peer gets a Notification."""
        from qlink.errors import CapabilityError

        raise CapabilityError(f"transport {self.capabilities.name!r} does not support one-sided put")

    #: True where :meth:`put_many` publishes one Notification for all its pieces; False for
    #: the default below (one ``put`` and one Notification per piece).
    put_many_gathers: bool = False

    def put_many(self, data, remote: RemoteRegion, src_offsets, dst_offsets, nbytes, *, notify_id: int = 0,
                 tag: bytes = b"", timeout_s: float | None = None, defer: bool = False) -> int:
        """Write ``data[src_offsets[i]:src_offsets[i] + nbytes[i]]`` into the peer's region at
        ``dst_offsets[i]`` for every ``i``; return how many Notifications the target will see.

        This default checks every piece against ``data`` and the descriptor, then calls
        :meth:`put` once per piece (each with ``notify_id`` and ``tag``, all within one
        ``timeout_s``): the target sees one Notification per piece, and the return value is
        the number of pieces. Endpoints with ``put_many_gathers`` publish a single
        Notification after the last byte of every piece, covering the lowest destination
        offset up to the end of the highest piece, and return 1.

        ``defer=True`` allows the endpoint to return before the bytes have moved (``shm``:
        the target copies them out of registered memory as it progresses); ``data`` must
        then stay unchanged until :meth:`flush` returns. Here it changes nothing.
        """
        import operator

        from qlink.errors import RegistrationError
        from qlink.memory import as_byte_view

        deadline = deadline_of(timeout_s)
        src = as_byte_view(data)
        pieces = [tuple(map(operator.index, p)) for p in zip(src_offsets, dst_offsets, nbytes)]
        if not pieces or not len(pieces) == len(src_offsets) == len(dst_offsets) == len(nbytes):
            raise ValueError("put_many needs src_offsets, dst_offsets and nbytes of one length >= 1, got lengths "
                             f"{len(src_offsets)}, {len(dst_offsets)}, {len(nbytes)}")
        if not isinstance(remote, RemoteRegion):
            remote = RemoteRegion.from_bytes(remote)
        for i, (s, d, n) in enumerate(pieces):
            if n < 0 or s < 0 or s + n > len(src):
                raise ValueError(f"put_many piece {i} ({n} bytes at source offset {s}) lies outside the "
                                 f"{len(src)}-byte source; need 0 <= src_offsets and src_offsets + nbytes <= len(data)")
            if d < 0 or d + n > remote.nbytes:
                raise RegistrationError(f"put_many piece {i} ({n} bytes at offset {d}) falls outside region "
                                        f"{remote.region_id} of {remote.nbytes} bytes")
        for s, d, n in pieces:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.put(src[s:s + n], remote, offset=d, notify_id=notify_id, tag=tag, timeout_s=left)
        return len(pieces)

    def flush(self, *, timeout_s: float | None = None) -> None:
        """Wait until the sources of every put this side made may be reused (deferred puts
        included). This default returns at once: without deferred puts, ``put`` and
        ``put_many`` return only once their source is free again (the bytes may still be on
        their way; the target's Notification says when they have landed)."""
        self._check_open()

    def wait_notification(self, *, timeout_s: float | None = None) -> Notification:
        """Wait for the next put completion targeted at this side."""
        from qlink.errors import CapabilityError

        raise CapabilityError(f"transport {self.capabilities.name!r} does not support one-sided put")

    def poll_notification_nowait(self) -> Notification:
        """The next put completion if one has arrived, else raise WouldBlock."""
        from qlink.errors import CapabilityError

        raise CapabilityError(f"transport {self.capabilities.name!r} does not support one-sided put")

    # ----- lifecycle -----------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.capabilities.name} endpoint was closed by this side")

    @abc.abstractmethod
    def close(self) -> None:
        """Close this side; the peer sees BrokenLinkError (or EOF) on its next call. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _deliver_queued(self, queue, out: memoryview) -> int:
        """Copy the oldest message of ``queue`` (a deque of bytes-likes a transport set aside
        while it looked for something else) into ``out``, count it and return its size; a
        buffer too small raises :class:`BufferTooSmallError` and the message stays queued."""
        msg = queue[0]
        n = len(msg)
        if n > len(out):
            raise BufferTooSmallError(
                f"next {self.capabilities.name} message is {n} bytes but the buffer holds {len(out)}; the message "
                f"stays queued, call again with a buffer of at least {n} bytes", needed_nbytes=n)
        out[:n] = msg
        queue.popleft()
        self._counters.messages_received += 1
        self._counters.bytes_received += n
        return n

    def statistics(self) -> Statistics:
        c = self._counters
        return Statistics(transport=self.capabilities.name, **{f.name: getattr(c, f.name) for f in fields(c)})

    def _timed_out(self, what: str, timeout_s: float | None) -> QlinkTimeoutError:
        self._counters.timeouts += 1
        return QlinkTimeoutError(f"{self.capabilities.name}: {what} did not complete within timeout_s={timeout_s}")


class Listener(abc.ABC):
    """Accepts connections on a URL. ``url`` is the bound address (a port of 0 is resolved)."""

    url: str

    @abc.abstractmethod
    def accept(self, *, timeout_s: float | None = None) -> Endpoint:
        """Wait for the next peer and return its connected Endpoint."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop listening and release the address. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unused(_: object) -> None:  # keep linters quiet about re-exported names
    return None


_unused(WouldBlock)
