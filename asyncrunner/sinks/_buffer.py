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
from ._npz import Padded

__all__ = ["BufferingSink", "EpisodeBuffer"]

# Rows allocated first, then doubled when full: only the rows played are kept.
_GROW_ROWS = 64
# Each array's padding, as grid2op's Runner preallocates it, and its dtype.
_FILLS: Mapping[str, tuple[Any, Any]] = {
    "observations": (np.nan, np.float32),
    "rewards": (np.nan, np.float32),
    "times": (np.nan, np.float32),
    "legal": (True, np.bool_),
    "ambiguous": (False, np.bool_),
    "actions": (np.nan, np.float32),
    "env_actions": (np.nan, np.float32),
    "disc_lines": (True, np.bool_),
    "attacks": (0.0, np.float32),
    "other_rewards": (np.nan, np.float64),
}
_WIDE = ("actions", "env_actions", "disc_lines", "attacks", "other_rewards")


class EpisodeBuffer:
    """One attempt of one episode, in arrays shaped as grid2op's Runner allocates them.

    Only the rows played are kept (for a short episode the padding would be nearly all of its
    memory): ``padded(capacity)`` gives them with their padding, ``arrays(capacity)`` the whole
    arrays. With ``capacity > 0`` the arrays have ``capacity`` rows (observations one more), the
    rows after the last step padded as grid2op pads them (NaN; ``True`` for disconnected lines
    and legal; ``False`` for ambiguous; ``0`` for attacks); otherwise they hold the steps played.

    ``spare``: the arrays of an earlier buffer (``release``), reused when their widths fit. Its
    steps must then arrive in order from the first (as a worker adds them): only the rows played
    are read, and those are written first.
    """

    def __init__(
        self, started: EpisodeStarted, spare: Mapping[str, np.ndarray] | None = None
    ) -> None:
        self.started = started
        self.attempt = started.attempt
        self.n = 0
        self._first = np.asarray(started.observation, dtype=np.float32)
        self._data: dict[str, np.ndarray] = {}  # allocated with the first batch's widths
        self._spare = spare

    def _allocate(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        spare, self._spare = self._spare, None
        if spare and all(
            spare[name].shape[1:] == shapes[name] and spare[name].dtype == dtype
            for name, (_, dtype) in _FILLS.items()
        ):
            self._data = dict(spare)
        else:
            for name, (fill, dtype) in _FILLS.items():
                rows = _GROW_ROWS + (name == "observations")
                self._data[name] = np.full((rows, *shapes[name]), fill, dtype=dtype)
        self._data["observations"][0] = self._first

    def _reserve(self, rows: int) -> None:
        size = len(self._data["rewards"])
        if rows <= size:
            return
        new = max(rows, 2 * size)
        for name, arr in self._data.items():
            out = np.full(
                (new + (name == "observations"), *arr.shape[1:]), _FILLS[name][0], arr.dtype
            )
            out[: len(arr)] = arr
            self._data[name] = out

    def add(self, batch: StepBatch) -> None:
        k = len(batch)
        lo = batch.first_step - 1
        if not self._data:
            self._allocate({name: _of(batch, name).shape[1:] for name in _FILLS})
        self._reserve(lo + k)
        for name, arr in self._data.items():
            start = lo + (name == "observations")
            arr[start : start + k] = _of(batch, name)
        self.n = max(self.n, lo + k)

    def padded(self, capacity: int) -> dict[str, Padded]:
        """The arrays to save: the rows played, and the padding that follows them up to
        ``capacity`` rows."""
        if not self._data:  # no step arrived (grid2op always plays at least one)
            shapes = {name: (0,) if name in _WIDE else () for name in _FILLS}
            self._allocate({**shapes, "observations": self._first.shape})
        rows = max(capacity, self.n) if capacity > 0 else self.n
        out = {}
        for name, arr in self._data.items():
            extra = int(name == "observations")
            fill = np.full(arr.shape[1:], _FILLS[name][0], dtype=arr.dtype)
            out[name] = Padded(arr[: self.n + extra], rows + extra, fill)
        return out

    def release(self) -> dict[str, np.ndarray]:
        """This buffer's arrays, for a later one to reuse (``spare``); this one is left empty."""
        data, self._data, self.n = self._data, {}, 0
        return data

    def arrays(self, capacity: int) -> dict[str, np.ndarray]:
        """The whole arrays, padding included."""
        return {name: padded.full() for name, padded in self.padded(capacity).items()}


def _of(batch: StepBatch, name: str) -> np.ndarray:
    """A batch's rows of array ``name``."""
    return batch.agent_times if name == "times" else getattr(batch, name)


class BufferingSink(Sink):
    """Keeps each episode attempt's steps in an ``EpisodeBuffer``; hands finished ones on.

    A retried episode's new attempt replaces the old one's buffer; a failed one is dropped.
    """

    needs_steps = True

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], EpisodeBuffer] = {}

    @abc.abstractmethod
    async def _finished(self, buffer: EpisodeBuffer, finished: EpisodeFinished) -> None:
        """Hand on a finished episode's buffer."""

    async def send(self, event: Event) -> None:
        if isinstance(event, StepBatch):
            buffer = self._open.get((event.run_id, event.index))
            if buffer is not None and buffer.attempt == event.attempt:
                buffer.add(event)
        elif isinstance(event, EpisodeStarted):
            self._open[(event.run_id, event.index)] = EpisodeBuffer(event)
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
