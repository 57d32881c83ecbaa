"""``asyncrunner.score``: grid2op's competition scores, equal to grid2op's own classes."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest

import asyncrunner
from asyncrunner import compat
from asyncrunner._pools._fork import ForkPool
from tests.conftest import make_env
from tests.helpers import CutsLines, SampleAgent, StorageAgent, grid2ops, quiet

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import grid2op
    import grid2op.utils
    from grid2op.Agent import BaseAgent, DoNothingAgent, RandomAgent, RecoPowerlineAgent
    from grid2op.Episode import EpisodeData
    from grid2op.utils.underlying_statistics import EpisodeStatistics

pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings("ignore")]


def env_copy(name: str, where: Path) -> Any:
    """The wheel's env ``name``, made from a copy in ``where``: grid2op's score classes write their
    statistics inside the env's folder, which must not touch (or come from) the installed one."""
    folder = where / name
    # (without statistics a grid2op score class left in the installed env)
    installed = Path(grid2op.__file__).parent / "data" / name
    shutil.copytree(installed, folder, ignore=shutil.ignore_patterns("_statistics_*"))
    return make_env(str(folder))


# (competition, grid2op's class, env, scenarios played, second agent): RandomAgent's action list is
# too big beyond case14 (147,896 actions on l2rpn_idf_2023; an instance of it on l2rpn_icaps_2021
# sent to compat's workers took over 15 minutes), so a line-reconnecting agent and a seeded
# sampling agent stand in; on l2rpn_wcci_2022_dev the second agent charges the storage units (the
# score's storage cost).
CASES = [
    ("l2rpn_2020", "ScoreL2RPN2020", "l2rpn_case14_sandbox", 2, RandomAgent),
    ("l2rpn_wcci_2022", "ScoreL2RPN2022", "l2rpn_wcci_2022_dev", 1, StorageAgent),
    ("icaps_2021", "ScoreICAPS2021", "l2rpn_icaps_2021", 1, SampleAgent),
    ("l2rpn_2023", "ScoreL2RPN2023", "l2rpn_idf_2023", 2, RecoPowerlineAgent),
]
SEEDS = [3, 7]
MAX_STEP = 12


def _class_kwargs(nb: int) -> dict[str, Any]:
    return {
        "nb_scenario": nb,
        "max_step": MAX_STEP,
        "env_seeds": SEEDS[:nb],
        "agent_seeds": SEEDS[:nb],
    }


@pytest.fixture(scope="module")
def grid2op_scores(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[Any]]:
    """``grid2op_scores(competition)``: what grid2op's class (with grid2op's Runner) gives for
    DoNothingAgent and the case's second agent; computed once for the tests that compare to it.
    ``get.folders[competition]``: the env folder where the class wrote its statistics."""
    computed: dict[str, list[Any]] = {}

    def get(competition: str) -> list[Any]:
        if competition not in computed:
            _, cls, name, nb, second = next(c for c in CASES if c[0] == competition)
            env = env_copy(name, tmp_path_factory.mktemp("grid2op"))
            try:
                scorer = grid2ops(getattr(grid2op.utils, cls), env, **_class_kwargs(nb))
                computed[competition] = [
                    grid2ops(scorer.get, DoNothingAgent(env.action_space)),
                    grid2ops(scorer.get, second(env.action_space)),
                ]
                get.folders[competition] = Path(env.get_path_env())  # type: ignore[attr-defined]
            finally:
                env.close()
        return computed[competition]

    get.folders = {}  # type: ignore[attr-defined]
    return get


def _statistics(folder: Path) -> dict[str, Any]:
    """Every array of the ``EpisodeStatistics`` folders found in ``folder``, by path from each
    statistics folder (``_statistics_<reference>/...``)."""
    arrays = {}
    for path in sorted(folder.glob("**/_statistics_*/**/*.npz")):
        parts = path.relative_to(folder).parts
        start = next(i for i, part in enumerate(parts) if part.startswith("_statistics_"))
        with np.load(path) as npz:
            arrays["/".join(parts[start:])] = npz["data"]
    return arrays


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(("competition", "cls", "name", "nb", "second"), CASES)
async def test_score_equals_grid2ops_class_for_two_agents(
    tmp_path: Path,
    grid2op_scores: Callable[[str], list[Any]],
    competition: str,
    cls: str,
    name: str,
    nb: int,
    second: type,
) -> None:
    expected = grid2op_scores(competition)
    ours_env = env_copy(name, tmp_path / "ours")
    try:
        results = await asyncrunner.score(
            ours_env,
            [DoNothingAgent, second],
            competition=competition,
            **_class_kwargs(nb),
            workers=2,
            cache_dir=tmp_path / "cache",
        )
        assert [r.as_grid2op() for r in results] == expected
        assert [r.agent for r in results] == ["DoNothingAgent", second.__name__]
        for result, (scores, survived, total) in zip(results, expected, strict=True):
            assert [s.steps_survived for s in result.scenarios] == survived
            assert [s.total_steps for s in result.scenarios] == total
            firsts = [s[0] if isinstance(s, tuple) else s for s in scores]
            assert [s.score for s in result.scenarios] == [float(v) for v in firsts]
            assert result.total == pytest.approx(sum(firsts) / len(firsts))
        # Nothing written in the env's folder (grid2op's classes cache there)...
        assert EpisodeStatistics.list_stats(ours_env) == []
        # ...but in the cache, in grid2op's layout: the same files, the same arrays.
        ours = _statistics(tmp_path / "cache")
        theirs = _statistics(grid2op_scores.folders[competition])  # type: ignore[attr-defined]
        assert sorted(ours) == sorted(theirs) and len(ours) > 2
        for path, array in theirs.items():
            assert ours[path].dtype == array.dtype, path
            np.testing.assert_array_equal(ours[path], array, err_msg=path)
    finally:
        ours_env.close()


@pytest.mark.slow
@pytest.mark.timeout(900)  # each phase of grid2op's class is a Runner
@pytest.mark.parametrize(("competition", "cls", "name", "nb", "second"), CASES)
def test_grid2ops_class_with_compat_patched_in_gives_the_same_score(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    grid2op_scores: Callable[[str], list[Any]],
    competition: str,
    cls: str,
    name: str,
    nb: int,
    second: type,
) -> None:
    # As the README says to: grid2op's score classes on compat.Runner's worker pool.
    import grid2op.utils.underlying_statistics as statistics

    expected = grid2op_scores(competition)
    played: list[int] = []

    class CountingRunner(compat.Runner):
        def _ar_call(self, nb_process: int, nb_episode: int, kwargs: dict[str, Any]) -> Any:
            played.append(nb_episode)
            return super()._ar_call(nb_process, nb_episode, kwargs)

    monkeypatch.setattr(statistics, "Runner", CountingRunner)
    env = env_copy(name, tmp_path)
    try:
        scorer = quiet(getattr(grid2op.utils, cls), env, **_class_kwargs(nb))
        ours = [
            quiet(scorer.get, DoNothingAgent(env.action_space), nb_process=2),
            quiet(scorer.get, second(env.action_space), nb_process=2),
        ]
    finally:
        env.close()
    assert ours == expected
    # Both reference agents (do nothing, reconnecting lines) and both agents played in compat's
    # workers.
    assert played == [nb] * 4


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_env_of_a_long_folder_name_is_scored(tmp_path: Path) -> None:
    # The cache entry was named after the env (its folder's name and backend's) in full: a
    # folder name of 220 characters failed the score, once every episode had played.
    folder = tmp_path / ("case14_" + "a_long_descriptive_name_" * 9)[:220]
    shutil.copytree(Path(grid2op.__file__).parent / "data" / "l2rpn_case14_sandbox", folder)
    env = make_env(str(folder))
    try:
        (result,) = await asyncrunner.score(
            env, DoNothingAgent, competition="l2rpn_2020", nb_scenario=1, max_step=3,
            workers=1, cache_dir=tmp_path / "cache",
        )  # fmt: skip
    finally:
        env.close()
    assert [s.steps_survived for s in result.scenarios] == [3]
    entries = [entry.name for entry in (tmp_path / "cache").iterdir()]
    assert entries and all(e.startswith(folder.name[:60]) and len(e) < 150 for e in entries)


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_reference_statistics_are_reused_and_invalidated(tmp_path: Path) -> None:
    env = env_copy("l2rpn_case14_sandbox", tmp_path)
    cache = tmp_path / "cache"

    async def once(seeds: list[int], agent: Any = RecoPowerlineAgent) -> Any:
        (result,) = await asyncrunner.score(
            env, agent, competition="l2rpn_2020", nb_scenario=1, max_step=8,
            env_seeds=seeds, agent_seeds=seeds, workers=2, cache_dir=cache,
        )  # fmt: skip
        return result

    try:
        first = await once([1])
        assert not first.references_reused
        again = await once([1], DoNothingAgent)
        assert again.references_reused  # another agent: same references
        other_seed = await once([2])
        assert not other_seed.references_reused
        params = env.parameters
        params.NB_TIMESTEP_COOLDOWN_LINE = params.NB_TIMESTEP_COOLDOWN_LINE + 1
        env.change_parameters(params)
        env.reset()
        changed = await once([1])
        assert not changed.references_reused  # grid2op would reuse them here
        assert (await once([1])).references_reused
        assert first.as_grid2op() == (await once([1])).as_grid2op()  # cached = recomputed
        # What else the env was made with (thermal limits here; its opponent, ...) counts too.
        env.set_thermal_limit(env.get_thermal_limit() * 0.5)
        assert not (await once([1])).references_reused
        assert (await once([1])).references_reused
    finally:
        env.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_cache_reached_by_another_path_is_reused_and_a_damaged_one_computed_again(
    env: Any, tmp_path: Path
) -> None:
    # grid2op signs its statistics under their folder's path: a cache reached through a link,
    # or moved (restored elsewhere), failed every score after its episodes had played ("Someone
    # probably moodified it outside of grid2op"); so did an entry that lost a file.
    async def once(cache: Path) -> Any:
        (result,) = await asyncrunner.score(
            env, DoNothingAgent, competition="l2rpn_2020", nb_scenario=1, max_step=5,
            workers=1, cache_dir=cache,
        )  # fmt: skip
        return result

    first = await once(tmp_path / "cache")
    assert not first.references_reused
    (tmp_path / "link").symlink_to(tmp_path / "cache")
    linked = await once(tmp_path / "link")
    (tmp_path / "cache").rename(tmp_path / "moved")
    moved = await once(tmp_path / "moved")
    assert linked.references_reused and moved.references_reused
    assert linked.as_grid2op() == moved.as_grid2op() == first.as_grid2op()
    lost = sorted((tmp_path / "moved").glob("*/*/scores.npz"))[0]  # of one reference
    lost.unlink()
    again = await once(tmp_path / "moved")
    assert not again.references_reused and again.as_grid2op() == first.as_grid2op()
    assert lost.is_file()
    assert (await once(tmp_path / "moved")).references_reused


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    "changed", [{"max_step": 6}, {"env_seeds": [2]}], ids=["max_step", "env_seeds"]
)
async def test_references_of_another_max_step_or_env_seeds_are_computed_again(
    tmp_path: Path, changed: dict[str, Any]
) -> None:
    # The same agent seeds: only the max_step, or only the env seeds, differ from what the
    # cache holds (a mutation audit found either left out of the cache key unguarded).
    env = env_copy("l2rpn_case14_sandbox", tmp_path)

    async def once(cache: str, **kwargs: Any) -> Any:
        arguments = {"max_step": 3, "env_seeds": [1], "agent_seeds": [1], **kwargs}
        (result,) = await asyncrunner.score(
            env, RecoPowerlineAgent, competition="l2rpn_2020", nb_scenario=1, workers=1,
            cache_dir=tmp_path / cache, **arguments,
        )  # fmt: skip
        return result

    try:
        first = await once("warm")
        assert not first.references_reused
        assert first.path is None  # nothing kept without path_save
        again = await once("warm", **changed)
        assert not again.references_reused
        fresh = await once("fresh", **changed)
        assert again.as_grid2op() == fresh.as_grid2op()
        assert [s.total_steps for s in again.scenarios] == [changed.get("max_step", 3)]
        assert (await once("warm", **changed)).references_reused
    finally:
        env.close()


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_path_save_keeps_each_agent_and_reference_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pools: list[ForkPool] = []

    class SeenPool(ForkPool):
        def __init__(self, limiter: Any) -> None:
            super().__init__(limiter)
            pools.append(self)

    monkeypatch.setattr(asyncrunner._runner, "ForkPool", SeenPool)
    env = env_copy("l2rpn_case14_sandbox", tmp_path)
    save = tmp_path / "scores"
    kwargs: dict[str, Any] = {
        "competition": "l2rpn_2020", "nb_scenario": 2, "max_step": 10, "env_seeds": SEEDS,
        "agent_seeds": SEEDS, "workers": 2, "cache_dir": tmp_path / "cache", "path_save": save,
    }  # fmt: skip
    try:
        results = await asyncrunner.score(env, [DoNothingAgent, RandomAgent], **kwargs)
        # Two references and two agents, on one pool of two workers (not a pool each).
        assert len(pools) == 1 and len(pools[0].served) == 2
        folders = sorted(p.name for p in save.iterdir())
        assert folders == ["DoNothingAgent", "RandomAgent", "l2rpn_dn", "l2rpn_no_overflow_reco"]
        for folder in folders:
            episodes = EpisodeData.list_episode(str(save / folder))
            assert len(episodes) == 2
            assert len(EpisodeData.from_disk(*episodes[0]).observations) >= 1
        assert results[1].path == str(save / "RandomAgent")
        # An interrupted score: one agent's episode missing. resume plays only that one.
        shutil.rmtree(save / "RandomAgent" / results[1].scenarios[1].name)
        resumed = await asyncrunner.score(env, [DoNothingAgent, RandomAgent], resume=True, **kwargs)
        assert [r.as_grid2op() for r in resumed] == [r.as_grid2op() for r in results]
        assert resumed[0].references_reused
    finally:
        env.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"competition": "l2rpn_2099"}, "unknown competition"),
        ({"competition": "l2rpn_2020", "env_seeds": [1]}, "`env_seeds` has 1 seeds for 2"),
        ({"competition": "l2rpn_2020", "resume": True}, "`resume=True` needs `path_save`"),
        ({"competition": "l2rpn_2020", "workers": 0}, "`workers` must be an integer >= 1"),
        ({"competition": "l2rpn_2020", "nb_scenario": 99}, r"is 99 but the env has \d+ scenarios"),
        (
            {"competition": "l2rpn_2020", "nb_scenario": None},
            r"is 16 \(the score class's default\) but the env has \d+ scenarios",
        ),
        ({"competition": "l2rpn_2020", "nb_scenario": 2.5}, "`nb_scenario` must be an integer"),
        ({"competition": "l2rpn_2020", "max_step": 0}, "`max_step` must be an integer >= 1"),
        ({"competition": "l2rpn_2020", "max_step": -5}, "`max_step` must be an integer >= 1"),
    ],
)
async def test_bad_arguments_fail_before_any_episode(
    env: Any, tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await asyncrunner.score(
            env, DoNothingAgent, **{"nb_scenario": 2, "cache_dir": tmp_path / "cache", **kwargs}
        )
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_env_name_or_a_closed_env_says_what_to_pass(env: Any, tmp_path: Path) -> None:
    # (grid2op's class failed inside, reading the name's get_path_env)
    kwargs: dict[str, Any] = dict(competition="l2rpn_2020", cache_dir=tmp_path / "cache")
    with pytest.raises(TypeError, match=r"got str: grid2op.make\('l2rpn_case14_sandbox', ...\)"):
        await asyncrunner.score("l2rpn_case14_sandbox", DoNothingAgent, **kwargs)
    closed = env.copy()
    closed.close()
    with pytest.raises(ValueError, match="the env is closed"):
        await asyncrunner.score(closed, DoNothingAgent, **kwargs)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_env_replaying_saved_episodes_refuses_more_scenarios_than_it_has(
    env: Any, tmp_path: Path
) -> None:
    """FromMultiEpisodeData plays its episodes in a loop, FromOneEpisodeData its one: a scenario
    played twice collides in the statistics (grid2op's classes fail with a KeyError once all
    are played; this failed with a FileExistsError, after playing the references)."""
    from grid2op.Chronics import FromMultiEpisodeData, FromOneEpisodeData
    from grid2op.Runner import Runner

    source = tmp_path / "source"
    grid2ops(
        Runner(**env.get_params_for_runner(), agentClass=DoNothingAgent).run,
        nb_episode=2, max_iter=3, path_save=str(source), env_seeds=[0, 1],
    )  # fmt: skip
    episodes = EpisodeData.list_episode(str(source))
    for chronics, feeding, count in (
        (FromMultiEpisodeData, {"li_ep_data": episodes}, "2 scenarios"),
        (FromOneEpisodeData, {"ep_data": episodes[0]}, "1 scenario "),
    ):
        replaying = make_env(
            "l2rpn_case14_sandbox", chronics_class=chronics, data_feeding_kwargs=feeding
        )
        try:
            with pytest.raises(ValueError, match=f"the env has {count}"):
                await asyncrunner.score(
                    replaying, DoNothingAgent, competition="l2rpn_2020", nb_scenario=3,
                    max_step=3, cache_dir=tmp_path / "cache",
                )  # fmt: skip
        finally:
            replaying.close()
    assert not (tmp_path / "cache").exists()


def test_each_agent_gets_a_folder_of_its_own() -> None:
    from asyncrunner._score._grid2op import _unique

    # Two agents had one label (and one folder, their episodes mixed) when a suffix made for a
    # repeated class name was another agent's name, or an agent was named as a reference.
    assert _unique(["A", "A", "A_2"], set()) == ["A", "A_3", "A_2"]
    assert _unique(["A_2", "A", "A"], set()) == ["A_2", "A", "A_3"]
    assert _unique(["l2rpn_dn", "B", "B"], {"l2rpn_dn"}) == ["l2rpn_dn_2", "B", "B_2"]


def test_a_central_agent_or_a_partial_is_labelled_by_the_agent_it_makes(env: Any) -> None:
    from asyncrunner import CentralAgent
    from asyncrunner._score._grid2op import agent_label

    assert agent_label(CentralAgent(DoNothingAgent)) == "DoNothingAgent"
    assert agent_label(CentralAgent(RandomAgent(env.action_space))) == "RandomAgent"
    # a functools.partial (an agent's constructor arguments bound): the class it makes
    assert agent_label(functools.partial(RandomAgent, space_prng=None)) == "RandomAgent"


class FailingAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Raises at its third step."""

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.steps = 0

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        self.steps += 1
        if self.steps == 3:
            raise ZeroDivisionError("the agent's bug")
        return self.action_space({})


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_failing_agent_or_cache_folder_raises_its_own_error(
    env: Any, tmp_path: Path
) -> None:
    kwargs: dict[str, Any] = dict(competition="l2rpn_2020", nb_scenario=1, max_step=6, workers=2)
    taken = tmp_path / "a_file"
    taken.write_text("")
    with pytest.raises(ValueError, match=r"`cache_dir` .* is a file: give a folder"):
        await asyncrunner.score(env, DoNothingAgent, cache_dir=taken, **kwargs)
    # As AsyncRunner.run raises it, not inside an exception group of the score's runs.
    with pytest.raises(asyncrunner.EpisodeError, match="the agent's bug") as caught:
        await asyncrunner.score(env, FailingAgent, cache_dir=tmp_path / "cache", **kwargs)
    # Agents and references play at once: the error says whose episode it was.
    assert caught.value.__notes__ == ["(scenario 0 of agent 'FailingAgent')"]
    # The references played on, and were cached (grid2op's class computes them before any
    # agent plays): the next score reuses them. They were lost with the agent's failure.
    (result,) = await asyncrunner.score(env, DoNothingAgent, cache_dir=tmp_path / "cache", **kwargs)
    assert result.references_reused


@pytest.mark.slow
def test_cli_score_prints_table_json_and_plot(tmp_path: Path) -> None:
    env = env_copy("l2rpn_case14_sandbox", tmp_path)
    folder = env.get_path_env()
    env.close()
    command = [
        sys.executable, "-m", "asyncrunner", "score", folder, "--test",
        "--agent", "DoNothingAgent", "--agent", "RecoPowerlineAgent",
        "--competition", "l2rpn_2020", "--nb-scenario", "2", "--max-step", "6", "--seed", "0",
        "--workers", "2", "--cache-dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    table = subprocess.run(
        [*command, "--plot", str(tmp_path / "score.png")],
        capture_output=True, text=True, timeout=600, env=environ, check=True,
    )  # fmt: skip
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "scenario", "DoNothingAgent", "score", "survived", "RecoPowerlineAgent", "score", "survived"
    ]  # fmt: skip
    assert lines[3].startswith("total")
    assert "computed in this run" in table.stdout
    assert (tmp_path / "score.png").stat().st_size > 0
    second = subprocess.run(
        [*command, "--json"], capture_output=True, text=True, timeout=600, env=environ, check=True
    )
    data = json.loads(second.stdout)
    assert [d["agent"] for d in data] == ["DoNothingAgent", "RecoPowerlineAgent"]
    assert all(d["references_reused"] for d in data)
    assert [len(d["scenarios"]) for d in data] == [2, 2]


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``asyncrunner ARGV`` prints on stdout, run in this process (it must succeed)."""
    from asyncrunner._cli import main

    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_cli_score_table_sums_the_steps_survived_and_says_where_references_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = env_copy("l2rpn_case14_sandbox", tmp_path)
    folder = env.get_path_env()
    env.close()
    argv = [
        "score", folder, "--agent", "DoNothingAgent", "--agent", f"{CutsLines.__module__}:CutsLines",
        "--competition", "l2rpn_2020", "--nb-scenario", "2", "--max-step", "6", "--seed", "0",
        "--workers", "2", "--cache-dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    first = _cli(argv, capsys).splitlines()
    header, rows, total = first[0].split(), [r.split() for r in first[1:3]], first[3].split()
    assert header[:4] == ["scenario", "DoNothingAgent", "score", "survived"]
    assert header[4:] == ["CutsLines", "score", "survived"]
    assert [r[0] for r in rows] == ["0000", "0001"]
    assert [r[2] for r in rows] == ["6/6", "6/6"]  # doing nothing survives
    survived = [int(r[4].split("/")[0]) for r in rows]  # the game overs
    assert all(0 < n < 6 for n in survived) and [r[4].split("/")[1] for r in rows] == ["6", "6"]
    # The total row: the scores' mean, and the steps survived of all steps played.
    assert total[0] == "total" and total[2] == "12/12" and total[4] == f"{sum(survived)}/12"
    assert first[4].endswith("reference statistics computed in this run (now cached)")
    again = _cli(argv, capsys).splitlines()
    assert again[:4] == first[:4]
    assert again[4].endswith("reference statistics reused from the cache")


def test_components_are_grid2ops_sub_scores_in_the_result_and_the_cli_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncrunner._cli._common import derive_seeds

    env = env_copy("l2rpn_idf_2023", tmp_path)
    folder = env.get_path_env()
    env_seeds, agent_seeds = derive_seeds(0, 1)
    try:
        scoring = functools.partial(
            asyncrunner.score, env, RecoPowerlineAgent, competition="l2rpn_2023",
            nb_scenario=1, max_step=8, env_seeds=env_seeds, agent_seeds=agent_seeds,
            workers=1, cache_dir=tmp_path / "cache",
        )  # fmt: skip
        (result,) = anyio.run(scoring)
    finally:
        env.close()
    # grid2op's tuple per scenario: (score, operational, renewables, assistant).
    (parts,) = result.as_grid2op()[0]
    (scenario,) = result.scenarios
    assert scenario.score == float(parts[0])
    assert dict(scenario.components) == {
        "operational": float(parts[1]),
        "renewables": float(parts[2]),
        "assistant": float(parts[3]),
    }
    out = _cli(
        [
            "score", folder, "--agent", "RecoPowerlineAgent", "--competition", "l2rpn_2023",
            "--nb-scenario", "1", "--max-step", "8", "--seed", "0", "--workers", "1", "--json",
            "--cache-dir", str(tmp_path / "cache"),
        ],
        capsys,
    )  # fmt: skip
    (printed,) = json.loads(out)
    assert printed["references_reused"]
    assert printed["scenarios"] == [
        {
            "name": scenario.name,
            "score": scenario.score,
            "components": dict(scenario.components),
            "steps_survived": scenario.steps_survived,
            "total_steps": scenario.total_steps,
        }
    ]


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_save_folder_holding_an_earlier_score_gives_the_same_references(
    tmp_path: Path,
) -> None:
    env = env_copy("l2rpn_case14_sandbox", tmp_path)
    kwargs: dict[str, Any] = {
        "competition": "l2rpn_2020", "nb_scenario": 1, "env_seeds": [5],
        "agent_seeds": [5], "workers": 2, "path_save": tmp_path / "scores",
    }  # fmt: skip
    try:
        # An earlier, longer score in the same folder...
        await asyncrunner.score(env, RandomAgent, cache_dir=tmp_path / "a", **kwargs, max_step=12)
        # ...then this one, with an empty cache: its references play again beside the earlier
        # ones (<chronic>_1); only this score's go into the statistics.
        (ours,) = await asyncrunner.score(
            env, RandomAgent, cache_dir=tmp_path / "b", **kwargs, max_step=6
        )
        assert not ours.references_reused
        alone = {**kwargs, "path_save": None}
        (fresh,) = await asyncrunner.score(
            env, RandomAgent, cache_dir=tmp_path / "c", **alone, max_step=6
        )
        assert ours.as_grid2op() == fresh.as_grid2op()
        assert len(EpisodeData.list_episode(str(tmp_path / "scores" / "l2rpn_dn"))) == 2
    finally:
        env.close()


def test_the_reconnecting_reference_plays_without_overflow_disconnection(
    env: Any, tmp_path: Path
) -> None:
    from asyncrunner._plan._mixes import runner_params
    from asyncrunner._score._grid2op import ScorePlan

    plan = ScorePlan.make(
        env, [DoNothingAgent], competition="l2rpn_2020", nb_scenario=1, max_step=5,
        env_seeds=None, agent_seeds=None, path_save=None, cache_dir=tmp_path,
    )  # fmt: skip
    try:
        sent = {
            folder: runner_params(job_env)["parameters_path"] for folder, job_env, _ in plan.jobs
        }
        # What grid2op's EpisodeStatistics.run_env gives its Runner for each reference.
        assert not env.parameters.NO_OVERFLOW_DISCONNECTION
        assert sent["l2rpn_no_overflow_reco"]["NO_OVERFLOW_DISCONNECTION"] is True
        assert sent["l2rpn_dn"] == sent["DoNothingAgent"] == env.parameters.to_dict()
    finally:
        plan.close()


# The chronic a test's chronics filter leaves out (a module-level function, pickled by name: the
# same function whatever it keeps).
_LEFT_OUT: str | None = None


def keep_chronic(path: str) -> bool:
    return os.path.basename(path) != _LEFT_OUT


def _cache_entries(env: Any, cache: Path, nb_scenario: int = 1) -> list[str]:
    """The cache folder of each reference statistics of a l2rpn_2020 score of ``env``."""
    from asyncrunner._score._grid2op import ScorePlan

    plan = ScorePlan.make(
        env, [DoNothingAgent], competition="l2rpn_2020", nb_scenario=nb_scenario, max_step=5,
        env_seeds=None, agent_seeds=None, path_save=None, cache_dir=cache,
    )  # fmt: skip
    plan.close()
    return [ref.stats.path_save_stats for ref in plan.refs]


def test_the_cache_key_names_the_scenarios_played(
    env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    filtered = env.copy()
    try:
        filtered.chronics_handler.set_filter(keep_chronic)
        filtered.chronics_handler.reset()
        every = _cache_entries(filtered, tmp_path)
        assert _cache_entries(filtered, tmp_path) == every
        # The same filter function keeps other chronics: the one played is another (0001).
        monkeypatch.setattr(sys.modules[__name__], "_LEFT_OUT", "0000")
        assert set(_cache_entries(filtered, tmp_path)).isdisjoint(every)
        monkeypatch.setattr(sys.modules[__name__], "_LEFT_OUT", None)
        assert _cache_entries(filtered, tmp_path) == every
    finally:
        filtered.close()


def test_the_cache_key_follows_the_env_files_and_the_played_chronics_files(
    tmp_path: Path,
) -> None:
    env = env_copy("l2rpn_case14_sandbox", tmp_path)
    folder = Path(env.get_path_env())
    cache = tmp_path / "cache"

    def touch(path: Path) -> None:  # as an edit does: a new modification time
        info = path.stat()
        os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))

    try:
        first = _cache_entries(env, cache)
        assert _cache_entries(env, cache) == first
        touch(folder / "chronics" / "0001" / "load_p.csv.bz2")  # not played (nb_scenario=1)
        assert _cache_entries(env, cache) == first
        played = folder / "chronics" / "0000" / "load_p.csv.bz2"
        played.write_bytes(played.read_bytes() + b"\n")
        edited = _cache_entries(env, cache)
        assert set(edited).isdisjoint(first)
        assert _cache_entries(env, cache) == edited
        for name in ("grid.json", "config.py", "prods_charac.csv"):
            touch(folder / name)
            assert set(_cache_entries(env, cache)).isdisjoint(edited), name
            edited = _cache_entries(env, cache)
        # A chronic added (never played): grid2op signs the statistics with every chronic's
        # name, and refused the entry's signature ("wrong hash value") for ever after.
        shutil.copytree(folder / "chronics" / "0001", folder / "chronics" / "0001_copy")
        assert set(_cache_entries(env, cache)).isdisjoint(edited)
    finally:
        env.close()


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_scenarios_whose_names_sort_otherwise_than_played_score_as_grid2op(
    tmp_path: Path,
) -> None:
    """FromMultiEpisodeData's 11 scenarios, ``chronics@0`` to ``chronics@10``: grid2op's class
    scores them in the order of its statistics (names sorted: ``@10`` before ``@2``), each
    against its own references; they were scored against another's. The episodes it replays
    are files outside the env's folder: edited, the references are computed again."""
    from grid2op.Chronics import FromMultiEpisodeData
    from grid2op.Runner import Runner

    base = env_copy("l2rpn_case14_sandbox", tmp_path)
    source = tmp_path / "source"
    grid2ops(
        Runner(**base.get_params_for_runner(), agentClass=DoNothingAgent).run,
        nb_episode=2, max_iter=6, path_save=str(source), env_seeds=[0, 1],
    )  # fmt: skip
    base.close()
    episodes = EpisodeData.list_episode(str(source))
    nb = 11
    env = make_env(
        str(tmp_path / "l2rpn_case14_sandbox"),
        chronics_class=FromMultiEpisodeData,
        data_feeding_kwargs={"li_ep_data": [episodes[i % 2] for i in range(nb)]},
    )
    kwargs: dict[str, Any] = dict(
        nb_scenario=nb, max_step=4, env_seeds=list(range(nb)), agent_seeds=list(range(nb))
    )
    try:
        scorer = grid2ops(grid2op.utils.ScoreL2RPN2020, env, **kwargs)
        expected = grid2ops(scorer.get, RandomAgent(env.action_space))
        cache = tmp_path / "cache"
        (result,) = await asyncrunner.score(
            env, RandomAgent, competition="l2rpn_2020", cache_dir=cache, **kwargs
        )
        assert result.as_grid2op() == expected
        names = [scorer.stat_dn.get_metadata()[str(i)]["scenario_name"] for i in range(nb)]
        assert [s.name for s in result.scenarios] == names and names[2] == "chronics@10"
        for npz in (source / episodes[0][1]).glob("*.npz"):  # (os.utime: as an edit does)
            info = npz.stat()
            os.utime(npz, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
        (again,) = await asyncrunner.score(
            env, RandomAgent, competition="l2rpn_2020", cache_dir=cache, **kwargs
        )
        assert not again.references_reused
    finally:
        env.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_two_computations_of_one_cache_entry_at_once_both_succeed(
    env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncrunner._score._grid2op import ScorePlan, compute_stats

    # The references' episodes, played once.
    save = tmp_path / "scores"
    await asyncrunner.score(
        env, DoNothingAgent, competition="l2rpn_2020", nb_scenario=1, max_step=5, workers=1,
        path_save=save, cache_dir=tmp_path / "first",
    )  # fmt: skip
    played = save / "l2rpn_dn"
    episodes = [
        SimpleNamespace(name=name, path=os.path.join(where, name))
        for where, name in EpisodeData.list_episode(str(played))
    ]

    def reference(cache: Path) -> tuple[Any, Any]:
        plan = ScorePlan.make(
            env, [DoNothingAgent], competition="l2rpn_2020", nb_scenario=1, max_step=5,
            env_seeds=None, agent_seeds=None, path_save=None, cache_dir=cache,
        )  # fmt: skip
        plan.close()
        return plan.scorer, next(ref for ref in plan.todo if ref.name == "l2rpn_dn")

    # Two processes scoring at once: both post-process the same entry at the same time.
    original = EpisodeStatistics.compute
    both_there = threading.Barrier(2, timeout=60)

    def together(self: Any, **kwargs: Any) -> Any:
        both_there.wait()
        return original(self, **kwargs)

    monkeypatch.setattr(EpisodeStatistics, "compute", together)
    computing = [reference(tmp_path / "shared") for _ in range(2)]
    errors: list[BaseException] = []

    def compute(scorer: Any, ref: Any) -> None:
        try:
            compute_stats(scorer, ref, str(played), episodes, None, None)
        except BaseException as error:
            errors.append(error)
            both_there.abort()

    threads = [threading.Thread(target=compute, args=pair) for pair in computing]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    (_, ref), (_, other) = computing
    target = Path(ref.stats.path_save_stats)
    assert other.stats.path_save_stats == str(target)
    assert (target / ".asyncrunner_complete").is_file()
    metadata = ref.stats.get_metadata()  # signed by grid2op for this folder
    assert metadata == other.stats.get_metadata() and metadata["0"]["path"] == str(target)
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no private folder left

    # A computation that fails leaves nothing behind; a damaged entry is computed again.
    monkeypatch.setattr(EpisodeStatistics, "compute", lambda self, **kwargs: 1 / 0)
    scorer, ref = reference(tmp_path / "other")
    target = Path(ref.stats.path_save_stats)
    with pytest.raises(ZeroDivisionError):
        compute_stats(scorer, ref, str(played), episodes, None, None)
    assert list(target.parent.iterdir()) == []
    monkeypatch.setattr(EpisodeStatistics, "compute", original)
    target.mkdir()
    (target / "cut_short").write_text("")
    compute_stats(scorer, ref, str(played), episodes, None, None)
    assert (target / ".asyncrunner_complete").is_file() and not (target / "cut_short").exists()
    again = ref.stats.get_metadata()
    assert again["0"] == {**metadata["0"], "path": str(target)}
    assert [p.name for p in target.parent.iterdir()] == [target.name]
