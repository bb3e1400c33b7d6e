"""Bootstrap of ``ucx://`` connections: URL parsing and the hello swapped over TCP.

Hello (little-endian, 24 bytes, then the UCX worker address): ``4s magic 'QLUX'``,
``u16 version``, ``u16 flags`` (bit 0: UCX peer error handling; bit 1: this side takes
vectored puts, ``OP_PUTV``), ``u32 connection id`` (the id the peer puts in the tags it
sends here), ``8s token`` (names this side's regions), ``u32 address length``. The client
speaks first; the server answers with the flags both sides will use: peer error handling
when either side asked for it, vectored puts only when both sides offered them.

The vectored-put flag leaves the version at 1: a server that predates it masks the flags
it answers with to bit 0, and a client that predates it neither sets bit 1 nor looks at
it in the answer, so either kind of older peer connects as before and gets one put per
``put_many`` piece.

>>> split_url("ucx://127.0.0.1:0", for_listen=True)
('127.0.0.1', 0)
>>> split_url("ucx://:7000", for_listen=True), scope_of("127.0.0.1"), scope_of("10.1.2.3")
(('127.0.0.1', 7000), 'lo', 'any')
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import time

from qlink.errors import BrokenLinkError, QlinkTimeoutError, WireError

from ._address import split_host_port

__all__ = ["split_url", "scope_of", "url_of", "handshake", "FLAG_PEER_ERRORS", "FLAG_PUTV"]

_MAGIC = b"QLUX"
_VERSION = 1
_HELLO = struct.Struct("<4sHHI8sI")
FLAG_PEER_ERRORS = 1
FLAG_PUTV = 2  # takes vectored puts (OP_PUTV control frames); in force only when both sides set it
_MAX_ADDRESS = 1 << 16
_CONN_MASK = 0xFFFFFF


def split_url(url: str, *, for_listen: bool) -> tuple[str, int]:
    """(host, port) of a ``ucx://host:port`` URL (no path, no query); ValueError naming what is wrong."""
    return split_host_port(url, scheme="ucx", for_listen=for_listen, extras_ok=False)


def scope_of(host: str) -> str:
    """'lo' for a loopback host (UCX's TCP transport then stays on the loopback device), else 'any'."""
    if host == "localhost":
        return "lo"
    try:
        return "lo" if ipaddress.ip_address(host).is_loopback else "any"
    except ValueError:
        return "any"


def url_of(host: str, port: int) -> str:
    return f"ucx://[{host}]:{port}" if ":" in host else f"ucx://{host}:{port}"


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise QlinkTimeoutError("ucx: the peer's handshake did not arrive in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(out))
        except socket.timeout:
            raise QlinkTimeoutError("ucx: the peer's handshake did not arrive in time") from None
        if not chunk:
            raise BrokenLinkError("ucx: the peer closed the bootstrap connection during the handshake")
        out += chunk
    return bytes(out)


def handshake(sock: socket.socket, *, conn_id: int, token: bytes, flags: int, address: bytes,
              deadline: float | None, server: bool) -> tuple[int, int, bytes, bytes]:
    """Swap hellos; returns (peer connection id, flags in force, peer token, peer worker address).

    Raises WireError for a peer that is not a qlink ucx endpoint, QlinkTimeoutError when
    the hello does not arrive by ``deadline``, BrokenLinkError when the peer hangs up.
    """
    def hello(fl: int) -> bytes:
        return _HELLO.pack(_MAGIC, _VERSION, fl, conn_id, token, len(address)) + address

    if not server:
        sock.sendall(hello(flags))
    magic, version, peer_flags, peer_conn, peer_token, addr_len = _HELLO.unpack(
        _recv_exact(sock, _HELLO.size, deadline))
    if magic != _MAGIC:
        raise WireError(f"ucx: the peer is not a qlink ucx endpoint (hello magic {magic!r}, expected {_MAGIC!r})")
    if version != _VERSION:
        raise WireError(f"ucx: the peer speaks handshake version {version}, this side speaks {_VERSION}")
    if not 0 < addr_len <= _MAX_ADDRESS or not 0 < peer_conn <= _CONN_MASK:
        raise WireError(f"ucx: bad hello (worker address of {addr_len} bytes, connection id {peer_conn})")
    peer_addr = _recv_exact(sock, addr_len, deadline)
    if server:
        flags = ((peer_flags | flags) & FLAG_PEER_ERRORS) | (peer_flags & flags & FLAG_PUTV)
        sock.sendall(hello(flags))
    else:
        flags = peer_flags & (FLAG_PEER_ERRORS | (flags & FLAG_PUTV))
    return peer_conn, flags, peer_token, peer_addr
