"""A single-producer / single-consumer byte ring in shared memory (pure-Python reference).

This module defines the ring's byte layout, which the C accelerator
(``transports._ringc``) implements identically; either implementation can sit on
either end of one ring.

Layout of a ring region (all integers little-endian)::

    header, HEADER_NBYTES = 512 bytes, one 64-byte cache line per field:
      [  0] u64 magic "QLRING01"   [  8] u64 data_nbytes (a power of two)
      [ 64] u64 head   (bytes ever written; stored by the producer only)
      [128] u64 tail   (bytes ever consumed; stored by the consumer only)
      [192] u64 producer_closed    [256] u64 consumer_closed
      [320] u64 producer_cpu: 1 + the CPU the producer last sent from, 0 if unknown
            (a scheduling hint only, written by the C producer; the C consumer yields
            its CPU when the producer last ran on it)
      [384] u64 pulled: the sequence number of the last deferred put the consumer has
            pulled (``KIND_PUT_PULL``; stored by the consumer only, read by the producer)
    data area, data_nbytes bytes, a sequence of records:
      u32 nbytes, u16 kind, u16 reserved, u64 aux, then nbytes of payload,
      padded so every record starts on a 16-byte boundary.

A record never wraps: when it does not fit before the end of the data area the
producer first writes a ``KIND_PAD`` record covering the rest, and the consumer
skips it. Records carry at most ``max_payload`` bytes (a quarter of the ring, at
most 256 KiB), so an empty ring always has room for one; longer messages are
streamed as several records by the endpoint.

Memory ordering: the producer writes the record, then stores ``head``; the
consumer loads ``head``, then reads the record, then stores ``tail``. In this
pure-Python version those are plain NumPy stores and loads of aligned 8-byte
words, which is enough on x86-64 (loads are not reordered with loads, stores not
with stores, and aligned 8-byte accesses are atomic). Other CPUs need the C
version, which uses acquire/release atomics.

>>> import numpy as np
>>> mem = np.zeros(ring_region_nbytes(1024), dtype=np.uint8)
>>> init_ring(mem, data_nbytes=1024)
>>> tx, rx = Ring(mem), Ring(mem)
>>> tx.try_send_msg(b"hello")
1
>>> out = bytearray(16)
>>> rx.try_recv(out, 0), bytes(out[:5])
(5, b'hello')
>>> rx.try_recv(out, 0)  # empty
-1
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = [
    "Ring",
    "init_ring",
    "ring_region_nbytes",
    "max_payload_of",
    "HEADER_NBYTES",
    "RECORD_HEADER_NBYTES",
    "MIN_DATA_NBYTES",
    "MAX_DATA_NBYTES",
    "KIND_PAD",
    "KIND_MSG",
    "KIND_MSG_CONT",
    "KIND_PUT_INLINE",
    "KIND_PUT_DONE",
    "KIND_PUT_PULL",
    "KIND_CORRUPT",
    "SEND_OK",
    "SEND_FULL",
    "SEND_TOO_BIG",
    "SEND_PEER_CLOSED",
    "RELEASED",
    "RECV_EMPTY",
    "RECV_SLOW",
]

HEADER_NBYTES = 512
RECORD_HEADER_NBYTES = 16
MIN_DATA_NBYTES = 1024
MAX_DATA_NBYTES = 1 << 30
RING_MAGIC = int.from_bytes(b"QLRING01", "little")
_MAX_RECORD = 1 << 18

# u64 word indices in the header
_W_MAGIC, _W_SIZE, _W_HEAD, _W_TAIL, _W_PCLOSED, _W_CCLOSED, _W_PULLED = 0, 1, 8, 16, 24, 32, 48

# record kinds (0 is never written: zeroed memory must not look like a record)
KIND_CORRUPT = 0  # returned by peek() for a record that fails validation
KIND_PAD = 1
KIND_MSG = 2  # a message, or the first chunk of one; aux = total message bytes
KIND_MSG_CONT = 3  # a later chunk of a message; aux = its offset in the message
KIND_PUT_INLINE = 4  # put data for a region the initiator cannot map; applied by the target
KIND_PUT_DONE = 5  # put completion: the target queues a Notification
KIND_PUT_PULL = 6  # deferred put: pieces the target copies out of the initiator's registered memory

# try_send* results
SEND_OK = 1
SEND_FULL = 0
SEND_TOO_BIG = -1
SEND_PEER_CLOSED = -2
RELEASED = -3
# try_recv results (besides n >= 0)
RECV_EMPTY = -1
RECV_SLOW = -2

_REC = struct.Struct("<IHHQ")


def max_payload_of(data_nbytes: int) -> int:
    """Largest payload one record may carry in a ring of ``data_nbytes``."""
    return min(data_nbytes // 4, _MAX_RECORD) - RECORD_HEADER_NBYTES


def ring_region_nbytes(data_nbytes: int) -> int:
    """Bytes of shared memory a ring with ``data_nbytes`` of data needs (header included)."""
    _check_size(data_nbytes)
    return HEADER_NBYTES + data_nbytes


def _check_size(data_nbytes: int) -> None:
    if not (MIN_DATA_NBYTES <= data_nbytes <= MAX_DATA_NBYTES) or data_nbytes & (data_nbytes - 1):
        raise ValueError(
            f"ring data_nbytes must be a power of two between {MIN_DATA_NBYTES} and {MAX_DATA_NBYTES}, got {data_nbytes}"
        )


def init_ring(buffer, *, data_nbytes: int) -> None:
    """Write an empty ring's header into ``buffer`` (done once, by the side that creates it)."""
    _check_size(data_nbytes)
    mv = memoryview(buffer).cast("B")
    if len(mv) < HEADER_NBYTES + data_nbytes:
        raise ValueError(f"ring needs {HEADER_NBYTES + data_nbytes} bytes, buffer has {len(mv)}")
    words = np.frombuffer(mv[:HEADER_NBYTES], dtype=np.uint64)
    words[:] = 0
    words[_W_SIZE] = data_nbytes
    words[_W_MAGIC] = RING_MAGIC


class Ring:
    """One end (or both ends, in tests) of a ring; see the module docstring for the layout.

    A process uses a ``Ring`` as producer (``try_send*``) or consumer (``try_recv``,
    ``peek``, ``consume``); the producer's position and the consumer's position are
    kept locally and published to the shared header.
    """

    impl = "python"

    def __init__(self, buffer) -> None:
        mv = memoryview(buffer).cast("B")
        if mv.readonly:
            raise TypeError("a ring needs writable memory")
        if len(mv) < HEADER_NBYTES + MIN_DATA_NBYTES:
            raise ValueError(f"buffer of {len(mv)} bytes is too small for a ring")
        words = np.frombuffer(mv[:HEADER_NBYTES], dtype=np.uint64)
        if int(words[_W_MAGIC]) != RING_MAGIC:
            raise ValueError("buffer does not hold a ring (bad magic); call init_ring first")
        size = int(words[_W_SIZE])
        _check_size(size)
        if len(mv) < HEADER_NBYTES + size:
            raise ValueError(f"ring header says {size} data bytes but the buffer holds {len(mv) - HEADER_NBYTES}")
        self._mv = mv
        self._w = words
        self._data = mv[HEADER_NBYTES:HEADER_NBYTES + size]
        self.nbytes = size
        self.max_payload = max_payload_of(size)
        self._mask = size - 1
        self._head = int(words[_W_HEAD])  # producer: next write position
        self._tail_cache = int(words[_W_TAIL])
        self._tail = int(words[_W_TAIL])  # consumer: next read position
        self._head_cache = int(words[_W_HEAD])
        self.messages = 0  # messages moved by try_send_msg / try_recv (the fast paths)
        self.message_bytes = 0
        self._released = False

    # ----- shared state ---------------------------------------------------------
    @property
    def data(self) -> memoryview:
        """The data area (payload offsets from :meth:`peek` index into it)."""
        return self._data

    @property
    def producer_head(self) -> int:
        """The producer's write position (bytes ever written)."""
        return self._head

    @property
    def head(self) -> int:
        return int(self._w[_W_HEAD])

    @property
    def tail(self) -> int:
        return int(self._w[_W_TAIL])

    @property
    def producer_closed(self) -> bool:
        return bool(self._w[_W_PCLOSED])

    @property
    def consumer_closed(self) -> bool:
        return bool(self._w[_W_CCLOSED])

    @property
    def pulled(self) -> int:
        """Sequence number of the last deferred put the consumer has pulled."""
        return int(self._w[_W_PULLED])

    def set_pulled(self, seq: int) -> None:
        """Consumer: publish that the deferred put ``seq`` has been pulled (after its bytes)."""
        self._w[_W_PULLED] = seq

    def set_producer_closed(self) -> None:
        self._w[_W_PCLOSED] = 1

    def set_consumer_closed(self) -> None:
        self._w[_W_CCLOSED] = 1

    def release(self) -> None:
        """Drop the reference to the shared memory; later calls return RELEASED."""
        if not self._released:
            self._released = True
            self._data = self._mv = None
            self._w = np.zeros(HEADER_NBYTES // 8, dtype=np.uint64)

    # ----- producer -------------------------------------------------------------
    def free_nbytes(self) -> int:
        """Bytes the producer could write now (records, pads and headers included)."""
        self._tail_cache = int(self._w[_W_TAIL])
        return self.nbytes - (self._head - self._tail_cache)

    def _reserve(self, need: int) -> int:
        pos = self._head & self._mask
        contiguous = self.nbytes - pos
        total = need if need <= contiguous else contiguous + need
        if self.nbytes - (self._head - self._tail_cache) < total:
            self._tail_cache = int(self._w[_W_TAIL])
            if self.nbytes - (self._head - self._tail_cache) < total:
                return -1
        if need > contiguous:
            _REC.pack_into(self._data, pos, contiguous - RECORD_HEADER_NBYTES, KIND_PAD, 0, 0)
            self._head += contiguous
            pos = 0
        return pos

    def try_send(self, kind: int, aux: int, part1, part2=None) -> int:
        """Write one record whose payload is ``part1`` followed by ``part2``."""
        if self._released:
            return RELEASED
        if self._w[_W_CCLOSED]:
            return SEND_PEER_CLOSED
        p1 = memoryview(part1).cast("B")
        p2 = memoryview(part2).cast("B") if part2 is not None else None
        n = len(p1) + (len(p2) if p2 is not None else 0)
        if n > self.max_payload:
            return SEND_TOO_BIG
        need = RECORD_HEADER_NBYTES + ((n + 15) & ~15)
        pos = self._reserve(need)
        if pos < 0:
            return SEND_FULL
        d = self._data
        _REC.pack_into(d, pos, n, kind, 0, aux)
        start = pos + RECORD_HEADER_NBYTES
        d[start:start + len(p1)] = p1
        if p2 is not None:
            d[start + len(p1):start + n] = p2
        self._head += need
        self._w[_W_HEAD] = self._head  # publish: after the record's bytes (x86 store order)
        return SEND_OK

    def try_send_msg(self, data) -> int:
        """Write a whole message as one record (``SEND_TOO_BIG`` if it needs streaming)."""
        if self._released:
            return RELEASED
        try:
            p = memoryview(data)
            if p.ndim != 1 or p.format != "B":
                p = p.cast("B")
        except (TypeError, ValueError):
            return SEND_TOO_BIG  # not a contiguous buffer: the caller's slow path says why
        r = self.try_send(KIND_MSG, len(p), p)
        if r == SEND_OK:
            self.messages += 1
            self.message_bytes += len(p)
        return r

    # ----- consumer -------------------------------------------------------------
    def _head_record(self):
        """(kind, nbytes, aux, pos) of the first non-pad record, None when empty."""
        while True:
            if self._tail == self._head_cache:
                self._head_cache = int(self._w[_W_HEAD])
                if self._tail == self._head_cache:
                    return None
            pos = self._tail & self._mask
            nbytes, kind, _, aux = _REC.unpack_from(self._data, pos)
            stride = RECORD_HEADER_NBYTES + ((nbytes + 15) & ~15)
            if stride > self.nbytes - pos or stride > self._head_cache - self._tail:
                return (KIND_CORRUPT, nbytes, aux, pos)
            if kind == KIND_PAD:
                self._tail += stride
                self._w[_W_TAIL] = self._tail
                continue
            return (kind, nbytes, aux, pos)

    def poll(self, spin_iters: int) -> bool:
        """Spin up to ``spin_iters`` times for a record; True when one is there."""
        if self._released:
            return False
        for _ in range(spin_iters + 1):
            if self._head_record() is not None:
                return True
        return False

    def try_recv(self, out, spin_iters: int) -> int:
        """Copy the next message into ``out`` if it is a whole message that fits.

        Returns its size, ``RECV_EMPTY`` when nothing arrived within ``spin_iters``
        polls, ``RECV_SLOW`` when the next record needs :meth:`peek` (a notification,
        a chunked message, a message larger than ``out``), ``RELEASED`` after release.
        """
        if self._released:
            return RELEASED
        rec = None
        for _ in range(spin_iters + 1):
            rec = self._head_record()
            if rec is not None:
                break
        if rec is None:
            return RECV_EMPTY
        kind, nbytes, aux, pos = rec
        try:
            o = memoryview(out)
            if o.ndim != 1 or o.format != "B":
                o = o.cast("B")
        except (TypeError, ValueError):
            return RECV_SLOW  # not a contiguous buffer: the caller's slow path says why
        if o.readonly:
            return RECV_SLOW
        if kind != KIND_MSG or nbytes != aux or nbytes > len(o):
            return RECV_SLOW
        start = pos + RECORD_HEADER_NBYTES
        o[:nbytes] = self._data[start:start + nbytes]
        self._tail += RECORD_HEADER_NBYTES + ((nbytes + 15) & ~15)
        self._w[_W_TAIL] = self._tail  # publish: after the payload was read
        self.messages += 1
        self.message_bytes += nbytes
        return nbytes

    def peek(self):
        """``(kind, nbytes, aux, payload_offset)`` of the next record, or None.

        ``kind`` is ``KIND_CORRUPT`` when the record's length does not fit the ring.
        """
        if self._released:
            return None
        rec = self._head_record()
        if rec is None:
            return None
        kind, nbytes, aux, pos = rec
        return (kind, nbytes, aux, pos + RECORD_HEADER_NBYTES)

    def consume(self) -> None:
        """Advance past the record :meth:`peek` returned."""
        if self._released:
            return
        rec = self._head_record()
        if rec is None or rec[0] == KIND_CORRUPT:
            raise RuntimeError("consume() without a valid record at the head of the ring")
        self._tail += RECORD_HEADER_NBYTES + ((rec[1] + 15) & ~15)
        self._w[_W_TAIL] = self._tail
