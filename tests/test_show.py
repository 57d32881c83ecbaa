"""``asyncrunner show DIR [--plot FILE.png]``, run as a user runs it (subprocesses), on a folder
saved by ``asyncrunner run --save`` and on one saved by grid2op's own Runner."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from .conftest import make_env

pytestmark = pytest.mark.slow  # the CLI in subprocesses

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncrunner", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    assert lines[0].split()[:2] == ["episode", "chronic"], stdout
    table = [line for line in lines[1:] if " episodes, " not in line and "plot written" not in line]
    return {line.split()[0]: line.split() for line in table}


def test_show_our_run_and_plot(tmp_path: Path) -> None:
    played = _cli(
        "run", "--episodes", "2", "--workers", "1", "--max-iter", "7", "--save", "out", cwd=tmp_path
    )
    assert played.returncode == 0, played.stderr
    shown = _cli("show", "out", "--plot", "run.png", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    rows = _rows(shown.stdout)
    assert sorted(rows) == ["0000", "0001"]
    for row in rows.values():
        assert row[2] == "7/7" and row[-1] == "no"  # steps/max, game over
    assert "2 episodes, 14 steps, 0 game over" in shown.stdout
    assert "plot written to run.png" in shown.stdout
    png = tmp_path / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_show_grid2op_runner_folder(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from grid2op.Agent import DoNothingAgent
    from grid2op.Runner import Runner

    env = make_env()
    try:
        runner = Runner(**env.get_params_for_runner(), agentClass=DoNothingAgent)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = runner.run(nb_episode=2, max_iter=5, path_save=str(tmp_path / "g2op"))
    finally:
        env.close()
    shown = _cli("show", "g2op", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    rows = _rows(shown.stdout)
    assert len(rows) == 2
    for _, name, cum_reward, nb_time_step, max_ts in results:
        row = rows[name]
        assert row[2] == f"{nb_time_step}/{max_ts}"
        assert float(row[3]) == pytest.approx(cum_reward, abs=0.01)


def test_show_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for args, expected in [
        (["show", "missing"], "no such folder"),
        (["show", "empty"], "no saved episode"),
        (["show", "empty", "--plot", "x.jpg"], "PNG"),
        (["show"], "required"),
    ]:
        done = _cli(*args, cwd=tmp_path)
        assert done.returncode == 2, (args, done.stderr)
        assert expected in done.stderr and "Traceback" not in done.stderr
        assert "asyncrunner show --help" in done.stderr
