"""The episode writers: grid2op's EpisodeData / CompactEpisodeData on disk, atomic, never
overwriting, and ``resume``. Parity is checked against what grid2op's own Runner writes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import grid2op
import numpy as np
import pytest
from grid2op.Agent import BaseAgent, DoNothingAgent, RandomAgent
from grid2op.Episode import CompactEpisodeData, EpisodeData
from grid2op.Reward import FlatReward, L2RPNReward
from grid2op.Runner import Runner

from asyncrunner import AsyncRunner
from asyncrunner._engine._recipe import env_key
from asyncrunner._model import (
    EpisodeFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    RunStarted,
    Staged,
    StepBatch,
)
from asyncrunner.sinks import CallbackSink, CompactEpisodeWriter, EpisodeDataWriter
from asyncrunner.sinks._buffer import EpisodeBuffer
from asyncrunner.sinks._compact import COMPACT_FOLDER
from asyncrunner.sinks._episode_data import episode_data_files
from asyncrunner.sinks._writer import TMP_PREFIX, stage_files

from .conftest import make_env
from .helpers import BOTH_LOOPS

pytestmark = pytest.mark.anyio

SPACE_FILES = [
    "dict_action_space.json",
    "dict_attack_space.json",
    "dict_env_modification_space.json",
    "dict_observation_space.json",
]
ARRAY_FILES = [
    "actions.npz",
    "env_modifications.npz",
    "observations.npz",
    "rewards.npz",
    "disc_lines_cascading_failure.npz",
    "opponent_attack.npz",
]
JSON_FILES = ["_parameters.json", "episode_meta.json", "other_rewards.json", "grid2op.info"]
COMPACT_ARRAYS = [
    "actions",
    "env_actions",
    "attacks",
    "observations",
    "rewards",
    "other_rewards",
    "disc_lines",
    "legal",
    "ambiguous",
]

# case14 with a seeded RandomAgent: "0000" ends in a game over at step 3, "0001" plays all of
# max_iter=4 steps, "0002" ends in a game over at its first step.
CASE14: dict[str, Any] = dict(
    nb_episode=3, episode_id=[0, 1, 2], env_seeds=[1, 2, 5], agent_seeds=[3, 4, 6], max_iter=4
)
# icaps 2021 (it has an opponent) with _SometimesRandom: "Scenario_august_21_wk1" ends in a
# game over at step 2; "Scenario_april_17_wk1" plays 30 steps with attacks and an illegal action.
ICAPS: dict[str, Any] = dict(
    nb_episode=2, episode_id=[1, 0], env_seeds=[1, 2], agent_seeds=[11, 12], max_iter=30
)


class _SometimesRandom(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Samples a random action one step in four (cheap on a big grid, unlike RandomAgent)."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if self.space_prng.rand() < 0.25:
            return self.action_space.sample()
        return self.action_space()


def _grid2op_run(env: Any, agent: type, path: Path, compact: bool, **kwargs: Any) -> list[Any]:
    path.mkdir(parents=True, exist_ok=True)
    runner = Runner(
        **env.get_params_for_runner(), agentClass=agent, use_compact_episode_data=compact
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(runner.run(**kwargs, path_save=str(path), add_detailed_output=not compact))


@pytest.fixture(scope="module")
def case14(wheel_env: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The env, and what grid2op's Runner saved for CASE14 (EpisodeData and compact)."""
    # other rewards, named out of order: CompactEpisodeData sorts them
    env = wheel_env(
        "l2rpn_case14_sandbox", other_rewards={"zeta": L2RPNReward, "alpha": FlatReward}
    )
    root = tmp_path_factory.mktemp("grid2op_case14")
    res = _grid2op_run(env, RandomAgent, root / "full", False, **CASE14)
    _grid2op_run(env, RandomAgent, root / "compact", True, **CASE14)
    return {"env": env, "path": root / "full", "compact": root / "compact", "res": res}


@pytest.fixture(scope="module")
def icaps(wheel_env: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    env = wheel_env("l2rpn_icaps_2021")
    root = tmp_path_factory.mktemp("grid2op_icaps")
    res = _grid2op_run(env, _SometimesRandom, root / "full", False, **ICAPS)
    _grid2op_run(env, _SometimesRandom, root / "compact", True, **ICAPS)
    return {"env": env, "path": root / "full", "compact": root / "compact", "res": res}


# --- helpers ------------------------------------------------------------------------------------


def _load(path: Path, name: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return EpisodeData.from_disk(str(path), name)


def _names(path: Path) -> list[str]:
    return [name for _, name in EpisodeData.list_episode(str(path))]


def _json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _array(path: Path) -> np.ndarray:
    with np.load(path) as data:
        assert list(data.keys()) == ["data"]
        return np.asarray(data["data"])


def _assert_same_array(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.dtype == b.dtype, what
    assert a.shape == b.shape, what
    np.testing.assert_array_equal(a, b, err_msg=what, strict=True)


def _assert_same_episode_data(ref: Path, ours: Path, reference_results: list[Any]) -> None:
    """``ours`` holds what grid2op's Runner wrote in ``ref``, array for array (timings aside)."""
    names = _names(ref)
    assert names and _names(ours) == names
    for space in SPACE_FILES:
        assert _json(ours / space) == _json(ref / space), space
    in_memory = {res[1]: res[5] for res in reference_results}
    for name in names:
        for file in ARRAY_FILES:
            _assert_same_array(_array(ours / name / file), _array(ref / name / file), file)
        for file in JSON_FILES:
            assert _json(ours / name / file) == _json(ref / name / file), (name, file)
        times = _array(ours / name / "agent_exec_times.npz")
        ref_times = _array(ref / name / "agent_exec_times.npz")
        assert times.dtype == ref_times.dtype and times.shape == ref_times.shape
        np.testing.assert_array_equal(np.isnan(times), np.isnan(ref_times))
        ep_times, ref_ep_times = (
            _json(ours / name / "episode_times.json"),
            _json(ref / name / "episode_times.json"),
        )
        assert ep_times.keys() == ref_ep_times.keys()
        assert ep_times["Env"].keys() == ref_ep_times["Env"].keys()

        # loaded back, as grid2op's tools read it
        a, b = _load(ref, name), _load(ours, name)
        assert len(b) == len(a) and len(b.actions) == len(a.actions) > 0
        assert len(b.observations) == len(a.observations) == len(a.actions) + 1
        for x, y in zip(b.actions, a.actions, strict=True):
            assert x == y
        for x, y in zip(b.observations, a.observations, strict=True):
            _assert_same_array(x.to_vect(), y.to_vect(), "observation")
        for x, y in zip(b.env_actions, a.env_actions, strict=True):
            assert x == y
        np.testing.assert_array_equal(b.rewards, a.rewards, strict=True)
        np.testing.assert_array_equal(b.disc_lines, a.disc_lines, strict=True)
        _assert_same_array(b.attacks.collection, a.attacks.collection, "attacks")
        assert b.other_rewards == a.other_rewards and b.meta == a.meta
        # legal / ambiguous: grid2op 1.12.6 keeps them in memory only (its from_disk reads a
        # legal_ambiguous.npz where there is one: none, or grid2op's Runner saving over one of
        # ours would read our episode's flags)
        assert not b.has_legal_ambiguous and not a.has_legal_ambiguous
        assert in_memory[name].has_legal_ambiguous


def _assert_same_compact(ref: Path, ours: Path) -> None:
    ref_dir, our_dir = ref / "CompactEpisodeData", ours / "CompactEpisodeData"
    names = sorted(n for _, n in CompactEpisodeData.list_episode(ref_dir))
    assert names and sorted(n for _, n in CompactEpisodeData.list_episode(our_dir)) == names
    assert sorted(p.name for p in our_dir.iterdir()) == sorted(p.name for p in ref_dir.iterdir())
    for space in SPACE_FILES:
        assert _json(our_dir / space) == _json(ref_dir / space), space
    for name in names:
        assert _json(our_dir / f"{name}_metadata.json") == _json(ref_dir / f"{name}_metadata.json")
        with np.load(our_dir / f"{name}.npz") as x, np.load(ref_dir / f"{name}.npz") as y:
            assert sorted(x.keys()) == sorted(y.keys())
            for key in COMPACT_ARRAYS:
                _assert_same_array(x[key], y[key], f"{name} {key}")
            assert x["times"].shape == y["times"].shape and x["times"].dtype == y["times"].dtype
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = CompactEpisodeData.from_disk(ours, name)
        assert loaded.meta["nb_timestep_played"] > 0
        assert len(loaded.observations) == len(loaded.actions) + 1


def _hidden(path: Path) -> list[str]:
    return [p.name for p in path.rglob(f"{TMP_PREFIX}*")]


class _Capture:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)


# --- parity with grid2op's Runner ---------------------------------------------------------------


async def test_case14_saves_what_grid2op_saves(case14: dict[str, Any], tmp_path: Path) -> None:
    capture = _Capture()
    async with AsyncRunner(case14["env"], agent=RandomAgent, workers=2) as runner:
        results = await runner.run(
            **CASE14,
            path_save=tmp_path / "full",
            sinks=[CallbackSink(capture), CompactEpisodeWriter(tmp_path / "compact")],
        )
    assert [r.as_tuple() for r in results] == [tuple(res[:5]) for res in case14["res"]]
    assert [r.nb_time_step for r in results] == [3, 4, 1]  # two game overs, one full episode
    for r in results:
        assert r.name is not None and r.path == str(tmp_path / "full" / r.name)
    _assert_same_episode_data(case14["path"], tmp_path / "full", case14["res"])
    _assert_same_compact(case14["compact"], tmp_path / "compact")
    assert _hidden(tmp_path) == []
    # Byte for byte, as grid2op writes them (keys sorted, its indent), where no time is written.
    for name in _names(case14["path"]):
        for file in JSON_FILES:
            ours, theirs = tmp_path / "full" / name / file, case14["path"] / name / file
            assert ours.read_bytes() == theirs.read_bytes(), (name, file)
    for space in SPACE_FILES:
        assert (tmp_path / "full" / space).read_bytes() == (case14["path"] / space).read_bytes()

    await _check_replays(capture.events, env_key(case14["env"]), tmp_path)


class _Placing(EpisodeDataWriter):
    """Records how each episode's files came: written by its worker (``Staged``), or sent."""

    def __init__(self, path: Path, stage_gone: bool) -> None:
        super().__init__(path)
        self.stage_gone = stage_gone
        self.came: list[str] = []

    def stager(self) -> Callable[[], str]:
        stage = super().stager()

        def made() -> str:
            path = stage()
            if self.stage_gone:  # e.g. removed by hand: the workers cannot write there
                os.rmdir(path)
            return path

        return made

    def _write_episode(self, started: EpisodeStarted, files: Mapping[str, bytes] | Staged) -> str:
        self.came.append("staged" if isinstance(files, Staged) else "sent")
        return super()._write_episode(started, files)


@pytest.mark.parametrize("stage_gone", [False, True], ids=["staged", "stage gone"])
async def test_workers_write_the_files_and_send_them_when_they_cannot(
    case14: dict[str, Any], tmp_path: Path, stage_gone: bool
) -> None:
    writer = _Placing(tmp_path / "full", stage_gone)
    async with AsyncRunner(case14["env"], agent=RandomAgent, workers=2) as runner:
        results = await runner.run(**CASE14, sinks=[writer])
    assert writer.came == ["sent" if stage_gone else "staged"] * len(results)
    assert [r.as_tuple() for r in results] == [tuple(res[:5]) for res in case14["res"]]
    _assert_same_episode_data(case14["path"], tmp_path / "full", case14["res"])
    assert _hidden(tmp_path) == []


async def test_a_worker_that_writes_after_the_run_ended_finds_no_stage(tmp_path: Path) -> None:
    writer = EpisodeDataWriter(tmp_path)
    stage = await anyio.to_thread.run_sync(writer.stage)
    staged = stage_files(stage, {"a.json": b"{}"})  # an episode the run never placed
    await writer.aclose()
    with pytest.raises(FileNotFoundError):  # a worker of a cancelled run, finishing late
        stage_files(stage, {"a.json": b"{}"})
    assert staged.folder.startswith(stage) and _hidden(tmp_path) == []


async def test_a_stage_made_as_the_writer_closes_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run cancelled as it starts: the writer closed (nothing to remove yet) while its stage
    # was being made in a thread, which then left an empty hidden folder in path_save.
    writer = EpisodeDataWriter(tmp_path)
    closed = threading.Event()
    makedirs = os.makedirs

    def late_makedirs(path: Any, *args: Any, **kwargs: Any) -> None:
        assert closed.wait(10)  # the writer closes between the stage's name and its folder
        makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", late_makedirs)
    async with anyio.create_task_group() as group:

        async def stage() -> None:
            with pytest.raises(OSError, match="the writer closed while its stage was made"):
                await anyio.to_thread.run_sync(writer.stage)

        group.start_soon(stage)
        await anyio.wait_all_tasks_blocked()
        await writer.aclose()
        closed.set()
    monkeypatch.undo()
    assert _hidden(tmp_path) == []
    # The close may also come before the stage's thread starts (it waits for the GIL).
    stager = writer.stager()  # on the event loop, as the run asks for the stage
    await writer.aclose()
    with pytest.raises(OSError, match="the writer closed before its stage was made"):
        await anyio.to_thread.run_sync(stager)
    assert _hidden(tmp_path) == []
    # The writer serves its next run as before.
    assert await anyio.Path(await anyio.to_thread.run_sync(writer.stage)).is_dir()
    await writer.aclose()
    assert _hidden(tmp_path) == []


def _with_files(events: list[Event], env: str) -> list[Event]:
    """The recorded events, each ``EpisodeFinished`` with the files its worker built (which only
    the writers of the run saw), built again from the recorded steps (``env``: its env key)."""
    buffers: dict[int, EpisodeBuffer] = {}
    out: list[Event] = []
    agent = None
    for event in events:
        if isinstance(event, RunStarted):
            agent = event.agent
        elif isinstance(event, EpisodeStarted):
            buffers[event.index] = EpisodeBuffer(event)
        elif isinstance(event, StepBatch):
            buffers[event.index].add(event)
        elif isinstance(event, EpisodeFinished):
            files = {"episode_data": episode_data_files(buffers[event.index], event, agent, env)}
            event = dataclasses.replace(event, files=files)
        out.append(event)
    return out


async def _check_replays(events: list[Event], env: str, tmp_path: Path) -> None:
    """Feed the recorded events to writers again, with a retried attempt, an unknown length, and
    an episode cut short by ``aclose``."""
    assert not any(isinstance(e, EpisodeFinished) and e.files for e in events)
    events = _with_files(events, env)
    reference = tmp_path / "full"
    first = next(e for e in events if isinstance(e, EpisodeStarted))
    index = first.index
    own = [e for e in events if getattr(e, "index", None) == index]
    others = [e for e in events if getattr(e, "index", None) != index]
    run_started = next(e for e in events if isinstance(e, RunStarted))

    # A failed attempt (its worker died after one batch) is dropped; the retry is saved.
    retried = tmp_path / "retried"
    writer = EpisodeDataWriter(retried)
    await writer.send(run_started)
    await writer.send(own[0])
    await writer.send(next(e for e in own if isinstance(e, StepBatch)))
    await writer.send(
        EpisodeFailed(first.run_id, index, 1, "BrokenWorkerProcess", "died", "", 1, retrying=True)
    )
    for event in own:
        assert isinstance(event, (EpisodeStarted, StepBatch, EpisodeFinished, EpisodeFailed))
        await writer.send(dataclasses.replace(event, attempt=2))
    for event in others:
        if not isinstance(event, RunStarted):
            await writer.send(event)
    await writer.aclose()
    assert _names(retried) == _names(reference)
    for name in _names(reference):
        for file in sorted(os.listdir(reference / name)):
            if file.endswith(".npz"):
                _assert_same_array(
                    _array(retried / name / file), _array(reference / name / file), file
                )
            else:
                assert _json(retried / name / file) == _json(reference / name / file), file

    # An episode of unknown length (max_ts <= 0): arrays grow and are cut to the steps played.
    # (Its files built from the recorded steps, as its worker builds them.)
    grown = tmp_path / "grown"
    writer = EpisodeDataWriter(grown)
    await writer.send(run_started)
    unknown = dataclasses.replace(first, max_ts=0)
    buffer = EpisodeBuffer(unknown)
    finished = next(e for e in own if isinstance(e, EpisodeFinished))
    for event in own:
        if isinstance(event, StepBatch):
            buffer.add(event)
    await writer.send(unknown)
    files = {"episode_data": episode_data_files(buffer, finished, run_started.agent, env)}
    await writer.send(dataclasses.replace(finished, files=files))
    await writer.aclose()
    steps = finished.nb_time_step
    for file in ARRAY_FILES:
        full = _array(reference / first.name / file)
        part = _array(grown / first.name / file)
        rows = steps + 1 if file == "observations.npz" else steps
        _assert_same_array(part, full[:rows], file)
    assert len(_load(grown, first.name).actions) == steps

    # Closed mid-episode (a cancelled run): nothing of it is left on disk.
    cut = tmp_path / "cut"
    writer = EpisodeDataWriter(cut)
    await writer.send(run_started)
    await writer.send(own[0])
    await writer.send(own[1])
    await writer.aclose()
    assert _names(cut) == [] and _hidden(cut) == []
    assert sorted(os.listdir(cut)) == sorted(SPACE_FILES)

    # Events from elsewhere, without the files a run's workers build: an error that says so.
    bare = EpisodeDataWriter(tmp_path / "bare")
    await bare.send(run_started)
    await bare.send(own[0])
    with pytest.raises(RuntimeError, match="came without its 'episode_data' files"):
        await bare.send(dataclasses.replace(finished, files={}))
    await bare.aclose()


@pytest.mark.slow  # icaps 2021 is a large grid: its env and grid2op's runs take a while
async def test_opponent_env_saves_what_grid2op_saves(icaps: dict[str, Any], tmp_path: Path) -> None:
    ref_res = icaps["res"]
    assert [res[3] for res in ref_res] == [2, 30]  # a game over, then a full episode
    attacked = ref_res[1][5].attacks.collection
    assert np.abs(attacked).sum() > 0  # the opponent did attack
    assert not ref_res[1][5].legal.all()  # and an action was illegal
    # one worker: the second episode runs on the env the first one used (no state may leak)
    async with AsyncRunner(icaps["env"], agent=_SometimesRandom, workers=1) as runner:
        results = await runner.run(
            **ICAPS, path_save=tmp_path / "full", sinks=[CompactEpisodeWriter(tmp_path / "compact")]
        )
    assert [r.as_tuple() for r in results] == [tuple(res[:5]) for res in ref_res]
    _assert_same_episode_data(icaps["path"], tmp_path / "full", ref_res)
    _assert_same_compact(icaps["compact"], tmp_path / "compact")


async def test_compact_episodes_without_limit_say_the_chronics_length(
    case14: dict[str, Any], tmp_path: Path
) -> None:
    # max_iter=-1 resets with "max step": -1, which leaves env.max_episode_duration() at -1: the
    # metadata gave the episode -1 as its length, and len() of it read back raised (grid2op's
    # Runner fails there: found by a hunt). Now the chronic's length, as the EpisodeData meta
    # says it: what grid2op's Runner writes with no max_iter (the same episode here).
    kwargs: dict[str, Any] = dict(nb_episode=1, episode_id=[0], env_seeds=[1], agent_seeds=[3])
    _grid2op_run(case14["env"], RandomAgent, tmp_path / "grid2op", True, **kwargs)
    async with AsyncRunner(case14["env"], agent=RandomAgent, workers=1) as runner:
        (result,) = await runner.run(
            max_iter=-1,
            path_save=tmp_path / "full",
            sinks=[CompactEpisodeWriter(tmp_path / "compact")],
            add_detailed_output="compact",
            **kwargs,
        )
    assert result.nb_time_step == 3 and result.max_ts == 575 and result.name == "0000"
    meta = _json(tmp_path / "full" / "0000" / "episode_meta.json")
    assert int(meta["chronics_max_timestep"]) == 575
    theirs, ours = tmp_path / "grid2op" / COMPACT_FOLDER, tmp_path / "compact" / COMPACT_FOLDER
    assert _json(ours / "0000_metadata.json") == _json(theirs / "0000_metadata.json")
    with np.load(ours / "0000.npz") as x, np.load(theirs / "0000.npz") as y:
        for key in COMPACT_ARRAYS:  # (the observations' max_step is -1 here, as in grid2op)
            assert x[key].shape == y[key].shape, key
            if key != "observations":
                _assert_same_array(x[key], y[key], key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = CompactEpisodeData.from_disk(tmp_path / "compact", "0000")
    assert len(loaded) == 575 and loaded.meta["nb_timestep_played"] == 3
    # add_detailed_output="compact": as grid2op's in memory, its length the game over's step
    assert result.episode_data.meta["game_over_timestep"] == 575
    assert len(result.episode_data) == 3


# --- never overwrite ----------------------------------------------------------------------------


async def test_another_envs_run_into_a_folder_is_refused_where_grid2op_saves_it_unreadable(
    case14: dict[str, Any], wheel_env: Any, tmp_path: Path
) -> None:
    # grid2op's EpisodeData writes dict_*_space.json only where they are not, and reads every
    # episode of the folder with them: another env's episodes saved there cannot be read back.
    # Such a run is refused before it plays; the folder stays as it was.
    from grid2op.Exceptions import Grid2OpException

    other = wheel_env("rte_case14_opponent")
    theirs, ours = tmp_path / "grid2op", tmp_path / "ours"
    for env in (case14["env"], other):
        _grid2op_run(env, DoNothingAgent, theirs, False, nb_episode=1, max_iter=2)
    with pytest.raises(Grid2OpException, match="mismatch between what has been stored"):
        EpisodeData.from_disk(str(theirs), "000")  # rte_case14_opponent's, saved second
    async with AsyncRunner(case14["env"], agent=DoNothingAgent, workers=1) as runner:
        await runner.run(1, max_iter=2, path_save=ours)
    first = {name: (ours / name).read_bytes() for name in SPACE_FILES}
    async with AsyncRunner(other, agent=DoNothingAgent, workers=1) as runner:
        with pytest.raises(ValueError, match="describes other spaces than this env's"):
            await runner.run(1, max_iter=2, path_save=ours)
    assert _names(ours) == ["0000"]
    for name in SPACE_FILES:
        assert (ours / name).read_bytes() == first[name]
        assert _json(ours / name) == _json(theirs / name), name


async def test_same_chronic_twice_gets_two_folders(case14: dict[str, Any], tmp_path: Path) -> None:
    kwargs: dict[str, Any] = dict(max_iter=2, path_save=tmp_path)
    async with AsyncRunner(case14["env"], agent=RandomAgent, workers=2) as runner:
        first = await runner.run(
            2, episode_id=[0, 0], env_seeds=[1, 7], agent_seeds=[3, 8],
            sinks=[CompactEpisodeWriter(tmp_path)], **kwargs,
        )  # fmt: skip
        before = {n: _json(tmp_path / n / "episode_meta.json") for n in _names(tmp_path)}
        again = await runner.run(
            1, episode_id=[0], env_seeds=[9], agent_seeds=[9],
            sinks=[CompactEpisodeWriter(tmp_path)], **kwargs,
        )  # fmt: skip
    assert _names(tmp_path) == ["0000", "0000_1", "0000_2"]
    assert sorted(str(r.path) for r in first) == [str(tmp_path / "0000"), str(tmp_path / "0000_1")]
    assert again[0].path == str(tmp_path / "0000_2")
    for name, meta in before.items():  # the earlier folders are untouched
        assert _json(tmp_path / name / "episode_meta.json") == meta
    for result in [*first, *again]:
        assert result.path is not None
        loaded = _load(tmp_path, os.path.basename(result.path))
        assert loaded.meta["env_seed"] == result.env_seed
        assert loaded.meta["nb_timestep_played"] == result.nb_time_step == len(loaded.actions)
    compact = tmp_path / "CompactEpisodeData"
    assert sorted(n for _, n in CompactEpisodeData.list_episode(compact)) == [
        "0000",
        "0000_1",
        "0000_2",
    ]
    for name in ["0000", "0000_1", "0000_2"]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = CompactEpisodeData.from_disk(tmp_path, name)
        assert loaded.meta["chronics_path"] == "0000"
    assert _hidden(tmp_path) == []


async def test_a_writer_given_to_a_second_run_says_what_that_run_saved(
    env: Any, tmp_path: Path
) -> None:
    writer = EpisodeDataWriter(tmp_path)
    async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
        first = await runner.run(2, max_iter=2, sinks=[writer])
        assert dict(writer.saved) == {0: str(tmp_path / "0000"), 1: str(tmp_path / "0001")}
        assert [r.path for r in first] == [writer.saved[0], writer.saved[1]]
        (second,) = await runner.run(1, max_iter=2, episode_id=[2], sinks=[writer])
    # The second run's episode only (index 0 of that run): not the first run's too.
    assert dict(writer.saved) == {0: str(tmp_path / "0002")} and second.path == writer.saved[0]
    assert _names(tmp_path) == ["0000", "0001", "0002"]


class _CountedSet(set[tuple[str | None, str]]):
    """A set that counts the lookups made in it."""

    lookups = 0

    def __contains__(self, item: object) -> bool:
        self.lookups += 1
        return super().__contains__(item)


def test_a_chronics_next_name_comes_without_probing_the_earlier_ones(tmp_path: Path) -> None:
    writer = EpisodeDataWriter(tmp_path)
    writer._reserved = reserved = _CountedSet()
    assert [next(writer._names("000")) for _ in range(3)] == ["000", "000_1", "000_2"]
    reserved.lookups = 0
    assert next(writer._names("000")) == "000_3"
    assert reserved.lookups == 1  # 000, 000_1 and 000_2 are not tried again (k names for the k-th)
    # a chronic named as another's second folder: that name is given once only
    assert next(writer._names("000_1")) == "000_1_1"


# --- cancellation and resume --------------------------------------------------------------------


class _CancelWhileWriting(EpisodeDataWriter):
    """Cancels the run from inside the write of the first finished episode."""

    def __init__(self, path: Path, scope: anyio.CancelScope) -> None:
        super().__init__(path)
        self.scope = scope
        self.written: list[str] = []

    def _place(self, started: EpisodeStarted, folder: str) -> str:
        if not self.written:
            anyio.from_thread.run_sync(self.scope.cancel)
        self.written.append(started.name)
        return super()._place(started, folder)


def test_names_are_cut_short_only_past_the_file_systems_limit(tmp_path: Path) -> None:
    from asyncrunner._plan._layout import suffixed

    folder = str(tmp_path)
    # A chronic's folder named in Latin-1 (an archive from another system): Python holds its
    # bytes as surrogates, which strict UTF-8 refused (the episode was lost, found by review).
    latin = os.fsdecode(b"sc\xe9nario")
    assert suffixed(folder, latin, "_1") == latin + "_1"
    name = "场景" * 42 + "_x"  # 254 bytes in UTF-8
    assert suffixed(folder, name, "") == name
    assert suffixed(folder, name, "_1") == name[:-1] + "_1"  # 255 bytes
    # Cut at a character's boundary: 239 bytes leave room for 79 characters of 3 bytes.
    assert suffixed(folder, name, "_1", "_metadata.json") == name[:79] + "_1"
    assert suffixed(folder, os.fsdecode(b"\xe9" * 300), "_2") == os.fsdecode(b"\xe9" * 253) + "_2"


async def test_a_chronic_named_up_to_the_file_systems_limit_is_saved_every_time(
    tmp_path: Path,
) -> None:
    # "<name>_1" for a chronic named in 254 bytes was too long a file name: the second run into
    # a folder lost its episode (SinkError, its files removed); grid2op's Runner saves it.
    folder = tmp_path / "case14"
    shutil.copytree(Path(grid2op.__file__).parent / "data" / "l2rpn_case14_sandbox", folder)
    name = "场景" * 42 + "_x"  # 254 bytes in UTF-8
    (folder / "chronics" / "0000").rename(folder / "chronics" / name)
    env = make_env(str(folder))
    compact = CompactEpisodeWriter(tmp_path / "compact")
    try:
        async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
            for _ in range(2):
                results = await runner.run(
                    1, max_iter=3, episode_id=[name], path_save=tmp_path / "saved", sinks=[compact]
                )
                assert results[0].error is None and results[0].path is not None
    finally:
        env.close()
    cut = name.encode()[:253].decode("utf-8", "ignore") + "_1"  # "_x" loses its "x"
    saved = sorted(p.name for p in (tmp_path / "saved").iterdir() if p.is_dir())
    assert saved == sorted([name, cut])
    for episode in saved:
        assert EpisodeData.from_disk(str(tmp_path / "saved"), episode).meta["chronics_path"]
    # The compact files are named "<name>_metadata.json" too: 14 bytes less for the name.
    room = 255 - len(b"_metadata.json")
    cuts = [name.encode()[: room - len(s)].decode("utf-8", "ignore") + s for s in ("", "_1")]
    files = sorted(p.name for p in (tmp_path / "compact" / COMPACT_FOLDER).glob("*.npz"))
    assert files == sorted(f"{n}.npz" for n in cuts)


@BOTH_LOOPS
async def test_cancel_leaves_complete_folders_and_resume_finishes(
    case14: dict[str, Any], tmp_path: Path
) -> None:
    kwargs: dict[str, Any] = dict(
        nb_episode=3, episode_id=[0, 1, 2], env_seeds=[1, 2, 3], agent_seeds=[5, 6, 7],
        max_iter=5,
    )  # fmt: skip
    async with AsyncRunner(case14["env"], agent=RandomAgent, workers=2) as runner:
        with anyio.CancelScope() as scope:
            writer = _CancelWhileWriting(tmp_path, scope)
            await runner.run(**kwargs, sinks=[writer])
        assert scope.cancelled_caught
        # the episode being written when the run was cancelled is complete; nothing else is there
        assert writer.written and _names(tmp_path) == writer.written
        assert _hidden(tmp_path) == []
        assert sorted(os.listdir(tmp_path)) == sorted([*SPACE_FILES, *writer.written])
        saved = _load(tmp_path, writer.written[0])
        assert len(saved.actions) == saved.meta["nb_timestep_played"] > 0

        started: list[int] = []

        def count(event: Event) -> None:
            if isinstance(event, EpisodeStarted):
                started.append(event.index)

        resumed = await runner.run(
            **kwargs, path_save=tmp_path, resume=True, sinks=[CallbackSink(count)]
        )
        names = ["0000", "0001", "0002"]
        skipped = names.index(writer.written[0])
        assert sorted(started) == [i for i in range(3) if i != skipped]  # not replayed
        assert [r.name for r in resumed] == names and all(r.ok for r in resumed)
        assert [r.path for r in resumed] == [str(tmp_path / n) for n in names]
        assert resumed[skipped].nb_time_step == saved.meta["nb_timestep_played"]
        assert resumed[skipped].cum_reward == saved.meta["cumulative_reward"]
        assert _names(tmp_path) == names

        # everything is on disk now: nothing is played, the results are read back
        started.clear()
        again = await runner.run(
            **kwargs, path_save=tmp_path, resume=True, sinks=[CallbackSink(count)]
        )
        assert started == []
        assert again == resumed
        # another seed is another episode: played, saved next to the first one, with a word
        with pytest.warns(UserWarning, match="played with another env seed: they play again"):
            other = await runner.run(
                1, episode_id=[0], env_seeds=[99], agent_seeds=[5], max_iter=5,
                path_save=tmp_path, resume=True,
            )  # fmt: skip
        assert other[0].path == str(tmp_path / "0000_1")


async def test_resume_needs_path_save(case14: dict[str, Any], tmp_path: Path) -> None:
    runner = AsyncRunner(case14["env"], agent=RandomAgent, workers=1)
    try:
        with pytest.raises(ValueError, match="path_save"):
            await runner.run(1, resume=True)
        with pytest.raises(ValueError, match="'compact' cannot go with resume=True"):
            await runner.run(1, resume=True, path_save=tmp_path, add_detailed_output="compact")
        assert [p async for p in anyio.Path(tmp_path).iterdir()] == []  # nothing written
    finally:
        await runner.aclose()


async def test_resumed_episodes_come_with_their_episode_data(
    case14: dict[str, Any], tmp_path: Path
) -> None:
    kwargs: dict[str, Any] = dict(
        env_seeds=[3, 4], agent_seeds=[5, 6], max_iter=8, path_save=tmp_path
    )
    async with AsyncRunner(case14["env"], agent=RandomAgent, workers=2) as runner:
        played = await runner.run(2, add_detailed_output=True, **kwargs)
        # One more episode: the first two are read back from disk.
        resumed = await runner.run(
            3, add_detailed_output=True, resume=True, **{**kwargs, "env_seeds": [3, 4, 7],
            "agent_seeds": [5, 6, 8]},
        )  # fmt: skip
    for before, after in zip(played, resumed[:2], strict=True):
        assert after.path == before.path and after.episode_data is not None
        assert len(after.episode_data) == len(before.episode_data) == before.nb_time_step + 1
        for name in ("observations", "actions", "env_actions"):
            np.testing.assert_array_equal(
                [o.to_vect() for o in getattr(after.episode_data, name)],
                [o.to_vect() for o in getattr(before.episode_data, name)],
                err_msg=name,
            )
        np.testing.assert_array_equal(after.episode_data.rewards, before.episode_data.rewards)
    assert resumed[2].episode_data is not None  # played now
    # Each one points at its folder, as grid2op's after a run with path_save: code written for
    # grid2op reads it back with EpisodeData.from_disk(data.agent_path, data.name).
    for result in resumed:
        data = result.episode_data
        assert (data.agent_path, data.episode_path, data.serialize) == (
            str(tmp_path),
            result.path,
            True,
        )
        assert len(EpisodeData.from_disk(data.agent_path, data.name)) == len(data)


async def test_episode_data_points_at_its_folder_as_grid2ops(
    case14: dict[str, Any], tmp_path: Path
) -> None:
    kwargs: dict[str, Any] = dict(nb_episode=1, env_seeds=[3], agent_seeds=[5], max_iter=4)
    theirs = Runner(**case14["env"].get_params_for_runner(), agentClass=RandomAgent).run(
        path_save=tmp_path / "grid2op", add_detailed_output=True, **kwargs
    )[0][-1]
    async with AsyncRunner(case14["env"], agent=RandomAgent, workers=1) as runner:
        ours = (await runner.run(path_save=tmp_path / "ours", add_detailed_output=True, **kwargs))[
            0
        ].episode_data
        unsaved = (await runner.run(add_detailed_output=True, **kwargs))[0].episode_data
        # Saved by a CompactEpisodeWriter only: no EpisodeData folder to point at (found by
        # review: it pointed at the writer's .npz file).
        (compact,) = await runner.run(
            add_detailed_output=True, sinks=[CompactEpisodeWriter(tmp_path / "c")], **kwargs
        )
    for data, folder in ((theirs, "grid2op"), (ours, "ours")):
        assert (data.agent_path, data.episode_path, data.serialize) == (
            str(tmp_path / folder),
            str(tmp_path / folder / data.name),
            True,
        )
    assert not unsaved.serialize and not hasattr(unsaved, "episode_path")  # as grid2op's
    assert compact.path is not None and compact.path.endswith(".npz")
    assert not compact.episode_data.serialize
    assert not hasattr(compact.episode_data, "episode_path")


class LockedActions(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Acts with actions holding a lock: they cannot be pickled."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        action = self.action_space({"set_line_status": [(observation.current_step % 3, 1)]})
        action.lock = threading.Lock()
        return action


async def test_detailed_objects_that_cannot_be_pickled_are_built_from_their_vectors(
    case14: dict[str, Any],
) -> None:
    # The workers send the steps' objects (grid2op's Runner keeps them); with an action holding
    # a lock they cannot: the EpisodeData has them as their vectors say, and the user is told.
    kwargs: dict[str, Any] = dict(nb_episode=1, env_seeds=[3], agent_seeds=[5], max_iter=4)
    theirs = Runner(**case14["env"].get_params_for_runner(), agentClass=LockedActions).run(
        add_detailed_output=True, **kwargs
    )[0][-1]
    async with AsyncRunner(case14["env"], agent=LockedActions, workers=1) as runner:
        with pytest.warns(UserWarning, match=r"episode 0 .*\(TypeError: cannot pickle '_thread"):
            (ours,) = await runner.run(add_detailed_output=True, **kwargs)
    data = ours.episode_data
    assert len(data.actions) == len(theirs.actions) == 4
    for mine, other in zip(data.actions, theirs.actions, strict=True):
        assert np.array_equal(mine.to_vect(), other.to_vect())
        assert not hasattr(mine, "lock")
    for mine, other in zip(data.observations, theirs.observations, strict=True):
        assert np.array_equal(mine.to_vect(), other.to_vect(), equal_nan=True)
