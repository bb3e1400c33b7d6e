"""``qlink paper build``: the reproducible artifact of the cross-domain latency paper.

:func:`build` runs the scenarios at fixed seeds and writes, under ``out_dir``
(default ``papers/cross-domain-latency/build/``):

* ``figures/NAME.png`` and ``figures/NAME.pdf``;
* ``tables/NAME.csv`` and ``tables/NAME.tex`` (booktabs, see :func:`to_latex`);
* ``data/`` — the raw reports behind the tables (JSON, the sinter CSV of the LER runs);
* ``paper.md`` — ``papers/cross-domain-latency/paper.md`` with every
  ``<!-- table:NAME -->`` marker filled in from the tables of this build;
* ``paper.pdf`` — that text typeset with its figures and tables by Typst (``paper.typ``
  is its source), see :mod:`qlink._paper_pdf`;
* ``manifest.json`` — package versions, CPU and GPU model, the run's conditions (load
  before and after, CPU floor; :mod:`qlink.bench.conditions`), git commit and a dirty
  flag, seeds, the exact commands, wall times, the SHA-256 of every file written, and
  which tables depend on timing.

Tables whose numbers depend only on the seed — logical-error counts of seeded shots
decoded through the wire, the seeded request stream, rows modeled from the link
catalog — are byte-identical between two builds with the same seed. Tables of
measured times are not; the manifest lists them under ``timing_dependent_tables``.

Profiles: ``test`` (well under a minute, for the test suite), ``quick`` (a few
minutes on two cores) and ``full`` (see ``papers/cross-domain-latency/README.md``).

>>> sorted(PROFILES), STEPS[1:3]
(['full', 'quick', 'test'], ('cross_domain', 'qec_memory'))
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterable

from ._paper_figures import (fig_backlog, fig_kv_bandwidth, fig_kv_exposed, fig_layer_arrival, fig_ler_deadline,
                             fig_link_times, fig_reaction_cdf, fig_stage_shares, fig_vllm_requests)
from ._paper_tables import _columns, to_latex, to_markdown, write_csv

__all__ = ["build", "verify", "load_scenario", "SCENARIOS", "to_latex", "to_markdown", "write_csv", "PROFILES", "STEPS",
           "PAPER_DIR", "DEFAULT_OUT_DIR", "main_from_cli", "fig_reaction_cdf", "fig_backlog", "fig_ler_deadline",
           "fig_stage_shares", "fig_kv_exposed", "fig_kv_bandwidth", "fig_layer_arrival", "fig_link_times",
           "fig_vllm_requests"]

_ROOT = Path(__file__).resolve().parent.parent
PAPER_DIR = _ROOT / "papers" / "cross-domain-latency"
DEFAULT_OUT_DIR = PAPER_DIR / "build"
SCENARIOS = ("qec_memory", "realtime_loop", "kv_disagg", "fabric_scale")
STEPS = ("catalog", "cross_domain", "qec_memory", "realtime_loop", "kv_disagg")

PROFILES: dict[str, dict[str, dict]] = {
    "test": {
        "cross_domain": dict(transports=("shm",), distances=(3,), presets=("llama-3-8b",), kv_tokens=1024,
                             num_shots=200, vllm_requests=0),
        "qec_memory": dict(transport="shm", distances=(3,), ps=(0.01, 0.02), num_shots=500),
        "realtime_loop": dict(transport="shm", distance=3, rounds=3, num_shots=200),
        "kv_disagg": dict(transport="shm", preset="tiny", num_requests=6, quick=True),
    },
    "quick": {
        "cross_domain": dict(transports=("shm", "tcp"), distances=(5,), presets=("llama-3-8b",), kv_tokens=4096,
                             num_shots=500, vllm_requests=3),
        "qec_memory": dict(transport="shm", distances=(3, 5), ps=(0.004, 0.008, 0.012), num_shots=2000),
        "realtime_loop": dict(transport="shm", distance=5, rounds=25, num_shots=2000),
        "kv_disagg": dict(transport="shm", preset="llama-3-8b", num_requests=16, quick=True),
    },
    "full": {
        "cross_domain": dict(transports=("shm", "tcp", "ucx"), distances=(5, 11),
                             presets=("llama-3-8b", "llama-3-70b"), kv_tokens=4096, num_shots=2000,
                             vllm_requests=6),
        "qec_memory": dict(transport="shm", distances=(3, 5, 7), ps=(0.001, 0.002, 0.003, 0.005, 0.007, 0.01),
                           num_shots=20_000),
        "realtime_loop": dict(transport="shm", distance=5, rounds=25, num_shots=20_000),
        "kv_disagg": dict(transport="shm", preset="llama-3-8b", num_requests=200, quick=False),
    },
}


# ----- scenarios, environment ---------------------------------------------------------------


def load_scenario(name: str):
    """The scenario module ``qlink.scenarios.<name>`` (``python scenarios/<name>.py`` is its
    command line).

    >>> load_scenario("qec_memory").CSV_NAME
    'qec_memory.csv'
    """
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return importlib.import_module(f"qlink.scenarios.{name}")


def _run(cmd: list[str]) -> str | None:
    try:
        p = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def _environment() -> dict:
    from ._version_info import versions
    from .bench.report import environment

    env = environment()
    gpu = None
    if shutil.which("nvidia-smi"):
        gpu = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    commit = _run(["git", "rev-parse", "HEAD"])
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"]) if commit else None
    return {"python": env["python"], "executable_name": Path(sys.executable).name, "platform": env["platform"],
            "cpu_model": env["cpu"], "num_cpus": env["num_cpus"], "gpu_model": gpu or "none",
            "versions": versions(), "git": {"commit": commit or "unknown", "dirty": bool(status) if commit else None}}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(manifest_path) -> list[str]:
    """Check every file a manifest lists against its SHA-256; return what differs (empty: all match)."""
    manifest_path = Path(manifest_path)
    man = json.loads(manifest_path.read_text())
    bad = []
    for rel, info in man["files"].items():
        p = manifest_path.parent / rel
        if not p.is_file():
            bad.append(f"{rel}: missing")
        elif _sha256(p) != info["sha256"]:
            bad.append(f"{rel}: SHA-256 differs from the manifest")
    return bad


# ----- the build -----------------------------------------------------------------------------


class _Artifact:
    """Collects what a build writes: tables, figures, data, and per-step records."""

    def __init__(self, out: Path, seed: int, say: Callable[[str], None]):
        self.out, self.seed, self.say = out, seed, say
        self.tables: dict[str, dict] = {}
        self.rows: dict[str, list[dict]] = {}
        self.figures: dict[str, list[str]] = {}
        for sub in ("figures", "tables", "data"):
            (out / sub).mkdir(parents=True, exist_ok=True)

    def table(self, name: str, rows: list[dict], *, timing: bool, caption: str, columns=None) -> None:
        rows = [dict(r) for r in rows]
        cols = _columns(rows, columns)
        csv_path = write_csv(rows, self.out / "tables" / f"{name}.csv", columns=cols)
        tex_path = self.out / "tables" / f"{name}.tex"
        tex_path.write_text(to_latex(rows, columns=cols or ["(empty)"], caption=caption, label=f"tab:{name}") + "\n")
        self.rows[name] = rows
        self.tables[name] = {"csv": str(csv_path.relative_to(self.out)), "tex": str(tex_path.relative_to(self.out)),
                             "rows": len(rows), "timing_dependent": timing, "caption": caption}

    def figure(self, name: str, draw) -> None:
        """``draw``: a matplotlib Figure, or a callable ``path -> None`` that writes one file."""
        paths = []
        for ext in ("png", "pdf"):
            p = self.out / "figures" / f"{name}.{ext}"
            if callable(draw):
                draw(p)
            else:
                draw.savefig(p, dpi=130, metadata={"CreationDate": None} if ext == "pdf" else None)
            paths.append(str(p.relative_to(self.out)))
        self.figures[name] = paths

    def data(self, name: str, obj) -> None:
        with open(self.out / "data" / f"{name}.json", "w") as f:
            json.dump(obj, f, indent=1, default=_json_default)


def _json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def _call(fn: str, cfg: dict, seed: int) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in {**cfg, "seed": seed}.items())
    return f"{fn}({args})"


def _step_catalog(a: _Artifact, cfg: dict) -> dict:
    from .budget import BUDGETS
    from .links import LINKS

    a.table("budgets", [{"key": b.key, "domain": b.domain, "budget": b.name, "limit_us": b.limit_ns / 1e3,
                         "source": b.citation} for b in BUDGETS.values()],
            timing=False, caption="Latency budgets of both domains and their sources")
    a.table("links", [{**{k: v for k, v in asdict(m).items() if k not in ("bandwidth_Bps",)},
                       "bandwidth_GBps": m.bandwidth_Bps / 1e9} for m in LINKS.values()],
            timing=False, caption="Link models (modeled figures only; every number cited)",
            columns=["name", "latency_ns", "bandwidth_GBps", "overhead_ns", "jitter_ns", "loss", "citation"])
    return {"call": "qlink.budget.BUDGETS, qlink.links.LINKS (no run)", "cli": None}


def _step_cross_domain(a: _Artifact, cfg: dict) -> dict:
    from .crossdomain import plot_cross_domain, run_cross_domain

    res = run_cross_domain(**cfg, seed=a.seed, vllm_out_dir=a.out / "data" / "kv_vllm", say=a.say)
    rows = res.rows()  # the real engine's rows (vLLM in its own environment) beside the emulated ones
    if cfg.get("vllm_requests"):
        a.table("kv_vllm", res.vllm or [{"note": res.vllm_note}], timing=True,
                caption="A real engine: vLLM prefill and decode engines (tiny random Llama, this CPU), the qlink "
                        "connector between them, per request")
        if res.vllm:
            a.figure("kv_vllm", fig_vllm_requests(res.vllm))
    a.table("cross_domain", rows, timing=True,
            caption="Cross-domain budget table: every figure against its own budget (measured here, or modeled)")
    # Modeled rows take no measured input (crossdomain keeps the two bases apart; the filter on
    # "measured" guards that), so they depend on the link catalog alone.
    a.table("cross_domain_modeled", [r for r in rows if r["basis"] == "modeled" and "measured" not in r["what"]],
            timing=False, caption="The modeled rows of the budget table that use no measured input")
    a.table("qec_loop", res.qec, timing=True, caption="QEC closed loop, surface-code memory at p=0.001")
    a.table("kv_bandwidth", res.kv, timing=True, caption="KV transfer beside the memcpy floor and modeled links")
    a.data("cross_domain", {"notes": res.notes, "qec": res.qec, "kv": res.kv, "rows": rows})
    a.figure("cross_domain", lambda p: plot_cross_domain(rows, p))
    a.figure("kv_bandwidth", fig_kv_bandwidth(res.kv))
    return {"call": _call("qlink.crossdomain.run_cross_domain", cfg, a.seed), "cli": None, "notes": res.notes}


_LER_COLUMNS = ["d", "p", "path", "transport", "decoder", "shots", "errors", "discards", "ler", "ler_lo", "ler_hi",
                "matches_offline"]


def _step_qec_memory(a: _Artifact, cfg: dict) -> dict:
    mod = load_scenario("qec_memory")
    rows = mod.run(out=a.out / "data" / "qec_memory", seed=a.seed, progress=False, plot=False, **cfg)
    rows = sorted(rows, key=lambda r: (r["d"], r["p"], r["path"]))
    a.table("qec_memory", rows, timing=False, columns=_LER_COLUMNS,
            caption="Surface-code memory: logical error rate per shot vs p and d, decoded through the wire "
                    "(and offline, the same shots)")
    a.figure("qec_threshold", lambda p: mod.plot_threshold(rows, p, transport=cfg["transport"]))
    cli = (f"python scenarios/qec_memory.py --transport {cfg['transport']} --distances "
           f"{' '.join(map(str, cfg['distances']))} --ps {' '.join(map(str, cfg['ps']))} --shots {cfg['num_shots']} "
           f"--seed {a.seed} --out OUT")
    return {"call": _call("qlink/scenarios/qec_memory.py:run", cfg, a.seed), "cli": cli,
            "wire_matches_offline": all(r.get("matches_offline", True) for r in rows)}


def _flat_mode(name: str, s: dict) -> dict:
    row = {"mode": name}
    for k, v in s.items():
        if isinstance(v, dict):
            row.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            row[k] = v
    return row


def _step_realtime_loop(a: _Artifact, cfg: dict) -> dict:

    mod = load_scenario("realtime_loop")
    rep = mod.run(out=None, seed=a.seed, progress=False, **cfg)
    results = rep.pop("results")
    a.data("realtime_loop", rep)
    a.table("realtime_loop", [_flat_mode(k, v) for k, v in rep["modes"].items()], timing=True,
            caption="Closed QEC loop at the 1.1 us cycle: streaming and feed-forward (measured)")
    c = rep["config"]
    title = f"d={c['distance']}, {c['rounds']} rounds/shot, cycle {c['cycle_ns']} ns, {c['transport']}"
    a.figure("reaction_cdf", fig_reaction_cdf(results, title=f"Reaction time — {title}"))
    a.figure("backlog", fig_backlog(results, title=f"Decoder backlog — {title}"))
    a.figure("ler_deadline", fig_ler_deadline(results, deadline_ns=c["deadline_ns"], title=f"LER(t) — {title}"))
    a.figure("stage_shares", fig_stage_shares(results, title=f"Stages of the reaction time — {title}"))
    cli = (f"python scenarios/realtime_loop.py --transport {cfg['transport']} --distance {cfg['distance']} "
           f"--rounds {cfg['rounds']} --shots {cfg['num_shots']} --seed {a.seed} --out OUT")
    return {"call": _call("qlink/scenarios/realtime_loop.py:run", cfg, a.seed), "cli": cli}


_KV_REQUEST_COLUMNS = ["request_id", "prompt_tokens", "kv_bytes", "exposed_ms_nvlink4_modeled",
                       "exposed_ms_400g_nic_modeled"]


def _step_kv_disagg(a: _Artifact, cfg: dict) -> dict:

    mod = load_scenario("kv_disagg")
    rows = mod.run(out_dir=None, seed=a.seed, progress=False, **cfg)
    a.table("kv_disagg", rows, timing=True,
            caption="Disaggregated prefill to decode: exposed KV transfer and TTFT per request")
    a.table("kv_requests", rows, timing=False, columns=_KV_REQUEST_COLUMNS,
            caption="The seeded request stream and its modeled exposed transfer")
    a.figure("kv_exposed", fig_kv_exposed(rows))
    cli = (f"python scenarios/kv_disagg.py --transport {cfg['transport']} --preset {cfg['preset']} "
           f"--num-requests {cfg['num_requests']} --seed {a.seed}{' --quick' if cfg['quick'] else ''} --out OUT")
    return {"call": _call("qlink/scenarios/kv_disagg.py:run", cfg, a.seed), "cli": cli}


_STEP_FUNCS = {"catalog": _step_catalog, "cross_domain": _step_cross_domain, "qec_memory": _step_qec_memory,
               "realtime_loop": _step_realtime_loop, "kv_disagg": _step_kv_disagg}


def _pct(values, q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else math.nan


def _headline(a: _Artifact) -> list[dict]:
    """The few figures the abstract quotes, each with its basis, from this build's tables."""
    out: list[dict] = []

    def add(figure, value, unit, basis, source):
        out.append({"figure": figure, "value": value, "unit": unit, "basis": basis, "table": source})

    for r in a.rows.get("realtime_loop", []):
        t = r.get("transport", "")
        for k in ("reaction_p50_us", "reaction_p99_us", "reaction_p999_us"):
            add(f"QEC {r['mode']} d={r['distance']} {k.split('_')[1]} reaction ({t})", r[k], "us", "measured",
                "realtime_loop")
        add(f"QEC {r['mode']} decoder keeps up with the cycle ({t})", float(bool(r["keeps_up"])), "1 = yes",
            "measured", "realtime_loop")
        add(f"QEC {r['mode']} LER(t = {r['deadline_us']:g} us)", r["ler_at_deadline"], "per shot", "measured",
            "realtime_loop")
    ler = [r for r in a.rows.get("qec_memory", []) if r["path"] == "wire"]
    if ler:
        add("LER tasks where wire-path corrections equal offline decoding", float(sum(bool(r.get("matches_offline"))
                                                                                       for r in ler)),
            f"of {len(ler)}", "measured", "qec_memory")
    kv = a.rows.get("kv_disagg", [])
    if kv:
        e = [r["exposed_transfer_ms"] for r in kv]
        add(f"exposed KV transfer p50 ({kv[0]['transport']})", _pct(e, 50), "ms", "measured", "kv_disagg")
        add(f"exposed KV transfer p95 ({kv[0]['transport']})", _pct(e, 95), "ms", "measured", "kv_disagg")
        add("exposed KV transfer p50, NVLink 4", _pct([r["exposed_ms_nvlink4_modeled"] for r in kv], 50), "ms",
            "modeled", "kv_disagg")
        add("exposed KV transfer p50, 400 Gb/s NIC", _pct([r["exposed_ms_400g_nic_modeled"] for r in kv], 50), "ms",
            "modeled", "kv_disagg")
        add("TTFT p50 as seen by decode", _pct([r["ttft_ms"] for r in kv], 50), "ms", "measured", "kv_disagg")
        add("requests within the 250 ms TTFT SLO", 100.0 * sum(bool(r["ttft_within_slo"]) for r in kv) / len(kv),
            "%", "measured", "kv_disagg")
    for r in a.rows.get("kv_bandwidth", []):
        if r.get("basis") in ("measured", "floor") and r.get("GBps"):
            add(f"KV bandwidth, {r['case']}, {r['tokens']} tokens", r["GBps"], "GB/s", r["basis"], "kv_bandwidth")
    cd = a.rows.get("cross_domain", [])
    for basis in ("measured", "modeled"):
        rs = [r for r in cd if r["basis"] == basis]
        if rs:
            add(f"budget-table rows within their budget ({basis})", float(sum(bool(r["within"]) for r in rs)),
                f"of {len(rs)}", basis, "cross_domain")
    return out


_MARKER = re.compile(r"<!--\s*table:([A-Za-z0-9_]+)(?:\s+columns=([A-Za-z0-9_.,]+))?\s*-->")


def _render_paper(a: _Artifact, env_line: str) -> Path | None:
    """papers/cross-domain-latency/paper.md with its table markers filled in, figure paths
    made relative to the build folder, and the build's environment stated."""
    src = PAPER_DIR / "paper.md"
    if not src.is_file():
        return None

    def table(m: re.Match) -> str:
        name, cols = m.group(1), m.group(2)
        if name not in a.rows:
            return f"*(table {name} was not built in this run)*"
        return to_markdown(a.rows[name], columns=cols.split(",") if cols else None)

    text = _MARKER.sub(table, src.read_text())
    text = text.replace("](build/", "](").replace("<!-- build:environment -->", env_line)
    dst = a.out / "paper.md"
    dst.write_text(text)
    return dst


_MARK_FILE = ".qlink-paper-build"


def _prepare(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        if not ((out / "manifest.json").exists() or (out / _MARK_FILE).exists()):
            raise ValueError(f"{out} is not empty and holds no earlier paper build; give a new or empty directory")
        for sub in ("figures", "tables", "data"):
            shutil.rmtree(out / sub, ignore_errors=True)
        for f in ("manifest.json", "paper.md", "paper.typ", "paper.pdf"):
            (out / f).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / _MARK_FILE).write_text("written by qlink paper build\n")


def build(*, out_dir=DEFAULT_OUT_DIR, quick: bool = False, seed: int = 1, profile: str | None = None,
          steps: Iterable[str] | None = None, command: str | None = None,
          say: Callable[[str], None] = print) -> Path:
    """Run the paper's scenarios at ``seed`` and write the artifact into ``out_dir``; return
    the path of ``manifest.json``.

    ``profile`` (``test``, ``quick``, ``full``) defaults to ``quick`` when ``quick`` is
    true, else ``full``; ``steps`` picks a subset of :data:`STEPS`. A step that fails is
    recorded in the manifest (``steps.NAME.status``) and the others still run. ``out_dir``
    must be new, empty, or an earlier build (whose figures, tables and data are replaced).
    """
    profile = profile or ("quick" if quick else "full")
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    steps = STEPS if steps is None else tuple(steps)
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise ValueError(f"unknown steps {unknown}; the steps are {list(STEPS)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(out_dir).resolve()
    _prepare(out)
    from .bench.conditions import begin as _begin_conditions

    conditions = _begin_conditions(warn=say)
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    a = _Artifact(out, seed, say)
    records: dict[str, dict] = {}
    for name in steps:
        cfg = dict(PROFILES[profile].get(name, {}))
        say(f"paper [{profile}] step {name}")
        t = time.monotonic()
        try:
            rec = {"status": "ok", **_STEP_FUNCS[name](a, cfg)}
        except Exception as e:  # recorded and reported; the other steps still run
            rec = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            say(f"  step {name} failed: {rec['error']}")
        rec["config"] = cfg
        rec["wall_s"] = round(time.monotonic() - t, 2)
        cli = rec.pop("cli", None)
        rec["equivalent_cli"] = cli.replace("--out OUT", f"--out {out / 'data' / name}") if cli else None
        records[name] = rec
    headline = _headline(a)
    if headline:
        a.table("headline", headline, timing=True, caption="Headline figures of this build")
    env = _environment()
    wall_s = round(time.monotonic() - t0, 2)
    env_line = (f"Built with profile `{profile}`, seed {seed}, on {env['cpu_model']} ({env['num_cpus']} CPUs), "
                f"GPU: {env['gpu_model']}; qlink commit `{env['git']['commit'][:12]}`"
                f"{' (with local changes)' if env['git']['dirty'] else ''}; {wall_s:.0f} s. "
                f"{conditions.summary().replace('conditions: ', 'Conditions: ')}.")
    paper = _render_paper(a, env_line)
    pdf, pdf_error = None, None
    if paper is not None:
        say("paper: typesetting paper.pdf (Typst)")
        try:
            from ._paper_pdf import build_pdf

            pdf = build_pdf(paper, out / "paper.pdf")
        except Exception as e:  # recorded in the manifest; the rest of the artifact stands
            pdf_error = f"{type(e).__name__}: {e}"
            say(f"  paper.pdf not written: {pdf_error}")
    invocation = command or (f"python -c 'import qlink.paper as p; p.build(out_dir={str(out)!r}, "
                             f"profile={profile!r}, seed={seed}, steps={list(steps)!r})'")
    timing = sorted(k for k, v in a.tables.items() if v["timing_dependent"])
    manifest = {
        "artifact": "papers/cross-domain-latency", "profile": profile, "seed": seed,
        "seeds": {"cross_domain": f"{seed} (the QEC shots; the KV bench draws its block patterns from its own "
                                  f"fixed seed)", "qec_memory": f"{seed} + task index (one stream per (d, p))",
                  "realtime_loop": seed, "kv_disagg": seed},
        "started_utc": started, "wall_s": wall_s,
        "commands": {"invocation": invocation, "argv": list(sys.argv),
                     "steps": {k: {"call": v.get("call"), "equivalent_cli": v.get("equivalent_cli")}
                               for k, v in records.items()}},
        "steps": records, "environment": env, "conditions": conditions.as_dict(),
        "tables": a.tables, "figures": a.figures, "paper": "paper.md" if paper else None,
        "paper_pdf": "paper.pdf" if pdf else None, "paper_pdf_error": pdf_error,
        "deterministic_tables": sorted(k for k in a.tables if k not in timing),
        "timing_dependent_tables": timing,
        "files": {},
    }
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name not in ("manifest.json", _MARK_FILE):
            manifest["files"][str(p.relative_to(out))] = {"sha256": _sha256(p), "nbytes": p.stat().st_size}
    man_path = out / "manifest.json"
    man_path.write_text(json.dumps(manifest, indent=1, default=_json_default) + "\n")
    (out / _MARK_FILE).unlink(missing_ok=True)
    return man_path


def main_from_cli(args, *, say: Callable[[str], None] = print) -> int:
    """``qlink paper build [--quick | --profile P] [--out DIR] [--seed N]``; returns the exit status."""
    if args.action != "build":
        raise ValueError(f"unknown paper action {args.action!r}; the only action is 'build'")
    profile = getattr(args, "profile", None) or ("quick" if args.quick else "full")
    out = Path(args.out).resolve() if args.out else DEFAULT_OUT_DIR
    command = f"qlink paper build --profile {profile} --seed {args.seed} --out {out}"
    man_path = build(out_dir=out, profile=profile, seed=args.seed, command=command, say=say)
    man = json.loads(man_path.read_text())
    failed = {k: v["error"] for k, v in man["steps"].items() if v["status"] != "ok"}
    print(f"\npaper artifact ({profile}, seed {args.seed}) built in {man['wall_s']:.0f} s under {out}/")
    print(f"  figures   {out / 'figures'}/  ({', '.join(sorted(man['figures']))}; PNG + PDF)")
    print(f"  tables    {out / 'tables'}/  ({', '.join(sorted(man['tables']))}; CSV + LaTeX)")
    print(f"  data      {out / 'data'}/")
    if man["paper"]:
        print(f"  paper     {out / man['paper']}")
    if man.get("paper_pdf"):
        print(f"  pdf       {out / man['paper_pdf']}")
    elif man.get("paper_pdf_error"):
        failed["paper.pdf"] = man["paper_pdf_error"]
    print(f"  manifest  {man_path}  (SHA-256 of {len(man['files'])} files; timing-dependent tables: "
          f"{', '.join(man['timing_dependent_tables']) or 'none'})")
    c = man.get("conditions") or {}
    if c:
        print(f"  conditions load {c['load_before'][0]:.2f} at start, {c['load_after'][0]:.2f} at the end; CPU floor "
              f"{c['cpu_floor_pct']} %{' (BUSY: timing figures not comparable with an idle host)' if c['busy'] else ''}")
    for k, e in failed.items():
        print(f"  step {k} FAILED: {e}")
    return 1 if failed else 0
