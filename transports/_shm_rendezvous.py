"""Where ``shm://`` peers meet and what they share: socket names, the private socket
directory, stale-socket reclaim, the memfd layout of a connection and its handshake.

A connection is one sealed memfd, laid out as::

    [0]                  connection header (CONN: magic, version, table slots, ring bytes, token)
    [PAGE]               ring written by side 0 (the connecting side)
    [PAGE + stride]      ring written by side 1 (the accepting side)
    [PAGE + 2 stride]    region table of side 0, then region table of side 1

The connecting side creates and fills it, then sends its fd with a HELLO packet
(same fields as the header) over the Unix socket.

>>> layout_nbytes(1 << 16) == PAGE + 2 * ring_stride(1 << 16) + 2 * TABLE_NBYTES
True
>>> name_of("shm://decoder-0")
'decoder-0'
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import socket
import stat
import struct
import tempfile
from urllib.parse import urlsplit

from . import _ring
from ._shm_regions import TABLE_NBYTES, TABLE_SLOTS

__all__ = [
    "name_of",
    "socket_dir",
    "socket_path",
    "reclaim_stale",
    "ring_offset",
    "ring_stride",
    "table_offset",
    "layout_nbytes",
    "peer_uid",
    "seal",
    "is_sealed",
    "CONN",
    "CONN_MAGIC",
    "HELLO_MAGIC",
    "VERSION",
    "PAGE",
    "MAP_FLAGS",
    "TABLE_SLOTS",
]

PAGE = 4096
CONN = struct.Struct("<8sIIQQ")  # magic, version, table slots, ring data bytes, token
CONN_MAGIC = b"QLSHMCN1"
HELLO_MAGIC = b"QLSHMHI1"
VERSION = 1
# populate at map time: the first pass over a fresh ring would otherwise take a page fault
# every 4 KiB, which shows up in the tail of round-trip latencies
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def name_of(url: str) -> str:
    """The name in ``shm://name``; ValueError for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "shm":
        raise ValueError(f"shm transport needs a URL like 'shm://name', got {url!r}")
    name = (parts.netloc + parts.path).strip("/")
    if not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"shm URL {url!r} needs a name of 1-100 characters from letters, digits, '.', '_' and '-' "
            "(starting with a letter or digit), like 'shm://decoder-0'"
        )
    return name


def socket_dir() -> str:
    """The private directory holding ``shm://`` rendezvous sockets (not created here).

    ``$QLINK_SHM_DIR`` if set, else ``$XDG_RUNTIME_DIR/qlink`` when that runtime
    directory is ours, else ``<tempdir>/qlink-<uid>``.
    """
    override = os.environ.get("QLINK_SHM_DIR")
    if override:
        return override
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            st = os.stat(xdg)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                return os.path.join(xdg, "qlink")
        except OSError:
            pass
    return os.path.join(tempfile.gettempdir(), f"qlink-{os.getuid()}")


def _private_dir(*, create: bool) -> str:
    d = socket_dir()
    if create:
        os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)  # FileNotFoundError when absent and not created
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"shm socket directory {d} is not a directory; set QLINK_SHM_DIR to a private directory")
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"shm socket directory {d} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
            "set QLINK_SHM_DIR to a directory of your own"
        )
    if create and stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(d, 0o700)
    return d


def socket_path(name: str, *, create: bool) -> str:
    """Path of the socket for ``name``; ``create`` makes (or tightens) the directory to 0700."""
    path = os.path.join(_private_dir(create=create), name + ".sock")
    if len(os.fsencode(path)) > 107:
        raise ValueError(f"socket path {path!r} is longer than the 107 bytes a Unix socket allows; "
                         "use a shorter name or set QLINK_SHM_DIR to a shorter directory")
    return path


def reclaim_stale(path: str, url: str) -> None:
    """Remove the socket file of a dead listener; raise EADDRINUSE if a live one answers."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket; remove it or use another shm name")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        try:
            os.unlink(path)  # nobody is listening: a crashed listener left it behind
        except FileNotFoundError:
            pass
        return
    except OSError:
        pass  # e.g. a full backlog: somebody is listening
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"{url} is already listening (socket {path}); close it or pick another name")


def reclaim_after_exit(url: str) -> bool:
    """After the process listening on ``url`` has exited (killed, it could not unlink its
    socket): remove the file it left. True when one was removed; a live listener, another
    scheme, or no file leaves everything as it is."""
    try:
        path = socket_path(name_of(url), create=False)
    except (ValueError, OSError):
        return False
    if not os.path.lexists(path):
        return False
    try:
        reclaim_stale(path, url)
    except OSError:
        return False  # somebody listens there (or it is not a socket): not ours to remove
    return not os.path.lexists(path)


def ring_stride(ring_nbytes: int) -> int:
    return -(-(_ring.HEADER_NBYTES + ring_nbytes) // PAGE) * PAGE


def ring_offset(side: int, ring_nbytes: int) -> int:
    """Offset of the ring written by ``side`` (0: the connecting side)."""
    return PAGE + side * ring_stride(ring_nbytes)


def table_offset(side: int, ring_nbytes: int) -> int:
    """Offset of the region table owned by ``side``."""
    return PAGE + 2 * ring_stride(ring_nbytes) + side * TABLE_NBYTES


def layout_nbytes(ring_nbytes: int) -> int:
    return table_offset(2, ring_nbytes)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (kernel-checked)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def seal(fd: int) -> None:
    """Fix the memfd's size for good, so neither side can shrink it under the other's mapping."""
    if hasattr(fcntl, "F_ADD_SEALS"):
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)


def is_sealed(fd: int) -> bool:
    return not hasattr(fcntl, "F_GET_SEALS") or bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)

