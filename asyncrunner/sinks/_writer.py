"""What both episode writers share: the files the workers built, written under hidden names that
a later run can clean up (by the workers themselves when they run on this machine, else off the
event loop), each episode moved into place atomically."""

from __future__ import annotations

import abc
import atexit
import contextlib
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from .._model import (
    EpisodeFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    RunStarted,
    Staged,
)
from .._plan._layout import (
    SPACE_FILES,
    suffixed,
    sync,
)
from ._base import Sink

__all__ = ["TMP_PREFIX", "Writer", "json_bytes", "stage_files", "write_file", "write_files"]

# Work in progress lives under hidden names that grid2op never lists; the name holds the owner
# (this machine, this process) so that a later run can remove what a killed one left.
TMP_PREFIX = ".asyncrunner-tmp-"
_HOST = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
_TMP_OWNER = re.compile(rf"^{re.escape(TMP_PREFIX)}([0-9a-f]{{8}})-([0-9]+)-")
# This process's work in progress, by path: a dead run's folder may carry our pid (pid reuse).
_LIVE: set[str] = set()
_LIVE_LOCK = threading.Lock()


def _forget_live() -> None:
    """In a forked process: the work in progress is its parent's, not its own."""
    global _LIVE_LOCK
    _LIVE.clear()
    _LIVE_LOCK = threading.Lock()  # (held, maybe, by a thread that is not in this process)


os.register_at_fork(after_in_child=_forget_live)


@atexit.register
def _remove_live() -> None:
    """At this process's exit, the work in progress of runs still open: an event loop stopped
    with a run going (Jupyter's ``quit()``, a loop that never cancels its tasks) ran no cleanup."""
    with _LIVE_LOCK:
        paths = list(_LIVE)
        _LIVE.clear()
    for path in paths:
        with contextlib.suppress(OSError):  # (a disk gone read-only: the next run removes it)
            _delete(path)


def _delete(path: str) -> None:
    """Remove the folder or file ``path``, if it is there. A folder is renamed first: a worker
    of a cancelled run still writing in a stage cannot add to it any more (its next file fails,
    and it sends the bytes instead), nor a writer's thread still running place it."""
    if os.path.isdir(path) and not os.path.islink(path):
        aside = f"{path}-removed"  # still a temporary name of this process's
        try:
            os.rename(path, aside)
        except OSError:
            aside = path
        shutil.rmtree(aside, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            # Not there (never made: a read-only disk says so, not "no such file"), or removed.
            if os.path.lexists(path):
                raise


class Writer(Sink):
    """What both episode writers share: an episode's files placed off the loop, atomically.

    The files come built with ``EpisodeFinished.files`` (under ``episode_format``): the workers
    build them from the steps they play, so the steps themselves are not needed here. Workers on
    this machine also write them, in this writer's ``stage``, and send only where (``Staged``):
    this sink then only moves them into place.

    On a ``MultiMixEnvironment`` (``RunStarted.mixes``) each mix's episodes go to a folder of
    its own, ``path/<mix>`` (``_folder``), with the space files: grid2op's layout, as its users
    save a multimix env with one Runner per mix, and ``path_save``'s. Work in progress stays in
    ``path`` itself.
    """

    needs_steps = False

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not os.fspath(path):  # (an unset shell variable: it saved into the current folder)
            raise ValueError(
                f'{type(self).__name__}("") is an empty path: give a folder to save episodes in '
                '(".": here)'
            )
        path = os.path.abspath(os.fspath(path))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"cannot save episodes in {path!r}: it exists and is not a folder")
        self.path = path
        self.agent: str | None = None  # the run's agent, recorded with each episode
        self._space_files: Mapping[str, bytes] = {}  # the run's, written beside its episodes
        self.paths: dict[int, str] = {}
        self._open: dict[tuple[str, int], EpisodeStarted] = {}  # episode attempts playing
        self._reserved: set[tuple[str | None, str]] = set()  # (mix, name) given
        # per mix and chronic, the suffix its next name starts from
        self._next_k: dict[tuple[str | None, str], int] = {}
        self._tmp: set[str] = set()
        self._spared: set[str] = set()  # work in progress never removed (``spare``)
        self._stage: str | None = None
        self._closes = 0  # aclose calls: a stage made across one is removed (``stage``)
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # (errors name the sink: its folder, not its address)
        return f"{type(self).__name__}({self.path!r})"

    # --- to implement -----------------------------------------------------------------------

    @abc.abstractmethod
    def _place(self, started: EpisodeStarted, folder: str) -> str:
        """Move the episode's files, flushed to the disk in ``folder``, into place (in
        ``_folder(started.mix)``, in a thread); returns where it is saved."""

    def _folder(self, mix: str | None) -> str:
        """Where the episodes of ``mix`` and their space files go: ``path``, or ``path/<mix>``
        for a mix of a ``MultiMixEnvironment``."""
        return self.path if mix is None else os.path.join(self.path, mix)

    @property
    def saved(self) -> Mapping[int, str]:
        return self.paths

    # --- events -----------------------------------------------------------------------------

    async def send(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.paths = {}
            self.agent = event.agent
            self._space_files = event.space_files
            await anyio.to_thread.run_sync(self._start, event.space_files, event.mixes)
        elif isinstance(event, EpisodeStarted):
            self._open[(event.run_id, event.index)] = event
        elif isinstance(event, EpisodeFinished | EpisodeFailed):
            key = (event.run_id, event.index)
            started = self._open.get(key)
            if started is None or started.attempt != event.attempt:
                return
            del self._open[key]
            if isinstance(event, EpisodeFailed):
                return
            files = event.files.get(str(self.episode_format))
            if files is None:
                raise RuntimeError(
                    f"{type(self).__name__}: episode {event.index} came without its "
                    f"{self.episode_format!r} files, which the workers of an AsyncRunner build "
                    "for the writers among a run's sinks: pass it to AsyncRunner(sinks=...) or "
                    "run(sinks=...)"
                )
            self.paths[event.index] = await anyio.to_thread.run_sync(
                self._write_episode, started, files
            )

    def stage(self) -> str:
        """A hidden folder in this writer's, where a run's workers on this machine write each
        episode's files (``stage_files``). Made before the run's first episode (in a thread:
        ``stager``), removed by ``aclose`` with whatever is left in it."""
        return self._stage_unless_closed_since(self._closes)

    def stager(self) -> Callable[[], str]:
        """``stage`` for a thread, as of now: if the writer closes meanwhile (a run cancelled as
        it starts closes its sinks while the thread waits to run), it makes no stage."""
        return functools.partial(self._stage_unless_closed_since, self._closes)

    def _stage_unless_closed_since(self, closes: int) -> str:
        with self._lock:
            if self._closes != closes:
                raise OSError(f"{self.path}: the writer closed before its stage was made")
            if self._stage is not None:
                return self._stage
        stage = self._new_tmp(self.path)
        os.makedirs(stage)
        with self._lock:
            if self._closes == closes:
                self._stage = stage
                return stage
        # Closed meanwhile: its leftovers may have been taken before the folder was made.
        self._remove([stage])
        raise OSError(f"{self.path}: the writer closed while its stage was made")

    async def aclose(self) -> None:
        """Forget unfinished episodes and remove any work-in-progress left on disk."""
        self._open.clear()
        with self._lock:
            self._closes += 1
            self._stage = None
            leftovers = sorted(self._tmp)
        if leftovers:
            await anyio.to_thread.run_sync(self._remove, leftovers)

    # --- file helpers (run in a worker thread) ----------------------------------------------

    def folders(self, mixes: Sequence[str]) -> list[str]:
        """Where a run on an env of ``mixes`` (none: not a multimix env) saves its episodes."""
        return [self._folder(mix) for mix in mixes] or [self._folder(None)]

    def _start(self, space_files: Mapping[str, bytes], mixes: Sequence[str]) -> None:
        folders = self.folders(mixes)
        # (in the mixes' and the episodes' folders too: where older versions worked)
        self._remove_stale(dict.fromkeys([self.path, self._folder(None), *folders]))
        if space_files:
            for folder in folders:
                self._write_json_once(folder, space_files, SPACE_FILES)

    def _write_episode(self, started: EpisodeStarted, files: Mapping[str, bytes] | Staged) -> str:
        if self._space_files:
            # Again, as grid2op's Runner writes them with each episode: the folder may have been
            # removed mid-run (a cleanup job), and its episodes read back only with them.
            self._write_json_once(self._folder(started.mix), self._space_files, SPACE_FILES)
        if isinstance(files, Staged):
            tmp = folder = files.folder
        else:
            os.makedirs(self.path, exist_ok=True)
            tmp = self._new_tmp(self.path)
            os.mkdir(tmp)
            # Nested one level down: a complete temporary folder is never a child of ``path``.
            folder = os.path.join(tmp, "episode")
            write_files(folder, files)
        try:
            return self._place(started, folder)
        finally:
            self._remove([tmp])

    def _remove_stale(self, folders: Iterable[str]) -> None:
        """Remove the work in progress of runs whose process is gone (killed mid-write) in
        ``folders``."""
        stale = []
        for folder, entry in _entries(folders):
            owner = _TMP_OWNER.match(entry)
            if owner is None or owner.group(1) != _HOST:
                continue  # an older version's, or another machine's (a shared folder)
            path = os.path.join(folder, entry)
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

    def _spare(self, path: str) -> None:
        """Never remove ``path``, work in progress that holds what could not be put back (the
        user's files...)."""
        with self._lock:
            self._spared.add(path)
            self._tmp.discard(path)
        with _LIVE_LOCK:
            _LIVE.discard(path)

    def _remove(self, paths: Sequence[str]) -> None:
        for p in paths:
            if any(kept == p or kept.startswith(p + os.sep) for kept in self._spared):
                continue
            _delete(p)
            with self._lock:
                self._tmp.discard(p)
            with _LIVE_LOCK:
                _LIVE.discard(p)

    def _names(self, name: str, ending: str = "", mix: str | None = None) -> Iterator[str]:
        """``name``, ``name_1``, ``name_2``, ...: the names not reserved yet by this writer in the
        folder of ``mix``, each reserved as it is given (the caller skips one taken on the disk
        and asks for the next).

        Each chronic's search starts after the last name given for it: the k-th episode of a
        chronic tries one or two names, not k (300 episodes of two chronics probed about 75 names
        each). A name the file system would find too long with its suffix and the ``ending`` of
        the files named after it is cut short before the suffix (``suffixed``): its chronic is in
        its meta.
        """
        folder = self._folder(mix)
        while True:
            with self._lock:
                k = self._next_k.get((mix, name), 0)
                self._next_k[(mix, name)] = k + 1
                candidate = suffixed(folder, name, "" if k == 0 else f"_{k}", ending)
                if (mix, candidate) in self._reserved:  # another chronic's (a chronic "000_1")
                    continue
                self._reserved.add((mix, candidate))
            yield candidate

    def _write_json_once(
        self, folder: str, files: Mapping[str, bytes], names: Sequence[str]
    ) -> None:
        """Write the space files missing in ``folder`` (existing ones are kept, as grid2op does):
        all flushed at once, then each renamed into place."""
        os.makedirs(folder, exist_ok=True)
        missing = [n for n in names if n in files and not os.path.exists(os.path.join(folder, n))]
        if not missing:
            return
        tmps = [self._new_tmp(folder, ".part") for _ in missing]
        try:
            for tmp, name in zip(tmps, missing, strict=True):
                write_file(tmp, files[name])
            sync(tmps)
            for tmp, name in zip(tmps, missing, strict=True):
                target = os.path.join(folder, name)
                if not os.path.exists(target):
                    os.replace(tmp, target)
            sync([folder])
        finally:
            self._remove(tmps)


def json_bytes(obj: Any) -> bytes:
    """``obj`` as grid2op writes its json files."""
    return json.dumps(_plain(obj), indent=4, sort_keys=True).encode("utf-8")


def write_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` (``sync`` flushes it to the disk)."""
    with open(path, "wb") as f:
        f.write(data)


def write_files(folder: str, files: Mapping[str, bytes]) -> None:
    """Make ``folder`` with ``files`` in it, flushed to the disk: contents and names."""
    os.mkdir(folder)
    paths = [os.path.join(folder, name) for name in files]
    for path, data in zip(paths, files.values(), strict=True):
        write_file(path, data)
    sync([*paths, folder])


def stage_files(stage: str, files: Mapping[str, bytes]) -> Staged:
    """Write an episode's ``files`` in a new folder of ``stage`` (``Writer.stage``), in the
    worker that built them: their bytes then never cross to the orchestrator, which only moves
    them into place (the stage is removed with what is left in it when the run ends)."""
    folder = os.path.join(stage, secrets.token_hex(8))
    write_files(folder, files)
    return Staged(folder)


def _entries(folders: Iterable[str]) -> Iterator[tuple[str, str]]:
    """Each entry of each of ``folders`` that exists, as ``(folder, name)``."""
    for folder in folders:
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            yield folder, name


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
