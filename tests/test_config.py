"""TOML run configurations: good files set the knobs, hostile ones get ConfigError naming the key."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlink.config import MAX_CONFIG_NBYTES, RunConfig, load_run_config, parse_run_config
from qlink.errors import ConfigError, QlinkError


def test_a_file_sets_what_it_names_and_keeps_the_rest(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('[qec]\ntransports = ["tcp"]\ndistances = [3, 7]\n[run]\nseed = 9\nscenarios = false\n')
    cfg = load_run_config(p, base=RunConfig.quick())
    assert cfg.qec_transports == ("tcp",) and cfg.distances == (3, 7) and cfg.seed == 9 and not cfg.scenarios
    assert cfg.num_shots == RunConfig.quick().num_shots and cfg.presets == RunConfig.quick().presets
    assert cfg.source == str(p)


def test_an_empty_file_is_the_base():
    assert parse_run_config("") == RunConfig()


@pytest.mark.parametrize("text, names", [
    ("[qec]\nnum_shots = nan", "qec.num_shots"),
    ("[qec]\nnum_shots = inf", "qec.num_shots"),
    ("[qec]\nnum_shots = -inf", "qec.num_shots"),
    ("[qec]\nnum_shots = 1.5", "qec.num_shots"),
    ("[qec]\nnum_shots = 0", "qec.num_shots"),
    ("[qec]\nnum_shots = -3", "qec.num_shots"),
    ("[qec]\nnum_shots = 99999999999999999", "qec.num_shots"),
    ("[qec]\nnum_shots = true", "qec.num_shots"),
    ("[qec]\nnum_shots = '100'", "qec.num_shots"),
    ("[qec]\ndistances = [5, nan]", "qec.distances[1]"),
    ("[qec]\ndistances = [4]", "qec.distances[0]"),
    ("[qec]\ndistances = []", "qec.distances"),
    ("[qec]\ndistances = 5", "qec.distances"),
    ("[qec]\ntransports = ['rdma']", "qec.transports[0]"),
    ("[qec]\ntransports = [1]", "qec.transports[0]"),
    ("[kv]\npresets = ['gpt-5']", "kv.presets[0]"),
    ("[kv]\npresets = ['tiny']", "kv.presets[0]"),  # a layout without a model size: no prefill budget
    ("[kv]\ntokens = inf", "kv.tokens"),
    ("[run]\nseed = -1", "run.seed"),
    ("[run]\nscenarios = 1", "run.scenarios"),
    ("[qec]\nnum_shot = 10", "qec.num_shot"),
    ("[qecc]\nnum_shots = 10", "[qecc]"),
    ("qec = 3", "qec must be a table"),
])
def test_bad_values_are_refused_by_name(text, names):
    with pytest.raises(ConfigError) as e:
        parse_run_config(text, source="run.toml")
    assert names in str(e.value) and str(e.value).startswith("run.toml: ")


@pytest.mark.parametrize("text", ["[qec", "num_shots = = 3", "[qec]\nx = [1, 2", "a = 1\na = 2", "\x00",
                                  "[qec]\nnum_shots = 1\n[qec]\nnum_shots = 2", "x = " + "[" * 5000 + "]" * 5000])
def test_text_that_is_not_toml_is_a_config_error(text):
    with pytest.raises(ConfigError, match="not valid TOML|unknown"):
        parse_run_config(text)


def test_files_that_cannot_be_read_or_are_too_large(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_run_config(tmp_path / "missing.toml")
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MAX_CONFIG_NBYTES + 1))
    with pytest.raises(ConfigError, match="at most"):
        load_run_config(big)
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"[run]\nseed = 1 # caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_run_config(bad)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=400),
                 st.builds(lambda k, v: f"[qec]\n{k} = {v}\n",
                           st.sampled_from(["num_shots", "distances", "transports", "x"]),
                           st.one_of(st.integers().map(str), st.floats().map(repr),
                                     st.text(max_size=20).map(repr), st.lists(st.integers(), max_size=5).map(str)))))
def test_any_text_gives_a_config_or_a_config_error(text):
    try:
        cfg = parse_run_config(text)
    except ConfigError:
        return
    assert isinstance(cfg, RunConfig) and all(d % 2 == 1 for d in cfg.distances) and cfg.num_shots >= 1


def test_the_cli_says_what_is_wrong_and_exits_2(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text("[qec]\nnum_shots = nan\n")
    r = subprocess.run([sys.executable, "-m", "qlink.cli", "run", "--config", str(p), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "qec.num_shots" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()  # nothing ran
    assert issubclass(ConfigError, QlinkError) and issubclass(ConfigError, ValueError)


def test_the_main_job_runs_end_to_end_on_a_small_config(tmp_path):
    """`qlink run --config` with a small config: the budget table, its CSV/JSON and plot."""
    import csv
    import json

    p = tmp_path / "small.toml"
    p.write_text('[qec]\ntransports = ["shm"]\ndistances = [3]\nnum_shots = 60\n'
                 '[kv]\npresets = ["llama-3-8b"]\ntokens = 256\n[run]\nscenarios = false\n')
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "qlink.cli", "run", "--config", str(p), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Cross-domain latency budgets" in r.stdout
    for name in ("cross_domain.csv", "cross_domain.json", "cross_domain.png", "qec_loop.csv", "kv_transfer.csv",
                 "run_summary.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    rows = list(csv.DictReader((out / "cross_domain.csv").open()))
    domains = {row["domain"] for row in rows}
    assert {"qec", "ai"} <= domains, domains
    assert all(row["basis"] in ("measured", "modeled") for row in rows)
    assert any(row["basis"] == "measured" and row["transport"] == "shm" for row in rows)
    measured = [row for row in rows if row["basis"] == "measured"]
    assert {row["transport"] for row in measured} == {"shm"}
    reaction = [x for x in measured if x["what"] == "QEC d=3 reaction time" and x["stat"] == "p50"]
    decision = [x for x in measured if x["what"].startswith("QEC d=3 feed-forward decision") and x["stat"] == "p50"]
    assert len(reaction) == len(decision) == 1
    assert float(decision[0]["value_us"]) < float(reaction[0]["value_us"])  # the decoder's work left out
    assert [x for x in measured if "time per round answered" in x["what"]]
    assert len([x for x in measured if "one layer's KV transfer" in x["what"]]) == 2  # p50 and p99
    stages = [x for x in rows if x["stage"]]
    assert stages and all(x["basis"] == "measured" for x in stages)
    assert {x["stage"] for x in stages} >= {"decode", "wire_in", "first layer", "total"}
    for link in ("nvqlink", "nvlink4", "pcie5-x16", "ib-ndr"):
        assert {x["domain"] for x in rows if x["basis"] == "modeled" and x["transport"] == link} == {"qec", "ai"}, link
    assert not [x for x in rows if x["basis"] == "modeled" and "measured" in x["what"]]
    assert "Where the time goes" in r.stdout  # the per-stage summary
    assert max(len(line) for line in r.stdout.splitlines()) <= 100  # the console gets the narrow view
    assert json.loads((out / "run_summary.json").read_text())["seconds"] > 0
