"""qlink transports: one API, one module per backend, chosen by URL scheme.

>>> import transports
>>> sorted(transports.schemes())[:3]
['cuda_ipc', 'inproc', 'shm']
>>> with transports.listen("inproc://doc") as lis:
...     client = transports.connect("inproc://doc")
...     server = lis.accept(timeout_s=1)
...     client.send(b"ping")
...     server.recv(timeout_s=1)
b'ping'
>>> client.close(); server.close()
"""

from __future__ import annotations

import importlib
import itertools
import os
from urllib.parse import urlsplit

from ._base import (
    Backoff,
    BufferTooSmallError,
    Capabilities,
    Endpoint,
    Listener,
    Notification,
    Statistics,
)

__all__ = [
    "listen",
    "connect",
    "schemes",
    "capabilities",
    "register_transport",
    "loopback_url",
    "Endpoint",
    "Listener",
    "Capabilities",
    "Statistics",
    "Notification",
    "BufferTooSmallError",
    "Backoff",
]

# scheme -> module path; modules are imported lazily so a missing optional stack
# (ucxx, nixl) only matters when its scheme is used.
_REGISTRY: dict[str, str] = {
    "cuda_ipc": "transports.cuda_ipc",
    "inproc": "transports.inproc",
    "shm": "transports.shm",
    "tcp": "transports.tcp",
    "ucx": "transports.ucx",
    "udp": "transports.udp",
}


# schemes addressed by host:port (the rest by a name unique on this host)
_HOST_PORT: set[str] = {"tcp", "ucx", "udp"}
_fresh = itertools.count()


def register_transport(scheme: str, module: str, *, host_port: bool = False) -> None:
    """Register a transport module (providing ``listen``, ``connect``, ``CAPABILITIES``) for ``scheme``;
    ``host_port=True`` when its URLs are ``scheme://host:port`` rather than ``scheme://name``."""
    if not scheme.isidentifier():
        raise ValueError(f"scheme must be an identifier, got {scheme!r}")
    _REGISTRY[scheme] = module
    if host_port:
        _HOST_PORT.add(scheme)
    else:
        _HOST_PORT.discard(scheme)


def loopback_url(scheme: str, *, tag: str = "qlink") -> str:
    """A fresh URL to listen on for ``scheme``, on this host only: ``tcp``/``udp``/``ucx`` get
    the loopback address with a port the OS picks; ``shm``/``inproc``/``cuda_ipc`` a name no
    other call (in any process) gets, ``<tag>-<pid>-<n>``. ``emulated+<scheme>`` keeps its
    prefix. A full URL (``...://...``) comes back unchanged.

    >>> loopback_url("tcp"), loopback_url("emulated+udp")
    ('tcp://127.0.0.1:0', 'emulated+udp://127.0.0.1:0')
    >>> loopback_url("shm", tag="doc").startswith(f"shm://doc-{os.getpid()}-")
    True
    >>> loopback_url("shm") != loopback_url("shm")
    True
    >>> loopback_url("carrier-pigeon")
    Traceback (most recent call last):
    ...
    ValueError: unknown transport scheme 'carrier-pigeon'; known: cuda_ipc, inproc, shm, tcp, ucx, udp (or emulated+ any of them)
    """
    if "://" in scheme:
        return scheme
    inner = scheme[len("emulated+"):] if scheme.startswith("emulated+") else scheme
    if inner not in _REGISTRY:
        raise ValueError(f"unknown transport scheme {scheme!r}; known: {', '.join(sorted(_REGISTRY))} "
                         "(or emulated+ any of them)")
    if inner in _HOST_PORT:
        return f"{scheme}://127.0.0.1:0"
    if not tag or not all(c.isalnum() or c in "-_" for c in tag):
        raise ValueError(f"tag must be letters, digits, '-' or '_', got {tag!r}")
    return f"{scheme}://{tag}-{os.getpid()}-{next(_fresh)}"


def schemes() -> list[str]:
    """The registered URL schemes (whether or not their optional stack is installed)."""
    return list(_REGISTRY)


def _scheme_of(url: str) -> str:
    """The URL's scheme, also one with an underscore (``cuda_ipc://``), which urlsplit does not take."""
    scheme = urlsplit(url).scheme
    if not scheme and "://" in url:
        head = url.split("://", 1)[0].lower()
        if head.replace("+", "_").isidentifier():
            scheme = head
    return scheme


def _module_for(url: str):
    scheme = _scheme_of(url)
    if scheme.startswith("emulated+"):
        return importlib.import_module("transports.emulated")
    if not scheme:
        raise ValueError(f"transport URL needs a scheme like 'shm://name' or 'tcp://127.0.0.1:0', got {url!r}")
    try:
        path = _REGISTRY[scheme]
    except KeyError:
        raise ValueError(f"unknown transport scheme {scheme!r} in {url!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return importlib.import_module(path)


def capabilities(url_or_scheme: str) -> Capabilities:
    """Declared capabilities of the transport for ``url_or_scheme``."""
    url = url_or_scheme if "://" in url_or_scheme else url_or_scheme + "://x"
    if _scheme_of(url).startswith("emulated+"):
        return _module_for(url).capabilities_of(url)  # (by name, as every backend: no import cycle)
    return _module_for(url).CAPABILITIES


def listen(url: str, **options) -> Listener:
    """Listen on ``url`` (``inproc://name``, ``shm://name``, ``cuda_ipc://name``, ``tcp://127.0.0.1:0``,
    ``ucx://127.0.0.1:0``, or any of them over a modeled link: ``emulated+tcp://127.0.0.1:0?link=ib-ndr``)."""
    return _module_for(url).listen(url, **options)


def connect(url: str, *, timeout_s: float | None = 10.0, **options) -> Endpoint:
    """Connect to a listener at ``url``; raises BrokenLinkError if nobody listens there."""
    return _module_for(url).connect(url, timeout_s=timeout_s, **options)
