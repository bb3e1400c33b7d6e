"""qlink: a quantum-classical interconnect research sandbox.

One low-latency messaging core carries QEC decoder traffic (CUDA-Q realtime wire
format) and AI data movement (KV-cache blocks) over the same transports, so their
latency budgets can be compared line by line.

>>> import qlink
>>> issubclass(qlink.WireError, qlink.QlinkError)
True
"""

from .errors import (
    BrokenLinkError,
    CapabilityError,
    ClosedError,
    MissingDependencyError,
    QlinkError,
    QlinkTimeoutError,
    RegistrationError,
    RingFullError,
    WireError,
    WouldBlock,
)
from . import clock, wire
from .budget import BUDGETS, Budget, Figure, assess
from .histogram import LatencyHistogram
from .links import LINKS, LinkModel
from .memory import Region, RemoteRegion, alloc

__version__ = "0.1.0"

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
    "Region",
    "RemoteRegion",
    "alloc",
    "wire",
    "clock",
    "LatencyHistogram",
    "LINKS",
    "LinkModel",
    "BUDGETS",
    "Budget",
    "Figure",
    "assess",
    "__version__",
]
