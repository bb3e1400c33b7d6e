"""The decode side of a KV link: :class:`KVReceiver` registers its cache and reports the
layers of requests as they land, in layer order (see :mod:`qlink.ai.engine` for the
protocol). ``_ReceiverBase`` (waiting, progress, frame dispatch) is shared with the NIXL
receiver."""

from __future__ import annotations

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
from qlink.memory import as_byte_view

from . import frames as fr
from ._handshake import (
    ABORT_CORRUPT,
    BREAK_GRACE_S,
    BREAK_QUIET_POLLS,
    EVENTS_PER_PROGRESS,
    MAX_HELLO_NBYTES,
    ROLE_RECEIVER,
    ROLE_SENDER,
    check_device,
    check_request_id,
    parse_hello,
    Peer,
)
from ._tracker import KVStatistics, RequestTracker, TransferRecord
from .kv import KVCache, KVCacheSpec, LayoutMismatchError, _cupy

__all__ = ["KVReceiver"]


class _ReceiverBase:
    """Waiting on requests, shared by the transport and NIXL receivers. Subclasses set
    ``_tracker`` and ``_peer_error`` and implement ``progress()``."""

    spec: KVCacheSpec
    _tracker: RequestTracker
    _peer_error: BaseException | None = None
    _peer = None
    _crc32 = False  # the sender checksums every part (its hello said so)
    crc_mismatches = 0  # parts whose bytes did not match the sender's CRC-32

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
                n = self._poll_frames(EVENTS_PER_PROGRESS)
            except BrokenLinkError as e:
                broken = e
        if self._peer is not None:
            try:
                n += self._poll_sources(EVENTS_PER_PROGRESS - n)
            except BrokenLinkError as e:  # every completion before the break was handled first
                broken = broken or e
        if broken is None:
            try:
                n += self._poll_frames(EVENTS_PER_PROGRESS - n)
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
        ``BREAK_QUIET_POLLS`` polls 1 ms apart find nothing, at most ``BREAK_GRACE_S``)."""
        if self._peer is None:
            return 0
        n = quiet = 0
        give_up = time.monotonic() + BREAK_GRACE_S
        while quiet < BREAK_QUIET_POLLS and time.monotonic() < give_up:
            try:
                k = self._poll_sources(EVENTS_PER_PROGRESS)
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
                if needed > MAX_HELLO_NBYTES:
                    self._refuse_oversized(needed)
                frame = ep.recv(timeout_s=self.data_timeout_s, max_nbytes=needed)
                self._on_frame(memoryview(frame))
                n += 1
                continue
            self._on_frame(self._ctl_mv[:k])
            n += 1
        return n

    def _refuse_oversized(self, needed: int) -> None:
        """A control frame longer than any (the largest is a hello): refused from its header,
        nothing read or allocated from it; the link is closed and counts as broken."""
        self._tracker.bad_frames += 1
        self.oversized_frames = getattr(self, "oversized_frames", 0) + 1
        abort = getattr(self.endpoint, "abort", None)
        try:
            (abort or self.endpoint.close)()
        except QlinkError:
            pass
        raise BrokenLinkError(f"the KV sender announced a {needed}-byte control frame, longer than any "
                              f"({MAX_HELLO_NBYTES} bytes); the link was closed")

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
        request_id = check_request_id(request_id)
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
        request_id = check_request_id(request_id)
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
        check_device(cache, endpoint)
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
        self._peer: Peer | None = None
        self._peer_error: BaseException | None = None
        self._max_part_nbytes = max(v.nbytes for v in self._views) + 4096
        self._ctl = bytearray(4096)
        self._ctl_mv = memoryview(self._ctl)
        self._stage: np.ndarray | None = None  # two-sided kv_rows parts land here, then scatter
        self._rows2d = [np.frombuffer(v, dtype=np.uint8).reshape(-1, self.spec.block_nbytes) for v in self._views] \
            if cache.device == "cpu" else None
        self._closed = False
        endpoint.send(fr.pack_hello(role=ROLE_RECEIVER, mode=0, spec=self.spec.to_bytes(),
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
        self._tracker.on_abort(rid, ABORT_CORRUPT, layer, f"a part of {len(landed)} B arrived with CRC-32 "
                               f"0x{got:08x} where the sender computed 0x{want:08x} (corrupted on the way)")
        return False

    def _on_hello(self, frame) -> None:
        peer = parse_hello(frame, expect_role=ROLE_SENDER, local=self.spec, side="sender")
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
        if int(rows.max()) >= spec.num_planes * spec.num_blocks:
            tr.bad_frames += 1
            tr.on_abort(rid, 2, layer, f"kv_rows names row {int(rows.max())}, outside the layer's "
                                       f"{spec.num_planes * spec.num_blocks} rows")
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
        try:  # (bounded: a layer is the most a part can carry; longer is refused unread)
            self.endpoint.recv(timeout_s=self.data_timeout_s, max_nbytes=self._max_part_nbytes)
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
