"""An episode's saved files, built in the worker that played it (``EpisodeFinished.files``).

Compressing an episode's arrays is most of what saving costs: done where the steps are, it runs in
parallel on every worker, the steps' arrays never cross to the orchestrator, and the writer sinks
only write finished bytes. Each writer names its format (``Sink.episode_format``); a run's
workers build the formats of its sinks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .._model import EpisodeFinished
from ._buffer import EpisodeBuffer
from ._compact import compact_files
from ._episode_data import episode_data_files

__all__ = ["FORMATS", "episode_files"]

FORMATS: dict[str, Callable[[EpisodeBuffer, EpisodeFinished], dict[str, bytes]]] = {
    "episode_data": episode_data_files,
    "compact": compact_files,
}


def episode_files(
    buffer: EpisodeBuffer, finished: EpisodeFinished, formats: Iterable[str]
) -> dict[str, dict[str, bytes]]:
    """The files of each of ``formats``, by format, then by file name."""
    return {name: FORMATS[name](buffer, finished) for name in formats}
