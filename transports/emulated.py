"""``emulated+<scheme>://…?link=<name>``: a real transport that delivers each message
at its *modeled* arrival time over a link from :mod:`qlink.links`.

The sender stamps each message with its send time (``CLOCK_MONOTONIC`` ns, shared by
processes on one host); the receiver holds it until ``send time + modeled delay`` —
latency, per-message overhead, size / bandwidth, half-normal jitter — and never
delivers earlier. Messages queue behind each other at the link's bandwidth (a message
cannot arrive before the previous one has finished arriving plus its own
serialization time). The bytes really travel over the inner transport; only the
timing is modeled, so figures taken over an emulated link are labelled *modeled*.

>>> import transports
>>> with transports.listen("emulated+inproc://emu-doc?link=ib-ndr") as lis:
...     a = transports.connect("emulated+inproc://emu-doc?link=ib-ndr")
...     b = lis.accept(timeout_s=1)
...     a.send(b"syndrome")
...     b.recv(timeout_s=1), b.statistics().extra["link"]
(b'syndrome', 'ib-ndr')
>>> a.close(); b.close()
"""

from __future__ import annotations

import struct
import time
from dataclasses import replace
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import numpy as np

from qlink.errors import QlinkTimeoutError, WouldBlock
from qlink.links import LinkModel, link as _link

from ._base import BufferTooSmallError, Capabilities, Endpoint, Listener, Notification, Statistics

__all__ = ["EmulatedEndpoint", "EmulatedListener", "listen", "connect", "wrap", "split_url"]

_STAMP = struct.Struct("<q")  # send time, ns
_now = time.monotonic_ns


def split_url(url: str) -> tuple[str, LinkModel, int]:
    """``emulated+tcp://h:p?link=ib-ndr&seed=1`` -> (``tcp://h:p``, the link model, seed)."""
    parts = urlsplit(url)
    if not parts.scheme.startswith("emulated+") or len(parts.scheme) == len("emulated+"):
        raise ValueError(f"emulated URL must look like 'emulated+shm://name?link=ib-ndr', got {url!r}")
    query = parse_qs(parts.query)
    names = query.pop("link", None)
    if not names:
        raise ValueError(f"emulated URL {url!r} needs ?link=<name> (one of the qlink.links catalog)")
    seed = int(query.pop("seed", ["0"])[0])
    inner = urlunsplit((parts.scheme[len("emulated+"):], parts.netloc, parts.path,
                        urlencode({k: v[0] for k, v in query.items()}), parts.fragment))
    return inner, _link(names[0]), seed


class EmulatedEndpoint(Endpoint):
    """Wraps a connected endpoint; see the module docstring."""

    def __init__(self, inner: Endpoint, model: LinkModel, *, seed: int = 0):
        super().__init__()
        self._inner = inner
        self._model = model
        self._rng = np.random.default_rng(seed)
        self._bw_ns_per_byte = 1e9 / model.bandwidth_Bps
        self._last_arrival_ns = 0
        self._held_delay_ns = 0  # sum of the time messages were held (for statistics)
        self._early_ns = 0  # how late delivery was behind the model, worst case (diagnostic)
        self._scratch = bytearray(_STAMP.size + (1 << 16))
        self._pending: tuple[int, int] | None = None  # (arrival_ns, nbytes) of a message read but held
        self._pending_buf = bytearray()
        self.capabilities = replace(inner.capabilities, name=f"emulated+{inner.capabilities.name}[{model.name}]")

    # --- timing ---------------------------------------------------------------
    def _arrival_ns(self, sent_ns: int, nbytes: int) -> int:
        m = self._model
        jitter = abs(self._rng.normal(0.0, m.jitter_ns)) if m.jitter_ns else 0.0
        serialize = nbytes * self._bw_ns_per_byte
        t = sent_ns + m.latency_ns + m.overhead_ns + serialize + jitter
        t = max(t, self._last_arrival_ns + serialize)
        self._last_arrival_ns = int(t)
        return int(t)

    def _hold_until(self, arrival_ns: int, deadline_ns: int | None, timeout_s) -> None:
        while True:
            now = _now()
            if now >= arrival_ns:
                return
            if deadline_ns is not None and now >= deadline_ns:
                raise self._timed_out("recv (message still in flight on the modeled link)", timeout_s)
            if arrival_ns - now > 200_000:
                time.sleep((arrival_ns - now - 100_000) / 1e9)

    # --- two-sided ------------------------------------------------------------
    def send(self, data, *, timeout_s=None) -> None:
        self._check_open()
        self._inner.send(self._stamped(data), timeout_s=timeout_s)
        self._counters.messages_sent += 1
        self._counters.bytes_sent += memoryview(data).nbytes

    def send_nowait(self, data) -> None:
        self._check_open()
        self._inner.send_nowait(self._stamped(data))
        self._counters.messages_sent += 1
        self._counters.bytes_sent += memoryview(data).nbytes

    def _stamped(self, data) -> bytearray:
        mv = memoryview(data).cast("B")
        out = bytearray(_STAMP.size + len(mv))
        _STAMP.pack_into(out, 0, _now())
        out[_STAMP.size:] = mv
        return out

    def _fetch(self, *, timeout_s, nowait: bool) -> None:
        if self._pending is not None:
            return
        while True:
            try:
                n = (self._inner.recv_into_nowait(self._scratch) if nowait
                     else self._inner.recv_into(self._scratch, timeout_s=timeout_s))
                break
            except BufferTooSmallError as e:
                self._scratch = bytearray(e.needed_nbytes)
        (sent_ns,) = _STAMP.unpack_from(self._scratch, 0)
        nbytes = n - _STAMP.size
        self._pending_buf = self._scratch  # the payload stays in scratch until delivered
        self._scratch = bytearray(len(self._scratch))
        self._pending = (self._arrival_ns(sent_ns, nbytes), nbytes)

    def recv_into(self, buf, *, timeout_s=None) -> int:
        self._check_open()
        deadline_ns = None if timeout_s is None else _now() + int(timeout_s * 1e9)
        self._fetch(timeout_s=timeout_s, nowait=False)
        arrival_ns, nbytes = self._pending
        self._hold_until(arrival_ns, deadline_ns, timeout_s)
        return self._deliver(buf)

    def recv_into_nowait(self, buf) -> int:
        self._check_open()
        self._fetch(timeout_s=0, nowait=True)
        if _now() < self._pending[0]:
            raise WouldBlock("emulated: the next message has not reached its modeled arrival time")
        return self._deliver(buf)

    def _deliver(self, buf) -> int:
        arrival_ns, nbytes = self._pending
        out = memoryview(buf).cast("B")
        if len(out) < nbytes:
            raise BufferTooSmallError(f"emulated: next message is {nbytes} bytes, buffer holds {len(out)}",
                                      needed_nbytes=nbytes)
        out[:nbytes] = memoryview(self._pending_buf)[_STAMP.size:_STAMP.size + nbytes]
        late = _now() - arrival_ns
        self._early_ns = max(self._early_ns, late)
        self._pending = None
        self._counters.messages_received += 1
        self._counters.bytes_received += nbytes
        return nbytes

    # --- one-sided: the notification is held until the modeled arrival ---------
    def register(self, array):
        return self._inner.register(array)

    def deregister(self, region) -> None:
        self._inner.deregister(region)

    def put(self, data, remote, *, offset=0, notify_id=0, tag=b"", timeout_s=None) -> None:
        self._check_open()
        self._inner.put(data, remote, offset=offset, notify_id=notify_id,
                        tag=_STAMP.pack(_now()) + bytes(tag), timeout_s=timeout_s)
        self._counters.puts += 1
        self._counters.put_bytes += memoryview(data).nbytes

    def _unstamp(self, n: Notification, deadline_ns, timeout_s) -> Notification:
        (sent_ns,) = _STAMP.unpack_from(n.tag, 0)
        self._hold_until(self._arrival_ns(sent_ns, n.nbytes), deadline_ns, timeout_s)
        self._counters.notifications += 1
        return replace(n, tag=n.tag[_STAMP.size:])

    def wait_notification(self, *, timeout_s=None) -> Notification:
        self._check_open()
        deadline_ns = None if timeout_s is None else _now() + int(timeout_s * 1e9)
        return self._unstamp(self._inner.wait_notification(timeout_s=timeout_s), deadline_ns, timeout_s)

    def poll_notification_nowait(self) -> Notification:
        self._check_open()
        return self._unstamp(self._inner.poll_notification_nowait(), None, None)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._inner.close()

    def statistics(self) -> Statistics:
        s = super().statistics()
        inner = self._inner.statistics()
        return replace(s, extra={"link": self._model.name, "basis": "modeled", "inner_transport": inner.transport,
                                 "max_late_ns": self._early_ns})


class EmulatedListener(Listener):
    def __init__(self, inner: Listener, model: LinkModel, seed: int, url_suffix: str):
        self._inner = inner
        self._model = model
        self._seed = seed
        self.url = f"emulated+{inner.url}{url_suffix}"

    def accept(self, *, timeout_s=None) -> Endpoint:
        return EmulatedEndpoint(self._inner.accept(timeout_s=timeout_s), self._model, seed=self._seed + 1)

    def close(self) -> None:
        self._inner.close()


def wrap(endpoint: Endpoint, *, link: str | LinkModel, seed: int = 0) -> EmulatedEndpoint:
    """Wrap an already connected endpoint; both sides must wrap with the same link."""
    model = _link(link) if isinstance(link, str) else link
    return EmulatedEndpoint(endpoint, model, seed=seed)


def _suffix(model: LinkModel, seed: int) -> str:
    return f"?link={model.name}" + (f"&seed={seed}" if seed else "")


def listen(url: str, **options) -> Listener:
    import transports

    inner, model, seed = split_url(url)
    return EmulatedListener(transports.listen(inner, **options), model, seed, _suffix(model, seed))


def connect(url: str, *, timeout_s=10.0, **options) -> Endpoint:
    import transports

    inner, model, seed = split_url(url)
    return EmulatedEndpoint(transports.connect(inner, timeout_s=timeout_s, **options), model, seed=seed)


def capabilities_of(url: str) -> Capabilities:
    import transports

    inner, model, _ = split_url(url)
    return replace(transports.capabilities(inner), name=f"emulated+{urlsplit(inner).scheme}[{model.name}]")


_unused = (QlinkTimeoutError,)
