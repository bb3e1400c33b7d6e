"""A ``udp://`` socket and its limits: the largest datagram an address family carries, the
capabilities an endpoint declares for it, resolving and naming addresses, making the socket."""

from __future__ import annotations

import socket
from dataclasses import replace

from ._address import join_host_port
from ._base import Capabilities

__all__ = ["MAX_DATAGRAM_BYTES_IPV4", "MAX_DATAGRAM_BYTES_IPV6", "CAPABILITIES", "DEFAULT_BUSY_POLL_S", "WAKE_S",
           "SCRATCH_NBYTES", "resolve", "url_of", "family_max", "capabilities_for", "new_socket", "check_busy_poll"]

MAX_DATAGRAM_BYTES_IPV4 = 65535 - 20 - 8  # IPv4 total length minus IP and UDP headers
MAX_DATAGRAM_BYTES_IPV6 = 65535 - 8  # IPv6 payload length minus the UDP header (no jumbograms)

CAPABILITIES = Capabilities(
    name="udp",
    two_sided=True,
    one_sided=False,
    device_memory=False,
    cross_process=True,
    cross_host=True,
    reliable=False,
    ordered=False,
    max_message_bytes=MAX_DATAGRAM_BYTES_IPV4,
)

WAKE_S = 0.1  # longest a blocked reader sleeps before re-checking close()
DEFAULT_BUSY_POLL_S = 50e-6  # a blocking receive spins this long before it sleeps in poll
SCRATCH_NBYTES = 65536  # holds any datagram (IPv4 and IPv6 payloads are smaller)


def resolve(host: str, port: int, *, passive: bool) -> tuple[int, tuple]:
    """``(address family, socket address)`` of ``host:port``; ValueError if it does not resolve."""
    flags = socket.AI_PASSIVE if passive else 0
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM, flags=flags)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve udp host {host!r}: {e}") from e
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr


def url_of(sockaddr: tuple) -> str:
    return join_host_port("udp", sockaddr[0], sockaddr[1])


def family_max(family: int) -> int:
    return MAX_DATAGRAM_BYTES_IPV6 if family == socket.AF_INET6 else MAX_DATAGRAM_BYTES_IPV4


def capabilities_for(family: int, max_message_bytes: int | None) -> Capabilities:
    limit = family_max(family)
    if max_message_bytes is not None:
        if not 0 < max_message_bytes <= limit:
            raise ValueError(f"max_message_bytes must be in 1..{limit} for this address family, "
                             f"got {max_message_bytes}")
        limit = max_message_bytes
    return replace(CAPABILITIES, max_message_bytes=limit)


def new_socket(family: int, *, rcvbuf_nbytes: int | None, sndbuf_nbytes: int | None,
               reuse_port: bool = False) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if rcvbuf_nbytes is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, int(rcvbuf_nbytes))
        if sndbuf_nbytes is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(sndbuf_nbytes))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def check_busy_poll(busy_poll_s) -> float:
    if isinstance(busy_poll_s, bool) or not isinstance(busy_poll_s, (int, float)) or not 0 <= busy_poll_s < 1:
        raise ValueError(f"busy_poll_s must be a number of seconds in [0, 1), got {busy_poll_s!r}")
    return float(busy_poll_s)
