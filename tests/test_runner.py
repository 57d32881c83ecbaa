"""AsyncRunner against grid2op's own Runner: same seeds, same results."""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import pickle
import shutil
import time
import weakref
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import grid2op
import numpy as np
import pytest
from grid2op.Agent import BaseAgent, DoNothingAgent, RandomAgent
from grid2op.Reward import AlarmReward, L2RPNReward

from asyncrunner import (
    AsyncRunner,
    CentralAgent,
    EpisodeError,
    EpisodeFinished,
    RunFinished,
    StepBatch,
)
from asyncrunner._engine import _channel, _envs
from asyncrunner._engine._pool import WorkerPool
from asyncrunner._pools._fork import ForkPool
from asyncrunner._runner import sharing_workers
from asyncrunner.sinks import CallbackSink

from .conftest import LightSimBackend, make_env
from .helpers import BOTH_LOOPS, grid2ops, quiet, run_code, starts

pytestmark = pytest.mark.anyio


class AlarmAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Raises an alarm at every step: leaves AlarmReward's `is_alarm_used` set after an episode."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return self.action_space({"raise_alarm": [0]})


@pytest.mark.parametrize(
    ("name", "agent", "workers"),
    [
        # the fast tier: a random agent on two workers, with and without an opponent
        ("l2rpn_case14_sandbox", RandomAgent, 2),
        ("rte_case14_opponent", RandomAgent, 2),
        pytest.param("l2rpn_case14_sandbox", DoNothingAgent, 1, marks=pytest.mark.slow),
        pytest.param("rte_case14_opponent", DoNothingAgent, 1, marks=pytest.mark.slow),
        pytest.param("educ_case14_storage", RandomAgent, 1, marks=pytest.mark.slow),
        pytest.param("educ_case14_storage", DoNothingAgent, 2, marks=pytest.mark.slow),
    ],
)
async def test_parity_with_grid2op_runner(
    wheel_env: Any, grid2op_reference: Any, name: str, agent: type[BaseAgent], workers: int
) -> None:
    env = wheel_env(name)
    # More episodes than workers, one chronic played twice, seeds and max_iter given.
    kwargs: dict[str, Any] = dict(
        nb_episode=3,
        max_iter=30,
        env_seeds=[11, 12, 13],
        agent_seeds=[21, 22, 23],
        episode_id=[0, 1, 0],
    )
    expected = grid2op_reference(env, agent, **kwargs)
    async with AsyncRunner(env, agent=agent, workers=workers) as runner:
        results = await runner.run(**kwargs)
    assert [r.as_tuple() for r in results] == expected
    assert [r.index for r in results] == [0, 1, 2]
    assert all(r.error is None for r in results)


async def test_env_built_once_per_worker_and_reused(env: Any, grid2op_reference: Any) -> None:
    started, sink = starts()
    kwargs: dict[str, Any] = dict(
        nb_episode=6,
        max_iter=8,
        env_seeds=list(range(6)),
        agent_seeds=list(range(6)),
        episode_id=[0, 1, 2, 0, 1, 2],
    )
    async with AsyncRunner(env, agent=RandomAgent, workers=2, sinks=[sink]) as runner:
        assert runner._recipe_key in _envs._HELD  # built here, for the workers forked next
        first = await runner.run(**kwargs)
        second = await runner.run(**kwargs)
    assert runner._recipe_key not in _envs._HELD  # freed with the runner
    by_worker: dict[int, list[int]] = {}
    for event in started:
        by_worker.setdefault(event.worker, []).append(event.env_builds)
    assert len(started) == 12
    assert len(by_worker) == 2  # both workers served, across both runs
    # Forked from this process after it built the env once: no worker builds one.
    assert all(set(builds) == {0} for builds in by_worker.values())
    assert [r.as_tuple() for r in first] == [r.as_tuple() for r in second]
    assert [r.as_tuple() for r in first] == grid2op_reference(env, RandomAgent, **kwargs)


async def test_runners_sharing_workers_interleave_on_one_warm_pool(
    env: Any, grid2op_reference: Any
) -> None:
    started, sink = starts()
    kwargs: dict[str, Any] = dict(
        nb_episode=4, max_iter=10, env_seeds=[1, 2, 3, 4], agent_seeds=[5, 6, 7, 8]
    )
    runners = [
        AsyncRunner(env, agent=a, workers=1, sinks=[sink]) for a in (RandomAgent, DoNothingAgent)
    ]
    builds_before = _envs.builds()
    async with sharing_workers(runners, 2):
        # Both recipes held here before the first fork: every worker starts with both envs,
        # and the two agents on one env share one pristine env (built once).
        first, second = (_envs._HELD[r._recipe_key][0] for r in runners)
        assert first.pristine is second.pristine is not None
        assert builds_before + 1 == _envs.builds()
        shared = first.pristine
        async with anyio.create_task_group() as group:
            results: dict[int, Any] = {}

            async def play(i: int) -> None:
                results[i] = await runners[i].run(**kwargs)

            for i in range(2):
                group.start_soon(play, i)
    assert not any(r._recipe_key in _envs._HELD for r in runners)
    assert shared._BaseEnv__closed  # closed once, with the last runner that held it
    # One pool of two for both runs (apart, each runner would have had one worker of its own).
    pool = runners[0]._pool
    assert isinstance(pool, ForkPool) and pool is runners[1]._pool and pool.workers == 2
    assert not pool.pids  # stopped
    runs: dict[int, set[str]] = {}
    for event in started:
        runs.setdefault(event.worker, set()).add(event.run_id)
    # Both runs' episodes on its two workers. Whether a worker serves both runs depends on which
    # dispatcher waited first for it (a freed worker may go back to the same run each time).
    assert len(runs) == 2 and len(set().union(*runs.values())) == 2, runs
    assert {e.env_builds for e in started} == {0}
    for i, agent in enumerate((RandomAgent, DoNothingAgent)):
        assert [r.as_tuple() for r in results[i]] == grid2op_reference(env, agent, **kwargs)


async def test_sharing_workers_takes_each_runner_once(env: Any) -> None:
    # The first runner given twice was also marked as sharing another's pool: nobody stopped
    # the pool, and its workers lived on after the block (found by a hunt).
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=1)
    with pytest.raises(ValueError, match="each runner once"):
        async with sharing_workers([runner, runner], 1):
            pass
    assert runner._pool is None


def test_a_lent_pristine_env_is_closed_by_its_last_holder(env: Any) -> None:
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=1)
    key, blob = runner._recipe_key, runner._recipe_bytes
    lent = env.copy()  # what compat lends: an env built from the recipe's params
    assert _envs.hold(key, blob, lent) and _envs.hold(key, blob)  # two holders
    _envs.release(key)
    assert _envs.disown(lent)  # its lender is done; a hold keeps it: the hold closes it
    assert not lent._BaseEnv__closed
    _envs.release(key)
    assert lent._BaseEnv__closed and key not in _envs._HELD
    other = env.copy()
    assert _envs.hold(key, blob, other)
    # Another agent on the same env does not share a lent env: its lender may close it first.
    twin_runner = AsyncRunner(env, agent=RandomAgent, workers=1)
    assert _envs.hold(twin_runner._recipe_key, twin_runner._recipe_bytes)
    assert _envs._HELD[twin_runner._recipe_key][0].pristine is not other
    _envs.release(twin_runner._recipe_key)
    _envs.release(key)
    assert not other._BaseEnv__closed and not _envs.disown(other)  # the lender closes it
    other.close()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_what_a_process_had_stays_out_of_its_collections_while_it_holds_envs(env: Any) -> None:
    # A held env's build triggers a full collection of everything this process has (0.15 to
    # 0.2 s with a big heap), landing as the workers are forked or a run starts. While envs are
    # held, what the process had before is frozen; after, it is collected as before.
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=1)
    key, blob = runner._recipe_key, runner._recipe_bytes
    cycle = _Cycle()
    gone = weakref.ref(cycle)
    # Python 3.12 keeps its immortal objects in the permanent generation: no freeze of anyone's.
    unfrozen = _envs._PERMANENT_AT_IMPORT
    assert gc.get_freeze_count() <= unfrozen
    assert _envs.hold(key, blob) and _envs.hold(key, blob)
    assert gc.get_freeze_count() > unfrozen + 1000
    del cycle
    gc.collect()
    assert gone() is not None  # frozen: not collected while held
    _envs.release(key)
    gc.collect()
    assert gone() is not None  # still held once
    _envs.release(key)
    assert gc.get_freeze_count() <= unfrozen
    gc.collect()
    assert gone() is None
    # A freeze of the caller's (a pre-fork server's) is left as it is.
    gc.freeze()
    try:
        assert _envs.hold(key, blob)
        _envs.release(key)
        assert gc.get_freeze_count() > unfrozen + 1000  # not unfrozen by the release
    finally:
        gc.unfreeze()


class _Finalized:
    """Part of a cycle; says when the collector finalizes it."""

    def __init__(self, name: str, order: list[str]) -> None:
        self.name, self.order = name, order
        self.other: _Finalized | None = None

    def __del__(self) -> None:
        self.order.append(self.name)


def test_holding_envs_keeps_the_order_in_which_a_cycle_is_finalized(env: Any) -> None:
    # A grid2op env is a cycle with its observation space's simulation env, made after it; the
    # env's __del__ closes both, the simulation env's closes itself, and the env's then raises
    # "is closed already" (printed as a script that left its env open ends). A plain collection
    # finalizes the older part first; freezing while envs are held must not turn that around.
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=1)
    key, blob = runner._recipe_key, runner._recipe_bytes
    order: list[str] = []
    old = _Finalized("old", order)
    gc.collect()  # in the oldest generation, as an env made a while ago
    young = _Finalized("young", order)  # in the youngest: a part of it made since
    old.other, young.other = young, old
    del young
    assert _envs.hold(key, blob)
    _envs.release(key)
    del old
    gc.collect()
    assert order == ["old", "young"]


async def test_copy_env_starts_forked_workers_from_a_copy_of_the_env(
    env: Any, grid2op_reference: Any
) -> None:
    # The session's env is as grid2op.make returned it: copies of it play what grid2op's Runner
    # plays, with no env built here or in the workers (the fast path); a pool that does not fork
    # this process builds its env from the env's parameters as usual.
    started, sink = starts()
    kwargs: dict[str, Any] = dict(
        nb_episode=4, max_iter=12, env_seeds=[1, 2, 3, 4], agent_seeds=[5, 6, 7, 8]
    )
    expected = grid2op_reference(env, RandomAgent, **kwargs)
    builds_before = _envs.builds()
    runner = AsyncRunner(env, agent=RandomAgent, workers=2, sinks=[sink], copy_env=True)
    async with runner:
        held = _envs._HELD[runner._recipe_key][0].pristine
        assert held is not env and not held._BaseEnv__closed
        results = await runner.run(**kwargs)
    assert held._BaseEnv__closed and not env._BaseEnv__closed  # the copy freed, not the env
    assert _envs.builds() == builds_before
    assert len(started) == 4 and {e.env_builds for e in started} == {0}
    assert [r.as_tuple() for r in results] == expected
    with ThreadPoolExecutor(1) as pool:
        async with AsyncRunner(env, agent=RandomAgent, executor=pool, copy_env=True) as runner:
            assert [r.as_tuple() for r in await runner.run(**kwargs)] == expected
    assert _envs.builds() == builds_before + 1


async def test_copies_and_builds_of_one_env_stay_apart_across_runners(
    grid2op_reference: Any,
) -> None:
    # Chronics shuffled since make: grid2op's Runner (and copy_env=False) build the env its
    # params give, copy_env=True plays the caller's. Held under one key, a runner opened while
    # another was open played the other's env: copy_env=False the copy, copy_env=True a build.
    env = make_env()
    env.chronics_handler.shuffle(lambda order: order[::-1])
    kwargs: dict[str, Any] = dict(nb_episode=2, max_iter=5, env_seeds=[1, 2], agent_seeds=[4, 5])
    built = grid2op_reference(env, RandomAgent, **kwargs)

    async def play(copy_env: bool) -> list[Any]:
        async with AsyncRunner(env, agent=RandomAgent, workers=1, copy_env=copy_env) as runner:
            return [r.as_tuple() for r in await runner.run(**kwargs)]

    copied = await play(True)
    assert copied != built  # other chronics
    for other, first in itertools.product((RandomAgent, DoNothingAgent), (True, False)):
        async with AsyncRunner(env, agent=other, workers=1, copy_env=first):  # one key, or twins
            assert await play(not first) == (built if first else copied)
    env.close()


def test_copy_env_must_be_a_bool(env: Any) -> None:
    with pytest.raises(TypeError, match="`copy_env` must be True or False"):
        AsyncRunner(env, agent=DoNothingAgent, copy_env="yes")  # type: ignore[arg-type]


class _BestOfSimulated(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """The best of three sampled actions as ``obs.simulate`` rates them: plays what the
    forecasts' parameters give."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        best, best_reward = self.action_space(), -np.inf
        for _ in range(3):
            action = self.action_space.sample()
            _, simulated, over, _ = observation.simulate(action)
            if not over and simulated > best_reward:
                best, best_reward = action, simulated
        return best


async def test_copy_env_refuses_an_env_whose_forecasts_differ_from_a_build(env: Any) -> None:
    # grid2op's Runner builds its env with the env's parameters, for its steps and for its
    # forecasts. Copies apply pending parameters at their first reset; and after
    # change_parameters and a reset the env's forecasts keep the old ones. The refusal's
    # "call env.reset() first" was accepted then, and copies played other episodes than grid2op's
    # Runner (found by the env variants hunt: rewards and steps differed).
    from grid2op.Runner import Runner as GridRunner

    kwargs: dict[str, Any] = dict(max_iter=12, env_seeds=[1, 2], agent_seeds=[3, 4])

    async def refused(match: str) -> None:
        runner = AsyncRunner(changed, agent=_BestOfSimulated, workers=1, copy_env=True)
        try:
            with pytest.raises(ValueError, match=match):
                await runner.__aenter__()
        finally:
            await runner.aclose()

    changed = env.copy()
    try:
        params = changed.parameters
        params.ENV_DC = params.FORECAST_DC = True
        changed.change_parameters(params)
        await refused(r"change_parameters\(...\), which grid2op's Runner does not see.*False")
        changed.reset()
        await refused(r"forecasts \(obs\.simulate\) use other parameters than the env")
        changed.change_forecast_parameters(params)
        await refused(r"change_forecast_parameters\(...\), which")
        changed.reset()  # the env's and its forecasts' parameters are the same again
        changed.change_reward(L2RPNReward)  # grid2op's Runner builds the make's reward
        await refused(r"change_reward\(...\), which .* pass the reward_class to grid2op.make")
        changed.reset()
        await refused(r"change_reward\(...\), which")  # applied now, still not the built one
        changed.change_reward(type(env._reward_helper.template_reward))
        changed.reset()
        # (an agent calling obs.simulate failed every episode: NoForecastAvailable)
        changed.deactivate_forecast()
        await refused(r"deactivate_forecast\(...\), which .*: use copy_env=False$")
        changed.reactivate_forecast()
        runner = quiet(GridRunner, **changed.get_params_for_runner(), agentClass=_BestOfSimulated)
        expected = grid2ops(runner.run, nb_episode=2, nb_process=1, **kwargs)
        async with AsyncRunner(
            changed, agent=_BestOfSimulated, workers=1, copy_env=True
        ) as copying:
            results = await copying.run(2, **kwargs)
        assert [r.as_tuple() for r in results] == [tuple(e[:5]) for e in expected]
    finally:
        changed.close()


async def test_copy_env_refuses_an_env_changed_since_the_runner_was_made(env: Any) -> None:
    # Copied when the runner opens, recorded as the runner was made: the episodes played the
    # new thermal limits, saved as the old ones', and resume returned them for the env as made.
    changed = env.copy()
    runner = AsyncRunner(changed, agent=DoNothingAgent, workers=1, copy_env=True)
    changed.set_thermal_limit(changed.get_thermal_limit() * 0.6)
    try:
        with pytest.raises(ValueError, match=r"changed since this AsyncRunner was made.*after"):
            await runner.__aenter__()
    finally:
        await runner.aclose()
    async with AsyncRunner(changed, agent=DoNothingAgent, workers=1, copy_env=True) as made:
        (result,) = await made.run(1, max_iter=3)
    assert result.error is None
    changed.close()


def test_copy_env_takes_an_env_made_with_a_nan_parameter_or_a_reward_instance() -> None:
    # grid2op takes SOFT_OVERFLOW_THRESHOLD=nan; the env's and its forecasts' parameters are
    # the same, and a NaN is not equal to itself: compared as the same value (found by review).
    from grid2op.Parameters import Parameters

    from asyncrunner._runner import _check_parameters_as_built

    params = Parameters()
    params.SOFT_OVERFLOW_THRESHOLD = float("nan")
    made = make_env(param=params)
    try:
        _check_parameters_as_built(made)
    finally:
        made.close()
    made = make_env(reward_class=L2RPNReward())  # an instance given to make: not a change
    try:
        _check_parameters_as_built(made)
    finally:
        made.close()


async def test_thermal_limit_reset_option_does_not_leak(env: Any, grid2op_reference: Any) -> None:
    low = env.get_thermal_limit() * 0.5
    kwargs: dict[str, Any] = dict(
        nb_episode=3,
        max_iter=20,
        env_seeds=[1, 2, 3],
        agent_seeds=[4, 5, 6],
        episode_id=[0, 1, 2],
        reset_options=[{"thermal limit": low}, {}, {}],
    )
    expected = grid2op_reference(env, DoNothingAgent, **kwargs)
    # One worker: the episodes after the first reuse the env that had the low limits.
    async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
        results = await runner.run(**kwargs)
    assert [r.as_tuple() for r in results] == expected
    assert results[0].nb_time_step < results[1].nb_time_step  # the option did act


async def test_time_serie_id_is_a_position_among_the_filtered_chronics_as_in_grid2op() -> None:
    # grid2op's Runner reads reset_options' "time serie id" with int(): "0001" is the second
    # chronic the filter keeps (0002 here), not the chronic named 0001, which was played.
    from grid2op.Runner import Runner as GridRunner

    from .conftest import make_env

    filtered = make_env()
    try:
        filtered.chronics_handler.set_filter(lambda path: not path.endswith("0000"))
        filtered.chronics_handler.reset()
        kwargs: dict[str, Any] = dict(
            nb_episode=3,
            max_iter=5,
            env_seeds=[1, 2, 3],
            reset_options=[{"time serie id": "0001"}, {"time serie id": 1.0}, {"time serie id": 0}],
        )
        runner = quiet(GridRunner, **filtered.get_params_for_runner(), agentClass=DoNothingAgent)
        expected = grid2ops(runner.run, nb_process=1, **kwargs)
        async with AsyncRunner(filtered, agent=DoNothingAgent, workers=1) as ours:
            results = await ours.run(**kwargs)
            assert [r.name for r in results] == ["0002", "0002", "0001"]
            assert [r.as_tuple() for r in results] == [tuple(e[:5]) for e in expected]
            with pytest.raises(ValueError, match=r"read with int\(\).*got 'x'"):
                await ours.run(1, reset_options={"time serie id": "x"})
    finally:
        filtered.close()


async def test_alarm_reward_state_does_not_leak(wheel_env: Any, grid2op_reference: Any) -> None:
    env = wheel_env("l2rpn_icaps_2021", reward_class=AlarmReward)
    kwargs: dict[str, Any] = dict(
        nb_episode=3, max_iter=15, env_seeds=[1, 2, 3], agent_seeds=[4, 5, 6], episode_id=[0, 1, 0]
    )
    expected = grid2op_reference(env, AlarmAgent, **kwargs)
    async with AsyncRunner(env, agent=AlarmAgent, workers=1) as runner:
        results = await runner.run(**kwargs)
    assert [r.as_tuple() for r in results] == expected


async def test_jobs_carry_a_recipes_key_and_workers_ask_for_the_recipe_once(
    env: Any, grid2op_reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An agent instance is pickled into the recipe with all it holds (a RandomAgent lists every
    # unitary action): it must not travel with every episode. Thread workers share this
    # process's env cache, and each plays its episodes with an agent of its own: the seeded
    # results are grid2op's.
    agent = RandomAgent(env.action_space)
    kwargs: dict[str, Any] = dict(
        nb_episode=6, max_iter=5, env_seeds=list(range(6)), agent_seeds=list(range(6))
    )
    jobs: list[int] = []
    play = WorkerPool.play

    async def measured(self: WorkerPool, group: Any) -> None:
        jobs.append(len(pickle.dumps(group)))
        await play(self, group)

    asked: list[bytes] = []
    send = _channel.AsyncSocket.send

    async def seen(self: _channel.AsyncSocket, data: bytes) -> None:
        asked.append(data)  # what the run's channel sends its workers
        await send(self, data)

    with ThreadPoolExecutor(2) as executor:
        async with AsyncRunner(env, agent=agent, workers=2, executor=executor) as runner:
            await runner.run(1, max_iter=1)  # the warm-up is over
            # Emptied: a worker must ask.
            recipe = runner._recipe_bytes
            for key in [k for k in _envs._ENVS if k.startswith(runner._recipe_key)]:
                _envs._ENVS.pop(key).close()
            monkeypatch.setattr(WorkerPool, "play", measured)
            monkeypatch.setattr(_channel.AsyncSocket, "send", seen)
            results = await runner.run(**kwargs)
            monkeypatch.undo()
    assert len(recipe) > 1_000_000
    assert len(jobs) == 6 and max(jobs) < 10_000
    # Once per entry of the env cache: one per thread playing at the same time, at most (an
    # episode plays with an agent of its own, as in a process of grid2op's Runner).
    assert 1 <= asked.count(recipe) <= 2
    assert [r.as_tuple() for r in results] == grid2op_reference(env, RandomAgent, **kwargs)


@pytest.mark.slow  # spawned workers import everything afresh
async def test_spawn_start_method_with_an_executor(env: Any, grid2op_reference: Any) -> None:
    kwargs: dict[str, Any] = dict(
        nb_episode=3, max_iter=10, env_seeds=[1, 2, 3], agent_seeds=[4, 5, 6], episode_id=[0, 1, 2]
    )
    context = multiprocessing.get_context("spawn")
    started, sink = starts()
    with ProcessPoolExecutor(max_workers=2, mp_context=context) as executor:
        async with AsyncRunner(
            env, agent=RandomAgent, workers=2, executor=executor, sinks=[sink]
        ) as runner:
            results = await runner.run(**kwargs)
    assert [r.as_tuple() for r in results] == grid2op_reference(env, RandomAgent, **kwargs)
    # A spawned worker holds nothing of this process: it builds the env itself, once.
    builds: dict[int, set[int]] = {}
    for event in started:
        builds.setdefault(event.worker, set()).add(event.env_builds)
    assert builds and all(b == {1} for b in builds.values()), builds


@BOTH_LOOPS
async def test_stream_gives_events_in_episode_order(env: Any) -> None:
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        async with runner.stream(2, max_iter=70, episode_id=[0, 1]) as events:
            seen = [event async for event in events]
    kinds = [type(e).__name__ for e in seen]
    assert kinds[0] == "RunStarted" and kinds[-1] == "RunFinished"
    for index in (0, 1):
        mine = [e for e in seen if getattr(e, "index", None) == index]
        assert type(mine[0]).__name__ == "EpisodeStarted"
        last = mine[-1]
        assert type(last) is EpisodeFinished
        batches = [e for e in mine if type(e) is StepBatch]
        assert len(batches) >= 2  # steps arrive in several batches, not one object per step
        steps = np.concatenate([b.rewards for b in batches])
        assert len(steps) == 70 == last.nb_time_step
        assert [b.first_step for b in batches] == list(
            np.cumsum([1] + [len(b) for b in batches[:-1]])
        )
        assert batches[0].observations.shape == (len(batches[0]), env.observation_space.n)


@BOTH_LOOPS
async def test_a_streams_run_finished_says_where_each_episode_is_saved(
    env: Any, tmp_path: Path
) -> None:
    # Its results had no path: the writer was still placing the files (a second run's went to
    # 0000_1, 0001_1, which a stream's user could not tell).
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        first = await runner.run(2, max_iter=3, path_save=tmp_path)
        async with runner.stream(2, max_iter=3, path_save=tmp_path) as events:
            seen = [event async for event in events]
    ended = seen[-1]
    assert isinstance(ended, RunFinished)
    assert [r.path for r in first] == [str(tmp_path / "0000"), str(tmp_path / "0001")]
    assert [r.path for r in ended.results] == [str(tmp_path / "0000_1"), str(tmp_path / "0001_1")]
    assert all(
        [await anyio.Path(r.path or "", "episode_meta.json").is_file() for r in ended.results]
    )


@BOTH_LOOPS
async def test_leaving_a_stream_early_cancels_the_run(env: Any) -> None:
    async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
        with anyio.fail_after(60):
            async with runner.stream(3) as events:
                async for event in events:
                    if type(event).__name__ == "StepBatch":
                        break
        # The runner is still usable after the cancelled run.
        again = await runner.run(1, max_iter=3)
    assert again[0].nb_time_step == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (dict(nb_episode=-1), ValueError, "nb_episode"),
        (dict(nb_episode=2, env_seeds=[1]), ValueError, "env_seeds"),
        (dict(nb_episode=2, agent_seeds=[1, 2, 3]), ValueError, "agent_seeds"),
        (dict(nb_episode=2, episode_id=[0]), ValueError, "episode_id"),
        (dict(nb_episode=1, episode_id=[7]), ValueError, "out of range"),
        (dict(nb_episode=2, init_states=[{}]), ValueError, "init_states"),
        (dict(nb_episode=1, reset_options={"bogus": 1}), ValueError, "bogus"),
        (dict(nb_episode=1, on_error="ignore"), ValueError, "on_error"),
        (
            dict(nb_episode=1, sinks=None),
            TypeError,
            "`sinks` must be a list of sinks, got NoneType",
        ),
        (
            dict(nb_episode=1, sinks=CallbackSink(print)),
            TypeError,
            r"got CallbackSink \(sinks=\[sink\]: a list of one\)",
        ),
        (dict(nb_episode=1, sinks=None, add_detailed_output=True), TypeError, "got NoneType"),
        (dict(nb_episode=1, bogus=2), TypeError, "unexpected keyword argument 'bogus'$"),
        (  # grid2op's Runner.run takes it
            dict(nb_episode=1, nb_process=2),
            TypeError,
            r"'nb_process': the runner's workers .* AsyncRunner\(env, agent=..., workers=N\)",
        ),
        (dict(nb_episode=1, add_nb_highres_sim=True), TypeError, "EpisodeResult.nb_highres_sim"),
    ],
)
async def test_bad_run_arguments_fail_before_any_work(
    env: Any, kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=1)
    with pytest.raises(error, match=words):
        await runner.run(**kwargs)
    assert runner._pids == set()  # no worker was started
    await runner.aclose()


class _Unpicklable(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.lock = multiprocessing.Lock().__enter__  # bound method of a lock: not picklable


async def test_bad_runner_arguments(env: Any) -> None:
    with pytest.raises(ValueError, match="workers"):
        AsyncRunner(env, agent=DoNothingAgent, workers=0)
    with pytest.raises(TypeError, match="`sinks` must be a list of sinks, got generator"):
        AsyncRunner(env, agent=DoNothingAgent, sinks=(s for s in [CallbackSink(print)]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="BaseAgent"):
        AsyncRunner(env, agent=int)
    with pytest.raises(TypeError, match="cannot be pickled"):
        AsyncRunner(env, agent=_Unpicklable(env.action_space))
    closed = env.copy()
    closed.close()
    with pytest.raises(ValueError, match="closed"):
        AsyncRunner(closed, agent=DoNothingAgent)
    with pytest.raises(TypeError, match=r"\(grid2op.make\(...\)\), got the class Environment"):
        AsyncRunner(type(env), agent=DoNothingAgent)  # (it failed deep inside, in grid2op)
    with pytest.raises(TypeError, match=r"got str: grid2op.make\('l2rpn_case14_sandbox', ...\)"):
        AsyncRunner("l2rpn_case14_sandbox", agent=DoNothingAgent)


_IN_CGROUP = """
import asyncio, sys, warnings
with open(sys.argv[1], "w") as f:  # this process into the cgroup
    f.write(str(__import__("os").getpid()))
warnings.simplefilter("ignore")
from grid2op.Agent import DoNothingAgent
from asyncrunner import AsyncRunner
from asyncrunner._runner import usable_cpus
from tests.conftest import make_env

async def main():
    async with AsyncRunner(make_env(), agent=DoNothingAgent) as runner:
        results = await runner.run(3, max_iter=3)
        print(usable_cpus(), runner.workers, len(runner._pids), [r.nb_time_step for r in results])

asyncio.run(main())
"""


def test_a_cgroup_cpu_quota_caps_the_default_workers() -> None:
    # ``docker --cpus=1`` or a Kubernetes limit of one CPU on a bigger machine: the affinity
    # still lists every CPU, and the default workers (one per CPU, each with its env) all
    # played in a quota of one. A quota set on the process's cgroup's parent counts too.
    root = Path("/sys/fs/cgroup/cpu")
    if not os.access(root / "cgroup.procs", os.W_OK):
        pytest.skip("needs a writable cgroup v1 cpu hierarchy (root, on Linux)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs or more: a quota of one CPU caps nothing on one")
    outer = root / f"asyncrunner-test-{os.getpid()}"
    inner = outer / "inner"
    outer.mkdir()
    try:
        inner.mkdir()
        period = int((outer / "cpu.cfs_period_us").read_text())
        (outer / "cpu.cfs_quota_us").write_text(str(period))  # one CPU's worth
        code = _IN_CGROUP.replace("sys.argv[1]", repr(str(inner / "cgroup.procs")))
        out = run_code(code)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1", "1", "1", "[3,", "3,", "3]"]
    finally:
        for folder in (inner, outer):
            for _ in range(50):  # its processes may still be leaving it
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


@pytest.mark.parametrize(
    ("files", "cgroup", "expected"),
    [
        pytest.param(  # systemd's CPUQuota=50% on a slice, the service below it unlimited
            {"app.slice/cpu.max": "50000 100000", "app.slice/run.service/cpu.max": "max 100000"},
            "0::/app.slice/run.service\n",
            0.5,
            id="v2 slice",
        ),
        pytest.param(
            {"cpu.max": "150000 100000"}, "0::/\n", 1.5, id="v2 container, docker --cpus=1.5"
        ),
        pytest.param({"x/cpu.max": "max 100000"}, "0::/x\n", None, id="v2 no quota"),
        pytest.param(  # a container without a cgroup namespace: the host's path, not mounted
            {
                "cpu,cpuacct/cpu.cfs_quota_us": "100000",
                "cpu,cpuacct/cpu.cfs_period_us": "100000",
            },
            "12:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n",
            1.0,
            id="v1 docker",
        ),
        pytest.param(
            {
                "cpu,cpuacct/cpu.cfs_quota_us": "-1",
                "cpu,cpuacct/cpu.cfs_period_us": "100000",
                "unified/cgroup.procs": "",
            },
            "3:cpu,cpuacct:/\n0::/\n",
            None,
            id="hybrid, no quota",
        ),
    ],
)
def test_cpu_quotas_read_from_cgroup_files(
    files: dict[str, str], cgroup: str, expected: float | None, tmp_path: Path
) -> None:
    # The layouts of other machines (cgroup v2, containers) as file trees with their files'
    # formats; this machine's own kind (cgroup v1) is played for real above.
    from asyncrunner._runner import _cpu_quota

    for name, text in files.items():
        (tmp_path / "sys/fs/cgroup" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sys/fs/cgroup" / name).write_text(text)
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    assert _cpu_quota(str(tmp_path)) == expected


def test_a_worker_that_cannot_import_the_agent_s_module_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Dask worker started elsewhere: "No module named 'my_agents'", and nothing more.
    import importlib
    import pickle
    import sys

    from asyncrunner._engine import _envs

    (tmp_path / "gone_agents.py").write_text("class Agent:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = pickle.dumps(importlib.import_module("gone_agents").Agent)
    monkeypatch.delitem(sys.modules, "gone_agents")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    with pytest.raises(ModuleNotFoundError, match=r"on the worker .*client\.upload_file") as info:
        _envs._unpickled(data)
    assert info.value.name == "gone_agents"


async def test_a_worker_without_the_env_s_folder_says_what_to_do(tmp_path: Path) -> None:
    # A Dask worker on a machine without the env's folder: grid2op's "Path ... doesn't
    # exists" alone, naming neither the worker nor what to do.
    folder = tmp_path / "env"
    shutil.copytree(make_env().get_path_env(), folder)
    env = make_env(str(folder))
    shutil.rmtree(folder)
    with pytest.raises(
        EpisodeError, match=r"FileNotFoundError: .*env is not on the worker .* every"
    ):
        async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
            await runner.run(1, max_iter=3)


def test_a_cpu_quota_is_rounded_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # docker --cpus=1.5 on 4 CPUs: 2 workers by default, not 1 (README: "rounded up").
    import asyncrunner._runner

    monkeypatch.setattr(asyncrunner._runner, "_cpu_quota", lambda: 1.5)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "process_cpu_count", lambda: 4, raising=False)
    assert asyncrunner._runner.usable_cpus() == 2


async def test_an_open_runner_saves_after_its_env_was_closed(tmp_path: Any) -> None:
    # An example notebook's last cell closes the env; a saving cell run again after it failed
    # with "'NoneType' object has no attribute 'cls_to_dict'" (the env's spaces, read then).
    # grid2op's Runner plays on after it, from the env its parameters build.
    from grid2op.Episode import EpisodeData

    from .conftest import make_env

    env = make_env()
    central = AsyncRunner(env, agent=CentralAgent(DoNothingAgent), workers=1)
    async with central, AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
        await runner.run(1, max_iter=3)
        env.close()
        [result] = await runner.run(1, max_iter=3, path_save=tmp_path)
        # Its spaces make the detailed outputs' observations, the initial states' actions and a
        # CentralAgent's observations: not after its close (the last two failed, blaming the
        # state, or each episode with "'NoneType' object has no attribute 'from_vect'").
        with pytest.raises(ValueError, match=r"env\.close\(\) was called: close it after"):
            await runner.run(1, max_iter=3, add_detailed_output=True)
        with pytest.raises(ValueError, match=r"init_states needs the env .* open"):
            await runner.run(1, max_iter=3, init_states=[{"set_line_status": [(0, -1)]}])
        with pytest.raises(ValueError, match=r"a CentralAgent needs the env .* open"):
            await central.run(1, max_iter=3)
        # Entered again: it read the closed env's parts (found by review).
        async with runner:
            assert [r.nb_time_step for r in await runner.run(1, max_iter=3)] == [3]
    assert result.nb_time_step == 3
    [(_, name)] = EpisodeData.list_episode(str(tmp_path))
    assert len(EpisodeData.from_disk(str(tmp_path), name).actions) == 3


@pytest.mark.parametrize("start", ["spawn", "fork"])
async def test_an_executor_started_before_a_class_in_file_env_plays_it_until_it_is_closed(
    tmp_path: Path, start: str
) -> None:
    # class_in_file: grid2op generates the env's classes in a folder of the env's, imported by
    # name from the folder grid2op.make puts on sys.path. An executor's workers started before
    # the env was made (a Dask cluster's, the README's recipe) lacked that entry: every episode
    # failed with "No module named 'tmp...'" (class_in_file hunt). env.close() deletes the
    # folder, which workers not forked from this process may then need (a worker that had not
    # built the env failed each episode with the same error): their runners refuse, a copy's
    # too; this runner's forked workers have the classes, and play on.
    from grid2op.Backend import PandaPowerBackend

    executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context(start))
    try:
        assert executor.submit(int).result() == 0  # its worker starts before the env is made
        folder = tmp_path / "case14"
        shutil.copytree(Path(grid2op.__file__).parent / "data" / "l2rpn_case14_sandbox", folder)
        env = quiet(grid2op.make, str(folder), backend=PandaPowerBackend(), class_in_file=True)
        assert env.classes_are_in_files()
        forked = AsyncRunner(env, agent=DoNothingAgent, workers=1)
        imports = AsyncRunner(env, agent=DoNothingAgent, workers=1, executor=executor)
        of_copy = AsyncRunner(env.copy(), agent=DoNothingAgent, workers=1, executor=executor)
        async with forked, imports:
            before = [r.cum_reward for r in await forked.run(1, max_iter=3, env_seeds=[1])]
            assert [r.cum_reward for r in await imports.run(1, max_iter=3, env_seeds=[1])] == before
            env.close()
            assert not any(p.is_dir() for p in (folder / "_grid2op_classes").iterdir())
            for runner in (imports, of_copy):
                with pytest.raises(ValueError, match=r"class_in_file\) are gone from .* close the"):
                    await runner.run(1, max_iter=3)
            after = [r.cum_reward for r in await forked.run(1, max_iter=3, env_seeds=[1])]
    finally:
        executor.shutdown()
    assert after == before


async def test_an_env_made_after_chronics_were_added_is_not_an_open_runners(
    tmp_path: Path,
) -> None:
    # A runner still open (a web app's) held its env for the same parameters: a runner of an env
    # made after a chronic was added played that held env, without the new chronic (found by
    # the caches hunt).
    folder = tmp_path / "case14"
    shutil.copytree(Path(grid2op.__file__).parent / "data" / "l2rpn_case14_sandbox", folder)
    first = quiet(grid2op.make, str(folder), backend=LightSimBackend())
    saved = tmp_path / "saved"
    async with AsyncRunner(first, agent=DoNothingAgent, workers=1) as held:
        await held.run(1, max_iter=2, path_save=saved)
        shutil.copytree(folder / "chronics" / "0000", folder / "chronics" / "0003")
        second = quiet(grid2op.make, str(folder), backend=LightSimBackend())
        async with AsyncRunner(second, agent=DoNothingAgent, workers=1) as runner:
            (result,) = await runner.run(1, episode_id=[3], max_iter=2)
            # The episode saved before the chronic was added is the same: resume keeps it
            # (found by review: it was played again, into 0000_1).
            await runner.run(1, max_iter=2, path_save=saved, resume=True)
        second.close()
    first.close()
    assert (result.error, result.name) == (None, "0003")
    assert sorted(p.name for p in saved.iterdir() if p.is_dir()) == ["0000"]


async def test_episodes_read_back_by_resume_keep_their_simulations(
    env: Any, tmp_path: Path
) -> None:
    # An episode resume=True reads from disk comes with what it played, nb_highres_sim included
    # (a mutation audit found it unguarded).
    kwargs: dict[str, Any] = dict(
        max_iter=4, env_seeds=[1, 2], agent_seeds=[3, 4], path_save=tmp_path, resume=True
    )
    async with AsyncRunner(env, agent=_BestOfSimulated, workers=1) as runner:
        played = await runner.run(2, **kwargs)
        read_back = await runner.run(2, **kwargs)
    assert [r.nb_highres_sim for r in played] == [12, 12]
    assert [r.as_tuple() for r in read_back] == [r.as_tuple() for r in played]
    assert [r.nb_highres_sim for r in read_back] == [12, 12]
