"""``scheme://host:port`` URLs: the one parser (and the one writer) of the transports
addressed by host and port (tcp, udp, ucx), so each says the same thing about the same mistake.

>>> split_host_port("tcp://127.0.0.1:5555", scheme="tcp", for_listen=False)
('127.0.0.1', 5555)
>>> split_host_port("udp://", scheme="udp", for_listen=True)  # listening: loopback, a port the OS picks
('127.0.0.1', 0)
>>> split_host_port("tcp://[::1]:7", scheme="tcp", for_listen=False)
('::1', 7)
>>> split_host_port("udp://127.0.0.1", scheme="udp", for_listen=False)
Traceback (most recent call last):
...
ValueError: udp URL 'udp://127.0.0.1' needs a port, like 'udp://127.0.0.1:5000'
>>> join_host_port("tcp", "::1", 7), join_host_port("udp", "127.0.0.1", 5000)
('tcp://[::1]:7', 'udp://127.0.0.1:5000')
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["join_host_port", "split_host_port"]


def split_host_port(url: str, *, scheme: str, for_listen: bool, extras_ok: bool = True) -> tuple[str, int]:
    """``(host, port)`` of ``url``, a ``scheme://host:port`` URL. To listen, a missing host is
    the loopback address (safe by default) and a missing port is 0 (the OS picks one); to
    connect, both are needed and port 0 is refused. ``extras_ok=False`` also refuses a path
    or a query. Every mistake is a ValueError that says what a right URL looks like."""
    parts = urlsplit(url)
    if parts.scheme != scheme:
        raise ValueError(f"{scheme} transport needs a URL like '{scheme}://127.0.0.1:0', got {url!r}")
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{scheme} URL {url!r} has a bad port ({e}); use {scheme}://host:port "
                         "with a port number in 0..65535") from None
    host = parts.hostname or ""
    if not host:
        if not for_listen:
            raise ValueError(f"{scheme} URL {url!r} needs a host to connect to, like '{scheme}://127.0.0.1:5000'")
        host = "127.0.0.1"
    if port is None:
        if not for_listen:
            raise ValueError(f"{scheme} URL {url!r} needs a port, like '{scheme}://{host}:5000'")
        port = 0
    if port == 0 and not for_listen:
        raise ValueError(f"cannot connect to port 0 in {url!r}; give the port the listener reports in its url")
    if not extras_ok and (parts.path not in ("", "/") or parts.query):
        raise ValueError(f"{scheme} URL {url!r} takes only host and port, no path or query")
    return host, port


def join_host_port(scheme: str, host: str, port: int) -> str:
    """The URL of ``host:port`` (an IPv6 address in brackets), as :func:`split_host_port` reads it."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
