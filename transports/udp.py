"""``udp://host:port``: raw datagrams, one message per datagram, nothing added.

This is the transport for talking to a peer that speaks a datagram protocol of its
own, such as the CUDA-Q realtime decoder RPC a controller or FPGA sends over UDP:
one request frame (24-byte ``CUQR`` header + payload) per datagram, one ``CUQS``
response per datagram. The bytes on the wire are exactly what ``send`` was given
and ``recv_into`` hands back exactly one datagram's payload: no qlink header, no
framing, no fragmentation of our own.

UDP is honest about what it cannot do, and so is this module:

* **Not reliable, not ordered** (``reliable=False``, ``ordered=False``). A lost or
  reordered datagram is not hidden here; the layer above sees it. For the decoder
  RPC that is the ``counter`` field of ``enqueue_syndromes``: a gap in the counter is
  answered with ``SYNDROMES_DROPPED``, never with a wrong correction.
* **Bounded size**: one message is one datagram, at most ``max_message_bytes`` =
  65,507 bytes over IPv4 (65,527 over IPv6). A larger ``send`` raises
  :class:`DatagramTooLargeError`. A request that would not fit -- a 2^20-bit syndrome
  is 131,072 bytes + 56 bytes of header and fields -- is split by the sender into several
  ``enqueue_syndromes`` requests (each carries its own ``num_syndromes``). Over a real
  network keep datagrams under the path MTU (1,472 bytes on a 1,500-byte Ethernet
  MTU), or the IP layer fragments them and the loss of one fragment loses the datagram;
  ``listen``/``connect`` take ``max_message_bytes=`` to enforce a lower limit.
* **No connections, no dead-peer detection.** ``connect`` sends nothing and
  succeeds whether or not anyone listens. The only sign of a missing peer is an
  ICMP "port unreachable" after a send on a connected socket, which the next call
  on that endpoint raises as :class:`~qlink.errors.BrokenLinkError`
  (``ECONNREFUSED``); the endpoint stays usable, since the peer may come back. If
  the ICMP is filtered (firewalls, other hosts) a missing peer looks like silence:
  receives time out. ``close()`` tells the peer nothing.
* **No one-sided put** (``one_sided=False``): ``put`` raises ``CapabilityError``.

A blocking receive busy-polls for ``busy_poll_s`` (50 µs by default, as ``tcp://``)
before it sleeps in ``poll``: a sleeping reader pays the scheduler's wake-up, which on
a virtual machine is tens of µs per side of a round trip. Each datagram costs one
``recvfrom`` (no peek first): a datagram larger than the caller's buffer is kept, whole,
for the next receive with a buffer large enough.

Three kinds of endpoint:

* ``connect("udp://host:port")`` -> :class:`UdpEndpoint`, a connected socket that
  sends to and receives from that one peer.
* ``listen("udp://127.0.0.1:0")`` binds (loopback unless told otherwise; port 0
  picks a free port, ``listener.url`` has it). ``accept()`` returns a
  :class:`UdpPeerEndpoint` for the next *new* peer address that sends a datagram;
  that datagram is its first message. Peers share the listener's socket and are
  told apart by source address.
* ``listener.serve_endpoint()`` -> :class:`UdpServeEndpoint`, for a service that
  answers whoever sent the frame (a controller or FPGA does no handshake):
  ``recv_into`` returns the next datagram from anyone and ``send`` answers the sender
  of the last datagram received, so a request/response loop written for any
  transport serves many UDP peers unchanged. ``recvfrom_into`` / ``sendto`` name the
  peer explicitly for services that interleave peers.

A listener serves either ``accept()`` or one ``serve_endpoint()``, not both.

Rooms: this module is the entry (``listen``, ``connect``, the listener);
:mod:`transports._udp_socket` the socket and its limits, :mod:`transports._udp_base` what
every endpoint shares (sending, the errors), :mod:`transports._udp_endpoint` the connected
endpoint, :mod:`transports._udp_hub` the listener's shared socket and its one receive loop,
:mod:`transports._udp_peers` the endpoints on it; :mod:`transports._udp_wait` the waiting
policy (one of :mod:`transports._waiting`'s family).

>>> from transports import udp
>>> with udp.listen("udp://127.0.0.1:0") as lis:
...     client = udp.connect(lis.url)
...     service = lis.serve_endpoint()
...     client.send(b"CUQR request")
...     request = service.recv(timeout_s=1)
...     service.send(b"CUQS answer to " + request[:4])   # goes back to the sender
...     client.recv(timeout_s=1)
b'CUQS answer to CUQR'
>>> client.close(); service.close()
"""

from __future__ import annotations

import socket

from qlink.errors import BrokenLinkError, ClosedError

from ._address import split_host_port
from ._base import Capabilities, Listener, deadline_of
from ._udp_base import DatagramTooLargeError, NoPeerError
from ._udp_endpoint import UdpEndpoint
from ._udp_hub import Hub
from ._udp_peers import UdpPeerEndpoint, UdpServeEndpoint
from ._udp_socket import (CAPABILITIES, DEFAULT_BUSY_POLL_S, MAX_DATAGRAM_BYTES_IPV4, MAX_DATAGRAM_BYTES_IPV6,
                          capabilities_for, check_busy_poll, new_socket, resolve, url_of)

__all__ = [
    "CAPABILITIES",
    "MAX_DATAGRAM_BYTES_IPV4",
    "MAX_DATAGRAM_BYTES_IPV6",
    "listen",
    "connect",
    "UdpEndpoint",
    "UdpPeerEndpoint",
    "UdpServeEndpoint",
    "UdpListener",
    "DatagramTooLargeError",
    "NoPeerError",
]


class UdpListener(Listener):
    """A bound UDP socket; see the module docstring for ``accept`` and ``serve_endpoint``."""

    def __init__(self, sock: socket.socket, *, capabilities: Capabilities, max_queued_datagrams: int,
                 max_queued_total: int = 16384, busy_poll_s: float = DEFAULT_BUSY_POLL_S) -> None:
        self._hub = Hub(sock, max_queued_datagrams=max_queued_datagrams, max_queued_total=max_queued_total,
                        busy_poll_s=busy_poll_s)
        self._capabilities = capabilities
        self.url = url_of(sock.getsockname())
        self._closed = False
        self._served = False

    def __repr__(self) -> str:
        return f"<UdpListener {self.url} {'closed' if self._closed else 'listening'}>"

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def _check(self) -> None:
        if self._closed:
            raise ClosedError(f"udp listener {self.url} was closed by this side")

    def _claim(self, mode: str) -> None:
        hub = self._hub
        with hub.cond:
            if hub.mode is None:
                hub.mode = mode
            elif hub.mode != mode:
                raise ValueError(f"udp listener {self.url} already serves {hub.mode!r}; a listener gives either "
                                 "accept() endpoints or one serve_endpoint(), not both")

    def accept(self, *, timeout_s: float | None = None) -> UdpPeerEndpoint:
        """Wait for a datagram from a peer address with no endpoint yet; return that peer's endpoint.

        The datagram that revealed the peer is the endpoint's first message.
        """
        deadline = deadline_of(timeout_s)
        self._check()
        self._claim("accept")
        hub = self._hub

        def take(_buf):
            if not hub.pending:
                return None
            addr = hub.pending.popleft()
            hub.refs += 1
            return UdpPeerEndpoint(hub, addr, capabilities=self._capabilities)

        return hub.wait(want=None, buf=None, ep=None, done=lambda: bool(hub.pending), take=take, deadline=deadline,
                        nowait=False, timeout_s=timeout_s, what="accept", check=self._check)

    def serve_endpoint(self) -> UdpServeEndpoint:
        """The any-peer endpoint of this listener (one per listener); see :class:`UdpServeEndpoint`."""
        self._check()
        self._claim("serve")
        hub = self._hub
        with hub.cond:
            if self._served:
                raise ValueError(f"udp listener {self.url} already handed out its serve endpoint")
            self._served = True
            hub.refs += 1
        return UdpServeEndpoint(hub, capabilities=self._capabilities)

    def close(self) -> None:
        """Stop taking new peers. Endpoints already handed out keep the socket open until they close."""
        if self._closed:
            return
        self._closed = True
        hub = self._hub
        with hub.cond:
            hub.accepting = False
            for addr in hub.pending:  # datagrams of peers nobody accepted: dropped, and counted
                hub.discard(addr)
            hub.pending.clear()
        hub.release()



# ----- module entry points -----------------------------------------------------------------------
def listen(url: str, *, max_message_bytes: int | None = None, rcvbuf_nbytes: int | None = None,
           sndbuf_nbytes: int | None = None, max_queued_datagrams: int = 4096, max_queued_total: int = 16384,
           busy_poll_s: float = DEFAULT_BUSY_POLL_S, reuse_port: bool = False) -> UdpListener:
    """Bind ``udp://host:port`` (host defaults to 127.0.0.1; port 0 picks a free port, see ``.url``).

    ``busy_poll_s``: how long a blocking receive on the listener's endpoints spins before it
    sleeps in poll (0: sleep at once).

    ``rcvbuf_nbytes`` asks the kernel for a larger receive buffer (capped by
    ``net.core.rmem_max``; ``statistics().extra["rcvbuf_nbytes"]`` says what was granted).
    ``max_queued_datagrams`` bounds each accepted peer's queue of datagrams read on its behalf,
    ``max_queued_total`` all those queues together; a datagram beyond either bound is dropped
    and counted (``statistics().extra["listener_dropped_by_peer"]`` names its sender).
    ``reuse_port``: SO_REUSEPORT, so that the serve endpoint can give each peer a socket of
    its own (:meth:`UdpServeEndpoint.peer_socket`); other processes of this user could then
    bind the same port too.
    """
    host, port = split_host_port(url, scheme="udp", for_listen=True)
    busy_poll_s = check_busy_poll(busy_poll_s)
    if max_queued_datagrams < 1 or max_queued_total < 1:
        raise ValueError(f"max_queued_datagrams and max_queued_total must be at least 1, got "
                         f"{max_queued_datagrams} and {max_queued_total}")
    family, sockaddr = resolve(host, port, passive=True)
    caps = capabilities_for(family, max_message_bytes)
    sock = new_socket(family, rcvbuf_nbytes=rcvbuf_nbytes, sndbuf_nbytes=sndbuf_nbytes, reuse_port=reuse_port)
    try:
        sock.bind(sockaddr)
    except OSError:
        sock.close()
        raise
    return UdpListener(sock, capabilities=caps, max_queued_datagrams=max_queued_datagrams,
                       max_queued_total=max_queued_total, busy_poll_s=busy_poll_s)


def connect(url: str, *, timeout_s: float | None = 10.0, max_message_bytes: int | None = None,
            rcvbuf_nbytes: int | None = None, sndbuf_nbytes: int | None = None,
            bind: str | None = None, busy_poll_s: float = DEFAULT_BUSY_POLL_S) -> UdpEndpoint:
    """A UDP socket connected to ``udp://host:port``. Sends nothing, so it succeeds even if nobody listens.

    ``bind="udp://127.0.0.1:0"`` picks the local address (default: the kernel chooses);
    ``busy_poll_s``: how long a blocking receive spins before it sleeps in poll.
    """
    deadline_of(timeout_s)
    busy_poll_s = check_busy_poll(busy_poll_s)
    host, port = split_host_port(url, scheme="udp", for_listen=False)
    family, sockaddr = resolve(host, port, passive=False)
    caps = capabilities_for(family, max_message_bytes)
    sock = new_socket(family, rcvbuf_nbytes=rcvbuf_nbytes, sndbuf_nbytes=sndbuf_nbytes)
    try:
        if bind is not None:
            local_host, local_port = split_host_port(bind, scheme="udp", for_listen=True)
            sock.bind(resolve(local_host, local_port, passive=True)[1])
        sock.connect(sockaddr)
    except OSError as e:
        sock.close()
        raise BrokenLinkError(f"cannot set up a udp socket towards {url!r}: {e}") from e
    return UdpEndpoint(sock, capabilities=caps, busy_poll_s=busy_poll_s)
