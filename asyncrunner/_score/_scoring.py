"""``asyncrunner.score``: grid2op's competition scores (``grid2op.utils.Score*``) on one warm pool.

grid2op's score classes play two reference agents in their constructor (DoNothing, and
RecoPowerline with ``NO_OVERFLOW_DISCONNECTION``), cache their ``EpisodeStatistics`` in the env's
folder, then play the agent in ``get``: three phases, each with a new Runner. Here every episode
(references and agents) is played at once. An ``AsyncRunner`` plays one agent on one env
recipe, so there is one runner per (agent, parametrisation), all running concurrently on one
pool of ``workers`` processes (``sharing_workers``): their episodes interleave on the same warm
workers, forked with every runner's env already built.

The arithmetic stays grid2op's: the reference episodes go through ``EpisodeStatistics.compute``'s
own post-processing (grid2op's layout, in our cache folder rather than the env's), and each
episode's score is the score class's own ``_compute_episode_score``.
"""

from __future__ import annotations

import functools
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from .._exceptions import EpisodeError, unwrapped
from .._plan._arguments import at_least
from .._plan._mixes import mixes_of
from .._runner import AsyncRunner, check_env, sharing_workers, usable_cpus
from ._grid2op import COMPETITIONS, ScorePlan, compute_stats, grid2op_scores

__all__ = ["COMPETITIONS", "ScenarioScore", "ScoreResult", "score"]

# What each entry of a per-scenario score tuple holds, after the score itself.
_COMPONENTS = {
    "l2rpn_2023": ("operational", "renewables", "assistant"),
    "icaps_2021": ("operational", "alarm"),
}


@dataclass(frozen=True)
class ScenarioScore:
    """One scenario's score: ``components`` are the competition's sub-scores (may be empty)."""

    name: str
    score: float
    components: Mapping[str, float]
    steps_survived: int
    total_steps: int


@dataclass(frozen=True)
class ScoreResult:
    """An agent's score: ``total`` is the mean of the scenarios' scores.

    ``references_reused``: the reference statistics came from the cache. ``path``: the folder of
    the agent's episodes (EpisodeData format), when ``path_save`` was given.
    """

    agent: str
    competition: str
    scenarios: tuple[ScenarioScore, ...]
    references_reused: bool
    path: str | None
    grid2op_result: tuple[Any, ...] = field(repr=False)

    @property
    def total(self) -> float:
        return sum(s.score for s in self.scenarios) / len(self.scenarios)

    def as_grid2op(self) -> tuple[Any, ...]:
        """What grid2op's ``Score*.get(agent)`` returns: ``(scores, ts_survived, total_ts)``."""
        return self.grid2op_result


async def score(
    env: Any,
    agents: Any,
    *,
    competition: str,
    nb_scenario: int | None = None,
    max_step: int | None = None,
    env_seeds: Sequence[int] | None = None,
    agent_seeds: Sequence[int] | None = None,
    workers: int | None = None,
    path_save: str | os.PathLike[str] | None = None,
    resume: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[ScoreResult]:
    """Score each of ``agents`` as grid2op's class for ``competition`` does; one result each.

    ``agents``: one agent or a list, each as ``AsyncRunner(agent=...)`` takes it. Other
    arguments mean what they mean for grid2op's class (``max_step``: steps per scenario).
    ``workers``: worker processes in all, shared by every agent and reference. ``path_save``: one folder per
    agent and per reference, EpisodeData format; ``resume`` completes them. Reference statistics
    are cached in ``cache_dir`` (default ``~/.cache/asyncrunner/scores``), keyed by everything
    that changes them.
    """
    check_env(env)
    if competition not in COMPETITIONS:
        raise ValueError(
            f"unknown competition {competition!r}: choose one of {', '.join(COMPETITIONS)}"
        )
    agent_list = list(agents) if isinstance(agents, (list, tuple)) else [agents]
    if not agent_list:
        raise ValueError("`agents` is empty: pass an agent or a list of agents")
    if resume and path_save is None:
        raise ValueError("`resume=True` needs `path_save`: the folder of the score to resume")
    mixes = mixes_of(env)
    if mixes is not None:
        first = next(iter(mixes.values()), None)
        where = f" (the first: {first.get_path_env()})" if first is not None else ""
        raise ValueError(
            "grid2op's score classes do not take a MultiMixEnvironment: score each mix as an "
            f"env of its own, grid2op.make(<its folder>){where}"
        )
    for name, value, lowest in (("nb_scenario", nb_scenario, 1), ("max_step", max_step, -1)):
        whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if value is not None and (not whole or value < lowest or value == 0):
            also = " (or -1: every step of the scenario)" if lowest < 0 else ""
            raise ValueError(f"`{name}` must be an integer >= 1{also}, got {value!r}")
    if workers is not None:
        workers = at_least("workers", workers, 1)
    plan = await anyio.to_thread.run_sync(
        functools.partial(
            ScorePlan.make, env, agent_list, competition=competition, nb_scenario=nb_scenario,
            max_step=max_step, env_seeds=env_seeds, agent_seeds=agent_seeds,
            path_save=path_save, cache_dir=cache_dir,
        )
    )  # fmt: skip
    try:
        return await _play_and_score(plan, competition, env_seeds, agent_seeds, workers, resume)
    finally:
        # Shielded: a cancelled score still closes its env copies and removes its temp folder.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(plan.close)


async def _play_and_score(
    plan: ScorePlan,
    competition: str,
    env_seeds: Sequence[int] | None,
    agent_seeds: Sequence[int] | None,
    workers: int | None,
    resume: bool,
) -> list[ScoreResult]:
    total = workers if workers is not None else usable_cpus()
    runners = [AsyncRunner(job_env, agent=agent, workers=total) for _, job_env, agent in plan.jobs]
    results: list[Any] = [None] * len(plan.jobs)
    failed: list[EpisodeError] = []

    async def play(i: int, folder: str, agents: anyio.CancelScope | None = None) -> None:
        try:
            results[i] = await runners[i].run(
                plan.nb,
                path_save=os.path.join(plan.root, folder),
                max_iter=plan.max_iter,
                env_seeds=env_seeds,
                agent_seeds=agent_seeds,
                resume=resume,
            )
        except EpisodeError as exc:
            # Agents and references play at once: say whose episode it was.
            whose = "the reference" if agents is None else "agent"
            exc.add_note(f"(scenario {exc.failure.index} of {whose} {folder!r})")
            if agents is None:
                raise
            # An agent's failure stops the agents, not the references: their statistics are
            # cached for the next score (grid2op's classes compute them before any agent).
            failed.append(exc)
            agents.cancel()

    # One pool for every runner: the references' and the agents' episodes interleave on the
    # same warm workers.
    resets = [{"time serie id": i, "max step": plan.max_iter} for i in range(plan.nb)]
    # A run's error comes out as the run raises it (an EpisodeError, ...), not in a group.
    with unwrapped():
        async with sharing_workers(runners, total, resets), anyio.create_task_group() as group:
            n = len(plan.todo)
            for i, (folder, _, _) in enumerate(plan.jobs[:n]):
                group.start_soon(play, i, folder)
            async with anyio.create_task_group() as agents:
                for i, (folder, _, _) in enumerate(plan.jobs[n:], start=n):
                    agents.start_soon(play, i, folder, agents.cancel_scope)
    scorer = plan.scorer
    for ref, episodes in zip(plan.todo, results, strict=False):
        await anyio.to_thread.run_sync(
            compute_stats, scorer, ref, os.path.join(plan.root, ref.name), episodes, env_seeds,
            agent_seeds,
        )  # fmt: skip
    if failed:
        raise failed[0]
    for ref in plan.refs:
        setattr(scorer, ref.attr, ref.stats)
    scored = []
    for label, episodes in zip(plan.labels, results[len(plan.todo) :], strict=True):
        raw, ordered = await anyio.to_thread.run_sync(grid2op_scores, scorer, episodes)
        path = None if plan.tmp is not None else os.path.join(plan.root, label)
        scored.append(_result(label, competition, raw, ordered, reused=not plan.todo, path=path))
    return scored


def _result(
    label: str,
    competition: str,
    raw: tuple[Any, ...],
    episodes: Sequence[Any],
    *,
    reused: bool,
    path: str | None,
) -> ScoreResult:
    names = _COMPONENTS.get(competition, ())
    scenarios = []
    for value, survived, total, episode in zip(*raw, episodes, strict=True):
        parts = tuple(value) if names else (value,)
        scenarios.append(
            ScenarioScore(
                name=str(episode.name),
                score=float(parts[0]),
                components={n: float(v) for n, v in zip(names, parts[1:], strict=True)},
                steps_survived=int(survived),
                total_steps=int(total),
            )
        )
    return ScoreResult(label, competition, tuple(scenarios), reused, path, raw)
