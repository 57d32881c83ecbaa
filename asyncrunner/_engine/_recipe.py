"""What goes to a worker: the recipe of the env and agent (checked here), the episode job, and
how they pickle."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import io
import os
import pickle
import threading
import types
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from .._plan._mixes import runner_params
from ._central import CentralAgent, is_async_agent

__all__ = [
    "EpisodeJob",
    "Recipe",
    "agent_name",
    "agent_recipe",
    "class_attributes",
    "dumps",
    "env_key",
    "recipes",
]


@dataclass(frozen=True)
class Recipe:
    """How to build the env and the agent: grid2op's ``get_params_for_runner()`` plus the agent.

    ``classes``: grid2op classes the parent made for the env, sent by value (``dumps``) so that
    the worker's env uses them: a multimix's mixes all use the classes made from the first mix
    (its generators' limits, ...), which a worker building another mix first would not.
    ``env_key``: a digest of what the env is built from (``params`` and ``classes``): recipes of
    other agents on the same env share it.
    """

    params: dict[str, Any]
    agent_kind: str  # "class" | "instance" | "factory" | "central" (agent: None)
    agent: Any
    classes: tuple[type, ...] = ()
    env_key: str = ""
    # The chronics the env found in its folder: an env made after chronics were added there or
    # removed is not the one a runner still open holds for the same parameters (``_envs.hold``;
    # not in ``env_key``, which saved episodes record for ``resume``).
    chronics: tuple[str, ...] = ()


@dataclass(frozen=True)
class EpisodeJob:
    """One episode to play, as sent to a worker (which asks the run for the recipe of
    ``recipe_key`` if it has no env for it yet: ``_channel.recipe``)."""

    address: str
    token: str
    run_id: str
    recipe_key: str
    index: int
    attempt: int
    episode_id: int | str
    env_seed: int | None
    agent_seed: int | None
    max_iter: int | None
    init_state: Any
    reset_options: dict[str, Any] | None
    detail: bool
    # Each step's actions read with grid2op's ``to_vect``, as grid2op's Runner reads them when it
    # records an episode (``RunSettings.record``).
    record: bool = True
    # A failure's exception sent pickled (``EpisodeFailed.exception``): compat.Runner raises it.
    exceptions: bool = False
    files: tuple[str, ...] = ()  # the episode file formats to build (``sinks._files``)
    # The steps' grid2op objects sent with the episode's end (``EpisodeFinished.objects``).
    objects: bool = False
    stages: Mapping[str, str] = field(default_factory=dict)  # where to write them, by format
    agent: str | None = None  # the run's agent, recorded with the saved episodes
    mix: str | None = None
    # Claim the attempt on the channel before playing it (``_channel.claim``): the run can then
    # drop the connection playing it (``Channel.drop``), which stops it at its next batch of
    # steps where the call itself cannot be stopped (an executor's, a Dask task's).
    claim: bool = False

    @property
    def claim_key(self) -> str:
        return f"{self.run_id}/{self.index}/{self.attempt}"


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
    """pickle, with grid2op's env classes by value; ``named``: the classes and functions
    pickled (by name, unless by value). A class or function of a module the caller registered
    with ``cloudpickle.register_pickle_by_value`` (one the workers cannot import: made at run
    time, not on their path) raises ``_ByValue``: cloudpickle then sends it by value."""

    named: list[Any]

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)):
            self.named.append(obj)
            if _registered_by_value(obj):
                raise _ByValue(obj)
        return _grid_reduce(obj) or NotImplemented


class _ByValue(Exception):
    """What ``_GridPickler`` leaves to cloudpickle."""


def _registered_by_value(obj: Any) -> bool:
    """Whether ``obj``'s module (or a package of it) is registered with
    ``cloudpickle.register_pickle_by_value``."""
    registered = cloudpickle.list_registry_pickle_by_value()
    parts = str(getattr(obj, "__module__", "")).split(".")
    return any(".".join(parts[:n]) in registered for n in range(1, len(parts) + 1))


class _ByValuePickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    """cloudpickle, with grid2op's env classes by value: what workers cannot import goes too."""

    named: list[Any]

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)):
            self.named.append(obj)
        return _grid_reduce(obj) or super().reducer_override(obj)


def dumps(obj: Any, *, main_by_value: bool = False) -> bytes:
    """``pickle.dumps`` for what goes to workers; ``pickle.loads`` reads it.

    What a worker cannot import (a class or function defined in a function, a lambda) goes by
    value (cloudpickle), as grid2op's forked processes simply inherit it. Plain pickle comes
    first: cloudpickle would also send ``__main__``'s classes by value, with the globals their
    methods use (a model the script loaded, that may not pickle), which workers forked or spawned
    from this process already have. ``main_by_value``: for workers that may not (a Dask worker's
    ``__main__`` is Dask's command, loky's workers never import the script; a local Dask
    cluster's is this script), cloudpickle first.
    """
    return _dumps_named(obj, main_by_value=main_by_value)[0]


def _dumps_named(obj: Any, *, main_by_value: bool = False) -> tuple[bytes, list[Any]]:
    """``dumps``, and the classes and functions pickled (``_GridPickler.named``)."""
    if main_by_value:
        try:
            return _dump(_ByValuePickler, obj)
        except Exception:
            return _dump(_GridPickler, obj)  # by reference, as workers spawned from here load it
    try:
        return _dump(_GridPickler, obj)
    except Exception:
        return _dump(_ByValuePickler, obj)


def _dump(pickler: type[_GridPickler | _ByValuePickler], obj: Any) -> tuple[bytes, list[Any]]:
    buffer = io.BytesIO()
    # Protocol 4, as multiprocessing (grid2op's Runner) pickles: 5 would bring read-only arrays
    # (LightSim's) back on immutable bytes, and an env an agent holds could never step again.
    dumper = pickler(buffer, protocol=4)
    dumper.named = []
    dumper.dump(obj)
    return buffer.getvalue(), dumper.named


def agent_recipe(agent: Any) -> tuple[str, Any]:
    """How workers get ``agent``: ``(kind, payload)``; a wrong agent raises here."""
    from grid2op.Agent import BaseAgent

    if isinstance(agent, CentralAgent):
        return "central", None  # the workers only step envs (see _central)
    if is_async_agent(agent):
        raise TypeError(
            f"agent {agent!r} has an async act: it runs on the event loop, not in a worker; "
            "pass agent=asyncrunner.CentralAgent(agent)"
        )
    if isinstance(agent, type):
        if not issubclass(agent, BaseAgent):
            raise TypeError(
                f"agent class {agent.__qualname__} is not a grid2op BaseAgent subclass: "
                "derive it from grid2op.Agent.BaseAgent, or pass a factory (action_space) -> agent"
            )
        if inspect.isabstract(agent):
            # It would be built, and fail, in every episode.
            missing = ", ".join(sorted(getattr(agent, "__abstractmethods__", ())))
            raise TypeError(
                f"agent class {agent.__qualname__} is abstract (it does not define {missing}): "
                "pass a concrete agent such as DoNothingAgent, or a subclass that defines it"
            )
        _check_call(agent, f"agent class {agent.__qualname__}")
        return "class", agent
    if isinstance(agent, BaseAgent):
        try:
            copy.copy(agent)  # each episode plays a copy (_envs._Cached.new_agent)
        except Exception as exc:
            raise TypeError(
                f"agent {agent!r} cannot be copied ({type(exc).__name__}: {exc}), and each "
                "episode plays a copy of an agent instance: pass its class or a factory "
                "(action_space) -> agent (asyncrunner.compat.Runner plays such an instance "
                "itself, in this process, as grid2op's Runner does)"
            ) from exc
        return "instance", agent
    if callable(agent):
        _check_call(agent, f"agent factory {getattr(agent, '__qualname__', repr(agent))}")
        return "factory", agent
    raise TypeError(
        f"agent must be a BaseAgent subclass, a BaseAgent instance or a callable "
        f"(action_space) -> BaseAgent, got {type(agent).__name__}"
    )


def _check_call(agent: Any, what: str) -> None:
    """Each episode builds its agent as ``agent(action_space)`` (as grid2op's Runner builds
    ``agentClass``): refuse, before any episode, what cannot be called so."""
    try:
        signature = inspect.signature(agent)
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): the call says what is wrong
    try:
        signature.bind(None)
    except TypeError as exc:
        raise TypeError(
            f"{what} cannot be called with the env's action space alone ({exc}), and each "
            f"episode builds its agent as agent(action_space): {FACTORY_HINT}"
        ) from None


FACTORY_HINT = (
    "pass a factory that takes the action space and gives the rest, such as "
    "functools.partial(MyAgent, arg=...) or lambda action_space: MyAgent(action_space, ...)"
)


def class_attributes(cls: type) -> dict[str, Any]:
    """The values ``cls`` itself holds (not its methods, properties...): what a worker forked
    from this process sees, and one that imports the class afresh may not."""
    return {
        name: value
        for name, value in vars(cls).items()
        if not name.startswith("__") and not hasattr(value, "__get__")
    }


def agent_name(agent: Any) -> str:
    """A stable name for the agent recipe, recorded with saved episodes (``resume`` matches it).

    The class's (or factory's) qualified name: instances of one class, or two factories built
    from one function, share it whatever their parameters or weights. A lambda's also names its
    line: every lambda of a module (or function) has the same qualified name.
    """
    if isinstance(agent, CentralAgent):
        return agent_name(agent.agent)
    if isinstance(agent, functools.partial):
        return agent_name(agent.func)
    if getattr(agent, "_named_after", None) is not None:  # compat's wrappers: their agent's
        return agent_name(agent._named_after)
    if not isinstance(agent, type) and not hasattr(agent, "__qualname__"):
        agent = type(agent)  # an instance, or a callable object
    name = f"{getattr(agent, '__module__', '?')}.{getattr(agent, '__qualname__', '?')}"
    code = getattr(agent, "__code__", None)
    if name.endswith("<lambda>") and code is not None:
        name += f":{code.co_firstlineno}"
    return name


def _env_part(source: Any) -> tuple[dict[str, Any], tuple[type, ...], str]:
    """What a worker builds ``source``'s env from: ``(params, classes, env_key)``."""
    params = runner_params(source)
    # A mix's env uses the classes grid2op made from the first mix: send them along.
    mixed = params.get("_overload_name_multimix") is not None
    classes = (type(source.backend),) if mixed else ()
    try:
        blob = dumps((params, classes))
    except Exception as exc:
        raise TypeError(
            "the env cannot be sent to worker processes: its get_params_for_runner() "
            f"cannot be pickled ({type(exc).__name__}: {exc})"
        ) from exc
    return params, classes, hashlib.blake2b(blob, digest_size=16).hexdigest()


def _chronics(source: Any) -> tuple[str, ...]:
    """The chronics ``source`` found in its folder (``Recipe.chronics``)."""
    real = getattr(getattr(source, "chronics_handler", None), "real_data", None)
    found = getattr(real, "subpaths", None)  # (a numpy array)
    return () if found is None else tuple(sorted(map(str, found)))


def env_key(source: Any) -> str:
    """The ``Recipe.env_key`` of ``source``: equal keys, the same env built in the workers."""
    return _env_part(source)[2]


def recipes(
    sources: Mapping[str | None, Any],
    agent: Any,
    kind: str,
    payload: Any,
    *,
    main_by_value: bool = False,
) -> dict[str | None, tuple[str, bytes]]:
    """Each mix's recipe, pickled: ``(key, bytes)``; what cannot be sent to workers raises here.

    ``main_by_value``: for workers that cannot import this script's ``__main__`` (``dumps``).
    """
    made: dict[str | None, tuple[str, bytes]] = {}
    for mix, source in sources.items():
        params, classes, key = _env_part(source)
        recipe = Recipe(params, kind, payload, classes, key, _chronics(source))
        try:
            blob, named = _dumps_named(recipe, main_by_value=main_by_value)
        except Exception as exc:
            raise TypeError(
                f"the agent {agent!r} cannot be sent to worker processes because it cannot be "
                f"pickled ({type(exc).__name__}: {exc}); pass its class, or a factory "
                "(action_space) -> agent"
            ) from exc
        # A class redefined under its name (a notebook cell run again, a module reloaded)
        # pickles to the same bytes, and a recipe held for the old one (``_envs.hold``) would
        # play it: their versions tell them apart (none for the first ones: a key is the same in
        # every process, as Dask workers cache envs by it).
        digest = hashlib.blake2b(blob, digest_size=16)
        redefined = [(k, v) for k, v in enumerate(map(_version, named)) if v]
        if redefined:
            digest.update(repr(redefined).encode())
        digest.update(_files_now(params).encode())
        made[mix] = (digest.hexdigest(), blob)
    return made


def _files_now(params: Mapping[str, Any]) -> str:
    """The env folder's own files (and the grid's) as they are now: their sizes and times of
    change (as ``_parsed`` keys a parse). A Dask worker keeps its envs across runners under
    their recipe's key: a grid file edited since it built one was not read again (the
    chronics' files, read at each reset, are keyed by their own times)."""
    found = []
    paths: list[Any] = [params.get("init_grid_path")]
    with contextlib.suppress(OSError, TypeError):
        paths += sorted(e.path for e in os.scandir(params.get("init_env_path")) if e.is_file())
    for path in paths:
        with contextlib.suppress(OSError, TypeError, ValueError):
            stat = os.stat(path)
            found.append((path, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns))
    return repr(found)


# The classes and functions the recipes of this process pickled, by name, in the order seen
# (weakly): the k-th object under a name is its version k.
_VERSIONS: dict[tuple[str, str], list[weakref.ref[Any]]] = {}
_VERSIONS_LOCK = threading.Lock()


def _version(obj: Any) -> int:
    """Which of the objects seen under ``obj``'s name (module and qualified name) it is."""
    name = (str(getattr(obj, "__module__", "")), str(getattr(obj, "__qualname__", "")))
    with _VERSIONS_LOCK:
        seen = _VERSIONS.setdefault(name, [])
        for k, ref in enumerate(seen):
            if ref() is obj:
                return k
        seen.append(weakref.ref(obj))
        return len(seen) - 1
