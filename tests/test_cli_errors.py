"""Where a new user trips: every bad input of ``asyncrunner run`` / ``show`` is one line on stderr,
exit 2, no traceback, and quick (before any env is built, no network); failed episodes say where
their traceback is; an interrupted run says how to resume it; ``show`` tells runs apart.

Most cases call the CLI's ``main(argv)`` in this process (fast); the subprocess ones are slow.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from grid2op.Agent import BaseAgent

from asyncrunner._cli import main

# Generous: catches a network retry loop (~20 s) or a Dask connect timeout (~90 s), not jitter.
QUICK = 20.0
SMALL = ["--episodes", "1", "--workers", "1", "--max-iter", "5"]

AGENTS = """
from grid2op.Agent import BaseAgent


class Boom(BaseAgent):
    def act(self, observation, reward, done=False):
        if observation.current_step >= 3:
            raise ValueError("boom at step 3")
        return self.action_space({})


class NoWeights(Boom):
    def __init__(self, action_space):
        raise FileNotFoundError("no weights file")
"""

# Booms from its worker's second episode on (a worker keeps its module).
SECOND_EPISODE_BOOMS = """

class SecondBooms(Boom):
    episodes = 0

    def reset(self, observation):
        type(self).episodes += 1

    def act(self, observation, reward, done=False):
        if type(self).episodes < 2:
            return self.action_space({})
        return super().act(observation, reward, done)
"""


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str, float]:
    """Exit status, stdout, stderr and wall time of ``asyncrunner ARGV`` run in this process."""
    start = time.perf_counter()
    try:
        code: Any = main(argv)
    except SystemExit as exc:
        code = exc.code
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    return int(code), out, err, elapsed


def _usage_error(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str], prog: str = "run"
) -> str:
    code, out, err, elapsed = _main(argv, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    # The error in one line, then the usual pointer to --help.
    assert len(lines) == 2, err
    assert lines[0].startswith(f"asyncrunner {prog}: error: "), err
    assert expected in lines[0], err
    assert "--help" in lines[1]
    assert out == ""
    assert elapsed < QUICK, f"took {elapsed:.1f} s"
    return lines[0]


# --- item 3: a save folder that cannot be written ----------------------------------------------


def test_save_under_a_file_is_refused_before_the_env_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile.txt").write_text("")
    target = tmp_path / "afile.txt" / "sub"
    _usage_error(["run", *SMALL, "--save", str(target)], "is a file, not a folder", capsys)


@pytest.mark.parametrize(
    ("folder", "expected"),
    [
        ("", "--save is an empty path: give a folder"),  # "--save $OUT", OUT unset
        ("/proc/asyncrunner-runs", "cannot be created"),  # /proc takes no new folder, even for root
        ("/proc", "is not writable"),  # exists, and os.access says writable as root
        ("/sys", "is not writable"),
    ],
)
def test_save_where_nothing_can_be_written_is_refused(
    folder: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _usage_error(["run", *SMALL, "--save", folder], expected, capsys)
    assert "--save" in line


def test_path_save_checks_real_writability(tmp_path: Path) -> None:
    from asyncrunner._plan._arguments import check_path_save

    with pytest.raises(ValueError, match="is not writable"):
        check_path_save("/sys")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        (tmp_path / "f").write_text("")
        check_path_save(tmp_path / "f" / "a" / "b")
    assert not (tmp_path / "f").is_dir()
    with pytest.raises(TypeError, match=r"`path_save` must be a folder path .*got int 123"):
        check_path_save(123)  # type: ignore[arg-type]
    # A writable folder keeps no trace of the probe.
    assert os.listdir(check_path_save(tmp_path / "ok")) == []


@pytest.mark.anyio
async def test_run_rejects_an_unwritable_path_save_before_any_episode(
    anyio_backend: str, env: Any
) -> None:
    from grid2op.Agent import DoNothingAgent

    from asyncrunner import AsyncRunner
    from asyncrunner.sinks import CallbackSink

    events: list[Any] = []
    async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
        with pytest.raises(ValueError, match="`path_save` '/sys' is not writable"):
            await runner.run(1, path_save="/sys", max_iter=2, sinks=[CallbackSink(events.append)])
        with pytest.raises(TypeError, match="must be a folder path"):
            await runner.run(1, path_save=123, max_iter=2)  # type: ignore[arg-type]
    assert events == []


# --- item 5: a typo in the env name --------------------------------------------------------------


@pytest.mark.parametrize("test_flag", [[], ["--test"]])
def test_env_name_typo_suggests_the_closest_name_offline(
    test_flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    line = _usage_error(
        ["run", *SMALL, *test_flag, "l2rpn_case14_sandbx"],
        "unknown env 'l2rpn_case14_sandbx': did you mean 'l2rpn_case14_sandbox'?",
        capsys,
    )
    assert "--test" not in line or test_flag  # "add --test" was no help
    assert "make('l2rpn_case14_sandbx')" not in line  # (the download advice repeated the typo)


def test_an_env_name_like_no_known_one_is_the_name_to_download(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # No close match: the download advice names the env as given (a typo's names <its name>).
    line = _usage_error(
        ["run", *SMALL, "--no-test", "qqqq_zzzz"],
        "unknown env 'qqqq_zzzz': (known offline: grid2op's test envs and the folders in ",
        capsys,
    )
    assert line.endswith("dataset, run grid2op.make('qqqq_zzzz') once)")


def test_a_test_env_name_without_test_is_refused_offline(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Not downloaded: grid2op would try the network (about 12 s of retries offline).
    monkeypatch.setattr("grid2op.get_current_local_dir", lambda: str(tmp_path))
    _usage_error(
        ["run", *SMALL, "--no-test", "rte_case14_realistic"],
        "env 'rte_case14_realistic' is not downloaded (not in "
        + repr(str(tmp_path))[1:-1]
        + "): add --test for the small copy shipped with grid2op",
        capsys,
    )


def test_missing_env_folder_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    _usage_error(["run", *SMALL, "no/such/env"], "no env folder 'no/such/env'", capsys)


# --- item 6: agents that cannot be loaded, a scheduler that is not there ------------------------


def test_agent_file_with_a_syntax_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "syntax_error_agent.py"
    bad.write_text("from grid2op.Agent import BaseAgent\nclass A(BaseAgent)\n    pass\n")
    line = _usage_error(["run", *SMALL, "--agent", f"{bad}:A"], "SyntaxError", capsys)
    assert "line 2" in line


def test_agent_file_raising_at_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "raising_agent.py"
    bad.write_text("x = 1\nraise RuntimeError('no GPU here')\n")
    line = _usage_error(["run", *SMALL, "--agent", f"{bad}:A"], "RuntimeError: no GPU here", capsys)
    assert "raising_agent.py, line 2" in line


@pytest.mark.parametrize(
    ("spec", "hint"),
    [
        ("RandomAgent()", "did you mean 'RandomAgent'? "),  # a call
        ("randomagnt", "did you mean 'RandomAgent'? "),  # a typo
        ("grid2op.Agent.RandomAgent", "did you mean 'RandomAgent'? "),  # its module
        ("Foo", ""),
    ],
)
def test_an_unknown_agent_name_suggests_grid2ops_closest(
    spec: str, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _usage_error(
        ["run", *SMALL, "--agent", spec],
        f"--agent {spec!r}: not an agent in grid2op.Agent; {hint}your own agent: module:Name",
        capsys,
    )


def test_abstract_agent_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    _usage_error(["run", *SMALL, "--agent", "BaseAgent"], "is abstract", capsys)


def test_abstract_agent_is_refused_by_the_runner(env: Any) -> None:
    from grid2op.Agent import BaseAgent

    from asyncrunner import AsyncRunner

    with pytest.raises(TypeError, match="BaseAgent is abstract"):
        AsyncRunner(env, agent=BaseAgent)


class _NeedsWeights(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    def __init__(self, action_space: Any, weights: str) -> None:
        super().__init__(action_space)
        self.weights = weights

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return self.action_space({})


def test_agent_needing_more_than_the_action_space_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = tmp_path / "needs.py"
    agent.write_text(
        "from grid2op.Agent import BaseAgent\n"
        "class Needs(BaseAgent):\n"
        "    def __init__(self, action_space, weights):\n"
        "        super().__init__(action_space)\n"
        "    def act(self, observation, reward, done=False):\n"
        "        return self.action_space({})\n"
    )
    err = _usage_error(
        ["run", *SMALL, "--agent", f"{agent}:Needs"],
        "agent class Needs cannot be called with the env's action space alone",
        capsys,
    )
    # What to do, on a command line: no Python expression to type.
    assert "make_agent = functools.partial(MyAgent" in err and "--agent module:make_agent" in err


@pytest.mark.parametrize(
    ("agent", "what"),
    [
        (_NeedsWeights, "agent class _NeedsWeights"),
        (lambda: None, "agent factory <lambda>"),
        (lambda action_space, weights: None, "agent factory <lambda>"),
    ],
)
def test_agent_needing_more_than_the_action_space_is_refused_by_the_runner(
    env: Any, agent: Any, what: str
) -> None:
    from asyncrunner import AsyncRunner

    with pytest.raises(TypeError, match=f"{what} cannot be called with the env's action space"):
        AsyncRunner(env, agent=agent)


class _PolicyWrapper:
    """Not a BaseAgent, with what an episode calls: it plays."""

    def __init__(self, action_space: Any) -> None:
        self.action_space = action_space

    def seed(self, seed: Any) -> None:
        pass

    def reset(self, observation: Any) -> None:
        pass

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return self.action_space({})


def test_a_factory_returning_no_agent_fails_its_episodes_saying_so(env: Any) -> None:
    import anyio

    from asyncrunner import AsyncRunner, EpisodeError

    async def main() -> None:
        async with AsyncRunner(env, agent=lambda action_space: 42, workers=1) as runner:
            with pytest.raises(EpisodeError) as caught:
                await runner.run(1, max_iter=5)
        assert "returned int, not an agent (no seed, reset and act)" in str(caught.value)
        async with AsyncRunner(env, agent=lambda space: _PolicyWrapper(space), workers=1) as runner:
            (played,) = await runner.run(1, max_iter=5)
        assert (played.nb_time_step, played.error) == (5, None)

    anyio.run(main)


def test_unreachable_scheduler_fails_fast(capsys: pytest.CaptureFixture[str]) -> None:
    _usage_error(
        ["run", *SMALL, "--scheduler", "tcp://127.0.0.1:1"],
        "no Dask scheduler reachable there",
        capsys,
    )


@contextlib.contextmanager
def _listener(greeting: bytes | None) -> Iterator[str]:
    """A TCP server on this machine that greets each connection with ``greeting`` (None: says
    nothing, as an HTTP server), at its ``tcp://`` address."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        accepted: list[socket.socket] = []

        def serve() -> None:
            with contextlib.suppress(OSError):
                connection, _ = server.accept()
                accepted.append(connection)
                if greeting is not None:
                    connection.sendall(greeting)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield f"tcp://127.0.0.1:{server.getsockname()[1]}"
        finally:
            thread.join(10)
            for connection in accepted:
                connection.close()


def test_a_scheduler_address_where_no_dask_scheduler_answers_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from asyncrunner._pools._dask import unreachable

    # An SSH server: Dask's client read its greeting as a message length (2.82 EiB) and failed
    # with a traceback.
    with _listener(b"SSH-2.0-OpenSSH_9.6\r\n") as address:
        _usage_error(
            ["run", *SMALL, "--scheduler", address],
            f"--scheduler {address}: no Dask scheduler reachable there (something answered "
            "b'SSH-2.0-'..., not a Dask scheduler's greeting)",
            capsys,
        )
    # An IPv6 address without a port is Dask's default port's, not a port "1]".
    assert "invalid literal" not in str(unreachable("tcp://[::1]", timeout=0.2))
    # An HTTP server (the dashboard's port): Dask's client waited for ever.
    with _listener(None) as address:
        assert unreachable(address, timeout=0.2) == (
            "something listens there but does not greet as a Dask scheduler does: a "
            "dashboard's port?"
        )


def test_a_save_folder_under_home_written_with_a_tilde_is_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The shell leaves "~" as it is after "--save=": the run saved in a folder named "~" here,
    # and did not say where.
    home, here = tmp_path / "home", tmp_path / "here"
    here.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    code, out, err, _ = _main(["run", *SMALL, "--save=~/runs"], capsys)
    assert code == 0, err
    assert (home / "runs" / "0000").is_dir() and not (here / "~").exists()
    assert out.splitlines()[-1].endswith(f"; saved in {home / 'runs'}")


def test_resume_needs_save(capsys: pytest.CaptureFixture[str]) -> None:
    _usage_error(["run", *SMALL, "--resume"], "--resume needs --save DIR", capsys)


def test_score_refusals_are_one_line_before_any_episode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    score = ["score", "--agent", "DoNothingAgent", "--nb-scenario", "1", "--max-step", "5"]
    taken = tmp_path / "a_file"
    taken.write_text("")
    _usage_error(
        [*score, "--competition", "l2rpn_2020", "--cache-dir", str(taken)],
        "--cache-dir " + repr(str(taken)) + " is a file",  # the option, not score()'s argument
        capsys,
        prog="score",
    )
    _usage_error(
        [*score[:3], "--nb-scenario", "99", "--competition", "l2rpn_2020"],
        "--nb-scenario is 99 but the env has 3 scenarios",
        capsys,
        prog="score",
    )
    seeded = ["score", "--agent", "DoNothingAgent", "--competition", "l2rpn_2020", "--seed", "3"]
    _usage_error(
        [*seeded, "no_such_env"],
        "--seed needs --nb-scenario N",  # before the env (here, an unknown one) is looked at
        capsys,
        prog="score",
    )
    # grid2op's class refuses the env (no alarms on l2rpn_case14_sandbox), saying to change its
    # reward class: which env to score instead.
    line = _usage_error(
        [*score, "--competition", "icaps_2021", "--cache-dir", str(tmp_path / "cache")],
        "icaps_2021 on this env: Grid2OpException",  # then grid2op's words (they vary)
        capsys,
        prog="score",
    )
    assert line.endswith("an env with an attention budget, such as l2rpn_icaps_2021.")


# --- item 7: failures that say what happened and where the traceback is -------------------------


def _agents(tmp_path: Path, stem: str) -> str:
    # One module name per test: an agent module is imported once per process.
    path = tmp_path / f"{stem}.py"
    path.write_text(AGENTS)
    return f"{path}:Boom"


def test_failed_row_names_its_chronic_and_length_and_the_traceback_is_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", *SMALL, "--agent", _agents(tmp_path, "boom_continue"), "--on-error", "continue"]
    code, out, err, _ = _main(argv, capsys)
    assert code == 1
    row = out.splitlines()[1].split()
    assert row[:3] == ["0", "0000", "3/5"]  # not "-" and "3/?"
    assert "episode 0 (0000) failed after 3 steps: ValueError: boom at step 3" in err
    assert 'boom_continue.py", line' in err and "Traceback" in err


def test_an_episode_failing_before_it_starts_names_its_chronic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = f"{tmp_path / 'no_weights.py'}:NoWeights"
    _agents(tmp_path, "no_weights")
    argv = ["run", "--episodes", "2", "--workers", "1", "--max-iter", "5", "--agent", agent]
    code, out, err, _ = _main([*argv, "--episode-id", "0002", "1"], capsys)
    assert code == 1
    assert out.splitlines()[1].split()[:3] == ["0", "0002", "0/?"]  # not "-"
    assert "episode 0 (0002) failed after 0 steps: FileNotFoundError: no weights file" in err
    code, out, err, _ = _main([*argv, "--on-error", "continue"], capsys)
    assert code == 1
    assert [line.split()[:2] for line in out.splitlines()[1:3]] == [["0", "0000"], ["1", "0001"]]


def test_failed_score_names_the_agent_whose_episode_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "score", "--agent", "DoNothingAgent", "--agent", _agents(tmp_path, "boom_score"),
        "--competition", "l2rpn_2020", "--nb-scenario", "1", "--max-step", "5",
        "--workers", "1", "--cache-dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    code, _, err, _ = _main(argv, capsys)
    assert code == 1
    assert "episode 0 failed after 3 steps: ValueError: boom at step 3" in err
    assert err.rstrip().endswith("(scenario 0 of agent 'Boom')")


def test_failed_row_under_raise_names_its_chronic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err, _ = _main(["run", *SMALL, "--agent", _agents(tmp_path, "boom_raise")], capsys)
    assert code == 1
    assert out.splitlines()[1].split()[:3] == ["0", "0000", "3/5"]
    assert "failed after 3 steps" in err and "failed at step" not in err
    # The episodes not played once one failed are counted too.
    argv = ["run", "--episodes", "3", "--workers", "1", "--max-iter", "5"]
    agent = ["--agent", _agents(tmp_path, "boom_raise3")]
    code, out, err, _ = _main([*argv, *agent], capsys)
    assert code == 1
    assert out.splitlines()[-1].startswith("0/3 episodes played, 1 failed, 2 cancelled, ")
    # Saved, it says what is kept and how to play the rest (as after Ctrl-C).
    save = ["--save", str(tmp_path / "runs")]
    code, out, err, _ = _main([*argv, *agent, *save], capsys)
    assert code == 1
    resume = shlex.join(["asyncrunner", *argv, *agent, *save, "--resume"])
    assert err.splitlines()[-1] == (
        f"asyncrunner: 0 saved in {tmp_path / 'runs'}; once fixed, play the other 3 with: {resume}"
    )


def test_a_multimix_run_names_each_rows_mix_and_counts_every_mix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "l2rpn_neurips_2020_track2", "--test", "-n", "1", "-w", "2", "--max-iter", "3"]
    code, out, err, _ = _main([*argv, "--save", str(tmp_path / "mm")], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["index", "mix", "chronic"]
    assert [line.split()[:3] for line in lines[1:3]] == [["0", "x1", "001"], ["1", "x2.5", "001"]]
    assert lines[3].startswith("2/2 episodes played, 0 failed, 6 steps")
    # show reads the folder of each mix (path_save/<mix>/<chronic>), as a score's of each agent.
    code, out, err, _ = _main(["show", str(tmp_path / "mm")], capsys)
    assert code == 0, err
    assert [line.split()[:3] for line in out.splitlines()[1:3]] == [
        ["x1/001", "001", "3/3"],
        ["x2.5/001", "001", "3/3"],
    ]
    _usage_error(
        ["show", str(tmp_path / "mm" / "x1" / "001")],
        f"is one episode's folder: give the folder it was saved in ({tmp_path / 'mm' / 'x1'})",
        capsys,
        "show",
    )
    # A failure names its mix: every mix has a chronic 001.
    boom = ["--agent", _agents(tmp_path, "boom_mixes"), "--on-error", "continue"]
    code, out, err, _ = _main([*argv[:-1], "5", *boom], capsys)
    assert code == 1
    assert "episode 1 (x2.5/001) failed after 3 steps: ValueError: boom at step 3" in err
    # The failure that stops a seeded run, in a mix but the first: its row, its mix and seeds
    # (each mix plays the seeds asked), not an IndexError (found by the third mutation audit).
    second = tmp_path / "boom_second.py"
    second.write_text(AGENTS + SECOND_EPISODE_BOOMS)
    one_worker = [*argv[:5], "-w", "1", "--max-iter", "5", "--seed", "3"]
    code, out, err, _ = _main([*one_worker, "--agent", f"{second}:SecondBooms"], capsys)
    assert code == 1
    assert "episode 1 (x2.5/001) failed after 3 steps: ValueError: boom at step 3" in err
    first, failed = (line.split() for line in out.splitlines()[1:3])
    assert failed[:2] == ["1", "x2.5"] and failed[5:7] == first[5:7]
    assert " ".join(failed[7:]) == "ValueError: boom at step 3"


def test_show_a_file_says_it_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    _usage_error(["show", str(tmp_path / "afile")], "is a file, not a folder", capsys, "show")


def test_show_plot_into_a_missing_folder_is_refused_before_plotting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _, _ = _main(["run", *SMALL, "--save", str(tmp_path / "runs")], capsys)
    assert code == 0
    _usage_error(
        ["show", str(tmp_path / "runs"), "--plot", str(tmp_path / "missing" / "x.png")],
        "does not exist",
        capsys,
        "show",
    )


# --- item 4: runs that add to a folder, and show telling them apart -----------------------------


@pytest.mark.slow  # several real runs
def test_a_second_run_in_the_same_folder_is_announced_and_shown_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from grid2op.Episode import EpisodeData

    runs = str(tmp_path / "runs")
    first = _main(["run", *SMALL, "--save", runs], capsys)
    assert first[0] == 0 and "earlier run" not in first[2]
    second = _main(["run", *SMALL[:4], "--max-iter", "3", "--save", runs], capsys)
    assert second[0] == 0
    assert f"{runs} already holds 1 saved episode of an earlier run" in second[2]
    assert "--resume" in second[2]
    # grid2op still reads both.
    assert sorted(name for _, name in EpisodeData.list_episode(runs)) == ["0000", "0000_1"]
    assert len(EpisodeData.from_disk(runs, "0000_1").rewards) == 3
    code, out, _, _ = _main(["show", runs], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split()[:3] == ["0000", "0000", "5/5"]
    assert lines[2].startswith("  run 1 (id ") and "1 episode, 5 steps" in lines[2]
    assert lines[3].split()[:3] == ["0000_1", "0000", "3/3"]
    assert lines[4].startswith("  run 2 (id ") and "1 episode, 3 steps" in lines[4]
    assert lines[5].startswith("2 episodes, 8 steps") and "2 runs in this folder" in lines[5]


def test_show_leaves_out_an_episode_it_cannot_read_and_shows_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One episode_meta.json cut short (a grid2op Runner killed as it wrote it): show printed
    # "cannot read runs: JSONDecodeError: ..." and nothing else, naming no episode nor file
    # (sharing hunt).
    runs = tmp_path / "runs"
    assert (
        _main(["run", "-n", "2", "-w", "1", "--max-iter", "3", "--save", str(runs)], capsys)[0] == 0
    )
    meta = runs / "0001" / "episode_meta.json"
    meta.write_text(meta.read_text()[:40])
    shown = subprocess.run(
        [_script(), "show", "runs"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert shown.returncode == 0, shown.stderr
    assert [line.split()[0] for line in shown.stdout.splitlines()[1:2]] == ["0000"]
    assert "1 episode, 3 steps" in shown.stdout
    said = shown.stderr.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("asyncrunner: UserWarning: "), shown.stderr
    assert "runs/0001 left out: cannot read it" in said[0]
    assert "episode_meta.json: " in said[0]


def test_a_run_into_another_envs_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its episodes were saved beside the other env's space files, which grid2op reads them
    # with: none could be read back (sharing hunt).
    runs = str(tmp_path / "runs")
    assert _main(["run", *SMALL, "--save", runs], capsys)[0] == 0
    other = ["run", "rte_case14_opponent", "--test", *SMALL, "--save", runs]
    code, _, err, _ = _main(other, capsys)
    assert code == 2 and "Traceback" not in err
    assert "asyncrunner run: error: " in err and "Save into another folder" in err
    assert "describes other spaces than this env's (name_gen," in err
    assert sorted(p.name for p in Path(runs).iterdir() if p.is_dir()) == ["0000"]


# --- item 8: the --plot picture -----------------------------------------------------------------


@pytest.mark.slow  # several real runs
def test_plot_legend_clears_the_bars_and_identical_lines_stay_visible(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    from asyncrunner._cli._show import figure, read_run

    runs = tmp_path / "runs"
    # The same chronic twice with the same seeds: identical episodes, identical lines.
    argv = ["run", "--workers", "1", "--max-iter", "30", "--seed", "1", "--save", str(runs)]
    assert _main([*argv, "--episode-id", "0000", "0001", "0002"], capsys)[0] == 0
    assert _main([*argv, "--episode-id", "0000", "0001", "0002"], capsys)[0] == 0
    code, out, _, _ = _main(["show", str(runs), "--plot", str(tmp_path / "plot.png")], capsys)
    assert code == 0 and "plot written to" in out
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    fig = figure(runs, read_run(runs))
    fig.canvas.draw()
    survival, reward = fig.axes
    renderer = fig.canvas.get_renderer()
    legend = survival.get_legend().get_window_extent(renderer)
    bars = [patch.get_window_extent(renderer) for patch in survival.patches]
    assert bars and not any(legend.overlaps(bar) for bar in bars)
    lines = reward.get_lines()
    assert len(lines) == 6
    same = [(ln.get_linestyle(), ln.get_linewidth()) for ln in (lines[0], lines[3])]
    assert (lines[0].get_ydata() == lines[3].get_ydata()).all()  # the two runs' 0000
    assert same[0] != same[1]  # drawn differently, so the later one does not hide the earlier
    # The reward legend sits outside the axes: it covers no line.
    outside = reward.get_legend().get_window_extent(renderer)
    assert outside.x0 >= reward.get_window_extent(renderer).x1


# --- subprocesses: a real terminal user's view ---------------------------------------------------


def _script() -> str:
    here = Path(sys.executable).parent / "asyncrunner"
    found = str(here) if here.exists() else shutil.which("asyncrunner")
    assert found, "the `asyncrunner` console script is not installed (pip install -e .)"
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["l2rpn_case14_sandbx"], "did you mean 'l2rpn_case14_sandbox'?"),
        (["--scheduler", "tcp://127.0.0.1:1"], "no Dask scheduler reachable"),
        (["--save", "/proc/runs"], "cannot be created"),
    ],
)
def test_errors_in_a_real_process_are_quick_and_one_line(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    start = time.perf_counter()
    done = subprocess.run(
        [_script(), "run", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    elapsed = time.perf_counter() - start
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and expected in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert elapsed < QUICK, f"took {elapsed:.1f} s"


SLOW_AGENT = """
import time

from grid2op.Agent import BaseAgent


class Slow(BaseAgent):
    def act(self, observation, reward, done=False):
        time.sleep(0.02)  # about 1 s per 50-step episode: time to interrupt between episodes
        return self.action_space({})
"""


def _interrupted(
    tmp_path: Path,
    argv: list[str],
    ready: Callable[[], bool],
    sent: int = signal.SIGINT,
    stdout_gone: bool = False,
    twice: bool = False,
) -> tuple[int, str, str, float]:
    """``asyncrunner ARGV`` in ``tmp_path``, sent ``sent`` once ``ready()`` (``stdout_gone``: its
    stdout's reader gone first; ``twice``: and again 2 ms later): its exit status, stdout,
    stderr, and the seconds it took to end after the signal."""
    proc = subprocess.Popen(
        [_script(), *argv], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(sent, signal.SIG_DFL),  # (not `nohup`'s)
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        if stdout_gone:  # its reader stopped by the same Ctrl-C (`| tee`)
            assert proc.stdout is not None
            proc.stdout.close()
        proc.send_signal(sent)
        if twice:
            time.sleep(0.002)
            proc.send_signal(sent)
        start = time.monotonic()
        if stdout_gone:
            assert proc.stderr is not None
            with proc.stderr:
                out, err = "", proc.stderr.read()
            proc.wait(60)
        else:
            out, err = proc.communicate(timeout=60)
        stopped = time.monotonic() - start
    finally:
        if proc.poll() is None:  # pragma: no cover - only when the test failed
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err, stopped


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sent", "status", "why", "stdout_gone", "twice"),
    [
        (signal.SIGINT, 130, "interrupted", False, False),
        (signal.SIGTERM, 143, "terminated", False, False),
        (signal.SIGHUP, 129, "hung up (SIGHUP)", False, False),
        (signal.SIGINT, 130, "interrupted", True, False),
        # Ctrl-C twice: asyncio's KeyboardInterrupt in the middle of the stop blamed the sinks
        # ("SinkError: ... cancelled its own task", a traceback), or left the process waiting for
        # anyio's worker threads at exit (a hunt: 1 run in 10)
        (signal.SIGINT, 130, "interrupted", False, True),
    ],
)
def test_ctrl_c_reports_what_finished_and_the_printed_command_resumes(
    tmp_path: Path, sent: signal.Signals, status: int, why: str, stdout_gone: bool, twice: bool
) -> None:
    # SIGTERM (kill, timeout, docker stop, a batch system's time limit) ended the process at
    # once: no word, no table, its temporary folders left in the save folder; so did SIGHUP (an
    # ssh session closed, no nohup). With `| tee`, which the same Ctrl-C stops, the table's
    # broken pipe ended it with status 1 and nothing on stderr (found by a hunt).
    (tmp_path / "slow_agent.py").write_text(SLOW_AGENT)
    argv = ["run", "--agent", "slow_agent.py:Slow", "-n", "3", "-w", "1", "--max-iter", "50"]
    argv += ["--seed", "0", "--save", "runs"]
    one_saved = lambda: any((tmp_path / "runs").glob("*/asyncrunner.json"))  # noqa: E731
    returncode, out, err, stopped = _interrupted(
        tmp_path, argv, one_saved, sent, stdout_gone, twice
    )
    assert returncode == status, err
    assert "Traceback" not in err
    assert stopped < QUICK
    assert not [p for p in (tmp_path / "runs").iterdir() if p.name.startswith(".")]
    saved = sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir())
    assert 1 <= len(saved) < 3, saved  # interrupted between episodes
    if not stdout_gone:  # the table of what finished
        assert [line.split()[1] for line in out.splitlines()[1:]] == saved
    assert f"asyncrunner: {why}; {len(saved)}/3 episodes finished" in err
    assert f"{len(saved)} saved in runs: {', '.join(saved)}" in err
    command = err.split("resume with: ", 1)[1].strip()
    assert command == "asyncrunner " + shlex.join([*argv, "--resume"])

    words = shlex.split(command)
    resumed = subprocess.run(
        [_script(), *words[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert resumed.returncode == 0, resumed.stderr
    missing = 3 - len(saved)
    summary = f"{missing}/3 episodes played, {len(saved)} already saved in runs, 0 failed"
    assert summary in resumed.stdout
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()) == [
        "0000",
        "0001",
        "0002",
    ]
    assert not [p for p in (tmp_path / "runs").iterdir() if p.name.startswith(".")]


SLOW_STOP = """
import asyncio, os, signal, sys, threading, time
import anyio
from asyncrunner._cli._common import run_until_stopped

async def main():
    try:
        await asyncio.sleep(100)
    except asyncio.CancelledError:
        with anyio.CancelScope(shield=True):  # a stop that takes a while (sinks draining)
            await anyio.sleep(3)
        raise

def send(first, second):
    time.sleep(0.5)
    os.kill(os.getpid(), first)
    time.sleep(0.5)
    os.kill(os.getpid(), second)

signums = tuple(getattr(signal, name) for name in sys.argv[1:3])
threading.Thread(target=send, args=signums, daemon=True).start()
start = time.monotonic()
try:
    run_until_stopped(main())
except KeyboardInterrupt as exc:
    print(type(exc).__name__, time.monotonic() - start)
"""


@pytest.mark.parametrize(
    ("second", "raised", "whole_stop", "first"),
    [
        ("SIGINT", "KeyboardInterrupt", True, "SIGINT"),
        ("SIGTERM", "Terminated", False, "SIGINT"),
        ("SIGTERM", "Terminated", False, "SIGTERM"),  # only Ctrl-C again is ignored
    ],
)
def test_ctrl_c_again_waits_for_the_stop_and_sigterm_still_ends_it(
    tmp_path: Path, second: str, raised: str, whole_stop: bool, first: str
) -> None:
    # Only a second Ctrl-C is ignored (asyncio's own raised in the middle of the stop): a
    # SIGTERM after it (`timeout`, a batch system's limit) still ends the stop now, as before.
    script = tmp_path / "stop.py"
    script.write_text(SLOW_STOP)
    done = subprocess.run(
        [sys.executable, str(script), first, second], capture_output=True, text=True, timeout=60
    )
    name, seconds = done.stdout.split()
    assert name == raised, done.stderr
    assert (float(seconds) >= 3) == whole_stop  # the 3 s stop from the first Ctrl-C at 0.5 s


@pytest.mark.parametrize("stopped", [False, True])
@pytest.mark.parametrize("module", [False, True])
def test_a_ctrl_c_as_the_command_ends_changes_nothing(
    tmp_path: Path, stopped: bool, module: bool
) -> None:
    # After the command's last line, Python's exit took about a second (collecting the env's
    # and pandas' objects): a Ctrl-C in it (a second one, after a stop: "changes nothing", the
    # README says) raised KeyboardInterrupt there and the process died of SIGINT, -2 for 130.
    (tmp_path / "slow_agent.py").write_text(SLOW_AGENT)
    command = [sys.executable, "-m", "asyncrunner"] if module else [_script()]
    argv = ["run", "--agent", "slow_agent.py:Slow", "-w", "1", "--no-pbar", "--save", "runs"]
    argv += ["-n", "3", "--max-iter", "50"] if stopped else ["-n", "1", "--max-iter", "3"]
    proc = subprocess.Popen(
        [*command, *argv], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        if stopped:
            deadline = time.monotonic() + 120
            while not any((tmp_path / "runs").glob("*/asyncrunner.json")):
                assert proc.poll() is None and time.monotonic() < deadline, "never saved one"
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
        last = proc.stderr if stopped else proc.stdout
        assert last is not None
        lines = iter(last.readline, "")
        told = next((line for line in lines if "resume with:" in line or "played" in line), "")
        assert told, "the command never said it ended"
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # pragma: no cover - only when the test failed
            proc.kill()
            proc.communicate()
    assert proc.returncode == (130 if stopped else 0), err
    assert "Traceback" not in err
    assert "KeyboardInterrupt" not in err


FAILS_ON_ONE = """

class FailsOnOne(Slow):
    # The second episode fails at its third step, and leaves a mark in the current folder.
    episodes = 0

    def reset(self, obs):
        FailsOnOne.episodes += 1

    def act(self, observation, reward, done=False):
        if FailsOnOne.episodes == 2 and observation.current_step == 3:
            open("failed", "w").close()
            raise RuntimeError("boom in 0001")
        return super().act(observation, reward, done)
"""


@pytest.mark.slow
def test_ctrl_c_reports_the_episodes_that_failed_before_it(tmp_path: Path) -> None:
    # Under --on-error continue, an episode that had failed before Ctrl-C appeared nowhere:
    # no row, no traceback, only "2/4 finished" (found by a hunt).
    (tmp_path / "agent.py").write_text(SLOW_AGENT + FAILS_ON_ONE)
    argv = ["run", "--agent", "agent.py:FailsOnOne", "-n", "3", "-w", "1", "--max-iter", "50"]
    argv += ["--save", "runs", "--on-error", "continue"]

    def failed() -> bool:  # the agent's mark: episode 1 failed; then episode 2 plays (1 s)
        if not (tmp_path / "failed").exists():
            return False
        time.sleep(0.3)
        return True

    returncode, out, err, _ = _interrupted(tmp_path, argv, failed)
    assert returncode == 130, err
    assert "asyncrunner: interrupted; 1/3 episodes finished, 1 failed" in err
    assert "episode 1 (0001) failed after 3 steps: RuntimeError: boom in 0001" in err
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [row[:2] for row in rows] == [["0", "0000"], ["1", "0001"]]
    assert "boom" in out.splitlines()[2]


@pytest.mark.slow
def test_ctrl_c_on_a_multimix_env_counts_and_finds_every_mix(tmp_path: Path) -> None:
    # It said "1/1 episodes finished" (one per mix asked, two mixes) and "0 saved": it looked
    # for the episodes in the save folder, not in its mixes' folders (found by a hunt).
    (tmp_path / "slow_agent.py").write_text(SLOW_AGENT)
    argv = ["run", "l2rpn_neurips_2020_track2", "--test", "--agent", "slow_agent.py:Slow"]
    argv += ["-n", "1", "-w", "1", "--max-iter", "50", "--save", "runs"]

    def in_a_mix() -> bool:  # placed in a mix's folder (not in the writer's hidden stage)
        found = (tmp_path / "runs").glob("[!.]*/[!.]*/asyncrunner.json")
        return any(found)

    returncode, out, err, _ = _interrupted(tmp_path, argv, in_a_mix)
    assert returncode == 130, err
    runs = tmp_path / "runs"
    [saved] = [p.relative_to(runs) for p in runs.glob("[!.]*/[!.]*") if p.is_dir()]
    assert "asyncrunner: interrupted; 1/2 episodes finished" in err
    assert f"1 saved in runs: {saved}" in err
    assert out.splitlines()[0].split()[:2] == ["index", "mix"]


def test_a_full_disk_reports_what_was_saved_and_how_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving failed (the disk full after the first episode): a 50-line traceback through
    asyncio and anyio, no table, no word of the episode saved nor of ``--resume``. Now what
    Ctrl-C gets: the table, what is saved where, the command that plays the rest."""
    from asyncrunner.sinks import EpisodeDataWriter

    place = EpisodeDataWriter._place
    placed: list[str] = []

    def full_disk(self: EpisodeDataWriter, started: Any, folder: str) -> str:
        if placed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), folder)
        placed.append(place(self, started, folder))
        return placed[-1]

    monkeypatch.setattr(EpisodeDataWriter, "_place", full_disk)
    runs = str(tmp_path / "runs")
    argv = ["run", "-n", "3", "-w", "1", "--max-iter", "3", "--seed", "0", "--save", runs]
    code, out, err, _ = _main(argv, capsys)
    assert code == 1, err
    assert "Traceback" not in err
    assert "stopped: EpisodeDataWriter failed: OSError: [Errno 28] No space left on device" in err
    assert [line.split()[1] for line in out.splitlines()[1:2]] == ["0000"]  # saved, first
    assert "1 saved in " + runs + ": 0000" in err
    command = err.split("resume with: ", 1)[1].strip()
    assert command == "asyncrunner " + shlex.join([*argv, "--resume"])

    monkeypatch.undo()
    code, out, err, _ = _main(shlex.split(command)[1:], capsys)
    assert code == 0, err
    assert "2/3 episodes played, 1 already saved in" in out
    assert sorted(n for n in os.listdir(runs) if not n.startswith(("dict_", "."))) == [
        "0000",
        "0001",
        "0002",
    ]


def test_run_starts_its_forked_workers_from_copies_of_the_env_it_made(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The command line makes its env and never plays it: the workers copy it (copy_env) rather
    # than build one, here or in themselves.
    from asyncrunner._engine import _envs

    before = _envs.builds()
    code, out, err, _ = _main(
        ["run", "--episodes", "2", "--workers", "2", "--max-iter", "3"], capsys
    )
    assert code == 0, err
    assert "2/2 episodes played" in out
    assert _envs.builds() == before


def _stop_handlers(_: object = None) -> tuple[bool, ...]:  # (in a pool's process: defaults?)
    return tuple(signal.getsignal(s) is signal.SIG_DFL for s in (signal.SIGTERM, signal.SIGHUP))


def test_a_pool_forked_during_the_bench_is_ended_by_sigterm() -> None:
    # `asyncrunner bench` hung for ever in grid2op's Runner contender: a process of its pool,
    # forked with the bench's Python handler for SIGTERM, lived on after `Pool.terminate()`
    # (its main thread, waiting on the pool's queue lock, never ran the handler), and
    # `Pool.join` waited. Forked processes now have the default, which the kernel applies
    # whatever their threads are doing.
    import multiprocessing

    from asyncrunner._cli._bench import _terminated_as_interrupted

    fork = multiprocessing.get_context("fork")
    with _terminated_as_interrupted():
        assert callable(signal.getsignal(signal.SIGTERM))  # (the bench's own)
        with fork.Pool(2) as pool:
            assert pool.map(_stop_handlers, range(4), chunksize=1) == [(True, True)] * 4
        assert callable(signal.getsignal(signal.SIGTERM))
    # a process forked outside the bench keeps what it inherits (ignoring SIGTERM, it is ended
    # by close(): `with` would terminate() it, which it ignores, and could wait for ever)
    mine = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pool = fork.Pool(1)
    try:
        assert pool.apply(_stop_handlers) == (False, True)
    finally:
        signal.signal(signal.SIGTERM, mine)
        pool.close()
        pool.join()


def test_the_sigterm_handler_is_the_runs_only() -> None:
    # The process's own handler comes back after (it was left at SIG_DFL), and a command run
    # off the main thread, where no signal handler can be set, runs.
    from concurrent.futures import ThreadPoolExecutor

    from asyncrunner._cli._common import run_until_stopped

    async def answer() -> int:
        return 42

    def mine(signum: int, frame: object) -> None:
        pass

    async def sigint_handler() -> Any:
        return signal.getsignal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, mine)
    ctrl_c = signal.getsignal(signal.SIGINT)
    try:
        assert run_until_stopped(answer()) == 42
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is ctrl_c  # (Ctrl-C's comes back too)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's: stays ignored
        assert run_until_stopped(sigint_handler()) is signal.SIG_IGN
        signal.signal(signal.SIGINT, ctrl_c)
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(run_until_stopped, answer()).result() == 42
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, ctrl_c)


def test_two_versions_of_one_file_name_say_what_to_do(tmp_path: Path) -> None:
    from asyncrunner._cli._common import UsageError, load_agent

    stem = f"submission_{os.getpid()}"  # a name no other test loads
    for version in ("v1", "v2"):
        (tmp_path / version).mkdir()
        (tmp_path / version / f"{stem}.py").write_text("from grid2op.Agent import DoNothingAgent\n")
    try:
        load_agent(f"{tmp_path / 'v1' / stem}.py:DoNothingAgent")
        with pytest.raises(
            UsageError, match=r"copy it under another name.*one command per version"
        ):
            load_agent(f"{tmp_path / 'v2' / stem}.py:DoNothingAgent")
    finally:
        sys.modules.pop(stem, None)
        sys.path.remove(str(tmp_path / "v1"))


def test_a_score_into_a_folder_of_an_earlier_one_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    episode = tmp_path / "scores" / "DoNothingAgent" / "0000"
    episode.mkdir(parents=True)
    (episode / "episode_meta.json").write_text("{}")
    argv = ["score", "--agent", "DoNothingAgent", "--competition", "l2rpn_2020"]
    argv += ["--save", str(tmp_path / "scores")]
    code, _, err, _ = _main([*argv, "--nb-scenario", "99"], capsys)  # (refused: too many)
    assert code == 2
    assert f"asyncrunner score: {tmp_path / 'scores'} already holds 1 saved episode of an " in err
    assert "--resume would play only the missing ones" in err
    code, _, err, _ = _main([*argv, "--nb-scenario", "99", "--resume"], capsys)
    assert code == 2 and "already holds" not in err


def test_the_score_plot_shows_scores_below_minus_100() -> None:
    pytest.importorskip("matplotlib")
    from asyncrunner._cli._score import figure
    from asyncrunner._score._scoring import ScenarioScore, ScoreResult

    # l2rpn_2023's assistant part takes a scenario's score down to -150: its bar was cut.
    scenario = ScenarioScore("0000", -150.0, {}, steps_survived=1, total_steps=10)
    result = ScoreResult("Agent", "l2rpn_2023", (scenario,), False, None, ())
    scores = figure([result]).axes[0]
    assert scores.get_ylim()[0] < -150 and scores.get_ylim()[1] >= 100


def test_a_run_with_stderr_closed_plays_and_prints_its_table(tmp_path: Path) -> None:
    # `2>&-` (a daemon, a job script): the progress bar's default read sys.stderr.isatty() on
    # None, and the run ended with status 1 before any episode, saying nothing.
    done = subprocess.run(
        [_script(), "run", "-n", "2", "--max-iter", "3", "--save", "runs"],
        cwd=tmp_path, stdout=subprocess.PIPE, text=True, timeout=120,
        preexec_fn=lambda: os.close(2),
    )  # fmt: skip
    assert done.returncode == 0
    assert "2/2 episodes played" in done.stdout
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()) == ["0000", "0001"]


TERMINATING_AGENT = """
import multiprocessing
import time

from grid2op.Agent import BaseAgent


def sleeper():
    time.sleep(30)


class Terminates(BaseAgent):
    # A solver in a process of its own, ended with terminate() (SIGTERM) when it takes too long.
    def act(self, observation, reward, done=False):
        solver = multiprocessing.Process(target=sleeper)
        solver.start()
        time.sleep(0.2)
        solver.terminate()
        solver.join(10)
        with open("exitcode", "w") as f:
            f.write(str(solver.exitcode))
        if solver.exitcode is None:
            solver.kill()
        return self.action_space({})
"""


def test_an_agents_process_ends_on_terminate_under_the_cli(tmp_path: Path) -> None:
    # It inherited the worker's SIGTERM handler, `asyncrunner run`'s (which stops the run): its
    # terminate() did nothing, the episode waited (grid2op's Runner: -15 at once).
    (tmp_path / "agent.py").write_text(TERMINATING_AGENT)
    done = subprocess.run(
        [_script(), "run", "--agent", "agent.py:Terminates", "-n", "1", "--max-iter", "1",
         "-w", "1", "--no-pbar"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "exitcode").read_text() == str(-signal.SIGTERM)
