"""Parity with grid2op's own Runner, env by env: same seeds, same rewards, steps and saved arrays.

grid2op's Runner builds a new env for every episode; a worker plays each episode on a copy of an
env it built and never played. These tests check that nothing an episode changes (opponents,
rewards, chronics handlers and their caches, ...) reaches a later episode, on every env shipped
in grid2op's wheel, over several ``run()`` calls on one runner. grid2op's results come from the
``grid2op_reference`` fixture (computed once per session, kept in pytest's cache), except where
its saved episodes are compared (``_reference``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grid2op
import numpy as np
import pytest
from grid2op.Agent import BaseAgent, DoNothingAgent, RandomAgent
from grid2op.Chronics import FromHandlers, FromNPY, MultifolderWithCache
from grid2op.Chronics.handlers import CSVHandler, JSONMaintenanceHandler, NoisyForecastHandler
from grid2op.Reward import BaseReward, EpisodeDurationReward, FlatReward
from grid2op.Runner import Runner

import asyncrunner.compat
from asyncrunner import AsyncRunner, EpisodeResult
from asyncrunner._engine._envs import _Cached
from asyncrunner._engine._recipe import Recipe

from .conftest import LightSimBackend, make_env
from .helpers import SampleAgent, grid2ops, starts

pytestmark = pytest.mark.anyio


def _key(result: Any) -> tuple[Any, ...]:
    """What must be identical: chronic, cumulative reward (exactly: repr), steps played, max."""
    if isinstance(result, EpisodeResult):
        return (result.name, repr(result.cum_reward), result.nb_time_step, result.max_ts)
    return (result[1], repr(float(result[2])), result[3], result[4])


def _reference(env: Any, agent: type, path_save: Path | None = None, **kwargs: Any) -> Any:
    """grid2op's results (``nb_process=1``), saving its episodes in ``path_save`` if given."""
    runner = grid2ops(Runner, **env.get_params_for_runner(), agentClass=agent)
    save = None if path_save is None else str(path_save)
    return [_key(r) for r in grid2ops(runner.run, nb_process=1, path_save=save, **kwargs)]


async def _three_runs(env: Any, agent: type, workers: int, **kwargs: Any) -> list[list[Any]]:
    async with AsyncRunner(env, agent=agent, workers=workers) as runner:
        return [[r.as_tuple() for r in await runner.run(**kwargs)] for _ in range(3)]


# --- fast tier: the cases that diverged, each on a short episode ---------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_idf_2023_opponent_on_a_reused_worker(
    module_env: Callable[[str], Any], grid2op_reference: Any
) -> None:
    # l2rpn_idf_2023's GeometricOpponentMultiArea keeps each area's episode length in its
    # sub-opponents: an env reused without them drew the second episode's attacks differently.
    env = module_env("l2rpn_idf_2023")
    kwargs: dict[str, Any] = dict(
        nb_episode=2, env_seeds=[1, 3], agent_seeds=[101, 103], episode_id=[1, 1], max_iter=120
    )
    expected = grid2op_reference(env, DoNothingAgent, **kwargs)
    async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
        results = await runner.run(**kwargs)
    assert [r.as_tuple() for r in results] == expected


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_max_iter_minus_one_plays_as_grid2op_plays_it(tmp_path: Path) -> None:
    # grid2op's Runner resets with "max step": -1, which leaves env.max_episode_duration() at -1
    # (the observations' max_step, rewards such as EpisodeDurationReward read it), not at the
    # chronic's length as with no max_iter. A game over at step 4 here.
    env = make_env("rte_case14_opponent", reward_class=EpisodeDurationReward)
    kwargs: dict[str, Any] = dict(nb_episode=1, env_seeds=[11], agent_seeds=[5], max_iter=-1)
    try:
        expected = _reference(env, RandomAgent, tmp_path / "grid2op", **kwargs)
        async with AsyncRunner(env, agent=RandomAgent, workers=1) as runner:
            results = await runner.run(path_save=tmp_path / "ours", **kwargs)
        assert [_key(r) for r in results] == expected
        (played,) = results
        assert played.nb_time_step < 10 and expected[0][1] == repr(-float(played.nb_time_step))
        for side in ("grid2op", "ours"):
            name = str(played.name) if side == "grid2op" else Path(str(played.path)).name
            observations = np.load(tmp_path / side / name / "observations.npz")["data"]
            max_step = [obs.max_step for obs in _observations(env, observations)]
            assert max_step == [-1] * (played.nb_time_step + 1), side
    finally:
        env.close()


def _observations(env: Any, rows: np.ndarray) -> list[Any]:
    """The observations of a saved episode's rows (the rows played: no NaN padding)."""
    out = []
    for row in rows:
        if np.isnan(row).all():
            break
        obs = env.observation_space.from_vect(row, check_legit=False)
        out.append(obs)
    return out


# An env with detachment: an action whose detachment arrays are not built yet (grid2op builds them
# on first read) counts every substation with a load as changed, so RandomAgent's actions, reused
# from step to step, turn illegal until something reads them. grid2op's Runner reads each step's
# actions with ``to_vect`` when it records an episode: always with one process, with several only
# when it saves or details. Two episodes of chronic 0, whose course differs from step 21 to 30.
DETACHED_RUN: dict[str, Any] = dict(
    nb_episode=2, env_seeds=[11, 11], agent_seeds=[21, 21], episode_id=[0, 0], max_iter=30
)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_actions_are_read_as_grid2op_reads_them_when_it_records(tmp_path: Path) -> None:
    env = make_env(allow_detachment=True)
    recorded = _reference(env, RandomAgent, path_save=tmp_path / "grid2op", **DETACHED_RUN)
    assert recorded == _reference(env, RandomAgent, **DETACHED_RUN)  # one process: recorded
    runner = grid2ops(Runner, **env.get_params_for_runner(), agentClass=RandomAgent)
    unread = grid2ops(runner.run_one_episode, env_seed=11, agent_seed=21, max_iter=30)
    assert _key(unread) != recorded[0]  # the reading changes the episode
    # The same results whether the run saves or not, and the same saved arrays.
    async with AsyncRunner(env, agent=RandomAgent, workers=1) as ours:
        assert [_key(r) for r in await ours.run(**DETACHED_RUN)] == recorded
        saved = await ours.run(path_save=tmp_path / "ours", **DETACHED_RUN)
    assert [_key(r) for r in saved] == recorded
    assert saved[1].path is not None
    assert _same_folder(Path(saved[1].path), tmp_path / "grid2op" / "0000") == []
    env.close()


class _Preprocessing(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Changes its observation in place (a network's preprocessing), then reads ``to_vect``,
    and redispatches when that vector's flows are not zero."""

    def reset(self, obs: Any) -> None:
        obs.rho[:] = 0.0  # before grid2op's Runner reads the first observation

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        observation.rho[:] = 0.0
        vector = observation.to_vect()
        names = type(observation).attr_list_vect
        start = sum(np.asarray(getattr(observation, n)).size for n in names[: names.index("rho")])
        if np.any(vector[start : start + observation.n_line] != 0):
            return self.action_space({"redispatch": [(0, 1.0)]})
        return self.action_space()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_observations_are_read_as_grid2op_reads_them_when_it_records(
    env: Any, tmp_path: Path
) -> None:
    # grid2op's Runner, as it records (always with one process), reads each observation with
    # ``to_vect``, which keeps the vector in it: the agent's own ``to_vect`` after changing it
    # in place returns the vector kept. asyncrunner read the observations its own way, keeping
    # nothing: other actions, other rewards, saving or not (found by the agents hunt).
    kwargs: dict[str, Any] = dict(nb_episode=2, max_iter=10, env_seeds=[0, 1])
    recorded = _reference(env, _Preprocessing, **kwargs)
    async with AsyncRunner(env, agent=_Preprocessing, workers=1) as ours:
        assert [_key(r) for r in await ours.run(**kwargs)] == recorded
        saved = await ours.run(path_save=tmp_path, **kwargs)
    assert [_key(r) for r in saved] == recorded


def test_compat_reads_actions_when_grid2op_records(tmp_path: Path) -> None:
    env = make_env(allow_detachment=True)
    params = env.get_params_for_runner()
    theirs = grid2ops(Runner, **params, agentClass=RandomAgent)
    compat = asyncrunner.compat.Runner(**params, agentClass=RandomAgent)
    one: dict[str, Any] = dict(indx=0, env_seed=11, agent_seed=21, max_iter=30)
    calls: list[dict[str, Any]] = [
        dict(nb_process=1),  # grid2op's sequential mode records every episode
        dict(nb_process=2),  # records nothing
        dict(nb_process=2, path_save=str(tmp_path / "grid2op")),
    ]
    expected = [[_key(r) for r in grid2ops(theirs.run, **DETACHED_RUN, **c)] for c in calls]
    assert expected[0] != expected[1] == [_key(grid2ops(theirs.run_one_episode, **one))] * 2
    assert expected[2] == expected[0]
    calls[2]["path_save"] = str(tmp_path / "ours")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [[_key(r) for r in compat.run(**DETACHED_RUN, **c)] for c in calls] == expected
        assert _key(compat.run_one_episode(**one)) == expected[1][0]  # records nothing
    env.close()


def test_reward_instances_keep_their_parameters() -> None:
    # Other rewards given as instances (as grid2op's scores give their scores_func) reach the
    # episode as they are, not rebuilt from their class.
    env = make_env()
    params = env.get_params_for_runner()
    params["other_rewards"] = {"flat": FlatReward(per_timestep=7.0)}
    kwargs: dict[str, Any] = dict(
        nb_episode=3, env_seeds=[1, 2, 3], agent_seeds=[4, 5, 6], max_iter=5, nb_process=1
    )
    kwargs["add_detailed_output"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = Runner(**params, agentClass=DoNothingAgent).run(**kwargs)
        results = asyncrunner.compat.Runner(**params, agentClass=DoNothingAgent).run(**kwargs)
    flat = [[step["flat"] for step in r[-1].other_rewards] for r in results]
    assert flat == [[step["flat"] for step in r[-1].other_rewards] for r in expected]
    assert flat[-1] == [7.0] * 5
    env.close()


class RhoSquared(BaseReward):  # type: ignore[misc]  # grid2op is untyped
    """A reward class of the caller's own: the sum of the lines' rho squared,
    -3 for an illegal, ambiguous or failed step."""

    def __call__(self, action: Any, env: Any, has_error: bool, is_done: bool, *flags: bool) -> Any:
        if has_error or any(flags):
            return -3.0
        return float(np.sum(env.get_obs().rho ** 2))


def _changed_by_hand() -> Any:
    """case14 changed the ways a user changes an env before a run: lower thermal limits, other
    parameters (taken at the next reset), a shorter episode, no forecasts, played a little."""
    env = make_env()
    env.set_thermal_limit(env.get_thermal_limit() * 0.85)
    params = env.parameters
    params.HARD_OVERFLOW_THRESHOLD = 1.5
    params.NB_TIMESTEP_OVERFLOW_ALLOWED = 1
    env.change_parameters(params)
    env.set_max_iter(9)
    env.deactivate_forecast()
    env.reset(seed=3)
    env.step(env.action_space())
    return env


def _fed_from_arrays() -> Any:
    """case14 fed from the caller's arrays (``FromNPY``: one unnamed chronic of 20 steps), with a
    reward class of the caller's own and another among its other rewards."""
    source = make_env()
    obs = source.reset(seed=0)
    source.close()
    wave = 1.0 + 0.05 * np.sin(np.arange(20))[:, np.newaxis]
    return make_env(
        chronics_class=FromNPY,
        data_feeding_kwargs={
            "load_p": np.tile(obs.load_p, (20, 1)) * wave,
            "load_q": np.tile(obs.load_q, (20, 1)),
            "prod_p": np.tile(obs.gen_p, (20, 1)) * wave,
        },
        reward_class=RhoSquared,
        other_rewards={"flat": FlatReward},
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("build", [_changed_by_hand, _fed_from_arrays])
async def test_an_env_made_or_changed_by_the_caller_plays_as_in_grid2op(
    build: Callable[[], Any],
) -> None:
    # What ``get_params_for_runner`` carries of an env the caller changed, or fed from its own
    # arrays with its own reward class, reaches a worker that plays several episodes in a row.
    env = build()
    # No max_iter: the changed env's own (9 steps) holds.
    kwargs: dict[str, Any] = dict(nb_episode=3, env_seeds=[5, 6, 7], agent_seeds=[8, 9, 10])
    expected = _reference(env, SampleAgent, **kwargs)
    async with AsyncRunner(env, agent=SampleAgent, workers=1) as runner:
        for _ in range(2):
            assert [_key(r) for r in await runner.run(**kwargs)] == expected
    env.close()


def _handlers_env(tmp_path: Path) -> Any:
    """case14 fed by handlers, cached by MultifolderWithCache: a JSON maintenance schedule drawn
    from the seed (each day, one of five meshed lines in the first hour) and noisy forecasts."""
    source = make_env()
    folder = tmp_path / "case14_handlers"
    shutil.copytree(source.get_path_env(), folder)
    meta = {
        "maintenance_starting_hour": 0,
        "maintenance_ending_hour": 1,
        "line_to_maintenance": ["1_2_2", "1_3_3", "1_4_4", "2_3_5", "3_4_6"],
        "daily_proba_per_month_maintenance": [1.0] * 12,
        "max_daily_number_per_month_maintenance": [1] * 12,
        "maintenance_day_of_week": list(range(7)),
    }
    source.close()
    for chronic in (folder / "chronics").iterdir():
        (chronic / "maintenance_meta.json").write_text(json.dumps(meta))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = grid2op.make(
            str(folder),
            backend=LightSimBackend(),
            chronics_class=MultifolderWithCache,
            data_feeding_kwargs={
                "gridvalueClass": FromHandlers,
                "gen_p_handler": CSVHandler("prod_p"),
                "load_p_handler": CSVHandler("load_p"),
                "gen_v_handler": CSVHandler("prod_v"),
                "load_q_handler": CSVHandler("load_q"),
                "maintenance_handler": JSONMaintenanceHandler(),
                "h_forecast": (5, 10),
                "gen_p_for_handler": NoisyForecastHandler("prod_p_forecasted"),
                "load_p_for_handler": NoisyForecastHandler("load_p_forecasted"),
                "load_q_for_handler": NoisyForecastHandler("load_q_forecasted"),
            },
        )
    env.chronics_handler.reset()
    return env


def _seen(results: list[Any]) -> list[tuple[Any, ...]]:
    """Each episode's reward, and the maintenance schedule and loads each observation showed."""
    seen = []
    for r in results:
        observations = [r[-1].observations[i] for i in range(len(r[-1].observations))]
        seen.append(
            (
                repr(float(r[2])),
                r[3],
                [o.time_next_maintenance.tolist() for o in observations],
                [o.load_p.tolist() for o in observations],
            )
        )
    return seen


def test_multifolder_with_cache_fed_by_handlers(tmp_path: Path) -> None:
    # The handlers' state (the maintenance drawn, its length, the dates) lives in the cached
    # chronics: a reused env saw none of the maintenance in the second and third episodes.
    env = _handlers_env(tmp_path)
    kwargs: dict[str, Any] = dict(
        nb_episode=3, env_seeds=[0, 1, 0], agent_seeds=[0, 0, 0], max_iter=5, nb_process=1
    )
    kwargs["add_detailed_output"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params = env.get_params_for_runner()
        expected = _seen(Runner(**params, agentClass=DoNothingAgent).run(**kwargs))
        results = _seen(
            asyncrunner.compat.Runner(**params, agentClass=DoNothingAgent).run(**kwargs)
        )
    assert results == expected
    assert results[0] == results[2]  # same seed, same schedule and loads
    assert any(t >= 0 for step in results[0][2] for t in step)  # maintenance was planned
    env.close()


_CODE = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType)


def _state(root: Any) -> dict[str, Any]:
    """Every value reachable from ``root`` (attributes, containers, arrays), by path."""
    state: dict[str, Any] = {}
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "env")]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, (str, bytes, int, float, bool, type(None), np.generic)):
            state[path] = repr(obj)
            continue
        if id(obj) in seen or isinstance(obj, _CODE):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            state[path] = (obj.dtype.str, obj.shape, obj.tobytes())
        elif isinstance(obj, dict):
            stack.extend((v, f"{path}[{k!r}]") for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(obj))
        elif hasattr(obj, "__dict__"):
            stack.extend((v, f"{path}.{k}") for k, v in vars(obj).items())
    return state


@pytest.mark.parametrize(
    "name", ["rte_case14_opponent", pytest.param("l2rpn_idf_2023", marks=pytest.mark.slow)]
)
def test_an_episode_leaves_the_pristine_env_untouched(name: str) -> None:
    # The contract, checked on everything reachable from the env the worker keeps: episodes
    # played on its copies (with an opponent that attacks) change none of it.
    env = make_env(name)
    cached = _Cached(Recipe(params=env.get_params_for_runner(), agent_kind="class", agent=None))
    before = _state(cached.pristine)
    for seed in (0, 1):
        episode = cached.episode_env()
        obs = episode.reset(seed=seed, options={"time serie id": seed, "max step": 100})
        agent = SampleAgent(episode.action_space)
        agent.seed(seed)
        done = False
        while not done:
            obs, _, done, _ = episode.step(agent.act(obs, 0.0, done))
        episode.close()
    after = _state(cached.pristine)
    changed = [p for p in before.keys() | after.keys() if before.get(p) != after.get(p)]
    assert sorted(changed) == []
    cached.close()
    env.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_backend_that_cannot_be_copied_is_rebuilt_for_each_episode() -> None:
    # grid2op's Runner cannot play it (saving an episode copies the observation space's backend):
    # the results must be those of the same backend that can be copied.
    kwargs: dict[str, Any] = dict(
        nb_episode=3, env_seeds=[1, 2, 1], agent_seeds=[4, 5, 4], episode_id=[0, 1, 0], max_iter=10
    )
    copyable = make_env()
    expected = _reference(copyable, RandomAgent, **kwargs)
    copyable.close()
    env = make_env(backend=LightSimBackend(can_be_copied=False))
    started, sink = starts()
    async with AsyncRunner(env, agent=RandomAgent, workers=1, sinks=[sink]) as runner:
        results = await runner.run(**kwargs)
    assert [_key(r) for r in results] == expected
    builds = [e.env_builds for e in started]  # counted from the fork, not from 0
    assert builds == [builds[0], builds[0] + 1, builds[0] + 2]  # a new env for each episode
    env.close()


class FolderBackend(LightSimBackend):  # type: ignore[misc]  # lightsim2grid is untyped
    """A user's backend with a resource outside the process (as one driving a solver keeps
    files, a socket or a subprocess): a working folder made by ``load_grid``, removed by
    ``close``; a power flow without it fails."""

    root = ""

    def load_grid(self, path: Any = None, filename: Any = None) -> None:
        super().load_grid(path, filename)
        self.workdir = tempfile.mkdtemp(dir=self.root)

    def runpf(self, is_dc: bool = False) -> Any:
        if not os.path.isdir(getattr(self, "workdir", self.root)):
            raise RuntimeError(f"{self.workdir} is gone")
        return super().runpf(is_dc)

    def close(self) -> None:
        shutil.rmtree(getattr(self, "workdir", ""), ignore_errors=True)
        super().close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("copy_env", [False, True])
async def test_a_user_backend_is_built_for_each_episode_not_forked(
    tmp_path: Path, copy_env: bool
) -> None:
    # A user backend's env was built once in this process and forked into every worker: the
    # first episode to end closed it, removing the folder the other workers' forks still used.
    FolderBackend.root = str(tmp_path)
    env = make_env("rte_case14_opponent", backend=FolderBackend())
    kwargs: dict[str, Any] = dict(nb_episode=4, max_iter=10, agent_seeds=[0, 1, 2, 3])
    expected = _reference(env, RandomAgent, **kwargs)
    started, sink = starts()
    async with AsyncRunner(
        env, agent=RandomAgent, workers=2, sinks=[sink], copy_env=copy_env
    ) as runner:
        results = await runner.run(**kwargs, on_error="continue")
    assert [r.error for r in results] == [None] * 4
    assert [_key(r) for r in results] == expected
    assert all(e.env_builds >= 1 for e in started)  # none played an env forked from here
    env.close()
    assert os.listdir(tmp_path) == []  # each episode's env closed, its folder removed


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_chronics_read_in_chunks_are_rebuilt_not_copied() -> None:
    # grid2op's env.copy() deep-copies the chronics' open chunk readers, which cannot be: every
    # episode failed ("cannot pickle '_io.TextIOWrapper' object"), with copy_env=True too.
    env = make_env(data_feeding_kwargs={"chunk_size": 5})
    kwargs: dict[str, Any] = dict(
        nb_episode=3, env_seeds=[1, 2, 3], agent_seeds=[4, 5, 6], episode_id=[0, 1, 0], max_iter=12
    )
    expected = _reference(env, RandomAgent, **kwargs)
    for copy_env in (False, True):
        async with AsyncRunner(env, agent=RandomAgent, workers=1, copy_env=copy_env) as runner:
            assert [_key(r) for r in await runner.run(**kwargs)] == expected
    env.close()


# --- slow tier: every wheel env, long episodes, three runs on one runner ------------------------

# Envs shipped in grid2op's wheel (grid2op.list_available_test_env()) that grid2op's Runner
# plays; l2rpn_neurips_2020_track2 is a MultiMixEnvironment, which grid2op's Runner does not take
# (it plays one mix at a time: tests/test_multimix.py compares each mix). RandomAgent builds in
# milliseconds on the small grids; on the others SampleAgent is the seeded random agent.
MATRIX_ENVS = {
    "educ_case14_redisp": RandomAgent,
    "educ_case14_storage": RandomAgent,
    "l2rpn_case14_sandbox": RandomAgent,
    "l2rpn_case14_sandbox_diff_grid": RandomAgent,
    "l2rpn_icaps_2021": SampleAgent,
    "l2rpn_idf_2023": SampleAgent,
    "l2rpn_neurips_2020_track1": SampleAgent,
    "l2rpn_wcci_2020": SampleAgent,
    "l2rpn_wcci_2022": SampleAgent,
    "l2rpn_wcci_2022_dev": SampleAgent,
    "rte_case118_example": SampleAgent,
    "rte_case14_opponent": RandomAgent,
    "rte_case14_realistic": RandomAgent,
    "rte_case14_redisp": RandomAgent,
    "rte_case14_test": RandomAgent,
    "rte_case5_example": RandomAgent,
}
# Three episodes on two workers (so a worker plays two in a row), 288 steps or to game over;
# the first chronic is played twice (with other seeds) where there are two.
MATRIX_RUN: dict[str, Any] = dict(
    nb_episode=3, env_seeds=[11, 12, 13], agent_seeds=[21, 22, 23], max_iter=288
)


def _matrix_cases() -> list[Any]:
    cases = []
    for name, random_agent in MATRIX_ENVS.items():
        for agent in (DoNothingAgent, random_agent):
            cases.append(pytest.param(name, agent, id=f"{name}-{agent.__name__}"))
    return cases


@pytest.fixture(scope="module")
def module_env() -> Iterator[Callable[[str], Any]]:
    """``module_env(name)``: the env ``name``, shared by consecutive tests of this module on that
    env; one at a time (the wheel's big envs take gigabytes together)."""
    held: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in held:
            for env in held.values():
                env.close()
            held.clear()
            held[name] = make_env(name)
        return held[name]

    yield get
    for env in held.values():
        env.close()


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(("name", "agent"), _matrix_cases())
async def test_parity_matrix(
    module_env: Callable[[str], Any], grid2op_reference: Any, name: str, agent: type
) -> None:
    env = module_env(name)
    ids = [0, 1, 0] if len(env.chronics_handler.real_data.subpaths) > 1 else [0, 0, 0]
    kwargs = dict(MATRIX_RUN, episode_id=ids)
    expected = grid2op_reference(env, agent, **kwargs)
    runs = await _three_runs(env, agent, 2, **kwargs)
    # The workers started from copies of the env as grid2op.make returned it (copy_env).
    async with AsyncRunner(env, agent=agent, workers=2, copy_env=True) as runner:
        runs.append([r.as_tuple() for r in await runner.run(**kwargs)])
    assert [run == expected for run in runs] == [True, True, True, True], (expected, runs)


ARRAY_FILES = [
    "actions.npz",
    "env_modifications.npz",
    "observations.npz",
    "rewards.npz",
    "disc_lines_cascading_failure.npz",
    "opponent_attack.npz",
]
JSON_FILES = ["_parameters.json", "other_rewards.json", "episode_meta.json"]


def _same_folder(ours: Path, theirs: Path) -> list[str]:
    """The files that differ between two saved episodes (arrays exactly, NaN equal to NaN)."""
    differ = []
    for name in ARRAY_FILES:
        with np.load(ours / name) as a, np.load(theirs / name) as b:
            if sorted(a.files) != sorted(b.files) or not all(
                np.array_equal(a[k], b[k], equal_nan=True) for k in a.files
            ):
                differ.append(name)
    for name in JSON_FILES:
        if json.loads((ours / name).read_text()) != json.loads((theirs / name).read_text()):
            differ.append(name)
    return differ


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    ("name", "agent"),
    [("l2rpn_idf_2023", DoNothingAgent), ("rte_case14_opponent", RandomAgent)],
)
async def test_saved_arrays_match_grid2op(name: str, agent: type, tmp_path: Path) -> None:
    env = make_env(name)
    kwargs = dict(MATRIX_RUN, episode_id=[0, 1, 0])
    expected = _reference(env, agent, path_save=tmp_path / "grid2op", **kwargs)
    async with AsyncRunner(env, agent=agent, workers=2) as runner:
        await runner.run(**kwargs)  # a run before, so that the saved one plays on used workers
        results = await runner.run(path_save=tmp_path / "ours", **kwargs)
    assert [_key(r) for r in results] == expected
    # grid2op's Runner overwrites a chronic's folder: it holds the last episode of that chronic.
    last = {r.name: r for r in results}
    for chronic, result in last.items():
        assert result.path is not None and chronic is not None
        assert _same_folder(Path(result.path), tmp_path / "grid2op" / chronic) == []
    env.close()
