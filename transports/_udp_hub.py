"""A ``udp://`` listener's socket, shared by the endpoints it gives out and demultiplexed by
source address: one thread at a time reads it, keeping what it reads for other peers in their
queues, and every blocking receive (and ``accept``) waits in :meth:`Hub.wait`."""

from __future__ import annotations

import select
import socket
import threading
from collections import deque

from qlink.errors import ClosedError, WouldBlock

from ._udp_base import UdpBase
from ._udp_socket import DEFAULT_BUSY_POLL_S, SCRATCH_NBYTES, WAKE_S, family_max
from ._udp_wait import HubWait

__all__ = ["ANY", "Hub"]

ANY = object()  # "any peer": the serve endpoint's claim on datagrams


class Hub:
    """The listener's socket and the per-peer queues of datagrams read on someone else's behalf.

    One thread at a time reads the socket (``_reading``); a datagram for another peer is
    copied into that peer's queue (bounded by ``max_queued_datagrams``; beyond it the
    datagram is dropped and counted, as the kernel would when its buffer fills).
    """

    def __init__(self, sock: socket.socket, *, max_queued_datagrams: int, max_queued_total: int = 16384,
                 busy_poll_s: float = DEFAULT_BUSY_POLL_S) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.busy_poll_s = busy_poll_s
        self.poller = select.poll()  # used by the reading thread only (``reading`` set)
        self.poller.register(self.fd, select.POLLIN)
        self.family_max = family_max(sock.family)
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
        self.scratch = bytearray(SCRATCH_NBYTES)  # every datagram is read here first, unless it is claimed
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

    def read_locked(self, want, buf: memoryview | None, ep: UdpBase | None, done):
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
                if want is ANY and cap >= self.family_max:
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
            if want is not None and (want is ANY or addr == want):
                if n > cap:
                    # kept, whole, for a receive with a larger buffer: first in its sender's queue
                    # (the any-peer endpoint's: held apart, with its sender)
                    if want is ANY:
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
        take what it routed to them) before it sleeps in poll (:class:`~transports._udp_wait.HubWait`);
        the others wait on the lock's condition, at most ``WAKE_S`` at a time."""
        pause = None  # this call's wait, made when it first finds nothing
        with self.cond:
            while True:
                check()
                got = take(buf)
                if got is not None:
                    return got
                reader = not self.reading
                if reader:
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
                if pause is None:
                    pause = HubWait(self.poller, ep, what=what, timeout_s=timeout_s, deadline=deadline,
                                    spin_s=self.busy_poll_s)
                if reader:
                    self.reading = True
                    self.cond.release()
                    try:
                        pause.pause()  # the lock released: spin on the socket, then sleep in poll
                    finally:
                        self.cond.acquire()
                        self.reading = False
                        if self.waiting:
                            self.cond.notify_all()
                else:
                    left = pause.left_s()
                    self.waiting += 1
                    try:
                        self.cond.wait(WAKE_S if left is None else min(left, WAKE_S))
                    finally:
                        self.waiting -= 1
