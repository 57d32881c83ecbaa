"""An episode's saved files, built in the worker that played it (``EpisodeFinished.files``).

Compressing an episode's arrays is most of what saving costs: done where the steps are, it runs in
parallel on every worker, the steps' arrays never cross to the orchestrator, and the writer sinks
only write finished bytes, or, when the workers run on this machine, only move the files the
workers wrote. Each writer names its format (``Sink.episode_format``); a run's workers build the
formats of its sinks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from .._model import EpisodeFinished, Staged
from ._buffer import EpisodeBuffer
from ._compact import compact_files
from ._episode_data import episode_data_files
from ._writer import stage_files

__all__ = ["FORMATS", "episode_files"]

FORMATS: dict[
    str, Callable[[EpisodeBuffer, EpisodeFinished, str | None, str | None], dict[str, bytes]]
] = {
    "episode_data": episode_data_files,
    "compact": compact_files,
}


def episode_files(
    buffer: EpisodeBuffer,
    finished: EpisodeFinished,
    formats: Iterable[str],
    agent: str | None,
    env: str | None,
    stages: Mapping[str, str],
) -> dict[str, Mapping[str, bytes] | Staged]:
    """The files of each of ``formats``, by format, then by file name (``agent`` and ``env``:
    the run's agent name and the env's key, recorded with the episode); those of a format with a
    stage folder (``Writer.stage``) written there (``Staged``), unless that fails: the writer
    then writes them."""
    files: dict[str, Mapping[str, bytes] | Staged] = {}
    for name in formats:
        files[name] = built = FORMATS[name](buffer, finished, agent, env)
        if name in stages:
            try:
                files[name] = stage_files(stages[name], built)
            except OSError:  # the stage removed, the disk full...: the writer will say why
                pass
    return files
