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
  transport's (``shm``: C; ``tcp``: one scatter-gather frame; ``inproc``: NumPy; ``ucx``: one
  gathered message scattered on arrival). Where the endpoint gathers (``put_many_gathers``:
  ``shm``, ``tcp``, ``inproc``, ``cuda_ipc``, ``ucx``) the layer is one part with one
  notification; elsewhere (a peer of an older version) each descriptor's notification is a
  part of the size it reports. Over ``shm``
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

import time
import zlib

import numpy as np

from qlink.errors import BrokenLinkError, CapabilityError, QlinkError, WireError, WouldBlock
from qlink.memory import as_byte_view

from . import frames as fr
from ._descriptors import TransferPlan, plan_transfer
from ._handshake import (
    ABORT_SUBMIT_FAILED,
    MAX_HELLO_NBYTES,
    MODE_CODES,
    ROLE_RECEIVER,
    ROLE_SENDER,
    MODES,
    can_defer,
    check_device,
    check_request_id,
    layers_of,
    parse_hello,
    Peer,
)
from ._tracker import SubmitRecord
from .kv import KVCache, KVCacheSpec, LayoutMismatchError

__all__ = ["KVSender", "KVSendRequest", "MODES"]  # qlink.ai exports them (and the rest of the KV API)


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
        self._sent.add(layer)
        if getattr(s, "_device_defer", False) and len(self._sent) == len(self.layers):
            try:  # the request's last layer: every queued device copy is done and published
                s.endpoint.flush(timeout_s=timeout_s)
            except BaseException as e:
                self._failed = e
                raise
        self._submit_ns_total += time.perf_counter_ns() - t0

    def send_all(self, *, timeout_s: float | None = 10.0) -> SubmitRecord:
        """Send every layer not sent yet, in order; return the submission record."""
        for layer in self.layers:
            if layer not in self._sent:
                self.send_layer(layer, timeout_s=timeout_s)
        return self.record()

    def record(self) -> SubmitRecord:
        n = len(self._sent)
        nblocks = self.plan.num_planes * self.plan.num_blocks * max(n, 1)
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
        check_device(cache, endpoint)
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
        self._peer: Peer | None = None
        self._views = [as_byte_view(a) if cache.device == "cpu" else a.reshape(-1).view("uint8") for a in cache.layers]
        self._rows2d = [a.reshape(-1).view(np.uint8).reshape(-1, self.spec.block_nbytes) for a in cache.layers] \
            if cache.device == "cpu" else None
        self._stage: np.ndarray | None = None  # two-sided parts are gathered here
        self._pack = fr._WRITE_FULL.pack
        self.checksum = bool(checksum)
        # a CRC-32 per part needs one notification per descriptor: no gathered put_many then
        self._gathers = bool(getattr(endpoint, "put_many_gathers", False)) and not self.checksum
        self._src_regions = []
        deferrable = bool(defer and self._gathers and cache.device == "cpu" and mode != "send")
        # an endpoint that defers any source in place (tcp: the pages go to the socket by splice)
        # needs no registration; the receiver's reading is the copy, flush waits for it
        in_place = deferrable and bool(getattr(endpoint, "defers_puts_in_place", False))
        if deferrable and not in_place and can_defer(endpoint):
            try:
                for a in cache.layers:  # so the receiver can copy out of them (deferred put_many)
                    self._src_regions.append(endpoint.register(a))
            except QlinkError:
                self._release_sources()
        self._defer = bool(self._src_regions) or in_place
        # device caches over an endpoint that queues device copies (cuda_ipc): each layer's copy
        # is queued and its notification published once CUDA has done it; a request's last
        # layer waits for all of them
        self._device_defer = bool(defer and self._gathers and cache.device != "cpu" and mode != "send"
                                  and getattr(endpoint, "defers_device_puts", False))
        self._max_desc_nbytes = endpoint.capabilities.max_message_bytes
        endpoint.send(fr.pack_hello(role=ROLE_SENDER, mode=MODE_CODES[mode], spec=self.spec.to_bytes(), regions=[],
                                    flags=fr.HELLO_PARTS_CRC32 if self.checksum else 0))

    def handshake(self, *, timeout_s: float | None = 10.0) -> str:
        """Read the receiver's hello, check the layouts, and return the mode (``"put"``/``"send"``)."""
        if self._peer is not None:
            return self.mode
        frame = self.endpoint.recv(timeout_s=timeout_s, max_nbytes=MAX_HELLO_NBYTES)
        peer = parse_hello(frame, expect_role=ROLE_RECEIVER, local=self.spec, side="receiver")
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
        request_id = check_request_id(request_id)
        self.handshake(timeout_s=timeout_s)
        layer_range = layers_of(layers, self.spec.num_layers)
        t0 = time.perf_counter_ns()
        plan = plan_transfer(src_block_ids, dst_block_ids, src_num_blocks=self.spec.num_blocks,
                             dst_num_blocks=self._peer.spec.num_blocks, block_nbytes=self.spec.block_nbytes,
                             num_planes=self.spec.num_planes,
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
                               tag=tag, timeout_s=timeout_s, defer=self._defer or self._device_defer)

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
            self.endpoint.send(fr.pack_abort(req.request_id, status=ABORT_SUBMIT_FAILED, layer=layer,
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
        if self._defer or self._device_defer:
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
