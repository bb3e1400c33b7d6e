"""``qlink serve --decoder-config FILE``: a CUDA-Q multi_decoder_config served as-is over TCP."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import stim

from qlink.qec.cudaq_config import compile_cudaq_entry, dump_multi_decoder_config, multi_decoder_config_from_circuit

_ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine, peers", [("python", 1), ("native", 1), ("native", 2)])
def test_serve_decoder_config_answers_measurement_records(tmp_path, engine, peers):
    """(``--max-peers 2`` on the native engine: its sessions, two controllers one after the other.)"""
    import transports

    from qlink.qec.controller import Controller, SyndromeStream

    c = stim.Circuit.generated("repetition_code:memory", distance=5, rounds=4, after_clifford_depolarization=0.02)
    doc = multi_decoder_config_from_circuit(c, id=2)
    path = tmp_path / "decoders.yaml"
    dump_multi_decoder_config(doc, path)
    proc = subprocess.Popen([sys.executable, "-m", "qlink.cli", "serve", "--decoder-config", str(path),
                             "--url", "tcp://127.0.0.1:0", "--max-peers", str(peers), "--accept-timeout-s", "60",
                             "--engine", engine],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        url = None
        for line in proc.stdout:
            m = re.search(r"decoder service: (tcp://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the service never said where it listens"
        meas = c.compile_sampler(seed=3).sample(200).astype(np.uint8)
        _, obs = c.compile_m2d_converter().convert(measurements=meas.astype(bool), separate_observables=True)
        stream = SyndromeStream(detectors=meas, observables=obs.astype(np.uint8),
                                round_of_detector=np.zeros(meas.shape[1], np.int64))
        want = compile_cudaq_entry(doc["decoders"][0]).decode_batch(meas)
        for _ in range(peers):
            ep = transports.connect(url, timeout_s=30)
            try:
                res = Controller(ep, stream, decoder_id=2, rounds_per_frame=0, max_in_flight_shots=1).run(timeout_s=60)
            finally:
                ep.close()
            got = np.unpackbits(res.corrections, axis=1, count=1, bitorder="little")
            assert np.array_equal(got, want)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_a_malformed_config(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("decoders:\n  - id: 0\n    type: not-a-decoder\n")
    out = subprocess.run([sys.executable, "-m", "qlink.cli", "serve", "--decoder-config", str(path)],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 2
    assert "decoders[0].type" in out.stderr and "pymatching" in out.stderr


def test_serve_from_a_stim_file_writes_the_config_it_serves(tmp_path):
    c = stim.Circuit.generated("repetition_code:memory", distance=3, rounds=2, after_clifford_depolarization=0.02)
    circuit_path = tmp_path / "memory.stim"
    c.to_file(circuit_path)
    out_cfg = tmp_path / "written.yaml"
    # no controller comes: the service gives up accepting after a second, having written the config
    out = subprocess.run([sys.executable, "-m", "qlink.cli", "serve", "--stim", str(circuit_path), "--write-config",
                          str(out_cfg), "--accept-timeout-s", "1"], capture_output=True, text=True, timeout=120,
                         env=_env())
    from qlink.qec.cudaq_config import load_multi_decoder_config

    assert load_multi_decoder_config(out_cfg) == multi_decoder_config_from_circuit(c)
    assert "decoder service: tcp://" in out.stdout, out.stdout + out.stderr
    bad = subprocess.run([sys.executable, "-m", "qlink.cli", "serve", "--stim", str(tmp_path / "none.stim")],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert bad.returncode == 2 and "none.stim" in bad.stderr
