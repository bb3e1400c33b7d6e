"""Sliding-window matching for long memory experiments, fed round by round.

Method (the standard forward sliding window, over the full DEM sliced by round):

- Every graphlike error component (an edge of the matching graph) belongs to
  the round of its *earliest* detector. Detector indices must be ordered by
  round (true for stim's generated circuits and for :mod:`qlink.qec.sources`).
- Window ``[t, t + W)`` contains the detectors of those rounds and every edge
  whose earliest round lies in the window. An edge that also touches a detector
  in a round ``>= t + W`` becomes a boundary edge inside the window (the
  artificial future boundary); the detector it would flip is remembered.
- The window is matched (PyMatching). Matched edges whose earliest round is in
  the commit region ``[t, t + C)`` are *committed*: their observable flips are
  emitted, and every detector they flip (including ones beyond the window) is
  XORed into the pending syndrome, so the next window, starting at ``t + C``,
  sees the syndrome with the committed corrections applied. Edges of the rest
  of the window are forgotten and re-decided by the next window.
- Edges with earliest round ``< t`` were all decided by earlier windows (the
  commit regions tile time), so they never appear again. The last window
  ``[t, num_rounds)`` commits everything.

Per-round cost does not grow with the experiment: a window holds at most ``W``
rounds of detectors and the edges starting there. Compiled windows are cached
by their shape *relative to the window start* (detector offsets, observables,
probabilities), so all bulk windows of a time-periodic circuit share one
compiled matcher (``statistics().num_compiled_windows`` stays at about 4 however
long the experiment is). The DEM is held as stim folds it (a loop body once,
:class:`~qlink.qec.decoders._dem_graph.DemEdgeIndex`) and each window's edges are
expanded on demand, so memory does not grow with the number of rounds either
(apart from the ``detector_rounds`` array).

>>> import numpy as np, stim
>>> circuit = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=20,
...                                  before_round_data_depolarization=0.02)
>>> dem = circuit.detector_error_model(decompose_errors=True)
>>> rounds = np.array([int(c[-1]) for c in dem.get_detector_coordinates().values()])
>>> win = SlidingWindowDecoder(dem, detector_rounds=rounds, window_rounds=6, commit_rounds=3)
>>> dets = circuit.compile_detector_sampler(seed=1).sample(4)
>>> bool((win.decode_batch(dets) == win.whole_history_decoder().decode_batch(dets)).all())
True
>>> st = win.statistics()  # 6 windows; all but the last share one compiled matcher
>>> st.num_windows_decoded, st.num_compiled_windows
(6, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from ._dem_graph import DemEdgeIndex

__all__ = ["SlidingWindowDecoder", "WindowStatistics"]


@dataclass(frozen=True)
class WindowStatistics:
    num_windows_decoded: int
    num_compiled_windows: int
    max_window_detectors: int
    max_window_edges: int
    rounds_pushed: int
    num_rounds: int


@dataclass(frozen=True)
class _CompiledWindow:
    matching: object  # pymatching.Matching; fault ids: the observables, then the detectors past the commit
    num_detectors: int  # region that committed edges flip (the XOR over the committed edges it matched)
    num_edges: int
    commit_obs: sp.csr_matrix  # (fault ids, num_observables)
    commit_flips: sp.csr_matrix  # (fault ids, buffer capacity): detectors flipped, relative to window start


class SlidingWindowDecoder:
    """Streaming matching decoder: ``push_round`` rounds in, committed observable flips out.

    ``detector_rounds[i]`` is the round of detector ``i`` (non-decreasing in ``i``).
    ``window_rounds`` (W) rounds are matched at a time; the first ``commit_rounds``
    (C, ``1 <= C <= W``) of them are committed, then the window slides by C.
    """

    def __init__(self, dem, *, detector_rounds, window_rounds: int, commit_rounds: int):
        rounds = np.asarray(detector_rounds, dtype=np.int64)
        if rounds.shape != (dem.num_detectors,):
            raise ValueError(f"detector_rounds must have one entry per detector "
                             f"({dem.num_detectors}), got shape {rounds.shape}")
        if len(rounds) and (rounds[0] < 0 or np.any(np.diff(rounds) < 0)):
            raise ValueError("detector_rounds must be non-negative and non-decreasing in detector index")
        if not 1 <= commit_rounds <= window_rounds:
            raise ValueError(f"need 1 <= commit_rounds <= window_rounds, got C={commit_rounds}, W={window_rounds}")
        self.window_rounds, self.commit_rounds = int(window_rounds), int(commit_rounds)
        self.num_detectors, self.num_observables = dem.num_detectors, dem.num_observables
        self.num_rounds = int(rounds[-1]) + 1 if len(rounds) else 0
        self._dem = dem
        self._round_ptr = np.searchsorted(rounds, np.arange(self.num_rounds + 1)).astype(np.int64)
        self._edges = DemEdgeIndex(dem)
        span = self._edges.max_span + 1
        starts = np.arange(max(self.num_rounds, 1))
        ends = np.minimum(starts + self.window_rounds, self.num_rounds)
        self._capacity = int(np.max(self._round_ptr[ends] - self._round_ptr[starts], initial=0)) + span
        self._cache: dict[bytes, _CompiledWindow] = {}
        self._max_dets = self._max_edges = self._windows = 0
        self.reset()

    # -- streaming ---------------------------------------------------------
    def reset(self, *, num_shots: int | None = None) -> None:
        """Start a new experiment (``num_shots`` parallel shots; set by the first push if None)."""
        self._t = 0  # first round of the current window
        self._pushed = 0
        self._num_shots = num_shots
        self._buf = None if num_shots is None else np.zeros((num_shots, self._capacity), dtype=np.uint8)

    @property
    def done(self) -> bool:
        """True once every round was pushed and every window committed."""
        return self._t >= self.num_rounds

    def detectors_in_round(self, round_index: int) -> int:
        return int(self._round_ptr[round_index + 1] - self._round_ptr[round_index])

    def push_round(self, detection_events) -> np.ndarray:
        """Feed the next round: ``(num_shots, detectors_in_round)`` (or 1-D for one shot).

        Returns the observable flips committed by this call, ``(num_shots, num_observables)``
        uint8 (1-D for 1-D input); XOR all returns together for the shot's prediction.
        """
        ev = np.asarray(detection_events)
        single = ev.ndim == 1
        ev = ev.reshape(1, -1) if single else ev
        r = self._pushed
        if r >= self.num_rounds:
            raise ValueError(f"all {self.num_rounds} rounds were already pushed; call reset() first")
        want = self.detectors_in_round(r)
        if ev.ndim != 2 or ev.shape[1] != want:
            raise ValueError(f"round {r} has {want} detectors: expected shape (num_shots, {want}), got {ev.shape}")
        if self._buf is None:
            self.reset(num_shots=ev.shape[0])
        elif ev.shape[0] != self._num_shots:
            raise ValueError(f"this stream has {self._num_shots} shots, got a round with {ev.shape[0]}")
        base = self._round_ptr[self._t]
        lo = self._round_ptr[r] - base
        self._buf[:, lo:lo + want] ^= ev.astype(np.uint8, copy=False)
        self._pushed += 1
        out = np.zeros((self._num_shots, self.num_observables), dtype=np.uint8)
        while self._t < self.num_rounds:
            end = self._t + self.window_rounds
            if end >= self.num_rounds:
                if self._pushed == self.num_rounds:
                    out ^= self._decode_window(self._t, self.num_rounds, self.num_rounds)
                    self._t = self.num_rounds
                break
            if self._pushed < end:
                break
            out ^= self._decode_window(self._t, end, self._t + self.commit_rounds)
            self._t += self.commit_rounds
        return out[0] if single else out

    def decode_batch(self, detection_events) -> np.ndarray:
        """Stream whole shots ``(num_shots, num_detectors)`` round by round; returns total flips."""
        dets = np.asarray(detection_events)
        if dets.ndim != 2 or dets.shape[1] != self.num_detectors:
            raise ValueError(f"expected shape (num_shots, {self.num_detectors}), got {dets.shape}")
        self.reset(num_shots=dets.shape[0])
        total = np.zeros((dets.shape[0], self.num_observables), dtype=np.uint8)
        for r in range(self.num_rounds):
            total ^= self.push_round(dets[:, self._round_ptr[r]:self._round_ptr[r + 1]])
        return total

    def whole_history_decoder(self):
        """The reference: PyMatching over the whole DEM at once."""
        from ._matching import CompiledMatchingDecoder

        return CompiledMatchingDecoder(self._dem)

    def statistics(self) -> WindowStatistics:
        return WindowStatistics(self._windows, len(self._cache), self._max_dets, self._max_edges,
                                self._pushed, self.num_rounds)

    # -- one window ----------------------------------------------------------
    def windows(self):
        """The windows of one experiment in order: ``(t, end, commit_end)`` round ranges
        (matched ``[t, end)``, committed ``[t, commit_end)``), as :meth:`push_round` decodes them."""
        t, W, C, R = 0, self.window_rounds, self.commit_rounds, self.num_rounds
        while t < R:
            if t + W >= R:
                yield t, R, R
                return
            yield t, t + W, t + C
            t += C

    def compiled_window(self, t: int, end: int, commit_end: int) -> tuple[bytes, "_CompiledWindow"]:
        """``(key, compiled window)`` of the window ``[t, end)`` committing ``[t, commit_end)``:
        windows of the same shape relative to their start share one key and one compiled
        matcher (its fault ids: the committed edges; ``commit_obs`` / ``commit_flips``: the
        observables and detectors, relative to ``t``, each committed edge flips)."""
        base = int(self._round_ptr[t])
        n = int(self._round_ptr[end]) - base
        ncommit = int(self._round_ptr[commit_end]) - base
        a, b, obs, p = self._edges.edges_in_range(base, base + n)
        a, b, p = a - base, np.where(b < 0, -1, b - base), np.clip(p, 1e-15, 0.5)
        # Probabilities enter the key on a 1e-6 grid in log(p): merges of parallel errors
        # leave last-bit noise that must not split identical bulk windows.
        logp = np.round(np.log(p) * 1e6).astype(np.int64)
        key = b"".join(x.tobytes() for x in (np.array([n, ncommit]), a, b, obs, logp))
        win = self._cache.get(key)
        if win is None:
            win = self._cache[key] = self._compile(n, ncommit, a, b, obs, p)
        return key, win

    @property
    def buffer_detectors(self) -> int:
        """Detectors the streaming buffer holds (a window's and the committed edges' reach)."""
        return self._capacity

    @property
    def round_ptr(self) -> np.ndarray:
        """``round_ptr[r]``: the first detector of round ``r`` (``round_ptr[num_rounds]``: all)."""
        return self._round_ptr

    def _decode_window(self, t: int, end: int, commit_end: int) -> np.ndarray:
        base = int(self._round_ptr[t])
        n = int(self._round_ptr[end]) - base
        ncommit = int(self._round_ptr[commit_end]) - base
        _, win = self.compiled_window(t, end, commit_end)
        self._windows += 1
        self._max_dets = max(self._max_dets, n)
        self._max_edges = max(self._max_edges, win.num_edges)
        out = np.zeros((self._num_shots, self.num_observables), dtype=np.uint8)
        shift = ncommit
        if win.matching is not None:
            matched = win.matching.decode_batch(self._buf[:, :n])  # (S, k) committed edges used
            m_t = matched.T.astype(np.int32)
            out = (np.asarray(win.commit_obs.T @ m_t).T & 1).astype(np.uint8)
            self._buf ^= (np.asarray(win.commit_flips.T @ m_t).T & 1).astype(np.uint8)
        if shift:
            self._buf[:, :-shift] = self._buf[:, shift:].copy()
            self._buf[:, -shift:] = 0
        return out

    def _compile(self, n, ncommit, a, b, obs, p) -> _CompiledWindow:
        import pymatching

        b_proj = np.where((b < 0) | (b >= n), -1, b)
        group_key = a * (n + 1) + (b_proj + 1)
        uniq, inv = np.unique(group_key, return_inverse=True)
        m = len(uniq)
        # Merged probability of each projected edge: P(odd number fire) = (1 - prod(1 - 2p)) / 2.
        log_terms = np.bincount(inv, weights=np.log1p(-2 * np.minimum(p, 0.5 - 1e-15)), minlength=m)
        p_edge = np.clip((1 - np.exp(log_terms)) / 2, 1e-15, 0.5 - 1e-15)
        # Label of a projected edge: its most likely member.
        best = np.lexsort((p, inv))
        rep = best[np.r_[np.flatnonzero(np.diff(inv[best])), len(best) - 1]] if len(best) else best
        ra, rb, rproj, robs = a[rep], b[rep], b_proj[rep], obs[rep]
        rows = np.concatenate([ra, rproj[rproj >= 0]])
        cols = np.concatenate([np.arange(m), np.flatnonzero(rproj >= 0)])
        h = sp.csc_matrix((np.ones(len(rows), dtype=np.uint8), (rows, cols)), shape=(n, m))
        committed = np.flatnonzero(ra < ncommit)
        k = len(committed)
        # What a window must give back is linear (mod 2) in the committed edges it matched:
        # the observables they flip, and the detectors at or past the commit boundary they
        # flip (those before it slide out of the buffer). So the matcher's fault ids are
        # those few bits -- the observables, then each such detector -- not one per edge:
        # PyMatching's fast path (<= 64 fault ids) instead of a path search per match.
        O = self.num_observables
        obs_bits = ((robs[committed, None] >> np.arange(O, dtype=np.uint64)) & np.uint64(1)).astype(bool)
        far = rb[committed] >= ncommit  # committed edges reaching past the commit region
        targets, tid = np.unique(rb[committed][far], return_inverse=True)
        f_rows = np.concatenate([np.nonzero(obs_bits)[1], O + tid])
        f_cols = np.concatenate([committed[np.nonzero(obs_bits)[0]], committed[far]])
        nf = O + len(targets)
        faults = sp.csc_matrix((np.ones(len(f_rows), dtype=np.uint8), (f_rows, f_cols)), shape=(nf, m))
        matching = None if k == 0 else pymatching.Matching.from_check_matrix(
            h, weights=np.log((1 - p_edge) / p_edge), faults_matrix=faults, use_virtual_boundary_node=True)
        commit_obs = sp.csr_matrix((np.ones(O, dtype=np.int32), (np.arange(O), np.arange(O))), shape=(nf, O))
        flips = sp.csr_matrix((np.ones(len(targets), dtype=np.int32), (O + np.arange(len(targets)), targets)),
                              shape=(nf, self._capacity))
        return _CompiledWindow(matching, n, m, commit_obs, flips)
