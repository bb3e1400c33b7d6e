"""The link catalog: latency, bandwidth, per-message overhead, jitter and loss of the
links a QEC loop or a KV transfer may cross, each number with its source.

Figures from a link model are *modeled*, never measured; every report that uses one
says so (``basis="modeled"``).

>>> from qlink.links import LINKS
>>> nv = LINKS["nvlink4"]
>>> round(nv.transfer_time_ns(512 * 131_072) / 1e3, 1)   # a 512-token Llama-3-8B KV request, µs
150.6
>>> LINKS["nvqlink"].round_trip_ns(64, 64) <= 3960
True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LinkModel", "LINKS", "link"]


@dataclass(frozen=True)
class LinkModel:
    """One direction of a link. ``latency_ns`` is the one-way wire+switch latency of the
    first byte, ``bandwidth_Bps`` the per-direction payload bandwidth, ``overhead_ns`` the
    fixed per-message software/NIC cost, ``jitter_ns`` the standard deviation of a
    half-normal extra delay, ``loss`` the probability a message is lost."""

    name: str
    latency_ns: float
    bandwidth_Bps: float
    overhead_ns: float = 0.0
    jitter_ns: float = 0.0
    loss: float = 0.0
    citation: str = ""
    note: str = ""

    def __post_init__(self):
        for field in ("latency_ns", "bandwidth_Bps", "overhead_ns", "jitter_ns", "loss"):
            v = getattr(self, field)
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"link {self.name!r}: {field} must be a finite non-negative number, got {v!r}")
        if self.bandwidth_Bps == 0:
            raise ValueError(f"link {self.name!r}: bandwidth_Bps must be > 0")
        if self.loss >= 1:
            raise ValueError(f"link {self.name!r}: loss must be < 1, got {self.loss}")

    def transfer_time_ns(self, nbytes: int) -> float:
        """Modeled time for one message of ``nbytes`` to arrive entirely (no jitter)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return self.latency_ns + self.overhead_ns + nbytes / self.bandwidth_Bps * 1e9

    def round_trip_ns(self, request_nbytes: int, response_nbytes: int) -> float:
        """Modeled request + response time over this link (no jitter, no service time)."""
        return self.transfer_time_ns(request_nbytes) + self.transfer_time_ns(response_nbytes)

    def sample_delay_ns(self, nbytes: int, rng: np.random.Generator) -> float:
        """One draw of the modeled delay: transfer time plus half-normal jitter."""
        extra = abs(rng.normal(0.0, self.jitter_ns)) if self.jitter_ns else 0.0
        return self.transfer_time_ns(nbytes) + extra


_GB = 1e9

LINKS: dict[str, LinkModel] = {
    m.name: m
    for m in [
        LinkModel(
            "nvlink4", latency_ns=1000, bandwidth_Bps=450 * _GB, overhead_ns=500, jitter_ns=100,
            citation="NVIDIA H100 datasheet: NVLink 4 900 GB/s bidirectional (450 GB/s per direction)",
            note="latency and per-message cost are order-of-magnitude estimates for a GPU peer copy",
        ),
        LinkModel(
            "nvlink-c2c", latency_ns=800, bandwidth_Bps=450 * _GB, overhead_ns=300, jitter_ns=50,
            citation="NVIDIA Grace Hopper Superchip: NVLink-C2C 900 GB/s bidirectional",
            note="latency is an estimate",
        ),
        LinkModel(
            "pcie5-x16", latency_ns=1000, bandwidth_Bps=64 * _GB, overhead_ns=1000, jitter_ns=200,
            citation="PCI-SIG PCIe 5.0: 32 GT/s x16, ~64 GB/s per direction",
            note="latency (DMA round trip ~1-2 us) is an estimate",
        ),
        LinkModel(
            "ib-ndr", latency_ns=1300, bandwidth_Bps=50 * _GB, overhead_ns=700, jitter_ns=200,
            citation="NVIDIA ConnectX-7 / InfiniBand NDR: 400 Gb/s per port",
            note="one-way latency of ~1-2 us through one switch is an estimate",
        ),
        LinkModel(
            "roce-400g", latency_ns=2000, bandwidth_Bps=50 * _GB, overhead_ns=1000, jitter_ns=500,
            citation="NVIDIA ConnectX-7: 400 Gb/s Ethernet (RoCE v2); Mooncake reports 87 GB/s over 4x200 Gb/s RoCE",
            note="latency is an estimate",
        ),
        LinkModel(
            "tcp-100g", latency_ns=10_000, bandwidth_Bps=12.5 * _GB, overhead_ns=5000, jitter_ns=5000,
            citation="100 Gb/s Ethernet line rate; kernel TCP round trips of tens of us",
            note="kernel TCP over a datacenter switch; estimates",
        ),
        LinkModel(
            "nvqlink", latency_ns=1975, bandwidth_Bps=50 * _GB, overhead_ns=0, jitter_ns=0,
            citation="arXiv:2510.25213: NVQLink FPGA->GPU->FPGA round trip 3.96 us max (split evenly per direction)",
            note="the one-way figure is half the measured maximum round trip; bandwidth of a 400 Gb/s NIC assumed",
        ),
    ]
}


def link(name: str) -> LinkModel:
    """The catalog entry ``name``; unknown names raise ValueError listing the known ones."""
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; known links: {', '.join(sorted(LINKS))}") from None
