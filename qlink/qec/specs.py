"""Syndrome sources described as plain data (*source specs*), and building them.

A spec crosses a process boundary as numbers and names only; each side rebuilds the
same circuit and DEM from it::

    {"kind": "stim", "code": "surface_code:rotated_memory_z", "distance": 5,
     "rounds": 5, "p": 0.001}

A user's own circuit is a spec too (:func:`circuit_spec`): a ``.stim`` file by its
absolute path and the SHA-256 of its text (``{"kind": "stim_file", "path": ..., "sha256":
...}``; the other side reads the file and refuses it if it changed), or a
``stim.Circuit`` by its text (``{"kind": "stim_circuit", "circuit": ..., "sha256": ...}``).
:func:`build_source` and :func:`qlink.qec.loop.run_loop` take the path or the circuit
directly as well.

>>> spec = source_spec(distance=3, rounds=3, p=0.001)
>>> src = build_source(spec)
>>> src.dem.num_detectors, int(np.asarray(src.round_of_detector).max())
(24, 3)
>>> import stim
>>> rep = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=2, after_clifford_depolarization=0.01)
>>> spec = circuit_spec(rep)
>>> spec["kind"], build_source(spec).dem.num_detectors
('stim_circuit', 6)
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Mapping

import numpy as np

from ._checks import knob as _knob
from .sources import CircuitError

__all__ = ["source_spec", "circuit_spec", "build_source"]

_SOURCE_KEYS = {"kind", "code", "distance", "rounds", "p", "noise"}
# the keys of a user's own circuit, by kind
_CIRCUIT_KEYS = {"stim_file": ({"kind", "path"}, {"sha256"}), "stim_circuit": ({"kind", "circuit"}, {"sha256"})}


def source_spec(*, distance: int, rounds: int | None = None, p: float = 0.001,
                code: str = "surface_code:rotated_memory_z", noise: str = "uniform", kind: str = "stim") -> dict:
    """A plain-data syndrome-source spec (``rounds`` defaults to ``distance``).

    >>> source_spec(distance=5)["rounds"]
    5
    """
    _knob("distance", distance, 2)
    if rounds is not None:
        _knob("rounds", rounds, 1)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 0.5:  # (NaN fails the comparison)
        raise ValueError(f"p must lie in [0, 0.5), got {p!r}")
    return {"kind": kind, "code": code, "distance": int(distance), "rounds": int(rounds or distance),
            "p": float(p), "noise": noise}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def circuit_spec(circuit) -> dict:
    """The source spec of a user's own stim circuit: a ``.stim`` path (read and checked
    here: it must exist and hold a circuit with detectors and observables) or a
    ``stim.Circuit``. A bad file raises :class:`~qlink.qec.sources.CircuitError` naming it.

    >>> circuit_spec("no-such-file.stim")
    Traceback (most recent call last):
    ...
    qlink.qec.sources.CircuitError: no-such-file.stim: no such file; give the path of a .stim circuit file (stim's text format)
    """
    return spec_and_source(circuit)[0]


def spec_and_source(source) -> tuple[dict, "_BoundSource"]:
    """``(checked spec, built source)`` from what :func:`qlink.qec.loop.run_loop` takes as
    ``source``: a spec dict, a ``.stim`` path or a ``stim.Circuit`` (built once)."""
    import stim

    if isinstance(source, Mapping):
        spec = _check_spec(source)
    elif isinstance(source, stim.Circuit):
        text = str(source)
        spec = {"kind": "stim_circuit", "circuit": text, "sha256": _sha256(text)}
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        spec = {"kind": "stim_file", "path": os.path.abspath(path), "sha256": _sha256(_read_circuit_text(path))}
    else:
        raise TypeError(f"a source is a source spec dict (source_spec(...)), a .stim path or a stim.Circuit, "
                        f"got {type(source).__name__}")
    return spec, _build(spec)


def _read_circuit_text(path: str) -> str:
    if not os.path.exists(path):
        raise CircuitError(f"{path}: no such file; give the path of a .stim circuit file (stim's text format)")
    if os.path.isdir(path):
        raise CircuitError(f"{path}: is a folder; give the path of a .stim circuit file (stim's text format)")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise CircuitError(f"{path}: not a UTF-8 text stim circuit ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise CircuitError(f"{path}: cannot be read ({exc.strerror or exc})") from exc


def _check_spec(spec: Mapping[str, Any]) -> dict:
    if not isinstance(spec, Mapping):
        raise TypeError(f"a source spec is a dict of plain values, got {type(spec).__name__}")
    if spec.get("kind") in _CIRCUIT_KEYS:
        required, optional = _CIRCUIT_KEYS[spec["kind"]]
        missing_keys, unknown = required - set(spec), set(spec) - required - optional
        if missing_keys or unknown:
            raise ValueError(f"a {spec['kind']!r} source spec has keys {sorted(required)} (and optionally "
                             f"{sorted(optional)}); missing {sorted(missing_keys)}, unknown {sorted(unknown)}")
        for k, v in spec.items():
            if not isinstance(v, str):
                raise TypeError(f"source spec values of a {spec['kind']!r} spec are strings, got {k}={v!r}")
        return dict(spec)
    unknown = set(spec) - _SOURCE_KEYS
    if unknown:
        raise ValueError(f"unknown source spec keys {sorted(unknown)}; allowed: {sorted(_SOURCE_KEYS)} "
                         f"(a user's own circuit: circuit_spec(path or stim.Circuit))")
    for k, v in spec.items():
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise TypeError(f"source spec values must be str/int/float, got {k}={v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"source spec values must be finite numbers, got {k}={v!r}")
    return dict(spec)


class _BoundSource:
    """A :class:`~qlink.qec.sources.SyndromeSource` with the DEM a decoder needs bound to it.

    ``round_of_detector`` is the round each detector is *sent* in: its own round, or a
    later detector's where a circuit lists a detector after one of a later round (a frame
    carries a contiguous run of detectors, so such a detector waits for that later round;
    ``rounds_held_back`` counts them). Generated codes list detectors in round order."""

    def __init__(self, source) -> None:
        self.source = source
        self.dem = source.detector_error_model(decompose_errors=True)
        rounds = np.asarray(source.detector_rounds, dtype=np.int64)
        self.round_of_detector = np.maximum.accumulate(rounds) if rounds.size else rounds
        self.rounds_held_back = int(np.count_nonzero(self.round_of_detector != rounds))

    def sample(self, num_shots: int, *, seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        b = self.source.sample(num_shots, seed=seed)
        return b.detection_events.view(np.uint8), b.observable_flips.view(np.uint8)


_CODES = {"surface_code:rotated_memory_z": "Z", "surface_code:rotated_memory_x": "X"}


def _user_circuit(spec: dict):
    """The :class:`~qlink.qec.sources.StimSource` of a ``stim_file`` / ``stim_circuit`` spec,
    checked for what the loop needs: detectors, observables, a DEM."""
    import stim

    from .sources import StimSource

    if spec["kind"] == "stim_file":
        name = spec["path"]
        text = _read_circuit_text(name)
    else:
        name, text = "the stim.Circuit given", spec["circuit"]
    if "sha256" in spec and _sha256(text) != spec["sha256"]:
        raise CircuitError(f"{name}: its text changed since its source spec was made (SHA-256 "
                           f"{_sha256(text)[:12]}..., the spec says {spec['sha256'][:12]}...); make the spec again")
    try:
        circuit = stim.Circuit(text)
    except ValueError as exc:
        try:
            stim.DetectorErrorModel(text)
        except (ValueError, IndexError):  # (stim raises either for text that is not a model)
            raise CircuitError(f"{name}: not a valid stim circuit: {exc}") from exc
        raise CircuitError(f"{name}: is a detector error model, not a circuit; the loop samples shots from a "
                           "circuit: give the .stim circuit the model was made from") from exc
    if circuit.num_detectors == 0:
        raise CircuitError(f"{name}: has no DETECTOR instructions; the decoder decodes detection events: declare "
                           "each parity check with DETECTOR rec[...] (stim.Circuit.generated(...) circuits have them)")
    if circuit.num_observables == 0:
        raise CircuitError(f"{name}: has no OBSERVABLE_INCLUDE; the loop scores each correction against the "
                           "logical observables: declare at least one with OBSERVABLE_INCLUDE(0) rec[...]")
    return StimSource(circuit, name=name)


def build_source(spec):
    """Build the syndrome source a spec describes (``kind`` ``"stim"`` or ``"cudaq"``,
    a rotated surface-code memory; ``"stim_file"`` / ``"stim_circuit"``: a user's own
    circuit, see :func:`circuit_spec`; a ``.stim`` path or a ``stim.Circuit`` is taken
    as its spec): an object with ``dem``, ``round_of_detector`` and
    ``sample(num_shots, seed=...) -> (detectors, observables)``."""
    return spec_and_source(spec)[1]


def _build(spec: dict):
    kind = spec.get("kind", "stim")
    if kind in _CIRCUIT_KEYS:
        return _BoundSource(_user_circuit(spec))
    code = spec.get("code", "surface_code:rotated_memory_z")
    if code not in _CODES:
        raise ValueError(f"code {code!r} is not supported; use one of {sorted(_CODES)}")
    if spec.get("noise", "uniform") != "uniform":
        raise ValueError(f"noise model {spec['noise']!r} is not supported; use 'uniform'")
    if "distance" not in spec or "p" not in spec:
        raise ValueError("a source spec needs 'distance' and 'p'")
    kw = dict(distance=int(spec["distance"]), rounds=int(spec.get("rounds", spec["distance"])),
              p=float(spec["p"]), basis=_CODES[code])
    if kind == "stim":
        from .sources import StimSource

        return _BoundSource(StimSource.surface_code(**kw))
    if kind == "cudaq":
        from .sources import CudaqSource

        return _BoundSource(CudaqSource.surface_code(**kw))
    raise ValueError(f"source kind {kind!r} is unknown; use 'stim' or 'cudaq'")
