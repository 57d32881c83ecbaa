"""The rows of the next ``StepBatch``, filled in place as the worker plays (no per-step arrays).

The steps' arrays go to the orchestrator when one of its sinks reads them (``job.detail``), and to
the worker's own ``EpisodeBuffer`` when the run saves episodes (``job.files``: the worker builds
their files at the end).
"""

from __future__ import annotations

import inspect
import operator
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._model import StepBatch
from ..sinks._buffer import EpisodeBuffer
from ._recipe import EpisodeJob

__all__ = ["Batcher", "fill"]

# A batch leaves when it holds this many steps, or when this many seconds passed since the last one.
_BATCH_STEPS = 64
_BATCH_SECONDS = 0.1
# A batch whose arrays no sink of the orchestrator reads (its sinks count steps, rewards) leaves
# every _QUIET_SECONDS (the episode's first one after _BATCH_SECONDS): each one costs the
# orchestrator's process about 0.6 ms of CPU (15.8 -> 5.7 us per step on l2rpn_case14_sandbox
# with 64-step batches against 1024). The rows a saving worker keeps go to its buffer every
# _BATCH_STEPS meanwhile.
_QUIET_STEPS = 4096
_QUIET_SECONDS = 0.5
# A step's wide rows (one per action, observation, ...): sent only to sinks that read them.
_WIDE = ("actions", "env_actions", "observations", "disc_lines", "attacks", "other_rewards")


def _to_float(value: Any) -> float:
    # grid2op's EpisodeData._convert_to_float
    try:
        return float(value)
    except Exception:
        return -float("inf")


def fill(row: np.ndarray, obj: Any) -> None:
    """``row[:] = obj.to_vect()`` for an observation or the env's action, without intermediate
    arrays (nor the vector ``to_vect`` keeps in the object).

    Each class's attributes are laid out once (``_layout``): a run of one-dimensional arrays is
    concatenated straight into its part of the row, three times as fast as one attribute at a time
    on an observation. An action's part is its class's default row with only the attributes the
    action holds written over it (``_action_run``): grid2op builds the others on first read, as
    copies of that default, and ``fill`` neither builds them nor changes the action. An object that
    does not fit its class's layout (an attribute of another kind or size) is filled one attribute
    at a time, as before.
    """
    layout = _LAYOUTS.get(type(obj))
    if layout is None:
        layout = _LAYOUTS[type(obj)] = _layout(obj)
    try:
        for kind, key, where in layout:
            if kind == "run":
                np.concatenate(key(obj), out=row[where], casting="unsafe")
            elif kind == "action":
                get, default, parts = key
                row[where] = default
                for value, part in zip(get(obj), parts, strict=True):
                    if value is not None:
                        row[part] = value
            elif kind == "scalar":
                row[where] = getattr(obj, key)
            else:
                row[where] = _value(obj, key).ravel()
    except Exception:
        _fill_one_by_one(row, obj)


def _value(obj: Any, name: str) -> Any:
    """Attribute ``name`` of ``obj`` as ``to_vect`` reads it: an action's injections live in its
    ``_dict_inj`` and unset ones take their class's default (``BaseAction._get_array_from_attr_name``).
    """
    value = getattr(obj, name, None)
    if value is None:
        injections = getattr(obj, "_dict_inj", {})
        value = injections[name] if name in injections else type(obj)._build_attr(name)
    return value


def _fill_one_by_one(row: np.ndarray, obj: Any) -> None:
    start = 0
    for name in type(obj).attr_list_vect:
        value = _value(obj, name)
        if isinstance(value, np.ndarray):
            end = start + value.size
            row[start:end] = value.ravel()
            start = end
        else:
            row[start] = value
            start += 1


_LAYOUTS: dict[type, list[tuple[str, Any, Any]]] = {}


def _layout(obj: Any) -> list[tuple[str, Any, Any]]:
    """Where each attribute of ``obj``'s class goes in its row, from ``obj``: runs of attributes
    that are one-dimensional arrays (``"run"``, read by one ``attrgetter``), scalars and the rest
    (arrays read through ``_value``)."""
    layout: list[tuple[str, Any, Any]] = []
    run: list[str] = []
    start = run_start = 0

    def end_run() -> None:
        if run:
            get = operator.attrgetter(*run) if len(run) > 1 else _one(run[0])
            layout.append(("run", get, slice(run_start, start)))
            run.clear()

    action = _action_run(obj)
    for name in type(obj).attr_list_vect:
        if name in action.readers:
            end_run()
            action.add(name, start)
            start += action.sizes[name]
            continue
        layout += action.end()
        value = getattr(obj, name, None)
        if isinstance(value, np.ndarray) and value.ndim == 1:
            if not run:
                run_start = start
            run.append(name)
            start += value.size
            continue
        end_run()
        value = _value(obj, name)
        if isinstance(value, np.ndarray):
            layout.append(("array", name, slice(start, start + value.size)))
            start += value.size
        else:
            layout.append(("scalar", name, start))
            start += 1
    end_run()
    layout += action.end()
    return layout


class _ActionRun:
    """A run of an action's attributes that grid2op builds on first read or keeps in its
    ``_dict_inj``: read without building them, ``None`` for those the action does not hold."""

    def __init__(self, readers: dict[str, Callable[[Any], Any]], defaults: dict[str, Any]) -> None:
        self.readers, self.defaults = readers, defaults
        self.sizes = {name: int(default.size) for name, default in defaults.items()}
        self.names: list[str] = []
        self.start = 0

    def add(self, name: str, start: int) -> None:
        if not self.names:
            self.start = start
        self.names.append(name)

    def end(self) -> list[tuple[str, Any, Any]]:
        """The layout's entry for the run so far, if any (``fill``'s ``"action"``)."""
        if not self.names:
            return []
        names, self.names = self.names, []
        readers = [self.readers[name] for name in names]
        default = np.concatenate([self.defaults[name] for name in names]).astype(np.float32)
        parts, start = [], 0
        for name in names:
            parts.append(slice(start, start + self.sizes[name]))
            start += self.sizes[name]
        get = lambda obj: [read(obj) for read in readers]  # noqa: E731
        return [("action", (get, default, parts), slice(self.start, self.start + start))]


def _action_run(obj: Any) -> _ActionRun:
    """The attributes of ``obj``'s class (an action's) read as an ``_ActionRun``, as
    ``BaseAction._get_array_from_attr_name`` reads them:

    - those ``BaseAction`` builds on first read (a property over ``_private<name>``, which a
      subclass does not override): the private one, ``None`` until built;
    - the injections of an env's action (``_dict_inj``) that are no attribute of it.

    The default of each is its class's ``DICT_ATTR_`` (what the property builds a copy of).
    """
    from grid2op.Action import BaseAction

    readers: dict[str, Callable[[Any], Any]] = {}
    defaults: dict[str, Any] = {}
    if not isinstance(obj, BaseAction):
        return _ActionRun(readers, defaults)
    cls = type(obj)
    cls._build_dict_attr_if_needed()
    for name in cls.attr_list_vect:
        default = cls.DICT_ATTR_.get(name)
        if not isinstance(default, np.ndarray) or default.ndim != 1:
            continue
        private = "_private" + name
        if name in BaseAction.__dict__:
            lazy = BaseAction.__dict__[name]
            if isinstance(lazy, property) and inspect.getattr_static(cls, name) is lazy:
                if hasattr(obj, private):
                    readers[name], defaults[name] = operator.attrgetter(private), default
        elif getattr(obj, name, None) is None and isinstance(obj._dict_inj, dict):
            readers[name], defaults[name] = _injection(name), default
    return _ActionRun(readers, defaults)


def _injection(name: str) -> Callable[[Any], Any]:
    return lambda obj: obj._dict_inj.get(name)


def _one(name: str) -> Any:
    """A getter of the one-element tuple ``(obj.name,)``, as ``attrgetter`` of several names."""
    get = operator.attrgetter(name)
    return lambda obj: (get(obj),)


class Batcher:
    """Preallocated rows for the next StepBatch; flushed by size or age."""

    def __init__(
        self, job: EpisodeJob, env: Any, n_other: int, send: Any, keep: EpisodeBuffer | None
    ) -> None:
        from grid2op.dtypes import dt_bool, dt_float

        self.job, self.send, self.keep = job, send, keep
        self.wide = job.detail or keep is not None  # the wide rows are filled
        # Each step's actions read as grid2op's Runner reads them when it records an episode
        # (``RunSettings.record``), and always when the rows are filled (grid2op records what
        # it saves or details): the wide rows hold what that reading gives.
        self.record = job.record or self.wide
        self.capacity = _BATCH_STEPS if job.detail else _QUIET_STEPS
        self.every = _BATCH_SECONDS if job.detail else _QUIET_SECONDS
        n = _BATCH_STEPS if self.wide else 0
        self.actions = np.full((n, env.action_space.n), np.nan, dtype=dt_float)
        self.env_actions = np.full((n, env._helper_action_env.n), np.nan, dtype=dt_float)
        self.observations = np.full((n, env.observation_space.n), np.nan, dtype=dt_float)
        self.disc_lines = np.full((n, env.backend.n_line), np.nan, dtype=dt_bool)
        self.disc_templ = np.full(env.backend.n_line, False, dtype=dt_bool)
        self.attacks = np.zeros((n, env._opponent_action_space.n), dtype=dt_float)
        self.other_rewards = np.zeros((n, n_other), dtype=np.float64)
        self.rewards = np.zeros(self.capacity, dtype=dt_float)
        self.done = np.zeros(self.capacity, dtype=bool)
        self.legal = np.ones(self.capacity, dtype=dt_bool)
        self.ambiguous = np.zeros(self.capacity, dtype=dt_bool)
        self.agent_times = np.zeros(self.capacity, dtype=dt_float)
        self.n = 0  # rows of the next batch
        self.w = 0  # wide rows filled, for the rows n - w to n (the buffer has those before)
        self.first_step = 1
        self.last_flush = time.perf_counter()
        # Each step's objects, as grid2op's Runner keeps them in its EpisodeData (``objects``).
        self.objects: list[tuple[Any, Any, Any, Any]] | None = [] if job.objects else None

    def add(
        self,
        env: Any,
        act: Any,
        obs: Any,
        reward: float,
        done: bool,
        info: dict[str, Any],
        attack: Any,
        agent_time: float,
        names: tuple[str, ...],
    ) -> None:
        if self.record:
            # grid2op's EpisodeData.incr_store: ``to_vect``, which builds the attributes an
            # action builds on first read: the agent's action (which it may play again) and the
            # opponent's attack (its opponent may too) play on read so. The env's action, which
            # it reads too, is a new one at each step (BaseEnv._update_actions) before anything
            # reads the last: ``fill`` reads it without building them, as the observation.
            action = act.to_vect()
            attacked = None if attack is None else attack.to_vect()
        if self.wide:
            w = self.w
            self.actions[w] = action
            fill(self.env_actions[w], env._env_modification)
            fill(self.observations[w], obs)
            if self.record and getattr(obs, "_vectorized", None) is None:
                obs._vectorized = self.observations[w].copy()  # as below
            self.attacks[w] = 0.0 if attacked is None else attacked
            if "disc_lines" in info:
                arr = info["disc_lines"]
                self.disc_lines[w] = arr if arr is not None else self.disc_templ
            else:
                self.disc_lines[w] = True  # grid2op leaves its NaN-filled bool row
            rewards = info.get("rewards", {})
            for k, name in enumerate(names):
                self.other_rewards[w, k] = _to_float(rewards.get(name, np.nan))
            self.w += 1
        elif self.record and getattr(obs, "_vectorized", None) is None:
            # grid2op's EpisodeData.incr_store reads the observation with ``to_vect``, which
            # keeps the vector in it (``_vectorized``): an agent that changes its observation in
            # place, then reads ``to_vect``, reads that one. ``fill``'s floats are ``to_vect``'s.
            vector = np.empty(self.observations.shape[1], dtype=self.observations.dtype)
            fill(vector, obs)
            obs._vectorized = vector
        if self.objects is not None:
            self.objects.append((act, env._env_modification, obs, attack))
        i = self.n
        self.rewards[i] = reward
        self.done[i] = done
        self.legal[i] = not info["is_illegal"]
        self.ambiguous[i] = info["is_ambiguous"]
        self.agent_times[i] = agent_time
        self.n += 1
        # The episode's first batch leaves as soon as ever (a run's first sign of life). The
        # last one leaves with the episode's end (``take``).
        every = self.every if self.first_step > 1 else _BATCH_SECONDS
        if not done and (self.n == self.capacity or time.perf_counter() - self.last_flush > every):
            self.flush()
        elif self.w == _BATCH_STEPS:
            self._keep()

    def _batch(self, start: int, wide_rows: int) -> StepBatch:
        """The rows ``start`` to ``n`` (views: ``send`` pickles a batch at once and the buffer
        copies what it keeps, before the rows are filled again), with ``wide_rows`` wide rows."""
        job, n = self.job, self.n
        return StepBatch(
            run_id=job.run_id,
            index=job.index,
            attempt=job.attempt,
            first_step=self.first_step + start,
            rewards=self.rewards[start:n],
            done=self.done[start:n],
            legal=self.legal[start:n],
            ambiguous=self.ambiguous[start:n],
            agent_times=self.agent_times[start:n],
            **{name: getattr(self, name)[:wide_rows] for name in _WIDE},
        )

    def _keep(self) -> None:
        """The wide rows filled so far, to the buffer (a saving worker's)."""
        if self.keep is not None and self.w:
            self.keep.add(self._batch(self.n - self.w, self.w))
        self.w = 0

    def take(self) -> StepBatch | None:
        """The rows not sent yet as a batch (the buffer keeps its copy now), for the caller to
        send with what follows: the last rows go with the episode's end, in one write."""
        n = self.n
        if n == 0:
            return None
        self._keep()  # the rows the buffer has not kept yet (a full batch's may be kept)
        # The orchestrator reads the arrays (``detail``): this batch's rows are all wide.
        batch = self._batch(0, n if self.job.detail else 0)
        self.first_step += n
        self.n = 0
        self.last_flush = time.perf_counter()
        return batch

    def flush(self) -> None:
        batch = self.take()
        if batch is not None:
            self.send(batch)
