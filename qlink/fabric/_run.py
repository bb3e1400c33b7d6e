"""One run of the fabric model: uplink solved up front, decoders on the event loop, figures."""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np

from ._dist import _Uniforms
from ._events import EventLoop
from ._layout import GET_CORRECTIONS_NBYTES, corrections_response_nbytes
from ._links import Downlink, describe_link, traverse
from ._result import FabricResult

__all__ = ["DRAIN_MAX_MESSAGES", "Run"]

DRAIN_MAX_MESSAGES = 256  # messages read before decoding (the qlink service's max_batch_requests default)
_FRAME, _GET, _SHOT = 0, 1, 2


class Run:
    """One simulation of a :class:`~qlink.fabric.model.FabricConfig` (use :func:`~qlink.fabric.simulate`)."""

    def __init__(self, cfg, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed
        ss = np.random.SeedSequence(seed)
        self.rng_phase, self.rng_up, self.rng_down, self.rng_svc, self.rng_ing = (
            np.random.default_rng(s) for s in ss.spawn(5))

    # ------------------------------------------------------------- uplink, up front
    def _arrivals(self):
        cfg = self.cfg
        N, S, M = cfg.num_controllers, cfg.num_shots, cfg.num_decoders
        frames = cfg.frames
        F = len(frames)
        K = F + (1 if cfg.poll else 0)
        cyc = float(cfg.cycle_ns)
        P = cfg.ticks_per_shot
        # whole ns: with integer link numbers every time stays an exact integer in float64
        spread = {"random": P * cyc, "cycle": cyc, "aligned": 0.0}[cfg.phase]
        phase = np.floor(self.rng_phase.random(N) * spread)
        tick = np.array([f.last_round + 1 for f in frames] + ([frames[-1].last_round + 1] if cfg.poll else []),
                        dtype=np.float64)
        nb = np.array([f.nbytes for f in frames] + ([GET_CORRECTIONS_NBYTES] if cfg.poll else []), np.float64)
        # emission times, shape (N, S, K), flattened in (controller, shot, message) order
        emit = (phase[:, None, None] + (np.arange(S, dtype=np.float64)[None, :, None] * P + tick[None, None, :]) * cyc)
        emit = emit.reshape(-1)
        port = np.repeat(np.arange(N, dtype=np.int64) % M, S * K)
        arrive, lost = traverse(cfg.link, emit, np.tile(nb, N * S), port, M, shared=cfg.shared_port,
                                 rng=self.rng_up, per_shot=K if cfg.shot_correlated else 0)
        return emit.reshape(N * S, K), arrive.reshape(N * S, K), lost.reshape(N * S, K), F, K

    # ------------------------------------------------------------- run
    def run(self) -> FabricResult:
        wall0 = time.perf_counter()
        cfg = self.cfg
        N, S, M = cfg.num_controllers, cfg.num_shots, cfg.num_decoders
        emit, arrive, lost, F, K = self._arrivals()
        G = N * S
        self.F = F
        self.t_emit_last = emit[:, F - 1]
        nan = math.nan
        self.t_in = [nan] * G
        self.t_complete = [nan] * G
        self.t_dec_start = [nan] * G
        self.t_dec_end = [nan] * G
        self.t_sent = [nan] * G
        self.t_applied = [nan] * G
        self.batch_of = [0] * G
        self.got_get = [False] * G
        self.decoded = [False] * G
        self.recv = [0] * G
        self.inbox = [deque() for _ in range(M)]
        self.ready = [deque() for _ in range(M)]
        self.busy = [False] * M
        self.drained = [0] * M
        self.busy_ns = [0.0] * M
        self.n_sys = 0
        self.area = 0.0
        self.t_last = 0.0
        self.S, self.M, self.B = S, M, cfg.batch_size
        self.svc = cfg.service
        self.u_svc = _Uniforms(self.rng_svc)
        self.u_ing = _Uniforms(self.rng_ing)
        self.ingest = cfg.ingest
        self.poll = cfg.poll
        self.down = Downlink(cfg.downlink, corrections_response_nbytes(cfg.num_observables), M,
                              shared=cfg.shared_port, rng=self.rng_down)
        self.apply_ns = float(cfg.apply_ns)
        self.loop = loop = EventLoop()

        frame_lost = lost[:, :F].any(axis=1)
        dropped = int(frame_lost.sum())
        g_all = np.arange(G, dtype=np.int64)
        if self.ingest is not None:
            # every message is work for the decoder: stream them all
            keep = ~lost.reshape(-1)
            t = arrive.reshape(-1)[keep]
            g = np.repeat(g_all, K)[keep]
            kind = np.tile(np.array([_FRAME] * F + [_GET] * (K - F), np.int64), G)[keep]
        else:
            # reading is free: a shot arrives when its last frame does
            ok = ~frame_lost
            t_shot = arrive[:, :F].max(axis=1)[ok]
            parts_t, parts_g, parts_k = [t_shot], [g_all[ok]], [np.full(int(ok.sum()), _SHOT, np.int64)]
            if cfg.poll:
                okg = ~lost[:, F]
                parts_t.append(arrive[:, F][okg])
                parts_g.append(g_all[okg])
                parts_k.append(np.full(int(okg.sum()), _GET, np.int64))
            t, g, kind = (np.concatenate(x) for x in (parts_t, parts_g, parts_k))
        order = np.lexsort((g, kind, t))
        self.s_g = g[order].tolist()
        self.s_kind = kind[order].tolist()
        times = t[order].tolist()
        loop.run(arrival_ns=times, on_arrival=self._on_arrival)
        return self._result(emit, dropped, loop.processed, time.perf_counter() - wall0)

    # ------------------------------------------------------------- handlers
    def _on_arrival(self, i: int) -> None:
        g = self.s_g[i]
        d = (g // self.S) % self.M
        if self.ingest is not None:
            kind = self.s_kind[i]
            if kind == _FRAME:
                self.t_in[g] = self.loop.now_ns  # the latest frame of the shot to reach the decoder
            self.inbox[d].append((g, kind))
            if not self.busy[d]:
                self._start(d)
            return
        self._deliver(d, g, self.s_kind[i])
        if not self.busy[d]:
            self._start(d)

    def _deliver(self, d: int, g: int, kind: int) -> None:
        if kind == _SHOT:
            self.t_in[g] = self.loop.now_ns
            self._complete(d, g)
        elif kind == _FRAME:
            r = self.recv[g] + 1
            self.recv[g] = r
            if r == self.F:
                self._complete(d, g)
        else:  # get_corrections read
            self.got_get[g] = True
            if self.decoded[g]:
                self._respond(d, g)

    def _complete(self, d: int, g: int) -> None:
        now = self.loop.now_ns
        self.t_complete[g] = now
        self.ready[d].append(g)
        self.area += self.n_sys * (now - self.t_last)
        self.t_last = now
        self.n_sys += 1

    def _start(self, d: int) -> None:
        loop = self.loop
        now = loop.now_ns
        inbox, ready = self.inbox[d], self.ready[d]
        if inbox and self.drained[d] < DRAIN_MAX_MESSAGES:
            msg = inbox.popleft()
            dur = self.ingest.quantile_ns(self.u_ing.next())
            self.drained[d] += 1
            self.busy[d] = True
            self.busy_ns[d] += dur
            loop.schedule(now + dur, self._ingested, (d, msg))
            return
        if ready:
            k = min(len(ready), self.B)
            batch = [ready.popleft() for _ in range(k)]
            dur = self.svc.sample_ns(k, self.u_svc.next())
            ds, bo = self.t_dec_start, self.batch_of
            for g in batch:
                ds[g] = now
                bo[g] = k
            self.busy[d] = True
            self.busy_ns[d] += dur
            loop.schedule(now + dur, self._decoded, (d, batch))
            return
        self.drained[d] = 0
        self.busy[d] = False
        if inbox:  # the drain limit was reached with nothing complete to decode
            self._start(d)

    def _ingested(self, arg) -> None:
        d, (g, kind) = arg
        self._deliver(d, g, kind)
        if not self.inbox[d]:
            self.drained[d] = DRAIN_MAX_MESSAGES  # the transport is empty: decode what is complete
        self._start(d)

    def _decoded(self, arg) -> None:
        d, batch = arg
        now = self.loop.now_ns
        de, dec, got = self.t_dec_end, self.decoded, self.got_get
        poll = self.poll
        for g in batch:
            de[g] = now
            dec[g] = True
            if not poll or got[g]:
                self._respond(d, g)
        self.area += self.n_sys * (now - self.t_last)
        self.t_last = now
        self.n_sys -= len(batch)
        self.drained[d] = 0
        self._start(d)

    def _respond(self, d: int, g: int) -> None:
        now = self.loop.now_ns
        self.t_sent[g] = now
        t = self.down.arrival(d, now)
        if t == t:  # NaN: lost on the way back (counted with the corrections that never arrive)
            self.t_applied[g] = t + self.apply_ns

    # ------------------------------------------------------------- figures
    def _result(self, emit: np.ndarray, dropped: int, events: int, wall_s: float) -> FabricResult:
        from qlink.histogram import LatencyHistogram

        cfg = self.cfg
        S = cfg.num_shots
        t_emit_last = self.t_emit_last
        t_in = np.array(self.t_in)
        t_cmp = np.array(self.t_complete)
        t_ds = np.array(self.t_dec_start)
        t_de = np.array(self.t_dec_end)
        t_sent = np.array(self.t_sent)
        t_app = np.array(self.t_applied)
        shot_idx = np.arange(t_app.size) % S
        answered = np.isfinite(t_app)
        # decoded, yet no correction reached the controller (the answer or the poll for it was lost)
        corrections_lost = int((np.isfinite(t_de) & ~answered).sum())
        use = answered & (shot_idx >= cfg.warmup_shots)
        reaction = (t_app - t_emit_last)[use]
        stages = {
            "wire_in": (t_in - t_emit_last)[use],
            "queue": (t_ds - t_in)[use],
            "decode": (t_de - t_ds)[use],
            "respond": (t_sent - t_de)[use],
            "wire_out": (t_app - t_sent)[use],
        }
        nan = math.nan
        if reaction.size:
            h = LatencyHistogram()
            h.record_many(reaction)
            p50, p99, p999 = (float(v) for v in h.percentiles([50, 99, 99.9]))
            mean, mx = float(reaction.mean()), float(reaction.max())
            stage_p50 = {k: float(np.percentile(v, 50)) for k, v in stages.items()}
        else:
            p50 = p99 = p999 = mean = mx = nan
            stage_p50 = {k: nan for k in stages}

        # queue and backlog over the emission window
        t_end = float(emit.max())
        grid = np.linspace(0.0, t_end, cfg.backlog_samples)
        cmp_sorted = np.sort(t_cmp[np.isfinite(t_cmp)])
        de_sorted = np.sort(t_de[np.isfinite(t_de)])
        queue = (np.searchsorted(cmp_sorted, grid, side="right")
                 - np.searchsorted(de_sorted, grid, side="right")).astype(np.int64)
        frames = cfg.frames
        rounds_in = np.array([f.num_rounds for f in frames], np.int64)
        e = emit[:, :len(frames)]
        order = np.argsort(e, axis=None, kind="stable")
        e_sorted = e.reshape(-1)[order]
        r_cum = np.concatenate([[0], np.cumsum(np.tile(rounds_in, e.shape[0])[order])])
        emitted = r_cum[np.searchsorted(e_sorted, grid, side="right")]
        app_sorted = np.sort(t_app[answered])
        resolved = np.searchsorted(app_sorted, grid, side="right") * cfg.ticks_per_shot
        backlog = (emitted - resolved).astype(np.int64)
        q_slope = _slope(grid, queue)
        b_slope = _slope(grid, backlog)
        offered = cfg.offered_shots_per_s
        # Keeping up: no decoder is offered more work than its cheapest batching can do, and over
        # the second half of the emission window the decoders' queue grows by less than 2 % of
        # the shots offered meanwhile or by less than two batches per decoder (the swing that
        # batching itself gives the queue).
        batches = np.array(self.batch_of)
        mean_batch = float(batches[batches > 0].mean()) if (batches > 0).any() else math.nan
        half_s = (grid[-1] - grid[len(grid) // 2]) / 1e9
        swing = 2.0 * cfg.num_decoders * (mean_batch if mean_batch > 1 else 1.0)
        bound = cfg.utilization_bound()
        stable = bool(bound < 1.0 and q_slope * half_s <= max(0.02 * offered * half_s, swing))

        # Little's law over the decoders' queue (complete -> decoded), whole run
        done = np.isfinite(t_de)
        soj = (t_de - t_cmp)[done]
        if soj.size:
            t0, t1 = float(np.nanmin(t_cmp)), float(np.nanmax(t_de))
            span = max(t1 - t0, 1e-9)
            L = self.area / span
            lam = soj.size / span
            W = float(soj.mean())
            rel = abs(L - lam * W) / max(L, 1e-300)
            busiest = max(self.busy_ns) / span
        else:
            L = lam = W = rel = busiest = nan
        little = {"L_shots": L, "lambda_shots_per_ns": lam, "W_ns": W, "rel_err": rel}
        inputs = {"service": cfg.service.describe(), "link": describe_link(cfg.link),
                  "downlink": describe_link(cfg.downlink),
                  "ingest": None if cfg.ingest is None else cfg.ingest.describe()}
        return FabricResult(
            config=cfg, seed=self.seed, basis="modeled", inputs=inputs, shots_answered=int(answered.sum()),
            shots_dropped=dropped, corrections_lost=corrections_lost, reaction_p50_ns=p50, reaction_p99_ns=p99,
            reaction_p999_ns=p999, reaction_mean_ns=mean, reaction_max_ns=mx, stage_p50_ns=stage_p50,
            offered_shots_per_s=offered, utilization_bound=bound, utilization_busiest=busiest,
            mean_batch=mean_batch,
            queue_max_shots=int(queue.max()), queue_slope_shots_per_s=q_slope, backlog_slope_rounds_per_s=b_slope,
            stable=stable, little=little, events=int(events), wall_s=wall_s, backlog_t_ns=grid,
            queue_shots=queue, backlog_rounds=backlog, reaction_ns=reaction, stages_ns=stages,
        )


def _slope(t_ns: np.ndarray, v: np.ndarray) -> float:
    """Least-squares growth per second over the second half of the window."""
    half = len(t_ns) // 2
    t = t_ns[half:] / 1e9
    y = v[half:].astype(np.float64)
    if len(t) < 2 or np.ptp(t) <= 0:
        return 0.0
    return float(np.polyfit(t, y, 1)[0])


