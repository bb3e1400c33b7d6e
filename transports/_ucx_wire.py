"""The frames ``transports.ucx`` puts on UCX tags, and the sizes it works with.

A tag is ``kind << 56 | connection id << 32 | sequence``; the connection id is the
receiver's, so one UCX worker per process serves every endpoint.

* ``K_MSG`` (0x10): a two-sided message; its length is the UCX message length.
* ``K_CTRL`` (0x11): a control frame, :data:`CTRL` header (``u8 op, 3x, u32 region id,
  u64 offset, u64 nbytes, u64 notify id, u32 put sequence, u16 tag length, 2x``), then the
  put tag, then (put-inline only) the put bytes.
* ``K_DATA`` (0x20): the bytes of a large put; the sequence field pairs them with their
  put-header.
* A vectored put (``put_many``, when both hellos set ``FLAG_PUTV``) is one control frame
  ``OP_PUTV`` (or ``OP_PUTV_MORE`` when more vectored puts of the same ``put_many``
  follow) whose ``offset`` field holds the piece count and ``nbytes`` the size of its data
  message, then ONE ``K_DATA`` message: the piece table (:data:`PIECE`, ``u64 dst offset,
  u64 nbytes`` per piece) followed by the pieces' bytes, back to back. A data message is
  at most :data:`PUTV_MAX_NBYTES`; a larger ``put_many`` goes as several vectored puts.

>>> CTRL.size, PIECE.size, hex(tag_of(K_MSG, 7))
(40, 16, '0x1000000700000000')
>>> tag_of(K_MSG, 7) & MASK_MSG_OR_CTRL == tag_of(K_CTRL, 7) & MASK_MSG_OR_CTRL
True
"""

from __future__ import annotations

import struct

from ._base import MAX_TAG_BYTES

K_MSG, K_CTRL, K_DATA = 0x10, 0x11, 0x20
KIND_SHIFT, CONN_SHIFT = 56, 32
CONN_MASK = 0xFFFFFF
MASK_MSG_OR_CTRL = (0xFE << KIND_SHIFT) | (CONN_MASK << CONN_SHIFT) | 0xFFFFFFFF  # messages and control frames
MASK_CONN = CONN_MASK << CONN_SHIFT  # everything sent to one connection
MASK_FULL = (1 << 64) - 1

CTRL = struct.Struct("<B3xIQQQIH2x")
OP_PUT_INLINE, OP_PUT_HEADER, OP_REVOKE, OP_CLOSE, OP_WIREUP = 1, 2, 3, 4, 5
OP_PUTV, OP_PUTV_MORE = 6, 7  # a vectored put: the last (announced) one of its put_many, or one of those before
OP_PUT_DONE = 8  # a put_many written by UCX RMA (FLAG_RMA) is all in place: announce it (offset, nbytes: its span)
OP_PULL = 9  # (FLAG_RMA) read these pieces of my region with UCX RMA now: inline PULL_KEY, key, PULL_PIECE table
OP_PULLED = 10  # (FLAG_RMA) the OP_PULL of this seq is done (notify_id 0) or was refused (1)
OP_CMA = 11  # (FLAG_CMA) inline transports._ucx_cma.IDENTITY: a challenge (pid 0), or the proof (pid, where it is shown)
OP_CMA_VERDICT = 12  # (FLAG_CMA) notify_id 1: the peer's proof read back (its pieces may move by CMA), 0: not
PULL_KEY = struct.Struct("<H")  # length of the source region's address + packed remote key that follow
PULL_PIECE = struct.Struct("<QQQ")  # source offset, destination offset, bytes
PIECE = struct.Struct("<QQ")  # one entry of a vectored put's piece table
PUTV_MAX_NBYTES = 16 << 20  # largest vectored-put data message (table + bytes); also the staging kept per side
INLINE_PUT_MAX = 4096  # puts up to this size travel inside their control frame
CTRL_MAX = CTRL.size + MAX_TAG_BYTES + INLINE_PUT_MAX

SMALL = 8192  # messages up to this size are staged in fixed slots (UCX's eager range)
LIVENESS_INTERVAL_S = 0.02  # how often a waiting endpoint looks at its bootstrap socket
LINGER_MAX_S = 30.0  # how long a closed endpoint keeps staged sends alive for the peer
IN_PROGRESS = 1  # UCS_INPROGRESS


def tag_of(kind: int, conn_id: int, seq: int = 0) -> int:
    return (kind << KIND_SHIFT) | (conn_id << CONN_SHIFT) | seq
