"""One-sided UCX RMA for ``transports.ucx``: registered regions and ``ucp_put_nbx``, through ctypes.

UCXX's Python API has no memory registration or remote keys, but UCXX owns an ordinary
UCP context, worker and endpoints, and :mod:`._ucx_core` already calls UCP's C functions
on their handles. This module adds the RMA calls NIXL's UCX backend makes:

* the target maps a registered host region (``ucp_mem_map``) and packs its remote key
  (``ucp_rkey_pack``); :func:`region_key` puts the region's address and that key into the
  region descriptor's key, after the endpoint's token;
* the initiator unpacks the key on its endpoint once (``ucp_ep_rkey_unpack``), writes
  each piece with ``ucp_put_nbx`` straight into the target's memory (between local
  processes UCX picks zero-copy CMA: one copy, by the initiator, nothing staged), then
  ``ucp_ep_flush_nbx`` so every byte is in place at the target before the control frame
  that announces the put leaves.

Between processes of one host the copy is ``process_vm_writev``: both must belong to one
user (and ptrace must allow it), as for UCX's CMA anywhere.

>>> split_key(b"tok" + bytes(8), 3)
(b'tok', None, b'')
"""

from __future__ import annotations

import ctypes
import struct
import time

import numpy as np

from qlink.errors import BrokenLinkError, QlinkTimeoutError

from . import _ucx_core as core
from ._shm_records import _ringc

__all__ = ["available", "MappedRegion", "RemoteKeys", "rma_pieces", "region_key", "split_key"]

_ADDR = struct.Struct("<Q")
_FIELD_ADDRESS, _FIELD_LENGTH = 1, 2  # UCP_MEM_MAP_PARAM_FIELD_ADDRESS | _LENGTH
_INPROGRESS = 1


class _MemMapParams(ctypes.Structure):  # ucp_mem_map_params_t (UCX 1.x)
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p), ("length", ctypes.c_size_t),
                ("flags", ctypes.c_uint), ("prot", ctypes.c_uint), ("memory_type", ctypes.c_int),
                ("exported_memh_buffer", ctypes.c_void_p)]


_lib = None
_PARAM = ctypes.create_string_buffer(256)  # ucp_request_param_t, op_attr_mask = 0: no callback, defaults
_PARAM_ADDR = ctypes.addressof(_PARAM)


def _ucp():
    global _lib
    if _lib is None:
        lib = core._libucp()
        vp, sz, u64, st = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int
        for name, args, res in (
            ("ucp_mem_map", [vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(vp)], st),
            ("ucp_mem_unmap", [vp, vp], st),
            ("ucp_rkey_pack", [vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)], st),
            ("ucp_rkey_buffer_release", [vp], None),
            ("ucp_ep_rkey_unpack", [vp, ctypes.c_char_p, ctypes.POINTER(vp)], st),
            ("ucp_rkey_destroy", [vp], None),
            ("ucp_put_nbx", [vp, vp, sz, u64, vp, vp], vp),
            ("ucp_get_nbx", [vp, vp, sz, u64, vp, vp], vp),
            ("ucp_ep_flush_nbx", [vp, vp], vp),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        _lib = lib
    return _lib


def available(box) -> bool:
    """Whether ``box`` (a :class:`~transports._ucx_core.Worker`) was made with UCP's RMA feature."""
    return bool(getattr(box, "rma", False))


class MappedRegion:
    """A host region mapped for RMA on ``box``'s context: ``key`` (its address and packed remote
    key) goes to the peer inside the region descriptor; :meth:`unmap` releases it."""

    def __init__(self, box, addr: int, nbytes: int) -> None:
        lib = _ucp()
        self._box = box
        self.memh = ctypes.c_void_p()
        p = _MemMapParams(field_mask=_FIELD_ADDRESS | _FIELD_LENGTH, address=addr, length=max(int(nbytes), 1))
        st = lib.ucp_mem_map(box.context.handle, ctypes.byref(p), ctypes.byref(self.memh))
        if st != 0:
            raise OSError(f"ucp_mem_map of {nbytes} bytes failed: {core.status_text(st)}")
        buf, n = ctypes.c_void_p(), ctypes.c_size_t()
        st = lib.ucp_rkey_pack(box.context.handle, self.memh, ctypes.byref(buf), ctypes.byref(n))
        if st != 0:
            self.unmap()
            raise OSError(f"ucp_rkey_pack failed: {core.status_text(st)}")
        self.key = _ADDR.pack(addr) + ctypes.string_at(buf, n.value)
        lib.ucp_rkey_buffer_release(buf)

    def unmap(self) -> None:
        if self.memh:
            _ucp().ucp_mem_unmap(self._box.context.handle, self.memh)
            self.memh = ctypes.c_void_p()


def region_key(token: bytes, mapped: MappedRegion | None) -> bytes:
    """A region descriptor's key: the endpoint's token, then (when mapped) address and remote key."""
    return token if mapped is None else token + mapped.key


def split_key(key: bytes, token_nbytes: int) -> tuple[bytes, int | None, bytes]:
    """``(token, remote address or None, packed remote key)`` of a descriptor key."""
    token, rest = key[:token_nbytes], key[token_nbytes:]
    if len(rest) <= _ADDR.size:
        return token, None, b""
    return token, _ADDR.unpack_from(rest)[0], rest[_ADDR.size:]


class RemoteKeys:
    """Remote keys unpacked on one endpoint, by region id (a region's key never changes)."""

    def __init__(self, ep_handle: int) -> None:
        self._ep = ep_handle
        self._keys: dict[int, tuple[bytes, ctypes.c_void_p]] = {}

    def get(self, region_id: int, packed: bytes) -> ctypes.c_void_p:
        hit = self._keys.get(region_id)
        if hit is not None and hit[0] == packed:
            return hit[1]
        if hit is not None:
            _ucp().ucp_rkey_destroy(hit[1])
        rkey = ctypes.c_void_p()
        st = _ucp().ucp_ep_rkey_unpack(self._ep, packed, ctypes.byref(rkey))
        if st != 0:
            raise OSError(f"ucp_ep_rkey_unpack failed: {core.status_text(st)}")
        self._keys[region_id] = (packed, rkey)
        return rkey

    def forget(self, region_id: int) -> None:
        hit = self._keys.pop(region_id, None)
        if hit is not None:
            _ucp().ucp_rkey_destroy(hit[1])

    def close(self) -> None:
        for rid in list(self._keys):
            self.forget(rid)


def _fn_address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _post_in_c(call, ep_handle: int, local_addr: int, lo, ro, ln, remote_addr: int, rkey):
    """One ``ucp_{put,get}_nbx`` per piece in the C loop of ``transports._ringc`` (``None``
    where that build is missing): ``(requests in progress, first error status, its piece)``."""
    post = getattr(_ringc, "rma_post", None) if _ringc is not None else None
    if post is None:
        return None
    lo, ro, ln = (np.ascontiguousarray(x, dtype=np.int64) for x in (lo, ro, ln))
    out = np.empty(max(ln.size, 1), dtype=np.uint64)
    nin, status, at = post(_fn_address(call), ep_handle, local_addr, lo, remote_addr, ro, ln,
                           rkey.value or 0, _PARAM_ADDR, out)
    return out[:nin].tolist(), status, at


def _status(r) -> int:
    if r is None:
        return 0
    return r - (1 << 64) if r >= core._ERR_LAST else _INPROGRESS


def rma_pieces(op: str, worker_handle: int, ep_handle: int, local_addr: int, local_offsets, remote_offsets, nbytes,
               remote_addr: int, rkey, *, deadline: float | None, what: str) -> None:
    """``op="put"``: write ``nbytes[i]`` bytes of the memory at ``local_addr + local_offsets[i]``
    to ``remote_addr + remote_offsets[i]``, for every piece i; ``"get"``: read them from there
    into here. Then flush the endpoint: when this returns, every byte is in place (at the target
    for a put, here for a get). BrokenLinkError when UCX fails one, QlinkTimeoutError past
    ``deadline``. The calls are made in one C loop (``transports._ringc.rma_post``), one ctypes
    call each only where that build is missing."""
    lib = _ucp()
    call = lib.ucp_put_nbx if op == "put" else lib.ucp_get_nbx
    progress, check, free = lib.ucp_worker_progress, lib.ucp_request_check_status, lib.ucp_request_free
    reqs = []

    def take(r, name: str) -> None:  # a request UCX handed back: done, in progress (kept), or failed
        st = _status(r)
        if st < 0:
            _finish(reqs, progress, check, free, worker_handle, None)
            raise BrokenLinkError(f"ucx: {what}: {name} failed: {core.status_text(st)}")
        if st == _INPROGRESS:
            reqs.append(r)

    posted = _post_in_c(call, ep_handle, local_addr, local_offsets, remote_offsets, nbytes, remote_addr, rkey)
    if posted is None:
        for lo, ro, n in zip(np.asarray(local_offsets).tolist(), np.asarray(remote_offsets).tolist(),
                             np.asarray(nbytes).tolist()):
            if n:
                take(call(ep_handle, local_addr + lo, n, remote_addr + ro, rkey, _PARAM_ADDR), f"ucp_{op}_nbx")
    else:
        reqs, status, at = posted
        if status < 0:
            _finish(reqs, progress, check, free, worker_handle, None)
            raise BrokenLinkError(f"ucx: {what}: ucp_{op}_nbx of piece {at} failed: {core.status_text(status)}")
    take(lib.ucp_ep_flush_nbx(ep_handle, _PARAM_ADDR), "ucp_ep_flush_nbx")
    bad = _finish(reqs, progress, check, free, worker_handle, deadline)
    if bad is None:
        raise QlinkTimeoutError(f"ucx: {what} was not done and flushed before its deadline")
    if bad < 0:
        raise BrokenLinkError(f"ucx: {what} failed: {core.status_text(bad)}")


def _finish(reqs, progress, check, free, worker_handle, deadline) -> int | None:
    """Progress until every request is done (freeing each); the first error status, 0, or
    None when ``deadline`` passed first (the rest are freed: UCX completes them itself)."""
    bad = 0
    spins = 0
    while reqs:
        r = reqs[-1]
        st = check(r)
        if st == _INPROGRESS:
            progress(worker_handle)
            spins += 1
            if deadline is not None and spins % 256 == 0 and time.monotonic() > deadline:
                for q in reqs:
                    free(q)
                return None
            continue
        free(r)
        reqs.pop()
        if st < 0 and not bad:
            bad = st
    return bad
