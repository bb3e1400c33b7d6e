"""Device (CuPy) buffers on ``ucx://``: handed to UCX as they are, and UCX moves them.

UCX finds the memory type of each buffer itself and moves GPU memory with its CUDA
transports (``cuda_copy`` to and from the host, ``cuda_ipc`` between GPUs of one machine;
GPUDirect RDMA on InfiniBand/RoCE where ``rc``/``dc`` run). Those transports only load when
``UCX_TLS`` names them, and qlink's default (``tcp,sm,self``) does not: set
``UCX_TLS=tcp,sm,self,cuda_copy,cuda_ipc`` (:data:`CUDA_UCX_TLS`) in the environment of
both processes before the first ``ucx://`` endpoint is made. A device buffer met with a
``UCX_TLS`` that cannot move it is a :class:`~qlink.errors.CapabilityError` (UCX would take
it for host memory), never a crash. Host buffers take exactly the paths they always took.

>>> tls_moves_device_memory("tcp,sm,self"), tls_moves_device_memory(CUDA_UCX_TLS), tls_moves_device_memory("all")
(False, True, True)
>>> tls_moves_device_memory("^cuda_ipc,cuda_copy"), tls_moves_device_memory("^rc")
(False, True)
"""

from __future__ import annotations

import numpy as np

from qlink.errors import CapabilityError

from . import cuda as _cuda

__all__ = ["CUDA_UCX_TLS", "tls_moves_device_memory", "device_view", "host_copy", "copy_into_region"]

CUDA_UCX_TLS = "tcp,sm,self,cuda_copy,cuda_ipc"


def tls_moves_device_memory(tls: str) -> bool:
    """Whether a ``UCX_TLS`` value loads a CUDA transport (``cuda``, ``cuda_copy``, ``cuda_ipc``...)."""
    names = [t.strip() for t in str(tls).split(",") if t.strip()]
    if not names:
        return False
    if names[0].startswith("^"):  # an exclusion list: everything else is loaded
        return not any(t.lstrip("^").startswith("cuda") for t in names)
    return "all" in names or any(t.startswith("cuda") for t in names)


def device_view(tls: str, obj, *, writable: bool = False):
    """A flat ``uint8`` CuPy view of device array ``obj`` (no copy), once UCX can move it."""
    cp = _cuda.require("a device buffer on ucx://")
    if not tls_moves_device_memory(tls):
        raise CapabilityError(f"ucx:// was given a device (CUDA) buffer, but UCX runs with UCX_TLS={tls!r}, which "
                              f"loads no CUDA transport; set UCX_TLS={CUDA_UCX_TLS} (both processes, before the "
                              "first ucx endpoint), or pass host memory")
    _cuda.device_span(obj, writable=writable)  # C-contiguous (ValueError otherwise)
    return cp.asarray(obj).reshape(-1).view(cp.uint8)


def host_copy(view) -> np.ndarray:
    """A host copy of a device view (small puts ride inline in a control frame)."""
    return _cuda.to_host(_cuda.require("a device buffer on ucx://"), view)


def copy_into_region(region, offset: int, host) -> None:
    """Copy host bytes into a registered device region at ``offset`` (an inline put), synchronously."""
    cp = _cuda.require("a put into a device region on ucx://")
    dev = _cuda.device_of(cp, region.array, region.address)
    _cuda.copy_pieces(cp, dst_address=region.address, dst_device=dev, src=host, pieces=[(0, offset, len(host))])
