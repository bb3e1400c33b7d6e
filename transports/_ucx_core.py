"""UCX plumbing for ``transports.ucx``: lazy UCXX import, one worker per process, hot-path ops.

UCXX creates and owns the UCX context, worker and endpoints (and closes them). The
per-message operations go through one of two *ops* objects with the same small API:

* :class:`UcpOps` (the default): the UCP C functions themselves (``ucp_worker_progress``,
  ``ucp_tag_probe_nb``, ``ucp_tag_send_nbx``, ``ucp_tag_msg_recv_nbx``, ``ucp_tag_recv_nbx``,
  request status/cancel/free) called through :mod:`ctypes` on the handles UCXX exposes, from
  the library UCXX loaded. Requests are plain UCP requests owned by this module.
* :class:`UcxxOps`: the same through UCXX's Python core API (``UCXWorker.progress_once``,
  ``tag_probe``, ``UCXEndpoint.tag_send`` / ``tag_recv_with_handle``...), each call wrapped
  in UCXX request objects; kept to compare against and as a fallback.

Buffers are passed as a *base* NumPy uint8 array plus a byte count, so both ops can cache
what they derive from a long-lived buffer (an address, a UCXX ``Array``).

Status codes follow UCX: 0 done, 1 in progress, negative an error (``-9`` truncated,
``-16`` canceled, ``-25``..``-89`` link and endpoint failures).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time

import numpy as np

from qlink.errors import missing

__all__ = ["ucxx", "ucx_config", "worker_for", "make_ops", "ep_lanes", "native_functions", "DEFAULT_UCX_TLS", "IN_PROGRESS", "status_text"]

DEFAULT_UCX_TLS = "tcp,sm,self"
IN_PROGRESS = 1
_ERR_LAST = (1 << 64) - 100  # UCS_PTR_IS_ERR: pointers at or above UCS_ERR_LAST are status codes
_CONN_MASK = 0xFFFFFF
_STATUS = {-3: "I/O error", -9: "message truncated", -16: "canceled", -25: "connection reset",
           -30: "endpoint timeout", -80: "timed out"}

# UCXX's import sets UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows and warns about.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

_mod = None
#: UCX options UCXX's import put into the environment, moved into the contexts made here
#: (see :func:`ucxx`); filled on first use
UCXX_IMPORT_OPTIONS: dict[str, str] = {}
_UNKNOWN_TO_UCX = {"MEMTYPE_CACHE"}  # set by UCXX, gone from UCX 1.21: as a context option it would fail


def ucxx():
    """(libucxx, Array) from UCXX, imported on first use; MissingDependencyError if absent.

    UCXX's import writes UCX options into ``os.environ`` (``UCX_RNDV_THRESH=8192``,
    ``UCX_RNDV_FRAG_MEM_TYPE``, ``UCX_MAX_RNDV_RAILS``, ``UCX_MEMTYPE_CACHE``). Every other
    UCX in the process, and every process started from it, would then read them: NIXL's
    UCX with ``UCX_RNDV_THRESH=8192`` reads a registered cache by software emulation
    over TCP instead of zero-copy CMA, 5-7 x slower. So the environment is put back as it
    was, and the options go to the contexts qlink makes (:data:`UCXX_IMPORT_OPTIONS`,
    applied by :func:`ucx_config`) - what UCXX meant, for UCXX's contexts only. An option
    the environment already held before the import stays in it (the user's)."""
    global _mod
    if _mod is None:
        before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        try:
            import ucxx._lib.libucxx as lib
            from ucxx._lib.arr import Array
        except ImportError as e:
            raise missing("ucxx-cu12", extra="ucx", feature="the ucx:// transport") from e
        finally:
            for k in [k for k in os.environ if k.startswith("UCX_") and os.environ[k] != before.get(k)]:
                if k[4:] not in _UNKNOWN_TO_UCX:
                    UCXX_IMPORT_OPTIONS[k[4:]] = os.environ[k]
                if k in before:
                    os.environ[k] = before[k]
                else:
                    del os.environ[k]
        _mod = (lib, Array)
    return _mod


def status_text(status: int) -> str:
    return f"UCX status {status} ({_STATUS.get(status, 'error')})"


def ucx_config(*, loopback: bool) -> dict[str, str]:
    """UCX options the contexts made here add to the environment's (the environment wins):
    qlink's transports and interface, and what UCXX's import meant to set (:func:`ucxx`).

    >>> import os
    >>> "NET_DEVICES" in ucx_config(loopback=True) or "UCX_NET_DEVICES" in os.environ
    True
    """
    cfg = {k: v for k, v in UCXX_IMPORT_OPTIONS.items() if "UCX_" + k not in os.environ}
    if "UCX_TLS" not in os.environ:
        cfg["TLS"] = DEFAULT_UCX_TLS
    if loopback and "UCX_NET_DEVICES" not in os.environ:
        cfg["NET_DEVICES"] = "lo"
    return cfg


class Worker:
    """One UCX context + worker per process and scope ('lo' or 'any'), shared by endpoints."""

    def __init__(self, scope: str) -> None:
        lib, _ = ucxx()
        self.scope = scope
        self.pid = os.getpid()
        self.config = ucx_config(loopback=scope == "lo")
        self.rma = True  # the context can map memory and put/get (endpoints opt in: transports.ucx rma=True)
        try:
            self.context = lib.UCXContext(self.config, feature_flags=(lib.Feature.TAG, lib.Feature.RMA))
        except Exception:  # noqa: BLE001 - a UCX without RMA here: tagged messages only
            self.rma = False
            self.context = lib.UCXContext(self.config, feature_flags=(lib.Feature.TAG,))
        self.worker = lib.UCXWorker(self.context)
        self.handle = self.worker.handle
        self.address = self.worker.address.tobytes()
        self.tls = self.context.config.get("TLS", "?")
        self._conn_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._linger_lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self.lingering: list = []  # closed endpoints (and orphaned requests) UCX still works on

    def next_conn_id(self) -> int:
        with self._lock:
            while True:
                cid = next(self._conn_ids) & _CONN_MASK
                if cid:
                    return cid

    def linger(self, item) -> None:
        """Keep ``item`` (with a ``_finish_linger(now, force=)`` method) until it says it is done."""
        with self._linger_lock:
            self.lingering.append(item)

    def reap_lingering(self, *, force: bool = False) -> None:
        if not self._reap_lock.acquire(blocking=force):
            return  # another thread is reaping
        try:
            with self._linger_lock:
                items, self.lingering = self.lingering, []
            now = time.monotonic()
            keep = [x for x in items if not x._finish_linger(now, force=force)]
            with self._linger_lock:
                self.lingering.extend(keep)
        finally:
            self._reap_lock.release()


_workers: dict[str, Worker] = {}
_workers_lock = threading.Lock()


def worker_for(scope: str) -> Worker:
    with _workers_lock:
        w = _workers.get(scope)
        if w is None or w.pid != os.getpid():
            w = _workers[scope] = Worker(scope)
        return w


def close_lingering() -> None:
    for w in list(_workers.values()):
        if w.pid == os.getpid():
            w.reap_lingering(force=True)


# ----- raw UCP through ctypes ------------------------------------------------------------------
class _Info(ctypes.Structure):
    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


_ucp = None


def _libucp():
    """The libucp UCXX loaded (found in this process's mappings), with argument types set."""
    global _ucp
    if _ucp is None:
        ucxx()
        path = None
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libucp.so" in line:
                    path = line.split()[-1]
                    break
        if path is None:
            raise OSError("libucp is not mapped into this process; UCXX did not load UCX")
        lib = ctypes.CDLL(path)
        vp, sz, u64, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int
        for name, args, res in (
            ("ucp_worker_progress", [vp], ctypes.c_uint),
            ("ucp_tag_probe_nb", [vp, u64, u64, i, ctypes.POINTER(_Info)], vp),
            ("ucp_tag_send_nbx", [vp, vp, sz, u64, vp], vp),
            ("ucp_tag_msg_recv_nbx", [vp, vp, sz, vp, vp], vp),
            ("ucp_tag_recv_nbx", [vp, vp, sz, u64, u64, vp], vp),
            ("ucp_request_check_status", [vp], i),
            ("ucp_request_cancel", [vp, vp], None),
            ("ucp_request_free", [vp], None),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        _ucp = lib
    return _ucp


def native_functions() -> tuple[int, ...]:
    """The addresses of ``ucp_worker_progress``, ``ucp_tag_probe_nb``, ``ucp_tag_send_nbx``,
    ``ucp_tag_msg_recv_nbx``, ``ucp_request_check_status`` and ``ucp_request_free`` in the
    library UCXX loaded, for native code that drives a connection itself."""
    lib = _libucp()
    names = ("ucp_worker_progress", "ucp_tag_probe_nb", "ucp_tag_send_nbx", "ucp_tag_msg_recv_nbx",
             "ucp_request_check_status", "ucp_request_free")
    return tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names)


def ep_lanes(ep_handle: int) -> list[str] | None:
    """The UCX transports/devices an endpoint's lanes use (from ``ucp_ep_print_info``), or None."""
    try:
        lib = _libucp()
        libc = ctypes.CDLL(None)
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
        lib.ucp_ep_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.ucp_ep_print_info.restype = None
        buf, size = ctypes.c_char_p(), ctypes.c_size_t()
        fp = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        if not fp:
            return None
        lib.ucp_ep_print_info(ep_handle, fp)
        libc.fclose(fp)
        text = ctypes.string_at(buf, size.value).decode(errors="replace")
        libc.free(ctypes.cast(buf, ctypes.c_void_p))
    except (OSError, AttributeError):
        return None
    lanes = []
    for line in text.splitlines():  # "#   lane[1]:  4:cma/memory.0 md[4] -> ..."
        if "lane[" in line and "]:" in line:
            field = line.split("]:", 1)[1].split()[0]
            name = field.split(":", 1)[-1].rsplit(".", 1)[0]
            if name not in lanes:
                lanes.append(name)
    return lanes


def _address_of(arr) -> int:
    ai = getattr(arr, "__array_interface__", None)
    if ai is None:  # device memory (a CuPy view): UCX finds its memory type itself
        ai = arr.__cuda_array_interface__
    return ai["data"][0]


class UcpOps:
    """Per-message operations as direct UCP calls. Requests are ints (0: completed at once)."""

    name = "ucp"
    _param = ctypes.create_string_buffer(256)  # ucp_request_param_t with op_attr_mask = 0: defaults
    _param_addr = ctypes.addressof(_param)

    def __init__(self, worker: Worker, ep) -> None:
        lib = _libucp()
        self._w = worker.handle
        self._e = ep.handle
        self._progress = lib.ucp_worker_progress
        self._probe = lib.ucp_tag_probe_nb
        self._send = lib.ucp_tag_send_nbx
        self._msg_recv = lib.ucp_tag_msg_recv_nbx
        self._tag_recv = lib.ucp_tag_recv_nbx
        self._check = lib.ucp_request_check_status
        self._cancel = lib.ucp_request_cancel
        self._free = lib.ucp_request_free
        self._info = _Info()
        self._info_ref = ctypes.byref(self._info)
        self._addrs: dict[int, tuple[np.ndarray, int]] = {}

    def _addr(self, base: np.ndarray) -> int:
        hit = self._addrs.get(id(base))
        if hit is not None and hit[0] is base:
            return hit[1]
        addr = _address_of(base)
        if len(self._addrs) > 256:
            self._addrs.clear()
        self._addrs[id(base)] = (base, addr)
        return addr

    def progress(self) -> None:
        self._progress(self._w)

    def probe(self, tag: int, mask: int):
        """Take the first matching message off the queue: (handle, length, sender_tag) or None."""
        h = self._probe(self._w, tag, mask, 1, self._info_ref)
        if not h:
            return None
        return h, self._info.length, self._info.sender_tag

    def _req(self, r) -> int:
        if r is None:
            return 0
        if r >= _ERR_LAST:
            raise _UcxStatus(r - (1 << 64))
        return r

    def send(self, base: np.ndarray, n: int, tag: int, *, cache: bool = True) -> int:
        r = self._send(self._e, self._addr(base) if cache else _address_of(base), n, tag, self._param_addr)
        if r is None:
            return 0  # completed at once
        if r >= _ERR_LAST:
            raise _UcxStatus(r - (1 << 64))
        return r

    def recv_msg(self, msg, base: np.ndarray, n: int, *, cache: bool = True) -> int:
        r = self._msg_recv(self._w, self._addr(base) if cache else _address_of(base), n, msg[0], self._param_addr)
        if r is None:
            return 0
        if r >= _ERR_LAST:
            raise _UcxStatus(r - (1 << 64))
        return r

    def recv_tag(self, base: np.ndarray, n: int, tag: int) -> int:
        return self._req(self._tag_recv(self._w, _address_of(base), n, tag, (1 << 64) - 1, self._param_addr))

    def status(self, req: int) -> int:
        return 0 if not req else self._check(req)

    def release(self, req: int) -> None:
        if req:
            self._free(req)

    def cancel(self, req: int) -> None:
        if req:
            self._cancel(self._w, req)


class UcxxOps:
    """Per-message operations through UCXX's Python core API (UCXX request objects)."""

    name = "ucxx"

    def __init__(self, worker: Worker, ep) -> None:
        lib, self._Array = ucxx()
        self._worker = worker.worker
        self._ep = ep
        self._Tag, self._Mask = lib.UCXXTag, lib.UCXXTagMask
        self._tags: dict[int, object] = {}
        self._arrays: dict[tuple[int, int], tuple[np.ndarray, object]] = {}

    def _tag(self, value: int):
        t = self._tags.get(value)
        if t is None:
            if len(self._tags) > 64:
                self._tags.clear()
            t = self._tags[value] = self._Tag(value)
        return t

    def _arr(self, base: np.ndarray, n: int):
        key = (id(base), n)
        hit = self._arrays.get(key)
        if hit is not None and hit[0] is base:
            return hit[1]
        arr = self._Array(base[:n])
        if len(self._arrays) > 1024:
            self._arrays.clear()
        self._arrays[key] = (base, arr)
        return arr

    def progress(self) -> None:
        self._worker.progress_once()

    def probe(self, tag: int, mask: int):
        p = self._worker.tag_probe(self._tag(tag), self._Mask(mask), remove=True)
        if not p.matched:
            return None
        return p, p.length, p.sender_tag.value

    @staticmethod
    def _req(req):
        st = req.status
        if st < 0:
            raise _UcxStatus(st)
        return req

    def send(self, base: np.ndarray, n: int, tag: int, *, cache: bool = True):
        arr = self._arr(base, n) if cache else self._Array(base[:n])
        return self._req(self._ep.tag_send(arr, self._tag(tag)))

    def recv_msg(self, msg, base: np.ndarray, n: int, *, cache: bool = True):
        arr = self._arr(base, n) if cache else self._Array(base[:n])
        return self._req(self._ep.tag_recv_with_handle(arr, msg[0]))

    def recv_tag(self, base: np.ndarray, n: int, tag: int):
        return self._req(self._ep.tag_recv(self._Array(base[:n]), self._tag(tag)))

    @staticmethod
    def status(req) -> int:
        return 0 if req is None else req.status

    @staticmethod
    def release(req) -> None:
        return None

    @staticmethod
    def cancel(req) -> None:
        return None  # UCXX cancels an endpoint's requests when the endpoint closes


class _UcxStatus(Exception):
    """A UCX call returned an error status at once (mapped to qlink errors by the endpoint)."""

    def __init__(self, status: int) -> None:
        super().__init__(status_text(status))
        self.status = status


UcxStatus = _UcxStatus

HOT_PATHS = {"ucp": UcpOps, "ucxx": UcxxOps}


def make_ops(kind: str, worker: Worker, ep):
    try:
        return HOT_PATHS[kind](worker, ep)
    except KeyError:
        raise ValueError(f"hot_path must be one of {sorted(HOT_PATHS)}, got {kind!r}") from None
