"""examples/notebook.ipynb's charts, executed in a real kernel: one bar and one line per episode
(its 4 episodes play the test env's 3 chronics, so one chronic twice)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebook.ipynb"

# Run after the notebook's cells, in its kernel: what the two charts hold.
INSPECT = """
print(len(results), len({r.name for r in results}))
print(len(right.patches), len({t.get_text() for t in right.get_xticklabels()}))
print(len(left.get_lines()), len({t.get_text() for t in left.get_legend().get_texts()}))
"""


@pytest.mark.slow
def test_one_bar_and_one_line_per_episode(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.insert(len(nb.cells) - 1, nbformat.v4.new_code_cell(INSPECT))  # before env.close()
    client = nbclient.NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    pngs = [out["data"]["image/png"] for out in outputs if "image/png" in out.get("data", {})]
    assert len(pngs) == 1
    chart = tmp_path / "notebook-charts.png"
    chart.write_bytes(base64.b64decode(pngs[0]))
    print(f"charts: {chart}")
    printed = nb.cells[-2].outputs[0]["text"].split("\n")
    episodes, chronics = map(int, printed[0].split())
    assert episodes == 4 and chronics == 3  # a chronic played twice
    assert printed[1] == f"{2 * episodes} {episodes}"  # two bars and one label per episode
    assert printed[2] == f"{episodes} {episodes}"  # one line and one legend entry per episode
