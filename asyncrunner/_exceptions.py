"""Errors raised by asyncrunner.

    AsyncRunnerError
    ├── EpisodeError       an episode failed and ``on_error="raise"``: carries the finished results
    ├── SinkError          a sink raised while handling an event: carries the finished results
    └── WorkerChannelError the channel from the workers broke

Bad arguments raise ``ValueError`` / ``TypeError`` before any work starts. Cancellation is never
wrapped.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._model import EpisodeFailed, EpisodeResult

__all__ = ["AsyncRunnerError", "EpisodeError", "SinkError", "WorkerChannelError"]


class AsyncRunnerError(Exception):
    """Base class of asyncrunner's own errors."""


class EpisodeError(AsyncRunnerError):
    """Raised when an episode fails under ``on_error="raise"``; ``results`` hold what finished,
    ``result`` the failed episode's own (its chronic, seeds and steps), when the run made it."""

    def __init__(
        self,
        failure: EpisodeFailed,
        results: list[EpisodeResult],
        result: EpisodeResult | None = None,
    ) -> None:
        if failure.steps_lost:
            where = (
                f"after step {failure.step} (the last step received from its worker; "
                "steps played after it were not received)"
            )
        else:
            where = f"after {failure.step} steps"
        super().__init__(
            f"episode {failure.index} failed {where}: "
            f"{failure.error_type}: {failure.message}\n{failure.traceback}"
        )
        self.failure = failure
        self.results = results
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:
        # (pickled by a process pool, a Dask task...: rebuilt with its failure and results)
        result = None if self.result is None else _portable([self.result])[0]
        return type(self), (self.failure, _portable(self.results), result)


class SinkError(AsyncRunnerError):
    """Raised when a sink fails, whatever ``on_error`` says: the run stops, the message names the
    sink (``sink``: the sink itself); ``results`` hold the episodes played to their end (``path``
    says which were saved)."""

    def __init__(
        self, message: str, results: list[EpisodeResult] | None = None, sink: Any = None
    ) -> None:
        super().__init__(message)
        self.results: list[EpisodeResult] = [] if results is None else results
        self.sink = sink

    def __reduce__(self) -> tuple[Any, ...]:
        # The sink, a live object of the process that ran the run (a lock, an open file...),
        # does not go along.
        return type(self), (str(self), _portable(self.results))


def _portable(results: list[EpisodeResult]) -> list[EpisodeResult]:
    """``results`` without their ``episode_data``, for another process: grid2op's objects in it
    are of classes grid2op makes at run time, which another process cannot load (it failed the
    process pool that ran the run: ``BrokenProcessPool`` instead of this error)."""
    return [
        r if r.episode_data is None else dataclasses.replace(r, episode_data=None) for r in results
    ]


class WorkerChannelError(AsyncRunnerError):
    """Raised when the channel that carries steps back from the workers breaks."""


def text_of(exc: BaseException) -> str:
    """``str(exc)``, or what ``traceback`` shows when the exception's ``__str__`` fails (an
    agent's exception reported as it was raised, not as the failure of its report)."""
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"


class unwrapped:  # a context manager, named as contextlib names its own
    """Re-raise the meaningful error out of task-group exception groups (cancellation untouched):
    the first of asyncrunner's own errors, else the first other one."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, BaseExceptionGroup):
            import anyio

            cancelled = anyio.get_cancelled_exc_class()
            real = [e for e in leaves(exc) if not isinstance(e, cancelled)]
            if real:
                ours = [e for e in real if isinstance(e, AsyncRunnerError)]
                raise (ours or real)[0]


def leaves(group: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or ``[group]`` for a plain one."""
    if isinstance(group, BaseExceptionGroup):
        return [leaf for e in group.exceptions for leaf in leaves(e)]
    return [group]
