"""How a message crosses a link in the fabric model: catalog links and measured ones.

A catalog :class:`~qlink.links.LinkModel` costs the sender's per-message
``overhead_ns``, then the bytes serialize at ``bandwidth_Bps`` (on a port shared by
every sender of that port, first come first served, when ``shared``), then
``latency_ns`` plus half-normal jitter; a lost message never arrives. A measured
link (:class:`EmpiricalDistribution` of one-way times) draws the whole one-way time.

>>> import numpy as np
>>> from qlink.links import LinkModel
>>> lm = LinkModel("toy", latency_ns=100, bandwidth_Bps=1e9)        # 1 byte per ns
>>> arrive, lost = traverse(lm, np.array([0.0, 0.0, 50.0]), np.array([10.0, 10.0, 10.0]),
...                         np.zeros(3, np.int64), 1, shared=True, rng=np.random.default_rng(0))
>>> arrive.tolist(), lost.tolist()       # the second waits for the first; the third finds the port free
([110.0, 120.0, 160.0], [False, False, False])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qlink.links import LinkModel

from ._dist import EmpiricalDistribution, _HalfNormals, _Uniforms

__all__ = ["describe_link", "check_link", "traverse", "Downlink"]


def check_link(name: str, v: Any) -> None:
    """TypeError unless ``v`` is a catalog link or a measured one-way distribution."""
    if not isinstance(v, (LinkModel, EmpiricalDistribution)):
        raise TypeError(f"{name} must be a qlink.links.LinkModel (catalog) or an EmpiricalDistribution of "
                        f"measured one-way times, got {type(v).__name__}")


def describe_link(v: LinkModel | EmpiricalDistribution) -> dict:
    """The link's numbers and where they come from (catalog citation, or the measurement)."""
    if isinstance(v, LinkModel):
        return {"name": v.name, "kind": "catalog", "latency_ns": v.latency_ns, "bandwidth_Bps": v.bandwidth_Bps,
                "overhead_ns": v.overhead_ns, "jitter_ns": v.jitter_ns, "loss": v.loss, "citation": v.citation,
                "note": v.note}
    d = v.describe()
    d["kind"] = "empirical"
    return d


def traverse(link, enter_ns: np.ndarray, nbytes: np.ndarray, port: np.ndarray, num_ports: int, *,
             shared: bool, rng: np.random.Generator, per_shot: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times (and a lost mask) of messages entering ``link`` at ``enter_ns``.

    ``per_shot`` > 0: a measured link draws one one-way time per run of ``per_shot``
    consecutive messages (the messages of one shot) instead of one per message."""
    n = enter_ns.size
    if isinstance(link, EmpiricalDistribution):
        a = link.samples_ns
        if per_shot:
            u = np.repeat(rng.random(n // per_shot), per_shot)
        else:
            u = rng.random(n)
        idx = np.minimum((u * a.size).astype(np.int64), a.size - 1)
        return enter_ns + a[idx], np.zeros(n, bool)
    start = enter_ns + link.overhead_ns
    ser = nbytes * (1e9 / link.bandwidth_Bps)
    if shared:
        depart = np.empty(n)
        order = np.lexsort((np.arange(n), start, port))  # by port, then time, then message index
        bounds = np.searchsorted(port[order], np.arange(num_ports + 1))
        for p in range(num_ports):
            sel = order[bounds[p]:bounds[p + 1]]
            if sel.size == 0:
                continue
            a, s = start[sel], ser[sel]
            c = np.cumsum(s)
            # Lindley: D_i = max(A_i, D_{i-1}) + S_i  =  C_i + max_{j<=i}(A_j - C_{j-1})
            depart[sel] = c + np.maximum.accumulate(a - (c - s))
    else:
        depart = start + ser
    arrive = depart + link.latency_ns
    if link.jitter_ns:
        arrive = arrive + np.abs(rng.standard_normal(n)) * link.jitter_ns
    lost = rng.random(n) < link.loss if link.loss else np.zeros(n, bool)
    return arrive, lost


class Downlink:
    """Answers leaving the decoders, in time order (so each port's FIFO runs inline)."""

    __slots__ = ("empirical", "lat", "ovh", "ser", "jit", "loss", "free", "shared", "u", "hn")

    def __init__(self, link, nbytes: int, num_ports: int, *, shared: bool, rng: np.random.Generator) -> None:
        self.u = _Uniforms(rng)
        self.hn = _HalfNormals(rng)
        self.shared = shared
        self.free = [0.0] * num_ports
        if isinstance(link, EmpiricalDistribution):
            self.empirical = link
            self.lat = self.ovh = self.ser = self.jit = self.loss = 0.0
        else:
            self.empirical = None
            self.lat, self.ovh, self.jit, self.loss = link.latency_ns, link.overhead_ns, link.jitter_ns, link.loss
            self.ser = nbytes * (1e9 / link.bandwidth_Bps)

    def arrival(self, port: int, now: float) -> float:
        """Arrival time of an answer sent at ``now``; NaN when the link loses it."""
        if self.empirical is not None:
            return now + self.empirical.quantile_ns(self.u.next())
        t = now + self.ovh
        if self.shared:
            f = self.free[port]
            t = (f if f > t else t) + self.ser
            self.free[port] = t
        else:
            t += self.ser
        t += self.lat
        if self.jit:
            t += self.jit * self.hn.next()
        if self.loss and self.u.next() < self.loss:
            return math.nan
        return t


