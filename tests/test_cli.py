"""The command line, run as a user runs it: in a subprocess, from a scratch working directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Small runs: a few steps of case14's test chronics, on one worker (each worker builds an env).
SMALL = ["--episodes", "2", "--workers", "1", "--max-iter", "5"]

AGENTS = """
from grid2op.Agent import BaseAgent


class Boom(BaseAgent):
    def act(self, observation, reward, done=False):
        if observation.current_step >= 2:
            raise ValueError("boom at step 2")
        return self.action_space({})


class Lazy(BaseAgent):
    def act(self, observation, reward, done=False):
        return self.action_space({})
"""


def _script() -> str:
    # The console script pip installed next to this interpreter, as a user's shell finds it.
    here = Path(sys.executable).parent / "asyncrunner"
    found = str(here) if here.exists() else shutil.which("asyncrunner")
    assert found, "the `asyncrunner` console script is not installed (pip install -e .)"
    return found


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=240)


def _table(stdout: str) -> list[list[str]]:
    lines = stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["index", "chronic"], stdout
    return [line.split() for line in lines[1:-1]]


@pytest.mark.slow
def test_run_plays_offline_and_saves_nothing(tmp_path: Path) -> None:
    done = _run(
        [_script(), "run", "--episodes", "2", "--workers", "2", "--max-iter", "5"], tmp_path
    )
    assert done.returncode == 0, done.stderr
    rows = _table(done.stdout)
    assert [row[:3] for row in rows] == [["0", "0000", "5/5"], ["1", "0001", "5/5"]]
    assert "2/2 episodes played, 0 failed, 10 steps" in done.stdout
    # Nothing but the data files of the test run's own coverage measurement (workers' included).
    assert [p for p in tmp_path.iterdir() if not p.name.startswith(".coverage")] == []


@pytest.mark.slow
def test_python_m_runs_an_agent_from_a_file_with_derived_seeds(tmp_path: Path) -> None:
    (tmp_path / "agents.py").write_text(AGENTS)
    command = [sys.executable, "-m", "asyncrunner", "run", "--agent", "agents.py:Lazy"]
    two = _run([*command, *SMALL, "--seed", "7"], tmp_path)
    assert two.returncode == 0, two.stderr
    header = two.stdout.splitlines()[0]
    assert "env seed" in header and "agent seed" in header
    rows = _table(two.stdout)
    seeds = [s for row in rows for s in row[4:6]]
    assert all(s.isdigit() for s in seeds) and len(set(seeds)) == 4
    # Episode i's seeds do not depend on how many episodes run.
    one = _run([*command, "-n", "1", "-w", "1", "--max-iter", "5", "--seed", "7"], tmp_path)
    assert one.returncode == 0, one.stderr
    assert _table(one.stdout) == rows[:1]


@pytest.mark.slow
def test_failed_episode_exits_1_with_the_agents_error(tmp_path: Path) -> None:
    (tmp_path / "agents.py").write_text(AGENTS)
    done = _run(
        [_script(), "run", *SMALL, "--agent", "agents:Boom", "--on-error", "continue"], tmp_path
    )
    assert done.returncode == 1
    rows = _table(done.stdout)
    assert [row[0] for row in rows] == ["0", "1"]
    assert all("ValueError: boom at step 2" in " ".join(row) for row in rows)
    assert "0/2 episodes played, 2 failed" in done.stdout


@pytest.mark.slow
def test_failed_episode_under_raise_shows_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "agents.py").write_text(AGENTS)
    done = _run([_script(), "run", *SMALL, "--agent", "agents:Boom"], tmp_path)
    assert done.returncode == 1
    assert "ValueError: boom at step 2" in done.stderr
    assert 'agents.py", line' in done.stderr  # where the user's agent raised


@pytest.mark.slow
def test_save_writes_one_folder_per_episode(tmp_path: Path) -> None:
    from grid2op.Episode import EpisodeData

    done = _run([_script(), "run", *SMALL, "--save", "runs"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()) == ["0000", "0001"]
    episodes = EpisodeData.list_episode(str(tmp_path / "runs"))
    assert sorted(name for _, name in episodes) == ["0000", "0001"]


def test_a_reader_that_leaves_ends_the_output_quietly(tmp_path: Path) -> None:
    # ``asyncrunner run | head -1``: the table's print met a closed pipe and Python printed a
    # BrokenPipeError traceback (found by the runtime hunt, one run in two). Here the pipe's
    # reader leaves before anything is written: the run plays and saves, the table's print
    # stops the command, quietly, with 1 as a pipe's writer does.
    with subprocess.Popen(
        [_script(), "run", *SMALL, "--save", "runs"],
        cwd=tmp_path,
        # block-buffered as in a shell (the print then succeeds; the flush at the end fails)
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()
        stderr = process.stderr.read()
        assert process.wait(timeout=240) == 1, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()) == ["0000", "0001"]


BAD = {
    "negative episodes": (["--episodes", "-1"], "--episodes"),
    "zero workers": (["--workers", "0"], "--workers"),
    "unknown grid2op agent": (["--agent", "NoSuchAgent"], "NoSuchAgent"),
    "unknown module": (["--agent", "no_such_module:Agent"], "no_such_module"),
    "missing agent file": (["--agent", "nowhere/agent.py:Agent"], "nowhere/agent.py"),
    "not an agent": (["--agent", "os:sep"], "os:sep"),
    "unknown env": (["--test", "no_such_env"], "no_such_env"),
    "episode id out of range": (["--episode-id", "99"], "99"),
    "no such chronic": (["--episode-id", "0003"], "no chronic of that name (0000, 0001, 0002)"),
    "ids and episodes disagree": (["--episode-id", "0", "1", "--episodes", "3"], "--episode-id"),
    "save into a file": (["--save", str(ROOT / "README.md")], "README.md"),
}


def _assert_one_line_error(code: Any, stdout: str, stderr: str, named: str) -> None:
    assert code == 2
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 2, stderr
    assert lines[0].startswith("asyncrunner run: error: ") and named in lines[0]
    assert "asyncrunner run --help" in lines[1]
    assert stdout == ""


@pytest.mark.parametrize(("args", "named"), BAD.values(), ids=BAD.keys())
def test_bad_arguments_give_one_line_and_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    named: str,
) -> None:
    from asyncrunner._cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *args])
    out, err = capsys.readouterr()
    _assert_one_line_error(exit_info.value.code, out, err, named)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # the same, from the console script a user's shell runs
def test_bad_arguments_from_the_console_script(tmp_path: Path) -> None:
    args, named = BAD["episode id out of range"]
    done = _run([_script(), "run", *args], tmp_path)
    _assert_one_line_error(done.returncode, done.stdout, done.stderr, named)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_no_command_points_to_run(tmp_path: Path) -> None:
    done = _run([_script()], tmp_path)
    assert done.returncode == 2
    assert "choose a command: run, show, score, bench" in done.stderr


@pytest.mark.slow
def test_example_script_runs(tmp_path: Path) -> None:
    script = ROOT / "examples" / "run_script.py"
    args = ["--episodes", "2", "--workers", "1", "--max-iter", "3"]
    done = _run([sys.executable, str(script), *args], tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    for i, line in enumerate(lines):
        assert line.startswith(f"episode {i}: chronic 000{i}, 3/3 steps, reward ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--episodes", "x"], "expected an integer, got 'x'"),
        (["--max-iter", "0"], "or -1 for no limit"),
        (["--agent", "grid2op.Agent:"], "expected module:Name or path/to/file.py:Name"),
        (["--agent", "grid2op.Agent:NoSuchAgent"], "has no attribute 'NoSuchAgent'"),
        (["--agent", "json:JSONDecoder"], "is not a grid2op BaseAgent subclass"),
        (["--agent", "no_such_module_here:Agent"], "no module named 'no_such_module_here'"),
        (["--agent", "missing.py:Agent"], "no such file 'missing.py'"),
        (["--episode-id", "0", "1", "--episodes", "3"], "gives 2 ids but --episodes is 3"),
        (["--test", "--episode-id", "0", "rte_case14_opponent"], "give it before --episode-id"),
        (["--scheduler", "tcp://127.0.0.1:1", "--dask-local", "2"], "choose one of"),
    ],
)
def test_bad_arguments_exit_2_with_what_to_do(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncrunner._cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "--help" in err  # one line, and where to read more


def test_an_agent_file_of_a_package_is_refused_with_its_module_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A starting kit's submission/agent.py importing `from .utils import pick`.
    package = tmp_path / "submission"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text("pick = 0\n")
    (package / "agent.py").write_text("from .utils import pick\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the command puts the file's folder in it)
    from asyncrunner._cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--agent", "submission/agent.py:MyAgent"])
    assert exit_info.value.code == 2
    assert "give it as a module, --agent submission.agent:MyAgent" in capsys.readouterr().err
    sys.modules.pop("agent", None)


def test_an_episode_id_that_is_a_chronic_s_name_is_that_chronic() -> None:
    # Chronics named 1..20 (sorted: 1, 10, 11, ...): `--episode-id 2` is the chronic "2", not
    # the third one, "11" (every env of grid2op's wheel names its chronics by position).
    from asyncrunner._cli._common import UsageError
    from asyncrunner._cli._settings import _episode_id

    names = sorted(str(i) for i in range(1, 21))
    assert _episode_id("2", names) == "2"
    assert _episode_id("19", names) == "19"
    assert _episode_id("0", names) == 0
    shown = r"name \(1, 10, 11, 12, 13, ...\) and none at that position \(0 to 19\)$"
    with pytest.raises(UsageError, match=shown):
        _episode_id("25", names)
    assert _episode_id("0001", None) == 1


def test_a_warning_under_a_command_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # (a Dask scheduler without workers: the user read our source line under it)
    import warnings

    from asyncrunner._cli import _main

    shown: list[str] = []

    def warns(argv: Any) -> int:
        shown.append(warnings.formatwarning("no workers yet", UserWarning, "_dask.py", 1, "..."))
        return 0

    monkeypatch.setattr(_main, "_command", warns)
    before = warnings.formatwarning
    assert _main.main(["run"]) == 0
    assert shown == ["asyncrunner: UserWarning: no workers yet\n"]
    assert warnings.formatwarning is before


def test_no_episode_id_hint_without_episode_ids(capsys: pytest.CaptureFixture[str]) -> None:
    # Every refusal of the runner ended with "(if '' is the env to play, give it before
    # --episode-id, ...)" when no --episode-id was given.
    from asyncrunner._cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--workers", "100000"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--workers 100000 asks for" in err and "--episode-id" not in err
    assert "CentralAgent" not in err and "executor=" not in err  # (Python's, not the CLI's)


def test_show_plots_each_episodes_rewards_over_the_steps_it_played(tmp_path: Path) -> None:
    # grid2op's rewards.npz pads an episode that ended early to the chronic's length: the plot
    # drew the padding as steps (a mutation audit found no test of it; both episodes end early).
    import matplotlib

    matplotlib.use("Agg")
    from grid2op.Agent import RandomAgent
    from grid2op.Runner import Runner

    from asyncrunner._cli._show import figure, read_run

    from .conftest import make_env
    from .helpers import grid2ops

    env = make_env("rte_case14_opponent")
    grid2ops(
        Runner(**env.get_params_for_runner(), agentClass=RandomAgent).run,
        nb_episode=2, path_save=str(tmp_path), max_iter=30, env_seeds=[11, 12],
        agent_seeds=[5, 6],
    )  # fmt: skip
    env.close()
    episodes = read_run(tmp_path)
    assert all(e.steps < e.max_steps for e in episodes)
    (reward,) = [
        ax for ax in figure(tmp_path, episodes).axes if ax.get_title() == "Cumulative reward"
    ]
    assert [len(line.get_xdata()) for line in reward.get_lines()] == [e.steps for e in episodes]
