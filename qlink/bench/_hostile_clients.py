"""Hostile clients of a decoder service, built from ``socket`` and ``struct`` alone.

Each kind runs until its stop event is set and returns what it saw (close frames by
reason, refusals); :class:`HostileProcess` runs one in a process of its own, so that
its work does not share an interpreter (and its lock) with the controller being measured.

* ``half_frame``: tcp handshake, half of a frame, then silence (a new one each time the
  service closes it);
* ``idle``: ``count`` tcp sessions that finish the handshake and send nothing;
* ``huge_header``: a tcp frame header announcing a 1 GiB message, and nothing after it;
* ``udp_garbage``: ``count`` udp sockets sending random bytes;
* ``udp_flood`` / ``tcp_flood``: one sender of well-formed frames as fast as it can,
  never reading an answer;
* ``busy_loop``: no client at all, a process that only spins on a CPU: the control beside
  the others (what taking a CPU from the service's host costs, with no traffic).

The qlink tcp framing is written out here by hand (magic ``QLTC``, a 16-byte hello, a
20-byte reply, 32-byte frame headers), as a client that never imported qlink would.

>>> hello = tcp_hello(key=7)
>>> len(hello), hello[:4]
(16, b'QLTC')
"""

from __future__ import annotations

import os
import random
import socket
import struct
import time
from collections import Counter

__all__ = ["HOSTILE_KINDS", "HostileProcess", "run_hostile", "tcp_hello"]

_HELLO = struct.Struct("<4sHHQ")  # magic, version, flags, key
_REPLY = struct.Struct("<4sHHQH")  # magic, version, status, key, reason bytes
_FRAME = struct.Struct("<BBHIQQQ")  # kind, flags, tag bytes, region id, payload bytes, offset, notify id
_RESP = struct.Struct("<IiIIQ")  # CUQS response header
_REQ = struct.Struct("<IIIIQ")
_KIND_MSG = 1
_ENQUEUE, _GET = 0x7ED8BE82, 0x882D5BA1
_CLOSE_RID = 0xFFFFFFFF

HOSTILE_KINDS = ("half_frame", "idle", "huge_header", "udp_garbage", "udp_flood", "tcp_flood", "busy_loop")


def tcp_hello(*, key: int) -> bytes:
    """A qlink tcp client's hello (protocol version 1, no flags)."""
    return _HELLO.pack(b"QLTC", 1, 0, key)


def _host_port(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[1]
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def _tcp_session(url: str, *, timeout_s: float = 5.0) -> socket.socket:
    """A connected socket past the handshake (raises OSError/ConnectionError when refused)."""
    sock = socket.create_connection(_host_port(url), timeout=timeout_s)
    sock.sendall(tcp_hello(key=random.getrandbits(64)))
    head = _recv_exact(sock, _REPLY.size)
    _magic, _version, status, _key, n = _REPLY.unpack(head)
    if n:
        _recv_exact(sock, n)
    if status:
        sock.close()
        raise ConnectionError(f"handshake refused (status {status})")
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        out += chunk
    return out


def _close_reason(payload: bytes) -> str | None:
    if len(payload) < _RESP.size:
        return None
    magic, _status, n, rid, _ptp = _RESP.unpack_from(payload)
    body = payload[_RESP.size:_RESP.size + n]
    if magic != 0x43555153 or rid != _CLOSE_RID or not body.startswith(b"qlink-close "):
        return None
    return body[len(b"qlink-close "):].split(b":", 1)[0].decode()


def _tcp_close_reasons(buf: bytes) -> list[str]:
    """The close frames among the qlink tcp frames in ``buf`` (what a closed session received)."""
    out, at = [], 0
    while at + _FRAME.size <= len(buf):
        kind, _f, tag_n, _r, n, _o, _nid = _FRAME.unpack_from(buf, at)
        at += _FRAME.size + tag_n
        if kind == _KIND_MSG:
            reason = _close_reason(buf[at:at + n])
            if reason:
                out.append(reason)
        at += n if kind == _KIND_MSG else 0
    return out


def _drain(sock: socket.socket, seen: Counter, *, wait_s: float, held: dict | None = None) -> bool:
    """Read what the service sent until it closes (True) or ``wait_s`` passes; count its close
    frames. ``held`` keeps each socket's bytes between calls: a close frame and the end of the
    stream may come in different calls (on a loaded host they often do)."""
    sock.settimeout(wait_s)
    got = b"" if held is None else held.pop(sock, b"")
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                for r in _tcp_close_reasons(got):
                    seen[f"closed:{r}"] += 1
                return True
            got += chunk
    except (socket.timeout, OSError):
        if held is not None and got:
            held[sock] = got
        return False


def _session_or_count(url: str, seen: Counter) -> socket.socket | None:
    """A session for the next try of a hostile loop; None (counted as refused, after a short
    pause) when the service refuses it."""
    try:
        return _tcp_session(url)
    except (OSError, ConnectionError):
        seen["refused"] += 1
        time.sleep(0.05)
        return None


def _half_frame(url: str, stop, seen: Counter, count: int) -> None:
    while not stop.is_set():
        sock = _session_or_count(url, seen)
        if sock is None:
            continue
        sock.sendall(_FRAME.pack(_KIND_MSG, 0, 0, 0, 80, 0, 0) + b"\x52\x51\x55\x43" + bytes(16))  # 20 of 80 bytes
        seen["half_frames_sent"] += 1
        held: dict = {}
        while not stop.is_set():  # silence until the service gives up on it
            if _drain(sock, seen, wait_s=0.1, held=held):
                break
        sock.close()


def _idle(url: str, stop, seen: Counter, count: int) -> None:
    socks = []
    for _ in range(count):
        try:
            socks.append(_tcp_session(url))
        except (OSError, ConnectionError):
            seen["refused"] += 1
    seen["idle_sessions"] = len(socks)
    open_socks = list(socks)
    held: dict = {}
    while not stop.is_set() and open_socks:
        for s in list(open_socks):
            if _drain(s, seen, wait_s=0.001, held=held):
                open_socks.remove(s)
        time.sleep(0.05)
    for s in socks:
        s.close()


def _huge_header(url: str, stop, seen: Counter, count: int) -> None:
    while not stop.is_set():
        sock = _session_or_count(url, seen)
        if sock is None:
            continue
        sock.sendall(_FRAME.pack(_KIND_MSG, 0, 0, 0, 1 << 30, 0, 0))  # announces 1 GiB, sends none of it
        seen["huge_headers_sent"] += 1
        held: dict = {}
        while not stop.is_set():
            if _drain(sock, seen, wait_s=0.1, held=held):
                break
        sock.close()
        time.sleep(0.05)


def _udp_garbage(url: str, stop, seen: Counter, count: int) -> None:
    addr = _host_port(url)
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(count)]
    rng = random.Random(7)
    try:
        while not stop.is_set():
            for s in socks:
                try:
                    s.sendto(os.urandom(rng.randrange(1, 200)), addr)
                    seen["datagrams_sent"] += 1
                except OSError:
                    seen["send_errors"] += 1
            time.sleep(0.001)
    finally:
        for s in socks:
            s.close()


def _valid_enqueue(counter: int) -> bytes:
    payload = struct.pack("<qqqq", 0, counter, 0, 8) + b"\x00"
    return _REQ.pack(0x43555152, _ENQUEUE, len(payload), counter & 0xFFFFFFFF, 0) + payload


def _udp_flood(url: str, stop, seen: Counter, count: int) -> None:
    addr = _host_port(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    frames = [_valid_enqueue(i) for i in range(64)]
    i = 0
    try:
        while not stop.is_set():
            for f in frames:
                try:
                    sock.sendto(f, addr)
                    i += 1
                except BlockingIOError:
                    pass
                except OSError:
                    seen["send_errors"] += 1
            seen["datagrams_sent"] = i  # (it reads no answer on purpose: they pile up and are dropped)
    finally:
        sock.close()


def _tcp_flood(url: str, stop, seen: Counter, count: int) -> None:
    while not stop.is_set():
        sock = _session_or_count(url, seen)
        if sock is None:
            continue
        body = b"".join(_FRAME.pack(_KIND_MSG, 0, 0, 0, len(f), 0, 0) + f for f in map(_valid_enqueue, range(256)))
        sock.setblocking(False)
        try:
            while not stop.is_set():
                try:
                    sock.send(body)
                    seen["frames_sent"] += 256
                except BlockingIOError:
                    time.sleep(0.0005)
        except OSError:
            seen["closed_by_service"] += 1
        sock.close()


def _busy_loop(url: str, stop, seen: Counter, count: int) -> None:
    """Spin on a CPU, sending nothing, until stopped (``url`` unused): the control case."""
    spins = 0
    while not stop.is_set():
        for _ in range(10_000):
            pass
        spins += 1
    seen["busy_spins"] = spins


_KINDS = {"half_frame": _half_frame, "idle": _idle, "huge_header": _huge_header, "udp_garbage": _udp_garbage,
          "udp_flood": _udp_flood, "tcp_flood": _tcp_flood, "busy_loop": _busy_loop}


def run_hostile(kind: str, url: str, stop, *, count: int = 1, out=None, started=None, nice: int = 0,
                idle: bool = False) -> dict:
    """Run one hostile client of ``kind`` against ``url`` until ``stop`` is set; what it saw.
    ``nice``: raise this process's nice level by that much first (in a process of its own);
    ``idle``: run it under ``SCHED_IDLE`` (it runs only on a CPU nothing else wants)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown hostile client {kind!r}; one of {HOSTILE_KINDS}")
    seen: Counter = Counter()
    if started is not None:  # (in a process of its own: it never outlives the one that started it)
        from qlink.procs import die_with_parent

        die_with_parent()
        if nice:
            os.nice(nice)
        if idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        started.set()
    _KINDS[kind](url, stop, seen, count)
    if out is not None:
        out.put(dict(seen))
    return dict(seen)


class HostileProcess:
    """``kind`` hostile clients in a spawned process; ``stop()`` returns what they saw."""

    def __init__(self, kind: str, url: str, *, count: int = 1, nice: int = 0, idle: bool = False) -> None:
        import multiprocessing as mp

        if kind not in _KINDS:
            raise ValueError(f"unknown hostile client {kind!r}; one of {HOSTILE_KINDS}")
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._out = ctx.Queue()
        started = ctx.Event()
        self.process = ctx.Process(target=run_hostile, args=(kind, url, self._stop),
                                   kwargs={"count": count, "out": self._out, "started": started, "nice": nice,
                                           "idle": idle},
                                   daemon=True,
                                   name=f"qlink-hostile-{kind}")
        self.process.start()
        if not started.wait(60):
            self.process.kill()
            raise RuntimeError(f"the hostile client {kind!r} did not start within 60 s")

    def stop(self, *, timeout_s: float = 20.0) -> dict:
        import queue

        self._stop.set()
        try:
            seen = self._out.get(timeout=timeout_s)
        except queue.Empty:
            seen = {"error": "the hostile client did not report"}
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        return seen

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.process.is_alive():
            self.stop()
