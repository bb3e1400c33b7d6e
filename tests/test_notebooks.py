"""Every notebook in notebooks/ runs top to bottom (QUICK parameters) in a kernel of this
interpreter; a cell that raises fails the test. Committed notebooks carry no outputs."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook tests need nbformat (pip install 'qlink[notebooks]')")
nbclient = pytest.importorskip("nbclient", reason="the notebook tests need nbclient (pip install 'qlink[notebooks]')")
pytest.importorskip("ipykernel", reason="the notebook tests need ipykernel (pip install 'qlink[notebooks]')")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "qlink-test-python"


def _code(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_realtime_qec_loop.ipynb", "02_kv_transfer_disaggregated.ipynb",
            "03_cross_domain_budgets.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs_parameters_first_and_no_definitions(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "strip outputs before committing"
    first = code[0]
    assert "parameters" in first.metadata.get("tags", []) and "QUICK = True" in first.source
    for c in code:  # the logic lives in qlink: cells call it, they define nothing
        src = "\n".join(ln for ln in c.source.splitlines() if not ln.lstrip().startswith("%"))
        tree = ast.parse(src)
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
    assert any("import qlink" in s or "from qlink" in s for s in _code(nb))


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """A kernelspec of this very interpreter, installed into a temporary prefix."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(kernel_name=KERNEL, display_name="qlink tests", prefix=str(prefix))
    return prefix / "share" / "jupyter"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, kernel_dir, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(kernel_dir), os.environ.get("JUPYTER_PATH")])))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=240,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the cell that failed
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2, "plots render inline"
    executable = nb.cells[-1].outputs[0].text.strip()
    assert Path(executable).resolve() == Path(sys.executable).resolve()
