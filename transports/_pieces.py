"""The pieces of a vectored put (``put_many``): checked once with NumPy, copied without a
Python step per piece where NumPy can do it in one call.

Piece ``i`` is ``nbytes[i]`` bytes from ``src_offsets[i]`` of the source to
``dst_offsets[i]`` of the target region. :func:`copy_pieces` views both buffers as rows of
``unit`` bytes (the greatest common divisor of every offset and size, e.g. one KV block)
and moves every row in one NumPy call: ``take`` when the destination pieces follow each
other, a fancy-index assignment when the source pieces do (a staging buffer filled from a
socket), both through a temporary for small scattered pieces. Large scattered pieces, a
small unit, or destinations that overlap (later pieces must win) take a plain loop of
slice copies instead, which for pieces of a few KiB or more is as fast.

>>> import numpy as np
>>> so, do, ln = check_pieces([0, 8], [16, 0], [8, 4], src_nbytes=16, region_nbytes=32)
>>> dst, src = np.zeros(32, np.uint8), np.arange(16, dtype=np.uint8)
>>> copy_pieces(dst, src, so, do, ln)
>>> dst[:4].tolist(), dst[16:24].tolist()
([8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6, 7])
"""

from __future__ import annotations

import numpy as np

from qlink.errors import RegistrationError

__all__: list[str] = []  # private helpers of the transports

_MIN_UNIT = 64  # below this row size the index arrays cost more than the copy saves
_LOOP_MIN_MEAN = 4096  # scattered both ways: slice copies win from pieces this large on


def check_pieces(src_offsets, dst_offsets, nbytes, *, src_nbytes: int, region_nbytes: int, region_id: int = 0):
    """The pieces as three int64 arrays; raises before anything is written.

    TypeError for offsets that are not 1-D integer sequences, ValueError for lists of
    different lengths (or none) and pieces outside the source, RegistrationError for
    pieces outside the region.
    """
    if _first_bad is not None and type(nbytes) is np.ndarray and nbytes.dtype == np.int64 and nbytes.size \
            and type(src_offsets) is np.ndarray and src_offsets.dtype == np.int64 and src_offsets.ndim == 1 \
            and type(dst_offsets) is np.ndarray and dst_offsets.dtype == np.int64 and dst_offsets.ndim == 1 \
            and nbytes.ndim == 1 and src_offsets.size == dst_offsets.size == nbytes.size \
            and src_offsets.flags.c_contiguous and dst_offsets.flags.c_contiguous and nbytes.flags.c_contiguous \
            and _first_bad(src_offsets, dst_offsets, nbytes, src_nbytes, region_nbytes) < 0:
        return src_offsets, dst_offsets, nbytes  # int64 arrays, every piece good: one pass in C
    few = _few_checked(src_offsets, dst_offsets, nbytes, src_nbytes, region_nbytes)
    if few is not None:
        return few
    arrays = []
    for name, v in (("src_offsets", src_offsets), ("dst_offsets", dst_offsets), ("nbytes", nbytes)):
        a = np.asarray(v)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise TypeError(f"put_many {name} must be a 1-D sequence of integers, got {a.dtype} of shape {a.shape}")
        arrays.append(a.astype(np.int64, copy=False))
    so, do, ln = arrays
    if not (so.size == do.size == ln.size) or so.size == 0:
        raise ValueError(f"put_many needs src_offsets, dst_offsets and nbytes of one length >= 1, got lengths "
                         f"{so.size}, {do.size}, {ln.size}")
    if (ln < 0).any() or (so < 0).any() or (ln > src_nbytes).any() or (so > src_nbytes - ln).any():
        raise ValueError(f"put_many pieces must lie inside the {src_nbytes}-byte source: need 0 <= src_offsets, "
                         "0 <= nbytes and src_offsets + nbytes <= len(data)")
    bad = (do < 0) | (ln > region_nbytes) | (do > region_nbytes - ln)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise RegistrationError(f"put_many piece {i} ({int(ln[i])} bytes at offset {int(do[i])}) falls outside "
                                f"region {region_id} of {region_nbytes} bytes; need 0 <= dst_offsets and "
                                f"dst_offsets + nbytes <= {region_nbytes}")
    return so, do, ln


_FEW = 16  # piece lists up to this long are checked with plain integers (no NumPy call per check)

try:  # the same checks in one pass over int64 arrays (the C ring's build); NumPy's where it is missing
    from ._ringc import first_bad_piece as _first_bad
except ImportError:
    _first_bad = None


def outside(do: np.ndarray, ln: np.ndarray, limit: int) -> bool:
    """Whether some piece ``[do[i], do[i] + ln[i])`` (int64 arrays of one length) falls outside
    ``[0, limit)``: a received table's check against its region (one C pass where built).

    >>> outside(np.array([0, 8]), np.array([8, 8]), 16), outside(np.array([-1]), np.array([1]), 16)
    (False, True)
    """
    if _first_bad is not None:
        return _first_bad(do, do, ln, limit, limit) >= 0
    return bool(((do < 0) | (ln < 0) | (ln > limit) | (do > limit - ln)).any())


def _few_ok(src_offsets, dst_offsets, nbytes, src_nbytes: int, region_nbytes: int) -> list | None:
    """The pieces as ``(src_offset, dst_offset, nbytes)`` int tuples when they are few
    (up to ``_FEW``, Python ints or a short integer array each) and all good; else None
    (many, or some piece is bad: :func:`check_pieces` then says which)."""
    src_offsets, dst_offsets, nbytes = (_few_ints(v) for v in (src_offsets, dst_offsets, nbytes))
    if (type(src_offsets) in (list, tuple) and type(dst_offsets) in (list, tuple) and type(nbytes) in (list, tuple)
            and 0 < len(nbytes) <= _FEW and len(src_offsets) == len(dst_offsets) == len(nbytes)
            and all(type(v) is int for seq in (src_offsets, dst_offsets, nbytes) for v in seq)):
        out = list(zip(src_offsets, dst_offsets, nbytes))
        if all(0 <= n <= src_nbytes and 0 <= so <= src_nbytes - n and 0 <= do and n <= region_nbytes
               and do <= region_nbytes - n for so, do, n in out):
            return out
    return None


def _few_checked(src_offsets, dst_offsets, nbytes, src_nbytes: int, region_nbytes: int):
    """:func:`check_pieces`'s arrays for a few good pieces, checked with plain integers
    (a few microseconds where the NumPy checks take tens); None otherwise."""
    out = _few_ok(src_offsets, dst_offsets, nbytes, src_nbytes, region_nbytes)
    if out is None:
        return None
    so, do, ln = zip(*out)
    return np.array(so, np.int64), np.array(do, np.int64), np.array(ln, np.int64)


def check_few(src_offsets, dst_offsets, nbytes, *, src_nbytes: int, region_nbytes: int, region_id: int = 0):
    """The pieces as a list of ``(src_offset, dst_offset, nbytes)`` int tuples, checked as
    :func:`check_pieces` checks them (same errors). Short lists of Python ints are checked
    here in microseconds (a device put's pieces: a KV layer's K and V), short integer NumPy
    arrays too; anything else goes through :func:`check_pieces`.

    >>> check_few([0, 8], [16, 0], [8, 4], src_nbytes=16, region_nbytes=32)
    [(0, 16, 8), (8, 0, 4)]
    """
    out = _few_ok(src_offsets, dst_offsets, nbytes, src_nbytes, region_nbytes)
    if out is not None:
        return out
    so, do, ln = check_pieces(src_offsets, dst_offsets, nbytes, src_nbytes=src_nbytes, region_nbytes=region_nbytes,
                              region_id=region_id)  # raises with the message that names the bad piece
    return list(zip(so.tolist(), do.tolist(), ln.tolist()))


def _few_ints(v):
    """A short 1-D integer NumPy array as a list of ints (a transfer plan's offsets); else ``v``."""
    if type(v) is np.ndarray and v.ndim == 1 and v.size <= _FEW and v.dtype.kind in "iu":
        return v.tolist()
    return v


def message_groups(ln: np.ndarray, *, entry_nbytes: int, max_nbytes: int) -> list[tuple[int, int]]:
    """Split pieces into runs ``[start, stop)`` whose table entries (``entry_nbytes`` each)
    and bytes fit one message of ``max_nbytes`` (a piece larger than that goes alone).

    >>> message_groups(np.full(5, 1500), entry_nbytes=16, max_nbytes=4000)
    [(0, 2), (2, 4), (4, 5)]
    """
    if int(ln.sum()) + entry_nbytes * ln.size <= max_nbytes:  # (one reduction: the usual case)
        return [(0, int(ln.size))]
    cum = np.cumsum(ln + entry_nbytes)
    out, start, base = [], 0, 0
    while start < ln.size:
        stop = max(start + 1, int(np.searchsorted(cum, base + max_nbytes, side="right")))
        out.append((start, stop))
        base, start = int(cum[stop - 1]), stop
    return out


def span(do: np.ndarray, ln: np.ndarray) -> tuple[int, int]:
    """``(lowest destination, end of the highest piece)``: what one Notification covers."""
    if do.size <= _FEW:  # plain integers: a few microseconds less than two NumPy reductions
        d, n = do.tolist(), ln.tolist()
        return min(d), max(a + b for a, b in zip(d, n))
    return int(do.min()), int((do + ln).max())


def _follow(off: np.ndarray, ln: np.ndarray) -> bool:
    """Each piece starts where the one before it ends."""
    return off.size == 1 or bool(np.array_equal(off[1:], off[:-1] + ln[:-1]))


def _overlap(do: np.ndarray, ln: np.ndarray) -> bool:
    order = np.argsort(do, kind="stable")
    d, n = do[order], ln[order]
    return bool((d[1:] < d[:-1] + n[:-1]).any())


def _rows(off: np.ndarray, units: np.ndarray, unit: int) -> np.ndarray:
    """Row indices (rows of ``unit`` bytes) of every piece, piece after piece."""
    total = int(units.sum())
    first = np.repeat(off // unit - (np.cumsum(units) - units), units)
    return first + np.arange(total)


def copy_pieces(dst: np.ndarray, src: np.ndarray, so: np.ndarray, do: np.ndarray, ln: np.ndarray) -> None:
    """``dst[do[i]:do[i] + ln[i]] = src[so[i]:so[i] + ln[i]]`` for every piece, later pieces
    winning where destinations overlap. ``dst`` and ``src`` are 1-D uint8 arrays, the pieces
    already checked (:func:`check_pieces`)."""
    n = ln.size
    if n == 1:
        s, d, k = int(so[0]), int(do[0]), int(ln[0])
        dst[d:d + k] = src[s:s + k]
        return
    keep = ln > 0
    if not keep.all():
        so, do, ln = so[keep], do[keep], ln[keep]
        if ln.size == 0:
            return
    src_packed, dst_packed = _follow(so, ln), _follow(do, ln)
    if src_packed and dst_packed:  # one run on both sides
        s, d, k = int(so[0]), int(do[0]), int(ln.sum())
        dst[d:d + k] = src[s:s + k]
        return
    unit = int(np.gcd.reduce(np.concatenate((so, do, ln))))
    scattered_big = not (src_packed or dst_packed) and int(ln.sum()) >= _LOOP_MIN_MEAN * ln.size
    if unit < _MIN_UNIT or scattered_big or (not dst_packed and _overlap(do, ln)):
        for s, d, k in zip(so.tolist(), do.tolist(), ln.tolist()):
            dst[d:d + k] = src[s:s + k]
        return
    units = ln // unit
    s2 = src[:src.size // unit * unit].reshape(-1, unit)
    d2 = dst[:dst.size // unit * unit].reshape(-1, unit)
    total = int(units.sum())
    if dst_packed:  # gather: rows of the source into one run of the destination
        r0 = int(do[0]) // unit
        np.take(s2, _rows(so, units, unit), axis=0, out=d2[r0:r0 + total], mode="clip")  # indices checked
    elif src_packed:  # scatter: one run of the source into rows of the destination
        r0 = int(so[0]) // unit
        d2[_rows(do, units, unit)] = s2[r0:r0 + total]
    else:
        d2[_rows(do, units, unit)] = np.take(s2, _rows(so, units, unit), axis=0, mode="clip")
