"""What both engines' session servers do alike (:class:`~qlink.qec.sessions.SessionServer`,
:class:`~qlink.qec._native_sessions.NativeSessionServer`): their shared state, the close frame
and its count, refusing a session beyond ``max_sessions``, letting an endpoint go, the end of
the serve loop, the sessions' part of a report, and closing every session when the service
stops."""

from __future__ import annotations

import collections
import select
import threading
from typing import Callable

from qlink.errors import QlinkTimeoutError

from ._session_accept import Acceptor, abort_endpoint
from ._session_terms import CloseReason, SessionLimits, encode_close_frame

__all__ = ["SessionServerBase"]


class SessionServerBase:
    """The state both servers keep (:meth:`_init_common`); a server closes one session with
    ``_close(session, reason, detail)``."""

    def _init_common(self, service, listener, *, limits: SessionLimits | None,
                     on_session_end: Callable[[dict], None] | None) -> None:
        self.svc = service
        self.limits = limits or SessionLimits()
        self.listener = listener
        self.on_session_end = on_session_end
        caps = getattr(listener, "capabilities", None)
        if caps is None:
            import transports

            caps = transports.capabilities(listener.url)
        self.datagram = not caps.reliable
        self.scheme = caps.name
        self.max_frame = self.limits.max_frame_nbytes or service.max_frame_nbytes()
        self.sessions: dict = {}  # sid -> session (streams), address -> session (udp)
        self._next_sid = 0
        self.counts: collections.Counter = collections.Counter()
        self.closed_by_reason: collections.Counter = collections.Counter()
        self.refused: collections.Counter = collections.Counter()
        self.udp_dropped_by_sender: dict = {}
        self.ended = 0
        self.max_live = 0
        self._acceptor: Acceptor | None = None
        self._epoll = select.epoll()
        self._udp = None

    @property
    def idle_timeout_s(self) -> float | None:
        """How long a session may stay silent: ``datagram_idle_timeout_s`` over udp (which has
        no close), ``idle_timeout_s`` otherwise."""
        return self.limits.datagram_idle_timeout_s if self.datagram else self.limits.idle_timeout_s

    def close(self, *, reason: CloseReason = CloseReason.SERVICE_STOPPING) -> None:
        """Close every session (a close frame each, no report) and stop accepting."""
        cb, self.on_session_end = self.on_session_end, None
        for s in list(self.sessions.values()):
            self._close(s, reason, "the service is stopping")
        self.on_session_end = cb
        if self._acceptor is not None:
            self._acceptor.stop()
        if self._udp is not None:
            self._udp.close()
        self._epoll.close()

    def _say_close(self, s, reason: CloseReason | str, detail: str) -> str:
        """Count a session's close by reason and, for a :class:`CloseReason`, send it the close
        frame that says why (udp: to its address); returns the reason's name."""
        key = reason.value if isinstance(reason, CloseReason) else reason
        self.closed_by_reason[key] += 1
        if isinstance(reason, CloseReason):
            frame = encode_close_frame(reason, detail)
            try:
                if s.ep is None:
                    self._udp.sendto(frame, s.addr)
                else:
                    s.ep.send_nowait(frame)
            except Exception:  # the peer may be gone or full: the close goes ahead
                pass
        return key

    def _done(self, now: float, *, stop_event: threading.Event | None, max_sessions_served: int | None,
              give_up: float | None, first_session_timeout_s: float | None) -> bool:
        """True when the serve loop should end (``max_sessions_served`` ended, or ``stop_event``
        set); QlinkTimeoutError when no session opened by ``give_up`` (monotonic s)."""
        if max_sessions_served is not None and self.ended >= max_sessions_served:
            return True
        if stop_event is not None and stop_event.is_set():
            return True
        if give_up is not None and not self.counts["sessions_opened"] and now >= give_up:
            raise QlinkTimeoutError(f"no controller opened a session on {self.listener.url} within "
                                    f"{first_session_timeout_s} s")
        return False

    def _let_go(self, ep) -> dict | None:
        """Close a session's endpoint (``None``: a udp sender, nothing to close); returns the
        endpoint's transport statistics, for the session's report."""
        if ep is None:
            return None
        try:
            stats = {k: v for k, v in vars(ep.statistics()).items() if k != "extra"}
        except Exception:
            stats = None
        abort_endpoint(ep)
        return stats

    def _no_room_for(self, ep=None, *, addr=None, waiting: int = 0) -> bool:
        """True when ``max_sessions`` are open (counting ``waiting`` about to open): the new
        peer (endpoint ``ep``, or a udp sender at ``addr``) is then refused with a close frame
        (status BUSY) and counted, and ``ep`` closed."""
        if len(self.sessions) + waiting < self.limits.max_sessions:
            return False
        self.refused["max_sessions"] += 1
        frame = encode_close_frame(CloseReason.TOO_MANY_SESSIONS, f"{len(self.sessions)} sessions are open, the most "
                                                                  "this service serves at once; try again later")
        try:
            if ep is not None:
                ep.send_nowait(frame)
            else:
                self._udp.sendto(frame, addr)
        except Exception:
            pass
        if ep is not None:
            abort_endpoint(ep)
        return True

    def _sessions_report(self, rep: dict) -> dict:
        """``rep`` with the transport, the sessions' counts and the refused peers by reason."""
        refused = collections.Counter(self.refused)
        refused.update(getattr(self.listener, "refused_by_reason", {}) or {})
        rep["transport"] = self.scheme
        rep["sessions"] = {"live": len(self.sessions), "max_live": self.max_live, "ended": self.ended,
                           **dict(self.counts), "closed_by_reason": dict(self.closed_by_reason),
                           "max_frame_nbytes": self.max_frame}
        rep["refused_peers"] = dict(refused)
        return rep
