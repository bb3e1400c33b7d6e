"""qlink.ai: paged KV caches and their movement from prefill to decode workers.

>>> from qlink.ai import preset
>>> preset("llama-3-8b").bytes_per_token
131072
"""

from ._descriptors import BlockIdError, TransferPlan, plan_transfer
from ._tracker import KVStatistics, SubmitRecord, TransferAbortedError, TransferRecord
from ._receiver import KVReceiver
from .engine import KVSender, KVSendRequest
from .kv import PRESETS, KVCache, KVCacheSpec, LayoutMismatchError, preset
from .nixl_backend import NixlKVReceiver, NixlKVSender, nixl_available  # nixl-cu12 itself is imported lazily

__all__ = [
    "KVCacheSpec",
    "KVCache",
    "PRESETS",
    "preset",
    "LayoutMismatchError",
    "BlockIdError",
    "TransferAbortedError",
    "TransferPlan",
    "plan_transfer",
    "KVSender",
    "KVReceiver",
    "KVSendRequest",
    "TransferRecord",
    "SubmitRecord",
    "KVStatistics",
    "NixlKVSender",
    "NixlKVReceiver",
    "nixl_available",
]
