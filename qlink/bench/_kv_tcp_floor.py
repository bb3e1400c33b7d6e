"""The kernel's floor for KV bytes over loopback TCP: a bare socket between two processes.

A sender process writes ``num_layers`` buffers of ``layer_nbytes`` with blocking
``sendall`` as soon as it is told to go; this process reads them with blocking
``recv_into(..., MSG_WAITALL)`` straight into buffers of its own (warm, faulted in
beforehand), and times from the go to the last byte. No framing, no notification, no
Python between the bytes: what any TCP transport (qlink's, Mooncake's) pays at the least
for the same bytes on this host. The best of ``repeats`` rounds after one warm-up.

>>> s = tcp_socket_floor_s(layer_nbytes=1 << 16, num_layers=2, repeats=1)
>>> 0 < s < 10
True
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import struct
import time

import numpy as np

__all__ = ["tcp_socket_floor_s"]


def _sender(port: int, layer_nbytes: int, num_layers: int, rounds: int) -> None:
    from qlink.procs import die_with_parent

    die_with_parent()
    bufs = [np.full(layer_nbytes, k % 251 + 1, dtype=np.uint8) for k in range(num_layers)]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            if s.recv(1) != b"g":
                return
            for b in bufs:
                s.sendall(memoryview(b))


def tcp_socket_floor_s(*, layer_nbytes: int, num_layers: int, repeats: int = 3, timeout_s: float = 120.0) -> float:
    """Best seconds over ``repeats`` rounds (after one warm-up) to move ``num_layers`` x
    ``layer_nbytes`` bytes over a bare loopback TCP socket between two processes."""
    if layer_nbytes <= 0 or num_layers <= 0 or repeats <= 0:
        raise ValueError(f"layer_nbytes, num_layers and repeats must be positive, got {layer_nbytes}, "
                         f"{num_layers}, {repeats}")
    dst = [np.zeros(layer_nbytes, dtype=np.uint8) for _ in range(num_layers)]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lis:
        lis.bind(("127.0.0.1", 0))
        lis.listen(1)
        lis.settimeout(timeout_s)
        proc = mp.get_context("spawn").Process(target=_sender, args=(lis.getsockname()[1], layer_nbytes, num_layers,
                                                                     repeats + 1), daemon=True)
        proc.start()
        try:
            conn, _ = lis.accept()
            with conn:
                conn.settimeout(None)  # blocking: MSG_WAITALL waits in the kernel; SO_RCVTIMEO bounds it
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6)))
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                times = []
                for _ in range(repeats + 1):
                    t0 = time.perf_counter_ns()
                    conn.sendall(b"g")
                    for d in dst:
                        mv, got = memoryview(d), 0
                        while got < layer_nbytes:
                            k = conn.recv_into(mv[got:], layer_nbytes - got, socket.MSG_WAITALL)
                            if k == 0:
                                raise ConnectionError("the floor's sender closed before all bytes came")
                            got += k
                    times.append((time.perf_counter_ns() - t0) / 1e9)
        finally:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    if int(dst[-1][0]) != (num_layers - 1) % 251 + 1:
        raise RuntimeError("the floor's bytes did not arrive as sent")
    return float(min(times[1:]))
