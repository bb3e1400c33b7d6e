"""The two ends of a serving engine's KV link, each on a thread of its own: the prefill
side serves pulls out of its own paged cache, the decode side asks for blocks and
reports which requests landed or failed. No vLLM here (the connector in
:mod:`qlink.ai.vllm_connector` drives these), so they are testable on their own.

The protocol is push on request (vLLM's NIXL "push" flow, over qlink transports):

1. The prefill engine finishes a request and *offers* its blocks under a transfer id
   (:meth:`PrefillServer.offer`); the id, the server's URL and the block ids travel to
   the decode engine in the request's ``kv_transfer_params``.
2. The decode engine allocates blocks and sends one ``kv_pull`` frame on its link to that
   URL: the transfer id, the source and the destination block ids
   (:func:`pack_pull`). Its :class:`~qlink.ai.KVReceiver` registered the decode cache
   when the link opened.
3. The prefill side checks the pull against the offer (same blocks, or a suffix of them
   when the decode side already had a prefix) and pushes them with its
   :class:`~qlink.ai.KVSender`, layer by layer; a pull it refuses is answered with a
   ``kv_abort`` frame naming why, which fails that request on the decode side.

Push during the forward pass (when the decode engine has the request first): the decode
engine sends a ``kv_expect`` frame (:func:`pack_expect`: a transfer id both engines
were given, how many leading blocks it already holds, its destination blocks) before
the prefill engine computes the prompt. The prefill engine then *streams* the request
(:meth:`PrefillServer.begin_stream`, :meth:`~PrefillServer.stream_layer` as each layer's
KV is written, :meth:`~PrefillServer.end_streams` when the forward pass ends): every
layer leaves while the next ones are computed. An expectation that arrives too late for
the forward pass is served from the offer afterwards, as a pull.

A link that carries nothing for ``idle_timeout_s`` (and has nothing of its own pending),
or holds half a frame for ``frame_timeout_s``, is closed by the prefill side with a
``kv_abort`` frame for request id 0xFFFFFFFF (which no load uses) whose reason says why,
``qlink-close idle_timeout: ...``; a decode client opens a new link at its next load, and
a load whose frame crossed that close on the wire is asked again on the new link.

>>> close_notice_reason(fr.pack_abort(CLOSE_RID, status=0, layer=0, reason="qlink-close idle_timeout: 9 s"))
'idle_timeout'
>>> f = pack_pull(7, xfer_id=3, src_block_ids=[5, 6], dst_block_ids=[0, 1])
>>> unpack_pull(f)
(7, 3, [5, 6], [0, 1])
>>> from qlink import wire
>>> wire.decode_request(f).function
'kv_pull'
>>> unpack_expect(pack_expect(8, xfer_id=9, skip_blocks=1, dst_block_ids=[4, 2]))
(8, 9, 1, [4, 2])
"""

from __future__ import annotations

import itertools
import struct
from collections import Counter
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from qlink import wire
from qlink.errors import BrokenLinkError, QlinkError, QlinkTimeoutError, WireError, WouldBlock
from transports import Backoff, BufferTooSmallError

from . import frames as fr
from ._tracker import TransferAbortedError

__all__ = ["PrefillServer", "DecodeClient", "LoadResult", "pack_pull", "unpack_pull", "pack_expect", "unpack_expect",
           "FN_PULL", "FN_EXPECT", "CLOSE_RID", "close_notice_reason"]

_PULL = struct.Struct(wire.REQUEST_HEADER.format + "II")  # the header, then xfer_id, num_blocks; then 2 * num_blocks u32
_MAX_PULL_BLOCKS = 1 << 16
FN_PULL = wire.register_function("kv_pull", min_payload_nbytes=_PULL.size - fr.HEADER.size,
                                 max_payload_nbytes=_PULL.size - fr.HEADER.size + 8 * _MAX_PULL_BLOCKS)
_EXPECT = struct.Struct(wire.REQUEST_HEADER.format + "III")  # the header, then xfer_id, skip_blocks, num_blocks; then num_blocks u32
FN_EXPECT = wire.register_function("kv_expect", min_payload_nbytes=_EXPECT.size - fr.HEADER.size,
                                   max_payload_nbytes=_EXPECT.size - fr.HEADER.size + 4 * _MAX_PULL_BLOCKS)
_ABORT_REFUSED = 2  # BAD_REQUEST: the pull names blocks that were not offered
_IDLE_SLEEP_MAX_S = 2e-4
_ENGINE_POLLS_S = 2e-3  # poll() called this recently: the client's own thread stands by
_QUIET_WAIT_S = 0.02  # nothing outstanding: a link thread waits this long for work (_Idle)
_HELD_WAIT_S = 1e-3  # work held that the engine's thread wakes it for (a stream): this long between progress calls
_PULLS_PER_TURN = 64  # one link's frames handled before the next link's turn
_LINK_TIMERS_S = 0.05  # how often the links' idle and half-frame clocks are looked at
CLOSE_RID = 0xFFFFFFFF  # the request id of a close notice (see the module docstring)
_CLOSE_PREFIX = "qlink-close "


def close_notice_reason(frame) -> str | None:
    """The reason (``idle_timeout``, ``frame_timeout``) if ``frame`` is a prefill server's
    close notice, else None."""
    try:
        if fr.function_of(frame) != fr.FN_ABORT:
            return None
        rid, _status, _layer, reason = fr.unpack_abort(frame)
    except WireError:
        return None
    if rid != CLOSE_RID or not reason.startswith(_CLOSE_PREFIX):
        return None
    return reason[len(_CLOSE_PREFIX):].partition(":")[0]


def pack_pull(request_id: int, *, xfer_id: int, src_block_ids, dst_block_ids) -> bytes:
    """A ``kv_pull`` frame: push ``src_block_ids`` of offer ``xfer_id`` into my
    ``dst_block_ids`` under ``request_id`` (the id my receiver waits on)."""
    src = np.asarray(src_block_ids, dtype="<u4")
    dst = np.asarray(dst_block_ids, dtype="<u4")
    if src.shape != dst.shape or src.ndim != 1 or not 0 < src.size <= _MAX_PULL_BLOCKS:
        raise ValueError(f"a pull names 1 to {_MAX_PULL_BLOCKS} source and as many destination blocks, "
                         f"got {src.size} and {dst.size}")
    head = _PULL.pack(fr.MAGIC_REQUEST, FN_PULL, _PULL.size - fr.HEADER.size + 8 * src.size, request_id, 0,
                      xfer_id, src.size)
    return head + src.tobytes() + dst.tobytes()


def unpack_pull(frame) -> tuple[int, int, list[int], list[int]]:
    """``(request_id, xfer_id, src_block_ids, dst_block_ids)``; WireError when malformed."""
    if fr.function_of(frame) != FN_PULL or len(frame) < _PULL.size:
        raise WireError(f"not a kv_pull frame ({len(frame)} B)")
    _, _, _, rid, _, xfer_id, n = _PULL.unpack_from(frame, 0)
    if n < 1 or len(frame) != _PULL.size + 8 * n:
        raise WireError(f"kv_pull announces {n} blocks but carries {len(frame) - _PULL.size} B of block ids")
    ids = np.frombuffer(frame, dtype="<u4", count=2 * n, offset=_PULL.size)
    return rid, xfer_id, ids[:n].tolist(), ids[n:].tolist()


def pack_expect(request_id: int, *, xfer_id: int, skip_blocks: int, dst_block_ids) -> bytes:
    """A ``kv_expect`` frame: push transfer ``xfer_id``'s blocks, after its first
    ``skip_blocks``, into my ``dst_block_ids`` under ``request_id`` as they are computed."""
    dst = np.asarray(dst_block_ids, dtype="<u4")
    if dst.ndim != 1 or not 0 < dst.size <= _MAX_PULL_BLOCKS or skip_blocks < 0:
        raise ValueError(f"an expectation names 1 to {_MAX_PULL_BLOCKS} destination blocks and skip_blocks >= 0, "
                         f"got {dst.size} and {skip_blocks}")
    head = _EXPECT.pack(fr.MAGIC_REQUEST, FN_EXPECT, _EXPECT.size - fr.HEADER.size + 4 * dst.size, request_id, 0,
                        xfer_id, skip_blocks, dst.size)
    return head + dst.tobytes()


def unpack_expect(frame) -> tuple[int, int, int, list[int]]:
    """``(request_id, xfer_id, skip_blocks, dst_block_ids)``; WireError when malformed."""
    if fr.function_of(frame) != FN_EXPECT or len(frame) < _EXPECT.size:
        raise WireError(f"not a kv_expect frame ({len(frame)} B)")
    _, _, _, rid, _, xfer_id, skip, n = _EXPECT.unpack_from(frame, 0)
    if n < 1 or len(frame) != _EXPECT.size + 4 * n:
        raise WireError(f"kv_expect announces {n} blocks but carries {len(frame) - _EXPECT.size} B of block ids")
    return rid, xfer_id, skip, np.frombuffer(frame, dtype="<u4", count=n, offset=_EXPECT.size).tolist()


def _backoff() -> Backoff:
    """Spin a little, then sleep with a doubling pause (an idle link costs no core)."""
    return Backoff(spin=200, min_sleep_s=1e-5, max_sleep_s=_IDLE_SLEEP_MAX_S)


class _Idle:
    """How a link thread waits between turns. While frames are due over its links (a load
    in flight, an offer waiting for its pull), :func:`_backoff`'s short sleeps: a frame is
    seen within 200 µs. While it holds only work that the engine's thread hands over
    through ``wake`` (a stream's next layer, an expectation waiting for its prefill), a
    wait of up to ``_HELD_WAIT_S`` on ``wake``; with nothing at all, up to
    ``_QUIET_WAIT_S``. A waiting link thread then neither takes a core's time slices nor
    holds the GIL against the engine's forward pass: a thread that polls in Python while
    the forward pass runs holds the GIL for a whole switch interval (5 ms) each time a
    torch op wants it back. Several engines on a few cores (a bench, a test) no longer
    slow each other down while they wait, and a streamed prefill no longer slows down
    its own forward pass.

    >>> import threading
    >>> idle = _Idle(threading.Event())
    >>> idle.wake.set(); idle.pause(frames_due=False)  # work handed over: no wait
    >>> idle.wake.is_set()
    False
    """

    __slots__ = ("wake", "_backoff")

    def __init__(self, wake: threading.Event) -> None:
        self.wake = wake
        self._backoff = _backoff()

    def worked(self) -> None:
        self._backoff.reset()

    def pause(self, *, frames_due: bool, work_held: bool = False) -> None:
        if frames_due:
            self._backoff.pause(self.wake)
        elif self.wake.wait(_HELD_WAIT_S if work_held else _QUIET_WAIT_S):
            self.wake.clear()
            self._backoff.reset()


@dataclass
class _Offer:
    block_ids: list[int]
    key: str
    expires: float


@dataclass
class _Link:
    endpoint: object
    sender: object
    pending: deque = field(default_factory=deque)  # pulls that arrived before their offer
    last_frame: float = field(default_factory=time.monotonic)  # when its last frame (or its handshake) came
    partial_since: float | None = None  # since when half a frame waits in its read-ahead


@dataclass
class _Expect:
    link: _Link
    rid: int
    skip: int
    dst: list


@dataclass
class _Stream:
    """A request whose layers go out during the forward pass (see :meth:`PrefillServer.begin_stream`)."""

    xfer_id: int
    key: str
    src: list
    begun_ns: int
    expect: _Expect | None = None
    req: object = None
    missed: bool = False  # no expectation when its first layer was written: served from the offer
    sent_ns: list = field(default_factory=list)  # (layer, time.monotonic_ns() when it left)
    ended_ns: int = 0


class PrefillServer:
    """Listens on ``url``; every decode engine that connects gets a
    :class:`~qlink.ai.KVSender` over ``cache`` (the engine's own paged cache, registered
    in place). :meth:`offer` makes a finished request's blocks pullable;
    :meth:`take_done` returns the keys of offers pushed (or expired unpulled), whose
    blocks the engine may then free.

    ``checksum=True`` sends a CRC-32 with every part (the receiver checks it).

    Limits, as the decoder service's (:mod:`qlink.qec.sessions`): each new link's handshake
    runs on a thread of its own and must finish within ``handshake_timeout_s`` (a silent
    peer holds up no other); at most ``max_links`` links (more are closed at once); a
    link's turn handles at most 64 pulls; a frame longer than the largest pull is refused
    from its header and its link closed; a link without a frame for ``idle_timeout_s``
    (nothing of its own pending: no pull waiting for its offer, no expectation) or with half
    a frame for ``frame_timeout_s`` is closed with a close notice (see the module
    docstring), ``None`` turns either off. ``url`` beyond loopback needs ``token`` (decode
    engines connect with the same ``token=``) or ``insecure=True``. ``refused_by_reason``
    counts refused peers, ``closed_by_reason`` the links closed by these timeouts.
    """

    def __init__(self, url: str, cache, *, checksum: bool = False, offer_ttl_s: float = 120.0,
                 push_timeout_s: float = 30.0, token: str | bytes | None = None, insecure: bool = False,
                 max_links: int = 64, handshake_timeout_s: float = 10.0, idle_timeout_s: float | None = 300.0,
                 frame_timeout_s: float | None = 1.0):
        import transports

        from qlink.access import check_bind, token_bytes

        key = token_bytes(token)
        check_bind(url, token=key, insecure=insecure)
        if key is not None and not url.startswith("tcp://"):
            raise ValueError(f"a shared token is checked over tcp:// only, not {url.split('://')[0]}://")
        self.cache = cache
        self.checksum = checksum
        self.offer_ttl_s = offer_ttl_s
        self.push_timeout_s = push_timeout_s
        self.max_links = int(max_links)
        self.handshake_timeout_s = float(handshake_timeout_s)
        for name, v in (("idle_timeout_s", idle_timeout_s), ("frame_timeout_s", frame_timeout_s)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{name} must be a positive number of seconds or None (no limit), got {v!r}")
        self.idle_timeout_s = idle_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self.refused_by_reason: Counter = Counter()
        self.closed_by_reason: Counter = Counter()
        self._handshaking = 0
        self.listener = transports.listen(url, **({"token": key} if key is not None else {}))
        self.url = self.listener.url
        self._lock = threading.Lock()
        self._offers: dict[int, _Offer] = {}
        self._done: list[str] = []
        self._new_links: list[_Link] = []
        self._links: list[_Link] = []
        self.pushed = self.refused = self.expired = self.failed = 0
        self.streamed = 0  # requests whose every layer left during the forward pass
        self.errors: list[str] = []
        self._cmds: deque = deque()  # stream commands from the engine's thread, done by the serve thread
        self._expects: dict[int, _Expect] = {}
        self._streams: dict[int, _Stream] = {}  # begun, not yet ended
        self._streamed: dict[int, _Stream] = {}  # every layer out, its offer not yet seen
        self.stream_log: deque = deque(maxlen=1024)  # dicts: key, xfer_id, begun_ns, sent_ns, ended_ns
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accept_thread = threading.Thread(target=self._accept_loop, name="qlink-kv-accept", daemon=True)
        self._serve_thread = threading.Thread(target=self._serve_loop, name="qlink-kv-serve", daemon=True)
        self._accept_thread.start()
        self._serve_thread.start()

    # ----- called by the engine ------------------------------------------------------
    def offer(self, xfer_id: int, block_ids, *, key: str) -> None:
        """Make ``block_ids`` pullable as ``xfer_id``; ``key`` comes back from
        :meth:`take_done` once they were pushed (or the offer expired)."""
        with self._lock:
            self._offers[int(xfer_id)] = _Offer([int(b) for b in block_ids], key,
                                               time.monotonic() + self.offer_ttl_s)
        self._wake.set()

    def take_done(self) -> list[str]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def begin_stream(self, xfer_id: int, block_ids, *, key: str) -> None:
        """The forward pass about to run computes all of request ``key``'s prompt into
        ``block_ids``: push its layers as :meth:`stream_layer` says they are written,
        to the decode engine that sent a ``kv_expect`` for ``xfer_id``."""
        self._cmds.append(("begin", int(xfer_id), [int(b) for b in block_ids], key, time.monotonic_ns()))
        self._wake.set()

    def stream_layer(self, layer: int) -> None:
        """Layer ``layer`` of every begun stream is written (called from the forward pass)."""
        self._cmds.append(("layer", int(layer)))
        self._wake.set()

    def end_streams(self) -> None:
        """The forward pass ended: the begun streams have all their layers."""
        self._cmds.append(("end", time.monotonic_ns()))
        self._wake.set()

    @property
    def num_expected(self) -> int:
        """Expectations received and not yet served."""
        return len(self._expects)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._accept_thread.join(5)
        self._serve_thread.join(5)
        for link in self._links + self._new_links:
            try:
                link.sender.close()
            except QlinkError:
                pass
            link.endpoint.close()
        self.listener.close()

    # ----- threads -------------------------------------------------------------------
    def _accept_loop(self) -> None:
        from .engine import KVSender

        while not self._stop.is_set():
            try:
                ep = self.listener.accept(timeout_s=0.2)
            except QlinkTimeoutError:
                continue
            except QlinkError as e:
                if not self._stop.is_set():
                    self.errors.append(f"accept: {e}")
                return
            with self._lock:
                full = len(self._links) + len(self._new_links) + self._handshaking >= self.max_links
                if not full:
                    self._handshaking += 1
            if full:
                self.refused_by_reason["max_links"] += 1
                ep.close()
                continue
            threading.Thread(target=self._handshake, args=(ep, KVSender), name="qlink-kv-handshake",
                             daemon=True).start()
        refused = getattr(self.listener, "refused_by_reason", None)
        if refused:
            self.refused_by_reason.update(refused)

    def _handshake(self, ep, sender_cls) -> None:
        """One new link's handshake, off the accept loop (a silent peer holds up no other)."""
        try:
            tx = sender_cls(ep, self.cache, checksum=self.checksum)
            tx.handshake(timeout_s=self.handshake_timeout_s)
        except QlinkError as e:  # a bad peer (layout mismatch, gone, silent): drop it, keep serving
            self.errors.append(f"handshake: {type(e).__name__}: {e}")
            self.refused_by_reason["handshake_timeout" if isinstance(e, QlinkTimeoutError) else "handshake"] += 1
            ep.close()
            with self._lock:
                self._handshaking -= 1
            return
        with self._lock:
            self._handshaking -= 1
            self._new_links.append(_Link(ep, tx))
        self._wake.set()

    def _serve_loop(self) -> None:
        buf = bytearray(_PULL.size + 8 * _MAX_PULL_BLOCKS)
        mv = memoryview(buf)
        idle = _Idle(self._wake)
        next_expiry = next_timers = 0.0
        while not self._stop.is_set():
            with self._lock:
                if self._new_links:
                    self._links.extend(self._new_links)
                    self._new_links.clear()
            busy = False
            for link in list(self._links):  # first: expectations that arrived before a stream's first layer
                try:
                    busy |= self._serve_link(link, mv)
                except BrokenLinkError:
                    self._links.remove(link)  # that decode engine is gone; others go on
                    self._drop_expects(link)
                    link.endpoint.close()
            busy |= self._run_commands()
            busy |= self._resolve()
            now = time.monotonic()
            if now >= next_expiry:
                self._expire(now)
                next_expiry = now + 0.5
            if now >= next_timers:
                self._link_timers(now)
                next_timers = now + _LINK_TIMERS_S
            if busy:
                idle.worked()
            else:
                idle.pause(frames_due=bool(self._offers) or any(link.pending for link in self._links),
                           work_held=bool(self._expects or self._streams or self._streamed or self._cmds))

    # ----- streams (push during the forward pass) ---------------------------------------
    def _run_commands(self) -> bool:
        busy = False
        while self._cmds:
            busy = True
            cmd = self._cmds.popleft()
            if cmd[0] == "begin":
                _, xfer_id, src, key, t = cmd
                self._streams[xfer_id] = _Stream(xfer_id, key, src, t)
            elif cmd[0] == "layer":
                for st in list(self._streams.values()):
                    self._stream_layer(st, cmd[1])
            else:
                for st in self._streams.values():
                    st.ended_ns = cmd[1]
                    self._end_stream(st)
                self._streams.clear()
        return busy

    def _stream_layer(self, st: _Stream, layer: int) -> None:
        if st.missed:
            return
        if st.req is None:
            ex = self._expects.pop(st.xfer_id, None)
            if ex is None or layer != 0:  # too late for this forward pass: the offer serves it
                st.missed = True
                if ex is not None:
                    self._expects[st.xfer_id] = ex
                return
            src = st.src[ex.skip:ex.skip + len(ex.dst)]
            st.expect = ex
            if len(src) != len(ex.dst):
                self._refuse(ex.link, ex.rid, f"expectation for {len(ex.dst)} blocks after {ex.skip}, but transfer "
                                              f"{st.xfer_id} computes {len(st.src)}")
                st.missed, st.expect = True, None
                return
            try:
                st.req = ex.link.sender.begin_request(ex.rid, src, ex.dst, timeout_s=self.push_timeout_s)
            except QlinkError as e:
                self._refuse(ex.link, ex.rid, f"push of transfer {st.xfer_id} failed: {type(e).__name__}: {e}")
                st.missed, st.expect = True, None
                return
        try:
            st.req.send_layer(layer, timeout_s=self.push_timeout_s)
            st.sent_ns.append((layer, time.monotonic_ns()))
        except QlinkError as e:
            self.failed += 1
            self.errors.append(f"stream of transfer {st.xfer_id}, layer {layer}: {type(e).__name__}: {e}")
            st.missed, st.req = True, None  # the decode side times out or sees the broken link

    def _end_stream(self, st: _Stream) -> None:
        self.stream_log.append(dict(key=st.key, xfer_id=st.xfer_id, begun_ns=st.begun_ns, sent_ns=list(st.sent_ns),
                                    ended_ns=st.ended_ns, streamed=st.req is not None and not st.missed))
        if st.req is None or st.missed:
            return
        try:
            st.expect.link.sender.flush(timeout_s=self.push_timeout_s)
        except QlinkError as e:
            self.failed += 1
            self.errors.append(f"stream of transfer {st.xfer_id}: {type(e).__name__}: {e}")
        self.streamed += 1
        self._streamed[st.xfer_id] = st

    def _resolve(self) -> bool:
        """Offers whose request streamed are done; expectations whose offer is here (and
        whose request is not streaming) are pushed from the offer."""
        busy = False
        with self._lock:
            ready = [(x, self._offers[x]) for x in list(self._streamed) if x in self._offers]
            for x, offer in ready:
                del self._offers[x]
                del self._streamed[x]
                self._done.append(offer.key)
                self.pushed += 1
            late = [(x, self._offers[x]) for x in self._expects if x in self._offers and x not in self._streams]
        for x, offer in late:
            ex = self._expects.pop(x)
            busy = True
            src = offer.block_ids[ex.skip:ex.skip + len(ex.dst)]
            if len(src) != len(ex.dst):
                self._refuse(ex.link, ex.rid, f"expectation for {len(ex.dst)} blocks after {ex.skip}, but transfer "
                                              f"{x} offered {len(offer.block_ids)}")
                continue
            self._push(ex.link, ex.rid, x, offer, src, ex.dst)
        return busy or bool(ready)

    def _link_timers(self, now: float) -> None:
        """Close the links whose half frame or silence has lasted too long (see the class docstring)."""
        for link in list(self._links):
            if link.partial_since is not None and self.frame_timeout_s is not None \
                    and now - link.partial_since >= self.frame_timeout_s:
                self._close_link(link, "frame_timeout", f"a frame stayed half received for {self.frame_timeout_s} s")
            elif self.idle_timeout_s is not None and now - link.last_frame >= self.idle_timeout_s \
                    and not link.pending and not any(ex.link is link for ex in self._expects.values()) \
                    and not any(st.expect is not None and st.expect.link is link for st in self._streams.values()):
                self._close_link(link, "idle_timeout", f"no frame for {self.idle_timeout_s} s")

    def _close_link(self, link: _Link, reason: str, detail: str) -> None:
        self.closed_by_reason[reason] += 1
        self._links.remove(link)
        self._drop_expects(link)
        ep = link.endpoint
        try:
            ep.send_nowait(fr.pack_abort(CLOSE_RID, status=_ABORT_REFUSED if reason == "frame_timeout" else 0,
                                         layer=0, reason=f"{_CLOSE_PREFIX}{reason}: {detail}"))
        except (QlinkError, OSError):
            pass  # a peer that does not read: closed all the same
        try:
            link.sender.close()
        except QlinkError:
            pass
        try:
            ep.close()
        except (QlinkError, OSError):
            pass

    def _drop_expects(self, link: _Link) -> None:
        for x in [x for x, ex in self._expects.items() if ex.link is link]:
            del self._expects[x]

    def _refuse(self, link: _Link, rid: int, reason: str) -> None:
        self.refused += 1
        try:
            link.endpoint.send(fr.pack_abort(rid, status=_ABORT_REFUSED, layer=0, reason=reason), timeout_s=5)
        except QlinkError:
            pass

    def _serve_link(self, link: _Link, mv) -> bool:
        ep, tx = link.endpoint, link.sender
        busy = False
        for _ in range(len(link.pending)):  # pulls waiting for their offer
            frame = link.pending.popleft()
            busy |= self._serve_pull(link, frame, requeue=True)
        got = 0
        drained = False
        for _ in range(_PULLS_PER_TURN):
            try:
                n = ep.recv_into_nowait(mv)
            except WouldBlock:
                drained = True
                break
            except BufferTooSmallError as e:  # longer than any pull: refused from its header, link closed
                self.refused_by_reason["oversized_frame"] += 1
                self.errors.append(f"a frame of {e.needed_nbytes} bytes announced, longer than any kv_pull "
                                   f"({len(mv)} bytes); link closed")
                abort = getattr(ep, "abort", None)
                if abort is not None:
                    abort()
                raise BrokenLinkError("the decode engine announced an oversized frame") from e
            busy = True
            got += 1
            frame = bytes(mv[:n])
            if fr.function_of(frame) == FN_EXPECT:
                self._take_expect(link, frame)
            else:
                self._serve_pull(link, frame, requeue=True)
        if got:
            link.last_frame = time.monotonic()
            link.partial_since = None
        if drained and link.partial_since is None and getattr(ep, "rx_buffered_nbytes", 0):
            link.partial_since = time.monotonic()  # half a frame is here: its clock starts
        tx.progress()
        return busy

    def _take_expect(self, link: _Link, frame: bytes) -> None:
        try:
            rid, xfer_id, skip, dst = unpack_expect(frame)
        except WireError as e:
            self.errors.append(f"bad expect frame: {e}")
            return
        if xfer_id in self._expects or xfer_id in self._streamed:
            self._refuse(link, rid, f"transfer {xfer_id} is already expected or pushed")
            return
        self._expects[xfer_id] = _Expect(link, rid, skip, dst)

    def _serve_pull(self, link: _Link, frame: bytes, *, requeue: bool) -> bool:
        try:
            rid, xfer_id, src, dst = unpack_pull(frame)
        except WireError as e:
            self.errors.append(f"bad pull frame: {e}")
            return False
        with self._lock:
            offer = self._offers.get(xfer_id)
        if offer is None:
            if requeue and len(link.pending) < 4096:
                link.pending.append(frame)  # the offer may be on its way from the scheduler
                return False
            return False
        ids = offer.block_ids
        k = len(ids) - len(src)
        if k < 0 or ids[k:] != src:  # a suffix of the offer (the decode side may hold a prefix)
            self.refused += 1
            link.endpoint.send(fr.pack_abort(rid, status=_ABORT_REFUSED, layer=0,
                                             reason=f"pull names blocks {src[:8]}… that transfer {xfer_id} did not "
                                                    f"offer ({len(ids)} blocks offered)"), timeout_s=5)
            return True
        self._push(link, rid, xfer_id, offer, src, dst)
        return True

    def _push(self, link: _Link, rid: int, xfer_id: int, offer: _Offer, src, dst) -> None:
        """Push an offer's blocks now (a pull, or an expectation too late for the forward pass)."""
        try:
            link.sender.send_request(rid, src, dst, timeout_s=self.push_timeout_s)
            link.sender.flush(timeout_s=self.push_timeout_s)
            self.pushed += 1
        except BrokenLinkError:
            raise
        except QlinkError as e:  # e.g. BlockIdError (nothing sent): say so, so the decode side does not wait
            self.failed += 1
            self.errors.append(f"push of transfer {xfer_id}: {type(e).__name__}: {e}")
            link.endpoint.send(fr.pack_abort(rid, status=_ABORT_REFUSED, layer=0,
                                             reason=f"push of transfer {xfer_id} failed: {type(e).__name__}: {e}"),
                               timeout_s=5)
        with self._lock:
            self._offers.pop(xfer_id, None)
            self._done.append(offer.key)

    def _expire(self, now: float) -> None:
        with self._lock:
            gone = [x for x, o in self._offers.items() if o.expires <= now and x not in self._streams]
            for x in gone:
                self._done.append(self._offers.pop(x).key)
                self.expired += 1


def _notice_reason(tracker) -> str | None:
    """The reason of a close notice already accounted by ``tracker``, if one came (nothing is read)."""
    try:
        tracker.record(CLOSE_RID)
    except TransferAbortedError as e:
        text = str(e)
        if _CLOSE_PREFIX in text:
            return text.split(_CLOSE_PREFIX, 1)[1].partition(":")[0]
    except QlinkError:
        pass
    return None


def _close_notice(rx) -> str | None:
    """The reason of the close notice ``rx``'s sender sent before closing the link, if it did
    (frames still read ahead are taken first: the break may have been seen before them)."""
    reason = _notice_reason(rx._tracker)
    if reason is None:
        try:
            rx._poll_frames(64)
        except (QlinkError, OSError, ValueError):
            pass
        reason = _notice_reason(rx._tracker)
    return reason


@dataclass(frozen=True)
class LoadResult:
    """One finished load: ``ok`` or the ``error`` that failed it, the destination blocks,
    and when it was asked for and landed (``time.monotonic_ns``)."""

    key: str
    ok: bool
    dst_block_ids: tuple[int, ...]
    asked_ns: int
    done_ns: int
    error: str = ""
    nbytes: int = 0
    reported_ns: int = 0  # when the engine was told (set by the connector)


@dataclass
class _Load:
    key: str
    rid: int
    url: str
    xfer_id: int
    src: list | None  # None: an expectation (the prefill engine pushes as it computes)
    dst: list
    deadline: float
    asked_ns: int = 0
    skip: int = 0


class DecodeClient:
    """The decode side: one link (and one :class:`~qlink.ai.KVReceiver` over ``cache``)
    per prefill URL, opened on first use. :meth:`load` queues a pull; :meth:`take_results`
    returns the loads that finished since, landed or failed (a link that breaks, a sender
    that aborts, a CRC-32 that does not match, or ``load_timeout_s`` passing).

    ``after_land`` (optional) is called with ``(key, dst_block_ids)`` on this client's
    thread when a load lands, before it is reported (a test uses it to change a block).

    A link the prefill server closed with a close notice (an idle link) is dropped and
    opened again at the next load; loads in flight on it were not read by the server
    and are asked again on the new link. ``links_closed_by_server`` counts those closes
    by reason.
    """

    def __init__(self, cache, *, load_timeout_s: float = 30.0, connect_timeout_s: float = 10.0, after_land=None,
                 token: str | bytes | None = None):
        self.token = token  # proved to tcp:// prefill servers that want one
        self.cache = cache
        self.load_timeout_s = load_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.after_land = after_land
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        self._queue: list[_Load] = []
        self._results: list[LoadResult] = []
        self._links: dict[str, tuple] = {}  # url -> (endpoint, receiver)
        self.links_closed_by_server: Counter = Counter()
        self._inflight: dict[int, _Load] = {}
        self._work = threading.Lock()  # held by whoever does the client's work (its thread or poll())
        self._polled = 0.0  # when poll() was last called
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by load(): the thread's quiet wait ends
        self._thread = threading.Thread(target=self._loop, name="qlink-kv-load", daemon=True)
        self._thread.start()

    def load(self, key: str, *, url: str, xfer_id: int, src_block_ids, dst_block_ids, skip_blocks: int = 0) -> None:
        """Queue a pull of ``src_block_ids`` into ``dst_block_ids``; with ``src_block_ids=None``
        an expectation instead: the prefill engine pushes transfer ``xfer_id``'s blocks after
        its first ``skip_blocks`` as it computes them."""
        src = None if src_block_ids is None else [int(b) for b in src_block_ids]
        ld = _Load(key, next(self._rids) & 0xFFFFFFFF, url, int(xfer_id), src,
                   [int(b) for b in dst_block_ids], time.monotonic() + self.load_timeout_s, skip=int(skip_blocks))
        with self._lock:
            self._queue.append(ld)
        self._wake.set()

    def take_results(self) -> list[LoadResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._queue or self._inflight)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)
        with self._work:
            self._close_links()

    def _close_links(self) -> None:
        for ep, rx in self._links.values():
            rx.close()
            ep.close()
        self._links.clear()

    # ----- the thread ----------------------------------------------------------------
    def _finish(self, ld: _Load, *, ok: bool, error: str = "", nbytes: int = 0) -> None:
        if ok and self.after_land is not None:
            self.after_land(ld.key, tuple(ld.dst))
        with self._lock:
            self._results.append(LoadResult(ld.key, ok, tuple(ld.dst), ld.asked_ns, time.monotonic_ns(), error,
                                            nbytes))

    def _link(self, url: str):
        import transports

        from ._receiver import KVReceiver

        link = self._links.get(url)
        if link is None:
            opts = {"token": self.token} if self.token is not None and url.startswith("tcp://") else {}
            ep = transports.connect(url, timeout_s=self.connect_timeout_s, **opts)
            try:
                rx = KVReceiver(ep, self.cache)
                rx.handshake(timeout_s=self.connect_timeout_s)
            except BaseException:
                ep.close()
                raise
            link = self._links[url] = (ep, rx)
        return link

    def _drop_link(self, url: str, why: str) -> None:
        ep, rx = self._links.pop(url, (None, None))
        closed = None if rx is None else _close_notice(rx)
        if closed is not None:
            self.links_closed_by_server[closed] += 1
        for rid, ld in list(self._inflight.items()):
            if ld.url == url:
                del self._inflight[rid]
                if closed is not None and time.monotonic() < ld.deadline:  # its frame crossed the close: again
                    ld.rid = next(self._rids) & 0xFFFFFFFF
                    with self._lock:
                        self._queue.append(ld)
                    continue
                self._finish(ld, ok=False, error=why)
        if rx is not None:
            rx.close()
            ep.close()

    def poll(self) -> bool:
        """Do the client's work once in the calling thread (the engine's, between its steps:
        no thread switch on the way), unless its own thread is at it; True if anything moved."""
        self._polled = time.monotonic()
        if not self._work.acquire(blocking=False):
            return False
        try:
            return self._step()
        finally:
            self._work.release()

    def _loop(self) -> None:
        idle = _Idle(self._wake)
        while not self._stop.is_set():
            if not self.busy:  # nothing asked for: wait for a load (the links' notices keep till then)
                idle.pause(frames_due=False)
            if time.monotonic() - self._polled < _ENGINE_POLLS_S:
                time.sleep(_ENGINE_POLLS_S)  # the engine's thread is doing the work: do not contend for the GIL
                continue
            with self._work:
                moved = self._step()
            if moved:
                idle.worked()
            elif self.busy:  # (with nothing in flight the next turn waits at the top)
                idle.pause(frames_due=True)

    def _step(self) -> bool:
        with self._lock:
            queue, self._queue = self._queue, []
        busy = bool(queue)
        for ld in queue:
            self._start(ld)
        for url in list(self._links):
            busy |= self._poll(url)
        if self._inflight:
            now = time.monotonic()
            for rid, ld in list(self._inflight.items()):
                if now > ld.deadline:
                    del self._inflight[rid]
                    link = self._links.get(ld.url)
                    if link is not None:
                        link[1].release(rid)
                    self._finish(ld, ok=False, error=f"KV of transfer {ld.xfer_id} from {ld.url} did not land "
                                                     f"within load_timeout_s={self.load_timeout_s}")
        return busy

    def _start(self, ld: _Load) -> None:
        ld.asked_ns = time.monotonic_ns()
        try:
            ep, _ = self._link(ld.url)
            frame = (pack_expect(ld.rid, xfer_id=ld.xfer_id, skip_blocks=ld.skip, dst_block_ids=ld.dst)
                     if ld.src is None else
                     pack_pull(ld.rid, xfer_id=ld.xfer_id, src_block_ids=ld.src, dst_block_ids=ld.dst))
            ep.send(frame, timeout_s=5)
        except (QlinkError, OSError, ValueError) as e:
            self._inflight[ld.rid] = ld  # (asked again if the server had closed the link with a notice)
            if ld.url in self._links:
                self._drop_link(ld.url, f"cannot pull from {ld.url}: link failed: {type(e).__name__}: {e}")
            if self._inflight.pop(ld.rid, None) is not None:
                self._finish(ld, ok=False, error=f"cannot pull from {ld.url}: {type(e).__name__}: {e}")
            return
        self._inflight[ld.rid] = ld

    def _poll(self, url: str) -> bool:
        _, rx = self._links[url]
        try:
            n = rx.progress()
        except BrokenLinkError as e:
            self._drop_link(url, f"the prefill engine at {url} went away mid-transfer ({e.__cause__ or e})")
            return True
        tr = rx._tracker
        broken = tr.broken
        for rid, ld in list(self._inflight.items()):
            if ld.url != url:
                continue
            try:
                rec = tr.record(rid)
            except (TransferAbortedError, QlinkError) as e:
                if broken is not None:
                    continue  # lost with the link: said so below
                del self._inflight[rid]
                rx.release(rid)
                self._finish(ld, ok=False, error=str(e))
                continue
            if rec is not None:  # landed (even if the link broke right after)
                del self._inflight[rid]
                rx.release(rid)
                self._finish(ld, ok=True, nbytes=rec.nbytes)
        if broken is not None:  # every request still in flight on this link is lost
            self._drop_link(url, f"the prefill engine at {url} went away mid-transfer ({broken})")
            return True
        if _notice_reason(tr) is not None:  # the server said it closes the link: no need to wait for the end of stream
            self._drop_link(url, f"the prefill engine at {url} closed the link")
            return True
        return bool(n)
