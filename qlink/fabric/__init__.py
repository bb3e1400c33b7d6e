"""Fabric-scale modeling: many QPU controllers sharing decoders over a modeled link.

A discrete-event model (:func:`simulate`) of N controllers streaming syndrome frames
to M decoders over a link from :mod:`qlink.links`, with decode times measured from a
real decoder (:func:`measure_service_times`), predicts the reaction time and the
decoder backlog as N grows. Its figures are *modeled*, never measured, and every
result names the measured inputs it rests on. :func:`validate_against_loop` checks
the model against the real closed loop (:func:`qlink.qec.loop.run_loop`) that runs
on this machine.

>>> from qlink.fabric import FabricConfig, ServiceTimes, simulate
>>> from qlink.links import link
>>> res = simulate(FabricConfig(num_controllers=1, link=link("ib-ndr"), distance=3, num_shots=20,
...                             service=ServiceTimes.constant(3_000)), seed=0)
>>> res.basis, res.shots_answered
('modeled', 20)
"""

from ._dist import EmpiricalDistribution
from ._events import EventLoop
from ._layout import FrameSpec, corrections_response_nbytes, detectors_per_round, round_frame_nbytes, shot_frames
from ._service import ServiceTimes, measure_service_times
from ._validate import Validation, validate_against_loop
from .model import FabricConfig, FabricResult, describe_link, simulate

__all__ = [
    "FabricConfig",
    "FabricResult",
    "simulate",
    "ServiceTimes",
    "measure_service_times",
    "EmpiricalDistribution",
    "EventLoop",
    "FrameSpec",
    "shot_frames",
    "detectors_per_round",
    "round_frame_nbytes",
    "corrections_response_nbytes",
    "describe_link",
    "Validation",
    "validate_against_loop",
]
