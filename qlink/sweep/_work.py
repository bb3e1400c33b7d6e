"""What a worker runs: one chunk of one task, from plain data to plain counts.

:func:`run_chunk` is the function a Dask worker is handed. It returns a dict with
sinter's counters (``shots``, ``errors``, ``discards``, ``seconds``) and ``custom_counts``
(integers only, so rows of one task add up). Compiled decoders and sources are cached
per worker process, so a worker pays for a DEM and a decoder once per grid point.

>>> from qlink.sweep._grid import QecGrid
>>> task = QecGrid(distances=(3,), ps=(0.01,), chunk_shots=200).tasks()[0]
>>> a = run_chunk(task.work, shots=200, seed=task.seed(0))
>>> b = run_chunk(task.work, shots=200, seed=task.seed(0))
>>> (a["shots"], a["errors"]) == (b["shots"], b["errors"]) and 0 < a["errors"] < 200
True
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import time

import numpy as np

__all__ = ["run_chunk"]


def run_chunk(work: dict, *, shots: int, seed: int) -> dict:
    """Run ``shots`` shots of the task described by ``work`` with ``seed``; return its counts."""
    if isinstance(shots, bool) or not isinstance(shots, int) or shots < 1:
        raise ValueError(f"shots must be an int >= 1, got {shots!r}")
    kind = work.get("kind") if isinstance(work, dict) else None
    if kind == "qec":
        if work["transport"] == "offline":
            return _qec_offline(work, shots, seed)
        return _qec_wire(work, shots, seed)
    if kind == "kv":
        return _kv(work, shots, seed)
    raise ValueError(f"unknown work kind {kind!r}; expected 'qec' or 'kv'")


@functools.lru_cache(maxsize=32)
def _compiled(spec_json: str, decoder: str):
    from qlink.qec.decoders import compile_decoder
    from qlink.qec.loop import build_source

    src = build_source(json.loads(spec_json))
    return src, compile_decoder(decoder, src.dem)


def _qec_offline(work: dict, shots: int, seed: int) -> dict:
    src, compiled = _compiled(json.dumps(work["source"], sort_keys=True), work["decoder"])
    t0 = time.perf_counter()
    dets, obs = src.source.sample_bit_packed(shots, seed=seed)
    pred = np.asarray(compiled.decode_shots_bit_packed(dets), dtype=np.uint8)
    errors = int(np.any(pred != obs, axis=1).sum())
    return {"shots": shots, "errors": errors, "discards": 0, "seconds": time.perf_counter() - t0,
            "custom_counts": {}}


def _needs_children(what: str) -> None:
    if multiprocessing.current_process().daemon:
        from qlink.errors import CapabilityError

        raise CapabilityError(
            f"{what} starts a second process, but this Dask worker is a daemonic process, which may not "
            "have children; start the workers with DASK_DISTRIBUTED__WORKER__DAEMON=False "
            "(run_sweep does this for the LocalCluster it starts)")


def _qec_wire(work: dict, shots: int, seed: int) -> dict:
    from qlink.qec.loop import run_loop, sample_stream

    transport = work["transport"]
    if transport != "inproc":
        _needs_children(f"the {transport} wire path")
    src, compiled = _compiled(json.dumps(work["source"], sort_keys=True), work["decoder"])
    stream = sample_stream(src, num_shots=shots, seed=seed)
    t0 = time.perf_counter()
    res = run_loop(transport=transport, source=work["source"], stream=stream, num_shots=shots,
                   decoder=work["decoder"], rounds_per_frame=int(work.get("rounds_per_frame", 1)),
                   cycle_ns=int(work.get("cycle_ns", 1)), max_in_flight_shots=int(work.get("max_in_flight_shots", 512)),
                   warmup_shots=0, keep_samples=0, timeout_s=max(120.0, shots * 0.01))
    seconds = time.perf_counter() - t0
    custom = {"failed": int(res.controller.shots_failed)}
    # The same shots decoded by calling the decoder directly: any answer that differs is
    # counted (a correct wire path never differs).
    corr = res.controller.corrections
    if corr is not None:
        packed = np.packbits(stream.detectors, axis=1, bitorder="little")
        pred = np.asarray(compiled.decode_shots_bit_packed(packed), dtype=np.uint8)
        answered = res.controller.correct >= 0
        custom["offline_mismatches"] = int(np.any(np.asarray(corr)[answered] != pred[answered], axis=1).sum())
    return {"shots": shots, "errors": int(res.logical_errors), "discards": int(res.shots_dropped),
            "seconds": seconds, "custom_counts": {k: v for k, v in custom.items() if v},
            "transport_used": res.transport}


def _kv(work: dict, transfers: int, seed: int) -> dict:
    from qlink.ai import preset as make_spec
    from qlink.ai.peer import open_link, transport_unavailable

    transport = work["transport"]
    backend = "nixl" if transport == "nixl" else "transport"
    scheme = "shm" if backend == "nixl" else transport
    why = transport_unavailable(scheme)
    if why:
        from qlink.errors import CapabilityError

        raise CapabilityError(f"KV transfers over {transport} cannot run on this worker: {why}")
    if scheme != "inproc":
        _needs_children(f"a KV transfer over {transport}")
    base = make_spec(work["preset"])
    n_tok = int(work["tokens"])
    spec = base.with_blocks(base.blocks_for(num_tokens=n_tok))
    nblocks = spec.blocks_for(num_tokens=n_tok)
    rng = np.random.default_rng(seed)
    budget_us = float(work["budget_ms"]) * 1e3
    times_us = []
    t0 = time.perf_counter()
    with open_link(scheme, spec, seed=int(seed % (1 << 31)), backend=backend, fill="touch") as (rx, cache, peer):
        for a in cache.layers:  # fault the receiver's pages in before any timing
            a.view(np.uint8).fill(0)
        for rid in range(transfers + 1):  # the first is a warm-up
            if work["pattern"] == "scattered":
                src_ids, dst_ids = rng.permutation(spec.num_blocks)[:nblocks], rng.permutation(spec.num_blocks)[:nblocks]
            else:
                src_ids = dst_ids = np.arange(nblocks)
            _, rec = peer.transfer(rx, rid + 1, src_ids, dst_ids, timeout_s=600)
            if rid:
                times_us.append(float(rec.submit_to_last_us))
    seconds = time.perf_counter() - t0
    t = np.asarray(times_us)
    custom = {"transfer_us": int(round(t.sum())), "kv_bytes": int(rec.nbytes) * transfers}
    # log2 histogram of transfer times (µs); bucket k holds [2^k, 2^(k+1)) µs. Counts add up across rows.
    for k, n in zip(*np.unique(np.floor(np.log2(np.maximum(t, 1.0))).astype(int), return_counts=True)):
        custom[f"us_log2_{k:02d}"] = int(n)
    return {"shots": transfers, "errors": int((t > budget_us).sum()), "discards": 0, "seconds": seconds,
            "custom_counts": custom, "transport_used": rec.transport}


def warm_worker() -> str:
    """Import what chunks use (run once per worker before timing)."""
    import pymatching  # noqa: F401
    import stim  # noqa: F401

    from qlink.qec import decoders, loop  # noqa: F401

    return "warm"

