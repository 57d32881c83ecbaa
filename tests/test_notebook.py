"""A real Jupyter kernel (ipykernel): examples/notebook.ipynb executed top to bottom (nbclient),
and a kernel quit while a run plays."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.slow  # a Jupyter kernel each

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


_RUN_LEFT_GOING = """
import asyncio, glob, os, time
import grid2op
from grid2op.Agent import DoNothingAgent
from lightsim2grid import LightSimBackend
from asyncrunner import AsyncRunner

class Slow(DoNothingAgent):
    def act(self, observation, reward, done=False):
        time.sleep(0.05)
        return super().act(observation, reward, done)

env = grid2op.make("l2rpn_case14_sandbox", test=True, backend=LightSimBackend())
runner = AsyncRunner(env, agent=Slow, workers=2)
await runner.__aenter__()
await runner.run(2, max_iter=3)
task = asyncio.create_task(runner.run(4, max_iter=60, path_save=SAVE))
await asyncio.sleep(1)
assert glob.glob(os.path.join(SAVE, ".asyncrunner-tmp-*")), "no work in progress"
assert glob.glob(os.path.join(os.environ["TMPDIR"], "asyncrunner-*")), "no channel folder"
"""


def test_quitting_the_kernel_during_a_run_leaves_no_work_in_progress(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # quit() in a cell stops the kernel's event loop with the run's task still going, never
    # cancelled: none of the run's cleanup ran, and its hidden stage folder stayed in path_save
    # (grid2viz cannot open it) and its channel's folder in the temporary folder.
    from jupyter_client.manager import start_new_kernel

    save = tmp_path / "save"
    # (short: under a long one, as pytest's folders of xdist's workers, the channel's socket
    # path would not fit and the run would put it in /tmp)
    tmp = Path(tempfile.mkdtemp(dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    path = os.pathsep.join([str(NOTEBOOK.parents[1]), os.environ.get("PYTHONPATH", "")])
    manager, client = start_new_kernel(
        kernel_name="python3", env={**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp)}
    )
    try:
        reply = client.execute_interactive(
            _RUN_LEFT_GOING.replace("SAVE", repr(str(save))), timeout=120
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        client.execute("quit()")
        deadline = time.monotonic() + 60
        while manager.is_alive():
            assert time.monotonic() < deadline, "the kernel did not quit"
            time.sleep(0.1)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert [p.name for p in save.iterdir() if p.name.startswith(".")] == []
    assert list(tmp.glob("asyncrunner-*")) == []
