"""Turning ``run()``'s arguments into episode requests, rejecting bad input before any work starts."""

from __future__ import annotations

import errno
import numbers
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from .._model import EpisodeRequest
from .._quiet import strict

__all__ = [
    "check_thermal_limit",
    "check_with_env",
    "chronic_names",
    "init_state_action",
    "plan_episodes",
]

# grid2op's limits: ``env.seed`` refuses seeds above int32's maximum ("Seed is too big"), and an
# agent is seeded through numpy's ``RandomState`` (``BaseAgent.seed``), which takes 0 .. 2**32 - 1.
MAX_ENV_SEED = int(np.iinfo(np.int32).max)
MAX_AGENT_SEED = 2**32 - 1

_RESET_KEYS = (
    "time serie id",
    "init state",
    "init datetime",
    "init ts",
    "max step",
    "thermal limit",
)


def chronic_names(env: Any, *, as_built: bool = True) -> list[str] | None:
    """The env's chronic folder names in id order, or None when its chronics have no ids.

    In the order of an env built from ``env.get_params_for_runner()`` (grid2op's Runner's, and
    the workers'): its chronics filter applied, with no shuffle; ``as_built=False``: in ``env``'s
    own order now (the workers play copies of it).
    """
    real = getattr(env.chronics_handler, "real_data", None)
    order = getattr(real, "_order", None)
    subpaths = getattr(real, "subpaths", None)
    if order is None or subpaths is None:
        return None
    keep = getattr(real, "_filter", None)
    if as_built and keep is not None:
        # What grid2op's Multifolder.reset() computes in the built env: a filter set without
        # that reset applies there, a shuffle does not travel. The default filter keeps what
        # it kept here (MultifolderWithCache's counts its calls: not called again).
        if keep != getattr(real, "_default_filter", None):
            order = [i for i, path in enumerate(subpaths) if keep(path)]
        else:
            order = sorted(order)
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


def is_integer(value: Any) -> bool:
    """An integer (Python's or numpy's), not a bool: what counts, episodes and ids must be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def at_least(name: str, value: Any, lowest: int) -> int:
    """``value`` as an ``int``: an integer (numpy's too, not a bool) >= ``lowest``."""
    if not is_integer(value) or value < lowest:
        raise ValueError(f"`{name}` must be an integer >= {lowest}, got {value!r}")
    return int(value)


def _seed(name: str, value: Any, maximum: int) -> int | None:
    if value is None:
        return None
    if not is_integer(value):
        raise TypeError(
            f"`{name}` entries must be integers (or None), got {value!r}: a float, bool or "
            "string is not a seed"
        )
    seed = int(value)
    if seed < 0:
        raise ValueError(f"`{name}` entries must be non-negative integers, got {seed}")
    if seed > maximum:
        raise ValueError(
            f"`{name}` entries must be at most {maximum} (grid2op's limit), got {seed}"
        )
    return seed


def _whole(value: Any) -> int | None:
    """``value`` as an int where grid2op's reset takes it for one (``int(value) == value``)."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number == value else None


_OVERRIDDEN = (
    "You provided both `{arg}` and the key `'{key}'` is present in the provided "
    "`reset_options`. In this case, grid2op will ignore the `{key}` of the `reset_options` and "
    "keep the value in `{arg}`."
)


def _check_reset_values(opts: dict[str, Any]) -> None:
    """The checks grid2op's ``env.reset`` makes of these options, before any work starts."""
    if "init ts" in opts:
        skip = _whole(opts["init ts"])
        if skip is None or skip < 1:
            raise ValueError(
                f'`reset_options` "init ts" must be an integer >= 1 (the step of the chronic to '
                f"start at), got {opts['init ts']!r}"
            )
    if "max step" in opts:
        steps = _whole(opts["max step"])
        if steps is None or (steps < 1 and steps != -1):
            raise ValueError(
                f'`reset_options` "max step" must be an integer >= 1 (or -1 for no limit), '
                f"got {opts['max step']!r}"
            )
    if "init datetime" in opts:
        value = opts["init datetime"]
        if not isinstance(value, datetime) and not (isinstance(value, str) and _is_date(value)):
            raise ValueError(
                f'`reset_options` "init datetime" must be a datetime or a string "YYYY-MM-DD '
                f'HH:MM" (or "YYYY-MM-DD"), got {value!r}'
            )


def _is_date(text: str) -> bool:
    for pattern in ("%Y-%m-%d %H:%M", "%Y-%m-%d"):  # grid2op's GridValue._datetime_from_str
        try:
            datetime.strptime(text, pattern)
        except ValueError:
            continue
        return True
    return False


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

    if not is_integer(nb_episode):
        raise TypeError(f"`nb_episode` must be an integer, got {type(nb_episode).__name__}")
    nb_episode = int(nb_episode)
    if nb_episode < 0:
        raise ValueError(f"`nb_episode` must be >= 0, got {nb_episode}")
    if max_iter is not None:
        if not is_integer(max_iter):
            raise TypeError(f"`max_iter` must be an integer or None, got {max_iter!r}")
        max_iter = int(max_iter)
        if max_iter < 1 and max_iter != -1:
            raise ValueError(f"`max_iter` must be >= 1 (or -1 for no limit), got {max_iter}")
    env_s = [
        _seed("env_seeds", s, MAX_ENV_SEED)
        for s in _per_episode("env_seeds", env_seeds, nb_episode)
    ]
    agent_s = [
        _seed("agent_seeds", s, MAX_AGENT_SEED)
        for s in _per_episode("agent_seeds", agent_seeds, nb_episode)
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
            # grid2op's Runner overrides these (aux_fun.py, with these warnings): never checked
            if max_iter is not None and "max step" in opts:
                del opts["max step"]
                warnings.warn(_OVERRIDDEN.format(arg="max_iter", key="max step"), stacklevel=3)
            if states[i] is not None and "init state" in opts:
                del opts["init state"]
                warnings.warn(_OVERRIDDEN.format(arg="init_state", key="init state"), stacklevel=3)
            _check_reset_values(opts)
        ep_id: Any = ids[i]
        if ep_id is None:
            # grid2op plays chronic i (wrapping around); "time serie id" in reset_options wins.
            ep_id = i % len(names) if names else i
            if opts is not None and "time serie id" in opts:
                ep_id = _time_serie_id(opts.pop("time serie id"))
        elif opts is not None and "time serie id" in opts:
            del opts["time serie id"]
            warnings.warn(_OVERRIDDEN.format(arg="episode_id", key="time serie id"), stacklevel=3)
        ep_id = _check_id(ep_id, names)
        requests.append(
            EpisodeRequest(
                index=i,
                episode_id=ep_id,
                chronic=chronic_of(ep_id, names),
                env_seed=env_s[i],
                agent_seed=agent_s[i],
                max_iter=max_iter,
                init_state=states[i],
                reset_options=opts,
            )
        )
    return requests


def _time_serie_id(value: Any) -> int:
    """grid2op's Runner reads ``"time serie id"`` with ``int(...)``: a chronic's position among
    those the env plays (its filter's), never a name ("0001" is the second chronic)."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(
            f'`reset_options` "time serie id" is a chronic\'s position, read with int() as '
            f"grid2op's Runner does, got {value!r} (give a chronic's name in `episode_id`)"
        ) from None


def _check_id(ep_id: Any, names: list[str] | None) -> int | str:
    if isinstance(ep_id, str):
        if names is not None and ep_id not in names:
            raise ValueError(
                f"episode id {ep_id!r} is not a chronic of this env; known: {names[:10]}..."
            )
        return ep_id
    if not is_integer(ep_id):
        pair = " ((mix, id) pairs are tuples)" if isinstance(ep_id, list) else ""
        raise TypeError(f"episode ids must be integers or chronic names, got {ep_id!r}{pair}")
    value = int(ep_id)
    if value < 0:
        raise ValueError(f"episode id {value} is out of range: ids start at 0")
    if names is not None and value >= len(names):
        raise ValueError(
            f"episode id {value} is out of range: this env has {len(names)} chronics, ids 0 to "
            f"{len(names) - 1} (or give a chronic's name)"
        )
    return value


def chronic_of(ep_id: int | str, names: list[str] | None) -> str | None:
    """The name of the chronic a checked episode id plays (``None`` when chronics have none)."""
    if isinstance(ep_id, str):
        return ep_id
    return None if names is None else names[ep_id]


def check_with_env(requests: Sequence[EpisodeRequest], env_for: Callable[[Any], Any]) -> None:
    """The checks of grid2op's reset that need the env: thermal limits and initial states.

    ``env_for(mix)`` is the env that plays a request. An initial state given once for every
    episode is checked once.
    """
    seen: set[tuple[int, Any]] = set()
    for request in requests:
        env = env_for(request.mix)
        options = request.reset_options or {}
        if "thermal limit" in options:
            check_thermal_limit(options["thermal limit"], env)
        for state in (request.init_state, options.get("init state")):
            if state is not None and (id(state), request.mix) not in seen:
                seen.add((id(state), request.mix))
                _check_state(state, env)


def check_thermal_limit(value: Any, env: Any) -> None:
    # as grid2op's BaseEnv.set_thermal_limit
    lines = [str(name) for name in env.name_line]
    what = '`reset_options` "thermal limit"'
    if isinstance(value, dict):
        for key, limit in value.items():
            if key not in lines:
                raise ValueError(
                    f"{what} keys must be line names; {key!r} is not one of {lines[:4]}..."
                )
            try:
                finite = np.isfinite(float(limit))
            except (TypeError, ValueError):
                finite = False
            if not finite:
                raise ValueError(
                    f"{what} values must be finite numbers (amps), got {limit!r} for line {key!r}"
                )
        # grid2op leaves a line the dict does not name without a limit (NaN) and then refuses it
        missing = [line for line in lines if line not in value]
        if missing:
            shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
            raise ValueError(
                f"{what} as a dict must give every line's limit; it misses {len(missing)} of "
                f"{len(lines)} lines ({shown}): name them all, or give a list with one limit per line"
            )
        return
    if not isinstance(value, (np.ndarray, list)):
        raise ValueError(
            f"{what} must be a list or array with one limit (amps) per line, or a dict "
            f"{{line name: limit}}, got {type(value).__name__}"
        )
    try:
        limits = np.array(value).flatten().astype(np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must hold numbers (amps), got {value!r}") from None
    if limits.shape[0] != len(lines):
        raise ValueError(
            f"{what} has {limits.shape[0]} values but the grid has {len(lines)} lines: give one "
            "per line"
        )
    if not np.isfinite(limits).all():
        raise ValueError(f"{what} must be finite numbers, got {value!r}")


def _check_state(state: Any, env: Any) -> None:
    from grid2op.Action import BaseAction

    if not isinstance(state, (dict, BaseAction)):
        raise TypeError(f"an initial state must be a dict or a grid2op action, got {state!r}")
    try:
        action = init_state_action(state, env)
    except Exception as exc:
        raise ValueError(
            f"initial state {state!r} is not an action of this env: {type(exc).__name__}: {exc}"
        ) from None
    ambiguous, reason = action.is_ambiguous()
    if ambiguous:
        raise ValueError(f"initial state {state!r} is an ambiguous action: {reason}")


def init_state_action(state: Any, env: Any) -> Any:
    """The action grid2op's ``Environment.reset`` makes of an initial state (``"init state"``: a
    dict, its ``"method"`` aside, or an action), raising what that reset raises."""
    from grid2op.Action import BaseAction
    from grid2op.Exceptions import Grid2OpException

    if isinstance(state, BaseAction):
        return state
    if not isinstance(state, dict):
        raise Grid2OpException(
            "`init state` kwargs in `env.reset(, options=XXX) should either be a "
            "grid2op action (instance of grid2op.Action.BaseAction) or a dictionaray "
            f"representing an action. You provided {state} which is a {type(state)}"
        )
    as_dict = {k: v for k, v in state.items() if k != "method"}
    with strict():  # as grid2op's reset: its warnings are errors there
        return env._helper_action_env(as_dict)


def check_path_save(
    path: str | os.PathLike[str], name: str = "path_save", purpose: str = "save episodes in"
) -> str:
    """Make sure files can be written under ``path`` (created if missing); return it absolute.
    ``name``: the argument's, ``purpose``: what the folder is for, in the errors.

    Writability is tried, not asked: ``os.access`` says yes for root everywhere, and for
    folders such as ``/proc`` or ``/sys`` where nothing can be created.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"`{name}` must be a folder path (str or os.PathLike), got {type(path).__name__} "
            f"{path!r}"
        )
    if not os.fspath(path):  # an unset shell variable ("--save $OUT"): not the current folder
        raise ValueError(f'`{name}` is an empty path: give a folder to {purpose} (".": here)')
    folder = os.path.abspath(os.fspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"`{name}` {folder!r} is a file: give a folder to {purpose}")
    ancestor = folder
    while not os.path.exists(ancestor):
        if os.path.islink(ancestor):  # ($SCRATCH/runs, the scratch disk not mounted)
            what = "is" if ancestor == folder else f"cannot be created: {ancestor!r} is"
            raise ValueError(
                f"`{name}` {folder!r} {what} a link to {os.readlink(ancestor)!r}, which is not "
                f"there (a disk not mounted?): make that folder, or give another folder to "
                f"{purpose}"
            )
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(
            f"`{name}` {folder!r} cannot be created: {ancestor!r} is a file, not a folder"
        )
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".asyncrunner-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        what = "is not writable" if ancestor == folder else "cannot be created"
        fix = "give a folder you can write to"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free some space on its disk (or quota), or give a folder on another disk"
        raise ValueError(f"`{name}` {folder!r} {what} ({exc.strerror or exc}): {fix}") from None
    return folder
