"""The endpoints a ``udp://`` listener gives out, all reading its one socket through its
:class:`~transports._udp_hub.Hub`: :class:`UdpPeerEndpoint` (from ``accept``) hears one peer
address and answers it; :class:`UdpServeEndpoint` (from ``serve_endpoint``) hears anyone and
answers whoever sent the last datagram."""

from __future__ import annotations

import socket

from qlink.memory import as_byte_view

from ._base import Capabilities, deadline_of
from ._udp_base import NoPeerError, UdpBase
from ._udp_hub import ANY, Hub
from ._udp_socket import new_socket, url_of

__all__ = ["HubEndpoint", "UdpPeerEndpoint", "UdpServeEndpoint"]


class HubEndpoint(UdpBase):
    """An endpoint reading from a listener's shared socket."""

    def __init__(self, hub: Hub, *, capabilities: Capabilities) -> None:
        super().__init__(hub.sock, capabilities=capabilities)
        self._hub = hub

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._forget()
        self._hub.release()

    def _forget(self) -> None:
        pass

    def _extra(self) -> dict:
        return {**super()._extra(), "listener_dropped": self._hub.dropped,
                "listener_dropped_by_peer": {url_of(a): n for a, n in self._hub.dropped_by_peer.items()}}


class UdpPeerEndpoint(HubEndpoint):
    """One peer of a listener (from ``accept``): datagrams from that source address, sends to it.

    After ``close``, a later datagram from the same address counts as a new peer for ``accept``.
    """

    def __init__(self, hub: Hub, peer: tuple, *, capabilities: Capabilities) -> None:
        super().__init__(hub, capabilities=capabilities)
        self.peer = peer
        self.url = url_of(peer)

    def __repr__(self) -> str:
        return f"<UdpPeerEndpoint {self.local_url} <- {self.url} {'closed' if self._closed else 'open'}>"

    def _send_addr(self):
        return self.peer

    def _take_into(self, view: memoryview):
        q = self._hub.queues.get(self.peer)
        if not q:
            return None
        data = q[0]
        if len(data) > view.nbytes:
            raise self._too_small(len(data), view.nbytes)
        view[:len(data)] = data
        q.popleft()
        self._hub.queued_total -= 1
        return len(data), self.peer

    def _recv(self, buf, timeout_s, nowait: bool) -> int:
        deadline = deadline_of(timeout_s)
        view = as_byte_view(buf)
        n, _ = self._hub.wait(want=self.peer, buf=view, ep=self, done=None, take=self._take_into,
                              deadline=deadline, nowait=nowait, timeout_s=timeout_s, what="recv_into",
                              check=self._check_open)
        return self._got(n)

    def recv_into(self, buf, *, timeout_s: float | None = None) -> int:
        """Receive the next datagram from this peer into ``buf``; return its size in bytes."""
        return self._recv(buf, timeout_s, False)

    def recv_into_nowait(self, buf) -> int:
        return self._recv(buf, None, True)

    def _forget(self) -> None:
        hub = self._hub
        with hub.cond:
            hub.discard(self.peer)  # received for us, never read: counted

    def _extra(self) -> dict:
        return {**super()._extra(), "peer": self.url}

    def native_datagrams(self) -> tuple[int, list, tuple]:
        """``(fd, datagrams already received from this peer, peer address)`` for native code
        that reads the listener's socket itself, keeps this peer's datagrams and answers with
        ``sendto`` (qlink's QEC hot path). Nothing else may read the listener's socket
        meanwhile (one peer served at a time); ``close()`` still releases it."""
        self._check_open()
        hub = self._hub
        with hub.cond:
            q = hub.queues.get(self.peer)
            held = list(q) if q else []
            if q:
                q.clear()
        return self._fd, held, (self.peer[0], self.peer[1])


class UdpServeEndpoint(HubEndpoint):
    """Any-peer endpoint of a listener (from ``serve_endpoint``): a decoder service's socket.

    ``recv_into`` returns the next datagram from anyone and remembers its sender in
    ``last_peer``; ``send`` answers ``last_peer``. ``recvfrom_into`` / ``sendto`` take
    and give the address explicitly.
    """

    def __init__(self, hub: Hub, *, capabilities: Capabilities) -> None:
        super().__init__(hub, capabilities=capabilities)
        self.url = url_of(hub.sock.getsockname())
        self.last_peer: tuple | None = None
        self._peers: set = set()

    def __repr__(self) -> str:
        return f"<UdpServeEndpoint {self.url} {'closed' if self._closed else 'open'}>"

    def _send_addr(self):
        if self.last_peer is None:
            raise NoPeerError(f"udp serve endpoint {self.url} has received no datagram yet, so there is nobody "
                              "to answer; recv first, or use sendto(data, address)")
        return self.last_peer

    def fileno(self) -> int:
        """The listener socket's file descriptor, to wait for datagrams with ``select``/``epoll``."""
        return self._hub.fd

    def peer_socket(self, address: tuple) -> socket.socket:
        """A new non-blocking socket on the listener's own address, connected to ``address``
        (the listener must be made with ``reuse_port=True``). The kernel then queues that
        peer's datagrams in this socket's buffer, apart from everyone else's, so a peer that
        floods fills only its own. The caller reads it (datagrams of other peers that
        arrived in the instant between bind and connect may be there too: ``recvfrom``
        names their senders) and closes it."""
        self._check_open()
        hub = self._hub
        if not hub.sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT):
            raise ValueError("peer_socket() needs a listener made with reuse_port=True")
        sock = new_socket(hub.sock.family, rcvbuf_nbytes=None, sndbuf_nbytes=None, reuse_port=True)
        try:
            sock.bind(hub.sock.getsockname())
            sock.connect(address)
        except OSError:
            sock.close()
            raise
        return sock

    def socket_reader(self):
        """The non-blocking ``recvfrom_into`` of the listener's socket itself, for a service's
        intake loop that reads every datagram waiting at each wake-up (a flood must be read
        as fast as it comes, or the kernel drops everyone's datagrams alike). It raises
        ``BlockingIOError`` when the socket is empty; ``statistics()`` does not see what it
        reads. Only for the endpoint's owner: nothing else may read the listener meanwhile."""
        self._check_open()
        return self._hub.sock.recvfrom_into

    def recvfrom_into(self, buf, *, timeout_s: float | None = None) -> tuple[int, tuple]:
        """Receive the next datagram from any peer into ``buf``; return ``(nbytes, sender address)``."""
        return self._recvfrom(buf, timeout_s, False)

    def recvfrom_into_nowait(self, buf) -> tuple[int, tuple]:
        return self._recvfrom(buf, None, True)

    def _take_held(self, view: memoryview):
        """The datagram an earlier receive's buffer was too small for, if this one holds it."""
        hub = self._hub
        if hub.held_any is None:
            return None
        data, addr = hub.held_any
        if len(data) > view.nbytes:
            raise self._too_small(len(data), view.nbytes)
        hub.held_any = None
        view[:len(data)] = data
        return len(data), addr

    def _forget(self) -> None:
        hub = self._hub
        with hub.cond:
            if hub.held_any is not None:  # received for us, never read: counted
                hub.held_any = None
                hub.dropped += 1

    def _recvfrom(self, buf, timeout_s, nowait: bool) -> tuple[int, tuple]:
        deadline = deadline_of(timeout_s)
        view = as_byte_view(buf)
        take = _nothing if self._hub.held_any is None else self._take_held
        n, addr = self._hub.wait(want=ANY, buf=view, ep=self, done=None, take=take, deadline=deadline,
                                 nowait=nowait, timeout_s=timeout_s, what="recv_into", check=self._check_open)
        self.last_peer = addr
        if len(self._peers) < 4096:
            self._peers.add(addr)
        self._got(n)
        return n, addr

    def recv_into(self, buf, *, timeout_s: float | None = None) -> int:
        """Receive the next datagram from any peer; its sender becomes ``last_peer``."""
        return self._recvfrom(buf, timeout_s, False)[0]

    def recv_into_nowait(self, buf) -> int:
        return self._recvfrom(buf, None, True)[0]

    def sendto(self, data, address: tuple, *, timeout_s: float | None = None) -> None:
        """Send ``data`` as one datagram to ``address`` (a ``(host, port)`` tuple as recvfrom_into gives)."""
        deadline = deadline_of(timeout_s)
        self._check_open()
        self._send_to(self._view(data), address, deadline=deadline, nowait=False, timeout_s=timeout_s)

    def _extra(self) -> dict:
        return {**super()._extra(), "peers_seen": len(self._peers),
                "last_peer": None if self.last_peer is None else url_of(self.last_peer)}


def _nothing(_buf):
    return None

