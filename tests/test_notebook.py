"""examples/notebook.ipynb executed top to bottom by a real Jupyter kernel (nbclient + ipykernel)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.slow  # a Jupyter kernel running the whole notebook

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebook.ipynb"


def test_notebook_runs(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    errors = [out for out in outputs if out.output_type == "error"]
    assert not errors, [f"{e.ename}: {e.evalue}" for e in errors]
    data = [out.get("data", {}) for out in outputs]
    # The progress bar rendered as a notebook widget, the table as HTML, the plot as a PNG.
    assert any("application/vnd.jupyter.widget-view+json" in d for d in data)
    assert any("<table" in d.get("text/html", "") for d in data)
    assert any("image/png" in d for d in data)
    nbformat.write(nb, tmp_path / "executed.ipynb")  # kept as a test artifact
