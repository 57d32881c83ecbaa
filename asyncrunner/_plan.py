"""Turning ``run()``'s arguments into episode requests, rejecting bad input before any work starts."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["EpisodeRequest", "chronic_names", "plan_episodes"]

_RESET_KEYS = (
    "time serie id",
    "init state",
    "init datetime",
    "init ts",
    "max step",
    "thermal limit",
)


@dataclass(frozen=True)
class EpisodeRequest:
    """The ``index``-th requested episode, with grid2op's Runner meaning for each field.

    ``mix``: the mix to play it on, for a ``MultiMixEnvironment`` (``None`` otherwise).
    """

    index: int
    episode_id: int | str
    env_seed: int | None
    agent_seed: int | None
    max_iter: int | None
    init_state: Any
    reset_options: dict[str, Any] | None
    mix: str | None = None


def chronic_names(env: Any) -> list[str] | None:
    """The env's chronic folder names in id order, or None when its chronics have no ids."""
    real = getattr(env.chronics_handler, "real_data", None)
    order = getattr(real, "_order", None)
    subpaths = getattr(real, "subpaths", None)
    if order is None or subpaths is None:
        return None
    return [os.path.basename(str(subpaths[i])) for i in order]


def _per_episode(
    name: str, value: Any, nb_episode: int, broadcast: tuple[type, ...] = ()
) -> list[Any]:
    if value is None:
        return [None] * nb_episode
    if broadcast and isinstance(value, broadcast):
        return [value] * nb_episode
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(
            f"`{name}` must be a list with one entry per episode, got {type(value).__name__}"
        )
    values: list[Any] = [*value]
    if len(values) != nb_episode:
        raise ValueError(
            f"`{name}` has {len(values)} entries but nb_episode={nb_episode}: give exactly one per episode"
        )
    return values


def _seed(name: str, value: Any) -> int | None:
    if value is None:
        return None
    try:
        seed = int(value)
    except (TypeError, ValueError):
        raise TypeError(f"`{name}` entries must be integers (or None), got {value!r}") from None
    if seed < 0:
        raise ValueError(f"`{name}` entries must be non-negative integers, got {seed}")
    return seed


def plan_episodes(
    nb_episode: int,
    *,
    names: list[str] | None,
    max_iter: int | None = None,
    env_seeds: Sequence[int] | None = None,
    agent_seeds: Sequence[int] | None = None,
    # (mix, id) pairs are for a MultiMixEnvironment (plan_mixes): rejected here by _check_id
    episode_id: Sequence[int | str | tuple[str, int | str]] | None = None,
    init_states: Any = None,
    reset_options: Any = None,
) -> list[EpisodeRequest]:
    """Check every argument and build one request per episode, in request order."""
    from grid2op.Action import BaseAction

    if isinstance(nb_episode, bool) or not isinstance(nb_episode, int):
        raise TypeError(f"`nb_episode` must be an integer, got {type(nb_episode).__name__}")
    if nb_episode < 0:
        raise ValueError(f"`nb_episode` must be >= 0, got {nb_episode}")
    if max_iter is not None and (isinstance(max_iter, bool) or not isinstance(max_iter, int)):
        raise TypeError(f"`max_iter` must be an integer or None, got {max_iter!r}")
    if max_iter is not None and max_iter < 1 and max_iter != -1:
        raise ValueError(f"`max_iter` must be >= 1 (or -1 for no limit), got {max_iter}")
    env_s = [_seed("env_seeds", s) for s in _per_episode("env_seeds", env_seeds, nb_episode)]
    agent_s = [
        _seed("agent_seeds", s) for s in _per_episode("agent_seeds", agent_seeds, nb_episode)
    ]
    ids = _per_episode("episode_id", episode_id, nb_episode)
    states = _per_episode("init_states", init_states, nb_episode, (dict, BaseAction))
    options = _per_episode("reset_options", reset_options, nb_episode, (dict,))
    for state in states:
        if state is not None and not isinstance(state, (dict, BaseAction)):
            raise TypeError(
                f"`init_states` entries must be dicts or grid2op actions, got {state!r}"
            )
    requests = []
    for i in range(nb_episode):
        opts = options[i]
        if opts is not None:
            if not isinstance(opts, dict):
                raise TypeError(f"`reset_options` entries must be dicts, got {opts!r}")
            unknown = sorted(set(opts) - set(_RESET_KEYS))
            if unknown:
                raise ValueError(
                    f"`reset_options` has unknown keys {unknown}; grid2op accepts {list(_RESET_KEYS)}"
                )
            opts = dict(opts)
        ep_id: Any = ids[i]
        if ep_id is None:
            # grid2op plays chronic i (wrapping around); "time serie id" in reset_options wins.
            ep_id = i % len(names) if names else i
            if opts is not None and "time serie id" in opts:
                ep_id = opts.pop("time serie id")
        ep_id = _check_id(ep_id, names)
        requests.append(
            EpisodeRequest(
                index=i,
                episode_id=ep_id,
                env_seed=env_s[i],
                agent_seed=agent_s[i],
                max_iter=None if max_iter == -1 else max_iter,
                init_state=states[i],
                reset_options=opts,
            )
        )
    return requests


def _check_id(ep_id: Any, names: list[str] | None) -> int | str:
    if isinstance(ep_id, str):
        if names is not None and ep_id not in names:
            raise ValueError(
                f"episode id {ep_id!r} is not a chronic of this env; known: {names[:10]}..."
            )
        return ep_id
    try:
        value = int(ep_id)
    except (TypeError, ValueError):
        raise TypeError(f"episode ids must be integers or chronic names, got {ep_id!r}") from None
    if value < 0 or (names is not None and value >= len(names)):
        count = "?" if names is None else len(names)
        raise ValueError(
            f"episode id {value} is out of range: this env has {count} chronics (ids 0..{count}-1)"
        )
    return value


def check_path_save(path: str | os.PathLike[str]) -> str:
    """Make sure episodes can be saved under ``path`` (created if missing); return it absolute.

    Writability is tried, not asked: ``os.access`` says yes for root everywhere, and for
    folders such as ``/proc`` or ``/sys`` where nothing can be created.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"`path_save` must be a folder path (str or os.PathLike), got {type(path).__name__} "
            f"{path!r}"
        )
    folder = os.path.abspath(os.fspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"`path_save` {folder!r} is a file: give a folder to save episodes in")
    ancestor = folder
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(
            f"`path_save` {folder!r} cannot be created: {ancestor!r} is a file, not a folder"
        )
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".asyncrunner-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        what = "is not writable" if ancestor == folder else "cannot be created"
        raise ValueError(
            f"`path_save` {folder!r} {what} ({exc.strerror or exc}): give a folder you can write to"
        ) from None
    return folder
