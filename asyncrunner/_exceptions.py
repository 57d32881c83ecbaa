"""Errors raised by asyncrunner.

    AsyncRunnerError
    ├── EpisodeError       an episode failed and ``on_error="raise"``: carries the finished results
    ├── SinkError          a sink raised while handling an event: carries the finished results
    └── WorkerChannelError the channel from the workers broke

Bad arguments raise ``ValueError`` / ``TypeError`` before any work starts. Cancellation is never
wrapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._model import EpisodeFailed, EpisodeResult

__all__ = ["AsyncRunnerError", "EpisodeError", "SinkError", "WorkerChannelError"]


class AsyncRunnerError(Exception):
    """Base class of asyncrunner's own errors."""


class EpisodeError(AsyncRunnerError):
    """Raised when an episode fails under ``on_error="raise"``; ``results`` hold what finished."""

    def __init__(self, failure: EpisodeFailed, results: list[EpisodeResult]) -> None:
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


class SinkError(AsyncRunnerError):
    """Raised when a sink fails, whatever ``on_error`` says: the run stops, the message names the
    sink; ``results`` hold the episodes played to their end (``path`` says which were saved)."""

    def __init__(self, message: str, results: list[EpisodeResult] | None = None) -> None:
        super().__init__(message)
        self.results: list[EpisodeResult] = [] if results is None else results


class WorkerChannelError(AsyncRunnerError):
    """Raised when the channel that carries steps back from the workers breaks."""


def leaves(group: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or ``[group]`` for a plain one."""
    if isinstance(group, BaseExceptionGroup):
        return [leaf for e in group.exceptions for leaf in leaves(e)]
    return [group]
