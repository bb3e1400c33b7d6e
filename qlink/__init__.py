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
    "__version__",
]
