"""A process's cache of the env files it has parsed: grid2op parses them again for every env
it builds and at every reset.

- Chronics: grid2op's chronics classes read a chronic's CSV files (``pandas.read_csv``, most of
  them bz2-compressed) at every reset: 92 % of a reset's time on ``rte_case14_opponent``, about
  130 ms, against 3 ms for the few steps an episode of a random agent lasts there. Episodes of a
  run, of the runs after it, and of a score's references and agents play the same chronics again.
- Grids: a backend reads the grid's JSON (``pandapower.from_json``) at every env build: 0.62 s
  on ``l2rpn_case14_sandbox``, 0.75 s on ``l2rpn_idf_2023``, most of a cold run's wait. A score
  builds one env per parametrisation of the same grid.

Both are also kept on disk, pickled, for the next processes (a cold run's build, a worker that
has not played a chronic yet, the next evaluation of the same env): in
``$XDG_CACHE_HOME/asyncrunner`` or ``~/.cache/asyncrunner`` (``grids``, ``chronics``), keyed like
the memory's entries and by the versions of Python, pandas, numpy and pandapower. A grid loads in
about 10 ms instead of its parse; a chronic of ``l2rpn_idf_2023``'s test data in 7 ms instead of
0.45 s (15 MB pickled). The chronics folder keeps at most ``DISK_BYTES`` (2 GiB, or
``$ASYNCRUNNER_CHRONICS_CACHE_MB`` MiB; 0 keeps none and reads none), least recently used
first out.

Within ``parsing_once()`` these functions, called with a file path and plain arguments (numbers,
strings, types), return a deep copy of what they returned for the same file (same inode, size, modification
and change times) and the same arguments: the same parse of the same bytes, in an object nothing
else holds. Any other call (a buffer, an iterator, a chunk size, other arguments) runs as usual.
At most ``MAX_BYTES`` of parsed files are kept, least recently used first out.

``ParsedAhead`` parses chronics in a forked helper process while this one builds its envs (one
core each), for workers forked after it: they then find those chronics parsed.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from .._quiet import quiet

__all__ = ["DISK_BYTES", "MAX_BYTES", "ParsedAhead", "cache_home", "parsing_once"]

MAX_BYTES = 128 * 1024 * 1024
DISK_BYTES = int(float(os.environ.get("ASYNCRUNNER_CHRONICS_CACHE_MB", 2048)) * 1024 * 1024)

_PLAIN = (str, int, float, bool, type(None), type)
_parsed: OrderedDict[tuple[Any, ...], tuple[Any, int]] = OrderedDict()
_size = 0
_lock = threading.Lock()
_users = 0  # callers inside parsing_once now (a worker may play several episodes at once)
_originals: dict[str, Callable[..., Any]] = {}
_REAL_PATHS: dict[str | bytes, str | bytes] = {}  # by the absolute path parsers were called with


def _key(name: str, path: Any, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    if not isinstance(path, (str, os.PathLike)) or not all(
        isinstance(v, _PLAIN) for v in kwargs.values()
    ):
        return None
    if kwargs.get("chunksize") is not None or kwargs.get("iterator"):
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None  # the parser raises its own error
    # The file itself, whatever path names it: ``os.path.realpath`` (the same for the next
    # processes, so it names the disk's entries too), once per absolute path in a process (40 us
    # per file: 0.35 ms of a reset's 0.6 ms of lookups). Its inode, size and times say whether
    # it changed: the change time too, which copies and ``os.utime`` cannot set back (a file
    # edited to the same size, its modification time restored, was served its old parse).
    named = os.fspath(path)  # a path object may not be hashable
    where = _REAL_PATHS.get(named)
    if where is None:
        where = os.path.realpath(named)
        if os.path.isabs(named):  # a relative one depends on the working folder
            _REAL_PATHS[named] = where
    changed = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    return (name, where, *changed, tuple(sorted(kwargs.items())))


def cache_home() -> str:
    """asyncrunner's folder in the user's cache: ``$XDG_CACHE_HOME/asyncrunner``, else
    ``~/.cache/asyncrunner`` (grids here, scores' reference statistics)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "asyncrunner")


_GRID = "pandapower.from_json"


def _disk_folder(name: str) -> str:
    """Where the parses of ``name`` (``"pandapower.from_json"``, ``"pandas.read_csv"``) are kept."""
    return os.path.join(cache_home(), "grids" if name == _GRID else "chronics")


def _disk_file(key: tuple[Any, ...]) -> tuple[str, tuple[str, ...]]:
    import numpy
    import pandas

    if key[0] == _GRID:
        import pandapower  # type: ignore[import-untyped]

        versions: tuple[str, ...] = (sys.version, pandas.__version__, pandapower.__version__)
    else:
        versions = (sys.version, pandas.__version__, numpy.__version__)
    digest = hashlib.blake2b(repr((key, versions)).encode(), digest_size=16).hexdigest()
    return os.path.join(_disk_folder(key[0]), f"{digest}.pickle"), versions


def _from_disk(key: tuple[Any, ...]) -> tuple[Any, int] | None:
    """What an earlier process parsed for ``key``, and its size pickled (None: not there, or not
    readable; a chronic with ``DISK_BYTES`` 0: the disk's are not used)."""
    if key[0] != _GRID and DISK_BYTES <= 0:
        return None
    path, versions = _disk_file(key)
    try:
        with open(path, "rb") as f:
            kept_key, kept_versions, parsed = pickle.load(f)
            size = f.tell()
        if key[0] != _GRID:
            os.utime(path)  # used now: the last to go (``_trim``)
    except Exception:  # missing, or damaged: parsed again (and written again)
        return None
    return (parsed, size) if (kept_key, kept_versions) == (key, versions) else None


def _to_disk(key: tuple[Any, ...], parsed: Any) -> int | None:
    """Keep ``parsed`` on disk for the next processes (not a chronic with ``DISK_BYTES`` 0);
    returns its size pickled, about what it takes in memory (None: it cannot be pickled)."""
    path, versions = _disk_file(key)
    try:
        data = pickle.dumps((key, versions, parsed), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None
    if key[0] != _GRID and DISK_BYTES <= 0:
        return len(data)
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # whole, or not at all
    except OSError:  # a read-only or full disk: memory only
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return len(data)
    if key[0] != _GRID:
        _trim(os.path.dirname(path), DISK_BYTES)
    return len(data)


def _trim(folder: str, most: int) -> None:
    """Remove the least recently used files of ``folder`` until it holds at most ``most`` bytes
    (other processes may remove the same ones: what is gone is gone)."""
    kept = []
    for entry in os.scandir(folder):
        if not entry.name.endswith(".pickle"):
            continue  # another process's file being written
        with contextlib.suppress(OSError):
            stat = entry.stat()
            kept.append((stat.st_mtime_ns, stat.st_size, entry.path))
    total = sum(size for _, size, _ in kept)
    for _, size, path in sorted(kept):
        if total <= most:
            break
        with contextlib.suppress(OSError):
            os.unlink(path)
        total -= size


def _memoised(name: str) -> Callable[..., Any]:
    def parse(path: Any, *args: Any, **kwargs: Any) -> Any:
        global _size
        original = _originals[name]
        key = None if args else _key(name, path, kwargs)
        if key is None:
            return original(path, *args, **kwargs)
        with _lock:
            found = _parsed.get(key)
            if found is not None:
                _parsed.move_to_end(key)
        if found is not None:
            return copy.deepcopy(found[0])
        loaded = _from_disk(key)
        if loaded is None:
            parsed = original(path, **kwargs)
            size = _to_disk(key, parsed)
        else:
            parsed, size = loaded
        if size is not None and size <= MAX_BYTES:
            kept = copy.deepcopy(parsed)  # before the caller changes its own
            with _lock:
                if key not in _parsed:
                    _parsed[key] = (kept, size)
                    _size += size
                    while _size > MAX_BYTES:
                        _, (_, dropped) = _parsed.popitem(last=False)
                        _size -= dropped
        return parsed

    return parse


_read_csv = _memoised("pandas.read_csv")
_from_json = _memoised(_GRID)


@contextlib.contextmanager
def parsing_once() -> Iterator[None]:
    """Within the block, the chronics and grid files parsed before come from memory, or from
    disk."""
    global _users
    import pandas

    try:
        import pandapower
    except ImportError:  # a backend of its own, without pandapower
        pandapower = None
    patched = [(pandas, "read_csv", _read_csv)]
    if pandapower is not None:
        patched.append((pandapower, "from_json", _from_json))
    with _lock:
        if _users == 0:
            for module, name, memoised in patched:
                _originals[f"{module.__name__}.{name}"] = getattr(module, name)
                setattr(module, name, memoised)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                for module, name, _ in patched:
                    setattr(module, name, _originals[f"{module.__name__}.{name}"])


def _after_fork() -> None:
    # A forked worker starts with no thread inside parsing_once: a thread of its parent (another
    # runner's build, running while this worker forked) may have held the lock, or left pandas'
    # and pandapower's functions patched, in this copy of the process.
    # Nor inside tempfile's first use: the lock it takes to pick the temporary folder and make
    # its name generator may have been held by a thread of the parent at the fork (a run's first
    # ``remove_stale_folders``, while its first worker forks), and ``_to_disk``'s ``mkstemp``
    # would then wait for it forever, in the first reset of a chronic not parsed before.
    global _lock, _users
    _lock = threading.Lock()
    if hasattr(tempfile, "_once_lock"):  # CPython's tempfile (3.11 to 3.13 at least)
        tempfile._once_lock = threading.Lock()
    if _users:
        for qualified, original in _originals.items():
            module, name = qualified.rsplit(".", 1)
            setattr(sys.modules[module], name, original)
        _users = 0


os.register_at_fork(after_in_child=_after_fork)


class ParsedAhead:
    """Resets a copy of ``env`` with each of ``resets`` (grid2op's reset options) in a forked
    helper process, under ``parsing_once``: the chronics those episodes read, parsed beside what
    this process does meanwhile (a score's env builds: about 0.4 s per chronic on
    l2rpn_idf_2023, which each forked worker would otherwise parse again).

    ``join()`` stops the helper and adds to this process's cache the parses of the resets it
    finished (each saved whole, or not at all); the rest are parsed where they are played. The
    cache keys say which file and arguments each parse is of, so what a worker takes from it is
    what it would have parsed itself.
    """

    def __init__(self, env: Any, resets: list[dict[str, Any]]) -> None:
        self._folder = tempfile.mkdtemp(prefix="asyncrunner-parsed-")
        # The helper holds the write end: the read end reads its end (EOF) even where it was
        # reaped by the kernel (SIGCHLD ignored), its pid then free for another process.
        self._ended, held = os.pipe()
        with quiet():
            # (Python >= 3.12 warns when a multi-threaded process forks, as this one runs in a
            # thread: the helper is killed where it stands by ``join``, whatever it waits for.)
            self._pid = os.fork()
        if self._pid == 0:  # pragma: no cover - the helper (coverage does not follow os.fork)
            try:
                self._parse(env, resets)
            finally:
                os._exit(0)
        os.close(held)

    def _parse(self, env: Any, resets: list[dict[str, Any]]) -> None:  # pragma: no cover
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            episode = env.copy()
            for i, options in enumerate(resets):
                before = set(_parsed)
                with parsing_once():
                    episode.reset(options=options)
                new = [(k, v) for k, v in _parsed.items() if k not in before]
                part = os.path.join(self._folder, f"{i}.part")
                with open(part, "wb") as f:
                    pickle.dump(new, f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(part, os.path.join(self._folder, f"{i}.pickle"))

    def join(self) -> None:
        """Stop the helper (where it is) and keep what it parsed; idempotent."""
        global _size
        if self._pid <= 0:
            return
        pid, self._pid = self._pid, 0
        if not multiprocessing.connection.wait([self._ended], 0):  # still running (a poll:
            # select() refuses a descriptor number above 1023, as a busy web app has)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # reaped by the kernel (SIGCHLD ignored)
            os.waitpid(pid, 0)
        os.close(self._ended)
        try:
            for name in sorted(os.listdir(self._folder)):
                if not name.endswith(".pickle"):
                    continue
                with open(os.path.join(self._folder, name), "rb") as f:
                    entries = pickle.load(f)
                with _lock:
                    for key, (parsed, size) in entries:
                        if key not in _parsed and _size + size <= MAX_BYTES:
                            _parsed[key] = (parsed, size)
                            _size += size
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)
