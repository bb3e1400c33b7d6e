"""The ``udp://`` endpoint of :func:`transports.udp.connect`: a connected socket that sends
to and hears from one peer, one ``recv_into`` per datagram (a datagram too large for the
caller's buffer is kept, whole, for the next receive)."""

from __future__ import annotations

import select
import socket

from qlink.errors import WouldBlock
from qlink.memory import as_byte_view

from ._base import Capabilities, deadline_of
from ._udp_base import UdpBase
from ._udp_socket import DEFAULT_BUSY_POLL_S, SCRATCH_NBYTES, url_of
from ._udp_wait import UdpWait

__all__ = ["UdpEndpoint"]


class UdpEndpoint(UdpBase):
    """A connected UDP socket (made by :func:`connect`): sends to and hears from one peer only."""

    def __init__(self, sock: socket.socket, *, capabilities: Capabilities,
                 busy_poll_s: float = DEFAULT_BUSY_POLL_S) -> None:
        super().__init__(sock, capabilities=capabilities)
        self.peer = sock.getpeername()
        self.url = url_of(self.peer)
        self._busy_poll_s = busy_poll_s
        self._scratch = bytearray(SCRATCH_NBYTES)  # a datagram read for a smaller buffer lands here first
        self._scratch_mv = memoryview(self._scratch)
        self._held: bytes | None = None  # a datagram too large for the last buffer, kept for the next receive

    def __repr__(self) -> str:
        return f"<UdpEndpoint {self.local_url} -> {self.url} {'closed' if self._closed else 'open'}>"

    def _recv_once(self, buf: memoryview) -> int:
        """One non-blocking attempt; -1 when no datagram is waiting."""
        cap = buf.nbytes
        held = self._held
        if held is not None:
            if len(held) > cap:
                raise self._too_small(len(held), cap)
            self._held = None
            buf[:len(held)] = held
            return len(held)
        try:
            if cap >= self._family_max:
                return self._sock.recv_into(buf)  # no datagram can exceed this buffer
            n = self._sock.recv_into(self._scratch_mv)  # one syscall, then a copy of n bytes
        except (BlockingIOError, InterruptedError):
            return -1
        except OSError as e:
            raise self._os_error("recv_into", e) from e
        if n > cap:
            self._held = bytes(self._scratch_mv[:n])
            raise self._too_small(n, cap)
        buf[:n] = self._scratch_mv[:n]
        return n

    def recv_into(self, buf, *, timeout_s: float | None = None) -> int:
        """Receive the next datagram from the peer into ``buf``; return its size in bytes."""
        deadline = deadline_of(timeout_s)
        view = as_byte_view(buf)
        self._check_open()
        n = self._recv_once(view)
        if n >= 0:
            return self._got(n)
        wait = UdpWait(self, self._fd, select.POLLIN, what="recv_into", timeout_s=timeout_s, deadline=deadline,
                       spin_s=self._busy_poll_s)
        while True:
            wait.pause()  # spinning: back at once; then asleep in poll
            self._check_open()
            n = self._recv_once(view)
            if n >= 0:
                return self._got(n)

    def recv_into_nowait(self, buf) -> int:
        self._check_open()
        n = self._recv_once(as_byte_view(buf))
        if n < 0:
            raise WouldBlock("no udp datagram has arrived yet")
        return self._got(n)

    def _extra(self) -> dict:
        return {**super()._extra(), "peer": self.url}

    def native_datagrams(self) -> tuple[int, list, None]:
        """``(fd, datagrams already received, None)`` for native code that sends and receives
        whole datagrams on this connected socket itself (qlink's QEC hot path); the endpoint's
        own receive must not be used meanwhile, and ``close()`` still closes the socket."""
        self._check_open()
        held, self._held = self._held, None
        return self._fd, [] if held is None else [held], None

    def close(self) -> None:
        """Close the socket (the peer is told nothing: UDP has no close). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._held is not None:  # received, never read: counted
            self._counters.errors += 1
            self._held = None
        self._sock.close()
