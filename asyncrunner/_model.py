"""The model every layer shares: what a run is asked to play, the events it emits, its results.

``EpisodeRequest``: one requested episode (planned by ``_plan``). Events, in the order a sink
sees them: ``RunStarted``, then for each episode ``EpisodeStarted``, any number of ``StepBatch``
and one of ``EpisodeFinished`` / ``EpisodeFailed``, then ``RunFinished``. Events of different
episodes interleave. A worker that dies mid-episode yields ``EpisodeFailed(retrying=True)`` and
the episode starts again with ``attempt + 1``: sinks drop what they hold for the failed attempt.
``EpisodeResult``: what ``AsyncRunner.run`` returns, one per requested episode.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "EpisodeFailed",
    "EpisodeFinished",
    "EpisodeRequest",
    "EpisodeResult",
    "EpisodeStarted",
    "Event",
    "RunFinished",
    "RunStarted",
    "Staged",
    "StepBatch",
]


@dataclass(frozen=True)
class EpisodeRequest:
    """The ``index``-th requested episode, with grid2op's Runner meaning for each field.

    ``mix``: the mix to play it on, for a ``MultiMixEnvironment`` (``None`` otherwise).
    ``chronic``: the name of the chronic it plays, where the env's chronics have names (what
    its result says when it fails before it starts).
    """

    index: int
    episode_id: int | str
    env_seed: int | None
    agent_seed: int | None
    max_iter: int | None
    init_state: Any
    reset_options: dict[str, Any] | None
    mix: str | None = None
    chronic: str | None = None


class ReadOnly(Mapping[str, Any]):
    """A read-only mapping that pickles and copies (a ``MappingProxyType`` does neither: a sink
    forwarding events to another process failed on the first one)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"ReadOnly({self._data!r})"


class ParsedJson(ReadOnly):
    """JSON files' content by name, each file parsed the first time it is read: dicts of this
    mapping's own (``RunStarted.spaces``; l2rpn_idf_2023's four spaces took 1.2 ms to parse at
    every saving run, which no writer reads)."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        super().__init__(files)
        self._parsed: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        try:
            return self._parsed[key]
        except KeyError:
            # (two threads reading at once both get the first dict kept)
            return self._parsed.setdefault(key, json.loads(self._data[key]))

    def __repr__(self) -> str:
        return f"ParsedJson({list(self._data)!r})"


@dataclass(frozen=True)
class RunStarted:
    """A run begins: how many episodes, and the env's spaces (grid2op's ``dict_*_space.json``).

    ``spaces`` holds the files' dicts (this run's own: a sink changing them changes no other
    run), ``space_files`` the files themselves, as the episode writers write them. ``agent``
    names the agent that plays (its class or factory, see ``AsyncRunner``): the episode writers
    record it, and ``resume`` matches on it. ``mixes``: the mixes of a ``MultiMixEnvironment``
    (empty for any other env); the episode writers save each mix in a folder of its own
    (``<path>/<mix>``, with the space files), as ``path_save`` and grid2op's users do.
    """

    run_id: str
    nb_episode: int
    spaces: Mapping[str, Any] = field(repr=False)
    agent: str | None = None
    space_files: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    mixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class EpisodeStarted:
    """An episode was reset in a worker; ``observation`` is the first observation as a vector.

    ``worker`` is the worker's pid, ``env_builds`` how many envs that worker has built so far.
    ``mix`` is the mix played, on a ``MultiMixEnvironment`` (``None`` otherwise).
    """

    run_id: str
    index: int
    attempt: int
    chronics_path: str
    name: str
    max_ts: int
    env_seed: int | None
    agent_seed: int | None
    worker: int
    env_builds: int
    observation: np.ndarray = field(repr=False)
    parameters: Mapping[str, Any] = field(repr=False)
    meta: Mapping[str, Any] = field(repr=False)
    other_reward_names: tuple[str, ...] = ()
    # What was requested (for ``resume``; ``reset``: the reset options and initial state as one
    # string, None for none), and what grid2op's CompactEpisodeData records.
    episode_id: int | str | None = None
    max_iter: int | None = None
    reset: str | None = None
    max_episode_duration: int = 0
    action_space_seed: int | None = None
    mix: str | None = None


@dataclass(frozen=True)
class StepBatch:
    """Consecutive steps ``first_step .. first_step + len(self) - 1`` (1-based) of one episode.

    Arrays hold one row per step, with the dtypes grid2op's EpisodeData stores; ``actions``,
    ``env_actions``, ``observations``, ``disc_lines``, ``attacks`` and ``other_rewards`` hold none
    when no sink of the run reads the steps (``Sink.needs_steps``).
    """

    run_id: str
    index: int
    attempt: int
    first_step: int
    actions: np.ndarray = field(repr=False)
    env_actions: np.ndarray = field(repr=False)
    observations: np.ndarray = field(repr=False)
    rewards: np.ndarray = field(repr=False)
    done: np.ndarray = field(repr=False)
    disc_lines: np.ndarray = field(repr=False)
    attacks: np.ndarray = field(repr=False)
    legal: np.ndarray = field(repr=False)
    ambiguous: np.ndarray = field(repr=False)
    agent_times: np.ndarray = field(repr=False)
    other_rewards: np.ndarray = field(repr=False)

    def __len__(self) -> int:
        return int(self.rewards.shape[0])


@dataclass(frozen=True)
class Staged:
    """An episode's files, written and flushed to the disk by its worker in ``folder``: a
    hidden folder inside the writer's own (``Writer.stage``), which the writer only moves into
    place."""

    folder: str


@dataclass(frozen=True)
class EpisodeFinished:
    """An episode ended (game over or end of its chronic); ``times`` as grid2op's ``episode_times.json``.

    ``cum_reward``: the rewards summed as grid2op's Runner sums them (from a float32, which a
    float64 reward makes a float64: ``cum_reward_type``, numpy's type of that sum);
    ``cum_reward64``: as grid2op's ``CompactEpisodeData`` sums them (``float(reward)``).
    ``files``: the episode's saved files, built by the worker for the run's episode writers, by
    format (``Sink.episode_format``): by file name, or ``Staged`` when the worker wrote them
    itself; empty for every other sink and in ``stream()``. ``objects``: with
    ``run(add_detailed_output=True)``, the steps' grid2op objects as grid2op's Runner keeps them
    in its ``EpisodeData`` (the agent's actions, the env's actions, the observations the env
    returned, the attacks), pickled (where they cannot be, the reason, a pickled ``str``);
    empty otherwise.
    """

    run_id: str
    index: int
    attempt: int
    chronics_path: str
    name: str
    cum_reward: float
    cum_reward_type: str
    cum_reward64: float
    nb_time_step: int
    max_ts: int
    env_seed: int | None
    agent_seed: int | None
    nb_highres_sim: int
    times: Mapping[str, Any] = field(repr=False)
    files: Mapping[str, Mapping[str, bytes] | Staged] = field(default_factory=dict, repr=False)
    objects: bytes = field(default=b"", repr=False)


# EpisodeFailed.error_type of an episode still playing when another one's failure stopped the
# run (``on_error="raise"``): it ends too, and has no result.
STOPPED = "Stopped"


@dataclass(frozen=True)
class EpisodeFailed:
    """An episode failed: an exception in the agent or env, or a worker that died.

    ``step``: the steps played when it failed. When its worker died (or was stopped by
    ``episode_timeout``, or by another episode's failure under ``on_error="raise"``:
    ``error_type`` ``"Stopped"``) ``steps_lost`` is true and ``step`` is the last step received
    from it: the steps it played since its last batch were never sent. ``retrying`` says the
    episode will start again on another attempt.
    """

    run_id: str
    index: int
    attempt: int
    error_type: str
    message: str
    traceback: str
    step: int
    retrying: bool = False
    steps_lost: bool = False
    # The exception itself, pickled in the worker when it could be, for ``compat.Runner`` (which
    # raises it, as grid2op's Runner does); None otherwise.
    exception: bytes | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class EpisodeResult:
    """The outcome of the ``index``-th requested episode.

    ``error`` is ``None`` for a played episode, else the ``EpisodeFailed`` event that ended it.
    ``path`` is the episode's saved folder, or ``None`` when nothing was saved.
    ``episode_data``: grid2op's ``EpisodeData`` (or ``CompactEpisodeData``) of the episode when
    ``run(add_detailed_output=...)`` asked for it. ``mix``: the mix played, on a
    ``MultiMixEnvironment`` (``None`` otherwise).
    """

    index: int
    chronics_path: str | None
    name: str | None
    cum_reward: float
    nb_time_step: int
    max_ts: int
    env_seed: int | None
    agent_seed: int | None
    path: str | None = None
    error: EpisodeFailed | None = None
    nb_highres_sim: int = 0
    episode_data: Any = field(default=None, repr=False, compare=False)
    mix: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the episode was played to its end."""
        return self.error is None

    @classmethod
    def of_finished(cls, event: EpisodeFinished, *, mix: str | None = None) -> EpisodeResult:
        """The result of an episode played to its end."""
        return cls(
            index=event.index,
            chronics_path=event.chronics_path,
            name=event.name,
            cum_reward=event.cum_reward,
            nb_time_step=event.nb_time_step,
            max_ts=event.max_ts,
            env_seed=event.env_seed,
            agent_seed=event.agent_seed,
            nb_highres_sim=event.nb_highres_sim,
            mix=mix,
        )

    @classmethod
    def of_failed(
        cls,
        failure: EpisodeFailed,
        started: EpisodeStarted | None,
        *,
        env_seed: int | None,
        agent_seed: int | None,
        mix: str | None = None,
        name: str | None = None,
    ) -> EpisodeResult:
        """The result of a failed episode: its chronic and length from its last start, if any
        (else ``name``, the chronic it was to play)."""
        return cls(
            index=failure.index,
            chronics_path=None if started is None else started.chronics_path,
            name=name if started is None else started.name,
            cum_reward=0.0,
            nb_time_step=failure.step,
            max_ts=0 if started is None else started.max_ts,
            env_seed=env_seed,
            agent_seed=agent_seed,
            error=failure,
            mix=mix,
        )

    def as_tuple(self) -> tuple[str | None, str | None, float, int, int]:
        """grid2op's ``(chronics_path, name, cum_reward, nb_time_step, max_ts)``."""
        return (self.chronics_path, self.name, self.cum_reward, self.nb_time_step, self.max_ts)


@dataclass(frozen=True)
class RunFinished:
    """A run ended; ``results`` in request order (episodes not played are absent)."""

    run_id: str
    results: tuple[EpisodeResult, ...] = field(repr=False)


Event = RunStarted | EpisodeStarted | StepBatch | EpisodeFinished | EpisodeFailed | RunFinished
