"""What both ends of a KV link share: role and mode codes, the hello check, and the
checks of request ids, layer ranges and cache placement."""

from __future__ import annotations

import operator

from qlink.errors import CapabilityError, WireError
from qlink.memory import RemoteRegion

from . import frames as fr
from .kv import KVCache, KVCacheSpec

__all__ = [  # shared by the KV modules of qlink.ai (this module is private to the package)
    "ABORT_CORRUPT",
    "ABORT_SUBMIT_FAILED",
    "BREAK_GRACE_S",
    "BREAK_QUIET_POLLS",
    "EVENTS_PER_PROGRESS",
    "MAX_HELLO_NBYTES",
    "MODE_CODES",
    "Peer",
    "ROLE_SENDER",
    "ROLE_RECEIVER",
    "ROLE_NIXL_SENDER",
    "ROLE_NIXL_RECEIVER",
    "can_defer",
    "check_device",
    "check_request_id",
    "layers_of",
    "parse_hello",
    "MODES",
]

MODES = ("auto", "put", "send")
ROLE_SENDER, ROLE_RECEIVER, ROLE_NIXL_SENDER, ROLE_NIXL_RECEIVER = 1, 2, 3, 4
_ROLE_NAMES = {1: "a KVSender", 2: "a KVReceiver", 3: "a NixlKVSender", 4: "a NixlKVReceiver"}
MODE_CODES = {"auto": 0, "put": 1, "send": 2, "nixl": 3}
_MODE_NAMES = {v: k for k, v in MODE_CODES.items()}
ABORT_SUBMIT_FAILED = 3  # INTERNAL_ERROR in the CUDA-Q status table
ABORT_CORRUPT = 2  # a part whose CRC-32 does not match (the receiver's own verdict)
_MAX_REQUEST_ID = (1 << 32) - 1
EVENTS_PER_PROGRESS = 4096
BREAK_GRACE_S = 0.25  # after the control link breaks, how long completions still in flight may take
BREAK_QUIET_POLLS = 20  # ... and how many empty polls (1 ms apart) end that wait sooner
MAX_HELLO_NBYTES = 1 << 20


def layers_of(layers, num_layers: int) -> range:
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"layers must be 'all' or a range of layer indices, got {layers!r}")
        return range(num_layers)
    if isinstance(layers, int):
        layers = range(layers, layers + 1)
    if not isinstance(layers, range) or layers.step != 1 or len(layers) == 0:
        raise ValueError(f"layers must be 'all', a layer index, or a non-empty range with step 1, got {layers!r}")
    if layers.start < 0 or layers.stop > num_layers:
        raise ValueError(f"layers {layers} fall outside the cache's layers [0, {num_layers})")
    return layers


def check_device(cache: KVCache, endpoint) -> None:
    if cache.device != "cpu" and not endpoint.capabilities.device_memory:
        raise CapabilityError(f"the KV cache lives on device {cache.device!r} but transport "
                              f"{endpoint.capabilities.name!r} moves host memory only; use a device-capable transport")


def can_defer(endpoint) -> bool:
    """The endpoint may leave a put_many's copy to the target (``shm``; ``ucx`` with RMA in
    force): it says so (``defers_puts``), or it has deferred puts to flush, so it overrides
    the base ``flush`` (which returns at once)."""
    from transports import Endpoint

    says = getattr(endpoint, "defers_puts", None)
    if says is not None:
        return bool(says)

    return getattr(getattr(endpoint, "flush", None), "__func__", None) is not Endpoint.flush


def check_request_id(request_id) -> int:
    try:
        rid = operator.index(request_id)
    except TypeError:
        rid = -1
    if isinstance(request_id, bool) or not 0 <= rid <= _MAX_REQUEST_ID:
        raise ValueError(f"request_id must be an integer in [0, 2**32), got {request_id!r}")
    return rid


class Peer:
    """What the handshake learned about the other side."""

    __slots__ = ("spec", "mode", "regions", "crc32")

    def __init__(self, spec: KVCacheSpec, mode: str, regions: list[RemoteRegion], crc32: bool = False):
        self.spec, self.mode, self.regions, self.crc32 = spec, mode, regions, crc32


def parse_hello(frame, *, expect_role: int, local: KVCacheSpec, side: str) -> Peer:
    role, mode_code, spec_b, regions_b = fr.unpack_hello(frame)
    if role != expect_role:
        what = _ROLE_NAMES.get(role, f"role {role}")
        raise WireError(f"the peer is {what} where {_ROLE_NAMES[expect_role]} was expected; a KV transfer pairs "
                        "KVSender with KVReceiver, or NixlKVSender with NixlKVReceiver")
    if mode_code not in _MODE_NAMES:
        raise WireError(f"the peer asked for unknown mode code {mode_code}")
    spec = KVCacheSpec.from_bytes(spec_b)
    local.check_compatible(spec, side=side)
    regions = regions_b if expect_role in (ROLE_NIXL_SENDER, ROLE_NIXL_RECEIVER) else \
        [RemoteRegion.from_bytes(r) for r in regions_b]
    return Peer(spec, _MODE_NAMES[mode_code], regions, bool(fr.hello_flags(frame) & fr.HELLO_PARTS_CRC32))
