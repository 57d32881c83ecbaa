"""asyncrunner.compat.Runner against grid2op's own Runner: same arguments, same tuples, same errors."""

from __future__ import annotations

import asyncio
import copy
import errno
import gc
import inspect
import json
import logging
import multiprocessing
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, cast

import anyio
import grid2op
import numpy as np
import pytest
from grid2op.Agent import BaseAgent, DoNothingAgent
from grid2op.Environment import MaskedEnvironment, TimedOutEnvironment
from grid2op.Episode import CompactEpisodeData, EpisodeData
from grid2op.Exceptions import EnvError, Grid2OpException
from grid2op.Reward import BaseReward, L2RPNReward, LinesCapacityReward
from grid2op.Runner import Runner as GridRunner

from asyncrunner import AsyncRunner, EpisodeError, SinkError, compat
from asyncrunner.compat._sinks import ReplacingWriter

from .conftest import LightSimBackend, make_env
from .helpers import SampleAgent, grid2ops, quiet, run_script

GRID2OP_DATA = Path(grid2op.__file__).parent / "data"


class SimulatingAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Calls ``obs.simulate`` once per step (counted as a high-resolution simulation)."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        observation.simulate(self.action_space({}))
        return self.action_space({})


class TagReward(BaseReward):  # type: ignore[misc]  # grid2op is untyped
    """Rewards each step with the ``tag`` the backend was built with (see TaggedBackend)."""

    def __call__(self, action: Any, env: Any, *args: Any) -> float:
        return float(env.backend._my_kwargs["tag"])


if LightSimBackend is not None:

    class TaggedBackend(LightSimBackend):  # type: ignore[misc]  # lightsim2grid is untyped
        """LightSim with one more constructor argument, kept in ``_my_kwargs`` (backend_kwargs)."""

        def __init__(self, tag: float = 0.0, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._my_kwargs["tag"] = tag


def grid_runner(env: Any, **kwargs: Any) -> Any:
    return quiet(GridRunner, **env.get_params_for_runner(), **kwargs)


def compat_runner(env: Any, **kwargs: Any) -> compat.Runner:
    runner: compat.Runner = quiet(compat.Runner, **env.get_params_for_runner(), **kwargs)
    return runner


def head(results: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The 5 fields grid2op always returns (chronics path as str: grid2op gives numpy's str)."""
    return [(str(r[0]), *r[1:5]) for r in results]


def same_array(a: Any, b: Any) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True))


def assert_same_episode_data(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs) is EpisodeData
    assert ours.name == theirs.name
    assert ours.meta == theirs.meta
    assert ours.parameters == theirs.parameters
    assert ours.other_rewards == theirs.other_rewards
    assert set(ours.episode_times) == set(theirs.episode_times)
    for name in ("rewards", "disc_lines", "legal", "ambiguous"):
        assert same_array(getattr(ours, name), getattr(theirs, name)), name
    assert np.shape(ours.times) == np.shape(theirs.times)
    for name in ("actions", "observations", "env_actions", "attacks"):
        mine, other = getattr(ours, name), getattr(theirs, name)
        assert same_array(mine.collection, other.collection), name
        assert len(mine) == len(other), name
        assert len(mine.objects) == len(other.objects), name
        for t, (a, b) in enumerate(zip(mine.objects, other.objects, strict=True)):
            assert (a is None) == (b is None), name
            if a is not None:
                # What the vector does not hold (voltage angles outside it, forecasts, an
                # action's flags and lazily built arrays: read before ``to_vect`` builds them),
                # but in the first observation, which grid2op builds from its vector too (what
                # that leaves uninitialized differs).
                if name != "observations" or t > 0:
                    assert differences(a, b) == [], f"{name}[{t}]"
                assert same_array(a.to_vect(), b.to_vect()), name
    assert ours.observations[0] is not None


def differences(ours: Any, theirs: Any, where: str = "", depth: int = 0) -> list[str]:
    """Where two grid2op objects' states differ: arrays, numbers, strings, containers, down to
    the objects they hold (spaces and random generators compared by type)."""
    if type(ours) is not type(theirs):
        return [f"{where}: {type(ours).__name__} vs {type(theirs).__name__}"]
    if isinstance(ours, np.ndarray):
        nan = ours.dtype.kind in "fc"
        same = np.array_equal(ours, theirs, equal_nan=nan) and ours.dtype == theirs.dtype
        return [] if same else [where]
    if isinstance(ours, dict):
        if ours.keys() != theirs.keys():
            return [f"{where}: keys"]
        return [d for k in ours for d in differences(ours[k], theirs[k], f"{where}[{k}]", depth)]
    if isinstance(ours, list | tuple):
        if len(ours) != len(theirs):
            return [f"{where}: length"]
        pairs = zip(ours, theirs, strict=True)
        return [
            d for i, (x, y) in enumerate(pairs) for d in differences(x, y, f"{where}[{i}]", depth)
        ]
    if inspect.ismethod(ours) or isinstance(ours, np.random.RandomState) or depth > 1:
        return []
    if hasattr(ours, "__dict__") and not type(ours).__name__.endswith("Space"):
        return differences(vars(ours), vars(theirs), where, depth + 1)
    return [] if ours == theirs or ours is theirs else [where]


@pytest.mark.parametrize(
    ("name", "agent", "make_kwargs", "episode_id"),
    [
        # a high-resolution simulation per step, another reward, an id beyond the chronics count
        pytest.param(
            "l2rpn_case14_sandbox",
            SimulatingAgent,
            {"other_rewards": {"l2": L2RPNReward}},
            [0, 4, 2],
            marks=pytest.mark.slow,
        ),
        # an opponent (attacks in the EpisodeData), a random agent
        ("rte_case14_opponent", SampleAgent, {}, [0, 1, 0]),
        # voltage angles the observations' vectors do not hold, alerts, forecasts
        pytest.param("l2rpn_idf_2023", SampleAgent, {}, [0, 1, 0], marks=pytest.mark.slow),
    ],
)
def test_run_matches_grid2op_with_detailed_output(
    wheel_env: Any,
    name: str,
    agent: type[BaseAgent],
    make_kwargs: dict[str, Any],
    episode_id: list[int],
) -> None:
    env = wheel_env(name, **make_kwargs)
    kwargs: dict[str, Any] = dict(
        nb_episode=3,
        max_iter=8,
        env_seeds=[11, 12, 13],
        agent_seeds=[21, 22, 23],
        episode_id=episode_id,
        add_detailed_output=True,
        add_nb_highres_sim=True,
    )
    expected = grid2ops(grid_runner(env, agentClass=agent).run, nb_process=1, **kwargs)
    runner = compat_runner(env, agentClass=agent)
    results = quiet(runner.run, nb_process=2, **kwargs)
    runner.close()
    assert head(results) == head(expected)
    assert [len(r) for r in results] == [7, 7, 7]
    assert [r[6] for r in results] == [r[6] for r in expected]
    if agent is SimulatingAgent:
        assert [r[6] for r in results] == [r[3] for r in results]  # one per step
    for ours, theirs in zip(results, expected, strict=True):
        assert_same_episode_data(ours[5], theirs[5])


@pytest.mark.parametrize("timed_out", [False, True])
def test_compact_episode_data_matches_grid2op(env: Any, tmp_path: Path, timed_out: bool) -> None:
    # TimedOutEnvironment steps on another path of the worker (it may skip steps: env.steps)
    if timed_out:
        env = TimedOutEnvironment(make_env(), time_out_ms=1e6)
    kwargs: dict[str, Any] = dict(
        nb_episode=2,
        max_iter=6,
        env_seeds=[1, 2],
        agent_seeds=[3, 4],
        add_detailed_output=True,
    )
    theirs_path, ours_path = tmp_path / "grid2op", tmp_path / "compat"
    theirs_path.mkdir()  # grid2op's CompactEpisodeData needs it
    expected = grid2ops(
        grid_runner(env, agentClass=SampleAgent, use_compact_episode_data=True).run,
        path_save=theirs_path,
        **kwargs,
    )
    runner = compat_runner(env, agentClass=SampleAgent, use_compact_episode_data=True)
    results = quiet(runner.run, path_save=ours_path, **kwargs)
    runner.close()
    # CompactEpisodeData sums the rewards in float64: so does compat, to the last bit.
    assert head(results) == head(expected)
    for ours, theirs in zip(results, expected, strict=True):
        mine, other = ours[5], theirs[5]
        assert type(mine) is type(other) is CompactEpisodeData
        assert mine.meta == other.meta
        assert len(mine) == len(other)
        assert mine.exp_dir == ours_path / "CompactEpisodeData"
        for array in mine.array_names:
            assert same_array(getattr(mine, array), getattr(other, array)) or array == "times"
        on_disk = CompactEpisodeData.from_disk(ours_path, mine.ep_id)
        for array in ("actions", "observations", "rewards", "other_rewards", "legal"):
            assert same_array(getattr(on_disk, array), getattr(other, array)), array
    if timed_out:
        env.close()


def test_a_with_block_keeps_one_pool_and_saving_replaces_like_grid2op(
    env: Any, tmp_path: Path
) -> None:
    path = tmp_path / "runs"
    kwargs: dict[str, Any] = dict(nb_episode=2, env_seeds=[5, 6], agent_seeds=[7, 8])
    with compat_runner(env, agentClass=DoNothingAgent) as runner:
        first = runner.run(path_save=path, max_iter=4, nb_process=2, **kwargs)
        (path / "0000" / "0000.gif").write_bytes(b"a replay")  # what EpisodeReplay adds there
        session = runner._ar_session
        assert session is not None and session.runner is not None
        pool = session.runner
        second = runner.run(path_save=path, max_iter=6, nb_process=2, **kwargs)
        assert runner._ar_session is session and session.runner is pool
        pids = set(pool._pids)
        assert len(pids) == 2  # the pool's two workers (both warmed up) served both runs
    assert runner._ar_session is None
    assert [r[3] for r in first] == [4, 4] and [r[3] for r in second] == [6, 6]
    expected = grid2ops(grid_runner(env, agentClass=DoNothingAgent).run, max_iter=6, **kwargs)
    assert head(second) == head(expected)
    # As grid2op does, the second run replaced the first one's folders.
    listed = sorted(name for _, name in EpisodeData.list_episode(str(path)))
    assert listed == ["0000", "0001"]
    assert len(EpisodeData.from_disk(str(path), "0000").actions) == 6
    # grid2op writes its files over the old ones: the others in the folder stay.
    assert (path / "0000" / "0000.gif").read_bytes() == b"a replay"
    for pid in pids:  # the workers stopped with the block
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class WaitsForItsPartner(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Does nothing; writes ``<agent seed>-<pid>`` in ``folder`` as it plays, and the episodes
    seeded 5 and 6 wait at their first step (up to 20 s) until the other one plays too."""

    folder = ""  # set by the test before the runner's workers start
    PARTNERS: ClassVar[dict[int, int]] = {5: 6, 6: 5}

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.seeded = -1

    def seed(self, seed: Any) -> Any:
        self.seeded = int(seed)
        return super().seed(seed)

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        folder = Path(self.folder)
        (folder / f"{self.seeded}-{os.getpid()}").touch()
        partner = self.PARTNERS.pop(self.seeded, None)  # (this process's copy: once)
        deadline = time.monotonic() + 20
        while partner is not None and time.monotonic() < deadline:
            if any(folder.glob(f"{partner}-*")):
                break
            time.sleep(0.01)
        return self.action_space({})


@pytest.mark.parametrize("nb_process", [1, 2])
def test_a_chronic_without_a_name_is_saved_in_path_save_itself(
    tmp_path: Path, nb_process: int
) -> None:
    # ChangeNothing's chronic is named "": grid2op writes its files in path_save itself; compat
    # tried to move path_save into a folder of its own and failed (OSError, the episode lost).
    from grid2op.Chronics import ChangeNothing

    env = make_env(chronics_class=ChangeNothing)
    kwargs: dict[str, Any] = dict(nb_episode=1, max_iter=5, env_seeds=[1], agent_seeds=[2])
    theirs_path, ours_path = tmp_path / "grid2op", tmp_path / "compat"
    expected = quiet(
        grid_runner(env, agentClass=DoNothingAgent).run, path_save=theirs_path, **kwargs
    )
    runner = compat_runner(env, agentClass=DoNothingAgent)
    results = quiet(runner.run, nb_process=nb_process, path_save=ours_path, **kwargs)
    runner.close()
    assert head(results) == head(expected)
    ours = {p.name for p in ours_path.iterdir()} - {"asyncrunner.json"}
    assert ours == {p.name for p in theirs_path.iterdir()}
    for npz in theirs_path.glob("*.npz"):
        if npz.name != "agent_exec_times.npz":
            with np.load(npz) as other, np.load(ours_path / npz.name) as mine:
                assert all(same_array(mine[k], other[k]) for k in other.files), npz.name
    mine, other = (EpisodeData.from_disk(str(p), "") for p in (ours_path, theirs_path))
    assert len(mine) == len(other) and mine.meta == other.meta
    env.close()


def test_a_with_block_run_asking_more_processes_plays_on_that_many(
    env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # grid2op's Runner plays each call on the processes it asks for: a with block kept its pool
    # of one process for a call asking two (a mutation audit found it unguarded).
    monkeypatch.setattr(WaitsForItsPartner, "folder", str(tmp_path))
    kwargs: dict[str, Any] = dict(nb_episode=2, max_iter=3, env_seeds=[1, 2])
    with compat_runner(env, agentClass=WaitsForItsPartner) as runner:
        first = runner.run(nb_process=1, agent_seeds=[3, 4], **kwargs)
        second = runner.run(nb_process=2, agent_seeds=[5, 6], **kwargs)
    assert head(first) == head(second)
    pids = {
        seed: {p.name.split("-")[1] for p in tmp_path.glob(f"{seed}-*")} for seed in range(3, 7)
    }
    assert len(pids[3]) == len(pids[4]) == 1 and pids[3] == pids[4]  # one process
    # Two: each episode played on a process of its own, both at once.
    assert len(pids[5]) == len(pids[6]) == 1 and pids[5] != pids[6]


def test_grid2op_saving_over_our_folder_reads_back_its_own_episode(
    env: Any, tmp_path: Path
) -> None:
    # The drop-in, then grid2op's Runner again, into one folder: grid2op writes its files over
    # ours. A legal_ambiguous.npz of ours stayed, and grid2op's from_disk read it: the flags of
    # the earlier episode (illegal steps it did not play), found by the consumers hunt.
    kwargs: dict[str, Any] = dict(nb_episode=1, max_iter=6, episode_id=[0], path_save=tmp_path)
    with compat_runner(env, agentClass=SampleAgent) as ours:
        ours.run(env_seeds=[11], agent_seeds=[101], **kwargs)
    grid2ops(grid_runner(env, agentClass=DoNothingAgent).run, env_seeds=[12], **kwargs)
    read = quiet(EpisodeData.from_disk, str(tmp_path), "0000")
    assert not read.has_legal_ambiguous and read.legal is None  # as grid2op's own folders
    assert len(read.actions) == 6 and all(not a.as_dict() for a in read.actions)


@pytest.mark.parametrize("failing", ["moving the kept files", "the old folder aside", "placing"])
def test_a_full_disk_while_replacing_a_folder_keeps_it_and_raises_oserror(
    env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Replacing an episode's folder moves the other files in it (a replay's frames, notes) into
    the new one, sets the old one aside and renames the new one into place: a rename that fails
    there (a directory that must grow on a full disk: ENOSPC) deleted the files already moved
    with the new folder. grid2op's Runner, writing over the old files, keeps them and raises
    its ``OSError``; so does this one now, not an ``asyncrunner.SinkError``."""
    path = tmp_path / "runs"
    kwargs: dict[str, Any] = dict(nb_episode=1, env_seeds=[5], agent_seeds=[7], nb_process=1)
    folder = path / "0000"
    with compat_runner(env, agentClass=DoNothingAgent) as runner:
        runner.run(path_save=path, max_iter=4, **kwargs)
        for k in range(5):
            (folder / f"plot_{k}.png").write_bytes(b"a frame %d" % k)
        before = {entry.name: entry.read_bytes() for entry in folder.iterdir()}
        rename = os.rename
        moved: list[str] = []
        failed: list[str] = []  # once: renaming back goes where the failed one went

        def full_disk(src: Any, dst: Any) -> None:
            src, dst = os.fspath(src), os.fspath(dst)
            if not failed:
                if failing == "moving the kept files" and os.path.dirname(src) == str(folder):
                    moved.append(src)
                    fails = len(moved) == 4
                elif failing == "the old folder aside":
                    fails = src == str(folder)
                else:
                    fails = dst == str(folder)
                if fails:
                    failed.append(src)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), src)
            rename(src, dst)

        monkeypatch.setattr(os, "rename", full_disk)
        with pytest.raises(OSError, match="No space left") as raised:
            runner.run(path_save=path, max_iter=6, **kwargs)
        monkeypatch.undo()
    assert raised.value.errno == errno.ENOSPC
    cause = raised.value.__cause__  # the chain ends: a loop hung `while e.__cause__` walks
    assert isinstance(cause, SinkError) and cause.__cause__ is None
    assert {entry.name: entry.read_bytes() for entry in folder.iterdir()} == before
    assert len(EpisodeData.from_disk(str(path), "0000").actions) == 4  # the first run's
    assert [name for name in os.listdir(path) if name.startswith(".")] == []


def _replacement(tmp_path: Path) -> tuple[ReplacingWriter, Path, str, dict[str, str]]:
    """A writer, its folder with an episode ``0000`` saved (and a user's frames beside its
    files), and a new ``0000`` staged to replace it; the contents of the old one's files."""
    path = tmp_path / "runs"
    writer = ReplacingWriter(path)
    old = path / "0000"
    old.mkdir(parents=True)
    for name in ("actions.npz", "episode_meta.json", *(f"plot_{k}.png" for k in range(3))):
        (old / name).write_text(f"old {name}")
    new = os.path.join(writer.stage(), "new")
    os.mkdir(new)
    for name in ("actions.npz", "episode_meta.json"):
        Path(new, name).write_text(f"new {name}")
    return writer, path, new, {f.name: f.read_text() for f in old.iterdir()}


def _contents(path: Path) -> set[str]:
    return {f.read_text() for f in path.rglob("*") if f.is_file()}


@pytest.mark.parametrize("failing", [(2, 3), (4, 5), (5, 6), (5, 7)])
def test_what_a_failed_replacement_cannot_put_back_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: tuple[int, int]
) -> None:
    """A rename of the replacement fails (``failing[0]``: the kept files' moves are renames 1
    to 3, setting the old folder aside 4, placing 5), then one that puts things back (a disk
    still full, EIO): the putting back stopped there, and the old folder (set aside) and the
    user's files (in the new folder) were removed with the work in progress. What cannot go
    back is now kept in hidden folders that no run removes, which the error names."""
    writer, path, new, old = _replacement(tmp_path)
    rename = os.rename
    calls: list[str] = []

    def failing_rename(src: Any, dst: Any) -> None:
        calls.append(os.fspath(src))
        if len(calls) in failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), src)
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="No space left") as raised:
        writer._move_into_place(new, "0000")
    monkeypatch.undo()
    writer._remove([new])  # as Writer._write_episode does, then the run's end
    asyncio.run(writer.aclose())
    assert set(old.values()) <= _contents(path)  # nothing of the old folder lost
    kept = sorted(p.name for p in path.iterdir() if p.name.startswith(".asyncrunner-kept-0000-"))
    assert kept
    (note,) = raised.value.__notes__
    assert all(name in note for name in kept), note


def test_a_folder_placed_meanwhile_by_another_run_loses_nothing(tmp_path: Path) -> None:
    """Another run saves the same chronic in the same folder between this one's setting the old
    folder aside and placing its own: both renames fail (the name is taken), and the old
    episode and the user's files were removed."""
    writer, path, new, old = _replacement(tmp_path)
    target = path / "0000"
    rename = os.rename

    def racing(src: Any, dst: Any) -> None:
        if os.fspath(dst) == str(target) and os.fspath(src) == new:
            target.mkdir()
            (target / "actions.npz").write_text("the other run's")
        rename(src, dst)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "rename", racing)
        with pytest.raises(OSError):
            writer._move_into_place(new, "0000")
    writer._remove([new])
    asyncio.run(writer.aclose())
    assert (target / "actions.npz").read_text() == "the other run's"
    assert set(old.values()) <= _contents(path)


def test_the_runners_parameters_as_they_are_when_it_runs(env: Any) -> None:
    # grid2op's runs build their env from runner.parameters as it is then, and read
    # runner.max_iter in the constructor only.
    kwargs: dict[str, Any] = dict(nb_episode=1, env_seeds=[0], max_iter=20)
    got = []
    params = {**env.get_params_for_runner(), "max_iter": 30}
    for cls in (GridRunner, compat.Runner):
        runner = quiet(cls, **params, agentClass=DoNothingAgent)
        runner.thermal_limit_a = [0.7 * a for a in env.get_thermal_limit()]
        before = quiet(runner.run, **kwargs)
        runner.parameters.NO_OVERFLOW_DISCONNECTION = True
        runner.max_iter = 4
        after = quiet(runner.run, **{**kwargs, "max_iter": None})
        got.append((head(before), head(after)))
    assert got[1] == got[0]
    (before, after) = got[0]
    assert before[0][3] < 20 and after[0][3] == 30  # the change played: no overflow cut


def test_the_constructor_has_grid2ops_signature(env: Any) -> None:
    """grid2op's own test_get_params: what ``_get_params`` returns builds a runner, read from
    the constructor's signature (ours took ``*args, **kwargs``)."""
    parameters = inspect.signature(compat.Runner.__init__).parameters
    assert parameters == inspect.signature(GridRunner.__init__).parameters
    runner = compat_runner(env)
    try:
        assert set(runner._get_params()) <= set(parameters)
    finally:
        runner.close()


class Refusal(Exception):
    """An agent's own error, with what it holds."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message, step)
        self.step = step


class RefusesAtStep3(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if observation.current_step == 3:
            raise Refusal("no action at step 3", observation.current_step)
        return self.action_space({})


@pytest.mark.parametrize("nb_process", [1, 2])
def test_a_failed_episode_raises_its_own_exception_as_grid2op(env: Any, nb_process: int) -> None:
    """grid2op's Runner raises the agent's (or env's) exception itself, multiprocessing's
    pickled copy with several processes: ``except Refusal`` around ``run()`` catches it."""
    raised = []
    for make in (grid_runner, compat_runner):
        runner = make(env, agentClass=RefusesAtStep3)
        with pytest.raises(Refusal) as info:
            quiet(runner.run, 2, nb_process=nb_process, max_iter=5)
        raised.append((info.value.args, info.value.step))
    assert raised[1] == raised[0] == (("no action at step 3", 3), 3)
    assert isinstance(info.value.__cause__, EpisodeError)  # ours: the worker's traceback


def test_an_exception_of_a_class_sent_by_value_comes_back_as_that_class(env: Any) -> None:
    """Classes defined in a function travel by value (cloudpickle): their exceptions too.
    AsyncRunner's own results do not carry the exception (only compat asks for it)."""

    class LocalRefusal(Exception):
        pass

    class Refuses(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
        def act(self, observation: Any, reward: float, done: bool = False) -> Any:
            raise LocalRefusal("no")

    with pytest.raises(LocalRefusal, match="no"):
        quiet(compat_runner(env, agentClass=Refuses).run, 1, nb_process=2, max_iter=3)

    async def main() -> list[Any]:
        async with AsyncRunner(env, agent=Refuses, workers=1) as runner:
            return await runner.run(1, max_iter=3, on_error="continue")

    (result,) = anyio.run(main)
    assert result.error is not None and result.error.error_type == "LocalRefusal"
    assert result.error.exception is None


def test_float_episode_ids_play_as_grid2op_plays_them(env: Any) -> None:
    kwargs: dict[str, Any] = dict(nb_episode=2, env_seeds=[0, 1], max_iter=3)
    ids = np.array([1.0, 2.7])  # read from a float column: grid2op's set_id takes int(...)
    expected = grid2ops(grid_runner(env).run, episode_id=ids, **kwargs)
    assert [r[1] for r in expected] == ["0001", "0002"]
    assert head(quiet(compat_runner(env).run, episode_id=ids, nb_process=2, **kwargs)) == head(
        expected
    )


def test_ids_past_the_chronics_and_the_largest_env_seed_play_as_grid2op_plays_them(
    env: Any,
) -> None:
    # grid2op wraps an integer id around the chronics it plays (5 is 0002 of 3) and takes an env
    # seed up to 2**31 - 1 included.
    kwargs: dict[str, Any] = dict(
        nb_episode=2, episode_id=[5, 1], env_seeds=[2**31 - 1, 0], agent_seeds=[3, 4], max_iter=3
    )
    expected = grid2ops(grid_runner(env, agentClass=SampleAgent).run, **kwargs)
    assert [r[1] for r in expected] == ["0002", "0001"]
    runner = compat_runner(env, agentClass=SampleAgent)
    try:
        assert head(quiet(runner.run, nb_process=2, **kwargs)) == head(expected)
    finally:
        runner.close()


@pytest.fixture(scope="module")
def runners(env: Any) -> Iterator[tuple[Any, compat.Runner]]:
    ours = compat_runner(env)
    yield grid_runner(env), ours
    ours.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(nb_episode=-1),
        dict(nb_episode=2, env_seeds=[1]),
        dict(nb_episode=1, env_seeds=[1, 2]),  # more seeds than episodes: refused too
        dict(nb_episode=2, agent_seeds=[1, 2, 3]),
        dict(nb_episode=2, episode_id=[0]),
        dict(nb_episode=2, init_states=[{}]),
        dict(nb_episode=1, init_states=[1]),
        dict(nb_episode=1, init_states="set_line_status"),
        dict(nb_episode=1, reset_options={"bogus": 1}),
        dict(nb_episode=1, reset_options=[{"bogus": 1}]),
        dict(nb_episode=1, reset_options=[1]),
        dict(nb_episode=1, reset_options="max step"),
        dict(nb_episode=1, nb_process=0),
        dict(nb_episode=1, max_iter="ten"),
        dict(nb_episode=1, max_iter=0),
        dict(nb_episode=1, episode_id=["no_such_chronic"]),
        # grid2op's reset checks (it raises them as the episode starts): its exceptions too
        dict(nb_episode=1, max_iter=3, episode_id=[None]),
        dict(nb_episode=1, max_iter=3, init_states={"set_line_status": [(99, -1)]}),
        dict(nb_episode=1, max_iter=3, init_states={"redispatch": [(0, 1000.0)]}),
        dict(nb_episode=1, max_iter=3, reset_options={"init state": "set_line_status"}),
        dict(nb_episode=1, reset_options={"max step": 0}),
        dict(nb_episode=1, max_iter=3, reset_options={"init ts": 0}),
        dict(nb_episode=1, max_iter=3, reset_options={"init ts": "abc"}),
        # (asyncrunner's ValueError before: found by a hunt)
        dict(nb_episode=1, max_iter=3, reset_options={"init datetime": "2024/01/01"}),
        dict(nb_episode=1, max_iter=3, reset_options={"init datetime": 20240101}),
    ],
)
def test_bad_arguments_raise_grid2op_errors(
    runners: tuple[Any, compat.Runner], kwargs: dict[str, Any]
) -> None:
    theirs, ours = runners
    with pytest.raises(Exception) as expected:
        grid2ops(theirs.run, **kwargs)
    with pytest.raises(expected.type) as raised:
        quiet(ours.run, **kwargs)
    assert str(raised.value) == str(expected.value)
    assert ours._ar_session is None  # failed before any worker started


def test_a_bad_thermal_limit_raises_a_grid2op_error(runners: tuple[Any, compat.Runner]) -> None:
    # asyncrunner's ValueError, which `except Grid2OpException` did not catch (found by a hunt);
    # the message is the async core's.
    theirs, ours = runners
    for limit in ([100.0, 100.0], {"no such line": 100.0}):
        kwargs: dict[str, Any] = dict(
            nb_episode=1, max_iter=3, reset_options={"thermal limit": limit}
        )
        with pytest.raises(Grid2OpException):
            grid2ops(theirs.run, **kwargs)
        with pytest.raises(Grid2OpException, match="thermal limit"):
            quiet(ours.run, **kwargs)


class PeriodicAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Changes the topology every 4 steps, its choice led by counters kept across episodes: its
    step count (on the agent) and its episode count (on its class)."""

    episodes = 0

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        topologies = action_space.get_all_unitary_topologies_set(action_space, sub_id=1)
        self.actions = [action_space({}), *topologies[:4]]
        self.steps = 0

    def reset(self, obs: Any) -> None:
        type(self).episodes += 1

    def act(self, observation: Any, reward: Any, done: bool = False) -> Any:
        self.steps += 1
        if self.steps % 4:
            return self.actions[0]
        return self.actions[1 + (type(self).episodes + self.steps // 4) % 4]


@pytest.mark.parametrize("kind", ["agentClass", "agentInstance"])
def test_what_episodes_change_in_the_agent_carries_over_as_in_grid2op(env: Any, kind: str) -> None:
    # grid2op plays each episode of one process on a shallow copy of the agent the episode
    # before played, and builds the agents of a class in the process the class changes in: an
    # agent counting its steps, or its episodes on its class, played other episodes than
    # grid2op's (compat set the class's attributes again before each agent, and played copies
    # of the instance itself) (found by a hunt). (With several processes, such an agent's
    # results depend on which process plays which episode: grid2op deals them out in turn,
    # compat to the first worker free.)
    kwargs: dict[str, Any] = dict(
        nb_episode=4,
        nb_process=1,
        env_seeds=[0, 1, 2, 3],
        agent_seeds=[0, 1, 2, 3],
        max_iter=20,
        episode_id=[0, 1, 0, 1],
    )
    results = []
    for make in (grid_runner, compat_runner):
        PeriodicAgent.episodes = 0
        if kind == "agentClass":
            runner = make(env, agentClass=PeriodicAgent)
        else:
            runner = make(env, agentClass=None, agentInstance=PeriodicAgent(env.action_space))
        played = (
            grid2ops(runner.run, **kwargs) if make is grid_runner else quiet(runner.run, **kwargs)
        )
        results.append(sorted(head(played)))
    assert results[0] == results[1]
    assert len({r[3] for r in results[1]}) > 1  # the counters led to other episodes


def test_the_runner_logs_what_grid2ops_logs(env: Any, caplog: pytest.LogCaptureFixture) -> None:
    # "Sequential runner used." and each episode's times and reward on the runner's logger
    # (found by a hunt: compat logged none of them).
    logged = []
    for make in (grid_runner, compat_runner):
        runner = make(env, agentClass=DoNothingAgent)
        with caplog.at_level(logging.INFO, logger=runner.logger.name):
            caplog.clear()
            run = grid2ops if make is grid_runner else quiet
            run(runner.run, nb_episode=2, max_iter=3, env_seeds=[0, 1], episode_id=[0, 1])
        lines = [r.getMessage().split("\n") for r in caplog.records if r.name == runner.logger.name]
        logged.append([(len(m), m[0].split(":")[0], m[-1]) for m in lines])
    assert logged[0] == logged[1]
    assert [m[:2] for m in logged[1]] == [(1, "Sequential runner used."), (7, "Env"), (7, "Env")]


def test_a_pbar_that_is_no_bar(runners: tuple[Any, compat.Runner], tmp_path: Path) -> None:
    # It failed the run after its first episode (saved); grid2op's parallel runs ignore pbar,
    # its sequential ones refuse it before any episode.
    theirs, ours = runners
    kwargs: dict[str, Any] = dict(nb_episode=3, max_iter=3, pbar=1)
    expected = grid2ops(theirs.run, nb_process=2, path_save=tmp_path / "theirs", **kwargs)
    results = quiet(ours.run, nb_process=2, path_save=tmp_path / "ours", **kwargs)
    assert sorted(r[1:5] for r in results) == sorted(e[1:5] for e in expected)
    assert sorted(p.name for p in (tmp_path / "ours").iterdir() if p.is_dir()) == [
        "0000",
        "0001",
        "0002",
    ]
    with pytest.raises(TypeError):
        grid2ops(theirs.run, nb_process=1, **kwargs)
    ours.close()
    with pytest.raises(TypeError, match=r"a bar with an update\(n\) method, got 1"):
        quiet(ours.run, nb_process=1, **kwargs)
    assert ours._ar_session is None  # refused before any worker started


def test_high_resolution_simulations_are_counted_as_grid2op_counts_them(env: Any) -> None:
    # The fast tier's guard of nb_highres_sim (the parametrization of
    # test_run_matches_grid2op_with_detailed_output with SimulatingAgent is slow).
    kwargs: dict[str, Any] = dict(nb_episode=2, max_iter=4, env_seeds=[1, 2], agent_seeds=[3, 4])
    expected = grid2ops(
        grid_runner(env, agentClass=SimulatingAgent).run, add_nb_highres_sim=True, **kwargs
    )
    assert [r[5] for r in expected] == [4, 4]  # one per step
    runner = compat_runner(env, agentClass=SimulatingAgent)
    try:
        results = quiet(runner.run, add_nb_highres_sim=True, nb_process=2, **kwargs)
    finally:
        runner.close()
    assert head(results) == head(expected)
    assert [r[5] for r in results] == [r[5] for r in expected]

    async def main() -> list[Any]:
        async with AsyncRunner(env, agent=SimulatingAgent, workers=2) as ours:
            return await ours.run(**kwargs)

    played = anyio.run(main)
    assert [r.as_tuple() for r in played] == head(expected)
    assert [r.nb_highres_sim for r in played] == [r[5] for r in expected]


def test_run_one_episode_matches_grid2op(env: Any) -> None:
    kwargs: dict[str, Any] = dict(max_iter=5, env_seed=3, agent_seed=4, add_nb_highres_sim=True)
    theirs: dict[str, Any] = {"time serie id": 1, "init ts": 2}
    expected = grid2ops(
        grid_runner(env, agentClass=SampleAgent).run_one_episode,
        reset_options=theirs,
        detailed_output=True,
        **kwargs,
    )
    runner = compat_runner(env, agentClass=SampleAgent)
    options = {"time serie id": 1, "init ts": 2}
    result = runner.run_one_episode(reset_options=options, detailed_output=True, **kwargs)
    # grid2op takes the id out of the caller's dict, then writes what its episode played in it
    assert options == theirs == {"time serie id": 1, "init ts": 2, "max step": 5}
    assert head([result]) == head([expected]) and result[1] == "0001"
    assert type(result[2]) is type(expected[2]) is np.float32
    assert result[6] == expected[6] == 0
    assert_same_episode_data(result[5], expected[5])
    # grid2op's warning, in the caller's thread: episode_id wins over "time serie id".
    with pytest.warns(UserWarning, match="time serie id"):
        again = runner.run_one_episode(reset_options={"time serie id": 1}, episode_id=2, max_iter=3)
    assert len(again) == 5 and again[1] == "0002" and again[4] == 3  # max_ts: max_iter
    with pytest.raises(EnvError, match="not an integer"):  # as grid2op's reset reads "max step"
        runner.run_one_episode(max_iter=cast(Any, 2.5))
    runner.close()


def test_reset_options_and_init_states_match_grid2op(env: Any) -> None:
    # grid2op's test_reset_options_runner.py, on an env of the wheel: per-episode options, and
    # run()'s own arguments overriding them (with grid2op's warnings).
    options = [
        {"time serie id": 1, "max step": 4},
        {"init state": {"set_line_status": [(1, -1)]}, "max step": 3},
        {"time serie id": 0, "max step": 2},
    ]
    cases: list[tuple[dict[str, Any], str | None, list[int], list[list[int]]]] = [
        # (run's arguments, the warning compat must give, max_ts, lines off at the start)
        (dict(), None, [4, 3, 2], [[], [1], []]),
        (dict(max_iter=5), "max step", [5, 5, 5], [[], [1], []]),
        (
            dict(max_iter=5, init_states={"set_line_status": [(2, -1)]}),
            "init state",
            [5, 5, 5],
            [[2], [2], [2]],
        ),
    ]
    theirs = grid_runner(env, agentClass=SampleAgent)
    ours = compat_runner(env, agentClass=SampleAgent)
    for case, warning, max_ts, lines_off in cases:
        kwargs: dict[str, Any] = dict(
            nb_episode=3, env_seeds=[1, 2, 3], agent_seeds=[4, 5, 6], add_detailed_output=True
        )
        expected = grid2ops(theirs.run, reset_options=copy.deepcopy(options), **kwargs, **case)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = ours.run(nb_process=2, reset_options=copy.deepcopy(options), **kwargs, **case)
        messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        assert (warning is None) == (not any("`reset_options`" in m for m in messages))
        assert warning is None or any(f"`{warning}`" in m for m in messages), messages
        assert head(results) == head(expected)
        assert [r[1] for r in results] == ["0001", "0001", "0000"]
        assert [r[4] for r in results] == max_ts
        for ours_r, theirs_r, off in zip(results, expected, lines_off, strict=True):
            status = ours_r[5].observations[0].line_status
            assert np.flatnonzero(~status).tolist() == off
            assert same_array(status, theirs_r[5].observations[0].line_status)
            assert same_array(ours_r[5].rewards, theirs_r[5].rewards)
    ours.close()


@pytest.mark.anyio
async def test_run_called_where_an_event_loop_is_running(env: Any) -> None:
    kwargs: dict[str, Any] = dict(nb_episode=2, max_iter=5, env_seeds=[1, 2], agent_seeds=[3, 4])
    expected = grid2ops(grid_runner(env, agentClass=SampleAgent).run, **kwargs)
    asyncio.get_running_loop()  # raises if no loop runs here
    runner = compat_runner(env, agentClass=SampleAgent)
    results = runner.run(nb_process=2, **kwargs)  # sync code, called from a coroutine
    assert head(results) == head(expected)
    one = runner.run_one_episode(indx=1, max_iter=5, env_seed=2, agent_seed=4)
    assert head([one]) == head(expected[1:])


def test_an_agent_that_cannot_be_pickled_plays_in_process(env: Any) -> None:
    agent = SampleAgent(env.action_space)
    agent.lock = multiprocessing.Lock().__enter__  # a bound method of a lock: not picklable
    kwargs: dict[str, Any] = dict(nb_episode=2, max_iter=4, env_seeds=[1, 2], agent_seeds=[3, 4])
    expected = grid2ops(grid_runner(env, agentClass=None, agentInstance=agent).run, **kwargs)
    runner = compat_runner(env, agentClass=None, agentInstance=agent)
    with pytest.warns(UserWarning, match="cannot be pickled"):
        results = runner.run(nb_process=2, **kwargs)
    assert head(results) == head(expected)
    assert runner._ar_session is None  # no worker (and no env but the constructor's: below)


class _HookedRunner(compat.Runner):
    """Overrides how the env is built: workers, which build it from the parameters, cannot."""

    def init_env(self) -> Any:
        env = super().init_env()
        env.set_thermal_limit(env.get_thermal_limit() * 0.5)
        return env


def test_a_subclass_building_the_env_itself_plays_in_process(env: Any) -> None:
    runner = quiet(_HookedRunner, **env.get_params_for_runner(), agentClass=DoNothingAgent)
    with pytest.warns(UserWarning, match="overrides Runner.init_env"):
        (low,) = runner.run(nb_episode=1, max_iter=20, env_seeds=[1])
    (normal,) = grid2ops(grid_runner(env).run, nb_episode=1, max_iter=20, env_seeds=[1])
    assert low[3] < normal[3]  # the hook did act: lower limits, earlier game over


def _local_dir_env(tmp_path: Path) -> Any:
    # experimental_read_from_local_dir reads classes generated in the env's folder: a copy.
    path = tmp_path / "l2rpn_case14_sandbox"
    shutil.copytree(GRID2OP_DATA / "l2rpn_case14_sandbox", path)
    env = quiet(grid2op.make, str(path))
    quiet(env.generate_classes)
    env.close()
    return quiet(grid2op.make, str(path), experimental_read_from_local_dir=True)


@pytest.mark.parametrize("made_with", [{}, {"max_iter": 5}])
def test_max_iter_minus_one_plays_without_limit_as_grid2op(made_with: dict[str, Any]) -> None:
    # grid2op resets with "max step": -1: no limit (over the constructor's max_iter too), and
    # max_episode_duration() -1, which EpisodeDurationReward reads.
    from grid2op.Reward import EpisodeDurationReward

    env = make_env("rte_case14_opponent", reward_class=EpisodeDurationReward)
    kwargs: dict[str, Any] = dict(nb_episode=1, env_seeds=[11], agent_seeds=[5], max_iter=-1)
    params = {**env.get_params_for_runner(), **made_with, "agentClass": DoNothingAgent}
    expected = grid2ops(quiet(GridRunner, **params).run, **kwargs)
    runner: compat.Runner = quiet(compat.Runner, **params)
    results = quiet(runner.run, **kwargs)
    runner.close()
    env.close()
    assert head(results) == head(expected) and results[0][3] > 5


@pytest.mark.parametrize(
    ("call", "kwargs"),
    [
        ("run", dict(nb_episode=1, max_iter=-1)),
        ("run", dict(nb_episode=2, nb_process=2, reset_options={"max step": -1})),
        ("run_one_episode", dict(max_iter=-1, detailed_output=True)),
    ],
)
def test_compact_episodes_without_limit_fail_as_in_grid2op(
    env: Any, tmp_path: Path, call: str, kwargs: dict[str, Any]
) -> None:
    # grid2op's CompactEpisodeData preallocates env.max_episode_duration() rows, -1 after a reset
    # with "max step": -1: its Runner raises numpy's ValueError. compat played and saved them,
    # with -1 as their length, which len() of the episode read back refused (found by a hunt).
    theirs = grid_runner(env, agentClass=DoNothingAgent, use_compact_episode_data=True)
    with pytest.raises(ValueError) as expected:
        grid2ops(getattr(theirs, call), **kwargs)
    ours = compat_runner(env, agentClass=DoNothingAgent, use_compact_episode_data=True)
    with pytest.raises(ValueError) as raised:
        quiet(getattr(ours, call), **kwargs, path_save=tmp_path)
    assert str(raised.value) == str(expected.value) == "negative dimensions are not allowed"
    assert not any(tmp_path.rglob("*.npz"))  # before any episode played


class NoValueReward(BaseReward):  # type: ignore[misc]  # grid2op is untyped
    """A reward that forgot its ``return``: grid2op's EpisodeData records -inf."""

    def __call__(self, *args: Any) -> Any:
        return None


def test_an_other_reward_that_is_no_number_is_saved_as_grid2op_saves_it(tmp_path: Path) -> None:
    env = make_env(other_rewards={"none": NoValueReward})
    kwargs: dict[str, Any] = dict(nb_episode=1, max_iter=3, env_seeds=[1], add_detailed_output=True)
    expected = grid2ops(grid_runner(env, agentClass=DoNothingAgent).run, **kwargs,
                        path_save=tmp_path / "grid2op")  # fmt: skip
    runner = compat_runner(env, agentClass=DoNothingAgent)
    results = quiet(runner.run, **kwargs, path_save=tmp_path / "compat")
    runner.close()
    env.close()
    assert results[0][5].other_rewards == expected[0][5].other_rewards == [{"none": -np.inf}] * 3
    saved = [(tmp_path / side / "0000" / "other_rewards.json").read_text() for side in
             ("grid2op", "compat")]  # fmt: skip
    assert json.loads(saved[0]) == json.loads(saved[1]) == [{"none": -np.inf}] * 3


class CutsLines(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Disconnects one more line each step: a game over within a few steps."""

    def reset(self, obs: Any) -> None:
        self.k = 0

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        self.k += 1
        return self.action_space({"set_line_status": [(i, -1) for i in range(self.k)]})


def test_an_endless_chronic_gives_grid2ops_max_ts() -> None:
    # ChangeNothing has no end (max_timestep() is -1): grid2op's tuples say 0.
    from grid2op.Chronics import ChangeNothing

    env = make_env(chronics_class=ChangeNothing)
    kwargs: dict[str, Any] = dict(nb_episode=2, nb_process=2, env_seeds=[1, 2], agent_seeds=[3, 4])
    expected = grid2ops(grid_runner(env, agentClass=CutsLines).run, **kwargs)
    runner = compat_runner(env, agentClass=CutsLines)
    results = quiet(runner.run, **kwargs)
    runner.close()
    env.close()
    assert head(results) == head(expected) and [r[4] for r in results] == [0, 0]


@pytest.mark.slow  # a special env each (local_dir generates the env's classes)
@pytest.mark.parametrize("kind", ["timed_out", "masked", "local_dir", "backend_kwargs"])
def test_env_kinds_grid2op_builds_specially(kind: str, tmp_path: Path) -> None:
    agent: type[BaseAgent] = SampleAgent
    expected_type = "Environment"
    if kind == "timed_out":
        env = TimedOutEnvironment(make_env(), time_out_ms=1e6)
        expected_type = "TimedOutEnvironment"
    elif kind == "masked":
        lines = np.arange(20) < 10
        env = MaskedEnvironment(make_env(), lines_of_interest=lines)
        expected_type = "MaskedEnvironment"
    elif kind == "local_dir":
        env = _local_dir_env(tmp_path)
        assert env.get_params_for_runner()["_read_from_local_dir"] is not None
        agent = DoNothingAgent
    else:
        if LightSimBackend is None:
            pytest.skip("needs lightsim2grid")
        env = make_env(backend=TaggedBackend(tag=2.5), reward_class=TagReward)
        assert env.get_params_for_runner()["backend_kwargs"]["tag"] == 2.5
    kwargs: dict[str, Any] = dict(
        nb_episode=2, max_iter=5, env_seeds=[1, 2], agent_seeds=[3, 4], episode_id=[1, 0]
    )
    expected = grid2ops(grid_runner(env, agentClass=agent).run, **kwargs)
    runner = compat_runner(env, agentClass=agent)
    results = quiet(runner.run, add_detailed_output=True, **kwargs)
    runner.close()
    assert head(results) == head(expected)
    for result in results:  # what the worker built
        assert result[5].meta["env_type"].startswith(expected_type)
    if kind == "backend_kwargs":
        assert [r[2] for r in results] == [2.5 * 5, 2.5 * 5]
    env.close()


def test_envs_built_in_this_process_by_a_run(
    env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # grid2op's constructor builds an env and closes it; compat keeps that one for its runs and
    # as the pristine env its forked workers start with: one build in all, none in the workers.
    # grid2op's Runner builds one per episode (nb_process=1).
    log = tmp_path / "builds"  # a file: the forked workers' builds are noted too
    new_env = GridRunner._new_env

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        with log.open("a") as f:
            f.write(f"{os.getpid()} {type(self).__module__}\n")
        return new_env(self, *args, **kwargs)

    def built() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    monkeypatch.setattr(GridRunner, "_new_env", counting)
    kwargs: dict[str, Any] = dict(nb_episode=2, max_iter=3, env_seeds=[1, 2], agent_seeds=[3, 4])
    runner = compat_runner(env, agentClass=DoNothingAgent)
    once = [f"{os.getpid()} asyncrunner.compat._runner"]
    assert built() == once  # grid2op's constructor's, kept
    kept = runner._ar_env
    results = runner.run(nb_process=2, **kwargs)
    results_again = runner.run(nb_process=2, **kwargs)
    assert built() == once  # nothing built since, here or in the workers of both runs
    assert not kept._BaseEnv__closed  # the runner's until close()
    runner.close()
    assert kept._BaseEnv__closed
    assert head(results) == head(results_again)
    assert head(results) == head(
        grid2ops(grid_runner(env, agentClass=DoNothingAgent).run, **kwargs)
    )


def test_a_runner_left_unclosed_closes_its_env_when_collected(env: Any) -> None:
    # Scripts do not close grid2op's Runner (it keeps no env). Ours keeps one: dropped, the
    # runner closes it, in order, rather than leave it to the collector (which may finalize its
    # observation env first, and the env's own close then raises).
    runner = compat_runner(env, agentClass=DoNothingAgent)
    runner.run(nb_episode=1, nb_process=2, max_iter=2)
    kept = runner._ar_env
    obs_env = kept._observation_space.obs_env
    del runner
    gc.collect()
    assert kept._BaseEnv__closed and obs_env._BaseEnv__closed


def test_the_constructor_parses_the_grid_once_per_process(
    env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # grid2op's constructor builds an env; ours reads the grid's file parsed by an earlier build
    # of this process (or from the disk's cache), the same parse of the same bytes.
    import pandapower  # type: ignore[import-untyped]

    parsed: list[Any] = []
    real = pandapower.from_json

    def from_json(*args: Any, **kwargs: Any) -> Any:
        parsed.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(pandapower, "from_json", from_json)
    params = env.get_params_for_runner()
    for _ in range(2):
        quiet(compat.Runner, **params, agentClass=DoNothingAgent).close()
    assert len(parsed) <= 1  # grid2op's own constructor parses it at each build


THREADS_SCRIPT = """
import sys, threading, warnings
warnings.filterwarnings("ignore")
from grid2op.Agent import RandomAgent
from asyncrunner.compat import Runner
from tests.conftest import make_env

RUN = dict(max_iter=30, env_seeds=[1, 2, 3, 4], agent_seeds=[5, 6, 7, 8], episode_id=[0, 1, 0, 1])
envs = [make_env("rte_case14_opponent"), make_env()]
BUILD = threading.Lock()  # grid2op's env builds are not thread-safe: the user's lock
results = {}


def endpoint(k):  # a sync web endpoint's thread
    for _ in range(6):
        with BUILD:
            runner = Runner(**envs[k].get_params_for_runner(), agentClass=RandomAgent)
        got = sorted(tuple(x[1:]) for x in runner.run(nb_episode=4, nb_process=2, **RUN))
        assert results.setdefault(k, got) == got


threads = [threading.Thread(target=endpoint, args=(k,)) for k in (0, 1)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("done", len(results))
"""


@pytest.mark.slow  # a subprocess, 24 runs
def test_runners_of_two_threads_fork_workers_that_start_sound(tmp_path: Path) -> None:
    # One thread's constructor built its env while the other's run forked workers: some started
    # with their after-fork hooks failed ("Exception ignored in: <bound method Random.seed ...>
    # SystemError"; 6 in a run like this one): their `random` was not reseeded.
    script = tmp_path / "service.py"
    script.write_text(THREADS_SCRIPT)
    done = run_script(script)
    assert done.returncode == 0 and done.stdout.strip() == "done 2", done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]


MAIN_ERROR_SCRIPT = """
import time
import warnings
warnings.simplefilter("ignore")
from grid2op.Agent import BaseAgent
from asyncrunner.compat import Runner
from tests.conftest import make_env


class PolicyError(Exception):
    pass


class Fails(BaseAgent):
    def act(self, obs, reward, done=False):
        raise PolicyError("no action")


env = make_env()
for nb_process in (1, 2):
    try:
        Runner(**env.get_params_for_runner(), agentClass=Fails).run(
            nb_episode=2, nb_process=nb_process, max_iter=3
        )
    except PolicyError:
        print("caught", nb_process)
"""


def test_an_exception_class_of_the_script_is_caught_by_its_except(tmp_path: Path) -> None:
    # grid2op's Runner raises the script's class; compat raised a copy of it (by value), which
    # `except PolicyError` did not catch.
    script = tmp_path / "evaluate.py"
    script.write_text(MAIN_ERROR_SCRIPT)
    done = run_script(script)
    assert done.stdout.split("\n")[:2] == ["caught 1", "caught 2"], done.stderr[-3000:]


def test_each_call_outside_a_with_block_plays_the_env_folder_as_it_is(tmp_path: Path) -> None:
    # grid2op's Runner builds an env at each run(): a chronic removed between two calls is not
    # played. compat kept its constructor's env (and its chronics) for every call: it played a
    # removed chronic's cached data, or failed (found by the caches hunt). It keeps it while the
    # chronics are those it found.
    folder = tmp_path / "case14"
    shutil.copytree(Path(grid2op.__file__).parent / "data" / "l2rpn_case14_sandbox", folder)
    env = quiet(grid2op.make, str(folder), backend=LightSimBackend())
    kwargs: dict[str, Any] = dict(
        nb_episode=1, episode_id=[0], max_iter=3, env_seeds=[1], agent_seeds=[2]
    )
    ours, theirs = (
        compat_runner(env, agentClass=SampleAgent),
        grid_runner(env, agentClass=SampleAgent),
    )
    try:
        assert head(quiet(ours.run, **kwargs)) == head(grid2ops(theirs.run, **kwargs))
        shutil.rmtree(folder / "chronics" / "0000")
        expected = head(grid2ops(theirs.run, **kwargs))
        assert expected[0][1] == "0001"
        assert head(quiet(ours.run, **kwargs)) == expected
    finally:
        ours.close()
        env.close()


class TenthReward(BaseReward):  # type: ignore[misc]  # grid2op is untyped
    """0.1 at each step: a Python float that float32 cannot hold exactly."""

    def __call__(self, action: Any, env: Any, *args: Any) -> float:
        return 0.1


@pytest.mark.parametrize("reward_class", [LinesCapacityReward, TenthReward])
def test_rewards_that_are_no_float32_sum_as_grid2op_sums_them(
    reward_class: type, tmp_path: Path
) -> None:
    """grid2op adds each reward to a float32 sum, which a float64 reward (LinesCapacityReward's)
    makes a float64; CompactEpisodeData sums ``float(reward)``. 64 steps: the last batch of
    steps is full, and the detailed output reads the steps too (it was counted twice)."""
    env = make_env(reward_class=reward_class)
    kwargs: dict[str, Any] = dict(nb_episode=2, max_iter=64, env_seeds=[0, 1])
    for compact in (False, True):
        made = dict(agentClass=DoNothingAgent, use_compact_episode_data=compact)
        theirs_path, ours_path = tmp_path / f"grid2op{compact}", tmp_path / f"compat{compact}"
        theirs_path.mkdir()
        expected = grid2ops(
            grid_runner(env, **made).run, path_save=theirs_path, add_detailed_output=True, **kwargs
        )
        runner = compat_runner(env, **made)
        results = quiet(runner.run, path_save=ours_path, add_detailed_output=True, **kwargs)
        assert [repr(r[2]) for r in results] == [repr(r[2]) for r in expected]
        assert [r[5].meta for r in results] == [r[5].meta for r in expected]
        one = runner.run_one_episode(max_iter=5, env_seed=0)
        runner.close()
        other = grid2ops(grid_runner(env, **made).run_one_episode, max_iter=5, env_seed=0)
        assert repr(one[2]) == repr(other[2])
        if compact:
            meta = "CompactEpisodeData/0000_metadata.json"
            saved = [json.loads((p / meta).read_text()) for p in (ours_path, theirs_path)]
            assert saved[0]["cumulative_reward"] == saved[1]["cumulative_reward"]
    env.close()


class FailsItsSecondEpisode(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Raises at step 2 of the episode played with agent seed 1."""

    seeded: int | None = None

    def seed(self, seed: int) -> Any:
        self.seeded = seed
        return super().seed(seed)

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if self.seeded == 1 and observation.current_step == 2:
            raise Refusal("no action at step 2", 2)
        return self.action_space({})


def test_one_failed_episode_of_two_processes_keeps_what_the_others_saved(
    env: Any, tmp_path: Path
) -> None:
    """grid2op's Pool raises once every process is done: episodes 0 and 2 (the first process's)
    are saved, and raise the failure of episode 1 (the second's) after them."""
    kwargs: dict[str, Any] = dict(nb_process=2, max_iter=6, agent_seeds=[0, 1, 2, 3])
    saved = {}
    for make in (grid_runner, compat_runner):
        path = tmp_path / make.__name__
        with pytest.raises(Refusal):
            quiet(make(env, agentClass=FailsItsSecondEpisode).run, 4, path_save=path, **kwargs)
        saved[make] = {
            p.parent.name: json.loads(p.read_text())["cumulative_reward"]
            for p in path.glob("*/episode_meta.json")
        }
    assert set(saved[grid_runner]) == {"0000", "0002"}  # (and 0001's empty folder)
    assert {k: saved[compat_runner][k] for k in saved[grid_runner]} == saved[grid_runner]


@pytest.mark.parametrize("nb_process", [1, 2])
def test_an_init_state_method_is_read_as_grid2op_reads_it(tmp_path: Path, nb_process: int) -> None:
    """grid2op's env.reset deletes "method" from the init state dict it is given: episodes of a
    process sharing that dict reset with "combine" after the first (this chronic's own initial
    state then disconnects a second line)."""
    folder = tmp_path / "env"
    shutil.copytree(GRID2OP_DATA / "l2rpn_case14_sandbox", folder)
    (folder / "chronics" / "0000" / "init_state.json").write_text(
        json.dumps({"set_line_status": [["1_2_2", -1]]})
    )
    env = make_env(str(folder))
    kwargs: dict[str, Any] = dict(
        nb_episode=4, nb_process=nb_process, max_iter=8, env_seeds=[0] * 4, episode_id=[0] * 4
    )
    try:
        played = []
        for make in (grid_runner, compat_runner):
            state = {"set_line_status": [(0, -1)], "method": "ignore"}
            results = quiet(
                make(env, agentClass=DoNothingAgent).run,
                reset_options={"init state": state},
                **kwargs,
            )
            played.append((sorted(r[2] for r in results), state))
    finally:
        env.close()
    assert played[1] == played[0]
    assert len(set(played[0][0])) == 2  # the two methods' rewards
    assert ("method" in played[0][1]) is (nb_process > 1)  # the caller's dict, with one process


class FailsAtItsSeedsStep(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Raises at the step its agent seed says (a step every 20 ms)."""

    seeded = 0

    def seed(self, seed: int) -> Any:
        self.seeded = seed
        return super().seed(seed)

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        time.sleep(0.02)
        if observation.current_step == self.seeded:
            raise Refusal(f"no action at step {self.seeded}", self.seeded)
        return self.action_space({})


def test_of_failures_in_two_processes_the_first_to_come_is_raised(env: Any) -> None:
    """grid2op's Pool keeps the exception that came first: episode 1's (at its step 1), not
    episode 0's (at its step 50, a second later: a worker started late on a busy machine still
    comes first; 15 steps, 0.3 s, did not on CI once)."""
    raised = []
    for make in (grid_runner, compat_runner):
        with pytest.raises(Refusal) as info:
            quiet(
                make(env, agentClass=FailsAtItsSeedsStep).run,
                2, nb_process=2, max_iter=60, agent_seeds=[50, 1],
            )  # fmt: skip
        raised.append(info.value.args)
    assert raised[1] == raised[0] == ("no action at step 1", 1)


def test_a_failed_sequential_run_leaves_the_method_of_states_never_reset(env: Any) -> None:
    """grid2op deletes an init state's "method" as its env resets with it: not for the episodes
    after a failed one, which it never plays."""
    kept = []
    for make in (grid_runner, compat_runner):
        first, second = (
            {"set_line_status": [(0, -1)]},
            {"set_line_status": [(3, -1)], "method": "ignore"},
        )
        with pytest.raises(Refusal):
            quiet(
                make(env, agentClass=FailsItsSecondEpisode).run,
                2, max_iter=5, agent_seeds=[1, 0], init_states=[first, second],
            )  # fmt: skip
        kept.append(second)
    assert kept[1] == kept[0] == {"set_line_status": [(3, -1)], "method": "ignore"}


def test_an_episode_failed_before_a_save_did_is_raised_as_in_grid2op(
    env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes: episode 0's agent fails at once, the saving of episode 1 later (a full
    disk): grid2op's Pool raises the failure that came first."""
    place = ReplacingWriter._move_into_place

    def full_disk_for_0001(self: Any, folder: Any, name: str) -> Any:
        if name == "0001":
            raise OSError(errno.ENOSPC, "No space left on device")
        return place(self, folder, name)

    monkeypatch.setattr(ReplacingWriter, "_move_into_place", full_disk_for_0001)
    runner = compat_runner(env, agentClass=FailsAtItsSeedsStep)
    with pytest.raises(Refusal, match="no action at step 1"):
        quiet(runner.run, 2, nb_process=2, max_iter=8, agent_seeds=[1, 30], path_save=tmp_path)


def test_a_file_named_as_an_episode_folder_is_never_replaced(env: Any, tmp_path: Path) -> None:
    """A file of yours named as a chronic in path_save: grid2op fails to write into it
    (NotADirectoryError); it was replaced by the episode's folder, and lost."""
    for make in (grid_runner, compat_runner):
        path = tmp_path / make.__name__
        path.mkdir()
        (path / "0000").write_text("my notes")
        with pytest.raises(NotADirectoryError):
            quiet(make(env, agentClass=DoNothingAgent).run, 1, max_iter=3, path_save=path)
        assert (path / "0000").read_text() == "my notes"


@pytest.mark.parametrize("kind", ["agentClass", "agentInstance"])
def test_saved_episodes_record_the_agent_played(env: Any, tmp_path: Path, kind: str) -> None:
    # They recorded compat's wrapper (asyncrunner.compat._session.AgentClass) for every agent.
    if kind == "agentClass":
        runner = compat_runner(env, agentClass=PeriodicAgent)
    else:
        runner = compat_runner(env, agentClass=None, agentInstance=PeriodicAgent(env.action_space))
    quiet(runner.run, nb_episode=1, max_iter=3, path_save=tmp_path)
    record = json.loads((tmp_path / "0000" / "asyncrunner.json").read_text())
    assert record["agent"] == f"{__name__}.PeriodicAgent"
