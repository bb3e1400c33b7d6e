"""One-sided put for ``transports.ucx``: by UCX RMA where both sides offer it, else in software
over tagged messages.

With ``FLAG_RMA`` in force, ``register`` maps a host region for RMA and ``put_many`` writes its
pieces with ``ucp_put_nbx`` and announces them with ``OP_PUT_DONE`` (:mod:`._ucx_rma`). Without
it (UCXX 0.52's Python API exposes no memory registration or remote keys) the initiator
sends the bytes and the target places them: puts up to ``INLINE_PUT_MAX`` ride inside a
control frame and are copied into the region; larger ones send a put-header, then the
bytes with their own tag, which the target receives straight into the region (UCX then
copies, or reads them with CMA between local processes). A Notification is queued only
once the bytes are in place, and notifications keep the order of their puts.

``put_many`` of one piece larger than ``INLINE_PUT_MAX`` is a put (received straight into
the region, one Notification for the same span). Otherwise it is a vectored put when both
hellos offered ``FLAG_PUTV``
(``put_many_gathers``): every piece is checked once (NumPy), then ONE ``OP_PUTV``
control frame and ONE data message go out, the message holding the piece table and the
pieces gathered back to back (one NumPy call straight into the staging buffer). The
target receives it into a staging buffer of its own (up to two are kept, each at most
``PUTV_MAX_NBYTES``), checks the table (sizes add up to the message, every piece inside
the region: else the frame is counted in ``bad_frames``, nothing is written and the
put_many is never announced), scatters the pieces with one ``copy_pieces`` call (a
device region: one copy per piece) and queues ONE Notification from the lowest
destination to the end of the highest piece; ``put_many`` returns 1. A put_many larger
than ``PUTV_MAX_NBYTES`` goes as several vectored puts (pieces larger than that are cut
first), all but the last sent as ``OP_PUTV_MORE``, and only the last is announced, with
the span and tag of the whole put_many. A device (CuPy) source is gathered on the device
in one call and copied to host once, then goes the same way. A peer whose hello did not
offer the flag (an older qlink) gets one put per piece, as before, and one Notification
per piece.
"""

from __future__ import annotations

import itertools
import socket
import time

import numpy as np

from qlink.errors import BrokenLinkError, QlinkError, QlinkTimeoutError, RegistrationError, WouldBlock
from qlink.memory import Region, RemoteRegion, as_byte_view

from . import cuda as _cuda
from . import _ucx_core as core
from ._pieces import _FEW, check_pieces, copy_pieces, message_groups, span
from . import _ucx_device as dev
from . import _ucx_rma as rma
from . import _ucx_wire as wire
from ._base import MAX_TAG_BYTES, Backoff, Notification, check_put_target, deadline_of

__all__ = ["PutSide"]

_KEEP_STAGES = 2  # vectored-put staging buffers a target keeps for the next ones


class _Vput:
    """A vectored put whose data message is on its way into a staging buffer (``valid``
    False: its control frame was malformed and the message is being discarded)."""

    __slots__ = ("rid", "count", "nbytes", "notify_id", "tag", "more", "valid")

    def __init__(self, rid: int, count: int, nbytes: int, notify_id: int, tag: bytes, more: bool, valid: bool):
        self.rid, self.count, self.nbytes, self.notify_id = rid, count, nbytes, notify_id
        self.tag, self.more, self.valid = tag, more, valid


def _split_pieces(so: np.ndarray, do: np.ndarray, ln: np.ndarray, most: int):
    """Cut pieces larger than ``most`` bytes into pieces of at most ``most``, in order."""
    parts = np.maximum(1, -(-ln // most))
    if (parts == 1).all():
        return so, do, ln
    idx = np.repeat(np.arange(ln.size), parts)
    off = (np.arange(idx.size) - np.repeat(np.cumsum(parts) - parts, parts)) * most
    return so[idx] + off, do[idx] + off, np.minimum(ln[idx] - off, most)


def _share(so: np.ndarray, do: np.ndarray, ln: np.ndarray, share: float):
    """The pieces, one of them cut in two (at a 4 KiB step) where needed, and the count of the
    first ones that make up ``share`` of the bytes: those the target reads, the rest this side writes.

    >>> so, do, ln, cut = _share(np.array([0]), np.array([0]), np.array([1 << 20]), 0.5)
    >>> ln.tolist(), cut, (so + ln).tolist() == [1 << 19, 1 << 20]
    ([524288, 524288], 1, True)
    >>> _share(np.array([0, 10]), np.array([0, 10]), np.array([10, 10]), 0.5)[3]
    1
    """
    if ln.size <= _FEW:  # plain integers: tens of microseconds less than the NumPy calls
        sizes = ln.tolist()
        total, i, before = sum(sizes), 0, 0
        want = int(total * share)
        while i < len(sizes) - 1 and before + sizes[i] < want:
            before += sizes[i]
            i += 1
        n_i = sizes[i] if sizes else 0
    else:
        cum = np.cumsum(ln)
        total = int(cum[-1]) if cum.size else 0
        want = int(total * share)
        i = int(np.searchsorted(cum, want)) if total else 0
        before, n_i = (int(cum[i] - ln[i]), int(ln[i])) if total else (0, 0)
    if total == 0:
        return so, do, ln, 0
    take = (want - before) // 4096 * 4096  # i: the piece holding the share's last byte
    if take <= 0 or take >= n_i:
        return so, do, ln, i + 1 if want - before >= n_i // 2 else i
    so = np.concatenate([so[:i], [so[i], so[i] + take], so[i + 1:]]).astype(np.int64)
    do = np.concatenate([do[:i], [do[i], do[i] + take], do[i + 1:]]).astype(np.int64)
    ln = np.concatenate([ln[:i], [take, ln[i] - take], ln[i + 1:]]).astype(np.int64)
    return so, do, ln, i + 1


def _ewma(old: float, new: float, weight: float = 0.25) -> float:
    """An exponentially weighted mean (the first sample taken as it is).

    >>> _ewma(0.0, 4.0), _ewma(4.0, 8.0)
    (4.0, 5.0)
    """
    return new if old <= 0 else (1 - weight) * old + weight * new


def putv_groups(ln: np.ndarray) -> list[tuple[int, int]]:
    """Split the pieces of a put_many into runs whose table and bytes fit one vectored put."""
    return message_groups(ln, entry_nbytes=wire.PIECE.size, max_nbytes=wire.PUTV_MAX_NBYTES)


class PutSide:
    """The one-sided half of :class:`transports.ucx.UcxEndpoint` (a mixin over its state)."""

    #: share of a deferred RMA put_many's bytes the target reads itself while this side writes the
    #: rest, until both sides' rates are known; then the share that has both finish together
    #: (:meth:`_pull_share`). A fixed share was right on one host and one piece size only (between
    #: two processes on the 2-core VM, 32 KiB pieces: best at 0.7 while this side posted each piece
    #: from Python, at 0.5 once posted from C; 1 MiB pieces best at 0.5 in a bare CMA pair).
    PULL_SHARE = 0.5
    #: the share never goes outside these bounds (each side keeps some of the copying, so its rate
    #: stays measured)
    PULL_SHARE_RANGE = (0.15, 0.85)

    def _init_put_side(self) -> None:
        self._regions: dict[int, Region] = {}
        self._next_region = itertools.count(1)
        self._revoked: set[int] = set()
        self._put_seq = 0
        self._vstages: list[np.ndarray] = []  # free staging buffers for vectored puts
        self._vspan: list | None = None  # [lo, hi, accepted] over the vectored puts of one put_many so far
        self._gathered = 0  # put_many calls sent as vectored puts
        self._rma_puts = 0  # put_many calls written by UCX RMA
        self._mapped: dict[int, rma.MappedRegion] = {}  # region id -> its RMA mapping (FLAG_RMA in force)
        self._homes: dict[tuple[int, int], tuple] = {}  # (address, nbytes) of a source -> what _home_of found
        self._rkeys = rma.RemoteKeys(self._ep.handle) if self.rma else None
        self._pull_seq = 0  # OP_PULL frames sent (deferred put_many: the target reads part of it)
        self._pull_acked = 0  # ...and answered with OP_PULLED
        self._pull_refused = 0  # ...answered as refused
        self._acks_due: list[tuple[int, int]] = []  # OP_PULLED (seq, status) to send when the send lock is free
        self._pull_failed = False  # an OP_PULL since the last OP_PUT_DONE was refused: do not announce that one
        self._pulled_bytes = 0  # bytes this side read out of the peer's regions
        self._deferred = 0  # put_many calls the target read (part of) itself
        self._pull_rate = 0.0  # bytes/ns the target reads at (EWMA of what its OP_PULLED frames report)
        self._put_rate = 0.0  # bytes/ns this side writes its share at, table building included (EWMA)

    def _take_pull(self, rid, src_rid, nbytes, seq, tag_len, length) -> None:
        """``OP_PULL``: read the listed pieces of the peer's region ``src_rid`` into region ``rid``
        here, now (control frames are taken in order, so the OP_PUT_DONE after it announces bytes
        that are all in place); answer OP_PULLED either way."""
        began_ns = time.perf_counter_ns()
        region = self._regions.get(rid)
        ok = False
        pulled = 0
        start = wire.CTRL.size + tag_len
        if self.rma and region is not None and (self._cma is not None or self._peer_alive()) and region.kind == "host" \
                and start + nbytes == length \
                and nbytes >= wire.PULL_KEY.size:
            buf = self._ctrl_buf
            (key_n,) = wire.PULL_KEY.unpack_from(buf, start)
            t0 = start + wire.PULL_KEY.size + key_n
            count, rest = divmod(length - t0, wire.PULL_PIECE.size)
            if t0 <= length and not rest and count and key_n > 8:
                key = bytes(buf[t0 - key_n:t0])
                table = np.frombuffer(buf, dtype="<u8", count=3 * count, offset=t0).reshape(count, 3)
                so, do, ln = table[:, 0], table[:, 1], table[:, 2]
                if not ((do > region.nbytes) | (ln > region.nbytes - np.minimum(do, region.nbytes))).any():
                    try:
                        self._rma_move("get", region.address, do, so, ln,  # (local = here, remote = the source)
                                       int.from_bytes(key[:8], "little"), src_rid, key[8:],
                                       deadline=time.monotonic() + 10.0, what=f"the pull into region {rid}")
                        ok = True
                        pulled = int(ln.sum())
                        self._pulled_bytes += pulled
                    except (OSError, QlinkError):
                        ok = False
        if not ok:
            self._bad_frame()
            self._pull_failed = True
        self._acks_due.append((seq, 0 if ok else 1, pulled, time.perf_counter_ns() - began_ns if ok else 0))
        # answered when this progress round has taken every frame waiting (_poll): the pulls of
        # several put_many calls taken back to back go in one OP_PULLED

    def _peer_alive(self) -> bool:
        """Is the peer's process still there to be read from? (Its bootstrap socket has not seen
        the end of the stream.) Reading a dead process's memory is an error UCX does not return
        without peer error handling: it aborts this process. So a pull is refused once the peer
        is known gone; one that dies during the read itself is the same hazard as UCX's own
        rendezvous reads."""
        if self._broken is not None:
            return False
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def _send_acks(self) -> None:
        """Answer the pulls taken, in order: a run of pulls done is one OP_PULLED (the last one's
        seq, their bytes and time summed: the initiator counts seqs as a high-water mark), a
        refused one an OP_PULLED of its own."""
        if self._acks_due and self._tx_lock.acquire(blocking=False):
            try:
                while self._acks_due:
                    seq, status, pulled, took_ns = self._acks_due.pop(0)
                    while not status and self._acks_due and not self._acks_due[0][1]:
                        seq, _, more, more_ns = self._acks_due.pop(0)
                        pulled, took_ns = pulled + more, took_ns + more_ns
                    self._send_ctrl(wire.OP_PULLED, seq=seq, notify_id=status, nbytes=pulled, offset=took_ns)
            except QlinkError:
                self._acks_due.clear()  # the link is gone: nobody waits for them
            finally:
                self._tx_lock.release()

    def _take_pulled(self, seq: int, status: int, nbytes: int = 0, took_ns: int = 0) -> None:
        """``OP_PULLED``: the target read the pieces of OP_PULL ``seq`` (``status`` 0) in
        ``took_ns`` (0 from a peer that does not say)."""
        self._pull_acked = max(self._pull_acked, seq)
        self._pull_refused += bool(status)
        if not status and nbytes > 0 and took_ns > 0:
            self._pull_rate = _ewma(self._pull_rate, nbytes / took_ns)

    def _pull_share(self) -> float:
        """The share of a deferred put_many's bytes the target reads: ``PULL_SHARE`` until both
        rates are known, then ``pull rate / (pull rate + put rate)``, within ``PULL_SHARE_RANGE``.

        >>> class _S(PutSide): pass
        >>> s = _S(); s._pull_rate, s._put_rate = 0.0, 2.0
        >>> s._pull_share()
        0.5
        >>> s._pull_rate = 6.0
        >>> s._pull_share()
        0.75
        """
        if self._pull_rate <= 0 or self._put_rate <= 0:
            return self.PULL_SHARE
        lo, hi = self.PULL_SHARE_RANGE
        return min(hi, max(lo, self._pull_rate / (self._pull_rate + self._put_rate)))

    def flush(self, *, timeout_s: float | None = None) -> None:
        """Wait until the target has read every piece it was asked to (deferred put_many)."""
        self._check_open()
        if self._pull_acked >= self._pull_seq:
            return
        deadline = deadline_of(timeout_s)
        backoff = Backoff(spin=2000)
        while self._pull_acked < self._pull_seq:
            with self._rx_lock:
                self._poll(False)
            if self._broken is not None or self._peer_closed:
                raise self._broken_error(f"{self._pull_seq - self._pull_acked} deferred puts were not confirmed")
            if deadline is not None and time.monotonic() >= deadline:
                raise QlinkTimeoutError(f"ucx: the target did not confirm {self._pull_seq - self._pull_acked} "
                                        f"deferred puts within timeout_s={timeout_s}")
            backoff.pause()

    def _take_put_done(self, rid, offset, nbytes, notify_id, tag_len, length) -> None:
        """``OP_PUT_DONE``: the peer's RMA put_many is in this side's memory; announce it in order."""
        region = self._regions.get(rid)
        failed, self._pull_failed = self._pull_failed, False
        if (not self.rma or tag_len > MAX_TAG_BYTES or wire.CTRL.size + tag_len != length or region is None
                or rid not in self._mapped or offset + nbytes > region.nbytes):
            self._bad_frame()  # malformed, not RMA, unknown/deregistered region or out of bounds: counted, dropped
            return
        if failed:
            return  # part of this put_many was refused (counted then): it is never announced
        tag = bytes(self._ctrl_buf[wire.CTRL.size:wire.CTRL.size + tag_len])
        self._put_pending.append((None, Notification(region_id=rid, offset=offset, nbytes=nbytes,
                                                     notify_id=notify_id, tag=tag), None))
        self._reap_puts()

    def _take_put(self, op, rid, offset, nbytes, notify_id, seq, tag_len, length) -> None:
        inline = nbytes if op == wire.OP_PUT_INLINE else 0
        region = self._regions.get(rid)
        if (tag_len > MAX_TAG_BYTES or wire.CTRL.size + tag_len + inline != length
                or region is None or offset + nbytes > region.nbytes):
            self._bad_frame()  # malformed, unknown/deregistered region or out of bounds: counted, dropped
            if op == wire.OP_PUT_HEADER:
                self._put_pending.append((self._discard_data(seq), None, None))
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

    def _take_putv(self, op, rid, count, nbytes, notify_id, seq, tag_len, length) -> None:
        """A vectored put's control frame: receive its data message into a staging buffer."""
        more = op == wire.OP_PUTV_MORE
        if (tag_len > MAX_TAG_BYTES or wire.CTRL.size + tag_len != length or count < 1
                or count * wire.PIECE.size > nbytes or nbytes > wire.PUTV_MAX_NBYTES):
            self._bad_frame()  # malformed: counted; its data message is consumed and its put_many never announced
            vp = _Vput(rid, 0, 0, notify_id, b"", more, False)
            self._put_pending.append((self._discard_data(seq), vp, None))
            self._reap_puts()
            return
        tag = bytes(self._ctrl_buf[wire.CTRL.size:wire.CTRL.size + tag_len])
        stage = self._vstage(nbytes)
        try:
            req = self._ops.recv_tag(stage, nbytes, self._rx_data | seq)
            vp = _Vput(rid, count, nbytes, notify_id, tag, more, True)
        except core.UcxStatus:  # already here and longer than announced: truncated, so consumed
            self._bad_frame()
            self._keep_vstage(stage)
            req, stage, vp = 0, None, _Vput(rid, 0, 0, notify_id, b"", more, False)
        self._put_pending.append((req, vp, stage))
        self._reap_puts()

    def _discard_data(self, seq: int) -> int:
        """Consume the data message that follows a refused put-header: a 1-byte receive
        truncates it. UCX reports the truncation at once when the message is already here."""
        try:
            return self._ops.recv_tag(self._scratch, 1, self._rx_data | seq)
        except core.UcxStatus:
            return 0

    def _vstage(self, nbytes: int) -> np.ndarray:
        fits = [b for b in self._vstages if b.size >= nbytes]
        if fits:
            buf = min(fits, key=len)
            self._vstages = [b for b in self._vstages if b is not buf]
            return buf
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def _keep_vstage(self, buf: np.ndarray) -> None:
        if buf.size <= wire.PUTV_MAX_NBYTES:  # keep the largest few
            self._vstages = sorted([*self._vstages, buf], key=len, reverse=True)[:_KEEP_STAGES]

    def _land_putv(self, vp: _Vput, stage, st: int) -> None:
        """A vectored put's data message has arrived (or failed): check its table, scatter
        its pieces, and announce the put_many once its last vectored put is in."""
        ok, lo, hi = False, 0, 0
        if vp.valid:
            if st < 0:
                self._bad_frame()
            else:
                ok, lo, hi = self._scatter(vp, stage)
            self._keep_vstage(stage)
        sp = self._vspan
        if sp is None:
            sp = self._vspan = [lo, hi, ok]
        else:
            sp[0], sp[1], sp[2] = min(sp[0], lo), max(sp[1], hi), sp[2] and ok
        if vp.more:
            return
        self._vspan = None
        if sp[2]:  # every vectored put of the put_many was accepted
            self._notes.append(Notification(region_id=vp.rid, offset=sp[0], nbytes=sp[1] - sp[0],
                                            notify_id=vp.notify_id, tag=vp.tag))

    def _scatter(self, vp: _Vput, stage: np.ndarray) -> tuple[bool, int, int]:
        count, n = vp.count, vp.nbytes
        tab = count * wire.PIECE.size
        table = stage[:tab].view("<u8").reshape(count, 2)
        do, ln = table[:, 0], table[:, 1]
        if (ln > n).any() or int(ln.astype(np.int64).sum()) != n - tab:
            self._bad_frame()  # the table does not add up to the message
            return False, 0, 0
        region = self._regions.get(vp.rid)
        limit = 0 if region is None else region.nbytes
        if region is None or ((do > limit) | (ln > limit - np.minimum(do, limit))).any():
            self._bad_frame()  # unknown or deregistered region, or a piece outside it: nothing written
            return False, 0, 0
        do, ln = do.astype(np.int64), ln.astype(np.int64)
        so = np.cumsum(ln) - ln + tab
        if region.kind == "device":
            for s, d, k in zip(so.tolist(), do.tolist(), ln.tolist()):
                if k:
                    dev.copy_into_region(region, d, stage[s:s + k])
        else:
            copy_pieces(np.frombuffer(region.view, dtype=np.uint8), stage, so, do, ln)
        lo, hi = span(do, ln)
        return True, lo, hi

    def _reap_puts(self) -> None:
        ops, pend = self._ops, self._put_pending
        while pend:
            req, note, target = pend[0]
            st = ops.status(req)
            if st == wire.IN_PROGRESS:
                return
            pend.popleft()
            ops.release(req)
            if note is None:
                continue
            if type(note) is _Vput:
                self._land_putv(note, target, st)
            elif st < 0:
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
            if self.rma and region.kind == "host" and region.nbytes:
                mapped = self._mapped[rid] = rma.MappedRegion(self._box, region.address, region.nbytes)
                region = Region.of(array, region_id=rid, key=rma.region_key(self._token, mapped))
            self._regions[rid] = region
        return region

    def deregister(self, region: Region) -> None:
        """Forget a region; the peer is told, and its later puts into it raise RegistrationError."""
        with self._rx_lock:
            known = self._regions.pop(region.region_id, None)
            mapped = self._mapped.pop(region.region_id, None)
            if mapped is not None:
                mapped.unmap()
        if known is not None and not self._closed and self._broken is None and not self._peer_closed:
            with self._tx_lock:
                self._send_ctrl(wire.OP_REVOKE, rid=region.region_id)

    def _check_put(self, remote, notify_id: int, tag) -> tuple[RemoteRegion, bytes]:
        """Checks shared by put and put_many, before anything is sent."""
        self._check_sendable("the put")
        remote, tag, _ = check_put_target(remote, notify_id=notify_id, tag=tag)
        return remote, tag

    def _check_target(self, remote: RemoteRegion) -> None:
        if remote.key[:len(self._peer_token)] != self._peer_token:
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
        """Write pieces of ``data`` into the peer's region; return the number of Notifications
        the target will see: 1 (one vectored put, ``put_many_gathers``), or one per piece
        towards a peer that does not take vectored puts (see the module docstring). Every
        piece is checked before anything is sent. ``defer`` changes nothing here."""
        t0 = time.perf_counter_ns()  # a deferred RMA put_many's own share is timed from here (checks included)
        device = type(data) is not bytes and _cuda.is_device(data)
        if device and not self.put_many_gathers:  # device sources: the generic per-piece puts
            return super().put_many(data, remote, src_offsets, dst_offsets, nbytes, notify_id=notify_id, tag=tag,
                                    timeout_s=timeout_s, defer=defer)
        deadline = deadline_of(timeout_s)
        remote, tag = self._check_put(remote, notify_id, tag)
        src = dev.device_view(self._box.tls, data) if device else as_byte_view(data)
        so, do, ln = check_pieces(src_offsets, dst_offsets, nbytes, src_nbytes=len(src), region_nbytes=remote.nbytes,
                                  region_id=remote.region_id)
        self._check_target(remote)
        rid = remote.region_id
        if not self.put_many_gathers:
            with self._tx_lock:
                for s, d, k in zip(so.tolist(), do.tolist(), ln.tolist()):
                    self._issue_put(src[s:s + k], k, rid, d, notify_id, tag, False, deadline, timeout_s)
            self._counters.puts += int(ln.size)
            self._counters.put_bytes += int(ln.sum())
            return int(ln.size)
        pieces, total = int(ln.size), int(ln.sum())
        if self.rma and not device and total:
            _, addr, packed = rma.split_key(remote.key, len(self._peer_token))
            if addr is not None:
                src = np.frombuffer(src, dtype=np.uint8)
                home = self._home_of(src) if defer else None
                self._rma_put_many(src, so, do, ln, remote, addr, packed, notify_id, tag, deadline, home, t0)
                self._counters.puts += pieces
                self._counters.put_bytes += total
                return 1
        if pieces == 1 and not device and total > wire.INLINE_PUT_MAX:
            # one large piece: a put, which the target receives straight into the region (one copy,
            # CMA between local processes) where a vectored put lands in a staging buffer first;
            # its one Notification spans the same bytes as the put_many's would
            with self._tx_lock:
                self._issue_put(src[int(so[0]):int(so[0]) + total], total, rid, int(do[0]), notify_id, tag, False,
                                deadline, timeout_s)
            self._counters.puts += 1
            self._counters.put_bytes += total
            return 1
        if device:  # gathered on the device in one call, copied to host once
            cp = _cuda.require("a put_many from device memory on ucx://")
            keep = ln > 0
            parts = [src[s:s + k] for s, k in zip(so[keep].tolist(), ln[keep].tolist())]
            host = dev.host_copy(cp.concatenate(parts)) if parts else np.empty(0, np.uint8)
            src, so = np.asarray(host, dtype=np.uint8).reshape(-1), np.cumsum(ln) - ln
        else:
            src = np.frombuffer(src, dtype=np.uint8)
        so, do, ln = _split_pieces(so, do, ln, wire.PUTV_MAX_NBYTES - wire.PIECE.size)
        groups = putv_groups(ln)
        with self._tx_lock:
            for g, (a, b) in enumerate(groups):
                last = g == len(groups) - 1
                self._issue_putv(src, so[a:b], do[a:b], ln[a:b], rid, notify_id, tag if last else b"", not last,
                                 deadline, timeout_s)
        self._gathered += 1
        self._counters.puts += pieces
        self._counters.put_bytes += total
        return 1

    def _home_of(self, src: np.ndarray):
        """``(region id, offset of src in it, its key)`` of the mapped region of this side holding
        all of ``src``, or None."""
        a, n = src.ctypes.data, src.size
        hit = self._homes.get((a, n))
        if hit is not None and hit[0] in self._mapped:
            return hit
        for rid, mapped in self._mapped.items():
            r = self._regions.get(rid)
            if r is not None and r.address <= a and a + n <= r.address + r.nbytes:
                if len(self._homes) >= 4096:
                    self._homes.clear()
                hit = self._homes[(a, n)] = (rid, a - r.address, r.key[len(self._token):])
                return hit
        return None

    def _rma_put_many(self, src: np.ndarray, so, do, ln, remote: RemoteRegion, addr: int, packed: bytes,
                      notify_id: int, tag: bytes, deadline, home, t0: int) -> None:
        """Write the pieces straight into the peer's region (UCX RMA, flushed), then announce them
        with one ``OP_PUT_DONE`` spanning the lowest destination to the end of the highest piece.

        ``home`` (a deferred put_many whose source lies in a region mapped here): the target is
        first asked to read the first share of the bytes itself (``OP_PULL``; :meth:`_pull_share`),
        so the two sides copy at once, each on its own core, as NIXL's worker threads do; this side
        writes the rest meanwhile. This side's rate is timed from ``t0``, when put_many was called:
        the checks before the copy are this side's time too, and the target reads while they run
        for the next put_many (the share then gives the target more). The OP_PUT_DONE after both
        is taken after the pull, in order."""
        rid = remote.region_id
        lo, hi = span(do, ln)
        cut = 0
        if home is not None:
            so, do, ln, cut = _share(so, do, ln, self._pull_share())
        if self._cma is None and not self._peer_alive():  # UCX writing into a dead process is fatal to this
            self._fail("the peer process exited or dropped the connection without closing")
            raise self._broken_error("the put_many was not written")
        with self._tx_lock:
            if cut:
                home_rid, base, key = home
                per = (wire.INLINE_PUT_MAX - wire.PULL_KEY.size - len(key)) // wire.PULL_PIECE.size
                for a in range(0, cut, per):
                    b = min(cut, a + per)
                    table = np.empty((b - a, 3), dtype="<u8")
                    table[:, 0], table[:, 1], table[:, 2] = so[a:b] + base, do[a:b], ln[a:b]
                    payload = wire.PULL_KEY.pack(len(key)) + key + table.tobytes()
                    self._pull_seq += 1
                    self._send_ctrl(wire.OP_PULL, rid=rid, offset=home_rid, nbytes=len(payload), seq=self._pull_seq,
                                    inline=payload)
                self._deferred += 1
            try:
                self._rma_move("put", src.ctypes.data, so[cut:], do[cut:], ln[cut:], addr, rid, packed,
                               deadline=deadline, what=f"the put_many into region {rid}")
            except BrokenLinkError as e:
                self._fail(str(e))
                raise
            if cut:
                mine = int(ln[cut:].sum())
                if mine:
                    self._put_rate = _ewma(self._put_rate, mine / max(1, time.perf_counter_ns() - t0))
            self._send_ctrl(wire.OP_PUT_DONE, rid=rid, offset=lo, nbytes=hi - lo, notify_id=notify_id, tag=tag)
        self._rma_puts += 1

    def _rma_move(self, op: str, local_addr: int, local_offsets, remote_offsets, nbytes, remote_addr: int,
                  remote_rid: int, packed: bytes, *, deadline, what: str) -> None:
        """Move the pieces to (``op="put"``) or from (``"get"``) the peer's region at ``remote_addr``:
        all in place when this returns. Same-host CMA, many pieces per call, where it is in force
        (:mod:`transports._ucx_cma`); else UCX RMA, one call per piece."""
        if self._cma is not None:
            self._cma.move(write=op == "put", local_addr=local_addr, local_offsets=local_offsets,
                           remote_addr=remote_addr, remote_offsets=remote_offsets, nbytes=nbytes, what=what)
            return
        rma.rma_pieces(op, self._box.handle, self._ep.handle, local_addr, local_offsets, remote_offsets, nbytes,
                       remote_addr, self._rkeys.get(remote_rid, packed), deadline=deadline, what=what)

    def _issue_putv(self, src: np.ndarray, so, do, ln, rid: int, notify_id: int, tag: bytes, more: bool,
                    deadline, timeout_s) -> None:
        """Send one vectored put: its control frame, then the table and the gathered pieces
        as one data message; the caller holds _tx_lock."""
        count = int(ln.size)
        tab = count * wire.PIECE.size
        n = tab + int(ln.sum())
        self._room(n, deadline, False, "the put_many", timeout_s)
        self._put_seq = (self._put_seq + 1) & 0xFFFFFFFF
        seq = self._put_seq
        self._send_ctrl(wire.OP_PUTV_MORE if more else wire.OP_PUTV, rid=rid, offset=count, nbytes=n,
                        notify_id=notify_id, seq=seq, tag=tag)

        def fill(buf: np.ndarray) -> None:
            table = buf[:tab].view("<u8").reshape(count, 2)
            table[:, 0], table[:, 1] = do, ln
            copy_pieces(buf[tab:], src, so, np.cumsum(ln) - ln, ln)  # packed destinations: one gather

        self._post(None, n, self._tx_data | seq, fill=fill)

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

