"""Peers used directly, beside the qlink transports: UCXX's asyncio API and plain sockets.

Each function runs an echo server in a spawned process and a client in a second spawned
process, and returns the client's per-round-trip latencies in ns (``time.perf_counter_ns``
around one send and the receive of its echo) as a :class:`PeerSamples` array whose
``meta`` says how they were measured (processes, API, UCX transports...).

* :func:`ucxx_asyncio_round_trip_ns`: UCXX used the ordinary way, ``ucxx.create_listener``
  / ``ucxx.create_endpoint``, ``await ep.send(buf)`` / ``await ep.recv(buf)`` of a NumPy
  buffer, UCXX's default progress mode and endpoint error handling. UCXX's listener has no
  bind address: it listens on every interface for the few seconds of the measurement.
* :func:`socket_round_trip_ns`: Python TCP sockets on 127.0.0.1 with ``TCP_NODELAY``.

Results travel back from the client process as raw int64 bytes (never pickled objects).

>>> s = socket_round_trip_ns(nbytes=8, num_round_trips=20, warmup=5)
>>> s.shape, s.dtype, s.meta["processes"], bool(s.min() > 0)
((20,), dtype('int64'), 2, True)
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import socket
import time

import numpy as np

from qlink.procs import die_with_parent, pin_to_cpu

__all__ = ["PeerSamples", "ucxx_asyncio_round_trip_ns", "socket_round_trip_ns"]

_TIMEOUT_S = 60.0


class PeerSamples(np.ndarray):
    """Per-round-trip latencies in ns (int64) with ``meta``: a dict describing the setup."""

    meta: dict

    def __array_finalize__(self, obj) -> None:
        self.meta = getattr(obj, "meta", {})


def _samples(values: np.ndarray, **meta) -> PeerSamples:
    out = np.asarray(values, dtype=np.int64).view(PeerSamples)
    out.meta = dict(meta)
    return out


def _check_counts(nbytes: int, num_round_trips: int, warmup: int, *, min_nbytes: int) -> None:
    if nbytes < min_nbytes:
        raise ValueError(f"nbytes must be at least {min_nbytes}, got {nbytes}")
    if num_round_trips < 1 or warmup < 0:
        raise ValueError(f"need num_round_trips >= 1 and warmup >= 0, got {num_round_trips} and {warmup}")


def _run_pair(server, client, args: tuple) -> tuple[np.ndarray, dict]:
    """Start ``server`` then ``client`` in spawned processes; return the client's samples and notes."""
    ctx = mp.get_context("spawn")
    port_rx, port_tx = ctx.Pipe(duplex=False)
    res_rx, res_tx = ctx.Pipe(duplex=False)
    srv = ctx.Process(target=server, args=(port_tx, *args), daemon=True)
    cli = ctx.Process(target=client, args=(port_rx, res_tx, *args), daemon=True)
    srv.start()
    try:
        cli.start()
        if not res_rx.poll(_TIMEOUT_S):
            raise TimeoutError(f"the peer benchmark client sent no result within {_TIMEOUT_S} s")
        head = res_rx.recv_bytes()
        if head.startswith(b"error:"):
            raise RuntimeError(f"peer benchmark failed: {head[6:].decode(errors='replace')}")
        data = np.frombuffer(res_rx.recv_bytes(), dtype=np.int64).copy()
        notes = dict(kv.split("=", 1) for kv in head.decode().split(";") if "=" in kv)
        cli.join(10)
        srv.join(10)
        return data, notes
    finally:
        for p in (cli, srv):
            if p.pid is not None and p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(5)


def _report(res_tx, samples: np.ndarray, **notes) -> None:
    res_tx.send_bytes(";".join(f"{k}={v}" for k, v in notes.items()).encode())
    res_tx.send_bytes(samples.tobytes())


# ----- plain sockets ---------------------------------------------------------------------------
def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the echo peer closed the socket")
        got += n


def _socket_server(port_tx, nbytes: int, total: int) -> None:
    die_with_parent()
    pin_to_cpu(1)
    lis = socket.socket()
    lis.bind(("127.0.0.1", 0))
    lis.listen(1)
    port_tx.send_bytes(str(lis.getsockname()[1]).encode())
    lis.settimeout(_TIMEOUT_S)
    conn, _ = lis.accept()
    lis.close()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(nbytes))
    for _ in range(total):
        _recv_exact(conn, view)
        conn.sendall(view)
    conn.close()


def _socket_client(port_rx, res_tx, nbytes: int, total: int) -> None:
    die_with_parent()
    pin_to_cpu(0)
    try:
        port = int(port_rx.recv_bytes())
        sock = socket.create_connection(("127.0.0.1", port), timeout=_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
        back = memoryview(bytearray(nbytes))
        out = np.empty(total, dtype=np.int64)
        clock = time.perf_counter_ns
        for i in range(total):
            t0 = clock()
            sock.sendall(msg)
            _recv_exact(sock, back)
            out[i] = clock() - t0
        if bytes(back) != msg:
            raise AssertionError("echoed bytes differ from the bytes sent")
        sock.close()
        _report(res_tx, out, api="socket")
    except Exception as e:  # reported to the parent, which raises
        res_tx.send_bytes(f"error:{type(e).__name__}: {e}".encode())


def socket_round_trip_ns(*, nbytes: int = 64, num_round_trips: int = 5000, warmup: int = 500) -> PeerSamples:
    """Round trips of ``nbytes`` over plain Python TCP sockets on loopback (TCP_NODELAY), two processes."""
    _check_counts(nbytes, num_round_trips, warmup, min_nbytes=1)
    data, _ = _run_pair(_socket_server, _socket_client, (nbytes, warmup + num_round_trips))
    return _samples(data[warmup:], peer="python socket", processes=2, transport="TCP loopback, TCP_NODELAY",
                    nbytes=nbytes, warmup=warmup)


# ----- UCXX asyncio ----------------------------------------------------------------------------
def _ucx_env() -> None:
    """The same UCX defaults as the ucx:// transport, set before UCXX is imported."""
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def _ucxx_server(port_tx, nbytes: int, total: int) -> None:
    die_with_parent()
    pin_to_cpu(1)
    _ucx_env()
    import asyncio

    import ucxx

    async def main() -> None:
        done = asyncio.Event()

        async def echo(ep) -> None:
            buf = np.empty(nbytes, dtype=np.uint8)
            for _ in range(total):
                await ep.recv(buf)
                await ep.send(buf)
            await ep.recv(np.empty(1, dtype=np.uint8))  # the client's goodbye
            await ep.close()
            done.set()

        lis = ucxx.create_listener(echo)
        port_tx.send_bytes(str(lis.port).encode())
        await asyncio.wait_for(done.wait(), _TIMEOUT_S)
        lis.close()

    asyncio.run(main())


def _ucxx_client(port_rx, res_tx, nbytes: int, total: int) -> None:
    die_with_parent()
    pin_to_cpu(0)
    _ucx_env()
    try:
        import asyncio

        import ucxx

        async def main() -> np.ndarray:
            port = int(port_rx.recv_bytes())
            ep = await ucxx.create_endpoint("127.0.0.1", port)
            msg = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
            back = np.empty(nbytes, dtype=np.uint8)
            out = np.empty(total, dtype=np.int64)
            clock = time.perf_counter_ns
            for i in range(total):
                t0 = clock()
                await ep.send(msg)
                await ep.recv(back)
                out[i] = clock() - t0
            if not np.array_equal(back, msg):
                raise AssertionError("echoed bytes differ from the bytes sent")
            await ep.send(np.zeros(1, dtype=np.uint8))
            await ep.close()
            return out

        out = asyncio.run(main())
        _report(res_tx, out, api="ucxx asyncio", ucx_tls=os.environ.get("UCX_TLS", ""),
                ucxx_version=getattr(ucxx, "__version__", "?"), ucx_version=ucxx.__ucx_version__,
                progress_mode=os.environ.get("UCXPY_PROGRESS_MODE", "thread (UCXX default)"))
    except Exception as e:  # reported to the parent, which raises
        res_tx.send_bytes(f"error:{type(e).__name__}: {e}".encode())


def ucxx_asyncio_round_trip_ns(*, nbytes: int = 64, num_round_trips: int = 2000, warmup: int = 200) -> PeerSamples:
    """Round trips of ``nbytes`` through UCXX's asyncio API used directly, two processes.

    Needs ``ucxx-cu12`` (``pip install 'qlink[ucx]'``); raises MissingDependencyError otherwise.
    """
    _check_counts(nbytes, num_round_trips, warmup, min_nbytes=0)
    import importlib.util

    if importlib.util.find_spec("ucxx") is None:
        from qlink.errors import missing

        raise missing("ucxx-cu12", extra="ucx", feature="the UCXX asyncio peer benchmark")
    data, notes = _run_pair(_ucxx_server, _ucxx_client, (nbytes, warmup + num_round_trips))
    return _samples(data[warmup:], peer="ucxx asyncio (direct)", processes=2,
                    api="ucxx.create_listener/create_endpoint, Endpoint.send/recv of NumPy buffers",
                    endpoint_error_handling="True (UCXX default)", nbytes=nbytes, warmup=warmup,
                    **{k: v for k, v in notes.items() if k != "api"})
