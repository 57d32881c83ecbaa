"""What both episode writers share: buffering, work in progress under hidden names that a
later run can clean up, writing off the event loop, moving an episode into place atomically."""

from __future__ import annotations

import abc
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from .._model import (
    EpisodeFinished,
    Event,
    RunStarted,
)
from .._plan._layout import (
    sync,
)
from ._buffer import BufferingSink, EpisodeBuffer

__all__ = ["TMP_PREFIX", "Writer", "json_bytes", "write_file"]

# Work in progress lives under hidden names that grid2op never lists; the name holds the owner
# (this machine, this process) so that a later run can remove what a killed one left.
TMP_PREFIX = ".asyncrunner-tmp-"
_HOST = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
_TMP_OWNER = re.compile(rf"^{re.escape(TMP_PREFIX)}([0-9a-f]{{8}})-([0-9]+)-")
# This process's work in progress, by path: a dead run's folder may carry our pid (pid reuse).
_LIVE: set[str] = set()
_LIVE_LOCK = threading.Lock()


class Writer(BufferingSink):
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

    @abc.abstractmethod
    def _write_spaces(self, spaces: Mapping[str, Any]) -> None:
        """Write the run's space files (in a thread)."""

    @abc.abstractmethod
    def _write_episode(self, buffer: EpisodeBuffer, finished: EpisodeFinished) -> str:
        """Write one finished episode (in a thread); returns its saved folder."""

    @property
    def saved(self) -> Mapping[int, str]:
        return self.paths

    # --- events -----------------------------------------------------------------------------

    async def _finished(self, buffer: EpisodeBuffer, finished: EpisodeFinished) -> None:
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
