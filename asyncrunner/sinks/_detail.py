"""``run(add_detailed_output=...)``: grid2op's ``EpisodeData`` of each episode, built from the events.

grid2op's Runner fills an ``EpisodeData`` (or a ``CompactEpisodeData``) in the process that plays
the episode and sends it back. Here the worker streams the steps as arrays, and sends the
steps' objects (actions, observations...) with the episode's end (``EpisodeFinished.objects``);
this sink assembles the arrays in the buffers the workers build the episode files from
(``EpisodeBuffer``) and builds the object, in a worker thread, with the parent's copy of the
env's spaces.
"""

from __future__ import annotations

import pickle
import types
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from .._model import EpisodeFinished
from ._buffer import BufferingSink, EpisodeBuffer
from ._compact import compact_content

__all__ = ["DetailCollector", "compact_episode_data", "episode_data"]


class DetailCollector(BufferingSink):
    """Builds each finished episode's ``EpisodeData`` (``compact``: ``CompactEpisodeData``).

    ``env_for(mix)`` gives the parent's env (or mix) whose spaces the objects use. ``data`` maps
    request index to the built object.
    """

    def __init__(self, env_for: Callable[[str | None], Any], *, compact: bool = False) -> None:
        super().__init__()
        self.env_for = env_for
        self.compact = compact
        self.data: dict[int, Any] = {}
        self._obs_spaces: dict[str | None, Any] = {}
        # One build at a time: they share the spaces, and each one is CPU-bound anyway.
        self._limiter = anyio.CapacityLimiter(1)

    def __repr__(self) -> str:
        return f"DetailCollector(compact={self.compact})"

    async def _finished(self, buffer: EpisodeBuffer, finished: EpisodeFinished) -> None:
        self.data[finished.index] = await anyio.to_thread.run_sync(
            self._build, buffer, finished, limiter=self._limiter
        )

    def _build(self, buffer: EpisodeBuffer, finished: EpisodeFinished) -> Any:
        mix = buffer.started.mix
        env = self.env_for(mix)
        obs_space = self._obs_spaces.get(mix)
        if obs_space is None:
            obs_space = self._obs_spaces[mix] = serializable_observation_space(env)
        if self.compact:
            return compact_episode_data(env, obs_space, buffer, finished)
        return episode_data(env, obs_space, buffer, finished)


def serializable_observation_space(env: Any) -> Any:
    """A copy of the env's observation space without its simulator, as grid2op's Runner returns."""
    from grid2op.Episode import EpisodeData

    holder = types.SimpleNamespace(observation_space=env.observation_space)
    EpisodeData._aux_make_obs_space_serializable(holder)
    return holder.observation_space


def episode_data(env: Any, obs_space: Any, buffer: EpisodeBuffer, finished: EpisodeFinished) -> Any:
    """The ``EpisodeData`` grid2op's Runner returns for this episode (``add_detailed_output``).

    Same arrays (shapes, padding, dtypes), attributes and objects: actions, environment
    modifications and observations of the steps played; attacks where the opponent attacked
    (``None`` elsewhere, as grid2op leaves them).
    """
    from grid2op.dtypes import dt_bool, dt_float
    from grid2op.Episode import EpisodeData

    started = buffer.started
    arrays = buffer.arrays(started.max_ts)  # grid2op preallocates max_timestep() rows
    n = int(finished.nb_time_step)
    names = started.other_reward_names
    other_rewards = [
        dict(zip(names, row, strict=True)) for row in arrays["other_rewards"][:n].tolist()
    ]
    action_space = env.action_space
    helper = env._helper_action_env
    attack_space = env._opponent_action_space
    episode = EpisodeData(
        actions=arrays["actions"],
        env_actions=arrays["env_actions"],
        observations=arrays["observations"],
        rewards=arrays["rewards"],
        disc_lines=arrays["disc_lines"],
        times=arrays["times"],
        observation_space=obs_space,
        action_space=action_space,
        helper_action_env=helper,
        attack_space=attack_space,
        disc_lines_templ=np.full((1, env.backend.n_line), fill_value=False, dtype=dt_bool),
        attack_templ=np.full((1, attack_space.n), fill_value=0.0, dtype=dt_float),
        attack=arrays["attacks"],
        name=started.name,
        force_detail=True,
        other_rewards=other_rewards,
        legal=arrays["legal"],
        ambiguous=arrays["ambiguous"],
        has_legal_ambiguous=True,
    )
    # grid2op's Runner builds the first observation from its vector, and keeps the objects of the
    # steps (the workers send them: ``EpisodeFinished.objects``).
    first = obs_space.from_vect(arrays["observations"][0])
    first._obs_env = None
    first._ptr_kwargs_env = None
    episode.observations.objects[0] = first
    steps = pickle.loads(finished.objects) if finished.objects else None
    if isinstance(steps, str):  # the reason they could not be pickled
        warnings.warn(
            f"add_detailed_output: the objects of episode {finished.index} ({started.name}) "
            f"could not be pickled in its worker ({steps}): its actions and observations are "
            "rebuilt from their vectors, as grid2op's EpisodeData.from_disk reads them, so what "
            "a vector does not hold (an observation's theta_* and forecasts, attributes your "
            "agent set) is not the played objects'. Make them picklable to get the objects as "
            "played (grid2op's Runner with nb_process > 1 fails on them).",
            UserWarning,
            stacklevel=1,
        )
        steps = None
    for t in range(n):
        if steps is not None:
            act, env_act, obs, attack = steps[t]
        else:  # (objects that could not be pickled: built from their vectors)
            act = action_space.from_vect(arrays["actions"][t], check_legit=False)
            env_act = helper.from_vect(arrays["env_actions"][t], check_legit=False)
            obs = obs_space.from_vect(arrays["observations"][t + 1])
            obs._obs_env = None
            obs._ptr_kwargs_env = None
            vector = arrays["attacks"][t]
            attack = attack_space.from_vect(vector, check_legit=False) if vector.any() else None
        episode.actions.objects[t] = act
        episode.env_actions.objects[t] = env_act
        episode.observations.objects[t + 1] = obs
        if attack is not None:
            episode.attacks.objects[t] = attack
    episode.parameters = dict(started.parameters)
    episode.meta = {
        "chronics_path": started.chronics_path,
        "chronics_max_timestep": started.meta["chronics_max_timestep"],
        "grid_path": started.meta["grid_path"],
        "backend_type": started.meta["backend_type"],
        "env_type": started.meta["env_type"],
        "nb_timestep_played": n,
        "cumulative_reward": float(finished.cum_reward),
        "env_seed": None if finished.env_seed is None else int(finished.env_seed),
        "agent_seed": None if finished.agent_seed is None else int(finished.agent_seed),
    }
    episode.episode_times = dict(finished.times)
    episode.set_game_over(n)
    return episode


def compact_episode_data(
    env: Any, obs_space: Any, buffer: EpisodeBuffer, finished: EpisodeFinished
) -> Any:
    """The ``CompactEpisodeData`` grid2op's Runner returns (``use_compact_episode_data=True``)."""
    from grid2op.Episode import CompactEpisodeData

    meta, padded = compact_content(buffer, finished)
    arrays = {name: array.full() for name, array in padded.items()}
    n_line = int(env.backend.n_line)
    n_attack = int(env._opponent_action_space.n)
    episode = CompactEpisodeData.__new__(CompactEpisodeData)
    episode.exp_dir = None
    episode.array_names = tuple(arrays)
    episode.space_names = (
        "observation_space",
        "action_space",
        "attack_space",
        "env_modification_space",
    )
    episode.ep_id = buffer.started.name
    for name, array in arrays.items():
        setattr(episode, name, array)
    episode.other_reward_names = list(meta["other_reward_names"])
    episode.disc_lines_templ = np.full((1, n_line), fill_value=False, dtype=np.bool_)
    episode.attack_templ = np.full((1, n_attack), fill_value=0.0, dtype=np.float32)
    episode.n_cols = (
        env.action_space.n + env._helper_action_env.n + obs_space.n + n_line + n_attack + 6
    )
    episode.game_over_timestep = int(finished.nb_time_step)
    episode.observation_space = obs_space
    episode.action_space = env.action_space
    episode.attack_space = env._opponent_action_space
    episode.env_modification_space = env._helper_action_env
    episode.meta = meta
    return episode
