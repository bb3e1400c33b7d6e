"""The kernel's floor for KV bytes over loopback TCP: a bare socket between two processes.

A sender process writes ``num_layers`` buffers of ``layer_nbytes`` as soon as it is told
to go, and this process reads them straight into buffers of its own (warm, faulted in
beforehand), timing from the go to the last byte, with the ends of one of three kinds
(:data:`MODES`): blocking calls at both ends (``sendall``, ``recv_into(...,
MSG_WAITALL)``); non-blocking calls in busy loops at both ends, as qlink's tcp ends poll
(on two cores these beat the blocking calls' sleeps and wake-ups); or a sender that hands
the socket its pages without copying them (``vmsplice`` into a pipe, ``splice`` into the
socket, as qlink's deferred tcp puts do) and a busy-polling receiver, whose read is then
the only copy. The floor is the fastest of them. No framing, no notification, no
Python between the bytes: what any TCP transport (qlink's, Mooncake's) pays at the least
for the same bytes on this host. :class:`TcpFloorPair` keeps one such pair up so that a
benchmark can take a floor round right before each of its transfer rounds (the host's
loopback rate drifts by tens of per cent between minutes); :func:`tcp_socket_floor_s`
is the best of ``repeats`` rounds of each kind after one warm-up.

>>> s = tcp_socket_floor_s(layer_nbytes=1 << 16, num_layers=2, repeats=1)
>>> 0 < s < 10
True
"""

from __future__ import annotations

import multiprocessing as mp
import select
import socket
import struct
import time

import numpy as np

__all__ = ["MODES", "tcp_socket_floor_s", "TcpFloorPair"]

_GO = struct.Struct("<QQ")  # bytes per layer of the next round (0: stop), and the index of its mode
#: the kinds of ends a round can take (the sender's way / the receiver's); "splice" only where
#: ``transports._tcpc`` is built
MODES = ("blocking", "busy", "splice")
_SPIN_NS = 100_000_000  # a busy-polling receive's C loop comes back to look at the clock this often at most


def modes() -> tuple[str, ...]:
    """The modes this host can run (``splice`` needs the C module)."""
    from transports.tcp import splice_built

    return MODES if splice_built() else MODES[:2]


def _splice_all(s: socket.socket, pipe, buf: np.ndarray, n: int) -> None:
    """Hand ``buf[:n]`` to the socket by vmsplice + splice, sleeping in poll while it is full."""
    from transports.tcp import splice_pieces

    so, ln, state = np.zeros(1, np.int64), np.array([n], np.int64), np.zeros(3, np.int64)
    p = select.poll()
    p.register(s, select.POLLOUT)
    while True:
        splice_pieces(s.fileno(), pipe, buf, so, ln, state)
        if state[0] >= 1 and state[2] == 0:
            return
        p.poll(1000)


def _sender(port: int, max_layer_nbytes: int, num_layers: int) -> None:
    from qlink.procs import die_with_parent

    die_with_parent()
    from transports.tcp import SplicePipe

    bufs = [np.full(max_layer_nbytes, k % 251 + 1, dtype=np.uint8) for k in range(num_layers)]
    pipe = SplicePipe.open()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            go = s.recv(_GO.size, socket.MSG_WAITALL)
            if len(go) != _GO.size or not _GO.unpack(go)[0]:
                return
            n, mode = _GO.unpack(go)
            for b in bufs:
                if MODES[mode] == "blocking":
                    s.sendall(memoryview(b)[:n])
                    continue
                if MODES[mode] == "splice":
                    _splice_all(s, pipe, b, n)
                    continue
                mv, sent = memoryview(b)[:n], 0
                while sent < n:  # non-blocking sends in a busy loop: no sleep while the socket is full
                    try:
                        sent += s.send(mv[sent:], socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        pass


class TcpFloorPair:
    """A bare loopback TCP socket pair (a spawned sender, a receiver here) for layers of up
    to ``max_layer_nbytes``; :meth:`round_s` times one round of ``num_layers`` layers.

    >>> with TcpFloorPair(max_layer_nbytes=1 << 16, num_layers=2) as pair:
    ...     0 < pair.round_s(1 << 15) < 10
    True
    """

    def __init__(self, *, max_layer_nbytes: int, num_layers: int, timeout_s: float = 120.0):
        if max_layer_nbytes <= 0 or num_layers <= 0:
            raise ValueError(f"max_layer_nbytes and num_layers must be positive, got {max_layer_nbytes}, {num_layers}")
        self.num_layers = int(num_layers)
        self._timeout_s = float(timeout_s)
        self._dst = [np.zeros(max_layer_nbytes, dtype=np.uint8) for _ in range(num_layers)]
        lis = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lis.bind(("127.0.0.1", 0))
            lis.listen(1)
            lis.settimeout(timeout_s)
            self._proc = mp.get_context("spawn").Process(
                target=_sender, args=(lis.getsockname()[1], max_layer_nbytes, num_layers), daemon=True)
            self._proc.start()
            self._conn, _ = lis.accept()
        except BaseException:
            lis.close()
            self.close()
            raise
        lis.close()
        self._conn.settimeout(None)  # blocking: MSG_WAITALL waits in the kernel; SO_RCVTIMEO bounds it
        self._conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                              struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6)))
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round_s(self, layer_nbytes: int, *, mode: str = "blocking") -> float:
        """Seconds from the go to the last byte of ``num_layers`` layers of ``layer_nbytes``,
        with ends of the kind ``mode`` (one of :data:`MODES`): blocking calls (``sendall``,
        ``MSG_WAITALL`` reads); non-blocking ones in busy loops on both ends, as a
        busy-polling transport does (no sleep and wake-up whenever a socket buffer fills or
        drains; on two cores it can be the faster); or the sender's pages spliced into the
        socket and a busy-polling receiver."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        from transports.tcp import recv_pieces

        conn = self._conn
        flags = socket.MSG_WAITALL if mode == "blocking" else socket.MSG_DONTWAIT
        in_c = recv_pieces is not None and mode != "blocking"
        at, ln, st = np.zeros(1, np.int64), np.array([layer_nbytes], np.int64), np.zeros(2, np.int64)
        t0 = time.perf_counter_ns()
        conn.sendall(_GO.pack(layer_nbytes, MODES.index(mode)))
        for d in self._dst:
            if in_c:  # busy-polling in one C loop, as qlink's tcp reader does: no Python between the bytes
                st[:] = 0
                while st[0] < 1:
                    if recv_pieces(conn.fileno(), d, at, ln, st, _SPIN_NS) < 0:
                        raise ConnectionError("the floor's sender closed before all bytes came")
                    if time.perf_counter_ns() - t0 > self._timeout_s * 1e9:
                        raise TimeoutError(f"the floor's round took over {self._timeout_s} s")
                continue
            mv, got = memoryview(d)[:layer_nbytes], 0
            while got < layer_nbytes:
                try:
                    k = conn.recv_into(mv[got:], layer_nbytes - got, flags)
                except BlockingIOError:
                    continue
                if k == 0:
                    raise ConnectionError("the floor's sender closed before all bytes came")
                got += k
        sec = (time.perf_counter_ns() - t0) / 1e9
        if int(self._dst[-1][0]) != (self.num_layers - 1) % 251 + 1:
            raise RuntimeError("the floor's bytes did not arrive as sent")
        return sec

    def close(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            try:
                conn.sendall(_GO.pack(0, 0))
            except OSError:
                pass
            conn.close()
            self._conn = None
        proc = getattr(self, "_proc", None)
        if proc is not None:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
            self._proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tcp_socket_floor_s(*, layer_nbytes: int, num_layers: int, repeats: int = 3, timeout_s: float = 120.0) -> float:
    """Best seconds over ``repeats`` rounds of each mode this host runs (after one warm-up) to
    move ``num_layers`` x ``layer_nbytes`` bytes over a bare loopback TCP socket between two
    processes."""
    if layer_nbytes <= 0 or num_layers <= 0 or repeats <= 0:
        raise ValueError(f"layer_nbytes, num_layers and repeats must be positive, got {layer_nbytes}, "
                         f"{num_layers}, {repeats}")
    with TcpFloorPair(max_layer_nbytes=layer_nbytes, num_layers=num_layers, timeout_s=timeout_s) as pair:
        pair.round_s(layer_nbytes)  # warm-up
        times = [pair.round_s(layer_nbytes, mode=m) for _ in range(repeats) for m in modes()]
    return float(min(times))
