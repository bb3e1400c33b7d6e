"""Run configurations from TOML files: ``qlink run --config run.toml``.

A file sets any of the main job's knobs; what it leaves out keeps its default. Every
value is checked before anything runs: an unknown key, a wrong type, a number that is not
finite or out of range, or a file that is not TOML raises :class:`~qlink.errors.ConfigError`
naming the file and the key. Nothing in the file is evaluated or imported.

>>> cfg = parse_run_config('''
... [qec]
... transports = ["shm", "tcp"]
... distances = [3, 5]
... num_shots = 200
... [kv]
... presets = ["llama-3-8b"]
... tokens = 1024
... ''')
>>> cfg.qec_transports, cfg.distances, cfg.num_shots, cfg.kv_tokens
(('shm', 'tcp'), (3, 5), 200, 1024)
>>> parse_run_config("[qec]\\nnum_shots = nan")
Traceback (most recent call last):
...
qlink.errors.ConfigError: <string>: qec.num_shots must be an integer, got float nan
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from . import checks
from .errors import ConfigError

__all__ = ["RunConfig", "load_run_config", "parse_run_config", "MAX_CONFIG_NBYTES"]

MAX_CONFIG_NBYTES = 1 << 20  # a run configuration is a few lines; a larger file is refused unread
_TRANSPORTS = checks.QEC_TRANSPORTS


@dataclass(frozen=True)
class RunConfig:
    """The main job's settings (defaults: the full ``qlink run``)."""

    qec_transports: tuple[str, ...] = ("shm", "tcp", "ucx")
    distances: tuple[int, ...] = (5, 11)
    num_shots: int = 1000
    presets: tuple[str, ...] = ("llama-3-8b", "llama-3-70b")
    kv_tokens: int = 4096
    seed: int = 0
    scenarios: bool = True  # step 3: the quick real-time loop and KV scenarios
    source: str = field(default="<defaults>", compare=False)

    @classmethod
    def quick(cls) -> "RunConfig":
        """The ``--quick`` settings (about a minute)."""
        return cls(qec_transports=("shm", "tcp"), distances=(5,), num_shots=300, presets=("llama-3-8b",),
                   source="<quick>")


# section -> key -> (RunConfig field, checker)
def _int_in(lo: int, hi: int):
    def check(where: str, v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{where} must be an integer, got {_show(v)}")
        if not lo <= v <= hi:
            raise ConfigError(f"{where} must be in [{lo}, {hi}], got {v}")
        return v
    return check


def _list_of(item_check, *, max_len: int = 64):
    def check(where: str, v):
        if not isinstance(v, list) or not v:
            raise ConfigError(f"{where} must be a non-empty array, got {_show(v)}")
        if len(v) > max_len:
            raise ConfigError(f"{where} has {len(v)} entries; at most {max_len}")
        return tuple(item_check(f"{where}[{i}]", x) for i, x in enumerate(v))
    return check


def _one_of(choices):
    def check(where: str, v):
        if not isinstance(v, str):
            raise ConfigError(f"{where} must be one of {', '.join(choices)}; got {_show(v)}")
        return checks.one_of(v, choices, what="value", where=where)  # names the nearest valid one
    return check


def _bool(where: str, v):
    if not isinstance(v, bool):
        raise ConfigError(f"{where} must be true or false, got {_show(v)}")
    return v


def _odd_distance(where: str, v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where} must be an integer, got {_show(v)}")
    return checks.distance(v, where=where)  # the same rule as the command line and the scenarios


def _presets():
    """The models the cross-domain table can set against a prefill budget (it needs their
    parameter count, qlink.crossdomain.MODEL_PARAMS)."""
    from .crossdomain import MODEL_PARAMS

    return tuple(MODEL_PARAMS)


_SCHEMA = {
    "qec": {"transports": ("qec_transports", _list_of(_one_of(_TRANSPORTS))),
            "distances": ("distances", _list_of(_odd_distance, max_len=8)),
            "num_shots": ("num_shots", _int_in(1, 10_000_000))},
    "kv": {"presets": ("presets", lambda w, v: _list_of(_one_of(_presets()), max_len=8)(w, v)),
           "tokens": ("kv_tokens", _int_in(1, 1 << 20))},
    "run": {"seed": ("seed", _int_in(0, 2**32 - 1)),
            "scenarios": ("scenarios", _bool)},
}


def _show(v) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return f"float {v}"
    r = repr(v)
    return f"{type(v).__name__} {r[:60] + '...' if len(r) > 60 else r}"


def parse_run_config(text: str, *, source: str = "<string>", base: RunConfig | None = None) -> RunConfig:
    """Read TOML ``text`` over ``base`` (default :class:`RunConfig`); ConfigError when bad."""
    if not isinstance(text, str):
        raise ConfigError(f"{source}: a configuration is text, got {type(text).__name__}")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_NBYTES:
        raise ConfigError(f"{source}: larger than {MAX_CONFIG_NBYTES} bytes; a run configuration is a few lines")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from e
    except (RecursionError, ValueError) as e:  # pathological nesting; NUL and other control characters
        raise ConfigError(f"{source}: not valid TOML: {type(e).__name__}: {e}") from e
    base = base or RunConfig()
    values = {f.name: getattr(base, f.name) for f in fields(base)}
    for section, table in doc.items():
        if section not in _SCHEMA:
            raise ConfigError(f"{source}: unknown section [{section}]; known: {', '.join(f'[{s}]' for s in _SCHEMA)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {section} must be a table ([{section}]), got {_show(table)}")
        for key, value in table.items():
            known = _SCHEMA[section]
            if key not in known:
                raise ConfigError(f"{source}: unknown key {section}.{key}; [{section}] takes {', '.join(known)}")
            name, check = known[key]
            values[name] = check(f"{source}: {section}.{key}", value)
    values["source"] = source
    return RunConfig(**values)


def load_run_config(path, *, base: RunConfig | None = None) -> RunConfig:
    """Read a TOML run configuration file; ConfigError (never a crash) when it is bad."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_NBYTES:
            raise ConfigError(f"{p}: {size} bytes; a run configuration is at most {MAX_CONFIG_NBYTES} bytes")
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the configuration: {e.strerror or e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    return parse_run_config(text, source=str(p), base=base)
