"""Latency budgets for both domains, and the arithmetic that sets figures against them.

A :class:`Figure` is one latency (a p50, a p99…) of one thing on one transport, either
*measured* on this machine or *modeled* from the link catalog. The two never mix in
one number: adding a measured and a modeled figure raises ``ValueError``.

:func:`assess` sets a figure against a :class:`Budget` and gives the share spent and
the headroom left; :func:`stage_lines` does the same per stage of a timeline (and
:func:`stage_shares` on plain numbers). A throughput sets against a time budget as the
time per item (:func:`figure_from_rate`).

>>> from qlink.budget import BUDGETS, Figure, assess
>>> f = Figure("reaction time d=5", 20_000, basis="measured", transport="shm", statistic="p50")
>>> line = assess(f, BUDGETS["qec.reaction"])
>>> round(line.share, 3), line.headroom_ns
(0.317, 43000.0)
>>> Figure("a", 1, basis="measured", transport="shm") + Figure("b", 2, basis="modeled", transport="nvlink4")
Traceback (most recent call last):
  ...
ValueError: cannot add a measured figure to a modeled one: measured and modeled figures never mix
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Literal, Mapping, Sequence

__all__ = [
    "Budget",
    "BUDGETS",
    "Figure",
    "BudgetLine",
    "assess",
    "stage_shares",
    "stage_lines",
    "figure_from_rate",
    "layer_compute_budget",
    "budget_rows",
]

Basis = Literal["measured", "modeled"]
_BASES = ("measured", "modeled")


@dataclass(frozen=True)
class Budget:
    """A named latency limit of one domain (``qec`` or ``ai``) with its source."""

    key: str
    name: str
    domain: str
    limit_ns: float
    citation: str

    def __post_init__(self):
        if not (math.isfinite(self.limit_ns) and self.limit_ns > 0):
            raise ValueError(f"budget {self.key!r}: limit_ns must be a finite positive number, got {self.limit_ns!r}")
        if self.domain not in ("qec", "ai"):
            raise ValueError(f"budget {self.key!r}: domain must be 'qec' or 'ai', got {self.domain!r}")


BUDGETS: dict[str, Budget] = {
    b.key: b
    for b in [
        Budget("qec.cycle", "surface-code syndrome cycle", "qec", 1_100,
               "Google Willow, arXiv:2408.13687: 1.1 us cycle"),
        Budget("qec.reaction", "decoder reaction time (Willow real-time average, d=5)", "qec", 63_000,
               "arXiv:2408.13687: 63 us average decoder latency at d=5"),
        Budget("qec.backlog_rate", "rounds answered per second to keep the backlog flat: 1 / cycle "
               "(909,091 rounds/s), set as time per round answered", "qec", 1_100,
               "arXiv:2408.13687: 1.1 us cycle; a decoder answering fewer rounds per second than the "
               "cycle produces falls behind without bound (the backlog problem, Terhal, RMP 87, 307 (2015))"),
        Budget("qec.feedforward", "feed-forward round trip (NVQLink FPGA->GPU->FPGA max)", "qec", 3_960,
               "arXiv:2510.25213: 3.96 us maximum round trip"),
        Budget("ai.ttft", "time to first token (DistServe chatbot SLO)", "ai", 250_000_000,
               "DistServe (OSDI'24): chatbot TTFT 0.25 s"),
        Budget("ai.tpot", "time per output token (DistServe chatbot SLO)", "ai", 100_000_000,
               "DistServe (OSDI'24): chatbot TPOT 0.1 s"),
        Budget("ai.kv_transfer", "KV transfer (DistServe: < 30 ms for > 95 % of requests)", "ai", 30_000_000,
               "DistServe (OSDI'24)"),
    ]
}


def layer_compute_budget(*, model: str, num_layers: int, num_tokens: int, params: float,
                         achieved_flops: float, citation: str) -> Budget:
    """The per-layer prefill compute time a layer's KV transfer must hide under.

    Prefill costs about ``2 * params * num_tokens`` FLOPs, spread evenly over layers.

    >>> b = layer_compute_budget(model="llama-3-8b", num_layers=32, num_tokens=4096, params=8.0e9,
    ...                          achieved_flops=400e12, citation="example")
    >>> round(b.limit_ns / 1e6, 3)   # ms per layer
    5.12
    """
    for name, v in (("num_layers", num_layers), ("num_tokens", num_tokens), ("params", params),
                    ("achieved_flops", achieved_flops)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite positive number, got {v!r}")
    per_layer_s = 2.0 * params * num_tokens / achieved_flops / num_layers
    return Budget(f"ai.layer_compute.{model}.{num_tokens}", f"per-layer prefill compute, {model}, {num_tokens} tokens",
                  "ai", per_layer_s * 1e9, citation)


@dataclass(frozen=True)
class Figure:
    """One latency of one thing on one transport, measured here or modeled."""

    what: str
    value_ns: float
    basis: Basis
    transport: str
    statistic: str = "p50"

    def __post_init__(self):
        if self.basis not in _BASES:
            raise ValueError(f"basis must be 'measured' or 'modeled', got {self.basis!r}")
        if not (isinstance(self.value_ns, (int, float)) and math.isfinite(self.value_ns) and self.value_ns >= 0):
            raise ValueError(f"{self.what}: value_ns must be a finite non-negative number, got {self.value_ns!r}")

    def __add__(self, other: "Figure") -> "Figure":
        if not isinstance(other, Figure):
            return NotImplemented
        if other.basis != self.basis:
            raise ValueError(f"cannot add a {self.basis} figure to a {other.basis} one: "
                             "measured and modeled figures never mix")
        transport = self.transport if self.transport == other.transport else f"{self.transport}+{other.transport}"
        return Figure(f"{self.what} + {other.what}", self.value_ns + other.value_ns, self.basis, transport, self.statistic)


def figure_from_rate(what: str, *, per_s: float, basis: Basis, transport: str, statistic: str = "mean") -> Figure:
    """A throughput (items per second) as the time per item, ``1e9 / per_s`` ns, so that it
    sets against a time budget: a decoder answering 500,000 rounds/s spends 2 µs per round.

    >>> figure_from_rate("rounds answered", per_s=500_000, basis="measured", transport="shm").value_ns
    2000.0
    """
    if not (isinstance(per_s, (int, float)) and math.isfinite(per_s) and per_s > 0):
        raise ValueError(f"{what}: per_s must be a finite positive rate, got {per_s!r}")
    return Figure(what, 1e9 / float(per_s), basis, transport, statistic)


@dataclass(frozen=True)
class BudgetLine:
    """A figure set against a budget: the share of the budget spent and the headroom left.

    ``stage`` names the stage of a timeline the line stands for (``"total"`` for its sum,
    ``""`` for a line that is not a stage); a stage line's headroom is what the budget
    has left after that stage and every stage before it (see :func:`stage_lines`)."""

    domain: str
    what: str
    transport: str
    basis: str
    statistic: str
    value_ns: float
    budget: str
    limit_ns: float
    share: float
    headroom_ns: float
    stage: str = ""

    @property
    def within(self) -> bool:
        return self.value_ns <= self.limit_ns


def assess(figure: Figure, budget: Budget) -> BudgetLine:
    """Set ``figure`` against ``budget``."""
    return BudgetLine(
        domain=budget.domain, what=figure.what, transport=figure.transport, basis=figure.basis,
        statistic=figure.statistic, value_ns=float(figure.value_ns), budget=budget.name,
        limit_ns=float(budget.limit_ns), share=float(figure.value_ns) / budget.limit_ns,
        headroom_ns=float(budget.limit_ns - figure.value_ns),
    )


def stage_shares(stage_ns: dict[str, float], budget: Budget, *, order: Sequence[str] | None = None
                 ) -> list[tuple[str, float, float]]:
    """Per stage: ``(stage, duration_ns, share of the budget)``, in ``order``; the last row is the total.

    >>> stage_shares({"transport": 3000, "queue": 1000, "decode": 6000}, BUDGETS["qec.reaction"],
    ...              order=["transport", "queue", "decode"])[-1]
    ('total', 10000.0, 0.15873015873015872)
    """
    names = list(order) if order is not None else list(stage_ns)
    missing = [n for n in names if n not in stage_ns]
    if missing:
        raise ValueError(f"stages {missing} are not in the timeline (it has {sorted(stage_ns)})")
    rows = []
    total = 0.0
    for n in names:
        v = float(stage_ns[n])
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"stage {n!r} has a duration of {v!r} ns; durations must be finite and >= 0")
        total += v
        rows.append((n, v, v / budget.limit_ns))
    rows.append(("total", total, total / budget.limit_ns))
    return rows


def stage_lines(stages: Mapping[str, Figure], budget: Budget, *, total_what: str) -> list[BudgetLine]:
    """One line per stage of a timeline, in order, then one for their total.

    Each stage's share is its own time over the budget; its headroom is the budget less
    that stage and every stage before it (what is left for the stages after it); the
    total line (``stage="total"``, ``what=total_what``) carries the headroom of the whole.
    The total is the :class:`Figure` sum of the stages, so stages of mixed basis are
    refused (``ValueError``), as any sum of measured and modeled figures.

    >>> st = {"transport": Figure("transport", 3_000, "measured", "shm", "mean"),
    ...       "decode": Figure("decode", 6_000, "measured", "shm", "mean")}
    >>> [(ln.stage, ln.value_ns, ln.headroom_ns) for ln in stage_lines(st, BUDGETS["qec.reaction"],
    ...                                                                   total_what="reaction")]
    [('transport', 3000.0, 60000.0), ('decode', 6000.0, 54000.0), ('total', 9000.0, 54000.0)]
    """
    if not stages:
        raise ValueError("stage_lines needs at least one stage")
    out = []
    total: Figure | None = None
    for name, fig in stages.items():
        if not isinstance(fig, Figure):
            raise TypeError(f"stage {name!r} must be a Figure, got {type(fig).__name__}")
        total = fig if total is None else total + fig
        line = assess(fig, budget)
        out.append(replace(line, stage=str(name), headroom_ns=float(budget.limit_ns - total.value_ns)))
    out.append(replace(assess(replace(total, what=total_what), budget), stage="total"))
    return out


def budget_rows(lines: Iterable[BudgetLine]) -> list[dict]:
    """Rows for a table/CSV, in µs, with the basis column kept beside every number."""
    out = []
    for ln in lines:
        d = asdict(ln)
        out.append({
            "domain": d["domain"], "what": d["what"], "transport": d["transport"], "basis": d["basis"],
            "stat": d["statistic"], "value_us": round(d["value_ns"] / 1e3, 3), "budget": d["budget"],
            "budget_us": round(d["limit_ns"] / 1e3, 3), "share_pct": round(100 * d["share"], 2),
            "headroom_us": round(d["headroom_ns"] / 1e3, 3), "within": ln.within, "stage": d["stage"],
        })
    return out
