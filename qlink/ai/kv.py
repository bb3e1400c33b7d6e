"""Paged KV caches laid out as vLLM's FlashAttention backend keeps them.

Per layer one array of shape ``(2, num_blocks, block_size, num_kv_heads, head_size)``:
plane 0 holds the keys, plane 1 the values, and a *block* is ``block_size`` tokens of
one plane. A request owns a list of block ids; moving a request moves those blocks of
both planes in every layer.

``num_planes=1`` is the layout of vLLM's CPU attention backend: per layer
``(num_blocks, num_kv_heads, block_size, 2 * head_size)``, one contiguous slab per block
holding its keys and values, so a *block* is both K and V of ``block_size`` tokens.

``bfloat16`` is stored as ``uint16`` (NumPy has no bfloat16): the bits are kept exactly
and moved exactly, and :attr:`KVCacheSpec.dtype_name` says how to read them. Every other
dtype is stored as itself.

>>> from qlink.ai.kv import preset, KVCache
>>> preset("llama-3-8b").bytes_per_token
131072
>>> preset("llama-3-70b").bytes_per_token
327680
>>> spec = preset("tiny", num_blocks=8)
>>> spec.layer_shape, spec.storage_dtype, spec.block_nbytes
((2, 8, 4, 2, 16), dtype('uint16'), 256)
>>> cache = KVCache.allocate(spec)
>>> len(cache.layers), cache.layers[0].shape, cache.nbytes
(4, (2, 8, 4, 2, 16), 16384)
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

import numpy as np

from qlink.errors import CapabilityError, QlinkError, missing
from qlink.memory import alloc

__all__ = [
    "KVCacheSpec",
    "KVCache",
    "LayoutMismatchError",
    "PRESETS",
    "preset",
    "DTYPES",
]

# dtype name -> storage dtype (bfloat16 keeps its bits in uint16)
DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(np.uint16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "fp8_e4m3": np.dtype(np.uint8),
    "uint8": np.dtype(np.uint8),
}
_DTYPE_CODES = {name: i for i, name in enumerate(DTYPES)}
_DTYPE_NAMES = {i: name for name, i in _DTYPE_CODES.items()}

# magic, num_layers, num_kv_heads, head_size, block_size, num_blocks, dtype code
# (then num_planes: 0 on the wire means 2, so a two-plane spec keeps its old bytes)
_SPEC = struct.Struct("<4sIIIIQBB2x")
_SPEC_MAGIC = b"QLKV"

# Fields both sides of a transfer must agree on (num_blocks may differ).
_MATCH_FIELDS = ("num_layers", "num_kv_heads", "head_size", "block_size", "dtype_name", "num_planes")


class LayoutMismatchError(QlinkError, ValueError):
    """The two sides of a transfer disagree on the KV-cache layout.

    ``field`` names the first field that differs; ``local`` and ``remote`` its values.
    """

    def __init__(self, message: str, *, field: str, local=None, remote=None):
        super().__init__(message)
        self.field = field
        self.local = local
        self.remote = remote


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of a paged KV cache.

    >>> s = KVCacheSpec(num_layers=32, num_kv_heads=8, head_size=128, block_size=16, num_blocks=4)
    >>> s.bytes_per_token, s.kv_nbytes(num_tokens=512), s.blocks_for(num_tokens=20)
    (131072, 67108864, 2)
    >>> KVCacheSpec.from_bytes(s.to_bytes()) == s
    True
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int = 16
    dtype_name: str = "bfloat16"
    num_blocks: int = 0
    num_planes: int = 2  # 2: separate K and V planes; 1: one K+V slab per block (vLLM CPU)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.num_blocks, (int, np.integer)) or self.num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative integer, got {self.num_blocks!r}")
        if self.dtype_name not in DTYPES:
            raise ValueError(f"dtype_name must be one of {sorted(DTYPES)}, got {self.dtype_name!r}")
        if self.num_planes not in (1, 2):
            raise ValueError(f"num_planes must be 2 (K and V planes) or 1 (one K+V slab per block), "
                             f"got {self.num_planes!r}")

    # ----- sizes ---------------------------------------------------------------
    @property
    def storage_dtype(self) -> np.dtype:
        """The NumPy dtype the bytes live in (``uint16`` for bfloat16)."""
        return DTYPES[self.dtype_name]

    @property
    def itemsize(self) -> int:
        return self.storage_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V over all layers: ``2 * num_layers * num_kv_heads * head_size * itemsize``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.itemsize

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one plane (K or V) of one layer; with ``num_planes=1``,
        of one block's K and V together."""
        return (2 // self.num_planes) * self.block_size * self.num_kv_heads * self.head_size * self.itemsize

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, heads, head_size)``; with ``num_planes=1``
        ``(num_blocks, heads, block_size, 2 * head_size)``.

        >>> preset("tiny", num_blocks=3, num_planes=1).layer_shape
        (3, 2, 4, 32)
        """
        if self.num_planes == 1:
            return (self.num_blocks, self.num_kv_heads, self.block_size, 2 * self.head_size)
        return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def layer_nbytes(self) -> int:
        return self.num_planes * self.num_blocks * self.block_nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache (all layers)."""
        return self.num_layers * self.layer_nbytes

    def blocks_for(self, *, num_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` tokens occupies (rounded up)."""
        return -(-int(num_tokens) // self.block_size)

    def kv_nbytes(self, *, num_tokens: int) -> int:
        """Bytes moved for a request of ``num_tokens`` tokens (whole blocks, all layers)."""
        return self.blocks_for(num_tokens=num_tokens) * self.block_size * self.bytes_per_token

    def with_blocks(self, num_blocks: int) -> "KVCacheSpec":
        """The same layout with another number of blocks."""
        return dataclasses.replace(self, num_blocks=int(num_blocks))

    # ----- agreement between two sides ---------------------------------------
    def check_compatible(self, other: "KVCacheSpec", *, side: str = "peer") -> None:
        """Raise :class:`LayoutMismatchError` naming the first field that differs
        (``num_blocks`` may differ: each side pages its own blocks).

        >>> a = preset("tiny", num_blocks=8)
        >>> a.check_compatible(a.with_blocks(16))
        >>> a.check_compatible(dataclasses.replace(a, head_size=32))
        Traceback (most recent call last):
        ...
        qlink.ai.kv.LayoutMismatchError: KV layout mismatch on head_size: local 16, peer 32; both sides...
        """
        for name in _MATCH_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise LayoutMismatchError(
                    f"KV layout mismatch on {name}: local {mine!r}, {side} {theirs!r}; both sides "
                    f"must use the same {', '.join(_MATCH_FIELDS)}",
                    field=name, local=mine, remote=theirs,
                )

    # ----- wire form -----------------------------------------------------------
    def to_bytes(self) -> bytes:
        return _SPEC.pack(_SPEC_MAGIC, self.num_layers, self.num_kv_heads, self.head_size, self.block_size,
                          self.num_blocks, _DTYPE_CODES[self.dtype_name], 0 if self.num_planes == 2 else self.num_planes)

    @classmethod
    def from_bytes(cls, data) -> "KVCacheSpec":
        """Parse :meth:`to_bytes` output; a malformed spec raises LayoutMismatchError(field="encoding")."""
        mv = memoryview(data).cast("B")
        if len(mv) != _SPEC.size:
            raise LayoutMismatchError(f"KV spec must be {_SPEC.size} bytes, got {len(mv)}", field="encoding")
        magic, nl, nh, hs, bs, nb, code, planes = _SPEC.unpack_from(mv, 0)
        if magic != _SPEC_MAGIC:
            raise LayoutMismatchError(f"KV spec has bad magic {magic!r}, expected {_SPEC_MAGIC!r}", field="encoding")
        if code not in _DTYPE_NAMES:
            raise LayoutMismatchError(f"KV spec has unknown dtype code {code}", field="dtype_name")
        try:
            return cls(num_layers=nl, num_kv_heads=nh, head_size=hs, block_size=bs, dtype_name=_DTYPE_NAMES[code],
                       num_blocks=nb, num_planes=planes or 2)
        except ValueError as e:
            raise LayoutMismatchError(f"KV spec from peer is invalid: {e}", field="encoding") from None

    SIZE_BYTES = _SPEC.size


# name -> (num_layers, num_kv_heads, head_size, dtype_name, default block_size); from the models' configs
PRESETS: dict[str, tuple[int, int, int, str, int]] = {
    "llama-3-8b": (32, 8, 128, "bfloat16", 16),
    "llama-3-70b": (80, 8, 128, "bfloat16", 16),
    "tiny": (4, 2, 16, "bfloat16", 4),
}


def preset(name: str, *, num_blocks: int = 0, block_size: int | None = None, num_planes: int = 2) -> KVCacheSpec:
    """A named layout (``PRESETS``) with ``num_blocks`` blocks.

    >>> preset("llama-3-70b", num_blocks=2).layer_shape
    (2, 2, 16, 8, 128)
    """
    try:
        nl, nh, hs, dt, bs = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown KV preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
    return KVCacheSpec(num_layers=nl, num_kv_heads=nh, head_size=hs, block_size=bs if block_size is None else block_size,
                       dtype_name=dt, num_blocks=num_blocks, num_planes=num_planes)


def _cupy():
    try:
        import cupy
    except ImportError:
        raise missing("cupy-cuda12x", extra="gpu", feature="a KV cache in GPU memory") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError when no driver / no device
        raise CapabilityError(f"a KV cache on device='gpu' needs an NVIDIA GPU, and CUDA finds none here ({e}); "
                              "use device='cpu'") from None
    if n < 1:
        raise CapabilityError("a KV cache on device='gpu' needs an NVIDIA GPU, and CUDA finds none here; use device='cpu'")
    return cupy


class KVCache:
    """Per-layer paged KV arrays of one worker.

    ``layers[i]`` has shape ``spec.layer_shape``; ``layers[i][0]`` is the K plane and
    ``layers[i][1]`` the V plane. Use :meth:`allocate` to make one.
    """

    def __init__(self, spec: KVCacheSpec, layers: list, *, device: str = "cpu"):
        if len(layers) != spec.num_layers:
            raise ValueError(f"expected {spec.num_layers} layer arrays, got {len(layers)}")
        for i, a in enumerate(layers):
            if tuple(a.shape) != spec.layer_shape or np.dtype(a.dtype) != spec.storage_dtype:
                raise ValueError(f"layer {i} has shape {tuple(a.shape)} dtype {a.dtype}, expected "
                                 f"{spec.layer_shape} {spec.storage_dtype}")
        self.spec = spec
        self.layers = list(layers)
        self.device = device

    @classmethod
    def allocate(cls, spec: KVCacheSpec, *, device: str = "cpu", shared: bool = True) -> "KVCache":
        """Zeroed per-layer arrays. ``device="cpu"``: host memory, from :func:`qlink.memory.alloc`
        when ``shared`` (so ``shm://`` puts land zero-copy) else plain NumPy; ``device="gpu"``:
        CuPy arrays (raises CapabilityError without a GPU)."""
        if spec.num_blocks <= 0:
            raise ValueError("spec.num_blocks must be positive to allocate a cache; use spec.with_blocks(n)")
        if device == "cpu":
            make = (lambda: alloc(spec.layer_shape, dtype=spec.storage_dtype)) if shared else \
                (lambda: np.zeros(spec.layer_shape, dtype=spec.storage_dtype))
            return cls(spec, [make() for _ in range(spec.num_layers)], device="cpu")
        if device == "gpu":
            cp = _cupy()
            return cls(spec, [cp.zeros(spec.layer_shape, dtype=spec.storage_dtype) for _ in range(spec.num_layers)],
                       device="gpu")
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    def fill_random(self, *, seed: int) -> None:
        """Fill every layer with reproducible random bits (for tests and benchmarks)."""
        rng = np.random.default_rng(seed)
        for a in self.layers:
            flat = a.reshape(-1).view(np.uint8)
            if self.device == "cpu":
                flat[...] = rng.integers(0, 256, size=flat.size, dtype=np.uint8)
            else:
                flat[...] = _cupy().asarray(rng.integers(0, 256, size=flat.size, dtype=np.uint8))

    def block_checksums(self, block_ids, *, layers=None) -> np.ndarray:
        """CRC-32 of every (layer, plane, block): shape ``(len(layers), num_planes, len(block_ids))``.

        Compare the sender's checksums of its source blocks with the receiver's of the
        destination blocks to check a transfer bit for bit.
        """
        import zlib

        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.spec.num_blocks):
            raise IndexError(f"block ids must be in [0, {self.spec.num_blocks}), got range [{ids.min()}, {ids.max()}]")
        layer_ids = range(self.spec.num_layers) if layers is None else list(layers)
        planes = self.spec.num_planes
        out = np.zeros((len(layer_ids), planes, ids.size), dtype=np.uint32)
        for li, layer in enumerate(layer_ids):
            a = self.layers[layer]
            if self.device != "cpu":
                a = a.get()
            for kind in range(planes):
                for j, b in enumerate(ids):
                    out[li, kind, j] = zlib.crc32((a[kind, b] if planes == 2 else a[b]).tobytes())
        return out
