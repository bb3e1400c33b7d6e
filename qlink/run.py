"""``qlink run`` — the main job: the default end-to-end scenario on one machine.

1. the QEC closed loop (controller → decoder service → back) at d = 5 and 11 over
   shm, tcp and ucx, and the Llama-3-8B / 70B KV transfers of a 4k-token request over
   the same transports (:mod:`qlink.crossdomain`; prefill compute modeled: engine
   ``emulated``), then a short leg with real vLLM engines (a tiny Llama on this CPU, the
   qlink connector over shm; engine ``vllm-cpu``) where the vLLM environment exists
   (:mod:`qlink._vllm_leg`: a subprocess with ``.venv-vllm``'s interpreter; otherwise
   the output says it was skipped and why; like the scenarios, off with ``[run]
   scenarios = false``);
2. the cross-domain budget table: every figure against its own budget, measured and
   modeled apart, then the measured per-stage shares (QEC reaction stages, KV transfer
   stages) — printed, written as CSV/JSON (one file; the ``stage`` column marks the
   stage rows), and drawn (``cross_domain.png``, without the stage rows);
3. the real-time loop and disaggregated-serving scenarios (``scenarios/``) in their
   quick mode, when the scenarios folder is present, with their own plots.

No server to start; everything runs as local processes. Plan on a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from .bench.report import write_results

__all__ = ["main_job"]

def _scenario(name: str):
    from .paper import load_scenario

    try:
        return load_scenario(name)
    except FileNotFoundError:
        return None


def print_cross_domain_tables(rows: list[dict], *, notes: list[str] = ()) -> None:
    """Print the cross-domain summary in at most 100 columns (:mod:`qlink._budget_table`):
    per domain, measured then modeled, one line per transport or link; then where each
    measured timeline spends its time; then the notes. Every row stays in the CSV/JSON."""
    from ._budget_table import stage_summary, summary_text
    from .bench.report import wrap

    print("\nCross-domain latency budgets, measured here or modeled (every row: cross_domain.csv)\n")
    print(summary_text(rows))
    stages = stage_summary(rows)
    if stages:
        print("\nWhere the time goes (measured, per stage; all stages in cross_domain.csv)")
        print(stages)
    for n in notes:
        print(wrap(f"  note: {n}", indent="    "))


def main_job(*, out_dir: Path, quick: bool = False, config=None, say: Callable[[str], None] = print,
             failures: list[str] | None = None, keep_going: bool = True) -> int:
    """Run the main job with ``config`` (a :class:`qlink.config.RunConfig`; default: the
    full settings, or the quick ones with ``quick=True``).

    Each measurement that fails is appended to ``failures`` (when given); with
    ``keep_going=False`` the job stops after step 2 when one did (the table and its files
    are still written), and skips the scenarios.
    """
    failures = [] if failures is None else failures
    from .config import RunConfig
    from .crossdomain import plot_cross_domain, run_cross_domain

    t0 = time.monotonic()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = config if config is not None else (RunConfig.quick() if quick else RunConfig())
    transports = cfg.qec_transports
    say(f"step 1/3: QEC loop and KV transfer on {', '.join(transports)} (results in {out_dir}; "
        f"settings from {cfg.source})")
    res = run_cross_domain(transports=transports, distances=cfg.distances, presets=cfg.presets,
                           kv_tokens=cfg.kv_tokens, num_shots=cfg.num_shots, seed=cfg.seed,
                           vllm_requests=(3 if quick else 6) if cfg.scenarios else 0,
                           vllm_out_dir=out_dir / "kv_disagg_vllm", say=say)
    if not cfg.scenarios:
        res.notes.append("vLLM leg skipped ([run] scenarios = false)")
        say(f"  {res.notes[-1]}")
    if "failed" in res.vllm_note:
        failures.append(res.vllm_note)
    rows = res.rows()  # the vLLM leg's rows beside the other AI rows, before the stage rows
    say("step 2/3: cross-domain budget table")
    write_results(rows, out_dir=out_dir, name="cross_domain", meta={"notes": res.notes})
    write_results(res.qec, out_dir=out_dir, name="qec_loop")
    write_results(res.kv, out_dir=out_dir, name="kv_transfer")
    png = plot_cross_domain(rows, out_dir / "cross_domain.png")
    print_cross_domain_tables(rows, notes=res.notes)
    # "not measured (Error: ...)" is a measurement that failed; a size skipped on purpose says why
    failures.extend(n for n in res.notes if "not measured (" in n)
    if failures and not keep_going:
        say(f"stopping: {len(failures)} measurement(s) failed (--keep-going runs the scenarios anyway)")
        return 1
    say("step 3/3: scenarios (quick): real-time QEC loop, disaggregated KV serving"
        if cfg.scenarios else "step 3/3: scenarios skipped ([run] scenarios = false)")
    steps = (("realtime_loop", ["--quick", "--transport", "shm", "--out", str(out_dir / "realtime_loop")]),
             ("kv_disagg", ["--quick", "--transport", "shm", "--out", str(out_dir / "kv_disagg")]))
    for name, args in steps if cfg.scenarios else ():
        mod = _scenario(name)
        if mod is None:
            say(f"  {name}: scenarios/ not found next to the package; skipped")
            continue
        try:
            rc = mod.main(args)
            if rc:
                raise RuntimeError(f"exit status {rc}")
        except Exception as e:  # the table above stands on its own
            say(f"  {name}: failed: {type(e).__name__}: {e}")
            failures.append(f"scenario {name}: {type(e).__name__}: {e}")
            if not keep_going:
                break
    from .bench.conditions import current

    summary = {"seconds": round(time.monotonic() - t0, 1), "cross_domain_png": str(png),
               "conditions": current().as_dict(), "failures": list(failures),
               "files": sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file())}
    (out_dir / "run_summary.json").write_text(json.dumps(summary, indent=2))
    say(f"done in {summary['seconds']} s; plots and tables under {out_dir}/")
    return 0
