"""``shm://name``: two processes on one host, a lock-free ring in shared memory per direction.

qlink's intra-node fast path (and its stand-in for NVLink / CUDA IPC on a CPU host).

Rooms: this module is the handshake (listen, accept, connect: the memfd and the hello over
the socket); :mod:`transports._shm_records` the records in the rings (the ring itself is
:mod:`transports._ring`, its C twin ``_ringc``); :mod:`transports._shm_wait` the waiting
policy (one of :mod:`transports._waiting`'s family); :mod:`transports._shm_endpoint` the
endpoint and its two-sided half, :mod:`transports._shm_put` its one-sided half;
:mod:`transports._shm_regions` the region tables and :mod:`transports._shm_rendezvous` the
socket directory.

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
  progresses (one C loop over the pieces; past 1 MiB with glibc's memcpy or streaming
  stores, whichever its own pulls have shown faster on this host:
  ``transports._ringc.pull_copy()``), then publishes the put's sequence number in
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
import os
import secrets
import select
import socket
import struct
import time
import weakref

from qlink.errors import (
    BrokenLinkError,
    ClosedError,
    MissingDependencyError,
    QlinkTimeoutError,
)

from . import _ring
from . import _shm_rendezvous as _rv
from ._base import Listener, deadline_of
from ._shm_endpoint import CAPABILITIES, ShmEndpoint
from ._shm_records import _ringc
from ._shm_rendezvous import reclaim_after_exit, socket_dir

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

DEFAULT_RING_NBYTES = 8 << 20
DEFAULT_SPIN_S = 1e-3
# How long the listener waits for an accepted connection's hello (the connecting side sends
# it right after connect()); as tcp's, generous for a host whose cores are all busy.
_HANDSHAKE_TIMEOUT_S = 5.0

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
    # The shared memory is made ready before connecting, so the listener, which gives a
    # connection _HANDSHAKE_TIMEOUT_S to say hello, waits for nothing but the hello itself
    # (on a loaded host, setting up the rings can take longer than that).
    token = secrets.randbits(64)
    total = _rv.layout_nbytes(ring_nbytes)
    fd = os.memfd_create(f"qlink-shm-{name}", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
    mm = None
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
    except BaseException:
        os.close(fd)
        if mm is not None:
            mm.close()
        raise
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    except BaseException:
        os.close(fd)
        mm.close()
        raise
    try:
        sock.settimeout(timeout_s)
        try:
            try:
                sock.connect(path)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                raise BrokenLinkError(f"nobody listens on {url} (socket {path}: {e.strerror})") from e
            except socket.timeout as e:
                raise QlinkTimeoutError(f"shm: connecting to {url} did not complete within timeout_s={timeout_s}") \
                    from e
            if _rv.peer_uid(sock) != os.getuid():
                raise BrokenLinkError(f"{url} is served by another user; shm connects to your own processes only")
            try:
                socket.send_fds(sock, [_rv.CONN.pack(_rv.HELLO_MAGIC, _rv.VERSION, _rv.TABLE_SLOTS, ring_nbytes, token)], [fd])
            except OSError as e:
                raise BrokenLinkError(f"the listener on {url} went away during the handshake ({e.strerror})") from e
        except BaseException:
            mm.close()
            raise
        finally:
            os.close(fd)
        sock.setblocking(False)
        return ShmEndpoint(url=f"shm://{name}", sock=sock, mm=mm, side=0, ring_nbytes=ring_nbytes, token=token,
                           ring_cls=ring_cls, spin_s=spin_s)
    except BaseException:
        sock.close()
        raise
