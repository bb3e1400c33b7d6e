"""Bootstrap of ``ucx://`` connections: URL parsing and the hello swapped over TCP.

Hello (little-endian, 24 bytes, then the UCX worker address): ``4s magic 'QLUX'``,
``u16 version``, ``u16 flags`` (bit 0: UCX peer error handling; bit 1: this side takes
vectored puts, ``OP_PUTV``), ``u32 connection id`` (the id the peer puts in the tags it
sends here), ``8s token`` (names this side's regions), ``u32 address length``. The client
speaks first; the server answers with the flags both sides will use: peer error handling
when either side asked for it, vectored puts only when both sides offered them.

Shared token: a listener given ``token=`` admits only clients that prove they hold it. Such
a client sets flag bit 2 and sends, right after its hello and address, a 32-byte
HMAC-SHA256 of them under the token (the token never travels). A client without it, or
with another, gets a hello with flag bit 3 (refused) whose connection id says why (1: no
token, 2: wrong token) and raises :class:`PeerRefusedError`; the listener counts it.

Flag bit 4 (``FLAG_RMA``): this side maps its registered host regions for UCX RMA (their
descriptors carry address and remote key) and takes ``OP_PUT_DONE``; in force only when
both sides set it, so a peer without it gets tagged puts as before.

Flag bit 5 (``FLAG_CMA``): this side challenges the peer and answers its challenge (``OP_CMA``:
random bytes, then the pid and address where the peer's are shown), says what it found
(``OP_CMA_VERDICT``), and moves RMA pieces to a peer on the same host itself, many
per ``process_vm_writev``/``readv`` (:mod:`transports._ucx_cma`); in force only when both set
it, used only where both verdicts say yes. Flag bit 6 (``FLAG_RMA_SAME_HOST``, the default):
RMA is wanted between two processes of one host, where those verdicts say yes, and nowhere
else; in force only when both set it. ``FLAG_RMA`` (``rma=True``) wants it anywhere.

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

import hashlib
import hmac
import ipaddress
import socket
import struct
import time

from qlink.errors import BrokenLinkError, QlinkTimeoutError, WireError

from ._address import join_host_port, split_host_port

__all__ = ["split_url", "scope_of", "url_of", "handshake", "FLAG_PEER_ERRORS", "FLAG_PUTV", "FLAG_RMA", "FLAG_CMA",
           "FLAG_RMA_SAME_HOST", "FLAG_AUTH", "PeerRefusedError"]

_MAGIC = b"QLUX"
_VERSION = 1
_HELLO = struct.Struct("<4sHHI8sI")
FLAG_PEER_ERRORS = 1
FLAG_PUTV = 2  # takes vectored puts (OP_PUTV control frames); in force only when both sides set it
FLAG_AUTH = 4  # (client) an HMAC of the hello under the shared token follows the address
FLAG_REFUSED = 8  # (server) not admitted; the connection id says why
FLAG_RMA = 16  # maps its regions for UCX RMA and takes OP_PUT_DONE; in force only when both sides set it
FLAG_CMA = 32  # sends OP_CMA and OP_CMA_VERDICT, moves same-host RMA pieces itself; in force only when both set it
FLAG_RMA_SAME_HOST = 64  # RMA where both CMA verdicts say yes (the default); in force only when both set it
_BOTH = FLAG_PUTV | FLAG_RMA | FLAG_CMA | FLAG_RMA_SAME_HOST  # flags in force only when both sides set them
_REFUSALS = {1: ("no_token", "this ucx listener admits only clients holding its shared token; connect with "
                             "token=... (the same token the service was given)"),
             2: ("bad_token", "the token this client proved is not the listener's; connect with the service's "
                              "shared token")}
_PROOF_NBYTES = 32
_AUTH_LABEL = b"qlink ucx hello v1\0"


class PeerRefusedError(WireError):
    """The other side refused the handshake (``reason``: ``no_token`` or ``bad_token``)."""

    def __init__(self, message: str, *, reason: str):
        super().__init__(message)
        self.reason = reason


def _proof(token: bytes, hello: bytes) -> bytes:
    return hmac.new(token, _AUTH_LABEL + hello, hashlib.sha256).digest()
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
    return join_host_port("ucx", host, port)


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
              deadline: float | None, server: bool, shared_token: bytes | None = None) -> tuple[int, int, bytes, bytes]:
    """Swap hellos; returns (peer connection id, flags in force, peer token, peer worker address).

    ``shared_token``: the server admits only a client that proves it; the client proves it.
    Raises WireError for a peer that is not a qlink ucx endpoint (PeerRefusedError for a
    refused token, on both sides), QlinkTimeoutError when the hello does not arrive by
    ``deadline``, BrokenLinkError when the peer hangs up.
    """
    def hello(fl: int) -> bytes:
        return _HELLO.pack(_MAGIC, _VERSION, fl, conn_id, token, len(address)) + address

    if not server:
        if shared_token is None:
            sock.sendall(hello(flags))
        else:
            mine = hello(flags | FLAG_AUTH)
            sock.sendall(mine + _proof(shared_token, mine))
    head = _recv_exact(sock, _HELLO.size, deadline)
    magic, version, peer_flags, peer_conn, peer_token, addr_len = _HELLO.unpack(head)
    if magic != _MAGIC:
        raise WireError(f"ucx: the peer is not a qlink ucx endpoint (hello magic {magic!r}, expected {_MAGIC!r})")
    if version != _VERSION:
        raise WireError(f"ucx: the peer speaks handshake version {version}, this side speaks {_VERSION}")
    if not 0 < addr_len <= _MAX_ADDRESS or not 0 < peer_conn <= _CONN_MASK:
        raise WireError(f"ucx: bad hello (worker address of {addr_len} bytes, connection id {peer_conn})")
    peer_addr = _recv_exact(sock, addr_len, deadline)
    if server:
        proof = _recv_exact(sock, _PROOF_NBYTES, deadline) if peer_flags & FLAG_AUTH else None
        if shared_token is not None:
            why = 1 if proof is None else 0 if hmac.compare_digest(proof, _proof(shared_token, head + peer_addr)) else 2
            if why:
                sock.sendall(_HELLO.pack(_MAGIC, _VERSION, FLAG_REFUSED, why, bytes(8), 1) + b"\0")
                reason, text = _REFUSALS[why]
                raise PeerRefusedError(f"ucx: refused a client: {text}", reason=reason)
        flags = ((peer_flags | flags) & FLAG_PEER_ERRORS) | (peer_flags & flags & _BOTH)
        sock.sendall(hello(flags))
    else:
        if peer_flags & FLAG_REFUSED:
            reason, text = _REFUSALS.get(peer_conn, ("refused", "the listener refused this client"))
            raise PeerRefusedError(f"ucx: {text}", reason=reason)
        flags = peer_flags & (FLAG_PEER_ERRORS | (flags & _BOTH))
    return peer_conn, flags, peer_token, peer_addr
