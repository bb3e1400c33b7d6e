"""N QPU controllers sharing M decoders over a fabric link: a discrete-event model.

Every controller plays shots of a surface-code memory back to back on its cycle
clock (one ``enqueue_syndromes`` frame per round, or per window of rounds). Their
clocks are independent (``phase="random"``: each starts at a uniform whole-ns offset
within a shot), skewed within one cycle of a shared clock (``"cycle"``: every
controller's shots end in the same cycle), or in step (``"aligned"``: worst-case
incast). Controller ``c`` talks to decoder ``c % M``. A message crosses the link as
the catalog models it: the sender's per-message ``overhead_ns``, then the bytes
serialize at ``bandwidth_Bps`` — on the decoder's port, shared by every controller
of that decoder, one FIFO per direction (``shared_port=True``) — then ``latency_ns``
plus half-normal jitter. A measured link (:class:`EmpiricalDistribution` of one-way
times) instead draws the whole one-way time from its samples.

A decoder is one server. A shot joins its queue once all its frames are in; a free
decoder takes every queued shot up to ``batch_size`` into one call whose duration is
drawn from :class:`ServiceTimes` (measured per batch size from the real decoder).
With ``ingest`` set the decoder also spends that time reading each message, like the
qlink decoder service (drain the transport, up to 256 messages, then decode what is
complete). After a shot's decode the correction goes back over the link (with
``poll=True`` only once the controller's ``get_corrections`` has been read too).

Reported, all labelled ``basis="modeled"`` with the measured inputs named: the
reaction time (last round's tick → correction applied at the controller)
p50/p99/p99.9 and its stages, the decoder queue over time and its growth slope, the
offered load against the decoders' capacity, and a Little's-law check.

Arrival times at the decoders depend on nothing downstream, so each port's FIFO is
solved up front (Lindley's recursion, vectorised); the decoders then run on a heap
event loop merged with that arrival stream.

>>> from qlink.links import link
>>> cfg = FabricConfig(num_controllers=4, num_decoders=1, link=link("nvqlink"), distance=3, num_shots=50,
...                    service=ServiceTimes.linear(fixed_ns=2_000, per_shot_ns=300), batch_size=8)
>>> res = simulate(cfg, seed=1)
>>> res.basis, res.shots_answered, res.stable
('modeled', 200, True)
>>> 2 * 1975 + 2_300 <= res.reaction_p50_ns < 20_000
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._dist import EmpiricalDistribution
from ._layout import shot_frames
from ._links import check_link, describe_link
from ._result import FabricResult
from ._run import DRAIN_MAX_MESSAGES, Run
from ._service import ServiceTimes

__all__ = ["FabricConfig", "FabricResult", "simulate", "describe_link", "DRAIN_MAX_MESSAGES"]

_PHASES = ("random", "cycle", "aligned")


def _pos_int(name: str, v: Any, *, low: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    return int(v)


def _nonneg(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class FabricConfig:
    """One fabric: who talks to whom over what, and how the decoders work.

    ``num_shots`` per controller; ``rounds`` QEC rounds per shot (default
    ``distance``); ``rounds_per_frame`` 0 sends a shot as one frame after its last
    round; ``downlink`` defaults to ``link``; ``ingest`` (ns, or a measured
    distribution) is the decoder's time to read one message (``None``: free);
    ``warmup_shots`` per controller are simulated but left out of the figures;
    ``shot_correlated``: a measured uplink draws one one-way time per shot for all its
    messages (a sender's own lateness delays a whole shot), not one per message.
    """

    num_controllers: int
    link: Any  # LinkModel | EmpiricalDistribution
    service: ServiceTimes
    num_decoders: int = 1
    downlink: Any = None
    distance: int = 5
    rounds: int | None = None
    rounds_per_frame: int = 1
    cycle_ns: float = 1100.0
    num_shots: int = 100
    batch_size: int = 1
    ingest: Any = None  # None | float ns | EmpiricalDistribution
    poll: bool = False
    shared_port: bool = True
    phase: str = "random"
    apply_ns: float = 0.0
    num_observables: int = 1
    warmup_shots: int = 0
    backlog_samples: int = 256
    shot_correlated: bool = False

    def __post_init__(self):
        _pos_int("num_controllers", self.num_controllers)
        _pos_int("num_decoders", self.num_decoders)
        _pos_int("num_shots", self.num_shots)
        _pos_int("batch_size", self.batch_size)
        _pos_int("num_observables", self.num_observables)
        _pos_int("backlog_samples", self.backlog_samples, low=4)
        _pos_int("warmup_shots", self.warmup_shots, low=0)
        if self.warmup_shots >= self.num_shots:
            raise ValueError(f"warmup_shots ({self.warmup_shots}) must be < num_shots ({self.num_shots})")
        check_link("link", self.link)
        if self.downlink is None:
            object.__setattr__(self, "downlink", self.link)
        check_link("downlink", self.downlink)
        if not isinstance(self.service, ServiceTimes):
            raise TypeError("service must be a ServiceTimes (see measure_service_times), "
                            f"got {type(self.service).__name__}")
        if self.rounds is None:
            object.__setattr__(self, "rounds", self.distance)
        shot_frames(self.distance, self.rounds, rounds_per_frame=self.rounds_per_frame)  # validates all three
        if _nonneg("cycle_ns", self.cycle_ns) <= 0:
            raise ValueError(f"cycle_ns must be > 0, got {self.cycle_ns!r}")
        _nonneg("apply_ns", self.apply_ns)
        if self.phase not in _PHASES:
            raise ValueError(f"phase must be one of {_PHASES}, got {self.phase!r}")
        if self.ingest is not None and not isinstance(self.ingest, EmpiricalDistribution):
            v = _nonneg("ingest", self.ingest)
            object.__setattr__(self, "ingest", None if v == 0 else EmpiricalDistribution(
                "ingest", np.array([v]), {"kind": "assumed", "ns": v}))

    @property
    def frames(self):
        return shot_frames(self.distance, self.rounds, rounds_per_frame=self.rounds_per_frame)

    @property
    def ticks_per_shot(self) -> int:
        """Cycle ticks one shot lasts (its rounds plus the final readout)."""
        return self.rounds + 1

    @property
    def offered_shots_per_s(self) -> float:
        return self.num_controllers * 1e9 / (self.ticks_per_shot * self.cycle_ns)

    def utilization_bound(self) -> float:
        """The busiest decoder's offered work over its time, at the cheapest batch ``batch_size``
        allows (ingest included): above 1 no batching keeps up."""
        per_decoder = -(-self.num_controllers // self.num_decoders)
        shots_per_ns = per_decoder / (self.ticks_per_shot * self.cycle_ns)
        per_shot, _ = self.service.best_per_shot_ns(self.batch_size)
        if self.ingest is not None:
            per_shot += self.ingest.mean_ns * (len(self.frames) + (1 if self.poll else 0))
        return shots_per_ns * per_shot


def simulate(config: FabricConfig, *, seed: int = 0) -> FabricResult:
    """Run the model once; the same ``config`` and ``seed`` give the same result."""
    if not isinstance(config, FabricConfig):
        raise TypeError(f"simulate takes a FabricConfig, got {type(config).__name__}")
    return Run(config, int(seed)).run()
