"""Many controllers at once: the session layer of the Python decoder service.

:class:`SessionServer` serves every live session of one listener from one thread,
polling them all and never waiting inside one: connections (``tcp://``, ``shm://``)
are accepted off the hot thread and watched with ``epoll``; ``udp://`` senders are
told apart by source address on the listener's one socket, and a new sender's first
datagram is served like any other. Each session has decoder states of its own (the
compiled decoders are shared), except decoders configured ``shared``; the frames are
handled by one :class:`~qlink.qec.service.DecoderService`, a session's turn at a time.

Limits (:class:`SessionLimits`), each counted when it bites:

* a session's turn handles at most ``max_frames_per_turn`` frames, then the next session's
  turn comes (a flooding peer waits in its own socket, or loses datagrams). A session that
  had more waiting than its turn took (it sends faster than it is served) and a udp sender
  most of whose frames were malformed are served *after* the others and with a small
  share: ``_LOW_QUANTUM`` frames a turn for a stream, ``_LOW_PER_ROUND`` datagrams a round
  for all such udp senders together, taken in turn. So a well-behaved controller's frame
  waits behind at most a few of theirs, whatever they send; with nobody else to serve they
  still get the whole service, a round after another. A udp sender most of whose frames were
  malformed gets at most ``_ABUSIVE_ANSWERS_PER_S`` answers a second (the rest are counted as
  ``udp_answers_withheld``): a datagram's source address can be forged, and answering every
  datagram would make the service a reflector of floods;
* a frame half received for ``frame_timeout_s``, or a session silent for
  ``idle_timeout_s`` (``datagram_idle_timeout_s`` for udp, which has no close), is closed
  with a close frame that says why;
* a stream announcing a message longer than ``max_frame_nbytes`` (by default derived from
  the decoders' shot size and queue) is refused from its header alone: a close frame,
  nothing read or allocated from the announced length; read-ahead per connection is
  ``read_ahead_nbytes``; datagrams waiting for their sender's turn are bounded in count
  and bytes across all senders, and the drops are counted per sender;
* beyond ``max_sessions`` a new session is refused with a close frame (status BUSY);
* with a ``token``, tcp clients must prove it in the handshake and every udp datagram must
  carry its HMAC tag and a sequence number of its sender's (:mod:`qlink.access`): a
  datagram whose number its sender already used, or one older than the last
  ``replay_window`` numbers, is refused as ``replayed`` (windows are kept per sender id for
  up to ``replay_senders`` senders); refused peers are counted by reason.

A close frame is a response (``CUQS``) with ``request_id`` 0xFFFFFFFF, which no request
uses here, the status of the reason, and as its result ``qlink-close <reason>: <detail>``
in UTF-8:

>>> frame = encode_close_frame(CloseReason.IDLE_TIMEOUT, "no frame for 30 s")
>>> parse_close_frame(frame)
('idle_timeout', 'no frame for 30 s')
>>> from qlink import wire
>>> r = wire.decode_response(frame); (r.status.name, hex(r.request_id))
('OK', '0xffffffff')
"""

from __future__ import annotations

import collections
import gc
import select
import threading
import time
from typing import Callable

from qlink.access import ReplayGuard, datagram_sender_seq, verify_datagram
from qlink.clock import now_ns
from qlink.errors import BrokenLinkError, ClosedError, WouldBlock
from transports import Backoff, BufferTooSmallError

from ._session_accept import Acceptor, peer_url
from ._session_common import SessionServerBase
from ._session_terms import CLOSE_REQUEST_ID, CloseReason, SessionLimits, encode_close_frame, parse_close_frame

__all__ = ["CLOSE_REQUEST_ID", "CloseReason", "SessionLimits", "SessionServer", "encode_close_frame",
           "parse_close_frame"]

_TIMER_PERIOD_S = 0.005  # how often session timers are looked at while frames flow
_UDP_READS_PER_ROUND = 256  # datagrams read from the shared socket (new senders) in one round
_CLOSES_PER_TICK = 16
# a udp sender most of whose frames were malformed (past this many) is served last, a little a round
_BAD_GRACE = 64
_LOW_QUANTUM = 2  # frames a turn for a stream session that floods (had more than its turn took)
_LOW_PER_ROUND = 4  # datagrams a round for all udp senders that flood or send garbage, together
_ADMITS_PER_PASS = 8  # new stream sessions opened per pass of the serve loop
_ABUSIVE_ANSWERS_PER_S = 100  # answers a second to a udp sender most of whose frames were malformed


class _Session:
    """One controller: its endpoint (or udp address), its decoder states, its timers and counts."""

    __slots__ = ("sid", "ep", "addr", "decoders", "active", "opened", "last_frame", "partial_since", "frames",
                 "dropped", "blocked", "queue", "url", "fd", "buffered", "bad", "sock", "heavy", "answers",
                 "answers_since")

    def __init__(self, sid: int, ep, addr, now: float) -> None:
        self.sid = sid
        self.ep = ep  # None for a udp sender
        self.addr = addr
        self.decoders = self.active = None  # its decoder states, made when its first frame is served
        self.opened = self.last_frame = now
        self.partial_since: float | None = None
        self.frames = 0
        self.dropped = 0  # udp: datagrams dropped beyond its share or the queue's bound
        self.bad = 0  # its frames refused as malformed
        self.sock = None  # udp: its own connected socket on the listener's address, if it has one
        self.blocked = False  # an answer found its socket full: the peer does not read
        self.queue: list = []  # udp: (offset, nbytes) of its datagrams waiting in the arena
        self.heavy = False  # its last turn left frames waiting: it sends faster than it is served
        self.answers = 0  # udp, a mostly malformed sender: answers sent since ``answers_since``
        self.answers_since = now
        self.url = peer_url(ep) if addr is None else f"udp://{addr[0]}:{addr[1]}"
        self.fd = ep.fileno() if ep is not None and hasattr(ep, "fileno") else -1
        self.buffered = getattr(type(ep), "rx_buffered_nbytes", None) is not None

    def send(self, data) -> None:  # the service's answers: never wait on a peer that does not read
        try:
            self.ep.send_nowait(data)
        except WouldBlock:
            self.blocked = True


class SessionServer(SessionServerBase):
    """Serves every session of ``listener`` with ``service`` (see the module docstring).

    ``on_session_end(report)`` is called as each session ends, with the service's report
    and this server's (``sessions``, ``refused_peers``, the ended session's reason).
    ``token``: the shared secret udp datagrams must be signed with (tcp checks its own in
    the handshake: give the listener the same token); replays are refused (see the module
    docstring).
    """

    def __init__(self, service, listener, *, limits: SessionLimits | None = None, token: bytes | None = None,
                 on_session_end: Callable[[dict], None] | None = None) -> None:
        self._init_common(service, listener, limits=limits, on_session_end=on_session_end)
        self.token = token
        self._serving: tuple | None = None  # (thread id, wall and CPU clocks) while serve() runs
        self.max_frame = min(self.max_frame, len(service._rx))
        self._rx = service._rx_mv[:self.max_frame]
        self._by_fd: dict[int, _Session] = {}
        self._polled: list[_Session] = []  # sessions without an fd: looked at every loop
        self._again: set = set()  # sessions whose last turn stopped at the frame cap: more is waiting
        self._incoming: collections.deque = collections.deque()
        self._replay: ReplayGuard | None = None
        if self.datagram:
            self._udp = listener.serve_endpoint()
            self._udp_read = self._udp.socket_reader()
            self._epoll.register(self._udp.fileno(), select.EPOLLIN)
            self._udp_by_fd: dict[int, _Session] = {}  # a sender's own socket -> its session
            self._per_sender = True  # off if the listener cannot give senders sockets of their own
            self._low_turn = 0  # which of the flooding / garbage senders is read first next round
            self._scratch = bytearray(1 << 16)
            self._scratch_mv = memoryview(self._scratch)
            self._arena = bytearray(self.limits.max_queued_nbytes)
            self._arena_mv = memoryview(self._arena)
            self._replay = None if token is None else ReplayGuard(window=self.limits.replay_window,
                                                                  max_senders=self.limits.replay_senders)
        else:  # off the hot thread: handshaken endpoints handed over, bounded
            self._acceptor = Acceptor(listener, bound=2 * self.limits.max_sessions, refused=self.refused)
            self._incoming = self._acceptor.incoming

    # ------------------------------------------------------------------ accepting
    def _admit(self, now: float) -> None:
        """Open sessions for endpoints the acceptor handed over, ``_ADMITS_PER_PASS`` a pass:
        a crowd connecting at once is let in between other sessions' frames."""
        for _ in range(min(len(self._incoming), _ADMITS_PER_PASS)):
            ep = self._incoming.popleft()
            if self._no_room_for(ep):
                continue
            s = self._open(ep, None, now)
            if s.fd >= 0:
                self._by_fd[s.fd] = s
                self._epoll.register(s.fd, select.EPOLLIN)
                self._again.add(s)  # it may have sent before it was admitted
            else:
                self._polled.append(s)

    def _open(self, ep, addr, now: float) -> _Session:
        s = _Session(self._next_sid, ep, addr, now)
        self._next_sid += 1
        self.sessions[s.sid if addr is None else addr] = s
        self.counts["sessions_opened"] += 1
        self.max_live = max(self.max_live, len(self.sessions))
        return s

    # ------------------------------------------------------------------ closing
    def _close(self, s: _Session, reason: CloseReason | str, detail: str = "") -> None:
        key = self._say_close(s, reason, detail)
        if s.ep is None:
            self.sessions.pop(s.addr, None)
            if s.sock is not None:
                self._udp_by_fd.pop(s.sock.fileno(), None)
                try:
                    self._epoll.unregister(s.sock.fileno())
                except (OSError, ValueError):
                    pass
                s.sock.close()
                s.sock = None
            if s.dropped:
                self.udp_dropped_by_sender[s.url] = self.udp_dropped_by_sender.get(s.url, 0) + s.dropped
        else:
            self.sessions.pop(s.sid, None)
            self._again.discard(s)
            if s.fd >= 0:
                self._by_fd.pop(s.fd, None)
                try:
                    self._epoll.unregister(s.fd)
                except (OSError, ValueError):
                    pass
            elif s in self._polled:
                self._polled.remove(s)
        stats = self._let_go(s.ep)
        self.ended += 1
        if self.on_session_end is not None:
            self.on_session_end(self.report(ended=s, reason=key, transport_statistics=stats))

    # ------------------------------------------------------------------ turns
    def _bind(self, s: _Session) -> None:
        svc = self.svc
        if s.decoders is None:  # (tens of µs each: not for sessions that never send, nor all at once)
            s.decoders, s.active = svc._session_states()
        svc._decoders = s.decoders
        svc._active = s.active
        if s.ep is None:
            sendto = self._udp.sendto
            if _mostly_malformed(s):  # abusive: its answers are rationed
                sendto = self._rationed(s, sendto)
            svc._ep, svc._sendto, svc._peer = None, sendto, s.addr
        else:
            svc._ep, svc._sendto, svc._peer = s, None, None

    def _rationed(self, s: _Session, sendto):
        """``sendto`` for an abusive udp sender: ``_ABUSIVE_ANSWERS_PER_S`` answers a second."""
        counts = self.counts

        def send(data, addr) -> None:
            t = time.monotonic()
            if t - s.answers_since >= 1.0:
                s.answers_since, s.answers = t, 0
            if s.answers >= _ABUSIVE_ANSWERS_PER_S:
                counts["udp_answers_withheld"] += 1
                return
            s.answers += 1
            sendto(data, addr)
        return send

    def _turn_stream(self, s: _Session, now: float) -> bool:
        """Up to the frame cap of one stream session's frames; True if it handled any."""
        svc = self.svc
        self._bind(s)
        recv = s.ep.recv_into_nowait
        rx = self._rx
        handle = svc._handle
        cap = _LOW_QUANTUM if s.heavy and len(self.sessions) > 1 else self.limits.max_frames_per_turn
        n_batch = 0
        drained = False
        t_busy = 0
        try:
            while n_batch < cap:
                try:
                    n = recv(rx)
                except WouldBlock:
                    drained = True
                    break
                t = now_ns()
                if not n_batch:
                    t_busy = t
                handle(n, t)
                n_batch += 1
            if n_batch:
                svc._flush()
                svc._busy_ns += svc._t_ready - t_busy
        except BufferTooSmallError as e:
            svc._flush()
            svc.faults["oversized_frame"] += 1
            self._close(s, CloseReason.OVERSIZED_FRAME,
                        f"a message of {e.needed_nbytes} bytes was announced; the longest frame this service "
                        f"takes is {self.max_frame} bytes")
            return bool(n_batch)
        except (BrokenLinkError, ClosedError):
            svc._n_staged = 0
            svc._st_plan = [None] * len(svc._st_plan)
            self._close(s, "peer_closed")
            return bool(n_batch)
        except Exception as e:  # a fault of this session's must not stop the others
            svc._n_staged = 0
            svc._st_plan = [None] * len(svc._st_plan)
            svc.faults["session_exception"] += 1
            self._close(s, CloseReason.INTERNAL_ERROR, f"{type(e).__name__}: {e}")
            return bool(n_batch)
        if n_batch:
            s.frames += n_batch
            s.last_frame = now
            s.partial_since = None
        if s.blocked:
            self._close(s, CloseReason.PEER_NOT_READING, "answers could not be sent: the peer does not read them")
            return bool(n_batch)
        s.heavy = not drained
        if not drained:
            self._again.add(s)
        elif drained and s.buffered and s.partial_since is None and s.ep.rx_buffered_nbytes:
            s.partial_since = now  # a frame is half here: its clock starts
        return bool(n_batch)

    def _udp_round(self, now: float) -> bool:
        """Read what the sockets hold, queue each datagram for its sender's turn (bounded), then
        serve each sender with datagrams: the well-behaved ones first, in order of arrival."""
        recvfrom = self._udp_read
        amv = self._arena_mv
        share = self.limits.max_frames_per_turn
        order: list = []
        used = queued = reads = 0
        # first the well-behaved senders' own sockets (each its share, the rest waits there), then
        # a few datagrams of the senders that flood or send garbage, in turn, then the shared one
        if self._udp_by_fd:
            low = []
            for fd, _ev in self._epoll.poll(0):
                s = self._udp_by_fd.get(fd)
                if s is None:
                    continue
                if (s.heavy or _mostly_malformed(s)) and len(self.sessions) > 1:
                    low.append(s)
                    continue
                got, used, queued = self._read_sender(s, share, now, order, used, queued)
                reads += got
                s.heavy = got >= share
            if low:
                budget = _LOW_PER_ROUND
                first = self._low_turn % len(low)
                self._low_turn += 1
                for s in low[first:] + low[:first]:
                    if budget <= 0:
                        break
                    want = min(_LOW_QUANTUM, budget)
                    got, used, queued = self._read_sender(s, want, now, order, used, queued)
                    reads += got
                    budget -= got
                    s.heavy = got >= want  # (it keeps up again: back among the others)
        got, used, queued = self._read_some(recvfrom, _UDP_READS_PER_ROUND, now, order, used, queued,
                                            past_errors=True)  # (an ICMP error queued on it: read on)
        reads += got
        self.counts["udp_datagrams_read"] += reads
        if not order:
            return reads > 0
        svc = self.svc
        rx = svc._rx_mv
        handle = svc._handle
        refused = svc._counts
        for s in order:
            self._bind(s)
            t_busy = 0
            bad0 = refused["frames_refused"]
            try:
                for i, (off, n) in enumerate(s.queue):
                    rx[:n] = amv[off:off + n]
                    t = now_ns()
                    if not i:
                        t_busy = t
                    handle(n, t)
                svc._flush()
                svc._busy_ns += svc._t_ready - t_busy
            except Exception as e:
                svc._n_staged = 0
                svc._st_plan = [None] * len(svc._st_plan)
                svc.faults["session_exception"] += 1
                s.queue.clear()
                self._close(s, CloseReason.INTERNAL_ERROR, f"{type(e).__name__}: {e}")
                continue
            s.frames += len(s.queue)
            s.bad += refused["frames_refused"] - bad0
            s.queue.clear()
            s.last_frame = now
        return True

    def _read_sender(self, s: _Session, most: int, now: float, order: list, used: int,
                     queued: int) -> tuple[int, int, int]:
        """Up to ``most`` datagrams from ``s``'s own socket into the arena: (read, used, queued)."""
        return self._read_some(s.sock.recvfrom_into, most, now, order, used, queued, past_errors=False)

    def _read_some(self, read, most: int, now: float, order: list, used: int, queued: int, *,
                   past_errors: bool) -> tuple[int, int, int]:
        """Up to ``most`` reads with ``read`` (a socket's ``recvfrom_into``), each datagram taken
        in (:meth:`_intake`); a socket error is counted and ends the reads, or with
        ``past_errors`` is read past. Returns (datagrams read, arena bytes used, queued)."""
        scratch = self._scratch
        got = tries = 0
        while tries < most:
            tries += 1
            try:
                n, addr = read(scratch)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.counts["udp_socket_errors"] += 1
                if past_errors:
                    continue
                break
            got += 1
            used, queued = self._intake(n, addr, now, order, used, queued)
        return got, used, queued

    def _intake(self, n: int, addr, now: float, order: list, used: int, queued: int) -> tuple[int, int]:
        """One datagram (in the scratch buffer) from ``addr``: queued for its sender's turn, or
        refused / dropped and counted. Returns the arena's new (bytes used, datagrams queued)."""
        lim = self.limits
        if self.token is not None:
            n = verify_datagram(self._scratch, n, self.token)
            if n < 0:
                self.refused["udp_bad_hmac"] += 1
                return used, queued
            refusal = self._replay.check(*datagram_sender_seq(self._scratch, n))
            if refusal is not None:
                self.refused[refusal] += 1
                return used, queued
        sessions = self.sessions
        s = sessions.get(addr)
        if s is None:
            if self._no_room_for(addr=addr):
                return used, queued
            s = self._open(None, addr, now)
            self._give_socket(s, now, order)
        if n > self.max_frame:
            self.svc.faults["oversized_frame"] += 1
            s.dropped += 1
            return used, queued
        cap = 1 if _mostly_malformed(s) else lim.max_frames_per_turn
        if len(s.queue) >= cap or queued >= lim.max_queued_datagrams or used + n > len(self._arena):
            s.dropped += 1
            self.counts["udp_dropped"] += 1
            return used, queued
        self._arena_mv[used:used + n] = self._scratch_mv[:n]
        if not s.queue:
            order.append(s)
        s.queue.append((used, n))
        return used + n, queued + 1

    def _give_socket(self, s: _Session, now: float, order: list) -> None:
        """A new sender's own socket (see :meth:`transports.udp.UdpServeEndpoint.peer_socket`)."""
        if not self._per_sender:
            return
        try:
            sock = self._udp.peer_socket(s.addr)
        except (ValueError, OSError):
            self._per_sender = False  # (a listener without reuse_port, or no room for sockets)
            return
        s.sock = sock
        self._udp_by_fd[sock.fileno()] = s
        self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _timers(self, now: float) -> None:
        """Close the sessions whose time is up (at most ``_CLOSES_PER_TICK`` per call, so that
        many sessions timing out together cost the others one short pause each tick)."""
        lim = self.limits
        idle = self.idle_timeout_s
        start = self.ended
        for s in list(self.sessions.values()):
            if self.ended - start >= _CLOSES_PER_TICK:
                break
            if s.partial_since is not None and lim.frame_timeout_s is not None \
                    and now - s.partial_since >= lim.frame_timeout_s:
                self._close(s, CloseReason.FRAME_TIMEOUT,
                            f"a frame stayed half received for {lim.frame_timeout_s} s")
            elif idle is not None and now - s.last_frame >= idle:
                self._close(s, CloseReason.IDLE_TIMEOUT, f"no frame for {idle} s")
            elif lim.session_timeout_s is not None and now - s.opened >= lim.session_timeout_s:
                self._close(s, CloseReason.SESSION_TIMEOUT, f"sessions last at most {lim.session_timeout_s} s")

    # ------------------------------------------------------------------ loop
    def run(self, *, stop_event: threading.Event | None = None, max_sessions_served: int | None = None,
            first_session_timeout_s: float | None = None, spin: int = 20000) -> dict:
        """Serve until ``stop_event`` is set or ``max_sessions_served`` sessions have ended.
        QlinkTimeoutError when no session opened within ``first_session_timeout_s``."""
        svc = self.svc
        backoff = Backoff(spin=spin, max_sleep_s=2e-4)
        give_up = None if first_session_timeout_s is None else time.monotonic() + first_session_timeout_s
        next_timers = 0.0
        epoll = self._epoll
        by_fd = self._by_fd
        gc.freeze()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        self._serving = (threading.get_ident(), wall0, cpu0)
        svc._counts["serve_calls"] += 1
        try:
            while True:
                now = time.monotonic()
                busy = False
                if self._incoming:
                    self._admit(now)
                    busy = bool(self._incoming)  # (more to let in: no sleep before the next pass)
                if self._udp is not None:
                    busy |= self._udp_round(now)
                if by_fd:
                    todo, self._again = self._again, set()
                    for fd, _ev in epoll.poll(0):
                        s = by_fd.get(fd)
                        if s is not None:
                            todo.add(s)
                    if len(todo) > 1:  # the sessions that flood take their (short) turns last
                        todo = sorted(todo, key=_heavy_last)
                    for s in todo:
                        if s.fd in by_fd:  # (not closed by an earlier turn)
                            busy |= self._turn_stream(s, now)
                for s in self._polled[:]:
                    busy |= self._turn_stream(s, now)
                if busy:
                    backoff.reset()
                if now >= next_timers or not busy:
                    if now >= next_timers:
                        self._timers(now)
                        next_timers = now + _TIMER_PERIOD_S
                    if self._done(now, stop_event=stop_event, max_sessions_served=max_sessions_served,
                                  give_up=give_up, first_session_timeout_s=first_session_timeout_s):
                        break
                if not busy:
                    if backoff.spinning or self._polled:
                        backoff.pause()
                    else:  # idle: sleep in epoll, woken by the first byte (or a new session within 1 ms)
                        epoll.poll(0.001)
        finally:
            svc._use_states(*svc._home)
            svc._ep = svc._sendto = svc._peer = None
            svc.stages.settle()
            svc._serve_wall_s += time.perf_counter() - wall0
            svc._serve_cpu_s += time.thread_time() - cpu0
            self._serving = None
        return self.report()

    # ------------------------------------------------------------------ results
    def report(self, *, ended: _Session | None = None, reason: str | None = None, transport_statistics=None) -> dict:
        """The service's report plus the sessions': live, opened, ended by reason, refused peers by reason."""
        svc = self.svc
        if ended is not None and not ended.frames:
            # a session that sent no frame changed nothing the service measures: a short report
            # (a full one costs about a millisecond, and many idle sessions may end together)
            rep = {"counts": dict(svc.counts), "faults": dict(svc.faults), "statuses": dict(svc.statuses)}
        else:
            decs = svc._decoders, svc._active
            svc._use_states(*svc._home)
            try:
                rep = svc.report()
            finally:
                svc._use_states(*decs)
        serving = self._serving
        if serving is not None and serving[0] == threading.get_ident() and "serve_wall_s" in rep:
            # a session's report while the serve loop runs: its wall and CPU time so far
            rep["serve_wall_s"] += time.perf_counter() - serving[1]
            rep["serve_cpu_s"] += time.thread_time() - serving[2]
        self._sessions_report(rep)
        if self._replay is not None:
            rep["sessions"]["replay_windows"] = len(self._replay)
            rep["sessions"]["replay_windows_evicted"] = self._replay.evicted
        drops = dict(self.udp_dropped_by_sender)
        for s in self.sessions.values():
            if s.dropped:
                drops[s.url] = drops.get(s.url, 0) + s.dropped
        if self.datagram:
            rep["udp_dropped_by_sender"] = dict(sorted(drops.items(), key=lambda kv: -kv[1])[:64])
        if ended is not None:
            rep["session"] = {"id": ended.sid, "peer": ended.url, "reason": reason, "frames": ended.frames,
                              "duration_s": time.monotonic() - ended.opened, "dropped": ended.dropped}
            if transport_statistics is not None:
                rep["transport_statistics"] = transport_statistics
        return rep


def _mostly_malformed(s: _Session) -> bool:
    """A udp sender past its grace most of whose frames were refused as malformed."""
    return s.bad > _BAD_GRACE and 2 * s.bad > s.frames


def _heavy_last(s: _Session) -> bool:
    return s.heavy
