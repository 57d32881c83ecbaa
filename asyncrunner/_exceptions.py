"""Errors raised by asyncrunner.

    AsyncRunnerError
    ├── EpisodeError       an episode failed and ``on_error="raise"``: carries the finished results
    ├── SinkError          a sink raised while handling an event
    └── WorkerChannelError the channel from the workers broke

Bad arguments raise ``ValueError`` / ``TypeError`` before any work starts. Cancellation is never
wrapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._events import EpisodeFailed
    from ._results import EpisodeResult

__all__ = ["AsyncRunnerError", "EpisodeError", "SinkError", "WorkerChannelError"]


class AsyncRunnerError(Exception):
    """Base class of asyncrunner's own errors."""


class EpisodeError(AsyncRunnerError):
    """Raised when an episode fails under ``on_error="raise"``; ``results`` hold what finished."""

    def __init__(self, failure: EpisodeFailed, results: list[EpisodeResult]) -> None:
        super().__init__(
            f"episode {failure.index} failed after {failure.step} steps: "
            f"{failure.error_type}: {failure.message}\n{failure.traceback}"
        )
        self.failure = failure
        self.results = results


class SinkError(AsyncRunnerError):
    """Raised when a sink fails; the run stops, the message names the sink."""


class WorkerChannelError(AsyncRunnerError):
    """Raised when the channel that carries steps back from the workers breaks."""
