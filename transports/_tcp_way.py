"""Which way a large deferred tcp put goes on this host: by splice, or copied by ``sendmsg``.

Spliced (:mod:`transports._tcp_splice`), the sender lends the socket its pages and the
receiver's read is the only copy; copied, the sender copies the bytes into the socket and
the receiver copies them out. Which is faster depends on the host, not on the code: where a
copy is cheap (memcpy at 13-15 GB/s) the page lending costs more than the copy it saves,
and loopback tcp ran at 1.9 GB/s spliced against 4.2 GB/s copied; where memcpy runs at a
third of that, splice won. So the way is measured, once per process, the first time a tcp
endpoint is asked whether it defers puts in place (a KV sender asks when it is made; an
endpoint that only sends small frames never does):

* a qlink tcp endpoint here, one in a reading process it starts, over loopback;
* ``rounds`` times each way, alternated: ``nbytes`` as deferred puts of one KV layer's size,
  spliced, then copied, each timed until the reader has every put's notification;
* splice is kept only if it beat the copy by ``SPLICE_MARGIN`` in every pair of rounds
  taken side by side: a copy is the conventional way and the one that measured faster in
  qlink's own bench on every host so far, and a moment of load on one round (a copy read
  1.17 GB/s in one measurement, against 3.5-4.3 on either side of it) must not flip it.

The result is left in the environment (``QLINK_TCP_WAY_MEASURED``) so that processes this
one starts later take it instead of measuring again. ``QLINK_TCP_SPLICE=1`` forces splice,
``QLINK_TCP_SPLICE=0`` forces copies (the receiving side is the same either way).

The public call is :func:`transports.tcp.deferred_put_way`; this module holds the choice and
the measurement, given tcp's ``listen`` (it imports no endpoint itself).

>>> Way.from_env("copy 1.94 3.71")
Way(kind='copy', basis='inherited', splice_GBps=1.94, copy_GBps=3.71, reason='')
>>> Way.from_env("copy 1.94 3.71").describe()
'copy (inherited: splice 1.94 GB/s, copy 3.71 GB/s)'
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import _tcp_splice
from ._tcp_handshake import ACK_VERSION

__all__ = ["FORCE_ENV", "MEASURED_ENV", "SPLICE_MARGIN", "Way", "measure", "way"]

FORCE_ENV = "QLINK_TCP_SPLICE"
MEASURED_ENV = "QLINK_TCP_WAY_MEASURED"
_NBYTES = 32 << 20  # more than most last-level caches: the pages come from memory, as a KV cache's do
_PIECE_NBYTES = 2 << 20  # one layer of a 512-token Llama-3-8B request
_ROUNDS = 5
SPLICE_MARGIN = 1.1  # splice must beat the copy by this factor in every pair of rounds
_WARMUP_ROUNDS = 2  # a fresh connection's buffers grow over its first few MB

_lock = threading.Lock()
_chosen: Way | None = None


@dataclass(frozen=True)
class Way:
    """How large deferred puts go: ``kind`` ``"splice"`` or ``"copy"``; the median rate each
    way showed (GB/s, None where not measured); ``basis``: ``measured`` here, ``inherited``
    from the process that started this one, ``forced`` by ``QLINK_TCP_SPLICE``,
    ``unavailable`` (splice is not built) or ``failed`` (the measurement could not run:
    ``reason``)."""

    kind: str
    basis: str
    splice_GBps: float | None = None
    copy_GBps: float | None = None
    reason: str = ""

    def describe(self) -> str:
        rates = ", ".join(f"{k} {g:.2f} GB/s" for k, g in (("splice", self.splice_GBps), ("copy", self.copy_GBps))
                          if g is not None)
        return f"{self.kind} ({self.basis}{': ' + rates if rates else ''}{': ' + self.reason if self.reason else ''})"

    def to_env(self) -> str:
        return f"{self.kind} {self.splice_GBps or 0:.4g} {self.copy_GBps or 0:.4g}"

    @classmethod
    def from_env(cls, text: str) -> Way | None:
        parts = text.split()
        if len(parts) != 3 or parts[0] not in ("splice", "copy"):
            return None
        try:
            s, c = float(parts[1]), float(parts[2])
        except ValueError:
            return None
        return cls(parts[0], "inherited", s or None, c or None)


def way(*, measure: Callable[[], Way]) -> Way:
    """The way this process's tcp endpoints send large deferred puts: forced, inherited, or
    ``measure()``'s (called once per process, the first time it is needed)."""
    global _chosen
    forced = os.environ.get(FORCE_ENV, "").strip()
    if not _tcp_splice.built():
        return Way("copy", "unavailable", reason="transports._tcpc is not built")
    if forced in ("0", "1"):
        return Way("splice" if forced == "1" else "copy", "forced", reason=f"{FORCE_ENV}={forced}")
    with _lock:
        if _chosen is None:
            _chosen = Way.from_env(os.environ.get(MEASURED_ENV, "")) or measure()
            if _chosen.basis == "measured":
                os.environ[MEASURED_ENV] = _chosen.to_env()
        return _chosen


def read_for_calibration(connect, url: str, nbytes: int, piece_nbytes: int, timeout_s: float) -> None:
    """The reading end of :func:`measure`, run in a process of its own as a receiving peer is:
    connect to ``url``, register ``nbytes`` of warm memory, send its descriptor; then, for
    every round, wait for the ``nbytes // piece_nbytes`` puts' notifications and answer
    ``b"k"``, until the other side closes."""
    from qlink.errors import QlinkError

    dst = np.ones(nbytes, np.uint8)
    with connect(url, timeout_s=timeout_s) as ep:
        ep.send(ep.register(dst).descriptor().to_bytes(), timeout_s=timeout_s)
        try:
            while True:
                ep.recv(timeout_s=timeout_s)  # a round begins
                for _ in range(nbytes // piece_nbytes):
                    ep.wait_notification(timeout_s=timeout_s)
                ep.send(b"k", timeout_s=timeout_s)
        except QlinkError:  # the measuring side closed: done
            return


def measure(*, listen, nbytes: int = _NBYTES, piece_nbytes: int = _PIECE_NBYTES, rounds: int = _ROUNDS,
            timeout_s: float = 10.0) -> Way:
    """Time ``nbytes`` (deferred puts of ``piece_nbytes``) from a tcp endpoint here (made by
    ``listen``, :func:`transports.tcp.listen`) to one in a reading process over loopback,
    spliced and copied, ``rounds`` times each (alternated), each from the first put to the
    reader's answer: splice where it beat the copy by ``SPLICE_MARGIN`` in every pair of
    rounds, else copy; the median rate of each way with it. A measurement that cannot run
    (no loopback, the reader gone) gives copy, ``basis="failed"`` and the reason: it never
    breaks the endpoint that asked."""
    if not _tcp_splice.built():
        return Way("copy", "unavailable", reason="transports._tcpc is not built")
    if nbytes <= 0 or rounds <= 0 or piece_nbytes <= 0 or nbytes % piece_nbytes:
        raise ValueError(f"nbytes, piece_nbytes and rounds must be positive and nbytes a multiple of "
                         f"piece_nbytes, got {nbytes}, {piece_nbytes} and {rounds}")
    from qlink.errors import QlinkError
    from qlink.memory import RemoteRegion

    src = np.empty(nbytes, np.uint8)
    src.fill(0x5A)
    rates: dict[str, list[float]] = {"splice": [], "copy": []}
    reader = None
    try:
        with listen("tcp://127.0.0.1:0") as lis:
            code = (f"from transports.tcp import connect; from transports._tcp_way import read_for_calibration as r; "
                    f"r(connect, {lis.url!r}, {nbytes}, {piece_nbytes}, {timeout_s!r})")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # imports as here
            reader = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            with lis.accept(timeout_s=timeout_s) as ep:
                remote = RemoteRegion.from_bytes(ep.recv(timeout_s=timeout_s))
                for r in range(_WARMUP_ROUNDS + rounds):
                    for kind in ("splice", "copy") if r % 2 else ("copy", "splice"):
                        ep._in_place = kind == "splice" and ep.version >= ACK_VERSION
                        ep.send(b"r", timeout_s=timeout_s)
                        t0 = time.perf_counter_ns()
                        for at in range(0, nbytes, piece_nbytes):
                            ep.put_many(src, remote, [at], [at], [piece_nbytes], timeout_s=timeout_s, defer=True)
                        ep.recv(timeout_s=timeout_s)
                        if r >= _WARMUP_ROUNDS:
                            rates[kind].append(nbytes / (time.perf_counter_ns() - t0))
                        ep.flush(timeout_s=timeout_s)
    except (QlinkError, OSError, ValueError) as e:  # (ValueError: a reader that sent no descriptor)
        why = ""
        if reader is not None and reader.poll() is not None and reader.stderr is not None:
            why = reader.stderr.read().decode(errors="replace").strip().splitlines()[-1:] or [""]
            why = f" (the reader: {why[0]})" if why[0] else ""
        return Way("copy", "failed", reason=f"the loopback measurement broke: {e}{why}")
    finally:
        if reader is not None:
            try:
                reader.wait(timeout_s)
            except subprocess.TimeoutExpired:
                reader.kill()
                reader.wait()
            if reader.stderr is not None:
                reader.stderr.close()
    mid = {k: float(np.median(v)) for k, v in rates.items()}
    kind = "splice" if all(s > SPLICE_MARGIN * c for s, c in zip(rates["splice"], rates["copy"])) else "copy"
    return Way(kind, "measured", round(mid["splice"], 3), round(mid["copy"], 3))
