"""The records of an ``shm://`` connection's rings: what a put, an inline put and a
pulled put write after the ring's record header (:mod:`transports._ring` has the ring
itself), the hello of a region offer, the ring space a batch of records takes, and the
fast :class:`~transports.Notification` builders (Python and C) the receive path uses."""

from __future__ import annotations

import struct

from . import _ring
from ._base import Notification

try:
    from . import _ringc
except ImportError:  # the optional C accelerator was not built
    _ringc = None
if _ringc is not None and not all(hasattr(x, a) for x, a in ((_ringc, "set_stream_copy"), (_ringc, "make_note"),
                                                               (getattr(_ringc, "Ring", None), "set_pulled"))):
    _ringc = None  # built from an older source: the pure-Python ring until it is rebuilt

__all__ = ["DONE", "INLINE", "PULL", "PULL_LAST", "PIECE_NBYTES", "KEY", "OFFER", "OFFER_MAGIC",
           "space_needed", "fast_note", "C_NOTES"]

DONE = struct.Struct("<IIQQQ")  # region_id, tag_len, offset, nbytes, notify_id (then the tag)
INLINE = struct.Struct("<IIQ")  # region_id, reserved, offset (then the data)
# dst region, src region, pieces, tag_len, notify_id, seq, span offset, span nbytes, flags, reserved;
# then the tag, then pieces x (u64 src_off, u64 dst_off, u64 nbytes)
PULL = struct.Struct("<IIIIQQQQII")
PULL_LAST = 1
PIECE_NBYTES = 24
KEY = struct.Struct("<QB")  # connection token, owner side
OFFER = struct.Struct("<8sI")  # a memfd for one of the sender's regions rides along (SCM_RIGHTS)
OFFER_MAGIC = b"QLSHMFD1"


def space_needed(head: int, ring_nbytes: int, payload_sizes) -> int:
    """Ring bytes (records, headers and pads) that writing these payloads from ``head`` takes."""
    total, pos = 0, head & (ring_nbytes - 1)
    for n in payload_sizes:
        need = _ring.RECORD_HEADER_NBYTES + ((n + 15) & ~15)
        if need > ring_nbytes - pos:
            total += ring_nbytes - pos
            pos = 0
        total += need
        pos = (pos + need) & (ring_nbytes - 1)
    return total


def fast_note(region_id: int, offset: int, nbytes: int, notify_id: int, tag: bytes) -> Notification:
    """A Notification without the frozen-dataclass __init__ (~1.5 us: one setattr per field):
    one dict update on a fresh instance, which is what __init__ leaves behind."""
    note = object.__new__(Notification)
    note.__dict__.update(region_id=region_id, offset=offset, nbytes=nbytes, notify_id=notify_id, tag=tag)
    return note


def check_note_shortcut() -> None:
    global fast_note
    probe = dict(region_id=1, offset=2, nbytes=3, notify_id=4, tag=b"t")
    try:
        ok = fast_note(**probe) == Notification(**probe)
    except (AttributeError, TypeError):
        ok = False
    if not ok:  # pragma: no cover - Notification changed shape (slots, new fields): use its constructor
        def fast_note(region_id, offset, nbytes, notify_id, tag):
            return Notification(region_id=region_id, offset=offset, nbytes=nbytes, notify_id=notify_id, tag=tag)


check_note_shortcut()


def c_notes_match() -> bool:
    """The C fast path builds Notifications without their ``__init__`` (like :func:`fast_note`);
    it runs only when what it builds equals what the constructor builds."""
    if _ringc is None or not hasattr(_ringc, "make_note"):  # not built, or built from an older source
        return False
    probe = dict(region_id=1, offset=2, nbytes=3, notify_id=(1 << 64) - 1, tag=b"t")
    try:
        made, ref = _ringc.make_note(Notification, *probe.values()), Notification(**probe)
        return made == ref and hash(made) == hash(ref) and repr(made) == repr(ref)
    except (AttributeError, TypeError):  # pragma: no cover - Notification changed shape
        return False


C_NOTES = c_notes_match()
