"""``ProgressBar``: an episode bar and a step bar over the whole run (what ``pbar=`` adds)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from .._model import (
    STOPPED,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    RunFinished,
    RunStarted,
    StepBatch,
)
from ._base import Sink

__all__ = ["ProgressBar"]


class ProgressBar(Sink):
    """Shows the run's progress: episodes done, and steps played summed over all workers.

    ``pbar`` has grid2op's meanings: ``True`` for tqdm (``tqdm.auto``, so it renders in
    Jupyter); a tqdm-like class, called with ``total=`` and ``desc=`` for both bars; or an
    instance, used as the episode bar only (and closed at the end of the run, as grid2op does).
    The step bar's total grows with each started episode's ``max_ts`` and shrinks to the steps
    actually played when an episode ends early, so both bars end at their totals.
    """

    needs_steps = False

    def __init__(self, pbar: Any = True) -> None:
        if pbar is None or pbar is False:
            raise ValueError("ProgressBar(pbar) needs True, a tqdm-like class or an instance")
        if pbar is not True and not isinstance(pbar, type) and not hasattr(pbar, "update"):
            # (it failed at the first episode's end, once that episode was played)
            raise TypeError(
                "ProgressBar(pbar) needs True, a tqdm-like class or a bar with an update(n) "
                f"method, got {pbar!r}"
            )
        self.pbar = pbar
        self._episodes: Any = None
        self._steps: Any = None
        # (index, attempt) -> [max_ts, steps counted] of the attempts still running
        self._running: dict[tuple[int, int], list[int]] = {}
        self._failed = 0

    def __repr__(self) -> str:
        return f"ProgressBar({self.pbar!r})"

    def _open(self, nb_episode: int) -> None:
        pbar = self.pbar
        if sys.stderr is None and (pbar is True or _draws_on_stderr(pbar)):
            # pythonw, `2>&-`, a daemon: nowhere to draw (tqdm would fail, and leave its lock
            # held: the next bar, and the process at its exit, would wait for it for ever)
            return
        if pbar is True:
            from tqdm.auto import tqdm

            with _stderr_drawn():
                self._episodes = tqdm(total=nb_episode, desc="episode", unit="ep", position=0)
                self._steps = tqdm(total=0, desc="step", unit="step", position=1)
        elif isinstance(pbar, type):
            # Called as grid2op's Runner calls it: a subclass of yours may choose its own file
            # (it drew on stderr when given ``file=``); where it takes tqdm's default, stderr,
            # it gets that stream as ``_Drawn`` guards it.
            with _stderr_drawn() if _draws_on_stderr(pbar) else contextlib.nullcontext():
                self._episodes = pbar(total=nb_episode, desc="episode")
                self._steps = pbar(total=0, desc="step")
        else:
            self._episodes = pbar

    async def send(self, event: Event) -> None:
        if isinstance(event, StepBatch):
            running = self._running.get((event.index, event.attempt))
            if running is not None:
                n = len(event)
                running[1] += n
                if self._steps is not None:
                    self._steps.update(n)
        elif isinstance(event, EpisodeStarted):
            self._running[(event.index, event.attempt)] = [event.max_ts, 0]
            self._grow(event.max_ts)
        elif isinstance(event, EpisodeFinished):
            max_ts, counted = self._running.pop((event.index, event.attempt), [0, 0])
            # Game over before max_ts: the episode's share of the total is what it played.
            self._grow(event.nb_time_step - max_ts)
            if counted != event.nb_time_step and self._steps is not None:
                self._steps.update(event.nb_time_step - counted)
            if self._episodes is not None:
                self._episodes.update(1)
        elif isinstance(event, EpisodeFailed):
            max_ts, counted = self._running.pop((event.index, event.attempt), [0, 0])
            if event.retrying:
                # The next attempt starts over and counts its steps again.
                self._grow(-max_ts)
                if counted and self._steps is not None:
                    self._steps.update(-counted)
            else:
                self._grow(counted - max_ts)
                self._failed += event.error_type != STOPPED
                if self._episodes is not None:
                    if hasattr(self._episodes, "set_postfix"):
                        self._episodes.set_postfix(failed=self._failed, refresh=False)
                    self._episodes.update(1)
        elif isinstance(event, RunStarted):
            self._close()
            self._open(event.nb_episode)
        elif isinstance(event, RunFinished):
            self._close()

    def _grow(self, by: int) -> None:
        bar = self._steps
        if bar is None or not by or not hasattr(bar, "total"):
            return
        bar.total = (bar.total or 0) + by
        widget = getattr(bar, "container", None)  # tqdm.notebook keeps its own copy of the total
        if widget is not None:
            try:
                progress = widget.children[1]
                progress.max = max(bar.total, 1)
                progress.bar_style = ""
                progress.layout.width = None
            except (AttributeError, IndexError):
                pass
        if hasattr(bar, "refresh"):
            bar.refresh()

    def _close(self) -> None:
        bars, self._episodes, self._steps = (self._episodes, self._steps), None, None
        self._running.clear()
        self._failed = 0
        for bar in bars:
            if bar is not None:
                bar.close()

    async def aclose(self) -> None:
        self._close()


def _draws_on_stderr(pbar: Any) -> bool:
    """A tqdm class (``tqdm``, ``tqdm.auto.tqdm``, a subclass): it draws on ``sys.stderr``
    unless it chooses another file."""
    tqdm = sys.modules.get("tqdm.std")
    return tqdm is not None and isinstance(pbar, type) and issubclass(pbar, tqdm.tqdm)


@contextlib.contextmanager
def _stderr_drawn() -> Iterator[None]:
    """``sys.stderr`` as ``_Drawn`` guards it, while a tqdm class makes its bars: tqdm takes it
    where it is given no file (a notebook's takes stdout for it, as for ``sys.stderr``)."""
    stderr = sys.stderr
    sys.stderr = _Drawn(stderr)  # (a stream as tqdm uses one)
    try:
        yield
    finally:
        sys.stderr = stderr


class _Drawn:
    """``stream`` as tqdm draws on it, where a write or flush never raises: a stream closed (by
    a daemon, a library), or a pipe whose reader left, stops the drawing and not the run. tqdm
    lets such errors through (and leaves its lock held: the next bar, and the process at its
    exit, would wait for it for ever)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty: tqdm's checks
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except (OSError, ValueError):
            return 0

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()
