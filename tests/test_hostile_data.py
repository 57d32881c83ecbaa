"""Hostile data and inputs: damaged saved episodes, another agent's folder, leftovers of a killed
run, bad arguments that used to pass the checks, failure reports, and durable writes."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import psutil  # type: ignore[import-untyped]
import pytest
from grid2op.Agent import BaseAgent, DoNothingAgent, RandomAgent
from grid2op.Episode import EpisodeData
from grid2op.Exceptions import Grid2OpException
from grid2op.Reward import ConstantReward
from grid2op.Runner import Runner as GridRunner

from asyncrunner import AsyncRunner, EpisodeError, EpisodeStarted, Event, SinkError
from asyncrunner._plan import _layout
from asyncrunner._plan._layout import BROKEN_FOLDER, RECORD_FILE, sync
from asyncrunner.compat import Runner as CompatRunner
from asyncrunner.sinks import CallbackSink, CompactEpisodeWriter, EpisodeDataWriter, _writer
from asyncrunner.sinks._writer import TMP_PREFIX

from .conftest import make_env

pytestmark = pytest.mark.anyio

TIMEOUT = 180  # generous: worker processes build their env on a shared machine
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def case14() -> Iterator[Any]:
    env = make_env()
    yield env
    env.close()


@pytest.fixture(scope="module")
async def runner(anyio_backend: str, case14: Any) -> AsyncIterator[AsyncRunner]:
    """One warm DoNothing runner per backend, shared by the module's tests."""
    async with AsyncRunner(case14, agent=DoNothingAgent, workers=2) as shared:
        yield shared


class Started:
    """Counts the episodes that actually play."""

    def __init__(self) -> None:
        self.indices: list[int] = []

    def __call__(self, event: Event) -> None:
        if isinstance(event, EpisodeStarted):
            self.indices.append(event.index)


KWARGS: dict[str, Any] = dict(max_iter=5, env_seeds=[1, 2], agent_seeds=[3, 4], episode_id=[0, 1])
ONE: dict[str, Any] = dict(max_iter=5, env_seeds=[1], agent_seeds=[3], episode_id=[0])


# --- 6. resume checks what it skips ----------------------------------------------------------


async def test_resume_replays_damaged_episodes(runner: AsyncRunner, tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        first = await runner.run(2, path_save=tmp_path, **KWARGS)
    truncated = Path(first[0].path or "") / "rewards.npz"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    flipped = Path(first[1].path or "") / "observations.npz"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    flipped.write_bytes(bytes(data))

    started = Started()
    with pytest.warns(UserWarning, match="is damaged") as caught, anyio.fail_after(TIMEOUT):
        resumed = await runner.run(
            2, path_save=tmp_path, resume=True, sinks=[CallbackSink(started)], **KWARGS
        )
    assert sorted(started.indices) == [0, 1]  # both replayed
    assert [r.as_tuple() for r in resumed] == [r.as_tuple() for r in first]
    messages = " ".join(str(w.message) for w in caught)
    assert "rewards.npz has" in messages and "observations.npz differs" in messages
    # The damaged folders were moved aside, where grid2op does not list them; the new ones
    # took their names, and every listed episode loads.
    aside = sorted(p.name for p in (tmp_path / BROKEN_FOLDER).iterdir())
    assert aside == sorted(Path(r.path or "").name for r in first)
    assert [r.path for r in resumed] == [r.path for r in first]
    listed = EpisodeData.list_episode(str(tmp_path))
    assert sorted(name for _, name in listed) == aside
    for path, name in listed:
        EpisodeData.from_disk(path, name)
    # Intact now: a third run plays nothing.
    again = Started()
    with anyio.fail_after(TIMEOUT):
        await runner.run(2, path_save=tmp_path, resume=True, sinks=[CallbackSink(again)], **KWARGS)
    assert again.indices == []


async def test_a_damaged_episode_another_resume_moves_first_plays_again(
    runner: AsyncRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two resumes of one folder at once: the one that found a damaged folder gone as it moved
    # it aside ended with FileNotFoundError and a traceback (sharing hunt: 3 crashes in 13).
    with anyio.fail_after(TIMEOUT):
        first = await runner.run(2, path_save=tmp_path, **KWARGS)
    damaged = Path(first[0].path or "")
    (damaged / "rewards.npz").write_bytes(b"")
    makedirs = os.makedirs

    def the_other_resume_first(name: Any, *args: Any, **kwargs: Any) -> None:
        if str(name).endswith(BROKEN_FOLDER) and damaged.exists():
            makedirs(name, *args, **kwargs)
            damaged.rename(Path(name) / "theirs")
        makedirs(name, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", the_other_resume_first)
    started = Started()
    with anyio.fail_after(TIMEOUT):
        resumed = await runner.run(
            2, path_save=tmp_path, resume=True, sinks=[CallbackSink(started)], **KWARGS
        )
    assert started.indices == [0]
    assert [r.as_tuple() for r in resumed] == [r.as_tuple() for r in first]
    assert sorted(p.name for p in (tmp_path / BROKEN_FOLDER).iterdir()) == ["theirs"]


async def test_a_folder_of_another_envs_episodes_is_refused_before_playing(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    # The space files already there are kept (as grid2op keeps them) and read back with every
    # episode of the folder: another env's made this run's episodes unreadable
    # (EpisodeData.from_disk: "mismatch between what has been stored and what is currently
    # used"), and the run said nothing (sharing hunt).
    with anyio.fail_after(TIMEOUT):
        await runner.run(1, path_save=tmp_path, **ONE)
    space = tmp_path / "dict_observation_space.json"
    theirs = json.loads(space.read_text())
    # Another env's name or class folder, or a grid2op version whose vectors are this one's (here
    # this version, written otherwise): read the same way.
    same = theirs["glop_version"] + ".0"
    space.write_text(json.dumps({**theirs, "env_name": "x", "glop_version": same}))
    started = Started()
    with anyio.fail_after(TIMEOUT):
        await runner.run(1, path_save=tmp_path, sinks=[CallbackSink(started)], **ONE)
    assert started.indices == [0]
    # A later grid2op's: this one cannot tell how that version reads the folder (grid2op 1.12.4
    # builds a file of 1.12.6 with its own vectors, 493 values where 1.12.6 reads 550).
    space.write_text(json.dumps({**theirs, "glop_version": "99.0.0"}))
    with pytest.raises(ValueError, match=r"was written by grid2op 99\.0\.0, later than"):
        await runner.run(1, path_save=tmp_path, sinks=[CallbackSink(started)], **ONE)
    # An earlier grid2op's (its space files otherwise the same, as grid2op 1.12.4's Runner
    # writes them for this env): grid2op reads the folder's episodes with that version's
    # observation vector, without what later versions added, and this run's failed to load.
    space.write_text(json.dumps({**theirs, "glop_version": "1.10.0"}))

    def load() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (grid2op's "compatibility feature" warning)
            EpisodeData.from_disk(str(tmp_path), "0000_1")

    with pytest.raises(Grid2OpException, match="mismatch between what has been stored"):
        await anyio.to_thread.run_sync(load)
    with pytest.raises(ValueError, match=r"was written by grid2op 1\.10\.0") as caught:
        await runner.run(1, path_save=tmp_path, sinks=[CallbackSink(started)], **ONE)
    assert "values per observation" in str(caught.value) and str(space) in str(caught.value)
    assert started.indices == [0]
    # Another grid (rte_case14_opponent's has five generators, the sandbox's six).
    space.write_text(json.dumps({**theirs, "name_gen": theirs["name_gen"][:5]}))
    started = Started()
    with pytest.raises(ValueError, match="describes other spaces than this env's") as caught:
        await runner.run(1, path_save=tmp_path, sinks=[CallbackSink(started)], **ONE)
    assert "(name_gen differ)" in str(caught.value) and str(space) in str(caught.value)
    assert started.indices == []
    saved = await anyio.to_thread.run_sync(lambda: sorted(p.name for p in tmp_path.glob("0*")))
    assert saved == ["0000", "0000_1"]


async def test_resume_replays_episodes_whose_record_is_damaged(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    kwargs: dict[str, Any] = dict(max_iter=3, episode_id=[0, 1, 0, 1], env_seeds=[1, 2, 3, 4])
    with anyio.fail_after(TIMEOUT):
        first = await runner.run(4, path_save=tmp_path, **kwargs)
    folders = [Path(r.path or "") for r in first]

    def edit(folder: Path, change: Any) -> None:
        record = json.loads((folder / RECORD_FILE).read_text())
        change(record["files"])
        if not record["files"]:
            del record["files"]
        (folder / RECORD_FILE).write_text(json.dumps(record))

    edit(folders[0], dict.clear)  # lists no files
    edit(folders[1], lambda files: files.pop("rewards.npz"))  # one file not listed
    edit(folders[2], lambda files: files.update({"../rewards.npz": files["rewards.npz"]}))
    (folders[3] / "actions.npz").unlink()  # listed, not there

    started = Started()
    with pytest.warns(UserWarning, match="is damaged") as caught, anyio.fail_after(TIMEOUT):
        resumed = await runner.run(
            4, path_save=tmp_path, resume=True, sinks=[CallbackSink(started)], **kwargs
        )
    assert sorted(started.indices) == [0, 1, 2, 3]
    assert [r.as_tuple() for r in resumed] == [r.as_tuple() for r in first]
    messages = " ".join(str(w.message) for w in caught)
    for said in ("lists no files", "does not list rewards.npz", "'../rewards.npz' wrongly"):
        assert said in messages
    assert "actions.npz cannot be read" in messages
    for path, name in EpisodeData.list_episode(str(tmp_path)):
        EpisodeData.from_disk(path, name)


# --- 7. resume matches the agent -------------------------------------------------------------


async def test_resume_plays_another_agents_episodes(
    runner: AsyncRunner, case14: Any, tmp_path: Path
) -> None:
    with anyio.fail_after(TIMEOUT):
        nothing = await runner.run(2, path_save=tmp_path, **KWARGS)
        started = Started()
        async with AsyncRunner(case14, agent=RandomAgent, workers=1) as other:
            told = f"resume: 2 of the episodes to play have an episode of their chronic saved in {tmp_path}, played with another agent: they play again"
            with pytest.warns(UserWarning, match=re.escape(told)):
                random = await other.run(
                    2, path_save=tmp_path, resume=True, sinks=[CallbackSink(started)], **KWARGS
                )
            assert sorted(started.indices) == [0, 1]  # RandomAgent's own episodes
            again = Started()
            await other.run(
                2, path_save=tmp_path, resume=True, sinks=[CallbackSink(again)], **KWARGS
            )
            assert again.indices == []
    # Next to the old ones, nothing overwritten.
    assert [Path(r.path or "").name for r in random] == [f"{r.name}_1" for r in nothing]
    for r in random:
        record = json.loads((Path(r.path or "") / RECORD_FILE).read_text())
        assert record["agent"] == "grid2op.Agent.randomAgent.RandomAgent"
    back = Started()
    with anyio.fail_after(TIMEOUT):
        resumed = await runner.run(
            2, path_save=tmp_path, resume=True, sinks=[CallbackSink(back)], **KWARGS
        )
    assert back.indices == [] and [r.path for r in resumed] == [r.path for r in nothing]


async def test_resume_of_one_of_two_runs_kept_in_one_folder_says_nothing(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    # Two runs of the same chronics with other seeds, saved in one folder on purpose; the
    # second lost an episode: resuming it plays that one, without a warning about the first
    # run's episodes (a review; warnings are errors here).
    other = {**KWARGS, "env_seeds": [7, 8], "agent_seeds": [9, 10]}
    with anyio.fail_after(TIMEOUT):
        await runner.run(2, path_save=tmp_path, **KWARGS)
        second = await runner.run(2, path_save=tmp_path, **other)
        shutil.rmtree(second[1].path or "")
        started = Started()
        await runner.run(2, path_save=tmp_path, resume=True, sinks=[CallbackSink(started)], **other)
    assert started.indices == [1]


async def test_resume_counts_episodes_not_folders_played_otherwise(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    # Two saved runs of chronic 0 (seeds 7 and 8), then a resume with seed 9: one episode plays
    # again, beside two folders of its chronic; the warning counts the one episode.
    one: dict[str, Any] = dict(max_iter=5, episode_id=[0], agent_seeds=[3])
    with anyio.fail_after(TIMEOUT):
        for seed in (7, 8):
            await runner.run(1, path_save=tmp_path, env_seeds=[seed], **one)
        told = f"resume: 1 of the episodes to play have an episode of their chronic saved in {tmp_path}, played with another env seed: they play again"
        with pytest.warns(UserWarning, match=re.escape(told)):
            await runner.run(1, path_save=tmp_path, resume=True, env_seeds=[9], **one)


async def test_resume_tells_two_lambdas_apart(case14: Any, tmp_path: Path) -> None:
    """Every lambda's qualified name is ``<lambda>``: one agent's episodes were another's."""
    first_agent: Any = lambda space: DoNothingAgent(space)  # noqa: E731
    second_agent: Any = lambda space: RandomAgent(space)  # noqa: E731
    with anyio.fail_after(TIMEOUT):
        async with AsyncRunner(case14, agent=first_agent, workers=1) as first:
            await first.run(2, path_save=tmp_path, **KWARGS)
        started = Started()
        async with AsyncRunner(case14, agent=second_agent, workers=1) as second:
            with pytest.warns(UserWarning, match="played with another agent: they play again"):
                await second.run(
                    2, path_save=tmp_path, resume=True, sinks=[CallbackSink(started)], **KWARGS
                )
    assert sorted(started.indices) == [0, 1]  # played, not read back


async def test_resume_plays_another_envs_episodes(
    runner: AsyncRunner, case14: Any, tmp_path: Path
) -> None:
    # The same env folder (same chronic names) made with another reward: its results differ.
    with anyio.fail_after(TIMEOUT):
        first = await runner.run(2, path_save=tmp_path, **KWARGS)
        other_env = make_env(reward_class=ConstantReward)
        try:
            async with AsyncRunner(other_env, agent=DoNothingAgent, workers=1) as other:
                started = Started()
                with pytest.warns(UserWarning, match="played with another env: they play again"):
                    played = await other.run(
                        2, path_save=tmp_path, resume=True, sinks=[CallbackSink(started)], **KWARGS
                    )
        finally:
            other_env.close()
    assert sorted(started.indices) == [0, 1]  # not taken for the first env's episodes
    assert [r.cum_reward for r in played] == [0.0, 0.0]
    assert all(r.cum_reward > 0 for r in first)
    assert [Path(r.path or "").name for r in played] == [f"{r.name}_1" for r in first]
    back = Started()
    with anyio.fail_after(TIMEOUT):
        resumed = await runner.run(
            2, path_save=tmp_path, resume=True, sinks=[CallbackSink(back)], **KWARGS
        )
    assert back.indices == [] and [r.path for r in resumed] == [r.path for r in first]


async def test_resume_plays_episodes_reset_otherwise(runner: AsyncRunner, tmp_path: Path) -> None:
    # The reset options and initial state were not compared: an episode saved with
    # reset_options={"max step": 5} was read back for one asked with "max step": 20, its 5 steps
    # and reward returned (found by a hunt).
    kwargs = {k: v for k, v in KWARGS.items() if k != "max_iter"}
    resets: list[dict[str, Any]] = [
        {"reset_options": {"max step": 5}},
        {"reset_options": {"max step": 8}},
        {"reset_options": {"max step": 5}, "init_states": {"set_bus": {"lines_or_id": [(0, 1)]}}},
        {"max_iter": 5, "reset_options": {"max step": 8}},  # max_iter wins over "max step"
    ]
    runs: list[list[int]] = []
    with anyio.fail_after(TIMEOUT), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You provided both `max_iter`", UserWarning)
        for reset in resets:
            started = Started()
            told = "played with another (max_iter or )?initial state or options: they play again"
            with pytest.warns(UserWarning, match=told) if runs else contextlib.nullcontext():
                played = await runner.run(
                    2,
                    path_save=tmp_path,
                    resume=True,
                    sinks=[CallbackSink(started)],
                    **kwargs,
                    **reset,
                )
            again = Started()
            resumed = await runner.run(
                2, path_save=tmp_path, resume=True, sinks=[CallbackSink(again)], **kwargs, **reset
            )
            assert sorted(started.indices) == [0, 1] and again.indices == []
            assert [r.as_tuple() for r in resumed] == [r.as_tuple() for r in played]
            runs.append([r.nb_time_step for r in played])
    assert runs == [[5, 5], [8, 8], [5, 5], [5, 5]]
    assert len(EpisodeData.list_episode(str(tmp_path))) == 8


# --- 8. leftovers of a killed run ------------------------------------------------------------

_BLOCKED_RUN = """
import sys, time
import grid2op
from grid2op.Agent import DoNothingAgent
import anyio
from asyncrunner import AsyncRunner
from asyncrunner.sinks import EpisodeDataWriter


class Stuck(EpisodeDataWriter):
    def _place(self, started, folder):
        open(sys.argv[2], "w").close()  # tell the test
        time.sleep(600)  # killed here: the episode's temporary folder stays behind


async def main():
    env = grid2op.make("l2rpn_case14_sandbox", test=True)
    async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
        await runner.run(1, max_iter=3, sinks=[Stuck(sys.argv[1])])
    sys.exit("the run ended: it should be stuck writing")


if __name__ == "__main__":
    anyio.run(main)
"""


def _start_stuck(script: Path, folder: Path, name: str) -> subprocess.Popen[bytes]:
    """A run in another process, stuck while writing its episode (a temporary folder exists)."""
    ready = script.parent / f"{name}.ready"
    with open(script.parent / f"{name}.err", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(folder), str(ready)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    deadline = time.monotonic() + TIMEOUT
    # Another process: nothing to await but its file (it starts an interpreter and an env).
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError((script.parent / f"{name}.err").read_text()[-2000:])
        time.sleep(0.1)
    return proc


@pytest.mark.slow
async def test_a_killed_runs_temporary_folder_is_removed_not_a_live_ones(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(_BLOCKED_RUN))
    folder = tmp_path / "runs"
    # Both workers forked first: a worker forked while another thread is inside Popen inherits
    # the pipe Popen waits on for the exec, and Popen then waits as long as the worker lives.
    await runner.run(2, max_iter=1)
    killed = await anyio.to_thread.run_sync(_start_stuck, script, folder, "killed")
    live = await anyio.to_thread.run_sync(_start_stuck, script, folder, "live")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)  # its workers, orphaned, exit when their channel closes
        names = {p.name: p for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)}
        dead = [n for n in names if f"-{killed.pid}-" in n]
        alive = [n for n in names if f"-{live.pid}-" in n]
        assert len(dead) == 1 and len(alive) == 1
        with anyio.fail_after(TIMEOUT):
            await runner.run(1, max_iter=3, path_save=folder)
        left = {p.name for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)}
        assert left == set(alive)  # the dead run's is gone, the live run's untouched
    finally:
        for proc in (killed, live):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


# --- 9. bad input is refused before any work -------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(env_seeds=[2**31]), ValueError, "at most 2147483647"),
        (dict(env_seeds=[2**32]), ValueError, "at most 2147483647"),
        (dict(agent_seeds=[2**32]), ValueError, "at most 4294967295"),
        (dict(env_seeds=[1.5]), TypeError, "a float, bool or string is not a seed"),
        (dict(agent_seeds=[True]), TypeError, "a float, bool or string is not a seed"),
        (dict(env_seeds=["12"]), TypeError, "a float, bool or string is not a seed"),
        (dict(episode_id=[1.5]), TypeError, "integers or chronic names"),
        (dict(episode_id=[True]), TypeError, "integers or chronic names"),
        (dict(episode_timeout="5"), TypeError, "a number of seconds"),
        (dict(reset_options={"init ts": -5}), ValueError, '"init ts" must be an integer >= 1'),
        (dict(reset_options={"init ts": "3"}), ValueError, '"init ts" must be an integer'),
        (
            dict(max_iter=None, reset_options={"max step": "abc"}),
            ValueError,
            '"max step" must be an integer',
        ),
        (dict(reset_options={"init datetime": "5 jan"}), ValueError, '"init datetime" must'),
        (dict(reset_options={"init datetime": 20190105}), ValueError, '"init datetime" must'),
        (dict(reset_options={"thermal limit": "x"}), ValueError, "one limit \\(amps\\) per line"),
        (dict(reset_options={"thermal limit": [1.0, 2.0]}), ValueError, "the grid has 20 lines"),
        (dict(reset_options={"thermal limit": ["a"] * 20}), ValueError, "must hold numbers"),
        (dict(reset_options={"thermal limit": {"nope": 1.0}}), ValueError, "not one of"),
        (dict(reset_options={"thermal limit": {"0_1_0": 1.0}}), ValueError, "misses 19 of 20"),
        (dict(reset_options={"thermal limit": {"0_1_0": "x"}}), ValueError, "finite numbers"),
        (dict(reset_options={"thermal limit": {"0_1_0": float("nan")}}), ValueError, "finite"),
        (dict(init_states={"set_line_status": "x"}), ValueError, "not an action of this env"),
        (dict(init_states={"bogus": 1}), ValueError, "not an action of this env"),
        (
            dict(init_states=[{"set_bus": {"lines_or_id": [(0, 2)]}, "change_bus": [0]}]),
            ValueError,
            "not an action of this env|ambiguous",
        ),
        (dict(reset_options={"init state": 3}), TypeError, "must be a dict or a grid2op action"),
    ],
)
async def test_bad_values_are_refused_before_any_work(
    runner: AsyncRunner, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    seen: list[Event] = []
    kwargs = {"max_iter": 3, **kwargs}
    with pytest.raises(error, match=message), anyio.fail_after(TIMEOUT):
        await runner.run(1, sinks=[CallbackSink(seen.append)], **kwargs)
    assert seen == []  # refused before the run started


async def test_numpy_integers_and_good_reset_values_are_accepted(
    runner: AsyncRunner, case14: Any
) -> None:
    options = {
        "init ts": 2,
        "max step": 3.0,  # grid2op takes a whole float
        "init datetime": "2019-01-06 00:00",
        "thermal limit": list(case14.get_thermal_limit() * 2),
    }
    # a dict naming every line (one naming only some is refused: grid2op leaves the rest NaN)
    limits = case14.get_thermal_limit().tolist()
    every_line = dict(zip(map(str, case14.name_line), limits, strict=True))
    numpy: dict[str, Any] = dict(  # what grid2op's Runner takes too
        max_iter=np.int64(4),
        env_seeds=np.array([5, 6]),
        agent_seeds=[np.uint32(7), 8],
        episode_id=[np.int64(1), "0000"],
        episode_timeout=np.float64(60),
        retries=np.int64(1),
    )
    with (
        anyio.fail_after(TIMEOUT),
        pytest.warns(UserWarning, match="ignore the `max step`"),  # grid2op's warning
    ):
        results = await runner.run(
            np.int64(2),  # type: ignore[arg-type]  # an Integral, not an int
            reset_options=[options, {"max step": -1, "thermal limit": every_line}],
            init_states={"set_line_status": [(0, -1)]},
            **numpy,
        )
    assert [(r.ok, r.env_seed, r.agent_seed) for r in results] == [(True, 5, 7), (True, 6, 8)]
    assert [r.nb_time_step for r in results] == [4, 4]  # max_iter wins over "max step"


def test_compat_runner_takes_the_seeds_grid2op_takes(case14: Any) -> None:
    # grid2op's env.seed truncates a float and reads a bool as 0 / 1; numpy seeds agents with
    # a bool as 0 / 1: compat.Runner plays them as grid2op does.
    kwargs: dict[str, Any] = dict(nb_episode=1, max_iter=5, env_seeds=[1.7], agent_seeds=[True])
    params = case14.get_params_for_runner()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = GridRunner(**params, agentClass=RandomAgent).run(**kwargs)
        got = CompatRunner(**params, agentClass=RandomAgent).run(**kwargs)
    assert [tuple(r) for r in got] == [tuple(r) for r in expected]


# --- 10. failure reports ---------------------------------------------------------------------


class DiesAtStepTen(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Takes a while at step 6 (a batch of steps then leaves), and kills its worker at step 10."""

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.calls = 0

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        self.calls += 1
        if self.calls == 6:
            time.sleep(0.3)  # older than the worker's batch age: steps 1-6 are sent
        if self.calls == 10:
            os._exit(1)
        return self.action_space({})


async def test_a_dead_worker_is_reported_after_the_last_step_received(case14: Any) -> None:
    with anyio.fail_after(TIMEOUT):
        async with AsyncRunner(case14, agent=DiesAtStepTen, workers=1, retries=0) as dying:
            with pytest.raises(EpisodeError) as caught:
                await dying.run(1, max_iter=50)
    failure = caught.value.failure
    # Steps 1-6 arrived; steps 7-9 were played but died with the worker (under load a later
    # batch may have left too).
    assert 6 <= failure.step <= 9 and failure.steps_lost
    assert f"step {failure.step} was the last received" in failure.message
    assert f"failed after step {failure.step}" in str(caught.value)
    assert "were not received" in str(caught.value)


async def test_a_failing_sink_reports_the_finished_episodes(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    ended = 0

    def disk_full(event: Event) -> None:
        nonlocal ended
        if type(event).__name__ == "EpisodeFinished":
            ended += 1
            if ended == 2:
                raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(SinkError, match="No space left") as caught, anyio.fail_after(TIMEOUT):
        # on_error="continue" is about episodes: a failing sink still stops the run.
        await runner.run(
            4,
            max_iter=3,
            path_save=tmp_path,
            on_error="continue",
            sinks=[CallbackSink(disk_full)],
        )
    results = caught.value.results
    assert len(results) >= 2 and all(r.ok for r in results)
    for r in results:
        if r.path is not None:
            EpisodeData.from_disk(str(tmp_path), Path(r.path).name)


# --- 11. durability --------------------------------------------------------------------------


class _LoggedLibc:
    """The C library ``_layout`` calls, logging each ``syncfs``."""

    def __init__(self, libc: Any, log: list[tuple[str, str, str]]) -> None:
        self._libc, self._log = libc, log

    def syncfs(self, fd: int) -> int:
        self._log.append(("syncfs", os.readlink(f"/proc/self/fd/{fd}"), ""))
        return int(self._libc.syncfs(fd))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._libc, name)


def _log_flushes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    """Log this process's ``fsync`` and ``syncfs`` calls: (what, the path flushed, "")."""
    log: list[tuple[str, str, str]] = []
    fsync = os.fsync

    def logged_fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), ""))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(_layout, "_LIBC", _LoggedLibc(_layout._LIBC, log))
    return log


def _on_a_local_disk(folder: Path) -> Path:
    """``folder``, where ``syncfs`` writes an episode's files out at once (``sync``)."""
    if _layout._file_system_type(str(folder)) not in _layout._LOCAL_DISK_FILE_SYSTEMS:
        pytest.skip(f"{folder} is not on a local disk's file system (ext4, XFS, Btrfs, F2FS)")
    return folder


def _quiet_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Little waiting to be written on the machine, whatever other programs write meanwhile."""
    monkeypatch.setattr(_layout, "_dirty_bytes", lambda: 0)


def _busy_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Much waiting to be written on the machine: no ``syncfs`` (``_layout._DIRTY_MAX``)."""
    monkeypatch.setattr(_layout, "_dirty_bytes", lambda: _layout._DIRTY_MAX)


@pytest.mark.parametrize("one_syncfs", [True, False], ids=["one syncfs first", "fsyncs only"])
@pytest.mark.parametrize("staged", [True, False], ids=["written by the worker", "sent"])
async def test_files_and_folders_are_synced_around_the_rename(
    case14: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staged: bool, one_syncfs: bool
) -> None:
    """With workers on this machine, one writer of a format has the workers write its files in
    its stage; with two, the files are sent and each writer writes them. Either way each file is
    flushed (``fsync``) after it is written and before the rename that publishes it, and the
    folder after; on a local disk one ``syncfs`` writes them out first. (The workers are
    threads here, so that this process sees their calls.)"""
    if one_syncfs:
        _on_a_local_disk(tmp_path)
        _quiet_disk(monkeypatch)
    else:
        _busy_disk(monkeypatch)
    log: list[tuple[str, str, str]] = []
    rename, link, write_file = os.rename, os.link, _writer.write_file

    def logged_rename(src: Any, dst: Any) -> None:
        rename(src, dst)
        log.append(("rename", os.fspath(dst), os.fspath(src)))

    def logged_link(src: Any, dst: Any) -> None:
        link(src, dst)
        log.append(("rename", os.fspath(dst), os.fspath(src)))

    def logged_write_file(path: str, data: bytes) -> None:
        write_file(path, data)
        log.append(("write", path, ""))

    data, compact = tmp_path / "data", tmp_path / "compact"
    writers = [EpisodeDataWriter(data), CompactEpisodeWriter(compact)]
    if not staged:
        writers += [EpisodeDataWriter(tmp_path / "data2"), CompactEpisodeWriter(tmp_path / "c2")]
    with ThreadPoolExecutor(1) as pool:
        async with AsyncRunner(case14, agent=DoNothingAgent, executor=pool) as runner:
            log = _log_flushes(monkeypatch)
            monkeypatch.setattr(os, "rename", logged_rename)
            monkeypatch.setattr(os, "link", logged_link)
            monkeypatch.setattr(_writer, "write_file", logged_write_file)
            with anyio.fail_after(TIMEOUT):
                (result,) = await runner.run(1, max_iter=3, sinks=writers)
            monkeypatch.undo()

    def rename_to(target: str) -> tuple[int, str]:
        (index,) = [i for i, (what, dst, _) in enumerate(log) if what == "rename" and dst == target]
        return index, log[index][2]

    def fsynced_before(path: str, renamed: int) -> bool:
        """``path`` was flushed after it was last written, before the ``renamed``-th call."""
        writes = [i for i, (what, p, _) in enumerate(log) if what == "write" and p == path]
        return ("fsync", path, "") in log[max(writes, default=-1) + 1 : renamed]

    # EpisodeData: each file and the folder synced before the folder's rename, its parent after.
    folder = str(data / (result.name or ""))
    renamed, tmp_folder = rename_to(folder)
    assert TMP_PREFIX in tmp_folder
    assert (os.path.basename(tmp_folder) == "episode") is not staged  # sent: nested in a tmp
    files = os.listdir(folder)
    assert len(files) >= 12
    for path in [tmp_folder, *(os.path.join(tmp_folder, name) for name in files)]:
        assert fsynced_before(path, renamed), path
    syncfs = [p for what, p, _ in log[:renamed] if what == "syncfs" and p.startswith(tmp_folder)]
    assert len(syncfs) == int(one_syncfs)
    assert ("fsync", str(data), "") in log[renamed:]
    # CompactEpisodeData: both files synced under their temporary names, their folder after.
    npz = str(compact / "CompactEpisodeData" / f"{result.name}.npz")
    moved, tmp_npz = rename_to(npz)
    _, tmp_meta = rename_to(str(compact / "CompactEpisodeData" / f"{result.name}_metadata.json"))
    assert TMP_PREFIX in tmp_npz
    assert fsynced_before(tmp_npz, moved) and fsynced_before(tmp_meta, moved)
    assert ("fsync", str(compact / "CompactEpisodeData"), "") in log[moved:]


def _episode_folder(folder: Path) -> list[str]:
    """An episode's files (as many as an EpisodeData folder has) in a new ``folder``: what
    ``sync`` gets for it, the folder last."""
    folder.mkdir()
    paths = [str(folder / f"{k}.npz") for k in range(14)]
    for path in paths:
        Path(path).write_bytes(os.urandom(3000))
    return [*paths, str(folder)]


def test_an_episodes_files_are_written_out_by_one_syncfs_on_a_local_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``fsync`` of each of an episode's 15 paths cost about 2 ms of CPU per episode here;
    one ``syncfs`` of their file system first, which writes them all out, brings the ``fsync``
    calls that follow (each reports its own file's errors) to about 0.4 ms in all."""
    episode = _episode_folder(_on_a_local_disk(tmp_path) / "episode")
    _quiet_disk(monkeypatch)
    log = _log_flushes(monkeypatch)
    sync(episode)
    assert log == [("syncfs", episode[0], ""), *(("fsync", p, "") for p in episode)]


def test_a_files_write_error_is_its_own_whatever_syncfs_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``syncfs`` reports a write error of the file system to whichever caller asks first: an
    episode whose data was lost would be placed as saved when another program's (or episode's)
    ``syncfs`` took the error, and a good one failed when its ``syncfs`` got another's. Each
    file's ``fsync`` reports its own: the episode with the error fails, the others do not."""
    episode = _episode_folder(_on_a_local_disk(tmp_path) / "episode")
    _quiet_disk(monkeypatch)
    libc: Any = _layout._LIBC
    fsync = os.fsync

    class Libc:
        result = 0  # what syncfs returns
        calls = 0

        def syncfs(self, fd: int) -> int:
            self.calls += 1
            libc.syncfs(fd)
            return self.result

        def __getattr__(self, name: str) -> Any:
            return getattr(libc, name)

    lost = episode[3]

    def fsync_lost_data(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == lost:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    fake = Libc()
    monkeypatch.setattr(_layout, "_LIBC", fake)
    monkeypatch.setattr(os, "fsync", fsync_lost_data)
    with pytest.raises(OSError, match="No space left"):
        sync(episode)  # syncfs reported nothing: another caller took the error
    good = _episode_folder(tmp_path / "good")
    fake.result = -1  # syncfs reports an error, another file's
    sync(good)
    assert fake.calls == 2


def test_files_are_flushed_one_by_one_where_one_syncfs_would_not_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``syncfs`` writes out what every program wrote to the file system, and may not reach a
    network or FUSE file system's server: only an ``fsync`` of each file on a file system not
    known to be a local disk's (tmpfs here), across two, or while much else is waiting to be
    written."""
    log = _log_flushes(monkeypatch)
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))  # tmpfs
    try:
        on_tmpfs = _episode_folder(shm / "episode")
        sync(on_tmpfs)
        assert sorted(p for _, p, _ in log) == sorted(on_tmpfs)
        assert {what for what, _, _ in log} == {"fsync"}

        log.clear()
        across = [_episode_folder(tmp_path / "episode")[0], on_tmpfs[0]]
        sync(across)
        assert sorted(p for _, p, _ in log) == sorted(across)
        assert {what for what, _, _ in log} == {"fsync"}
    finally:
        shutil.rmtree(shm)

    log.clear()
    busy = _episode_folder(tmp_path / "busy")
    _busy_disk(monkeypatch)
    sync(busy)
    assert sorted(p for _, p, _ in log) == sorted(busy)
    assert {what for what, _, _ in log} == {"fsync"}


def _cap_address_space(pid: int, headroom: int) -> tuple[int, int]:
    """Cap ``pid``'s address space at its size now plus ``headroom`` (as ``ulimit -v`` does);
    returns the limits it had."""
    with open(f"/proc/{pid}/status") as f:
        size = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize"))
    return resource.prlimit(pid, resource.RLIMIT_AS, (size + headroom, resource.RLIM_INFINITY))


async def test_a_saved_run_plays_under_an_address_space_cap(env: Any, tmp_path: Path) -> None:
    """A batch node's ``ulimit -v`` (SGE's ``h_vmem``): each thread takes a stack and a malloc
    arena of the address space, about 70 MiB here. The 16 threads that flush a saved episode's
    files at once made workers fail episodes grid2op's Runner plays ("can't start new thread").
    Under a cap, the files are flushed one after the other."""
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        await runner.run(2, max_iter=5)  # both workers started, their envs built
        pids = [os.getpid(), *(p.pid for p in psutil.Process().children())]
        limits = [_cap_address_space(pid, 300 << 20) for pid in pids]
        try:
            results = await runner.run(6, max_iter=5, path_save=tmp_path, on_error="continue")
        finally:
            resource.setrlimit(resource.RLIMIT_AS, limits[0])
    assert [(r.nb_time_step, r.error) for r in results] == [(5, None)] * 6
    assert len(EpisodeData.list_episode(str(tmp_path))) == 6


def test_files_are_flushed_when_no_thread_can_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A container's limit on processes (pids.max counts threads): the threads that flush an
    # episode's files at once could not start, and the episode failed after it played.
    paths = [str(tmp_path / f"{k}.npz") for k in range(3)]
    for path in paths:
        Path(path).write_bytes(b"x")
    start = threading.Thread.start

    def no_sync_thread(thread: threading.Thread) -> None:
        if thread.name.startswith("asyncrunner-sync"):
            raise RuntimeError("can't start new thread")
        start(thread)

    flushed: list[str] = []
    fsync = os.fsync

    def logged_fsync(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(_layout, "_POOL", None)  # a pool of its own, with no thread yet
    monkeypatch.setattr(_layout, "_dirty_bytes", lambda: _layout._DIRTY_MAX)  # no syncfs
    monkeypatch.setattr(threading.Thread, "start", no_sync_thread)
    monkeypatch.setattr(os, "fsync", logged_fsync)
    sync(paths)
    assert sorted(set(flushed)) == paths
