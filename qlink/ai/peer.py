"""A KV sender driven by commands, in another process (or thread): the far end of the
tests and benchmarks that measure a transfer between two processes.

The parent listens, starts :func:`serve` in a spawned process with one end of a
``multiprocessing`` pipe (a control channel between our own two processes, not peer
traffic), accepts the connection and builds its :class:`~qlink.ai.KVReceiver`; then it
sends commands over the pipe:

* ``("send", request_id, src_ids, dst_ids, layers)`` -> ``("ok", SubmitRecord)``
* ``("checksums", block_ids, layers)`` -> ``("ok", crc32 array)`` of this side's blocks
* ``("partial", request_id, src_ids, dst_ids, full_layers, extra_parts)`` sends
  ``full_layers`` layers and ``extra_parts`` descriptors of the next one, replies,
  then exits the process abruptly (a peer dying mid-transfer; in a thread it closes
  its endpoint instead)
* ``("paced", request_id, src_ids, dst_ids)`` plans the request and replies ``("ok",
  num_descs)``; then for each layer ``k`` in order it waits for ``("go", k)``, sends
  that layer and replies ``("ok", k)`` (so a test knows exactly which layers are out)
* ``("bye",)`` closes and returns

Failures come back as ``("err", class name, message)`` and the loop goes on.
"""

from __future__ import annotations

import contextlib
import os


__all__ = ["serve", "PeerHandle", "start_peer", "open_link", "DecodeStation", "transport_unavailable"]


def _sender(endpoint, cache, backend: str, mode: str):
    if backend == "nixl":
        from .nixl_backend import NixlKVSender

        return NixlKVSender(endpoint, cache)
    from .engine import KVSender

    return KVSender(endpoint, cache, mode=mode)


def serve(conn, target, spec_bytes: bytes, *, seed: int, mode: str = "auto", backend: str = "transport",
          fill: str = "random", connect_timeout_s: float = 30.0, device: str = "cpu") -> None:
    """Connect to ``target`` (a URL, or an Endpoint for in-process use), fill a cache of
    ``spec_bytes`` (``fill="random"`` from ``seed``; ``"touch"``: one byte value per layer,
    fast, for benchmarks) in ``device`` memory (``"cpu"`` or ``"gpu"``), and obey commands
    from ``conn`` until ``("bye",)``."""
    import transports
    from qlink.errors import QlinkError

    from .kv import KVCache, KVCacheSpec

    spec = KVCacheSpec.from_bytes(spec_bytes)
    cache = KVCache.allocate(spec, device=device)
    if fill == "random":
        cache.fill_random(seed=seed)
    else:
        for i, a in enumerate(cache.layers):
            a.view("uint8").fill(i % 251 + 1)
    ep = transports.connect(target, timeout_s=connect_timeout_s) if isinstance(target, str) else target
    tx = _sender(ep, cache, backend, mode)
    conn.send(("ready", os.getpid()))
    live = True
    try:
        while True:
            while live and not conn.poll(0.001):
                try:
                    tx.progress()  # some transports (ucx) move staged puts only while the initiator progresses
                except QlinkError:
                    live = False  # the link is gone; keep answering the parent until it says bye
            cmd = conn.recv()
            op = cmd[0]
            try:
                if op == "bye":
                    conn.send(("ok", None))
                    return
                if op == "send":
                    _, rid, src, dst, layers = cmd
                    conn.send(("ok", tx.send_request(rid, src, dst, layers=layers, timeout_s=30)))
                elif op == "checksums":
                    _, ids, layers = cmd
                    conn.send(("ok", cache.block_checksums(ids, layers=layers)))
                elif op == "paced":
                    _, rid, src, dst = cmd
                    _paced(conn, tx, tx.begin_request(rid, src, dst, timeout_s=30))
                elif op == "partial":
                    _, rid, src, dst, full_layers, extra = cmd
                    req = tx.begin_request(rid, src, dst, timeout_s=30)
                    # the whole layers land before the peer dies: written now, not left for the
                    # receiver to read out of this process later (its memory goes with it; shm's
                    # mapping outlives it, ucx's same-host reads do not)
                    deferring = getattr(tx, "_defer", None)  # (NIXL's sender: its reads are the decode side's)
                    if deferring is not None:
                        tx._defer = False
                    try:
                        for layer in range(full_layers):
                            req.send_layer(layer, timeout_s=30)
                    finally:
                        if deferring is not None:
                            tx._defer = deferring
                    if extra:
                        _partial_layer(tx, req, full_layers, extra)
                    if backend == "nixl":
                        tx.flush(timeout_s=30)
                    conn.send(("ok", None))
                    if not isinstance(target, str):
                        ep.close()  # in a thread: drop the link and stop
                        return
                    conn.close()
                    os._exit(0)  # a process: die without closing anything
                else:
                    conn.send(("err", "ValueError", f"unknown command {op!r}"))
            except Exception as e:  # noqa: BLE001 - reported to the parent, the loop goes on
                conn.send(("err", type(e).__name__, str(e)))
    finally:
        tx.close()
        if isinstance(target, str):
            ep.close()


def _paced(conn, tx, req) -> None:
    """Send the layers of ``req`` one by one, each when the parent says go."""
    conn.send(("ok", req.plan.num_descs))
    for layer in req.layers:
        while not conn.poll(0.001):
            tx.progress()
        go = conn.recv()
        if tuple(go) != ("go", layer):
            raise ValueError(f"paced request {req.request_id}: expected ('go', {layer}), got {go!r}")
        req.send_layer(layer, timeout_s=30)
        conn.send(("ok", layer))


def _partial_layer(tx, req, layer: int, extra: int) -> None:
    """Send only the first ``extra`` descriptors of ``layer`` (as a dying peer would)."""
    from . import frames as fr

    if tx.mode not in ("put", "send"):
        raise ValueError(f"a partial layer needs a put/send sender, not mode {tx.mode!r}")
    plan = req.plan
    src = tx._views[layer]
    n, lnb = plan.num_descs, plan.layer_nbytes
    for so, do, nb in list(zip(req._src, req._dst, req._len))[:extra]:
        if tx.mode == "put":
            tag = fr.pack_write(fr.FN_WRITE, req.request_id, req.submit_ns, layer=layer, layer_lo=req.layers.start,
                                layer_hi=req.layers.stop, num_parts=n, num_descs=n, layer_nbytes=lnb, part_nbytes=nb)
            tx.endpoint.put(src[so:so + nb], tx._peer.regions[layer], offset=do, notify_id=req.request_id, tag=tag)
        else:
            tx.endpoint.send(fr.pack_data(req.request_id, req.submit_ns, layer=layer, layer_lo=req.layers.start,
                                          layer_hi=req.layers.stop, num_parts=n, num_descs=n, layer_nbytes=lnb,
                                          part_nbytes=nb, dst_offset=do))
            tx.endpoint.send(src[so:so + nb])


class PeerHandle:
    """The parent's side of a :func:`serve` peer."""

    def __init__(self, conn, proc=None, thread=None):
        self.conn = conn
        self.proc = proc
        self.thread = thread

    def call(self, *cmd, timeout_s: float = 60.0):
        """Send a command and wait for its answer (for commands the receiver need not progress)."""
        self.submit(*cmd)
        return self.result(timeout_s=timeout_s)

    def submit(self, *cmd) -> None:
        """Send a command without waiting (the receiver can progress meanwhile)."""
        self.conn.send(cmd)

    def result(self, *, timeout_s: float = 60.0):
        """The answer to the oldest command submitted."""
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"KV peer did not answer within {timeout_s} s")
        status, *rest = self.conn.recv()
        if status == "err":
            raise RuntimeError(f"KV peer failed: {rest[0]}: {rest[1]}")
        return rest[0]

    def transfer(self, rx, request_id: int, src, dst, layers="all", *, timeout_s: float = 60.0):
        """Have the peer send a request while ``rx`` waits for it: ``(SubmitRecord, TransferRecord)``."""
        self.submit("send", request_id, src, dst, layers)
        try:
            rec = rx.wait_request(request_id, timeout_s=timeout_s)
        except BaseException:
            if self.conn.poll(0.5):
                self.result(timeout_s=0)  # surface the peer's own error if it has one
            raise
        return self.result(timeout_s=timeout_s), rec

    def wait_ready(self, timeout_s: float = 60.0) -> int:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"KV peer not ready within {timeout_s} s")
        status, pid = self.conn.recv()
        if status != "ready":
            raise RuntimeError(f"KV peer failed to start: {pid}")
        return pid

    def close(self, timeout_s: float = 10.0) -> None:
        if self.conn.closed:
            return
        try:
            alive = self.proc.is_alive() if self.proc is not None else self.thread.is_alive()
            if alive and not self.conn.closed:
                self.call("bye", timeout_s=timeout_s)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        if self.proc is not None:
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout_s)
        if self.thread is not None:
            self.thread.join(timeout_s)
        self.conn.close()


def start_peer(target, spec, *, seed: int, mode: str = "auto", backend: str = "transport",
               fill: str = "random", device: str = "cpu") -> PeerHandle:
    """Start :func:`serve`: in a spawned process for a URL, in a thread for an Endpoint."""
    import multiprocessing as mp
    import threading

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    kwargs = dict(seed=seed, mode=mode, backend=backend, fill=fill, device=device)
    if isinstance(target, str):
        p = ctx.Process(target=serve, args=(child, target, spec.to_bytes()), kwargs=kwargs, daemon=True)
        p.start()
        child.close()
        return PeerHandle(parent, proc=p)
    t = threading.Thread(target=serve, args=(child, target, spec.to_bytes()), kwargs=kwargs, daemon=True)
    t.start()
    return PeerHandle(parent, thread=t)


def transport_unavailable(scheme: str) -> str | None:
    """Why transport ``scheme`` cannot be used here, or None when it can."""
    import transports
    from qlink.errors import MissingDependencyError

    try:
        transports.capabilities(scheme)
    except (ImportError, MissingDependencyError) as e:
        return f"transport {scheme!r} is not available here: {e}"
    except ValueError as e:
        return str(e)
    if scheme == "ucx":
        from transports.ucx import require_ucxx

        try:
            require_ucxx()
        except (ImportError, MissingDependencyError) as e:
            return f"the ucx transport needs ucxx ({e})"
    return None


class DecodeStation:
    """The decode side of one listener: a cache that outlives its links. Each
    :meth:`attach` starts a new :func:`serve` sender (a spawned process, a thread for
    ``inproc``) that connects to the listener, and builds a new receiver on the same
    cache, closing the previous receiver and its endpoint first. Close with :meth:`close`.
    """

    def __init__(self, scheme: str, cache):
        import transports

        self.scheme = scheme
        self.cache = cache
        self.listener = transports.listen(transports.loopback_url(scheme, tag="kv"))
        self._link: contextlib.ExitStack | None = None

    def attach(self, tx_spec=None, *, seed: int = 1, mode: str = "auto", backend: str = "transport",
               fill: str = "random", device: str = "cpu"):
        """Start a sender with ``tx_spec`` (default: the cache's) and return ``(receiver, peer)``."""
        import transports

        from ._receiver import KVReceiver

        self.detach()
        tx_spec = self.cache.spec if tx_spec is None else tx_spec
        link = self._link = contextlib.ExitStack()
        lis = self.listener
        if self.scheme == "inproc":
            client = transports.connect(lis.url, timeout_s=5)
            link.callback(client.close)
            peer = start_peer(client, tx_spec, seed=seed, mode=mode, backend=backend, fill=fill, device=device)
        else:
            peer = start_peer(lis.url, tx_spec, seed=seed, mode=mode, backend=backend, fill=fill, device=device)
        link.callback(peer.close)
        ep = lis.accept(timeout_s=60)
        link.callback(ep.close)
        if backend == "nixl":
            from .nixl_backend import NixlKVReceiver

            rx = NixlKVReceiver(ep, self.cache)
        else:
            rx = KVReceiver(ep, self.cache)
        link.callback(rx.close)
        peer.wait_ready()
        link.callback(peer.close)  # say bye while the link is still up (runs first)
        return rx, peer

    def detach(self) -> None:
        """Say bye to the current sender and close its receiver and endpoint."""
        if self._link is not None:
            link, self._link = self._link, None
            link.close()

    def close(self) -> None:
        self.detach()
        self.listener.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def open_link(scheme: str, rx_spec, tx_spec=None, *, seed: int = 1, mode: str = "auto", backend: str = "transport",
              rx_cache=None, fill: str = "random", device: str = "cpu"):
    """Yield ``(receiver, receiver_cache, peer)``: a receiver here, a :func:`serve` sender
    filled from ``seed`` in a spawned process (a thread for ``inproc``); both caches in
    ``device`` memory (``"gpu"``: CuPy arrays, for a device-capable transport)."""
    from .kv import KVCache

    cache = KVCache.allocate(rx_spec, device=device) if rx_cache is None else rx_cache
    with DecodeStation(scheme, cache) as station:
        rx, peer = station.attach(tx_spec, seed=seed, mode=mode, backend=backend, fill=fill, device=device)
        yield rx, cache, peer
