"""The sink interface: an async resource that receives every event of a run."""

from __future__ import annotations

import abc
from collections.abc import Mapping

from anyio.abc import AsyncResource

from .._model import Event

__all__ = ["Sink"]


class Sink(AsyncResource):
    """Receives a run's events in order through ``send``; ``aclose`` ends it.

    Each sink reads its own bounded stream: a slow ``send`` slows the run instead of growing
    memory. Do file or CPU work in ``anyio.to_thread.run_sync`` so the event loop stays free.
    """

    # Whether the sink reads the steps (``StepBatch``): when no sink of a run does, the workers
    # send none.
    needs_steps = True
    # The episode files the sink saves ("episode_data" or "compact", see ``sinks._files``): the
    # workers build them, where the steps are, and send them with ``EpisodeFinished.files``.
    episode_format: str | None = None
    # Whether the sink's state is its run's (a run starts it and closes it): such a sink serves
    # one run at a time, and a run that would share it with another still playing is refused.
    # False for a sink that keeps nothing per run and may serve overlapping runs.
    one_run_at_a_time = True

    @property
    def saved(self) -> Mapping[int, str]:
        """The folder each episode was saved in, by request index (``EpisodeResult.path``)."""
        return {}

    @abc.abstractmethod
    async def send(self, event: Event) -> None:
        """Handle one event."""

    async def aclose(self) -> None:
        """Release what the sink holds; called once when the run ends, even on failure."""
