"""``MultiMixEnvironment``: one run over the episodes of every mix.

grid2op's own Runner plays one mix at a time (``for mix in env: Runner(**mix.get_params_for_runner())``,
saving each under ``path_save/<mix>``). Here a run on a multimix env plays the requested episodes on
every mix (or the ``(mix, episode id)`` pairs given as ``episode_id``), each result says its
``mix``, and ``path_save`` gets one grid2op folder per mix: ``path_save/<mix>/<chronic>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeGuard

from .._model import EpisodeRequest
from ._arguments import _check_id, chronic_of, plan_episodes

__all__ = ["mixes_of", "plan_mixes", "runner_params"]


def mixes_of(env: Any) -> dict[str, Any] | None:
    """The mixes of a ``MultiMixEnvironment`` (name -> env, in the env's order), else ``None``."""
    from grid2op.Environment import MultiMixEnvironment

    if not isinstance(env, MultiMixEnvironment):
        return None
    return {str(name): mix for name, mix in env.items()}


def runner_params(env: Any) -> dict[str, Any]:
    """``env.get_params_for_runner()``, made to pickle.

    A mix after the first gets a copy of the first mix's backend, whose class is the one grid2op
    built for the grid (not importable by name): its recipe names the backend's original class,
    from which the worker builds its own.
    """
    params: dict[str, Any] = env.get_params_for_runner()
    backend_class = params.get("backendClass")
    original = getattr(backend_class, "_INIT_GRID_CLS", None)
    if original is not None:
        params["backendClass"] = original
    return params


def _is_pair(entry: object) -> TypeGuard[tuple[str, int | str]]:
    return isinstance(entry, tuple) and len(entry) == 2


def plan_mixes(
    nb_episode: int,
    names: Mapping[str, list[str] | None],
    *,
    episode_id: Sequence[int | str | tuple[str, int | str]] | None = None,
    **kwargs: Any,
) -> list[EpisodeRequest]:
    """Requests for a multimix run, mix by mix.

    ``episode_id`` entries that are ``(mix, id)`` pairs name exactly the episodes to play (one
    request each). Otherwise each mix plays the ``nb_episode`` requested episodes (seeds, ids and
    options alike on every mix, as a loop over the mixes would): ``nb_episode * len(mixes)``
    requests, the first mix's first.
    """
    entries = None if episode_id is None else list(episode_id)
    pairs = [] if entries is None else [e for e in entries if _is_pair(e)]
    if entries and pairs:
        if len(pairs) != len(entries):
            raise TypeError(
                "on a MultiMixEnvironment, `episode_id` entries must be all (mix, episode id) "
                "pairs, or all episode ids (played on every mix)"
            )
        base = plan_episodes(nb_episode, names=None, episode_id=[e[1] for e in pairs], **kwargs)
        requests = []
        for request, (mix, ep_id) in zip(base, pairs, strict=True):
            if mix not in names:
                raise ValueError(f"unknown mix {mix!r}: this env's mixes are {list(names)}")
            checked = _check_id(ep_id, names[mix])
            chronic = chronic_of(checked, names[mix])
            requests.append(replace(request, episode_id=checked, chronic=chronic, mix=mix))
        return requests
    requests = []
    for mix, mix_names in names.items():
        for request in plan_episodes(nb_episode, names=mix_names, episode_id=episode_id, **kwargs):
            requests.append(replace(request, index=len(requests), mix=mix))
    return requests
