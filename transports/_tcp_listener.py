"""The ``tcp://`` listener: a background thread accepts connections and answers their
handshakes (:mod:`transports._tcp_handshake`) without waiting for anyone to call ``accept``,
so a slow or silent client never holds up the others; endpoints whose handshake succeeded
wait in an :class:`~transports._accept.AcceptQueue` for ``accept()``."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections import Counter

from . import framing as fr
from . import _tcp_handshake as hs
from ._accept import AcceptQueue
from ._address import join_host_port
from ._base import Listener
from ._tcp_endpoint import RBUF_NBYTES, TcpEndpoint
from ._tcp_frames import SEND_FLAGS
from ._waiting import poll_ms

__all__ = ["TcpListener"]

_POLLIN = select.POLLIN


class TcpListener(Listener):
    """Listens on a TCP address; a background thread answers handshakes so ``connect`` never waits for ``accept``."""

    def __init__(self, sock: socket.socket, *, busy_poll_s: float, handshake_timeout_s: float,
                 token: bytes | None = None, read_ahead_nbytes: int = RBUF_NBYTES, way_of_host=None) -> None:
        self._sock = sock
        self._way_of_host = way_of_host  # handed to every endpoint accepted
        self._token = token
        self._read_ahead_nbytes = read_ahead_nbytes
        #: refused handshakes by reason: bad_hello, no_token, bad_token, hung_up, handshake_timeout
        self.refused_by_reason: Counter = Counter()
        host, port = sock.getsockname()[:2]
        self.url = join_host_port("tcp", host, port)
        self.refused_handshakes = 0  # wrong magic/version, hung up or silent during the handshake
        self.accepted_handshakes = 0
        self._busy_poll_s = busy_poll_s
        self._handshake_timeout_s = handshake_timeout_s
        self._queue = AcceptQueue(self.url)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name=f"qlink-tcp-listener {self.url}", daemon=True)
        self._thread.start()

    @property
    def _closed(self) -> bool:
        return self._queue.closed

    def __repr__(self) -> str:
        return f"<TcpListener {self.url} {'closed' if self._closed else 'listening'}>"

    def _serve(self) -> None:
        try:
            self._serve_loop()
        except BaseException as e:  # surface in accept() rather than dying silently
            self._queue.fail(e)

    def _serve_loop(self) -> None:
        poller = select.poll()
        poller.register(self._sock, _POLLIN)
        poller.register(self._wake_r, _POLLIN)
        lfd, wfd = self._sock.fileno(), self._wake_r.fileno()
        pending: dict[int, list] = {}  # fd -> [sock, hello buffer, bytes got, deadline]
        try:
            while True:
                now = time.monotonic()
                wait_ms = poll_ms(min(p[3] for p in pending.values()) - now) if pending else None
                for fd, _ev in poller.poll(wait_ms):
                    if fd == wfd:
                        return
                    if fd == lfd:
                        self._accept_all(poller, pending)
                        continue
                    entry = pending.get(fd)
                    if entry is not None:
                        self._read_hello(poller, pending, fd, entry)
                now = time.monotonic()
                for fd in [fd for fd, p in pending.items() if p[3] <= now]:
                    self._drop(poller, pending, fd, "handshake_timeout")
        finally:
            for fd in list(pending):
                self._drop(poller, pending, fd)

    def _accept_all(self, poller, pending) -> None:
        while True:
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors: try again on the next wake-up
                return
            conn.setblocking(False)
            poller.register(conn, _POLLIN)
            pending[conn.fileno()] = [conn, bytearray(fr.HELLO.size + hs.AUTH_NBYTES), 0,
                                      time.monotonic() + self._handshake_timeout_s]

    def _drop(self, poller, pending, fd, reason: str = "hung_up") -> None:
        conn = pending.pop(fd)[0]
        poller.unregister(fd)
        self.refused_by_reason[reason] += 1
        self.refused_handshakes += 1  # counted before the hang-up the client can observe
        conn.close()

    def _read_hello(self, poller, pending, fd, entry) -> None:
        conn, buf, got, _deadline = entry
        want = hs.hello_nbytes(buf, got)
        try:
            k = conn.recv_into(memoryview(buf)[got:], want - got)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            k = 0
        if k == 0:
            self._drop(poller, pending, fd)
            return
        entry[2] = got = got + k
        if got < hs.hello_nbytes(buf, got):
            return
        del pending[fd]
        poller.unregister(fd)
        status, why, reason, peer_key, version = hs.judge_hello(buf, got, self._token)
        if status != fr.STATUS_OK:
            self.refused_handshakes += 1
            self.refused_by_reason[why] += 1
            hs.refuse(conn, status, reason)
            return
        local_key = hs.random_key()
        try:
            conn.send(hs.accept_reply(local_key, version=version), SEND_FLAGS)
            ep = TcpEndpoint(conn, url=self.url, local_key=local_key, peer_key=peer_key, busy_poll_s=self._busy_poll_s,
                             version=version, read_ahead_nbytes=self._read_ahead_nbytes, way_of_host=self._way_of_host)
        except OSError:
            self.refused_handshakes += 1
            conn.close()
            return
        if not self._queue.offer(ep):
            ep.close()
            return
        self.accepted_handshakes += 1

    def accept(self, *, timeout_s: float | None = None) -> TcpEndpoint:
        """The next connected peer whose handshake succeeded (QlinkTimeoutError after timeout_s)."""
        return self._queue.take(timeout_s=timeout_s)

    def close(self) -> None:
        ready = self._queue.close()
        if ready is None:
            return
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=2.0)
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()
        for ep in ready:
            ep.close()
