"""MultiMixEnvironment: one run over every mix, against grid2op's Runner on each mix."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grid2op.Episode import CompactEpisodeData, EpisodeData
from grid2op.Runner import Runner as GridRunner

import asyncrunner
from asyncrunner import AsyncRunner, compat
from asyncrunner.sinks import CompactEpisodeWriter, EpisodeDataWriter, _writer
from asyncrunner.sinks._compact import COMPACT_FOLDER

from .conftest import make_env
from .helpers import SampleAgent, grid2ops, quiet, starts

# l2rpn_neurips_2020_track2 (test data): two mixes, "x1" and "x2.5", two chronics each.
MIXES = ["x1", "x2.5"]
KWARGS: dict[str, Any] = dict(max_iter=4, env_seeds=[7], agent_seeds=[8], episode_id=[1])


@pytest.fixture(scope="module")
def multimix() -> Iterator[Any]:
    env = make_env("l2rpn_neurips_2020_track2")
    assert list(env.keys()) == MIXES
    yield env
    env.close()


@pytest.fixture(scope="module")
def expected(multimix: Any) -> dict[str, tuple[Any, ...]]:
    """What grid2op's Runner gives on each mix, as grid2op's users run a multimix env."""
    out = {}
    for name, mix in multimix.items():
        runner = quiet(GridRunner, **mix.get_params_for_runner(), agentClass=SampleAgent)
        (result,) = grid2ops(runner.run, nb_episode=1, **KWARGS)
        out[name] = (str(result[0]), *result[1:5])
    return out


@pytest.mark.anyio
async def test_one_run_covers_every_mix(
    multimix: Any, expected: dict[str, tuple[Any, ...]], tmp_path: Path
) -> None:
    started, sink = starts()
    async with AsyncRunner(multimix, agent=SampleAgent, workers=2) as runner:
        results = await runner.run(
            1, path_save=tmp_path, add_detailed_output=True, sinks=[sink], **KWARGS
        )
        # (mix, episode id) pairs: exactly those episodes, in that order.
        pairs = await runner.run(
            2,
            max_iter=4,
            env_seeds=[7, 7],
            agent_seeds=[8, 8],
            episode_id=[("x2.5", 1), ("x1", "002")],
        )
        resumed = await runner.run(1, path_save=tmp_path, resume=True, **KWARGS)
    # Every mix played the requested episode, with grid2op's results for that mix.
    assert [r.mix for r in results] == MIXES
    assert [r.index for r in results] == [0, 1]
    assert [r.as_tuple() for r in results] == [expected[m] for m in MIXES]
    assert sorted(str(e.mix) for e in started) == MIXES
    assert [r.mix for r in pairs] == ["x2.5", "x1"]
    assert [r.as_tuple() for r in pairs] == [expected["x2.5"], expected["x1"]]
    # Saved as grid2op users save a multimix run: one grid2op folder per mix.
    for r in results:
        assert r.mix is not None and r.name is not None
        assert r.path == str(tmp_path / r.mix / r.name)
        assert EpisodeData.list_episode(str(tmp_path / r.mix)) == [(str(tmp_path / r.mix), r.name)]
        on_disk = quiet(EpisodeData.from_disk, str(tmp_path / r.mix), r.name)
        assert len(on_disk.actions) == r.nb_time_step == 4
        # add_detailed_output: the EpisodeData, built with that mix's spaces
        assert isinstance(r.episode_data, EpisodeData)
        assert r.episode_data.meta["chronics_path"] == r.chronics_path
        assert len(r.episode_data.observations) == 5
    # resume reads them back, mix by mix.
    assert [(r.mix, r.path) for r in resumed] == [(r.mix, r.path) for r in results]
    assert [r.as_tuple() for r in resumed] == [r.as_tuple() for r in results]
    assert sorted(os.listdir(tmp_path)) == MIXES


@pytest.mark.anyio
async def test_writers_given_as_sinks_keep_one_folder_per_mix(
    multimix: Any, expected: dict[str, tuple[Any, ...]], tmp_path: Path
) -> None:
    """A user's EpisodeDataWriter or CompactEpisodeWriter saves a multimix run as path_save
    does: ``<path>/<mix>``, with the space files. Both put every mix's episodes in one folder
    (x2.5's "001" in "001_1", found by a hunt), with one set of space files."""
    data, compact = tmp_path / "data", tmp_path / "compact"
    sinks = [EpisodeDataWriter(data), CompactEpisodeWriter(compact)]
    async with AsyncRunner(multimix, agent=SampleAgent, workers=2) as runner:
        results = await runner.run(1, path_save=tmp_path / "saved", sinks=sinks, **KWARGS)
    assert [r.as_tuple() for r in results] == [expected[m] for m in MIXES]
    assert sorted(os.listdir(data)) == sorted(os.listdir(compact)) == MIXES  # nothing else
    for r in results:
        assert r.mix is not None and r.name is not None
        saved = tmp_path / "saved" / r.mix
        assert sorted(os.listdir(data / r.mix)) == sorted(os.listdir(saved))
        assert EpisodeData.list_episode(str(data / r.mix)) == [(str(data / r.mix), r.name)]
        for space in [f for f in os.listdir(saved) if f.startswith("dict_")]:
            assert (data / r.mix / space).read_bytes() == (saved / space).read_bytes()
            assert (compact / r.mix / COMPACT_FOLDER / space).read_bytes() == (
                saved / space
            ).read_bytes()
        on_disk = quiet(EpisodeData.from_disk, str(data / r.mix), r.name)
        assert on_disk.meta["chronics_path"] == r.chronics_path
        assert len(on_disk.actions) == 4
        episode = quiet(CompactEpisodeData.from_disk, compact / r.mix, r.name)
        assert episode.meta["chronics_path"] == r.name
        assert episode.meta["nb_timestep_played"] == 4


@pytest.mark.slow  # a compat Runner and its workers per mix
def test_compat_runner_on_each_mix(multimix: Any, expected: dict[str, tuple[Any, ...]]) -> None:
    # grid2op's documented way: one Runner per mix. A mix after the first
    # has a backend class grid2op built for the grid: it still reaches the workers.
    played = []
    for name, mix in multimix.items():
        runner = quiet(compat.Runner, **mix.get_params_for_runner(), agentClass=SampleAgent)
        (result,) = runner.run(nb_episode=1, nb_process=2, **KWARGS)
        runner.close()
        played.append((name, (str(result[0]), *result[1:5])))
    # Same chronic, reward and steps as grid2op's Runner on that mix, and the mixes differ.
    assert played == [(m, expected[m]) for m in MIXES]
    assert expected["x1"][0] != expected["x2.5"][0]
    assert expected["x1"][2] != expected["x2.5"][2]


@pytest.mark.parametrize(
    ("episode_id", "error", "words"),
    [
        ([("x3", 0)], ValueError, "unknown mix 'x3'"),
        ([("x1", 5)], ValueError, "out of range"),
        ([("x1", 0), 1], TypeError, "all \\(mix, episode id\\) pairs"),
        ([7], ValueError, "out of range"),
    ],
)
@pytest.mark.anyio
async def test_bad_multimix_episode_ids_fail_before_any_work(
    multimix: Any, episode_id: list[Any], error: type[Exception], words: str
) -> None:
    runner = AsyncRunner(multimix, agent=SampleAgent, workers=1)
    with pytest.raises(error, match=words):
        await runner.run(len(episode_id), episode_id=episode_id)
    assert runner._pids == set()  # no worker was started
    await runner.aclose()


@pytest.mark.anyio
async def test_a_score_of_a_multimix_env_says_to_score_each_mix(
    multimix: Any, tmp_path: Path
) -> None:
    """grid2op's score classes raised a RuntimeError (the CLI printed its traceback)."""
    with pytest.raises(ValueError, match=r"score each mix as an env of its own.*[/\\]x1\)"):
        await asyncrunner.score(
            multimix, SampleAgent, competition="l2rpn_2020", cache_dir=tmp_path / "cache"
        )
    assert not (tmp_path / "cache").exists()


@pytest.mark.anyio
async def test_each_mixs_episodes_are_written_by_the_workers(
    multimix: Any, expected: dict[str, tuple[Any, ...]], tmp_path: Path, monkeypatch: Any
) -> None:
    """path_save's writer saves each mix in ``path_save/<mix>``: the workers write every mix's
    episodes in its stage, and this process writes none of their files."""
    written: list[str] = []
    write_files = _writer.write_files

    def recorded(folder: str, files: Any) -> None:
        written.append(folder)  # in a forked worker, into that worker's own copy of the list
        write_files(folder, files)

    monkeypatch.setattr(_writer, "write_files", recorded)
    async with AsyncRunner(multimix, agent=SampleAgent, workers=2) as runner:
        results = await runner.run(1, path_save=tmp_path, **KWARGS)
    assert written == []
    assert [r.as_tuple() for r in results] == [expected[m] for m in MIXES]
    for r in results:
        assert r.mix is not None and r.name is not None
        assert r.path == str(tmp_path / r.mix / r.name)
        assert len(quiet(EpisodeData.from_disk, str(tmp_path / r.mix), r.name).actions) == 4


@pytest.mark.anyio
async def test_a_closed_multimix_env_is_named_as_closed(tmp_path: Path) -> None:
    # A multimix env keeps its own closed flag, and once closed raises grid2op's EnvError for
    # any attribute it does not have: that EnvError was what a user got.
    env = make_env("l2rpn_neurips_2020_track2")
    async with AsyncRunner(env, agent=SampleAgent, workers=1) as runner:
        env.close()
        results = await runner.run(1, path_save=tmp_path, **KWARGS)  # it plays on, as before
        with pytest.raises(ValueError, match=r"add_detailed_output needs .* env\.close\(\) was"):
            await runner.run(1, add_detailed_output=True, **KWARGS)
        with pytest.raises(ValueError, match=r"init_states needs the env .* open"):
            await runner.run(1, init_states=[{"set_line_status": [(0, -1)]}], **KWARGS)
    assert [(r.mix, r.nb_time_step) for r in results] == [(m, 4) for m in MIXES]
    with pytest.raises(ValueError, match="the env is closed: pass an open grid2op env"):
        AsyncRunner(env, agent=SampleAgent)
