"""What one fabric simulation predicts: :class:`FabricResult`, labelled *modeled*."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["FabricResult"]


@dataclass(frozen=True, eq=False)
class FabricResult:
    """What one simulation predicts; every figure is *modeled* from the inputs it names."""

    config: Any = field(repr=False)  # the FabricConfig simulated
    seed: int
    basis: str
    inputs: dict = field(repr=False)
    shots_answered: int
    shots_dropped: int
    corrections_lost: int
    reaction_p50_ns: float
    reaction_p99_ns: float
    reaction_p999_ns: float
    reaction_mean_ns: float
    reaction_max_ns: float
    stage_p50_ns: dict
    offered_shots_per_s: float
    utilization_bound: float
    utilization_busiest: float
    mean_batch: float
    queue_max_shots: int
    queue_slope_shots_per_s: float
    backlog_slope_rounds_per_s: float
    stable: bool
    little: dict
    events: int
    wall_s: float
    backlog_t_ns: np.ndarray = field(repr=False)
    queue_shots: np.ndarray = field(repr=False)
    backlog_rounds: np.ndarray = field(repr=False)
    reaction_ns: np.ndarray = field(repr=False)
    stages_ns: dict = field(repr=False)

    def row(self) -> dict:
        """One flat CSV row: the headline figures, ``basis``, and the inputs they rest on."""
        c = self.config
        svc = self.inputs["service"]["source"]
        up, down = self.inputs["link"], self.inputs["downlink"]
        ing = self.inputs.get("ingest")
        return {
            "basis": self.basis, "fabric": up["name"], "downlink": down["name"],
            "num_controllers": c.num_controllers, "num_decoders": c.num_decoders, "distance": c.distance,
            "rounds": c.rounds, "rounds_per_frame": c.rounds_per_frame, "cycle_ns": c.cycle_ns,
            "frame_nbytes": max(f.nbytes for f in c.frames), "shots_per_controller": c.num_shots,
            "batch_size": c.batch_size, "phase": c.phase, "shared_port": c.shared_port, "poll": c.poll,
            "reaction_p50_us": self.reaction_p50_ns / 1e3, "reaction_p99_us": self.reaction_p99_ns / 1e3,
            "reaction_p999_us": self.reaction_p999_ns / 1e3,
            **{f"{k}_p50_us": v / 1e3 for k, v in self.stage_p50_ns.items()},
            "offered_shots_per_s": self.offered_shots_per_s, "utilization_bound": self.utilization_bound,
            "utilization_busiest": self.utilization_busiest, "mean_batch": self.mean_batch,
            "queue_max_shots": self.queue_max_shots, "queue_slope_shots_per_s": self.queue_slope_shots_per_s,
            "backlog_slope_rounds_per_s": self.backlog_slope_rounds_per_s, "stable": self.stable,
            "shots_answered": self.shots_answered, "shots_dropped": self.shots_dropped,
            "corrections_lost": self.corrections_lost, "little_rel_err": self.little["rel_err"],
            "service_kind": svc.get("kind"), "service_decoder": svc.get("decoder", svc.get("model")),
            "service_distance": svc.get("distance"), "service_p": svc.get("p"),
            "service_measured_at": svc.get("time_utc"), "service_host": svc.get("host"),
            "service_cpu": svc.get("cpu"), "link_kind": up["kind"], "link_citation": up.get("citation", ""),
            "ingest": None if ing is None else ing.get("name"), "seed": self.seed, "events": self.events,
            "sim_wall_s": self.wall_s,
        }


