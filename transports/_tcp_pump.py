"""The receive side of a ``tcp://`` endpoint: read the stream ahead into one buffer, cut it
into frames (:mod:`transports.framing`, and :mod:`transports._tcp_frames` for PUTV) and land
each one: a message into the caller's buffer (a large one straight from the socket) or aside
in a queue, a put into its registered region with its Notification queued, a PUTV frame
through a staging buffer scattered into the region, DEREG and BYE into the endpoint's state.

:class:`TcpReceiveSide` is a part of :class:`~transports._tcp_endpoint.TcpEndpoint`; every
method runs with the endpoint's receive lock held.
"""

from __future__ import annotations

import os
import socket

import numpy as np

from qlink.errors import WireError

from . import framing as fr
from ._base import BufferTooSmallError, Notification
from ._pieces import copy_pieces, span
from ._tcp_frames import KIND_PUTV, PIECE_NBYTES, PUTV_MORE, check_putv_header

__all__ = ["TcpReceiveSide", "NOTHING", "NOTE"]

NOTHING = -1  # _pump: no more bytes for now
NOTE = -2  # _pump: a notification was queued
_DIRECT_MIN = 32 << 10  # a payload remainder at least this large is read straight into its destination
_MAX_STAGE_KEEP = 256 << 20  # a PUTV staging buffer up to this size is kept for the next frame

_unpack_header = fr.HEADER.unpack_from
_HSIZE = fr.HEADER.size


class TcpReceiveSide:
    """Frames in: the read-ahead buffer, the frame in progress, the queues set aside."""

    def _fill(self) -> bool:
        """Read what the socket has into the read-ahead buffer; False when nothing came.

        Reading goes on after a send found the link dead: what the peer sent before it
        went away is still delivered."""
        if self._rpos == self._rend:
            self._rpos = self._rend = 0
        elif self._rpos and len(self._rbuf) - self._rend < len(self._rbuf) // 2:
            left = self._rend - self._rpos
            self._rbuf[:left] = self._rmv[self._rpos:self._rend]
            self._rpos, self._rend = 0, left
        try:
            n = self._sock.recv_into(self._rmv[self._rend:])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            self._mark_dead(f"{os.strerror(e.errno) if e.errno else e} while receiving", e)
            return False
        if n == 0:
            self._mark_eof()
            return False
        self._rend += n
        return True

    def _pump(self, out: memoryview | None) -> int:
        """Progress incoming frames without blocking.

        Returns the size of a message delivered into ``out``, ``NOTE`` when a
        notification was queued, ``NOTHING`` when the socket has no more for now.
        A plain message (no tag) takes no call beyond this one and the socket's.
        """
        rmv = self._rmv
        while True:
            cur = self._cur
            if cur is None:
                avail = self._rend - self._rpos
                if avail < _HSIZE:
                    if not self._fill():
                        return NOTHING
                    continue
                kind, flags, tag_n, rid, n, off, nid = _unpack_header(rmv, self._rpos)
                if kind != fr.KIND_MSG or tag_n or n > fr.MAX_FRAME_PAYLOAD:
                    cur = self._begin_frame(avail, kind, flags, tag_n, rid, n, off, nid)
                    if cur is None:
                        continue  # a control frame was read, or more bytes came
                    if cur is NOTHING:
                        return NOTHING
                else:
                    self._rpos += _HSIZE
                    cur = self._cur = (kind, rid, n, off, nid, b"")
                    self._cur_got = 0
                    self._cur_direct = False
                    self._cur_flags = flags
                    self._cur_dst = None
            kind, rid, n, off, nid, tag = cur
            dst = self._cur_dst
            if kind == fr.KIND_MSG and out is not None and not self._msgq and n > len(out):
                raise BufferTooSmallError(
                    f"next tcp message is {n} bytes but the buffer holds {len(out)}; the message stays "
                    f"queued, call again with a buffer of at least {n} bytes", needed_nbytes=n)
            if kind == fr.KIND_MSG and dst is None:
                if out is not None and not self._msgq:
                    dst = self._cur_dst = out[:n]
                    self._cur_direct = True
                else:
                    dst = self._cur_dst = memoryview(bytearray(n))
                    self._staged += 1
            got = self._cur_got
            while got < n:
                avail = self._rend - self._rpos
                if avail:
                    k = min(avail, n - got)
                    if dst is not None:
                        dst[got:got + k] = rmv[self._rpos:self._rpos + k]
                    self._rpos += k
                    got += k
                elif dst is not None and n - got >= _DIRECT_MIN:
                    k = self._recv_direct(dst, got, n)
                    if k < 0:
                        self._cur_got = got
                        return NOTHING
                    got += k
                elif not self._fill():
                    self._cur_got = got
                    return NOTHING
            self._cur = None
            self._cur_dst = None
            self._cur_got = 0
            if kind == fr.KIND_MSG:
                if self._cur_direct:
                    self._cur_direct = False
                    self._counters.messages_received += 1
                    self._counters.bytes_received += n
                    return n
                self._msgq.append(dst)
                if out is not None:
                    return self._deliver_queued(self._msgq, out)
            else:
                r = self._landed(kind, rid, n, off, nid, tag, dst)
                if r is not None:
                    return r

    def _begin_frame(self, avail: int, kind: int, flags: int, tag_n: int, rid: int, n: int, off: int, nid: int):
        """Any frame but a plain message: check its header, read DEREG and BYE, start a put.
        Returns the frame now in progress, None to go on reading, NOTHING to stop."""
        try:
            if kind == KIND_PUTV:
                check_putv_header(flags, tag_n, n, off)
            else:
                kind, tag_n, rid, n, off, nid = fr.parse_header(self._rmv, self._rpos)
        except WireError as e:
            self._bad_frame(e)
            return NOTHING
        if avail < _HSIZE + tag_n:
            return None if self._fill() else NOTHING
        start = self._rpos + _HSIZE
        tag = bytes(self._rmv[start:start + tag_n]) if tag_n else b""
        self._rpos = start + tag_n
        if kind == fr.KIND_DEREG:
            self._withdrawn.add(rid)
            return None
        if kind == fr.KIND_BYE:
            self._peer_said_bye = True
            return None
        cur = self._cur = (kind, rid, n, off, nid, tag)
        self._cur_got = 0
        self._cur_direct = False
        self._cur_flags = flags
        if kind == fr.KIND_PUT:
            self._cur_dst = self._put_target(rid, off, n)
        elif kind == KIND_PUTV:
            self._cur_dst = self._staging(n)
        else:
            self._cur_dst = None
        return cur

    def _recv_direct(self, dst: memoryview, got: int, n: int) -> int:
        """Read the rest of a large payload straight into ``dst``; -1 when nothing came."""
        try:
            k = self._sock.recv_into(dst[got:], n - got)
        except (BlockingIOError, InterruptedError):
            return -1
        except OSError as e:
            self._mark_dead(f"{os.strerror(e.errno) if e.errno else e} while receiving", e)
            return -1
        if k == 0:
            self._mark_eof()
            return -1
        return k

    def _landed(self, kind: int, rid: int, n: int, off: int, nid: int, tag: bytes, dst):
        """A put's bytes are all in: announce it. NOTE when a Notification was queued,
        NOTHING when the link broke, None to go on reading."""
        if kind == KIND_PUTV:
            note = self._land_putv(rid, n, off, nid, tag, dst)
            if note is not None:
                self._noteq.append(note)
                return NOTE
            return NOTHING if self._dead is not None else None
        if dst is not None:  # an accepted put: its bytes are in place
            self._noteq.append(Notification(region_id=rid, offset=off, nbytes=n, notify_id=nid, tag=tag))
            return NOTE
        return None  # a rejected put: read past it

    def _put_target(self, region_id: int, offset: int, nbytes: int) -> memoryview | None:
        entry = self._regions.get(region_id)
        if entry is None or offset + nbytes > entry[0].nbytes:
            self._puts_rejected += 1  # deregistered while the put was in flight, or a bad peer
            self._counters.errors += 1
            return None
        return entry[1][offset:offset + nbytes]

    def _bad_frame(self, err: WireError) -> None:
        self._counters.errors += 1
        self._mark_dead(f"the peer sent a malformed frame: {err}", err)
        self._rpos = self._rend = 0
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _staging(self, nbytes: int) -> memoryview:
        st = self._stage
        if st is None or st.size < nbytes:
            st = np.empty(nbytes, dtype=np.uint8)
            if nbytes <= _MAX_STAGE_KEEP:
                self._stage = st
        return memoryview(st)[:nbytes]

    def _land_putv(self, rid: int, n: int, count: int, nid: int, tag: bytes, staged: memoryview):
        """A whole PUTV frame is in ``staged``: check its table, scatter its pieces into the
        region; the Notification when this was the last frame of its put_many, else None."""
        tab_n = count * PIECE_NBYTES
        table = np.frombuffer(staged, dtype="<u8", count=2 * count).reshape(count, 2)
        do, ln = table[:, 0], table[:, 1]
        if (ln > fr.MAX_FRAME_PAYLOAD).any() or int(ln.sum()) != n - tab_n:
            self._bad_frame(WireError(f"PUTV frame of {n} bytes: its {count} pieces add up to {int(ln.sum())} "
                                      f"bytes, not the {n - tab_n} after the table"))
            self._vspan = None
            return None
        entry = self._regions.get(rid)
        limit = 0 if entry is None else entry[0].nbytes
        ok = entry is not None and not ((do > limit) | (ln > limit - np.minimum(do, limit))).any()
        if ok:
            do, ln = do.astype(np.int64), ln.astype(np.int64)
            so = np.cumsum(ln) - ln + tab_n
            copy_pieces(np.frombuffer(entry[1], dtype=np.uint8), np.frombuffer(staged, dtype=np.uint8), so, do, ln)
            lo, hi = span(do, ln)
        else:
            self._puts_rejected += 1  # deregistered while the put was in flight, or a bad peer
            self._counters.errors += 1
            lo, hi = 0, 0
        sp = self._vspan
        if sp is None:
            sp = self._vspan = [lo, hi, ok]
        else:
            sp[0], sp[1], sp[2] = min(sp[0], lo), max(sp[1], hi), sp[2] and ok
        if self._cur_flags & PUTV_MORE:
            return None
        self._vspan = None
        if not sp[2]:
            return None  # some piece was refused: the put_many is never announced
        return Notification(region_id=rid, offset=sp[0], nbytes=sp[1] - sp[0], notify_id=nid, tag=tag)

    def _detach(self) -> None:
        """Leaving a receive early: move a half-received message out of the caller's buffer."""
        if self._cur_direct:
            staged = memoryview(bytearray(self._cur[2]))
            staged[:self._cur_got] = self._cur_dst[:self._cur_got]
            self._cur_dst = staged
            self._cur_direct = False
            self._staged += 1

    def _recv_once(self, out: memoryview) -> int:
        if self._msgq:
            return self._deliver_queued(self._msgq, out)
        while True:
            r = self._pump(out)
            if r != NOTE:
                return r

    def _note_once(self) -> Notification | None:
        if not self._noteq and self._pump(None) != NOTE:
            return None
        self._counters.notifications += 1
        return self._noteq.popleft()

    def _drain_background(self) -> None:
        """Progress incoming frames for a thread that is not receiving (stage messages, apply puts)."""
        if self._rlock.acquire(blocking=False):
            try:
                while self._pump(None) != NOTHING:
                    pass
            finally:
                self._rlock.release()

    def _receive_wait(self, attempt, what: str, timeout_s: float | None, deadline: float | None):
        """Try ``attempt()`` until it returns something, waiting by the endpoint's policy
        (:class:`~transports._tcp_wait.TcpRecvWait`) in between."""
        wait = self._rwait
        wait.restart(what, timeout_s, deadline)
        while True:
            if self._dead is not None:
                self._raise_broken(what)
            wait.pause()
            self._check_open()
            r = attempt()
            if r is not None:
                return r
