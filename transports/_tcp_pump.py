"""The receive side of a ``tcp://`` endpoint: read the stream ahead into one buffer, cut it
into frames (:mod:`transports.framing`, and :mod:`transports._tcp_frames` for PUTV) and land
each one: a message into the caller's buffer (a large one straight from the socket) or aside
in a queue, a put into its registered region with its Notification queued, a PUTV frame's
table first and then its pieces (large ones straight into their places in the region, small
ones staged and scattered in one call), DEREG and BYE into the endpoint's state.

:class:`TcpReceiveSide` is a part of :class:`~transports._tcp_endpoint.TcpEndpoint`; every
method runs with the endpoint's receive lock held.
"""

from __future__ import annotations

import fcntl
import os
import socket
import termios

import numpy as np

from qlink.errors import WireError

from . import framing as fr
from ._base import BufferTooSmallError, Notification
from ._pieces import copy_pieces, outside, span
from ._tcp_frames import (KIND_PUTV, KIND_PUTV_ACK, PIECE_NBYTES, PUTV_ACK, PUTV_MORE, check_ack_header,
                          check_putv_header)
from ._tcp_splice import recv_pieces

__all__ = ["TcpReceiveSide", "NOTHING", "NOTE"]

NOTHING = -1  # _pump: no more bytes for now
NOTE = -2  # _pump: a notification was queued
_DIRECT_MIN = 32 << 10  # a payload remainder at least this large is read straight into its destination
_MAX_STAGE_KEEP = 256 << 20  # a PUTV staging buffer up to this size is kept for the next frame
_DIRECT_PIECE = 64 << 10  # PUTV pieces this large on average land straight in the region, not staged
_HEAD_AHEAD = 16 << 10  # after a frame read by the C loop, the next read-ahead takes at most this much
_NATIVE_PIECE = 4 << 10  # with the C module, pieces this large on average are read straight into place by it
_V_TABLE, _V_DIRECT, _V_STAGED, _V_SKIP, _V_NATIVE = range(5)  # the phases of a PUTV frame in progress

_unpack_header = fr.HEADER.unpack_from
_HSIZE = fr.HEADER.size


class TcpReceiveSide:
    """Frames in: the read-ahead buffer, the frame in progress, the queues set aside."""

    def _fill(self) -> bool:
        """Read what the socket has into the read-ahead buffer; False when nothing came.
        Right after a frame the C loop read into place, only ``_HEAD_AHEAD`` bytes: the
        next frame's header and table, so its pieces too go straight into place.

        Reading goes on after a send found the link dead: what the peer sent before it
        went away is still delivered."""
        if self._rpos == self._rend:
            self._rpos = self._rend = 0
        elif self._rpos and len(self._rbuf) - self._rend < len(self._rbuf) // 2:
            left = self._rend - self._rpos
            self._rbuf[:left] = self._rmv[self._rpos:self._rend]
            self._rpos, self._rend = 0, left
        want, self._ra_next = self._ra_next, 0
        try:
            n = self._sock.recv_into(self._rmv[self._rend:self._rend + want] if want else self._rmv[self._rend:])
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
        The PUTV_ACKs owed when the socket runs dry go then (see :meth:`_socket_dry`).
        """
        r = self._pump_frames(out)
        if self._ack_read > self._ack_told and (r == NOTHING or self._socket_dry()):
            self._answer_ack()
        return r

    def _socket_dry(self) -> bool:
        """Nothing read ahead and nothing more in the socket now. The PUTV_ACKs owed wait
        while the peer's bytes keep coming: its sender is then still sending, not waiting
        in ``flush``, and one answer counts every frame read (the count is cumulative),
        where an answer per frame cost both sides a wake-up and a small send per layer of a
        KV transfer. The answer goes once the socket is dry, whatever this call returns."""
        if self._rend > self._rpos:
            return False
        try:
            fcntl.ioctl(self._sock.fileno(), termios.FIONREAD, self._inq)
        except OSError:
            return True
        return self._inq[0] == 0

    def _pump_frames(self, out: memoryview | None) -> int:
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
            if kind == KIND_PUTV:
                r = self._pump_putv()
                if r is not None:
                    return r
                continue
            got = self._cur_got = self._take(dst, self._cur_got, n)
            if got < n:
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
                check_putv_header(flags, tag_n, n, off, version=self.version)
            elif kind == KIND_PUTV_ACK and self.version >= 3:
                check_ack_header(flags, tag_n, n)
                self._rpos += _HSIZE
                self._ack_heard = max(self._ack_heard, off)
                return None
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
            self._vphase = _V_TABLE
            self._cur_dst = self._table_buffer(off * PIECE_NBYTES)
        else:
            self._cur_dst = None
        return cur

    def _take(self, dst: memoryview | None, got: int, n: int) -> int:
        """Move the frame's bytes ``[got, n)`` into ``dst`` (None: read past them), from the
        read-ahead buffer or, for a large remainder, straight from the socket; returns how
        far it got (less than ``n``: the socket has no more for now)."""
        rmv = self._rmv
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
                    return got
                got += k
            elif not self._fill():
                return got
        return got

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
        """A put's bytes are all in: announce it. NOTE when a Notification was queued, None
        to go on reading (a rejected put)."""
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

    def _table_buffer(self, nbytes: int) -> memoryview:
        st = self._stage
        if st is None or st.size < nbytes:
            st = np.empty(nbytes, dtype=np.uint8)
            if nbytes <= _MAX_STAGE_KEEP:
                self._stage = st
        return memoryview(st)[:nbytes]

    def _pump_putv(self) -> int | None:
        """Progress the PUTV frame in progress: its table, then its pieces. Pieces of
        ``_DIRECT_PIECE`` bytes or more on average go straight into their places in the
        region (a large remainder read from the socket into it); smaller ones are read into a
        staging buffer behind the table and scattered from there in one call. A frame whose
        pieces fall outside the region is read past and counted; one whose table does not
        add up breaks the link. NOTE when the put_many's Notification was queued, NOTHING to
        stop, None when the frame is done and reading goes on."""
        kind, rid, n, count, nid, tag = self._cur
        tab_n = count * PIECE_NBYTES
        phase = self._vphase
        if phase == _V_TABLE:
            got = self._cur_got = self._take(self._cur_dst, self._cur_got, tab_n)
            if got < tab_n:
                return NOTHING
            phase = self._start_pieces(n, tab_n)
            if phase is None:
                return NOTHING
        if phase == _V_DIRECT:
            do, ln, view = self._vdo, self._vln, self._cur_dst
            i, got = self._vi, self._cur_got
            while i < count:
                d, k = do[i], ln[i]
                got = self._take(view[d:d + k], got, k)
                if got < k:
                    self._vi, self._cur_got = i, got
                    return NOTHING
                i, got = i + 1, 0
        elif phase == _V_NATIVE:
            if not self._pieces_in_place():
                return NOTHING
        else:  # staged behind the table, or read past (dst None)
            dst = self._cur_dst
            got = self._cur_got = self._take(dst, self._cur_got, n)
            if got < n:
                return NOTHING
            if phase == _V_STAGED:
                do, ln = self._vdo, self._vln
                stage = np.frombuffer(dst, dtype=np.uint8)
                copy_pieces(np.frombuffer(self._vregion, dtype=np.uint8), stage,
                            np.cumsum(ln) - ln + tab_n, do, ln)
                self._vregion = None
        self._cur = None
        self._cur_dst = None
        self._cur_got = 0
        if self._cur_flags & PUTV_ACK:  # its pages were lent to the socket: say they are read (_pump)
            self._ack_read += 1
        note = self._putv_done(rid, nid, tag, phase != _V_SKIP)
        if note is not None:
            self._noteq.append(note)
            return NOTE
        return None

    def _start_pieces(self, n: int, tab_n: int) -> int | None:
        """The table is in: check it and choose how the pieces land (the phase), or None
        when the table breaks the link."""
        rid, count = self._cur[1], self._cur[3]
        table = np.frombuffer(self._cur_dst, dtype="<u8", count=2 * count).reshape(count, 2)
        do, ln = table[:, 0], table[:, 1]
        if int(ln.max()) > fr.MAX_FRAME_PAYLOAD or int(ln.sum()) != n - tab_n:
            self._bad_frame(WireError(f"PUTV frame of {n} bytes: its {count} pieces add up to {int(ln.sum())} "
                                      f"bytes, not the {n - tab_n} after the table"))
            self._cur = self._cur_dst = self._vspan = None
            return None
        entry = self._regions.get(rid)
        limit = 0 if entry is None else entry[0].nbytes
        self._cur_got = tab_n
        do, ln = do.astype(np.int64), ln.astype(np.int64)  # (an offset of 2**63 or more turns negative: refused)
        if entry is None or outside(do, ln, limit):
            self._puts_rejected += 1  # deregistered while the put was in flight, or a bad peer
            self._counters.errors += 1
            self._cur_dst = None
            self._vphase = _V_SKIP
            return _V_SKIP
        self._vlo, self._vhi = span(do, ln)
        if recv_pieces is not None and n - tab_n >= _NATIVE_PIECE * count:
            self._vdo, self._vln = do, ln
            self._vstate = np.zeros(2, dtype=np.int64)
            self._cur_dst = entry[1]
            self._vphase = _V_NATIVE
            return _V_NATIVE
        if n - tab_n >= _DIRECT_PIECE * count:
            self._vdo, self._vln = do.tolist(), ln.tolist()
            self._vi, self._cur_got = 0, 0
            self._cur_dst = entry[1]
            self._vphase = _V_DIRECT
            return _V_DIRECT
        self._vdo, self._vln = do, ln
        self._vregion = entry[1]  # (as a PUT's target: the region as it was when the frame began)
        stage = self._table_buffer(n)
        if stage.obj is not self._cur_dst.obj:  # a larger buffer: the table moves with it
            stage[:tab_n] = self._cur_dst
        self._cur_dst = stage
        self._vphase = _V_STAGED
        return _V_STAGED

    def _pieces_in_place(self) -> bool:
        """The pieces of the PUTV frame in progress, straight into the region: what was read
        ahead first, then the socket by the C loop (many pieces a recvmsg). True once all in."""
        do, ln, view, st = self._vdo, self._vln, self._cur_dst, self._vstate
        count = len(ln)
        rmv = self._rmv
        while self._rpos < self._rend and st[0] < count:
            i, got = int(st[0]), int(st[1])
            d, k = int(do[i]), int(ln[i])
            take = min(self._rend - self._rpos, k - got)
            view[d + got:d + got + take] = rmv[self._rpos:self._rpos + take]
            self._rpos += take
            st[0], st[1] = (i + 1, 0) if got + take == k else (i, got + take)
        if st[0] < count:
            try:
                # (spinning in C for the next segment while the frame is unfinished, as long as
                # a receive spins before it sleeps: not back through Python for each 64 KiB)
                k = recv_pieces(self._sock.fileno(), view, do, ln, st, self._pieces_spin_ns)
                if st[0] >= count:  # the next frame is likely one like it: read its head, not its pieces, ahead
                    self._ra_next = _HEAD_AHEAD
            except OSError as e:
                self._mark_dead(f"{os.strerror(e.errno) if e.errno else e} while receiving", e)
                return False
            if k < 0:
                self._mark_eof()
                return False
        return st[0] >= count

    def _putv_done(self, rid: int, nid: int, tag: bytes, ok: bool) -> Notification | None:
        """One PUTV frame landed (``ok``) or was refused: the put_many's Notification when
        this was its last frame and every frame of it landed, else None."""
        lo, hi = (self._vlo, self._vhi) if ok else (0, 0)
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

    def _acked_once(self):
        """For ``flush``: True once the peer has said it read every PUTV frame flagged ACK,
        None while not yet (frames read meanwhile are kept: messages and notifications queue)."""
        while self._ack_heard < self._ack_asked:
            if self._pump(None) == NOTHING:  # (it may have read the answer before it ran dry)
                return True if self._ack_heard >= self._ack_asked else None
        return True

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
