"""The KV movement engine over NIXL (``nixl-cu12``, UCX backend) instead of a qlink transport.

Same API and the same frames as :mod:`qlink.ai.engine`; NIXL moves the bytes, a qlink
endpoint carries the control traffic (the ``kv_hello`` handshake with each side's
NIXL agent metadata and per-layer base addresses, and ``kv_abort``). Each layer of a
request is one NIXL transfer: the merged descriptors of that layer (an ``Nx3`` uint64
array ``[addr, nbytes, dev_id]``), ``initialize_xfer("WRITE", ...)`` with the
``kv_write`` frame as the notification message, ``transfer``, then ``check_xfer_state``
polled until done. The receiver polls ``get_new_notifs`` and reports layers exactly
as :class:`~qlink.ai.KVReceiver` does. READ (the decode side pulls) works too:
:meth:`NixlKVReceiver.read_request`.

Agents are set up the way vLLM's ``NixlConnector`` runs them: UCX chooses its own
transports (qlink sets no ``UCX_TLS`` for NIXL), one registered region per layer cache,
and NIXL's progress thread on. NIXL's Python API starts that thread with no delay
between progress calls (``pthrDelay=0``), so an idle agent busy-polls a whole core;
``progress_delay_us`` (default :data:`PROGRESS_DELAY_US`, 100 µs) gives it a pause
instead. NIXL's start-up pins the calling thread to one core; the affinity the thread
had before is restored once the agent is up. :meth:`NixlKVReceiver.read_request` pulls
a whole request the way vLLM's decode side does: descriptor lists of every (layer,
plane, block) prepared once per agent pair (``prep_xfer_dlist``), then ONE
``make_prepped_xfer("READ", ...)`` per request over all its layers, with a
notification to the sender when it is done.

NIXL's status strings become :class:`XferState`; its failures become qlink errors:
``"ERR"`` or a remote disconnect -> :class:`~qlink.errors.BrokenLinkError`, an address
outside registered memory -> :class:`~qlink.errors.RegistrationError`, anything else
-> :class:`NixlError`.

>>> XferState.of("PROC"), XferState.of("DONE").done
(<XferState.PROC: 'PROC'>, True)
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import threading
import time

import numpy as np

from qlink.errors import (
    BrokenLinkError,
    CapabilityError,
    QlinkError,
    QlinkTimeoutError,
    RegistrationError,
    WireError,
    missing,
)

from . import frames as fr
from ._descriptors import plan_transfer
from ._tracker import RequestTracker, TransferRecord
from ._handshake import (
    MAX_HELLO_NBYTES as _MAX_HELLO_NBYTES,
    MODE_CODES as _MODE_CODES,
    ROLE_NIXL_RECEIVER as _ROLE_NIXL_RECEIVER,
    ROLE_NIXL_SENDER as _ROLE_NIXL_SENDER,
    check_request_id as _check_request_id,
    layers_of as _layers_of,
    parse_hello as _parse_hello,
)
from ._receiver import _ReceiverBase
from .engine import KVSender, KVSendRequest
from .kv import KVCache, KVCacheSpec

__all__ = ["NixlKVSender", "NixlKVReceiver", "XferState", "NixlError", "nixl_available", "ucx_environment",
           "PROGRESS_DELAY_US"]

_names = itertools.count()
#: Pause between two progress calls of NIXL's progress thread (µs); NIXL's Python API uses 0.
PROGRESS_DELAY_US = 100
#: UCX worker threads of an agent: vLLM's NixlConnector default (its extra config "num_threads").
NUM_THREADS = 4
_CONFIG_LOCK = threading.Lock()


class NixlError(QlinkError):
    """A NIXL call failed for a reason qlink has no narrower error for; ``nixl_error``
    names NIXL's exception class."""

    def __init__(self, message: str, *, nixl_error: str = ""):
        super().__init__(message)
        self.nixl_error = nixl_error


class XferState(enum.Enum):
    """State of a NIXL transfer (NIXL reports it as a string)."""

    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"

    @classmethod
    def of(cls, status: str) -> "XferState":
        try:
            return cls(status)
        except ValueError:
            raise NixlError(f"NIXL reported unknown transfer status {status!r}") from None

    @property
    def done(self) -> bool:
        return self is XferState.DONE


def _nixl():
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        raise missing("nixl-cu12", extra="nixl", feature="the NIXL KV-transfer backend") from None
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs every agent creation to stdout at INFO
    return nixl_agent, nixl_agent_config


def nixl_available() -> bool:
    """True when ``nixl_cu12`` imports here."""
    try:
        _nixl()
    except QlinkError:
        return False
    return True


def _as_qlink(exc: BaseException, what: str) -> QlinkError:
    name = type(exc).__name__
    if name == "nixlRemoteDisconnectError":
        return BrokenLinkError(f"NIXL: the remote agent disconnected during {what}")
    if name == "nixlNotFoundError":
        return RegistrationError(f"NIXL: {what} touches memory that is not registered with the agent (or an "
                                 "unknown remote agent)")
    if name == "nixlNotSupportedError":
        return CapabilityError(f"NIXL: {what} is not supported by the configured backends")
    return NixlError(f"NIXL: {what} failed with {name}: {exc}", nixl_error=name)


def _check(state: str, what: str) -> XferState:
    st = XferState.of(state)
    if st is XferState.ERR:
        raise BrokenLinkError(f"NIXL reported ERR for {what} (the peer agent or the link failed)")
    return st


def ucx_environment() -> dict[str, str]:
    """The ``UCX_*`` options in this process's environment, which NIXL's UCX reads when an
    agent is made (UCX leaves no other way in).

    One of them costs NIXL most of its speed here: with ``UCX_RNDV_THRESH=8192`` (what
    UCXX's import writes into the environment; qlink's ucx transport takes it back out,
    see ``transports.ucx.require_ucxx``) ``UCX_PROTO_INFO=y`` shows NIXL's ``ucp_get`` as
    "software emulation" over ``tcp/lo`` instead of zero-copy ``cma/memory``, and a
    64 MiB read of 2,048 prepared 32 KiB blocks moved at 0.45-0.55 GB/s against
    2.7-3.6 GB/s without it on the 2-core VM. An agent made with it set warns.

    >>> isinstance(ucx_environment(), dict)
    True
    """
    return {k: v for k, v in os.environ.items() if k.startswith("UCX_")}


def _make_agent(name: str, *, backends: list[str], progress_thread: bool, progress_delay_us: int | None,
                num_threads: int = 0):
    """``nixl_agent(name, ...)`` with the progress thread pausing ``progress_delay_us``
    between progress calls (None: NIXL's own 0), and the calling thread's CPU affinity
    as it was before (NIXL's start-up pins it to one core)."""
    nixl_agent, nixl_agent_config = _nixl()
    from nixl_cu12 import _api

    conf = nixl_agent_config(backends=backends, enable_prog_thread=progress_thread, num_threads=int(num_threads))
    env = ucx_environment()
    if "UCX_RNDV_THRESH" in env and "UCX" in backends:
        import warnings

        warnings.warn(f"a NIXL agent is made with UCX_RNDV_THRESH={env['UCX_RNDV_THRESH']} in the environment "
                      "(UCXX's import sets 8192): NIXL's reads and writes then go as software emulation over TCP "
                      "instead of zero-copy CMA, several times slower; import UCXX through "
                      "transports.ucx.require_ucxx(), or unset it", RuntimeWarning, stacklevel=3)
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        if progress_delay_us is None:
            return nixl_agent(name, conf)
        with _CONFIG_LOCK:
            real = _api.nixlBind
            _api.nixlBind = _BindWithDelay(real, int(progress_delay_us))
            try:
                return nixl_agent(name, conf)
            finally:
                _api.nixlBind = real
    finally:
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)


class _BindWithDelay:
    """NIXL's bindings module, except that an agent config made through it keeps a
    progress-thread delay of at least ``delay_us`` (NIXL's Python API sets 0)."""

    def __init__(self, real, delay_us: int):
        base = real.nixlAgentConfig

        class Config(base):
            @property
            def pthrDelay(self):  # noqa: N802 - NIXL's name
                return base.pthrDelay.__get__(self)

            @pthrDelay.setter
            def pthrDelay(self, value):  # noqa: N802
                base.pthrDelay.__set__(self, max(int(value), delay_us))

        self._real = real
        self.nixlAgentConfig = Config

    def __getattr__(self, name):
        return getattr(self._real, name)


class _Agent:
    """One NIXL agent with the cache's layers registered as DRAM, one region per layer."""

    def __init__(self, cache: KVCache, *, name: str | None, backends: tuple[str, ...], progress_thread: bool = True,
                 progress_delay_us: int | None = PROGRESS_DELAY_US, num_threads: int = NUM_THREADS):
        if cache.device != "cpu":
            raise CapabilityError("the NIXL backend here registers host (DRAM) caches only; use device='cpu'")
        self.name = name or f"qlink-kv-{os.getpid()}-{next(_names)}"
        try:
            self.agent = _make_agent(self.name, backends=list(backends), progress_thread=progress_thread,
                                     progress_delay_us=progress_delay_us, num_threads=num_threads)
        except QlinkError:
            raise
        except Exception as e:  # noqa: BLE001 - NIXL raises plain exceptions
            raise _as_qlink(e, "creating the agent") from e
        self.spec = cache.spec
        self._prepped: dict = {}  # peer name -> (local handle, remote handle)
        self.addrs = np.array([a.ctypes.data for a in cache.layers], dtype=np.uint64)
        self.layer_nbytes = cache.spec.layer_nbytes
        regs = np.stack([self.addrs, np.full_like(self.addrs, self.layer_nbytes), np.zeros_like(self.addrs)], axis=1)
        try:
            self.reg = self.agent.register_memory(regs, "DRAM")
        except Exception as e:  # noqa: BLE001
            raise _as_qlink(e, "registering the KV cache") from e
        self.backend = "nixl-" + "+".join(b.lower() for b in backends)

    def hello(self, role: int, spec: KVCacheSpec) -> bytes:
        return fr.pack_hello(role=role, mode=_MODE_CODES["nixl"], spec=spec.to_bytes(),
                             regions=[self.name.encode(), self.agent.get_agent_metadata(), self.addrs.tobytes()])

    def add_peer(self, items: list[bytes], num_layers: int) -> tuple[str, np.ndarray]:
        if len(items) != 3 or len(items[2]) != 8 * num_layers:
            raise WireError(f"NIXL hello must carry an agent name, metadata and {num_layers} layer addresses")
        try:
            peer = self.agent.add_remote_agent(items[1])
        except Exception as e:  # noqa: BLE001
            raise _as_qlink(e, "adding the remote agent") from e
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        return peer, np.frombuffer(items[2], dtype=np.uint64).copy()

    def descs(self, base: int, offsets: np.ndarray, nbytes: np.ndarray):
        arr = np.empty((offsets.size, 3), dtype=np.uint64)
        arr[:, 0] = offsets
        arr[:, 0] += np.uint64(base)
        arr[:, 1] = nbytes
        arr[:, 2] = 0
        return self.agent.get_xfer_descs(arr, "DRAM")

    def block_descs(self, addrs: np.ndarray) -> np.ndarray:
        """Nx3 ``[addr, nbytes, 0]`` of every (layer, plane, block) of a cache whose layers
        start at ``addrs``, in that order (index = (layer * planes + plane) * blocks + block)."""
        spec = self.spec
        bn = spec.block_nbytes
        plane = np.arange(spec.num_planes, dtype=np.uint64)[:, None] * np.uint64(spec.num_blocks * bn)
        block = np.arange(spec.num_blocks, dtype=np.uint64)[None, :] * np.uint64(bn)
        offs = (plane + block).ravel()
        arr = np.empty((addrs.size * offs.size, 3), dtype=np.uint64)
        arr[:, 0] = (addrs.astype(np.uint64)[:, None] + offs[None, :]).ravel()
        arr[:, 1] = bn
        arr[:, 2] = 0
        return arr

    def prepped(self, peer: str, peer_addrs: np.ndarray, peer_num_blocks: int):
        """Prepared descriptor lists (local, remote) for transfers with ``peer``, made once."""
        if peer not in self._prepped:
            if peer_num_blocks != self.spec.num_blocks:
                raise CapabilityError("prepared NIXL descriptor lists need caches of the same num_blocks on both "
                                      f"sides (here {self.spec.num_blocks}, peer {peer_num_blocks})")
            try:
                local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.block_descs(self.addrs), "DRAM")
                remote = self.agent.prep_xfer_dlist(peer, self.block_descs(peer_addrs), "DRAM")
            except Exception as e:  # noqa: BLE001
                raise _as_qlink(e, "preparing descriptor lists") from e
            self._prepped[peer] = (local, remote)
        return self._prepped[peer]

    def block_indices(self, block_ids: np.ndarray, layers: range) -> np.ndarray:
        """Indices into :meth:`block_descs` of ``block_ids`` in every plane of ``layers``."""
        spec = self.spec
        rows = (np.arange(layers.start, layers.stop, dtype=np.int64)[:, None] * spec.num_planes
                + np.arange(spec.num_planes, dtype=np.int64)[None, :]).ravel()
        return (rows[:, None] * spec.num_blocks + np.asarray(block_ids, dtype=np.int64)[None, :]).ravel().astype(
            np.int32)

    def start(self, op: str, local, remote, peer: str, notif: bytes, what: str):
        try:
            h = self.agent.initialize_xfer(op, local, remote, peer, notif)
            state = self.agent.transfer(h)
        except Exception as e:  # noqa: BLE001
            raise _as_qlink(e, what) from e
        try:
            _check(state, what)
        except BrokenLinkError:
            h.release()
            raise
        return h

    def close(self) -> None:
        for local, remote in self._prepped.values():
            for h in (local, remote):
                try:
                    h.release()
                except Exception:  # noqa: BLE001 - best effort on shutdown
                    pass
        self._prepped.clear()
        try:
            self.agent.deregister_memory(self.reg)
        except Exception:  # noqa: BLE001 - best effort on shutdown
            pass


def _attach(side, endpoint, cache, *, agent_name, backends, progress_thread: bool, progress_delay_us,
            num_threads: int) -> None:
    """What both sides set up first: ``cache`` checked, its NIXL agent, and the attributes every
    KV side has (``endpoint``, ``cache``, ``spec``, ``transport``)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a qlink.ai.KVCache, got {type(cache).__name__}")
    side._nx = _Agent(cache, name=agent_name, backends=tuple(backends), progress_thread=progress_thread,
                      progress_delay_us=progress_delay_us, num_threads=num_threads)
    side.endpoint = endpoint
    side.cache = cache
    side.spec = cache.spec
    side.transport = side._nx.backend


class NixlKVSender(KVSender):
    """Prefill side over NIXL: ``endpoint`` (any qlink transport) carries the handshake,
    NIXL's agent the bytes (``progress_thread``: NIXL's own progress thread, its default;
    on a 2-core host it competes with the two processes for the cores). ``send_request`` returns once every layer's transfer is DONE
    at the initiator; ``begin_request(...).send_layer(k)`` streams layers and
    :meth:`flush` waits for them."""

    def __init__(self, endpoint, cache: KVCache, *, agent_name: str | None = None, backends=("UCX",),
                 progress_thread: bool = True, progress_delay_us: int | None = PROGRESS_DELAY_US,
                 num_threads: int = NUM_THREADS):
        _attach(self, endpoint, cache, agent_name=agent_name, backends=backends, progress_thread=progress_thread,
                progress_delay_us=progress_delay_us, num_threads=num_threads)
        self.requested_mode = "nixl"
        self.mode = ""
        self._peer = None
        self._peer_name = ""
        self._peer_addrs = None
        self._max_desc_nbytes = None
        self._pending: list = []
        endpoint.send(self._nx.hello(_ROLE_NIXL_SENDER, self.spec))

    def handshake(self, *, timeout_s: float | None = 10.0) -> str:
        if self._peer is not None:
            return self.mode
        frame = self.endpoint.recv(timeout_s=timeout_s, max_nbytes=_MAX_HELLO_NBYTES)
        peer = _parse_hello(frame, expect_role=_ROLE_NIXL_RECEIVER, local=self.spec, side="receiver")
        self._peer_name, self._peer_addrs = self._nx.add_peer(peer.regions, self.spec.num_layers)
        self._peer = peer
        self.mode = "nixl"
        return self.mode

    def _submit_layer(self, req: KVSendRequest, layer: int, timeout_s) -> None:
        plan = req.plan
        n = plan.num_descs
        notif = fr.pack_write(fr.FN_WRITE, req.request_id, req.submit_ns, layer=layer, layer_lo=req.layers.start,
                              layer_hi=req.layers.stop, num_parts=1, num_descs=n, layer_nbytes=plan.layer_nbytes,
                              part_nbytes=plan.layer_nbytes)
        nx = self._nx
        local = nx.descs(int(nx.addrs[layer]), plan.src_offsets, plan.nbytes)
        remote = nx.descs(int(self._peer_addrs[layer]), plan.dst_offsets, plan.nbytes)
        h = nx.start("WRITE", local, remote, self._peer_name, notif, f"WRITE of layer {layer} of request {req.request_id}")
        self._pending.append((h, req.request_id, layer))
        self.progress()

    def progress(self) -> int:
        """Release transfers that are DONE; raise BrokenLinkError for one in ERR."""
        done = 0
        keep = []
        for item in self._pending:
            h, rid, layer = item
            try:
                st = _check(self._nx.agent.check_xfer_state(h), f"WRITE of layer {layer} of request {rid}")
            except BrokenLinkError:
                h.release()
                self._pending = [x for x in self._pending if x is not item]
                raise
            if st.done:
                h.release()
                done += 1
            else:
                keep.append(item)
        self._pending = keep
        return done

    def flush(self, *, timeout_s: float | None = 10.0) -> None:
        """Wait until every submitted transfer is DONE at this side."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._pending:
            if not self.progress():
                if deadline is not None and time.monotonic() > deadline:
                    raise QlinkTimeoutError(f"{len(self._pending)} NIXL transfers not DONE within timeout_s={timeout_s}")
                time.sleep(2e-5)

    def send_request(self, request_id: int, src_block_ids, dst_block_ids, *, layers="all",
                     timeout_s: float | None = 10.0):
        rec = super().send_request(request_id, src_block_ids, dst_block_ids, layers=layers, timeout_s=timeout_s)
        self.flush(timeout_s=timeout_s)
        return rec

    def read_request(self, *_args, **_kwargs):
        raise CapabilityError("with NIXL the decode side pulls: call NixlKVReceiver.read_request")

    def close(self) -> None:
        for h, _, _ in self._pending:
            try:
                h.release()
            except Exception:  # noqa: BLE001
                pass
        self._pending = []
        self._nx.close()


class NixlKVReceiver(_ReceiverBase):
    """Decode side over NIXL: registers its cache with a NIXL agent, reports layers as the
    sender's notifications arrive, and can pull (READ) blocks itself."""

    def __init__(self, endpoint, cache: KVCache, *, agent_name: str | None = None, backends=("UCX",),
                 progress_thread: bool = True, progress_delay_us: int | None = PROGRESS_DELAY_US,
                 num_threads: int = NUM_THREADS, max_requests: int = 65536):
        _attach(self, endpoint, cache, agent_name=agent_name, backends=backends, progress_thread=progress_thread,
                progress_delay_us=progress_delay_us, num_threads=num_threads)
        self._tracker = RequestTracker(num_layers=self.spec.num_layers, transport=self.transport, mode="",
                                       max_requests=max_requests)
        self._peer = None
        self._peer_error = None
        self._peer_name = ""
        self._peer_addrs = None
        self._ctl = bytearray(4096)
        self._ctl_mv = memoryview(self._ctl)
        self._closed = False
        endpoint.send(self._nx.hello(_ROLE_NIXL_RECEIVER, self.spec))

    def _on_hello(self, frame) -> None:
        peer = _parse_hello(frame, expect_role=_ROLE_NIXL_SENDER, local=self.spec, side="sender")
        self._peer_name, self._peer_addrs = self._nx.add_peer(peer.regions, self.spec.num_layers)
        self._peer = peer
        self._tracker.mode = "nixl"

    def _poll_sources(self, budget: int) -> int:
        if self._peer is None:
            return 0  # leave notifications queued in NIXL until the sender's hello names its agent
        try:
            notifs = self._nx.agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001
            raise _as_qlink(e, "polling notifications") from e
        n = 0
        tr = self._tracker
        now = time.monotonic_ns()
        for agent, msgs in notifs.items():
            agent = agent.decode() if isinstance(agent, bytes) else agent
            for m in msgs:
                n += 1
                if agent != self._peer_name:
                    tr.bad_frames += 1
                    continue
                try:
                    rid, ts, layer, lo, hi, parts, descs, lnb, pnb = fr.unpack_write(m)
                except WireError:
                    tr.bad_frames += 1
                    continue
                tr.on_part(rid, ts, layer, lo, hi, parts, descs, lnb, pnb, now_ns=now)
        return n

    def read_request(self, request_id: int, src_block_ids, dst_block_ids, *, layers="all",
                     timeout_s: float | None = 10.0) -> TransferRecord:
        """READ: pull the sender's blocks ``src_block_ids`` into this cache's
        ``dst_block_ids`` as vLLM's NixlConnector does: ONE prepared transfer over every
        (layer, plane, block) of the request, indices into descriptor lists prepared once
        per peer, the request id as the notification the sender receives when it is done.
        Where the two caches differ in ``num_blocks`` (no shared list shape), one transfer
        per layer from per-request descriptor lists instead. Returns when all is DONE."""
        request_id = _check_request_id(request_id)
        self.handshake(timeout_s=timeout_s)
        rng = _layers_of(layers, self.spec.num_layers)
        t0 = time.monotonic_ns()
        plan = plan_transfer(src_block_ids, dst_block_ids, src_num_blocks=self._peer.spec.num_blocks,
                             dst_num_blocks=self.spec.num_blocks, block_nbytes=self.spec.block_nbytes,
                             num_planes=self.spec.num_planes)
        nx = self._nx
        what = f"READ of request {request_id}"
        handles = []
        try:
            if self._peer.spec.num_blocks == self.spec.num_blocks:
                local, remote = nx.prepped(self._peer_name, self._peer_addrs, self._peer.spec.num_blocks)
                src = np.asarray(src_block_ids, dtype=np.int64).ravel()
                dst = np.asarray(dst_block_ids, dtype=np.int64).ravel()
                try:
                    h = nx.agent.make_prepped_xfer("READ", local, nx.block_indices(dst, rng), remote,
                                                   nx.block_indices(src, rng), str(request_id).encode())
                    _check(nx.agent.transfer(h), what)
                except QlinkError:
                    raise
                except Exception as e:  # noqa: BLE001
                    raise _as_qlink(e, what) from e
                handles.append((rng, h))
                num_descs = int(src.size) * self.spec.num_planes * len(rng)
            else:
                for layer in rng:
                    local = nx.descs(int(nx.addrs[layer]), plan.dst_offsets, plan.nbytes)
                    remote = nx.descs(int(self._peer_addrs[layer]), plan.src_offsets, plan.nbytes)
                    handles.append((range(layer, layer + 1),
                                    nx.start("READ", local, remote, self._peer_name, b"", f"{what}, layer {layer}")))
                num_descs = plan.num_descs * len(rng)
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            ready = []
            for covered, h in handles:
                while not _check(nx.agent.check_xfer_state(h), what).done:
                    if deadline is not None and time.monotonic() > deadline:
                        raise QlinkTimeoutError(f"{what} not DONE within timeout_s={timeout_s}")
                ready.extend([time.monotonic_ns()] * len(covered))
        finally:
            for _, h in handles:
                try:
                    h.release()
                except Exception:  # noqa: BLE001
                    pass
        rel = (np.array(ready, dtype=np.int64) - t0) / 1e3
        return TransferRecord(request_id=request_id, nbytes=plan.layer_nbytes * len(rng),
                              num_descs=num_descs, num_layers=len(rng), transport=self.transport,
                              mode="nixl-read", submit_to_last_us=float(rel.max()),
                              layer_ready_us=tuple(float(x) for x in rel))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._nx.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
