"""Region tables of an ``shm://`` connection: what each side registered, in shared memory.

Each side owns one table of ``TABLE_SLOTS`` slots inside the connection's memfd and
the peer only reads it: a put is validated against the target's own table before a
byte is written, and a region in :func:`qlink.memory.alloc` memory is found there so
the initiator can map it and write it directly. A slot is 8 little-endian u64 words::

    [0] state: region_id << 32 | flags (ACTIVE 1, SHARED 2); 0 when free.
        Written last when registering, first when deregistering.
    [1] region nbytes       [2] offset of the region in its alloc() block
    [3] the block's fd in the owner process    [4] st_ino  [5] st_dev of that memfd
    [6] block nbytes        [7] owner pid

``region_id`` = generation << 12 | slot, so a reused slot gets a new id and an old
descriptor stops matching. The owner also hands the block's memfd to the peer over the
connection socket when it registers (``SCM_RIGHTS``; :meth:`PeerRegions.offer_fd`), so the
peer can map the region even after the owner has died (a deferred put it posted is still
pulled) or from another PID namespace; without it the peer opens ``/proc/<pid>/fd/<fd>``.
Either way the inode is checked before mapping; when neither works the put falls back to
inline records, which the target applies itself.

Each side also keeps a private mirror of its own table (``LocalRegions.c_table``: state,
nbytes, address and a spare word per slot) that the C fast path validates incoming
notifications and deferred puts against, so what the peer writes into the shared table never
decides what this side accepts or where it writes.

A deferred put runs the other way round: its source lies in a region the *initiator*
registered in alloc() memory; the target maps it through the initiator's table
(:meth:`PeerRegions.source`) and copies the pieces out itself.

>>> import numpy as np
>>> words = memoryview(bytearray(TABLE_NBYTES)).cast("Q")
>>> mine = LocalRegions(words, key=b"k")
>>> region = mine.register(np.zeros(16, dtype=np.uint8))
>>> peer = PeerRegions(words, key=b"k")
>>> peer.target(region.descriptor(), offset=8, nbytes=8) is None  # plain numpy memory: inline put
True
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from qlink.errors import CapabilityError, RegistrationError
from qlink.memory import Region, RemoteRegion, is_device_array, shared_fd_of

__all__ = ["LocalRegions", "PeerRegions", "TABLE_SLOTS", "TABLE_NBYTES", "C_WORDS", "MAX_OFFERED_FDS"]

TABLE_SLOTS = 4096
_SLOT_BITS = 12
_SLOT_WORDS = 8
TABLE_NBYTES = TABLE_SLOTS * _SLOT_WORDS * 8
_MASK = TABLE_SLOTS - 1
_ACTIVE, _SHARED = 1, 2
C_WORDS = 4  # words per slot of LocalRegions.c_table: state, nbytes, address, spare
MAX_OFFERED_FDS = 256  # memfds of the peer's regions held before they are mapped (each is an open fd)
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class LocalRegions:
    """This side's registered regions and the table the peer reads."""

    def __init__(self, words: memoryview, *, key: bytes) -> None:
        self._q = words  # a 'Q' memoryview over this side's table
        self._key = key
        self._regions: dict[int, tuple[Region, memoryview]] = {}
        self._free = list(range(TABLE_SLOTS - 1, -1, -1))
        self._gen = [0] * TABLE_SLOTS
        self._fds: dict[int, int] = {}  # region id -> its alloc() block's memfd (owned by qlink.memory)
        self.c_table = np.zeros(C_WORDS * TABLE_SLOTS, dtype=np.uint64)  # private mirror, see the module notes

    def register(self, array) -> Region:
        if is_device_array(array) and not hasattr(array, "__array_interface__"):
            raise CapabilityError("shm registers host memory only; device arrays need a transport with device_memory")
        if not self._free:
            raise RegistrationError(f"this shm endpoint already has {TABLE_SLOTS} regions registered; "
                                    "deregister some (or register one larger pool) first")
        slot = self._free.pop()
        gen = self._gen[slot] + 1
        rid = ((gen << _SLOT_BITS) | slot) & 0xFFFFFFFF
        try:
            region = Region.of(array, region_id=rid, key=self._key)
            view = region.view
            shared = shared_fd_of(array) if region.nbytes else None
            q, base = self._q, slot * _SLOT_WORDS
            q[base] = 0
            q[base + 1] = region.nbytes
            flags = _ACTIVE
            if shared is not None:
                fd, block_off, _ = shared
                st = os.fstat(fd)
                q[base + 2], q[base + 3], q[base + 4] = block_off, fd, st.st_ino
                q[base + 5], q[base + 6], q[base + 7] = st.st_dev, st.st_size, os.getpid()
                flags |= _SHARED
            q[base] = (rid << 32) | flags  # published last (x86 keeps stores in order)
            c = C_WORDS * slot
            self.c_table[c + 1], self.c_table[c + 2] = region.nbytes, region.address
            self.c_table[c] = (rid << 32) | flags
        except BaseException:
            self._free.append(slot)
            raise
        self._gen[slot] = gen
        self._regions[rid] = (region, view)
        if shared is not None:
            self._fds[rid] = shared[0]
        return region

    def shared_fd(self, rid: int) -> int | None:
        """The memfd of a registered region in alloc() memory (to hand to the peer), else None."""
        return self._fds.get(rid)

    def deregister(self, region: Region, *, publish: bool = True) -> None:
        rid = region.region_id
        entry = self._regions.get(rid)
        if entry is None or (entry[0] is not region and entry[0].array is not region.array):
            raise RegistrationError(f"region {rid} is not registered on this shm endpoint")
        del self._regions[rid]
        self._fds.pop(rid, None)
        slot = rid & _MASK
        self.c_table[C_WORDS * slot] = 0
        if publish:
            self._q[slot * _SLOT_WORDS] = 0
        self._free.append(slot)

    def get(self, rid: int) -> tuple[Region, memoryview] | None:
        """(region, flat byte view) of a registered region, or None."""
        return self._regions.get(rid)

    def containing(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """``(region_id, offset)`` of a registered alloc() region holding ``[address, address + nbytes)``
        (one the peer can map), or None."""
        q = self._q
        for rid, (region, _) in self._regions.items():
            off = address - region.address
            if 0 <= off and off + nbytes <= region.nbytes and q[(rid & _MASK) * _SLOT_WORDS] & _SHARED:
                return rid, off
        return None

    def clear(self) -> None:
        self._regions.clear()
        self._fds.clear()
        self.c_table[:] = 0


class PeerRegions:
    """The peer's table, read to validate and place puts; caches the peer's mapped blocks."""

    def __init__(self, words: memoryview, *, key: bytes, counters: dict | None = None) -> None:
        self._q = words
        self._key = key
        self._x = counters if counters is not None else {}
        self._cache: dict[int, tuple[int, int, memoryview | None]] = {}  # rid -> (state, nbytes, view)
        self._maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self._offered: dict[int, int] = {}  # region id -> memfd the peer handed over (ours to close)
        self.on_unmap = None  # called with a region id before its mapping goes (the C fast path forgets it)
        self.before_map = None  # called before mapping a region (the endpoint collects offered memfds)

    def offer_fd(self, rid: int, fd: int) -> None:
        """Take ownership of the memfd the peer sent for its region ``rid`` (at most
        ``MAX_OFFERED_FDS`` are kept unmapped; past that, regions are mapped through /proc)."""
        old = self._offered.pop(rid, None)
        if old is not None:
            os.close(old)
        if len(self._offered) >= MAX_OFFERED_FDS:  # first those the peer deregistered, then the oldest
            for r in [r for r in self._offered if not self._active(r)] or [next(iter(self._offered))]:
                os.close(self._offered.pop(r))
        self._offered[rid] = fd

    def _active(self, rid: int) -> bool:
        state = self._q[(rid & _MASK) * _SLOT_WORDS]
        return state >> 32 == rid and bool(state & _ACTIVE)

    @property
    def words(self) -> memoryview:
        """The peer's table (u64 words), as the C fast path reads it."""
        return self._q

    def target(self, remote: RemoteRegion, *, offset: int, nbytes: int) -> memoryview | None:
        """Validate a put of ``nbytes`` at ``offset`` into ``remote``; return the mapped
        region (zero-copy put) or None (inline put). Raises RegistrationError."""
        return self.entry(remote, offset=offset, nbytes=nbytes)[2]

    def entry(self, remote: RemoteRegion, *, offset: int, nbytes: int) -> tuple[int, int, memoryview | None]:
        """Like :meth:`target`, returning ``(state word, region nbytes, mapped view or None)``."""
        rid = remote.region_id
        e = self._cache.get(rid)
        if (e is None or self._q[(rid & _MASK) * _SLOT_WORDS] != e[0] or remote.key != self._key
                or remote.nbytes != e[1] or remote.kind != "host"):
            e = self._lookup(remote)
        if offset < 0 or offset + nbytes > e[1]:
            raise RegistrationError(
                f"put of {nbytes} bytes at offset {offset} falls outside region {rid} of {e[1]} bytes; "
                f"need 0 <= offset and offset + nbytes <= {e[1]}"
            )
        return e

    def source(self, rid: int) -> tuple[int, memoryview] | None:
        """``(state word, mapped view)`` of region ``rid`` as the peer registered it, for
        copying out of it (a deferred put); None when it is not registered or not mappable."""
        q, base = self._q, (rid & _MASK) * _SLOT_WORDS
        state = q[base]
        if state >> 32 != rid or not state & _ACTIVE:
            return None
        try:
            state, _, view = self.entry(RemoteRegion(region_id=rid, nbytes=q[base + 1], key=self._key), offset=0,
                                        nbytes=0)
        except (RegistrationError, CapabilityError):
            return None
        return None if view is None else (state, view)

    def _lookup(self, remote: RemoteRegion) -> tuple[int, int, memoryview | None]:
        rid = remote.region_id
        self._cache.pop(rid, None)
        if remote.key != self._key:
            raise RegistrationError(
                f"region descriptor {rid} was not issued by this connection's peer "
                "(register on the peer and pass its descriptor over this connection)"
            )
        if remote.kind != "host":
            raise CapabilityError("shm puts into host memory only; the descriptor is for device memory")
        q, base = self._q, (rid & _MASK) * _SLOT_WORDS
        state = q[base]
        if state >> 32 != rid or not state & _ACTIVE:
            self._unmap(rid)
            raise RegistrationError(f"region {rid} is not registered at the peer (never registered, or deregistered)")
        nbytes = q[base + 1]
        if nbytes != remote.nbytes:
            raise RegistrationError(f"descriptor says region {rid} has {remote.nbytes} bytes, the peer registered {nbytes}")
        view = self._map(rid, base, nbytes) if state & _SHARED else None
        if q[base] != state:
            raise RegistrationError(f"region {rid} was deregistered at the peer while being looked up")
        if len(self._cache) >= 1024:
            self.prune()
        e = (state, nbytes, view)
        self._cache[rid] = e
        return e

    def _map(self, rid: int, base: int, nbytes: int) -> memoryview | None:
        entry = self._maps.get(rid)
        if entry is not None:
            return entry[1]
        q = self._q
        block_off, fd, ino, dev, block_nbytes, pid = (q[base + i] for i in range(2, 8))
        if self.before_map is not None:
            self.before_map()
        view = None
        for how in ("offered", "proc"):
            if how == "offered":
                f = self._offered.pop(rid, -1)
            else:
                try:
                    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
                except OSError:
                    f = -1
            if f < 0:
                continue
            try:
                st = os.fstat(f)
                if st.st_ino == ino and st.st_dev == dev and st.st_size >= block_nbytes > 0:
                    mm = mmap.mmap(f, block_nbytes, flags=_MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                    view = memoryview(mm)[block_off:block_off + nbytes]
                    self._maps[rid] = (mm, view)
            except (OSError, ValueError):
                view = None
            finally:
                os.close(f)
            if view is not None:
                break
        if view is None:
            self._x["zero_copy_unavailable"] = self._x.get("zero_copy_unavailable", 0) + 1
        return view

    def _unmap(self, rid: int) -> None:
        if self.on_unmap is not None:
            self.on_unmap(rid)
        entry = self._maps.pop(rid, None)
        if entry is not None:
            try:
                entry[1].release()
                entry[0].close()
            except BufferError:  # a slice (or a copy running in another thread) still uses it; it goes with it
                pass

    def prune(self) -> None:
        """Forget regions the peer has deregistered since they were looked up."""
        for rid in list(set(self._cache) | set(self._maps) | set(self._offered)):
            state = self._q[(rid & _MASK) * _SLOT_WORDS]
            if state >> 32 != rid or not state & _ACTIVE:
                self._cache.pop(rid, None)
                self._unmap(rid)
                fd = self._offered.pop(rid, None)
                if fd is not None:
                    os.close(fd)

    def close(self) -> None:
        self._cache.clear()
        for rid in list(self._maps):
            self._unmap(rid)
        for fd in self._offered.values():
            os.close(fd)
        self._offered.clear()
