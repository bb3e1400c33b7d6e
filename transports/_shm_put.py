"""One-sided puts of an ``shm://`` endpoint (a side of :class:`~transports._shm_endpoint.ShmEndpoint`):
register, put, put_many (inline, mapped, or pulled by the target), flush, and the records
other than messages a receive meets on the way (put done, inline put, pull)."""

from __future__ import annotations

import operator
import socket

import numpy as np

from qlink.errors import ClosedError
from qlink.memory import Region, RemoteRegion, as_byte_view

from ._base import MAX_TAG_BYTES, Notification, deadline_of
from ._base import check_notify_id as _check_notify_id
from ._base import check_tag as _check_tag
from ._pieces import check_pieces
from ._ring import (
    KIND_CORRUPT,
    KIND_MSG,
    KIND_MSG_CONT,
    KIND_PUT_DONE,
    KIND_PUT_INLINE,
    KIND_PUT_PULL,
    SEND_OK,
    SEND_TOO_BIG,
)
from ._shm_records import C_NOTES, DONE, INLINE, OFFER, OFFER_MAGIC, PIECE_NBYTES, PULL, PULL_LAST, fast_note
from ._shm_wait import ShmWait

__all__ = ["ShmPutSide"]


class ShmPutSide:
    """The one-sided half of :class:`~transports._shm_endpoint.ShmEndpoint` (its state lives there)."""

    # ----- records other than messages ---------------------------------------------------
    def _take_put_done(self, n: int, off: int) -> Notification | None:
        """Consume the PUT_DONE record at the head of the ring; its Notification, or None if bad."""
        note = None
        if n >= DONE.size:
            data = self._rx_data
            rid, tag_len, offset, nbytes, notify_id = DONE.unpack_from(data, off)
            entry = self._local.get(rid)
            if DONE.size + tag_len == n and entry is not None and offset + nbytes <= entry[0].nbytes:
                note = fast_note(rid, offset, nbytes, notify_id, bytes(data[off + DONE.size:off + n]) if tag_len else b"")
        if note is None:  # not a put into a region registered here (deregistered meanwhile?)
            self._x["bad_records"] += 1
            self._counters.errors += 1
        self._rx.consume()
        return note

    def _apply_pull(self, n: int, off: int) -> Notification | None:
        """Copy the pieces of the PUT_PULL record at the head of the ring out of the peer's
        region into ours, consume it; the Notification when it was the put's last record."""
        data, note, ok, seq, last = self._rx_data, None, False, 0, False
        if n >= PULL.size:
            dst_rid, src_rid, k, tag_len, nid, seq, span_off, span_n, flags, _ = PULL.unpack_from(data, off)
            last = bool(flags & PULL_LAST)
            entry = self._local.get(dst_rid)
            source = self._peer.source(src_rid)
            if (tag_len <= MAX_TAG_BYTES and PULL.size + tag_len + k * PIECE_NBYTES == n and entry is not None
                    and source is not None):
                dview, (state, sview) = entry[1], source
                at = off + PULL.size + tag_len
                raw = np.frombuffer(data, dtype="<u8", count=3 * k, offset=at).reshape(k, 3)
                q = raw.astype(np.int64)
                s_, d_, l_ = q[:, 0], q[:, 1], q[:, 2]
                lim = len(dview)
                if ((raw < 1 << 62).all() and (l_ <= len(sview)).all() and (s_ <= len(sview) - l_).all()
                        and (l_ <= lim).all() and (d_ <= lim - l_).all() and (not last or span_off + span_n <= lim)):
                    for a, b, c in q.tolist():
                        dview[b:b + c] = sview[a:a + c]
                    self._x["pulled_bytes"] += int(l_.sum())
                    if self._fast is not None:
                        self._fast.cache_source(src_rid, state, sview)  # later records of it are pulled in C
                    ok = True
                    if last:
                        tag = bytes(data[off + PULL.size:off + PULL.size + tag_len]) if tag_len else b""
                        note = fast_note(dst_rid, span_off, span_n, nid, tag)
        if not ok:  # the source or the target region is gone, or the record is malformed
            self._x["bad_records"] += 1
            self._counters.errors += 1
        self._rx.consume()
        if last:
            self._rx.set_pulled(seq)  # after the copies: the initiator may reuse its source
        return note

    def _side_record(self, kind: int, n: int, aux: int, off: int) -> None:
        rx, data = self._rx, self._rx_data
        if kind == KIND_PUT_DONE:
            note = self._take_put_done(n, off)
            if note is not None:
                self._notes.append(note)
        elif kind == KIND_PUT_INLINE:
            ok = False
            if n >= INLINE.size:
                rid, _, offset = INLINE.unpack_from(data, off)
                entry = self._local.get(rid)
                c = n - INLINE.size
                if entry is not None and offset + c <= entry[0].nbytes:
                    entry[1][offset:offset + c] = data[off + INLINE.size:off + n]
                    ok = True
            if not ok:
                self._x["bad_records"] += 1
                self._counters.errors += 1
            rx.consume()
        elif kind == KIND_PUT_PULL:
            done = self._fast.pull_head() if self._fast is not None and C_NOTES else None
            note = self._apply_pull(n, off) if done is None else None if done is True else done
            if note is not None:
                self._notes.append(note)
        elif kind == KIND_CORRUPT:
            self._peer_gone = (f"the ring from the peer holds a record of {n} bytes that does not fit it "
                               "(memory corrupted); the connection cannot continue")
            raise self._broken("receive")
        else:
            self._x["bad_records"] += 1
            self._counters.errors += 1
            rx.consume()

    # ----- one-sided ------------------------------------------------------------------
    def register(self, array) -> Region:
        """Register ``array`` (writable, C-contiguous host memory) as a put target.

        Puts into :func:`qlink.memory.alloc` memory are zero-copy (the initiator writes
        it directly); any other array is written by this side as it progresses.
        """
        self._check_open()
        region = self._local.register(array)
        fd = self._local.shared_fd(region.region_id)
        if fd is not None:  # hand the memfd over: the peer maps it even if this process is gone by then
            try:
                socket.send_fds(self._sock, [OFFER.pack(OFFER_MAGIC, region.region_id)], [fd], socket.MSG_DONTWAIT)
            except OSError:
                pass  # the peer maps it through /proc instead
        return region

    def deregister(self, region: Region) -> None:
        """Forget a region; later puts into it raise RegistrationError on the initiator."""
        self._local.deregister(region, publish=not self._closed)

    def _put_args(self, remote, tag, notify_id, timeout_s):
        """The checks every put starts with: open, a valid timeout, the target as a RemoteRegion,
        the tag and the notify id; returns ``(remote, tag, notify_id)``."""
        if self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        if timeout_s is not None and not timeout_s >= 0:
            deadline_of(timeout_s)
        if not isinstance(remote, RemoteRegion):
            remote = RemoteRegion.from_bytes(remote)
        return remote, _check_tag(tag), _check_notify_id(notify_id)

    def put(self, data, remote: RemoteRegion, *, offset: int = 0, notify_id: int = 0, tag: bytes = b"",
            timeout_s: float | None = None) -> None:
        """Write ``data`` into the peer's region at ``offset``; the peer then gets a Notification.

        Validation failures (unknown region, out of range) raise RegistrationError
        before anything is written.
        """
        remote, tag, notify_id = self._put_args(remote, tag, notify_id, timeout_s)
        if type(offset) is not int:
            offset = operator.index(offset)
        try:
            src = memoryview(data)
        except TypeError:
            src = None
        if src is None or src.format != "B" or src.ndim != 1 or not src.c_contiguous:
            src = as_byte_view(data)  # casts, or says what is wrong with the buffer
        n = len(src)
        state, _, dst = self._peer.entry(remote, offset=offset, nbytes=n)  # raises before anything is written
        self._check_peer_for_put("put")  # never write into memory the peer may have moved on from
        rid = remote.region_id
        w = None
        if dst is not None:
            if n:
                dst[offset:offset + n] = src
            self._x["zero_copy_puts"] += 1
            if self._fast is not None:
                self._fast.cache_remote(remote, rid, state, len(dst), dst)  # later puts into it run in C
        else:
            w = ShmWait(self, "put", timeout_s)
            self._put_inline(rid, src, offset, w)
            self._x["inline_puts"] += 1
        self._finish_put(DONE.pack(rid, len(tag), offset, n, notify_id), tag, timeout_s, w)
        self._counters.puts += 1
        self._counters.put_bytes += n

    def put_many(self, data, remote: RemoteRegion, src_offsets, dst_offsets, nbytes, *, notify_id: int = 0,
                 tag: bytes = b"", timeout_s: float | None = None, defer: bool = False) -> int:
        """Write pieces of ``data`` into the peer's region and publish ONE Notification for all.

        Piece ``i`` is ``data[src_offsets[i]:src_offsets[i] + nbytes[i]]`` and lands at
        ``dst_offsets[i]`` (later pieces win where destinations overlap). The target's
        Notification covers the smallest range holding every piece (``offset`` = the lowest
        destination, ``nbytes`` = up to the end of the highest) and is published after the
        last byte. Every piece is checked before any is written. Returns 1, the number of
        Notifications the target will see (see :meth:`transports.Endpoint.put_many`).
        Offsets and sizes as int64 NumPy arrays take the C path; any integer sequences work.

        ``defer=True`` with ``data`` inside alloc() memory registered on this endpoint: only
        the list of pieces is sent, and the target copies them out of that memory itself as
        it progresses (in ``wait_notification`` / ``poll_notification_nowait`` / receives),
        so the call returns in microseconds however many bytes move; ``data`` must then stay
        unchanged until :meth:`flush` returns (or the Notification was seen). Elsewhere
        ``defer`` changes nothing.
        """
        remote, tag, notify_id = self._put_args(remote, tag, notify_id, timeout_s)
        src = as_byte_view(data)
        so, do, ln = check_pieces(src_offsets, dst_offsets, nbytes, src_nbytes=len(src), region_nbytes=remote.nbytes,
                                  region_id=remote.region_id)
        lo, hi = int(do.min()), int((do + ln).max())
        state, region_nbytes, dst = self._peer.entry(remote, offset=lo, nbytes=hi - lo)
        self._check_peer_for_put("put_many")
        rid = remote.region_id
        if self._fast is not None:
            self._fast.cache_remote(remote, rid, state, region_nbytes, dst)  # later put_many into it run in C
        if defer and len(src) and self._tx.max_payload - PULL.size - len(tag) >= PIECE_NBYTES:
            home = self._local.containing(np.frombuffer(src, dtype=np.uint8).ctypes.data, len(src))
            if home is not None:
                self._post_pull(home, rid, so, do, ln, lo, hi, notify_id, tag, timeout_s)
                return 1
        w = None
        pieces = zip(so.tolist(), do.tolist(), ln.tolist())
        if dst is not None:
            for s, d, n in pieces:
                dst[d:d + n] = src[s:s + n]
            self._x["zero_copy_puts"] += len(ln)
        else:
            w = ShmWait(self, "put_many", timeout_s)
            for s, d, n in pieces:
                self._put_inline(rid, src[s:s + n], d, w)
            self._x["inline_puts"] += len(ln)
        self._finish_put(DONE.pack(rid, len(tag), lo, hi - lo, notify_id), tag, timeout_s, w)
        self._x["gathered_puts"] += 1
        self._counters.puts += len(ln)
        self._counters.put_bytes += int(ln.sum())
        return 1

    def _publish_span(self, remote: RemoteRegion, lo: int, span: int, *, notify_id: int, tag: bytes,
                      timeout_s: float | None) -> None:
        """Publish one Notification over ``[lo, lo + span)`` of ``remote`` and move no byte: the
        completion of bytes another engine (CUDA) has already written there. The same checks
        and record as a ``put_many`` whose pieces are empty, without building piece arrays."""
        remote, tag, notify_id = self._put_args(remote, tag, notify_id, timeout_s)
        self._peer.entry(remote, offset=lo, nbytes=span)  # raises before anything is published
        self._check_peer_for_put("put_many")
        self._finish_put(DONE.pack(remote.region_id, len(tag), lo, span, notify_id), tag, timeout_s)
        self._x["gathered_puts"] += 1

    def _check_peer_for_put(self, what: str) -> None:
        """BrokenLinkError (naming ``what``) once the peer is gone or has stopped reading."""
        self._look_at_peer()
        if self._peer_gone is not None or self._tx.consumer_closed:
            self._peer_flags()
            raise self._broken(what)

    def _post_pull(self, home: tuple[int, int], rid: int, so, do, ln, lo: int, hi: int, notify_id: int, tag: bytes,
                   timeout_s: float | None) -> None:
        """PUT_PULL records naming the pieces; the target copies them out of our region ``home``."""
        src_rid, base = home
        pieces = np.empty((len(ln), 3), dtype="<u8")
        pieces[:, 0], pieces[:, 1], pieces[:, 2] = so + base, do, ln
        per_record = (self._tx.max_payload - PULL.size - len(tag)) // PIECE_NBYTES
        seq, w = self._next_pull_seq(), None
        for start in range(0, len(pieces), per_record):
            part = pieces[start:start + per_record]
            last = start + per_record >= len(pieces)
            head = PULL.pack(rid, src_rid, len(part), len(tag), notify_id, seq, lo, hi - lo,
                              PULL_LAST if last else 0, 0) + tag
            body = memoryview(part).cast("B")
            if self._tx.try_send(KIND_PUT_PULL, 0, head, body) != SEND_OK:
                w = w or ShmWait(self, "put_many", timeout_s)
                self._send_record(KIND_PUT_PULL, head, body, w, "put_many")
        self._x["deferred_puts"] += 1
        self._x["gathered_puts"] += 1
        self._counters.puts += len(ln)
        self._counters.put_bytes += int(ln.sum())
        if self._fast is not None:
            self._fast.cache_home(src_rid)  # the next deferred put from there is posted in C

    def _next_pull_seq(self) -> int:
        if self._fast is not None:
            self._fast.pull_seq += 1
            return self._fast.pull_seq
        self._pull_seq += 1
        return self._pull_seq

    def flush(self, *, timeout_s: float | None = None) -> None:
        """Wait until the peer has copied every deferred put (``put_many(..., defer=True)``);
        their sources may change from then on. BrokenLinkError if the peer goes away first."""
        self._check_open()
        deadline_of(timeout_s)
        w = None
        posted = self._fast.pull_seq if self._fast is not None else self._pull_seq
        while self._tx.pulled < posted:
            if self._peer_flags() is not None:
                raise self._broken("flush")
            if w is None:
                w = ShmWait(self, "flush", timeout_s)
            w.pause()

    def _put_inline(self, rid: int, src: memoryview, offset: int, w: "ShmWait") -> None:
        """PUT_INLINE records carrying ``src`` for the target to apply at ``offset``."""
        n = len(src)
        step = self._tx.max_payload - INLINE.size
        for pos in range(0, n, step):
            c = min(step, n - pos)
            self._send_record(KIND_PUT_INLINE, INLINE.pack(rid, 0, offset + pos), src[pos:pos + c], w, "put")

    def _finish_put(self, done: bytes, tag: bytes, timeout_s: float | None, w: "ShmWait | None" = None) -> None:
        """Publish a put's PUT_DONE record, waiting (up to ``timeout_s``) while the ring is full."""
        if self._tx.try_send(KIND_PUT_DONE, 0, done, tag) != SEND_OK:
            self._send_record(KIND_PUT_DONE, done, tag, w or ShmWait(self, "put", timeout_s), "put")

    def _send_record(self, kind: int, part1, part2, w: ShmWait, what: str) -> None:
        tx = self._tx
        while True:
            r = tx.try_send(kind, 0, part1, part2)
            if r == SEND_OK:
                w.progressed()
                return
            self._check_send_code(r, what)
            if r == SEND_TOO_BIG:  # cannot happen: records are sized below max_payload
                raise RuntimeError(f"shm record of kind {kind} exceeds the ring's max payload")
            if self._peer_gone is not None:
                raise self._broken(what)
            w.pause()

    def wait_notification(self, *, timeout_s: float | None = None) -> Notification:
        """Wait for the next put completion targeted at this side (applying inline puts on the way)."""
        if not self._notes and not self._closed and (timeout_s is None or timeout_s >= 0):
            rec = self._rx.peek()  # fast path: a completion is at the head of the ring
            if rec is not None and rec[0] == KIND_PUT_DONE:
                note = self._take_put_done(rec[1], rec[3])
                if note is not None:
                    self._counters.notifications += 1
                    return note
        return self._next_note(timeout_s, False)

    def poll_notification_nowait(self) -> Notification:
        """The next put completion if one has arrived, else raise WouldBlock."""
        return self._next_note(None, True)

    def _next_note(self, timeout_s: float | None, nowait: bool) -> Notification:
        self._check_open()
        if self._notes:
            self._counters.notifications += 1
            return self._notes.popleft()
        w = None
        rx = self._rx
        what = "poll_notification_nowait" if nowait else "wait_notification"
        if not nowait:
            deadline_of(timeout_s)
        while True:
            if self._notes:
                self._counters.notifications += 1
                return self._notes.popleft()
            rec = rx.peek()
            if rec is None:
                w = self._idle(w, what, timeout_s, nowait)
                continue
            kind, n, aux, off = rec
            if kind in (KIND_MSG, KIND_MSG_CONT):
                self._stash(kind, n, aux, off)
            else:
                self._side_record(kind, n, aux, off)
