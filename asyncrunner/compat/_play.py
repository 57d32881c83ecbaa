"""compat's episodes on asyncrunner's core: grid2op's arguments become one ``AsyncRunner.run``
on the runner's pool, and its results grid2op's tuples."""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np

from .._engine._recipe import env_key
from .._exceptions import EpisodeError, SinkError
from .._model import EpisodeFailed, EpisodeResult
from .._runner import AsyncRunner
from ..sinks._base import Sink
from ._rules import (
    check_resets,
    chronic_id,
    env_seed,
    grid2op_tuple,
    reset_options_for_core,
)
from ._session import AgentClass, AgentCopies, EnvView, Session
from ._sinks import EpisodeLog, Failures, ReplacingCompactWriter, ReplacingWriter, Sums

__all__ = ["call", "play"]


def play(
    runner: Any,
    *,
    ids: list[Any],
    options: list[dict[str, Any] | None],
    nb_process: int,
    path_save: str | os.PathLike[str] | None,
    pbar: Any,
    env_seeds: list[Any],
    agent_seeds: list[Any],
    max_iter: int | None,
    init_states: list[Any],
    detailed: bool,
    nb_highres: bool,
    raw_reward: bool,
    sequential: bool,
) -> list[tuple[Any, ...]]:
    """Play the episodes (grid2op's chronic ids and reset options) on the async core.

    ``sequential``: grid2op's Runner would play them in its sequential mode, which records every
    episode (``run_one_episode(detailed_output=True)``); otherwise it records those it saves or
    details, and all of them with ``CompactEpisodeData``. A recorded episode's actions are read
    with ``to_vect`` at each step, which changes how they play on some envs
    (``RunSettings.record``): the workers do the same exactly when grid2op would.
    """
    nb_episode = len(ids)
    env = runner._ar_template()
    if max_iter is not None:  # grid2op's checks (its reset's), with its errors: 5.9, 0
        max_iter = env._aux_check_max_iter(max_iter)
    core_options = reset_options_for_core(options, max_iter, init_states)
    ids = [chronic_id(ep_id, env) for ep_id in ids]
    compact = bool(runner.use_compact_episode_data)
    check_resets(env, core_options, init_states, compact=compact)
    env_seeds = [env_seed(seed) for seed in env_seeds]
    # numpy's RandomState, which seeds grid2op's agents, takes a bool as 0 / 1
    agent_seeds = [int(s) if isinstance(s, (bool, np.bool_)) else s for s in agent_seeds]
    sinks: list[Sink] = []
    if path_save is not None:
        writer: Sink
        writer = ReplacingCompactWriter(path_save) if compact else ReplacingWriter(path_save)
        sinks.append(writer)
    sinks.append(EpisodeLog(runner.logger))
    sums = Sums()
    sinks.append(sums)
    kwargs: dict[str, Any] = dict(
        nb_episode=nb_episode,
        path_save=None,
        max_iter=None if max_iter == -1 else max_iter,
        pbar=pbar,
        env_seeds=env_seeds,
        agent_seeds=agent_seeds,
        episode_id=ids,
        init_states=init_states,
        reset_options=core_options,
        sinks=sinks,
        add_detailed_output=("compact" if compact else True) if detailed else False,
        # Taken by ``call``, not a run option.
        _record_steps=sequential or path_save is not None or detailed or compact,
    )
    results = runner._ar_call(nb_process, nb_episode, kwargs)
    return [
        grid2op_tuple(
            r,
            sums.sums.get(r.index, ("float32", r.cum_reward)),
            compact=compact,
            raw_reward=raw_reward,
            detailed=detailed,
            path_save=path_save,
            nb_highres=nb_highres,
        )
        for r in results
    ]


def env_view(runner: Any, env: Any) -> EnvView:
    """``env`` with the runner's parameters: what the workers build their env from."""
    params = runner._get_params()
    for key in ("agentClass", "agentInstance", "logger", "mp_context", "_local_dir_cls"):
        params.pop(key, None)  # the worker's Runner gets its defaults
    # As grid2op's runs build their env: with the runner's parameters as they are now (set after
    # its construction too), and the max_iter its constructor put in gridStateclass_kwargs
    # (grid2op reads ``runner.max_iter`` there only: setting it later changes nothing).
    params["parameters_path"] = runner.parameters.to_dict()
    params["max_iter"] = -1
    return EnvView(env, params)


def call(
    runner: Any, nb_process: int, nb_episode: int, kwargs: dict[str, Any]
) -> list[EpisodeResult]:
    """Run ``kwargs`` (``AsyncRunner.run``'s) on the runner's pool: kept across calls in a
    ``with`` block, else started and stopped here."""
    kwargs = dict(kwargs)
    record = kwargs.pop("_record_steps", True)
    view = env_view(runner, runner._ar_template())
    agent: Any = runner.agent
    if runner._useclass:
        agent = AgentClass(runner.agentClass)
    elif nb_process == 1:  # grid2op plays each episode on a copy of the one before
        agent = AgentCopies(agent)
    keep = runner._ar_keep
    workers = nb_process if keep else min(nb_process, nb_episode)
    core = AsyncRunner(view, agent=agent, workers=workers)
    core._record_steps = record
    core._send_exceptions = True  # raised as grid2op's Runner raises them (below)
    if runner._ar_env_key == env_key(view):
        # The env grid2op's constructor built from these very parameters, never played: the
        # pristine env forked workers start with, rather than a second build here.
        core._lent_env = runner._ar_env
    session = runner._ar_session if keep else None
    if session is None:
        session = Session()
        if keep:
            runner._ar_session = session
    failures = Failures()
    if nb_process > 1:
        # grid2op's processes (episodes dealt round-robin) play on while one fails (each stops
        # at its first), and its Pool raises the failure that came first once all are done:
        # what they save, is saved.
        kwargs["on_error"] = "continue"
        kwargs["sinks"] = [*kwargs.get("sinks", ()), failures]
    try:
        results = session.run(core, kwargs)
        firsts: dict[int, EpisodeResult] = {}  # each process's first failure
        for r in results:
            if r.error is not None:
                firsts.setdefault(r.index % nb_process, r)
        if firsts:
            first = min(firsts.values(), key=lambda r: failures.order.get(r.index, 0))
            assert first.error is not None
            raise EpisodeError(first.error, [r for r in results if r.ok], first)
        return results
    except EpisodeError as exc:
        original = _original(exc.failure)
        if original is None:
            raise
        raise original from exc  # as multiprocessing raises a worker's, its traceback the cause
    except SinkError as exc:
        if failures.events:  # an episode failed before saving did: grid2op's Pool raises that
            error = EpisodeError(failures.events[0], exc.results)
            original = _original(failures.events[0])
            if original is None:
                raise error from exc
            raise original from error
        # Saving failed (a full disk...): grid2op's Runner raises what its writing raised.
        cause = exc.__cause__
        if not isinstance(cause, Exception):
            raise
        exc.__cause__ = exc.__context__ = None  # the chain ends: no loop back to the cause
        raise cause from exc
    finally:
        if not keep:
            session.close()


def _original(failure: EpisodeFailed) -> Exception | None:
    """The exception that failed the episode, as grid2op's Runner raises it (None if it did not
    come back from the worker, or cannot be unpickled here)."""
    if failure.exception is None:
        return None
    try:
        original = pickle.loads(failure.exception)
    except Exception:
        return None
    return original if isinstance(original, Exception) else None
