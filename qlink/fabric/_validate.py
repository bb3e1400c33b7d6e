"""The model against the real loop: one controller, one decoder service, on this machine.

:func:`validate_against_loop` runs :func:`qlink.qec.loop.run_loop` (controller here,
decoder service in a child process, over ``shm`` or ``tcp``), then asks the model to
predict the same configuration from measured inputs only:

* the transport, as two measured one-way distributions taken from the loop's joined
  per-shot timestamps: *in* = last round's tick → the service received the shot's last
  frame (the controller's send + the wire), *out* = the service's send of the answer +
  the wire back + the controller applying it;
* the service's cost of reading one message (its ``parse`` stage histogram);
* decode times per batch size measured offline by :func:`measure_service_times`
  (the same decoder, distance and noise; *not* the loop's own decode stage).

The model itself supplies the rest — the decoder's queue, batching, and waiting for
``get_corrections`` — and its reaction-time p50 is compared with the loop's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ._dist import EmpiricalDistribution
from ._service import ServiceTimes, measure_service_times
from .model import FabricConfig, FabricResult, simulate

__all__ = ["Validation", "validate_against_loop", "DEFAULT_TOLERANCE_REL", "DEFAULT_TOLERANCE_ABS_NS"]

# Two processes busy-polling on a shared 2-core machine: repeated real loops of the same
# configuration differ run to run by tens of percent in p50 (the OS decides when the
# service runs), so a prediction within 35 % (or 15 µs, whichever is larger) matches.
DEFAULT_TOLERANCE_REL = 0.35
DEFAULT_TOLERANCE_ABS_NS = 15_000.0


@dataclass(frozen=True)
class Validation:
    """Predicted against measured reaction time of one real-loop configuration."""

    transport: str
    predicted_p50_ns: float
    measured_p50_ns: float
    predicted_p99_ns: float
    measured_p99_ns: float
    tolerance_rel: float
    tolerance_abs_ns: float
    stages_p50_ns: dict  # {stage: (predicted, measured)} for the decoder-side stages
    inputs: dict
    loop_summary: dict
    model: FabricResult = field(repr=False)

    @property
    def error_ns(self) -> float:
        return self.predicted_p50_ns - self.measured_p50_ns

    @property
    def rel_error(self) -> float:
        return self.error_ns / self.measured_p50_ns if self.measured_p50_ns else math.inf

    @property
    def allowed_ns(self) -> float:
        return max(self.tolerance_rel * self.measured_p50_ns, self.tolerance_abs_ns)

    @property
    def within(self) -> bool:
        return abs(self.error_ns) <= self.allowed_ns

    def row(self) -> dict:
        return {
            "basis": "modeled vs measured", "transport": self.transport,
            "predicted_p50_us": self.predicted_p50_ns / 1e3, "measured_p50_us": self.measured_p50_ns / 1e3,
            "predicted_p99_us": self.predicted_p99_ns / 1e3, "measured_p99_us": self.measured_p99_ns / 1e3,
            "rel_error": self.rel_error, "allowed_us": self.allowed_ns / 1e3, "within": self.within,
            **{f"{k}_p50_us_pred": v[0] / 1e3 for k, v in self.stages_p50_ns.items()},
            **{f"{k}_p50_us_meas": v[1] / 1e3 for k, v in self.stages_p50_ns.items()},
        }


def _stages_of(loop_result) -> dict:
    from qlink.qec.timeline import SERVICE_SHOT_FIELDS, ShotRecords, join_shots

    cres = loop_result.controller
    if cres.shot_records is None or "shots" not in loop_result.service:
        raise ValueError("the loop result keeps no per-shot records (run_loop keep_samples=0); "
                         "the validation needs them")
    svc = ShotRecords.from_dict(SERVICE_SHOT_FIELDS, loop_result.service["shots"])
    st = join_shots(cres.shot_records, svc)
    if len(st["reaction"]) == 0:
        raise ValueError("no shot of the loop was answered; nothing to validate against")
    return st


def loop_inputs(loop_result) -> dict:
    """The measured inputs a real loop gives the model: ``uplink``, ``downlink`` and ``ingest``
    distributions, each recording where it came from."""
    st = _stages_of(loop_result)
    from ._service import _environment

    env = _environment()
    where = {"kind": "measured", "from": "qlink.qec.loop.run_loop", "transport": loop_result.transport,
             "shots": int(len(st["reaction"])), "host": env["host"], "cpu": env["cpu"], "time_utc": env["time_utc"]}
    up = EmpiricalDistribution("measured-in:" + loop_result.transport, st["send"] + st["wire_in"],
                               {**where, "stages": "send + wire_in (tick -> service received the last frame)"})
    down = EmpiricalDistribution("measured-out:" + loop_result.transport,
                                 st["respond"] + st["wire_out"] + st["apply"],
                                 {**where, "stages": "respond + wire_out + apply (answer sent -> applied)"})
    parse = loop_result.service.get("stages", {}).get("parse")
    ingest = None
    if parse and parse.get("count"):
        ingest = EmpiricalDistribution.from_histogram(
            "measured-ingest:" + loop_result.transport, parse,
            source={**where, "stages": "service parse (one message read and queued)"})
    return {"uplink": up, "downlink": down, "ingest": ingest, "stages": st}


def predict_loop(loop_result, service: ServiceTimes, *, seed: int = 0, max_decode_batch: int = 4096
                 ) -> FabricResult:
    """The model's prediction of ``loop_result``'s configuration from its measured inputs."""
    inp = loop_inputs(loop_result)
    src = loop_result.source
    cfg = FabricConfig(
        num_controllers=1, num_decoders=1, link=inp["uplink"], downlink=inp["downlink"], service=service,
        distance=int(src["distance"]), rounds=int(src["rounds"]), rounds_per_frame=loop_result.rounds_per_frame,
        cycle_ns=float(loop_result.cycle_ns), num_shots=int(loop_result.num_shots), batch_size=max_decode_batch,
        ingest=inp["ingest"], poll=True, shared_port=False, phase="aligned", shot_correlated=True,
    )
    return simulate(cfg, seed=seed)


def validate_against_loop(*, transport: str = "shm", distance: int = 3, rounds: int | None = None,
                          p: float = 0.001, cycle_ns: int = 10_000, rounds_per_frame: int = 0,
                          num_shots: int = 400, warmup_shots: int = 100, seed: int = 1,
                          service: ServiceTimes | None = None, decoder: str = "pymatching",
                          tolerance_rel: float = DEFAULT_TOLERANCE_REL,
                          tolerance_abs_ns: float = DEFAULT_TOLERANCE_ABS_NS, timeout_s: float = 120.0) -> Validation:
    """Run the real loop once, predict it with the model, and compare reaction-time p50s."""
    from qlink.qec.loop import run_loop, source_spec

    if tolerance_rel <= 0 or tolerance_abs_ns < 0:
        raise ValueError("tolerance_rel must be > 0 and tolerance_abs_ns >= 0")
    spec = source_spec(distance=distance, rounds=rounds, p=p)
    if service is None:
        service = measure_service_times(distance, p, (1, 2, 4, 8, 16, 32, 64, 128, 256), rounds=spec["rounds"],
                                        decoder=decoder, seed=seed)
    res = run_loop(transport=transport, source=spec, decoder=decoder, num_shots=num_shots, cycle_ns=cycle_ns,
                   rounds_per_frame=rounds_per_frame, seed=seed, warmup_shots=warmup_shots, timeout_s=timeout_s)
    model = predict_loop(res, service, seed=seed)
    st = _stages_of(res)
    measured = {k: float(np.percentile(st[k], 50)) for k in ("queue", "decode")}
    stages = {k: (model.stage_p50_ns[k], measured[k]) for k in ("queue", "decode")}
    inputs = {k: (v.describe() if isinstance(v, EmpiricalDistribution) else None)
              for k, v in loop_inputs(res).items() if k != "stages"}
    inputs["service"] = service.describe()
    return Validation(
        transport=res.transport, predicted_p50_ns=model.reaction_p50_ns, measured_p50_ns=res.reaction_p50_ns,
        predicted_p99_ns=model.reaction_p99_ns, measured_p99_ns=res.reaction_p99_ns,
        tolerance_rel=float(tolerance_rel), tolerance_abs_ns=float(tolerance_abs_ns), stages_p50_ns=stages,
        inputs=inputs, loop_summary=res.summary(), model=model,
    )
