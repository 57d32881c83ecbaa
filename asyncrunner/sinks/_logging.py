"""``LoggingSink``: the run's story in stdlib ``logging`` (the ``"asyncrunner"`` logger)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .._model import (
    STOPPED,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    RunFinished,
    RunStarted,
)
from .._plan._arguments import is_integer
from ._base import Sink

__all__ = ["LoggingSink"]


class LoggingSink(Sink):
    """Logs each episode's start and finish (reward, steps and the times grid2op's Runner logs).

    ``logger``: a ``logging.Logger`` or a logger name (default ``"asyncrunner"``); ``level`` is
    used for the normal story. A failed episode is logged at ERROR with the worker's traceback
    (WARNING when it is retried, or stopped by another's failure). Step batches are not logged.
    It keeps nothing per run: one may serve overlapping runs.
    """

    needs_steps = False
    one_run_at_a_time = False

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter[Any] | str | None = None,
        level: int = logging.INFO,
    ) -> None:
        if logger is None or isinstance(logger, str):
            logger = logging.getLogger(logger or "asyncrunner")
        if not isinstance(logger, logging.Logger | logging.LoggerAdapter):
            raise TypeError(
                f"LoggingSink(logger) needs a logging.Logger (or adapter) or its name, got {logger!r}"
            )
        if not is_integer(level):
            raise TypeError(
                f"LoggingSink(level=) needs a logging level (logging.INFO), got {level!r}"
            )
        self.logger = logger
        self.level = int(level)

    def __repr__(self) -> str:
        return f"LoggingSink(logger={self.logger.name!r}, level={logging.getLevelName(self.level)})"

    async def send(self, event: Event) -> None:
        log, level = self.logger, self.level
        if isinstance(event, EpisodeFailed):
            # Retried, or stopped by another episode's failure: not this episode's error.
            again = event.retrying or event.error_type == STOPPED
            failed_level = logging.WARNING if again else logging.ERROR
            if log.isEnabledFor(failed_level):
                log.log(
                    failed_level,
                    "episode %d (attempt %d) failed after %d %s: %s: %s%s%s",
                    event.index,
                    event.attempt,
                    event.step,  # the steps played
                    "step" if event.step == 1 else "steps",
                    event.error_type,
                    event.message,
                    "; retrying" if event.retrying else "",
                    f"\n{event.traceback.rstrip()}" if event.traceback else "",
                )
        elif not log.isEnabledFor(level):
            return
        elif isinstance(event, EpisodeStarted):
            log.log(
                level,
                "episode %d (%s) started on worker %d (attempt %d, env_seed=%s, agent_seed=%s)",
                event.index,
                event.name,
                event.worker,
                event.attempt,
                event.env_seed,
                event.agent_seed,
            )
        elif isinstance(event, EpisodeFinished):
            env, agent = _section(event.times, "Env"), _section(event.times, "Agent")
            log.log(
                level,
                "episode %d (%s) finished: cumulative reward %f, %d/%d steps\n"
                "\tEnv: %.2fs\n"
                "\t - apply act: %.2fs\n"
                "\t - run pf: %.2fs\n"
                "\t - env update + observation: %.2fs\n"
                "\tAgent: %.2fs\n"
                "\tTotal time: %.2fs",
                event.index,
                event.name,
                event.cum_reward,
                event.nb_time_step,
                event.max_ts,
                env.get("total", 0.0),
                env.get("apply_act", 0.0),
                env.get("powerflow_computation", 0.0),
                env.get("observation_computation", 0.0),
                agent.get("total", 0.0),
                float(event.times.get("total", 0.0)),
            )
        elif isinstance(event, RunStarted):
            log.log(level, "run %s started: %d episodes", event.run_id, event.nb_episode)
        elif isinstance(event, RunFinished):
            failed = sum(r.error is not None for r in event.results)
            log.log(
                level,
                "run %s finished: %d episodes, %d failed",
                event.run_id,
                len(event.results),
                failed,
            )


def _section(times: Mapping[str, Any], name: str) -> Mapping[str, float]:
    section = times.get(name)
    return section if isinstance(section, Mapping) else {}
