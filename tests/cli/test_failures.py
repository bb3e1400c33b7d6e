"""A measurement that fails makes the command exit non-zero and says which one failed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failed_measurement_exits_1_and_is_listed(tmp_path):
    pytest.importorskip("ucxx")
    # a UCX that may use no transport at all: the ucx measurement really fails
    env = dict(os.environ, UCX_TLS="no-such-transport",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "qlink.cli", "bench", "qec", "--quick", "--distances", "5",
                        "--transports", "ucx", "--out", str(tmp_path)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    # two measurements of ucx failed: the native rows (the link itself) and the Python engine's row
    assert "qlink bench qec: 2 measurement(s) failed" in r.stderr
    tail = r.stderr[r.stderr.index("measurement(s) failed"):]
    lines = tail.strip().splitlines()
    assert "Traceback" not in tail and len(lines) == 3  # the summary line + one line a failure
    assert all("bench qec (ucx" in line for line in lines[1:]), lines
    assert "peer process exited" in r.stderr  # said at once, not after a minute's wait on an empty queue
    assert (tmp_path / "qec.json").is_file()  # what was measured is still written


def test_finish_lists_failures(capsys):
    from qlink.cli import _finish

    assert _finish("qlink x", [], False) == 0
    assert _finish("qlink x", ["a: broke", "b: broke"], True) == 1
    err = capsys.readouterr().err
    assert "2 measurement(s) failed (--keep-going)" in err and "  - a: broke" in err
