"""``tcp://host:port``: framed messages and software-emulated puts over one TCP socket.

Each message travels as one frame (see :mod:`transports.framing`): a 32-byte
header packed into a preallocated buffer, then the payload. Small payloads are
copied behind the header and leave in one ``send``; large ones go out with
``sendmsg`` straight from the caller's buffer and are read with ``recv_into``
straight into the receiver's buffer, so big payloads are never copied in user space.

Rooms: this module is the entry (``listen``, ``connect``); :mod:`transports._tcp_handshake`
the handshake both sides speak, :mod:`transports._tcp_listener` the listener and its
handshake thread; :mod:`transports._tcp_endpoint` the endpoint, whose receive side
(:mod:`transports._tcp_pump`: the frame parser and where each frame lands) and send side
(:mod:`transports._tcp_send`) speak the frames of :mod:`transports.framing` and
:mod:`transports._tcp_frames` (PUTV, PUTV_ACK); :mod:`transports._tcp_wait` is its waiting
policy (one of :mod:`transports._waiting`'s family); :mod:`transports._tcp_splice` hands a
deferred put's pages to the socket (``SplicePipe``, ``splice_pieces`` and ``splice_built``
are public here, for a benchmark's bare-socket floor) where :func:`deferred_put_way` finds
that faster on this host than a copy (:mod:`transports._tcp_way` measures it).

One-sided ``put`` is emulated in software, the way UCX emulates RMA over active
messages: the initiator sends a PUT frame, and the target writes its payload into
the registered region during its own progress (any ``recv_into`` /
``wait_notification`` / ``send`` call), then queues the :class:`Notification`.
Messages and notifications that arrive interleaved each go to their own queue.

* The listener binds ``127.0.0.1`` unless another host is named; port 0 picks a
  free port and ``Listener.url`` reports the real one.
* A connection opens with a handshake (magic ``QLTC`` + protocol version); a
  listener thread answers it, refusing a client that speaks anything else with a
  readable reason, without disturbing other clients.
* A blocking call busy-polls for ``busy_poll_s`` (50 µs by default), then sleeps in
  ``poll`` for the rest of its timeout. A peer that closes, crashes or is killed
  shows up as :class:`~qlink.errors.BrokenLinkError` as soon as its kernel closes
  the socket, after the messages it sent before have been received.
* One thread may send (``send``/``put``) while another receives
  (``recv_into``/``wait_notification``) on the same endpoint.
* ``put_many`` (vectored put) sends ONE frame for all its pieces: a PUTV frame (kind 5;
  the header's ``offset`` field holds the number of pieces) whose payload is a table of
  ``u64 dst_offset, u64 nbytes`` per piece followed by the pieces themselves, handed to
  ``socket.sendmsg`` as a list of views of the caller's buffer (scatter-gather, no
  copy). The target reads the table first. Pieces of 64 KiB or more on average (a
  contiguous KV layer: its K and V planes) are then read straight into their places in
  the region, a large remainder from the socket into it with no copy in between;
  smaller ones are read into one staging buffer behind the table and scattered into
  the region with one call (NumPy, one call where the pieces share a row size, e.g. KV
  blocks; see :mod:`transports._pieces`). It then queues ONE Notification spanning every piece
  (``put_many_gathers``). A put_many beyond the 1 GiB frame limit goes as several PUTV
  frames in a row, all but the last flagged MORE (header ``flags`` bit 0); the
  notification comes after the last.
* Protocol version 2 is version 1 plus the PUTV frame. A client opens with the
  version-1 hello and hello flag bit 0 ("I take PUTV"), so a version-1 listener still
  accepts it; a version-2 listener answers with version 2 when the client set that
  flag. Each side sends PUTV frames only when the other said it takes them (the client:
  a version-2 reply; the listener: the hello flag), else ``put_many`` is one PUT frame
  per piece, which a version-1 peer reads as before.
* A listener made with ``token=`` admits only clients that prove they hold the same
  shared token: such a client sets hello flag bit 1 and sends, right after the hello, a
  32-byte HMAC-SHA256 of the hello under the token (the token itself never travels). A
  client without it is refused with a readable reason; ``refused_by_reason`` counts
  refused handshakes by why. Without ``token=`` the handshake is byte for byte as before.
* ``read_ahead_nbytes`` bounds each endpoint's read-ahead buffer (256 KiB by default).
* ``statistics().extra`` counts ``staged_messages`` (messages that had to be parked
  in an internal buffer: they arrived while the caller waited for a notification,
  or a receive left mid-message), ``puts_rejected`` (puts into a region the
  target no longer has, counted and dropped) and ``gathered_puts`` (put_many calls
  sent as PUTV frames).

>>> from transports import tcp
>>> with tcp.listen("tcp://127.0.0.1:0") as lis:
...     with tcp.connect(lis.url, timeout_s=5) as client, lis.accept(timeout_s=5) as server:
...         client.send(b"syndrome round")
...         buf = bytearray(64)
...         n = server.recv_into(buf, timeout_s=5)
...         bytes(buf[:n])
b'syndrome round'
"""

from __future__ import annotations

import errno
import socket
import time

from qlink.access import token_bytes
from qlink.errors import BrokenLinkError, QlinkTimeoutError

from . import _tcp_handshake as hs
from ._address import join_host_port, split_host_port
from ._base import deadline_of
from ._tcp_endpoint import CAPABILITIES, DEFAULT_BUSY_POLL_S, RBUF_NBYTES, TcpEndpoint
from ._tcp_splice import SplicePipe, recv_pieces, splice_pieces
from ._tcp_splice import built as splice_built
from . import _tcp_way
from ._tcp_listener import TcpListener

__all__ = ["CAPABILITIES", "listen", "connect", "deferred_put_way", "TcpEndpoint", "TcpListener", "SplicePipe",
           "splice_built", "splice_pieces", "recv_pieces"]


def deferred_put_way() -> _tcp_way.Way:
    """How this process's tcp endpoints send a large deferred ``put_many``: by splice (the pages
    lent to the socket) or copied, whichever this host moved faster between two processes,
    measured the first time it is asked (about 0.4 s), inherited by processes started
    afterwards, or forced by ``QLINK_TCP_SPLICE=1``/``0`` (:mod:`transports._tcp_way`)."""
    return _tcp_way.way(measure=_measure_way)


def _measure_way() -> _tcp_way.Way:
    return _tcp_way.measure(listen=listen)


def listen(url: str, *, busy_poll_s: float = DEFAULT_BUSY_POLL_S, backlog: int = 128,
           handshake_timeout_s: float = hs.HANDSHAKE_TIMEOUT_S, token: str | bytes | None = None,
           read_ahead_nbytes: int = RBUF_NBYTES) -> TcpListener:
    """Listen on ``tcp://host:port`` (host defaults to 127.0.0.1, port 0 picks a free one; see ``.url``).

    ``token``: admit only clients that prove they hold this shared secret (see the module
    docstring); ``read_ahead_nbytes``: each accepted endpoint's read-ahead buffer."""
    token = token_bytes(token)
    if not isinstance(read_ahead_nbytes, int) or read_ahead_nbytes < 4096:
        raise ValueError(f"read_ahead_nbytes must be an int >= 4096, got {read_ahead_nbytes!r}")
    host, port = split_host_port(url, scheme="tcp", for_listen=True)
    infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    family, stype, proto, _canon, addr = infos[0]
    sock = socket.socket(family, stype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                where = join_host_port("tcp", host, port)
                raise OSError(errno.EADDRINUSE, f"{where} is already in use; close the other listener "
                                                "or listen on port 0 for a free one") from None
            raise
        sock.listen(backlog)
        sock.setblocking(False)
        return TcpListener(sock, busy_poll_s=busy_poll_s, handshake_timeout_s=handshake_timeout_s, token=token,
                           read_ahead_nbytes=read_ahead_nbytes, way_of_host=deferred_put_way)
    except BaseException:
        sock.close()
        raise


def connect(url: str, *, timeout_s: float | None = 10.0, busy_poll_s: float = DEFAULT_BUSY_POLL_S,
            token: str | bytes | None = None) -> TcpEndpoint:
    """Connect to a qlink tcp listener and complete the handshake (proving ``token`` when given).

    BrokenLinkError when nobody listens there, WireError when the listener refuses
    the handshake (its reason is in the message), QlinkTimeoutError after timeout_s.
    """
    token = token_bytes(token)
    host, port = split_host_port(url, scheme="tcp", for_listen=False)
    where = join_host_port("tcp", host, port)
    deadline = deadline_of(timeout_s)

    def left() -> float | None:
        if deadline is None:
            return None
        rest = deadline - time.monotonic()
        if rest <= 0:
            raise QlinkTimeoutError(f"tcp: connecting to {where} did not complete within timeout_s={timeout_s}")
        return rest

    try:
        sock = socket.create_connection((host, port), timeout=left())
    except ConnectionRefusedError as e:
        raise BrokenLinkError(f"nobody listens on {where} (connection refused)") from e
    except TimeoutError as e:
        raise QlinkTimeoutError(f"tcp: connecting to {where} did not complete within timeout_s={timeout_s}") from e
    except OSError as e:
        raise BrokenLinkError(f"cannot connect to {where}: {e}") from e
    try:
        local_key, peer_key, version = hs.client_handshake(sock, token=token, left=left, where=where)
        return TcpEndpoint(sock, url=where, local_key=local_key, peer_key=peer_key, busy_poll_s=busy_poll_s,
                           version=version, way_of_host=deferred_put_way)
    except BaseException as e:
        sock.close()
        if isinstance(e, TimeoutError):
            raise QlinkTimeoutError(f"tcp: handshake with {where} did not complete within timeout_s={timeout_s}") from e
        if isinstance(e, OSError):
            raise BrokenLinkError(f"tcp handshake with {where} failed: {e}") from e
        raise
