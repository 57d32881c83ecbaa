"""``EpisodeDataWriter``: saves episodes in grid2op's ``EpisodeData`` folder layout, atomically.

The layout itself (file names, our record) and reading it back for ``resume`` are in
``_plan._layout``; the atomic writing both writers share, in ``_writer``. The files' content is
built by ``episode_data_files``, in the worker that played the episode (``sinks._files``).
"""

from __future__ import annotations

import hashlib
import os

from .._model import EpisodeFinished, EpisodeStarted
from .._plan._layout import (
    NAME_TAKEN,
    RECORD_FILE,
    RECORD_FORMAT,
    sync,
)
from ._buffer import EpisodeBuffer
from ._npz import npz_bytes
from ._writer import Writer, json_bytes

__all__ = ["EpisodeDataWriter", "episode_data_files"]


class EpisodeDataWriter(Writer):
    """Saves each finished episode as grid2op's ``EpisodeData`` folder in ``path``.

    The result loads with ``grid2op.Episode.EpisodeData.list_episode`` / ``from_disk`` (so with
    grid2op's replay tools and grid2viz) and matches what grid2op's ``Runner.run(path_save=...)``
    writes: the four ``dict_*_space.json`` at the top (kept if already there), and per episode
    ``_parameters.json``, ``episode_meta.json``, ``episode_times.json``, ``other_rewards.json``,
    ``grid2op.info`` and the ``.npz`` arrays with grid2op's shapes, dtypes and padding. One more
    file: ``asyncrunner.json`` (what was requested, the agent, and each file's size and sha256,
    for ``resume``). No ``legal_ambiguous.npz``: grid2op's Runner writes none, and its
    ``EpisodeData.from_disk`` reads one where it is, so one left by an episode saved here before
    gave the legal and ambiguous flags of that episode to one grid2op's Runner saved over it.

    Folders appear complete or not at all: an episode is written in a hidden temporary folder,
    flushed to the disk and renamed into place; a failed or cancelled episode leaves nothing that
    grid2op lists. Temporary folders left by a killed run are removed by the next one.

    Nothing is overwritten: an episode goes to the folder named after its chronic (as grid2op
    does) unless that name is taken, by an earlier run in ``path`` or by the same chronic played
    earlier in this run; it then goes to ``<name>_<k>`` with the smallest free ``k >= 1``.

    On a ``MultiMixEnvironment`` each mix gets its own folder, ``path/<mix>``, as grid2op's
    users save one (one Runner per mix), with the space files and that mix's episodes: what
    ``path_save`` writes, and what ``EpisodeData.list_episode(path/<mix>)`` reads.

    ``paths`` maps each saved episode's request index to its folder. The files are built by the
    worker that played the episode (``EpisodeFinished.files``), which also writes them when it
    runs on this machine; this sink places them (and writes them, otherwise), in a thread.
    """

    episode_format = "episode_data"

    def _place(self, started: EpisodeStarted, folder: str) -> str:
        target = self._move_into_place(folder, started.name, started.mix)
        sync([os.path.dirname(target)])  # the rename
        return target

    def _move_into_place(self, folder: str, name: str, mix: str | None = None) -> str:
        into = self._folder(mix)
        os.makedirs(into, exist_ok=True)
        names = self._names(name, mix=mix)  # endless
        while True:
            candidate = next(names)
            target = os.path.join(into, candidate)
            if os.path.lexists(target):
                continue
            try:
                os.rename(folder, target)  # fails when target is a file or a non-empty folder
            except OSError as exc:
                if exc.errno in NAME_TAKEN:
                    continue
                raise
            return target


def episode_data_files(
    buffer: EpisodeBuffer, finished: EpisodeFinished, agent: str | None, env: str | None
) -> dict[str, bytes]:
    """The files of an episode's ``EpisodeData`` folder, by name, our record (``agent``: the
    run's ``RunStarted.agent``; ``env``: the env's ``Recipe.env_key``) among them."""
    from grid2op.Space import GRID2OP_CURRENT_VERSION_STR

    started = buffer.started
    arrays = buffer.padded(started.max_ts)  # grid2op preallocates chronics' max_timestep() rows
    meta = {
        "chronics_path": started.chronics_path,
        "chronics_max_timestep": started.meta["chronics_max_timestep"],
        "grid_path": started.meta["grid_path"],
        "backend_type": started.meta["backend_type"],
        "env_type": started.meta["env_type"],
        "nb_timestep_played": int(finished.nb_time_step),
        "cumulative_reward": float(finished.cum_reward),
        "env_seed": None if finished.env_seed is None else int(finished.env_seed),
        "agent_seed": None if finished.agent_seed is None else int(finished.agent_seed),
    }
    names = started.other_reward_names
    played = arrays["other_rewards"].head.tolist()
    files = {
        "_parameters.json": json_bytes(dict(started.parameters)),
        "episode_meta.json": json_bytes(meta),
        "episode_times.json": json_bytes(finished.times),
        "other_rewards.json": json_bytes([dict(zip(names, row, strict=True)) for row in played]),
        "agent_exec_times.npz": npz_bytes(data=arrays["times"]),
        "actions.npz": npz_bytes(data=arrays["actions"]),
        "env_modifications.npz": npz_bytes(data=arrays["env_actions"]),
        "observations.npz": npz_bytes(data=arrays["observations"]),
        "opponent_attack.npz": npz_bytes(data=arrays["attacks"]),
        "disc_lines_cascading_failure.npz": npz_bytes(data=arrays["disc_lines"]),
        "rewards.npz": npz_bytes(data=arrays["rewards"]),
        "grid2op.info": json_bytes({"version": f"{GRID2OP_CURRENT_VERSION_STR}"}),
    }
    record = {
        "format": RECORD_FORMAT,
        "episode_id": started.episode_id,
        "name": started.name,
        "env_seed": started.env_seed,
        "agent_seed": started.agent_seed,
        "max_iter": started.max_iter,
        "reset": started.reset,
        "nb_highres_sim": int(finished.nb_highres_sim),
        "run_id": started.run_id,
        "index": started.index,
        "agent": agent,
        "env": env,
        "files": {
            name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in files.items()
        },
    }
    files[RECORD_FILE] = json_bytes(record)
    return files
