"""The rows of the next ``StepBatch``, filled in place as the worker plays (no per-step arrays).

The steps' arrays go to the orchestrator when one of its sinks reads them (``job.detail``), and to
the worker's own ``EpisodeBuffer`` when the run saves episodes (``job.files``: the worker builds
their files at the end).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from .._model import StepBatch
from ..sinks._buffer import EpisodeBuffer
from ._recipe import EpisodeJob

__all__ = ["Batcher", "fill"]

# A batch leaves when it holds this many steps, or when this many seconds passed since the last one.
_BATCH_STEPS = 64
_BATCH_SECONDS = 0.1
# A step's wide rows (one per action, observation, ...): sent only to sinks that read them.
_WIDE = ("actions", "env_actions", "observations", "disc_lines", "attacks", "other_rewards")


def _to_float(value: Any) -> float:
    # grid2op's EpisodeData._convert_to_float
    try:
        return float(value)
    except Exception:
        return -float("inf")


def fill(row: np.ndarray, obj: Any) -> None:
    """``row[:] = obj.to_vect()`` for an observation or an action, without intermediate arrays.

    An action's injections live in its ``_dict_inj`` and unset ones take their class's default,
    as in grid2op's ``BaseAction._get_array_from_attr_name``.
    """
    cls = type(obj)
    injections = getattr(obj, "_dict_inj", {})
    start = 0
    for name in cls.attr_list_vect:
        value = getattr(obj, name, None)
        if value is None:
            value = injections[name] if name in injections else cls._build_attr(name)
        if isinstance(value, np.ndarray):
            end = start + value.size
            row[start:end] = value.ravel()
            start = end
        else:
            row[start] = value
            start += 1


class Batcher:
    """Preallocated rows for the next StepBatch; flushed by size or age."""

    def __init__(
        self, job: EpisodeJob, env: Any, n_other: int, send: Any, keep: EpisodeBuffer | None
    ) -> None:
        from grid2op.dtypes import dt_bool, dt_float

        self.job, self.send, self.keep = job, send, keep
        self.wide = job.detail or keep is not None  # the wide rows are filled
        n = _BATCH_STEPS if self.wide else 0
        self.actions = np.full((n, env.action_space.n), np.nan, dtype=dt_float)
        self.env_actions = np.full((n, env._helper_action_env.n), np.nan, dtype=dt_float)
        self.observations = np.full((n, env.observation_space.n), np.nan, dtype=dt_float)
        self.disc_lines = np.full((n, env.backend.n_line), np.nan, dtype=dt_bool)
        self.disc_templ = np.full(env.backend.n_line, False, dtype=dt_bool)
        self.attacks = np.zeros((n, env._opponent_action_space.n), dtype=dt_float)
        self.other_rewards = np.zeros((n, n_other), dtype=np.float64)
        self.rewards = np.zeros(_BATCH_STEPS, dtype=dt_float)
        self.done = np.zeros(_BATCH_STEPS, dtype=bool)
        self.legal = np.ones(_BATCH_STEPS, dtype=dt_bool)
        self.ambiguous = np.zeros(_BATCH_STEPS, dtype=dt_bool)
        self.agent_times = np.zeros(_BATCH_STEPS, dtype=dt_float)
        self.n = 0
        self.first_step = 1
        self.last_flush = time.perf_counter()

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
        i = self.n
        if self.wide:
            fill(self.actions[i], act)
            fill(self.env_actions[i], env._env_modification)
            fill(self.observations[i], obs)
            if attack is not None:
                fill(self.attacks[i], attack)
            else:
                self.attacks[i] = 0.0
            if "disc_lines" in info:
                arr = info["disc_lines"]
                self.disc_lines[i] = arr if arr is not None else self.disc_templ
            else:
                self.disc_lines[i] = True  # grid2op leaves its NaN-filled bool row
            rewards = info.get("rewards", {})
            for k, name in enumerate(names):
                self.other_rewards[i, k] = _to_float(rewards.get(name, np.nan))
        self.rewards[i] = reward
        self.done[i] = done
        self.legal[i] = not info["is_illegal"]
        self.ambiguous[i] = info["is_ambiguous"]
        self.agent_times[i] = agent_time
        self.n += 1
        if self.n == _BATCH_STEPS or done or time.perf_counter() - self.last_flush > _BATCH_SECONDS:
            self.flush()

    def flush(self) -> None:
        n = self.n
        if n == 0:
            return
        m = n if self.wide else 0
        job = self.job
        # Views of the rows: ``send`` pickles the batch at once and the buffer copies what it
        # keeps, before the rows are filled again.
        wide = {name: getattr(self, name)[:m] for name in _WIDE}
        batch = StepBatch(
            run_id=job.run_id,
            index=job.index,
            attempt=job.attempt,
            first_step=self.first_step,
            rewards=self.rewards[:n],
            done=self.done[:n],
            legal=self.legal[:n],
            ambiguous=self.ambiguous[:n],
            agent_times=self.agent_times[:n],
            **wide,
        )
        if self.keep is not None:
            self.keep.add(batch)
            if not job.detail:  # the orchestrator's sinks read no arrays: only the small ones go
                batch = dataclasses.replace(batch, **{k: a[:0] for k, a in wide.items()})
        self.send(batch)
        self.first_step += n
        self.n = 0
        self.last_flush = time.perf_counter()
