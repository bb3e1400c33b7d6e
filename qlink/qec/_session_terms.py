"""The terms of a decoder service's sessions (re-exported by :mod:`qlink.qec.sessions`): the
limits a :class:`~qlink.qec.sessions.SessionServer` keeps, and the close frame that tells a
peer why its session ended.

>>> SessionLimits().frame_timeout_s
0.25
>>> parse_close_frame(encode_close_frame(CloseReason.FRAME_TIMEOUT, "half a frame for 0.25 s"))
('frame_timeout', 'half a frame for 0.25 s')
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from qlink import wire
from qlink.wire import Status

__all__ = ["CLOSE_REQUEST_ID", "CloseReason", "SessionLimits", "encode_close_frame", "parse_close_frame"]

CLOSE_REQUEST_ID = 0xFFFFFFFF
_CLOSE_PREFIX = b"qlink-close "


class CloseReason(enum.Enum):
    """Why the service closed a session; each goes out with its status."""

    IDLE_TIMEOUT = "idle_timeout"
    FRAME_TIMEOUT = "frame_timeout"
    OVERSIZED_FRAME = "oversized_frame"
    TOO_MANY_SESSIONS = "too_many_sessions"
    PEER_NOT_READING = "peer_not_reading"
    SESSION_TIMEOUT = "session_timeout"
    INTERNAL_ERROR = "internal_error"
    SERVICE_STOPPING = "service_stopping"

    @property
    def status(self) -> Status:
        return _CLOSE_STATUS[self]


_CLOSE_STATUS = {CloseReason.IDLE_TIMEOUT: Status.OK, CloseReason.FRAME_TIMEOUT: Status.BAD_REQUEST,
                 CloseReason.OVERSIZED_FRAME: Status.BAD_REQUEST, CloseReason.TOO_MANY_SESSIONS: Status.BUSY,
                 CloseReason.PEER_NOT_READING: Status.BUSY, CloseReason.SESSION_TIMEOUT: Status.OK,
                 CloseReason.INTERNAL_ERROR: Status.INTERNAL_ERROR, CloseReason.SERVICE_STOPPING: Status.OK}


def encode_close_frame(reason: CloseReason, detail: str) -> bytes:
    """The close frame for ``reason`` (see the module docstring)."""
    text = _CLOSE_PREFIX + reason.value.encode() + b": " + detail.encode("utf-8")[:400]
    head = wire.RESPONSE_HEADER.pack(wire.RESPONSE_MAGIC, int(reason.status), len(text), CLOSE_REQUEST_ID, 0)
    return head + text


def parse_close_frame(buf) -> tuple[str, str] | None:
    """``(reason, detail)`` if ``buf`` is a close frame, else None."""
    mv = memoryview(buf)
    if len(mv) < wire.HEADER_NBYTES:
        return None
    magic, _status, n, rid, _ptp = wire.RESPONSE_HEADER.unpack_from(mv)
    body = bytes(mv[wire.HEADER_NBYTES:wire.HEADER_NBYTES + n])
    if magic != wire.RESPONSE_MAGIC or rid != CLOSE_REQUEST_ID or not body.startswith(_CLOSE_PREFIX):
        return None
    reason, _, detail = body[len(_CLOSE_PREFIX):].decode("utf-8", "replace").partition(": ")
    return reason, detail


@dataclass(frozen=True)
class SessionLimits:
    """The bounds a :class:`SessionServer` keeps (see the module docstring); ``None`` turns a
    timeout off; ``max_frame_nbytes`` None: derived from the decoders."""

    max_sessions: int = 64
    frame_timeout_s: float = 0.25
    idle_timeout_s: float | None = 300.0
    datagram_idle_timeout_s: float = 1.0
    session_timeout_s: float | None = None
    max_frame_nbytes: int | None = None
    max_frames_per_turn: int = 16
    read_ahead_nbytes: int = 64 << 10
    max_queued_datagrams: int = 1024
    max_queued_nbytes: int = 1 << 20
    replay_window: int = 1024
    replay_senders: int = 4096

    def __post_init__(self):
        for name in ("max_sessions", "max_frames_per_turn", "max_queued_datagrams", "max_queued_nbytes",
                     "read_ahead_nbytes", "replay_window", "replay_senders"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("frame_timeout_s", "idle_timeout_s", "datagram_idle_timeout_s", "session_timeout_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds or None, got {v!r}")
        if self.max_frame_nbytes is not None and self.max_frame_nbytes < wire.HEADER_NBYTES + 32:
            raise ValueError(f"max_frame_nbytes must hold at least a header and an enqueue's fields "
                             f"({wire.HEADER_NBYTES + 32}), got {self.max_frame_nbytes}")
