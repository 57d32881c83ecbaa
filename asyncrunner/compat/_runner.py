"""A synchronous drop-in for ``grid2op.Runner.Runner``, playing its episodes on asyncrunner.

    from asyncrunner.compat import Runner  # instead of: from grid2op.Runner import Runner

    runner = Runner(**env.get_params_for_runner(), agentClass=RandomAgent)
    results = runner.run(nb_episode=4, nb_process=2, path_save="runs/demo")

``Runner`` *is* grid2op's Runner (a subclass): same constructor, argument checks, errors and
attributes (``envClass``, ``parameters``, ``path_chron``, ``thermal_limit_a``, ``agentClass``,
...). ``run()`` and ``run_one_episode()`` take grid2op's arguments, raise grid2op's errors for bad
ones and return grid2op's tuples ``(id_chron, name_chron, cum_reward, nb_time_step, max_ts)``,
plus the ``EpisodeData`` (``CompactEpisodeData`` with ``use_compact_episode_data=True``) with
``add_detailed_output=True`` and then the high-resolution simulation count with
``add_nb_highres_sim=True``. The episodes play in ``nb_process`` asyncrunner worker processes.

The calls are synchronous and work where an event loop is already running (a Jupyter cell, an
async handler calling sync code): the async core always runs on an event loop of its own, in a
thread (anyio's blocking portal), never on the caller's.

The worker pool lives for one ``run()`` / ``run_one_episode()`` call: the workers start, build the
env, play and stop. To keep them (and the env each one built) across calls, use the runner as a
context manager: ``with Runner(...) as runner:`` keeps one pool until the block ends (or until
``runner.close()``); it is rebuilt when ``nb_process`` or the agent changes.

Where it differs from grid2op's Runner:

- Results come in request order. (grid2op groups them by process when ``nb_process > 1``:
  0, 2, 4, 1, 3, 5 for two processes; with one process the two agree.)
- Saving follows grid2op's layout and its overwriting: an episode's files replace those of the
  same chronic already in ``path_save`` (its folder's other files stay, as with grid2op), but
  atomically: the episode's files are either the old episode's or the new one's, never a mix.
- An agent instance (``agentInstance=``) is copied to the worker processes, as grid2op does with
  ``nb_process > 1``: what an episode changes in the agent does not reach the instance held here.
  As in grid2op, with ``nb_process=1`` each episode plays a shallow copy of the agent the episode
  before played (attributes an episode sets carry over; across calls only inside ``with``), with
  ``nb_process > 1`` a shallow copy of the instance its worker received (they start again);
  objects an episode changes in place (a list, actions grid2op builds as it records them) are
  shared by the episodes of a worker, as by those of a grid2op process. An agent class is built
  in the workers with the class attributes it has here, set once per worker (as in a forked
  process: ``OneChangeThenNothing.gen_next(...)`` works, and what its episodes set on the class
  stays for the worker's next ones).
- Workers build the env from the runner's parameters; what they cannot import (agents, solvers,
  chronics filters defined in a function or as lambdas) goes by value (cloudpickle). A subclass
  that overrides ``init_env``, ``_new_env`` or ``_make_new_backend``, or an agent that cannot be
  pickled even so (it holds a lock), plays in this process, one episode at a time, with grid2op's
  own code (with a warning). So does, as in grid2op and without a warning, an agent instance
  that ``copy.copy`` cannot copy, and ``nb_process > 1`` with ``GRID2OP_RUNNER_FORCE_SEQUENTIAL``
  set to an integer > 0.
- A failed episode raises the agent's or env's own exception, as grid2op's Runner does (a copy
  pickled in the worker, as multiprocessing's), caused by an ``asyncrunner.EpisodeError`` that
  holds the worker's traceback; the ``EpisodeError`` itself when the exception cannot be
  pickled (or unpickled here). Saving that fails (a full disk) raises what the writing raised,
  caused by an ``asyncrunner.SinkError``.
- ``mp_context`` is not used: workers are asyncrunner's (forked on Linux, fresh interpreters
  elsewhere), whatever the context asked.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

from grid2op.Action import BaseAction
from grid2op.Runner import Runner as _GridRunner

from .._engine._envs import disown, exclusive
from .._engine._parsed import parsing_once
from .._engine._recipe import dumps, env_key
from .._exceptions import EpisodeError
from .._model import EpisodeResult
from .._quiet import quiet
from ._play import call, env_view, play
from ._rules import (
    KEY_TIME_SERIE_ID,
    check_init_states,
    check_lengths,
    check_reset_options,
    ids_and_options,
    methods_taken,
)
from ._session import Session

__all__ = ["Runner"]

# Runner methods that build the env: a subclass overriding one plays in-process (grid2op's code).
_ENV_HOOKS = ("init_env", "_new_env", "_make_new_backend")
# grid2op's Runner._run_parrallel, when it falls back to playing in its own process.
_LOG_SEQUENTIAL = (
    "Runner.run_parrallel: number of process set to 1. Failing back into sequential mode."
)


class Runner(_GridRunner):  # type: ignore[misc]  # grid2op is untyped (Any base class)
    """grid2op's ``Runner``, playing episodes in asyncrunner's worker processes.

    Build it as grid2op's: ``Runner(**env.get_params_for_runner(), agentClass=...)`` (or
    ``agentInstance=...``). ``nb_process`` is the number of worker processes. See the module's
    documentation for the pool's lifetime and the few differences with grid2op.
    """

    _ar_session: Session | None = None
    _ar_env: Any = None
    # The ``env_key`` of the workers' env when ``_ar_env`` was built: while the runner's
    # parameters give the same, ``_ar_env`` is the runs' pristine env (``_play.call``).
    _ar_env_key: str | None = None
    # Frees ``_ar_env`` once (``close``, or this runner collected: scripts do not close grid2op's).
    _ar_free: weakref.finalize[[Any], Runner] | None = None
    _ar_keep = False
    # Set while grid2op's constructor runs: the env its init_env builds is kept (``_ar_env``).
    _ar_capture = False
    # Set while grid2op's own _run_sequential plays here: its run_one_episode calls stay here.
    _ar_here = False

    # --- lifetime ----------------------------------------------------------------------------

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # grid2op's constructor builds an env (on Linux, with init_env) only to close it: the
        # runs keep that one (chronic names, spaces) rather than build a second (about 1 s).
        # parsing_once: the grid's and the first chronic's files come parsed from this process's
        # cache (the grid also from the disk's) when a build parsed them before: the same parse
        # of the same bytes (on l2rpn_case14_sandbox, 1.1 s -> 0.2-0.3 s). Under ``exclusive()``,
        # as every env this process holds for the workers it forks is built: a fork during a
        # build in another thread (two threads' runners) started workers whose after-fork hooks
        # failed ("Exception ignored in: ... Random.seed ... SystemError"; 6 of 24 forks).
        self._ar_capture = True
        try:
            with exclusive(), parsing_once():
                super().__init__(*args, **kwargs)
        finally:
            self._ar_capture = False
        self._ar_note_env()

    # grid2op's parameters, for help(), IDEs and code reading them (grid2op's own tests check
    # that what ``_get_params`` returns can build a runner, from this signature)
    __init__.__signature__ = inspect.signature(_GridRunner.__init__)  # type: ignore[attr-defined]

    def init_env(self) -> Any:
        env = super().init_env()
        # A subclass's own init_env gets the env itself (it plays in this process: see below).
        if self._ar_capture and self._ar_env is None and type(self).init_env is Runner.init_env:
            self._ar_env = env
            return contextlib.nullcontext(env)  # grid2op closes what it gets: not this one
        return env

    def __enter__(self) -> Runner:
        """Keep one worker pool across the calls made in the ``with`` block."""
        self._ar_keep = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker pool kept by ``with`` (if any) and free the env held for the runs."""
        self._ar_keep = False
        session, self._ar_session = self._ar_session, None
        free, self._ar_free = self._ar_free, None
        self._ar_env = self._ar_env_key = None
        try:
            if session is not None:
                session.close()
        finally:
            if free is not None:
                free()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_ar_session", "_ar_env", "_ar_free", "_ar_keep"):
            state.pop(key, None)
        return state

    # --- grid2op's entry points --------------------------------------------------------------

    def run(
        self,
        nb_episode: int,
        *,
        nb_process: int = 1,
        path_save: str | os.PathLike[str] | None = None,
        max_iter: int | None = None,
        pbar: Any = False,
        env_seeds: Sequence[int] | None = None,
        agent_seeds: Sequence[int] | None = None,
        episode_id: Sequence[int | str] | None = None,
        add_detailed_output: bool = False,
        add_nb_highres_sim: bool = False,
        init_states: Any = None,
        reset_options: Any = None,
    ) -> list[tuple[Any, ...]]:
        """Play ``nb_episode`` episodes, as ``grid2op.Runner.Runner.run`` (same arguments, errors
        and tuples), in ``nb_process`` worker processes; results in request order."""
        check_lengths(nb_episode, env_seeds, agent_seeds, episode_id)
        init_states = check_init_states(init_states, nb_episode)
        reset_options = check_reset_options(
            reset_options, nb_episode, self.envClass.KEYS_RESET_OPTIONS
        )
        if max_iter is not None:
            max_iter = int(max_iter)
        if nb_episode == 0:
            return []
        if nb_process <= 0:
            raise RuntimeError("Impossible to run using less than 1 process.")
        self._Runner__used = True
        self.logger.info("Sequential runner used." if nb_process == 1 else "Parallel runner used.")
        return self._ar_run_many(
            nb_episode,
            nb_process=nb_process,
            path_save=path_save,
            pbar=pbar,
            env_seeds=env_seeds,
            agent_seeds=agent_seeds,
            max_iter=max_iter,
            episode_id=episode_id,
            add_detailed_output=add_detailed_output,
            add_nb_highres_sim=add_nb_highres_sim,
            init_states=init_states,
            reset_options=reset_options,
        )

    def run_one_episode(
        self,
        indx: int = 0,
        path_save: str | os.PathLike[str] | None = None,
        pbar: Any = False,
        env_seed: int | None = None,
        max_iter: int | None = None,
        agent_seed: int | None = None,
        episode_id: int | str | None = None,
        detailed_output: bool = False,
        add_nb_highres_sim: bool = False,
        init_state: Any = None,
        reset_options: dict[str, Any] | None = None,
    ) -> tuple[Any, ...]:
        """Play one episode, as grid2op's ``run_one_episode``: ``(id_chron, name_chron,
        cum_reward, nb_time_step, max_ts[, episode_data][, nb_highres_sim])``."""
        if self._ar_here or self._ar_in_process_reason() is not None or self._ar_as_grid2op(1):
            return tuple(
                super().run_one_episode(
                    indx=indx,
                    path_save=path_save,
                    pbar=pbar,
                    env_seed=env_seed,
                    max_iter=max_iter,
                    agent_seed=agent_seed,
                    episode_id=episode_id,
                    detailed_output=detailed_output,
                    add_nb_highres_sim=add_nb_highres_sim,
                    init_state=init_state,
                    reset_options=reset_options,
                )
            )
        ep_id: int | str = indx
        if episode_id is not None:
            ep_id = episode_id
        elif reset_options is not None and KEY_TIME_SERIE_ID in reset_options:
            ep_id = int(reset_options[KEY_TIME_SERIE_ID])
            del reset_options[KEY_TIME_SERIE_ID]  # as grid2op does, in the caller's dict
        try:
            (result,) = play(
                self,
                ids=[ep_id],
                options=[reset_options],
                nb_process=1,
                path_save=path_save,
                pbar=pbar,
                env_seeds=[env_seed],
                agent_seeds=[agent_seed],
                max_iter=max_iter,
                init_states=[init_state],
                detailed=detailed_output,
                nb_highres=add_nb_highres_sim,
                raw_reward=True,
                sequential=False,
            )
        finally:
            if reset_options is not None:  # grid2op's episode writes them in the caller's dict
                reset_options[KEY_TIME_SERIE_ID] = ep_id
                if max_iter is not None:
                    reset_options["max step"] = max_iter
                if init_state is not None:
                    reset_options["init state"] = init_state
            state = (reset_options or {}).get("init state", init_state)
            if isinstance(state, dict):
                state.pop("method", None)  # grid2op's env.reset takes it out of the state's dict
        return result

    def _run_sequential(
        self,
        nb_episode: int,
        path_save: str | os.PathLike[str] | None = None,
        pbar: Any = False,
        env_seeds: Sequence[int] | None = None,
        agent_seeds: Sequence[int] | None = None,
        max_iter: int | None = None,
        episode_id: Sequence[int | str] | None = None,
        add_detailed_output: bool = False,
        add_nb_highres_sim: bool = False,
        init_states: Any = None,
        reset_options: Any = None,
    ) -> list[tuple[Any, ...]]:
        return self._ar_run_many(
            nb_episode,
            nb_process=1,
            path_save=path_save,
            pbar=pbar,
            env_seeds=env_seeds,
            agent_seeds=agent_seeds,
            max_iter=max_iter,
            episode_id=episode_id,
            add_detailed_output=add_detailed_output,
            add_nb_highres_sim=add_nb_highres_sim,
            init_states=init_states,
            reset_options=reset_options,
        )

    def _run_parrallel(
        self,
        nb_episode: int,
        nb_process: int = 1,
        path_save: str | os.PathLike[str] | None = None,
        env_seeds: Sequence[int] | None = None,
        agent_seeds: Sequence[int] | None = None,
        max_iter: int | None = None,
        episode_id: Sequence[int | str] | None = None,
        add_detailed_output: bool = False,
        add_nb_highres_sim: bool = False,
        init_states: Any = None,
        reset_options: Any = None,
    ) -> list[tuple[Any, ...]]:
        if nb_process <= 0:
            raise RuntimeError("Runner: you need at least 1 process to run episodes")
        return self._ar_run_many(
            nb_episode,
            nb_process=nb_process,
            path_save=path_save,
            pbar=False,
            env_seeds=env_seeds,
            agent_seeds=agent_seeds,
            max_iter=max_iter,
            episode_id=episode_id,
            add_detailed_output=add_detailed_output,
            add_nb_highres_sim=add_nb_highres_sim,
            init_states=init_states,
            reset_options=reset_options,
        )

    # --- the async core ----------------------------------------------------------------------

    def _ar_run_many(
        self,
        nb_episode: int,
        *,
        nb_process: int,
        path_save: str | os.PathLike[str] | None,
        pbar: Any,
        env_seeds: Sequence[int] | None,
        agent_seeds: Sequence[int] | None,
        max_iter: int | None,
        episode_id: Sequence[int | str] | None,
        add_detailed_output: bool,
        add_nb_highres_sim: bool,
        init_states: Any,
        reset_options: Any,
    ) -> list[tuple[Any, ...]]:
        reason = self._ar_in_process_reason()
        if reason is not None:
            warnings.warn(
                f"asyncrunner.compat.Runner: {reason}: the episodes play in this process, one "
                "at a time, with grid2op's own Runner code",
                stacklevel=3,
            )
        as_grid2op = reason is None and self._ar_as_grid2op(nb_process)
        if as_grid2op and nb_process > 1:
            # grid2op's Runner._run_parrallel logs this (with `logger.warn`) and plays here.
            self.logger.warning(_LOG_SEQUENTIAL)
        if reason is not None or as_grid2op:
            self._ar_here = True
            try:
                result: list[tuple[Any, ...]] = _GridRunner._run_sequential(
                    self,
                    nb_episode,
                    path_save=path_save,
                    pbar=pbar,
                    env_seeds=env_seeds,
                    agent_seeds=agent_seeds,
                    max_iter=max_iter,
                    episode_id=episode_id,
                    add_detailed_output=add_detailed_output,
                    add_nb_highres_sim=add_nb_highres_sim,
                    init_states=init_states,
                    reset_options=reset_options,
                )
            finally:
                self._ar_here = False
            return result
        if isinstance(init_states, (dict, BaseAction)):
            init_states = [init_states.copy() for _ in range(nb_episode)]
        ids, options = ids_and_options(nb_episode, episode_id, reset_options)
        states = [None] * nb_episode if init_states is None else list(init_states)
        taken = methods_taken(states, options, int(nb_process))
        reached = nb_episode  # the episodes reset: with one process, up to a failed one
        try:
            return play(
                self,
                ids=ids,
                options=options,
                nb_process=int(nb_process),
                path_save=path_save,
                pbar=pbar if nb_process == 1 else False,  # (grid2op's parallel runs draw no bar)
                env_seeds=[None] * nb_episode if env_seeds is None else list(env_seeds),
                agent_seeds=[None] * nb_episode if agent_seeds is None else list(agent_seeds),
                max_iter=max_iter,
                init_states=states,
                detailed=add_detailed_output,
                nb_highres=add_nb_highres_sim,
                raw_reward=False,
                sequential=nb_process == 1,
            )
        except BaseException as exc:
            failed = exc if isinstance(exc, EpisodeError) else exc.__cause__
            reached = failed.failure.index + 1 if isinstance(failed, EpisodeError) else 0
            raise
        finally:
            if nb_process == 1:  # grid2op's processes take it out of their own copies
                for i, state in taken:
                    if i < reached:
                        state.pop("method", None)

    def _ar_call(
        self, nb_process: int, nb_episode: int, kwargs: dict[str, Any]
    ) -> list[EpisodeResult]:
        return call(self, nb_process, nb_episode, kwargs)

    # --- helpers -----------------------------------------------------------------------------

    def _ar_in_process_reason(self) -> str | None:
        """Why this runner's episodes cannot play in worker processes (``None``: they can)."""
        for name in _ENV_HOOKS:
            if getattr(type(self), name) is not getattr(Runner, name):
                return (
                    f"{type(self).__name__} overrides Runner.{name}, which worker processes "
                    "do not call (they build the env from the runner's parameters)"
                )
        if not self._useclass:
            try:
                dumps(self.agent)
            except Exception:
                return (
                    f"the agent {self.agent!r} cannot be pickled, so it cannot be sent to "
                    "worker processes"
                )
        return None

    def _ar_as_grid2op(self, nb_process: int) -> bool:
        """Whether grid2op's Runner plays these episodes in its own process, one at a time.

        It does for an agent instance that ``copy.copy`` cannot copy (it then plays the instance
        itself, which a worker process could not), and for ``nb_process > 1`` when the
        ``GRID2OP_RUNNER_FORCE_SEQUENTIAL`` environment variable is an integer > 0 (read as
        grid2op reads it: another value raises its ``ValueError``).
        """
        if not self._useclass and not self._Runner__can_copy_agent:
            return True
        value = os.getenv(_GridRunner.FORCE_SEQUENTIAL)
        return nb_process > 1 and value is not None and int(value) > 0

    def _ar_template(self) -> Any:
        """The env this process keeps for the runs: chronic names and spaces (grid2op's
        constructor's; built here where it built none). Outside a ``with`` block, a new one
        where chronics were added to its folder or removed since it was built: grid2op's
        Runner builds an env at each run, which finds them (the one replaced is closed with
        the runner: another thread's run may be using it)."""
        if self._ar_env is None or (not self._ar_keep and _chronics_changed(self._ar_env)):
            with exclusive(), parsing_once(), quiet():
                self._ar_env, _ = self._new_env(self.parameters)
            self._ar_note_env()
        return self._ar_env

    def _ar_note_env(self) -> None:
        if self._ar_env is not None:
            # Not left to the collector: it may finalize the env's observation env first, and
            # the env's own close then closes that one again, which raises ("Exception ignored
            # in BaseEnv.__del__").
            self._ar_free = weakref.finalize(self, _free_env, self._ar_env)
            try:
                self._ar_env_key = env_key(env_view(self, self._ar_env))
            except TypeError:  # parameters that cannot be pickled: the runs say so
                self._ar_env_key = None


def _chronics_changed(env: Any) -> bool:
    """Whether the chronics folder of ``env`` (a multifolder's) lists other chronics now."""
    real = getattr(env.chronics_handler, "real_data", None)
    found, folder = getattr(real, "subpaths", None), getattr(real, "path", None)
    if found is None or not isinstance(folder, str):
        return False
    try:
        now = {  # as grid2op's Multifolder lists them
            e.name
            for e in os.scandir(folder)
            if e.is_dir() and e.name != "__pycache__" and not e.name.startswith(".")
        }
    except OSError:
        return False  # the run says what is wrong with it
    return now != {os.path.basename(str(path)) for path in found}


def _free_env(env: Any) -> None:
    """Close a runner's env, unless it is lent to the workers' hold (``_play.call``) that another
    runner still keeps: that hold closes it."""
    if not disown(env):
        env.close()
