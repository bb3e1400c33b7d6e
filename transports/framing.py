"""qlink's own stream framing: the 32-byte frame header and the connection handshake.

Stream transports (``tcp://``) carry two-sided messages and emulated one-sided puts
as frames on one byte stream. Every frame starts with a fixed little-endian header

======  =====  ===========================================================
offset  type   field
======  =====  ===========================================================
0       u8     kind: MSG 1, PUT 2, DEREG 3 (region withdrawn), BYE 4 (orderly close)
1       u8     flags (reserved, 0)
2       u16    tag_nbytes: bytes of put tag after the header (<= 256)
4       u32    region_id (PUT, DEREG)
8       u64    nbytes: payload bytes after the tag (<= 1 GiB)
16      u64    offset into the region (PUT)
24      u64    notify_id (PUT)
======  =====  ===========================================================

followed by the tag and the payload. A connection opens with a 16-byte hello from
the client (magic ``QLTC``, protocol version, flags, the client's 8-byte region key)
answered by an 18-byte reply (magic, the server's version, a status, the server's
region key, the length of a UTF-8 reason that follows). A listener refuses a peer
that speaks another magic or version with a reason it can print.

>>> hdr = bytearray(HEADER.size)
>>> pack_header(hdr, KIND_PUT, nbytes=5, region_id=3, offset=8, notify_id=1, tag_nbytes=2)
>>> parse_header(hdr)
(2, 2, 3, 5, 8, 1)
>>> parse_header(b"\\x09" + bytes(31))
Traceback (most recent call last):
...
qlink.errors.WireError: frame kind 9 is unknown (expected 1 MSG, 2 PUT, 3 DEREG or 4 BYE); the stream is out of step
"""

from __future__ import annotations

import struct

from qlink.errors import WireError

from ._base import MAX_TAG_BYTES

__all__: list[str] = []  # private wire format; see the module docstring

KIND_MSG = 1
KIND_PUT = 2
KIND_DEREG = 3
KIND_BYE = 4
_KIND_NAMES = {KIND_MSG: "MSG", KIND_PUT: "PUT", KIND_DEREG: "DEREG", KIND_BYE: "BYE"}

MAX_FRAME_PAYLOAD = 1 << 30

#: kind, flags, tag_nbytes, region_id, nbytes, offset, notify_id
HEADER = struct.Struct("<BBHIQQQ")



def native_layout() -> dict:
    """The frame header's format and numbers, as plain data for native code (the QEC hot
    path reads and writes whole MSG frames itself, and checks it implements this format).

    >>> native_layout()["header"], native_layout()["KIND_MSG"]
    ('<BBHIQQQ', 1)
    """
    return {"header": HEADER.format, "KIND_MSG": KIND_MSG, "KIND_BYE": KIND_BYE,
            "MAX_FRAME_PAYLOAD": MAX_FRAME_PAYLOAD}


MAGIC = b"QLTC"
PROTOCOL_VERSION = 1
#: magic, version, flags, region key
HELLO = struct.Struct("<4sHHQ")
#: magic, version, status, region key, reason_nbytes
REPLY = struct.Struct("<4sHHQH")
STATUS_OK = 0
STATUS_BAD_MAGIC = 1
STATUS_BAD_VERSION = 2
MAX_REASON_BYTES = 1024


def pack_header(buf, kind: int, *, nbytes: int, region_id: int = 0, offset: int = 0, notify_id: int = 0,
                tag_nbytes: int = 0, at: int = 0) -> None:
    """Write a frame header into ``buf`` at ``at`` (no allocation)."""
    HEADER.pack_into(buf, at, kind, 0, tag_nbytes, region_id, nbytes, offset, notify_id)


def parse_header(buf, at: int = 0) -> tuple[int, int, int, int, int, int]:
    """Read and validate a header: ``(kind, tag_nbytes, region_id, nbytes, offset, notify_id)``.

    Raises WireError naming the fault; a stream that fails here cannot be resynchronized.
    """
    kind, _flags, tag_nbytes, region_id, nbytes, offset, notify_id = HEADER.unpack_from(buf, at)
    if kind not in _KIND_NAMES:
        raise WireError(f"frame kind {kind} is unknown (expected 1 MSG, 2 PUT, 3 DEREG or 4 BYE); the stream is out of step")
    if nbytes > MAX_FRAME_PAYLOAD:
        raise WireError(f"{_KIND_NAMES[kind]} frame announces {nbytes} payload bytes, more than the {MAX_FRAME_PAYLOAD} allowed")
    if tag_nbytes > MAX_TAG_BYTES:
        raise WireError(f"{_KIND_NAMES[kind]} frame announces a {tag_nbytes}-byte tag, more than MAX_TAG_BYTES={MAX_TAG_BYTES}")
    if kind != KIND_PUT and tag_nbytes:
        raise WireError(f"{_KIND_NAMES[kind]} frame carries a {tag_nbytes}-byte tag; only PUT frames have tags")
    if kind in (KIND_DEREG, KIND_BYE) and nbytes:
        raise WireError(f"{_KIND_NAMES[kind]} frame announces {nbytes} payload bytes; it has none")
    return kind, tag_nbytes, region_id, nbytes, offset, notify_id


def pack_hello(region_key: int, *, version: int = PROTOCOL_VERSION) -> bytes:
    """The client's opening 16 bytes."""
    return HELLO.pack(MAGIC, version, 0, region_key)


def check_hello(data) -> tuple[int, int, str]:
    """Validate a client hello: ``(status, client_region_key, reason)``; reason is '' when accepted."""
    magic, version, _flags, key = HELLO.unpack_from(data, 0)
    if magic != MAGIC:
        return STATUS_BAD_MAGIC, 0, (
            f"qlink tcp listener refused the connection: the client's first 4 bytes were {bytes(magic)!r}, "
            f"expected the magic {MAGIC!r} of a qlink tcp client (protocol version {PROTOCOL_VERSION})"
        )
    if version != PROTOCOL_VERSION:
        return STATUS_BAD_VERSION, 0, (
            f"qlink tcp listener refused the connection: the client speaks protocol version {version}, "
            f"this listener speaks version {PROTOCOL_VERSION}; use matching qlink versions on both sides"
        )
    return STATUS_OK, key, ""


def pack_reply(status: int, region_key: int, reason: str = "") -> bytes:
    """The listener's answer to a hello (accepted when ``status == STATUS_OK``)."""
    text = reason.encode("utf-8")[:MAX_REASON_BYTES]
    return REPLY.pack(MAGIC, PROTOCOL_VERSION, status, region_key, len(text)) + text


def parse_reply(data) -> tuple[int, int, int, int]:
    """``(version, status, server_region_key, reason_nbytes)`` of a reply header; WireError if not qlink."""
    magic, version, status, key, reason_nbytes = REPLY.unpack_from(data, 0)
    if magic != MAGIC:
        raise WireError(f"the tcp server answered with {bytes(magic)!r} instead of the qlink magic {MAGIC!r}; "
                        "is a qlink listener on that port?")
    if reason_nbytes > MAX_REASON_BYTES:
        raise WireError(f"the tcp server's refusal reason is {reason_nbytes} bytes, more than {MAX_REASON_BYTES}")
    return version, status, key, reason_nbytes
