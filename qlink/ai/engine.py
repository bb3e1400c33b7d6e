"""Moving KV-cache blocks from a prefill worker to a decode worker, layer by layer.

A :class:`KVReceiver` (decode side) registers its per-layer arrays once and sends their
descriptors and its :class:`~qlink.ai.kv.KVCacheSpec` to the :class:`KVSender` (prefill
side) in a ``kv_hello`` frame; both sides check the layouts agree
(:class:`~qlink.ai.kv.LayoutMismatchError` names the field that differs). Then
``sender.send_request(request_id, src_block_ids, dst_block_ids)`` turns the block ids
into byte ranges with NumPy, merges contiguous runs (K and V planes), and pushes layer by
layer:

* over a transport with one-sided put (``capabilities.one_sided``): the merged descriptors
  go straight into the receiver's cache (WRITE), with ``notify_id`` = request id and a
  ``kv_write`` tag saying which layer and how many parts complete it. A whole layer is one
  ``endpoint.put_many`` call, however scattered its blocks: the per-descriptor work is the
  transport's (``shm``: C; ``tcp``: one scatter-gather frame; ``inproc``: NumPy; ``ucx``: a
  loop of puts inside the transport). Where the endpoint gathers (``put_many_gathers``:
  ``shm``, ``tcp``, ``inproc``, ``cuda_ipc``) the layer is one part with one notification;
  elsewhere each descriptor's notification is a part of the size it reports. Over ``shm``
  the sender also registers its own cache and defers the copy (``put_many(..., defer=True)``):
  submitting a layer only posts its descriptors, and the receiver copies the blocks out of
  the sender's cache while it waits for them, so the source blocks must stay unchanged
  until the receiver has the request or :meth:`KVSender.flush` returns (``defer=False``
  copies at submission instead). With ``checksum=True`` each descriptor is its own put
  and part, carrying its CRC-32;
* otherwise (two-sided): per layer one ``kv_rows`` frame and one message holding the
  destination block rows and the blocks, gathered with one NumPy ``take`` and scattered
  by the receiver with one fancy-index assignment (a layer larger than the transport's
  message limit goes in several such parts). A device cache sends a ``kv_data`` frame and
  the payload per descriptor, received straight into the destination blocks.

The receiver's :meth:`KVReceiver.wait_layer` returns once a layer is complete, always in
layer order, so decode can read layer ``k`` while later layers still move. READ (pull)
needs a one-sided get, which none of the transports offers: it raises CapabilityError
(the NIXL backend does READ).

>>> import threading, transports
>>> from qlink.ai import KVCache, KVReceiver, KVSender, preset
>>> spec = preset("tiny", num_blocks=16)
>>> prefill, decode = KVCache.allocate(spec), KVCache.allocate(spec)
>>> prefill.fill_random(seed=1)
>>> with transports.listen("inproc://kv-doc") as lis:
...     a = transports.connect(lis.url); b = lis.accept(timeout_s=1)
...     rx = KVReceiver(b, decode); tx = KVSender(a, prefill)
...     sub = tx.send_request(7, [3, 4, 5, 9], [0, 1, 2, 3], timeout_s=5)
...     rec = rx.wait_request(7, timeout_s=5)
>>> sub.num_descs, rec.num_descs, rec.nbytes, rec.transport, rec.mode
(16, 16, 8192, 'inproc', 'put')
>>> bool((decode.block_checksums([0, 1, 2, 3]) == prefill.block_checksums([3, 4, 5, 9])).all())
True
>>> a.close(); b.close()
"""

from __future__ import annotations

import operator
import time
import zlib

import numpy as np

from qlink.errors import (
    BrokenLinkError,
    CapabilityError,
    ClosedError,
    QlinkError,
    QlinkTimeoutError,
    RegistrationError,
    WireError,
    WouldBlock,
)
from qlink.memory import RemoteRegion, as_byte_view

from . import _frames as fr
from ._descriptors import BlockIdError, TransferPlan, plan_transfer
from ._tracker import KVStatistics, RequestTracker, SubmitRecord, TransferAbortedError, TransferRecord
from .kv import KVCache, KVCacheSpec, LayoutMismatchError, _cupy

__all__ = [
    "KVSender",
    "KVReceiver",
    "KVSendRequest",
    "TransferRecord",
    "SubmitRecord",
    "KVStatistics",
    "TransferAbortedError",
    "BlockIdError",
    "MODES",
]

MODES = ("auto", "put", "send")
_ROLE_SENDER, _ROLE_RECEIVER, _ROLE_NIXL_SENDER, _ROLE_NIXL_RECEIVER = 1, 2, 3, 4
_ROLE_NAMES = {1: "a KVSender", 2: "a KVReceiver", 3: "a NixlKVSender", 4: "a NixlKVReceiver"}
_MODE_CODES = {"auto": 0, "put": 1, "send": 2, "nixl": 3}
_MODE_NAMES = {v: k for k, v in _MODE_CODES.items()}
_ABORT_SUBMIT_FAILED = 3  # INTERNAL_ERROR in the CUDA-Q status table
_ABORT_CORRUPT = 2  # a part whose CRC-32 does not match (the receiver's own verdict)
_MAX_REQUEST_ID = (1 << 32) - 1
_EVENTS_PER_PROGRESS = 4096
_BREAK_GRACE_S = 0.25  # after the control link breaks, how long completions still in flight may take
_BREAK_QUIET_POLLS = 20  # ... and how many empty polls (1 ms apart) end that wait sooner
_MAX_HELLO_NBYTES = 1 << 20


def _layers_of(layers, num_layers: int) -> range:
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"layers must be 'all' or a range of layer indices, got {layers!r}")
        return range(num_layers)
    if isinstance(layers, int):
        layers = range(layers, layers + 1)
    if not isinstance(layers, range) or layers.step != 1 or len(layers) == 0:
        raise ValueError(f"layers must be 'all', a layer index, or a non-empty range with step 1, got {layers!r}")
    if layers.start < 0 or layers.stop > num_layers:
        raise ValueError(f"layers {layers} fall outside the cache's layers [0, {num_layers})")
    return layers


def _check_device(cache: KVCache, endpoint) -> None:
    if cache.device != "cpu" and not endpoint.capabilities.device_memory:
        raise CapabilityError(f"the KV cache lives on device {cache.device!r} but transport "
                              f"{endpoint.capabilities.name!r} moves host memory only; use a device-capable transport")


def _can_defer(endpoint) -> bool:
    """The endpoint may leave a put_many's copy to the target (``shm``): it has deferred
    puts to flush, so it overrides the base ``flush`` (which returns at once)."""
    from transports import Endpoint

    return getattr(getattr(endpoint, "flush", None), "__func__", None) is not Endpoint.flush


def _check_request_id(request_id) -> int:
    try:
        rid = operator.index(request_id)
    except TypeError:
        rid = -1
    if isinstance(request_id, bool) or not 0 <= rid <= _MAX_REQUEST_ID:
        raise ValueError(f"request_id must be an integer in [0, 2**32), got {request_id!r}")
    return rid


class _Peer:
    """What the handshake learned about the other side."""

    __slots__ = ("spec", "mode", "regions", "crc32")

    def __init__(self, spec: KVCacheSpec, mode: str, regions: list[RemoteRegion], crc32: bool = False):
        self.spec, self.mode, self.regions, self.crc32 = spec, mode, regions, crc32


def _parse_hello(frame, *, expect_role: int, local: KVCacheSpec, side: str) -> _Peer:
    role, mode_code, spec_b, regions_b = fr.unpack_hello(frame)
    if role != expect_role:
        what = _ROLE_NAMES.get(role, f"role {role}")
        raise WireError(f"the peer is {what} where {_ROLE_NAMES[expect_role]} was expected; a KV transfer pairs "
                        "KVSender with KVReceiver, or NixlKVSender with NixlKVReceiver")
    if mode_code not in _MODE_NAMES:
        raise WireError(f"the peer asked for unknown mode code {mode_code}")
    spec = KVCacheSpec.from_bytes(spec_b)
    local.check_compatible(spec, side=side)
    regions = regions_b if expect_role in (_ROLE_NIXL_SENDER, _ROLE_NIXL_RECEIVER) else \
        [RemoteRegion.from_bytes(r) for r in regions_b]
    return _Peer(spec, _MODE_NAMES[mode_code], regions, bool(fr.hello_flags(frame) & fr.HELLO_PARTS_CRC32))


class KVSendRequest:
    """One request being sent: its merged plan, sent layer by layer.

    Made by :meth:`KVSender.begin_request`; call :meth:`send_layer` for each layer of
    ``layers`` as it becomes ready (prefill), in any order, each once.
    """

    def __init__(self, sender: "KVSender", request_id: int, plan: TransferPlan, layers: range, plan_ns: int):
        self.sender = sender
        self.request_id = request_id
        self.plan = plan
        self.layers = layers
        self.submit_ns = time.monotonic_ns()
        self._plan_ns = plan_ns
        self._submit_ns_total = 0
        self._sent: set[int] = set()
        self._failed: BaseException | None = None
        self._lists = None
        self._rows = None

    def _descs(self) -> tuple[list, list, list]:
        """Source offsets, destination offsets and sizes as Python ints (made once, when a
        per-descriptor loop needs them, so it touches no NumPy scalar)."""
        if self._lists is None:
            p = self.plan
            self._lists = (p.src_offsets.tolist(), p.dst_offsets.tolist(), p.nbytes.tolist())
        return self._lists

    def _row_parts(self, max_rows: int) -> tuple:
        """Source rows, destination rows as little-endian u32, and ``(start, stop)`` of each
        part of at most ``max_rows`` rows (made once per request, for two-sided sends)."""
        if self._rows is None:
            src_rows, dst_rows = self.plan.block_rows()
            bounds = [(a, min(a + max_rows, src_rows.size)) for a in range(0, src_rows.size, max_rows)]
            self._rows = (src_rows, dst_rows.astype("<u4"), bounds)
        return self._rows

    @property
    def _src(self) -> list:
        return self._descs()[0]

    @property
    def _dst(self) -> list:
        return self._descs()[1]

    @property
    def _len(self) -> list:
        return self._descs()[2]

    @property
    def done(self) -> bool:
        return len(self._sent) == len(self.layers)

    def send_layer(self, layer: int, *, timeout_s: float | None = 10.0) -> None:
        """Push every descriptor of ``layer`` (one ``put_many``, or one gathered two-sided part)."""
        if self._failed is not None:
            raise QlinkError(f"request {self.request_id} already failed ({self._failed}); begin a new request") \
                from self._failed
        if layer not in self.layers:
            raise ValueError(f"request {self.request_id} moves layers {self.layers}; layer {layer} is not one of them")
        if layer in self._sent:
            raise ValueError(f"layer {layer} of request {self.request_id} was already sent")
        s = self.sender
        t0 = time.perf_counter_ns()
        try:
            s._submit_layer(self, layer, timeout_s)
        except BrokenLinkError as e:
            self._failed = e
            raise
        except BaseException as e:
            self._failed = e
            s._abort(self, layer, e)
            raise
        self._submit_ns_total += time.perf_counter_ns() - t0
        self._sent.add(layer)

    def send_all(self, *, timeout_s: float | None = 10.0) -> SubmitRecord:
        """Send every layer not sent yet, in order; return the submission record."""
        for layer in self.layers:
            if layer not in self._sent:
                self.send_layer(layer, timeout_s=timeout_s)
        return self.record()

    def record(self) -> SubmitRecord:
        n = len(self._sent)
        nblocks = 2 * self.plan.num_blocks * max(n, 1)
        total_us = (self._plan_ns + self._submit_ns_total) / 1e3
        return SubmitRecord(
            request_id=self.request_id, nbytes=self.plan.layer_nbytes * n, num_descs=self.plan.num_descs * n,
            num_layers=n, transport=self.sender.transport, mode=self.sender.mode, plan_us=self._plan_ns / 1e3,
            submit_us=self._submit_ns_total / 1e3, us_per_block=total_us / nblocks,
        )


class KVSender:
    """The prefill side: pushes blocks of its cache into a :class:`KVReceiver`'s cache.

    ``mode``: ``"auto"`` (one-sided put when the transport has it, else two-sided send),
    ``"put"`` or ``"send"``. The hello is sent here; the receiver's is read by
    :meth:`handshake` (called by the first request if not before). ``defer`` (where the
    endpoint gathers puts, ``shm``): register this cache so the receiver copies the blocks
    out of it itself; submission then costs no copy, and blocks sent must stay unchanged
    until the receiver has them or :meth:`flush` returns.
    """

    def __init__(self, endpoint, cache: KVCache, *, mode: str = "auto", defer: bool = True,
                 checksum: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a qlink.ai.KVCache, got {type(cache).__name__}")
        _check_device(cache, endpoint)
        if checksum and cache.device != "cpu":
            raise ValueError("checksum=True needs a host (NumPy) cache: the CRC-32 of each part is taken on the host")
        if mode == "put" and not endpoint.capabilities.one_sided:
            raise CapabilityError(f"mode='put' needs one-sided put; transport {endpoint.capabilities.name!r} has none "
                                  "(use mode='auto' or 'send')")
        self.endpoint = endpoint
        self.cache = cache
        self.spec = cache.spec
        self.transport = endpoint.capabilities.name
        self.requested_mode = mode
        self.mode = ""  # decided by the handshake
        self._peer: _Peer | None = None
        self._views = [as_byte_view(a) if cache.device == "cpu" else a.reshape(-1).view("uint8") for a in cache.layers]
        self._rows2d = [a.reshape(-1).view(np.uint8).reshape(-1, self.spec.block_nbytes) for a in cache.layers] \
            if cache.device == "cpu" else None
        self._stage: np.ndarray | None = None  # two-sided parts are gathered here
        self._pack = fr._WRITE_FULL.pack
        self.checksum = bool(checksum)
        # a CRC-32 per part needs one notification per descriptor: no gathered put_many then
        self._gathers = bool(getattr(endpoint, "put_many_gathers", False)) and not self.checksum
        self._src_regions = []
        if defer and self._gathers and _can_defer(endpoint) and cache.device == "cpu" and mode != "send":
            try:
                for a in cache.layers:  # so the receiver can copy out of them (deferred put_many)
                    self._src_regions.append(endpoint.register(a))
            except QlinkError:
                self._release_sources()
        self._defer = bool(self._src_regions)
        self._max_desc_nbytes = endpoint.capabilities.max_message_bytes
        endpoint.send(fr.pack_hello(role=_ROLE_SENDER, mode=_MODE_CODES[mode], spec=self.spec.to_bytes(), regions=[],
                                    flags=fr.HELLO_PARTS_CRC32 if self.checksum else 0))

    def handshake(self, *, timeout_s: float | None = 10.0) -> str:
        """Read the receiver's hello, check the layouts, and return the mode (``"put"``/``"send"``)."""
        if self._peer is not None:
            return self.mode
        frame = self.endpoint.recv(timeout_s=timeout_s, max_nbytes=_MAX_HELLO_NBYTES)
        peer = _parse_hello(frame, expect_role=_ROLE_RECEIVER, local=self.spec, side="receiver")
        if len(peer.regions) not in (0, self.spec.num_layers):
            raise WireError(f"receiver sent {len(peer.regions)} region descriptors for {self.spec.num_layers} layers")
        if self.requested_mode == "send" or not peer.regions:
            if self.requested_mode == "put":
                raise CapabilityError("mode='put' but the receiver registered no regions (its transport side cannot)")
            self.mode = "send"
        else:
            self.mode = "put"
        for i, r in enumerate(peer.regions):
            if r.nbytes != peer.spec.layer_nbytes:
                raise LayoutMismatchError(f"receiver's region for layer {i} is {r.nbytes} B, its spec says "
                                          f"{peer.spec.layer_nbytes} B", field="region_nbytes")
        self._peer = peer
        return self.mode

    @property
    def peer_spec(self) -> KVCacheSpec | None:
        return None if self._peer is None else self._peer.spec

    def begin_request(self, request_id: int, src_block_ids, dst_block_ids, *, layers="all",
                      timeout_s: float | None = 10.0) -> KVSendRequest:
        """Validate and plan a request; send its layers with :meth:`KVSendRequest.send_layer`.

        Raises :class:`~qlink.ai.BlockIdError` for ids out of range (of this cache for
        ``src``, of the receiver's for ``dst``), lists of different lengths, or a
        destination block named twice; nothing is sent then.
        """
        request_id = _check_request_id(request_id)
        self.handshake(timeout_s=timeout_s)
        layer_range = _layers_of(layers, self.spec.num_layers)
        t0 = time.perf_counter_ns()
        plan = plan_transfer(src_block_ids, dst_block_ids, src_num_blocks=self.spec.num_blocks,
                             dst_num_blocks=self._peer.spec.num_blocks, block_nbytes=self.spec.block_nbytes,
                             max_desc_nbytes=self._max_desc_nbytes)
        return KVSendRequest(self, request_id, plan, layer_range, time.perf_counter_ns() - t0)

    def send_request(self, request_id: int, src_block_ids, dst_block_ids, *, layers="all",
                     timeout_s: float | None = 10.0) -> SubmitRecord:
        """Move blocks ``src_block_ids[i]`` -> ``dst_block_ids[i]`` of every layer in ``layers``,
        layer by layer (WRITE). Returns when everything is submitted; the receiver's
        notifications say when each layer has landed. With deferred puts (``shm``, the
        default there) the receiver copies the blocks out of this cache as it waits for
        them: keep them unchanged until it has the request, or call :meth:`flush`."""
        return self.begin_request(request_id, src_block_ids, dst_block_ids, layers=layers,
                                  timeout_s=timeout_s).send_all(timeout_s=timeout_s)

    def read_request(self, *_args, **_kwargs):
        """READ (pull) is done by the target with a one-sided get; qlink transports offer put only."""
        raise CapabilityError(f"READ needs a one-sided get, which transport {self.transport!r} does not offer; "
                              "use WRITE (send_request: the prefill side pushes) or the NIXL backend")

    # ----- hot paths ---------------------------------------------------------------
    def _submit_layer(self, req: KVSendRequest, layer: int, timeout_s) -> None:
        if self.mode == "put":
            self._put_layer(req, layer, timeout_s)
        else:
            self._send_layer_two_sided(req, layer, timeout_s)

    def _put_layer(self, req: KVSendRequest, layer: int, timeout_s) -> None:
        src = self._views[layer]
        remote = self._peer.regions[layer]
        plan = req.plan
        pack, rid, ts = self._pack, req.request_id, req.submit_ns
        lo, hi, n, lnb = req.layers.start, req.layers.stop, plan.num_descs, plan.layer_nbytes
        if self.checksum:  # a CRC-32 per part: one put, one part, one notification per descriptor
            put = self.endpoint.put
            for so, do, nb in zip(*req._descs()):
                part = src[so:so + nb]
                tag = pack(fr.MAGIC_REQUEST, fr.FN_WRITE, fr.WRITE_ARG_NBYTES, rid, ts, layer, lo, hi, n, n,
                           zlib.crc32(part), lnb, nb)
                put(part, remote, offset=do, notify_id=rid, tag=tag, timeout_s=timeout_s)
            return
        if self._gathers:  # one notification for the layer: one part of all its bytes
            tag = pack(fr.MAGIC_REQUEST, fr.FN_WRITE, fr.WRITE_ARG_NBYTES, rid, ts, layer, lo, hi, 1, n, 0, lnb, lnb)
        else:  # one notification per descriptor: n parts, each the size its notification reports (0 here)
            tag = pack(fr.MAGIC_REQUEST, fr.FN_WRITE, fr.WRITE_ARG_NBYTES, rid, ts, layer, lo, hi, n, n, 0, lnb, 0)
        self.endpoint.put_many(src, remote, plan.src_offsets, plan.dst_offsets, plan.nbytes, notify_id=rid,
                               tag=tag, timeout_s=timeout_s, defer=self._defer)

    def _staging(self, nbytes: int) -> np.ndarray:
        st = self._stage
        if st is None or st.size < nbytes:
            st = self._stage = np.empty(nbytes, dtype=np.uint8)
        return st[:nbytes]

    def _send_layer_two_sided(self, req: KVSendRequest, layer: int, timeout_s) -> None:
        if self._rows2d is None:
            self._send_layer_per_descriptor(req, layer, timeout_s)
            return
        send = self.endpoint.send
        plan = req.plan
        bn = plan.block_nbytes
        src_rows, dst_rows, bounds = req._row_parts(max(1, self._max_desc_nbytes // (bn + 4)))
        rows2d = self._rows2d[layer]
        rid, ts = req.request_id, req.submit_ns
        lo, hi, lnb = req.layers.start, req.layers.stop, plan.layer_nbytes
        for a, b in bounds:
            k = b - a
            buf = self._staging(k * (4 + bn))
            buf[:4 * k].view("<u4")[:] = dst_rows[a:b]
            body = buf[4 * k:]
            np.take(rows2d, src_rows[a:b], axis=0, out=body.reshape(k, bn), mode="clip")  # rows checked by the plan
            send(fr.pack_rows(rid, ts, layer=layer, layer_lo=lo, layer_hi=hi, num_parts=len(bounds),
                              num_descs=plan.num_descs, layer_nbytes=lnb, num_rows=k, row_nbytes=bn,
                              crc32=zlib.crc32(body) if self.checksum else 0), timeout_s=timeout_s)
            send(buf, timeout_s=timeout_s)

    def _send_layer_per_descriptor(self, req: KVSendRequest, layer: int, timeout_s) -> None:
        """Two-sided, from device memory: a kv_data frame and the payload per descriptor."""
        send = self.endpoint.send
        src = self._views[layer]
        plan = req.plan
        rid, ts = req.request_id, req.submit_ns
        lo, hi, n, lnb = req.layers.start, req.layers.stop, plan.num_descs, plan.layer_nbytes
        crc = zlib.crc32 if self.checksum else None
        for so, do, nb in zip(*req._descs()):
            part = src[so:so + nb]
            send(fr.pack_data(rid, ts, layer=layer, layer_lo=lo, layer_hi=hi, num_parts=n, num_descs=n,
                              layer_nbytes=lnb, part_nbytes=nb, dst_offset=do, crc32=crc(part) if crc else 0),
                 timeout_s=timeout_s)
            send(part, timeout_s=timeout_s)

    def _abort(self, req: KVSendRequest, layer: int, exc: BaseException) -> None:
        try:
            self.endpoint.send(fr.pack_abort(req.request_id, status=_ABORT_SUBMIT_FAILED, layer=layer,
                                             reason=f"{type(exc).__name__}: {exc}"), timeout_s=1.0)
        except QlinkError:
            pass  # the link is going down too; the receiver will see BrokenLinkError

    def progress(self) -> None:
        """Let the transport make progress on this side while the caller is idle.

        Some transports move a submitted put only while the initiator calls into its
        endpoint (``ucx``: staged sends complete in the caller's thread); a sender that
        submits and then waits on something else should call this now and then. Harmless
        elsewhere. A link that broke raises BrokenLinkError.
        """
        try:
            self.endpoint.poll_notification_nowait()  # nothing puts into the sender: this only progresses
        except (WouldBlock, CapabilityError):
            pass

    def flush(self, *, timeout_s: float | None = 10.0) -> None:
        """Wait until the receiver has copied every block submitted so far (deferred puts);
        the source blocks may change from then on. Immediate where nothing is deferred."""
        if self._defer:
            self.endpoint.flush(timeout_s=timeout_s)

    def _release_sources(self) -> None:
        for r in self._src_regions:
            try:
                self.endpoint.deregister(r)
            except QlinkError:
                pass
        self._src_regions = []
        self._defer = False

    def close(self, *, timeout_s: float = 1.0) -> None:
        """Let the receiver finish copying (up to ``timeout_s``), then deregister this cache.
        The endpoint stays open (it belongs to the caller)."""
        if self._defer and not self.endpoint.closed:
            try:
                self.flush(timeout_s=timeout_s)
            except QlinkError:
                pass
        self._release_sources()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ReceiverBase:
    """Waiting on requests, shared by the transport and NIXL receivers. Subclasses set
    ``_tracker`` and ``_peer_error`` and implement ``progress()``."""

    spec: KVCacheSpec
    _tracker: RequestTracker
    _peer_error: BaseException | None = None
    _peer = None
    _crc32 = False  # the sender checksums every part (its hello said so)
    crc_mismatches = 0  # parts whose bytes did not match the sender's CRC-32
    _peer = None

    endpoint = None
    _closed = False
    data_timeout_s = 10.0

    def _poll_sources(self, budget: int) -> int:  # pragma: no cover - overridden
        """Handle up to ``budget`` data completions (put notifications, NIXL notifications)."""
        return 0

    def progress(self) -> int:
        """Handle every completion and frame that has arrived; return how many.

        When the link breaks, everything that arrived before is still handled; then every
        incomplete request fails with BrokenLinkError (and later calls raise it).
        """
        if self._closed:
            raise ClosedError(f"{type(self).__name__} was closed by this side")
        tr = self._tracker
        if tr.broken is not None:
            raise BrokenLinkError("the KV sender's link is broken") from tr.broken
        n = 0
        broken = None
        if self._peer is None:  # the sender's hello first: it says how to check the parts (CRC-32 or not)
            try:
                n = self._poll_frames(_EVENTS_PER_PROGRESS)
            except BrokenLinkError as e:
                broken = e
        if self._peer is not None:
            try:
                n += self._poll_sources(_EVENTS_PER_PROGRESS - n)
            except BrokenLinkError as e:  # every completion before the break was handled first
                broken = broken or e
        if broken is None:
            try:
                n += self._poll_frames(_EVENTS_PER_PROGRESS - n)
            except BrokenLinkError as e:
                broken = e
        if broken is not None and n == 0:
            n = self._drain_after_break()
            if n:
                return n  # completions that were still on their way: handled first
            tr.fail_all(broken)
            return 1  # the state changed: callers look again
        return n

    def _drain_after_break(self) -> int:
        """The control link broke: completions of the data path may still be on their way
        (NIXL delivers its notifications apart from the control link, and may deliver them
        after the sender's exit shows there). Take what comes within a short grace (until
        ``_BREAK_QUIET_POLLS`` polls 1 ms apart find nothing, at most ``_BREAK_GRACE_S``)."""
        if self._peer is None:
            return 0
        n = quiet = 0
        give_up = time.monotonic() + _BREAK_GRACE_S
        while quiet < _BREAK_QUIET_POLLS and time.monotonic() < give_up:
            try:
                k = self._poll_sources(_EVENTS_PER_PROGRESS)
            except (BrokenLinkError, ClosedError):
                break
            if k:
                n += k
                quiet = 0
            else:
                quiet += 1
                time.sleep(1e-3)
        return n

    def _poll_frames(self, budget: int) -> int:
        n = 0
        ep = self.endpoint
        while n < budget:
            try:
                k = ep.recv_into_nowait(self._ctl_mv)
            except WouldBlock:
                break
            except ValueError as e:  # BufferTooSmallError: a hello with a large key, or garbage
                needed = getattr(e, "needed_nbytes", None)
                if needed is None:
                    raise
                frame = ep.recv(timeout_s=self.data_timeout_s, max_nbytes=needed)
                if needed <= _MAX_HELLO_NBYTES:
                    self._on_frame(memoryview(frame))
                else:
                    self._tracker.bad_frames += 1
                n += 1
                continue
            self._on_frame(self._ctl_mv[:k])
            n += 1
        return n

    def _on_frame(self, frame) -> None:
        tr = self._tracker
        try:
            fn = fr.function_of(frame)
        except WireError:
            tr.bad_frames += 1
            return
        try:
            if fn == fr.FN_DATA:
                self._on_data(frame)
            elif fn == fr.FN_ROWS:
                self._on_rows(frame)
            elif fn == fr.FN_ABORT:
                tr.on_abort(*fr.unpack_abort(frame))
            elif fn == fr.FN_HELLO:
                if self._peer is not None:  # the handshake is done: a second hello is noise, never fatal
                    tr.bad_frames += 1
                    return
                self._on_hello(frame)
            else:
                tr.bad_frames += 1
        except (WireError, LayoutMismatchError, RegistrationError) as e:
            tr.bad_frames += 1
            if fn == fr.FN_HELLO:
                self._peer_error = e
        except QlinkError as e:  # e.g. NIXL could not reach the agent the hello names
            if fn != fr.FN_HELLO:
                raise
            self._peer_error = e

    def _on_data(self, frame) -> None:
        raise WireError("kv_data frame received, but this receiver takes no two-sided data")

    def _on_rows(self, frame) -> None:
        raise WireError("kv_rows frame received, but this receiver takes no two-sided data")

    def _on_hello(self, frame) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def mode(self) -> str:
        """``"put"``, ``"send"`` or ``"nixl"`` once the sender's hello arrived, else ``""``."""
        return self._tracker.mode

    @property
    def peer_spec(self) -> KVCacheSpec | None:
        return None if self._peer is None else self._peer.spec

    def handshake(self, *, timeout_s: float | None = 10.0) -> str:
        """Wait for the sender's hello (checking layouts); return the mode."""
        self._wait(lambda: self._peer is not None, timeout_s, "the sender's hello")
        return self.mode

    def statistics(self) -> KVStatistics:
        return self._tracker.statistics()

    def _wait(self, ready, timeout_s, what: str):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        spin, sleep_s = 0, 5e-6
        while True:
            r = ready()
            if r:
                return r
            if self._peer_error is not None:
                raise self._peer_error
            if self._tracker.broken is not None:
                raise BrokenLinkError(f"the KV sender's link broke before {what}") from self._tracker.broken
            if self.progress():
                spin, sleep_s = 0, 5e-6
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise QlinkTimeoutError(f"{what} did not arrive within timeout_s={timeout_s}")
            if spin < 2000:
                spin += 1
            else:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, 2e-4)

    # ----- waiting on requests -------------------------------------------------------
    def wait_layer(self, request_id: int, layer: int, *, timeout_s: float | None = 10.0) -> int:
        """Wait until ``layer`` of ``request_id`` (and every layer of the request below it)
        has landed; return when it became ready (``time.monotonic_ns``)."""
        request_id = _check_request_id(request_id)
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer must be in [0, {self.spec.num_layers}), got {layer}")
        return self._wait(lambda: self._tracker.ready_ns(request_id, layer), timeout_s,
                          f"layer {layer} of request {request_id}")

    def ready_layers(self, request_id: int) -> int:
        """Without waiting: one past the last layer of ``request_id`` that is ready (0 if none)."""
        self.progress()
        return self._tracker.ready_layers(request_id)

    def wait_request(self, request_id: int, *, timeout_s: float | None = 10.0, release: bool = True) -> TransferRecord:
        """Wait until every layer of ``request_id`` has landed; return its record (and forget
        the request unless ``release=False``, so its id may be reused)."""
        request_id = _check_request_id(request_id)
        rec = self._wait(lambda: self._tracker.record(request_id), timeout_s, f"request {request_id}")
        if release:
            self._tracker.release(request_id)
        return rec

    def release(self, request_id: int) -> None:
        """Forget a request (complete or failed) so its id may be reused."""
        self._tracker.release(request_id)


class KVReceiver(_ReceiverBase):
    """The decode side: registers its cache, then reports layers of requests as they land.

    Progress is driven by the caller (``wait_layer``/``wait_request``/``progress``): it
    polls put notifications and two-sided frames, busy-polling briefly then backing off.
    """

    def __init__(self, endpoint, cache: KVCache, *, max_requests: int = 65536, data_timeout_s: float = 10.0):
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a qlink.ai.KVCache, got {type(cache).__name__}")
        _check_device(cache, endpoint)
        self.endpoint = endpoint
        self.cache = cache
        self.spec = cache.spec
        self.transport = endpoint.capabilities.name
        self.data_timeout_s = data_timeout_s
        self._regions = []
        if endpoint.capabilities.one_sided:
            self._regions = [endpoint.register(a) for a in cache.layers]
        self._layer_of_region = {r.region_id: i for i, r in enumerate(self._regions)}
        self._views = [as_byte_view(a) if cache.device == "cpu" else a.reshape(-1).view("uint8") for a in cache.layers]
        self._tracker = RequestTracker(num_layers=self.spec.num_layers, transport=self.transport, mode="",
                                       max_requests=max_requests)
        self._peer: _Peer | None = None
        self._peer_error: BaseException | None = None
        self._ctl = bytearray(4096)
        self._ctl_mv = memoryview(self._ctl)
        self._stage: np.ndarray | None = None  # two-sided kv_rows parts land here, then scatter
        self._rows2d = [np.frombuffer(v, dtype=np.uint8).reshape(-1, self.spec.block_nbytes) for v in self._views] \
            if cache.device == "cpu" else None
        self._closed = False
        endpoint.send(fr.pack_hello(role=_ROLE_RECEIVER, mode=0, spec=self.spec.to_bytes(),
                                    regions=[r.descriptor().to_bytes() for r in self._regions]))

    # ----- progress ----------------------------------------------------------------
    def _poll_sources(self, budget: int) -> int:
        if not self._regions:
            return 0
        n = 0
        poll = self.endpoint.poll_notification_nowait
        while n < budget:
            try:
                note = poll()
            except WouldBlock:
                break
            self._on_note(note)
            n += 1
        return n

    def _on_note(self, note) -> None:
        tr = self._tracker
        try:
            rid, ts, layer, lo, hi, parts, descs, lnb, pnb = fr.unpack_write(note.tag)
        except WireError:
            tr.bad_frames += 1
            return
        if pnb == 0 and parts == descs:  # one part per descriptor, each the size its notification reports
            pnb = note.nbytes
        # one descriptor per part: the put's size is the part's; a gathered part (several
        # descriptors, one notification) spans at least its bytes
        if (self._layer_of_region.get(note.region_id) != layer or rid != note.notify_id
                or (pnb != note.nbytes if parts == descs else pnb > note.nbytes)):
            tr.bad_frames += 1
            return
        if self._crc32 and not self._crc_ok(rid, layer, note.tag, self._views[layer][note.offset:note.offset + pnb]):
            return
        tr.on_part(rid, ts, layer, lo, hi, parts, descs, lnb, pnb, now_ns=time.monotonic_ns())

    def _crc_ok(self, rid: int, layer: int, frame, landed) -> bool:
        """Compare the part's bytes as they landed with the sender's CRC-32; a mismatch
        fails the request (never reported complete) and is counted."""
        want, got = fr.part_crc32(frame), zlib.crc32(landed)
        if want == got:
            return True
        self.crc_mismatches += 1
        self._tracker.on_abort(rid, _ABORT_CORRUPT, layer, f"a part of {len(landed)} B arrived with CRC-32 "
                               f"0x{got:08x} where the sender computed 0x{want:08x} (corrupted on the way)")
        return False

    def _on_hello(self, frame) -> None:
        peer = _parse_hello(frame, expect_role=_ROLE_SENDER, local=self.spec, side="sender")
        self._peer = peer
        self._crc32 = peer.crc32
        mode = "send" if (peer.mode == "send" or not self._regions) else "put"
        self._tracker.mode = mode

    def _on_data(self, frame) -> None:
        tr = self._tracker
        rid, ts, layer, lo, hi, parts, descs, lnb, pnb, off = fr.unpack_data(frame)
        ok_layer = 0 <= layer < self.spec.num_layers
        if not ok_layer or off + pnb > self.spec.layer_nbytes:
            self.endpoint.recv(timeout_s=self.data_timeout_s)  # drain the payload that follows
            tr.bad_frames += 1
            return
        n = self.endpoint.recv_into(self._views[layer][off:off + pnb], timeout_s=self.data_timeout_s)
        if n != pnb:
            tr.bad_frames += 1
            tr.on_abort(rid, 2, layer, f"payload of {n} B where the kv_data frame announced {pnb} B")
            return
        if self._crc32 and not self._crc_ok(rid, layer, frame, self._views[layer][off:off + pnb]):
            return
        tr.on_part(rid, ts, layer, lo, hi, parts, descs, lnb, pnb, now_ns=time.monotonic_ns())

    def _on_rows(self, frame) -> None:
        """A gathered two-sided part: receive the rows table and the blocks into staging,
        check them (and the CRC-32), then scatter the blocks into the layer in one call."""
        tr = self._tracker
        rid, ts, layer, lo, hi, parts, descs, lnb, pnb, nrows, row_nb = fr.unpack_rows(frame)
        spec = self.spec
        if not (0 <= layer < spec.num_layers and row_nb == spec.block_nbytes and 0 < pnb <= spec.layer_nbytes):
            self._drain_payload()
            tr.bad_frames += 1
            return
        tab = 4 * nrows
        need = tab + pnb
        st = self._stage
        if st is None or st.size < need:
            st = self._stage = np.empty(need, dtype=np.uint8)
        buf = st[:need]
        try:
            n = self.endpoint.recv_into(buf, timeout_s=self.data_timeout_s)
        except ValueError as e:  # BufferTooSmallError: more than the frame announced
            if getattr(e, "needed_nbytes", None) is None:
                raise
            self._drain_payload()
            n = -1
        if n != need:
            tr.bad_frames += 1
            tr.on_abort(rid, 2, layer, f"kv_rows payload of {n} B where the frame announced {need} B")
            return
        rows = buf[:tab].view("<u4")
        if int(rows.max()) >= 2 * spec.num_blocks:
            tr.bad_frames += 1
            tr.on_abort(rid, 2, layer, f"kv_rows names row {int(rows.max())}, outside the layer's "
                                       f"{2 * spec.num_blocks} rows")
            return
        body = buf[tab:]
        if self._crc32 and not self._crc_ok(rid, layer, frame, body):
            return  # nothing written: the corrupted part never reaches the cache
        data = body.reshape(nrows, row_nb)
        if self._rows2d is not None:
            self._rows2d[layer][rows] = data
        else:
            xp = _cupy()
            self._views[layer].reshape(-1, row_nb)[xp.asarray(rows.astype(np.int64))] = xp.asarray(data)
        tr.on_part(rid, ts, layer, lo, hi, parts, descs, lnb, pnb, now_ns=time.monotonic_ns())

    def _drain_payload(self) -> None:
        """Take the message that follows a refused kv_data / kv_rows frame off the link."""
        try:
            self.endpoint.recv(timeout_s=self.data_timeout_s)
        except ValueError:
            pass

    def read_request(self, *_args, **_kwargs):
        """READ (pull) needs a one-sided get, which qlink transports do not offer."""
        raise CapabilityError(f"READ needs a one-sided get, which transport {self.transport!r} does not offer; "
                              "have the prefill side push with KVSender.send_request (WRITE), or use the NIXL backend")

    def close(self) -> None:
        """Deregister the cache (later puts into it fail at the sender). The endpoint stays open."""
        if self._closed:
            return
        self._closed = True
        for r in self._regions:
            try:
                self.endpoint.deregister(r)
            except QlinkError:
                pass
        self._regions = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
