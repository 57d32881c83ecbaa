"""``CompactEpisodeWriter``: saves episodes in grid2op's ``CompactEpisodeData`` format."""

from __future__ import annotations

import errno
import os
from typing import Any

import numpy as np

from .._model import EpisodeFinished, EpisodeStarted
from .._plan._layout import sync
from ._buffer import EpisodeBuffer
from ._npz import Padded, npz_bytes
from ._writer import Writer, json_bytes

__all__ = ["CompactEpisodeWriter", "compact_files"]

# grid2op's CompactEpisodeData keeps its files in this sub-folder of ``path_save``.
COMPACT_FOLDER = "CompactEpisodeData"
_NO_LIMIT = int(np.iinfo(np.int32).max)  # env.max_episode_duration() of an endless episode
# os.link errors meaning "this file system has no hard links".
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}


class CompactEpisodeWriter(Writer):
    """Saves each finished episode as grid2op's ``CompactEpisodeData`` in ``path``.

    What ``grid2op.Runner.Runner(..., use_compact_episode_data=True).run(path_save=path)`` writes:
    ``path/CompactEpisodeData/`` with the four ``dict_*_space.json`` (kept if already there) and,
    per episode, ``<name>_metadata.json`` and ``<name>.npz``; it loads with
    ``CompactEpisodeData.from_disk(path, name)`` and is listed by
    ``CompactEpisodeData.list_episode(Path(path, "CompactEpisodeData"))``. (The metadata's
    ``game_over_timestep`` is the episode's maximum length, as grid2op records it, the
    chronic's with ``max_iter=-1`` (``compact_duration``); ``nb_timestep_played`` is the steps
    played.)

    Both files are written in a hidden temporary folder, flushed to the disk and moved into
    place, the ``.npz`` last, so an episode is listed only once complete. Nothing is
    overwritten: ``<name>`` is the chronic's name unless taken (by an earlier run or the same
    chronic played earlier in this run), then ``<name>_<k>`` with the smallest free ``k >= 1``.
    On a ``MultiMixEnvironment`` each mix's go to ``path/<mix>/CompactEpisodeData/`` (as
    ``Runner(**mix.get_params_for_runner(), ...).run(path_save=path/<mix>)`` saves them), read
    with ``CompactEpisodeData.from_disk(path/<mix>, name)``.

    ``paths`` maps each saved episode's request index to its ``.npz`` file. The files are built
    (and, on this machine, written) by the worker that played the episode
    (``EpisodeFinished.files``).
    """

    episode_format = "compact"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.folder = self._folder(None)

    def _folder(self, mix: str | None) -> str:
        return os.path.join(super()._folder(mix), COMPACT_FOLDER)

    def _place(self, started: EpisodeStarted, folder: str) -> str:
        meta, npz = (os.path.join(folder, name) for name in ("metadata.json", "episode.npz"))
        target = self._move_into_place(meta, npz, started.name, started.mix)
        sync([os.path.dirname(target)])  # the renames
        return target

    def _move_into_place(
        self, tmp_meta: str, tmp_npz: str, name: str, mix: str | None = None
    ) -> str:
        into = self._folder(mix)
        os.makedirs(into, exist_ok=True)
        names = self._names(name, ending="_metadata.json", mix=mix)  # endless
        while True:
            candidate = next(names)
            meta_path = os.path.join(into, f"{candidate}_metadata.json")
            npz_path = os.path.join(into, f"{candidate}.npz")
            if os.path.lexists(npz_path):
                continue
            if not _move_unless_taken(tmp_meta, meta_path):
                continue
            # the .npz last: it makes the episode visible
            if not _move_unless_taken(tmp_npz, npz_path):
                os.unlink(meta_path)
                continue
            return npz_path


def compact_duration(started: EpisodeStarted) -> int:
    """The episode's maximum length, as grid2op's CompactEpisodeData records it
    (``env.max_episode_duration()``). After a reset with ``"max step": -1`` (``max_iter=-1``)
    that is -1, with which grid2op's Runner fails (numpy's "negative dimensions are not
    allowed") and which ``len()`` of the episode read back refused: the chronic's length, as
    the EpisodeData format's meta has it (an endless chronic's: no limit, as
    ``max_episode_duration()`` says without ``max_iter``)."""
    duration = int(started.max_episode_duration)
    if duration < 0:
        return started.max_ts if started.max_ts > 0 else _NO_LIMIT
    return duration


def compact_capacity(started: EpisodeStarted) -> int:
    """Rows grid2op's CompactEpisodeData preallocates: the episode's maximum length, if any."""
    duration = compact_duration(started)
    return duration if 0 < duration < _NO_LIMIT else 0


def compact_files(
    buffer: EpisodeBuffer, finished: EpisodeFinished, agent: str | None, env: str | None
) -> dict[str, bytes]:
    """A CompactEpisodeData's ``metadata.json`` and ``episode.npz`` (``agent`` and ``env`` are
    not recorded in this format)."""
    meta, data = compact_content(buffer, finished)
    return {"metadata.json": json_bytes(meta), "episode.npz": npz_bytes(**data)}


def compact_content(
    buffer: EpisodeBuffer, finished: EpisodeFinished
) -> tuple[dict[str, Any], dict[str, Padded]]:
    """A CompactEpisodeData's metadata and arrays, as grid2op's Runner makes them."""
    started = buffer.started
    arrays = buffer.padded(compact_capacity(started))
    names = list(started.other_reward_names)
    order = sorted(range(len(names)), key=names.__getitem__)
    duration = compact_duration(started)
    meta = {
        "chronics_path": started.name,
        "chronics_max_timestep": duration,
        "game_over_timestep": duration,
        "other_reward_names": [names[i] for i in order],
        "grid_path": started.meta["grid_path"],
        "backend_type": started.meta["backend_type"],
        "env_type": started.meta["env_type"],
        "env_seed": None if started.env_seed is None else int(started.env_seed),
        "agent_seed": started.action_space_seed,
        "nb_timestep_played": int(finished.nb_time_step),
        "cumulative_reward": finished.cum_reward64,
    }
    data = {
        "actions": arrays["actions"].map(lambda a: a.astype(np.float16)),
        "env_actions": arrays["env_actions"],
        "attacks": arrays["attacks"],
        "observations": arrays["observations"],
        "rewards": arrays["rewards"],
        "other_rewards": arrays["other_rewards"].map(lambda a: a[:, order].astype(np.float32)),
        "disc_lines": arrays["disc_lines"],
        "times": arrays["times"],
        "legal": arrays["legal"],
        "ambiguous": arrays["ambiguous"],
    }
    return meta, data


def _move_unless_taken(tmp: str, target: str) -> bool:
    """Move ``tmp`` to ``target`` unless ``target`` exists (never replacing it)."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        return False
    except OSError as exc:  # no hard links on this file system
        if exc.errno not in _NO_LINKS:
            raise
        if os.path.lexists(target):
            return False
        os.replace(tmp, target)
        return True
    os.unlink(tmp)
    return True
