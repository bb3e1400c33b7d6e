"""``qlink bench gpu``: the GPU-direct paths, each beside its floor in the same run.

* **bandwidth** — ``cuda_ipc://`` put of device memory into a device region of another
  process (CUDA IPC, ``cudaMemcpyAsync`` device to device, synchronised before the
  completion is sent), timed per put at the initiator, beside a plain CuPy copy of the same
  bytes on the same GPU (``x_copy`` = put GB/s / copy GB/s). The target checks the bytes
  (CRC-32) after the last put of each size.
* **kv** — KV caches in device memory (Llama-3-8B layout by default) moved by the KV engine
  (:class:`~qlink.ai.KVSender` in a spawned process, :class:`~qlink.ai.KVReceiver` here)
  over ``cuda_ipc://``, one deferred ``put_many`` per layer (copies queued, each layer's
  notification published once CUDA has done it); time from submit to the last layer
  ready, beside a CuPy copy of the same bytes layer by layer; ``submit_us`` is the sender's
  own time for the request (its last layer waits for every copy); blocks checked bit for bit.
* **qec** — reaction time of a QEC loop whose syndromes land in device memory: a
  controller process puts each shot (host bytes) into the decoder's device region
  (host to device through the IPC mapping); the decoder waits for the notification and
  decodes the region where it lies with the CuPy BP decoder (``qlink-bp``,
  :meth:`~qlink.qec.decoders._bp.CompiledBeliefPropagationDecoder.decode_device`: no host
  round trip of the syndromes), then sends the correction back. Beside it: the same
  decoder fed from a host region (``decode_batch`` copies the shot to the GPU), and
  ``nv-qldpc-decoder`` where ``cudaq_qec`` offers it (its Python API takes host syndromes,
  so that row copies each shot off the GPU first). Predictions are compared with the
  decoder's own offline ``decode_batch`` of the same shots (``bit_identical``).

Every row names the device it ran on. Without a usable GPU the bench writes one row,
``basis="skipped"`` with ``note="skipped: no GPU (...)"`` and exits 0. The same code runs
with ``device="cpu"`` on NumPy (host regions over the shm path of ``cuda_ipc``, NumPy BP):
the tests check the harness that way on machines without a GPU; those are CPU figures and
their rows say so.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import struct
import time
import zlib
from typing import Callable, Iterable

import numpy as np

from ._gpu_procs import CHECK, REPLY, SHOTS, array_module, bandwidth_target, host_copy, qec_controller, synchronize
from ._stats import ratio, summarize_ns

__all__ = ["gpu_unavailable", "run_gpu_bench", "measure_bandwidth", "measure_kv", "measure_qec", "main_from_cli",
           "COLUMNS"]

COLUMNS = ["section", "case", "basis", "device", "nbytes", "tokens", "distance", "GBps", "x_copy", "p50_us",
           "p99_us", "p999_us", "submit_us", "bit_exact", "bit_identical", "logical_errors", "note"]
_names = itertools.count()


def gpu_unavailable() -> str | None:
    """None when CuPy can run on an NVIDIA GPU here, else why not."""
    from transports.cuda import cuda_unavailable

    return cuda_unavailable()


def _device_label(device: str) -> str:
    if device == "cpu":
        return "cpu (NumPy, host regions: a harness check, not a GPU figure)"
    from transports.cuda import device_name, require

    cp = require("qlink bench gpu")
    return device_name(cp, cp.cuda.runtime.getDevice())


@contextlib.contextmanager
def _peer(child, *args):
    """Listen on a fresh ``cuda_ipc://`` name, run ``child(url, *args)`` in a spawned process,
    yield the accepted endpoint; say bye and reap the child at the end."""
    import multiprocessing as mp

    import transports
    from qlink.errors import QlinkError

    url = f"cuda_ipc://gpu-bench-{os.getpid()}-{next(_names)}"
    with transports.listen(url) as lis:
        proc = mp.get_context("spawn").Process(target=child, args=(url, *args), daemon=True)
        proc.start()
        try:
            ep = lis.accept(timeout_s=120)
            try:
                yield ep
                ep.send(b"bye", timeout_s=5)
                proc.join(30)
            finally:
                ep.close()
        except QlinkError:
            if proc.exitcode not in (None, 0):
                raise RuntimeError(f"the bench's peer process failed (exit code {proc.exitcode})") from None
            raise
        finally:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _pattern(xp, nbytes: int):
    """``nbytes`` of reproducible random bytes in ``xp`` memory (a random MiB, tiled)."""
    block = np.random.default_rng(1).integers(0, 256, size=min(nbytes, 1 << 20), dtype=np.uint8)
    reps = -(-nbytes // block.size)
    return xp.tile(xp.asarray(block), reps)[:nbytes]


def _copy_ns(xp, src, repeats: int) -> np.ndarray:
    dst = xp.empty_like(src)
    xp.copyto(dst, src)  # warm-up
    synchronize(xp)
    out = np.empty(repeats, dtype=np.int64)
    for r in range(repeats):
        t0 = time.perf_counter_ns()
        xp.copyto(dst, src)
        synchronize(xp)
        out[r] = time.perf_counter_ns() - t0
    return out


def measure_bandwidth(*, device: str = "gpu", sizes: Iterable[int] = (1 << 20, 64 << 20), repeats: int = 10,
                      progress: Callable[[str], None] = print) -> list[dict]:
    """cuda_ipc put GB/s per size beside a copy of the same bytes here (see the module notes)."""
    from qlink.memory import RemoteRegion

    xp, label = array_module(device), _device_label(device)
    sizes = sorted(set(int(n) for n in sizes))
    if not sizes or sizes[0] <= 0 or repeats < 1:
        raise ValueError(f"sizes must be positive and repeats >= 1, got {sizes!r}, {repeats!r}")
    copy_name = "cupy copy" if device == "gpu" else "numpy copy"
    src = _pattern(xp, sizes[-1])
    rows = []
    with _peer(bandwidth_target, sizes[-1], device) as ep:
        desc = RemoteRegion.from_bytes(ep.recv(timeout_s=120))
        for n in sizes:
            view = src[:n]
            ep.put(view, desc, notify_id=0)  # warm-up (the first one opens the peer's IPC handle)
            put_ns = np.empty(repeats, dtype=np.int64)
            for r in range(repeats):
                t0 = time.perf_counter_ns()
                ep.put(view, desc, notify_id=r + 1)
                put_ns[r] = time.perf_counter_ns() - t0
            ep.send(CHECK.pack(b"CHK!", repeats + 1, n))
            count, crc = REPLY.unpack(ep.recv(timeout_s=120))
            exact = count == repeats + 1 and crc == zlib.crc32(host_copy(view))
            copy_ns = _copy_ns(xp, view, repeats)
            put_gbps, copy_gbps = n / float(np.median(put_ns)), n / float(np.median(copy_ns))
            for case, ns, gbps, extra in (("cuda_ipc put", put_ns, put_gbps, {"bit_exact": bool(exact)}),
                                          (copy_name, copy_ns, copy_gbps, {})):
                s = summarize_ns(ns)
                rows.append({"section": "bandwidth", "case": case, "basis": "measured", "device": label, "nbytes": n,
                             "GBps": float(f"{gbps:.4g}"), "x_copy": ratio(gbps, copy_gbps), "p50_us": s["p50_us"],
                             "p99_us": s["p99_us"], **extra})
            progress(f"  bandwidth {n:>11} B: put {put_gbps:8.2f} GB/s, copy {copy_gbps:8.2f} GB/s, "
                     f"bit-exact {exact}")
    return rows


def _copy_layers_ns(xp, *, layer_nbytes: int, num_layers: int, repeats: int) -> float:
    src = [xp.ones(layer_nbytes, dtype=xp.uint8) for _ in range(num_layers)]
    dst = [xp.zeros(layer_nbytes, dtype=xp.uint8) for _ in range(num_layers)]
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter_ns()
        for s, d in zip(src, dst):
            xp.copyto(d, s)
        synchronize(xp)
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times[1:]))


def measure_kv(*, device: str = "gpu", preset: str = "llama-3-8b", tokens: Iterable[int] = (512, 4096),
               repeats: int = 3, progress: Callable[[str], None] = print) -> list[dict]:
    """KV-engine transfers of ``tokens``-token requests between device caches over cuda_ipc."""
    from qlink.ai import preset as _preset
    from qlink.ai.peer import open_link

    xp, label = array_module(device), _device_label(device)
    base = _preset(preset)
    token_list = sorted(set(int(t) for t in tokens))
    if not token_list or token_list[0] <= 0 or repeats < 1:
        raise ValueError(f"tokens must be positive and repeats >= 1, got {tokens!r}, {repeats!r}")
    spec = base.with_blocks(base.blocks_for(num_tokens=token_list[-1]))
    copy_name = "cupy copy per layer" if device == "gpu" else "numpy copy per layer"
    floor = {}
    rows = []
    for t in token_list:
        nb = base.kv_nbytes(num_tokens=t)
        ns = _copy_layers_ns(xp, layer_nbytes=nb // spec.num_layers, num_layers=spec.num_layers, repeats=repeats)
        floor[t] = nb / ns
        rows.append({"section": "kv", "case": copy_name, "basis": "measured", "device": label, "tokens": t,
                     "nbytes": nb, "GBps": float(f"{floor[t]:.4g}"), "x_copy": 1.0, "p50_us": round(ns / 1e3, 3)})
    with open_link("cuda_ipc", spec, seed=3, device=device) as (rx, cache, peer):
        rid = 0
        for t in token_list:
            ids = list(range(spec.blocks_for(num_tokens=t)))
            times, submits = [], []
            for rep in range(repeats + 1):  # the first is a warm-up
                rid += 1
                sub, rec = peer.transfer(rx, rid, ids, ids, timeout_s=600)
                if rep:
                    times.append(rec.submit_to_last_us)
                    submits.append(sub.submit_us)
            check_ids = sorted(set(ids[:4] + ids[-4:]))
            layers = sorted({0, spec.num_layers - 1})
            exact = bool((cache.block_checksums(check_ids, layers=layers)
                          == peer.call("checksums", check_ids, layers)).all())
            t_us = float(np.median(times))
            gbps = rec.nbytes / (t_us * 1e3)
            rows.append({"section": "kv", "case": f"cuda_ipc KV {sub.mode}", "basis": "measured", "device": label,
                         "tokens": t, "nbytes": rec.nbytes, "GBps": float(f"{gbps:.4g}"),
                         "x_copy": ratio(gbps, floor[t]), "p50_us": round(t_us, 3), "bit_exact": exact,
                         "submit_us": round(float(np.median(submits)), 3),
                         "note": f"{rec.num_descs} descriptors, {spec.num_layers} layers"})
            progress(f"  kv {t:>6} tokens: {gbps:8.2f} GB/s ({ratio(gbps, floor[t])} x copy), bit-exact {exact}")
    return rows


# QEC cases: (decoder name, where the syndromes land)
_QEC_CASES = (("qlink-bp", "device"), ("qlink-bp", "host"), ("cudaq-nv-qldpc-decoder", "device"))


def _qec_loop(decoder, dets: np.ndarray, *, landing: str, xp) -> tuple[np.ndarray, np.ndarray]:
    """Serve one controller process: ``(reaction times ns, corrections it received)``."""
    from qlink.memory import alloc

    num_shots, nd = dets.shape
    no = decoder.num_observables
    on_device = landing == "device" and xp is not np
    region_mem = xp.zeros(nd, dtype=xp.uint8) if landing == "device" else alloc(nd, dtype=np.uint8)
    row = region_mem.reshape(1, nd)
    if hasattr(decoder, "decode_device") and landing == "device":
        decode = lambda: decoder.decode_device(row)  # noqa: E731 - syndromes decoded where they landed
    elif on_device:
        decode = lambda: decoder.decode_batch(host_copy(row))  # noqa: E731 - host API: a copy off the GPU
    else:
        decode = lambda: decoder.decode_batch(row)  # noqa: E731
    busy = next((k for k in range(num_shots) if dets[k].any()), 0)
    rx = xp if landing == "device" else np  # the module of the region's own memory
    for shot in (busy, busy):  # warm-up: compile kernels, touch every buffer
        region_mem[...] = rx.asarray(dets[shot])
        host_copy(decode())
    region_mem[...] = 0
    out = bytearray(8 + no)
    with _peer(qec_controller) as ep:
        region = ep.register(region_mem)
        ep.send(region.descriptor().to_bytes())
        ep.send(SHOTS.pack(b"SHOT", num_shots, nd) + np.ascontiguousarray(dets, dtype=np.uint8).tobytes())
        for k in range(num_shots):
            note = ep.wait_notification(timeout_s=60)
            if note.notify_id != k:
                raise RuntimeError(f"syndromes of shot {note.notify_id} arrived where shot {k} was expected")
            struct.pack_into("<Q", out, 0, k)
            out[8:] = host_copy(decode())[0].astype(np.uint8).tobytes()
            ep.send(out)
        times = np.frombuffer(ep.recv(timeout_s=60), dtype=np.int64)
        got = np.frombuffer(ep.recv(timeout_s=60), dtype=np.uint8).reshape(num_shots, no)
        ep.deregister(region)
    return times, got


def _qec_case_name(name: str, landing: str, device: str) -> str:
    where = "GPU memory" if landing == "device" and device == "gpu" else "host memory"
    if name == "qlink-bp" and landing == "device":
        how = "decode_device"
    elif where == "GPU memory":
        how = "copied to host, decode_batch"
    else:
        how = "decode_batch"
    return f"{name}, syndromes in {where}, {how}"


def measure_qec(*, device: str = "gpu", distances: Iterable[int] = (5,), num_shots: int = 300, p: float = 0.001,
                cases=_QEC_CASES, progress: Callable[[str], None] = print) -> list[dict]:
    """QEC reaction time with syndromes put into the decoder's memory (see the module notes)."""
    from qlink.qec.decoders import DecoderUnavailableError, compile_decoder
    from qlink.qec.sources import StimSource

    xp, label = array_module(device), _device_label(device)
    if num_shots < 2:
        raise ValueError(f"num_shots must be >= 2, got {num_shots}")
    warmup = min(20, num_shots // 5)
    rows = []
    for d in distances:
        src = StimSource.surface_code(distance=int(d), rounds=int(d), p=p)
        batch = src.sample(num_shots, seed=5)
        dets = batch.detection_events.astype(np.uint8)
        dem = src.detector_error_model(decompose_errors=True)
        for name, landing in cases:
            case = _qec_case_name(name, landing, device)
            base = {"section": "qec", "case": case, "device": label, "distance": int(d)}
            try:
                opts = {"device": device} if name == "qlink-bp" else {}
                decoder = compile_decoder(name, dem, **opts)
            except (DecoderUnavailableError, ImportError) as e:
                rows.append({**base, "basis": "skipped", "note": str(e)})
                progress(f"  qec d={d} {case}: skipped ({e})")
                continue
            times, got = _qec_loop(decoder, dets, landing=landing, xp=xp)
            offline = decoder.decode_batch(dets)
            s = summarize_ns(times[warmup:])
            note = "host round trip: cudaq_qec takes host syndromes" if name.startswith("cudaq") else ""
            rows.append({**base, "basis": "measured", "p50_us": s["p50_us"], "p99_us": s["p99_us"],
                         "p999_us": s["p999_us"], "bit_identical": bool((got == offline).all()),
                         "logical_errors": int((got != batch.observable_flips).any(axis=1).sum()),
                         "note": f"{num_shots - warmup} shots after {warmup} warm-up{'; ' + note if note else ''}"})
            progress(f"  qec d={d} {case}: reaction p50 {s['p50_us']} us, p99 {s['p99_us']} us")
    return rows


def run_gpu_bench(*, device: str = "gpu", sizes=(1 << 20, 64 << 20), repeats: int = 10,
                  kv_preset: str = "llama-3-8b", kv_tokens=(512, 4096), kv_repeats: int = 3, distances=(5,),
                  num_shots: int = 300, progress: Callable[[str], None] = print) -> list[dict]:
    """Every section; a section that fails becomes an ``error`` row and the others still run."""
    rows: list[dict] = []
    sections = (("bandwidth", lambda: measure_bandwidth(device=device, sizes=sizes, repeats=repeats,
                                                         progress=progress)),
                ("kv", lambda: measure_kv(device=device, preset=kv_preset, tokens=kv_tokens, repeats=kv_repeats,
                                          progress=progress)),
                ("qec", lambda: measure_qec(device=device, distances=distances, num_shots=num_shots,
                                            progress=progress)))
    for name, run in sections:
        progress(f"gpu bench: {name}")
        try:
            rows.extend(run())
        except Exception as e:  # noqa: BLE001 - reported in the rows; the other sections still run
            rows.append({"section": name, "case": name, "basis": "error", "note": f"{type(e).__name__}: {e}"})
            progress(f"  {name}: error {type(e).__name__}: {e}")
    return rows


def main_from_cli(args, *, say: Callable[[str], None] = print) -> list[dict]:
    """``qlink bench gpu [--quick] [--out DIR]``: run (or record why not), print a table, write JSON/CSV."""
    from pathlib import Path

    from .report import format_table, write_results

    quick = bool(getattr(args, "quick", False))
    out = Path(getattr(args, "out", "results/bench"))
    settings = dict(sizes=(1 << 20, 64 << 20) if quick else (1 << 20, 16 << 20, 256 << 20, 1 << 30),
                    repeats=10 if quick else 50, kv_tokens=(512, 4096) if quick else (512, 4096, 16384),
                    distances=(5,) if quick else (5, 9), num_shots=300 if quick else 2000)
    why = gpu_unavailable()
    if why is not None:
        rows = [{"section": "all", "case": "gpu bench", "basis": "skipped", "device": "none",
                 "note": f"skipped: no GPU ({why})"}]
        say(f"gpu: skipped, no GPU here ({why})")
    else:
        rows = run_gpu_bench(progress=say, **settings)
    write_results(rows, out_dir=out, name="gpu", meta={**{k: list(v) if isinstance(v, tuple) else v
                                                            for k, v in settings.items()}, "quick": quick,
                                                         "ran": why is None})
    print("\nGPU-direct paths: cuda_ipc put vs a CuPy copy, KV caches in device memory, QEC with syndromes "
          "landing in device memory")
    print(format_table(rows, columns=[c for c in COLUMNS if any(c in r for r in rows)]))
    print(f"\nwritten: {out}/gpu.{{json,csv}}")
    return rows
