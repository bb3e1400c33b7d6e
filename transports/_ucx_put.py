"""One-sided put for ``transports.ucx``, done in software over tagged messages.

UCXX 0.52's Python API exposes no memory registration or remote keys, so the initiator
sends the bytes and the target places them: puts up to ``INLINE_PUT_MAX`` ride inside a
control frame and are copied into the region; larger ones send a put-header, then the
bytes with their own tag, which the target receives straight into the region (UCX then
copies, or reads them with CMA between local processes). A Notification is queued only
once the bytes are in place, and notifications keep the order of their puts.

``put_many`` checks every piece once (NumPy) and then issues one put per piece in a loop
here, under one hold of the send lock: the target sees one Notification per piece
(``put_many_gathers`` is False). A gathered put would need a vectored frame on the wire
(and a bootstrap version that announces it) or UCX's iov datatype, which UCXX's Python
API does not expose; the loop keeps the per-piece work inside the transport.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from qlink.errors import RegistrationError, WouldBlock
from qlink.memory import Region, RemoteRegion, as_byte_view

from . import _cuda
from ._pieces import check_pieces
from . import _ucx_device as dev
from . import _ucx_wire as wire
from ._base import MAX_TAG_BYTES, Backoff, Notification, check_put_target, deadline_of

__all__ = ["PutSide"]


class PutSide:
    """The one-sided half of :class:`transports.ucx.UcxEndpoint` (a mixin over its state)."""

    def _init_put_side(self) -> None:
        self._regions: dict[int, Region] = {}
        self._next_region = itertools.count(1)
        self._revoked: set[int] = set()
        self._put_seq = 0

    def _take_put(self, op, rid, offset, nbytes, notify_id, seq, tag_len, length) -> None:
        inline = nbytes if op == wire.OP_PUT_INLINE else 0
        region = self._regions.get(rid)
        if (tag_len > MAX_TAG_BYTES or wire.CTRL.size + tag_len + inline != length
                or region is None or offset + nbytes > region.nbytes):
            self._bad_frame()  # malformed, unknown/deregistered region or out of bounds: counted, dropped
            if op == wire.OP_PUT_HEADER:  # a 1-byte receive truncates (so consumes) the bytes that follow
                self._put_pending.append((self._ops.recv_tag(self._scratch, 1, self._rx_data | seq), None, None))
            return
        tag = bytes(self._ctrl_buf[wire.CTRL.size:wire.CTRL.size + tag_len])
        note = Notification(region_id=rid, offset=offset, nbytes=nbytes, notify_id=notify_id, tag=tag)
        if op == wire.OP_PUT_INLINE:
            if nbytes:
                start = wire.CTRL.size + tag_len
                if region.kind == "device":
                    dev.copy_into_region(region, offset, self._ctrl_buf[start:start + nbytes])
                else:
                    region.view[offset:offset + nbytes] = self._ctrl_buf.data[start:start + nbytes]
            self._put_pending.append((None, note, None))
        else:
            if region.kind == "device":  # UCX receives the bytes straight into device memory
                target = dev.device_view(self._box.tls, region.array)[offset:offset + nbytes]
            else:
                target = np.frombuffer(region.view, dtype=np.uint8)[offset:offset + nbytes]
            self._put_pending.append((self._ops.recv_tag(target, nbytes, self._rx_data | seq), note, target))
        self._reap_puts()

    def _reap_puts(self) -> None:
        ops, pend = self._ops, self._put_pending
        while pend:
            req, note, _ = pend[0]
            st = ops.status(req)
            if st == wire.IN_PROGRESS:
                return
            pend.popleft()
            ops.release(req)
            if note is None:
                continue
            if st < 0:
                self._bad_frame()
            else:
                self._notes.append(note)


    # ----- one-sided -------------------------------------------------------------------------
    def register(self, array) -> Region:
        """Register ``array`` (writable, C-contiguous; host memory, or a CuPy array when
        ``UCX_TLS`` loads a CUDA transport) as a put target."""
        self._check_open()
        if _cuda.is_device(array):
            dev.device_view(self._box.tls, array, writable=True)  # CapabilityError unless UCX can move it
        with self._rx_lock:
            rid = next(self._next_region)
            region = Region.of(array, region_id=rid, key=self._token)
            self._regions[rid] = region
        return region

    def deregister(self, region: Region) -> None:
        """Forget a region; the peer is told, and its later puts into it raise RegistrationError."""
        with self._rx_lock:
            known = self._regions.pop(region.region_id, None)
        if known is not None and not self._closed and self._broken is None and not self._peer_closed:
            with self._tx_lock:
                self._send_ctrl(wire.OP_REVOKE, rid=region.region_id)

    def _check_put(self, remote, notify_id: int, tag) -> tuple[RemoteRegion, bytes]:
        """Checks shared by put and put_many, before anything is sent."""
        self._check_sendable("the put")
        remote, tag, _ = check_put_target(remote, notify_id=notify_id, tag=tag)
        return remote, tag

    def _check_target(self, remote: RemoteRegion) -> None:
        if remote.key != self._peer_token:
            raise RegistrationError(
                f"region descriptor {remote.region_id} was not issued by this endpoint's peer; "
                "register on the peer and pass its descriptor"
            )
        if self._rx_lock.acquire(blocking=False):  # learn of revoked regions before writing
            try:
                self._poll(False)
            finally:
                self._rx_lock.release()
        if remote.region_id in self._revoked:
            raise RegistrationError(f"region {remote.region_id} was deregistered by the peer; the put was not done")

    def put(self, data, remote: RemoteRegion, *, offset: int = 0, notify_id: int = 0, tag: bytes = b"",
            timeout_s: float | None = None) -> None:
        """Write ``data`` into the peer's region at ``offset``; the peer gets a Notification."""
        deadline = deadline_of(timeout_s)
        remote, tag = self._check_put(remote, notify_id, tag)
        device = type(data) is not bytes and _cuda.is_device(data)
        if device:  # small puts ride inline (copied to host); larger ones leave from device memory
            src = dev.device_view(self._box.tls, data)
            if len(src) <= wire.INLINE_PUT_MAX:
                src, device = dev.host_copy(src), False
        else:
            src = data if type(data) is bytes else as_byte_view(data)
        n = len(src)
        if offset < 0 or offset + n > remote.nbytes:
            raise RegistrationError(
                f"put of {n} bytes at offset {offset} falls outside region {remote.region_id} of {remote.nbytes} bytes"
            )
        self._check_target(remote)
        with self._tx_lock:
            self._issue_put(src, n, remote.region_id, offset, notify_id, tag, device, deadline, timeout_s)
        self._counters.puts += 1
        self._counters.put_bytes += n

    def put_many(self, data, remote: RemoteRegion, src_offsets, dst_offsets, nbytes, *, notify_id: int = 0,
                 tag: bytes = b"", timeout_s: float | None = None, defer: bool = False) -> int:
        """Write pieces of ``data`` into the peer's region, one put per piece (see the module
        docstring); return the number of Notifications the target will see (one per piece).
        Every piece is checked before any is sent. ``defer`` changes nothing here."""
        if type(data) is not bytes and _cuda.is_device(data):  # device sources: the generic per-piece puts
            return super().put_many(data, remote, src_offsets, dst_offsets, nbytes, notify_id=notify_id, tag=tag,
                                    timeout_s=timeout_s, defer=defer)
        deadline = deadline_of(timeout_s)
        remote, tag = self._check_put(remote, notify_id, tag)
        src = as_byte_view(data)
        so, do, ln = check_pieces(src_offsets, dst_offsets, nbytes, src_nbytes=len(src), region_nbytes=remote.nbytes,
                                  region_id=remote.region_id)
        self._check_target(remote)
        rid = remote.region_id
        with self._tx_lock:
            for s, d, k in zip(so.tolist(), do.tolist(), ln.tolist()):
                self._issue_put(src[s:s + k], k, rid, d, notify_id, tag, False, deadline, timeout_s)
        self._counters.puts += int(ln.size)
        self._counters.put_bytes += int(ln.sum())
        return int(ln.size)

    def _issue_put(self, src, n: int, rid: int, offset: int, notify_id: int, tag: bytes, device: bool,
                   deadline, timeout_s) -> None:
        """Send one put's control frame (and its bytes); the caller holds _tx_lock."""
        if n <= wire.INLINE_PUT_MAX:
            if self._tx_pending:
                self._room(n, deadline, False, "the put", timeout_s)
            self._send_ctrl(wire.OP_PUT_INLINE, rid=rid, offset=offset, nbytes=n, notify_id=notify_id, tag=tag,
                            inline=src)
            return
        zero_copy = device or (self._zero_copy_min is not None and n >= self._zero_copy_min)
        self._room(0 if zero_copy else n, deadline, False, "the put", timeout_s)
        self._put_seq = (self._put_seq + 1) & 0xFFFFFFFF
        seq = self._put_seq
        self._send_ctrl(wire.OP_PUT_HEADER, rid=rid, offset=offset, nbytes=n, notify_id=notify_id, seq=seq, tag=tag)
        if zero_copy:
            self._zero_copy(src, n, self._tx_data | seq, deadline, "zero-copy put", timeout_s)
        else:
            self._post(src, n, self._tx_data | seq)

    def wait_notification(self, *, timeout_s: float | None = None) -> Notification:
        """Wait for the next put completion targeted at this side (progressing puts meanwhile)."""
        self._check_open()
        deadline = deadline_of(timeout_s)
        backoff = Backoff()
        while True:
            note = self._next_note()
            if note is not None:
                return note
            now = time.monotonic()
            if now >= self._next_check:
                self._check_link(now)
            if (self._peer_closed or self._broken is not None) and not self._put_pending:
                note = self._next_note()
                if note is not None:
                    return note
                self._counters.errors += 1
                raise self._broken_error("no more put notifications will arrive")
            if deadline is not None and now >= deadline:
                raise self._timed_out("wait_notification", timeout_s)
            backoff.pause()
            self._check_open()

    def poll_notification_nowait(self) -> Notification:
        """The next put completion if one has arrived, else raise WouldBlock."""
        self._check_open()
        note = self._next_note()
        if note is not None:
            return note
        now = time.monotonic()
        if now >= self._next_check:
            self._check_link(now)
        if (self._peer_closed or self._broken is not None) and not self._put_pending:
            self._counters.errors += 1
            raise self._broken_error("no more put notifications will arrive")
        raise WouldBlock("no ucx put notification has arrived yet")

    def _next_note(self):
        with self._rx_lock:
            if not self._notes:
                self._poll(False)
            if self._notes:
                self._counters.notifications += 1
                return self._notes.popleft()
        return None

