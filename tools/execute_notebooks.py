#!/usr/bin/env python
"""Execute the notebooks in place, so that the committed files show their outputs and plots.

usage: python tools/execute_notebooks.py [NOTEBOOK ...]   (default: every notebooks/*.ipynb)

Each notebook runs top to bottom in a fresh python3 kernel with the repository on PYTHONPATH, from
a temporary working directory (the notebooks write nothing into the repository). A cell that
raises stops the run and leaves the file unchanged. Uses nbformat and nbclient (the test extras).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat

REPO = Path(__file__).resolve().parents[1]


def execute(path: Path) -> float:
    notebook = nbformat.read(path, as_version=4)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": work}}).execute()
    nbformat.write(notebook, path)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or sorted((REPO / "notebooks").glob("*.ipynb"))
    for path in paths:
        print(f"{path.name}: executed in {execute(path):.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
