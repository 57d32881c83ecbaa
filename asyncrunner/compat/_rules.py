"""grid2op's Runner rules, as compat applies them: its argument checks (with its messages),
which chronic each episode plays, the reset options it overrides (with its warnings) and the
seeds as grid2op reads them."""

from __future__ import annotations

import numbers
import os
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from grid2op.Action import BaseAction
from grid2op.Exceptions import ChronicsError, EnvError, Grid2OpException

from .._model import EpisodeResult
from .._plan._arguments import (
    MAX_ENV_SEED,
    check_thermal_limit,
    chronic_names,
    init_state_action,
)

KEY_TIME_SERIE_ID = "time serie id"
# grid2op's warnings (grid2op/Runner/aux_fun.py), raised in the caller's thread.
_WARN_TS_ID = (
    "You provided both `episode_id` and the key `'time serie id'` is present "
    "in the provided `reset_options`. In this case, grid2op will ignore the "
    "`time serie id` of the `reset_options` and keep the value in `episode_id`."
)
_WARN_MAX_STEP = (
    "You provided both `max_iter` and the key `'max step'` is present "
    "in the provided `reset_options`. In this case, grid2op will ignore the "
    "`max step` of the `reset_options` and keep the value in `max_iter`."
)
_WARN_INIT_STATE = (
    "You provided both `init_state` and the key `'init state'` is present "
    "in the provided `reset_options`. In this case, grid2op will ignore the "
    "`init state` of the `reset_options` and keep the value in `init_state`."
)


def check_lengths(nb_episode: int, env_seeds: Any, agent_seeds: Any, episode_id: Any) -> None:
    """grid2op's ``Runner.run`` checks: one seed (env, agent) and one id per episode."""
    if nb_episode < 0:
        raise RuntimeError("Impossible to run a negative number of scenarios.")
    if env_seeds is not None and len(env_seeds) != nb_episode:
        raise RuntimeError(
            f'You want to compute "{nb_episode}" run(s) but provide only "{len(env_seeds)}" '
            "different seeds (environment)."
        )
    if agent_seeds is not None and len(agent_seeds) != nb_episode:
        raise RuntimeError(
            f'You want to compute "{nb_episode}" run(s) but provide only "{len(agent_seeds)}" '
            "different seeds (agent)."
        )
    if episode_id is not None and len(episode_id) != nb_episode:
        raise RuntimeError(
            f'You want to compute "{nb_episode}" run(s) but provide only "{len(episode_id)}" '
            "different ids."
        )


def check_init_states(init_states: Any, nb_episode: int) -> list[Any] | None:
    """grid2op's check: one initial state per episode (one given is copied for each)."""
    if init_states is None:
        return None
    if isinstance(init_states, (dict, BaseAction)):
        return [init_states.copy() for _ in range(nb_episode)]
    if isinstance(init_states, (list, tuple, np.ndarray)):
        if len(init_states) != nb_episode:
            raise RuntimeError(
                f'You want to compute "{nb_episode}" run(s) but provide only '
                f'"{len(init_states)}" different initial state.'
            )
        for i, el in enumerate(init_states):
            if not isinstance(el, (dict, BaseAction)):
                raise RuntimeError(
                    "When specifying `init_states` kwargs with a list (or a tuple) "
                    "it should be a list (or a tuple) of dictionary or BaseAction. "
                    f"You provided {type(el)} at position {i}."
                )
        return list(init_states)
    raise RuntimeError(
        "When using `init_state` in the runner, you should make sure to use "
        "either use dictionnary, grid2op actions or list / tuple of actions."
    )


def check_reset_options(reset_options: Any, nb_episode: int, keys: Any) -> list[Any] | None:
    """grid2op's check; ``keys``: the env class's ``KEYS_RESET_OPTIONS``."""
    if reset_options is None:
        return None
    if isinstance(reset_options, dict):
        for k in reset_options:
            if k not in keys:
                raise RuntimeError(
                    "Wehn specifying `reset options` all keys of the dictionary should "
                    "be compatible with the available reset options of your environment "
                    f'class. You provided the key "{k}" for the provided dictionary but'
                    f"possible keys are limited to {keys}."
                )
        return [reset_options.copy() for _ in range(nb_episode)]
    if isinstance(reset_options, (list, tuple, np.ndarray)):
        if len(reset_options) != nb_episode:
            raise RuntimeError(
                f'You want to compute "{nb_episode}" run(s) but provide only '
                f'"{len(reset_options)}" different reset options.'
            )
        for i, el in enumerate(reset_options):
            if not isinstance(el, dict):
                raise RuntimeError(
                    "When specifying `reset_options` kwargs with a list (or a tuple) "
                    "it should be a list (or a tuple) of dictionary or BaseAction. "
                    f"You provided {type(el)} at position {i}."
                )
        for i, el in enumerate(reset_options):
            for k in el:
                if k not in keys:
                    raise RuntimeError(
                        "Wehn specifying `reset options` all keys of the dictionary should "
                        "be compatible with the available reset options of your environment "
                        f'class. You provided the key "{k}" for the {i}th dictionary but'
                        f"possible keys are limited to {keys}."
                    )
        return list(reset_options)
    raise RuntimeError(
        "When using `reset_options` in the runner, you should make sure to use "
        "either use dictionnary, grid2op actions or list / tuple of actions."
    )


def ids_and_options(
    nb_episode: int, episode_id: Any, reset_options: Any
) -> tuple[list[Any], list[dict[str, Any] | None]]:
    """Which chronic each episode plays, and its reset options: grid2op's rules
    (``Runner._run_sequential``: ``episode_id``, else the options' ``"time serie id"``, else
    the episode's number)."""
    if isinstance(reset_options, dict):
        reset_options = [reset_options.copy() for _ in range(nb_episode)]
    ids: list[Any] = []
    options: list[dict[str, Any] | None] = []
    for i in range(nb_episode):
        option = None if reset_options is None else dict(reset_options[i])
        ep_id: Any = i
        if episode_id is not None:
            ep_id = episode_id[i]
        elif option is not None and KEY_TIME_SERIE_ID in option:
            ep_id = int(option.pop(KEY_TIME_SERIE_ID))
        ids.append(ep_id)
        options.append(option)
    return ids, options


def methods_taken(
    init_states: list[Any], options: list[dict[str, Any] | None], nb_process: int
) -> list[tuple[int, dict[str, Any]]]:
    """grid2op's ``env.reset`` deletes ``"method"`` from the init state dict it is given: where
    its Runner gives several episodes one dict (``reset_options={"init state": {...}}`` given
    once, a dict listed twice in ``init_states``), those a process plays after the first reset
    with the default, ``"combine"`` (its processes get the episodes round-robin). So do they
    here: each gets a copy without it (``init_states`` or ``options`` changed in place).
    Returns the dicts grid2op takes it from, with the episode that does (the caller's own with
    one process)."""
    seen: set[tuple[int, int]] = set()
    taken: list[tuple[int, dict[str, Any]]] = []
    for i, option in enumerate(options):
        state = init_states[i]
        if state is None and option is not None:
            state = option.get("init state")
        if not isinstance(state, dict) or "method" not in state:
            continue
        key = (i % nb_process, id(state))
        if key not in seen:
            seen.add(key)
            taken.append((i, state))
            continue
        bare = {k: v for k, v in state.items() if k != "method"}
        if init_states[i] is not None:
            init_states[i] = bare
        else:
            options[i] = {**(option or {}), "init state": bare}
    return taken


def reset_options_for_core(
    options: list[dict[str, Any] | None], max_iter: int | None, init_states: list[Any]
) -> list[dict[str, Any] | None]:
    """The reset options the episodes play with: what grid2op's episode loop
    (``aux_fun._aux_run_one_episode``) warns about and overrides."""
    core_options: list[dict[str, Any] | None] = []
    for i in range(len(options)):
        option = dict(options[i] or {})
        if KEY_TIME_SERIE_ID in option:
            warnings.warn(_WARN_TS_ID, stacklevel=4)
            del option[KEY_TIME_SERIE_ID]
        if max_iter is not None:
            if "max step" in option:
                warnings.warn(_WARN_MAX_STEP, stacklevel=4)
            option.pop("max step", None)
            if max_iter == -1:
                option["max step"] = -1  # "no limit", even over the runner's max_iter
        if init_states[i] is not None:
            if "init state" in option:
                warnings.warn(_WARN_INIT_STATE, stacklevel=4)
            option.pop("init state", None)
        core_options.append(option or None)
    return core_options


def chronic_id(ep_id: Any, env: Any) -> Any:
    """A chronic id as grid2op reads it: ints wrap around, strings may be full paths."""
    names = chronic_names(env)
    if isinstance(ep_id, str):
        if names is None or ep_id in names:
            return ep_id
        real = env.chronics_handler.real_data
        for name, number in zip(names, real._order, strict=True):
            if ep_id == real.subpaths[number]:
                return name
        raise ChronicsError(
            f'Impossible to find the chronics with id "{ep_id}". The call to '
            "`env.chronics_handler.tell_id(...)` cannot be performed."
        )
    try:
        value = int(ep_id)  # grid2op's Environment.set_id: 1.0 plays chronic 1
    except Exception as exc:
        raise EnvError(
            'the "id_" parameters should be convertible to integer and not be of type '
            f'{type(ep_id)}with error \n"{exc}"'
        ) from exc
    return value % len(names) if names else value


def check_resets(
    env: Any, options: list[dict[str, Any] | None], init_states: list[Any], *, compact: bool
) -> None:
    """grid2op's checks of each episode's reset options and initial state, with its errors
    (``Environment.reset``, which raises them as the episode starts), before any episode plays.
    ``options``: those the episodes reset with (``reset_options_for_core``).

    With ``compact`` (``use_compact_episode_data=True``), an episode reset with ``"max step":
    -1`` (``max_iter=-1``) fails as in grid2op's Runner: its ``CompactEpisodeData`` preallocates
    ``env.max_episode_duration()`` rows, -1 after that reset (numpy's ``ValueError``)."""
    for option, state in zip(options, init_states, strict=True):
        option = option or {}
        skip = env._aux_get_skip_ts(option)
        if state is None:
            state = option.get("init state")
        if state is not None:
            ambiguous, reason = init_state_action(state, env).is_ambiguous()
            if ambiguous:
                raise Grid2OpException(
                    "You provided an invalid (ambiguous) action to set the 'init state'"
                ) from reason
        max_step = None
        if "max step" in option:
            max_step = env._aux_check_max_iter(option["max step"])
        if skip is not None and skip < 1:
            raise Grid2OpException(
                f"In `env.reset` the kwargs `init ts` should be an int >= 1, found {option['init ts']}"
            )
        if "init datetime" in option:
            _check_datetime(option["init datetime"], env)
        if "thermal limit" in option:
            try:
                check_thermal_limit(option["thermal limit"], env)
            except ValueError as exc:  # (the async core's message, as grid2op's type)
                raise Grid2OpException(str(exc)) from exc
        if compact and max_step == -1:  # (after the reset, which raised the errors above)
            raise ValueError("negative dimensions are not allowed")


def _check_datetime(value: Any, env: Any) -> None:
    """grid2op's ``GridValue.set_current_datetime`` checks, with its errors."""
    if isinstance(value, str):
        env.chronics_handler.real_data._datetime_from_str(value)
    elif not isinstance(value, datetime):
        raise Grid2OpException(
            "Impossible to set the current date and time with your input. You have provided a "
            f"string or a datetime.datetime object but provided {type(value)}."
        )


def env_seed(seed: Any) -> Any:
    """An env seed as grid2op's ``env.seed`` reads it (a float truncated, a bool as 0 / 1).

    The async core takes integers only; anything else goes on for it to reject.
    """
    if seed is None or not isinstance(seed, (numbers.Real, np.bool_)):
        return seed
    if float(seed) > MAX_ENV_SEED:
        raise Grid2OpException(
            f"Seed is too big. Max value is {MAX_ENV_SEED}, provided value is {seed}"
        )
    return int(np.array(seed).astype(np.int32))


def located(result: EpisodeResult, path_save: str | os.PathLike[str] | None) -> Any:
    """The episode's data object, pointing at where it was saved (as grid2op's does; an
    ``EpisodeData``'s folder is set by ``AsyncRunner.run``)."""
    data = result.episode_data
    if data is not None and path_save is not None and hasattr(data, "exp_dir"):
        data.exp_dir = Path(path_save) / "CompactEpisodeData"  # CompactEpisodeData
    return data


def grid2op_tuple(
    result: EpisodeResult,
    sums: tuple[str, float],
    *,
    compact: bool,
    raw_reward: bool,
    detailed: bool,
    path_save: str | os.PathLike[str] | None,
    nb_highres: bool,
) -> tuple[Any, ...]:
    """What grid2op's Runner returns for an episode: ``(id_chron, name_chron, cum_reward,
    nb_time_step, max_ts[, episode_data][, nb_highres_sim])``. The reward as grid2op sums it
    (``sums``: numpy's type of that sum, and CompactEpisodeData's float64 sum): a Python float
    from ``run()``, numpy's from ``run_one_episode()`` (``raw_reward``), CompactEpisodeData's
    with ``compact``."""
    kind, sum64 = sums
    cum_reward: Any = result.cum_reward
    if compact:
        cum_reward = sum64
    elif raw_reward:
        cum_reward = np.dtype(kind).type(cum_reward)
    res: tuple[Any, ...] = (
        result.chronics_path,
        result.name,
        cum_reward,
        result.nb_time_step,
        result.max_ts,
    )
    if detailed:
        res = (*res, located(result, path_save))
    if nb_highres:
        res = (*res, result.nb_highres_sim)
    return res
