"""What goes to a worker: the recipe of the env and agent, the episode job, and how they pickle."""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import cloudpickle

__all__ = ["EpisodeJob", "Recipe", "dumps"]


@dataclass(frozen=True)
class Recipe:
    """How to build the env and the agent: grid2op's ``get_params_for_runner()`` plus the agent.

    ``classes``: grid2op classes the parent made for the env, sent by value (``dumps``) so that
    the worker's env uses them: a multimix's mixes all use the classes made from the first mix
    (its generators' limits, ...), which a worker building another mix first would not.
    """

    params: dict[str, Any]
    agent_kind: str  # "class" | "instance" | "factory" | "central" (agent: None)
    agent: Any
    classes: tuple[type, ...] = ()


@dataclass(frozen=True)
class EpisodeJob:
    """One episode to play, as sent to a worker."""

    address: str
    token: str
    run_id: str
    recipe_key: str
    recipe: bytes
    index: int
    attempt: int
    episode_id: int | str
    env_seed: int | None
    agent_seed: int | None
    max_iter: int | None
    init_state: Any
    reset_options: dict[str, Any] | None
    detail: bool
    mix: str | None = None


def _grid_class(name: str, base: type, attributes: dict[str, Any]) -> type:
    """The class grid2op made for an env (recreated, or found when this process has it)."""
    from grid2op.Space import GridObjects

    return type(GridObjects.init_grid_from_dict_for_pickle(name, base, attributes))


def _grid_reduce(obj: Any) -> Any:
    """How to rebuild a class grid2op created for an env, from its grid description (or None).

    As grid2op pickles their instances: an agent instance holds its action space, whose
    ``actionClass`` is such a class, which a fresh worker cannot import by name.
    """
    base = getattr(obj, "_INIT_GRID_CLS", None) if isinstance(obj, type) else None
    if base is None:
        return None
    from grid2op.Space import GridObjects

    if not issubclass(obj, GridObjects):
        return None
    attributes: dict[str, Any] = {}
    GridObjects._make_cls_dict_extended(obj, attributes, as_list=False)
    return _grid_class, (obj.__name__, base, attributes)


class _GridPickler(pickle.Pickler):
    """pickle, with grid2op's env classes by value."""

    def reducer_override(self, obj: Any) -> Any:
        return _grid_reduce(obj) or NotImplemented


class _ByValuePickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    """cloudpickle, with grid2op's env classes by value: what workers cannot import goes too."""

    def reducer_override(self, obj: Any) -> Any:
        return _grid_reduce(obj) or super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    """``pickle.dumps`` for what goes to workers; ``pickle.loads`` reads it.

    What a worker cannot import (a class or function defined in a function, a lambda) goes by
    value (cloudpickle), as grid2op's forked processes simply inherit it. Plain pickle comes
    first: cloudpickle would also send ``__main__``'s classes by value, with the globals their
    methods use (a model the script loaded, that may not pickle), which workers already have.
    """
    try:
        return _dump(_GridPickler, obj)
    except Exception:
        return _dump(_ByValuePickler, obj)


def _dump(pickler: type[pickle.Pickler], obj: Any) -> bytes:
    buffer = io.BytesIO()
    pickler(buffer, protocol=5).dump(obj)
    return buffer.getvalue()
