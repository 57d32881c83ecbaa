"""``AsyncRunner``: the async resource users hold; owns the worker pool, starts runs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import itertools
import math
import numbers
import os
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, Literal, TypedDict, Unpack

import anyio
import anyio.lowlevel
from anyio.abc import AsyncResource
from anyio.streams.memory import MemoryObjectSendStream

from ._engine import _dispatch
from ._engine._central import CentralAgent
from ._engine._dispatch import Run, RunSettings
from ._engine._envs import (
    copies_faithfully,
    dropped,
    fresh_copy,
    generated_classes,
    hold,
    release,
    warm,
)
from ._engine._parsed import ParsedAhead
from ._engine._pool import WorkerPool, on_trio
from ._engine._recipe import agent_name, agent_recipe, class_attributes, env_key, recipes
from ._exceptions import AsyncRunnerError, EpisodeError, unwrapped
from ._model import EpisodeResult, Event, ParsedJson, ReadOnly
from ._plan._arguments import at_least, check_path_save, chronic_names
from ._plan._layout import other_spaces
from ._plan._mixes import mixes_of
from ._plan._planner import plan_run
from ._pools._dask import DaskPool, as_dask
from ._pools._executor import ExecutorPool
from ._pools._fork import ForkPool, available, forked
from ._pools._process import ProcessPool
from .sinks._base import Sink
from .sinks._writer import Writer, json_bytes

__all__ = ["AsyncRunner", "RunOptions"]

# Local workers are forked from this process where that is safe (Linux): a fresh interpreter
# (anyio.to_process, used elsewhere) first spends about 2 s importing grid2op.
_FORK = available()
# Numbers the recipe keys of ``copy_env`` runners (each plays copies of its own env).
_COPIES = itertools.count()
# Local worker processes allowed per CPU: more cannot be meant (each holds an env; 10,000 forked
# until memory ran out). Agents that wait rather than compute have CentralAgent(envs_per_worker=).
_WORKERS_PER_CPU = 64
# The runs (their scopes) the current task plays a part in: their sinks' and callbacks' tasks.
_INSIDE: contextvars.ContextVar[frozenset[anyio.CancelScope]] = contextvars.ContextVar(
    "asyncrunner_inside", default=frozenset()
)


def check_local_workers(workers: int) -> None:
    """Refuse more local worker processes than this machine can hold (each has its own env)."""
    cpus = usable_cpus()
    if workers > _WORKERS_PER_CPU * cpus:
        raise ValueError(
            f"workers={workers} asks for up to {workers} worker processes, each with its own env, "
            f"on the {cpus} CPU(s) this process may use: use at most {_WORKERS_PER_CPU * cpus} "
            f"({_WORKERS_PER_CPU} per CPU){ELSEWHERE}"
        )


# (what ``check_local_workers`` offers besides fewer workers, in Python: the CLI drops it)
ELSEWHERE = (
    ", CentralAgent(agent, envs_per_worker=N) for agents that mostly wait, or a cluster "
    "(executor=...)"
)


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity (``taskset``, a Slurm job's CPUs, a
    container's cpuset; ``os.process_cpu_count`` of Python 3.13), not the machine's count, and
    no more than its cgroups' CPU quota allows (``docker --cpus``, a Kubernetes CPU limit, a
    systemd ``CPUQuota=``), rounded up."""
    if sys.version_info >= (3, 13):
        cpus = os.process_cpu_count() or 1
    elif hasattr(os, "sched_getaffinity"):  # not on macOS or Windows
        cpus = len(os.sched_getaffinity(0)) or 1
    else:
        cpus = os.cpu_count() or 1
    quota = _cpu_quota()
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def _cpu_quota(root: str = "/") -> float | None:
    """How many CPUs' worth of time this process's cgroups allow it: the smallest quota from
    its cgroup up to the hierarchy's root (cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us``);
    None without one (or off Linux). In a container, the hierarchy's root is its own cgroup.
    ``root``: where ``/proc`` and ``/sys`` are (another for the tests' file trees)."""
    cgroups = os.path.join(root, "sys/fs/cgroup")
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            tops, read = [cgroups], _cpu_max
        elif "cpu" in controllers.split(","):
            tops = [os.path.join(cgroups, controllers), os.path.join(cgroups, "cpu")]
            read = _cfs_quota
        else:
            continue
        top = next((t for t in tops if os.path.isdir(t)), None)
        if top is None:
            continue
        folder = os.path.normpath(os.path.join(top, path.lstrip("/")))
        while True:  # a folder the process's view lacks (a container's) is skipped
            quota = read(folder)
            if quota is not None:
                quotas.append(quota)
            if folder == top or not folder.startswith(top):
                break
            folder = os.path.dirname(folder)
    return min(quotas, default=None)


def _cpu_max(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _cfs_quota(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


class RunOptions(TypedDict, total=False):
    """The keyword arguments of ``AsyncRunner.run`` and ``AsyncRunner.stream`` (see ``run``).

    Unset, each takes grid2op's Runner default: no ``path_save``, ``max_iter`` and seeds;
    ``pbar=False``, ``sinks=()``, ``on_error="raise"``, no ``episode_timeout``, the runner's
    ``retries``, ``resume=False``.
    """

    path_save: str | os.PathLike[str] | None
    max_iter: int | None
    pbar: Any
    env_seeds: Sequence[int] | None
    agent_seeds: Sequence[int] | None
    episode_id: Sequence[int | str | tuple[str, int | str]] | None
    init_states: Any
    reset_options: Any
    sinks: Sequence[Sink]
    on_error: Literal["raise", "continue"]
    episode_timeout: float | None
    retries: int | None
    resume: bool


class AsyncRunner(AsyncResource):
    """Plays grid2op episodes of ``agent`` on ``env`` in worker processes, from asyncio or trio.

    ``agent``: a ``BaseAgent`` subclass (built in the worker with the env's action space), an
    instance (copied for each episode, as grid2op does with ``nb_process > 1``) or a callable
    ``(action_space) -> agent``
    (a lambda or a class defined in a function too: what workers cannot import goes by value).
    ``workers``: episodes run at once (default: the CPUs this process may use; local processes:
    at most 64 per CPU, started as episodes need them). ``executor``: ``None`` for local
    processes (forked from this one on Linux, ``anyio.to_process`` elsewhere), a
    ``concurrent.futures.Executor``, or a Dask cluster (a ``distributed.Client``, a scheduler
    address or an ``asyncrunner.DaskExecutor``).
    The pool lives as long as the runner: use ``async with`` or ``await runner.aclose()``.

    ``copy_env=True``: forked workers (local, on Linux) start from a copy of ``env`` as it is
    when the runner opens, instead of an env built from ``env.get_params_for_runner()`` as
    grid2op's Runner builds one: the first step comes sooner (no grid to load), and each episode
    still plays a copy of that env. The results equal grid2op's Runner's when ``env`` is as
    ``grid2op.make`` returned it (``tests/test_parity.py``), not after you stepped, reset,
    seeded or changed it (parameters given to ``env.change_parameters`` or
    ``change_forecast_parameters``, and forecasts on other parameters than the env's, are
    refused). Other workers (spawned, an executor, Dask) build their env as usual.
    """

    def __init__(
        self,
        env: Any,
        *,
        agent: Any,
        workers: int | None = None,
        executor: concurrent.futures.Executor | Any | None = None,
        sinks: Sequence[Sink] = (),
        retries: int = 1,
        copy_env: bool = False,
    ) -> None:
        check_env(env)
        workers = usable_cpus() if workers is None else at_least("workers", workers, 1)
        if executor is None:
            check_local_workers(workers)
        self._dask = as_dask(executor)
        if (
            self._dask is None
            and executor is not None
            and not isinstance(executor, concurrent.futures.Executor)
        ):
            raise TypeError(
                "`executor` must be None, a concurrent.futures.Executor or a Dask client, got "
                f"{type(executor).__name__}"
            )
        retries = at_least("retries", retries, 0)
        if not isinstance(copy_env, bool):
            raise TypeError(f"`copy_env` must be True or False, got {copy_env!r}")
        _check_sinks(sinks)
        kind, payload = agent_recipe(agent)
        self._agent_name = agent_name(agent)
        # A class's attributes as forked workers will see them (_check_agent_class); workers
        # that import the class afresh see them as imported, whatever this process changes.
        forked = executor is None and _FORK
        self._agent_class = agent if isinstance(agent, type) and forked else None
        self._class_attributes = {} if self._agent_class is None else class_attributes(agent)
        # A MultiMixEnvironment: one recipe per mix (each mix is an env of its own for grid2op).
        self._mixes = mixes_of(env)
        sources: dict[str | None, Any] = {None: env}
        if self._mixes is not None:
            sources = dict(self._mixes.items())
        # The standard library's pools run this script as their workers' ``__main__`` (forked,
        # or imported as ``__mp_main__``); others' workers (Dask's command, loky's) do not: they
        # get this script's classes by value. So do a process pool's when ``__main__`` is no
        # file (a notebook's cells, ``python -c``: even forked workers, forked before a cell
        # defined a class, lack it), or when its spawned workers would not import it
        # (``_spawned_workers_import_main``); and anyio's (where this process does not fork)
        # when ``__main__`` is no file: they run it by its file, and have none to run.
        by_value = executor is not None and not isinstance(
            executor, concurrent.futures.ThreadPoolExecutor
        )
        if executor is None and not _FORK:
            by_value = not hasattr(sys.modules["__main__"], "__file__")
        if isinstance(executor, concurrent.futures.ProcessPoolExecutor):
            context = getattr(executor, "_mp_context", None)
            forks = context is not None and context.get_start_method() == "fork"
            by_value = not hasattr(sys.modules["__main__"], "__file__") or (
                not forks and not _spawned_workers_import_main()
            )
        # Workers that are not forked here (spawned, Dask's, an executor's forked before the env
        # was made) may import the classes grid2op generated for the env in a temporary folder
        # (``class_in_file``), which ``env.close()`` deletes (``_prepare``).
        in_process = isinstance(executor, concurrent.futures.ThreadPoolExecutor)
        folders = {
            generated_classes(getattr(s, "_read_from_local_dir", None)) for s in sources.values()
        }
        self._class_folders = () if forked or in_process else tuple(sorted(filter(None, folders)))
        self._recipes = recipes(sources, agent, kind, payload, main_by_value=by_value)
        # The first (or only) recipe: the env the workers build while warming up.
        self._recipe_key, self._recipe_bytes = next(iter(self._recipes.values()))
        self._first_env = next(iter(sources.values()))  # that recipe's env (copy_env)
        self.copy_env = copy_env
        self.env = env
        self.workers = workers
        self.executor = executor
        self.sinks = tuple(sinks)
        self.retries = retries
        self._central = agent if isinstance(agent, CentralAgent) else None
        # Each mix's chronic names, as its workers' env orders them; a single env is the mix None.
        # Whether the workers start from copies of it (see _hold).
        # Whether copies of the env play as new envs (read here: it may be closed when the
        # runner opens, ``_hold``).
        self._faithful = copies_faithfully(self._first_env)
        copied = self._copied = copy_env and executor is None and _FORK and self._faithful
        if copied:
            # Its workers' env is a copy of the caller's, which may hold what the recipe does
            # not say (a reward changed since make): a key of its own keeps other runners'
            # workers from playing it, and its own from playing their builds.
            self._recipe_key = f"{self._recipe_key}:copy{next(_COPIES)}"
            self._recipes[next(iter(self._recipes))] = (self._recipe_key, self._recipe_bytes)
        self._names = {
            mix: chronic_names(source, as_built=not (copied and source is self._first_env))
            for mix, source in sources.items()
        }
        # What the workers build each mix's env from, as its recipe keys it (``resume`` matches it).
        self._env_keys = {mix: env_key(source) for mix, source in sources.items()}
        # The env's spaces, kept: ``env.close()`` sets the env's to None, and a saving run reads
        # them (their files, encoded once: ``_spaces``).
        self._space_objects = {
            "dict_action_space.json": env.action_space,
            "dict_observation_space.json": env.observation_space,
            "dict_env_modification_space.json": env._helper_action_env,
            "dict_attack_space.json": env._opponent_action_space,
        }
        self._space_files: dict[str, bytes] | None = None
        self._pool: WorkerPool | None = None
        self._closed = False
        self._closing: anyio.Event | None = None  # set as the first ``aclose`` ends
        # The runs playing, each in a scope of its own, and an event set when none is left (when
        # the last one ends). Closing the runner stops each run (its sinks finish the events they
        # were given), or cancels its scope before its sinks start or once they are done.
        self._playing: dict[anyio.CancelScope, Run] = {}
        # Set by the run that leaves only those its closer plays a part in (``_closer_in``).
        self._none_playing: anyio.Event | None = None
        self._closer_in: frozenset[anyio.CancelScope] = frozenset()
        self._entering = 0  # ``__aenter__`` calls between their loop check and the warm-up
        # The event loop that last used the runner (see _check_loop), and the lock under which
        # loops of other threads check it.
        self._loop: tuple[str, object] | None = None
        self._loop_lock = threading.Lock()
        # The env held here for forked workers (released on close), the hold under way if any
        # (set when it ends), whether it is to be let go as it ends, and what collecting the
        # runner unclosed does (``_hold``); under ``_hold_lock``, which the hold's thread takes.
        self._held = False
        self._holding: threading.Event | None = None
        self._closed_hold = False
        self._dropped: weakref.finalize[Any, Any] | None = None
        self._hold_lock = threading.Lock()
        self._shares_pool = False  # another runner's pool (``sharing_workers``): not ours to stop
        # An env built from the recipe's params and never played, held for forked workers
        # instead of a build here (compat gives the one grid2op's constructor built).
        self._lent_env: Any = None
        # Whether the workers read each step's actions as grid2op's Runner does when it records
        # an episode (``RunSettings.record``): always, so that a run gives the same results
        # whether it saves or not, those of grid2op's Runner with one process (which records
        # every episode). compat turns it off where grid2op's Runner records nothing (several
        # processes, nothing saved or detailed); workers that fill rows record anyway (Batcher).
        self._record_steps = True
        # Whether a failed episode's exception comes back (``EpisodeFailed.exception``): compat's.
        self._send_exceptions = False

    # --- the pool ------------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncRunner:
        self._check_open()
        with self._loop_lock:
            self._check_loop()
            self._entering += 1
        opened = self._pool is None and not self._held and self._holding is None
        try:
            # Start the workers and build their envs now, while the caller prepares its first
            # run. No more than the CPUs: more would not be ready sooner, and a run of fewer
            # episodes would not use them. A run's first calls take these workers as they
            # become ready rather than start more processes (see WorkerPool.warm_up).
            count = min(self.workers, usable_cpus())
            await self._hold()
            await anyio.lowlevel.checkpoint_if_cancelled()  # interrupted while holding the env
            self._check_open()  # closed meanwhile
            await self._get_pool().warm_up(count, warm, self._recipe_key, self._recipe_bytes)
        except BaseException:
            # Interrupted (a notebook's stop button) or failed: ``async with`` calls no
            # ``__aexit__`` then. What this opening started stops, and the env it held is let go.
            if opened:
                with anyio.CancelScope(shield=True):
                    await self._stop_workers()
                self._pool = None  # a new opening starts afresh
            raise
        finally:
            with self._loop_lock:
                self._entering -= 1
        return self

    async def _hold(self) -> None:
        """For a pool that forks this process: build the env once here, so that each forked
        worker starts with it instead of building its own (the same recipe and code: the same
        pristine env). With ``copy_env``, a copy of the caller's env instead of a build.

        The hold's thread records what it held (``_held``) itself: the caller may be cancelled
        meanwhile (asyncio's own ``task.cancel()`` goes through shields), or the runner closed
        (``_stop_workers`` then has it let go of the env as it ends)."""
        self._check_open()
        if not self._get_pool().forks_this_process:
            return
        if self.copy_env:
            _check_parameters_as_built(self._first_env)
        if self._copied:
            # Copied as it is now, recorded as it was made (``resume`` matches on it).
            mix = next(iter(self._recipes))
            if (
                env_key(self._first_env) != self._env_keys[mix]
                or chronic_names(self._first_env, as_built=False) != self._names[mix]
            ):
                raise ValueError(
                    "copy_env=True: the env changed since this AsyncRunner was made (its thermal "
                    "limits, chronics, ...); its workers would play it as it is now, its saved "
                    "episodes say it is as it was: make the AsyncRunner after changing the env"
                )
        if not self._faithful:
            # Each episode plays an env built for it: one built here would be shared by every
            # worker forked with it (a user backend's solver process, socket or files too).
            return
        with self._hold_lock:
            if self._held or self._holding is not None:
                return  # another opening of this runner holds it, or is holding it
            done = self._holding = threading.Event()
            self._closed_hold = False
        # Under its own key (__init__). A copy whose user parts are the caller's env's as they
        # are (``fresh_copy``): grid2op's copy drops what their __init__ or init set.
        make = functools.partial(fresh_copy, self._first_env) if self._copied else None
        key = self._recipe_key
        started = False

        def holding() -> None:
            nonlocal started
            with self._hold_lock:
                if done.is_set():
                    return  # given up before it started (below)
                started = True
            held = False
            try:
                held = hold(key, self._recipe_bytes, self._lent_env, make)
            finally:
                with self._hold_lock:
                    self._holding = None
                    let_go = held and self._closed_hold
                    if held and not let_go:
                        self._held = True  # a runner collected unclosed lets it go too
                        self._dropped = weakref.finalize(self, dropped, key)
                try:
                    if let_go:
                        release(key)
                finally:
                    done.set()

        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(holding)
        except BaseException:
            # Cancelled by asyncio through the shield before a thread took the call: anyio then
            # never runs it, and the closing waited for ever for its end.
            with self._hold_lock:
                if not started:
                    self._holding = None
                    done.set()
            raise

    async def aclose(self) -> None:
        """Stop the warm-up and the runs still playing (another task's ``run()`` then raises
        ``AsyncRunnerError``), then the worker processes this runner used. A second call
        returns once the first has (at once from a run the first waits for: a sink of it)."""
        if self._closed:
            closing, loop = self._closing, self._loop
            inside = self._playing.keys() & _INSIDE.get()
            if closing is not None and not inside and loop and _current_loop()[1] is loop[1]:
                await closing.wait()  # (it returned at once: its caller went on, workers alive)
            return
        with self._loop_lock:
            self._check_loop()
        self._closed = True
        self._closing = closing = anyio.Event()
        try:
            if self._playing:
                for scope, run in self._playing.items():
                    if not run.stop():  # (its sinks then place what finished)
                        scope.cancel()
                # Not for the runs this call is part of (a sink closing, a shielded callback):
                # they wait for it, and end after it (stopped, or cancelled).
                self._closer_in = _INSIDE.get()
                if not self._playing.keys() <= self._closer_in:
                    self._none_playing = anyio.Event()
                    await self._none_playing.wait()
        finally:
            try:
                await self._stop_workers()
            finally:
                closing.set()

    async def _stop_workers(self) -> None:
        """Stop this runner's worker processes and let go of the env held for them (or being
        held: the hold's thread lets it go as it ends, which this waits for)."""
        try:
            if self._pool is not None and not self._shares_pool:
                await self._pool.aclose()
        finally:
            with self._hold_lock:
                holding, held = self._holding, self._held
                self._closed_hold = holding is not None
                self._held = False
                if held and self._dropped is not None:
                    self._dropped.detach()
            with anyio.CancelScope(shield=True):
                if held:
                    await anyio.to_thread.run_sync(release, self._recipe_key)
                elif holding is not None:
                    await anyio.to_thread.run_sync(holding.wait)

    @property
    def _pids(self) -> set[int]:
        """The pids of the workers that served this runner (none until a call starts one)."""
        return set() if self._pool is None else self._pool.served

    def _get_pool(self) -> WorkerPool:
        """The pool of this runner, made on first use (its limiter needs the event loop)."""
        if self._pool is None:
            limiter = anyio.CapacityLimiter(self.workers)
            if self._dask is not None:
                self._pool = DaskPool(self._dask, limiter)
            elif self.executor is not None:
                self._pool = ExecutorPool(self.executor, limiter)
            elif _FORK:
                self._pool = ForkPool(limiter)
            else:
                self._pool = ProcessPool(limiter)
        return self._pool

    def _env_for(self, mix: str | None) -> Any:
        """The parent's env (or mix) behind episodes of ``mix``."""
        return self.env if self._mixes is None or mix is None else self._mixes[mix]

    def _check_env_open(self, what: str, why: str) -> None:
        """``what`` needs the env this runner was made with open: its space ``why``."""
        if _closed(self.env):
            raise ValueError(
                f"{what} needs the env this AsyncRunner was made with open (its space {why}), "
                "and env.close() was called: close it after the runs, or make a new env and "
                "AsyncRunner"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise AsyncRunnerError("this AsyncRunner is closed: create a new one")

    def _check_loop(self) -> None:
        """Refuse an event loop the runner's pool cannot serve (under ``_loop_lock``): its
        limiter, locks and streams are of the async library that made them (asyncio, trio),
        and serve one loop at a time (a loop of another thread would wait for ever)."""
        loop = _current_loop()
        if self._loop is not None and loop[1] is not self._loop[1]:
            if loop[0] != self._loop[0]:
                raise AsyncRunnerError(
                    f"this AsyncRunner was opened under {self._loop[0]}: it cannot serve "
                    f"{loop[0]}; use it (and close it) under {self._loop[0]}, or make a runner "
                    "for each"
                )
            warming = self._pool is not None and self._pool.warming
            if (self._playing or warming) and _loop_closed(self._loop):
                raise AsyncRunnerError(
                    "the event loop that used this AsyncRunner was closed with its work unfinished "
                    "(loop.close() with tasks pending; asyncio.run cancels them first): another "
                    "loop can neither use nor close it; make a new runner"
                )
            if self._playing or warming or self._entering:
                raise AsyncRunnerError(
                    "this AsyncRunner is in use by another event loop (another thread's "
                    "asyncio.run, say): a runner serves one event loop at a time; make a runner "
                    "for each thread, or send the calls to the loop that has it "
                    "(asyncio.run_coroutine_threadsafe, anyio.from_thread)"
                )
        self._loop = loop

    async def _execute(
        self, run: Run, send: MemoryObjectSendStream[Event] | None = None
    ) -> list[EpisodeResult]:
        """``run.execute(send)``, stopped if the runner closes meanwhile."""
        self._check_open()
        with anyio.CancelScope() as scope:
            with self._loop_lock:
                self._check_loop()
                self._playing[scope] = run
            inside = _INSIDE.set(_INSIDE.get() | {scope})  # its tasks (sinks) inherit it
            try:
                results = await run.execute(send)
                if not run.stopped:
                    return results
            finally:
                _INSIDE.reset(inside)
                self._playing.pop(scope, None)
                if self._none_playing is not None and self._playing.keys() <= self._closer_in:
                    self._none_playing.set()
        raise AsyncRunnerError(_closed_while_playing(run))

    async def _spaces(self) -> tuple[Mapping[str, Any], Mapping[str, bytes]]:
        """A saving run's spaces: dicts of its own (``RunStarted.spaces``: a sink changing
        them changed the files of every later run), and the files, encoded once (10 ms for a
        large grid's four)."""
        if self._space_files is None:
            spaces = self._space_objects

            def build() -> dict[str, bytes]:
                return {name: json_bytes(space.cls_to_dict()) for name, space in spaces.items()}

            self._space_files = await anyio.to_thread.run_sync(build)
        return ParsedJson(self._space_files), ReadOnly(self._space_files)

    # --- runs ----------------------------------------------------------------------------------

    async def _prepare(
        self, nb_episode: int, options: RunOptions, *, streaming: bool, objects: bool = False
    ) -> Run:
        unknown = sorted(set(options) - RunOptions.__optional_keys__)
        if unknown:
            call = "stream" if streaming else "run"
            hint = _GRID2OP_ONLY.get(unknown[0], "")
            raise TypeError(f"{call}() got an unexpected keyword argument {unknown[0]!r}{hint}")
        path_save = options.get("path_save")
        pbar = options.get("pbar", False)
        sinks = options.get("sinks", ())
        on_error = options.get("on_error", "raise")
        episode_timeout = options.get("episode_timeout")
        retries = options.get("retries")
        self._check_open()
        if self._class_folders:
            await self._check_class_folders()
        if options.get("init_states") is not None:
            self._check_env_open("init_states", "makes each initial state's action")
        if self._central is not None:
            self._check_env_open("a CentralAgent", "reads each step's observation")
        if on_error not in ("raise", "continue"):
            raise ValueError(f'`on_error` must be "raise" or "continue", got {on_error!r}')
        if episode_timeout is not None:
            if isinstance(episode_timeout, bool) or not isinstance(episode_timeout, numbers.Real):
                raise TypeError(
                    "`episode_timeout` must be a number of seconds (or None), got "
                    f"{episode_timeout!r}"
                )
            if not episode_timeout > 0:
                raise ValueError(f"`episode_timeout` must be > 0 seconds, got {episode_timeout!r}")
            episode_timeout = float(episode_timeout)
        retries = self.retries if retries is None else at_least("retries", retries, 0)
        _check_sinks(sinks)
        self._check_agent_class()
        plan = await plan_run(
            nb_episode,
            names=self._names,
            env_for=self._env_for,
            agent=self._agent_name,
            env_keys=self._env_keys,
            path_save=path_save,
            resume=options.get("resume", False),
            max_iter=options.get("max_iter"),
            env_seeds=options.get("env_seeds"),
            agent_seeds=options.get("agent_seeds"),
            episode_id=options.get("episode_id"),
            init_states=options.get("init_states"),
            reset_options=options.get("reset_options"),
        )
        requests, skipped, path_save = plan.requests, plan.skipped, plan.path_save
        all_sinks = [*self.sinks, *sinks]
        writers = [s for s in all_sinks if isinstance(s, Writer)]
        if writers:  # as path_save is: a clear error before any work, not the first episode's
            await anyio.to_thread.run_sync(_check_writer_paths, writers)
        if path_save is not None:
            from .sinks import EpisodeDataWriter

            # (on a multimix env, grid2op's layout: path_save/<mix>/<chronic>, the writer's)
            all_sinks.append(EpisodeDataWriter(path_save))
        _check_writers(all_sinks)
        if pbar:
            from .sinks import ProgressBar

            all_sinks.append(ProgressBar(pbar))
        detail = streaming or any(s.needs_steps for s in all_sinks)
        files = tuple(sorted({s.episode_format for s in all_sinks if s.episode_format}))
        spaces, space_files = await self._spaces() if detail or files else ({}, {})
        if files:  # another env's episodes there: this run's could not be read back
            mixes = [m for m in self._recipes if m is not None]
            folders = [f for s in all_sinks if isinstance(s, Writer) for f in s.folders(mixes)]
            why = await anyio.to_thread.run_sync(
                lambda: next(filter(None, (other_spaces(f, space_files) for f in folders)), None)
            )
            if why is not None:
                raise ValueError(why)
        settings = RunSettings(
            sinks=all_sinks,
            on_error=on_error,
            retries=retries,
            episode_timeout=episode_timeout,
            detail=detail,
            recipes=self._recipes,
            agent=self._agent_name,
            central=self._central,
            env_for=self._env_for,
            spaces=spaces,
            space_files=space_files,
            files=files,
            objects=objects,
            record=self._record_steps,
            exceptions=self._send_exceptions,
        )
        return Run(self._get_pool(), requests, settings, skipped=skipped)

    async def _check_class_folders(self) -> None:
        """Refuse a run once a folder of generated classes its workers may import is gone."""
        gone = await anyio.to_thread.run_sync(
            lambda: [f for f in self._class_folders if not os.path.isdir(f)]
        )
        if gone:
            raise ValueError(
                f"the classes grid2op generated in files for this env (class_in_file) are gone "
                f"from {gone[0]} (env.close() deletes them), and this AsyncRunner's workers, not "
                "forked from this process, may need them: close the env after the runs, or make "
                "a new env and AsyncRunner"
            )

    def _check_agent_class(self) -> None:
        """Refuse a run whose agent class's attributes changed since the runner was made (as
        ``OneChangeThenNothing.gen_next`` changes them): its workers would play it as it was."""
        if self._agent_class is None:
            return
        # The same objects (a value a method caches in them, an action's vector, changes
        # nothing), or equal numbers and strings.
        now, then = class_attributes(self._agent_class), self._class_attributes
        changed = sorted(n for n in now.keys() | then.keys() if not _same(now.get(n), then.get(n)))
        if changed:
            raise ValueError(
                f"{self._agent_class.__qualname__}'s class attributes changed since this "
                f"AsyncRunner was made ({', '.join(changed)}): its workers build the agent as "
                "it was then. Make a new AsyncRunner after changing them"
            )

    async def run(
        self,
        nb_episode: int,
        *,
        add_detailed_output: bool | Literal["compact"] = False,
        **options: Unpack[RunOptions],
    ) -> list[EpisodeResult]:
        """Play ``nb_episode`` episodes; returns one ``EpisodeResult`` each, in request order.

        Arguments shared with ``grid2op.Runner.Runner.run`` mean the same. ``on_error="raise"``
        stops at the first failed episode and raises ``EpisodeError`` (finished episodes stay
        saved); ``"continue"`` plays every episode and reports failures in ``result.error``.
        ``resume=True`` (with ``path_save``) skips the episodes already saved complete there
        (same chronic, agent, seeds and ``max_iter``, every file as written) and returns their
        results as read from disk; a damaged one is moved aside and played again.
        ``add_detailed_output=True`` puts each played episode's grid2op ``EpisodeData`` on
        ``result.episode_data`` (``"compact"``: a ``CompactEpisodeData``), built in this process
        from the streamed steps; an episode ``resume`` read back gets grid2op's
        ``EpisodeData.from_disk`` of its folder (``"compact"`` and ``resume`` do not mix).

        On a ``MultiMixEnvironment`` every mix plays the ``nb_episode`` requested episodes
        (``nb_episode * len(env)`` results, mix by mix, each with its ``mix``), unless
        ``episode_id`` lists ``(mix, episode id)`` pairs; ``path_save`` then holds one grid2op
        folder per mix, ``path_save/<mix>/<chronic>``.
        """
        collector = None
        if add_detailed_output == "compact" and options.get("resume"):
            raise ValueError(
                "add_detailed_output='compact' cannot go with resume=True: the episodes read "
                "back from path_save (EpisodeData folders) have no CompactEpisodeData; use "
                "add_detailed_output=True (grid2op's EpisodeData.from_disk of each folder)"
            )
        if add_detailed_output:
            from .sinks._detail import DetailCollector

            self._check_env_open("add_detailed_output", "makes each step's observation")
            collector = DetailCollector(self._env_for, compact=add_detailed_output == "compact")
            sinks = options.get("sinks", ())
            _check_sinks(sinks)  # (before it is spliced)
            options = {**options, "sinks": [*sinks, collector]}
        objects = collector is not None and not collector.compact
        run = await self._prepare(nb_episode, options, streaming=False, objects=objects)
        if collector is None:
            with unwrapped():
                return await self._execute(run)
        data = collector.data
        try:
            with unwrapped():
                results = await self._execute(run)
        except EpisodeError as exc:
            exc.results = await _detailed(exc.results, data)
            raise
        return await _detailed(results, data)

    @asynccontextmanager
    async def stream(
        self, nb_episode: int, **options: Unpack[RunOptions]
    ) -> AsyncIterator[AsyncIterator[Event]]:
        """Like ``run``, as an async context manager giving the events as they happen.

        Leaving the block early cancels what is left of the run.
        """
        run = await self._prepare(nb_episode, options, streaming=True)
        send, receive = anyio.create_memory_object_stream[Event](16)

        async def produce() -> None:
            async with send:
                await self._execute(run, send)

        with unwrapped():
            async with anyio.create_task_group() as group, receive:
                group.start_soon(produce)
                try:
                    yield receive
                finally:
                    group.cancel_scope.cancel()


def _spawned_workers_import_main() -> bool:
    """The standard library's spawned (and forkserver) workers import this process's
    ``__main__`` as theirs: by its module's name (``python -m package.module``), else its file
    (``python script.py``); never a package's ``__main__.py`` (``python -m package``) nor a
    zipapp's (``multiprocessing.spawn._fixup_main_from_name`` skips them), nor a ``__main__``
    without a file (a notebook's cells, ``python -c``)."""
    main = sys.modules["__main__"]
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return name != "__main__" and not name.endswith(".__main__")
    return hasattr(main, "__file__")


# What grid2op's ``Runner.run`` takes and ``run()`` does not: where it went.
_GRID2OP_ONLY = {
    "nb_process": ": the runner's workers play the episodes, AsyncRunner(env, agent=..., "
    "workers=N) (asyncrunner.compat.Runner takes grid2op's run(nb_episode, nb_process=...))",
    "add_nb_highres_sim": ": every result has it, EpisodeResult.nb_highres_sim",
}


def check_env(env: Any) -> None:
    """Raises what to pass where ``env`` is not an open grid2op env (a name, a class...)."""
    # (the closed check first: a closed multimix env raises reading any other attribute)
    if not isinstance(env, type) and _closed(env):
        raise ValueError("the env is closed: pass an open grid2op env (make a new one)")
    if isinstance(env, type) or not hasattr(env, "get_params_for_runner"):
        what = f"the class {env.__name__}" if isinstance(env, type) else type(env).__name__
        hint = f": grid2op.make({env!r}, ...)" if isinstance(env, str) else ""
        raise TypeError(f"env must be a grid2op Environment (grid2op.make(...)), got {what}{hint}")


def _closed(env: Any) -> bool:
    """``env.close()`` was called: a multimix env's flag (read first: a closed one raises
    grid2op's ``EnvError`` for any other attribute), or a single env's."""
    return bool(
        getattr(env, "_MultiMixEnvironment__closed", False)
        or getattr(env, "_BaseEnv__closed", False)
    )


def _loop_closed(loop: tuple[str, object]) -> bool:
    """Whether an asyncio loop was closed (its tasks never run again; a trio run ends only
    once its tasks did)."""
    return isinstance(loop[1], asyncio.AbstractEventLoop) and loop[1].is_closed()


def _closed_while_playing(run: Run) -> str:
    """What ``run()`` raises when the runner closed while the run played (``run.stop``)."""
    if not run.cut:
        return (
            "the AsyncRunner was closed while this run played: the episodes it finished are "
            "saved (path_save; run again with resume=True in a new runner to play the rest)"
        )
    names = ", ".join(repr(sink) for sink in run.cut)
    one = len(run.cut) == 1
    return (
        f"the AsyncRunner was closed while this run played, and sink{'' if one else 's'} "
        f"{names} {'was' if one else 'were'} cut short {_dispatch.SINK_DRAIN_GRACE:g} s after the "
        f"run stopped (still handling {'its' if one else 'their'} events, or closing): what "
        f"{'it' if one else 'they'} had not handled is lost; the episodes the writers placed "
        "are saved (path_save; run again with resume=True in a new runner to play the rest)"
    )


def _current_loop() -> tuple[str, object]:
    """The async library running this task, and its running loop (trio: its token)."""
    if on_trio():
        import trio

        return "trio", trio.lowlevel.current_trio_token()
    return "asyncio", asyncio.get_running_loop()


def _same(value: Any, then: Any) -> bool:
    return value is then or (isinstance(value, int | float | str | bytes) and value == then)


def _check_sinks(sinks: Sequence[Sink]) -> None:
    if isinstance(sinks, Sink) or not isinstance(sinks, Sequence):
        raise TypeError(
            f"`sinks` must be a list of sinks, got {type(sinks).__name__}"
            + (" (sinks=[sink]: a list of one)" if isinstance(sinks, Sink) else "")
        )
    for sink in sinks:
        if not isinstance(sink, Sink):
            raise TypeError(
                f"sinks must be asyncrunner.sinks.Sink instances, got {type(sink).__name__}; "
                "wrap a function in CallbackSink(fn)"
            )
        for method in ("send", "aclose"):
            if not inspect.iscoroutinefunction(getattr(sink, method)):
                raise TypeError(
                    f"{type(sink).__name__}.{method} must be a coroutine function (async def "
                    f"{method}(...)); for a plain function, use CallbackSink(fn)"
                )


def _check_writers(sinks: Sequence[Sink]) -> None:
    """Refuse two writers of one format in one folder: each would save every episode there (the
    second as ``<chronic>_1``)."""
    seen: dict[tuple[str | None, str], Sink] = {}
    for sink in sinks:
        if not isinstance(sink, Writer):
            continue
        where = (sink.episode_format, sink.path)  # (an absolute path)
        if seen.setdefault(where, sink) is not sink:  # (one given twice: refused as such)
            raise ValueError(
                f"{seen[where]!r} and {sink!r} would both save every episode in {where[1]}: "
                "keep one of them (path_save is an EpisodeDataWriter of its folder)"
            )


def _check_writer_paths(writers: Sequence[Writer]) -> None:
    for writer in writers:
        check_path_save(writer.path, f"{type(writer).__name__}.path")


def _check_parameters_as_built(env: Any) -> None:
    """grid2op's Runner builds its env with the env's current parameters
    (``get_params_for_runner``), for its steps and its forecasts (``obs.simulate``) alike;
    ``copy_env``'s copies keep the env's own. Refuse rather than differ where those are not the
    same: parameters given to ``env.change_parameters`` or ``change_forecast_parameters``, a
    reward to ``change_reward`` (the copies apply them at their first reset, or play the reward
    a reset applied), forecasts deactivated (``deactivate_forecast``), and forecasts on other
    parameters than the env's
    (``change_parameters`` then a reset changes the env's, not its forecasts')."""
    pending: list[tuple[str, str | None]] = [
        (call, what)
        for call, attr, what in (
            ("change_parameters", "_BaseEnv__new_param", "parameters"),
            ("change_forecast_parameters", "_BaseEnv__new_forecast_param", "parameters"),
            ("change_reward", "_BaseEnv__new_reward_func", "reward_class"),
        )
        if getattr(env, attr, None) is not None
    ]
    reward = getattr(getattr(env, "_reward_helper", None), "template_reward", None)
    made = env._rewardClass  # the class given to make, or the instance
    made = made if isinstance(made, type) else type(made)
    if not pending and reward is not None and type(reward) is not made:
        pending = [("change_reward", "reward_class")]  # applied by a reset since
    if not pending and not env.with_forecast:
        pending = [("deactivate_forecast", None)]  # (its forecasts are on there)
    if pending:
        call, what = pending[0]
        also = f" (or pass the {what} to grid2op.make)" if what else ""
        raise ValueError(
            f"copy_env=True: the env was given env.{call}(...), which grid2op's Runner does not "
            "see (it builds its env from the env's runner parameters), so copies of it would not "
            f"play as grid2op's Runner plays this env: use copy_env=False{also}"
        )
    forecasts = getattr(getattr(env, "_observation_space", None), "_simulate_parameters", None)
    if forecasts is not None and not _same_values(forecasts.to_dict(), env.parameters.to_dict()):
        raise ValueError(
            "copy_env=True: the env's forecasts (obs.simulate) use other parameters than the env "
            "(env.change_parameters(...) and a reset since grid2op.make, or "
            "env.change_forecast_parameters(...)), where grid2op's Runner builds an env whose "
            "forecasts use the env's parameters, so copies of it would not play as it plays: "
            "use copy_env=False (or pass the parameters to grid2op.make(..., param=...))"
        )


def _same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a == b``, a NaN equal to a NaN (grid2op takes ``SOFT_OVERFLOW_THRESHOLD=nan``)."""
    return a.keys() == b.keys() and all(
        x == y
        or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
        for x, y in ((a[k], b[k]) for k in a)
    )


async def _detailed(results: list[EpisodeResult], data: dict[int, Any]) -> list[EpisodeResult]:
    """``results`` with their ``EpisodeData``: built from the streamed steps (``data``), or for
    an episode ``resume`` read back, grid2op's ``EpisodeData.from_disk`` of its folder; that of
    an episode saved in grid2op's EpisodeData format points at its folder, as grid2op's does
    after a run with ``path_save`` (``agent_path``, ``episode_path``, ``serialize``)."""
    saved = {
        r.index: r.path
        for r in results
        if r.index not in data and r.error is None and r.path is not None
    }
    paths = [r.path for r in results if r.path is not None]

    def read() -> tuple[dict[int, Any], set[str]]:
        folders = {p for p in paths if os.path.isfile(os.path.join(p, "episode_meta.json"))}
        return _from_disk(saved), folders  # (not a CompactEpisodeWriter's .npz file)

    read_back, folders = await anyio.to_thread.run_sync(read)
    data = {**data, **read_back}
    out = []
    for r in results:
        episode = data.get(r.index, r.episode_data)
        if r.path in folders and episode is not None and not hasattr(episode, "exp_dir"):
            episode.agent_path = os.path.dirname(r.path)
            episode.episode_path = r.path
            episode.serialize = True
        out.append(replace(r, episode_data=episode))
    return out


def _from_disk(paths: dict[int, str]) -> dict[int, Any]:
    from grid2op.Episode import EpisodeData

    return {i: EpisodeData.from_disk(*os.path.split(path)) for i, path in paths.items()}


@asynccontextmanager
async def sharing_workers(
    runners: Sequence[AsyncRunner], workers: int, resets: Sequence[dict[str, Any]] = ()
) -> AsyncIterator[None]:
    """Opens ``runners`` on one pool of ``workers`` processes, closed at the end of the block.

    Their runs then play on the same warm workers, episodes of all of them interleaved as the
    workers free up, where each runner would have started its own pool. Every runner's env is
    held before the first worker starts: a forked worker has all of them (none builds one).
    ``resets``: reset options (chronic, max steps) the runs will play; on a machine with a core
    to spare, their chronics are parsed meanwhile (``ParsedAhead``), so that no forked worker
    parses them.
    """
    first = runners[0]
    if len({id(runner) for runner in runners}) < len(runners):
        raise ValueError("sharing_workers: each runner once (one twice would never stop the pool)")
    for runner in runners:
        if runner._pool is not None:
            raise AsyncRunnerError("sharing_workers needs runners that never started a pool")
    first.workers = workers
    pool = first._get_pool()
    ahead = None
    try:
        for runner in runners[1:]:
            runner._pool, runner._shares_pool, runner.workers = pool, True, workers
        if resets and pool.forks_this_process and usable_cpus() > 1:
            ahead = await forked(ParsedAhead, first.env, list(resets), owner=pool)
        for runner in runners:
            await runner._hold()
        if ahead is not None:
            await anyio.to_thread.run_sync(ahead.join)
        count = min(workers, usable_cpus())
        await pool.warm_up(count, warm, first._recipe_key, first._recipe_bytes)
        yield
    finally:
        if ahead is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(ahead.join)
        for runner in (*runners[1:], first):  # the pool's owner last
            await runner.aclose()
