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

import errno
import select
import socket
import threading
import time
from collections import deque
from dataclasses import replace

from qlink.errors import BrokenLinkError, ClosedError, QlinkError, QlinkTimeoutError, WouldBlock
from qlink.memory import as_byte_view

from ._address import split_host_port
from ._base import BufferTooSmallError, Capabilities, Endpoint, Listener, Statistics, deadline_of

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

MAX_DATAGRAM_BYTES_IPV4 = 65535 - 20 - 8  # IPv4 total length minus IP and UDP headers
MAX_DATAGRAM_BYTES_IPV6 = 65535 - 8  # IPv6 payload length minus the UDP header (no jumbograms)

CAPABILITIES = Capabilities(
    name="udp",
    two_sided=True,
    one_sided=False,
    device_memory=False,
    cross_process=True,
    cross_host=True,
    reliable=False,
    ordered=False,
    max_message_bytes=MAX_DATAGRAM_BYTES_IPV4,
)

_WAKE_S = 0.1  # longest a blocked reader sleeps before re-checking close()
_DEFAULT_BUSY_POLL_S = 50e-6  # a blocking receive spins this long before it sleeps in poll
_SCRATCH_NBYTES = 65536  # holds any datagram (IPv4 and IPv6 payloads are smaller)


class DatagramTooLargeError(QlinkError, ValueError):
    """A send was larger than one datagram may be; nothing was sent."""

    def __init__(self, message: str, *, nbytes: int, max_nbytes: int):
        super().__init__(message)
        self.nbytes = nbytes
        self.max_nbytes = max_nbytes


class NoPeerError(QlinkError, LookupError):
    """``send`` on a serve endpoint before any datagram arrived: there is nobody to answer yet."""


# ----- addresses -------------------------------------------------------------------------------
def _resolve(host: str, port: int, *, passive: bool) -> tuple[int, tuple]:
    flags = socket.AI_PASSIVE if passive else 0
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM, flags=flags)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve udp host {host!r}: {e}") from e
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr


def _url_of(sockaddr: tuple) -> str:
    host, port = sockaddr[0], sockaddr[1]
    return f"udp://[{host}]:{port}" if ":" in host else f"udp://{host}:{port}"


def _family_max(family: int) -> int:
    return MAX_DATAGRAM_BYTES_IPV6 if family == socket.AF_INET6 else MAX_DATAGRAM_BYTES_IPV4


def _capabilities_for(family: int, max_message_bytes: int | None) -> Capabilities:
    limit = _family_max(family)
    if max_message_bytes is not None:
        if not 0 < max_message_bytes <= limit:
            raise ValueError(f"max_message_bytes must be in 1..{limit} for this address family, got {max_message_bytes}")
        limit = max_message_bytes
    return replace(CAPABILITIES, max_message_bytes=limit)


def _new_socket(family: int, *, rcvbuf_nbytes: int | None, sndbuf_nbytes: int | None,
                reuse_port: bool = False) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if rcvbuf_nbytes is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, int(rcvbuf_nbytes))
        if sndbuf_nbytes is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(sndbuf_nbytes))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _wake_ms(left_s: float | None) -> int:
    """How long one sleep in poll lasts (ms): what is left of the timeout, at most _WAKE_S."""
    wait_s = _WAKE_S if left_s is None else min(left_s, _WAKE_S)
    return max(0, int(wait_s * 1000 + 0.999))


def _wait_fd(fd: int, events: int, left_s: float | None) -> bool:
    """poll ``fd`` for ``events`` up to ``left_s`` (None: _WAKE_S); True when ready or in error."""
    p = select.poll()
    p.register(fd, events)
    try:
        return bool(p.poll(_wake_ms(left_s)))
    except InterruptedError:
        return False


def _check_busy_poll(busy_poll_s) -> float:
    if isinstance(busy_poll_s, bool) or not isinstance(busy_poll_s, (int, float)) or not 0 <= busy_poll_s < 1:
        raise ValueError(f"busy_poll_s must be a number of seconds in [0, 1), got {busy_poll_s!r}")
    return float(busy_poll_s)


# ----- the part every endpoint shares -----------------------------------------------------------
class _UdpBase(Endpoint):
    """Sending, size checks and counters; subclasses say where datagrams go and come from."""

    def __init__(self, sock: socket.socket, *, capabilities: Capabilities) -> None:
        super().__init__()
        self.capabilities = capabilities
        self._sock = sock
        self._fd = sock.fileno()
        self._family_max = _family_max(sock.family)
        self._truncated = 0  # receives refused because the datagram exceeded the buffer (datagram kept)
        self._oversize = 0  # sends refused because they exceed max_message_bytes
        self._refused = 0  # ECONNREFUSED seen (ICMP port unreachable from the peer's host)
        self.local_url = _url_of(sock.getsockname())

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
        while True:
            self._check_open()
            try:
                n = self._sock.send(view) if addr is None else self._sock.sendto(view, addr)
            except (BlockingIOError, InterruptedError):
                if nowait:
                    raise WouldBlock("udp socket send buffer is full; retry the send") from None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._timed_out("send", timeout_s) from None
                _wait_fd(self._fd, select.POLLOUT, left)
                continue
            except OSError as e:
                raise self._os_error("send", e, nbytes=view.nbytes) from e
            self._counters.messages_sent += 1
            self._counters.bytes_sent += n
            return

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


# ----- connect(): a connected socket -----------------------------------------------------------
class UdpEndpoint(_UdpBase):
    """A connected UDP socket (made by :func:`connect`): sends to and hears from one peer only."""

    def __init__(self, sock: socket.socket, *, capabilities: Capabilities,
                 busy_poll_s: float = _DEFAULT_BUSY_POLL_S) -> None:
        super().__init__(sock, capabilities=capabilities)
        self.peer = sock.getpeername()
        self.url = _url_of(self.peer)
        self._busy_poll_s = busy_poll_s
        self._scratch = bytearray(_SCRATCH_NBYTES)  # a datagram read for a smaller buffer lands here first
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
        spin_until = None
        while True:
            self._check_open()
            n = self._recv_once(view)
            if n >= 0:
                return self._got(n)
            now = time.monotonic()
            left = None if deadline is None else deadline - now
            if left is not None and left <= 0:
                raise self._timed_out("recv_into", timeout_s)
            if spin_until is None:
                spin_until = now + self._busy_poll_s
            if now >= spin_until:  # (before it, try again at once: the busy-poll)
                _wait_fd(self._fd, select.POLLIN, left)

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


# ----- listen(): one socket shared by accepted peers, demultiplexed by source address -----------
class _Hub:
    """The listener's socket and the per-peer queues of datagrams read on someone else's behalf.

    One thread at a time reads the socket (``_reading``); a datagram for another peer is
    copied into that peer's queue (bounded by ``max_queued_datagrams``; beyond it the
    datagram is dropped and counted, as the kernel would when its buffer fills).
    """

    def __init__(self, sock: socket.socket, *, max_queued_datagrams: int, max_queued_total: int = 16384,
                 busy_poll_s: float = _DEFAULT_BUSY_POLL_S) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.busy_poll_s = busy_poll_s
        self.poller = select.poll()  # used by the reading thread only (``reading`` set)
        self.poller.register(self.fd, select.POLLIN)
        self.family_max = _family_max(sock.family)
        self.cond = threading.Condition(threading.Lock())
        self.reading = False
        self.waiting = 0  # threads in cond.wait (none: nobody to notify)
        self.queues: dict[tuple, deque] = {}  # peer address -> datagrams (accepted or awaiting accept)
        self.pending: deque = deque()  # new peer addresses in arrival order, not yet accepted
        self.accepting = True
        self.mode: str | None = None  # "accept" or "serve", fixed by first use
        self.max_queued = max_queued_datagrams
        self.max_queued_total = max_queued_total  # across every peer's queue
        self.queued_total = 0
        self.dropped_by_peer: dict = {}  # peer address -> datagrams dropped (the first 1024 peers named)
        self.refs = 1  # the listener; each endpoint adds one; the socket closes at zero
        self.dropped = 0  # datagrams dropped because a queue was full or nobody could take them
        self.errors = 0
        self.held_any: tuple | None = None  # (datagram, sender) too large for the serve endpoint's last buffer
        self.scratch = bytearray(_SCRATCH_NBYTES)  # every datagram is read here first, unless it is claimed
        self.scratch_mv = memoryview(self.scratch)  # by a caller whose buffer holds any datagram

    def release(self) -> None:
        with self.cond:
            self.refs -= 1
            last = self.refs == 0
            self.cond.notify_all()
        if last:
            self.sock.close()

    def route(self, addr, data: bytes) -> None:
        q = self.queues.get(addr)
        if q is None:
            if self.mode != "accept" or not self.accepting or self.queued_total >= self.max_queued_total:
                self._drop(addr)
                return
            q = self.queues[addr] = deque()
            self.pending.append(addr)
        if len(q) >= self.max_queued or self.queued_total >= self.max_queued_total:
            self._drop(addr)
            return
        q.append(data)
        self.queued_total += 1

    def _drop(self, addr) -> None:
        self.dropped += 1
        by = self.dropped_by_peer
        if addr in by or len(by) < 1024:
            by[addr] = by.get(addr, 0) + 1

    def discard(self, addr) -> int:
        """Forget ``addr``'s queue (its datagrams counted as dropped); returns how many there were."""
        n = len(self.queues.pop(addr, ()))
        self.queued_total -= n
        self.dropped += n
        return n

    def read_locked(self, want, buf: memoryview | None, ep: _UdpBase | None, done):
        """Drain the socket without blocking until ``done()`` or a datagram ``want(addr)`` lands in ``buf``.

        Returns ``(n, addr)`` for a datagram delivered into ``buf``, True when ``done()``, None when the
        socket is empty. Called with ``cond`` held and ``reading`` set.
        """
        sock = self.sock
        scratch = self.scratch_mv
        cap = buf.nbytes if buf is not None else 0
        while True:
            if done is not None and done():
                return True
            try:
                if want is _ANY and cap >= self.family_max:
                    return sock.recvfrom_into(buf)  # every datagram is ours and fits: straight in
                n, addr = sock.recvfrom_into(scratch)  # one syscall per datagram, no peek
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as e:
                if self.sock.fileno() < 0:
                    raise ClosedError("udp listener socket was closed") from e
                self.errors += 1  # e.g. a stray ICMP error; the datagram queue goes on
                if ep is not None:
                    ep._counters.errors += 1
                continue
            if want is not None and (want is _ANY or addr == want):
                if n > cap:
                    # kept, whole, for a receive with a larger buffer: first in its sender's queue
                    # (the any-peer endpoint's: held apart, with its sender)
                    if want is _ANY:
                        self.held_any = (bytes(scratch[:n]), addr)
                    else:
                        self.queues[addr].appendleft(bytes(scratch[:n]))
                        self.queued_total += 1
                    raise ep._too_small(n, cap)
                buf[:n] = scratch[:n]
                return n, addr
            self.route(addr, bytes(scratch[:n]))

    def wait(self, *, want, buf, ep, done, take, deadline, nowait: bool, timeout_s, what: str, check):
        """The one blocking loop: ``take(buf)`` from a queue, else read the socket (one reader at a time).

        The reader busy-polls the socket for ``busy_poll_s`` (lock released, so other threads
        take what it routed to them) before it sleeps in poll."""
        spin_until = None
        with self.cond:
            while True:
                check()
                got = take(buf)
                if got is not None:
                    return got
                if not self.reading:
                    self.reading = True
                    try:
                        got = self.read_locked(want, buf, ep, done)
                    finally:
                        self.reading = False
                        if self.waiting:
                            self.cond.notify_all()
                    if got is True:
                        continue  # take() now finds it
                    if got is not None:
                        return got
                    if nowait:
                        raise WouldBlock(f"udp {what}: nothing has arrived yet")
                    now = time.monotonic()
                    left = None if deadline is None else deadline - now
                    if left is not None and left <= 0:
                        raise _timeout(ep, what, timeout_s)
                    if spin_until is None:
                        spin_until = now + self.busy_poll_s
                    self.reading = True
                    self.cond.release()
                    try:
                        poll = self.poller.poll
                        if now < spin_until:
                            while not poll(0) and time.monotonic() < spin_until:
                                pass
                        else:
                            poll(_wake_ms(left))
                    except InterruptedError:
                        pass
                    finally:
                        self.cond.acquire()
                        self.reading = False
                        if self.waiting:
                            self.cond.notify_all()
                else:
                    if nowait:
                        raise WouldBlock(f"udp {what}: nothing has arrived yet")
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise _timeout(ep, what, timeout_s)
                    self.waiting += 1
                    try:
                        self.cond.wait(_WAKE_S if left is None else min(left, _WAKE_S))
                    finally:
                        self.waiting -= 1


_ANY = object()  # "any peer": the serve endpoint's claim on datagrams


def _timeout(ep: _UdpBase | None, what: str, timeout_s) -> QlinkTimeoutError:
    if ep is not None:
        return ep._timed_out(what, timeout_s)
    return QlinkTimeoutError(f"udp: {what} did not complete within timeout_s={timeout_s}")


class _HubEndpoint(_UdpBase):
    """An endpoint reading from a listener's shared socket."""

    def __init__(self, hub: _Hub, *, capabilities: Capabilities) -> None:
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
                "listener_dropped_by_peer": {_url_of(a): n for a, n in self._hub.dropped_by_peer.items()}}


class UdpPeerEndpoint(_HubEndpoint):
    """One peer of a listener (from ``accept``): datagrams from that source address, sends to it.

    After ``close``, a later datagram from the same address counts as a new peer for ``accept``.
    """

    def __init__(self, hub: _Hub, peer: tuple, *, capabilities: Capabilities) -> None:
        super().__init__(hub, capabilities=capabilities)
        self.peer = peer
        self.url = _url_of(peer)

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


class UdpServeEndpoint(_HubEndpoint):
    """Any-peer endpoint of a listener (from ``serve_endpoint``): a decoder service's socket.

    ``recv_into`` returns the next datagram from anyone and remembers its sender in
    ``last_peer``; ``send`` answers ``last_peer``. ``recvfrom_into`` / ``sendto`` take
    and give the address explicitly.
    """

    def __init__(self, hub: _Hub, *, capabilities: Capabilities) -> None:
        super().__init__(hub, capabilities=capabilities)
        self.url = _url_of(hub.sock.getsockname())
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
        sock = _new_socket(hub.sock.family, rcvbuf_nbytes=None, sndbuf_nbytes=None, reuse_port=True)
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
        n, addr = self._hub.wait(want=_ANY, buf=view, ep=self, done=None, take=take, deadline=deadline,
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
                "last_peer": None if self.last_peer is None else _url_of(self.last_peer)}


def _nothing(_buf):
    return None


class UdpListener(Listener):
    """A bound UDP socket; see the module docstring for ``accept`` and ``serve_endpoint``."""

    def __init__(self, sock: socket.socket, *, capabilities: Capabilities, max_queued_datagrams: int,
                 max_queued_total: int = 16384, busy_poll_s: float = _DEFAULT_BUSY_POLL_S) -> None:
        self._hub = _Hub(sock, max_queued_datagrams=max_queued_datagrams, max_queued_total=max_queued_total,
                         busy_poll_s=busy_poll_s)
        self._capabilities = capabilities
        self.url = _url_of(sock.getsockname())
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
           busy_poll_s: float = _DEFAULT_BUSY_POLL_S, reuse_port: bool = False) -> UdpListener:
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
    busy_poll_s = _check_busy_poll(busy_poll_s)
    if max_queued_datagrams < 1 or max_queued_total < 1:
        raise ValueError(f"max_queued_datagrams and max_queued_total must be at least 1, got "
                         f"{max_queued_datagrams} and {max_queued_total}")
    family, sockaddr = _resolve(host, port, passive=True)
    caps = _capabilities_for(family, max_message_bytes)
    sock = _new_socket(family, rcvbuf_nbytes=rcvbuf_nbytes, sndbuf_nbytes=sndbuf_nbytes, reuse_port=reuse_port)
    try:
        sock.bind(sockaddr)
    except OSError:
        sock.close()
        raise
    return UdpListener(sock, capabilities=caps, max_queued_datagrams=max_queued_datagrams,
                       max_queued_total=max_queued_total, busy_poll_s=busy_poll_s)


def connect(url: str, *, timeout_s: float | None = 10.0, max_message_bytes: int | None = None,
            rcvbuf_nbytes: int | None = None, sndbuf_nbytes: int | None = None,
            bind: str | None = None, busy_poll_s: float = _DEFAULT_BUSY_POLL_S) -> UdpEndpoint:
    """A UDP socket connected to ``udp://host:port``. Sends nothing, so it succeeds even if nobody listens.

    ``bind="udp://127.0.0.1:0"`` picks the local address (default: the kernel chooses);
    ``busy_poll_s``: how long a blocking receive spins before it sleeps in poll.
    """
    deadline_of(timeout_s)
    busy_poll_s = _check_busy_poll(busy_poll_s)
    host, port = split_host_port(url, scheme="udp", for_listen=False)
    family, sockaddr = _resolve(host, port, passive=False)
    caps = _capabilities_for(family, max_message_bytes)
    sock = _new_socket(family, rcvbuf_nbytes=rcvbuf_nbytes, sndbuf_nbytes=sndbuf_nbytes)
    try:
        if bind is not None:
            local_host, local_port = split_host_port(bind, scheme="udp", for_listen=True)
            sock.bind(_resolve(local_host, local_port, passive=True)[1])
        sock.connect(sockaddr)
    except OSError as e:
        sock.close()
        raise BrokenLinkError(f"cannot set up a udp socket towards {url!r}: {e}") from e
    return UdpEndpoint(sock, capabilities=caps, busy_poll_s=busy_poll_s)
