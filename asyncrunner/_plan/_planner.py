"""``plan_run``: which episodes a run plays, for one env, a multimix env and ``resume`` alike.

A single env is the mix ``None``: ``names`` maps each mix to its chronic names, and each mix
saves (and resumes) in its own folder, ``path_save`` itself for the mix ``None``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import anyio
import anyio.to_thread

from .._model import EpisodeRequest, EpisodeResult
from ._arguments import check_path_save, check_with_env, plan_episodes
from ._layout import resume_plan
from ._mixes import plan_mixes

__all__ = ["Plan", "plan_run"]

Names = Mapping[str | None, list[str] | None]


@dataclass(frozen=True)
class Plan:
    """The episodes to play, the results ``resume`` read back instead, and where to save."""

    requests: list[EpisodeRequest]
    skipped: list[EpisodeResult]
    path_save: str | None


async def plan_run(
    nb_episode: int,
    *,
    names: Names,
    env_for: Callable[[str | None], Any],
    agent: str | None,
    env_keys: Mapping[str | None, str],
    path_save: str | os.PathLike[str] | None,
    resume: bool,
    max_iter: int | None,
    env_seeds: Sequence[int] | None,
    agent_seeds: Sequence[int] | None,
    episode_id: Sequence[int | str | tuple[str, int | str]] | None,
    init_states: Any,
    reset_options: Any,
) -> Plan:
    """Check ``run()``'s episode arguments and plan its episodes (bad input raises here).

    ``env_for(mix)``: the parent's env of a mix (initial states are built against it).
    ``agent``: the agent's recorded name, ``env_keys`` each mix's env key (``Recipe.env_key``),
    which ``resume`` matches.
    """
    arguments: dict[str, Any] = dict(
        max_iter=max_iter,
        env_seeds=env_seeds,
        agent_seeds=agent_seeds,
        episode_id=episode_id,
        init_states=init_states,
        reset_options=reset_options,
    )
    if list(names) == [None]:
        requests = plan_episodes(nb_episode, names=names[None], **arguments)
    else:
        requests = plan_mixes(nb_episode, cast(Mapping[str, list[str] | None], names), **arguments)
    if resume and path_save is None:
        raise ValueError("`resume=True` needs `path_save`: the folder to resume")
    checked = None if path_save is None else check_path_save(path_save)
    # Building actions from initial states, and reading back saved episodes, take a while.
    await anyio.to_thread.run_sync(check_with_env, requests, env_for)
    skipped: list[EpisodeResult] = []
    if resume:
        assert checked is not None
        requests, skipped = await anyio.to_thread.run_sync(
            _resume, requests, checked, names, agent, env_keys
        )
    return Plan(requests, skipped, checked)


def _resume(
    requests: Sequence[EpisodeRequest],
    path: str,
    names: Names,
    agent: str | None,
    env_keys: Mapping[str | None, str],
) -> tuple[list[EpisodeRequest], list[EpisodeResult]]:
    """``resume_plan`` mix by mix, each in its own folder."""
    todo: list[EpisodeRequest] = []
    done: list[EpisodeResult] = []
    for mix, mix_names in names.items():
        mine = [r for r in requests if r.mix == mix]
        if not mine:
            continue
        folder = path if mix is None else os.path.join(path, mix)
        left, found = resume_plan(mine, folder, mix_names, agent, env_keys[mix])
        todo.extend(left)
        done.extend(replace(r, mix=mix) for r in found)
    todo.sort(key=lambda r: r.index)
    return todo, done
