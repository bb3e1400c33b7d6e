"""The import contract in pyproject.toml ([tool.importlinter]) holds, and it would catch a
broken one: a lower layer importing a higher one, a private module imported from another
package, an import cycle."""

import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")

pytestmark = pytest.mark.skipif(LINT is None, reason="import-linter is not installed (pip install -e '.[test]')")


def _lint(cwd: Path, *, config: Path | None = None) -> subprocess.CompletedProcess:
    args = [LINT, "--no-cache"] + (["--config", str(config)] if config else [])
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_import_contract_holds():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_every_ignore_entry_says_why():
    text = (ROOT / "pyproject.toml").read_text()
    for contract in _contracts():
        for entry in contract.get("ignore_imports", []):
            line = next(ln for ln in text.splitlines() if entry in ln)
            assert "#" in line, f"ignore entry {entry!r} of contract {contract['id']!r} has no reason beside it"


def test_every_module_of_qlink_has_a_layer():
    import pkgutil

    import qlink

    (layers,) = [c["layers"] for c in _contracts() if c["type"] == "layers"]
    named = {m.strip() for layer in layers for m in layer.replace("|", ":").split(":")}
    top = {f"qlink.{m.name}" for m in pkgutil.iter_modules(qlink.__path__)} - {"qlink.conftest"}
    assert top - named == set(), f"modules with no layer in pyproject.toml: {sorted(top - named)}"
    assert "transports" in named


def _throwaway(tmp_path: Path, bad: str) -> Path:
    """A package ``pkg`` laid out like qlink (low, core, high) plus one bad import, and a
    config with the same three kinds of contract as pyproject.toml."""
    pkg = tmp_path / "pkg"
    (pkg / "high").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("X = 1\n")
    (pkg / "core.py").write_text("from pkg import low\n")
    (pkg / "high" / "__init__.py").write_text("from pkg import core\n")
    (pkg / "high" / "_inner.py").write_text("Y = 2\n")
    (pkg / "bad.py").write_text(bad)
    cfg = tmp_path / "contracts.toml"
    cfg.write_text(textwrap.dedent("""
        [tool.importlinter]
        root_packages = ["pkg"]

        [[tool.importlinter.contracts]]
        id = "layers"
        name = "layers"
        type = "layers"
        layers = ["pkg.high", "pkg.core", "pkg.low"]

        [[tool.importlinter.contracts]]
        id = "private"
        name = "private"
        type = "private_modules"

        [[tool.importlinter.contracts]]
        id = "acyclic"
        name = "acyclic"
        type = "acyclic_siblings"
        ancestors = ["pkg"]
    """))
    return cfg


def test_the_throwaway_package_passes_without_the_bad_import(tmp_path):
    cfg = _throwaway(tmp_path, "")
    out = _lint(tmp_path, config=cfg)
    assert out.returncode == 0, out.stdout[-3000:]


def test_a_lower_layer_importing_a_higher_one_is_caught(tmp_path):
    cfg = _throwaway(tmp_path, "")
    (tmp_path / "pkg" / "low.py").write_text("X = 1\n\n\ndef late():\n    from pkg import high\n    return high\n")
    out = _lint(tmp_path, config=cfg)
    assert out.returncode != 0
    assert "layers BROKEN" in out.stdout, out.stdout[-3000:]
    assert "pkg.low -> pkg.high" in out.stdout


def test_a_private_module_of_another_package_is_caught(tmp_path):
    cfg = _throwaway(tmp_path, "from pkg.high import _inner\n")
    out = _lint(tmp_path, config=cfg)
    assert out.returncode != 0
    assert "private BROKEN" in out.stdout, out.stdout[-3000:]
    assert "pkg.bad -> pkg.high._inner" in out.stdout


def test_a_cycle_is_caught(tmp_path):
    cfg = _throwaway(tmp_path, "from pkg import low\n")
    (tmp_path / "pkg" / "low.py").write_text("X = 1\n\n\ndef late():\n    from pkg import bad\n    return bad\n")
    out = _lint(tmp_path, config=cfg)
    assert out.returncode != 0
    assert "acyclic BROKEN" in out.stdout, out.stdout[-3000:]
