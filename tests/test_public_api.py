"""The public front door: exactly the documented names, each importable and documented."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "asyncrunner": [
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
    ],
    "asyncrunner.sinks": [
        "CallbackSink",
        "CompactEpisodeWriter",
        "EpisodeDataWriter",
        "LoggingSink",
        "ProgressBar",
        "Sink",
    ],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_all_is_exactly_the_documented_names_sorted(module: str) -> None:
    mod = importlib.import_module(module)
    assert mod.__all__ == PUBLIC[module]
    assert mod.__all__ == sorted(mod.__all__)


@pytest.mark.parametrize(("module", "name"), [(m, n) for m in PUBLIC for n in PUBLIC[m]])
def test_each_public_name_is_importable_and_documented(module: str, name: str) -> None:
    obj = getattr(importlib.import_module(module), name)
    if name == "Event":  # a type alias (a union of the event classes)
        return
    assert obj.__doc__ and obj.__doc__.strip()
    assert obj.__module__.startswith("asyncrunner")
