"""Every Python block of README.md runs as written when saved to a file and run as a script."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("code", [pytest.param(b, marks=[pytest.mark.slow] if "run_loop(" in b else [],
                                               id=f"block{i}") for i, b in enumerate(BLOCKS)])
def test_readme_block_runs_as_a_script(code, tmp_path):
    if re.search(r"^\s*from vllm\b|^\s*import vllm\b", code, flags=re.M) and importlib.util.find_spec("vllm") is None:
        pytest.skip("a vLLM example: vLLM lives in .venv-vllm (make vllm-env), whose tests run it for real")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    if "print(" in code:
        assert r.stdout.strip()
    if "run_loop(" in code:
        assert "keeps up:" in r.stdout and "LER " in r.stdout
