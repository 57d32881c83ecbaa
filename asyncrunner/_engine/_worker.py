"""What runs inside a worker process: the per-episode reset options and the step loop.

Functions here are called in a worker (one of ``_pools``) with picklable arguments (``_recipe``).
Each episode plays a copy of its recipe's pristine env (``_envs``), the fresh env grid2op's
Runner builds for every episode, so results match grid2op's Runner bit for bit. Steps go back in
batches (``_batch``) over the run's channel (``_channel``), not as return values; when the run
saves episodes, their files are built here at the end (``sinks._files``), written here too when
this machine is the orchestrator's, and sent (or where they are) with ``EpisodeFinished``.
When the agent lives in the orchestrator (``CentralAgent``), ``_RemoteAgent`` stands in for it:
it sends each observation over the same channel and plays the action that comes back.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import time
import traceback
from concurrent.futures import ThreadPoolExecutor  # imported before any fork (see _layout)
from typing import Any

import cloudpickle
import numpy as np

from .._exceptions import text_of
from .._model import EpisodeFailed, EpisodeFinished, EpisodeStarted
from .._plan._layout import reset_key
from ..sinks._buffer import EpisodeBuffer
from ..sinks._files import episode_files
from . import _channel
from ._batch import Batcher, fill
from ._envs import _Cached, builds, discard, exclusive, get_env
from ._parsed import parsing_once
from ._recipe import EpisodeJob

__all__ = ["run_episode", "run_episodes"]


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
        names = _EXTRAS.get(type(obs))
        if names is None:
            names = _EXTRAS[type(obs)] = _extra_names(obs)
        call = _channel.AgentCall(
            run_id=job.run_id,
            index=job.index,
            attempt=job.attempt,
            observation=self.row,
            reward=float(reward),
            done=bool(done),
            agent_seed=job.agent_seed,
            first=self.first,
            extras={name: getattr(obs, name) for name in names},
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


# The values of an observation class that its vector leaves out, by class (``_extra_names``).
_EXTRAS: dict[type, tuple[str, ...]] = {}


def _extra_names(obs: Any) -> tuple[str, ...]:
    """The attributes of ``obs`` holding values (arrays, numbers) that ``to_vect`` leaves out and
    ``from_vect`` cannot rebuild: its thermal limits, voltage angles, alarm state, shunts..."""
    in_vector = set(type(obs).attr_list_vect)
    return tuple(
        name
        for name, value in vars(obs).items()
        if name not in in_vector
        and name != "_vectorized"  # the cached vector itself
        and isinstance(value, (np.ndarray, np.generic, bool, int, float))
    )


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
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run_episode, job, slot, len(jobs)) for slot, job in enumerate(jobs)]
        return [f.result() for f in futures]


# What fails an episode: anything its code raises, a ``sys.exit``, ``KeyboardInterrupt``,
# ``asyncio.CancelledError`` or a library's own ``BaseException`` too (a worker ignores Ctrl-C,
# the parent stops the run): sent back to the caller, they would end its program or look like the
# cancellation of its dispatching task, not fail the episode.
_EPISODE_ERRORS = BaseException


def run_episode(job: EpisodeJob, slot: int = 0, slots: int = 1) -> str:
    """Play one episode, streaming its events; returns ``"finished"`` or ``"failed"``.

    Exceptions of the agent or the env become an ``EpisodeFailed`` event (``_EPISODE_ERRORS``);
    a broken channel raises.
    """
    if job.claim:  # (first: a claim may open a new connection, which ``send`` must use)
        _channel.claim(job.address, job.token, job.claim_key)
    send = _channel.connect(job.address, job.token)
    key = None
    progress = [0]  # steps played, set by ``_play`` as it ends (the user's exception untouched)
    try:
        # A recipe this worker cannot load or build (a package missing or of another version, an
        # env folder it cannot see) fails the episode with its traceback, like the agent's errors.
        key, cached = get_env(
            job.recipe_key,
            lambda: _channel.recipe(job.address, job.token, job.recipe_key),
            slot,
            slots,
        )
        _play(job, cached, send, progress)
    except _channel.ChannelClosed:
        raise
    except _EPISODE_ERRORS as exc:
        failure = EpisodeFailed(
            run_id=job.run_id,
            index=job.index,
            attempt=job.attempt,
            error_type=getattr(exc, "_ar_type", type(exc).__name__),
            message=text_of(exc),
            traceback=getattr(exc, "_ar_traceback", None) or traceback.format_exc(),
            step=progress[0],
            exception=_pickled(exc) if job.exceptions else None,
        )
        send(failure)
        return "failed"
    finally:
        if key is not None:
            discard(key)
    return "finished"


def _play(job: EpisodeJob, cached: _Cached, send: Any, progress: list[int]) -> None:
    with exclusive():
        env = cached.episode_env()
    try:
        _play_on(job, env, cached, send, progress)
    finally:
        with exclusive():
            env.close()


def _play_on(job: EpisodeJob, env: Any, cached: _Cached, send: Any, progress: list[int]) -> None:
    from grid2op.dtypes import dt_float

    names = cached.other_reward_names
    kind = cached.recipe.agent_kind
    agent = _RemoteAgent(job, env) if kind == "central" else cached.new_agent(env)
    # parsing_once: a chronic played before is not parsed again.
    with exclusive(), parsing_once():
        obs = env.reset(seed=job.env_seed, options=_reset_options(job))
    if job.agent_seed is not None:
        agent.seed(job.agent_seed)
    agent.reset(obs)
    chronics = env.chronics_handler
    max_ts = max(chronics.max_timestep(), 0)
    started = _started(job, env, obs, names, max_ts)
    send(started)
    # The run saves episodes: their files are built here, from the rows kept in this buffer.
    keep = EpisodeBuffer(started, _spare()) if job.files else None
    batch = Batcher(job, env, len(names), send, keep)
    can_skip = type(env).CAN_SKIP_TS
    time_step = 0
    time_act = 0.0
    cum_reward = dt_float(0.0)
    cum_reward64 = 0.0  # as CompactEpisodeData sums: float(reward), in float64
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
                with exclusive():
                    played = list(zip(*env.steps(act), strict=True))
                for (obs, reward, done, info), attack in played:
                    time_step += 1
                    cum_reward += reward
                    cum_reward64 += float(reward)
                    batch.add(env, act, obs, reward, done, info, attack, end__ - beg__, names)
            else:
                with exclusive():
                    obs, reward, done, info = env.step(act)
                time_step += 1
                cum_reward += reward
                cum_reward64 += float(reward)
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
    except _EPISODE_ERRORS:
        batch.flush()
        progress[0] = time_step
        raise
    end_ = time.perf_counter()
    progress[0] = time_step
    last = [b for b in [batch.take()] if b is not None]
    finished = _finished(
        job, env, (cum_reward, cum_reward64), time_step, max_ts, time_act, end_ - beg_
    )
    if keep is not None:
        try:
            files = episode_files(
                keep, finished, job.files, job.agent, cached.recipe.env_key, job.stages
            )
        except Exception:
            send(*last)
            raise
        finished = dataclasses.replace(finished, files=files)
        _SPARE.append(keep.release())
    if batch.objects is not None:
        finished = dataclasses.replace(finished, objects=_objects_pickled(batch.objects))
    send(*last, finished)  # one write: one wake-up of the orchestrator


# A failed episode's exception larger than this, pickled, is not sent (it holds an env...).
_EXCEPTION_MAX_BYTES = 1 << 20


def _pickled(exc: BaseException) -> bytes | None:
    """``exc`` pickled as multiprocessing sends a worker's exception back, if it can be (by
    value where its class cannot be by reference: one the caller sent by value comes back as
    the caller's own)."""
    if not isinstance(exc, Exception) or isinstance(exc, _CentralAgentFailed):
        return None  # SystemExit, KeyboardInterrupt... end the episode only (README)
    try:
        # By reference first: a class of the caller's script (``__main__``, which a forked
        # worker shares) is then the caller's own, which its ``except`` clauses catch; by
        # value otherwise (cloudpickle: a class defined in a function).
        data: bytes = pickle.dumps(exc, protocol=4)
    except Exception:
        try:
            data = cloudpickle.dumps(exc, protocol=4)
        except Exception:
            return None
    return data if len(data) <= _EXCEPTION_MAX_BYTES else None


def _objects_pickled(steps: list[tuple[Any, Any, Any, Any]]) -> bytes:
    """Each step's agent action, env action, observation and attack, pickled as grid2op's Runner
    sends its EpisodeData back (``make_serializable``: the observations without their simulator;
    one pickle: an object kept at several steps stays one). Where they cannot be (an action
    holding a lock...), the reason, a pickled ``str``: the orchestrator then builds them from
    their vectors and warns."""
    for _, env_action, obs, _ in steps:
        # grid2op's Runner reads the env's action with ``to_vect`` at its step, which builds
        # what an action builds on first read; ``Batcher`` reads the same vector without. Built
        # now: the action changes no more after its step, and building it during the episode
        # changed which leftover bytes an observation's attributes that grid2op leaves
        # uninitialized hold (l2rpn_idf_2023's last ``attack_under_alert``: no longer grid2op's).
        env_action.to_vect()
        obs._obs_env = None
        obs._ptr_kwargs_env = None
    data = io.BytesIO()
    try:
        _GridPickler(data, protocol=pickle.HIGHEST_PROTOCOL).dump(steps)
    except Exception:
        try:
            return bytes(cloudpickle.dumps(steps, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:
            return pickle.dumps(f"{type(exc).__name__}: {exc}")
    return data.getvalue()


class _GridPickler(pickle.Pickler):
    """Pickles grid2op's objects as their ``GridObjects.__reduce__`` does (their class rebuilt
    by ``init_grid_from_dict_for_pickle`` where it is not found, and their state), with each
    class's attributes once, not once per object: 2.3 to 7.7 times as fast on a whole episode's
    steps (case14, l2rpn_idf_2023), and a third of the bytes."""

    def reducer_override(self, obj: Any) -> Any:
        from grid2op.Space import GridObjects

        if isinstance(obj, type):
            if issubclass(obj, GridObjects) and "_INIT_GRID_CLS" in vars(obj):  # an env's
                attributes: dict[str, Any] = {}
                GridObjects._make_cls_dict_extended(obj, attributes, as_list=False)
                return _grid_class, (obj.__name__, vars(obj)["_INIT_GRID_CLS"], attributes)
        elif isinstance(obj, GridObjects) and type(obj).__reduce__ is GridObjects.__reduce__:
            return _grid_object, (type(obj),), obj.__getstate__()
        return NotImplemented


def _grid_class(name: str, base: type, attributes: dict[str, Any]) -> type:
    from grid2op.Space import GridObjects

    return type(GridObjects.init_grid_from_dict_for_pickle(name, base, attributes))


def _grid_object(cls: Any) -> Any:
    return cls.__new__(cls)


# The arrays of this process's last saved episodes (one per episode played at once), for the
# next ones: allocating them afresh costs page faults (10 ms per 300 steps of l2rpn_idf_2023).
_SPARE: list[dict[str, np.ndarray]] = []


def _spare() -> dict[str, np.ndarray] | None:
    try:
        return _SPARE.pop()
    except IndexError:
        return None


def _started(
    job: EpisodeJob, env: Any, obs: Any, names: tuple[str, ...], max_ts: int
) -> EpisodeStarted:
    """The start of an episode just reset: what grid2op's EpisodeData records of it."""
    from grid2op.dtypes import dt_float

    chronics = env.chronics_handler
    # grid2op's Runner reads the first observation with ``to_vect`` when it records (and keeps
    # the vector in it, which the agent's own ``to_vect`` then returns: ``Batcher.add``).
    vector = obs.to_vect() if job.record or job.detail or job.files else None
    empty = np.empty(0, dtype=dt_float)
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
        env_builds=builds(),
        observation=vector if vector is not None and (job.detail or job.files) else empty,
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
        reset=reset_key(job.max_iter, job.init_state, job.reset_options),
        max_episode_duration=int(env.max_episode_duration()),
        action_space_seed=env.action_space.seed_used,
        mix=job.mix,
    )


def _finished(
    job: EpisodeJob,
    env: Any,
    sums: tuple[Any, float],
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
        cum_reward=float(sums[0]),
        cum_reward_type=np.result_type(sums[0]).name,
        cum_reward64=sums[1],
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
