"""The QEC loop's native per-frame path (over shm rings, a tcp socket or a udp socket), and its control plane.

The per-frame work of both sides lives in C (``qlink.qec._hotcore``, built from
``setup.py``): on the service side frame ingest, validation, accumulation of a shot's
rounds and the answer; on the controller side emission on the cycle clock, the answer's
application to the Pauli frame, and every stage timestamp, written into preallocated
rows. The one Python call per shot is the decoder itself — for PyMatching the matching
graph's own call on the fired detectors' indices (no public-API wrapper, no array built
per shot), for any other decoder its ``decode_shots_bit_packed`` on a preallocated row.
This module is the control plane: it builds the cores from an shm endpoint's rings
(:meth:`transports.shm.ShmEndpoint.native_rings`: no system call per frame) or a tcp
endpoint's socket (:meth:`transports.tcp.TcpEndpoint.native_socket`: the same framing as
the Python path, read in large chunks and parsed in place, answers and frames gathered and
written when the side has nothing else to do, so a side that is behind writes several whole
frames at once, each stamped at its own time) or a udp endpoint's socket
(:meth:`transports.udp.UdpEndpoint.native_datagrams`: one frame per datagram, the udp
wire unchanged, received and sent in batches of up to 32 with ``recvmmsg`` /
``sendmmsg``), looks at the peer whenever a core comes back idle (a dead peer is reported
within a second; over udp the controller sees the service's closed port, ``ECONNREFUSED``),
and turns the rows into the
same reports, histograms and per-shot records as the Python path
(:mod:`qlink.qec.timeline`).

What the native service serves (the rest of the protocol: :mod:`qlink.qec.service`):

* ``enqueue_syndromes`` frames of any size that fits the shot: a round per frame (the
  hardware's way), a window of rounds, or whole shots; the shot is decoded the moment its
  last bits land, in the order it completed. A counter gap drops every shot the lost
  frames touched (exactly, given ``frames_per_shot``) and answers ``SYNDROMES_DROPPED``
  for them in turn; a full queue answers ``BUSY`` and drops the shot.
* ``get_corrections`` of one shot (``return_size`` ≤ the observables), ``reset=1``
  consuming it, ``reset=0`` peeking; ``NOT_READY`` while none is decoded.
* a long memory experiment with a :class:`~qlink.qec.decoders.SlidingWindowDecoder`
  (or the name ``"sliding_window:W:C"``): each window is matched the moment its last round
  lands and its commit region committed in C (:func:`window_plan`); the experiment's
  correction is answered once its last window is committed.
* ``reset_decoder``; every malformed frame is answered with its status where its header
  can be read, and counted by fault. Over tcp a frame whose header announces more than the
  input buffer (4 MiB) ends the session without allocating anything for it; frames of other
  kinds (puts) are skipped and counted.

Over udp (a lossy link) a shot is named, not taken first come first served: the native
controller's get for a shot carries, as its request id, the counter of the shot's last
frame (low 30 bits) under both top bits. The service answers such a get from that shot's
own record, whatever was lost before it, and keeps each answered shot's record (the last
4,096 shots), so a get asked again is answered again and nothing is consumed twice. A
shot lost to a counter gap is recorded as dropped (a shot with two gaps once); the
service answers ``NOT_READY`` for a shot whose last frame has not come and
``SYNDROMES_DROPPED`` for a dropped one, and the controller then sends that shot's frames
again (their own counters, behind the stream's) and asks again: the service puts them
together aside and decodes the shot, a repair. Answers are taken in any order; gets of the
oldest unanswered shots are asked again when none came within 50 ms; a shot still missing
after 16 repairs is reported ``SYNDROMES_DROPPED`` in its row. Before its first frame the
controller sends a peek and plays nothing until it is answered, so no burst lands in a
socket the service does not read yet. Gets with other request ids keep the first come,
first served answer, kept at the request id (the very same request again is answered
again and consumes nothing). A ``NOT_READY`` is kept too: the very same get sent again is
answered ``NOT_READY`` even once a shot is ready, and a client whose syndromes were lost asks
again as a new request (a new ``ptp_timestamp``, as the benches' lock-step controller does). The
Python engine keeps no answer for a ``NOT_READY``.

>>> available() is None
True
>>> import stim
>>> dem = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=2,
...                              after_clifford_depolarization=0.01).detector_error_model()
>>> dec = single_shot_decoder("pymatching", dem)
>>> dec.kind, dec.label
('fired', 'pymatching (matching graph on fired detectors)')
>>> import pymatching
>>> events = np.array([0, 1, 0, 0, 0, 0], np.uint8)
>>> bool(dec.decode_one(events)[0] == pymatching.Matching.from_detector_error_model(dem).decode(events)[0])
True
"""

from __future__ import annotations

import functools
import gc
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from qlink import wire
from qlink.errors import BrokenLinkError, ClosedError, QlinkError, QlinkTimeoutError, WouldBlock

from .timeline import (
    CONTROLLER_SHOT_FIELDS,
    SERVICE_SHOT_FIELDS,
    StageRecorder,
    record_values,
)

__all__ = [
    "available",
    "single_shot_decoder",
    "window_plan",
    "SingleShotDecoder",
    "NativeDecoderService",
    "NativeController",
    "link_round_trip_ns",
]

try:
    from . import _hotcore
except ImportError as _e:  # not built: the Python path serves, and available() says why
    _hotcore = None
    _WHY = f"qlink.qec._hotcore is not built ({_e}); run 'python setup.py build_ext --inplace' or reinstall qlink"
else:
    from transports.framing import native_layout as _stream_layout

    _hotcore.set_wire_layout(wire.native_layout())
    _hotcore.set_stream_layout(_stream_layout())
    _WHY = None

_CALL_FIRED, _CALL_PACKED = 0, 1
_ACK = {"none": 0, "errors": 1, "all": 2}
_IDLE_NS = 1_000_000  # a core comes back this often when idle: the peer is looked at
_SVC_DTYPE = np.dtype(list(SERVICE_SHOT_FIELDS))
_CTL_DTYPE = np.dtype(list(CONTROLLER_SHOT_FIELDS))


def available() -> str | None:
    """None when the native path is built here, else why not (one line)."""
    return _WHY


def _need() -> None:
    if _WHY is not None:
        raise QlinkError(_WHY)


def native_link(endpoint) -> tuple:
    """What a native core moves frames through: an shm endpoint's ``(tx_ring, rx_ring)``, or
    a tcp endpoint's ``(socket_fd, bytes_already_read)`` (``CapabilityError`` otherwise)."""
    from qlink.errors import CapabilityError

    if hasattr(endpoint, "native_rings"):
        return endpoint.native_rings()
    if hasattr(endpoint, "native_socket"):
        return endpoint.native_socket()
    if hasattr(endpoint, "native_datagrams"):
        return endpoint.native_datagrams()
    if hasattr(endpoint, "native_ucx"):
        return endpoint.native_ucx()
    raise CapabilityError(f"the native QEC path runs over shm://, tcp://, udp:// and ucx://; {type(endpoint).__name__} "
                          "offers none of them (use the Python path: engine='python')")


def _check_peer(endpoint) -> None:
    """BrokenLinkError when the endpoint's peer is gone (a datagram endpoint cannot tell: its
    native core sees the peer's closed port, ECONNREFUSED, itself)."""
    check = getattr(endpoint, "check_peer", None)
    if check is not None:
        check()


@dataclass(frozen=True)
class SingleShotDecoder:
    """A decoder prepared for one shot per call, as the native service calls it.

    ``kind`` ``"fired"``: ``fn(indices)`` takes the fired detectors' indices (uint64) and
    returns the observable flips, one byte each (or a tuple whose first item is that);
    ``"packed"``: ``fn(bit_packed_detection_event_data=row)`` on a (1, ceil(D/8)) uint8 row.
    """

    fn: Any
    kind: str
    num_detectors: int
    num_observables: int
    label: str
    batch_fn: Any = None  # rows (k, ceil(D/8)) uint8 -> (k, ceil(O/8)) packed flips: a backlog in one call
    plan: Any = None  # sliding windows: the service core's window plan (window_plan), decoded as rounds land
    # measurement-level shots: (table, detectors) from MeasurementDecoder.byte_table; the shot's
    # ``num_detectors`` bits are measurements, mapped to ``detectors`` before ``fn`` is called
    measurement_map: Any = None

    def decode_one(self, detectors: np.ndarray) -> np.ndarray:
        """The observable flips (uint8, one per observable) of one shot's detection events."""
        det = np.asarray(detectors, dtype=np.uint8).reshape(-1)
        if self.measurement_map is not None:
            table, n = self.measurement_map
            acc = np.zeros(table.shape[1], np.uint64)
            for j, v in enumerate(np.packbits(det, bitorder="little").tolist()):
                if v:
                    acc ^= table[256 * j + v]
            det = np.unpackbits(acc.view(np.uint8), count=n, bitorder="little")
        if self.kind == "fired":
            out = self.fn(np.flatnonzero(det).astype(np.uint64))
            out = out[0] if isinstance(out, tuple) else out
            return np.asarray(out, dtype=np.uint8)[: self.num_observables]
        row = np.packbits(det, bitorder="little").reshape(1, -1)
        packed = np.asarray(self.fn(bit_packed_detection_event_data=row), dtype=np.uint8).reshape(-1)
        return np.unpackbits(packed, count=self.num_observables, bitorder="little")


def single_shot_decoder(decoder: Any, dem: Any, *, num_detectors: int | None = None,
                        num_observables: int | None = None) -> SingleShotDecoder:
    """Prepare ``decoder`` (a name, decoder object or compiled decoder) for one shot per call.

    PyMatching decodes through its matching graph's own call on the fired detectors (what
    ``Matching.decode`` does after converting its input); every other decoder through its
    compiled ``decode_shots_bit_packed`` on one row. ``num_detectors`` / ``num_observables``
    give the shot's shape where it is not the DEM's (a compiled decoder that takes
    measurement records, say; ``dem`` may then be None).
    """
    from .decoders import SlidingWindowDecoder

    if isinstance(decoder, str) and decoder.startswith("sliding_window"):
        decoder = _window_decoder(decoder, dem)
    if isinstance(decoder, SlidingWindowDecoder):
        W, C = decoder.window_rounds, decoder.commit_rounds
        return SingleShotDecoder(_no_call, "packed", decoder.num_detectors, decoder.num_observables,
                                 f"sliding windows of {W} rounds committing {C} (matching graph on fired detectors, "
                                 "each window as its last round lands)", None, window_plan(decoder))
    nd = int(num_detectors if num_detectors is not None else dem.num_detectors)
    no = int(num_observables if num_observables is not None else dem.num_observables)
    if decoder == "pymatching" and dem is not None and nd == dem.num_detectors:
        import pymatching

        return _graph_single_shot(pymatching.Matching.from_detector_error_model(dem)._matching_graph, nd, no)
    from .decoders import MeasurementDecoder, compile_decoder

    if isinstance(decoder, MeasurementDecoder) and nd == decoder.num_detectors and decoder.byte_table() is not None:
        return _measurement_single_shot(decoder, nd, no)
    graph = _matching_graph_of(decoder)
    if graph is not None and nd == decoder.num_detectors:  # a compiled PyMatching decoder (from a config file, say)
        return _graph_single_shot(graph, nd, no)
    compiled = compile_decoder(decoder, dem)
    name = decoder if isinstance(decoder, str) else type(decoder).__name__
    fn = compiled.decode_shots_bit_packed

    def batch(rows):
        return fn(bit_packed_detection_event_data=rows)

    return SingleShotDecoder(fn, "packed", nd, no, f"{name} (decode_shots_bit_packed, one shot)", batch)


def _graph_single_shot(graph, nd: int, no: int) -> SingleShotDecoder:
    """PyMatching's matching graph called on the fired detectors; a backlog in its batch call."""
    batch = functools.partial(graph.decode_batch, bit_packed_shots=True, bit_packed_predictions=True)
    return SingleShotDecoder(graph.decode, "fired", nd, no, "pymatching (matching graph on fired detectors)", batch)


def _matching_graph_of(decoder):
    """PyMatching's matching graph behind a compiled PyMatching decoder (the one whose single
    shot goes to that graph's call on the fired detectors), else None."""
    if not hasattr(decoder, "decode_detectors_int"):
        return None
    return getattr(getattr(decoder, "matching", None), "_matching_graph", None)


def _measurement_single_shot(decoder, nd: int, no: int) -> SingleShotDecoder:
    """A measurement-level decoder with its map in the call: the native core maps a shot's
    measurements to detectors (one table row XORed per nonzero byte) and calls the inner
    decoder as it would a detector-level shot; a backlog goes to the decoder's batch call."""
    inner = decoder.inner
    dmap = decoder.byte_table()
    graph = _matching_graph_of(inner)
    if graph is not None:
        fn, kind, how = graph.decode, "fired", "matching graph on fired detectors"
    else:
        fn, kind, how = inner.decode_shots_bit_packed, "packed", "decode_shots_bit_packed, one shot"
    return SingleShotDecoder(fn, kind, nd, no, f"measurements -> {dmap[1]} detectors in C, then {how}",
                             decoder.decode_shots_bit_packed,
                             measurement_map=dmap)


def _no_call(*_a, **_k):  # (a window decoder's shots are matched window by window, never whole)
    raise QlinkError("a sliding-window decoder decodes window by window as rounds land, not whole shots")


def _window_decoder(name: str, dem):
    """``"sliding_window:W:C"`` over ``dem`` (rounds from its detectors' last coordinate)."""
    from .decoders import SlidingWindowDecoder
    from .sources import rounds_from_coordinates

    parts = name.split(":")
    try:
        W, C = int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        raise ValueError(f"a sliding-window decoder is named 'sliding_window:W:C' (window and commit rounds), "
                         f"got {name!r}") from None
    rounds = rounds_from_coordinates(dem.get_detector_coordinates(), dem.num_detectors)
    if rounds is None:
        raise ValueError(f"{name}: the DEM's detectors carry no time coordinate to slide windows over")
    return SlidingWindowDecoder(dem, detector_rounds=rounds, window_rounds=W, commit_rounds=C)


def window_plan(win, *, sample_middle: int = 16) -> tuple:
    """The service core's plan for ``win`` (a :class:`~qlink.qec.decoders.SlidingWindowDecoder`):
    the rounds' detector offsets, each window's compiled matcher (an index into the compiled
    windows: the matching graph's own call, the observables and buffer detectors each of its
    committed edges flips), in the order :meth:`~SlidingWindowDecoder.push_round` decodes
    them. A long experiment's bulk windows are all one shape (a periodic circuit): its first
    and last 16 windows are compiled and ``sample_middle`` of the others checked against
    the bulk (``ValueError`` when they differ); a short one is compiled window by window."""
    if win.num_observables > 64:
        raise ValueError(f"the native window path carries at most 64 observables, got {win.num_observables}")
    wins = list(win.windows())
    ids = np.zeros(len(wins), np.uint8)
    keys: dict = {}
    compiled: list = []

    def cid(i: int) -> int:
        t, end, cend = wins[i]
        key, cw = win.compiled_window(t, end, cend)
        if key not in keys:
            if len(compiled) == 32:
                raise ValueError("more than 32 window shapes: the native window path wants a periodic circuit")
            keys[key] = len(compiled)
            rp = win.round_ptr
            compiled.append(_compiled_window_tuple(cw, int(rp[cend] - rp[t])))
        return keys[key]

    edge = 16
    if len(wins) <= 4 * edge:
        for i in range(len(wins)):
            ids[i] = cid(i)
    else:
        for i in (*range(edge), *range(len(wins) - edge, len(wins))):
            ids[i] = cid(i)
        bulk = ids[edge - 1]
        rng = np.random.default_rng(len(wins))
        for i in rng.integers(edge, len(wins) - edge, size=sample_middle):
            if cid(int(i)) != bulk:
                raise ValueError(f"window {int(i)} differs from the bulk windows: the circuit is not periodic in time")
        ids[edge:len(wins) - edge] = bulk
    return (np.ascontiguousarray(win.round_ptr, np.int64), ids, win.window_rounds, win.commit_rounds,
            win.buffer_detectors, tuple(compiled))


def _compiled_window_tuple(cw, ncommit: int) -> tuple:
    import scipy.sparse as sp

    n = cw.num_detectors
    k = cw.commit_obs.shape[0] if cw.matching is not None else 0  # fault ids (none: nothing to commit)
    obs = sp.csr_matrix(cw.commit_obs)
    obsmask = np.zeros(k, np.uint64)
    for j in range(k):
        lo, hi = obs.indptr[j], obs.indptr[j + 1]
        for col, v in zip(obs.indices[lo:hi], obs.data[lo:hi]):
            if int(v) & 1:
                obsmask[j] ^= np.uint64(1) << np.uint64(col)
    fl = sp.csr_matrix(cw.commit_flips)
    fl.data = fl.data & 1
    fl.eliminate_zeros()
    fl.sort_indices()
    idx = np.zeros(max(1, n), np.uint64)
    views = tuple(idx[:i] for i in range(n + 1))
    fn = cw.matching._matching_graph.decode if k else None
    if fn is not None:
        fn(views[0])  # PyMatching builds its matcher at the first call: here, not when a window lands
    return (fn, views, idx, n, ncommit, k, obsmask, fl.indptr.astype(np.int64), fl.indices.astype(np.int64))


def _core_decoder_tuple(decoder_id: int, dec: SingleShotDecoder, *, frames_per_shot: int | None,
                        capacity_shots: int, keep: list) -> tuple:
    nd = dec.num_detectors
    if dec.plan is not None:  # windows: no whole-shot call, no waiting rows
        row = np.zeros((1, (nd + 7) // 8), np.uint8)
        keep.append((row, dec.plan))
        return (decoder_id, nd, dec.num_observables, dec.fn, _CALL_PACKED, int(frames_per_shot or 0),
                int(capacity_shots), None, row, None, None, None, dec.plan)
    pend = np.zeros((int(capacity_shots), (nd + 7) // 8), np.uint8)  # shots waiting while frames are queued
    keep.append(pend)
    tail = (dec.batch_fn, pend) if dec.batch_fn is not None else (None, None)
    mapped = ()  # (window plan, measurement map): only with a map
    call_nd = nd
    if dec.measurement_map is not None:
        keep.append(dec.measurement_map)
        mapped, call_nd = (None, dec.measurement_map), int(dec.measurement_map[1])
    if dec.kind == "fired":
        idx = np.zeros(max(1, call_nd), np.uint64)
        views = tuple(idx[:k] for k in range(call_nd + 1))
        keep.append((idx, views))
        return (decoder_id, nd, dec.num_observables, dec.fn, _CALL_FIRED, int(frames_per_shot or 0),
                int(capacity_shots), idx, None, views, *tail, *mapped)
    row = np.zeros((1, (call_nd + 7) // 8), np.uint8)
    keep.append(row)
    return (decoder_id, nd, dec.num_observables, dec.fn, _CALL_PACKED, int(frames_per_shot or 0),
            int(capacity_shots), None, row, None, *tail, *mapped)


# ------------------------------------------------------------------------ service

class NativeDecoderService:
    """The decoder service with its per-frame path in C, over shm, tcp or udp (the interface of
    :class:`qlink.qec.service.DecoderService`: ``serve``, ``report``).

    ``configs``: ``{decoder_id: DecoderConfig}``; ``keep_samples``: per-shot rows kept
    (the service's side of :func:`qlink.qec.timeline.join_shots`); ``max_batch_requests``: a
    service that is behind decodes its waiting shots in one call once this many wait, even with
    frames still queued (as the Python service's option of that name; a throughput run sets it
    to the offline batch size, a real-time one keeps the default: a shorter wait for the oldest).

    ``ingest_cpu``: a CPU number, and a served shm link takes its frames in on a thread of its
    own pinned there while the serving thread only calls the decoder (a pipelined run: the
    decoder never waits for frames to be parsed, nor frames for the decoder; see
    ``_hotcore_pipe.h``). Batch decoders over shm only; any other run is served
    single-threaded and ``report()["ingest_thread"]`` says why. ``None`` (the default): one
    thread, as a real-time run wants it (no hand-over between threads on a shot's path).
    """

    def __init__(self, configs: Mapping[int, Any], *, ack_enqueue: str = "errors", keep_samples: int = 0,
                 max_batch_requests: int = 256, ingest_cpu: int | None = None, **_python_path_options) -> None:
        _need()
        if ack_enqueue not in _ACK:
            raise ValueError(f"ack_enqueue must be one of {tuple(_ACK)}, got {ack_enqueue!r}")
        if not 1 <= int(max_batch_requests) <= 65536:
            raise ValueError(f"max_batch_requests must be in [1, 65536], got {max_batch_requests!r}")
        if ingest_cpu is not None and (isinstance(ingest_cpu, bool) or not isinstance(ingest_cpu, int)
                                       or not 0 <= ingest_cpu < (os.cpu_count() or 1)):
            raise ValueError(f"ingest_cpu must be None or a CPU number in [0, {os.cpu_count()}), got {ingest_cpu!r}")
        self.ingest_cpu = ingest_cpu
        self.max_batch_requests = int(max_batch_requests)
        if not configs:
            raise ValueError("NativeDecoderService needs at least one decoder config")
        self.ack_enqueue = ack_enqueue
        self._decoders = {}
        for did, cfg in configs.items():
            if not isinstance(did, int) or not 0 <= did < wire.MAX_DECODERS:
                raise ValueError(f"decoder ids must be ints in [0, {wire.MAX_DECODERS}), got {did!r}")
            self._decoders[did] = (cfg, single_shot_decoder(cfg.decoder, cfg.dem, num_detectors=cfg.num_detectors,
                                                            num_observables=cfg.num_observables))
        self._rows = np.zeros(max(0, int(keep_samples)), _SVC_DTYPE)
        self._core = None
        self._served = None
        self._live: list = []  # the cores of sessions served at once, while they last
        self._counts_before: dict = {}
        self._wall_s = self._cpu_s = 0.0
        self._busy_ns = 0
        self._extra: dict = {"peer_closed": 0, "serve_calls": 0, "oversized_frame": 0}

    def _decoder_tuples(self) -> tuple[list, list]:
        """Every decoder as a core takes it (arrays of its own: a core's waiting shots), and
        what must outlive the core (it borrows their memory)."""
        keep: list = []
        decs = [_core_decoder_tuple(did, dec, frames_per_shot=cfg.frames_per_shot,
                                    capacity_shots=cfg.capacity_shots, keep=keep)
                for did, (cfg, dec) in self._decoders.items()]
        return decs, keep

    def _make_core(self, endpoint) -> None:
        link = native_link(endpoint)
        decs, keep = self._decoder_tuples()
        if self._core is not None:
            self._fold_counts(self._core)
        self._core = _hotcore.ServiceCore(link, decs, ack=_ACK[self.ack_enqueue],
                                          rows=self._rows if len(self._rows) else None,
                                          max_batch=self.max_batch_requests,
                                          ingest_cpu=-1 if self.ingest_cpu is None else self.ingest_cpu)
        self._keep = keep

    def session_core(self, link: tuple, *, read_ahead_nbytes: int = 0, max_frame_nbytes: int = 0,
                     ration_answers_per_s: int = 0) -> tuple:
        """A core of its own for one of several sessions served at once
        (:mod:`qlink.qec._native_sessions`): ``(core, keep)`` (``keep`` must live as long as
        the core). Its decoders start reset; a full link is never waited on (its answer is
        counted as blocked); ``read_ahead_nbytes`` bounds a stream's read-ahead and
        ``max_frame_nbytes`` the longest message it takes (0: the defaults); a datagram sender
        most of whose frames are malformed gets at most ``ration_answers_per_s`` answers a second
        (0: no ration), the rest counted as ``answers_withheld``. Its counts join the service's
        report while it lives and after :meth:`end_session`."""
        decs, keep = self._decoder_tuples()
        core = _hotcore.ServiceCore(link, decs, ack=_ACK[self.ack_enqueue], answer_block_s=0.0,
                                    read_ahead_nbytes=int(read_ahead_nbytes), max_frame_nbytes=int(max_frame_nbytes),
                                    ration_answers_per_s=int(ration_answers_per_s))
        self._live.append(core)
        return core, keep

    def end_session(self, core) -> None:
        """A session's core is done: its counts stay in the service's."""
        if core in self._live:
            self._live.remove(core)
            self._fold_counts(core)

    def max_frame_nbytes(self) -> int:
        """The longest request this service's decoders can use (as
        :meth:`qlink.qec.service.DecoderService.max_frame_nbytes`): a longer one announced on
        a stream is refused from its header."""
        return wire.longest_enqueue_nbytes((dec.num_detectors, cfg.capacity_shots)
                                           for cfg, dec in self._decoders.values())

    def _fold_counts(self, core) -> None:
        for k, v in core.counts().items():
            self._counts_before[k] = self._counts_before.get(k, 0) + v

    def decoder_shape(self, decoder_id: int) -> tuple[int, int]:
        """``(syndrome bits per shot, observables)`` of a configured decoder."""
        if decoder_id not in self._decoders:
            raise KeyError(f"decoder {decoder_id} is not configured")
        dec = self._decoders[decoder_id][1]
        return dec.num_detectors, dec.num_observables

    def serve(self, endpoint, *, stop_event=None, max_requests: int | None = None, timeout_s: float | None = None,
              idle_timeout_s: float | None = None, **_ignored) -> dict:
        """Serve ``endpoint`` (an shm endpoint) until the peer leaves, ``stop_event`` is set,
        ``max_requests`` frames were handled, ``timeout_s`` passed or ``idle_timeout_s`` went
        by without a frame. A new endpoint starts with every decoder reset. Returns :meth:`report`."""
        if max_requests is not None and max_requests < 1:
            raise ValueError(f"max_requests must be >= 1 or None, got {max_requests}")
        if endpoint is not self._served:
            self._make_core(endpoint)
            self._served = endpoint
        core = self._core
        self._extra["serve_calls"] += 1
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        buf = bytearray(wire.enqueue_syndromes_nbytes(wire.MAX_SYNDROME_BITS))
        mv = memoryview(buf)
        gc.freeze()  # what exists now lives as long as the service: keep the collector off it
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        handled0 = seen = core.counts()["requests"]
        idle_since = time.monotonic()
        try:
            while True:
                left = None if max_requests is None else max_requests - (core.counts()["requests"] - handled0)
                if left is not None and left <= 0:
                    break
                code = core.run(_IDLE_NS, left or 0)
                now = time.monotonic()
                if code == 3:
                    break
                if code == 1:  # not a whole message at the ring's head: the endpoint's own path
                    try:
                        self._slow_frame(endpoint, buf, mv)
                    except (BrokenLinkError, ClosedError):  # (a ucx link's close, taken there)
                        self._extra["peer_closed"] += 1
                        break
                    idle_since = now
                    continue
                if code in (2, -3):  # the peer closed (or the ring went away)
                    self._extra["peer_closed"] += 1
                    break
                # idle for a while: look at the peer, the stop event and the clocks
                try:
                    _check_peer(endpoint)
                except (BrokenLinkError, ClosedError):
                    self._extra["peer_closed"] += 1
                    break
                handled = core.counts()["requests"]
                if handled != seen:  # frames came since the last look: idle since the core's last wait began
                    seen = handled
                    idle_since = now - _IDLE_NS / 1e9
                if stop_event is not None and stop_event.is_set():
                    break
                if deadline is not None and now >= deadline:
                    break
                if idle_timeout_s is not None and now - idle_since >= idle_timeout_s:
                    break
        finally:
            self._wall_s += time.perf_counter() - wall0
            self._cpu_s += time.thread_time() - cpu0
        return self.report()

    def _slow_frame(self, endpoint, buf: bytearray, mv: memoryview, core=None) -> None:
        """The frame at the head of ``endpoint`` that its core left to the endpoint's own code,
        handled by ``core`` (the one-at-a-time core when None)."""
        from transports import BufferTooSmallError

        core = self._core if core is None else core
        try:
            n = endpoint.recv_into_nowait(buf)
        except WouldBlock:
            return
        except BufferTooSmallError as e:  # longer than any valid frame: answered from its header, counted
            self._extra["oversized_frame"] += 1
            data = endpoint.recv(max_nbytes=e.needed_nbytes, timeout_s=1.0)
            core.handle(data)
            return
        core.handle(mv[:n])

    def report(self) -> dict:
        """Counts (faults as ``fault.<name>``), per-stage histograms, per-shot rows, CPU figures."""
        counts = dict(self._counts_before)
        for core in ([self._core] if self._core is not None else []) + self._live:
            for k, v in core.counts().items():
                counts[k] = counts.get(k, 0) + v
        counts.update({k: v for k, v in self._extra.items() if v})
        faults = {k[len("fault."):]: v for k, v in counts.items() if k.startswith("fault.") and v}
        counts = {k: v for k, v in counts.items() if not k.startswith("fault.")}
        n = self._core.rows_used if self._core is not None else 0
        rows = self._rows[:n]
        stages = StageRecorder(("decode", "queue", "respond", "shot_service", "decode_per_shot"))
        ok = rows[rows["status"] == 0]
        if len(ok):
            dec = ok["decode_end_ns"] - ok["decode_start_ns"]
            for name, v in (("decode", dec), ("decode_per_shot", dec),
                            ("queue", ok["decode_start_ns"] - ok["in_last_ns"]),
                            ("respond", ok["out_ns"] - ok["decode_end_ns"]),
                            ("shot_service", ok["out_ns"] - ok["in_last_ns"])):
                record_values(stages.histogram(name), v)
        out = {
            "engine": "native",
            "counts": counts,
            "faults": faults,
            "stages": stages.to_dict(),
            "ack_enqueue": self.ack_enqueue,
            "serve_wall_s": self._wall_s,
            "serve_cpu_s": self._cpu_s,
            "serve_busy_s": float(np.sum(ok["out_ns"] - ok["in_last_ns"])) / 1e9 if len(ok) else 0.0,
            "decoders": {str(did): {"num_detectors": dec.num_detectors, "num_observables": dec.num_observables,
                                    "capacity_shots": cfg.capacity_shots, "frames_per_shot": cfg.frames_per_shot,
                                    "single_shot_call": dec.label,
                                    "backlog_shots": self._core.backlog(did) if self._core is not None else 0}
                         for did, (cfg, dec) in self._decoders.items()},
            "first_decoder_error": self._core.first_error if self._core is not None else None,
        }
        if self._core is not None and self.ingest_cpu is not None:
            out["ingest_thread"] = self._core.pipe
        if len(self._rows):
            out["shots"] = {name: rows[name].tolist() for name in rows.dtype.names}
            out["shots_not_kept"] = self._core.rows_dropped if self._core is not None else 0
        return out


# ------------------------------------------------------------------------ controller

def _build_frames(stream, layouts, *, decoder_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every enqueue frame of the run, prebuilt (counter, request id, ptp patched at send):
    (bytes, offsets, lengths), shot-major."""
    S = stream.num_shots
    dets = stream.detectors
    parts, lens = [], []
    for lay in layouts:
        bits = dets[:, lay.first_bit:lay.first_bit + lay.num_bits]
        packed = np.packbits(bits, axis=1, bitorder="little")
        head = bytearray(wire.enqueue_syndromes_nbytes(lay.num_bits))
        wire.encode_enqueue_syndromes_into(head, request_id=0, decoder_id=decoder_id, counter=0,
                                           syndrome_mapping_id=0, syndromes=np.zeros(lay.num_bits, np.uint8))
        fixed = wire.HEADER_NBYTES + wire.ENQUEUE_SYNDROMES_FIXED_NBYTES
        block = np.empty((S, len(head)), np.uint8)
        block[:, :fixed] = np.frombuffer(bytes(head[:fixed]), np.uint8)
        block[:, fixed:] = packed
        parts.append(block)
        lens.append(len(head))
    shot_nbytes = sum(lens)
    frames = np.concatenate(parts, axis=1).reshape(-1) if len(parts) > 1 else parts[0].reshape(-1)
    frames = np.ascontiguousarray(frames)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    offs = (np.arange(S, dtype=np.int64)[:, None] * shot_nbytes + starts[None, :]).reshape(-1)
    lengths = np.tile(np.asarray(lens, np.int64), S)
    return frames, offs, lengths


class NativeController:
    """The controller emulator with its emit / answer / apply loop in C, over shm, tcp or udp.

    Plays ``stream`` (a :class:`~qlink.qec.controller.SyndromeStream`) at ``cycle_ns``:
    each frame of a shot on the tick of its last round (``rounds_per_frame`` rounds per
    frame: 1 is the hardware's way), ``get_corrections`` right after a shot's last frame,
    the answer XORed into the Pauli frame. ``lockstep``: wait for each shot's correction
    before the next shot starts (on the next tick): the feed-forward reaction with no
    backlog; otherwise shots follow back to back on the clock and answers are applied
    between ticks. :meth:`run` returns a :class:`~qlink.qec.controller.ControllerResult`.
    Over udp each get names its shot and a shot the service lacks has its frames sent
    again (see the module's notes): ``answer_faults`` counts ``repairs`` (shots whose
    frames were sent again), ``resent_frames``, ``resent_gets`` and ``stale_answers``;
    with ``get_in_last_datagram`` (the default) a shot's get rides in the datagram of its last
    frame, two whole frames back to back, so a shot costs as many datagrams as it has frames
    (qlink's services take such a datagram frame by frame; a service that takes one frame per
    datagram needs it off). A controller behind its clock (flat out; over udp whenever its
    sends cost more than a cycle) catches up with the frames and gets due back to back in one
    message -- a datagram, an shm ring record -- whole frames up to ``join_nbytes`` (an
    Ethernet MTU's UDP payload by default, a small ring's largest record at most; 0: never),
    each stamped when it was emitted, as a tcp stream carries them anyway; the result's
    ``frames_joined`` counts them. That needs a service that takes a message frame by frame
    (qlink's do); over udp it is off with ``get_in_last_datagram`` off.
    """

    def __init__(self, endpoint, stream, *, decoder_id: int = 0, cycle_ns: int = 1100, rounds_per_frame: int = 1,
                 lockstep: bool = False, feed_forward_deadline_ns: int | None = None, gap_cycles: int = 0,
                 counter_start: int = 0, request_id_start: int = 0, get_request_id_start: int = 0,
                 keep_lag_frames: int = 0, backlog_samples: int = 4096, get_in_last_datagram: bool = True,
                 join_nbytes: int = 1472) -> None:
        _need()
        from ._checks import knob

        knob("cycle_ns", cycle_ns, 1)
        knob("rounds_per_frame", rounds_per_frame, 0)  # 0: the whole shot in one frame
        knob("join_nbytes", join_nbytes, 0)
        self.endpoint = endpoint
        self.stream = stream
        self.decoder_id = int(decoder_id)
        self.cycle_ns = int(cycle_ns)
        self.lockstep = bool(lockstep or feed_forward_deadline_ns)
        self.deadline_ns = int(feed_forward_deadline_ns or 0)
        link = native_link(endpoint)
        self.layouts = stream.frames(rounds_per_frame=int(rounds_per_frame),
                                     max_frame_nbytes=endpoint.capabilities.max_message_bytes)
        frames, offs, lens = _build_frames(stream, self.layouts, decoder_id=self.decoder_id)
        S, F = stream.num_shots, len(self.layouts)
        self.frames_per_shot = F
        nbo = max(1, (stream.num_observables + 7) // 8)
        get = bytearray(wire.HEADER_NBYTES + wire.GET_CORRECTIONS_PAYLOAD_NBYTES)
        wire.encode_get_corrections_into(get, request_id=0, decoder_id=self.decoder_id,
                                         return_size=max(1, stream.num_observables), reset=True)
        self._rows = np.zeros(S, _CTL_DTYPE)
        self._corr = np.zeros((S, nbo), np.uint8)
        self._lag = np.zeros(int(keep_lag_frames), np.int64)
        every = max(1, S // max(1, backlog_samples - 1))
        self._backlog = np.zeros((S // every + 2, 2), np.int64)
        last_round = np.asarray([lay.last_round for lay in self.layouts], np.int64)
        self._keep = (frames, offs, lens, last_round, get)
        self._core = _hotcore.ControllerCore(
            link, frames, offs, lens, last_round, get, self._rows, self._corr, num_shots=S, frames_per_shot=F,
            rounds_per_shot=stream.num_rounds, obs_nbytes=nbo, cycle_ns=self.cycle_ns, gap_cycles=int(gap_cycles),
            lockstep=int(self.lockstep), deadline_ns=self.deadline_ns, counter_start=int(counter_start),
            request_id_start=int(request_id_start), get_request_id_start=int(get_request_id_start),
            lag=self._lag if len(self._lag) else None, backlog=self._backlog, backlog_every=every,
            late_ns=self.cycle_ns * max(1, int(rounds_per_frame)), get_in_last_datagram=int(bool(get_in_last_datagram)),
            join_nbytes=int(join_nbytes))

    def continue_after(self, other: "NativeController") -> None:
        """Start this run's counter and request ids where ``other`` (a run over the same
        link that has ended: a warm-up) left them. Before :meth:`run`; lets a run be built
        (its frames prebuilt) before the one it follows is played, so no idle gap lies between."""
        self._core.start_ids(other.counter, other.next_request_id, other.next_get_request_id)

    @property
    def counter(self) -> int:
        return self._core.stats()["counter"]

    @property
    def next_request_id(self) -> int:
        return self._core.stats()["request_id"]

    @property
    def next_get_request_id(self) -> int:
        return self._core.stats()["get_request_id"]

    def run(self, *, timeout_s: float = 60.0):
        """Play every shot; a dead service raises ``BrokenLinkError`` within a second."""
        deadline = time.monotonic() + timeout_s
        cpu0 = time.thread_time_ns()
        while True:
            code = self._core.run(50_000_000)
            if code == 0:
                break
            if code == -2:
                if hasattr(self.endpoint, "native_ucx"):  # a ucx control frame (a close): the endpoint takes it
                    _check_peer(self.endpoint)
                    continue
                raise QlinkError("an answer arrived that is not a whole message on the shm ring")
            _check_peer(self.endpoint)  # BrokenLinkError when the service is gone
            if code == -1:
                raise BrokenLinkError(f"{self.endpoint.url}: the decoder service closed its side mid-run")
            if time.monotonic() > deadline:
                st = self._core.stats()
                raise QlinkTimeoutError(f"the native controller ran past timeout_s={timeout_s}: "
                                        f"{st['shots_answered']} of {self.stream.num_shots} shots answered "
                                        f"(answers by status {st['statuses']}, re-asks {st['reasks']}, gets sent "
                                        f"again {st['resent_gets']}, stale answers {st['stale_answers']}, shots "
                                        f"whose frames were sent again {st['repairs']})")
        return self._result(time.thread_time_ns() - cpu0)

    def _result(self, cpu_ns: int):
        from qlink.histogram import LatencyHistogram

        from .controller import ControllerResult

        st = self._core.stats()
        rows = self._rows
        S = len(rows)
        status = rows["status"]
        ok = (status == int(wire.Status.OK)) & (rows["applied_ns"] > 0)
        truth = np.packbits(self.stream.observables, axis=1, bitorder="little")[:, : self._corr.shape[1]]
        right = np.all(self._corr == truth, axis=1)
        correct = np.where(ok, right.astype(np.int64), -1)
        rows["correct"] = correct
        reaction = np.where(ok, rows["applied_ns"] - rows["emit_last_ns"], -1)
        hists = {}
        for name, v in (("reaction", reaction[ok]), ("send", (rows["sent_last_ns"] - rows["emit_last_ns"])[ok]),
                        ("get_round_trip", (rows["response_ns"] - rows["get_sent_ns"])[ok]),
                        ("apply", (rows["applied_ns"] - rows["response_ns"])[ok]),
                        ("emit_lag", self._lag[: min(len(self._lag), st["frames_sent"])])):
            h = LatencyHistogram()
            record_values(h, np.asarray(v, np.int64))
            hists[name] = h.to_dict()
        nb = self._core.backlog_samples
        bl = self._backlog[:nb]
        names = {int(s): s.name for s in wire.Status}
        statuses = {names.get(i, str(i)): int(n) for i, n in enumerate(st["statuses"]) if n}
        pauli = int.from_bytes(st["pauli_frame"], "little")
        return ControllerResult(
            num_shots=S, num_rounds=self.stream.num_rounds, frames_per_shot=self.frames_per_shot,
            cycle_ns=self.cycle_ns, shots_ok=int(ok.sum()), logical_errors=int((ok & ~right).sum()),
            shots_dropped=int((status == int(wire.Status.SYNDROMES_DROPPED)).sum()),
            shots_failed=int((status == int(wire.Status.INTERNAL_ERROR)).sum()), late_frames=st["late_frames"],
            throttled=0, max_lag_ns=st["max_lag_ns"], deadline_misses=st["deadline_misses"],
            duration_ns=max(0, st["t_end_ns"] - st["t0_ns"]), statuses=statuses, stages=hists, correct=correct,
            reaction_ns=reaction, backlog_t_ns=bl[:, 0].copy(), backlog_rounds=bl[:, 1].copy(),
            corrections=self._corr, shot_records=rows, pauli_frame=pauli, cpu_ns=int(cpu_ns),
            answer_faults={k: st[k] for k in ("reasks", "bad_answers", "full_waits", "resent_gets", "stale_answers",
                                              "repairs", "resent_frames") if st[k]},
            frames_joined=st["frames_joined"],
        )


def link_round_trip_ns(endpoint, *, num_round_trips: int, nbytes: int = 64, echo: bool = False,
                       hold_ns: int | np.ndarray = 0, pause_ns: int = 0) -> np.ndarray:
    """The bare round trip of ``nbytes`` messages over an endpoint's native link (shm rings
    through the ring C API, or the tcp socket in its framing, written at once) — the floor
    under a frame and its answer on the path the native cores use. One side calls it with
    ``echo=True`` (it answers ``num_round_trips`` messages), the other without (it returns
    each round trip's ns).

    ``hold_ns`` (the echoing side): a busy spin that long before each answer, standing for a
    decoder call (an array: one spin per answer in turn, e.g. a decoder's own call times); ``pause_ns`` (the other side): a busy spin that long between round trips,
    standing for a shot's rounds, each round trip then timed from when it was due (as a
    reaction is from its last round's tick). With both, the round trips have the lock-step
    loop's shape and none of its software: their tail is what the host adds."""
    _need()
    link = native_link(endpoint)
    out = np.zeros(num_round_trips, np.int64)
    holds = None
    if np.ndim(hold_ns):
        holds = np.ascontiguousarray(hold_ns, np.int64)
        if holds.size == 0 or (holds < 0).any():
            raise ValueError("hold_ns: a non-empty array of spins >= 0 ns")
        hold_ns = 0
    if _hotcore.link_round_trip(link, int(num_round_trips), int(nbytes), bool(echo), out, int(hold_ns),
                                int(pause_ns), holds) != 0:
        raise BrokenLinkError(f"{endpoint.url}: the peer went away during the round trips")
    return out
