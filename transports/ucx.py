"""``ucx://host:port``: messages and one-sided put over UCX (UCXX), polled from the caller's thread.

The endpoint drives a UCX worker from the thread that calls it (progress + tag probes in a
bounded busy-poll, then backoff): no event loop and no progress thread sit on the path.
UCXX creates the context, worker and endpoints; the per-message calls go straight to UCP
on UCXX's handles (``hot_path="ucp"``, the default) or through UCXX's Python core API
(``hot_path="ucxx"``), see :mod:`transports._ucx_core`.

How a connection is made and watched
    ``listen`` binds a small TCP *bootstrap* socket (``127.0.0.1`` unless another address is
    given; port 0 picks a free port, ``Listener.url`` names it). ``connect`` opens it, both
    sides swap a hello (connection id, token, UCX worker address; see
    :mod:`transports._ucx_boot`), create a UCX endpoint to the other's worker and swap one
    control frame over UCX before returning, so the data path is up and proven. The
    bootstrap socket stays open as a liveness wire: a peer that exits or is killed closes
    it, and every wait looks at it at least every 20 ms, so a dead peer surfaces as
    :class:`~qlink.errors.BrokenLinkError` well within a second. (UCXX's own listener binds
    every interface and takes no address, which is why the bootstrap socket is ours.)

Transports
    ``UCX_TLS`` from the environment wins; otherwise the contexts made here use
    ``tcp,sm,self``. For a loopback address UCX's TCP transport also stays on the loopback
    device (``NET_DEVICES=lo``) unless ``UCX_NET_DEVICES`` is set. By default endpoints use
    UCX's error-handling mode *none*, which lets UCX pick shared memory between processes
    on one host (sysv/posix eager, CMA rendezvous); failures are caught by the bootstrap
    socket. ``peer_error_handling=True`` asks UCX for mode *peer* (UCX detects failures
    itself and calls the endpoint's error callback), which on UCX 1.21 rules out the
    shared-memory transports and runs over TCP.

Wire (:mod:`transports._ucx_wire`)
    Tags carry the receiver's 24-bit connection id, so one worker per process serves every
    endpoint. A message's length is the UCX message length, found by probing before
    receiving: a buffer that is too small raises :class:`BufferTooSmallError` and the
    message stays held for the next call. Control frames (put, region revoked, close,
    wireup) ride their own tag.

Device memory (:mod:`transports._ucx_device`)
    CuPy arrays (anything with ``__cuda_array_interface__``) pass to UCX as they are: ``send``
    sends from device memory (waiting, like a zero-copy send, until the receiver has taken it;
    ``send_nowait`` stages a host copy), ``recv_into`` receives into device memory, a device
    array can be registered as a put target, and a put from device memory leaves from it
    (puts up to 4 KiB are copied to host and ride inline). UCX moves GPU memory only with its
    CUDA transports loaded: set ``UCX_TLS=tcp,sm,self,cuda_copy,cuda_ipc``
    (:data:`CUDA_UCX_TLS`) in both processes; with qlink's default ``tcp,sm,self`` a device
    buffer raises :class:`~qlink.errors.CapabilityError`. Host buffers are untouched by this.

One-sided put (:mod:`transports._ucx_put`, :mod:`transports._ucx_rma`, :mod:`transports._ucx_cma`)
    Where RMA is in force (``endpoint.rma``), a registered host region is mapped with
    ``ucp_mem_map`` and its descriptor carries its address and packed remote key: ``put_many``
    writes every piece straight into the peer's memory, then announces the bytes with ONE
    control frame, so the target's Notification comes after they are all in place.
    ``put_many(..., defer=True)`` from a region registered on this side (the KV sender
    registers its cache) shares the copy: the target first reads a share of the bytes itself
    (``OP_PULL``) while this side writes the rest, so both cores copy, as NIXL's worker threads
    do; the share starts at one half and then follows the two sides' measured rates (the
    target reports each read's bytes and time) so that both finish together; :meth:`flush`
    waits until the target confirmed its reads.

    **Between two processes of one host** (the default, ``rma=None`` / ``"same-host"``) RMA is
    in force when both sides prove they can read each other's memory: each sends 16 random
    bytes, the other writes them into its own memory and answers with its pid and their
    address (``OP_CMA``), the first reads them back there with ``process_vm_readv`` and says
    whether it could (``OP_CMA_VERDICT``); only where both say
    yes are the pieces moved, by qlink itself, up to 1024 per ``process_vm_writev``/``readv``
    (UCX's CMA makes one call per piece, and with 32 KiB pieces the calls, not the copy, took
    most of the time). A peer that has exited is then an error (:class:`BrokenLinkError`,
    found by a pidfd polled before each call), never an abort.

    **Anywhere** (``rma=True`` on both ends, or ``QLINK_UCX_RMA=1``): the pieces go by
    ``ucp_put_nbx``/``ucp_get_nbx`` where CMA is not in use (posted from one C loop; zero-copy
    CMA between local processes, as NIXL's UCX backend does). Opt-in, because without UCX peer
    error handling (the default; with it this UCX leaves shared memory and CMA for software
    emulation over TCP) UCX aborts a process whose RMA read or write meets a dead peer: each
    side checks that the peer is alive (its bootstrap socket) right before, but a peer killed
    during the copy takes this process with it.

    Otherwise (``rma=False`` on either end, ``QLINK_UCX_RMA=0``, or another host without
    ``rma=True``) put is done over tagged messages: puts up to 4 KiB travel inline in a control
    frame and are copied into the region; larger ones send a header, then the bytes, which
    the target receives directly into the region during its progress (the target must be
    calling into its endpoint). The notification is queued only once the bytes are in place.
    ``put_many`` is then one vectored put (a piece table and the gathered pieces in one
    message, scattered by the target) and ONE notification, when both hellos offer it
    (``put_many_gathers``); towards an older peer it is one put per piece. ``put`` always
    goes as a tagged put. A region freed by its owner while an RMA put into it is in flight
    is written anyway, as with any RMA: deregister first (the initiator checks revocations
    before each put). A deferred put's source lives only in the sender's process: the target
    reads it while the sender lives, so a sender that exits must ``flush`` first.

Sends are staged (:mod:`transports._ucx_endpoint`): the caller's bytes are copied into
endpoint-owned memory before UCX sees them, so ``send`` returns while a large message waits for the receiver (like a socket
buffer; ``send_buffer_nbytes`` bounds it, then ``send`` blocks and ``send_nowait`` raises
WouldBlock). ``zero_copy_send_nbytes=N`` sends messages of at least N bytes from the
caller's buffer instead; ``send`` then waits until the receiver has taken them. A large
message leaves only while both sides make progress (they are inside a call on their
endpoints) unless UCX can read it directly (CMA between local processes).

>>> import transports
>>> with transports.listen("ucx://127.0.0.1:0") as lis:
...     a = transports.connect(lis.url, timeout_s=5)
...     b = lis.accept(timeout_s=5)
...     a.send(b"ping")
...     b.recv(timeout_s=5)
b'ping'
>>> a.close(); b.close()
"""

from __future__ import annotations

import atexit
import collections
import os
import select
import socket
import threading
import time

from qlink.access import token_bytes
from qlink.errors import BrokenLinkError, QlinkTimeoutError, WireError

from . import _ucx_boot as boot
from . import _ucx_cma as cma
from . import _ucx_core as core
from . import _ucx_wire as wire
from ._accept import AcceptQueue
from ._base import Listener, deadline_of
from ._ucx_device import CUDA_UCX_TLS
from ._ucx_endpoint import CAPABILITIES, UcxEndpoint

__all__ = ["CAPABILITIES", "DEFAULT_UCX_TLS", "CUDA_UCX_TLS", "HOT_PATHS", "listen", "connect", "UcxEndpoint",
           "UcxListener", "require_ucxx"]

DEFAULT_UCX_TLS = core.DEFAULT_UCX_TLS
HOT_PATHS = tuple(core.HOT_PATHS)

atexit.register(core.close_lingering)


def require_ucxx() -> None:
    """Import UCXX as this transport does (MissingDependencyError where it is absent),
    leaving the environment as it was: UCXX's import-time UCX options go to qlink's own
    UCX contexts, not to other UCX users in this process or its children (NIXL's; see
    ``transports._ucx_core.ucxx``). Import UCXX through this, not directly, in a process
    that may also run NIXL."""
    core.ucxx()


# ----- listener and connect ----------------------------------------------------------------
_DEFAULTS = dict(peer_error_handling=False, send_buffer_nbytes=256 << 20, zero_copy_send_nbytes=None,
                 linger_s=1.0, handshake_timeout_s=5.0, hot_path="ucp", token=None, rma=None)


def _options(opts: dict, where: str) -> dict:
    unknown = sorted(set(opts) - set(_DEFAULTS))
    if unknown:
        raise TypeError(f"{where} got unknown options {unknown}; known: {sorted(_DEFAULTS)}")
    out = {**_DEFAULTS, **opts}
    if out["send_buffer_nbytes"] <= 0:
        raise ValueError(f"send_buffer_nbytes must be positive, got {out['send_buffer_nbytes']}")
    z = out["zero_copy_send_nbytes"]
    if z is not None and z <= wire.SMALL:
        raise ValueError(f"zero_copy_send_nbytes must be None or above {wire.SMALL}, got {z}")
    if out["hot_path"] not in core.HOT_PATHS:
        raise ValueError(f"hot_path must be one of {sorted(core.HOT_PATHS)}, got {out['hot_path']!r}")
    out["token"] = token_bytes(out["token"])
    if out["rma"] is None:  # (see the module docstring) QLINK_UCX_RMA=1: anywhere; =0: never; else same host
        out["rma"] = {"1": True, "0": False}.get(os.environ.get("QLINK_UCX_RMA", ""), "same-host")
    elif out["rma"] not in (True, False, "same-host"):
        raise ValueError(f"rma must be True, False, 'same-host' or None, got {out['rma']!r}")
    return out


def _endpoint(url, sock, box, opts, deadline, *, server: bool) -> UcxEndpoint:
    """Handshake on a connected bootstrap socket, then build the endpoint and bring UCX up."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn_id, token = box.next_conn_id(), os.urandom(8)
    flags = _offered_flags(opts, server=server)
    if opts["rma"] and box.rma:
        same_host = boot.FLAG_CMA | boot.FLAG_RMA_SAME_HOST if cma.offered() else 0
        flags |= same_host | (boot.FLAG_RMA if opts["rma"] is True else 0)
    peer_conn, flags, peer_token, peer_addr = boot.handshake(
        sock, conn_id=conn_id, token=token, flags=flags, address=box.address, deadline=deadline, server=server,
        shared_token=opts["token"])
    ep = UcxEndpoint(url=url, sock=sock, box=box, conn_id=conn_id, token=token, peer_conn_id=peer_conn,
                     peer_token=peer_token, peer_address=peer_addr, opts=opts, flags=flags)
    try:
        ep._wireup(deadline)
    except BaseException:
        ep._closed = True
        ep._finish_linger(0.0, force=True)
        raise
    return ep


def _offered_flags(opts: dict, *, server: bool) -> int:
    """The hello flags this side offers: peer error handling when asked for, vectored puts always
    (``server`` names the end of the handshake; both ends offer the same today)."""
    return (boot.FLAG_PEER_ERRORS if opts["peer_error_handling"] else 0) | boot.FLAG_PUTV


class UcxListener(Listener):
    """Accepts ``ucx://host:port`` connections (bootstrap over TCP, data over UCX).

    A small daemon thread answers handshakes as clients arrive (like a kernel accept
    backlog), so ``connect`` completes even before ``accept`` is called.
    """

    def __init__(self, host: str, port: int, opts: dict) -> None:
        self._opts = opts
        self.rejected = 0  # connections that failed the handshake (counted, never fatal)
        #: refused handshakes by reason: no_token, bad_token, bad_hello, hung_up, handshake_timeout
        self.refused_by_reason: collections.Counter = collections.Counter()
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(sockaddr)
        except OSError as e:
            self._sock.close()
            raise OSError(e.errno, f"ucx: cannot listen on {host}:{port} ({e.strerror}); "
                                   "pick a free port (0 picks one) on an address of this machine") from None
        self._sock.listen(64)
        self._sock.setblocking(False)
        self.url = boot.url_of(host, self._sock.getsockname()[1])
        self._box = core.worker_for(boot.scope_of(host))
        self._queue = AcceptQueue(self.url)
        self._thread = threading.Thread(target=self._serve, name=f"qlink-ucx-accept {self.url}", daemon=True)
        self._thread.start()

    @property
    def _closed(self) -> bool:
        return self._queue.closed

    def __repr__(self) -> str:
        return f"<UcxListener {self.url} {'closed' if self._closed else 'listening'}>"

    def _serve(self) -> None:
        while not self._closed:
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.05)
                if not ready:
                    continue
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, ValueError):
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            try:
                conn.setblocking(True)
                ep = _endpoint(self.url, conn, self._box, self._opts,
                               time.monotonic() + self._opts["handshake_timeout_s"], server=True)
            except (WireError, BrokenLinkError, QlinkTimeoutError, OSError) as e:
                self.rejected += 1  # a bad or vanished client never takes the listener down
                self.refused_by_reason[getattr(e, "reason", None) or (
                    "handshake_timeout" if isinstance(e, QlinkTimeoutError) else
                    "bad_hello" if isinstance(e, WireError) else "hung_up")] += 1
                conn.close()
                continue
            if not self._queue.offer(ep):
                ep.close()
                return

    def accept(self, *, timeout_s: float | None = None) -> UcxEndpoint:
        """Wait for the next peer and return its connected endpoint."""
        return self._queue.take(timeout_s=timeout_s)

    def close(self) -> None:
        """Stop listening and release the port; connections not yet accepted are closed. Idempotent."""
        pending = self._queue.close()
        if pending is None:
            return
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._opts["handshake_timeout_s"] + 1.0)
        self._sock.close()
        for ep in pending:
            ep.close()


def listen(url: str, **options) -> UcxListener:
    """Listen on ``ucx://host:port`` (host defaults to 127.0.0.1; port 0 picks a free port).

    Options: ``peer_error_handling`` (UCX error mode *peer*; default False, see the module
    notes), ``send_buffer_nbytes`` (staged bytes in flight before send blocks, 256 MiB),
    ``zero_copy_send_nbytes`` (send messages this big from the caller's buffer; None),
    ``linger_s`` (how long close waits for staged sends, 1 s), ``handshake_timeout_s`` (5 s),
    ``hot_path`` (``"ucp"``: UCP calls on UCXX's handles, default; ``"ucxx"``: UCXX's API),
    ``token`` (a shared secret of at least 16 characters: only clients that prove it in the
    handshake are admitted; others are refused with the reason and counted in
    ``refused_by_reason``).
    """
    host, port = boot.split_url(url, for_listen=True)
    return UcxListener(host, port, _options(options, "ucx.listen"))


def connect(url: str, *, timeout_s: float | None = 10.0, **options) -> UcxEndpoint:
    """Connect to a listener at ``ucx://host:port``; BrokenLinkError if nobody listens there.

    Takes the same options as :func:`listen`; ``token`` is proved to a listener that wants
    one (a refusal raises :class:`~transports._ucx_boot.PeerRefusedError`, a WireError).
    """
    host, port = boot.split_url(url, for_listen=False)
    opts = _options(options, "ucx.connect")
    deadline = deadline_of(timeout_s)
    box = core.worker_for(boot.scope_of(host))
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.gaierror as e:
        raise BrokenLinkError(f"ucx: cannot resolve host {host!r} in {url!r} ({e})") from e
    except socket.timeout:
        raise QlinkTimeoutError(f"ucx: connecting to {url} did not complete within timeout_s={timeout_s}") from None
    except OSError as e:
        raise BrokenLinkError(f"ucx: nobody listens on {url} ({e.strerror or e})") from e
    try:
        return _endpoint(boot.url_of(host, port), sock, box, opts, deadline, server=False)
    except boot.PeerRefusedError:
        sock.close()
        raise
    except WireError as e:
        sock.close()
        raise BrokenLinkError(f"ucx: {url} did not answer as a qlink ucx listener: {e}") from e
    except (QlinkTimeoutError, BrokenLinkError):
        sock.close()
        raise
    except OSError as e:
        sock.close()
        raise BrokenLinkError(f"ucx: the connection to {url} failed during the handshake ({e})") from e
    except BaseException:
        sock.close()
        raise
