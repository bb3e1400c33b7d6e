"""``shm://name``: two processes on one host, a lock-free ring in shared memory per direction.

qlink's intra-node fast path (and its stand-in for NVLink / CUDA IPC on a CPU host).

* **Rendezvous.** ``listen("shm://name")`` binds a Unix-domain ``SOCK_SEQPACKET``
  socket ``<name>.sock`` in a private directory (``$QLINK_SHM_DIR``, else
  ``$XDG_RUNTIME_DIR/qlink``, else ``<tmp>/qlink-<uid>``; created 0700, socket 0600).
  ``connect`` creates one anonymous ``memfd`` holding both rings and both region
  tables, seals its size, and hands it over the socket (``SCM_RIGHTS``). No named
  shared-memory segment exists, so nothing outlives the two processes; a socket file
  left by a killed listener is reclaimed by the next ``listen`` on that name.
  (Seqpacket rather than stream: each control packet keeps its boundary and its fd.)
* **Rings.** One single-producer/single-consumer ring per direction
  (:mod:`transports._ring` has the layout). A message that fits one record is one
  memcpy in and one memcpy out; larger messages (up to 1 GiB) stream through the
  ring in chunks of at most 256 KiB. The C accelerator ``transports._ringc`` runs
  the hot path; without it the pure-Python ring (same bytes) is used.
* **Waiting.** Blocking calls busy-poll for ``spin_s`` (default 1 ms; in C when
  available; after 100 us also yielding the CPU, so two endpoints sharing a core still
  take turns), then sleep with exponential backoff up to 1 ms, each pause also polling the socket:
  a peer that dies (even by SIGKILL) is seen as EOF and reported as
  :class:`~qlink.errors.BrokenLinkError` within about a millisecond of the spin
  ending. An orderly ``close()`` also sets a flag in each ring's header; the peer
  still receives everything sent before the close, then gets ``BrokenLinkError``.
* **One-sided put.** ``register(array)`` publishes the region in this side's region
  table inside the shared memfd and, for :func:`qlink.memory.alloc` memory, hands its
  memfd to the peer over the socket. The initiator maps that memfd (else
  ``/proc/<pid>/fd/<n>``; either is checked against the inode the owner published) and a
  ``put`` is a single memcpy into the target's array followed by a ``PUT_DONE`` record
  (published with release ordering, so the notification is never seen before the bytes).
  Once a region is mapped, ``put`` / ``put_many`` run entirely in C (bounds check, memcpy,
  record) and so do ``wait_notification`` / ``poll_notification_nowait``. Any other host
  array is served by ``PUT_INLINE`` records the target applies while it progresses (in
  ``recv_into`` / ``wait_notification``); ``statistics().extra`` counts both kinds.
* **Vectored and deferred puts.** ``put_many`` writes many pieces of one buffer under ONE
  notification (``put_many_gathers``). With ``defer=True`` and a source in alloc() memory
  registered on the initiator, only the list of pieces goes through the ring (a
  ``PUT_PULL`` record): the target copies the pieces out of the initiator's memory while it
  progresses (streaming stores past 1 MiB), then publishes the put's sequence number in
  the ring header, which :meth:`ShmEndpoint.flush` waits for. Submitting costs the same
  however many bytes move; the bytes move on the target's CPU, which is waiting anyway.
* Messages and notifications share the ring; whichever one a call is not looking
  for is moved to a small queue on the receiving side, so nothing is lost.
* One thread may send/put while another receives; two threads must not send (or
  receive) on one endpoint at the same time.

>>> import os, numpy as np, transports
>>> from qlink.memory import alloc
>>> url = f"shm://doc-{os.getpid()}"
>>> with transports.listen(url) as lis:
...     a = transports.connect(url)
...     b = lis.accept(timeout_s=5)
...     a.send(b"syndrome")
...     got = b.recv(timeout_s=5)
...     target = alloc(8, dtype=np.uint8)
...     region = b.register(target)
...     a.put(b"\\x01\\x02", region.descriptor(), offset=3, notify_id=9)
...     note = b.wait_notification(timeout_s=5)
...     got, (note.offset, note.nbytes, note.notify_id), target.tolist()
(b'syndrome', (3, 2, 9), [0, 0, 0, 1, 2, 0, 0, 0])
>>> a.close(); b.close()
"""

from __future__ import annotations

import errno
import mmap
import operator
import os
import secrets
import select
import socket
import struct
import time
import weakref
from collections import deque
from dataclasses import replace

import numpy as np

from qlink.errors import (
    BrokenLinkError,
    CapabilityError,
    ClosedError,
    MissingDependencyError,
    QlinkTimeoutError,
    RingFullError,
    WouldBlock,
)
from qlink.memory import Region, RemoteRegion, as_byte_view

from . import _ring
from . import _shm_rendezvous as _rv
from ._base import MAX_TAG_BYTES, BufferTooSmallError, Capabilities, Endpoint, Listener, Notification, deadline_of
from ._base import check_notify_id as _check_notify_id
from ._base import check_tag as _check_tag
from ._pieces import check_pieces
from ._shm_regions import LocalRegions, PeerRegions
from ._shm_rendezvous import reclaim_after_exit, socket_dir
from ._ring import (
    KIND_CORRUPT,
    KIND_MSG,
    KIND_MSG_CONT,
    KIND_PUT_DONE,
    KIND_PUT_INLINE,
    KIND_PUT_PULL,
    RELEASED,
    SEND_OK,
    SEND_PEER_CLOSED,
    SEND_TOO_BIG,
)

try:
    from . import _ringc
except ImportError:  # the optional C accelerator was not built
    _ringc = None
if _ringc is not None and not all(hasattr(x, a) for x, a in ((_ringc, "set_stream_copy"), (_ringc, "make_note"),
                                                               (getattr(_ringc, "Ring", None), "set_pulled"))):
    _ringc = None  # built from an older source: the pure-Python ring until it is rebuilt

__all__ = [
    "CAPABILITIES",
    "listen",
    "connect",
    "socket_dir",
    "reclaim_after_exit",
    "ring_impls",
    "ShmEndpoint",
    "ShmListener",
    "DEFAULT_RING_NBYTES",
    "DEFAULT_SPIN_S",
]

CAPABILITIES = Capabilities(
    name="shm",
    one_sided=True,
    zero_copy_put=True,
    device_memory=False,
    cross_process=True,
    cross_host=False,
)

DEFAULT_RING_NBYTES = 8 << 20
DEFAULT_SPIN_S = 1e-3
# Polls per C call (~20 ns each): the first call of a receive spins ~10 us, which covers a
# prompt peer; after that the Python wait loop checks the deadline and yields the CPU
# between calls, so two endpoints that share one CPU still take turns.
_SPIN_ITERS = 500
_WAIT_SPIN_ITERS = 500
# Yield only after this long without progress: a yield hands the CPU to whatever else is
# runnable, and on a busy machine that costs a time slice; short waits (a streamed chunk,
# a prompt reply) should not pay it.
_YIELD_AFTER_S = 100e-6
_MIN_SLEEP_S = 5e-6
_MAX_SLEEP_S = 1e-3
_NOWAIT_SOCKET_CHECK_S = 1e-3
_PEER_CHECK_NS = 5_000_000  # a send or put that fits the ring still looks at the peer this often
_HANDSHAKE_TIMEOUT_S = 1.0

_DONE = struct.Struct("<IIQQQ")  # region_id, tag_len, offset, nbytes, notify_id (then the tag)
_INLINE = struct.Struct("<IIQ")  # region_id, reserved, offset (then the data)
# dst region, src region, pieces, tag_len, notify_id, seq, span offset, span nbytes, flags, reserved;
# then the tag, then pieces x (u64 src_off, u64 dst_off, u64 nbytes)
_PULL = struct.Struct("<IIIIQQQQII")
_PULL_LAST = 1
_PIECE_NBYTES = 24
_KEY = struct.Struct("<QB")  # connection token, owner side
_OFFER = struct.Struct("<8sI")  # a memfd for one of the sender's regions rides along (SCM_RIGHTS)
_OFFER_MAGIC = b"QLSHMFD1"


def ring_impls() -> list[str]:
    """Ring implementations available here: ``["c", "python"]`` or ``["python"]``."""
    return (["c"] if _ringc is not None else []) + ["python"]


def _ring_class(ring_impl: str | None):
    if ring_impl is None:
        return _ringc.Ring if _ringc is not None else _ring.Ring
    if ring_impl == "python":
        return _ring.Ring
    if ring_impl == "c":
        if _ringc is None:
            raise MissingDependencyError(
                "ring_impl='c' needs the C accelerator transports._ringc, which is not built here (or was built from "
                "an older source); build it with "
                "`python setup.py build_ext --inplace` (needs a C compiler) or pass ring_impl='python'"
            )
        return _ringc.Ring
    raise ValueError(f"ring_impl must be 'c', 'python' or None (best available), got {ring_impl!r}")


def _space_needed(head: int, ring_nbytes: int, payload_sizes) -> int:
    """Ring bytes (records, headers and pads) that writing these payloads from ``head`` takes."""
    total, pos = 0, head & (ring_nbytes - 1)
    for n in payload_sizes:
        need = _ring.RECORD_HEADER_NBYTES + ((n + 15) & ~15)
        if need > ring_nbytes - pos:
            total += ring_nbytes - pos
            pos = 0
        total += need
        pos = (pos + need) & (ring_nbytes - 1)
    return total


def _note(region_id: int, offset: int, nbytes: int, notify_id: int, tag: bytes) -> Notification:
    """A Notification without the frozen-dataclass __init__ (~1.5 us: one setattr per field):
    one dict update on a fresh instance, which is what __init__ leaves behind."""
    note = object.__new__(Notification)
    note.__dict__.update(region_id=region_id, offset=offset, nbytes=nbytes, notify_id=notify_id, tag=tag)
    return note


def _check_note_shortcut() -> None:
    global _note
    probe = dict(region_id=1, offset=2, nbytes=3, notify_id=4, tag=b"t")
    try:
        ok = _note(**probe) == Notification(**probe)
    except (AttributeError, TypeError):
        ok = False
    if not ok:  # pragma: no cover - Notification changed shape (slots, new fields): use its constructor
        def _note(region_id, offset, nbytes, notify_id, tag):
            return Notification(region_id=region_id, offset=offset, nbytes=nbytes, notify_id=notify_id, tag=tag)


_check_note_shortcut()


def _c_notes_match() -> bool:
    """The C fast path builds Notifications without their ``__init__`` (like :func:`_note`);
    it runs only when what it builds equals what the constructor builds."""
    if _ringc is None or not hasattr(_ringc, "make_note"):  # not built, or built from an older source
        return False
    probe = dict(region_id=1, offset=2, nbytes=3, notify_id=(1 << 64) - 1, tag=b"t")
    try:
        made, ref = _ringc.make_note(Notification, *probe.values()), Notification(**probe)
        return made == ref and hash(made) == hash(ref) and repr(made) == repr(ref)
    except (AttributeError, TypeError):  # pragma: no cover - Notification changed shape
        return False


_C_NOTES = _c_notes_match()




# ----------------------------------------------------------------------------- waiting


class _Wait:
    """Deadline; busy-poll, then also yield the CPU, then sleep doubling to 1 ms while
    polling the peer's socket. ``progressed()`` starts the phases over."""

    __slots__ = ("ep", "what", "timeout_s", "deadline", "yield_after", "spin_until", "sleep_s")

    def __init__(self, ep: "ShmEndpoint", what: str, timeout_s: float | None) -> None:
        self.ep = ep
        self.what = what
        self.timeout_s = timeout_s
        self.deadline = deadline_of(timeout_s)
        self.progressed()

    def progressed(self) -> None:
        now = time.monotonic()
        self.yield_after = now + _YIELD_AFTER_S
        self.spin_until = now + self.ep._spin_s
        self.sleep_s = _MIN_SLEEP_S

    def pause(self) -> None:
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            raise self.ep._timed_out(self.what, self.timeout_s)
        if now < self.spin_until:
            if now >= self.yield_after:
                # still busy-polling, but let a runnable process sharing this CPU (perhaps the
                # peer itself, on a machine with few cores) run instead of spinning against it
                os.sched_yield()
            return
        self.ep._poll_socket()
        if self.ep._peer_gone is not None:
            return  # the caller sees it and raises once nothing is left to deliver
        sleep_s = self.sleep_s if self.deadline is None else min(self.sleep_s, self.deadline - now)
        time.sleep(sleep_s)
        self.sleep_s = min(self.sleep_s * 2, _MAX_SLEEP_S)


# ----------------------------------------------------------------------------- endpoint


class ShmEndpoint(Endpoint):
    """One side of an ``shm://`` connection (made by :func:`connect` or ``accept``)."""

    capabilities = CAPABILITIES
    put_many_gathers = True  # one Notification per put_many, after every piece

    def __init__(self, *, url: str, sock: socket.socket, mm: mmap.mmap, side: int, ring_nbytes: int, token: int,
                 ring_cls, spin_s: float) -> None:
        super().__init__()
        self.url = url
        self._sock = sock
        self._mm = mm
        self._side = side
        self._spin_s = float(spin_s)
        whole = memoryview(mm)
        region = _ring.ring_region_nbytes(ring_nbytes)
        tx_off, rx_off = _rv.ring_offset(side, ring_nbytes), _rv.ring_offset(1 - side, ring_nbytes)
        self._tx = ring_cls(whole[tx_off:tx_off + region])
        self._rx = ring_cls(whole[rx_off:rx_off + region])
        whole.release()
        self._rx_data = self._rx.data
        tables = memoryview(mm)[_rv.table_offset(0, ring_nbytes):_rv.table_offset(2, ring_nbytes)].cast("Q")
        half = len(tables) // 2
        self._x = dict(zero_copy_puts=0, inline_puts=0, gathered_puts=0, deferred_puts=0, pulled_bytes=0,
                       queued_messages=0, aborted_messages=0, bad_records=0, zero_copy_unavailable=0)
        self._pull_seq = 0  # deferred puts posted; the peer publishes the last one it pulled in the ring header
        self._local = LocalRegions(tables[side * half:(side + 1) * half], key=_KEY.pack(token, side))
        self._peer = PeerRegions(tables[(1 - side) * half:(2 - side) * half], key=_KEY.pack(token, 1 - side),
                                 counters=self._x)
        self._tables = tables
        me = weakref.ref(self)  # no reference cycle: a dropped endpoint is freed (its socket closed) at once

        def collect_offers() -> None:
            ep = me()
            if ep is not None:
                ep._drain_socket()

        self._peer.before_map = collect_offers
        self._clean = True  # no queued message and no half-received one: the fast path may run
        self._msgq: deque = deque()  # whole messages moved aside (oldest first)
        self._notes: deque = deque()  # notifications moved aside
        self._partial: bytearray | None = None  # a streamed message being received off the fast path
        self._partial_filled = 0
        self._gone: str | None = None
        self._sock_eof = False
        self._peer_cause: BaseException | None = None
        self._last_socket_check = 0.0
        self._next_peer_check_ns = 0
        # the hot paths call these bound methods directly
        self._send_msg = self._tx.try_send_msg
        self._try_recv = self._rx.try_recv
        self._fast = None
        if _ringc is not None and ring_cls is _ringc.Ring:
            # send / recv_into entirely in C when the ring can serve them, else our _*_slow methods
            self._fast = fp = _ringc.FastPath(self._tx, self._rx, self, ShmEndpoint._send_slow, ShmEndpoint._recv_slow,
                                              _SPIN_ITERS)
            self.send, self.send_nowait = fp.send, fp.send_nowait
            self.recv_into, self.recv_into_nowait = fp.recv_into, fp.recv_into_nowait
            if _C_NOTES:
                # put / put_many / notifications in C once a region is mapped, else the Python methods
                fp.enable_one_sided(self._peer.words, self._local.c_table, Notification, self._notes, ShmEndpoint.put,
                                    ShmEndpoint.put_many, ShmEndpoint.wait_notification,
                                    ShmEndpoint.poll_notification_nowait, ShmEndpoint._finish_put)
                self._peer.on_unmap = fp.forget_remote
                self.put, self.put_many = fp.put, fp.put_many
                self.wait_notification, self.poll_notification_nowait = fp.wait_notification, fp.poll_notification_nowait

    def native_rings(self):
        """``(tx, rx)``: this endpoint's C rings, for native code that moves whole messages
        through them with the ring's C API (``transports/_ring_api.h``; qlink's QEC hot
        path). The caller must not use this endpoint's own send/receive meanwhile.

        Raises :class:`~qlink.errors.CapabilityError` where the rings are the pure-Python
        ones (the C accelerator is not built) or a message is already queued aside on
        the Python side (it would be skipped).
        """
        if _ringc is None or not isinstance(self._tx, _ringc.Ring):
            raise CapabilityError("native_rings() needs the C ring (transports._ringc), which this endpoint does not "
                                  "use: build it with 'python setup.py build_ext --inplace' or reinstall qlink")
        if not self._rx_clean:
            raise CapabilityError("native_rings(): a message is queued aside on the Python side; receive it first")
        if self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        return self._tx, self._rx

    def check_peer(self) -> None:
        """Look at the peer now: raise :class:`~qlink.errors.BrokenLinkError` when it is gone
        (for native code driving :meth:`native_rings`, which sees only the rings' flags, not
        a peer that died without closing)."""
        if self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        self._poll_socket()
        if self._peer_flags() is not None:
            raise self._broken("peer check")

    def __repr__(self) -> str:
        return f"<ShmEndpoint {self.url} side={self._side} ring={self._tx.impl} {'closed' if self._closed else 'open'}>"

    @property
    def _peer_gone(self) -> str | None:
        """Why the peer is gone (None while it is there); setting it also stops the C put path."""
        return self._gone

    @_peer_gone.setter
    def _peer_gone(self, why: str | None) -> None:
        self._gone = why
        if self._fast is not None:
            self._fast.peer_gone = why is not None

    def statistics(self):
        s = super().statistics()
        tx, rx = self._tx, self._rx
        x = dict(self._x)
        if self._fast is not None:
            puts, put_bytes, zc, gathered, notes, pulled, deferred = self._fast.counters()
            x["zero_copy_puts"] += zc
            x["gathered_puts"] += gathered
            x["pulled_bytes"] += pulled
            x["deferred_puts"] += deferred
            s = replace(s, puts=s.puts + puts, put_bytes=s.put_bytes + put_bytes,
                        notifications=s.notifications + notes)
        return replace(
            s,
            messages_sent=s.messages_sent + tx.messages,
            bytes_sent=s.bytes_sent + tx.message_bytes,
            messages_received=s.messages_received + rx.messages,
            bytes_received=s.bytes_received + rx.message_bytes,
            extra={"ring_impl": tx.impl, "ring_nbytes": tx.nbytes, "spin_s": self._spin_s, **x},
        )

    # ----- peer state -------------------------------------------------------------
    def _peer_flags(self) -> str | None:
        if self._peer_gone is None and (self._rx.producer_closed or self._tx.consumer_closed):
            self._peer_gone = "the peer closed its endpoint"
        return self._peer_gone

    def _look_at_peer(self) -> None:
        """Poll the peer's socket if it was not looked at in the last millisecond: a send or
        put that fits the ring still learns of a dead peer (the C path routes a call here at
        most every 5 ms; the Python path does the same through ``_next_peer_check``)."""
        if self._peer_gone is None and time.monotonic() - self._last_socket_check > _NOWAIT_SOCKET_CHECK_S:
            self._poll_socket()

    def _poll_socket(self) -> None:
        """Non-blocking look at the connection socket: EOF or a reset means the peer is gone."""
        self._last_socket_check = time.monotonic()
        if self._peer_gone is not None or self._closed:
            return
        self._drain_socket()

    def _drain_socket(self) -> None:
        """Read what the peer sent on the connection socket: memfds of regions it registered
        (kept for mapping them), then EOF or an error once it is gone."""
        if self._closed or self._sock_eof:
            return
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self._sock, 64, 4, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._sock_eof = True
                if self._peer_gone is None:
                    self._peer_cause = e
                    self._peer_gone = (f"the connection to the peer failed ({e.strerror or e}); "
                                       "the peer process probably died")
                    self._tx.set_consumer_closed()
                return
            if not msg and not fds:
                self._sock_eof = True
                if self._peer_flags() is None:
                    self._peer_cause = EOFError("EOF on the shm connection socket")
                    self._peer_gone = ("the peer's endpoint went away without close() "
                                       "(its process exited or was killed, or it dropped the endpoint)")
                    self._tx.set_consumer_closed()  # the peer will never read again: sends now fail fast, even in C
                return
            if len(msg) == _OFFER.size and len(fds) == 1 and msg[:8] == _OFFER_MAGIC:
                self._peer.offer_fd(_OFFER.unpack(msg)[1], fds[0])
            else:  # nothing else is ever sent after the handshake: drop and count
                for fd in fds:
                    os.close(fd)
                self._x["bad_records"] += 1

    def _broken(self, what: str) -> BrokenLinkError:
        self._counters.errors += 1
        err = BrokenLinkError(f"{self.url}: {what}: {self._peer_gone}")
        err.__cause__ = self._peer_cause
        return err

    def _check_send_code(self, r: int, what: str) -> None:
        if r == RELEASED or self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        if r == SEND_PEER_CLOSED:
            self._peer_flags()
            raise self._broken(what)

    # ----- two-sided: send ----------------------------------------------------------
    def send(self, data, *, timeout_s: float | None = None) -> None:
        """Send one message; waits (up to ``timeout_s``) while the ring is full. Messages
        larger than one record stream through the ring while the peer drains it."""
        if timeout_s is not None and not timeout_s >= 0:
            deadline_of(timeout_s)  # raises ValueError
        if self._peer_check_due() or self._send_msg(data) != SEND_OK:
            self._send_slow(data, timeout_s, False)

    def send_nowait(self, data) -> None:
        """Send one message now or raise RingFullError having sent nothing."""
        if self._peer_check_due() or self._send_msg(data) != SEND_OK:
            self._send_slow(data, None, True)

    def _peer_check_due(self) -> bool:
        """(Python ring path; the C path keeps its own clock.) True at most every 5 ms."""
        now = time.monotonic_ns()
        if now < self._next_peer_check_ns:
            return False
        self._next_peer_check_ns = now + _PEER_CHECK_NS
        return True

    def _send_slow(self, data, timeout_s: float | None, nowait: bool) -> None:
        self._check_open()
        mv = as_byte_view(data)
        n = len(mv)
        if n > CAPABILITIES.max_message_bytes:
            raise ValueError(f"message of {n} bytes exceeds max_message_bytes={CAPABILITIES.max_message_bytes}")
        self._look_at_peer()
        if self._peer_flags() is not None:
            raise self._broken("send")
        tx = self._tx
        if n <= tx.max_payload:
            w = None
            while True:
                r = self._send_msg(mv)
                if r == SEND_OK:
                    return
                self._check_send_code(r, "send")
                if nowait:
                    self._nowait_check("send")
                    raise RingFullError(f"shm ring to the peer is full ({tx.free_nbytes()} of {tx.nbytes} bytes free); "
                                        "nothing was sent, retry once the peer has received")
                if self._peer_gone is not None:
                    raise self._broken("send")
                if w is None:
                    w = _Wait(self, "send", timeout_s)
                w.pause()
        if nowait:
            self._send_whole_nowait(mv)
        else:
            self._stream(mv, timeout_s)
        self._counters.messages_sent += 1
        self._counters.bytes_sent += n

    def _chunks(self, total: int):
        step = self._tx.max_payload
        return [(off, min(step, total - off)) for off in range(0, total, step)]

    def _send_whole_nowait(self, mv: memoryview) -> None:
        tx = self._tx
        chunks = self._chunks(len(mv))
        need = _space_needed(tx.producer_head, tx.nbytes, [c for _, c in chunks])
        if need > tx.nbytes:
            raise RingFullError(
                f"message of {len(mv)} bytes needs {need} bytes of ring but the ring holds {tx.nbytes}; send_nowait "
                "cannot take it in one go: use send(), which streams it, or connect with a larger ring_nbytes"
            )
        if tx.free_nbytes() < need:
            self._nowait_check("send")
            raise RingFullError(f"shm ring to the peer has {tx.free_nbytes()} bytes free, the message needs {need}; "
                                "nothing was sent, retry once the peer has received")
        for off, c in chunks:
            r = tx.try_send(KIND_MSG if off == 0 else KIND_MSG_CONT, len(mv) if off == 0 else off, mv[off:off + c])
            if r != SEND_OK:  # only a concurrent close can get here: the space was checked
                self._check_send_code(r, "send")
                raise RuntimeError(f"shm ring refused a record after its space was checked (code {r})")

    def _stream(self, mv: memoryview, timeout_s: float | None) -> None:
        tx = self._tx
        total = len(mv)
        w = _Wait(self, "send", timeout_s)
        chunks = self._chunks(total)
        i = 0
        try:
            while i < len(chunks):
                off, c = chunks[i]
                r = tx.try_send(KIND_MSG if i == 0 else KIND_MSG_CONT, total if i == 0 else off, mv[off:off + c])
                if r == SEND_OK:
                    i += 1
                    w.progressed()
                    continue
                self._check_send_code(r, "send")
                if self._peer_gone is not None:
                    raise self._broken("send")
                w.pause()
        except BaseException:
            if i:  # the receiver drops the part that went out when the next message starts
                self._x["aborted_messages"] += 1
            raise

    # ----- two-sided: receive ---------------------------------------------------------
    def recv_into(self, buf, *, timeout_s: float | None = None) -> int:
        """Receive the next message into ``buf``; return its size in bytes."""
        if timeout_s is not None and not timeout_s >= 0:
            deadline_of(timeout_s)
        if self._clean:
            n = self._try_recv(buf, _SPIN_ITERS)
            if n >= 0:
                return n
        return self._recv_slow(buf, timeout_s, False)

    def recv_into_nowait(self, buf) -> int:
        """Receive the next message if one is ready, else raise WouldBlock."""
        if self._clean:
            n = self._try_recv(buf, 0)
            if n >= 0:
                return n
        return self._recv_slow(buf, None, True)

    @property
    def _rx_clean(self) -> bool:
        return self._clean

    @_rx_clean.setter
    def _rx_clean(self, value: bool) -> None:
        self._clean = value
        if self._fast is not None:
            self._fast.rx_clean = value

    def _set_clean(self) -> None:
        self._rx_clean = not self._msgq and self._partial is None

    def _recv_slow(self, buf, timeout_s: float | None, nowait: bool) -> int:
        self._check_open()
        out = as_byte_view(buf)
        if out.readonly:
            raise TypeError("recv_into needs a writable buffer (bytearray, numpy array...), got a read-only one")
        w = None
        rx = self._rx
        while True:
            if self._msgq:
                n = self._deliver_queued(self._msgq, out)
                self._set_clean()
                return n
            rec = rx.peek()
            if rec is None:
                w = self._idle(w, "recv_into", timeout_s, nowait)
                continue
            kind, n, aux, off = rec
            if kind == KIND_MSG and self._partial is None:
                if aux > len(out):
                    raise BufferTooSmallError(
                        f"next shm message is {aux} bytes but the buffer holds {len(out)}; the message stays "
                        f"queued, call again with a buffer of at least {aux} bytes",
                        needed_nbytes=aux,
                    )
                out[:n] = self._rx_data[off:off + n]
                rx.consume()
                if n == aux:
                    self._counters.messages_received += 1
                    self._counters.bytes_received += n
                    return n
                got = self._recv_rest(out, aux, n, w, timeout_s, nowait)
                if got is not None:
                    return got
            elif kind in (KIND_MSG, KIND_MSG_CONT):
                self._stash(kind, n, aux, off)
            else:
                self._side_record(kind, n, aux, off)
                if nowait and self._notes:
                    # a put completed on the way to the message: hand control back so the caller
                    # sees that completion now, not after every put queued before the message
                    raise WouldBlock("shm: a put completed before the next message; poll its notification, "
                                     "then receive again")

    def _recv_rest(self, out: memoryview, total: int, filled: int, w, timeout_s, nowait) -> int | None:
        """Receive the later chunks of a streamed message straight into the caller's buffer."""
        rx, data = self._rx, self._rx_data
        while filled < total:
            rec = rx.peek()
            if rec is None:
                try:
                    w = self._idle(w, "recv_into", timeout_s, nowait, mid_message=True)
                except (QlinkTimeoutError, WouldBlock):  # keep what arrived; the next call goes on from here
                    self._partial = bytearray(total)
                    self._partial[:filled] = out[:filled]
                    self._partial_filled = filled
                    self._rx_clean = False
                    raise
                continue
            kind, n, aux, off = rec
            if kind == KIND_MSG_CONT:
                if aux != filled or n > total - filled:
                    self._x["bad_records"] += 1
                    self._counters.errors += 1
                else:
                    out[filled:filled + n] = data[off:off + n]
                    filled += n
                rx.consume()
            elif kind == KIND_MSG:  # the sender gave up on this message (its send timed out)
                self._x["aborted_messages"] += 1
                return None
            else:
                self._side_record(kind, n, aux, off)
        self._counters.messages_received += 1
        self._counters.bytes_received += total
        return total

    def _stash(self, kind: int, n: int, aux: int, off: int) -> None:
        """Move a message record off the ring into the receive-side queue."""
        data = self._rx_data
        if kind == KIND_MSG:
            if self._partial is not None:
                self._x["aborted_messages"] += 1
                self._partial = None
            if n == aux:
                self._msgq.append(bytes(data[off:off + n]))
                self._x["queued_messages"] += 1
            else:
                self._partial = bytearray(aux)
                self._partial[:n] = data[off:off + n]
                self._partial_filled = n
        else:  # KIND_MSG_CONT
            p = self._partial
            if p is None or aux != self._partial_filled or n > len(p) - aux:
                self._x["bad_records"] += 1
                self._counters.errors += 1
            else:
                p[aux:aux + n] = data[off:off + n]
                self._partial_filled += n
                if self._partial_filled == len(p):
                    self._msgq.append(p)
                    self._x["queued_messages"] += 1
                    self._partial = None
        self._rx.consume()
        self._set_clean()

    def _nowait_check(self, what: str) -> None:
        """In a ``*_nowait`` call that found nothing: look at the socket at most every millisecond."""
        self._look_at_peer()
        if self._peer_flags() is not None and what == "send":
            raise self._broken(what)

    def _idle(self, w, what: str, timeout_s, nowait: bool, *, mid_message: bool = False):
        """Nothing to read: spin, back off, or raise (closed, broken, timed out, would block)."""
        if self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        if self._rx.poll(_WAIT_SPIN_ITERS if (w is not None or mid_message) else 0):
            return w
        if nowait:
            self._nowait_check(what)
        if self._peer_flags() is not None:
            if not self._rx.poll(0):  # everything sent before the peer went away has been delivered
                if mid_message:
                    self._peer_gone += " in the middle of a message"
                raise self._broken(what)
            return w
        if nowait:
            raise WouldBlock(f"shm: nothing for {what} has arrived yet")
        if w is None:
            w = _Wait(self, what, timeout_s)
        w.pause()
        return w

    # ----- records other than messages ---------------------------------------------------
    def _take_put_done(self, n: int, off: int) -> Notification | None:
        """Consume the PUT_DONE record at the head of the ring; its Notification, or None if bad."""
        note = None
        if n >= _DONE.size:
            data = self._rx_data
            rid, tag_len, offset, nbytes, notify_id = _DONE.unpack_from(data, off)
            entry = self._local.get(rid)
            if _DONE.size + tag_len == n and entry is not None and offset + nbytes <= entry[0].nbytes:
                note = _note(rid, offset, nbytes, notify_id, bytes(data[off + _DONE.size:off + n]) if tag_len else b"")
        if note is None:  # not a put into a region registered here (deregistered meanwhile?)
            self._x["bad_records"] += 1
            self._counters.errors += 1
        self._rx.consume()
        return note

    def _apply_pull(self, n: int, off: int) -> Notification | None:
        """Copy the pieces of the PUT_PULL record at the head of the ring out of the peer's
        region into ours, consume it; the Notification when it was the put's last record."""
        data, note, ok, seq, last = self._rx_data, None, False, 0, False
        if n >= _PULL.size:
            dst_rid, src_rid, k, tag_len, nid, seq, span_off, span_n, flags, _ = _PULL.unpack_from(data, off)
            last = bool(flags & _PULL_LAST)
            entry = self._local.get(dst_rid)
            source = self._peer.source(src_rid)
            if (tag_len <= MAX_TAG_BYTES and _PULL.size + tag_len + k * _PIECE_NBYTES == n and entry is not None
                    and source is not None):
                dview, (state, sview) = entry[1], source
                at = off + _PULL.size + tag_len
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
                        tag = bytes(data[off + _PULL.size:off + _PULL.size + tag_len]) if tag_len else b""
                        note = _note(dst_rid, span_off, span_n, nid, tag)
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
            if n >= _INLINE.size:
                rid, _, offset = _INLINE.unpack_from(data, off)
                entry = self._local.get(rid)
                c = n - _INLINE.size
                if entry is not None and offset + c <= entry[0].nbytes:
                    entry[1][offset:offset + c] = data[off + _INLINE.size:off + n]
                    ok = True
            if not ok:
                self._x["bad_records"] += 1
                self._counters.errors += 1
            rx.consume()
        elif kind == KIND_PUT_PULL:
            done = self._fast.pull_head() if self._fast is not None and _C_NOTES else None
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
                socket.send_fds(self._sock, [_OFFER.pack(_OFFER_MAGIC, region.region_id)], [fd], socket.MSG_DONTWAIT)
            except OSError:
                pass  # the peer maps it through /proc instead
        return region

    def deregister(self, region: Region) -> None:
        """Forget a region; later puts into it raise RegistrationError on the initiator."""
        self._local.deregister(region, publish=not self._closed)

    def put(self, data, remote: RemoteRegion, *, offset: int = 0, notify_id: int = 0, tag: bytes = b"",
            timeout_s: float | None = None) -> None:
        """Write ``data`` into the peer's region at ``offset``; the peer then gets a Notification.

        Validation failures (unknown region, out of range) raise RegistrationError
        before anything is written.
        """
        if self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        if timeout_s is not None and not timeout_s >= 0:
            deadline_of(timeout_s)
        if not isinstance(remote, RemoteRegion):
            remote = RemoteRegion.from_bytes(remote)
        if type(offset) is not int:
            offset = operator.index(offset)
        tag = _check_tag(tag)
        notify_id = _check_notify_id(notify_id)
        try:
            src = memoryview(data)
        except TypeError:
            src = None
        if src is None or src.format != "B" or src.ndim != 1 or not src.c_contiguous:
            src = as_byte_view(data)  # casts, or says what is wrong with the buffer
        n = len(src)
        state, _, dst = self._peer.entry(remote, offset=offset, nbytes=n)  # raises before anything is written
        self._look_at_peer()
        if self._peer_gone is not None or self._tx.consumer_closed:
            self._peer_flags()
            raise self._broken("put")  # never write into memory the peer may have moved on from
        rid = remote.region_id
        w = None
        if dst is not None:
            if n:
                dst[offset:offset + n] = src
            self._x["zero_copy_puts"] += 1
            if self._fast is not None:
                self._fast.cache_remote(remote, rid, state, len(dst), dst)  # later puts into it run in C
        else:
            w = _Wait(self, "put", timeout_s)
            self._put_inline(rid, src, offset, w)
            self._x["inline_puts"] += 1
        self._finish_put(_DONE.pack(rid, len(tag), offset, n, notify_id), tag, timeout_s, w)
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
        if self._closed:
            raise ClosedError(f"shm endpoint {self.url} was closed by this side")
        if timeout_s is not None and not timeout_s >= 0:
            deadline_of(timeout_s)
        if not isinstance(remote, RemoteRegion):
            remote = RemoteRegion.from_bytes(remote)
        tag = _check_tag(tag)
        notify_id = _check_notify_id(notify_id)
        src = as_byte_view(data)
        so, do, ln = check_pieces(src_offsets, dst_offsets, nbytes, src_nbytes=len(src), region_nbytes=remote.nbytes,
                                  region_id=remote.region_id)
        lo, hi = int(do.min()), int((do + ln).max())
        state, region_nbytes, dst = self._peer.entry(remote, offset=lo, nbytes=hi - lo)
        self._look_at_peer()
        if self._peer_gone is not None or self._tx.consumer_closed:
            self._peer_flags()
            raise self._broken("put_many")
        rid = remote.region_id
        if self._fast is not None:
            self._fast.cache_remote(remote, rid, state, region_nbytes, dst)  # later put_many into it run in C
        if defer and len(src) and self._tx.max_payload - _PULL.size - len(tag) >= _PIECE_NBYTES:
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
            w = _Wait(self, "put_many", timeout_s)
            for s, d, n in pieces:
                self._put_inline(rid, src[s:s + n], d, w)
            self._x["inline_puts"] += len(ln)
        self._finish_put(_DONE.pack(rid, len(tag), lo, hi - lo, notify_id), tag, timeout_s, w)
        self._x["gathered_puts"] += 1
        self._counters.puts += len(ln)
        self._counters.put_bytes += int(ln.sum())
        return 1

    def _post_pull(self, home: tuple[int, int], rid: int, so, do, ln, lo: int, hi: int, notify_id: int, tag: bytes,
                   timeout_s: float | None) -> None:
        """PUT_PULL records naming the pieces; the target copies them out of our region ``home``."""
        src_rid, base = home
        pieces = np.empty((len(ln), 3), dtype="<u8")
        pieces[:, 0], pieces[:, 1], pieces[:, 2] = so + base, do, ln
        per_record = (self._tx.max_payload - _PULL.size - len(tag)) // _PIECE_NBYTES
        seq, w = self._next_pull_seq(), None
        for start in range(0, len(pieces), per_record):
            part = pieces[start:start + per_record]
            last = start + per_record >= len(pieces)
            head = _PULL.pack(rid, src_rid, len(part), len(tag), notify_id, seq, lo, hi - lo,
                              _PULL_LAST if last else 0, 0) + tag
            body = memoryview(part).cast("B")
            if self._tx.try_send(KIND_PUT_PULL, 0, head, body) != SEND_OK:
                w = w or _Wait(self, "put_many", timeout_s)
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
                w = _Wait(self, "flush", timeout_s)
            w.pause()

    def _put_inline(self, rid: int, src: memoryview, offset: int, w: "_Wait") -> None:
        """PUT_INLINE records carrying ``src`` for the target to apply at ``offset``."""
        n = len(src)
        step = self._tx.max_payload - _INLINE.size
        for pos in range(0, n, step):
            c = min(step, n - pos)
            self._send_record(KIND_PUT_INLINE, _INLINE.pack(rid, 0, offset + pos), src[pos:pos + c], w, "put")

    def _finish_put(self, done: bytes, tag: bytes, timeout_s: float | None, w: "_Wait | None" = None) -> None:
        """Publish a put's PUT_DONE record, waiting (up to ``timeout_s``) while the ring is full."""
        if self._tx.try_send(KIND_PUT_DONE, 0, done, tag) != SEND_OK:
            self._send_record(KIND_PUT_DONE, done, tag, w or _Wait(self, "put", timeout_s), "put")

    def _send_record(self, kind: int, part1, part2, w: _Wait, what: str) -> None:
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

    # ----- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Close this side: the peer receives what was already sent, then BrokenLinkError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._tx.set_producer_closed()
        self._rx.set_consumer_closed()
        self._tx.release()
        self._rx.release()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._fast is not None:
            self._fast.disable_one_sided()  # drops its mappings and table views before they go
        self._peer.close()
        self._local.clear()
        self._msgq.clear()
        self._partial = None
        self._tables.release()
        self._rx_data = None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


# ----------------------------------------------------------------------------- listener


class ShmListener(Listener):
    """Accepts ``shm://name`` connections from processes of the same user on this host."""

    def __init__(self, *, name: str, path: str, sock: socket.socket, ring_impl: str | None, spin_s: float) -> None:
        self.name = name
        self.url = f"shm://{name}"
        self.path = path
        self._sock = sock
        st = os.stat(path)
        self._ring_cls = _ring_class(ring_impl)
        self._spin_s = spin_s
        self._closed = False
        self.rejected = 0  # connections dropped during the handshake (bad hello, other user, probe)
        # also run when the listener is dropped without close(), or at interpreter exit
        self._release = weakref.finalize(self, _release_listener, sock, path, (st.st_dev, st.st_ino))

    def __repr__(self) -> str:
        return f"<ShmListener {self.url} {'closed' if self._closed else 'listening'}>"

    def accept(self, *, timeout_s: float | None = None) -> ShmEndpoint:
        """Wait for the next peer and return its connected endpoint."""
        deadline = deadline_of(timeout_s)
        while True:
            if self._closed:
                raise ClosedError(f"shm listener {self.url} was closed by this side")
            tick = 0.05
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QlinkTimeoutError(f"shm: no connection to {self.url} within timeout_s={timeout_s}")
                tick = min(tick, left)
            try:
                ready, _, _ = select.select([self._sock], [], [], tick)
            except (OSError, ValueError):
                if self._closed:
                    raise ClosedError(f"shm listener {self.url} was closed by this side") from None
                raise
            if not ready:
                continue
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            ep = self._handshake(conn)
            if ep is not None:
                return ep

    def _handshake(self, conn: socket.socket) -> ShmEndpoint | None:
        fds: list[int] = []
        mm = None
        try:
            conn.settimeout(_HANDSHAKE_TIMEOUT_S)
            if _rv.peer_uid(conn) != os.getuid():
                raise PermissionError("peer runs as another user")
            msg, fds, _, _ = socket.recv_fds(conn, 256, 4)
            if len(msg) != _rv.CONN.size or len(fds) != 1:
                raise ValueError("not a qlink shm hello")
            magic, version, slots, ring_nbytes, token = _rv.CONN.unpack(msg)
            if magic != _rv.HELLO_MAGIC or version != _rv.VERSION or slots != _rv.TABLE_SLOTS:
                raise ValueError("hello from an incompatible qlink shm version")
            _ring.ring_region_nbytes(ring_nbytes)  # validates the size
            fd = fds[0]
            total = _rv.layout_nbytes(ring_nbytes)
            if os.fstat(fd).st_size != total:
                raise ValueError("shared memory has the wrong size")
            if not _rv.is_sealed(fd):
                raise ValueError("shared memory is not sealed against shrinking")
            mm = mmap.mmap(fd, total, flags=_rv.MAP_FLAGS)
            if _rv.CONN.unpack_from(mm, 0) != (_rv.CONN_MAGIC, _rv.VERSION, _rv.TABLE_SLOTS, ring_nbytes, token):
                raise ValueError("shared memory header does not match the hello")
            conn.setblocking(False)
            ep = ShmEndpoint(url=self.url, sock=conn, mm=mm, side=1, ring_nbytes=ring_nbytes, token=token,
                             ring_cls=self._ring_cls, spin_s=self._spin_s)
            mm = None
            return ep
        except (OSError, ValueError, struct.error):
            self.rejected += 1
            conn.close()
            return None
        finally:
            for fd in fds:
                os.close(fd)
            if mm is not None:
                mm.close()

    def close(self) -> None:
        """Stop listening and remove the socket file. Idempotent."""
        self._closed = True
        self._release()


def _release_listener(sock: socket.socket, path: str, identity: tuple[int, int]) -> None:
    sock.close()
    try:
        st = os.stat(path)
        if (st.st_dev, st.st_ino) == identity:  # not a newer listener's socket
            os.unlink(path)
    except OSError:
        pass


def listen(url: str, *, ring_impl: str | None = None, spin_s: float = DEFAULT_SPIN_S, backlog: int = 64) -> ShmListener:
    """Listen on ``shm://name``. ``ring_impl`` ('c', 'python' or None for the best
    available) and ``spin_s`` (busy-poll time before backing off) apply to accepted endpoints."""
    name = _rv.name_of(url)
    _ring_class(ring_impl)
    if not spin_s >= 0:
        raise ValueError(f"spin_s must be a non-negative number of seconds, got {spin_s!r}")
    path = _rv.socket_path(name, create=True)
    _rv.reclaim_stale(path, url)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        old_umask = os.umask(0o177)  # the socket file is created 0600
        try:
            sock.bind(path)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        sock.listen(backlog)
        sock.setblocking(False)
        return ShmListener(name=name, path=path, sock=sock, ring_impl=ring_impl, spin_s=spin_s)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(errno.EADDRINUSE, f"{url} is already listening (socket {path})") from e
        raise


def connect(url: str, *, timeout_s: float | None = 10.0, ring_nbytes: int = DEFAULT_RING_NBYTES,
            ring_impl: str | None = None, spin_s: float = DEFAULT_SPIN_S) -> ShmEndpoint:
    """Connect to ``shm://name``; BrokenLinkError if nobody listens there.

    ``ring_nbytes`` (a power of two, 1 KiB .. 1 GiB) sizes both rings of the connection;
    messages larger than a ring still pass, streamed through it.
    """
    deadline_of(timeout_s)
    name = _rv.name_of(url)
    ring_cls = _ring_class(ring_impl)
    _ring.ring_region_nbytes(ring_nbytes)
    if not spin_s >= 0:
        raise ValueError(f"spin_s must be a non-negative number of seconds, got {spin_s!r}")
    try:
        path = _rv.socket_path(name, create=False)
    except FileNotFoundError as e:
        raise BrokenLinkError(f"nobody listens on {url} (no shm socket directory {socket_dir()})") from e
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise BrokenLinkError(f"nobody listens on {url} (socket {path}: {e.strerror})") from e
        except socket.timeout as e:
            raise QlinkTimeoutError(f"shm: connecting to {url} did not complete within timeout_s={timeout_s}") from e
        if _rv.peer_uid(sock) != os.getuid():
            raise BrokenLinkError(f"{url} is served by another user; shm connects to your own processes only")
        token = secrets.randbits(64)
        total = _rv.layout_nbytes(ring_nbytes)
        fd = os.memfd_create(f"qlink-shm-{name}", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
        try:
            os.ftruncate(fd, total)
            _rv.seal(fd)
            mm = mmap.mmap(fd, total, flags=_rv.MAP_FLAGS)
            _rv.CONN.pack_into(mm, 0, _rv.CONN_MAGIC, _rv.VERSION, _rv.TABLE_SLOTS, ring_nbytes, token)
            region = _ring.ring_region_nbytes(ring_nbytes)
            for side in (0, 1):
                off = _rv.ring_offset(side, ring_nbytes)
                with memoryview(mm)[off:off + region] as ring_mem:
                    _ring.init_ring(ring_mem, data_nbytes=ring_nbytes)
            try:
                socket.send_fds(sock, [_rv.CONN.pack(_rv.HELLO_MAGIC, _rv.VERSION, _rv.TABLE_SLOTS, ring_nbytes, token)], [fd])
            except OSError as e:
                mm.close()
                raise BrokenLinkError(f"the listener on {url} went away during the handshake ({e.strerror})") from e
        finally:
            os.close(fd)
        sock.setblocking(False)
        return ShmEndpoint(url=f"shm://{name}", sock=sock, mm=mm, side=0, ring_nbytes=ring_nbytes, token=token,
                           ring_cls=ring_cls, spin_s=spin_s)
    except BaseException:
        sock.close()
        raise
