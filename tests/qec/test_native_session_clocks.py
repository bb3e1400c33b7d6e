"""The native session server's clocks are looked at even when its wake flag never goes down.

The acceptor raises the flag after queueing a new endpoint; the serving loop once lowered it
only when that queue held something, so a flag raised just after the queue was emptied
stayed up, every ``serve_sessions`` call returned at its first look at the flag, and idle
sessions were never closed (1 clean-clone run in 8). Here the flag is held up for good (a
byte that ignores being lowered): the C loop must still close an idle session on its clock
and a half-sent frame on its timeout, and say why in the close frame."""

from __future__ import annotations

import threading
import time

import pytest

from qlink.qec.hotpath import NativeDecoderService, available
from qlink.qec.service import DecoderConfig
from qlink.qec.specs import build_source

pytestmark = [pytest.mark.skipif(available() is not None, reason=f"native path not built: {available()}"),
              pytest.mark.timeout(60)]


class _StuckUp(bytearray):
    """A wake flag nobody can lower: every write leaves it raised."""

    def __setitem__(self, index, value):
        super().__setitem__(index, 1)


def _serve_with_the_flag_stuck_up(limits_kw: dict, client_does):
    """Serve one tcp session with the wake flag held up: the close frame's ``(reason,
    detail)``, the seconds from the client's connect to it, and the session end reports."""
    import transports
    from qlink.qec._native_sessions import NativeSessionServer
    from qlink.qec._session_terms import SessionLimits, parse_close_frame

    src = build_source({"code": "surface_code:rotated_memory_z", "distance": 3, "rounds": 3, "p": 0.01})
    svc = NativeDecoderService({0: DecoderConfig(decoder="pymatching", dem=src.dem)})
    lis = transports.listen("tcp://127.0.0.1:0")
    ended: list = []
    server = NativeSessionServer(svc, lis, limits=SessionLimits(**limits_kw), on_session_end=ended.append)
    server._wake = _StuckUp(b"\x01")
    t = threading.Thread(target=server.run, kwargs={"max_sessions_served": 1, "first_session_timeout_s": 20},
                         daemon=True)
    t.start()
    try:
        ep = transports.connect(lis.url, timeout_s=5)
        t0 = time.monotonic()
        try:
            client_does(ep)
            buf = bytearray(256)
            n = ep.recv_into(buf, timeout_s=20)  # the close frame, then the end of the stream
            took_s = time.monotonic() - t0
            closed = parse_close_frame(bytes(buf[:n]))
        finally:
            ep.close()
        t.join(20)
        assert not t.is_alive(), "the server did not end after its one session"
    finally:
        server.close()
        lis.close()
    assert server._wake[0] == 1  # the flag really stayed up throughout
    return closed, took_s, ended


def test_an_idle_session_is_closed_on_its_clock_with_the_wake_flag_stuck_up():
    closed, took_s, ended = _serve_with_the_flag_stuck_up({"idle_timeout_s": 0.3}, lambda ep: None)
    assert closed is not None and closed[0] == "idle_timeout", closed
    assert took_s < 10.0  # 0.3 s and a loaded host's slack; never, before the fix
    assert ended and ended[-1]["session"]["reason"] == "idle_timeout"


def test_a_half_frame_is_timed_out_with_the_wake_flag_stuck_up():
    from transports import framing as fr

    def half_frame(ep):  # a frame header announcing 80 bytes, 20 of them, then silence
        ep._sock.sendall(fr.HEADER.pack(fr.KIND_MSG, 0, 0, 0, 80, 0, 0) + b"RQUC" + bytes(16))

    closed, took_s, ended = _serve_with_the_flag_stuck_up({"frame_timeout_s": 0.2, "idle_timeout_s": 30.0},
                                                          half_frame)
    assert closed is not None and closed[0] == "frame_timeout", closed
    assert took_s < 10.0
