"""Who may talk to a qlink service: the loopback rule, shared tokens, signed datagrams.

A service listens on loopback unless told otherwise. Binding any other address is
refused unless the service holds a shared ``token`` (stream transports check it in the
handshake, see :mod:`transports.tcp`; datagrams carry an HMAC of themselves, below) or
the caller says ``insecure=True`` on purpose. Shared memory (``shm://``) and in-process
URLs never leave the host and its user, so the rule does not concern them.

A signed datagram is the frame followed by a 16-byte tag, HMAC-SHA256 of the frame
under the token, truncated (RFC 2104 truncation to 128 bits). It authenticates the
sender; it does not hide the bytes and does not stop a replay.

>>> check_bind("tcp://127.0.0.1:0", token=None, insecure=False)   # loopback: fine
>>> check_bind("tcp://0.0.0.0:5000", token=None, insecure=False)
Traceback (most recent call last):
...
qlink.access.InsecureBindError: tcp://0.0.0.0:5000 is not a loopback address: a service listening there needs a shared token (token=... / --token-env) so that only holders of the token are served, or insecure=True (--insecure) to serve anyone who can reach it
>>> key = b"0123456789abcdef"
>>> signed = sign_datagram(b"CUQR frame", key)
>>> len(signed) - len(b"CUQR frame"), verify_datagram(signed, len(signed), key)
(16, 10)
>>> verify_datagram(b"CUQR frame" + bytes(16), 26, key)
-1
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
from urllib.parse import urlsplit

from .errors import QlinkError

__all__ = ["InsecureBindError", "is_loopback_url", "check_bind", "token_bytes", "sign_datagram", "verify_datagram",
           "DATAGRAM_TAG_NBYTES"]

DATAGRAM_TAG_NBYTES = 16
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


def _tag(frame, key: bytes) -> bytes:
    return hmac.new(key, frame, hashlib.sha256).digest()[:DATAGRAM_TAG_NBYTES]


def sign_datagram(frame, key: bytes) -> bytes:
    """``frame`` followed by its 16-byte tag under ``key``."""
    return bytes(frame) + _tag(frame, key)


def verify_datagram(buf, nbytes: int, key: bytes) -> int:
    """The frame's length within the signed datagram ``buf[:nbytes]``, or -1 when its tag is wrong or missing."""
    n = nbytes - DATAGRAM_TAG_NBYTES
    if n < 0:
        return -1
    mv = memoryview(buf)
    if not hmac.compare_digest(bytes(mv[n:nbytes]), _tag(mv[:n], key)):
        return -1
    return n
