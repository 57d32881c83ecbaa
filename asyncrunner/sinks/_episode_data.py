"""``EpisodeDataWriter``: saves episodes in grid2op's ``EpisodeData`` folder layout, atomically.

Also the on-disk side of ``resume``: which requested episodes are already complete in a folder.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np

from .._events import EpisodeFailed, EpisodeFinished, EpisodeStarted, Event, RunStarted, StepBatch
from .._results import EpisodeResult
from ._base import Sink
from ._npz import save_npz

if TYPE_CHECKING:
    from .._plan import EpisodeRequest

__all__ = ["EpisodeDataWriter"]

# The run-level files grid2op writes once at the top of ``path_save`` (keys of RunStarted.spaces).
SPACE_FILES = (
    "dict_action_space.json",
    "dict_observation_space.json",
    "dict_env_modification_space.json",
    "dict_attack_space.json",
)
# Files grid2op's EpisodeData.list_episode requires in an episode folder (EpisodeData.ATTR_EPISODE).
EPISODE_FILES = (
    "_parameters.json",
    "episode_meta.json",
    "episode_times.json",
    "other_rewards.json",
    "agent_exec_times.npz",
    "actions.npz",
    "env_modifications.npz",
    "observations.npz",
    "disc_lines_cascading_failure.npz",
    "opponent_attack.npz",
    "rewards.npz",
)
# Ours: what was requested, so that ``resume`` recognises the episode.
RECORD_FILE = "asyncrunner.json"
RECORD_FORMAT = 1
# Work in progress lives under hidden names that grid2op never lists.
TMP_PREFIX = ".asyncrunner-tmp-"
# Rows added at a time when an episode's length is unknown (max_ts <= 0).
_GROW_ROWS = 64
# rename() errors meaning "that name is taken": try the next one.
_TAKEN = {errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR}


class _EpisodeBuffer:
    """One attempt of one episode, in arrays shaped as grid2op's Runner allocates them.

    With ``capacity > 0`` the arrays hold ``capacity`` rows (observations one more) padded as
    grid2op pads them (NaN; ``True`` for disconnected lines; ``0`` for attacks); otherwise they
    grow and are cut to the steps played.
    """

    def __init__(self, started: EpisodeStarted, capacity: int) -> None:
        self.started = started
        self.attempt = started.attempt
        self.fixed = capacity > 0
        self.capacity = capacity if capacity > 0 else 0
        self.n = 0
        self.cum_reward64 = 0.0  # as CompactEpisodeData sums: float(reward) in float64
        first = np.asarray(started.observation, dtype=np.float32)
        self.observations = np.full((self.capacity + 1, first.shape[0]), np.nan, dtype=np.float32)
        self.observations[0] = first
        self.rewards = np.full(self.capacity, np.nan, dtype=np.float32)
        self.times = np.full(self.capacity, np.nan, dtype=np.float32)
        self.legal = np.full(self.capacity, True, dtype=np.bool_)
        self.ambiguous = np.full(self.capacity, False, dtype=np.bool_)
        # Their widths come with the first batch.
        self.actions: np.ndarray | None = None
        self.env_actions: np.ndarray | None = None
        self.disc_lines: np.ndarray | None = None
        self.attacks: np.ndarray | None = None
        self.other_rewards: np.ndarray | None = None

    _PAD: Mapping[str, tuple[Any, Any]] = {
        "actions": (np.nan, np.float32),
        "env_actions": (np.nan, np.float32),
        "disc_lines": (True, np.bool_),
        "attacks": (0.0, np.float32),
        "other_rewards": (np.nan, np.float64),
    }

    def _wide(self, name: str, width: int, rows: int) -> np.ndarray:
        fill, dtype = self._PAD[name]
        return np.full((rows, width), fill, dtype=dtype)

    def _reserve(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        new = max(rows, 2 * self.capacity, _GROW_ROWS)

        def grown(arr: np.ndarray, fill: Any, extra: int = 0) -> np.ndarray:
            out = np.full((new + extra, *arr.shape[1:]), fill, dtype=arr.dtype)
            out[: arr.shape[0]] = arr
            return out

        self.observations = grown(self.observations, np.nan, 1)
        self.rewards = grown(self.rewards, np.nan)
        self.times = grown(self.times, np.nan)
        self.legal = grown(self.legal, True)
        self.ambiguous = grown(self.ambiguous, False)
        for name, (fill, _) in self._PAD.items():
            arr = getattr(self, name)
            if arr is not None:
                setattr(self, name, grown(arr, fill))
        self.capacity = new

    def add(self, batch: StepBatch) -> None:
        k = len(batch)
        lo = batch.first_step - 1
        hi = lo + k
        self._reserve(hi)
        if self.actions is None:
            rows = self.capacity
            self.actions = self._wide("actions", batch.actions.shape[1], rows)
            self.env_actions = self._wide("env_actions", batch.env_actions.shape[1], rows)
            self.disc_lines = self._wide("disc_lines", batch.disc_lines.shape[1], rows)
            self.attacks = self._wide("attacks", batch.attacks.shape[1], rows)
            self.other_rewards = self._wide("other_rewards", batch.other_rewards.shape[1], rows)
        assert self.env_actions is not None and self.disc_lines is not None
        assert self.attacks is not None and self.other_rewards is not None
        self.actions[lo:hi] = batch.actions
        self.env_actions[lo:hi] = batch.env_actions
        self.observations[lo + 1 : hi + 1] = batch.observations
        self.rewards[lo:hi] = batch.rewards
        self.times[lo:hi] = batch.agent_times
        self.disc_lines[lo:hi] = batch.disc_lines
        self.attacks[lo:hi] = batch.attacks
        self.legal[lo:hi] = batch.legal
        self.ambiguous[lo:hi] = batch.ambiguous
        self.other_rewards[lo:hi] = batch.other_rewards
        for reward in batch.rewards.tolist():
            self.cum_reward64 += float(reward)
        self.n = max(self.n, hi)

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays to save: preallocated ones whole, grown ones cut to the steps played."""
        if self.actions is None:  # no step arrived (grid2op always plays at least one)
            self._reserve(1)
            for name in self._PAD:
                setattr(self, name, self._wide(name, 0, self.capacity))
        rows = self.capacity if self.fixed else self.n
        out = {
            "observations": self.observations[: rows + 1],
            "rewards": self.rewards[:rows],
            "times": self.times[:rows],
            "legal": self.legal[:rows],
            "ambiguous": self.ambiguous[:rows],
        }
        for name in self._PAD:
            out[name] = getattr(self, name)[:rows]
        return out


class BufferingSink(Sink):
    """Keeps each episode attempt's steps in an ``_EpisodeBuffer``; hands finished ones on.

    A retried episode's new attempt replaces the old one's buffer; a failed one is dropped.
    """

    needs_steps = True

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], _EpisodeBuffer] = {}

    def _capacity(self, started: EpisodeStarted) -> int:
        return started.max_ts  # grid2op preallocates chronics_handler.max_timestep() rows

    async def _finished(self, buffer: _EpisodeBuffer, finished: EpisodeFinished) -> None:
        raise NotImplementedError

    async def send(self, event: Event) -> None:
        if isinstance(event, StepBatch):
            buffer = self._open.get((event.run_id, event.index))
            if buffer is not None and buffer.attempt == event.attempt:
                buffer.add(event)
        elif isinstance(event, EpisodeStarted):
            self._open[(event.run_id, event.index)] = _EpisodeBuffer(event, self._capacity(event))
        elif isinstance(event, EpisodeFinished | EpisodeFailed):
            key = (event.run_id, event.index)
            buffer = self._open.get(key)
            if buffer is None or buffer.attempt != event.attempt:
                return
            del self._open[key]  # its memory goes once handed on
            if isinstance(event, EpisodeFinished):
                await self._finished(buffer, event)

    async def aclose(self) -> None:
        self._open.clear()


class _Writer(BufferingSink):
    """What both episode writers share: buffering per episode attempt, writing off the loop."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.path.abspath(os.fspath(path))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"cannot save episodes in {path!r}: it exists and is not a folder")
        super().__init__()
        self.path = path
        self.paths: dict[int, str] = {}
        self._reserved: set[str] = set()
        self._tmp: set[str] = set()
        self._lock = threading.Lock()

    # --- to implement -----------------------------------------------------------------------

    def _write_spaces(self, spaces: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _write_episode(self, buffer: _EpisodeBuffer, finished: EpisodeFinished) -> str:
        raise NotImplementedError

    # --- events -----------------------------------------------------------------------------

    async def _finished(self, buffer: _EpisodeBuffer, finished: EpisodeFinished) -> None:
        self.paths[finished.index] = await anyio.to_thread.run_sync(
            self._write_episode, buffer, finished
        )

    async def send(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.paths = {}
            if event.spaces:
                await anyio.to_thread.run_sync(self._write_spaces, event.spaces)
        else:
            await super().send(event)

    async def aclose(self) -> None:
        """Drop unfinished episodes and remove any work-in-progress left on disk."""
        await super().aclose()
        with self._lock:
            leftovers = sorted(self._tmp)
        if leftovers:
            await anyio.to_thread.run_sync(self._remove, leftovers)

    # --- file helpers (run in a worker thread) ----------------------------------------------

    def _new_tmp(self, folder: str, suffix: str = "") -> str:
        tmp = os.path.join(folder, f"{TMP_PREFIX}{secrets.token_hex(6)}{suffix}")
        with self._lock:
            self._tmp.add(tmp)
        return tmp

    def _remove(self, paths: Sequence[str]) -> None:
        for p in paths:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            with self._lock:
                self._tmp.discard(p)

    def _reserve_name(self, name: str) -> bool:
        with self._lock:
            if name in self._reserved:
                return False
            self._reserved.add(name)
            return True

    def _write_json_once(
        self, folder: str, spaces: Mapping[str, Any], names: Sequence[str]
    ) -> None:
        """Write the space files missing in ``folder`` (existing ones are kept, as grid2op does)."""
        os.makedirs(folder, exist_ok=True)
        for name in names:
            if name not in spaces:
                continue
            target = os.path.join(folder, name)
            if os.path.exists(target):
                continue
            tmp = self._new_tmp(folder, ".part")
            try:
                _dump_json(tmp, spaces[name])
                if not os.path.exists(target):
                    os.replace(tmp, target)
            finally:
                self._remove([tmp])


class EpisodeDataWriter(_Writer):
    """Saves each finished episode as grid2op's ``EpisodeData`` folder in ``path``.

    The result loads with ``grid2op.Episode.EpisodeData.list_episode`` / ``from_disk`` (so with
    grid2op's replay tools and grid2viz) and matches what grid2op's ``Runner.run(path_save=...)``
    writes: the four ``dict_*_space.json`` at the top (kept if already there), and per episode
    ``_parameters.json``, ``episode_meta.json``, ``episode_times.json``, ``other_rewards.json``,
    ``grid2op.info`` and the ``.npz`` arrays with grid2op's shapes, dtypes and padding. Two more
    files: ``legal_ambiguous.npz`` (read by ``EpisodeData.from_disk``, which then exposes
    ``legal`` / ``ambiguous``) and ``asyncrunner.json`` (what was requested, for ``resume``).

    Folders appear complete or not at all: an episode is written in a hidden temporary folder and
    renamed into place; a failed or cancelled episode leaves nothing that grid2op lists.

    Nothing is overwritten: an episode goes to the folder named after its chronic (as grid2op
    does) unless that name is taken, by an earlier run in ``path`` or by the same chronic played
    earlier in this run; it then goes to ``<name>_<k>`` with the smallest free ``k >= 1``.

    ``paths`` maps each saved episode's request index to its folder.
    """

    def _write_spaces(self, spaces: Mapping[str, Any]) -> None:
        self._write_json_once(self.path, spaces, SPACE_FILES)

    def _write_episode(self, buffer: _EpisodeBuffer, finished: EpisodeFinished) -> str:
        os.makedirs(self.path, exist_ok=True)
        parent = self._new_tmp(self.path)
        try:
            os.mkdir(parent)
            # Nested one level down: a complete temporary folder is never a child of ``path``.
            folder = os.path.join(parent, "episode")
            os.mkdir(folder)
            self._write_files(folder, buffer, finished)
            return self._move_into_place(folder, buffer.started.name)
        finally:
            self._remove([parent])

    def _write_files(self, folder: str, buffer: _EpisodeBuffer, finished: EpisodeFinished) -> None:
        from grid2op.Space import GRID2OP_CURRENT_VERSION_STR

        started = buffer.started
        arrays = buffer.arrays()
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
        played = arrays["other_rewards"][: buffer.n].tolist()
        other_rewards = [dict(zip(names, row, strict=True)) for row in played]
        record = {
            "format": RECORD_FORMAT,
            "episode_id": started.episode_id,
            "name": started.name,
            "env_seed": started.env_seed,
            "agent_seed": started.agent_seed,
            "max_iter": started.max_iter,
            "nb_highres_sim": int(finished.nb_highres_sim),
            "run_id": started.run_id,
            "index": started.index,
        }
        join = os.path.join
        _dump_json(join(folder, "_parameters.json"), dict(started.parameters))
        _dump_json(join(folder, "episode_meta.json"), meta)
        _dump_json(join(folder, "episode_times.json"), finished.times)
        _dump_json(join(folder, "other_rewards.json"), other_rewards)
        save_npz(join(folder, "agent_exec_times.npz"), data=arrays["times"])
        save_npz(join(folder, "actions.npz"), data=arrays["actions"])
        save_npz(join(folder, "env_modifications.npz"), data=arrays["env_actions"])
        save_npz(join(folder, "observations.npz"), data=arrays["observations"])
        save_npz(join(folder, "opponent_attack.npz"), data=arrays["attacks"])
        save_npz(join(folder, "disc_lines_cascading_failure.npz"), data=arrays["disc_lines"])
        save_npz(join(folder, "rewards.npz"), data=arrays["rewards"])
        legal_ambiguous = np.stack((arrays["legal"], arrays["ambiguous"]), axis=1)
        save_npz(join(folder, "legal_ambiguous.npz"), data=legal_ambiguous)
        _dump_json(join(folder, "grid2op.info"), {"version": f"{GRID2OP_CURRENT_VERSION_STR}"})
        _dump_json(join(folder, RECORD_FILE), record)

    def _move_into_place(self, folder: str, name: str) -> str:
        k = 0
        while True:
            candidate = name if k == 0 else f"{name}_{k}"
            k += 1
            target = os.path.join(self.path, candidate)
            if not self._reserve_name(candidate) or os.path.lexists(target):
                continue
            try:
                os.rename(folder, target)  # fails when target is a file or a non-empty folder
            except OSError as exc:
                if exc.errno in _TAKEN:
                    continue
                raise
            return target


def _dump_json(path: str, obj: Any) -> None:
    # as grid2op writes its json files
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj=_plain(obj), fp=f, indent=4, sort_keys=True)


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


# --- resume -----------------------------------------------------------------------------------


def _episode_key(episode_id: Any, name: str | None, names: list[str] | None) -> Any:
    if names is None:
        return episode_id
    if isinstance(episode_id, str):
        return episode_id
    if name is not None:
        return name
    return names[int(episode_id)]


def completed_episodes(path: str | os.PathLike[str]) -> list[tuple[str, dict[str, Any]]]:
    """Complete episode folders in ``path`` written by ``EpisodeDataWriter``, with their record."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        return []
    found = []
    for entry in sorted(os.listdir(path)):
        folder = os.path.join(path, entry)
        if entry.startswith(".") or not os.path.isfile(os.path.join(folder, RECORD_FILE)):
            continue
        if not all(os.path.exists(os.path.join(folder, f)) for f in EPISODE_FILES):
            continue
        try:
            with open(os.path.join(folder, RECORD_FILE), encoding="utf-8") as f:
                record = json.load(f)
            with open(os.path.join(folder, "episode_meta.json"), encoding="utf-8") as f:
                record["meta"] = json.load(f)
        except (OSError, ValueError):
            continue
        if record.get("format") == RECORD_FORMAT:
            found.append((folder, record))
    return found


def resume_plan(
    requests: Sequence[EpisodeRequest], path: str | os.PathLike[str], names: list[str] | None
) -> tuple[list[EpisodeRequest], list[EpisodeResult]]:
    """Split ``requests`` into those still to play and results read back from ``path``.

    A request is complete when a folder in ``path`` saved the same chronic with the same env seed,
    agent seed and ``max_iter`` (``init_states`` / ``reset_options`` are not compared). Each
    folder stands for one request at most (a chronic requested twice needs two folders).
    """
    pool: dict[Any, list[tuple[str, dict[str, Any]]]] = {}
    for folder, record in completed_episodes(path):
        key = (
            _episode_key(record.get("episode_id"), record.get("name"), names),
            record.get("env_seed"),
            record.get("agent_seed"),
            record.get("max_iter"),
        )
        pool.setdefault(key, []).append((folder, record))
    todo: list[EpisodeRequest] = []
    done: list[EpisodeResult] = []
    for request in requests:
        key = (
            _episode_key(request.episode_id, None, names),
            request.env_seed,
            request.agent_seed,
            request.max_iter,
        )
        matches = pool.get(key)
        if not matches:
            todo.append(request)
            continue
        folder, record = matches.pop(0)
        meta = record["meta"]
        done.append(
            EpisodeResult(
                index=request.index,
                chronics_path=meta.get("chronics_path"),
                name=record.get("name"),
                cum_reward=float(meta.get("cumulative_reward", 0.0)),
                nb_time_step=int(meta.get("nb_timestep_played", 0)),
                max_ts=max(int(meta.get("chronics_max_timestep", 0)), 0),
                env_seed=request.env_seed,
                agent_seed=request.agent_seed,
                path=folder,
                nb_highres_sim=int(record.get("nb_highres_sim", 0)),
            )
        )
    return todo, done
