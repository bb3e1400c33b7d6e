"""One set of input checks for every entry point: the CLI, the scenarios and the TOML configs.

Each check takes a value and ``where`` (the flag or key it came from) and returns the
value converted, or raises :class:`UsageError` with one line that says what was wrong
and what would be right; an unknown name also gets the nearest valid one.

Lists are written the same way everywhere: ``"5,7"``, ``"5 7"`` and ``"5, 7"`` all mean
the two values, as do the separate words of a shell list (``--distances 5 7``).

>>> distances("5,7 9", where="--distances")
(5, 7, 9)
>>> distance(4, where="--distance")
Traceback (most recent call last):
...
qlink.checks.UsageError: --distance must be odd (a rotated surface code distance), got 4
>>> one_of("shmm", ("shm", "tcp", "ucx"), what="transport", where="--transports")
Traceback (most recent call last):
...
qlink.checks.UsageError: --transports: unknown transport 'shmm'; valid: shm, tcp, ucx (did you mean 'shm'?)
>>> transport("emulated+tcp://127.0.0.1:0?link=ib-ndr", where="--transport", urls=True)
'emulated+tcp://127.0.0.1:0?link=ib-ndr'
>>> probability(0.5, where="--p")
Traceback (most recent call last):
...
qlink.checks.UsageError: --p must be a probability in (0, 0.5), got 0.5
>>> count("0", where="--shots")
Traceback (most recent call last):
...
qlink.checks.UsageError: --shots must be a whole number > 0, got '0'
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Callable, Iterable

from .errors import ConfigError

__all__ = ["UsageError", "QEC_TRANSPORTS", "KV_TRANSPORTS", "ROUND_TRIP_TRANSPORTS", "MAX_DISTANCE", "nearest",
           "one_of", "split_list", "list_of", "integer", "count", "non_negative", "distance", "distances",
           "probability", "number", "decoder", "decoder_names", "transport", "out_dir", "in_file"]

# The transports the QEC decoder service can be reached over (controller <-> service, two processes).
QEC_TRANSPORTS = ("shm", "tcp", "ucx", "udp", "inproc")
# The transports a KV block can be moved over (one-sided put; nixl drives NIXL's UCX backend).
KV_TRANSPORTS = ("shm", "tcp", "ucx", "nixl")
# The transports whose 64-byte round trip `qlink bench transport` measures.
ROUND_TRIP_TRANSPORTS = ("shm", "tcp", "ucx", "udp")
MAX_DISTANCE = 51


class UsageError(ConfigError):
    """A value given on the command line, in a config or to a scenario is not valid; the
    message names where it came from and what would be valid."""


def _say(v) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def nearest(value: str, choices: Iterable[str]) -> str | None:
    """The valid choice closest to ``value`` (difflib), or None when none is close.

    >>> nearest("pymatchin", ["pymatching", "bposd"]), nearest("zzz", ["shm"])
    ('pymatching', None)
    """
    choices = [str(c) for c in choices]
    low = {c.lower(): c for c in choices}
    if str(value).lower() in low:
        return low[str(value).lower()]
    hit = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
    return hit[0] if hit else None


def one_of(value, choices: Iterable[str], *, what: str, where: str) -> str:
    """``value`` when it is one of ``choices``; else UsageError naming them and the nearest one."""
    choices = tuple(choices)
    if isinstance(value, str) and value in choices:
        return value
    hint = nearest(str(value), choices)
    raise UsageError(f"{where}: unknown {what} {_say(value)}; valid: {', '.join(choices)}"
                     f"{f' (did you mean {hint!r}?)' if hint else ''}")


def split_list(value, *, where: str) -> list[str]:
    """Words of a list written ``"a,b"``, ``"a b"``, ``"a, b"`` or as a list of such strings.

    >>> split_list(["5,7", "9"], where="x"), split_list("shm, tcp", where="x")
    (['5', '7', '9'], ['shm', 'tcp'])
    """
    parts = value if isinstance(value, (list, tuple)) else [value]
    words = [w for p in parts for w in str(p).replace(",", " ").split()]
    if not words:
        raise UsageError(f"{where} needs at least one value (a list is written '5,7' or '5 7'), got {_say(value)}")
    return words


def list_of(check: Callable, value, *, where: str, max_len: int = 64) -> tuple:
    """Apply ``check(word, where=...)`` to every word of the list ``value``."""
    if isinstance(value, (list, tuple)) and value and not all(isinstance(x, str) for x in value):
        words = list(value)  # already typed (a config array, a Python call)
        if not words:
            raise UsageError(f"{where} needs at least one value, got {_say(value)}")
    else:
        words = split_list(value, where=where)
    if len(words) > max_len:
        raise UsageError(f"{where} has {len(words)} values; at most {max_len}")
    return tuple(check(w, where=where) for w in words)


def integer(value, *, where: str, lo: int | None = None, hi: int | None = None, what: str = "a whole number") -> int:
    """``value`` as an int within [lo, hi]; bools, fractions and words are refused."""
    v = None
    if isinstance(value, int) and not isinstance(value, bool):
        v = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        v = int(value)
    elif isinstance(value, str):
        try:
            v = int(value.strip())
        except ValueError:
            v = None
    if v is None or (lo is not None and v < lo) or (hi is not None and v > hi):
        if lo is None:
            rng = ""
        elif hi is None:
            rng = " > 0" if lo == 1 else f" >= {lo}"
        else:
            rng = f" in [{lo}, {hi}]"
        raise UsageError(f"{where} must be {what}{rng}, got {_say(value)}")
    return v


def count(value, *, where: str) -> int:
    """A count: a whole number > 0 (0 is refused, never taken as 'the default')."""
    return integer(value, where=where, lo=1)


def non_negative(value, *, where: str) -> int:
    """A whole number >= 0 (where 0 has a stated meaning, e.g. 'a whole shot per frame')."""
    return integer(value, where=where, lo=0)


def number(value, *, where: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False, what: str = "a number") -> float:
    """A finite float within the given bounds."""
    try:
        v = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        v = float("nan")
    bad = not math.isfinite(v)
    if not bad and lo is not None:
        bad = v <= lo if lo_open else v < lo
    if not bad and hi is not None:
        bad = v >= hi if hi_open else v > hi
    if bad:
        rng = ""
        if lo is not None or hi is not None:
            rng = (f" in {'(' if lo_open else '['}{lo if lo is not None else '-inf'}, "
                   f"{hi if hi is not None else 'inf'}{')' if hi_open else ']'}")
        raise UsageError(f"{where} must be {what}{rng}, got {_say(value)}")
    return v


def probability(value, *, where: str) -> float:
    """A physical error rate: a number in (0, 0.5)."""
    return number(value, where=where, lo=0, hi=0.5, lo_open=True, hi_open=True, what="a probability")


def distance(value, *, where: str) -> int:
    """A rotated surface-code distance: odd, 3 to :data:`MAX_DISTANCE`."""
    d = integer(value, where=where, lo=3, hi=MAX_DISTANCE, what="an odd code distance")
    if d % 2 == 0:
        raise UsageError(f"{where} must be odd (a rotated surface code distance), got {d}")
    return d


def distances(value, *, where: str) -> tuple[int, ...]:
    """A list of distances (``"5,7"`` or ``"5 7"``)."""
    return list_of(distance, value, where=where, max_len=16)


def decoder_names() -> tuple[str, ...]:
    """The names of :data:`qlink.qec.decoders.BUILT_IN_DECODERS` (the one decoder list)."""
    from .qec.decoders import BUILT_IN_DECODERS

    return tuple(BUILT_IN_DECODERS)


def decoder(value, *, where: str) -> str:
    """A built-in decoder's name."""
    return one_of(value, decoder_names(), what="decoder", where=where)


def transport(value, *, where: str, choices: Iterable[str] = QEC_TRANSPORTS, urls: bool = False) -> str:
    """A transport name from ``choices``; with ``urls=True`` also a URL of a registered scheme."""
    choices = tuple(choices)
    if urls and isinstance(value, str) and "://" in value:
        import transports as _transports

        scheme = value.split("://", 1)[0].lower()
        inner = scheme.removeprefix("emulated+")  # emulated+<scheme>: a link model over a real transport
        one_of(inner, _transports.schemes(), what="URL scheme", where=where)
        return value
    return one_of(value, choices, what="transport", where=where)


def out_dir(value, *, where: str) -> Path:
    """An output directory: it exists as a directory, or can be created under a writable one."""
    p = Path(str(value)).expanduser()
    if not str(value).strip():
        raise UsageError(f"{where} needs a directory, got an empty path")
    if p.exists():
        if not p.is_dir():
            raise UsageError(f"{where}: {p} exists and is not a directory; give a directory")
        if not os.access(p, os.W_OK):
            raise UsageError(f"{where}: {p} is not writable")
        return p
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{where}: cannot create {p}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{where}: cannot create {p}: {parent} is not writable")
    return p


def in_file(value, *, where: str) -> Path:
    """An input file that exists and can be read."""
    p = Path(str(value)).expanduser()
    if not p.is_file():
        raise UsageError(f"{where}: {p} {'is a directory' if p.is_dir() else 'does not exist'}; give a file")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{where}: {p} is not readable")
    return p


def stim_file(value, *, where: str) -> str:
    """A ``.stim`` circuit file the QEC loop can run: it exists, parses as a stim circuit and
    has detectors and observables (:func:`qlink.qec.specs.circuit_spec`); its path as text."""
    from .qec.sources import CircuitError
    from .qec.specs import circuit_spec

    p = in_file(value, where=where)
    try:
        circuit_spec(p)
    except CircuitError as e:
        raise UsageError(f"{where}: {e}") from None
    return str(p)
