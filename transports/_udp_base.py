"""What every ``udp://`` endpoint shares: sending one datagram (and waiting while the socket
buffer is full), the size check before it, the typed errors, the counters; a subclass says
where datagrams go (:meth:`UdpBase._send_addr`) and how they come in."""

from __future__ import annotations

import errno
import select
import socket
from dataclasses import replace

from qlink.errors import BrokenLinkError, ClosedError, QlinkError, WouldBlock
from qlink.memory import as_byte_view

from ._base import BufferTooSmallError, Capabilities, Endpoint, Statistics, deadline_of
from ._udp_socket import family_max, url_of
from ._udp_wait import UdpWait

__all__ = ["DatagramTooLargeError", "NoPeerError", "UdpBase"]


class DatagramTooLargeError(QlinkError, ValueError):
    """A send was larger than one datagram may be; nothing was sent."""

    def __init__(self, message: str, *, nbytes: int, max_nbytes: int):
        super().__init__(message)
        self.nbytes = nbytes
        self.max_nbytes = max_nbytes


class NoPeerError(QlinkError, LookupError):
    """``send`` on a serve endpoint before any datagram arrived: there is nobody to answer yet."""


class UdpBase(Endpoint):
    """Sending, size checks and counters; subclasses say where datagrams go and come from."""

    def __init__(self, sock: socket.socket, *, capabilities: Capabilities) -> None:
        super().__init__()
        self.capabilities = capabilities
        self._sock = sock
        self._fd = sock.fileno()
        self._family_max = family_max(sock.family)
        self._truncated = 0  # receives refused because the datagram exceeded the buffer (datagram kept)
        self._oversize = 0  # sends refused because they exceed max_message_bytes
        self._refused = 0  # ECONNREFUSED seen (ICMP port unreachable from the peer's host)
        self.local_url = url_of(sock.getsockname())

    def _view(self, data) -> memoryview:
        view = as_byte_view(data)
        n = view.nbytes
        limit = self.capabilities.max_message_bytes
        if n > limit:
            self._oversize += 1
            self._counters.errors += 1
            raise DatagramTooLargeError(
                f"udp message of {n} bytes exceeds max_message_bytes={limit} (one datagram); nothing was sent. "
                "Split it at the protocol level (a controller splits syndromes across several "
                "enqueue_syndromes requests) or use a stream transport such as tcp://",
                nbytes=n, max_nbytes=limit)
        return view

    def _send_to(self, view: memoryview, addr, *, deadline: float | None, nowait: bool, timeout_s) -> None:
        wait = None
        while True:
            self._check_open()
            try:
                n = self._sock.send(view) if addr is None else self._sock.sendto(view, addr)
            except (BlockingIOError, InterruptedError):
                if nowait:
                    raise WouldBlock("udp socket send buffer is full; retry the send") from None
                n = None
            except OSError as e:
                raise self._os_error("send", e, nbytes=view.nbytes) from e
            if n is not None:
                self._counters.messages_sent += 1
                self._counters.bytes_sent += n
                return
            if wait is None:
                wait = UdpWait(self, self._fd, select.POLLOUT, what="send", timeout_s=timeout_s, deadline=deadline,
                               spin_s=0.0)
            wait.pause()

    def _os_error(self, what: str, e: OSError, *, nbytes: int = -1) -> QlinkError:
        self._counters.errors += 1
        if e.errno == errno.EMSGSIZE:
            self._oversize += 1
            return DatagramTooLargeError(f"udp {what}: the kernel refused a datagram of {nbytes} bytes as too large "
                                         f"({e}); nothing was sent", nbytes=nbytes,
                                         max_nbytes=self.capabilities.max_message_bytes)
        if e.errno == errno.ECONNREFUSED:
            self._refused += 1
            return BrokenLinkError(
                f"udp {what}: the peer's host answered 'port unreachable' (ECONNREFUSED) to an earlier datagram: "
                "nothing listens there now. The endpoint stays usable if the peer comes back.")
        if e.errno in (errno.EBADF, errno.ENOTSOCK) and self._closed:
            return ClosedError(f"udp endpoint {self.local_url} was closed by this side")
        return BrokenLinkError(f"udp {what} failed: {e}")

    def _too_small(self, size: int, buf_nbytes: int) -> BufferTooSmallError:
        self._truncated += 1
        return BufferTooSmallError(
            f"next udp datagram is {size} bytes but the buffer holds {buf_nbytes}; the datagram stays queued, "
            f"call again with a buffer of at least {size} bytes", needed_nbytes=size)

    def _got(self, n: int) -> int:
        self._counters.messages_received += 1
        self._counters.bytes_received += n
        return n

    def _extra(self) -> dict:
        try:
            rcvbuf = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        except OSError:
            rcvbuf = None
        return {"local": self.local_url, "truncated": self._truncated, "oversize": self._oversize,
                "refused": self._refused, "rcvbuf_nbytes": rcvbuf}

    def statistics(self) -> Statistics:
        base = super().statistics()
        return replace(base, extra=self._extra())

    def send(self, data, *, timeout_s: float | None = None) -> None:
        """Send ``data`` as one datagram (exactly these bytes); waits only while the socket buffer is full."""
        deadline = deadline_of(timeout_s)
        self._check_open()
        self._send_to(self._view(data), self._send_addr(), deadline=deadline, nowait=False, timeout_s=timeout_s)

    def send_nowait(self, data) -> None:
        self._check_open()
        self._send_to(self._view(data), self._send_addr(), deadline=None, nowait=True, timeout_s=None)

    def _send_addr(self):
        return None
