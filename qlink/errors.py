"""Typed errors of qlink.

Every failure a caller can meet has its own class under :class:`QlinkError`, so
code can tell *you closed it* from *the peer or link failed* from *it took too
long*, in the spirit of trio's ``ClosedResourceError`` / ``BrokenResourceError``.

>>> from qlink.errors import BrokenLinkError, QlinkError
>>> issubclass(BrokenLinkError, QlinkError)
True
"""

from __future__ import annotations

__all__ = [
    "QlinkError",
    "ClosedError",
    "BrokenLinkError",
    "QlinkTimeoutError",
    "WouldBlock",
    "WireError",
    "CapabilityError",
    "RegistrationError",
    "RingFullError",
    "MissingDependencyError",
    "ConfigError",
]


class QlinkError(Exception):
    """Base class of every error qlink raises on purpose."""


class ClosedError(QlinkError):
    """The endpoint or listener was closed by *this* side; do not use it again."""


class BrokenLinkError(QlinkError):
    """The peer or the link failed (peer died, connection reset, EOF mid-message).

    The low-level cause, when there is one, is chained as ``__cause__``.
    """


class QlinkTimeoutError(QlinkError, TimeoutError):
    """A blocking call did not complete within its ``timeout_s``."""


class WouldBlock(QlinkError):
    """A ``*_nowait`` call could not complete immediately; retry later."""


class WireError(QlinkError, ValueError):
    """A frame failed validation. The message names the fault (bad magic, length past
    the end, too many syndrome bits...)."""


class CapabilityError(QlinkError):
    """The transport cannot do what was asked (e.g. one-sided put, device memory)."""


class RegistrationError(QlinkError, ValueError):
    """A memory region is unknown, unregistered, or the access falls outside it."""


class RingFullError(WouldBlock):
    """A bounded ring or queue is full; the message was not enqueued."""


class ConfigError(QlinkError, ValueError):
    """A configuration file or value is malformed; the message names the key and the file."""


class MissingDependencyError(QlinkError, ImportError):
    """An optional heavy stack is not installed; the message says what to install."""


def missing(package: str, *, extra: str, feature: str) -> MissingDependencyError:
    """Build the error raised when an optional dependency is absent."""
    return MissingDependencyError(
        f"{feature} needs the '{package}' package, which is not installed. "
        f"Install it with: pip install 'qlink[{extra}]' (or `make run`, which installs everything)."
    )


def optional_import(module: str, *, package: str, extra: str, feature: str):
    """Import ``module``, an optional dependency, or raise :func:`missing`'s error: what needs
    it and what to install (the ImportError chained).

    >>> optional_import("math", package="python", extra="all", feature="a doctest").floor(2.5)
    2
    >>> optional_import("no_such_module_here", package="nsm", extra="all", feature="a doctest")
    Traceback (most recent call last):
    ...
    qlink.errors.MissingDependencyError: a doctest needs the 'nsm' package, which is not installed. Install it with: pip install 'qlink[all]' (or `make run`, which installs everything).
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing(package, extra=extra, feature=feature) from exc
