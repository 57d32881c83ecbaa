"""Agents in the orchestrator (CentralAgent): parity with in-worker agents, async and batched agents."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest
from grid2op.Agent import BaseAgent, DoNothingAgent, RandomAgent

from asyncrunner import AsyncRunner, CentralAgent, StepBatch
from asyncrunner.sinks import CallbackSink

from .conftest import LightSimBackend, make_env
from .helpers import children, run_code, wait_no_children

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[1]
KWARGS: dict[str, Any] = dict(
    nb_episode=4,
    max_iter=30,
    env_seeds=[1, 2, 3, 4],
    agent_seeds=[11, 12, 13, 14],
    episode_id=[0, 1, 2, 0],
)


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The agent runs on the orchestrator's loop: both loops."""
    return str(request.param)


class MLPAgent(BaseAgent):  # type: ignore[misc]
    """A fixed-weight MLP over ``obs.to_vect()`` picking one of a few topology actions.

    Deterministic and stateless (weights drawn from a fixed seed), so one instance may serve
    every episode; ``choices`` records the picks made in this process.
    """

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        topologies = action_space.get_all_unitary_topologies_set(action_space, sub_id=1)
        self.actions = [action_space({}), *topologies[:7]]
        self.w1 = self.w2 = np.empty(0)
        self.choices: list[int] = []

    def _pick(self, x: np.ndarray) -> list[int]:
        if self.w1.size == 0:  # weights from a fixed seed, sized on the first observation
            rng = np.random.default_rng(0)
            self.w1 = rng.normal(size=(x.shape[1], 16))
            self.w2 = rng.normal(size=(16, len(self.actions)))
            self.w2[:, 0] += 2.0  # mostly do nothing: episodes last
        h = np.tanh(np.sin(x) @ self.w1 / np.sqrt(x.shape[1]))
        picks = [int(i) for i in np.argmax(h @ self.w2, axis=1)]
        self.choices.extend(picks)
        return picks

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return self.act_batch([observation], [reward], [done])[0]

    def act_batch(self, observations: Any, rewards: Sequence[float], dones: Sequence[bool]) -> Any:
        x = (
            np.asarray(observations, dtype=np.float64)
            if isinstance(observations, np.ndarray)
            else np.stack([o.to_vect() for o in observations]).astype(np.float64)
        )
        return [self.actions[i] for i in self._pick(x)]


class SleepyAgent:
    """An async agent whose every call waits ``delay`` seconds (a remote service); counts overlap."""

    def __init__(self, action_space: Any, delay: float) -> None:
        self.noop = action_space({})
        self.delay = delay
        self.calls = self.pending = self.max_pending = 0

    async def act(self, observation: Any, reward: float, done: bool) -> Any:
        self.calls += 1
        self.pending += 1
        self.max_pending = max(self.max_pending, self.pending)
        try:
            await anyio.sleep(self.delay)
        finally:
            self.pending -= 1
        return self.noop


class HangingAgent:
    """An async agent whose first call never returns."""

    def __init__(self) -> None:
        self.called = anyio.Event()

    async def act(self, observation: Any, reward: float, done: bool) -> Any:
        self.called.set()
        await anyio.sleep_forever()


class FailsOnSeedAgent(BaseAgent):  # type: ignore[misc]
    """Raises at its third step in the episode seeded with 12."""

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.fail = False
        self.steps = 0

    def seed(self, seed: int) -> Any:
        self.fail = seed == 12
        return super().seed(seed)

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        self.steps += 1
        if self.fail and self.steps == 3:
            self.give_up()
        return self.action_space({})

    def give_up(self) -> None:
        raise ValueError("agent gave up")


async def play(
    env: Any, agent: Any, workers: int = 2, warm_up: int = 0, **kwargs: Any
) -> tuple[list[Any], Any]:
    rewards: dict[int, list[float]] = {}

    def keep(event: Any) -> None:
        if isinstance(event, StepBatch):
            rewards.setdefault(event.index, []).extend(event.rewards.tolist())

    async with AsyncRunner(env, agent=agent, workers=workers) as runner:
        with anyio.fail_after(300):
            if warm_up:  # every env built before the run that counts
                await runner.run(warm_up, max_iter=1)
                if isinstance(agent, CentralAgent):
                    agent.batch_sizes.clear()
            results = await runner.run(**{**KWARGS, **kwargs}, sinks=[CallbackSink(keep)])
    return [r.as_tuple() for r in results], rewards


_IN_WORKER: dict[str, tuple[list[Any], Any]] = {}


async def in_worker(env: Any, agent: Any, **kwargs: Any) -> tuple[list[Any], Any]:
    """``play(env, agent)`` in the workers: the loop plays no part in it, so played once for both
    loops (``agent``: a class, or a stateless instance such as MLPAgent's)."""
    key = repr((agent if isinstance(agent, type) else type(agent), sorted(kwargs.items())))
    if key not in _IN_WORKER:
        _IN_WORKER[key] = await play(env, agent, **kwargs)
    return _IN_WORKER[key]


async def test_mlp_in_orchestrator_matches_in_worker(env: Any) -> None:
    agent = MLPAgent(env.action_space)
    expected = await in_worker(env, agent)
    central = CentralAgent(agent, max_batch=8)
    assert await play(env, central) == expected
    assert len(set(agent.choices)) > 1  # the test would see a wrong action
    assert sum(n * c for n, c in central.batch_sizes.items()) == len(agent.choices)


async def test_vectors_give_the_same_results(env: Any) -> None:
    agent = MLPAgent(env.action_space)
    kwargs: dict[str, Any] = dict(
        nb_episode=2, env_seeds=[1, 2], agent_seeds=None, episode_id=[0, 1]
    )
    expected = await in_worker(env, agent, **kwargs)
    assert await play(env, CentralAgent(agent, vectors=True), **kwargs) == expected
    assert len(set(agent.choices)) > 1


class MarginAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Deterministic, from values an observation's vector leaves out (its thermal limits):
    disconnects the line closest to its limit once its margin falls under 150 A."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        margin = observation.thermal_limit - observation.a_or
        if margin.min() < 150:
            return self.action_space({"set_line_status": [(int(np.argmin(margin)), -1)]})
        return self.action_space({})


async def test_observations_in_the_orchestrator_hold_what_their_vector_leaves_out(
    env: Any,
) -> None:
    # from_vect leaves them as allocated (np.empty): garbage, unless the worker sends them.
    kwargs: dict[str, Any] = dict(
        nb_episode=2, env_seeds=[0, 1], agent_seeds=[0, 1], episode_id=[0, 1]
    )
    expected = await in_worker(env, MarginAgent, **kwargs)
    assert await play(env, CentralAgent(MarginAgent), **kwargs) == expected
    seen: list[Any] = []

    class Probe(MarginAgent):
        def act(self, observation: Any, reward: float, done: bool = False) -> Any:
            seen.append((observation.thermal_limit.copy(), observation.support_theta))
            return super().act(observation, reward, done)

    await play(
        env, CentralAgent(Probe), nb_episode=1, env_seeds=[0], agent_seeds=[0], episode_id=[0],
        max_iter=3,
    )  # fmt: skip
    assert seen and all(
        np.array_equal(limits, env.get_thermal_limit()) and theta is True for limits, theta in seen
    )


async def test_seeded_agent_class_in_orchestrator_matches_in_worker(env: Any) -> None:
    # One RandomAgent per episode, seeded with its agent seed, as in a worker.
    assert await play(env, CentralAgent(RandomAgent)) == await in_worker(env, RandomAgent)


class PlanAtReset(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Draws its plan at ``reset`` from its action space, seeded before (as grid2op does)."""

    def reset(self, obs: Any) -> None:
        self.plan = self.action_space.sample()

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return self.plan


async def test_an_agent_drawing_at_reset_in_orchestrator_matches_in_worker(env: Any) -> None:
    # Seeded, then reset, as in a worker (and grid2op's Runner: test_agents_fidelity).
    expected = await in_worker(env, PlanAtReset)
    assert await play(env, CentralAgent(PlanAtReset)) == expected
    assert len({r[2] for r in expected[0]}) > 1  # the plans differ


async def test_async_agent_waits_overlap(env: Any) -> None:
    agent = SleepyAgent(env.action_space, delay=0.02)
    # 4 episodes in flight on 2 processes; vectors=True: the agent ignores its observations.
    central = CentralAgent(agent, vectors=True, envs_per_worker=2)
    async with AsyncRunner(env, agent=central, workers=2) as runner:
        with anyio.fail_after(300):
            await runner.run(4, max_iter=1)  # every worker started, its envs built
            agent.calls = agent.max_pending = 0
            results = await runner.run(4, max_iter=10, env_seeds=list(range(4)))
    assert agent.calls == sum(r.nb_time_step for r in results) == 40
    # Calls waited together, not one after the other (how much faster: `asyncrunner bench`).
    assert agent.max_pending > 1


async def test_batches_hold_the_episodes_in_flight(env: Any) -> None:
    agent = MLPAgent(env.action_space)
    # One worker playing the three episodes at once: all three are in flight together (with
    # one episode per process, a process still starting would leave the others alone).
    central = CentralAgent(agent, max_batch=2, max_wait=0.5, envs_per_worker=3)
    async with AsyncRunner(env, agent=central, workers=1) as runner:
        with anyio.fail_after(300):
            await runner.run(3, max_iter=1)  # the worker started, its envs built
            central.batch_sizes.clear()
            results = await runner.run(3, max_iter=30, env_seeds=[1, 2, 3])
    assert sum(r.nb_time_step for r in results) == sum(
        n * c for n, c in central.batch_sizes.items()
    )
    assert max(central.batch_sizes) == 2  # several episodes per call, never above max_batch


async def test_agent_error_fails_its_episode_only(env: Any) -> None:
    async with AsyncRunner(env, agent=CentralAgent(FailsOnSeedAgent), workers=2) as runner:
        with anyio.fail_after(300):
            results = await runner.run(**KWARGS, on_error="continue")
    assert [r.error is None for r in results] == [True, False, True, True]
    error = results[1].error
    assert error is not None
    assert (error.error_type, error.message, error.step) == ("ValueError", "agent gave up", 2)
    assert "agent gave up" in error.traceback
    assert [r.nb_time_step for r in results if r.error is None] == [30, 30, 30]


class Simulates(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        observation.simulate(self.action_space({}))
        return self.action_space({})


async def test_an_agent_simulating_in_the_orchestrator_is_told_where_to_play(env: Any) -> None:
    async with AsyncRunner(env, agent=CentralAgent(Simulates), workers=1) as runner:
        with anyio.fail_after(300):
            (result,) = await runner.run(1, max_iter=3, on_error="continue")
    assert result.error is not None and result.error.error_type == "NoForecastAvailable"
    assert "give this agent to the workers" in result.error.message


async def test_cancelling_while_the_agent_call_is_pending(env: Any, tmp_path: Any) -> None:
    from grid2op.Episode import EpisodeData

    before = children()
    agent = HangingAgent()
    runner = AsyncRunner(env, agent=CentralAgent(agent), workers=2)
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            await runner.run(2, max_iter=20, path_save=tmp_path)

    with anyio.fail_after(300):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await agent.called.wait()
            scope.cancel()
    assert scope.cancelled_caught
    await runner.aclose()
    await wait_no_children(before)
    assert EpisodeData.list_episode(str(tmp_path)) == []
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []


async def test_async_agent_in_a_worker_is_rejected(env: Any) -> None:
    with pytest.raises(TypeError, match="CentralAgent"):
        AsyncRunner(env, agent=SleepyAgent(env.action_space, 0.0))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_batch=0), "max_batch"),
        (dict(max_wait=-1.0), "max_wait"),
        (dict(max_wait=math.nan), "max_wait"),
        (dict(max_wait="0.1"), "max_wait"),
        (dict(envs_per_worker=0), "envs_per_worker"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CentralAgent(RandomAgent, **kwargs)


def test_numpy_integers_are_integers(env: Any) -> None:
    # "must be an integer >= 1, got np.int64(2)" (run()'s counts took them)
    two, four = np.int64(2), np.int64(4)
    central = CentralAgent(RandomAgent, max_batch=four, envs_per_worker=two)  # type: ignore[arg-type]
    assert (central.max_batch, central.envs_per_worker) == (4, 2)
    runner = AsyncRunner(env, agent=central, workers=two, retries=two)  # type: ignore[arg-type]
    assert (runner.workers, runner.retries) == (2, 2)


def test_not_an_agent_is_rejected() -> None:
    with pytest.raises(TypeError, match="act"):
        CentralAgent(42)


async def test_several_envs_per_worker(env: Any) -> None:
    # One worker process plays the four episodes at once: same results, batches across them.
    agent = MLPAgent(env.action_space)
    expected = await in_worker(env, agent)
    central = CentralAgent(agent, envs_per_worker=4, max_wait=0.5)
    assert await play(env, central, workers=1, warm_up=4) == expected
    assert max(central.batch_sizes) > 1


class LockCheckingBackend(LightSimBackend):  # type: ignore[misc]  # lightsim2grid is untyped
    """LightSim whose power flows, in a worker process, fail unless the thread holds the
    worker's env lock (every reset and step runs one)."""

    def runpf(self, is_dc: bool = False) -> Any:
        from asyncrunner._engine import _envs

        if multiprocessing.parent_process() is not None and not _envs.exclusive()._is_owned():
            raise RuntimeError("a power flow outside the worker's env lock")
        return super().runpf(is_dc)


async def test_episodes_of_one_worker_reset_and_step_under_the_env_lock() -> None:
    # grid2op changes the process's warning filters while it resets and steps: the episodes a
    # worker plays at once (one thread each) take turns, or a filter leaks into another's build.
    env = make_env(backend=LockCheckingBackend())
    try:
        central = CentralAgent(DoNothingAgent, envs_per_worker=2)
        async with AsyncRunner(env, agent=central, workers=1) as runner:
            results = await runner.run(2, max_iter=5, env_seeds=[1, 2], agent_seeds=[3, 4])
    finally:
        env.close()
    assert [(r.ok, r.nb_time_step) for r in results] == [(True, 5), (True, 5)], results


@pytest.mark.parametrize(
    "script",
    [
        ["examples/central_mlp.py", "--episodes", "2", "--max-iter", "20"],
        ["examples/async_http_agent.py", "--episodes", "2", "--max-iter", "20"],
    ],
)
@pytest.mark.slow  # a Python subprocess per example
def test_example_runs(script: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, *script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "same results: True" in done.stdout


async def test_a_timeout_ends_every_episode_of_the_group(env: Any) -> None:
    # One worker plays both episodes together; the agent never answers.
    central = CentralAgent(HangingAgent(), envs_per_worker=2)
    async with AsyncRunner(env, agent=central, workers=1) as runner:
        with anyio.fail_after(120):
            results = await runner.run(
                2, max_iter=20, episode_timeout=0.5, on_error="continue", retries=0
            )
    assert [r.error.error_type if r.error else None for r in results] == ["EpisodeTimeout"] * 2


class HeldFirstBatch:
    """A batch agent whose first batch waits for ``release`` (a policy server waking up)."""

    def __init__(self, action_space: Any) -> None:
        self.action_space = action_space
        self.release = anyio.Event()
        self.asked: list[int] = []  # the episode of each observation it was asked to act on

    async def act_batch(self, observations: Any, rewards: Any, dones: Any) -> list[Any]:
        self.asked += [int(o[0]) for o in observations]
        if len(self.asked) == 1:
            await self.release.wait()
        return [self.action_space({}) for _ in observations]


async def test_episodes_that_ended_waiting_for_a_batch_are_not_asked_for(env: Any) -> None:
    # The calls of episodes that ended (timed out, their worker died) while queued behind a
    # slow batch were still played: a remote policy paid for answers nobody took, and the live
    # episodes' batches were the smaller for them. (The run's side of the agent, as a run's
    # channel drives it: a call per episode, its end told by ``forget``.)
    from asyncrunner._engine._central import _Server
    from asyncrunner._engine._channel import AgentCall

    agent = HeldFirstBatch(env.action_space)
    server = _Server(CentralAgent(agent, max_batch=1, vectors=True), lambda index: env)
    vector = env.reset().to_vect()
    replies: dict[int, bytes] = {}
    answered = anyio.Event()  # both live episodes

    async def call(index: int, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            observation = np.concatenate([[index], vector[1:]])
            call = AgentCall("run", index, 1, observation, 0.0, False, None, True)
            replies[index] = await server.act(call)
            if len(replies) == 2:
                answered.set()

    async with server.send, server.receive, anyio.create_task_group() as group:
        group.start_soon(server.batches)
        await group.start(call, 0)
        scopes = [await group.start(call, index) for index in (1, 2)]
        await anyio.wait_all_tasks_blocked()
        for index, scope in zip((1, 2), scopes, strict=True):  # they time out
            scope.cancel()
            server.forget((index, 1))
        await group.start(call, 3)
        await anyio.wait_all_tasks_blocked()
        agent.release.set()
        with anyio.fail_after(10):
            await answered.wait()
        group.cancel_scope.cancel()
    assert agent.asked == [0, 3] and sorted(replies) == [0, 3]


async def test_an_episode_ending_while_its_batch_forms_is_not_asked_for(env: Any) -> None:
    # The call waits in a batch still forming (for another episode in flight, max_wait) when
    # its episode ends: the batch played it anyway.
    from asyncrunner._engine._central import _Server
    from asyncrunner._engine._channel import AgentCall

    agent = HeldFirstBatch(env.action_space)
    server = _Server(CentralAgent(agent, max_batch=2, max_wait=60, vectors=True), lambda i: env)
    vector = env.reset().to_vect()
    answered = anyio.Event()

    async def call(index: int, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            observation = np.concatenate([[index], vector[1:]])
            await server.act(AgentCall("run", index, 1, observation, 0.0, False, None, True))
            if index == 3:
                answered.set()

    async with server.send, server.receive, anyio.create_task_group() as group:
        group.start_soon(server.batches)
        await group.start(call, 0)  # its batch is held
        await anyio.wait_all_tasks_blocked()
        scope = await group.start(call, 1)  # waits in line
        await anyio.wait_all_tasks_blocked()
        agent.release.set()  # episode 0 answered; 1's batch forms, waiting for 0's next call
        await anyio.wait_all_tasks_blocked()
        scope.cancel()  # episode 1 ends (a timeout)
        server.forget((1, 1))
        server.forget((0, 1))  # and so does episode 0
        await anyio.wait_all_tasks_blocked()
        await group.start(call, 3)
        with anyio.fail_after(10):
            await answered.wait()
        group.cancel_scope.cancel()
    assert agent.asked == [0, 3]


async def test_a_worker_dying_mid_group_replays_the_group(env: Any) -> None:
    import os
    import signal

    from asyncrunner import EpisodeFailed, EpisodeStarted

    events: list[Any] = []

    def kill_once(event: Any) -> None:
        events.append(event)
        if isinstance(event, StepBatch) and not any(isinstance(e, EpisodeFailed) for e in events):
            started = next(e for e in events if isinstance(e, EpisodeStarted))
            os.kill(started.worker, signal.SIGKILL)

    central = CentralAgent(SleepyAgent(env.action_space, 0.005), envs_per_worker=2)
    async with AsyncRunner(env, agent=central, workers=1) as runner:
        with anyio.fail_after(300):
            results = await runner.run(
                2, max_iter=60, env_seeds=[1, 2], episode_id=[0, 1], sinks=[CallbackSink(kill_once)]
            )
    failed = [(e.index, e.attempt, e.retrying) for e in events if isinstance(e, EpisodeFailed)]
    assert sorted(failed) == [(0, 1, True), (1, 1, True)]  # the whole group, retried
    assert [(r.error, r.nb_time_step) for r in results] == [(None, 60), (None, 60)]
    # The final attempts' steps arrive once each.
    final = [e for e in events if isinstance(e, StepBatch) and e.attempt == 2]
    assert [sum(len(e) for e in final if e.index == i) for i in (0, 1)] == [60, 60]


_KILLS_ITS_WORKER = """
import asyncio, os, signal, warnings
warnings.filterwarnings("ignore")
import psutil
from asyncrunner import AsyncRunner, CentralAgent
from tests.conftest import make_env
from tests.helpers import alive

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as a program piped to `head` may set it


class KillsItsWorker:
    def __init__(self, space):
        self.space, self.killed = space, False

    async def act(self, obs, reward, done):
        if not self.killed:  # the worker dies while its action is computed
            self.killed = True
            pids = [p.pid for p in psutil.Process().children()]
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            while any(alive(pid) for pid in pids):
                await asyncio.sleep(0.01)
        return self.space({})


async def main():
    env = make_env()
    agent = CentralAgent(KillsItsWorker(env.action_space))
    async with AsyncRunner(env, agent=agent, workers=1) as runner:
        results = await runner.run(1, max_iter=5)
    print([(r.nb_time_step, r.error) for r in results])


asyncio.run(main())
"""


def test_with_sigpipe_at_its_default_a_worker_dying_mid_action_ends_no_run() -> None:
    # With SIGPIPE at its default (a program piped to `head`, an interpreter embedded without
    # Python's signal set-up), the action sent to the dead worker killed the orchestrator by
    # SIGPIPE: every result lost, no message. The episode is played again, as with SIGPIPE
    # ignored.
    done = run_code(_KILLS_ITS_WORKER)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.splitlines()[-1] == "[(5, None)]"


class Counting:
    """A sync agent counting how many of its calls run at once (a model with a scratch buffer
    is not thread-safe); with ``block``, its third call waits for it (a call that hangs)."""

    def __init__(self, action_space: Any, block: threading.Event | None = None) -> None:
        self.space, self.block = action_space, block
        self.inside = self.most = self.calls = 0
        self.count = threading.Lock()

    def act(self, observation: Any, reward: float, done: bool) -> Any:
        with self.count:
            self.inside += 1
            self.calls += 1
            self.most = max(self.most, self.inside)
            calls = self.calls
        try:
            if self.block is not None and calls == 3:
                self.block.wait(60)
            time.sleep(0.002)
            return self.space({})
        finally:
            with self.count:
                self.inside -= 1


async def test_a_shared_sync_agent_takes_one_call_at_a_time_across_runs(env: Any) -> None:
    # The lock was each run's: two runs at once called it at once.
    agent = Counting(env.action_space)
    async with AsyncRunner(env, agent=CentralAgent(agent), workers=2) as runner:

        async def play(episode: int) -> None:
            await runner.run(1, max_iter=15, episode_id=[episode])

        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                for episode in (0, 1):
                    group.start_soon(play, episode)
    assert agent.calls == 30 and agent.most == 1


async def test_a_hung_sync_agent_call_holds_no_timeout(env: Any) -> None:
    # The run waited for the call's thread: a call that never returns held it for ever.
    block = threading.Event()
    try:
        agent = CentralAgent(Counting(env.action_space, block))
        async with AsyncRunner(env, agent=agent, workers=1) as runner:
            with anyio.fail_after(30):
                results = await runner.run(1, max_iter=10, episode_timeout=1, on_error="continue")
            assert results[0].error is not None
            assert results[0].error.error_type == "EpisodeTimeout"
            with anyio.move_on_after(1) as cancelled:
                await runner.run(1, max_iter=10)
            assert cancelled.cancelled_caught
    finally:
        block.set()


class BatchOfSteps:
    """A batch agent doing nothing."""

    def __init__(self, action_space: Any) -> None:
        self.space = action_space

    def act_batch(self, observations: Any, rewards: Any, dones: Any) -> list[Any]:
        return [self.space({}) for _ in observations]


async def test_a_batch_does_not_wait_for_an_episode_that_ended(env: Any, tmp_path: Path) -> None:
    # It waited max_wait for it (for ever with max_wait=inf): the episodes in flight were
    # counted once, as the batch began.
    agent = CentralAgent(BatchOfSteps(env.action_space), max_wait=math.inf)
    async with AsyncRunner(env, agent=agent, workers=2) as runner:
        with anyio.fail_after(60):
            results = await runner.run(
                2, path_save=tmp_path, reset_options=[{"max step": 3}, {"max step": 30}]
            )
    assert [r.nb_time_step for r in results] == [3, 30]


class ExitsOnThirdStep(FailsOnSeedAgent):
    """Calls sys.exit() where FailsOnSeedAgent raises; notes the thread it was built in (a
    per-episode agent loading its weights)."""

    threads: ClassVar[list[str]] = []

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        ExitsOnThirdStep.threads.append(threading.current_thread().name)

    def give_up(self) -> None:
        sys.exit("library gave up")


async def test_a_per_episode_agent_is_built_off_the_loop_and_its_exit_fails_its_episode(
    env: Any,
) -> None:
    # SystemExit ended the program (the other episode's result lost), and the agents were built
    # on the event loop (stalling every other episode, sink and connection).
    ExitsOnThirdStep.threads = []
    async with AsyncRunner(env, agent=CentralAgent(ExitsOnThirdStep), workers=2) as runner:
        with anyio.fail_after(120):
            results = await runner.run(
                2, max_iter=10, agent_seeds=[11, 12], on_error="continue", retries=0
            )
    assert [(r.nb_time_step, r.error and r.error.error_type) for r in results] == [
        (10, None),
        (2, "SystemExit"),
    ]
    assert len(ExitsOnThirdStep.threads) == 2
    assert threading.main_thread().name not in ExitsOnThirdStep.threads


class StrFails(Exception):
    def __str__(self) -> str:
        raise KeyError("reason")


class CancelsOnThirdCall(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Its third act raises a CancelledError of its own (its asyncio client's)."""

    ERROR: ClassVar[type[BaseException]] = asyncio.CancelledError

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.calls = 0

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        self.calls += 1
        if self.calls == 3:
            raise self.ERROR("the agent's own")
        return self.action_space({})


class BatchCancelsOnThirdCall(CancelsOnThirdCall):
    def act_batch(self, observations: Any, rewards: Any, dones: Any) -> list[Any]:
        return [self.act(o, r) for o, r in zip(observations, rewards, strict=True)]


class AsyncCancelsOnThirdCall(CancelsOnThirdCall):
    async def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return super().act(observation, reward, done)


class AsyncBatchCancelsOnThirdCall(CancelsOnThirdCall):
    async def act_batch(self, observations: Any, rewards: Any, dones: Any) -> list[Any]:
        return [
            CancelsOnThirdCall.act(self, o, r) for o, r in zip(observations, rewards, strict=True)
        ]


class ReportFails(CancelsOnThirdCall):
    ERROR = StrFails


@pytest.mark.parametrize(
    ("agent_class", "per_episode"),
    [
        (CancelsOnThirdCall, False),
        (CancelsOnThirdCall, True),
        (BatchCancelsOnThirdCall, False),
        (AsyncCancelsOnThirdCall, False),
        (AsyncCancelsOnThirdCall, True),
        (AsyncBatchCancelsOnThirdCall, False),
        (ReportFails, False),
    ],
)
async def test_what_the_agent_raises_fails_its_episodes(
    env: Any, agent_class: Any, per_episode: bool
) -> None:
    # A CancelledError of the agent's own looked like the cancellation of the run's task (the
    # run returned without the episodes it failed); an exception whose __str__ fails, like a
    # worker's death.
    agent = agent_class if per_episode else agent_class(env.action_space)
    async with AsyncRunner(env, agent=CentralAgent(agent), workers=2) as runner:
        with anyio.fail_after(120):
            results = await runner.run(2, max_iter=5, on_error="continue", retries=0)
    assert len(results) == 2
    errors = [r.error for r in results if r.error is not None]
    assert errors and {e.error_type for e in errors} == {agent_class.ERROR.__name__}
    assert all("in act" in e.traceback for e in errors)


async def test_calls_waiting_for_a_shared_agent_hold_no_thread_of_the_default_pool(
    env: Any,
) -> None:
    # They waited for its lock in threads of anyio's default pool, which the sinks and the
    # runner need: one hung call starved them all (found by review).
    block = threading.Event()
    limiter = anyio.to_thread.current_default_thread_limiter()
    tokens, limiter.total_tokens = limiter.total_tokens, 3  # (40: as many episodes at once)
    agent = Counting(env.action_space, block)
    try:
        central = CentralAgent(agent, envs_per_worker=4)
        async with AsyncRunner(env, agent=central, workers=1) as runner:
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: runner.run(4, max_iter=10))
                with anyio.fail_after(60):
                    while agent.calls < 3:  # noqa: ASYNC110 - the agent runs in a thread
                        await anyio.sleep(0.05)
                await anyio.sleep(1)  # the other episodes' calls wait for the agent
                with anyio.fail_after(10):
                    await anyio.to_thread.run_sync(time.sleep, 0)  # (it waited for ever)
                block.set()
    finally:
        block.set()
        limiter.total_tokens = tokens


async def test_every_slot_of_a_worker_plays_a_copy_of_the_callers_env() -> None:
    # copy_env=True with envs_per_worker=2: the second slot built an env of its own from the
    # runner's parameters, which did not have the caller's changes (here its chronics' order):
    # episode 1 played 0001 again, not 0002.
    from asyncrunner import EpisodeStarted

    env = make_env()
    env.chronics_handler.shuffle(lambda order: np.concatenate([order[1:], order[:1]]))
    started: list[EpisodeStarted] = []

    def seen(event: Any) -> None:
        if isinstance(event, EpisodeStarted):
            started.append(event)

    agent = CentralAgent(DoNothingAgent, envs_per_worker=2)
    async with AsyncRunner(env, agent=agent, workers=1, copy_env=True) as runner:
        results = await runner.run(
            3, max_iter=3, episode_id=[0, 1, 2], sinks=[CallbackSink(seen, needs_steps=False)]
        )
    assert [r.name for r in results] == ["0001", "0002", "0000"]
    assert sorted(e.env_builds for e in started) == [0, 0, 0]
    env.close()
