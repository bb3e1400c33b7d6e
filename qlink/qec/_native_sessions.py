"""Many controllers at once on the native engine: the session layer over the C service core.

:class:`NativeSessionServer` gives every session a :class:`~qlink.qec.hotpath.NativeDecoderService`
core of its own (its own decoder states and link: shm rings, a tcp or udp socket, a UCX
endpoint) and serves them all from one thread with ``_hotcore.serve_sessions``: each pass
gives every session with input a turn of at most ``max_frames_per_turn`` frames, decodes
its shots and writes its answers, then the next session's turn comes; a session that sends
faster than it is served takes short turns after the others. The per-frame work never
enters Python; the loop comes back to this control plane only when a session needs it (a
close, a refusal, a clock that ran out, a frame for the endpoint's own code), when new
sessions wait to be let in, and every ``_PERIOD_S`` (peers, stop flag, session clocks).

The limits are those of :class:`~qlink.qec.sessions.SessionLimits`, kept the same way as
the Python engine keeps them, with the same close frames: a frame half received for
``frame_timeout_s`` and a session silent for ``idle_timeout_s`` (``datagram_idle_timeout_s``
over udp) are closed; a stream announcing more than ``max_frame_nbytes`` is refused from its
header, nothing read; read-ahead per connection is ``read_ahead_nbytes``; beyond
``max_sessions`` a new session is refused with status BUSY; a peer that does not read its
answers is closed (``peer_not_reading``) rather than waited on. Over udp each sender gets a
socket of its own on the listener's address (its datagrams queue apart from everyone
else's); the first datagram of a new sender is answered like any other. A udp sender most of
whose frames were malformed (past 64 of them) gets at most ``_ABUSIVE_ANSWERS_PER_S`` answers
a second, the rest counted as ``answers_withheld``: a datagram's source address can be forged,
and the service must not reflect a flood. A sender's datagrams wait in its own socket's
receive buffer (the kernel's, at most ``net.core.rmem_max``; with at most ``max_sessions``
senders, that bounds them all); what the kernel drops there is counted per sender
(``udp_dropped_by_sender``, from ``/proc/net/udp``).

Not here (the Python engine has them): decoders ``shared`` between sessions, and udp tokens
(HMAC).
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Callable

from qlink.errors import BrokenLinkError, ClosedError

from ._session_accept import Acceptor, abort_endpoint, peer_url
from ._session_common import SessionServerBase
from ._session_terms import CloseReason, SessionLimits

__all__ = ["NativeSessionServer"]

_PERIOD_S = 0.02  # the C loop comes back this often, busy or not
_LOW_QUANTUM = 2  # frames a turn for a session that floods
_UDP_READS_PER_WAKE = 256
_CLOSES_PER_TICK = 16
_ABUSIVE_ANSWERS_PER_S = 100  # answers a second to a udp sender most of whose frames were malformed
# serve_sessions' return codes (qlink/qec/_hotcore_sessions.h)
_PERIOD, _SLOW, _CLOSED, _OVERSIZED, _WAKE, _FRAME_TIMEOUT, _IDLE_TIMEOUT, _BLOCKED = range(8)


class _NativeSession:
    __slots__ = ("sid", "ep", "addr", "sock", "core", "keep", "opened", "url", "fd")

    def __init__(self, sid: int, ep, addr, sock, core, keep, now: float) -> None:
        self.sid = sid
        self.ep = ep  # None for a udp sender
        self.addr = addr
        self.sock = sock  # udp: the sender's own socket
        self.core = core
        self.keep = keep
        self.opened = now
        self.url = peer_url(ep) if addr is None else f"udp://{addr[0]}:{addr[1]}"
        self.fd = -1


class NativeSessionServer(SessionServerBase):
    """Serves every session of ``listener`` with the native ``service`` (see the module
    docstring); the interface of :class:`~qlink.qec.sessions.SessionServer` (``run``,
    ``close``, ``report``, ``ended``)."""

    def __init__(self, service, listener, *, limits: SessionLimits | None = None,
                 on_session_end: Callable[[dict], None] | None = None) -> None:
        from . import hotpath

        hotpath._need()
        shared = sorted(did for did, (cfg, _dec) in service._decoders.items() if getattr(cfg, "shared", False))
        if shared:
            raise ValueError(f"decoder(s) {shared} are configured shared between sessions, which the native engine "
                             "does not do (each session has decoder states of its own): serve them with "
                             "engine='python', or drop 'shared'")
        self._hotcore = hotpath._hotcore
        self._native_link = hotpath.native_link
        self._init_common(service, listener, limits=limits, on_session_end=on_session_end)
        self._cores: list = []  # the live sessions' cores, in the order served
        self._by_core: dict = {}
        self.first_admit_error: str | None = None
        self._wake = bytearray(1)
        self._wake_fd = -1
        self._buf = bytearray(1 << 16)
        self._mv = memoryview(self._buf)
        if self.datagram:
            self._udp = listener.serve_endpoint()
            self._udp_read = self._udp.socket_reader()
            self._wake_fd = self._udp.fileno()
            self._epoll.register(self._wake_fd, select.EPOLLIN)
        else:
            self._acceptor = Acceptor(listener, bound=2 * self.limits.max_sessions, refused=self.refused,
                                      on_new=self._woken)

    def _woken(self) -> None:
        self._wake[0] = 1

    # ------------------------------------------------------------------ letting in
    def _open(self, ep, addr, link, now: float, sock=None) -> _NativeSession:
        lim = self.limits
        core, keep = self.svc.session_core(link, read_ahead_nbytes=lim.read_ahead_nbytes,
                                           max_frame_nbytes=self.max_frame,
                                           ration_answers_per_s=_ABUSIVE_ANSWERS_PER_S if addr is not None else 0)
        s = _NativeSession(self._next_sid, ep, addr, sock, core, keep, now)
        self._next_sid += 1
        self.sessions[s.sid if addr is None else addr] = s
        self._cores.append(core)
        self._by_core[id(core)] = s
        fd = sock.fileno() if sock is not None else (ep.fileno() if ep is not None and self.scheme == "tcp" else -1)
        if fd >= 0:
            s.fd = fd
            self._epoll.register(fd, select.EPOLLIN)
        self.counts["sessions_opened"] += 1
        self.max_live = max(self.max_live, len(self.sessions))
        return s

    def _admit(self, now: float) -> None:
        """The endpoints the acceptor handed over: a session each, or refused beyond ``max_sessions``."""
        incoming = self._acceptor.incoming
        while incoming:
            ep = incoming.popleft()
            if self._no_room_for(ep):
                continue
            try:
                link = self._native_link(ep)
                self._open(ep, None, link, now)
            except Exception as e:  # (an endpoint the native core cannot take: counted, said why, closed)
                self.refused["native_link_failed"] += 1
                self.first_admit_error = self.first_admit_error or f"{type(e).__name__}: {e}"
                abort_endpoint(ep)

    def _udp_intake(self, now: float) -> None:
        """Datagrams on the listener's socket: a new sender's first ones open its session (with
        a socket of its own, where its later datagrams queue); a known sender's stragglers go to
        its core, in the order they came."""
        buf, mv = self._buf, self._mv
        lim = self.limits
        fresh: dict = {}  # a new sender's datagrams of this intake, in order
        for _ in range(_UDP_READS_PER_WAKE):
            try:
                n, addr = self._udp_read(buf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.counts["udp_socket_errors"] += 1
                continue
            s = self.sessions.get(addr)
            if s is not None:
                s.core.handle(mv[:n])
                continue
            if n > self.max_frame:
                self.svc._extra["oversized_frame"] += 1
                url = f"udp://{addr[0]}:{addr[1]}"
                self.udp_dropped_by_sender[url] = self.udp_dropped_by_sender.get(url, 0) + 1
                continue
            if addr in fresh:
                fresh[addr].append(bytes(mv[:n]))
                continue
            if self._no_room_for(addr=addr, waiting=len(fresh)):
                continue
            fresh[addr] = [bytes(mv[:n])]
        for addr, first in fresh.items():
            try:
                sock = self._udp.peer_socket(addr)
            except (ValueError, OSError):
                self.refused["no_socket_for_sender"] += 1
                continue
            self._open(None, addr, (sock.fileno(), first, (addr[0], addr[1])), now, sock=sock)

    # ------------------------------------------------------------------ closing
    def _close(self, s: _NativeSession, reason: CloseReason | str, detail: str = "") -> None:
        # (a peer that does not read gets no close frame: its stream may end mid-answer)
        key = self._say_close(s, reason if reason is not CloseReason.PEER_NOT_READING else reason.value, detail)
        self.sessions.pop(s.sid if s.addr is None else s.addr, None)
        self._cores.remove(s.core)
        self._by_core.pop(id(s.core), None)
        if s.fd >= 0:
            try:
                self._epoll.unregister(s.fd)
            except (OSError, ValueError):
                pass
        frames = s.core.counts()["requests"]
        self.svc.end_session(s.core)
        stats = self._let_go(s.ep)
        if s.sock is not None:
            drops = _udp_drops_by_inode().get(os.fstat(s.sock.fileno()).st_ino, 0)
            if drops:
                self.udp_dropped_by_sender[s.url] = self.udp_dropped_by_sender.get(s.url, 0) + drops
            s.sock.close()
        self.ended += 1
        if self.on_session_end is not None:
            self.on_session_end(self.report(ended=s, frames=frames, reason=key, transport_statistics=stats))

    def _look(self, now: float) -> None:
        """Every period: peers gone without a word (shm, ucx), and sessions past their time."""
        lim = self.limits
        start = self.ended
        for s in list(self.sessions.values()):
            if self.ended - start >= _CLOSES_PER_TICK:
                break
            if s.ep is not None and self.scheme != "tcp":
                try:
                    check = getattr(s.ep, "check_peer", None)
                    if check is not None:
                        check()
                except (BrokenLinkError, ClosedError):
                    self._close(s, "peer_closed")
                    continue
            if lim.session_timeout_s is not None and now - s.opened >= lim.session_timeout_s:
                self._close(s, CloseReason.SESSION_TIMEOUT, f"sessions last at most {lim.session_timeout_s} s")

    def _event(self, code: int, i: int) -> None:
        """What session ``i`` of the last call needs."""
        core = self._cores[i]
        s = self._by_core[id(core)]
        lim = self.limits
        if code == _SLOW:
            try:
                self.svc._slow_frame(s.ep, self._buf, self._mv, core)
            except (BrokenLinkError, ClosedError):
                self._close(s, "peer_closed")
        elif code == _CLOSED:
            self._close(s, "peer_closed")
        elif code == _OVERSIZED:
            self.svc._extra["oversized_frame"] += 1
            self._close(s, CloseReason.OVERSIZED_FRAME, f"a message longer than {self.max_frame} bytes was announced; "
                        f"the longest frame this service takes is {self.max_frame} bytes")
        elif code == _FRAME_TIMEOUT:
            self._close(s, CloseReason.FRAME_TIMEOUT, f"a frame stayed half received for {lim.frame_timeout_s} s")
        elif code == _IDLE_TIMEOUT:
            self._close(s, CloseReason.IDLE_TIMEOUT, f"no frame for {self.idle_timeout_s} s")
        elif code == _BLOCKED:
            self._close(s, CloseReason.PEER_NOT_READING, "answers could not be sent: the peer does not read them")

    # ------------------------------------------------------------------ loop
    def run(self, *, stop_event: threading.Event | None = None, max_sessions_served: int | None = None,
            first_session_timeout_s: float | None = None) -> dict:
        """Serve until ``stop_event`` is set or ``max_sessions_served`` sessions have ended.
        QlinkTimeoutError when no session opened within ``first_session_timeout_s``."""
        lim = self.limits
        give_up = None if first_session_timeout_s is None else time.monotonic() + first_session_timeout_s
        idle = self.idle_timeout_s
        ft_ns = 0 if lim.frame_timeout_s is None else int(lim.frame_timeout_s * 1e9)
        it_ns = 0 if idle is None else int(idle * 1e9)
        period_ns = int(_PERIOD_S * 1e9)
        serve = self._hotcore.serve_sessions
        epfd = self._epoll.fileno()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        self.svc._extra["serve_calls"] += 1
        try:
            while True:
                now = time.monotonic()
                if self._acceptor is not None:
                    # the flag down before the queue is read: an endpoint queued after this read
                    # raises it again (its on_new comes after its append), and one queued before is
                    # admitted now. Lowered only when the queue was not empty, a flag raised just
                    # after that queue was emptied stayed up, and every serve_sessions call
                    # returned at once for a wake-up with nobody to let in.
                    self._wake[0] = 0
                    if self._acceptor.incoming:
                        self._admit(now)
                if self._udp is not None:
                    self._udp_intake(now)
                if self._done(now, stop_event=stop_event, max_sessions_served=max_sessions_served, give_up=give_up,
                              first_session_timeout_s=first_session_timeout_s):
                    break
                if not self._cores:  # nobody to serve: wait for someone (no spinning)
                    if self._acceptor is not None:
                        self._acceptor.wait(timeout_s=_PERIOD_S * 5)
                    else:
                        self._epoll.poll(_PERIOD_S * 5)
                    continue
                code, i = serve(self._cores, self._wake, epfd, self._wake_fd, period_ns, ft_ns, it_ns,
                                lim.max_frames_per_turn, _LOW_QUANTUM)
                if code == _WAKE:
                    continue
                if code == _PERIOD:
                    self._look(time.monotonic())
                    continue
                self._event(code, i)
        finally:
            self.svc._wall_s += time.perf_counter() - wall0
            self.svc._cpu_s += time.thread_time() - cpu0
        return self.report()

    # ------------------------------------------------------------------ results
    def report(self, *, ended: _NativeSession | None = None, frames: int = 0, reason: str | None = None,
               transport_statistics=None) -> dict:
        """The service's report plus the sessions': live, opened, ended by reason, refused peers by reason."""
        rep = self.svc.report()
        self._sessions_report(rep)
        if self.first_admit_error is not None:
            rep["sessions"]["first_admit_error"] = self.first_admit_error
        if self.datagram:  # (what the kernel dropped from each sender's own socket: its buffer was full)
            rep["sessions"]["udp_answers_withheld"] = rep["counts"].get("answers_withheld", 0)
            drops = dict(self.udp_dropped_by_sender)
            by_inode = _udp_drops_by_inode()
            for s in self.sessions.values():
                if s.sock is not None:
                    n = by_inode.get(os.fstat(s.sock.fileno()).st_ino, 0)
                    if n:
                        drops[s.url] = drops.get(s.url, 0) + n
            rep["udp_dropped_by_sender"] = dict(sorted(drops.items(), key=lambda kv: -kv[1])[:64])
        if ended is not None:
            rep["session"] = {"id": ended.sid, "peer": ended.url, "reason": reason, "frames": frames,
                              "duration_s": time.monotonic() - ended.opened, "dropped": 0}
            if transport_statistics is not None:
                rep["transport_statistics"] = transport_statistics
        return rep


def _udp_drops_by_inode() -> dict[int, int]:
    """Datagrams the kernel dropped per udp socket (its receive buffer was full), by socket
    inode, from ``/proc/net/udp`` and ``udp6`` (empty where they cannot be read)."""
    out: dict[int, int] = {}
    for name in ("/proc/net/udp", "/proc/net/udp6"):
        try:
            with open(name) as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) >= 13:
                        out[int(parts[9])] = int(parts[-1])
        except (OSError, ValueError):
            continue
    return out
