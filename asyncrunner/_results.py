"""What ``AsyncRunner.run`` returns: one ``EpisodeResult`` per requested episode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._events import EpisodeFailed

__all__ = ["EpisodeResult"]


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

    def as_tuple(self) -> tuple[str | None, str | None, float, int, int]:
        """grid2op's ``(chronics_path, name, cum_reward, nb_time_step, max_ts)``."""
        return (self.chronics_path, self.name, self.cum_reward, self.nb_time_step, self.max_ts)
