"""The paper artifact: a small build through the CLI writes figures, tables and a manifest
whose hashes match; two builds with one seed give byte-identical deterministic tables."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qlink import paper
from qlink.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
SEED = 3


@pytest.fixture(scope="module")
def first_build(tmp_path_factory):
    """One ``test``-profile build through ``qlink paper build`` in a subprocess."""
    out = tmp_path_factory.mktemp("paper") / "build"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "qlink.cli", "paper", "build", "--profile", "test", "--seed",
                           str(SEED), "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    return out, proc


@pytest.mark.timeout(300)
def test_cli_build_succeeds_and_says_where_things_went(first_build):
    out, proc = first_build
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"manifest  {out / 'manifest.json'}" in proc.stdout
    assert str(out / "figures") in proc.stdout and str(out / "tables") in proc.stdout
    man = json.loads((out / "manifest.json").read_text())
    assert all(s["status"] == "ok" for s in man["steps"].values()), man["steps"]
    assert man["commands"]["invocation"] == f"qlink paper build --profile test --seed {SEED} --out {out}"


@pytest.mark.timeout(300)
def test_manifest_lists_every_file_with_a_matching_hash(first_build, tmp_path):
    out, _ = first_build
    man = json.loads((out / "manifest.json").read_text())
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(man["files"]) == on_disk
    assert paper.verify(out / "manifest.json") == []
    for name, paths in man["figures"].items():
        assert sorted(Path(p).suffix for p in paths) == [".pdf", ".png"], name
        assert (out / paths[0]).stat().st_size > 1000
    for name, t in man["tables"].items():
        assert (out / t["csv"]).read_text().count("\n") == t["rows"] + 1, name
        assert (out / t["tex"]).read_text().startswith("\\begin{table}"), name
    env = man["environment"]
    assert env["versions"]["numpy"] and env["versions"]["stim"]
    assert env["cpu_model"] and env["gpu_model"]
    assert len(env["git"]["commit"]) == 40 or env["git"]["commit"] == "unknown"
    assert man["seed"] == SEED and man["seeds"]["realtime_loop"] == SEED and man["wall_s"] > 0
    assert man["steps"]["qec_memory"]["equivalent_cli"].startswith("python scenarios/qec_memory.py")
    assert man["paper"] == "paper.md" and "<!-- table:" not in (out / "paper.md").read_text()
    # a changed byte is caught
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    csv_path = copy / man["tables"]["qec_memory"]["csv"]
    csv_path.write_text(csv_path.read_text().replace("wire", "wira", 1))
    (copy / man["figures"]["backlog"][0]).unlink()
    bad = paper.verify(copy / "manifest.json")
    assert sorted(b.split(":")[0] for b in bad) == sorted([man["tables"]["qec_memory"]["csv"],
                                                          man["figures"]["backlog"][0]])


@pytest.mark.slow  # a second build (about 20 s on two cores)
@pytest.mark.timeout(300)
def test_same_seed_gives_byte_identical_deterministic_tables(first_build, tmp_path):
    out, _ = first_build
    man_a = json.loads((out / "manifest.json").read_text())
    # the steps that make deterministic tables (the real-time loop makes only timing tables)
    man_b = json.loads(paper.build(out_dir=tmp_path / "b", profile="test", seed=SEED, say=lambda s: None,
                                   steps=("catalog", "cross_domain", "qec_memory", "kv_disagg")).read_text())
    assert {"qec_memory", "kv_requests", "cross_domain_modeled", "budgets", "links"} <= set(
        man_a["deterministic_tables"])
    assert {"cross_domain", "qec_loop", "kv_bandwidth", "realtime_loop", "kv_disagg", "headline"} <= set(
        man_a["timing_dependent_tables"])
    assert not set(man_a["deterministic_tables"]) & set(man_a["timing_dependent_tables"])
    assert man_b["deterministic_tables"] == man_a["deterministic_tables"]
    for name in man_a["deterministic_tables"]:
        for kind in ("csv", "tex"):
            rel = man_a["tables"][name][kind]
            assert (out / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
            assert man_a["files"][rel]["sha256"] == man_b["files"][rel]["sha256"]
    ler = (out / man_a["tables"]["qec_memory"]["csv"]).read_text().splitlines()
    assert len(ler) == 1 + 2 * 2  # one d, two p, wire and offline
    assert all(line.endswith(",True") for line in ler if ",wire," in line)  # the wire agrees with offline


@pytest.mark.timeout(120)
def test_another_seed_gives_another_ler_table(first_build, tmp_path):
    out, _ = first_build
    man = json.loads(paper.build(out_dir=tmp_path / "c", profile="test", seed=SEED + 1, steps=("qec_memory",),
                                 say=lambda s: None).read_text())
    rel = man["tables"]["qec_memory"]["csv"]
    assert (out / rel).read_bytes() != (tmp_path / "c" / rel).read_bytes()
    assert set(man["tables"]) == {"qec_memory", "headline"} and man["steps"].keys() == {"qec_memory"}


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="profile must be one of"):
        paper.build(out_dir=tmp_path / "x", profile="huge")
    with pytest.raises(ValueError, match="unknown steps"):
        paper.build(out_dir=tmp_path / "x", profile="test", steps=("nope",))
    with pytest.raises(ValueError, match="seed must be"):
        paper.build(out_dir=tmp_path / "x", profile="test", seed=-1)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        paper.build(out_dir=tmp_path / "mine", profile="test", steps=("catalog",))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_an_earlier_build_is_replaced(tmp_path):
    out = tmp_path / "b"
    paper.build(out_dir=out, profile="test", steps=("catalog",), say=lambda s: None)
    (out / "tables" / "stale.csv").write_text("old\n")
    man = json.loads(paper.build(out_dir=out, profile="test", steps=("catalog",), say=lambda s: None).read_text())
    assert not (out / "tables" / "stale.csv").exists()
    assert set(man["tables"]) == {"budgets", "links"} and paper.verify(out / "manifest.json") == []


def test_tables_render_as_latex_markdown_and_csv(tmp_path):
    rows = [{"case": "a_b & c", "GBps": 12.3456, "ok": True}, {"case": "100%", "GBps": float("nan"), "ok": None}]
    tex = paper.to_latex(rows, caption="x_y", label="tab:x")
    assert r"a\_b \& c & 12.35 & yes \\" in tex and r"100\% & -- &  \\" in tex
    assert r"\begin{tabular}{lrl}" in tex and r"\caption{x\_y}" in tex
    md = paper.to_markdown(rows, columns=["GBps", "case"])
    assert md.splitlines()[:2] == ["| GBps | case |", "|---:|---|"]
    p = paper.write_csv(rows, tmp_path / "t.csv")
    assert p.read_text() == "case,GBps,ok\na_b & c,12.3456,True\n100%,nan,\n"
    with pytest.raises(ValueError, match="at least one column"):
        paper.to_latex([])


def test_cli_parser_has_paper_build():
    args = build_parser().parse_args(["paper", "build", "--quick", "--seed", "5", "--out", "x"])
    assert (args.action, args.quick, args.seed, args.out, args.profile) == ("build", True, 5, "x", None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["paper", "publish"])


def _pdf_text(path: Path) -> str:
    pypdf = pytest.importorskip("pypdf")
    return "\n".join(p.extract_text() for p in pypdf.PdfReader(str(path)).pages)


@pytest.mark.timeout(300)
def test_the_build_writes_a_pdf_holding_its_own_numbers(first_build):
    out, proc = first_build
    pytest.importorskip("typst")
    man = json.loads((out / "manifest.json").read_text())
    assert man["paper_pdf"] == "paper.pdf" and man["paper_pdf_error"] is None
    assert "paper.pdf" in man["files"] and paper.verify(out / "manifest.json") == []
    assert (out / "paper.pdf").read_bytes()[:5] == b"%PDF-"
    assert f"pdf       {out / 'paper.pdf'}" in proc.stdout
    text = " ".join(_pdf_text(out / "paper.pdf").split())
    assert "One interconnect, two budgets" in text
    # numbers of this build's tables, as the paper's tables print them (4 significant digits; 1.016e+05 set as
    # 101,600, and a tiny or huge one as m x 10^e, whose mantissa is what the text shows)
    import csv

    from qlink._paper_pdf import _cell
    from qlink._paper_tables import _text

    def as_shown(v: float) -> str:
        s = _text(v, "{:.4g}")
        c = _cell(s)
        return s.split("e")[0].lstrip("-") if c.startswith("$") else c

    with open(out / "tables" / "budgets.csv") as f:
        limits = [as_shown(float(r["limit_us"])) for r in csv.DictReader(f)]
    assert limits and [v for v in limits if v not in text] == []
    with open(out / "tables" / "headline.csv") as f:
        shown = [as_shown(float(r["value"])) for r in csv.DictReader(f) if r["value"] not in ("", "nan")]
    assert shown and [v for v in shown if v not in text] == []
    # the conditions of the run are stated in the PDF and the manifest
    assert "CPU floor" in text
    assert man["conditions"]["cpu_floor_pct"] is not None and len(man["conditions"]["load_after"]) == 3
