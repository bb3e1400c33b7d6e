"""Block ids -> byte ranges, merged into as few transfers as possible (NumPy, no per-block loop).

Within one layer's array ``(2, num_blocks, block_size, heads, head_size)`` block ``b`` of
plane ``k`` (0 = K, 1 = V) starts at byte ``(k * num_blocks + b) * block_nbytes``. A request
maps source block ``src[i]`` to destination block ``dst[i]``; the pairs are sorted by
destination and consecutive pairs whose source *and* destination offsets both advance by
one block are merged into one descriptor. The plan is the same for every layer, so it is
computed once per request. With ``num_planes=1`` (vLLM's CPU layout, one K+V slab per
block) block ``b`` starts at ``b * block_nbytes`` and there is no second plane.

>>> p = plan_transfer([4, 5, 6, 9], [0, 1, 2, 3], src_num_blocks=16, dst_num_blocks=8, block_nbytes=64)
>>> p.num_descs, p.src_offsets.tolist(), p.dst_offsets.tolist(), p.nbytes.tolist()
(4, [256, 576, 1280, 1600], [0, 192, 512, 704], [192, 64, 192, 64])
>>> p.layer_nbytes
512
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qlink.errors import QlinkError

__all__ = ["BlockIdError", "TransferPlan", "plan_transfer"]


class BlockIdError(QlinkError, ValueError):
    """A request's block-id lists are unusable: out of range, of different lengths,
    empty, or naming one destination block twice."""


@dataclass(frozen=True)
class TransferPlan:
    """Per-layer byte ranges of one request (identical for every layer)."""

    src_offsets: np.ndarray  # int64, per descriptor, byte offset in the source layer region
    dst_offsets: np.ndarray  # int64, per descriptor, byte offset in the destination layer region
    nbytes: np.ndarray       # int64, per descriptor
    num_blocks: int          # blocks per plane in the request
    block_nbytes: int
    num_planes: int = 2      # 2: K and V planes; 1: one K+V slab per block

    @property
    def num_descs(self) -> int:
        return int(self.nbytes.size)

    @property
    def layer_nbytes(self) -> int:
        """Bytes moved per layer (K and V)."""
        return self.num_planes * self.num_blocks * self.block_nbytes

    def block_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Every block moved (K plane, then V plane) as a row index of the source and of the
        destination layer seen as rows of ``block_nbytes`` (``num_planes * num_blocks`` rows), in
        descriptor order (int64; NumPy, no per-block loop).

        >>> p = plan_transfer([4, 5, 9], [0, 1, 2], src_num_blocks=16, dst_num_blocks=8, block_nbytes=64)
        >>> [r.tolist() for r in p.block_rows()]
        [[4, 5, 9, 20, 21, 25], [0, 1, 2, 8, 9, 10]]
        """
        bn = self.block_nbytes
        units = self.nbytes // bn
        within = np.arange(int(units.sum())) - np.repeat(np.cumsum(units) - units, units)
        return np.repeat(self.src_offsets // bn, units) + within, np.repeat(self.dst_offsets // bn, units) + within


def _ids(name: str, ids) -> np.ndarray:
    a = np.asarray(ids)
    if a.ndim != 1:
        raise BlockIdError(f"{name} must be a 1-D list of block ids, got an array of shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise BlockIdError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def plan_transfer(src_block_ids, dst_block_ids, *, src_num_blocks: int, dst_num_blocks: int, block_nbytes: int,
                  max_desc_nbytes: int | None = None, num_planes: int = 2) -> TransferPlan:
    """Validate the block lists and merge contiguous runs (see the module docstring).

    ``max_desc_nbytes`` splits longer runs (whole blocks per piece) for transports with a
    message size limit. ``num_planes=1``: one slab per block, no V plane.

    >>> plan_transfer([1, 2, 5], [0, 1, 2], src_num_blocks=8, dst_num_blocks=4, block_nbytes=64,
    ...               num_planes=1).src_offsets.tolist()
    [64, 320]

    >>> plan_transfer([0, 1], [0], src_num_blocks=4, dst_num_blocks=4, block_nbytes=8)
    Traceback (most recent call last):
    ...
    qlink.ai._descriptors.BlockIdError: src_block_ids has 2 ids but dst_block_ids has 1; they pair up one to one
    """
    src = _ids("src_block_ids", src_block_ids)
    dst = _ids("dst_block_ids", dst_block_ids)
    if src.size != dst.size:
        raise BlockIdError(f"src_block_ids has {src.size} ids but dst_block_ids has {dst.size}; they pair up one to one")
    if src.size == 0:
        raise BlockIdError("a request must move at least one block (both block-id lists are empty)")
    for name, a, n in (("src_block_ids", src, src_num_blocks), ("dst_block_ids", dst, dst_num_blocks)):
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise BlockIdError(f"{name} contains block id {bad}, outside the cache's blocks [0, {n})")
    order = np.argsort(dst, kind="stable")
    d_sorted = dst[order]
    if d_sorted.size > 1 and not np.all(np.diff(d_sorted)):
        dup = int(d_sorted[np.flatnonzero(np.diff(d_sorted) == 0)[0]])
        raise BlockIdError(f"dst_block_ids names block {dup} more than once; each destination block takes one source")
    s_sorted = src[order]
    bn = int(block_nbytes)
    if num_planes not in (1, 2):
        raise ValueError(f"num_planes must be 1 or 2, got {num_planes!r}")
    if num_planes == 2:
        s = np.concatenate([s_sorted, s_sorted + src_num_blocks]) * bn
        d = np.concatenate([d_sorted, d_sorted + dst_num_blocks]) * bn
    else:
        s, d = s_sorted * bn, d_sorted * bn
    brk = (np.diff(s) != bn) | (np.diff(d) != bn)
    starts = np.flatnonzero(np.concatenate([[True], brk]))
    lengths = np.diff(np.concatenate([starts, [s.size]])) * bn
    s0, d0 = s[starts], d[starts]
    if max_desc_nbytes is not None:
        cap = (int(max_desc_nbytes) // bn) * bn
        if cap <= 0:
            raise ValueError(f"max_desc_nbytes={max_desc_nbytes} is smaller than one block ({bn} bytes)")
        if lengths.max() > cap:
            k = -(-lengths // cap)
            idx = np.repeat(np.arange(lengths.size), k)
            within = np.arange(idx.size) - np.repeat(np.cumsum(k) - k, k)
            off = within * cap
            s0, d0 = s0[idx] + off, d0[idx] + off
            lengths = np.minimum(cap, lengths[idx] - off)
    return TransferPlan(src_offsets=s0.astype(np.int64), dst_offsets=d0.astype(np.int64),
                        nbytes=lengths.astype(np.int64), num_blocks=int(src.size), block_nbytes=bn,
                        num_planes=int(num_planes))
