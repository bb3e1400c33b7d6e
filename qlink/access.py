"""Who may talk to a qlink service: the loopback rule, shared tokens, signed datagrams.

A service listens on loopback unless told otherwise. Binding any other address is
refused unless the service holds a shared ``token`` (stream transports check it in the
handshake, see :mod:`transports.tcp`; datagrams carry an HMAC of themselves, below) or
the caller says ``insecure=True`` on purpose. Shared memory (``shm://``) and in-process
URLs never leave the host and its user, so the rule does not concern them.

A signed datagram is the frame (its bytes as they are: a CUDA-Q realtime frame stays
byte for byte what it was) followed by qlink's 32-byte trailer: the sender's id (u64, drawn
at random by each sender), its sequence number (u64, one more for every datagram it sends,
a resent frame included) and a 16-byte tag, HMAC-SHA256 under the token of everything before
it, truncated (RFC 2104 truncation to 128 bits). The tag authenticates the sender; it does
not hide the bytes. Replays are stopped by the receiver's :class:`ReplayGuard`: a sliding
window per sender id over sequence numbers (the anti-replay window of IPsec, RFC 4303
3.4.3), which refuses a number it has seen or one older than the window. Sender ids are
under the tag, so a datagram replayed from another address meets the same window. The guard
lives as long as its service: replays into a later service under the same token are not
stopped (give each service run a token of its own to rule them out), nor, once more than
``max_senders`` senders have been seen, those of a sender forgotten to make room (counted).

>>> check_bind("tcp://127.0.0.1:0", token=None, insecure=False)   # loopback: fine
>>> check_bind("tcp://0.0.0.0:5000", token=None, insecure=False)
Traceback (most recent call last):
...
qlink.access.InsecureBindError: tcp://0.0.0.0:5000 is not a loopback address: a service listening there needs a shared token (token=... / --token-env) so that only holders of the token are served, or insecure=True (--insecure) to serve anyone who can reach it
>>> key = b"0123456789abcdef"
>>> signer = DatagramSigner(key, sender_id=7)
>>> d1, d2 = signer.sign(b"CUQR frame"), signer.sign(b"CUQR frame")   # the same frame twice
>>> len(d1) - len(b"CUQR frame"), verify_datagram(d1, len(d1), key), datagram_sender_seq(d1, 10)
(32, 10, (7, 1))
>>> verify_datagram(b"CUQR frame" + bytes(32), 42, key)
-1
>>> guard = ReplayGuard(window=64)
>>> guard.check(7, 2), guard.check(7, 1), guard.check(7, 2)   # reordered: fine; again: refused
(None, None, 'replayed')
>>> guard.check(7, 100), guard.check(7, 36), guard.check(7, 37)   # 36 is 64 behind 100
(None, 'replayed', None)
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket
import struct
from urllib.parse import urlsplit

from .errors import QlinkError

__all__ = ["InsecureBindError", "is_loopback_url", "check_bind", "token_bytes", "sign_datagram", "verify_datagram",
           "datagram_sender_seq", "DatagramSigner", "ReplayGuard", "DATAGRAM_TAG_NBYTES", "DATAGRAM_TRAILER_NBYTES"]

DATAGRAM_TAG_NBYTES = 16
DATAGRAM_TRAILER_NBYTES = 16 + DATAGRAM_TAG_NBYTES  # sender id, sequence number, tag
_IDS = struct.Struct("<QQ")
_LOCAL_SCHEMES = ("shm", "inproc", "cuda_ipc")


class InsecureBindError(QlinkError, ValueError):
    """A service was asked to listen beyond loopback with neither a token nor ``insecure=True``."""


def is_loopback_url(url: str) -> bool:
    """Whether ``url`` can only be reached from this host (loopback addresses, shared memory, in-process)."""
    parts = urlsplit(url)
    scheme = parts.scheme.split("+")[-1] if parts.scheme else url.split("://", 1)[0]
    if scheme in _LOCAL_SCHEMES:
        return True
    host = parts.hostname or "127.0.0.1"
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:  # a name: loopback only if every address it resolves to is
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def token_bytes(token) -> bytes | None:
    """A shared token as bytes (None stays None); ValueError for a token too short to be a secret."""
    if token is None:
        return None
    if isinstance(token, str):
        token = token.encode("utf-8")
    if not isinstance(token, (bytes, bytearray)) or len(token) < 16:
        raise ValueError("token must be a str or bytes of at least 16 characters (a shared secret, e.g. "
                         "secrets.token_hex(16)), or None")
    return bytes(token)


def check_bind(url: str, *, token, insecure: bool) -> None:
    """Raise :class:`InsecureBindError` when ``url`` is not loopback and there is neither a token
    nor ``insecure=True``."""
    if token is not None or insecure or is_loopback_url(url):
        return
    raise InsecureBindError(
        f"{url} is not a loopback address: a service listening there needs a shared token (token=... / "
        "--token-env) so that only holders of the token are served, or insecure=True (--insecure) to serve "
        "anyone who can reach it")


def _tag(parts, key: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()[:DATAGRAM_TAG_NBYTES]


def sign_datagram(frame, key: bytes, *, sender_id: int, seq: int) -> bytes:
    """``frame`` followed by its trailer (sender id, sequence number, tag under ``key``);
    a sender's sequence numbers must never repeat (see :class:`DatagramSigner`)."""
    ids = _IDS.pack(sender_id, seq)
    return b"".join((frame, ids, _tag((frame, ids), key)))


def verify_datagram(buf, nbytes: int, key: bytes) -> int:
    """The frame's length within the signed datagram ``buf[:nbytes]``, or -1 when its tag is
    wrong or its trailer missing; the sender id and sequence number follow the frame
    (:func:`datagram_sender_seq`)."""
    n = nbytes - DATAGRAM_TRAILER_NBYTES
    if n < 0:
        return -1
    mv = memoryview(buf)
    t = nbytes - DATAGRAM_TAG_NBYTES
    if not hmac.compare_digest(bytes(mv[t:nbytes]), _tag((mv[:t],), key)):
        return -1
    return n


def datagram_sender_seq(buf, n: int) -> tuple[int, int]:
    """``(sender id, sequence number)`` of a signed datagram whose frame is ``buf[:n]``."""
    return _IDS.unpack_from(buf, n)


class DatagramSigner:
    """Signs one sender's datagrams under ``key``: its id (random unless given) and a
    sequence number that goes up by one with every datagram (a frame sent again is a new
    datagram and takes a new number)."""

    def __init__(self, key: bytes, *, sender_id: int | None = None) -> None:
        self.key = key
        self.sender_id = secrets.randbits(64) if sender_id is None else int(sender_id)
        self.seq = 0

    def sign(self, frame) -> bytes:
        """``frame`` with its trailer and the next sequence number."""
        self.seq += 1
        return sign_datagram(frame, self.key, sender_id=self.sender_id, seq=self.seq)


class ReplayGuard:
    """The receiver's anti-replay windows: per sender id, the highest sequence number taken
    and a bitmap of the ``window`` numbers below it (RFC 4303 3.4.3). Check a datagram only
    after its tag verified (a forged number must not move a window). At most
    ``max_senders`` windows are kept; beyond, the sender heard from least recently is
    forgotten (``evicted`` counts them)."""

    def __init__(self, *, window: int = 1024, max_senders: int = 4096) -> None:
        for name, v, least in (("window", window, 1), ("max_senders", max_senders, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.window = window
        self.max_senders = max_senders
        self._mask = (1 << window) - 1
        self._senders: dict[int, list] = {}  # sender id -> [highest seq, bitmap]; in order of last use
        self.evicted = 0

    def check(self, sender_id: int, seq: int) -> str | None:
        """None: ``seq`` is new for ``sender_id`` (now recorded); ``"replayed"``: seen before,
        or older than the window."""
        w = self._senders.pop(sender_id, None)
        if w is None:
            if len(self._senders) >= self.max_senders:
                del self._senders[next(iter(self._senders))]
                self.evicted += 1
            self._senders[sender_id] = [seq, 1]
            return None
        self._senders[sender_id] = w  # (most recently used last)
        top, bits = w
        if seq > top:
            w[0] = seq
            ahead = seq - top  # (a jump past the whole window clears it, without a shift that long)
            w[1] = ((bits << ahead) | 1) & self._mask if ahead < self.window else 1
            return None
        back = top - seq
        if back >= self.window or (bits >> back) & 1:
            return "replayed"
        w[1] = bits | (1 << back)
        return None

    def __len__(self) -> int:
        return len(self._senders)
