"""The frames a ``tcp://`` stream carries beyond :mod:`transports.framing`: the vectored put
(PUTV, kind 5, protocol version 2). Its header's ``offset`` field holds the number of pieces;
its payload is a table of ``u64 dst_offset, u64 nbytes`` per piece, then the pieces. A
put_many larger than one frame goes as several PUTV frames, all but the last flagged MORE.
Protocol version 3 adds the PUTV flag ACK and the frame PUTV_ACK (kind 6, header only): a side
that has read a PUTV frame flagged ACK answers with a PUTV_ACK whose ``offset`` counts the ACK
frames it has read so far; that is how a sender learns that the pages of its spliced
(deferred) puts are free again. The count is cumulative, so one answer may cover several
frames: qlink answers once its socket runs dry, not while the next frame's bytes are there.

>>> import socket

import numpy as np
>>> frame_groups(np.array([10, 20, 30]))  # all three pieces and their table fit one frame
[(0, 3)]
>>> check_putv_header(0, 0, 40, 3)
Traceback (most recent call last):
...
qlink.errors.WireError: PUTV frame announces 3 pieces but only 40 payload bytes (16 per table entry)
"""

from __future__ import annotations

import socket

import numpy as np

from qlink.errors import WireError

from . import framing as fr
from ._base import MAX_TAG_BYTES
from ._pieces import message_groups

__all__ = ["KIND_PUTV", "KIND_PUTV_ACK", "PUTV_ACK", "PUTV_MORE", "PIECE_NBYTES", "MAX_PIECE_NBYTES", "SEND_FLAGS",
           "check_ack_header", "check_putv_header", "frame_groups"]

SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # every write to a tcp stream: a gone peer is an error, not SIGPIPE

KIND_PUTV = 5
KIND_PUTV_ACK = 6  # protocol version 3: "I have read this many PUTV frames flagged ACK" (in offset)
PUTV_MORE = 1  # header flags of a PUTV frame: more frames of the same put_many follow
PUTV_ACK = 2  # (version 3) answer with a PUTV_ACK once this frame is read: its pages were spliced
PIECE_NBYTES = 16  # u64 dst_offset, u64 nbytes per piece in a PUTV table
MAX_PIECE_NBYTES = fr.MAX_FRAME_PAYLOAD - PIECE_NBYTES


def check_putv_header(flags: int, tag_nbytes: int, nbytes: int, count: int, *, version: int = 2) -> None:
    """Validate the header of a PUTV frame (``count``: the pieces in its table) read on a
    link of protocol ``version``."""
    if flags & ~(PUTV_MORE | (PUTV_ACK if version >= 3 else 0)):
        raise WireError(f"PUTV frame carries unknown flags 0x{flags:02x}")
    if nbytes > fr.MAX_FRAME_PAYLOAD:
        raise WireError(f"PUTV frame announces {nbytes} payload bytes, more than the {fr.MAX_FRAME_PAYLOAD} allowed")
    if tag_nbytes > MAX_TAG_BYTES:
        raise WireError(f"PUTV frame announces a {tag_nbytes}-byte tag, more than MAX_TAG_BYTES={MAX_TAG_BYTES}")
    if count < 1 or count * PIECE_NBYTES > nbytes:
        raise WireError(f"PUTV frame announces {count} pieces but only {nbytes} payload bytes (16 per table entry)")


def check_ack_header(flags: int, tag_nbytes: int, nbytes: int) -> None:
    """Validate the header of a PUTV_ACK frame: no flags, no tag, no payload.

    >>> check_ack_header(0, 0, 4)
    Traceback (most recent call last):
    ...
    qlink.errors.WireError: PUTV_ACK frame announces 4 payload bytes, flags 0x00 and a 0-byte tag; it has none of them
    """
    if flags or tag_nbytes or nbytes:
        raise WireError(f"PUTV_ACK frame announces {nbytes} payload bytes, flags 0x{flags:02x} and a "
                        f"{tag_nbytes}-byte tag; it has none of them")


def frame_groups(ln: np.ndarray) -> list[tuple[int, int]]:
    """Split the pieces of a put_many into runs whose table and bytes fit one frame."""
    return message_groups(ln, entry_nbytes=PIECE_NBYTES, max_nbytes=fr.MAX_FRAME_PAYLOAD)
