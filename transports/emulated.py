"""``emulated+<scheme>://…?link=<name>``: a real transport that delivers each message
at its *modeled* arrival time over a link from :mod:`qlink.links`.

The sender stamps each message with its send time (``CLOCK_MONOTONIC`` ns, shared by
processes on one host); the receiver holds it until ``send time + modeled delay`` —
latency, per-message overhead, size / bandwidth, half-normal jitter — and never
delivers earlier. Messages queue behind each other at the link's bandwidth (a message
cannot arrive before the previous one has finished arriving plus its own
serialization time). The bytes really travel over the inner transport; only the
timing is modeled, so figures taken over an emulated link are labelled *modeled*.

Faults: ``faults=FaultSpec(...)`` (or fault keys in the URL query, e.g.
``emulated+tcp://127.0.0.1:0?link=ib-ndr&drop=0.01&dup=0.01&reorder=0.01&delay_ns=50000
&corrupt=0.001&seed=3``) makes the messages and puts *this side sends* get dropped,
duplicated, reordered, delayed or corrupted (see :mod:`transports._faults`); the
link model's own ``loss`` is a drop probability too. Injected faults are counted by
kind in ``statistics().extra["faults"]`` / ``["put_faults"]`` and logged
(``endpoint.fault_log()``); an endpoint that may lose or reorder says so in its
capabilities (``reliable`` / ``ordered``). A listener's faults apply to each endpoint
it accepts, and its ``url`` carries them (connect to it and both directions are faulty).

>>> import transports
>>> with transports.listen("emulated+inproc://emu-doc?link=ib-ndr") as lis:
...     a = transports.connect("emulated+inproc://emu-doc?link=ib-ndr")
...     b = lis.accept(timeout_s=1)
...     a.send(b"syndrome")
...     b.recv(timeout_s=1), b.statistics().extra["link"]
(b'syndrome', 'ib-ndr')
>>> a.close(); b.close()
>>> with transports.listen("emulated+inproc://emu-doc2?link=ib-ndr") as lis:
...     a = transports.connect("emulated+inproc://emu-doc2?link=ib-ndr&drop=1&seed=3")
...     b = lis.accept(timeout_s=1)
...     a.send(b"lost")
...     a.statistics().extra["faults"]["drop"], a.capabilities.reliable
(1, False)
>>> a.close(); b.close()
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque
from dataclasses import replace
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import numpy as np

from qlink.errors import QlinkError, QlinkTimeoutError, WouldBlock
from qlink.links import LinkModel, link as _link

from ._base import BufferTooSmallError, Capabilities, Endpoint, Listener, Notification, Statistics
from ._faults import FaultEvent, FaultInjector, FaultSpec, faults_from_query, flip_bit

__all__ = ["EmulatedEndpoint", "EmulatedListener", "listen", "connect", "wrap", "split_url", "split_url_faults",
           "FaultSpec", "FaultEvent"]

_STAMP = struct.Struct("<q")  # send time, ns
_STAGE_MIN_NBYTES = 1 << 16  # stamped messages this large reuse one staging buffer
_now = time.monotonic_ns


def split_url(url: str) -> tuple[str, LinkModel, int]:
    """``emulated+tcp://h:p?link=ib-ndr&seed=1`` -> (``tcp://h:p``, the link model, seed)."""
    inner, model, seed, _ = split_url_faults(url)
    return inner, model, seed


def split_url_faults(url: str) -> tuple[str, LinkModel, int, FaultSpec | None]:
    """Like :func:`split_url`, plus the :class:`FaultSpec` of the fault keys in the query (or None).

    >>> inner, model, seed, faults = split_url_faults("emulated+tcp://127.0.0.1:0?link=ib-ndr&drop=0.1&seed=4")
    >>> inner, model.name, seed, faults.drop, faults.seed
    ('tcp://127.0.0.1:0', 'ib-ndr', 4, 0.1, 4)
    """
    parts = urlsplit(url)
    if not parts.scheme.startswith("emulated+") or len(parts.scheme) == len("emulated+"):
        raise ValueError(f"emulated URL must look like 'emulated+shm://name?link=ib-ndr', got {url!r}")
    query = parse_qs(parts.query)
    names = query.pop("link", None)
    if not names:
        raise ValueError(f"emulated URL {url!r} needs ?link=<name> (one of the qlink.links catalog)")
    faults = faults_from_query(query)
    try:
        seed = int(query.pop("seed", ["0"])[0])
    except ValueError:
        raise ValueError(f"emulated URL {url!r}: seed must be an integer") from None
    inner = urlunsplit((parts.scheme[len("emulated+"):], parts.netloc, parts.path,
                        urlencode({k: v[0] for k, v in query.items()}), parts.fragment))
    return inner, _link(names[0]), seed, faults


class EmulatedEndpoint(Endpoint):
    """Wraps a connected endpoint; see the module docstring."""

    def __init__(self, inner: Endpoint, model: LinkModel, *, seed: int = 0, faults: FaultSpec | None = None,
                 fault_stream: int = 0):
        super().__init__()
        self._inner = inner
        self._model = model
        self._rng = np.random.default_rng(seed)
        self._bw_ns_per_byte = 1e9 / model.bandwidth_Bps
        self._last_arrival_ns = 0
        self._held_delay_ns = 0  # sum of the time messages were held (for statistics)
        self._early_ns = 0  # how late delivery was behind the model, worst case (diagnostic)
        self._scratch = bytearray(_STAMP.size + (1 << 16))
        self._stage = bytearray()  # large messages are stamped here (_send_stamped)
        self._stage_lock = threading.Lock()
        self._pending: tuple[int, int] | None = None  # (arrival_ns, nbytes) of a message read but held
        self._pending_buf = bytearray()
        caps = replace(inner.capabilities, name=f"emulated+{inner.capabilities.name}[{model.name}]")
        self._faults: FaultInjector | None = None
        if faults is not None or model.loss > 0:
            spec = faults if faults is not None else FaultSpec(seed=seed)
            self._faults = FaultInjector(spec, extra_drop=model.loss, stream=fault_stream)
            if spec.may_lose or model.loss > 0:
                caps = replace(caps, reliable=False)
            if spec.may_reorder:
                caps = replace(caps, ordered=False)
        self._outbox: deque = deque()  # stamped messages due out before anything new (dup copies, released holds)
        self._held = None  # (stamped message, held since ns): a reordered message waiting for the next one
        self._held_put = None  # (put args, held since ns)
        # The message (put) after a reordered one passes unfaulted whether or not the held one
        # already left on its own (hold_ns): the faults drawn do not depend on timing.
        self._follower_due = False
        self._follower_due_put = False
        self._fault_lock = threading.RLock()  # a sending and a receiving thread may share one faulty endpoint
        self.capabilities = caps

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
                wake = arrival_ns - 100_000 if deadline_ns is None else min(arrival_ns - 100_000, deadline_ns)
                if wake > now:
                    time.sleep((wake - now) / 1e9)

    # --- two-sided ------------------------------------------------------------
    def send(self, data, *, timeout_s=None) -> None:
        self._check_open()
        if self._faults is None:
            self._send_stamped(data, self._inner.send, timeout_s=timeout_s)
        else:
            self._send_faulty(data, timeout_s=timeout_s, nowait=False)
        self._counters.messages_sent += 1
        self._counters.bytes_sent += memoryview(data).nbytes

    def send_nowait(self, data) -> None:
        self._check_open()
        if self._faults is None:
            self._send_stamped(data, self._inner.send_nowait)
        else:
            self._send_faulty(data, timeout_s=0, nowait=True)
        self._counters.messages_sent += 1
        self._counters.bytes_sent += memoryview(data).nbytes

    def _send_stamped(self, data, send, **kw) -> None:
        """Stamp and send without faults. A message of ``_STAGE_MIN_NBYTES`` or more is stamped
        into one staging buffer reused from message to message (every transport copies a send,
        or finishes with it, before the call returns): a fresh megabyte buffer per message
        costs its page faults, about 1 ms per MiB on a small VM, which delivered large
        messages that much later than their modeled arrival."""
        mv = memoryview(data).cast("B")
        need = _STAMP.size + len(mv)
        if need < _STAGE_MIN_NBYTES:
            send(self._stamped(mv), **kw)
            return
        with self._stage_lock:  # (a second sending thread waits rather than share the buffer)
            if len(self._stage) < need:
                self._stage = bytearray(need)
            stage = self._stage
            _STAMP.pack_into(stage, 0, _now())
            stage[_STAMP.size:need] = mv
            send(memoryview(stage)[:need], **kw)

    def _stamped(self, data, *, delay_ns: int = 0, bit: int = -1) -> bytearray:
        mv = memoryview(data).cast("B")
        out = bytearray(_STAMP.size + len(mv))
        _STAMP.pack_into(out, 0, _now() + delay_ns)
        out[_STAMP.size:] = mv
        if bit >= 0:
            out[_STAMP.size + (bit >> 3)] ^= 1 << (bit & 7)
        return out

    # --- faults (only when a FaultSpec or a lossy link model is in use) ---------
    def _flush_outbox(self, *, timeout_s, nowait: bool) -> bool:
        """Send what is due out first; False when the inner transport is full (nowait)."""
        out = self._outbox
        while out:
            try:
                if nowait:
                    self._inner.send_nowait(out[0])
                else:
                    self._inner.send(out[0], timeout_s=timeout_s)
            except WouldBlock:
                return False
            out.popleft()
        return True

    def _release_due(self, *, force: bool = False, wait: bool = True) -> None:
        """``wait=False`` (the receive paths): skip when another thread is sending right now."""
        if not self._fault_lock.acquire(blocking=wait):
            return
        try:
            self._release_due_locked(force=force)
        finally:
            self._fault_lock.release()

    def _release_due_locked(self, *, force: bool) -> None:
        """Let a reordered message (or put) go when nothing followed it within hold_ns."""
        if self._faults is None:
            return
        now = _now()
        hold = self._faults.spec.hold_ns
        if self._held is not None and (force or now - self._held[1] >= hold):
            self._outbox.append(self._held[0])
            self._held = None
            self._faults.reorders_expired["message"] += 1  # it was not overtaken: no reorder happened
        if self._held_put is not None and (force or now - self._held_put[1] >= hold):
            args, _ = self._held_put
            self._held_put = None
            self._faults.reorders_expired["put"] += 1
            self._inner.put(*args[0], **args[1])
        if self._outbox:
            try:
                self._flush_outbox(timeout_s=0, nowait=True)
            except QlinkError:
                pass  # the link is going down; the caller's own call will say so

    def _send_faulty(self, data, *, timeout_s, nowait: bool) -> None:
        with self._fault_lock:
            self._send_faulty_locked(data, timeout_s=timeout_s, nowait=nowait)

    def _send_faulty_locked(self, data, *, timeout_s, nowait: bool) -> None:
        """Send under faults. The decision is drawn only once everything due out before has
        left, so a run is reproducible whatever the backpressure; ``send_nowait`` then
        accepts the message (it may wait in a queue of at most three: itself, its
        duplicate, a released reordered one) and ``send`` hands it to the transport."""
        self._release_due()
        if self._outbox and not self._flush_outbox(timeout_s=timeout_s, nowait=nowait):
            raise WouldBlock("emulated: earlier messages are still waiting to leave")
        nbytes = memoryview(data).nbytes
        if self._follower_due and self._faults.eligible_size(nbytes):
            # the message after a reordered one: it overtakes the held one, then the held one leaves
            kind, delay, bit = "none", 0, -1
            if self._faults.applies_to("message"):
                self._faults.eligible += 1
            follow = self._held[0] if self._held is not None else None  # (None: it left after hold_ns)
            self._held = None
            self._follower_due = False
        else:
            kind, delay, bit = self._faults.decide(nbytes)
            follow = None
        if kind == "drop":
            return
        msg = self._stamped(data, delay_ns=delay, bit=bit)
        if kind == "reorder":
            self._held = (msg, _now())
            self._follower_due = True
            return
        if nowait:
            self._outbox.append(msg)
        else:
            self._inner.send(msg, timeout_s=timeout_s)
        if kind == "dup":
            self._outbox.append(bytes(msg))
        if follow is not None:
            self._outbox.append(follow)
        if self._outbox:
            self._flush_outbox(timeout_s=timeout_s, nowait=True)

    def fault_log(self) -> list[FaultEvent]:
        """The faults injected so far (the newest ``log_capacity``), oldest first."""
        return [] if self._faults is None else list(self._faults.log)

    @property
    def fault_spec(self) -> FaultSpec | None:
        return None if self._faults is None else self._faults.spec

    @property
    def faults_enabled(self) -> bool:
        """False while the link is healed (no faults drawn); a held message still leaves."""
        return self._faults is not None and self._faults.enabled

    @faults_enabled.setter
    def faults_enabled(self, value: bool) -> None:
        if self._faults is None:
            raise ValueError("this emulated endpoint has no faults to enable or disable (give faults=...)")
        self._faults.enabled = bool(value)

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
        # The payload stays in scratch until delivered; the next fetch comes only after that
        # (a message is pending until _deliver), so scratch is reused, not reallocated: a fresh
        # megabyte buffer per message costs its page faults (~1 ms per MiB on a small VM).
        self._pending_buf = self._scratch
        self._pending = (self._arrival_ns(sent_ns, nbytes), nbytes)

    def recv_into(self, buf, *, timeout_s=None) -> int:
        self._check_open()
        if self._faults is not None:
            self._release_due(wait=False)
        deadline_ns = None if timeout_s is None else _now() + int(timeout_s * 1e9)
        self._fetch(timeout_s=timeout_s, nowait=False)
        arrival_ns, nbytes = self._pending
        self._hold_until(arrival_ns, deadline_ns, timeout_s)
        return self._deliver(buf)

    def recv_into_nowait(self, buf) -> int:
        self._check_open()
        if self._faults is not None:
            self._release_due(wait=False)
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
        if self._faults is None:
            self._inner.put(data, remote, offset=offset, notify_id=notify_id,
                            tag=_STAMP.pack(_now()) + bytes(tag), timeout_s=timeout_s)
        else:
            self._put_faulty(data, remote, offset=offset, notify_id=notify_id, tag=tag, timeout_s=timeout_s)
        self._counters.puts += 1
        self._counters.put_bytes += memoryview(data).nbytes

    def _put_faulty(self, data, remote, *, offset, notify_id, tag, timeout_s) -> None:
        with self._fault_lock:
            self._put_faulty_locked(data, remote, offset=offset, notify_id=notify_id, tag=tag, timeout_s=timeout_s)

    def _put_faulty_locked(self, data, remote, *, offset, notify_id, tag, timeout_s) -> None:
        self._release_due()
        nbytes = memoryview(data).nbytes
        follow = None
        if self._follower_due_put and self._faults.eligible_size(nbytes):
            kind, delay, bit = "none", 0, -1
            if self._faults.applies_to("put"):
                self._faults.eligible_puts += 1
            follow = self._held_put[0] if self._held_put is not None else None
            self._held_put = None
            self._follower_due_put = False
        else:
            kind, delay, bit = self._faults.decide(nbytes, what="put")
        if kind == "drop":
            return
        if bit >= 0:
            data = flip_bit(data, bit)
        args = ((data, remote), dict(offset=offset, notify_id=notify_id, tag=_STAMP.pack(_now() + delay) + bytes(tag),
                                     timeout_s=timeout_s))
        if kind == "reorder":
            args = ((bytes(memoryview(data).cast("B")), remote), args[1])  # the caller may reuse its buffer
            self._held_put = (args, _now())
            self._follower_due_put = True
            return
        self._inner.put(*args[0], **args[1])
        if kind == "dup":
            self._inner.put(*args[0], **args[1])
        if follow is not None:
            self._inner.put(*follow[0], **follow[1])

    def _unstamp(self, n: Notification, deadline_ns, timeout_s) -> Notification:
        (sent_ns,) = _STAMP.unpack_from(n.tag, 0)
        self._hold_until(self._arrival_ns(sent_ns, n.nbytes), deadline_ns, timeout_s)
        self._counters.notifications += 1
        return replace(n, tag=n.tag[_STAMP.size:])

    def wait_notification(self, *, timeout_s=None) -> Notification:
        self._check_open()
        if self._faults is not None:
            self._release_due(wait=False)
        deadline_ns = None if timeout_s is None else _now() + int(timeout_s * 1e9)
        return self._unstamp(self._inner.wait_notification(timeout_s=timeout_s), deadline_ns, timeout_s)

    def poll_notification_nowait(self) -> Notification:
        self._check_open()
        if self._faults is not None:
            self._release_due(wait=False)
        return self._unstamp(self._inner.poll_notification_nowait(), None, None)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._faults is not None:  # what was held or queued still leaves (best effort)
                try:
                    self._release_due(force=True)
                    self._flush_outbox(timeout_s=0.5, nowait=False)
                except QlinkError:
                    pass
                self._outbox.clear()
            self._inner.close()

    def statistics(self) -> Statistics:
        s = super().statistics()
        inner = self._inner.statistics()
        extra = {"link": self._model.name, "basis": "modeled", "inner_transport": inner.transport,
                 "max_late_ns": self._early_ns}
        if self._faults is not None:
            extra.update(self._faults.statistics())
            extra["fault_spec"] = self._faults.spec.to_query()
        return replace(s, extra=extra)


class EmulatedListener(Listener):
    def __init__(self, inner: Listener, model: LinkModel, seed: int, url_suffix: str,
                 faults: FaultSpec | None = None):
        self._inner = inner
        self._model = model
        self._seed = seed
        self._faults = faults
        self._accepted = 0
        self.url = f"emulated+{inner.url}{url_suffix}"

    def accept(self, *, timeout_s=None) -> Endpoint:
        ep = self._inner.accept(timeout_s=timeout_s)
        self._accepted += 1
        # each accepted endpoint draws its own fault stream (1, 2, ...); connecting sides draw stream 0
        return EmulatedEndpoint(ep, self._model, seed=self._seed + 1, faults=self._faults,
                                fault_stream=self._accepted)

    def close(self) -> None:
        self._inner.close()


def wrap(endpoint: Endpoint, *, link: str | LinkModel, seed: int = 0, faults: FaultSpec | None = None,
         fault_stream: int = 0) -> EmulatedEndpoint:
    """Wrap an already connected endpoint; both sides must wrap with the same link.
    ``faults`` applies to what this side sends."""
    model = _link(link) if isinstance(link, str) else link
    return EmulatedEndpoint(endpoint, model, seed=seed, faults=faults, fault_stream=fault_stream)


def _suffix(model: LinkModel, seed: int, faults: FaultSpec | None = None) -> str:
    out = f"?link={model.name}" + (f"&seed={seed}" if seed else "")
    if faults is not None:
        q = replace(faults, seed=0).to_query()  # the seed travels once, as seed=
        out += f"&{q}" if q else ""
    return out


def _merge_faults(url_faults: FaultSpec | None, option) -> FaultSpec | None:
    if option is None:
        return url_faults
    if not isinstance(option, FaultSpec):
        raise TypeError(f"faults= must be a transports.emulated.FaultSpec, got {type(option).__name__}")
    if url_faults is not None:
        raise ValueError("give faults either in the URL query or as faults=, not both")
    return option


def listen(url: str, *, faults: FaultSpec | None = None, **options) -> Listener:
    import transports

    inner, model, seed, url_faults = split_url_faults(url)
    faults = _merge_faults(url_faults, faults)
    if faults is not None and faults.seed != seed:
        seed = faults.seed if seed == 0 else seed
        faults = replace(faults, seed=seed)
    return EmulatedListener(transports.listen(inner, **options), model, seed, _suffix(model, seed, faults), faults)


def connect(url: str, *, timeout_s=10.0, faults: FaultSpec | None = None, **options) -> Endpoint:
    import transports

    inner, model, seed, url_faults = split_url_faults(url)
    faults = _merge_faults(url_faults, faults)
    return EmulatedEndpoint(transports.connect(inner, timeout_s=timeout_s, **options), model, seed=seed,
                            faults=faults)


def capabilities_of(url: str) -> Capabilities:
    import transports

    inner, model, _, faults = split_url_faults(url)
    caps = transports.capabilities(inner)
    if (faults is not None and faults.may_lose) or model.loss > 0:
        caps = replace(caps, reliable=False)
    if faults is not None and faults.may_reorder:
        caps = replace(caps, ordered=False)
    return replace(caps, name=f"emulated+{urlsplit(inner).scheme}[{model.name}]")


_unused = (QlinkTimeoutError,)
