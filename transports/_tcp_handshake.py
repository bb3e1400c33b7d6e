"""The ``tcp://`` handshake, both sides of it: the client's hello (magic ``QLTC``, protocol
version, flags, its region key) and, with a shared token, its proof; the listener's answer
to it (accept, with the version in force, or refuse with a readable reason).

* Protocol version 2 is version 1 plus the PUTV frame. A client sends the version-1 hello
  with flag bit 0 ("I take PUTV"), so a version-1 listener still accepts it; a version-2
  listener answers version 2 to a client that set that flag.
* Protocol version 3 is version 2 plus the PUTV flag ACK and the PUTV_ACK frame (a deferred
  put's flush). A client that takes them sets flag bit 2 too; a version-3 listener answers
  version 3 to a client that set bits 0 and 2.
* With a token the client sets flag bit 1 and sends, right after the hello, a 32-byte
  HMAC-SHA256 of the hello under the token (the token itself never travels).

>>> hello = client_hello(7, token=b"secret")
>>> judge_hello(bytearray(hello), len(hello), b"secret")[:2]
(0, '')
>>> judge_hello(bytearray(hello), len(hello), b"other")[1]
'bad_token'
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from qlink.errors import BrokenLinkError, WireError

from . import framing as fr
from ._tcp_frames import SEND_FLAGS

__all__ = ["HANDSHAKE_TIMEOUT_S", "HELLO_PUTV", "HELLO_AUTH", "HELLO_PUTV_ACK", "AUTH_NBYTES", "PUTV_VERSION",
           "ACK_VERSION", "random_key",
           "client_hello", "hello_nbytes", "judge_hello", "accept_reply", "refuse", "client_handshake"]

HANDSHAKE_TIMEOUT_S = 5.0  # a listener hangs up on a client whose hello has not come by then
HELLO_PUTV = 1  # hello flags: this client takes PUTV frames
HELLO_AUTH = 2  # hello flags: a 32-byte HMAC-SHA256 of the hello under the shared token follows
HELLO_PUTV_ACK = 4  # hello flags: this client takes the PUTV flag ACK and PUTV_ACK frames
AUTH_NBYTES = 32
PUTV_VERSION = 2
ACK_VERSION = 3
_TAKES = HELLO_PUTV | HELLO_PUTV_ACK  # what this client says it takes
_AUTH_LABEL = b"qlink-tcp-hello-v1"
_STATUS_UNAUTHORIZED = 3  # handshake reply status: this listener wants a token the client did not prove


def random_key() -> int:
    """A fresh region key: descriptors this side issues carry it, so a peer's are told apart."""
    return int.from_bytes(os.urandom(8), "little")


def _hello_proof(token: bytes, hello: bytes) -> bytes:
    """What a client sends after a hello with flag bit 1: HMAC-SHA256 of the hello under the token."""
    return hmac.new(token, _AUTH_LABEL + bytes(hello), hashlib.sha256).digest()


def client_hello(local_key: int, *, token: bytes | None) -> bytes:
    """The client's opening bytes: the version-1 hello saying it takes PUTV (and its proof)."""
    if token is None:
        return fr.HELLO.pack(fr.MAGIC, fr.PROTOCOL_VERSION, _TAKES, local_key)
    hello = fr.HELLO.pack(fr.MAGIC, fr.PROTOCOL_VERSION, _TAKES | HELLO_AUTH, local_key)
    return hello + _hello_proof(token, hello)


def hello_nbytes(buf: bytearray, got: int) -> int:
    """How long this client's hello is: the hello, and its proof when it says one follows."""
    if got >= fr.HELLO.size and fr.HELLO.unpack_from(buf, 0)[2] & HELLO_AUTH:
        return fr.HELLO.size + AUTH_NBYTES
    return fr.HELLO.size


def _check_proof(token: bytes, buf: bytearray, got: int) -> tuple[int, str, str]:
    """``(status, reason key, reason text)`` of a hello sent to a listener that wants a token."""
    flags = fr.HELLO.unpack_from(buf, 0)[2]
    if not flags & HELLO_AUTH or got < fr.HELLO.size + AUTH_NBYTES:
        return _STATUS_UNAUTHORIZED, "no_token", ("this tcp listener admits only clients holding its shared token; "
                                                 "connect with token=... (the same token the service was given)")
    proof = bytes(buf[fr.HELLO.size:fr.HELLO.size + AUTH_NBYTES])
    if not hmac.compare_digest(proof, _hello_proof(token, buf[:fr.HELLO.size])):
        return _STATUS_UNAUTHORIZED, "bad_token", ("the token this client proved is not the listener's; "
                                                  "connect with the service's shared token")
    return fr.STATUS_OK, "", ""


def judge_hello(buf: bytearray, got: int, token: bytes | None) -> tuple[int, str, str, int, int]:
    """The listener's verdict on a whole hello (``got`` bytes of ``buf``): ``(status, reason
    key, reason text, peer's region key, the protocol version both sides speak)``; status
    ``fr.STATUS_OK`` admits."""
    status, peer_key, reason = fr.check_hello(buf)
    why = "bad_hello"
    if status == fr.STATUS_OK and token is not None:
        status, why, reason = _check_proof(token, buf, got)
    return status, why, reason, peer_key, _version_of(fr.HELLO.unpack_from(buf, 0)[2])


def _version_of(flags: int) -> int:
    """The protocol version a client's hello flags let both sides speak.

    >>> _version_of(0), _version_of(HELLO_PUTV), _version_of(HELLO_PUTV | HELLO_PUTV_ACK)
    (1, 2, 3)
    """
    if not flags & HELLO_PUTV:
        return fr.PROTOCOL_VERSION
    return ACK_VERSION if flags & HELLO_PUTV_ACK else PUTV_VERSION


def accept_reply(region_key: int, *, version: int) -> bytes:
    """The listener's acceptance, with the version both sides speak (from :func:`judge_hello`;
    version 1 clients do not look at the reply's version)."""
    return fr.REPLY.pack(fr.MAGIC, version, fr.STATUS_OK, region_key, 0)


def refuse(conn: socket.socket, status: int, reason: str) -> None:
    """Tell a client that speaks another protocol why it is refused, then hang up without a reset."""
    try:
        conn.setblocking(True)
        conn.settimeout(0.5)
        conn.sendall(fr.pack_reply(status, 0, reason), SEND_FLAGS)
        conn.shutdown(socket.SHUT_WR)
        conn.setblocking(False)
        while conn.recv(65536):  # read what the client sent on so close() does not reset the connection
            pass
    except OSError:
        pass
    finally:
        conn.close()


def client_handshake(sock: socket.socket, *, token: bytes | None, left, where: str) -> tuple[int, int, int]:
    """The client's side on a connected blocking socket: send the hello, read the answer.
    ``left()`` gives the seconds left (raising when none are). Returns ``(local region key,
    peer's region key, the protocol version in force)``; WireError with the listener's reason
    if refused."""
    local_key = random_key()
    sock.settimeout(left())
    sock.sendall(client_hello(local_key, token=token))
    head = _recv_exact(sock, fr.REPLY.size, left, where)
    version, status, peer_key, reason_n = fr.parse_reply(head)
    reason = _recv_exact(sock, reason_n, left, where).decode("utf-8", "replace") if reason_n else ""
    if status != fr.STATUS_OK:
        raise WireError(reason or f"the tcp listener at {where} refused the handshake (status {status})")
    return local_key, peer_key, min(max(version, fr.PROTOCOL_VERSION), ACK_VERSION)


def _recv_exact(sock: socket.socket, nbytes: int, left, where: str) -> bytes:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        sock.settimeout(left())
        k = sock.recv_into(view[got:])
        if k == 0:
            raise BrokenLinkError(f"the tcp listener at {where} hung up during the handshake")
        got += k
    return bytes(buf)
