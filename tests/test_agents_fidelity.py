"""Agent code and env parameters that grid2op's Runner plays, played alike by asyncrunner.

Agents defined inside a function (classes, instances, lambda factories) and a chronics filter
that is a lambda go to the workers by value; an agent instance that cannot be copied, and
``GRID2OP_RUNNER_FORCE_SEQUENTIAL``, play in the caller's process as with grid2op's Runner;
``redispatch_solver`` reaches the workers' envs.
"""

from __future__ import annotations

import copy
import json
import logging
import multiprocessing
import os
import threading
import warnings
import weakref
import zipapp
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest
from grid2op.Action import PowerlineSetAction
from grid2op.Agent import BaseAgent, DoNothingAgent, RandomAgent
from grid2op.Chronics import MultifolderWithCache
from grid2op.Opponent import BaseActionBudget, BaseOpponent
from grid2op.Reward import BaseReward
from grid2op.Rules import BaseRules
from grid2op.Runner import Runner as GridRunner
from grid2op.VoltageControler import ControlVoltageFromFile
from lightsim2grid import LightSimBackend

from asyncrunner import AsyncRunner
from asyncrunner.compat import _runner as compat

from .conftest import make_env
from .helpers import grid2ops, run_code, run_module, run_script


def seeds(nb_episode: int) -> dict[str, Any]:
    """Seeds and ``max_iter`` for ``nb_episode`` episodes (the same in every test)."""
    return dict(env_seeds=[1, 2, 3][:nb_episode], agent_seeds=[4, 5, 6][:nb_episode], max_iter=20)


def played(results: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """(chronic name, cum_reward, steps, max_ts) of grid2op-style result tuples."""
    return [(str(r[1]), r[2], r[3], r[4]) for r in results]


def grid2op_run(params: dict[str, Any], nb_episode: int = 3, **kwargs: Any) -> list[Any]:
    """grid2op's own Runner, one process (its results then come in request order)."""
    runner = grid2ops(GridRunner, **params)
    return played(grid2ops(runner.run, nb_episode, nb_process=1, **seeds(nb_episode), **kwargs))


def compat_run(params: dict[str, Any], nb_episode: int = 3) -> list[Any]:
    """compat.Runner on two worker processes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grid2op's own, at the Runner's construction
        runner = compat.Runner(**params)
    return played(runner.run(nb_episode, nb_process=2, **seeds(nb_episode)))


def local_sampling_agent() -> type[BaseAgent]:
    """An agent class defined in a function (not importable by a worker): samples its space."""

    class LocalAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
        def act(self, observation: Any, reward: float, done: bool = False) -> Any:
            return self.action_space.sample()

    return LocalAgent


@pytest.fixture(scope="module")
def env() -> Iterator[Any]:
    e = make_env()
    yield e
    e.close()


@pytest.fixture(scope="module")
def spawn_pool() -> Iterator[ProcessPoolExecutor]:
    """Two spawned worker processes (fresh interpreters), shared by this module's spawn tests."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
        yield pool


@pytest.fixture(scope="module")
def by_class(env: Any) -> list[Any]:
    """What grid2op's Runner plays with ``agentClass=`` a class defined in a function."""
    return grid2op_run({**env.get_params_for_runner(), "agentClass": local_sampling_agent()})


@pytest.fixture(scope="module")
def by_instance(env: Any) -> list[Any]:
    """What grid2op's Runner plays with ``agentInstance=`` an instance of such a class."""
    instance = local_sampling_agent()(env.action_space)
    params = {**env.get_params_for_runner(), "agentClass": None, "agentInstance": instance}
    return grid2op_run(params)


def async_run(env: Any, agent: Any, executor: Any = None, copy_env: bool = False) -> list[Any]:
    async def main() -> list[Any]:
        async with AsyncRunner(
            env, agent=agent, workers=2, executor=executor, copy_env=copy_env
        ) as runner:
            results = await runner.run(3, **seeds(3))
        return [r.as_tuple() for r in results]

    return played(anyio.run(main))


# --- a class redefined under the same name ---------------------------------------------------


def define_stopping_agent(steps: int) -> type[BaseAgent]:
    """``StoppingAgent`` of this module, (re)defined: it fails after ``steps`` steps (a notebook
    cell defining the agent, run again after a fix; a module reloaded)."""

    class StoppingAgent(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
        def act(self, observation: Any, reward: float, done: bool = False) -> Any:
            self.n = getattr(self, "n", 0) + 1
            if self.n > steps:
                raise RuntimeError(f"stopped after {steps} steps")
            return super().act(observation, reward, done)

    StoppingAgent.__qualname__ = "StoppingAgent"  # pickled by name, as a top-level class
    globals()["StoppingAgent"] = StoppingAgent
    return StoppingAgent


def test_a_new_runner_plays_a_class_redefined_under_the_same_name(env: Any) -> None:
    """The two definitions pickle to the same bytes (a class goes by name): a new runner made
    with the second, while one made with the first was open (or dropped unclosed), found the
    env held for the first one's recipe and its workers played the first definition."""

    async def main() -> list[list[int]]:
        played = []
        async with AsyncRunner(env, agent=define_stopping_agent(3), workers=2) as first:
            played.append(await steps(first))
            async with AsyncRunner(env, agent=define_stopping_agent(6), workers=2) as second:
                played.append(await steps(second))
            played.append(await steps(first))  # the open one keeps the class it was given
        return played

    async def steps(runner: AsyncRunner) -> list[int]:
        results = await runner.run(2, max_iter=20, on_error="continue")
        return [r.nb_time_step for r in results]

    try:
        assert anyio.run(main) == [[3, 3], [6, 6], [3, 3]]
    finally:
        globals().pop("StoppingAgent", None)


def test_a_recipe_key_is_the_same_in_every_process(env: Any) -> None:
    """Dask workers keep their envs by recipe key across clients: keys of the ids of the classes
    a recipe pickles made every new client (a script run again, each CLI call) rebuild them."""
    code = (
        "from grid2op.Agent import DoNothingAgent\n"
        "from asyncrunner import AsyncRunner\n"
        "from tests.conftest import make_env\n"
        "print(AsyncRunner(make_env(), agent=DoNothingAgent, workers=1)._recipe_key)\n"
    )
    done = run_code(code)
    assert done.returncode == 0, done.stderr
    here = AsyncRunner(env, agent=DoNothingAgent, workers=1)._recipe_key
    assert done.stdout.strip().splitlines()[-1] == here


# --- agents defined in a function, sent by value ----------------------------------------------


def test_local_agent_class_plays_in_workers_as_in_grid2op(env: Any, by_class: list[Any]) -> None:
    params = {**env.get_params_for_runner(), "agentClass": local_sampling_agent()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to playing in this process
        assert compat_run(params) == by_class


def test_local_agent_instance_plays_in_workers_as_in_grid2op(
    env: Any, by_instance: list[Any]
) -> None:
    instance = local_sampling_agent()(env.action_space)
    params = {**env.get_params_for_runner(), "agentClass": None, "agentInstance": instance}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert compat_run(params) == by_instance


def test_a_random_agent_instance_plays_what_fresh_agents_play(env: Any) -> None:
    """The README's fast path for an agent costly to build (grid2op's RandomAgent lists every
    unitary action): an instance, copied for each episode as grid2op copies ``agentInstance``,
    plays what a fresh agent per episode plays, the episodes seeded."""
    fresh = grid2op_run({**env.get_params_for_runner(), "agentClass": RandomAgent})
    assert async_run(env, RandomAgent(env.action_space)) == fresh
    # the agents' actions count: doing nothing plays otherwise
    assert fresh != grid2op_run({**env.get_params_for_runner(), "agentClass": DoNothingAgent})


def test_lambda_factory_plays_on_the_fork_pool(env: Any, by_class: list[Any]) -> None:
    agent = local_sampling_agent()
    assert async_run(env, lambda space: agent(space)) == by_class


@pytest.mark.slow  # spawned interpreters import grid2op (seconds each)
def test_lambda_factory_plays_on_spawned_workers(
    env: Any, spawn_pool: ProcessPoolExecutor, by_class: list[Any]
) -> None:
    agent = local_sampling_agent()
    assert async_run(env, lambda space: agent(space), spawn_pool) == by_class


@pytest.mark.slow  # spawned interpreters import grid2op (seconds each)
def test_local_agent_class_plays_on_spawned_workers(
    env: Any, spawn_pool: ProcessPoolExecutor, by_class: list[Any]
) -> None:
    assert async_run(env, local_sampling_agent(), spawn_pool) == by_class


_PLUGIN_SCRIPT = """
import asyncio, multiprocessing, sys, types
from concurrent.futures import ProcessPoolExecutor
import cloudpickle
from asyncrunner import AsyncRunner
from tests.conftest import make_env

PLUGIN = (
    "from grid2op.Agent import BaseAgent\\n"
    "class PluginAgent(BaseAgent):\\n"
    "    def act(self, observation, reward, done=False):\\n"
    "        return self.action_space({})\\n"
)

async def main():
    module = types.ModuleType("plugins")  # a plugin loader's, a config system's
    exec(PLUGIN, module.__dict__)
    sys.modules["plugins"] = module
    cloudpickle.register_pickle_by_value(module)
    env = make_env()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=spawn) as pool:
        async with AsyncRunner(env, agent=module.PluginAgent, executor=pool) as runner:
            results = await runner.run(2, max_iter=5)
    print([(r.nb_time_step, r.error) for r in results])

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.slow  # spawned interpreters import grid2op (seconds each)
def test_a_module_registered_by_value_goes_by_value_to_spawned_workers(tmp_path: Path) -> None:
    # A module made at run time: spawned workers cannot import it, and
    # cloudpickle.register_pickle_by_value(module), cloudpickle's way to send it, was not
    # honoured for a script's spawn pool ("No module named 'plugins'" at every episode).
    script = tmp_path / "evaluate.py"
    script.write_text(_PLUGIN_SCRIPT)
    done = run_script(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[(5, None), (5, None)]"


@pytest.mark.slow  # spawned interpreters import grid2op (seconds each)
def test_local_agent_instance_plays_on_spawned_workers(
    env: Any, spawn_pool: ProcessPoolExecutor, by_instance: list[Any]
) -> None:
    # The instance holds its action space, whose classes grid2op made for the env (by value too).
    instance = local_sampling_agent()(env.action_space)
    assert async_run(env, instance, spawn_pool) == by_instance


_SPAWNED_MAIN = """
import asyncio, multiprocessing
from concurrent.futures import ProcessPoolExecutor
from grid2op.Agent import DoNothingAgent
from asyncrunner import AsyncRunner
from tests.conftest import make_env

class CellAgent(DoNothingAgent):
    pass

async def main():
    env = make_env()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=spawn) as pool:
        async with AsyncRunner(env, agent=CellAgent, executor=pool) as runner:
            results = await runner.run(2, max_iter=5)
    print([(r.nb_time_step, r.error) for r in results])

asyncio.run(main())
"""


@pytest.mark.slow  # spawned interpreters import grid2op (seconds each)
@pytest.mark.parametrize("main", ["python -c", "python -m package", "zipapp"])
def test_an_agent_class_of_a_main_spawned_workers_cannot_import_plays_there(
    main: str, tmp_path: Path
) -> None:
    """A notebook's cells (``python -c`` here), a package's ``__main__.py`` (``python -m
    package``) and a zipapp's are a ``__main__`` that spawned workers do not import (the
    standard library's ``_fixup_main_from_name`` skips ``__main__`` and ``*.__main__``): their
    classes failed every episode ("Can't get attribute 'CellAgent' on <module '__main__'
    (built-in)>"; the last two found by the runtime hunt). They go by value to such pools."""
    if main == "python -c":
        done = run_code(_SPAWNED_MAIN)
    else:
        package = tmp_path / "evaluation"
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "__main__.py").write_text(_SPAWNED_MAIN)
        if main == "python -m package":
            done = run_module(tmp_path, "evaluation")
        else:
            (package / "__init__.py").unlink()
            zipapp.create_archive(package, tmp_path / "evaluation.pyz")
            done = run_script(tmp_path / "evaluation.pyz")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[(5, None), (5, None)]", done.stdout


_UNFORKED_MAIN = """
import asyncio

from grid2op.Agent import DoNothingAgent

import asyncrunner._runner
from asyncrunner import AsyncRunner
from tests.conftest import make_env

IMPORTS
asyncrunner._runner._FORK = False  # the default pool where this process cannot fork (macOS)


async def main(agent):
    async with AsyncRunner(make_env(), agent=agent, workers=1) as runner:
        try:
            results = await runner.run(2, max_iter=5)
        except Exception as exc:
            print(type(exc).__name__, exc)
        else:
            print([(r.nb_time_step, r.error) for r in results])


class CellAgent(DoNothingAgent):
    pass


if __name__ == "__main__":

    class GuardedAgent(DoNothingAgent):
        pass

    asyncio.run(main(AGENT))
"""


@pytest.mark.slow  # anyio's worker interpreters import grid2op (seconds each)
@pytest.mark.parametrize("main", ["python -c", "relative import", "class under the guard"])
def test_a_main_script_anyios_workers_cannot_run_plays_or_says_why(
    main: str, tmp_path: Path
) -> None:
    """The default pool where this process does not fork (macOS, Windows) is anyio's: each
    worker runs the main script by its file. A notebook's cells (``python -c``) have none: a
    class of theirs failed every episode ("No module named '__main__'"), it goes by value. A
    script run as ``python -m package.script`` with a relative import was a worker death
    (retried, "Error during worker process initialization", no cause), and a class defined
    under ``if __name__ == "__main__":`` an AttributeError naming ``__mp_main__``: both say
    what to change (found by the spawn hunt)."""
    package = tmp_path / "evaluation"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "agents.py").write_text(
        "from grid2op.Agent import DoNothingAgent\n\nclass RelAgent(DoNothingAgent):\n    pass\n"
    )
    code = _UNFORKED_MAIN.replace(
        "IMPORTS", "from .agents import RelAgent" * (main == "relative import")
    )
    code = code.replace(
        "AGENT", {"python -c": "CellAgent", "relative import": "RelAgent"}.get(main, "GuardedAgent")
    )
    if main == "python -c":
        done = run_code(code)
    else:
        (package / "script.py").write_text(code)
        done = run_module(tmp_path, "evaluation.script")
    assert done.returncode == 0, done.stderr
    said = next(line for line in done.stdout.splitlines() if line.startswith(("[", "Episode")))
    if main == "python -c":
        assert said == "[(5, None), (5, None)]", done.stdout
    elif main == "relative import":
        assert said.startswith(
            "EpisodeError episode 0 failed after 0 steps: RuntimeError: a worker process could "
            f"not run your main script {package / 'script.py'} (ImportError: attempted relative "
            "import with no known parent package): "
        ), said
        assert "absolute imports rather than relative ones" in said
    else:
        assert said.startswith(
            "EpisodeError episode 0 failed after 0 steps: AttributeError: Can't get attribute "
            "'GuardedAgent' on <module '__mp_main__'"
        ), said
        assert "define the agent's class (and the others given to the runner) at the" in said


@pytest.mark.slow  # a local Dask cluster (worker processes of its own)
def test_lambda_factory_plays_on_dask_workers(env: Any, by_class: list[Any]) -> None:
    pytest.importorskip("distributed")
    from asyncrunner.dask import DaskExecutor

    agent = local_sampling_agent()
    executor = DaskExecutor(local_workers=2)
    assert async_run(env, lambda space: agent(space), executor) == by_class


SCRIPT = """
import asyncio, threading, warnings
warnings.simplefilter("ignore")
from grid2op.Agent import DoNothingAgent
from asyncrunner import AsyncRunner
from tests.conftest import make_env

LOCK = threading.Lock()  # what a script's agent may use: cannot be pickled


class ScriptAgent(DoNothingAgent):
    def act(self, observation, reward, done=False):
        with LOCK:
            return super().act(observation, reward, done)


async def main():
    async with AsyncRunner(make_env(), agent=ScriptAgent, workers=2) as runner:
        results = await runner.run(2, max_iter=5)
    print([r.nb_time_step for r in results])


if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.slow  # a subprocess
def test_script_agent_class_keeps_its_globals_in_the_script(tmp_path: Any) -> None:
    # By reference, as before: by value, the class would drag its unpicklable global along.
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = run_script(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[5, 5]"


LOKY_SCRIPT = """
import asyncio, json, warnings
warnings.simplefilter("ignore")
import loky
from grid2op.Agent import RandomAgent
from grid2op.Runner import Runner
from asyncrunner import AsyncRunner
from tests.conftest import make_env


class ScriptAgent(RandomAgent):
    pass


RUN = dict(nb_episode=2, max_iter=10, env_seeds=[1, 2], agent_seeds=[4, 5])


async def main():
    env = make_env()
    theirs = Runner(**env.get_params_for_runner(), agentClass=ScriptAgent).run(**RUN)
    executor = loky.get_reusable_executor(max_workers=2)
    try:
        async with AsyncRunner(env, agent=ScriptAgent, workers=2, executor=executor) as runner:
            mine = await runner.run(**RUN)
    finally:
        executor.shutdown(wait=True)
    print(json.dumps([[r.as_tuple()[1:4] for r in mine], [list(r[1:4]) for r in theirs]]))


if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.slow  # a subprocess, and loky's worker processes
def test_a_script_agent_class_plays_on_a_loky_executor(tmp_path: Any) -> None:
    # loky's workers (joblib's process pool) never import the script: its class goes by value,
    # as loky sends a script's functions. By reference, every episode failed ("Can't get
    # attribute 'ScriptAgent' on <module 'loky.backend.popen_loky_posix'>").
    script = tmp_path / "script.py"
    script.write_text(LOKY_SCRIPT)
    done = run_script(script)
    assert done.returncode == 0, done.stderr[-3000:]
    mine, theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert mine == theirs


# --- an agent instance that cannot be copied -------------------------------------------------


class Uncopyable(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
    """Counts the steps it plays; ``copy.copy`` raises (it holds something like a session)."""

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.steps = 0

    def __copy__(self) -> Any:
        raise copy.Error("this agent holds a session that cannot be copied")

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        self.steps += 1
        return super().act(observation, reward, done)


def logged_warnings(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(name)]


def test_uncopyable_agent_instance_is_played_itself_as_in_grid2op(
    env: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    runs = {}
    for name, cls in (("grid2op", GridRunner), ("ours", compat.Runner)):
        agent = Uncopyable(env.action_space)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # grid2op's logger.warn
            warnings.simplefilter("ignore", UserWarning)  # grid2op's, at construction
            params = {
                **env.get_params_for_runner(),
                "logger": logging.getLogger(f"fidelity.{name}"),
            }
            runner = cls(**params, agentClass=None, agentInstance=agent)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            results = played(runner.run(2, nb_process=2, **seeds(2)))
        # The instance itself played every episode, in this process.
        runs[name] = (results, agent.steps, logged_warnings(caplog, f"fidelity.{name}"))
    assert runs["ours"] == runs["grid2op"]
    assert runs["ours"][1] == sum(r[2] for r in runs["ours"][0])
    assert runs["ours"][2] == [compat._LOG_SEQUENTIAL]


def test_async_runner_rejects_an_uncopyable_agent_instance_before_work(env: Any) -> None:
    with pytest.raises(TypeError, match=r"cannot be copied.*pass its class or a factory"):
        AsyncRunner(env, agent=Uncopyable(env.action_space))


class LooksAhead(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Holds an env of its own (a planner's), which it resets and steps before each action."""

    def __init__(self, sim_env: Any) -> None:
        super().__init__(sim_env.action_space)
        self.sim = sim_env

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        self.sim.reset(seed=0, options={"time serie id": 0})
        self.sim.step(self.action_space({}))
        return self.action_space({})


def test_an_agent_holding_an_env_steps_it_in_the_workers(env: Any) -> None:
    """Pickle protocol 5 brought LightSim's read-only arrays back on immutable bytes: the env an
    agent holds could not be reset in a worker ("cannot set WRITEABLE flag")."""
    sim = make_env()
    try:
        agent = LooksAhead(sim)
        params = {**env.get_params_for_runner(), "agentClass": None, "agentInstance": agent}
        assert async_run(env, agent) == grid2op_run(params)
    finally:
        sim.close()


class EveryFifthStep(BaseOpponent):  # type: ignore[misc]  # grid2op is untyped
    """Attacks a line every fifth step; sets its attributes in ``init``, as grid2op documents:
    its lines, the one of highest thermal limit first (as the env shows them to ``init``: in
    grid2op's build, the backend's, the same for every line, not yet the env's)."""

    lines: tuple[int, ...] = ()  # a class default, as many opponents have

    def init(self, partial_env: Any, lines_attacked: Any = (), **kwargs: Any) -> None:
        lines = [partial_env.name_line.tolist().index(n) for n in lines_attacked]
        limits = partial_env.get_thermal_limit()
        self.lines = tuple(sorted(lines, key=lambda line: -limits[line]))

    def reset(self, initial_budget: Any) -> None:
        self.n = 0

    def attack(self, observation: Any, agent_action: Any, env_action: Any, *args: Any) -> Any:
        self.n += 1
        if self.n % 5 == 0 and self.lines:
            return self.action_space({"set_line_status": [(self.lines[0], -1)]}), 2
        return None, None


class ScaledVoltages(ControlVoltageFromFile):  # type: ignore[misc]  # grid2op is untyped
    """Sets attributes in ``__init__`` and reads them at every step: a scale, and its calls
    (never reset: a new env's controller has had one, at the build's step)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale = 1.0
        self.calls = 0

    def fix_voltage(self, observation: Any, agent_action: Any, env_action: Any, v: Any) -> Any:
        self.calls += 1
        scale = self.scale * (1.0 + 0.001 * self.calls)
        return super().fix_voltage(observation, agent_action, env_action, v * scale)


class StepCountReward(BaseReward):  # type: ignore[misc]  # grid2op is untyped
    """Keeps the env ``initialize`` gives it, and reads its step count; plus the lines in
    service (an attack shows), its calls since ``initialize`` (never reset: a new env's reward
    has had one, at the build's step) and the generators' voltages (the voltage controller's);
    times ``scale`` (an instance given to make keeps its own)."""

    def __init__(self, scale: float = 1.0, logger: Any = None) -> None:
        super().__init__(logger=logger)
        self.scale = scale

    def initialize(self, env: Any) -> None:
        self.env = env
        self.calls = 0
        # In grid2op's build, the backend's limits, not yet the env's (see EveryFifthStep).
        self.limit = float(env.get_thermal_limit().max())
        self.reward_min, self.reward_max = 0.0, 1000.0

    def __call__(self, action: Any, env: Any, *flags: Any) -> float:
        self.calls += 1
        status = env.backend.get_line_status()
        # The lines in service, and which are not (the line an opponent attacked).
        seen = self.env.nb_time_step + status.sum() + 0.001 * np.flatnonzero(~status).sum()
        volts = env.backend.generators_info()[2].sum()
        return self.scale * float(seen + 0.01 * self.calls + 1e-4 * volts + 1e-5 * self.limit)


@pytest.mark.parametrize("copy_env", [False, True])
def test_a_users_opponent_voltage_controller_and_rewards_play_as_in_grid2op(
    copy_env: bool,
) -> None:
    """Episodes play copies of an env: grid2op's copy loses what such classes set in
    ``__init__`` / ``init``, and points a reward's env at the env copied (never played). With
    ``copy_env``, the copies of the caller's env (grid2op's copy of it: found by a hunt)."""
    env = make_env(
        reward_class=StepCountReward(scale=2.0),
        other_rewards={"steps": StepCountReward},
        voltagecontroler_class=ScaledVoltages,
        opponent_class=EveryFifthStep,
        opponent_action_class=PowerlineSetAction,
        opponent_budget_class=BaseActionBudget,
        opponent_init_budget=100.0,
        opponent_budget_per_ts=1.0,
        opponent_attack_duration=2,
        opponent_attack_cooldown=3,
        kwargs_opponent={"lines_attacked": ["1_4_4", "1_3_3"]},  # limits 175 A and 636 A
    )
    try:
        params = {**env.get_params_for_runner(), "agentClass": DoNothingAgent}
        expected = grid2op_run(params)
        untouched = grid2op_run({**params, "opponent_init_budget": 0, "opponent_budget_per_ts": 0})
        assert all(r[1] < u[1] for r, u in zip(expected, untouched, strict=True))  # it attacked
        assert async_run(env, DoNothingAgent, copy_env=copy_env) == expected
    finally:
        env.close()


class LockedVoltages(ControlVoltageFromFile):  # type: ignore[misc]  # grid2op is untyped
    """Holds a lock, which cannot be copied: grid2op's Runner never copies it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lock = threading.Lock()


def test_a_users_part_that_cannot_be_copied_plays_on_a_new_build() -> None:
    # Copied since the user's parts are copies of the pristine env's: every episode failed
    # ("cannot pickle '_thread.lock' object", found by review). Each gets a new build instead.
    env = make_env(voltagecontroler_class=LockedVoltages)
    try:
        expected = grid2op_run({**env.get_params_for_runner(), "agentClass": DoNothingAgent})
        assert async_run(env, DoNothingAgent) == expected
    finally:
        env.close()


class _KeepsTheEnv(BaseReward):  # type: ignore[misc]  # grid2op is untyped
    """A reward keeping something of the env ``initialize`` gives it, read at every step."""

    def initialize(self, env: Any) -> None:
        self.reward_min, self.reward_max = -1e9, 1e9


class ChronicIndexReward(_KeepsTheEnv):
    """Keeps a part of a part of the env (its chronics' data)."""

    def initialize(self, env: Any) -> None:
        super().initialize(env)
        self.data = getattr(env.chronics_handler, "real_data", None)  # (none in a forecast env)

    def __call__(self, action: Any, env: Any, *flags: Any) -> float:
        return 0.0 if self.data is None else float(self.data.data.current_index)


class WeakEnvReward(_KeepsTheEnv):
    """Keeps a weak reference to the env (copied as it is)."""

    def initialize(self, env: Any) -> None:
        super().initialize(env)
        self.env: Callable[[], Any] = weakref.ref(env)

    def __call__(self, action: Any, env: Any, *flags: Any) -> float:
        return float(self.env().nb_time_step)


class ProxyReward(_KeepsTheEnv):
    """Keeps a weak proxy of the env (deep-copying it made an env that closed the backend)."""

    def initialize(self, env: Any) -> None:
        super().initialize(env)
        self.env = weakref.proxy(env)

    def __call__(self, action: Any, env: Any, *flags: Any) -> float:
        return float(self.env.nb_time_step)


class ClosureReward(_KeepsTheEnv):
    """Keeps a function closing over the env (copied as it is)."""

    def initialize(self, env: Any) -> None:
        super().initialize(env)
        self.step_of: Callable[[], Any] = lambda: env.nb_time_step

    def __call__(self, action: Any, env: Any, *flags: Any) -> float:
        return float(self.step_of())


class ViewReward(_KeepsTheEnv):
    """Keeps a view of an array the env writes at every step (a copy no longer follows it)."""

    def initialize(self, env: Any) -> None:
        super().initialize(env)
        self.gen_p = env._gen_activeprod_t[:3]

    def __call__(self, action: Any, env: Any, *flags: Any) -> float:
        return float(self.gen_p.sum())


class AppendsReward(_KeepsTheEnv):
    """Keeps a list's built-in ``append`` (copied as it is: the pristine env's part's list)."""

    def initialize(self, env: Any) -> None:
        super().initialize(env)
        self.seen: list[int] = []
        self.push = self.seen.append

    def __call__(self, action: Any, env: Any, *flags: Any) -> float:
        self.push(1)
        return float(len(self.seen))


class ObjectArrayReward(_KeepsTheEnv):
    """Keeps the chronics' data in an array of objects (whose items gc does not report)."""

    def initialize(self, env: Any) -> None:
        super().initialize(env)
        self.held = np.empty(1, dtype=object)
        self.held[0] = getattr(env.chronics_handler, "real_data", None)

    def __call__(self, action: Any, env: Any, *flags: Any) -> float:
        data = self.held[0]
        return 0.0 if data is None else float(data.data.current_index)


class HelperReward(_KeepsTheEnv):
    """Keeps the env's action space for its own actions (its forecast env's too), seeded by
    ``env.seed``, and draws from it."""

    def initialize(self, env: Any) -> None:
        super().initialize(env)
        self.helper = env._helper_action_env

    def __call__(self, action: Any, env: Any, *flags: Any) -> float:
        return float(self.helper.space_prng.randint(100))


class DrawsFromItsHelper(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Draws from ``obs.action_helper``'s generator, which ``env.seed`` seeds in grid2op."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        status = [None, -1, 1][int(observation.action_helper.space_prng.randint(3))]
        return self.action_space({} if status is None else {"set_line_status": [(3, status)]})


HOLDING_THE_ENV = [
    ChronicIndexReward, WeakEnvReward, ProxyReward, ClosureReward, ViewReward, HelperReward,
    AppendsReward, ObjectArrayReward,
]  # fmt: skip


@pytest.mark.parametrize("reward", HOLDING_THE_ENV)
def test_a_reward_holding_the_env_in_other_ways_plays_as_in_grid2op(reward: type[Any]) -> None:
    # Holding the env otherwise than by its attributes, copied with the pristine env's parts
    # (never played: 0 where grid2op gives 55, or a view frozen at the build's values): their
    # env is built for each episode (found by hunt and review). The env's action space for its
    # own actions is also its forecast env's: the copy's forecast env had its own, never
    # seeded. Observations' action_helper was the pristine env's, shared and never seeded
    # (each run gave other numbers).
    env = make_env(reward_class=reward)
    try:
        expected = grid2op_run({**env.get_params_for_runner(), "agentClass": DrawsFromItsHelper})
        assert all(r[1] > 0 for r in expected)
        assert async_run(env, DrawsFromItsHelper) == expected
    finally:
        env.close()


class FollowsItsForecasts(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Disconnects or reconnects a line by what ``simulate`` gives for doing nothing: the reward
    and the other reward "steps" the forecast env computes."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        _, simulated, _, info = observation.simulate(self.action_space({}))
        disconnect = (int(10 * simulated) + int(10 * info["rewards"]["steps"])) % 3 == 0
        return self.action_space({"set_line_status": [(3, -1 if disconnect else 1)]})


def test_a_users_rewards_in_the_forecast_env_play_as_in_grid2op() -> None:
    """``simulate`` computes rewards in the forecast env, where grid2op's copy points a reward's
    env at the forecast env copied (never played)."""
    from grid2op.Reward import CombinedReward

    # grid2op's CombinedReward of the user's: it went through grid2op's copy (its reward read
    # the pristine env, never played).
    combined = CombinedReward()
    combined.addReward("steps", StepCountReward(scale=1.5), 1.0)
    env = make_env(reward_class=combined, other_rewards={"steps": StepCountReward})
    try:
        expected = grid2op_run({**env.get_params_for_runner(), "agentClass": FollowsItsForecasts})
        assert async_run(env, FollowsItsForecasts) == expected
    finally:
        env.close()


def test_a_run_after_the_agent_class_changed_is_refused(env: Any) -> None:
    """Workers forked as the runner opened keep the class as it was: grid2op's own pattern,
    ``OneChangeThenNothing.gen_next(...)`` before each run, played the first action again."""
    from grid2op.Agent import OneChangeThenNothing

    first = OneChangeThenNothing.gen_next({"set_line_status": [(0, -1)]})

    async def main() -> None:
        async with AsyncRunner(env, agent=first, workers=1) as runner:
            await runner.run(1, max_iter=2)
            OneChangeThenNothing.gen_next({"set_line_status": [(1, -1)]})
            with pytest.raises(ValueError, match=r"class attributes changed.*\(my_dict\)"):
                await runner.run(1, max_iter=2)

    try:
        anyio.run(main)
    finally:
        OneChangeThenNothing.my_dict = {}


class PlaysItsList(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Plays the actions its class holds, in turn."""

    actions: ClassVar[list[Any]] = []

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return self.actions[observation.current_step % len(self.actions)]


def test_using_the_agent_class_attributes_is_not_changing_them(
    env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An action caches its vector in itself: reading it between runs changed its pickle, which
    an earlier check took for a changed class."""
    monkeypatch.setattr(PlaysItsList, "actions", [env.action_space({}) for _ in range(2)])

    async def main() -> list[list[Any]]:
        async with AsyncRunner(env, agent=PlaysItsList, workers=1) as runner:
            first = await runner.run(1, max_iter=3, env_seeds=[0])
            vectors = [a.to_vect() for a in PlaysItsList.actions]
            assert len(vectors) == 2
            return [first, await runner.run(1, max_iter=3, env_seeds=[0])]

    first, second = anyio.run(main)
    assert [r.as_tuple() for r in first] == [r.as_tuple() for r in second]


class ScaledLoads(LightSimBackend):  # type: ignore[misc]  # LightSim is untyped
    """A backend subclass setting an attribute in ``__init__`` (recorded for runner params)."""

    load_factor = 1.0

    def __init__(self, load_factor: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._my_kwargs["load_factor"] = load_factor
        self.load_factor = load_factor

    def loads_info(self) -> Any:
        p, q, v = super().loads_info()
        return p * self.load_factor, q, v


class OddStepRules(BaseRules):  # type: ignore[misc]  # grid2op is untyped
    """Acting is illegal on odd steps, read from the env ``initialize`` gives."""

    def initialize(self, env: Any) -> None:
        self.env = env

    def __call__(self, action: Any, env: Any) -> tuple[bool, Any]:
        return not (self.env.nb_time_step % 2 and action.can_affect_something()), None


class Toggles(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Disconnects and reconnects a line in turn (illegal on odd steps under OddStepRules)."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        status = -1 if observation.current_step % 4 == 0 else 1
        return self.action_space({"set_line_status": [(3, status)]})


@pytest.mark.parametrize("copy_env", [False, True])
def test_a_users_backend_and_rules_play_as_in_grid2op(copy_env: bool) -> None:
    """A copy keeps neither what a LightSim subclass's ``__init__`` set (LightSim's copy takes a
    fixed list of attributes) nor the env rules keep from ``initialize``: such envs play a new
    build per episode (and copy_env builds too)."""
    env = make_env(backend=ScaledLoads(load_factor=1.5), gamerules_class=OddStepRules)
    try:
        expected = grid2op_run({**env.get_params_for_runner(), "agentClass": Toggles})

        async def main() -> list[Any]:
            async with AsyncRunner(env, agent=Toggles, workers=2, copy_env=copy_env) as runner:
                return [r.as_tuple() for r in await runner.run(3, **seeds(3))]

        assert played(anyio.run(main)) == expected
    finally:
        env.close()


class SimulatesOnce(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Simulates doing nothing once per step, then does it."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        observation.simulate(self.action_space({}))
        return self.action_space({})


def test_episodes_in_threads_count_their_own_simulations(env: Any) -> None:
    """grid2op's copy shares the high-resolution simulation counter: two copies playing at once
    in one process (a thread executor) counted each other's, and a new copy reset the other's."""

    async def main() -> list[Any]:
        with ThreadPoolExecutor(2) as executor:
            async with AsyncRunner(
                env, agent=SimulatesOnce, workers=2, executor=executor
            ) as runner:
                return await runner.run(4, max_iter=30, episode_id=[0, 1, 0, 1])

    results = anyio.run(main)
    assert [(r.nb_time_step, r.nb_highres_sim) for r in results] == [(30, 30)] * 4


# --- env parameters that plain pickle cannot send -------------------------------------------


def test_chronics_filter_lambda_is_honoured_as_in_grid2op() -> None:
    env = make_env(chronics_class=MultifolderWithCache)
    try:
        env.chronics_handler.real_data.set_filter(lambda path: not path.endswith("0001"))
        env.chronics_handler.reset()
        params = {**env.get_params_for_runner(), "agentClass": DoNothingAgent}
        ours = compat_run(params, 2)
    finally:
        env.close()
    expected = grid2op_run(params, 2)
    assert [r[0] for r in expected] == ["0000", "0002"]  # the chronics the filter kept
    assert ours == expected


def test_ids_follow_the_chronics_order_the_workers_play_after_a_shuffle_and_a_filter(
    tmp_path: Path,
) -> None:
    """grid2op's Runner and the workers play an env built from the params: a filter set without
    ``chronics_handler.reset()`` applies there, a shuffle does not. Ids, their wrap-around and
    ``resume`` follow that order, not the caller's env's."""
    env = make_env()
    try:
        env.chronics_handler.shuffle(lambda order: order[::-1])
        env.chronics_handler.set_filter(lambda path: not path.endswith("0001"))
        expected = grid2op_run({**env.get_params_for_runner(), "agentClass": DoNothingAgent}, 3)

        async def main() -> list[list[Any]]:
            async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
                return [
                    [r.as_tuple() for r in await runner.run(3, path_save=tmp_path, **kw)]
                    for kw in ({**seeds(3)}, {**seeds(3), "resume": True})
                ]

        first, resumed = anyio.run(main)
    finally:
        env.close()
    assert [r[0] for r in expected] == ["0000", "0002", "0000"]  # the filter's, wrapped
    assert played(first) == played(resumed) == expected
    saved = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert saved == ["0000", "0000_1", "0002"]  # resume played nothing again


class CountingAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Rebinds a counter at each step (``self.steps += 1``); from its 4th step on, disconnects
    a line."""

    def __init__(self, action_space: Any) -> None:
        super().__init__(action_space)
        self.steps = 0

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        self.steps += 1
        if self.steps >= 4:
            return self.action_space({"set_line_status": [(3, -1)]})
        return self.action_space({})


def test_each_episode_of_a_worker_plays_a_copy_of_the_instance_it_received() -> None:
    # As grid2op's Runner with several processes: both episodes play 3 steps from steps = 0
    # (a mutation audit: the instance itself played, the second episode went on counting).
    env = make_env()
    try:
        agent = CountingAgent(env.action_space)
        kwargs: dict[str, Any] = dict(max_iter=3, episode_id=[0, 0], env_seeds=[1, 1])
        params = {**env.get_params_for_runner(), "agentClass": None, "agentInstance": agent}
        runner = grid2ops(GridRunner, **params)
        expected = played(grid2ops(runner.run, 2, nb_process=2, **kwargs))

        async def main() -> list[Any]:
            async with AsyncRunner(env, agent=agent, workers=1) as runner:
                return [r.as_tuple() for r in await runner.run(2, **kwargs)]

        mine = played(anyio.run(main))
    finally:
        env.close()
    assert mine == expected and mine[0] == mine[1]
    assert agent.steps == 0  # nothing reached the instance held here


class RedispatchingAgent(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Asks for the same redispatching at every step: the env's redispatch solver runs."""

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return self.action_space({"redispatch": [(0, 1.0)]})


def test_redispatch_solver_argument_reaches_the_workers(env: Any) -> None:
    # grid2op 1.12.6 added redispatch solvers
    dispatch: Any = pytest.importorskip("grid2op.Environment.dispatch")
    from grid2op.Exceptions import ImpossibleRedispatching

    class NeverSolves(dispatch.BaseRedispatchSolver):  # type: ignore[misc]  # grid2op is untyped
        """Finds no dispatch: the first redispatching ends the episode (a game over)."""

        def solve(self, constraints: Any, state: Any) -> Any:
            failed = ImpossibleRedispatching("no dispatch, on purpose")
            return dispatch.RedispatchResult.failed(failed)

    params = {
        **env.get_params_for_runner(),
        "agentClass": RedispatchingAgent,
        "redispatch_solver": NeverSolves,
    }
    expected = grid2op_run(params, 2)
    assert [r[2] for r in expected] == [1, 1]  # the solver was used: game over at once
    assert compat_run(params, 2) == expected


# --- GRID2OP_RUNNER_FORCE_SEQUENTIAL -----------------------------------------------------------

# The processes PidAgent acted in (a forked worker appends to its own copy).
PIDS: list[int] = []


class PidAgent(DoNothingAgent):  # type: ignore[misc]  # grid2op is untyped
    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        PIDS.append(os.getpid())
        return super().act(observation, reward, done)


def test_force_sequential_plays_in_this_process_as_grid2op(
    env: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv(GridRunner.FORCE_SEQUENTIAL, "1")
    runs = {}
    for name, cls in (("grid2op", GridRunner), ("ours", compat.Runner)):
        PIDS.clear()
        params = {**env.get_params_for_runner(), "logger": logging.getLogger(f"fidelity.{name}")}
        runner = cls(**params, agentClass=PidAgent)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # grid2op's logger.warn
            results = played(runner.run(2, nb_process=2, **seeds(2)))
        runs[name] = (results, set(PIDS), logged_warnings(caplog, f"fidelity.{name}"))
    assert runs["ours"] == runs["grid2op"]
    assert runs["ours"][1] == {os.getpid()}
    assert runs["ours"][2] == [compat._LOG_SEQUENTIAL]


def test_force_sequential_is_read_as_grid2op_reads_it(
    env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = {**env.get_params_for_runner(), "agentClass": DoNothingAgent}
    monkeypatch.setenv(GridRunner.FORCE_SEQUENTIAL, "yes")
    for cls in (GridRunner, compat.Runner):
        runner = cls(**params)
        # Read only when several processes are asked for; then an integer, or ValueError.
        runner.run(1, nb_process=1, max_iter=2)
        with pytest.raises(ValueError, match="invalid literal for int"):
            runner.run(2, nb_process=2, max_iter=2)


class PlanAtReset(BaseAgent):  # type: ignore[misc]  # grid2op is untyped
    """Draws its plan at ``reset``, from its action space as seeded for the episode, and replays
    it: grid2op's Runner seeds the agent before its reset."""

    def reset(self, obs: Any) -> None:
        self.plan = self.action_space.sample()

    def act(self, observation: Any, reward: float, done: bool = False) -> Any:
        return self.plan


def test_an_agent_drawing_at_reset_draws_from_its_seeded_space_as_in_grid2op(env: Any) -> None:
    # (a mutation audit found no test telling the seed-then-reset order from the other)
    params = {**env.get_params_for_runner(), "agentClass": PlanAtReset}
    expected = grid2op_run(params)
    assert compat_run(params) == expected
    assert async_run(env, PlanAtReset) == expected
    assert len({reward for _, reward, _, _ in expected}) == 3
