"""Buffering a run's steps per episode attempt: ``BufferingSink`` hands finished episodes on."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._model import (
    EpisodeFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    StepBatch,
)
from ._base import Sink

__all__ = ["BufferingSink", "EpisodeBuffer"]

# Rows added at a time when an episode's length is unknown (max_ts <= 0).
_GROW_ROWS = 64


class EpisodeBuffer:
    """One attempt of one episode, in arrays shaped as grid2op's Runner allocates them.

    With ``capacity > 0`` the arrays hold ``capacity`` rows (observations one more) padded as
    grid2op pads them (NaN; ``True`` for disconnected lines; ``0`` for attacks); otherwise they
    grow and are cut to the steps played.
    """

    def __init__(self, started: EpisodeStarted, capacity: int) -> None:
        self.started = started
        self.attempt = started.attempt
        self.fixed = capacity > 0
        self.capacity = capacity if capacity > 0 else 0
        self.n = 0
        self.cum_reward64 = 0.0  # as CompactEpisodeData sums: float(reward) in float64
        first = np.asarray(started.observation, dtype=np.float32)
        self.observations = np.full((self.capacity + 1, first.shape[0]), np.nan, dtype=np.float32)
        self.observations[0] = first
        self.rewards = np.full(self.capacity, np.nan, dtype=np.float32)
        self.times = np.full(self.capacity, np.nan, dtype=np.float32)
        self.legal = np.full(self.capacity, True, dtype=np.bool_)
        self.ambiguous = np.full(self.capacity, False, dtype=np.bool_)
        # Their widths come with the first batch.
        self.actions: np.ndarray | None = None
        self.env_actions: np.ndarray | None = None
        self.disc_lines: np.ndarray | None = None
        self.attacks: np.ndarray | None = None
        self.other_rewards: np.ndarray | None = None

    _PAD: Mapping[str, tuple[Any, Any]] = {
        "actions": (np.nan, np.float32),
        "env_actions": (np.nan, np.float32),
        "disc_lines": (True, np.bool_),
        "attacks": (0.0, np.float32),
        "other_rewards": (np.nan, np.float64),
    }

    def _wide(self, name: str, width: int, rows: int) -> np.ndarray:
        fill, dtype = self._PAD[name]
        return np.full((rows, width), fill, dtype=dtype)

    def _reserve(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        new = max(rows, 2 * self.capacity, _GROW_ROWS)

        def grown(arr: np.ndarray, fill: Any, extra: int = 0) -> np.ndarray:
            out = np.full((new + extra, *arr.shape[1:]), fill, dtype=arr.dtype)
            out[: arr.shape[0]] = arr
            return out

        self.observations = grown(self.observations, np.nan, 1)
        self.rewards = grown(self.rewards, np.nan)
        self.times = grown(self.times, np.nan)
        self.legal = grown(self.legal, True)
        self.ambiguous = grown(self.ambiguous, False)
        for name, (fill, _) in self._PAD.items():
            arr = getattr(self, name)
            if arr is not None:
                setattr(self, name, grown(arr, fill))
        self.capacity = new

    def add(self, batch: StepBatch) -> None:
        k = len(batch)
        lo = batch.first_step - 1
        hi = lo + k
        self._reserve(hi)
        if self.actions is None:
            rows = self.capacity
            self.actions = self._wide("actions", batch.actions.shape[1], rows)
            self.env_actions = self._wide("env_actions", batch.env_actions.shape[1], rows)
            self.disc_lines = self._wide("disc_lines", batch.disc_lines.shape[1], rows)
            self.attacks = self._wide("attacks", batch.attacks.shape[1], rows)
            self.other_rewards = self._wide("other_rewards", batch.other_rewards.shape[1], rows)
        assert self.env_actions is not None and self.disc_lines is not None
        assert self.attacks is not None and self.other_rewards is not None
        self.actions[lo:hi] = batch.actions
        self.env_actions[lo:hi] = batch.env_actions
        self.observations[lo + 1 : hi + 1] = batch.observations
        self.rewards[lo:hi] = batch.rewards
        self.times[lo:hi] = batch.agent_times
        self.disc_lines[lo:hi] = batch.disc_lines
        self.attacks[lo:hi] = batch.attacks
        self.legal[lo:hi] = batch.legal
        self.ambiguous[lo:hi] = batch.ambiguous
        self.other_rewards[lo:hi] = batch.other_rewards
        for reward in batch.rewards.tolist():
            self.cum_reward64 += float(reward)
        self.n = max(self.n, hi)

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays to save: preallocated ones whole, grown ones cut to the steps played."""
        if self.actions is None:  # no step arrived (grid2op always plays at least one)
            self._reserve(1)
            for name in self._PAD:
                setattr(self, name, self._wide(name, 0, self.capacity))
        rows = self.capacity if self.fixed else self.n
        out = {
            "observations": self.observations[: rows + 1],
            "rewards": self.rewards[:rows],
            "times": self.times[:rows],
            "legal": self.legal[:rows],
            "ambiguous": self.ambiguous[:rows],
        }
        for name in self._PAD:
            out[name] = getattr(self, name)[:rows]
        return out


class BufferingSink(Sink):
    """Keeps each episode attempt's steps in an ``EpisodeBuffer``; hands finished ones on.

    A retried episode's new attempt replaces the old one's buffer; a failed one is dropped.
    """

    needs_steps = True

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], EpisodeBuffer] = {}

    def _capacity(self, started: EpisodeStarted) -> int:
        return started.max_ts  # grid2op preallocates chronics_handler.max_timestep() rows

    @abc.abstractmethod
    async def _finished(self, buffer: EpisodeBuffer, finished: EpisodeFinished) -> None:
        """Hand on a finished episode's buffer."""

    async def send(self, event: Event) -> None:
        if isinstance(event, StepBatch):
            buffer = self._open.get((event.run_id, event.index))
            if buffer is not None and buffer.attempt == event.attempt:
                buffer.add(event)
        elif isinstance(event, EpisodeStarted):
            self._open[(event.run_id, event.index)] = EpisodeBuffer(event, self._capacity(event))
        elif isinstance(event, EpisodeFinished | EpisodeFailed):
            key = (event.run_id, event.index)
            buffer = self._open.get(key)
            if buffer is None or buffer.attempt != event.attempt:
                return
            del self._open[key]  # its memory goes once handed on
            if isinstance(event, EpisodeFinished):
                await self._finished(buffer, event)

    async def aclose(self) -> None:
        self._open.clear()
