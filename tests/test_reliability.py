"""Failures stay local, dead workers are replaced, cancellation is clean."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import pytest
from grid2op.Agent import BaseAgent, DoNothingAgent
from grid2op.Episode import EpisodeData

import asyncrunner._runner
from asyncrunner import (
    AsyncRunner,
    AsyncRunnerError,
    EpisodeError,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    RunFinished,
    SinkError,
    StepBatch,
)
from asyncrunner._engine import _dispatch, _envs
from asyncrunner.sinks import CallbackSink, Sink

from .conftest import LightSimBackend, make_env
from .helpers import (
    BOTH_LOOPS,
    alive,
    children,
    run_code,
    run_script,
    starts,
    wait_dead,
    wait_no_children,
)

pytestmark = pytest.mark.anyio

KWARGS: dict[str, Any] = dict(
    nb_episode=3, max_iter=20, env_seeds=[1, 2, 3], agent_seeds=[11, 12, 13], episode_id=[0, 1, 2]
)


class FailsAtStep5(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Raises at step 5 of the episode whose agent seed is 12."""

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.seed_used: int | None = None
        self.steps = 0

    def seed(self, seed: int) -> Any:
        self.seed_used = seed
        return super().seed(seed)

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        self.steps += 1
        if self.seed_used == 12 and self.steps == 5:
            raise RuntimeError("agent broke at step 5")
        return self.action_space({})


class Hangs(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Never returns from act (for the episode whose agent seed is 12)."""

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.seed_used: int | None = None

    def seed(self, seed: int) -> Any:
        self.seed_used = seed
        return super().seed(seed)

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if self.seed_used == 12:
            time.sleep(3600)
        return self.action_space({})


async def test_agent_error_continue_fails_that_episode_only(env: Any) -> None:
    async with AsyncRunner(env, agent=FailsAtStep5, workers=2) as runner:
        results = await runner.run(**KWARGS, on_error="continue")
    assert [r.error is None for r in results] == [True, False, True]
    failure = results[1].error
    assert failure is not None
    assert failure.error_type == "RuntimeError"
    assert failure.message == "agent broke at step 5"
    assert failure.step == 4  # four steps played, the fifth act raised
    assert "test_reliability.py" in failure.traceback and "in act" in failure.traceback
    assert results[0].nb_time_step == results[2].nb_time_step == 20
    # The failed episode's result still says which chronic it played, and for how long.
    failed = results[1]
    assert (failed.name, failed.nb_time_step, failed.cum_reward) == ("0001", 4, 0.0)
    played = [r.chronics_path for r in results]
    assert None not in played
    assert [os.path.basename(str(p)) for p in played] == ["0000", "0001", "0002"]
    assert len({os.path.dirname(str(p)) for p in played}) == 1
    assert failed.max_ts == results[0].max_ts == 20


class Exits(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Calls ``sys.exit`` at step 3 (a library giving up: a solver without its license)."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if observation.current_step == 2:
            sys.exit("solver: license not found")
        return self.action_space({})


class Interrupts(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Raises ``KeyboardInterrupt`` at step 3 (code that does; workers ignore Ctrl-C itself)."""

    RAISES: ClassVar[type[BaseException]] = KeyboardInterrupt

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if observation.current_step == 2:
            raise self.RAISES("solver: license not found")
        return self.action_space({})


class Cancels(Interrupts):
    """Raises ``asyncio.CancelledError`` (leaked by the agent's own asyncio client)."""

    RAISES = asyncio.CancelledError


class Abort(BaseException):
    """A library's own ``BaseException`` (as pytest's ``fail``)."""


class Aborts(Interrupts):
    RAISES = Abort


@pytest.mark.parametrize("agent", [Exits, Interrupts, Cancels, Aborts])
async def test_an_agent_exiting_fails_its_episode_only(env: Any, agent: Any) -> None:
    """Sent back to this process, a SystemExit ended (and under asyncio, hung) the caller; a
    CancelledError looked like the cancellation of the run's task: its episode had no result;
    another BaseException ended the run, on_error="continue" or not."""
    async with AsyncRunner(env, agent=agent, workers=2) as runner:
        with anyio.fail_after(120):
            results = await runner.run(2, max_iter=5, on_error="continue")
            with pytest.raises(EpisodeError, match="failed after 2 steps"):
                await runner.run(2, max_iter=5)
        assert [r.nb_time_step for r in await runner.run(1, max_iter=2)] == [2]  # it goes on
    assert len(results) == 2
    for result in results:
        error = result.error
        assert error is not None
        assert error.error_type == getattr(agent, "RAISES", SystemExit).__name__
        assert error.message == "solver: license not found" and error.step == 2


@dataclasses.dataclass(frozen=True)
class FrozenError(Exception):
    """An exception that takes no new attribute."""

    code: int


class StrFails(Exception):
    def __str__(self) -> str:
        raise KeyError("reason")


class FailsOddly(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Raises at step 3 an exception made by ``make``."""

    make: ClassVar[Any] = FrozenError

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if observation.current_step == 2:
            raise type(self).make(7)
        return self.action_space({})


class FailsWithBadStr(FailsOddly):
    make = StrFails


@pytest.mark.parametrize(
    ("agent", "message"),
    [(FailsOddly, "7"), (FailsWithBadStr, "<exception str() failed>")],
)
async def test_an_odd_exception_is_reported_as_raised(env: Any, agent: Any, message: str) -> None:
    """A frozen exception was reported as asyncrunner's FrozenInstanceError (the worker set an
    attribute on it); one whose ``__str__`` fails, as a worker's death at step 0 without its
    traceback."""
    async with AsyncRunner(env, agent=agent, workers=1) as runner:
        (result,) = await runner.run(1, max_iter=5, on_error="continue")
    error = result.error
    assert error is not None
    assert (error.error_type, error.message, error.step, error.steps_lost) == (
        agent.make.__name__,
        message,
        2,
        False,
    )
    assert "in act" in error.traceback


async def test_agent_error_raise_carries_finished_results(env: Any, tmp_path: Any) -> None:
    async with AsyncRunner(env, agent=FailsAtStep5, workers=1) as runner:
        with pytest.raises(EpisodeError, match="agent broke at step 5") as info:
            await runner.run(**KWARGS, path_save=tmp_path / "saved", add_detailed_output=True)
    assert info.value.failure.index == 1
    assert [r.index for r in info.value.results] == [0]  # one worker: episode 2 never started
    assert info.value.results[0].nb_time_step == 20
    assert info.value.results[0].episode_data is not None
    # A run in a process pool (or a Dask task) raises it in its caller: it pickles (it did not:
    # the pool broke), with what it carries, but grid2op's EpisodeData: its objects' classes are
    # made at run time, and another process cannot load them (the pool broke again).
    # The failed episode's own result: its chronic, seeds and the steps played.
    failed = info.value.result
    assert failed is not None and failed.error == info.value.failure
    assert (failed.index, failed.name, failed.nb_time_step) == (1, "0001", 4)
    assert (failed.env_seed, failed.agent_seed) == (2, 12)
    again = pickle.loads(pickle.dumps(info.value))
    assert (str(again), again.failure, again.results, again.result) == (
        str(info.value),
        info.value.failure,
        info.value.results,
        failed,
    )
    sink_error = pickle.loads(pickle.dumps(SinkError("a sink failed", info.value.results, Sink)))
    assert (str(sink_error), sink_error.results) == ("a sink failed", info.value.results)
    for error in (info.value, sink_error):
        (tmp_path / "error").write_bytes(pickle.dumps(error))
        loaded = run_code(
            "import pickle; e = pickle.load(open('error', 'rb')); "
            "print(type(e).__name__, [(r.nb_time_step, r.episode_data) for r in e.results])".replace(
                "'error'", repr(str(tmp_path / "error"))
            )
        )
        assert loaded.stdout.split("\n")[-2:] == [f"{type(error).__name__} [(20, None)]", ""], (
            loaded.stderr
        )


class NoWeights(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
    def __init__(self, action_space: Any) -> None:
        raise FileNotFoundError("no weights file")


async def test_an_episode_failing_before_it_starts_names_the_chronic_it_was_to_play(
    env: Any,
) -> None:
    """An agent that cannot be made fails each episode before its env is reset: the result
    still says which chronic (by position or by name), and its seeds."""
    async with AsyncRunner(env, agent=NoWeights, workers=1) as runner:
        results = await runner.run(
            3, max_iter=5, episode_id=[2, "0000", 1], agent_seeds=[4, 5, 6], on_error="continue"
        )
        assert [(r.name, r.agent_seed, r.nb_time_step, r.ok) for r in results] == [
            ("0002", 4, 0, False),
            ("0000", 5, 0, False),
            ("0001", 6, 0, False),
        ]
        with pytest.raises(EpisodeError, match="no weights file") as info:
            await runner.run(2, max_iter=5)
    assert info.value.results == []
    assert info.value.result is not None and info.value.result.name == "0000"


async def test_killed_worker_is_replaced_and_episode_retried(env: Any) -> None:
    before = children()
    kwargs = dict(KWARGS, max_iter=300)
    events: list[Any] = []
    killed: list[int] = []

    def kill_mid_episode(event: Any) -> None:
        events.append(event)
        if isinstance(event, StepBatch) and event.index == 1 and not killed:
            pid = next(e.worker for e in events if isinstance(e, EpisodeStarted) and e.index == 1)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        disturbed = await runner.run(**kwargs, sinks=[CallbackSink(kill_mid_episode)])
        undisturbed = await runner.run(**kwargs)
    assert killed
    assert [r.as_tuple() for r in disturbed] == [r.as_tuple() for r in undisturbed]
    failures = [e for e in events if isinstance(e, EpisodeFailed)]
    assert [(f.index, f.attempt, f.retrying) for f in failures] == [(1, 1, True)]
    retried = [e for e in events if isinstance(e, EpisodeStarted) and e.index == 1]
    assert [e.attempt for e in retried] == [1, 2]
    assert retried[1].worker != killed[0]
    await wait_no_children(before)


async def test_a_run_s_retries_override_the_runner_s(env: Any) -> None:
    # AsyncRunner(retries=0) with run(retries=1): the killed worker's episode is played again
    # (a mutation audit found run()'s own retries ignored by no test).
    killed: list[int] = []

    def kill_once(event: Any) -> None:
        if isinstance(event, EpisodeStarted) and not killed:
            os.kill(event.worker, signal.SIGKILL)
            killed.append(event.worker)

    async with AsyncRunner(env, agent=DoNothingAgent, workers=1, retries=0) as runner:
        sinks = [CallbackSink(kill_once)]
        (result,) = await runner.run(1, max_iter=5, retries=1, on_error="continue", sinks=sinks)
    assert killed and result.ok and result.nb_time_step == 5


class _PoolOfItsOwn(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
    """Plays with a process pool of its own (forked by its worker, as an agent may to evaluate
    candidates at once), and writes each pool process's pid in ``pids``."""

    pids: ClassVar[str] = ""
    pool: ClassVar[ProcessPoolExecutor | None] = None

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if _PoolOfItsOwn.pool is None:
            _PoolOfItsOwn.pool = ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("fork")
            )
            with open(self.pids, "a") as f:
                f.write(f"{_PoolOfItsOwn.pool.submit(os.getpid).result()}\n")
        time.sleep(0.02)  # (the episode still plays when its first steps reach the test)
        return super().act(observation, reward, done)


async def test_a_worker_killed_from_outside_while_its_agent_has_a_pool_is_replaced(
    env: Any, tmp_path: Any
) -> None:
    # The pool's process held the worker's socket: the worker's death (the OOM killer) went
    # unseen and run() waited for ever; the pool's process then outlived the runner.
    _PoolOfItsOwn.pids = str(tmp_path / "pids")
    killed: list[int] = []

    def kill_mid_episode(event: Any) -> None:
        if isinstance(event, EpisodeStarted) and not killed:
            killed.append(event.worker)
        elif isinstance(event, StepBatch) and len(killed) == 1:
            os.kill(killed[0], signal.SIGKILL)
            killed.append(0)

    async with AsyncRunner(env, agent=_PoolOfItsOwn, workers=1) as runner:
        with anyio.fail_after(60):
            results = await runner.run(
                1, max_iter=30, env_seeds=[0], sinks=[CallbackSink(kill_mid_episode)]
            )
    assert len(killed) == 2
    assert [(r.nb_time_step, r.error) for r in results] == [(30, None)]
    pools = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    assert len(pools) == 2  # the dead worker's agent's, and its replacement's
    await wait_dead(pools)


class _StartsADaemon(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
    """Starts a helper the classic way at its first step (fork, setsid, fork, the middle process
    exits): the helper writes ``done`` 0.3 s later."""

    done: ClassVar[str] = ""
    started: ClassVar[bool] = False

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if not _StartsADaemon.started:
            _StartsADaemon.started = True
            middle = os.fork()
            if middle == 0:
                os.setsid()
                if os.fork() == 0:
                    time.sleep(0.3)
                    open(self.done, "w").close()
                os._exit(0)
            os.waitpid(middle, 0)
        return super().act(observation, reward, done)


async def test_a_helper_an_agent_daemonises_lives_on_as_in_grid2op(env: Any, tmp_path: Any) -> None:
    # Processes an agent forks end with the worker (above): the helper, whose parent ended at
    # once, was killed with it.
    _StartsADaemon.done = str(tmp_path / "done")
    async with AsyncRunner(env, agent=_StartsADaemon, workers=1) as runner:
        (result,) = await runner.run(1, max_iter=3)
        with anyio.fail_after(10):
            while not await anyio.Path(_StartsADaemon.done).exists():  # noqa: ASYNC110 - another process's file
                await anyio.sleep(0.05)
    assert result.ok


async def test_a_worker_dead_while_idle_is_replaced_before_its_next_episode(env: Any) -> None:
    # Killed between runs (the OOM killer): its next episode must not fail, nor use up a retry,
    # for a death that came before it started.
    async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
        await runner.run(1, max_iter=5)
        [pid] = runner._pids
        os.kill(pid, signal.SIGKILL)
        await wait_dead([pid])
        started, sink = starts()
        results = await runner.run(2, max_iter=5, on_error="continue", retries=0, sinks=[sink])
    assert [(r.error, r.nb_time_step) for r in results] == [(None, 5), (None, 5)]
    assert pid not in {e.worker for e in started}


_TEST_PROCESS = os.getpid()


class LoadsOnlyHere(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
    """An agent instance another process cannot load (its weights' file is not there, say)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        if os.getpid() != _TEST_PROCESS:
            raise FileNotFoundError("weights.pt is not on this worker")
        self.__dict__.update(state)


# Python >= 3.12 warns that forking a multi-threaded process may deadlock: not here.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
async def test_a_recipe_a_worker_cannot_load_fails_the_episode_with_its_traceback(
    env: Any,
) -> None:
    """(As Dask workers with another grid2op or numpy, or without the env's folder, fail.) The
    failure came with no traceback, as steps lost after step 0 of an episode never started."""
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(1, mp_context=context) as executor:
        agent = LoadsOnlyHere(env.action_space)
        async with AsyncRunner(env, agent=agent, workers=1, executor=executor) as runner:
            with pytest.raises(EpisodeError) as caught:
                await runner.run(1, max_iter=3)
    failure = caught.value.failure
    assert failure.error_type == "FileNotFoundError" and not failure.steps_lost
    assert "weights.pt is not on this worker" in failure.message
    assert "__setstate__" in failure.traceback


# Python >= 3.12 warns that forking a multi-threaded process may deadlock: not here.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("recipe", [False, True], ids=["", "readme-sigterm-recipe"])
async def test_a_broken_process_pool_executor_fails_what_is_left_saying_why(
    env: Any, recipe: bool
) -> None:
    """A ProcessPoolExecutor that lost a process fails every call after: nothing can be replayed
    on it (a retry would fail at once, and blame a dead worker for episodes that never ran).
    With the README's recipe for SIGTERM (``loop.add_signal_handler``), the processes the pool
    forked from the loop's thread kept its wakeup fd and asyncio's handler: the SIGTERM the pool
    ends the others with went to this loop, and cancelled the whole run (signals hunt)."""
    if recipe:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        await _kill_a_process_of_the_executor(env)
    finally:
        if recipe:
            loop.remove_signal_handler(signal.SIGTERM)


_IDLE_PROCESSES = """
import asyncio, multiprocessing, os, signal
from concurrent.futures import ProcessPoolExecutor
from grid2op.Agent import DoNothingAgent
from asyncrunner import AsyncRunner, EpisodeStarted, StepBatch
from asyncrunner.sinks import CallbackSink
from tests.conftest import make_env

async def main():
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    events = []

    def kill(event):
        events.append(event)
        if isinstance(event, StepBatch) and event.index == 0 and event.first_step == 1:
            os.kill(next(e.worker for e in events if isinstance(e, EpisodeStarted)), signal.SIGKILL)

    fork = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(4, mp_context=fork) as executor:
        async with AsyncRunner(make_env(), agent=DoNothingAgent, workers=1, executor=executor) as r:
            results = await r.run(2, max_iter=300, on_error="continue", sinks=[CallbackSink(kill)])
    print([r.error.error_type for r in results])

asyncio.run(main())
"""


def test_idle_processes_of_a_broken_executor_leave_the_run_to_end() -> None:
    # As above, with processes that never had a call (4 for 1 worker, forked with the first
    # call's): they kept the loop's wakeup fd and asyncio's handler (review of the fix).
    done = run_code(_IDLE_PROCESSES)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['BrokenProcessPool', 'BrokenProcessPool']"


async def _kill_a_process_of_the_executor(env: Any) -> None:
    events: list[Any] = []

    def kill_mid_episode(event: Any) -> None:
        events.append(event)
        if isinstance(event, StepBatch) and event.index == 1 and event.first_step == 1:
            started = (e for e in events if isinstance(e, EpisodeStarted) and e.index == 1)
            os.kill(next(started).worker, signal.SIGKILL)

    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(2, mp_context=context) as executor:
        async with AsyncRunner(env, agent=DoNothingAgent, workers=2, executor=executor) as runner:
            with anyio.fail_after(120):
                results = await runner.run(
                    **dict(KWARGS, max_iter=300),
                    on_error="continue",
                    sinks=[CallbackSink(kill_mid_episode)],
                )
    failed = [r.error for r in results if r.error is not None]
    assert results[1].error in failed
    for error in failed:
        assert error.error_type == "BrokenProcessPool" and error.attempt == 1
        assert "cannot replace a dead process" in error.message
    assert not any(isinstance(e, EpisodeFailed) and e.retrying for e in events)


class _DiesInItsFirstClose(LightSimBackend):  # type: ignore[misc]  # lightsim2grid is untyped
    """Kills its worker in its first ``close`` there (a solver's teardown crashing): just after
    the worker sent the episode's end. A backend class of the user's: each episode builds (and
    closes) its env, as in grid2op's Runner."""

    parent: ClassVar[int] = 0
    mark: ClassVar[str] = ""

    def close(self) -> None:
        if os.getpid() != self.parent and not os.path.exists(self.mark):
            open(self.mark, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        super().close()


class _OneBatchAStep(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        time.sleep(0.11)  # longer than a batch's age (0.1 s): a StepBatch per step
        return super().act(observation, reward, done)


async def test_a_worker_dying_just_after_an_episodes_end_does_not_replay_it(
    tmp_path: Any,
) -> None:
    # The collector is behind (a sink slow at the first event, its buffer full) when the worker
    # dies after sending the episode's end: the end was in the inbox ahead of the dispatcher's
    # failure. The episode was played again, and run() waited for ever on the replay's end.
    _DiesInItsFirstClose.parent = os.getpid()
    _DiesInItsFirstClose.mark = str(tmp_path / "died")
    seen: list[Any] = []

    def until_the_worker_died() -> None:
        while not os.path.exists(_DiesInItsFirstClose.mark):
            time.sleep(0.05)
        time.sleep(0.5)  # the dispatcher learns of the death meanwhile

    async def slow_at_first(event: Any) -> None:
        seen.append(event)
        if len(seen) == 1:
            await anyio.to_thread.run_sync(until_the_worker_died)

    env = make_env(backend=_DiesInItsFirstClose())
    try:
        async with AsyncRunner(env, agent=_OneBatchAStep, workers=1) as runner:
            with anyio.fail_after(60):
                results = await runner.run(1, max_iter=40, sinks=[CallbackSink(slow_at_first)])
    finally:
        env.close()
    assert await anyio.Path(_DiesInItsFirstClose.mark).exists()  # it died after the episode
    assert [(r.nb_time_step, r.error) for r in results] == [(40, None)]
    ends = [e for e in seen if isinstance(e, EpisodeStarted | EpisodeFinished | EpisodeFailed)]
    assert [(type(e).__name__, e.attempt) for e in ends] == [
        ("EpisodeStarted", 1),
        ("EpisodeFinished", 1),
    ]


async def test_worker_dying_every_time_is_reported_after_retries(env: Any) -> None:
    def kill_every_start(event: Any) -> None:
        if isinstance(event, EpisodeStarted) and event.index == 0:
            os.kill(event.worker, signal.SIGKILL)

    async with AsyncRunner(env, agent=DoNothingAgent, workers=1, retries=1) as runner:
        results = await runner.run(
            2, max_iter=300, on_error="continue", sinks=[CallbackSink(kill_every_start)]
        )
    error = results[0].error
    assert error is not None and error.attempt == 2 and "died" in error.message
    assert results[1].error is None and results[1].nb_time_step == 300


async def test_episode_timeout_stops_a_hanging_agent(env: Any) -> None:
    before = children()
    async with AsyncRunner(env, agent=Hangs, workers=2) as runner:
        with anyio.fail_after(120):
            # The other episodes' 20 steps must fit in it: 0.47 s measured on a busy machine,
            # against the 0.5 s it was.
            results = await runner.run(**KWARGS, episode_timeout=3.0, on_error="continue")
        error = results[1].error
        assert error is not None and error.error_type == "EpisodeTimeout"
        assert error.message.endswith("its worker was stopped")
        assert results[0].nb_time_step == results[2].nb_time_step == 20
    await wait_no_children(before)


class Slow(Hangs):
    """Takes a second per action (the episode whose agent seed is 12)."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        if self.seed_used == 12:
            time.sleep(1.0)
        return self.action_space({})


async def test_episode_timeout_on_an_executor_says_its_task_runs_on(env: Any) -> None:
    # A concurrent.futures executor cannot stop a running call: the episode stops at its next
    # batch of steps (its channel closed), after the agent's call it was in.
    with ThreadPoolExecutor(2) as executor:
        async with AsyncRunner(env, agent=Slow, workers=2, executor=executor) as runner:
            with anyio.fail_after(120):
                # The other episodes' 20 steps must fit in it: up to 0.7 s measured on a busy
                # machine, threads of this process (a 0.3 s timeout failed them there).
                results = await runner.run(**KWARGS, episode_timeout=3.0, on_error="continue")
        error = results[1].error
        assert error is not None and error.error_type == "EpisodeTimeout"
        assert "cannot interrupt a running task: the episode stops at its next batch" in (
            error.message
        )
        assert results[0].nb_time_step == results[2].nb_time_step == 20


@BOTH_LOOPS
@pytest.mark.parametrize("point", ["EpisodeStarted", "StepBatch", "written"])
async def test_cancelling_a_run_stops_workers_and_keeps_finished_episodes(
    env: Any, tmp_path: Any, point: str
) -> None:
    from grid2op.Episode import EpisodeData

    from asyncrunner.sinks import EpisodeDataWriter

    before = children()
    writer = EpisodeDataWriter(tmp_path)
    # "written" on one worker: episode 0 is on disk, episode 1 has most of its steps to play
    # when the run is cancelled, so exactly one episode is saved.
    workers = 1 if point == "written" else 2
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=workers)
    with anyio.CancelScope() as scope:

        def cancel_at_point(event: Any) -> None:
            # "written": the first event after an episode is on disk, another still in flight.
            if type(event).__name__ == point or (point == "written" and writer.paths):
                scope.cancel()

        await runner.run(4, max_iter=200, sinks=[writer, CallbackSink(cancel_at_point)])
    assert scope.cancelled_caught
    await runner.aclose()
    await wait_no_children(before)
    listed = EpisodeData.list_episode(str(tmp_path))
    if point == "written":
        assert listed == [(str(tmp_path), "0000")]
        assert writer.paths == {0: str(tmp_path / "0000")}
    else:
        assert listed == []
    for folder, name in listed:
        assert len(EpisodeData.from_disk(folder, name)) == 200
    # Only complete episode folders remain: nothing half-written beside them.
    leftovers = {p.name for p in tmp_path.iterdir() if p.is_dir()} - {name for _, name in listed}
    assert leftovers == set()


@pytest.mark.parametrize(
    "forked",
    [True, pytest.param(False, marks=pytest.mark.slow)],  # slow: spawns fresh interpreters
    ids=["forked", "anyio.to_process"],
)
async def test_runner_close_leaves_no_worker_process(
    env: Any, forked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without fork (not Linux) local workers are anyio.to_process's fresh interpreters.
    monkeypatch.setattr(asyncrunner._runner, "_FORK", forked)
    before = children()
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        await runner.run(2, max_iter=5)
        assert len(children() - before) == 2
    await wait_no_children(before)


@BOTH_LOOPS
async def test_a_runner_closed_from_inside_its_own_run(env: Any) -> None:
    # A sink or callback of the run closing the runner in a shielded scope (as a sink's own
    # aclose runs): closing waited for the run, which waited for it.
    before = children()
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=2)

    async def close_the_runner(event: Any) -> None:
        if isinstance(event, EpisodeFinished):
            with anyio.CancelScope(shield=True):
                await runner.aclose()

    async with runner:
        with anyio.fail_after(60), pytest.raises(AsyncRunnerError, match="closed while"):
            await runner.run(8, max_iter=5, sinks=[CallbackSink(close_the_runner)])
    await wait_no_children(before)


@BOTH_LOOPS
async def test_a_runner_closed_from_inside_one_run_waits_for_the_others(env: Any) -> None:
    # Closed from a callback of run A, it waited for no run: run B (another task's, its agent
    # stuck in act) still played as the close returned, its worker alive.
    runner = AsyncRunner(env, agent=Hangs, workers=2)
    log: list[str] = []
    b_plays = anyio.Event()

    async def on_b(event: Any) -> None:
        if isinstance(event, EpisodeStarted):
            b_plays.set()

    async def on_a(event: Any) -> None:
        if isinstance(event, EpisodeStarted):
            await b_plays.wait()
            with anyio.CancelScope(shield=True):
                await runner.aclose()
            log.append("closed")

    async def play(name: str, seed: int, on: Any) -> None:
        with pytest.raises(AsyncRunnerError, match="closed while"):
            await runner.run(1, max_iter=10, agent_seeds=[seed], sinks=[CallbackSink(on)])
        log.append(name)

    async with runner:
        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                group.start_soon(play, "B", 12, on_b)  # hangs in act
                group.start_soon(play, "A", 1, on_a)
    assert log == ["B", "closed", "A"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # unclosed: says so
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def holders(key: str) -> int:
    """How many holds this process has on recipe ``key``'s env (other tests' runners too)."""
    return _envs._HELD.get(key, (None, 0))[1]


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # what a runner left unclosed holds
@pytest.mark.parametrize("closed", [False, True], ids=["dropped", "closed"])
async def test_a_runner_dropped_unclosed_leaves_no_worker_nor_hold_once_collected(
    env: Any, closed: bool
) -> None:
    # The fork thread kept its last call's result (a worker) until its next call: that worker
    # outlived a runner dropped without closing it. The env it held for its workers stayed held
    # (and this process's objects frozen out of its collections) for the process's life. Let go
    # (by the next hold, or closed), the env was then frozen with the rest by the next opening,
    # for good (in a service: 1.25 MiB more per runner dropped, 0.4 per runner closed).
    before = children()
    runner = AsyncRunner(env, agent=Fresh, workers=2)
    key = runner._recipe_key
    await runner.__aenter__()
    await runner.run(2, max_iter=5)
    assert len(children() - before) == 2 and holders(key) == 1
    # Its env's parts in cycles (pandas' frames, in thousands), as this one:
    in_a_cycle = _Cycle()
    _envs._HELD[key][0].pristine.in_a_cycle = in_a_cycle
    its_part = weakref.ref(in_a_cycle)
    gc.collect()  # (among the oldest objects, as a service's long-lived ones are)
    if closed:
        await runner.aclose()
    del runner, in_a_cycle
    if not closed:
        gc.collect()  # (the runner, in cycles itself)
    await wait_no_children(before)
    async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as another:
        assert holders(key) == 0  # (its opening's hold let the collected runner's go)
        gc.collect()
        assert its_part() is None  # (not frozen out of the collections)
        await another.run(1, max_iter=3)
    gc.collect()  # its parts, no longer frozen out of the collections: here, not in a later test


def _slow_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Holding an env takes 0.3 s more (a big grid's build)."""

    def slow_hold(*args: Any) -> bool:
        held = _envs.hold(*args)
        time.sleep(0.3)  # still holding when the cancel or the close comes
        return held

    monkeypatch.setattr(asyncrunner._runner, "hold", slow_hold)


class Fresh(DoNothingAgent):  # type: ignore[misc]  # a recipe of its own in this module
    pass


async def cancel_opening(runner: AsyncRunner, times: int) -> None:
    """Open ``runner`` in a task that asyncio's own ``task.cancel()`` cancels ``times`` times,
    0.05 s apart (while its env is held: ``_slow_hold``)."""
    opening = asyncio.ensure_future(runner.__aenter__())
    for _ in range(times):
        await asyncio.sleep(0.05)
        opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening


@pytest.mark.parametrize(
    "meanwhile", ["closed", "opened again", "cancelled twice"], ids=lambda m: m.replace(" ", "_")
)
# Two openings at once leave the first warm-up's streams to the collector (not the env held).
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_hold_under_way_is_let_go_whatever_happens_meanwhile(
    env: Any, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    # The runner closed as it opens, opened twice at once, or its opening cancelled twice (a
    # timeout, then its caller): the env held for its workers stayed held and this process's
    # objects frozen out of its collections, for good.
    _slow_hold(monkeypatch)
    before = children()
    runner = AsyncRunner(env, agent=Fresh, workers=2)
    key = runner._recipe_key
    if meanwhile == "closed":
        opening = asyncio.ensure_future(runner.__aenter__())
        await asyncio.sleep(0.05)
        await runner.aclose()
        with pytest.raises(AsyncRunnerError, match="closed"):
            await opening
    elif meanwhile == "opened again":
        await asyncio.gather(runner.__aenter__(), runner.__aenter__())
        assert holders(key) == 1
        await runner.aclose()
    else:
        await cancel_opening(runner, times=2)
        with anyio.fail_after(60):  # the hold's thread ends, and lets the env go
            while holders(key) or _envs._FROZEN:  # noqa: ASYNC110  # a thread's, no event
                await anyio.sleep(0.05)
    assert holders(key) == 0 and not _envs._FROZEN
    await wait_no_children(before)
    gc.collect()  # what the filter lets go, collected here


@BOTH_LOOPS
async def test_an_interrupted_opening_stops_its_workers_and_lets_its_env_go(
    env: Any, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A notebook's stop button as ``async with AsyncRunner(...)`` opens: ``async with`` calls no
    # ``__aexit__`` when ``__aenter__`` fails, and the env held for the opening's workers stayed
    # held, with this process's objects frozen out of its collections, for good (asyncio's own
    # cancel, ``task.cancel()``, also went through the shield around the hold's thread).
    _slow_hold(monkeypatch)
    before = children()
    runner = AsyncRunner(env, agent=Fresh, workers=2)
    key = runner._recipe_key
    if anyio_backend == "asyncio":
        await cancel_opening(runner, times=1)
    else:
        with anyio.move_on_after(0.05) as scope:
            await runner.__aenter__()
        assert scope.cancelled_caught
    assert holders(key) == 0 and not _envs._FROZEN
    await wait_no_children(before)
    monkeypatch.undo()
    async with runner:  # a new opening starts afresh
        [result] = await runner.run(1, max_iter=3)
    assert result.nb_time_step == 3 and holders(key) == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # (trio's cancel keeps to the shield)
async def test_an_opening_cancelled_before_its_hold_started_ends(env: Any) -> None:
    # `asyncio.timeout(0.005)` around `async with AsyncRunner(...)`, a web client gone: asyncio's
    # cancel went through the shield before a thread took the hold's call, which anyio then
    # never ran, and the opening's cleanup waited for its end for ever. Cancelled here as soon
    # as the hold's call is handed to a thread (this thread keeps the GIL until then).
    for _ in range(3):
        runner = AsyncRunner(env, agent=Fresh, workers=2)
        opening = asyncio.ensure_future(runner.__aenter__())
        while runner._holding is None:  # noqa: ASYNC110  (set in the opening: no event)
            await asyncio.sleep(0)
        opening.cancel()
        ended = (await asyncio.wait({opening}, timeout=20))[0]
        if not ended:  # (unstuck, to end the test)
            runner._holding.set()
        assert ended, "the cancelled opening never ended"
        assert opening.cancelled()
        assert holders(runner._recipe_key) == 0 and not _envs._FROZEN
    async with runner:  # a new opening starts afresh
        [result] = await runner.run(1, max_iter=3)
    assert result.nb_time_step == 3


@BOTH_LOOPS
async def test_runners_opened_in_one_task_close_in_the_order_opened(env: Any) -> None:
    first = AsyncRunner(env, agent=DoNothingAgent, workers=1)
    second = AsyncRunner(env, agent=DoNothingAgent, workers=1)
    await first.__aenter__()
    await second.__aenter__()
    await first.run(1, max_iter=5)
    await first.aclose()
    assert first._pids and not any(alive(pid) for pid in first._pids)
    # The task goes on (it was left cancelled), with the other runner's workers alive.
    [result] = await second.run(1, max_iter=5)
    assert result.error is None and all(alive(pid) for pid in second._pids)
    await second.aclose()
    assert not any(alive(pid) for pid in second._pids)


@BOTH_LOOPS
async def test_a_runner_opened_in_one_task_closes_in_another(env: Any) -> None:
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=1)
    async with anyio.create_task_group() as group:  # a startup hook's task
        group.start_soon(runner.__aenter__)
    [result] = await runner.run(1, max_iter=5)
    assert result.error is None
    await runner.aclose()
    assert runner._pids and not any(alive(pid) for pid in runner._pids)


def one_saved(folder: str) -> None:
    deadline = time.monotonic() + 60
    while not EpisodeData.list_episode(folder):
        assert time.monotonic() < deadline, "no episode saved in 60 s"
        time.sleep(0.01)


@BOTH_LOOPS
@pytest.mark.parametrize("closer", ["caller", "sink"])
async def test_closing_a_runner_mid_run_keeps_each_episode_the_sinks_were_told_finished(
    env: Any, tmp_path: Any, closer: str
) -> None:
    # aclose() cancelled the whole run, its sinks with it: the writer lost the episode that had
    # just finished, which the other sinks had been told of (and the error says it is saved).
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=2)
    finished: list[int] = []
    told = anyio.Event()
    kept: set[int] = set()

    class Posts(Sink):  # a sink sending each end to a server (trio's writer is in its thread)
        async def send(self, event: Event) -> None:
            if isinstance(event, EpisodeFinished):
                await anyio.sleep(0.2)
                kept.add(event.index)

    async def on(event: Event) -> None:
        if isinstance(event, EpisodeFinished):
            finished.append(event.index)
            told.set()
            if closer == "sink":
                await runner.aclose()

    async def play() -> None:
        with pytest.raises(AsyncRunnerError, match="closed while this run played"):
            await runner.run(4, max_iter=30, path_save=tmp_path, sinks=[CallbackSink(on), Posts()])

    await runner.__aenter__()
    async with anyio.create_task_group() as group:
        group.start_soon(play)
        await told.wait()
        await runner.aclose()
    saved = {
        json.loads((p / "asyncrunner.json").read_text())["index"]
        for p in tmp_path.iterdir()
        if (p / "asyncrunner.json").is_file()
    }
    assert finished and saved >= set(finished) and kept >= set(finished)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


class _Hangs(Sink):
    """Its ``send`` of an episode's end, or its ``aclose``, never returns (a server down)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __repr__(self) -> str:
        return f"<Hangs in {self.where}>"

    async def send(self, event: Event) -> None:
        if self.where == "send" and isinstance(event, EpisodeFinished):
            await anyio.sleep_forever()

    async def aclose(self) -> None:
        if self.where == "close":
            await anyio.sleep_forever()


@BOTH_LOOPS
@pytest.mark.parametrize("where", ["send", "close"])
async def test_closing_a_runner_names_the_sink_its_grace_cut_short(
    env: Any, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # A sink still at work when a closing runner's grace ended was cut short unsaid: the error
    # told the caller that every episode the run finished was saved.
    monkeypatch.setattr(_dispatch, "SINK_DRAIN_GRACE", 0.5)
    ended = anyio.Event()

    def on(event: Event) -> None:
        if isinstance(event, EpisodeFinished):
            ended.set()

    runner = AsyncRunner(env, agent=DoNothingAgent, workers=2)

    async def play() -> None:
        with pytest.raises(AsyncRunnerError, match="closed while this run played") as info:
            await runner.run(4, max_iter=30, sinks=[CallbackSink(on), _Hangs(where)])
        told = str(info.value)
        assert f"<Hangs in {where}> was cut short 0.5 s after" in told, told

    await runner.__aenter__()
    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            group.start_soon(play)
            await ended.wait()
            await runner.aclose()


@BOTH_LOOPS
async def test_closing_a_runner_whose_stream_reader_lags_after_the_run_is_prompt(env: Any) -> None:
    # Once the sinks were done, the run waited to hand the stream its RunFinished (the reader's
    # buffer full), and aclose() waited the sinks' 30 s grace for it.
    done = anyio.Event()

    def on(event: Event) -> None:
        if isinstance(event, RunFinished):
            done.set()

    runner = AsyncRunner(env, agent=DoNothingAgent, workers=1)
    await runner.__aenter__()
    with pytest.raises(AsyncRunnerError, match="closed while this run played"):
        async with runner.stream(12, max_iter=3, sinks=[CallbackSink(on)]) as events:
            while not done.is_set():  # a reader slower than the run: it ends waiting for it
                await anext(events)
                await anyio.sleep(0.1)
            with anyio.fail_after(10):
                await runner.aclose()


_FORKED_EXIT = """
import asyncio, glob, os, sys, time
import grid2op
from grid2op.Agent import DoNothingAgent
from lightsim2grid import LightSimBackend
from asyncrunner import AsyncRunner

class Slow(DoNothingAgent):
    def act(self, observation, reward, done=False):
        time.sleep(0.05)
        return super().act(observation, reward, done)

pid = os.fork()  # a preforking server's worker, forked after the import
if pid == 0:
    env = grid2op.make("l2rpn_case14_sandbox", test=True, backend=LightSimBackend())
    runner = AsyncRunner(env, agent=Slow, workers=2)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.__aenter__())
    loop.run_until_complete(runner.run(2, max_iter=3))
    loop.create_task(runner.run(4, max_iter=60, path_save=SAVE))
    loop.run_until_complete(asyncio.sleep(1))
    print(len(glob.glob(os.path.join(SAVE, ".asyncrunner-tmp-*"))), flush=True)
    sys.exit(0)  # its loop stopped with the run going, as quit() in a Jupyter cell
os.waitpid(pid, 0)
"""


def test_a_forked_process_exiting_with_a_run_going_removes_its_work_in_progress(
    tmp_path: Any,
) -> None:
    # (The exit's cleanup in the notebook test; a fork of the process that imported asyncrunner
    # took its parent's pid for the owner's and removed nothing.)
    done = run_code(_FORKED_EXIT.replace("SAVE", repr(str(tmp_path))))
    assert done.returncode == 0 and done.stdout.split() == ["1"], done.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@BOTH_LOOPS
async def test_closing_a_runner_stops_the_runs_playing_on_it(env: Any, tmp_path: Any) -> None:
    # A service closing (or replacing) its runner while another task's run plays: aclose
    # returned at once, the run went on to its end, and its workers outlived the runner.
    before = children()
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=2)

    async def play() -> None:
        with pytest.raises(AsyncRunnerError, match="closed while this run played"):
            await runner.run(40, max_iter=5, path_save=tmp_path)

    await runner.__aenter__()
    async with anyio.create_task_group() as group:
        group.start_soon(play)
        await anyio.to_thread.run_sync(one_saved, str(tmp_path))
        await runner.aclose()
        assert not any(alive(pid) for pid in runner._pids)
    assert children() - before == set()
    # What finished is saved complete; a new runner plays the rest (resume).
    done = len(EpisodeData.list_episode(str(tmp_path)))
    assert 1 <= done < 40
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as again:
        results = await again.run(40, max_iter=5, path_save=tmp_path, resume=True)
    assert [r.nb_time_step for r in results] == [5] * 40


@BOTH_LOOPS
async def test_a_second_close_returns_once_the_first_has(env: Any) -> None:
    # A web app's shutdown and its own cleanup both closing the runner: the second aclose()
    # returned at once while the first still stopped the run and the workers, and its caller
    # went on (a new runner, the process's exit) with them alive.
    before = children()
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=2)
    playing = anyio.Event()

    def note(event: Any) -> None:
        if isinstance(event, EpisodeStarted):
            playing.set()

    async def play() -> None:
        with pytest.raises(AsyncRunnerError, match="closed while this run played"):
            await runner.run(40, max_iter=5, sinks=[CallbackSink(note)])

    await runner.__aenter__()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(play)
            await playing.wait()
            group.start_soon(runner.aclose)
            while not runner._closed:  # (the first close has begun)
                await anyio.lowlevel.checkpoint()
            await runner.aclose()
            assert not any(alive(pid) for pid in runner._pids)
    assert children() - before == set()


@BOTH_LOOPS
async def test_channel_rejects_strangers() -> None:
    from asyncrunner._engine._channel import frame, open_channel

    async with open_channel() as channel:
        # A stranger with a wrong token: closed before anything it sends is unpickled.
        async with await anyio.connect_unix(channel.address) as stream:
            await stream.send(frame(b"not-the-token 1"))
            await stream.send(frame(b"\x80\x05junk"))
            with anyio.fail_after(5), pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                await stream.receive()  # the runner hung up on it
        assert channel.rejected == 1
        # A worker with the token gets through.
        async with await anyio.connect_unix(channel.address) as stream:
            await stream.send(frame(f"{channel.token} {os.getpid()}".encode()))
            await stream.send(frame(pickle.dumps({"hello": "runner"})))
            with anyio.fail_after(5):
                assert await channel.receive.receive() == {"hello": "runner"}
        assert channel.rejected == 1
        assert os.getpid() in channel.pids
        assert os.stat(os.path.dirname(channel.address)).st_mode & 0o077 == 0  # private folder


async def test_unusable_path_save_is_rejected_before_work(env: Any, tmp_path: Any) -> None:
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    runner = AsyncRunner(env, agent=DoNothingAgent, workers=1)
    with pytest.raises(ValueError, match="is a file"):
        await runner.run(1, path_save=a_file)
    with pytest.raises(ValueError, match="cannot be created"):
        await runner.run(1, path_save=a_file / "sub")
    # A link to a scratch disk not mounted: it said "cannot be created (File exists)".
    (tmp_path / "scratch").symlink_to(tmp_path / "not-mounted" / "runs")
    with pytest.raises(ValueError, match=r"is a link to .*not-mounted/runs', which is not there"):
        await runner.run(1, path_save=tmp_path / "scratch")
    told = r"scratch/exp1' cannot be created: .*scratch' is a link to .*runs', which is not there"
    with pytest.raises(ValueError, match=told):
        await runner.run(1, path_save=tmp_path / "scratch" / "exp1")
    assert runner._pids == set()
    await runner.aclose()


ORPHANS = """
import os, signal, sys, time, warnings
import anyio, grid2op
from grid2op.Agent import DoNothingAgent
from asyncrunner import AsyncRunner, EpisodeStarted
from asyncrunner.sinks import CallbackSink

class Busy(DoNothingAgent):
    def act(self, observation, reward, done=False):
        time.sleep(600)  # a slow or hung agent (a remote model, an endless loop)

async def main(busy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = grid2op.make("l2rpn_case14_sandbox", test=True)
    runner = AsyncRunner(env, agent=Busy if busy else DoNothingAgent, workers=2)
    if not busy:
        await runner.run(2, max_iter=2)
    else:  # both workers in act(), one of them stopped
        started = anyio.Event()
        seen = CallbackSink(lambda e: isinstance(e, EpisodeStarted) and e.index == 1 and started.set())
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: runner.run(2, max_iter=2, sinks=[seen]))
            await started.wait()
            await anyio.sleep(0.5)
            os.kill(min(runner._pool.pids), signal.SIGSTOP)
            print(*runner._pool.pids, flush=True)
            os._exit(0)  # dies in the middle of the run
    print(*runner._pool.pids, flush=True)
    os._exit(0)  # dies without closing the runner

anyio.run(main, sys.argv[1] == "busy")
"""


@pytest.mark.slow  # a Python subprocess that builds an env and forks its own workers
@pytest.mark.parametrize("workers", ["idle", "busy"])
async def test_forked_workers_exit_when_their_parent_dies(tmp_path: Any, workers: str) -> None:
    # Busy workers (an agent in act(), a worker stopped) outlived their parent: they only saw
    # it gone when they next wrote to it, which a hung agent never does.
    script, out = tmp_path / "orphans.py", tmp_path / "pids"
    script.write_text(ORPHANS)
    command = [sys.executable, str(script), workers]
    with anyio.fail_after(120), out.open("w") as stdout:  # (files: orphans hold them open)
        await anyio.run_process(command, stdout=stdout, stderr=subprocess.DEVNULL, check=True)
    pids = [int(p) for p in out.read_text().split()]
    assert len(pids) == 2
    try:
        await wait_dead(pids)
    finally:
        for pid in pids:  # (the old code's orphans)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


LEFT_OPEN = """
import asyncio
import grid2op
from grid2op.Agent import DoNothingAgent
from lightsim2grid import LightSimBackend
from asyncrunner import AsyncRunner

async def main():
    # never closed: a script's habit
    env = grid2op.make("l2rpn_case14_sandbox", test=True, backend=LightSimBackend())
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        results = await runner.run(2, max_iter=3)
    print(sum(r.nb_time_step for r in results))

asyncio.run(main())
"""


@pytest.mark.slow  # a fresh interpreter, ended as a script ends
def test_a_script_that_leaves_its_env_open_ends_without_a_traceback(tmp_path: Any) -> None:
    # Its env is collected as the interpreter ends; holding envs for the forked workers had
    # reordered the collector's objects, and grid2op's BaseEnv.__del__ then printed "Exception
    # ignored ... is closed already" after every such script.
    script = tmp_path / "left_open.py"
    script.write_text(LEFT_OPEN)
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["6"]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


CTRL_C_TWICE = """
import asyncio, os, sys, time
import grid2op
from grid2op.Agent import BaseAgent
from lightsim2grid import LightSimBackend
from asyncrunner import AsyncRunner


class Slow(BaseAgent):
    def act(self, observation, reward, done=False):
        time.sleep(0.01)
        return self.action_space({})


async def main():
    env = grid2op.make("l2rpn_case14_sandbox", test=True, backend=LightSimBackend())
    async with AsyncRunner(env, agent=Slow, workers=2) as runner:
        await runner.run(6, max_iter=80, path_save=sys.argv[1])


try:
    asyncio.run(main())
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)  # (anyio's worker threads, which asyncio's cut-short shutdown left, wait)
"""


@pytest.mark.slow  # fresh interpreters, Ctrl-C'd twice
def test_ctrl_c_twice_in_a_script_blames_no_sink(tmp_path: Any) -> None:
    # The second Ctrl-C makes asyncio.run cancel every task itself, in the middle of the run's
    # stop: the sinks, cancelled by no scope of the run, were said to have "cancelled their own
    # task" (SinkError, printed as an unhandled exception during asyncio.run's shutdown; a hunt:
    # 6 runs in 6, depending on where the stop stood when the second Ctrl-C came).
    script = tmp_path / "twice.py"
    script.write_text(CTRL_C_TWICE)
    for trial in range(3):
        runs = tmp_path / f"runs{trial}"
        proc = subprocess.Popen(
            [sys.executable, "-W", "ignore", str(script), str(runs)], text=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not (runs.is_dir() and any(p.name.startswith(".") for p in runs.iterdir())):
                assert proc.poll() is None and time.monotonic() < deadline, "never started"
                time.sleep(0.01)
            time.sleep(0.5)  # episodes playing
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, Ctrl-C (the terminal's process group)
            time.sleep(0.002)
            os.killpg(proc.pid, signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:  # pragma: no cover - only when the test failed
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        assert proc.returncode == 130 and "interrupted" in err, err
        assert "SinkError" not in err and "unhandled exception" not in err, err


IMPORTS_SCRIPT = '''
import asyncio, json, os, sys, warnings
import grid2op
from grid2op.Agent import BaseAgent
from asyncrunner import AsyncRunner

OUT = sys.argv[1]


class Snapshot(BaseAgent):
    """Writes the modules its worker holds when an episode starts (before its reset)."""

    def __init__(self, action_space):
        super().__init__(action_space)
        with open(OUT, "a") as f:
            f.write(json.dumps(sorted(sys.modules)) + "\\n")

    def act(self, obs, reward, done=False):
        return self.action_space({})


async def main():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = grid2op.make("l2rpn_case14_sandbox", test=True)
    async with AsyncRunner(env, agent=Snapshot, workers=1) as runner:
        await runner.run(nb_episode=2, max_iter=5, path_save=os.path.dirname(OUT) + "/saved")


asyncio.run(main())
'''


@pytest.mark.slow  # a fresh interpreter: what a user's script has imported before its workers fork
def test_a_forked_worker_imports_nothing_while_it_plays_and_saves(tmp_path: Any) -> None:
    """A module a worker imports on first use may be half-imported by a thread of the parent at
    the fork, its import lock held by a thread the child does not have: the child would wait
    forever. From its first episode's start to its second's (its first reset, steps, saving), a
    worker imports nothing."""
    script, out = tmp_path / "script.py", tmp_path / "modules.jsonl"
    script.write_text(IMPORTS_SCRIPT)
    done = run_script(script, str(out))
    assert done.returncode == 0, done.stderr
    first, second = (set(json.loads(line)) for line in out.read_text().splitlines())
    assert (tmp_path / "saved").is_dir()
    assert sorted(second - first) == []


class CancelledOnItsOwn(Sink):
    """Raises a cancellation no scope asked for on its first step batch: it awaited a future
    someone else cancelled (a client shut down), or cancelled its own task."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __repr__(self) -> str:
        return "<CancelledOnItsOwn>"

    async def send(self, event: Event) -> None:
        if isinstance(event, StepBatch):
            if self.how == "future":
                future = asyncio.get_running_loop().create_future()
                future.cancel()
                await future
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            if self.how == "task":
                await asyncio.sleep(0)  # (else the cancellation lands as it takes the next event)


@pytest.mark.parametrize("how", ["future", "task", "task, returning"])
async def test_a_sinks_own_cancellation_is_its_failure_not_the_runs_end(
    env: Any, tmp_path: Any, how: str
) -> None:
    # It ended the sink's task as cancelled, which ended the run's task group without an
    # error: run() returned 1 result of 4, as if the run were over.
    async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
        sinks = [CancelledOnItsOwn(how)]
        with anyio.fail_after(120), pytest.raises(SinkError, match=r"StepBatch: Cancel|own task"):
            await runner.run(4, max_iter=20, path_save=tmp_path, sinks=sinks)
        assert len(await runner.run(2, max_iter=3)) == 2  # the runner goes on


async def test_a_sinks_own_cancellation_in_a_task_cancelled_before_is_its_failure(
    env: Any, tmp_path: Any
) -> None:
    # A task whose earlier cancel was swallowed (``task.cancel()`` to cut a sleep short) has
    # ``cancelling()`` 1 for good: the run took that for its own stop and a sink's cancellation
    # for asyncio's, and returned 1 result of 4 without an error (a review).
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(5)
    try:
        async with AsyncRunner(env, agent=DoNothingAgent, workers=1) as runner:
            sinks = [CancelledOnItsOwn("task")]
            with anyio.fail_after(120), pytest.raises(SinkError, match="StepBatch: Cancel"):
                await runner.run(4, max_iter=20, sinks=sinks)
    finally:
        task.uncancel()


class SlowSteps(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
    calls = 0  # in this process (a thread executor's)

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        SlowSteps.calls += 1
        time.sleep(0.05)  # a 575-step episode: about 30 s
        return super().act(observation, reward, done)


async def test_an_executors_episode_stops_though_a_process_forked_during_its_run(
    env: Any, tmp_path: Any
) -> None:
    # Another runner's worker, forked while the run played, held a copy of the run's channel
    # connections: cancelled, the executor's episode never saw its connection close and kept
    # the executor's thread (blocked for good on a full socket) until that worker ended.
    executor = ThreadPoolExecutor(1)
    started = anyio.Event()
    sink = CallbackSink(lambda e: started.set() if isinstance(e, EpisodeStarted) else None)
    try:
        other = AsyncRunner(env, agent=DoNothingAgent, workers=1)
        async with AsyncRunner(env, agent=SlowSteps, workers=1, executor=executor) as first:
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: first.run(1, path_save=tmp_path, sinks=[sink]))
                with anyio.fail_after(120):
                    await started.wait()
                await other.__aenter__()
                await other.run(1, max_iter=1)  # its worker is forked during the run
                group.cancel_scope.cancel()
        try:
            free = executor.submit(os.getpid)
            await anyio.to_thread.run_sync(free.result, 20)  # (TimeoutError before)
        finally:
            await other.aclose()
    finally:
        executor.shutdown(cancel_futures=True)


async def test_an_executor_shut_down_is_named_and_no_step_is_said_lost(env: Any) -> None:
    # A bare "cannot schedule new futures after shutdown", after "the last step received from
    # its worker; steps played after it were not received" (none was played).
    executor = ThreadPoolExecutor(1)
    executor.shutdown()
    async with AsyncRunner(env, agent=DoNothingAgent, workers=1, executor=executor) as runner:
        with anyio.fail_after(60):
            results = await runner.run(1, max_iter=2, on_error="continue")
    error = results[0].error
    assert error is not None and error.error_type == "RuntimeError"
    assert "the executor given to AsyncRunner was shut down (executor.shutdown())" in error.message
    assert not error.steps_lost


async def test_an_executors_timed_out_episode_stops_at_its_next_batch(env: Any) -> None:
    # Future.cancel() cannot stop a running call: the episode played to its end (575 steps,
    # 30 s here), holding the executor's worker, the next episode waiting behind it.
    executor = ThreadPoolExecutor(1)
    SlowSteps.calls = 0
    try:
        async with AsyncRunner(env, agent=SlowSteps, workers=1, executor=executor) as runner:
            with anyio.fail_after(180):
                results = await runner.run(2, episode_timeout=0.5, on_error="continue")
        assert [r.error.error_type if r.error else None for r in results] == ["EpisodeTimeout"] * 2
        assert SlowSteps.calls < 575  # the first one stopped before the second began
    finally:
        executor.shutdown(cancel_futures=True)


async def test_an_executor_threads_next_episode_plays_after_its_last_was_dropped(
    env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Episode 0's call still cleaning up when its timeout fired: its connection was dropped.
    # Episode 1, next on that thread, claimed on a new connection but sent on the closed one
    # ("Bad file descriptor": failed as a lost worker; found by review).
    from asyncrunner._engine import _worker

    discard = _envs.discard

    def slow_discard(key: Any) -> Any:
        time.sleep(1.5)  # a slow env close after the episode's last event was sent
        return discard(key)

    monkeypatch.setattr(_worker, "discard", slow_discard)
    executor = ThreadPoolExecutor(1)
    try:
        async with AsyncRunner(env, agent=DoNothingAgent, workers=1, executor=executor) as runner:
            with anyio.fail_after(120):
                results = await runner.run(
                    2, max_iter=5, episode_timeout=1.0, on_error="continue", retries=0
                )
        assert [(r.nb_time_step, r.error) for r in results] == [(5, None), (5, None)]
    finally:
        executor.shutdown(cancel_futures=True)
