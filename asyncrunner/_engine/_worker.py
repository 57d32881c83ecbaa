"""What runs inside a worker process: the env cache, the per-episode reset contract, the step loop.

Functions here are called in a worker (one of ``_pools``) with picklable arguments (``_recipe``). A worker builds the env of a recipe once and keeps it, never played
(``_ENVS``); each episode plays a copy of it, the fresh env grid2op's Runner builds for every
episode, so results match grid2op's Runner bit for bit. Steps go back in batches (``_batch``)
over the run's channel (``_channel``), not as return values.
When the agent lives in the orchestrator (``CentralAgent``), ``_RemoteAgent`` stands in for it:
it sends each observation over the same channel and plays the action that comes back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import os
import pickle
import threading
import time
import traceback
import warnings
from typing import Any

import numpy as np

from .._model import EpisodeFailed, EpisodeFinished, EpisodeStarted
from . import _channel
from ._batch import Batcher, fill
from ._recipe import EpisodeJob, Recipe

__all__ = ["run_episode", "run_episodes", "warm"]

# How many envs one worker keeps (a worker may serve several runners in turn).
_MAX_ENVS = 2


class _Cached:
    """A pristine env built from a recipe, never played: each episode plays a copy of it.

    grid2op's Runner builds a new env for every episode. ``env.copy()`` of an env that was built
    and never stepped is that fresh env, whatever state its parts keep (opponents, rewards,
    chronics handlers and their caches, backends), at about 2 % of a build's cost; nothing an
    episode changes reaches the pristine env or the next episode.
    """

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.pristine: Any = self._build()
        self.other_reward_names = tuple(self.pristine.other_rewards)

    def _build(self) -> Any:
        from grid2op.Agent import DoNothingAgent
        from grid2op.Runner import Runner

        global _BUILDS
        _BUILDS += 1

        class OnceRunner(Runner):  # type: ignore[misc]  # grid2op is untyped
            # On Linux grid2op's Runner.__init__ builds an env (with init_env) and closes it;
            # keep that one instead of building a second (each build parses the grid: ~1 s).
            def init_env(self) -> Any:
                env, self.agent = self._new_env(self.parameters)
                self.built = env
                return contextlib.nullcontext(env)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner = OnceRunner(**self.recipe.params, agentClass=DoNothingAgent)
            built = getattr(runner, "built", None)
            return built if built is not None else runner._new_env(runner.parameters)[0]

    def episode_env(self) -> Any:
        """A fresh env for one episode (the caller closes it)."""
        if self.pristine is None:
            with _ENVS_LOCK:  # grid2op's class creation is not thread-safe
                self.pristine = self._build()
        if not getattr(self.pristine.backend, "_can_be_copied", True):
            # Its backend cannot be copied: play the pristine env itself, build another next time.
            env, self.pristine = self.pristine, None
            return env
        env = self.pristine.copy()
        # What grid2op's copy shares with the original and an episode changes (checked by
        # tests/test_parity.py on everything the pristine env holds): the high-resolution
        # simulation counter (shared on purpose; a fresh env counts from 0), and the initial
        # state meant to be constant, whose one-element arrays (a single shunt's setpoint, ...)
        # cannot be made read-only and are written by the episode through the env's and the
        # forecast env's state after a reset.
        env._highres_sim_counter._HighResSimCounter__nb_highres_called = 0
        for part in (env, getattr(env._observation_space, "obs_env", None)):
            if part is not None and part._cst_prev_state_at_init is not None:
                initial = part._cst_prev_state_at_init.copy()
                initial.prevent_modification()
                part._cst_prev_state_at_init = initial
        return env

    def close(self) -> None:
        if self.pristine is not None:
            self.pristine.close()

    def new_agent(self, env: Any) -> Any:
        kind, agent = self.recipe.agent_kind, self.recipe.agent
        if kind in ("class", "factory"):
            return agent(env.action_space)
        return copy.copy(agent)


class _CentralAgentFailed(Exception):
    """The orchestrator's agent raised; carries its error's type name and traceback."""

    def __init__(self, type_name: str, message: str, tb: str) -> None:
        super().__init__(message)
        self._ar_type = type_name
        self._ar_traceback = tb


class _RemoteAgent:
    """Stands for the agent in the orchestrator: observation out, action back, per step.

    The orchestrator seeds and resets its own agent (``AgentCall.first``).
    """

    # Actions decoded, by vector: ``from_vect`` costs more than a step; agents often reuse a few.
    _CACHE_SIZE = 256

    def __init__(self, job: EpisodeJob, env: Any) -> None:
        from grid2op.dtypes import dt_float

        self.job = job
        self.action_space = env.action_space
        self.row = np.empty(env.observation_space.n, dtype=dt_float)
        self.first = True
        self.cache: dict[bytes, Any] = {}

    def seed(self, seed: int) -> None:
        pass

    def reset(self, obs: Any) -> None:
        pass

    def act(self, obs: Any, reward: float, done: bool = False) -> Any:
        job = self.job
        fill(self.row, obs)
        call = _channel.AgentCall(
            run_id=job.run_id,
            index=job.index,
            attempt=job.attempt,
            observation=self.row,
            reward=float(reward),
            done=bool(done),
            agent_seed=job.agent_seed,
            first=self.first,
        )
        reply = _channel.call(job.address, job.token, call)
        self.first = False
        if reply[0] != "ok":
            raise _CentralAgentFailed(*reply[1:])
        vector = reply[1]
        key = vector.tobytes()
        action = self.cache.get(key)
        if action is None:
            action = self.action_space.from_vect(vector, check_legit=False)
            if len(self.cache) < self._CACHE_SIZE:
                self.cache[key] = action
        return action.copy()  # the env may keep or change what it is given


_ENVS: dict[str, _Cached] = {}
_BUILDS = 0
# Envs that an episode is playing now (a worker may play several episodes at once, in threads).
_IN_USE: set[str] = set()
_ENVS_LOCK = threading.Lock()


# Pristine envs this process holds for the workers it forks (``hold``), by recipe key, and how
# many holders each has. Never played here: a forked worker starts with them in its cache.
_HELD: dict[str, tuple[_Cached, int]] = {}


def hold(recipe_key: str, recipe_bytes: bytes) -> None:
    """Build a recipe's pristine env in this process, for the workers forked from it later.

    A forked worker then finds it in its cache: the fork copies it (pages shared until written),
    where a worker's own build parses the grid again (0.6 s for case14, several on big grids).
    The env is the one the worker would build, from the same recipe and code, and episodes play
    copies of it there as of any pristine env. A build that fails here is left to the workers,
    which report it as they do. Each ``hold`` is undone by one ``release``.
    """
    with _ENVS_LOCK:
        if recipe_key in _HELD:
            cached, holders = _HELD[recipe_key]
            _HELD[recipe_key] = (cached, holders + 1)
            return
        try:
            cached = _Cached(pickle.loads(recipe_bytes))
        except Exception:
            return
        _HELD[recipe_key] = (cached, 1)


def release(recipe_key: str) -> None:
    """Undo one ``hold``; the last one frees the env (workers forked before keep theirs)."""
    with _ENVS_LOCK:
        entry = _HELD.pop(recipe_key, None)
        if entry is None:  # its build failed here
            return
        cached, holders = entry
        if holders > 1:
            _HELD[recipe_key] = (cached, holders - 1)
            return
    cached.close()


def _after_fork() -> None:
    # A forked worker counts its own builds (EpisodeStarted.env_builds), not its parent's, and
    # takes a new lock: a thread of the parent may have held this one at the fork. The envs its
    # parent held for it are its cache's (the parent keeps, and later frees, its own copy).
    global _BUILDS, _ENVS_LOCK
    _BUILDS = 0
    _ENVS_LOCK = threading.Lock()
    _ENVS.update((key, cached) for key, (cached, _) in _HELD.items())
    _HELD.clear()


os.register_at_fork(after_in_child=_after_fork)


def _get_env(recipe_key: str, recipe_bytes: bytes, slot: int = 0, keep: int = _MAX_ENVS) -> _Cached:
    """The env of a recipe for episode slot ``slot`` of this worker (built if needed)."""
    key = recipe_key if slot == 0 else f"{recipe_key}#{slot}"
    with _ENVS_LOCK:  # builds too: grid2op's class creation is not thread-safe
        cached = _ENVS.pop(key, None)
        if cached is None:
            idle = [k for k in _ENVS if k not in _IN_USE]
            while len(_ENVS) >= max(keep, _MAX_ENVS) and idle:
                _ENVS.pop(idle.pop(0)).close()
            cached = _Cached(pickle.loads(recipe_bytes))
        _ENVS[key] = cached  # most recently used last
        _IN_USE.add(key)  # until the caller discards it
        return cached


def warm(recipe_key: str, recipe_bytes: bytes) -> int:
    """Build (or find) the env of a recipe; returns this worker's pid."""
    _get_env(recipe_key, recipe_bytes)
    _IN_USE.discard(recipe_key)
    return os.getpid()


def _reset_options(job: EpisodeJob) -> dict[str, Any]:
    options = dict(job.reset_options or {})
    options["time serie id"] = job.episode_id
    if job.max_iter is not None:
        options["max step"] = job.max_iter
    if job.init_state is not None:
        options["init state"] = copy.deepcopy(job.init_state)
    return options


def run_episodes(jobs: list[EpisodeJob]) -> list[str]:
    """Play several episodes at once, one thread and one env each (``run_episode`` each).

    Meant for agents in the orchestrator: while one episode waits for its action, another steps.
    """
    if len(jobs) == 1:
        return [run_episode(jobs[0])]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run_episode, job, slot, len(jobs)) for slot, job in enumerate(jobs)]
        return [f.result() for f in futures]


def run_episode(job: EpisodeJob, slot: int = 0, slots: int = 1) -> str:
    """Play one episode, streaming its events; returns ``"finished"`` or ``"failed"``.

    Exceptions of the agent or the env become an ``EpisodeFailed`` event; a broken channel raises.
    """
    send = _channel.connect(job.address, job.token)
    cached = _get_env(job.recipe_key, job.recipe, slot, slots)
    key = job.recipe_key if slot == 0 else f"{job.recipe_key}#{slot}"
    step = 0
    try:
        step = _play(job, cached, send)
    except _channel.ChannelClosed:
        raise
    except Exception as exc:
        failure = EpisodeFailed(
            run_id=job.run_id,
            index=job.index,
            attempt=job.attempt,
            error_type=getattr(exc, "_ar_type", type(exc).__name__),
            message=str(exc),
            traceback=getattr(exc, "_ar_traceback", None) or traceback.format_exc(),
            step=getattr(exc, "_ar_step", step),
        )
        send(failure)
        return "failed"
    finally:
        _IN_USE.discard(key)
    return "finished"


def _play(job: EpisodeJob, cached: _Cached, send: Any) -> int:
    env = cached.episode_env()
    try:
        return _play_on(job, env, cached, send)
    finally:
        env.close()


def _play_on(job: EpisodeJob, env: Any, cached: _Cached, send: Any) -> int:
    from grid2op.dtypes import dt_float

    names = cached.other_reward_names
    kind = cached.recipe.agent_kind
    agent = _RemoteAgent(job, env) if kind == "central" else cached.new_agent(env)
    obs = env.reset(seed=job.env_seed, options=_reset_options(job))
    if job.agent_seed is not None:
        agent.seed(job.agent_seed)
    agent.reset(obs)
    chronics = env.chronics_handler
    max_ts = max(chronics.max_timestep(), 0)
    send(_started(job, env, obs, names, max_ts))
    batch = Batcher(job, env, len(names), send)
    can_skip = type(env).CAN_SKIP_TS
    time_step = 0
    time_act = 0.0
    cum_reward = dt_float(0.0)
    reward = float(env.reward_range[0])
    done = False
    beg_ = time.perf_counter()
    try:
        while not done:
            beg__ = time.perf_counter()
            act = agent.act(obs, reward, done)
            end__ = time.perf_counter()
            time_act += end__ - beg__
            if can_skip:
                for (obs, reward, done, info), attack in zip(*env.steps(act), strict=True):
                    time_step += 1
                    cum_reward += reward
                    batch.add(env, act, obs, reward, done, info, attack, end__ - beg__, names)
            else:
                obs, reward, done, info = env.step(act)
                time_step += 1
                cum_reward += reward
                batch.add(
                    env,
                    act,
                    obs,
                    reward,
                    done,
                    info,
                    env._oppSpace.last_attack,
                    end__ - beg__,
                    names,
                )
    except Exception as exc:
        batch.flush()
        exc._ar_step = time_step  # type: ignore[attr-defined]  # read by run_episode
        raise
    end_ = time.perf_counter()
    batch.flush()
    send(_finished(job, env, cum_reward, time_step, max_ts, time_act, end_ - beg_))
    return time_step


def _started(
    job: EpisodeJob, env: Any, obs: Any, names: tuple[str, ...], max_ts: int
) -> EpisodeStarted:
    """The start of an episode just reset: what grid2op's EpisodeData records of it."""
    from grid2op.dtypes import dt_float

    chronics = env.chronics_handler
    return EpisodeStarted(
        run_id=job.run_id,
        index=job.index,
        attempt=job.attempt,
        chronics_path=str(chronics.get_id()),
        name=str(chronics.get_name()),
        max_ts=int(max_ts),
        env_seed=job.env_seed,
        agent_seed=job.agent_seed,
        worker=os.getpid(),
        env_builds=_BUILDS,
        observation=obs.to_vect() if job.detail else np.empty(0, dtype=dt_float),
        parameters=env.parameters.to_dict(),
        meta={
            "chronics_max_timestep": str(chronics.max_timestep()),
            "grid_path": str(env._init_grid_path),
            "backend_type": type(env.backend).__name__,
            "env_type": type(env).__name__,
        },
        other_reward_names=names,
        episode_id=job.episode_id,
        max_iter=job.max_iter,
        max_episode_duration=int(env.max_episode_duration()),
        action_space_seed=env.action_space.seed_used,
        mix=job.mix,
    )


def _finished(
    job: EpisodeJob,
    env: Any,
    cum_reward: Any,
    time_step: int,
    max_ts: int,
    time_act: float,
    total: float,
) -> EpisodeFinished:
    """The end of an episode played: grid2op's ``episode_times.json`` among it."""
    chronics = env.chronics_handler
    return EpisodeFinished(
        run_id=job.run_id,
        index=job.index,
        attempt=job.attempt,
        chronics_path=str(chronics.get_id()),
        name=str(chronics.get_name()),
        cum_reward=float(cum_reward),
        nb_time_step=int(time_step),
        max_ts=int(max_ts),
        env_seed=job.env_seed,
        agent_seed=job.agent_seed,
        nb_highres_sim=int(env.nb_highres_called),
        times={
            "Env": {
                "total": float(env._time_apply_act + env._time_powerflow + env._time_extract_obs),
                "apply_act": float(env._time_apply_act),
                "powerflow_computation": float(env._time_powerflow),
                "observation_computation": float(env._time_extract_obs),
            },
            "Agent": {"total": float(time_act)},
            "total": float(total),
        },
    )
