"""``cuda_ipc://name``: two processes on one host; puts move GPU memory device to device.

The control path *is* an ``shm://`` connection (:mod:`transports.shm`): rendezvous on a
private Unix socket (named ``cuda_ipc.<name>`` in the shm socket directory), messages,
notifications and dead-peer detection all ride its rings, unchanged. What this transport
adds is the data path of device memory:

* **register.** ``register(array)`` takes a CuPy array (anything with
  ``__cuda_array_interface__``): the allocation holding it is exported with
  ``cudaIpcGetMemHandle`` and its descriptor's key (:class:`~transports._cuda_key.DeviceKey`,
  struct-packed: IPC handle, offset in the allocation, size, device ordinal and PCI bus id)
  goes to the peer as ``region.descriptor().to_bytes()``, like any region's. A NumPy array
  is registered on the shm path as it is, so the same code runs on a CPU host.
* **put.** Into a device region, the initiator opens the peer's allocation once
  (``cudaIpcOpenMemHandle``, on the device with that PCI bus id), copies with
  ``cudaMemcpyAsync`` (device to device; host to device from a NumPy source;
  ``cudaMemcpyPeerAsync`` across GPUs) on the current CuPy stream, synchronises it, and only
  then sends the completion, so the target never sees a notification before the bytes.
  Into a host region, put is the shm put (a device source is first copied to host).
* **deferred device puts.** ``put_many(..., defer=True)`` into a device region queues the
  copies, records a CUDA event and returns; the completion is published once the event has
  fired, oldest first, at the next put or :meth:`~CudaIpcEndpoint.flush`, and before any
  message sent after it. A sender of many puts (a KV cache, layer by layer) then keeps the
  copy engine busy instead of waiting for each copy in turn.
* **notifications.** For each device region the target also registers a *host stand-in* of
  the same size on the shm path: address space only (an anonymous ``MAP_NORESERVE``
  mapping nobody writes). A device put's completion is one shm completion record over
  the put's span of that stand-in: no byte moves, and the shm target reports ``Notification(region_id, offset, nbytes, notify_id, tag)`` exactly
  as for a host put, in order with every other message and notification. The stand-in's
  id is the device region's id, so deregistering it makes later puts fail at the initiator
  (``RegistrationError``) before any byte is copied.

Typed errors: a device array where CUDA cannot run is a
:class:`~qlink.errors.CapabilityError` (without CuPy installed,
:class:`~qlink.errors.MissingDependencyError`); a descriptor naming a GPU this process cannot
see, :class:`DeviceMismatchError`; a put past the region's end, or into a region the peer
deregistered or did not issue on this connection, :class:`~qlink.errors.RegistrationError`;
a dead peer, :class:`~qlink.errors.BrokenLinkError` (from the shm control path, within about a
millisecond of its waits backing off).

Opened IPC handles stay open until this endpoint closes. The copy waits for the work queued
on the current CuPy stream of the destination's device (where CuPy runs its kernels); data
written on another stream must be finished by the caller first.

>>> import os, numpy as np, transports
>>> from qlink.memory import alloc
>>> url = f"cuda_ipc://doc-{os.getpid()}"
>>> with transports.listen(url) as lis:
...     a = transports.connect(url, timeout_s=5)
...     b = lis.accept(timeout_s=5)
...     target = alloc(8, dtype=np.uint8)          # host memory: the shm path
...     region = b.register(target)
...     a.put(b"\\x01\\x02", region.descriptor(), offset=3, notify_id=9)
...     note = b.wait_notification(timeout_s=5)
...     (note.offset, note.nbytes, note.notify_id), target.tolist(), a.capabilities.device_memory
((3, 2, 9), [0, 0, 0, 1, 2, 0, 0, 0], True)
>>> a.close(); b.close()
"""

from __future__ import annotations

import mmap
import operator
import re
import time
from collections import deque
from dataclasses import replace

import numpy as np

from qlink.errors import BrokenLinkError, ClosedError, QlinkTimeoutError, RegistrationError
from qlink.memory import Region, RemoteRegion, as_byte_view

from . import cuda as _cuda
from . import shm as _shm
from ._base import Capabilities, Endpoint, Listener, deadline_of
from ._base import check_notify_id as _check_notify_id
from ._base import check_tag as _check_tag
from ._pieces import check_few
from .cuda import DeviceMismatchError
from ._cuda_key import DeviceKey

__all__ = ["CAPABILITIES", "listen", "connect", "CudaIpcEndpoint", "CudaIpcListener", "DeviceMismatchError",
           "cuda_unavailable"]

CAPABILITIES = Capabilities(
    name="cuda_ipc",
    one_sided=True,
    zero_copy_put=True,  # the initiator writes the target's memory; the target copies nothing
    device_memory=True,
    cross_process=True,
    cross_host=False,
)

cuda_unavailable = _cuda.cuda_unavailable
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,90}")
_SHM_PREFIX = "cuda_ipc."
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux value; Python's mmap does not export it


def _name_of(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    name = rest.strip("/")
    if scheme.lower() != "cuda_ipc" or not sep or not _NAME_RE.fullmatch(name):
        raise ValueError(f"cuda_ipc transport needs a URL like 'cuda_ipc://decoder-0' (a name of 1-91 letters, "
                         f"digits, '.', '_' or '-', starting with a letter or digit), got {url!r}")
    return name


def _stand_in(nbytes: int) -> np.ndarray:
    """Host address space of ``nbytes`` that is never written (no page is ever backed)."""
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    try:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE)
    except OSError as e:
        raise RegistrationError(f"cannot reserve {nbytes} bytes of address space for the host stand-in of a device "
                                f"region ({e}); under vm.overcommit_memory=2 the kernel counts it as memory: "
                                "register smaller regions, or allow overcommit") from None
    return np.frombuffer(mm, dtype=np.uint8)


def _source_nbytes(data) -> int:
    if _cuda.is_device(data):
        return _cuda.device_span(data)[1]
    return len(as_byte_view(data))


class CudaIpcEndpoint(Endpoint):
    """One side of a ``cuda_ipc://`` connection: an shm endpoint plus the device data path."""

    capabilities = CAPABILITIES
    put_many_gathers = True  # one Notification per put_many, host and device regions alike
    defers_device_puts = True  # put_many(..., defer=True) into a device region returns once queued

    def __init__(self, shm_endpoint: _shm.ShmEndpoint, *, url: str) -> None:
        super().__init__()
        self.url = url
        self._shm = ep = shm_endpoint
        ep.url = url  # its errors then name the URL the caller used
        self._device_regions: dict[int, tuple[Region, Region]] = {}  # region id -> (device region, stand-in)
        self._mappings = _cuda.IpcMappings()
        self._x = dict(device_puts=0, device_put_bytes=0, device_notifications=0, deferred_device_puts=0,
                       staged_to_host_puts=0)
        # deferred device puts, oldest first: (CUDA event, stand-in, lo, span, notify_id, tag, keep-alive)
        self._pending: deque = deque()
        self._keys: dict[bytes, DeviceKey] = {}  # a descriptor's key bytes, unpacked once
        # the control path is the shm endpoint's own (its C fast paths included)
        self.send, self.send_nowait = ep.send, ep.send_nowait
        self.recv_into, self.recv_into_nowait, self.recv = ep.recv_into, ep.recv_into_nowait, ep.recv
        self.wait_notification, self.poll_notification_nowait = ep.wait_notification, ep.poll_notification_nowait

    def __repr__(self) -> str:
        return f"<CudaIpcEndpoint {self.url} {'closed' if self._closed else 'open'}>"

    # ----- two-sided and notifications: the shm endpoint's (bound in __init__) ------------------
    def send(self, data, *, timeout_s: float | None = None) -> None:
        """Send one message (host bytes) over the shm control path."""
        self._shm.send(data, timeout_s=timeout_s)

    def send_nowait(self, data) -> None:
        """Send one message now or raise RingFullError having sent nothing."""
        self._shm.send_nowait(data)

    def recv_into(self, buf, *, timeout_s: float | None = None) -> int:
        """Receive the next message into ``buf`` (host memory); return its size."""
        return self._shm.recv_into(buf, timeout_s=timeout_s)

    def recv_into_nowait(self, buf) -> int:
        """Receive the next message if one is ready, else raise WouldBlock."""
        return self._shm.recv_into_nowait(buf)

    def wait_notification(self, *, timeout_s: float | None = None):
        """Wait for the next put completion (host or device region) targeted at this side."""
        return self._shm.wait_notification(timeout_s=timeout_s)

    def poll_notification_nowait(self):
        """The next put completion if one has arrived, else raise WouldBlock."""
        return self._shm.poll_notification_nowait()

    def flush(self, *, timeout_s: float | None = None) -> None:
        """Wait until every deferred put is done: device puts copied by CUDA and their
        notifications published, host puts copied by the peer."""
        self._check_open()
        self._publish_pending(wait=True, timeout_s=timeout_s)
        self._shm.flush(timeout_s=timeout_s)

    def _send_after_pending(self, data, *, timeout_s: float | None = None) -> None:
        self._publish_pending(wait=True, timeout_s=timeout_s)  # a message never overtakes a completion
        self._shm.send(data, timeout_s=timeout_s)

    def _send_nowait_after_pending(self, data) -> None:
        self._publish_pending(wait=True, timeout_s=None)
        self._shm.send_nowait(data)

    def _publish_pending(self, *, wait: bool, timeout_s: float | None) -> None:
        """Publish the notifications of deferred device puts whose copies are done, oldest
        first; ``wait``: wait for all of them. While some are pending, a message sent goes
        after them (``send`` is rebound to wait first), so order is kept."""
        q = self._pending
        while q:
            event, stand_in, lo, span, notify_id, tag, _keep = q[0]
            if not event.done:
                if not wait:
                    return
                event.synchronize()
            self._notify(stand_in, lo, span, notify_id, tag, timeout_s)
            q.popleft()
        self.send, self.send_nowait = self._shm.send, self._shm.send_nowait  # nothing pending: the fast path

    # ----- registration ---------------------------------------------------------------------
    def register(self, array) -> Region:
        """Register ``array`` as a put target: a CuPy (device) array for device-to-device puts,
        or host memory (NumPy, :func:`qlink.memory.alloc`) on the shm path."""
        self._check_open()
        if not _cuda.is_device(array):
            return self._shm.register(array)
        cp = _cuda.require("registering a device array with cuda_ipc")
        _, nbytes = _cuda.device_span(array, writable=True)
        stand_in = self._shm.register(_stand_in(nbytes))
        try:
            key = _cuda.export_region(cp, array, notify_key=stand_in.key)
        except BaseException:
            self._shm.deregister(stand_in)
            raise
        region = Region(stand_in.region_id, array, nbytes, "device", key.address, key.pack())
        self._device_regions[region.region_id] = (region, stand_in)
        return region

    def deregister(self, region: Region) -> None:
        """Forget a region; later puts into it raise RegistrationError at the initiator."""
        entry = self._device_regions.get(region.region_id) if region.kind == "device" else None
        if entry is None or (entry[0] is not region and entry[0].array is not region.array):
            if region.kind == "device":
                raise RegistrationError(f"device region {region.region_id} is not registered on this endpoint")
            self._shm.deregister(region)
            return
        del self._device_regions[region.region_id]
        self._shm.deregister(entry[1])

    # ----- one-sided ------------------------------------------------------------------------
    def put(self, data, remote: RemoteRegion, *, offset: int = 0, notify_id: int = 0, tag: bytes = b"",
            timeout_s: float | None = None) -> None:
        """Write ``data`` (a CuPy array or host buffer) into the peer's region at ``offset``;
        the peer then gets a Notification. Device regions: copied by CUDA, synchronised
        before the notification is sent. Validation failures raise before anything is written."""
        remote, data = self._prelude(remote, data)
        if remote.kind == "host":
            if self._pending:
                self._publish_pending(wait=True, timeout_s=timeout_s)
            self._shm.put(data, remote, offset=offset, notify_id=notify_id, tag=tag, timeout_s=timeout_s)
            return
        offset = operator.index(offset)
        n = _source_nbytes(data)
        self._device_put(data, remote, [(0, offset, n)], offset, n, notify_id, tag, timeout_s)

    def put_many(self, data, remote: RemoteRegion, src_offsets, dst_offsets, nbytes, *, notify_id: int = 0,
                 tag: bytes = b"", timeout_s: float | None = None, defer: bool = False) -> int:
        """Write pieces of ``data`` into the peer's region and publish ONE Notification for all
        (see :meth:`transports.Endpoint.put_many`). Device regions: one copy per piece on one
        stream, synchronised, then the notification. ``defer=True`` into a device region: the
        copies are queued and the call returns; the notification is published once CUDA has
        finished them, at a later put or :meth:`flush` (and before any message sent after
        it); ``data`` must stay unchanged until then. Into a host region, shm's ``defer``.
        Returns 1."""
        remote, source = self._prelude(remote, data)
        if remote.kind == "host":
            if self._pending:
                self._publish_pending(wait=True, timeout_s=timeout_s)
            defer = defer and source is data  # a staged copy is not registered memory: no deferral
            return self._shm.put_many(source, remote, src_offsets, dst_offsets, nbytes, notify_id=notify_id, tag=tag,
                                      timeout_s=timeout_s, defer=defer)
        pieces = check_few(src_offsets, dst_offsets, nbytes, src_nbytes=_source_nbytes(data),
                           region_nbytes=remote.nbytes, region_id=remote.region_id)
        lo, hi = min(d for _, d, _ in pieces), max(d + n for _, d, n in pieces)
        self._device_put(data, remote, pieces, lo, hi - lo, notify_id, tag, timeout_s, defer=defer)
        return 1

    def _prelude(self, remote, data):
        """Checks shared by put and put_many: open, a RemoteRegion; into a host region a
        device source is first copied to the host. Returns ``(remote, data)``."""
        if self._closed:
            raise ClosedError(f"cuda_ipc endpoint {self.url} was closed by this side")
        if not isinstance(remote, RemoteRegion):
            remote = RemoteRegion.from_bytes(remote)
        if remote.kind == "host" and _cuda.is_device(data):
            data = self._staged(data)
        return remote, data

    def _staged(self, data) -> np.ndarray:
        cp = _cuda.require("a put from device memory")
        self._x["staged_to_host_puts"] += 1
        return _cuda.to_host(cp, data)

    def _device_put(self, data, remote: RemoteRegion, pieces, lo: int, span: int, notify_id, tag,
                    timeout_s: float | None, *, defer: bool = False) -> None:
        """Check everything, copy every piece with CUDA, then publish one notification over [lo, lo + span)."""
        deadline_of(timeout_s)
        tag, notify_id = _check_tag(tag), _check_notify_id(notify_id)
        key = self._keys.get(remote.key)
        if key is None:
            if len(self._keys) >= 4096:  # a peer that sends endless descriptors does not grow this
                self._keys.clear()
            key = self._keys[remote.key] = DeviceKey.unpack(remote.key)
        if key.nbytes != remote.nbytes:
            raise RegistrationError(f"descriptor says device region {remote.region_id} has {remote.nbytes} bytes, "
                                    f"its key says {key.nbytes}")
        if lo < 0 or lo + span > remote.nbytes:
            raise RegistrationError(f"put of {span} bytes at offset {lo} falls outside device region "
                                    f"{remote.region_id} of {remote.nbytes} bytes; need 0 <= offset and "
                                    f"offset + nbytes <= {remote.nbytes}")
        stand_in = RemoteRegion(region_id=remote.region_id, nbytes=remote.nbytes, kind="host", key=key.notify_key)
        self._check_target(stand_in, lo, span)  # before any byte moves: issued here, still registered, peer alive
        moved = 0
        has_bytes = any(n for _, _, n in pieces)
        defer = defer and has_bytes  # a put of no bytes only notifies, after every earlier one
        if self._pending:  # earlier deferred puts: theirs first (all of them, unless this one defers too)
            self._publish_pending(wait=not defer, timeout_s=timeout_s)
        if has_bytes:
            cp = _cuda.require("a put into a device region")
            dev, address = self._mappings.target(cp, key)
            if defer:
                moved, event, keep = _cuda.queue_pieces(cp, dst_address=address, dst_device=dev, src=data,
                                                        pieces=pieces)
                self._pending.append((event, stand_in, lo, span, notify_id, tag, keep))
                self.send, self.send_nowait = self._send_after_pending, self._send_nowait_after_pending
                self._x["deferred_device_puts"] += 1
            else:
                moved = _cuda.copy_pieces(cp, dst_address=address, dst_device=dev, src=data, pieces=pieces)
        if not defer:
            self._notify(stand_in, lo, span, notify_id, tag, timeout_s)
        self._x["device_puts"] += len(pieces)
        self._x["device_put_bytes"] += moved

    def _check_target(self, stand_in: RemoteRegion, offset: int, nbytes: int) -> None:
        """RegistrationError unless the peer's shm table holds this stand-in (this connection's,
        still registered, big enough); BrokenLinkError if the peer is gone.

        The shm endpoint has no public "may I write there?" call, so this reads its peer
        table and peer state (``_peer``, ``_peer_flags``, ``_poll_socket``, ``_broken``), as
        its own ``put`` does before writing; a change there shows in tests/transports/test_cuda_ipc.py."""
        shm = self._shm
        shm._poll_socket()
        if shm._peer_flags() is not None:
            raise shm._broken("put")
        shm._peer.entry(stand_in, offset=offset, nbytes=nbytes)

    def _notify(self, stand_in: RemoteRegion, lo: int, span: int, notify_id: int, tag: bytes,
                timeout_s: float | None) -> None:
        """One shm notification covering [lo, lo + span) of the stand-in, moving no byte."""
        self._shm._publish_span(stand_in, lo, span, notify_id=notify_id, tag=tag, timeout_s=timeout_s)
        self._x["device_notifications"] += 1

    # ----- lifecycle ------------------------------------------------------------------------
    def statistics(self):
        """The shm control path's counters, with device puts counted as puts (and in ``extra``)."""
        s = self._shm.statistics()
        x = self._x
        extra = dict(s.extra)
        if "gathered_puts" in extra:  # the records that carried device completions are not host puts
            extra["gathered_puts"] = max(0, extra["gathered_puts"] - x["device_notifications"])
        extra.update(x, opened_ipc_handles=len(self._mappings), device_regions=len(self._device_regions))
        return replace(s, transport=CAPABILITIES.name, puts=s.puts + x["device_puts"],
                       put_bytes=s.put_bytes + x["device_put_bytes"], extra=extra)

    def close(self) -> None:
        """Close this side (the peer sees BrokenLinkError) and close the peer's IPC handles. Idempotent."""
        if self._closed:
            return
        if self._pending:
            try:  # what was queued before the close is still completed, as a host put's would be
                self._publish_pending(wait=True, timeout_s=1.0)
            except Exception:  # noqa: BLE001 - the peer may be gone: closing goes on
                self._pending.clear()
        self._closed = True
        self._shm.close()
        if len(self._mappings):
            self._mappings.close(_cuda.require("closing CUDA IPC handles"))
        self._device_regions.clear()


class CudaIpcListener(Listener):
    """Accepts ``cuda_ipc://name`` connections from processes of the same user on this host."""

    def __init__(self, *, name: str, shm_listener: _shm.ShmListener) -> None:
        self.name = name
        self.url = f"cuda_ipc://{name}"
        self._shm = shm_listener

    def __repr__(self) -> str:
        return f"<CudaIpcListener {self.url}>"

    @property
    def rejected(self) -> int:
        """Connections dropped during the handshake."""
        return self._shm.rejected

    def accept(self, *, timeout_s: float | None = None) -> CudaIpcEndpoint:
        """Wait for the next peer and return its connected endpoint."""
        try:
            ep = self._shm.accept(timeout_s=timeout_s)
        except ClosedError:
            raise ClosedError(f"cuda_ipc listener {self.url} was closed by this side") from None
        except QlinkTimeoutError:
            raise QlinkTimeoutError(f"cuda_ipc: no connection to {self.url} within timeout_s={timeout_s}") from None
        return CudaIpcEndpoint(ep, url=self.url)

    def close(self) -> None:
        """Stop listening and remove the socket file. Idempotent."""
        self._shm.close()


def listen(url: str, *, ring_impl: str | None = None, spin_s: float = _shm.DEFAULT_SPIN_S,
           backlog: int = 64) -> CudaIpcListener:
    """Listen on ``cuda_ipc://name``; options as :func:`transports.shm.listen`."""
    name = _name_of(url)
    try:
        lis = _shm.listen(f"shm://{_SHM_PREFIX}{name}", ring_impl=ring_impl, spin_s=spin_s, backlog=backlog)
    except OSError as e:
        raise OSError(e.errno, f"{url} is already listening" if "already listening" in str(e) else str(e)) from e
    return CudaIpcListener(name=name, shm_listener=lis)


def connect(url: str, *, timeout_s: float | None = 10.0, ring_nbytes: int = _shm.DEFAULT_RING_NBYTES,
            ring_impl: str | None = None, spin_s: float = _shm.DEFAULT_SPIN_S) -> CudaIpcEndpoint:
    """Connect to ``cuda_ipc://name``; BrokenLinkError if nobody listens there. Options as
    :func:`transports.shm.connect` (the rings carry messages and notifications, not device bytes)."""
    name = _name_of(url)
    t0 = time.monotonic()
    try:
        ep = _shm.connect(f"shm://{_SHM_PREFIX}{name}", timeout_s=timeout_s, ring_nbytes=ring_nbytes,
                          ring_impl=ring_impl, spin_s=spin_s)
    except BrokenLinkError as e:
        raise BrokenLinkError(f"nobody listens on {url} ({e})") from e
    except QlinkTimeoutError:
        raise QlinkTimeoutError(f"cuda_ipc: connecting to {url} did not complete within timeout_s={timeout_s} "
                                f"(waited {time.monotonic() - t0:.3f} s)") from None
    return CudaIpcEndpoint(ep, url=f"cuda_ipc://{name}")
