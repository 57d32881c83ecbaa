"""The folder layout of saved episodes, and reading it back: what ``resume`` finds complete.

``EpisodeDataWriter`` (sinks) writes this layout: grid2op's ``EpisodeData`` files, plus our record
``asyncrunner.json`` written last. ``resume_plan`` splits requests into those still to play and
the results read back from a folder.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import hashlib
import json
import os
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence

# Imported now, not on first use (``concurrent.futures`` imports it lazily): a worker forked while
# a thread of its parent was importing it would wait forever for that import at its first save.
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

if sys.platform != "win32":
    import resource

from .._model import EpisodeRequest, EpisodeResult
from .._quiet import quiet

__all__ = [
    "damage",
    "other_spaces",
    "reset_key",
    "resume_plan",
    "saved_episodes",
    "suffixed",
    "sync",
]

# The run-level files grid2op writes once at the top of ``path_save`` (keys of RunStarted.spaces).
SPACE_FILES = (
    "dict_action_space.json",
    "dict_observation_space.json",
    "dict_env_modification_space.json",
    "dict_attack_space.json",
)
# What a space file names that is not its spaces: an env of another name or backend, or a
# folder of generated classes, has the same spaces (another grid2op version: see other_spaces).
_NOT_THE_SPACES = frozenset({"env_name", "glop_version", "_PATH_GRID_CLASSES"})
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
# Ours, written last: what was requested, which agent played, and each file's size and checksum,
# so that ``resume`` recognises the episode and replays it when a file is damaged.
RECORD_FILE = "asyncrunner.json"
RECORD_FORMAT = 2
# Where ``resume`` moves a damaged episode folder (one level down: grid2op does not list it).
BROKEN_FOLDER = ".asyncrunner-broken"
# rename() errors meaning "that name is taken": try the next one.
NAME_TAKEN = {errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR}


def sync(paths: Sequence[str]) -> None:
    """Flush files, or a folder's entries (names created or renamed in it), to the disk.

    Without it a power loss after the rename that publishes an episode can leave it complete
    in name and empty in content. Each path gets an ``fsync``: it reports a write error of its
    own file, where ``syncfs`` reports the file system's errors to whichever caller asks first
    (and none before Linux 5.8). Several paths on one local disk's file system, while little
    waits to be written (``_syncfs_covers``), are first written out together by one
    ``syncfs``: the ``fsync`` calls that follow find their data on the disk (here about 0.4 ms
    of CPU per episode in all, against 2 ms for the ``fsync`` calls alone). Otherwise the
    ``fsync`` calls run at once: the file system then commits them together (here 14 in a row
    took about 8 ms each; at once, about as long as one).
    """
    if len(paths) > 1 and _syncfs_covers(paths):
        _syncfs(paths[0])
        for path in paths:
            _fsync(path)
        return
    if len(paths) == 1 or _address_space_capped():
        for path in paths:
            _fsync(path)
        return
    try:
        for _ in _fsync_pool().map(_fsync, paths):
            pass
    except RuntimeError:  # no thread could start (a container's limit on processes)
        for path in paths:
            _fsync(path)


# File systems whose ``syncfs`` writes every file's data and names, and commits them, as an
# ``fsync`` of each would (statfs magic numbers): ext2/3/4, XFS, Btrfs, F2FS. Not network or
# FUSE file systems, where ``fsync`` reaches the server and ``syncfs`` may not.
_LOCAL_DISK_FILE_SYSTEMS = {0xEF53, 0x58465342, 0x9123683E, 0xF2F52010}
# ``syncfs`` waits for everything waiting to be written on the file system, other programs'
# too: used only while the whole machine has less than this to write.
_DIRTY_MAX = 64 << 20


def _syncfs_covers(paths: Sequence[str]) -> bool:
    """Whether one ``syncfs`` writes ``paths`` out as an ``fsync`` of each would, and cheaply:
    Linux, all of them on one local disk's file system, and little data waiting to be written
    on the machine (``sync``)."""
    if _LIBC is None:
        return False
    try:
        device = os.stat(paths[0]).st_dev
        if any(os.stat(path).st_dev != device for path in paths[1:]):
            return False
    except OSError:
        return False  # the fsync of each says what is wrong
    return _file_system_type(paths[0]) in _LOCAL_DISK_FILE_SYSTEMS and _dirty_bytes() < _DIRTY_MAX


def _file_system_type(path: str) -> int | None:
    """The ``f_type`` of ``statfs(path)`` (Linux), ``None`` when it cannot be read."""
    assert _LIBC is not None
    buffer = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on 64-bit Linux
    if _LIBC.statfs(os.fsencode(path), buffer) != 0:
        return None
    # f_type comes first, a C long: its magic numbers read as unsigned 32-bit values.
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def _dirty_bytes() -> int:
    """Data waiting to be written to disks, machine-wide (``Dirty`` and ``Writeback``)."""
    total = 0
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith((b"Dirty:", b"Writeback:")):
                    total += int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        return _DIRTY_MAX
    return total


def _syncfs(path: str) -> None:
    """Write out the file system of ``path`` (``syncfs``). Its result is not checked: an error
    it reports may be another file's, and the ``fsync`` of each path that follows reports
    this caller's own."""
    assert _LIBC is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        _LIBC.syncfs(fd)
    finally:
        os.close(fd)


def _linux_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syncfs, libc.statfs  # noqa: B018  # both there (glibc >= 2.14, musl)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _linux_libc()


def _address_space_capped() -> bool:
    """Whether this process's address space is capped (``ulimit -v``, a batch system's memory
    limit): each thread takes a stack and a malloc arena of it (about 70 MiB here), and 16 of
    them made a worker that grid2op's would run in fail to start a thread."""
    if sys.platform == "win32":
        return False
    return resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY


# Threads kept from one call to the next: starting 15 threads per saved episode cost the parent
# more CPU than the fsync calls (about 3 ms against 1 ms per episode, here).
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _fsync_pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(16, thread_name_prefix="asyncrunner-sync")
        return _POOL


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK
    _POOL = None  # a forked child has none of its threads (nor their lock's owner)
    _POOL_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _fsync(path: str) -> None:
    folder = os.path.isdir(path)
    if folder and os.name == "nt":
        return  # Windows has no fsync of a folder
    fd = os.open(path, os.O_RDONLY if folder else os.O_RDWR)  # Windows flushes writable files
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reset_key(max_iter: int | None, init_state: Any, reset_options: Any) -> str | None:
    """What an episode's reset is given beyond its chronic, seeds and ``max_iter``, as one string
    (``None``: nothing), recorded with the episode for ``resume``: the reset options as grid2op's
    Runner passes them to ``env.reset`` ("time serie id" left out: the chronic is compared on its
    own; "max step" too when ``max_iter`` overrides it), the initial state in "init state"."""
    options = dict(reset_options or {})
    options.pop("time serie id", None)
    if max_iter is not None:
        options.pop("max step", None)
    if init_state is not None:
        options["init state"] = init_state
    if not options:
        return None
    return json.dumps(options, sort_keys=True, default=_json_value)


def _json_value(value: Any) -> Any:
    """What JSON cannot write, as JSON values: an action as its ``as_serializable_dict()``, an
    array as lists, a date as ISO text, anything else unknown as its ``repr``."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, datetime.date):
        return value.isoformat()
    serializable = getattr(value, "as_serializable_dict", None)
    return serializable() if callable(serializable) else repr(value)


def _episode_key(episode_id: Any, name: str | None, names: list[str] | None) -> Any:
    if names is None:
        return episode_id
    if isinstance(episode_id, str):
        return episode_id
    if name is not None:
        return name
    return names[int(episode_id)]


def saved_episodes(path: str | os.PathLike[str]) -> list[tuple[str, dict[str, Any]]]:
    """Episode folders in ``path`` with a record of this format, and their record (unverified)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        return []
    found = []
    for entry in sorted(os.listdir(path)):
        folder = os.path.join(path, entry)
        if entry.startswith(".") or not os.path.isfile(os.path.join(folder, RECORD_FILE)):
            continue
        try:
            with open(os.path.join(folder, RECORD_FILE), encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("format") == RECORD_FORMAT:
            found.append((folder, record))
    return found


def damage(folder: str, record: Mapping[str, Any]) -> str | None:
    """What is wrong with the files of a saved episode (``None``: each is as recorded)."""
    files = record.get("files")
    if not isinstance(files, dict):
        return f"{RECORD_FILE} lists no files"
    missing = [name for name in EPISODE_FILES if name not in files]
    if missing:
        return f"{RECORD_FILE} does not list {missing[0]}"
    for name, expected in sorted(files.items()):
        if os.path.basename(name) != name or not isinstance(expected, dict):
            return f"{RECORD_FILE} lists {name!r} wrongly"
        try:
            with open(os.path.join(folder, name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or exc})"
        if size != expected.get("size"):
            return f"{name} has {size} bytes where {expected.get('size')} were written"
        if digest != expected.get("sha256"):
            return f"{name} differs from what was written (sha256)"
    return None


def suffixed(folder: str, name: str, suffix: str, ending: str = "") -> str:
    """``name + suffix``, a name in ``folder`` that leaves room for ``ending`` (of the files
    named after it): ``name`` is cut short before ``suffix`` where the file system would find
    it too long (a chronic's folder name may take its 255 bytes), at a character's boundary."""
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # (no pathconf on Windows)
        limit = 255
    raw = os.fsencode(name)  # as the file system has it (a name not in UTF-8 too)
    cut = limit - len(os.fsencode(suffix + ending))
    if len(raw) > cut:
        while cut > 0 and raw[cut] & 0xC0 == 0x80:  # not within a UTF-8 character
            cut -= 1
        name = os.fsdecode(raw[:cut])
    return name + suffix


def _move_aside(path: str, folder: str) -> str | None:
    """Move a damaged episode folder into ``path/.asyncrunner-broken/``; returns where, or
    ``None`` when it is gone (another run resuming the same folder moved it first)."""
    broken = os.path.join(path, BROKEN_FOLDER)
    os.makedirs(broken, exist_ok=True)
    name = os.path.basename(folder)
    k = 0
    while True:
        target = os.path.join(broken, suffixed(broken, name, "" if k == 0 else f"_{k}"))
        k += 1
        if os.path.lexists(target):
            continue
        try:
            os.rename(folder, target)
        except OSError as exc:
            if exc.errno in NAME_TAKEN:
                continue
            if exc.errno == errno.ENOENT and not os.path.lexists(folder):
                return None
            raise
        sync([broken, path])
        return target


def resume_plan(
    requests: Sequence[EpisodeRequest],
    path: str | os.PathLike[str],
    names: list[str] | None,
    agent: str | None,
    env: str | None,
) -> tuple[list[EpisodeRequest], list[EpisodeResult]]:
    """Split ``requests`` into those still to play and results read back from ``path``.

    A request is complete when a folder in ``path`` saved the same chronic with the same agent,
    env (``env``: its ``Recipe.env_key``, everything it is made with), env seed, agent seed,
    ``max_iter`` and reset options and initial state (``reset_key``), and each of its files is
    as written (size and sha256 in its record). Each
    folder stands for one request at most (a chronic requested twice needs two folders). A
    matching folder whose files are damaged is moved into ``path/.asyncrunner-broken/`` (with a
    warning) and its episode plays again. Reads every matching file: call it off the event loop.
    """
    path = os.path.abspath(os.fspath(path))
    pool: dict[Any, list[tuple[str, dict[str, Any]]]] = {}
    for folder, record in saved_episodes(path):
        key = (
            _episode_key(record.get("episode_id"), record.get("name"), names),
            record.get("agent"),
            record.get("env"),
            record.get("env_seed"),
            record.get("agent_seed"),
            record.get("max_iter"),
            record.get("reset"),
        )
        pool.setdefault(key, []).append((folder, record))
    todo: list[EpisodeRequest] = []
    done: list[EpisodeResult] = []
    missing: list[tuple[Any, ...]] = []
    for request in requests:
        key = (
            _episode_key(request.episode_id, None, names),
            agent,
            env,
            request.env_seed,
            request.agent_seed,
            request.max_iter,
            reset_key(request.max_iter, request.init_state, request.reset_options),
        )
        found = _intact(path, pool.get(key, []))
        if found is None:
            todo.append(request)
            missing.append(key)
            continue
        folder, record, meta = found
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
    if not done:  # (some read back: the run's own folder, others' runs beside it on purpose)
        _warn_played_otherwise(path, missing, [key for key, left in pool.items() if left])
    return todo, done


# What a saved episode's key holds after its chronic, as a user names it.
_KEY_FIELDS = ("agent", "env", "env seed", "agent seed", "max_iter", "initial state or options")


def _warn_played_otherwise(path: str, missing: list[Any], unused: list[Any]) -> None:
    """Warn when episodes to play have a saved episode of their chronic left unused, played with
    other arguments (none of the run's read back): ``resume`` plays them again, and the folder
    then holds both."""
    differs: set[str] = set()
    count = 0
    for key in missing:
        others = [other for other in unused if other[0] == key[0]]
        if others:
            count += 1
            for other in others:
                differs.update(
                    f for f, a, b in zip(_KEY_FIELDS, key[1:], other[1:], strict=True) if a != b
                )
    if count:
        what = " or ".join(f for f in _KEY_FIELDS if f in differs)
        warnings.warn(
            f"resume: {count} of the episodes to play have an episode of their chronic saved in "
            f"{path}, played with another {what}: they play again, saved beside it (resume completes "
            "a run with the arguments it was started with)",
            stacklevel=2,
        )


def _intact(
    path: str, matches: list[tuple[str, dict[str, Any]]]
) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
    """Take the first intact folder of ``matches`` (with its meta), moving damaged ones aside."""
    while matches:
        folder, record = matches.pop(0)
        problem = damage(folder, record)
        if problem is None:
            with open(os.path.join(folder, "episode_meta.json"), encoding="utf-8") as f:
                return folder, record, json.load(f)
        aside = None if not os.path.isdir(folder) else _move_aside(path, folder)
        if aside is None:
            continue  # moved by another run resuming the same folder
        warnings.warn(
            f"resume: the saved episode {folder} is damaged ({problem}); it was moved to "
            f"{aside} and the episode plays again (move that folder out before opening "
            f"{path} in grid2viz, which takes every folder there for an episode)",
            stacklevel=2,
        )
    return None


def other_spaces(folder: str, space_files: Mapping[str, bytes]) -> str | None:
    """Why ``folder`` cannot take episodes of ``space_files``' spaces, or ``None``: a space file
    already there (kept, as grid2op keeps it, and read back with every episode of the folder)
    that describes other spaces (another env's grid, other classes) in the entries both have,
    or that another grid2op version wrote, whose vectors grid2op reads another way."""
    for name, ours in space_files.items():
        there = os.path.join(folder, name)
        try:
            with open(there, "rb") as f:
                theirs = json.load(f)
        except (OSError, ValueError):
            continue  # none (or one grid2op cannot read either)
        mine = json.loads(ours)
        if not isinstance(theirs, dict):
            continue
        differ = sorted(  # the elements' names first: the clearest
            (
                key
                for key in mine.keys() & theirs.keys() - _NOT_THE_SPACES
                if mine[key] != theirs[key]
            ),
            key=lambda key: (not key.startswith("name_"), key),
        )
        if differ:
            shown = ", ".join(differ[:4]) + (", ..." if len(differ) > 4 else "")
            return (
                f"{there} describes other spaces than this env's ({shown} differ): the episodes "
                f"saved in {folder} are another env's, and grid2op would read this run's with "
                "that file and fail. Save into another folder"
            )
        version = theirs.get("glop_version")
        if version != mine.get("glop_version"):
            if _later(version, mine.get("glop_version")):
                return (
                    f"{there} was written by grid2op {version}, later than this run's "
                    f"({mine.get('glop_version')}), which cannot tell how that version reads the "
                    f"episodes saved in {folder}: it may not read this run's. Save into another "
                    f"folder, or run with grid2op {version}"
                )
            try:
                read, written = _vectors(name, theirs), _vectors(name, mine)
            except Exception:  # one grid2op cannot read either
                continue
            if read != written:
                return (
                    f"{there} was written by grid2op {version}: grid2op reads every episode "
                    f"saved in {folder} as that version wrote them ({read[0]} values per "
                    f"{_VECTOR_OF[name]}), and this run's ({written[0]}, grid2op "
                    f"{mine.get('glop_version')}) would fail to load. Save into another folder, "
                    f"or run with grid2op {version}"
                )
    return None


def _later(version: Any, than: Any) -> bool:
    """Whether grid2op ``version`` is later than ``than`` (``False`` where either is no version)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(version)) > Version(str(than))
    except InvalidVersion:
        return False


# What each space file's vectors are, in grid2op's EpisodeData.
_VECTOR_OF = {
    "dict_observation_space.json": "observation",
    "dict_action_space.json": "action",
    "dict_attack_space.json": "attack",
    "dict_env_modification_space.json": "env modification",
}


def _vectors(name: str, space: dict[str, Any]) -> tuple[int, list[str]]:
    """The size and attributes of the vectors grid2op's ``EpisodeData.from_disk`` reads with
    the space file ``name`` of contents ``space``: they depend on the grid2op version that wrote
    it (its ``glop_version``; 1.12.6 added the voltage angles to the observation vector)."""
    from grid2op.Action import ActionSpace
    from grid2op.Observation import ObservationSpace

    kind = ObservationSpace if name == "dict_observation_space.json" else ActionSpace
    with quiet():  # (in a thread of the run's: not the program's filters)
        built = kind.from_dict(json.loads(json.dumps(space)))  # (a copy: it may change it)
    return built.n, list(built.subtype.attr_list_vect)
