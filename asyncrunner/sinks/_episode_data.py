"""``EpisodeDataWriter``: saves episodes in grid2op's ``EpisodeData`` folder layout, atomically.

The layout itself (file names, our record) and reading it back for ``resume`` are in
``_plan._layout``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np

from .._model import (
    EpisodeFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    RunStarted,
    StepBatch,
)
from .._plan._layout import (
    NAME_TAKEN,
    RECORD_FILE,
    RECORD_FORMAT,
    SPACE_FILES,
    sync,
)
from ._base import Sink
from ._npz import npz_bytes

if TYPE_CHECKING:
    pass

__all__ = ["EpisodeDataWriter"]

# Work in progress lives under hidden names that grid2op never lists; the name holds the owner
# (this machine, this process) so that a later run can remove what a killed one left.
TMP_PREFIX = ".asyncrunner-tmp-"
_HOST = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
_TMP_OWNER = re.compile(rf"^{re.escape(TMP_PREFIX)}([0-9a-f]{{8}})-([0-9]+)-")
# This process's work in progress, by path: a dead run's folder may carry our pid (pid reuse).
_LIVE: set[str] = set()
_LIVE_LOCK = threading.Lock()
# Rows added at a time when an episode's length is unknown (max_ts <= 0).
_GROW_ROWS = 64


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
        self.agent: str | None = None  # the run's agent, recorded with each episode
        self._work = path  # where work in progress goes
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
            self.agent = event.agent
            await anyio.to_thread.run_sync(self._start, event.spaces)
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

    def _start(self, spaces: Mapping[str, Any]) -> None:
        self._remove_stale()
        if spaces:
            self._write_spaces(spaces)

    def _remove_stale(self) -> None:
        """Remove the work in progress of runs whose process is gone (killed mid-write)."""
        try:
            entries = os.listdir(self._work)
        except (FileNotFoundError, NotADirectoryError):
            return
        stale = []
        for entry in entries:
            owner = _TMP_OWNER.match(entry)
            if owner is None or owner.group(1) != _HOST:
                continue  # an older version's, or another machine's (a shared folder)
            path = os.path.join(self._work, entry)
            pid = int(owner.group(2))
            if pid == os.getpid():
                with _LIVE_LOCK:
                    if path in _LIVE:
                        continue
            elif _alive(pid):
                continue
            stale.append(path)
        self._remove(stale)

    def _new_tmp(self, folder: str, suffix: str = "") -> str:
        name = f"{TMP_PREFIX}{_HOST}-{os.getpid()}-{secrets.token_hex(6)}{suffix}"
        tmp = os.path.join(folder, name)
        with self._lock:
            self._tmp.add(tmp)
        with _LIVE_LOCK:
            _LIVE.add(tmp)
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
            with _LIVE_LOCK:
                _LIVE.discard(p)

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
                write_file(tmp, json_bytes(spaces[name]))
                sync([tmp])
                if not os.path.exists(target):
                    os.replace(tmp, target)
                    sync([folder])
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
    ``legal`` / ``ambiguous``) and ``asyncrunner.json`` (what was requested, the agent, and
    each file's size and sha256, for ``resume``).

    Folders appear complete or not at all: an episode is written in a hidden temporary folder,
    flushed to the disk and renamed into place; a failed or cancelled episode leaves nothing that
    grid2op lists. Temporary folders left by a killed run are removed by the next one.

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
            # The files and their names on the disk before the folder appears complete.
            sync([*(os.path.join(folder, name) for name in os.listdir(folder)), folder])
            target = self._move_into_place(folder, buffer.started.name)
            sync([self.path])  # the rename
            return target
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
        files: dict[str, dict[str, Any]] = {}

        def put(name: str, data: bytes) -> None:
            files[name] = {
                "size": len(data),
                "sha256": write_file(os.path.join(folder, name), data),
            }

        put("_parameters.json", json_bytes(dict(started.parameters)))
        put("episode_meta.json", json_bytes(meta))
        put("episode_times.json", json_bytes(finished.times))
        put("other_rewards.json", json_bytes(other_rewards))
        put("agent_exec_times.npz", npz_bytes(data=arrays["times"]))
        put("actions.npz", npz_bytes(data=arrays["actions"]))
        put("env_modifications.npz", npz_bytes(data=arrays["env_actions"]))
        put("observations.npz", npz_bytes(data=arrays["observations"]))
        put("opponent_attack.npz", npz_bytes(data=arrays["attacks"]))
        put("disc_lines_cascading_failure.npz", npz_bytes(data=arrays["disc_lines"]))
        put("rewards.npz", npz_bytes(data=arrays["rewards"]))
        legal_ambiguous = np.stack((arrays["legal"], arrays["ambiguous"]), axis=1)
        put("legal_ambiguous.npz", npz_bytes(data=legal_ambiguous))
        put("grid2op.info", json_bytes({"version": f"{GRID2OP_CURRENT_VERSION_STR}"}))
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
            "agent": self.agent,
            "files": files,
        }
        write_file(os.path.join(folder, RECORD_FILE), json_bytes(record))

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
                if exc.errno in NAME_TAKEN:
                    continue
                raise
            return target


def json_bytes(obj: Any) -> bytes:
    """``obj`` as grid2op writes its json files."""
    return json.dumps(_plain(obj), indent=4, sort_keys=True).encode("utf-8")


def write_file(path: str, data: bytes) -> str:
    """Write ``data`` to ``path`` (``sync`` flushes it to the disk); returns its sha256."""
    with open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this machine)."""
    if os.name == "nt":
        return True  # os.kill(pid, 0) would interrupt it there: never remove another's work
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
