"""A worker's env cache: one pristine env per recipe, built once and never played; each episode
plays a copy of it (the reset contract).

A process that forks workers may build the pristine env itself (``hold``): a forked worker then
starts with it in its cache instead of building one.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import logging
import os
import pickle
import socket
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from .._quiet import quiet
from ._parsed import parsing_once
from ._recipe import Recipe

__all__ = [
    "builds",
    "discard",
    "disown",
    "exclusive",
    "fresh_copy",
    "get_env",
    "hold",
    "release",
    "warm",
]

# How many envs one worker keeps (a worker may serve several runners in turn).
_MAX_ENVS = 2


class _Cached:
    """A pristine env built from a recipe, never played: each episode plays a copy of it.

    grid2op's Runner builds a new env for every episode. ``env.copy()`` of an env that was built
    and never stepped is that fresh env, whatever state its parts keep (opponents, rewards,
    chronics handlers and their caches, backends), at about 2 % of a build's cost; nothing an
    episode changes reaches the pristine env or the next episode.
    """

    def __init__(
        self, recipe: Recipe, pristine: Any = None, *, lent: bool = False, copied: bool = False
    ) -> None:
        self.recipe = recipe
        # Another agent's recipe on the same env, or the caller of ``hold``, may give the
        # pristine env: it is only ever copied. A ``lent`` one is its owner's to close; a
        # ``copied`` one is a copy of a caller's env (``copy_env``), not a build of the recipe.
        self.pristine: Any = pristine if pristine is not None else self._build()
        self.lent = lent
        self.copied = copied
        self.faithful: bool | None = None  # copies_faithfully, once asked
        agent, found = _named(recipe.agent)
        self.by_name = found is agent  # (current)
        self.other_reward_names = tuple(self.pristine.other_rewards)

    def _build(self) -> Any:
        from grid2op.Agent import DoNothingAgent
        from grid2op.Runner import Runner

        global _BUILDS
        _BUILDS += 1

        class OnceRunner(Runner):  # type: ignore[misc]  # grid2op is untyped
            # On Linux grid2op's Runner.__init__ builds an env (with init_env) and closes it;
            # keep that one instead of building a second (each build parses the grid: ~1 s).
            def init_env(self) -> Any:
                env, self.agent = self._new_env(self.parameters)
                self.built = env
                return contextlib.nullcontext(env)

        _find_generated_classes(self.recipe.params)
        # parsing_once: another env of the same grid (a score's other parametrisation) does
        # not parse the grid's file again.
        with quiet(), parsing_once(), _missing_files(self.recipe.params):
            runner = OnceRunner(**self.recipe.params, agentClass=DoNothingAgent)
            built = getattr(runner, "built", None)
            return built if built is not None else runner._new_env(runner.parameters)[0]

    def episode_env(self) -> Any:
        """A fresh env for one episode (the caller closes it)."""
        if self.pristine is None:
            with _ENVS_LOCK:  # grid2op's class creation is not thread-safe
                self.pristine = self._build()
        if self.faithful is None:
            self.faithful = copies_faithfully(self.pristine)
        if not self.faithful:
            # Play the pristine env itself, build another next time.
            env, self.pristine = self.pristine, None
            return env
        return fresh_copy(self.pristine)

    def close(self) -> None:
        """Close the pristine env, unless another recipe's entry shares it (``hold``)."""
        pristine, self.pristine = self.pristine, None
        entries = [*_ENVS.values(), *(cached for cached, _ in _HELD.values())]
        if pristine is None or self.lent or any(c.pristine is pristine for c in entries):
            return
        pristine.close()

    def current(self) -> bool:
        """Whether the agent's class (or function), if its module held it when this entry was
        built, still is what its module holds. A Dask worker keeps its envs across runners, and
        runs: ``client.upload_file`` reloads the agent's module there, and a recipe naming the
        new class pickles as the old one did (the same key), which played on. (A class sent by
        value, a script's, is never its module's: its entry is kept.)"""
        if not self.by_name:
            return True
        agent, found = _named(self.recipe.agent)
        return found is agent

    def new_agent(self, env: Any) -> Any:
        kind, agent = self.recipe.agent_kind, self.recipe.agent
        if kind == "class":
            return agent(env.action_space)
        if kind == "factory":
            made = agent(env.action_space)
            # What an episode calls (a BaseAgent, or a policy wrapper with the same methods).
            if not all(callable(getattr(made, m, None)) for m in ("seed", "reset", "act")):
                raise TypeError(
                    f"agent factory {getattr(agent, '__qualname__', repr(agent))} returned "
                    f"{type(made).__qualname__}, not an agent (no seed, reset and act): a "
                    "factory takes the env's action space and returns the agent that plays "
                    "the episode, a grid2op BaseAgent"
                )
            return made
        return copy.copy(agent)


def _named(agent: Any) -> tuple[Any, Any]:
    """The class or function that makes ``agent`` (a recipe's), and what its module holds under
    its name now (None: no such module or name)."""
    if isinstance(agent, functools.partial):
        agent = agent.func
    if not (isinstance(agent, type) or inspect.isfunction(agent)):
        agent = type(agent)  # an instance's class
    found: Any = sys.modules.get(getattr(agent, "__module__", None) or "")
    for part in str(getattr(agent, "__qualname__", "")).split("."):
        found = getattr(found, part, None)
    return agent, found


def fresh_copy(pristine: Any) -> Any:
    """A copy of ``pristine`` (an env never played) that shares nothing an episode changes with
    it: the fresh env grid2op's Runner builds for each episode.

    What grid2op's copy shares with the original and an episode changes (checked by
    tests/test_parity.py on everything the pristine env holds): the high-resolution simulation
    counter (shared on purpose; a fresh env has its own, from 0: copies playing at once in
    threads counted together), and the initial state meant to be constant, whose one-element
    arrays (a single shunt's setpoint, ...) cannot be made read-only and are written by the
    episode through the env's and the forecast env's state after a reset.
    """
    from grid2op.Observation.highresSimCounter import HighResSimCounter

    env = pristine.copy()
    # grid2op's copy keeps the observation space's action space of the pristine env (shared,
    # and never seeded: observations' ``action_helper``); a new env's is its own, seeded.
    env._observation_space.action_helper_env = env._helper_action_env
    forecasts = getattr(env._observation_space, "obs_env", None)
    if forecasts is not None:  # (a new env's forecast env acts with the env's, too)
        forecasts._helper_action_env = forecasts._action_space = env._helper_action_env
    counter = HighResSimCounter()
    for holder in (env, env._observation_space, forecasts):
        if holder is not None:
            holder._highres_sim_counter = counter
    for part in (env, forecasts):
        if part is not None and part._cst_prev_state_at_init is not None:
            initial = part._cst_prev_state_at_init.copy()
            initial.prevent_modification()
            part._cst_prev_state_at_init = initial
    _rebuild_user_parts(pristine, env)
    return env


def _rebuild_user_parts(pristine: Any, env: Any) -> None:
    """Rewards, opponent and voltage controller of classes not grid2op's own, in ``env`` (a
    copy of ``pristine``) as grid2op's build made them for a new env.

    grid2op's copy deep-copies the rewards (one that keeps the env given to ``initialize``
    would read the pristine env, never played) and rebuilds the opponent and the voltage
    controller with ``__new__`` and ``_custom_deepcopy_for_copy`` (what ``__init__`` or the
    opponent's ``init`` set is lost, unless the class copies it). grid2op's own classes copy
    correctly (tests/test_parity.py). A user's (``_user_parts``) are ``pristine``'s, deep-copied
    as its build left them (``_memo``): a new env's have seen the build's step (a reward or a
    controller that counts its calls has counted it), and what the env showed them as it was
    built (an opponent's ``init`` and a forecast reward's ``initialize`` see the backend's
    thermal limits, not yet the env's).
    """
    parts = _user_parts(pristine)
    if not parts:
        return  # (grid2op's own: no memo to make, at every episode)
    # (the copy has a forecast env where ``pristine`` has one, and its parts there)
    forecasts: Any = getattr(env._observation_space, "obs_env", None)
    originals = getattr(pristine._observation_space, "obs_env", None)
    memo = _memo([(pristine, env), (originals, forecasts)])
    for (where, name), part in copy.deepcopy(parts, memo).items():
        if where == "reward":
            env._reward_helper = part
        elif where == "other reward":
            env.other_rewards[name] = part
        elif where == "forecast reward":  # the space's and its forecast env's: one object
            env._observation_space.reward_helper = forecasts._reward_helper = part
        elif where == "forecast other reward":
            forecasts.other_rewards[name] = part
        elif where == "voltage controller":
            env._voltage_controler = part
        elif where == "opponent space":  # (holding the opponent: one copy, the memo's)
            env._oppSpace = part
        else:
            env._opponent = part


def _user_parts(env: Any) -> dict[tuple[str, str], Any]:
    """``env``'s parts of a user's classes (a grid2op ``CombinedReward`` of a user's reward
    too), by where they are: what a copy of ``env`` takes from it (``_rebuild_user_parts``)."""
    parts: dict[tuple[str, str], Any] = {}
    if not _grid2ops_reward(env._reward_helper):
        parts["reward", ""] = env._reward_helper
    for name, helper in env.other_rewards.items():
        if not _grid2ops_reward(helper):
            parts["other reward", name] = helper
    forecasts = getattr(env._observation_space, "obs_env", None)
    if forecasts is not None:
        if not _grid2ops_reward(forecasts._reward_helper):
            parts["forecast reward", ""] = forecasts._reward_helper
        for name, helper in forecasts.other_rewards.items():
            if not _grid2ops_reward(helper):
                parts["forecast other reward", name] = helper
    if env._voltage_controler is not None and not _grid2ops(env._voltage_controler):
        parts["voltage controller", ""] = env._voltage_controler
    if not (_grid2ops(env._opponent) and _grid2ops(env._oppSpace)):
        parts["opponent space", ""] = env._oppSpace
        parts["opponent", ""] = env._opponent
    return parts


def _memo(pairs: list[tuple[Any, Any]]) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo for the parts ``_rebuild_user_parts`` copies: each of ``pairs``
    is an env and its copy (the env's, its forecast env's), and each attribute of the env its
    copy's, so that a part holding the env given to ``initialize``, its backend, its spaces...
    holds the copy's (and what the copy shares with the env stays shared). Not the parts copied
    (``_PARTS``): the memo would give the copy's own, grid2op's copy of them."""
    memo: dict[int, Any] = {}
    for original, copied in reversed(pairs):  # the first pair's mapping wins (the env's)
        if original is None or copied is None:
            continue
        memo[id(original)] = copied
        theirs = vars(copied)
        for name, value in vars(original).items():
            # Immutable values are shared, or equal in both (an int is not the env's object).
            mine = theirs.get(name)
            if name in _PARTS or mine is None or isinstance(value, _IMMUTABLE):
                continue
            memo[id(value)] = mine
    return memo


_PARTS = frozenset(
    {"_reward_helper", "other_rewards", "_voltage_controler", "_oppSpace", "_opponent"}
)


def _grid2ops_reward(helper: Any) -> bool:
    """Whether a ``RewardHelper``'s reward, and each reward it combines (grid2op's
    ``CombinedReward``, nested too), are grid2op's own."""
    rewards = [helper.template_reward]
    while rewards:
        reward = rewards.pop()
        if not _grid2ops(reward):
            return False
        combined = getattr(reward, "rewards", None)
        rewards.extend(combined.values() if isinstance(combined, dict) else ())
    return True


# The packages of grid2op's (and LightSim's) own env parts, whose copies tests/test_parity.py
# checks (not grid2op's tests' classes).
_OWN_PACKAGES = (
    "grid2op.Reward.",
    "grid2op.Opponent.",
    "grid2op.VoltageControler.",
    "grid2op.Backend.",
    "lightsim2grid.",
    "grid2op.Rules.",
    "grid2op.operator_attention.",
)


def _grid2ops(part: Any) -> bool:
    """Whether ``part``'s class is grid2op's own (a backend's: the class grid2op derived its
    grid's class from)."""
    cls = type(part)
    return (getattr(cls, "_INIT_GRID_CLS", None) or cls).__module__.startswith(_OWN_PACKAGES)


def copies_faithfully(pristine: Any) -> bool:
    """Whether a copy of ``pristine`` plays as a new env: its backends can be copied and are
    grid2op's or LightSim's classes (a backend's ``copy`` keeps a fixed list of attributes, not a
    subclass's), its rules and attention budget are grid2op's (the copy deep-copies them,
    with the env one kept from ``initialize``), its chronics do not read their files in
    chunks (``data_feeding_kwargs={"chunk_size": ...}``, a handler's ``chunk_size``: the copy
    deep-copies the open readers, which cannot be), and its parts of a user's classes can be
    deep-copied (``_user_parts``: not one holding a lock or an open file). Otherwise each
    episode plays a new build."""
    real = getattr(pristine.chronics_handler, "real_data", None)
    data = getattr(real, "data", None)
    readers = [real, data, *getattr(data, "__dict__", {}).values()]
    if any(getattr(part, "chunk_size", None) is not None for part in readers):
        return False
    forecasts = getattr(pristine._observation_space, "obs_env", None)
    for backend in (pristine.backend, getattr(forecasts, "backend", None)):
        if backend is None:
            continue
        if not (getattr(backend, "_can_be_copied", True) and _grid2ops(backend)):
            return False
    others = [pristine._game_rules.legal_action, getattr(pristine, "_attention_budget", None)]
    if not all(p is None or _grid2ops(p) for p in others):
        return False
    return _carried_faithfully(pristine, forecasts)


def _carried_faithfully(pristine: Any, forecasts: Any) -> bool:
    """Whether ``_rebuild_user_parts`` gives a copy of ``pristine`` its user parts as a new
    build has them: what they hold past the env and its attributes (the copy's are given:
    ``_memo``) is theirs alone (``_theirs``), and they can be deep-copied (not a lock, an open
    file: grid2op's Runner never copies them). One holding a part deeper in the env (its
    chronics handler's data) would read a copy of the pristine env's, never played."""
    parts = _user_parts(pristine)
    if not parts:
        return True
    memo = _memo([(pristine, pristine), (forecasts, forecasts)])
    if not _theirs(parts.values(), set(memo), _reachable(pristine, parts.values())):
        return False
    try:
        copy.deepcopy(parts, memo)
    except Exception:
        return False
    return True


def _theirs(parts: Iterable[Any], given: set[int], env_objects: set[int]) -> bool:
    """Whether what ``parts`` hold, past what the copy is ``given`` its own of (by id), is
    theirs alone: none of ``env_objects`` (what the env holds, by id), no weak reference, no
    function closing over (or defaulting to) more than values nor built-in method of an object
    (``copy.deepcopy`` leaves them as they are: to the pristine env's, or its part's), no view
    of an array of the env's (copied, it no longer follows the env's). Not a function's
    module's globals."""
    seen: set[int] = set()
    stack = list(parts)
    while stack:
        held = stack.pop()
        if id(held) in seen or id(held) in given or isinstance(held, _VALUES):
            continue
        seen.add(id(held))
        shared = id(held) in env_objects and not isinstance(held, (tuple, frozenset))
        if shared or isinstance(held, _WEAK):  # (a tuple's items are looked at in turn)
            return False
        if isinstance(held, types.FunctionType):
            kept = [*(held.__defaults__ or ()), *(held.__kwdefaults__ or {}).values()]
            for cell in held.__closure__ or ():
                with contextlib.suppress(ValueError):  # (an empty cell)
                    kept.append(cell.cell_contents)
            if not all(isinstance(value, _VALUES) for value in kept):
                return False
        elif isinstance(held, types.BuiltinFunctionType):  # (a list's append, len)
            if not isinstance(held.__self__, (type(None), types.ModuleType, type)):
                return False
        elif not isinstance(held, (type, types.ModuleType)):
            stack.extend(_held_by(held))
            base = getattr(held, "base", None) if isinstance(held, np.ndarray) else None
            if base is not None:
                if id(base) in given:
                    return False
                stack.append(base)
    return True


def _reachable(env: Any, parts: Iterable[Any]) -> set[int]:
    """The objects ``env`` holds (ids), but through ``parts``; not classes, modules, functions
    nor values (``_VALUES``)."""
    seen = {id(env), *map(id, parts)}
    stack = [env]
    while stack:
        for held in _held_by(stack.pop()):
            if id(held) not in seen and not isinstance(held, _NOT_HELD):
                seen.add(id(held))
                stack.append(held)
    return seen - set(map(id, parts))


def _held_by(obj: Any) -> list[Any]:
    """What ``obj`` holds: ``gc.get_referents``, and the items of an array of objects (which
    it does not report, and ``copy.deepcopy`` copies)."""
    held = gc.get_referents(obj)
    if isinstance(obj, np.ndarray) and obj.dtype.hasobject:
        # (a structured array's object fields: each record's, as a tuple of its fields)
        held.extend(obj.ravel().tolist())
    return held


# Copied as values, or not at all: a logger (grid2op's are not the logging module's), a dtype
# and a numpy scalar are the same in both.
_VALUES = (
    int, float, complex, str, bytes, bool, type(None), logging.Logger, np.dtype, np.generic,
)  # fmt: skip
_NOT_HELD = (
    *_VALUES, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
    types.MethodType,
)  # fmt: skip
_WEAK = (weakref.ref, weakref.ProxyType, weakref.CallableProxyType)
# Never mapped by ``_memo``: shared, or equal in both (an int is not the env's object).
_IMMUTABLE = (*_VALUES, tuple, frozenset, type)


_ENVS: dict[str, _Cached] = {}
_BUILDS = 0
# Envs that an episode is playing now (a worker may play several episodes at once, in threads).
_IN_USE: set[str] = set()
_ENVS_LOCK = threading.RLock()


# Pristine envs this process holds for the workers it forks (``hold``), by recipe key, and how
# many holders each has. Never played here: a forked worker starts with them in its cache.
_HELD: dict[str, tuple[_Cached, int]] = {}
# Whether this process's objects are frozen (``gc.freeze``) because it holds envs (``_freeze``).
_FROZEN = False


# What the permanent generation holds without anyone's freeze: Python 3.12 moves its immortal
# objects there (375 tuples of the built-in types, from startup on), 3.11 and 3.13 nothing. A
# count above it is a freeze of the process's (one made before this import is not told apart).
_PERMANENT_AT_IMPORT = gc.get_freeze_count()


_THAWED = False  # whether ``_thaw`` undid a freeze since the last full collection


def _freeze() -> None:
    """While this process holds envs, the objects it had before are out of its collections.

    A build allocates enough to trigger a full collection, which goes through everything this
    process has: 0.15 to 0.2 s with a caller's heap of a few hundred thousand objects, landing
    between the build and the forks, or blocking the event loop as a run starts. Frozen, the
    collections go through the objects made since (the held env's among them), and write to none
    of the pages the workers share. A freeze that is not ours (``gc.get_freeze_count()`` above
    ``_PERMANENT_AT_IMPORT``, a pre-fork server's) is left as it is.

    The young generations are collected first (about 2 ms): a freeze puts their objects before
    the old ones, and the thaw would leave them there, so that a cycle's parts made after it
    would be finalized first. An env the caller never closed would then be finalized after its
    observation space's simulation env, and grid2op's ``BaseEnv.__del__`` prints "is closed
    already, you cannot close it a second time" as the script ends.
    """
    global _FROZEN, _THAWED
    if not _HELD and not _FROZEN and gc.get_freeze_count() <= _PERMANENT_AT_IMPORT:
        if _THAWED:
            # The envs let go since the last freeze are garbage among the oldest objects, which
            # a young collection leaves and the freeze kept for good (a runner's env parts in
            # cycles, pandas' frames: 0.4 MiB more per runner opened after another closed, 1.25
            # per runner dropped unclosed, in the many-runners hunt and its review).
            gc.collect()
            _THAWED = False
        else:
            gc.collect(1)
        gc.freeze()
        _FROZEN = True


def _thaw() -> None:
    """Undo ``_freeze`` once this process holds no env: its objects are collected as before."""
    global _FROZEN, _THAWED
    if not _HELD and _FROZEN:
        gc.unfreeze()
        _FROZEN = False
        _THAWED = True


def hold(
    recipe_key: str,
    recipe_bytes: bytes,
    pristine: Any = None,
    make: Callable[[], Any] | None = None,
) -> bool:
    """Build a recipe's pristine env in this process, for the workers forked from it later.

    A forked worker then finds it in its cache: the fork copies it (pages shared until written),
    where a worker's own build parses the grid again (0.6 s for case14, several on big grids).
    The env is the one the worker would build, from the same recipe and code, and episodes play
    copies of it there as of any pristine env. A build that fails here is left to the workers,
    which report it as they do (returns False: nothing to ``release``). Each ``hold`` that
    returns True is undone by one ``release``. ``pristine``: an env the caller built from this
    recipe's params and never played (compat's, built by grid2op's Runner constructor), held
    instead of a new build; the caller closes it. ``make``: returns the env to hold instead of a
    build (``AsyncRunner(copy_env=True)``: a copy of the caller's env), closed by the last
    ``release``; not called when the recipe is held already (give such a recipe a key of its
    own). Recipes of other agents on the same env (``Recipe.env_key``) share one pristine build,
    never a ``make``'s env: a worker plays one call at a time, so two episodes never copy it at
    once. While this process holds any env, the objects it had before
    are out of its collections (``_freeze``).
    """
    with _ENVS_LOCK:
        _release_dropped()
        if recipe_key in _HELD:
            cached, holders = _HELD[recipe_key]
            _HELD[recipe_key] = (cached, holders + 1)
            return True
        _freeze()
        try:
            recipe = pickle.loads(recipe_bytes)
            if pristine is not None:
                _HELD[recipe_key] = (_Cached(recipe, pristine, lent=True), 1)
                return True
            if make is not None:  # never another's build: the caller's env may differ from it
                cached = _Cached(recipe, make(), copied=True)
            else:
                # Another agent on the same env (scores play several): one pristine env for
                # both. Not a copy of a caller's env: it may hold what the params do not say.
                twin = next(
                    (
                        c.pristine
                        for c, _ in _HELD.values()
                        if (c.recipe.env_key, c.recipe.chronics)
                        == (recipe.env_key, recipe.chronics)
                        and not c.lent  # its lender may close it before this hold ends
                        and not c.copied
                        and copies_faithfully(c.pristine)
                    ),
                    None,
                )
                cached = _Cached(recipe, twin)
        except Exception:
            _thaw()
            return False
        _HELD[recipe_key] = (cached, 1)
        return True


def release(recipe_key: str) -> None:
    """Undo one ``hold``; the last one frees the env (workers forked before keep theirs)."""
    with _ENVS_LOCK:
        _release_dropped()
        _release(recipe_key)


# The holds of holders collected without their ``release`` (``dropped``).
_DROPPED: list[str] = []


def dropped(recipe_key: str) -> None:
    """A holder of ``recipe_key`` was collected without its ``release`` (a runner never closed):
    the next ``hold`` or ``release`` does it. Not here: a garbage collection calls this, and an
    env's close and ``gc.unfreeze`` have no place in one."""
    _DROPPED.append(recipe_key)


def _release_dropped() -> None:
    while _DROPPED:
        _release(_DROPPED.pop())


def _release(recipe_key: str) -> None:  # under _ENVS_LOCK
    entry = _HELD.pop(recipe_key, None)
    if entry is None:
        return
    cached, holders = entry
    if holders > 1:
        _HELD[recipe_key] = (cached, holders - 1)
        return
    try:
        cached.close()
    finally:
        _thaw()


def exclusive() -> Any:
    """The (reentrant) lock a worker's env builds run under; episodes copy, reset, step and
    close their env under it too.

    grid2op's code changes the process's warning filters (``warnings.catch_warnings`` is not
    thread-safe, and a reset turns warnings into errors for a moment): with several episodes at
    once in threads (``CentralAgent(envs_per_worker=...)``), a filter could leak from one to
    another and make pandapower's deprecation warnings fail a build. The threads wait for
    their actions outside it. In a process that forks workers, the envs it holds for them are
    built under it (``hold``) and each fork waits for it (``ForkPool``).
    """
    return _ENVS_LOCK


def disown(env: Any) -> bool:
    """The lender of ``env`` (``hold(..., pristine=env)``) is done with it: whether a hold still
    keeps it, which then closes it with its last ``release`` (else the lender closes it)."""
    with _ENVS_LOCK:
        held = [cached for cached, _ in _HELD.values() if cached.pristine is env]
        for cached in held:
            cached.lent = False
        return bool(held)


def _after_fork() -> None:
    # A forked worker counts its own builds (EpisodeStarted.env_builds), not its parent's, and
    # takes a new lock: a thread of the parent may have held this one at the fork. The envs its
    # parent held for it are its cache's (the parent keeps, and later frees, its own copy).
    global _BUILDS, _ENVS_LOCK, _FROZEN
    _BUILDS = 0
    _FROZEN = False  # the worker freezes what it inherited for good (``_pools._fork._serve``)
    _ENVS_LOCK = threading.RLock()
    for key, (cached, _) in _HELD.items():
        cached.lent = False  # this process's copy: its own to close
        _ENVS[key] = cached
    _HELD.clear()


os.register_at_fork(after_in_child=_after_fork)


def get_env(
    recipe_key: str, recipe_bytes: Callable[[], bytes], slot: int = 0, keep: int = _MAX_ENVS
) -> tuple[str, _Cached]:
    """The env of a recipe for episode slot ``slot`` of this worker (built if needed, from the
    recipe ``recipe_bytes()`` returns), and its key (for ``discard``).

    An entry is used by one episode at a time: with an episode playing on it in another thread
    of this process (a ``ThreadPoolExecutor``'s workers), this one gets an entry of its own, with
    an agent of its own (copies of one agent instance share its random generator, as in
    grid2op), sharing the pristine env (copied under ``exclusive``)."""
    key = recipe_key if slot == 0 else f"{recipe_key}#{slot}"
    with _ENVS_LOCK:  # builds too: grid2op's class creation is not thread-safe
        busy = None
        while key in _IN_USE:
            busy = busy or _ENVS.get(key)
            slot += 1
            key = f"{recipe_key}#{slot}"
        cached = _ENVS.pop(key, None)
        if cached is not None and not cached.current():
            cached.close()
            cached = None
        if cached is None:
            # Another slot's entry of the recipe gives its pristine env (a slot past the first
            # built one of its own: with copy_env, not the caller's env).
            source = busy or _ENVS.get(recipe_key)
            idle = [k for k in _ENVS if k not in _IN_USE and _ENVS[k] is not source]
            while len(_ENVS) >= max(keep, _MAX_ENVS) and idle:
                _ENVS.pop(idle.pop(0)).close()
            pristine = source.pristine if source is not None else None
            if pristine is not None and not copies_faithfully(pristine):
                pristine = None  # played itself by the other entry's episode
            cached = _Cached(_unpickled(recipe_bytes()), pristine)
        _ENVS[key] = cached  # most recently used last
        _IN_USE.add(key)  # until the caller discards it
        return key, cached


@contextlib.contextmanager
def _missing_files(params: Mapping[str, Any]) -> Iterator[None]:
    """A build that failed on a path the runner's env was made from, missing here, says so:
    a Dask worker on another machine, without the env's folder, failed with grid2op's "Path
    ... doesn't exists" alone."""
    try:
        yield
    except Exception as exc:
        for what in ("init_env_path", "init_grid_path", "path_chron"):
            path = params.get(what)
            if isinstance(path, str | os.PathLike) and path and not os.path.exists(path):
                raise FileNotFoundError(
                    f"{os.fspath(path)} is not on the worker {socket.gethostname()} (process "
                    f"{os.getpid()}): a worker builds the env from the files the runner's env "
                    "was made from, at the same paths. Copy the env's folder to the same path "
                    "on every worker's machine, or keep it on a filesystem they share"
                ) from exc
        raise


def generated_classes(folder: Any) -> str | None:
    """``folder`` (an env's ``_read_from_local_dir``) when it holds the classes grid2op generated
    in files for the env (``class_in_file``: a temporary folder, which the env's ``close()``
    deletes); ``None`` otherwise (``experimental_read_from_local_dir``'s ``_grid2op_classes``,
    kept, is found by grid2op itself)."""
    if isinstance(folder, str) and os.path.basename(os.path.normpath(folder)) != "_grid2op_classes":
        return folder
    return None


def _find_generated_classes(params: Mapping[str, Any]) -> None:
    """Put the folder of the classes grid2op generated in files for the env on ``sys.path`` (and
    its parent), as generating them did in the process that made the env: grid2op imports them
    from there by name. A worker started before the env was made (a Dask worker, an
    executor's) has no such entry."""
    folder = generated_classes(params.get("_read_from_local_dir"))
    if folder is not None:
        for entry in (os.path.dirname(folder), folder):
            if entry not in sys.path:
                sys.path.append(entry)


def _unpickled(recipe_bytes: bytes) -> Recipe:
    try:
        recipe: Recipe = pickle.loads(recipe_bytes)
    except ModuleNotFoundError as exc:
        # (a Dask worker, started elsewhere: the message was the module's name alone)
        raise ModuleNotFoundError(
            f"{exc} on the worker {socket.gethostname()} (process {os.getpid()}): it imports "
            "the modules of the agent and the env by name. Install them there, or make them "
            "importable (on a Dask cluster, send a module with client.upload_file(path), or "
            "start the workers with its folder on PYTHONPATH)",
            name=exc.name,
        ) from exc
    except AttributeError as exc:
        if "__mp_main__" not in str(exc):
            raise
        # (a class defined under the script's ``if __name__ == "__main__":``)
        raise AttributeError(
            f'{exc}: this worker runs your main script as "__mp_main__", so what is defined '
            'under its `if __name__ == "__main__":` is not there: define the agent\'s class '
            "(and the others given to the runner) at the script's top level, or in a module"
        ) from exc
    return recipe


def warm(recipe_key: str, recipe_bytes: bytes) -> int:
    """Build (or find) the env of a recipe; returns this worker's pid."""
    discard(get_env(recipe_key, lambda: recipe_bytes)[0])
    return os.getpid()


def discard(key: str) -> None:
    """The episode using the env of ``key`` (``get_env``) is over."""
    _IN_USE.discard(key)


def builds() -> int:
    """How many envs this process has built (a forked worker counts from its fork)."""
    return _BUILDS
