"""The notebooks: committed executed (a reader sees their outputs and plots without running them;
`python tools/execute_notebooks.py` refreshes them), they only import jaxspec (plus matplotlib for
plots and tempfile) and define nothing, and each one executes top to bottom on CPU through nbclient,
with the suite's temporary compilation cache."""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
ALLOWED_IMPORTS = {"jaxspec", "matplotlib", "tempfile"}
CELL_TIMEOUT_S = 300  # per cell; a whole notebook takes well under a minute on an idle 2-core CPU

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def code_cells(notebook) -> list[str]:
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_speculative_decoding.ipynb",
                                           "03_buckets_and_compile.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_executed_and_only_calls_jaxspec(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in cells] == list(range(1, len(cells) + 1)), \
        f"{path.name}: not executed top to bottom in one run (python tools/execute_notebooks.py)"
    assert any(cell.outputs for cell in cells), f"{path.name}: no outputs"
    errors = [out for cell in cells for out in cell.outputs if out.output_type == "error"]
    assert not errors, f"{path.name}: committed with an error output"
    text = nbformat.writes(notebook)
    assert "site-packages" not in text and str(REPO) not in text, f"{path.name}: an output names a local path"
    for source in code_cells(notebook):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module]
            else:
                names = []
            assert all(n.split(".")[0] in ALLOWED_IMPORTS for n in names), f"{path.name} imports {names}"
            assert not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Lambda)), \
                f"{path.name} defines a helper; helpers belong in the package"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    cache = os.environ.get("JAXSPEC_CACHE_DIR")
    assert cache, "tests/conftest.py points JAXSPEC_CACHE_DIR at a temporary directory"
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", cache)  # the kernel inherits the environment
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    errors = [out for cell in notebook.cells for out in cell.get("outputs", []) if out.output_type == "error"]
    assert not errors
    print(f"{path.name}: {seconds:.1f}s")
