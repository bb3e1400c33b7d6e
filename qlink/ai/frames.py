"""Frames of the KV movement protocol, all struct-packed (never pickled).

Every frame starts with the 24-byte request header of the CUDA-Q realtime decoder
wire (``u32 magic 'CUQR', u32 function_id, u32 arg_len, u32 request_id, u64
ptp_timestamp``, little-endian) with KV-specific FNV-1a 32 function ids, registered in
:data:`qlink.wire.REGISTRY`, so one parser and one validator serve decoder and KV
traffic alike (``qlink.wire.decode_request`` accepts every frame made here). The timestamp carries the
sender's submit time (``time.monotonic_ns``; comparable between processes on one host).

Frames:

* ``kv_hello``  (two-sided, once): role, mode, the cache spec and the region descriptors.
* ``kv_write``  (the tag of a one-sided put; also a NIXL notification): which layer,
  which part, how many parts and bytes make the layer complete.
* ``kv_data``   (two-sided, one descriptor): a ``kv_write`` plus the destination offset;
  the payload follows as the next message and lands directly in the cache.
* ``kv_rows``   (two-sided, gathered): a ``kv_write`` plus ``u32 num_rows, u32 row_nbytes``;
  the next message holds ``num_rows`` destination rows (``u32`` each: block ids of the
  layer seen as ``2 * num_blocks`` rows, K plane then V plane) followed by the rows'
  bytes, gathered by the sender and scattered by the receiver with NumPy.
* ``kv_abort``  (two-sided): the sender gave up on a request; its layers never complete.

>>> hex(fnv1a_32(b"enqueue_syndromes"))
'0x7ed8be82'
>>> t = pack_write(FN_WRITE, 7, 123, layer=2, layer_lo=0, layer_hi=4, num_parts=3, num_descs=3,
...                layer_nbytes=4096, part_nbytes=1024)
>>> len(t), unpack_write(t)[:4]
(64, (7, 123, 2, 0))
>>> wire.decode_request(t).function
'kv_write'
"""

from __future__ import annotations

import struct

from qlink import wire
from qlink.errors import WireError

__all__ = [
    "fnv1a_32",
    "HEADER",
    "MAGIC_REQUEST",
    "FN_HELLO",
    "FN_WRITE",
    "FN_DATA",
    "FN_ABORT",
    "FN_ROWS",
    "pack_rows",
    "unpack_rows",
    "pack_write",
    "unpack_write",
    "pack_data",
    "unpack_data",
    "pack_abort",
    "unpack_abort",
    "pack_hello",
    "unpack_hello",
    "hello_flags",
    "part_crc32",
    "HELLO_PARTS_CRC32",
    "function_of",
]

MAGIC_REQUEST = wire.REQUEST_MAGIC  # 'CUQR'
HEADER = wire.REQUEST_HEADER  # magic, function_id, arg_len, request_id, ptp_timestamp
assert HEADER.size == wire.HEADER_NBYTES
fnv1a_32 = wire.fnv1a_32

FN_HELLO = wire.function_id_for("kv_hello")
FN_WRITE = wire.function_id_for("kv_write")
FN_DATA = wire.function_id_for("kv_data")
FN_ABORT = wire.function_id_for("kv_abort")
FN_ROWS = wire.function_id_for("kv_rows")

# layer, layer_lo, layer_hi, num_parts, num_descs, reserved, layer_nbytes, part_nbytes
_WRITE = struct.Struct("<IIIIIIQQ")
_WRITE_FULL = struct.Struct(wire.REQUEST_HEADER.format + "IIIIIIQQ")
# ... then dst_offset
_DATA_FULL = struct.Struct(wire.REQUEST_HEADER.format + "IIIIIIQQ" + "Q")
# ... then num_rows, row_nbytes
_ROWS_FULL = struct.Struct(wire.REQUEST_HEADER.format + "IIIIIIQQ" + "II")
# status, layer, reason_len (reason utf-8 follows)
_ABORT_FULL = struct.Struct(wire.REQUEST_HEADER.format + "iII")
# role, mode, num_regions, spec_len (spec and descriptors follow: each u32 length + bytes)
_HELLO_FULL = struct.Struct(wire.REQUEST_HEADER.format + "BBHI")
_U32 = struct.Struct("<I")
_CRC_OFFSET = HEADER.size + 20  # the sixth u32 of the kv_write / kv_data arguments
HELLO_PARTS_CRC32 = 1

WRITE_NBYTES = _WRITE_FULL.size
WRITE_ARG_NBYTES = _WRITE.size
_MAX_REASON = 1024

# Known to qlink's one frame parser (qlink.wire.decode_request), beside the decoder calls.
for _name, _opts in (
    ("kv_hello", dict(min_payload_nbytes=_HELLO_FULL.size - HEADER.size)),
    ("kv_write", dict(payload_nbytes=_WRITE.size)),
    ("kv_data", dict(payload_nbytes=_DATA_FULL.size - HEADER.size)),
    ("kv_rows", dict(payload_nbytes=_ROWS_FULL.size - HEADER.size)),
    ("kv_abort", dict(min_payload_nbytes=_ABORT_FULL.size - HEADER.size,
                      max_payload_nbytes=_ABORT_FULL.size - HEADER.size + _MAX_REASON)),
):
    wire.register_function(_name, **_opts)
DATA_NBYTES = _DATA_FULL.size


def function_of(frame) -> int:
    """The function id of a frame after checking its magic and length fields."""
    if len(frame) < HEADER.size:
        raise WireError(f"KV frame of {len(frame)} bytes is shorter than the {HEADER.size}-byte header")
    magic, fn, arg_len, _, _ = HEADER.unpack_from(frame, 0)
    if magic != MAGIC_REQUEST:
        raise WireError(f"KV frame has bad magic 0x{magic:08x}, expected 0x{MAGIC_REQUEST:08x} ('CUQR')")
    if HEADER.size + arg_len != len(frame):
        raise WireError(f"KV frame declares arg_len {arg_len} but {len(frame) - HEADER.size} payload bytes follow")
    return fn


def pack_write(fn: int, request_id: int, submit_ns: int, *, layer: int, layer_lo: int, layer_hi: int,
               num_parts: int, num_descs: int, layer_nbytes: int, part_nbytes: int) -> bytes:
    """A whole kv_write frame (``fn``: FN_WRITE, or a sibling id): one layer's announcement."""
    return _WRITE_FULL.pack(MAGIC_REQUEST, fn, _WRITE.size, request_id, submit_ns,
                            layer, layer_lo, layer_hi, num_parts, num_descs, 0, layer_nbytes, part_nbytes)


def unpack_write(frame) -> tuple:
    """``(request_id, submit_ns, layer, layer_lo, layer_hi, num_parts, num_descs, layer_nbytes, part_nbytes)``."""
    if len(frame) != _WRITE_FULL.size:
        raise WireError(f"kv_write frame must be {_WRITE_FULL.size} bytes, got {len(frame)}")
    magic, fn, arg_len, rid, ts, layer, lo, hi, parts, descs, _, lnb, pnb = _WRITE_FULL.unpack_from(frame, 0)
    if magic != MAGIC_REQUEST or fn != FN_WRITE or arg_len != _WRITE.size:
        raise WireError(f"not a kv_write frame (magic 0x{magic:08x}, function 0x{fn:08x}, arg_len {arg_len})")
    return rid, ts, layer, lo, hi, parts, descs, lnb, pnb


def pack_data(request_id: int, submit_ns: int, *, layer: int, layer_lo: int, layer_hi: int, num_parts: int,
              num_descs: int, layer_nbytes: int, part_nbytes: int, dst_offset: int, crc32: int = 0) -> bytes:
    """A kv_data frame's header (the part's bytes follow it): where the part goes, its CRC-32."""
    return _DATA_FULL.pack(MAGIC_REQUEST, FN_DATA, _DATA_FULL.size - HEADER.size, request_id, submit_ns,
                           layer, layer_lo, layer_hi, num_parts, num_descs, crc32, layer_nbytes, part_nbytes,
                           dst_offset)


def unpack_data(frame) -> tuple:
    """Like :func:`unpack_write` plus ``dst_offset`` at the end."""
    if len(frame) != _DATA_FULL.size:
        raise WireError(f"kv_data frame must be {_DATA_FULL.size} bytes, got {len(frame)}")
    magic, fn, arg_len, rid, ts, layer, lo, hi, parts, descs, _, lnb, pnb, off = _DATA_FULL.unpack_from(frame, 0)
    if magic != MAGIC_REQUEST or fn != FN_DATA or arg_len != _DATA_FULL.size - HEADER.size:
        raise WireError(f"not a kv_data frame (magic 0x{magic:08x}, function 0x{fn:08x}, arg_len {arg_len})")
    return rid, ts, layer, lo, hi, parts, descs, lnb, pnb, off


def pack_rows(request_id: int, submit_ns: int, *, layer: int, layer_lo: int, layer_hi: int, num_parts: int,
              num_descs: int, layer_nbytes: int, num_rows: int, row_nbytes: int, crc32: int = 0) -> bytes:
    """A ``kv_rows`` frame; its part is ``num_rows * row_nbytes`` bytes (the table not counted).

    >>> unpack_rows(pack_rows(3, 9, layer=1, layer_lo=0, layer_hi=2, num_parts=1, num_descs=5,
    ...                       layer_nbytes=4096, num_rows=4, row_nbytes=1024))[-3:]
    (4096, 4, 1024)
    """
    return _ROWS_FULL.pack(MAGIC_REQUEST, FN_ROWS, _ROWS_FULL.size - HEADER.size, request_id, submit_ns,
                           layer, layer_lo, layer_hi, num_parts, num_descs, crc32, layer_nbytes,
                           num_rows * row_nbytes, num_rows, row_nbytes)


def unpack_rows(frame) -> tuple:
    """Like :func:`unpack_write` plus ``num_rows, row_nbytes`` at the end."""
    if len(frame) != _ROWS_FULL.size:
        raise WireError(f"kv_rows frame must be {_ROWS_FULL.size} bytes, got {len(frame)}")
    magic, fn, arg_len, rid, ts, layer, lo, hi, parts, descs, _, lnb, pnb, nrows, row_nb = \
        _ROWS_FULL.unpack_from(frame, 0)
    if magic != MAGIC_REQUEST or fn != FN_ROWS or arg_len != _ROWS_FULL.size - HEADER.size:
        raise WireError(f"not a kv_rows frame (magic 0x{magic:08x}, function 0x{fn:08x}, arg_len {arg_len})")
    if pnb != nrows * row_nb:
        raise WireError(f"kv_rows frame: part of {pnb} B is not {nrows} rows of {row_nb} B")
    return rid, ts, layer, lo, hi, parts, descs, lnb, pnb, nrows, row_nb


def pack_abort(request_id: int, *, status: int, layer: int, reason: str) -> bytes:
    """A kv_abort frame: the request failed at ``layer`` with ``status``; ``reason`` cut to fit."""
    r = reason.encode("utf-8", "replace")[:_MAX_REASON]
    return _ABORT_FULL.pack(MAGIC_REQUEST, FN_ABORT, _ABORT_FULL.size - HEADER.size + len(r), request_id, 0,
                            status, layer, len(r)) + r


def unpack_abort(frame) -> tuple[int, int, int, str]:
    """``(request_id, status, layer, reason)``."""
    if len(frame) < _ABORT_FULL.size:
        raise WireError(f"kv_abort frame of {len(frame)} bytes is shorter than {_ABORT_FULL.size}")
    magic, fn, arg_len, rid, _, status, layer, rlen = _ABORT_FULL.unpack_from(frame, 0)
    if fn != FN_ABORT or _ABORT_FULL.size + rlen != len(frame) or HEADER.size + arg_len != len(frame):
        raise WireError("malformed kv_abort frame (reason length does not match the frame)")
    return rid, status, layer, bytes(frame[_ABORT_FULL.size:]).decode("utf-8", "replace")


def pack_hello(*, role: int, mode: int, spec: bytes, regions: list[bytes], flags: int = 0) -> bytes:
    """``flags``: :data:`HELLO_PARTS_CRC32` when the sender puts a CRC-32 of every part in
    its kv_write / kv_data frame (the u32 otherwise reserved)."""
    body = [_U32.pack(len(spec)), spec]
    for r in regions:
        body += [_U32.pack(len(r)), r]
    payload = b"".join(body)
    return _HELLO_FULL.pack(MAGIC_REQUEST, FN_HELLO, _HELLO_FULL.size - HEADER.size + len(payload), 0, 0,
                            role, mode, len(regions), flags) + payload


def hello_flags(frame) -> int:
    """The flags word of a kv_hello frame (validate it with :func:`unpack_hello` first)."""
    return _HELLO_FULL.unpack_from(frame, 0)[-1]


def part_crc32(frame) -> int:
    """The CRC-32 a kv_write tag or kv_data frame carries for its part (0 when the sender
    does not checksum; the hello says whether it does)."""
    return _U32.unpack_from(frame, _CRC_OFFSET)[0]


def unpack_hello(frame) -> tuple[int, int, bytes, list[bytes]]:
    """``(role, mode, spec_bytes, [region descriptor bytes])``; WireError when malformed."""
    mv = memoryview(frame).cast("B")
    if function_of(mv) != FN_HELLO or len(mv) < _HELLO_FULL.size:
        raise WireError("expected a kv_hello frame from the peer (is the peer a qlink KV engine?)")
    *_, role, mode, nregions, _ = _HELLO_FULL.unpack_from(mv, 0)
    pos = _HELLO_FULL.size
    items = []
    for _i in range(1 + nregions):
        if pos + 4 > len(mv):
            raise WireError("kv_hello frame ends inside an item length")
        (n,) = _U32.unpack_from(mv, pos)
        pos += 4
        if pos + n > len(mv):
            raise WireError(f"kv_hello item of {n} bytes runs past the end of the frame")
        items.append(bytes(mv[pos:pos + n]))
        pos += n
    if pos != len(mv):
        raise WireError(f"kv_hello frame has {len(mv) - pos} trailing bytes")
    return role, mode, items[0], items[1:]
