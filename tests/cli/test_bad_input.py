"""Bad input on every command line: one line on stderr, exit status 2, no traceback, nothing run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
QLINK = [sys.executable, "-m", "qlink.cli"]


def _scenario(name):
    return [sys.executable, str(ROOT / "scenarios" / f"{name}.py")]


def _run(argv, tmp_path, timeout=120):
    return subprocess.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=timeout)


# (argv, a phrase the one line must hold): every class of bad input, on the CLI and the scenarios
CASES = [
    # unknown names: the valid ones and the nearest match
    (QLINK + ["bnch"], "did you mean 'bench'"),
    (QLINK + ["bench", "transport", "--transports", "shmm"], "did you mean 'shm'"),
    (QLINK + ["bench", "qec", "--transports", "tcp,shmm"], "valid: shm, tcp, ucx, udp"),
    (QLINK + ["bench", "hostile", "--attacker-nice", "30"], "--attacker-nice must be a whole number in [0, 19]"),
    (QLINK + ["budget", "--transports", "uxc"], "did you mean 'ucx'"),
    (QLINK + ["sweep", "qec", "--decoders", "pymatchng"], "did you mean 'pymatching'"),
    (QLINK + ["sweep", "kv", "--preset", "llama-3-7b"], "KV preset"),
    (QLINK + ["paper", "build", "--profile", "quik"], "did you mean 'quick'"),
    (_scenario("realtime_loop") + ["--decoder", "bposdd"], "did you mean 'bposd'"),
    (_scenario("realtime_loop") + ["--transport", "tpc"], "did you mean 'tcp'"),
    (_scenario("fabric_scale") + ["--fabrics", "nvqlnk"], "did you mean 'nvqlink'"),
    (_scenario("kv_disagg") + ["--preset", "tinny"], "did you mean 'tiny'"),
    # distances: odd, >= 3, on every entry point alike
    (QLINK + ["bench", "qec", "--distances", "5,4"], "must be odd"),
    (QLINK + ["sweep", "qec", "--distances", "1"], "odd code distance in [3, 51]"),
    (_scenario("realtime_loop") + ["--distance", "4"], "must be odd"),
    (_scenario("qec_memory") + ["--distances", "3", "6"], "must be odd"),
    # p in (0, 0.5)
    (QLINK + ["sweep", "qec", "--ps", "0.001,0.5"], "probability in (0, 0.5)"),
    (_scenario("realtime_loop") + ["--p", "-0.1"], "probability in (0, 0.5)"),
    (_scenario("fabric_scale") + ["--p", "nan"], "probability in (0, 0.5)"),
    # counts > 0: 0 never becomes the default
    (_scenario("realtime_loop") + ["--distance", "0"], "--distance"),
    (_scenario("realtime_loop") + ["--rounds", "0"], "whole number > 0"),
    (_scenario("realtime_loop") + ["--shots", "0"], "whole number > 0"),
    (_scenario("qec_memory") + ["--shots", "0"], "whole number > 0"),
    (_scenario("kv_disagg") + ["--num-requests", "0"], "whole number > 0"),
    (QLINK + ["sweep", "qec", "--shots", "0"], "whole number > 0"),
    (QLINK + ["sweep", "kv", "--tokens", "512,-1"], "whole number > 0"),
    # a stim circuit of one's own that is missing, or not a circuit the loop can run
    (QLINK + ["bench", "qec", "--stim", "missing.stim"], "does not exist"),
    (_scenario("realtime_loop") + ["--stim", "missing.stim"], "does not exist"),
    (_scenario("qec_memory") + ["--stim", "missing.stim"], "does not exist"),
    (QLINK + ["bench", "cudaq", "--transports", "ucx"], "valid: shm, tcp"),
    (QLINK + ["bench", "qec", "--stim", str(ROOT / "README.md"), "--distances", "5"], "not a valid stim circuit"),
    # a flag that does not apply to the subcommand
    (QLINK + ["bench", "transport", "--distances", "5"], "does not apply to `qlink bench transport`"),
    (QLINK + ["sweep", "kv", "--ps", "0.01"], "does not apply to `qlink sweep kv`"),
    (QLINK + ["run", "--transports", "shm"], "does not apply to `qlink run`"),
    (QLINK + ["doctor", "--quick"], "does not apply to `qlink doctor`"),
    # paths
    (QLINK + ["run", "--config", "missing.toml"], "does not exist"),
    (QLINK + ["bench", "kv", "--out", "a_file"], "is not a directory"),
    (_scenario("fabric_scale") + ["--service-json", "nope.json"], "does not exist"),
    # a bad config file: its checks, the same rules
    (QLINK + ["run", "--config", "bad.toml"], "must be odd"),
    # a sweep CSV that is not one
    (QLINK + ["sweep", "qec", "--distances", "3", "--ps", "0.01", "--csv", "bad.csv", "--no-progress"],
     "is not a sinter CSV"),
]


@pytest.mark.parametrize("argv,phrase", CASES, ids=[" ".join(Path(a).name for a in c[0][1:])[:60] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, phrase, tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "bad.toml").write_text("[qec]\ndistances = [4]\n")
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    r = _run(argv, tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert phrase in lines[0], lines[0]
    assert "error" in lines[0]
    assert not (tmp_path / "results").exists()  # nothing ran


def test_the_same_list_syntax_everywhere():
    from qlink._argparse import Parser
    from qlink.cli import build_parser
    from qlink.sweep.cli import add_arguments

    p = build_parser()
    for argv in (["5,7"], ["5", "7"], ["5, 7"], ["5,", "7"]):
        assert p.parse_args(["bench", "qec", "--distances", *argv]).distances == (5, 7)
    s = Parser(prog="s")
    add_arguments(s)
    assert s.parse_args(["qec", "--distances", "3", "5"]).distances == (3, 5)
    assert s.parse_args(["qec", "--ps", "0.001,0.002"]).ps == (0.001, 0.002)


def test_one_decoder_list():
    from qlink import checks
    from qlink.qec.decoders import BUILT_IN_DECODERS

    assert checks.decoder_names() == tuple(BUILT_IN_DECODERS)
    for name in BUILT_IN_DECODERS:
        assert checks.decoder(name, where="x") == name


def test_zero_is_refused_by_the_scenario_functions_too():
    from qlink import checks
    from qlink.paper import load_scenario

    rl = load_scenario("realtime_loop")
    for kw in ({"distance": 0}, {"rounds": 0}, {"num_shots": 0}, {"p": 0.0}):
        with pytest.raises(checks.UsageError):
            rl.run(out=None, progress=False, **kw)
    qm = load_scenario("qec_memory")
    for kw in ({"distances": ()}, {"ps": (0.0,)}, {"num_shots": 0}):
        with pytest.raises(checks.UsageError):
            qm.run(out=None, progress=False, plot=False, **kw)


def test_help_shows_examples_and_defaults_and_version(tmp_path):
    r = _run(QLINK + ["run", "--help"], tmp_path)
    assert r.returncode == 0
    assert "examples:" in r.stdout and "qlink run --quick" in r.stdout
    assert "(default: results/run)" in r.stdout
    r = _run(QLINK + ["bench", "qec", "--help"], tmp_path)
    assert "examples:" in r.stdout and "--distances" in r.stdout
    r = _run(_scenario("realtime_loop") + ["--help"], tmp_path)
    assert r.returncode == 0 and "examples:" in r.stdout and "(default: 0.001)" in r.stdout
    r = _run(QLINK + ["--version"], tmp_path)
    import qlink

    assert r.returncode == 0 and r.stdout.strip().startswith(f"qlink {qlink.__version__}")
