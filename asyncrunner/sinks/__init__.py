"""Sinks: async resources that receive a run's events (``send``) and are closed at its end."""

from __future__ import annotations

from ._base import Sink
from ._callback import CallbackSink
from ._compact import CompactEpisodeWriter
from ._episode_data import EpisodeDataWriter
from ._logging import LoggingSink
from ._progress import ProgressBar

__all__ = [
    "CallbackSink",
    "CompactEpisodeWriter",
    "EpisodeDataWriter",
    "LoggingSink",
    "ProgressBar",
    "Sink",
]
