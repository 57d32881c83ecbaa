"""asyncrunner: run grid2op episodes concurrently from asyncio.

async with AsyncRunner(env, agent=DoNothingAgent, workers=2) as runner:
    results = await runner.run(nb_episode=4, path_save="runs/demo", pbar=True)
"""

from __future__ import annotations

from ._engine._central import CentralAgent
from ._exceptions import AsyncRunnerError, EpisodeError, SinkError, WorkerChannelError
from ._model import (
    EpisodeFailed,
    EpisodeFinished,
    EpisodeResult,
    EpisodeStarted,
    Event,
    RunFinished,
    RunStarted,
    StepBatch,
)
from ._runner import AsyncRunner
from ._score._scoring import ScenarioScore, ScoreResult, score

__all__ = [
    "AsyncRunner",
    "AsyncRunnerError",
    "CentralAgent",
    "EpisodeError",
    "EpisodeFailed",
    "EpisodeFinished",
    "EpisodeResult",
    "EpisodeStarted",
    "Event",
    "RunFinished",
    "RunStarted",
    "ScenarioScore",
    "ScoreResult",
    "SinkError",
    "StepBatch",
    "WorkerChannelError",
    "score",
]
