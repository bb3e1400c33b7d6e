"""The Mooncake Transfer Engine as a KV-transfer peer of ``qlink bench kv``.

Two spawned processes, as Mooncake's users run it between a prefill and a decode
worker: a *target* holding a destination cache and an *initiator* holding a source
cache of the same layout, each a ``mooncake.engine.TransferEngine`` initialized over
the ``tcp`` protocol with ``P2PHANDSHAKE`` metadata (no metadata server; the initiator
names the target as ``host:rpc_port``), each layer's cache registered as one region.
A request is ONE ``batch_transfer_sync_write`` of every layer's merged block runs
(contiguous blocks as one piece, as vLLM's ``MooncakeConnector`` groups them; several
calls in a row beyond :data:`MAX_BATCH_ENTRIES` runs), timed in the initiator from the
first call to the last one's return. The target then checks one byte of every
moved piece against the initiator's fill, so a transfer that moved nothing fails.

Mooncake's TCP transport cuts transfers into slices of ``MC_TCP_SLICE_SIZE`` bytes
(64 KiB by default; its users raise it, e.g. to 1 MiB). The variable is read once
per process, so every slice size gets its own process pair. :data:`TCP_ENV` holds the
other TCP settings its users run with.

Needs ``mooncake-transfer-engine-non-cuda`` and, at run time, the Debian packages
libibverbs1, libnl-3-200 and libnl-route-3-200. ``make`` unpacks them into the venv
(``<venv>/lib/mooncake-runtime``, or ``$QLINK_MOONCAKE_LIBS``) rather than installing
them system-wide: a system libibverbs makes the UCX inside nixl-cu12 load a second
libnl-route, and every process that used NIXL then dies with SIGSEGV at exit. Only the
Mooncake processes get those libraries on ``LD_LIBRARY_PATH``; the parent never imports
Mooncake. :func:`mooncake_unavailable` says why it cannot run here, or None.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import numpy as np

__all__ = ["mooncake_unavailable", "runtime_lib_dirs", "MooncakePair", "SLICE_SIZES", "TCP_ENV"]

#: Slice sizes measured: Mooncake's TCP default and the 1 MiB its users set.
SLICE_SIZES = (65536, 1 << 20)
_TIMEOUT_S = 120.0


def runtime_lib_dirs() -> list[str]:
    """Folders holding Mooncake's unpacked Debian run-time libraries (may be empty)."""
    import sys
    from pathlib import Path

    root = Path(os.environ.get("QLINK_MOONCAKE_LIBS") or Path(sys.prefix) / "lib" / "mooncake-runtime")
    return [str(d) for d in (*root.glob("usr/lib/*-linux-gnu"), *root.glob("lib/*-linux-gnu")) if d.is_dir()]


def _child_env() -> dict:
    """The environment of a Mooncake process: its run-time libraries first on LD_LIBRARY_PATH."""
    dirs = runtime_lib_dirs()
    env = dict(os.environ)
    if dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*dirs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    return env


def mooncake_unavailable() -> str | None:
    """Why the Mooncake peer cannot run here (None when it can); asked of a subprocess with
    the Mooncake processes' environment, so this process never loads Mooncake.

    >>> isinstance(mooncake_unavailable(), (str, type(None)))
    True
    """
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine-non-cuda is not installed (pip install 'qlink[mooncake]')"
    r = subprocess.run([sys.executable, "-c", "import mooncake.engine"], env=_child_env(), capture_output=True,
                       text=True, timeout=120)
    if r.returncode == 0:
        return None
    msg = (r.stderr.strip().splitlines() or ["?"])[-1]
    if "libibverbs" in msg or "libnl" in msg:
        return (f"the Mooncake Transfer Engine needs the Debian packages libibverbs1, libnl-3-200 and "
                f"libnl-route-3-200 at run time (`make deb-runtime` unpacks them into the venv): {msg}")
    return f"the Mooncake Transfer Engine does not import here: {msg}"


#: Set in both processes before the engine starts, as Mooncake's users run its TCP transport:
#: pooled connections (SGLang sets it; Mooncake's default from releases after 0.3.13) and
#: per-peer queues of 65535 transfers (the later default; 0.3.13's 1024 refuses one batch of
#: a few thousand block runs with -1).
#: Entries of one ``batch_transfer_sync_write``: a request with more (32k scattered tokens of
#: Llama-3-8B: 131,072 block runs) goes as several calls in a row, each at most half the
#: per-peer queue below (one call of all 131,072 returns -1 at once).
MAX_BATCH_ENTRIES = 32768
TCP_ENV = {"MC_TCP_ENABLE_CONNECTION_POOL": "true", "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
           "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535", "MC_LOG_LEVEL": "ERROR"}


def _engine(slice_nbytes: int):
    os.environ["MC_TCP_SLICE_SIZE"] = str(int(slice_nbytes))
    for k, v in TCP_ENV.items():
        os.environ.setdefault(k, v)
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    rc = eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize(tcp, P2PHANDSHAKE) returned {rc}")
    return eng


def _cache(spec_bytes: bytes, fill: int | None):
    from qlink.ai.kv import KVCache, KVCacheSpec

    cache = KVCache.allocate(KVCacheSpec.from_bytes(spec_bytes))
    for i, a in enumerate(cache.layers):  # fault every page in; the initiator's bytes say which layer
        a.view(np.uint8).fill(0 if fill is None else (i + fill) % 251 + 1)
    return cache


def _register(eng, cache) -> np.ndarray:
    addrs = [int(a.ctypes.data) for a in cache.layers]
    rc = eng.batch_register_memory(addrs, [cache.spec.layer_nbytes] * len(addrs))
    if rc != 0:
        raise RuntimeError(f"Mooncake batch_register_memory returned {rc}")
    return np.array(addrs, dtype=np.uint64)


def _target(conn, spec_bytes: bytes, slice_nbytes: int) -> None:
    from qlink.procs import die_with_parent

    die_with_parent()
    try:
        eng = _engine(slice_nbytes)
        cache = _cache(spec_bytes, None)
        addrs = _register(eng, cache)
        conn.send(("ready", eng.get_rpc_port(), addrs.tobytes()))
        while True:
            cmd = conn.recv()
            if cmd[0] == "bye":
                conn.send(("ok", None))
                return
            _, dst_offsets, layers, fill = cmd  # check one byte of every piece moved, then clear them
            bad = 0
            for k in layers:
                v = cache.layers[k].view(np.uint8).reshape(-1)
                bad += int(np.count_nonzero(v[dst_offsets] != (k + fill) % 251 + 1))
                v[dst_offsets] = 0
            conn.send(("ok", bad))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("err", f"{type(e).__name__}: {e}"))


def _initiator(conn, spec_bytes: bytes, slice_nbytes: int, session: str, remote: bytes,
               max_batch_entries: int = MAX_BATCH_ENTRIES) -> None:
    import time

    from qlink.procs import die_with_parent

    die_with_parent()
    try:
        eng = _engine(slice_nbytes)
        cache = _cache(spec_bytes, 0)
        local = _register(eng, cache)
        remote_addrs = np.frombuffer(remote, dtype=np.uint64)
        conn.send(("ready", None))
        while True:
            cmd = conn.recv()
            if cmd[0] == "bye":
                conn.send(("ok", None))
                return
            _, so, do, ln, layers = cmd
            src = (local[list(layers)][:, None] + so.astype(np.uint64)[None, :]).ravel().tolist()
            dst = (remote_addrs[list(layers)][:, None] + do.astype(np.uint64)[None, :]).ravel().tolist()
            lens = np.tile(ln, len(layers)).tolist()
            t0 = time.perf_counter_ns()
            rc = 0
            for a in range(0, len(lens), max_batch_entries):  # (one call beyond that fails: see MAX_BATCH_ENTRIES)
                b = a + max_batch_entries
                rc = eng.batch_transfer_sync_write(session, src[a:b], dst[a:b], lens[a:b])
                if rc != 0:
                    break
            t1 = time.perf_counter_ns()
            conn.send(("ok", (rc, t1 - t0)) if rc == 0 else ("err", f"batch_transfer_sync_write returned {rc}"))
    except Exception as e:  # noqa: BLE001
        conn.send(("err", f"{type(e).__name__}: {e}"))


_ENV_LOCK = threading.Lock()


def _start_with(proc, env: dict) -> None:
    """Start a spawned process with ``env`` (the child's loader reads LD_LIBRARY_PATH at start)."""
    with _ENV_LOCK:
        saved = os.environ.get("LD_LIBRARY_PATH")
        try:
            if env.get("LD_LIBRARY_PATH"):
                os.environ["LD_LIBRARY_PATH"] = env["LD_LIBRARY_PATH"]
            proc.start()
        finally:
            if saved is None:
                os.environ.pop("LD_LIBRARY_PATH", None)
            else:
                os.environ["LD_LIBRARY_PATH"] = saved


class MooncakePair:
    """A Mooncake target and initiator in two spawned processes, caches of ``spec``.

    ``write(plan, layers)`` moves the request's pieces (a :class:`~qlink.ai._descriptors.TransferPlan`)
    in every layer of ``layers`` with one ``batch_transfer_sync_write`` and returns
    the seconds the call took; it raises RuntimeError when a moved piece did not land."""

    def __init__(self, spec, *, slice_nbytes: int, max_batch_entries: int = MAX_BATCH_ENTRIES):
        ctx = mp.get_context("spawn")
        self.slice_nbytes = int(slice_nbytes)
        self._t, t_child = ctx.Pipe()
        self._i, i_child = ctx.Pipe()
        self._procs = [ctx.Process(target=_target, args=(t_child, spec.to_bytes(), self.slice_nbytes), daemon=True)]
        try:
            _start_with(self._procs[0], _child_env())
            _, port, remote = self._answer(self._t)
            self._procs.append(ctx.Process(target=_initiator, daemon=True,
                                           args=(i_child, spec.to_bytes(), self.slice_nbytes, f"127.0.0.1:{port}",
                                                 remote, int(max_batch_entries))))
            _start_with(self._procs[1], _child_env())
            self._answer(self._i)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _answer(conn):
        if not conn.poll(_TIMEOUT_S):
            raise TimeoutError(f"the Mooncake peer did not answer within {_TIMEOUT_S} s")
        msg = conn.recv()
        if msg[0] == "err":
            raise RuntimeError(f"Mooncake peer failed: {msg[1]}")
        return msg

    def write(self, plan, layers: range) -> float:
        self._i.send(("write", plan.src_offsets, plan.dst_offsets, plan.nbytes, tuple(layers)))
        _, (_, ns) = self._answer(self._i)
        self._t.send(("check", plan.dst_offsets, tuple(layers), 0))
        _, bad = self._answer(self._t)
        if bad:
            raise RuntimeError(f"Mooncake: {bad} moved pieces do not hold the initiator's bytes")
        return ns / 1e9

    def close(self) -> None:
        for conn in (self._i, self._t):
            try:
                conn.send(("bye",))
                conn.poll(5) and conn.recv()
            except (OSError, EOFError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
