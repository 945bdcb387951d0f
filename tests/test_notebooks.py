"""The notebooks run top to bottom: each is executed in a fresh python3 kernel (this interpreter's
environment) and any cell that raises fails the test. Committed notebooks keep their outputs
cleared; that is checked too."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import requires_default_model

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def _execute(path: pathlib.Path) -> nbformat.NotebookNode:
    notebook = nbformat.read(path, as_version=4)
    # kernel "python3" resolves to this interpreter (jupyter_client swaps `python` for
    # sys.executable), so the kernel sees the same venv and the same installed jaxspec.
    client = NotebookClient(notebook, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the cell and its traceback
    return notebook


@pytest.mark.parametrize("name", ["quickstart.ipynb"])
def test_committed_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{name}: commit notebooks with outputs cleared")


@requires_default_model
@pytest.mark.real_model
def test_quickstart_runs():
    notebook = _execute(NOTEBOOKS / "quickstart.ipynb")
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "identical tokens: True" in text
    assert "tau" in text and "acceptance" in text
    assert any("image/png" in out.get("data", {}) for out in outputs), "the acceptance plot was not drawn"
