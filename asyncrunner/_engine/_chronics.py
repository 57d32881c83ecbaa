"""A worker's cache of the chronics files it has read: ``env.reset`` parses them again otherwise.

grid2op's chronics classes read a chronic's CSV files (``pandas.read_csv``, most of them
bz2-compressed) at every reset: 92 % of a reset's time on ``rte_case14_opponent``, about 130 ms,
against 3 ms for the few steps an episode of a random agent lasts there. Episodes of a run, of
runs after it, and of a score's references and agents play the same chronics again.

While an episode resets (``reading_chronics``), ``pandas.read_csv`` of a file path with plain
arguments returns a deep copy of the frame it returned for the same file (same size and
modification time) and the same arguments: the same parse of the same bytes, so the same
values, dtypes, index and columns, in a frame nothing else holds. Any other call (a buffer, an
iterator, a chunk size, arguments other than numbers, strings and types) reads as usual. At most ``MAX_BYTES`` of frames
are kept, least recently used first out.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

__all__ = ["MAX_BYTES", "reading_chronics"]

MAX_BYTES = 256 * 1024 * 1024

_PLAIN = (str, int, float, bool, type(None))
_frames: OrderedDict[tuple[Any, ...], tuple[Any, int]] = OrderedDict()
_size = 0
_lock = threading.Lock()
_users = 0  # episodes resetting now (a worker may play several at once, in threads)
_original: Any = None


def _key(path: Any, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    if not isinstance(path, (str, os.PathLike)) or not all(
        isinstance(v, _PLAIN) or isinstance(v, type)
        for v in kwargs.values()  # dtype=str
    ):
        return None
    if kwargs.get("chunksize") is not None or kwargs.get("iterator"):
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None  # read_csv raises its own error
    return (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, tuple(sorted(kwargs.items())))


def _read_csv(path: Any, *args: Any, **kwargs: Any) -> Any:
    global _size
    key = None if args else _key(path, kwargs)
    if key is None:
        return _original(path, *args, **kwargs)
    with _lock:
        found = _frames.get(key)
        if found is not None:
            _frames.move_to_end(key)
    if found is not None:
        return found[0].copy(deep=True)
    frame = _original(path, **kwargs)
    size = int(frame.memory_usage(index=True, deep=True).sum())
    if size <= MAX_BYTES:
        with _lock:
            if key not in _frames:
                _frames[key] = (frame.copy(deep=True), size)
                _size += size
                while _size > MAX_BYTES:
                    _, (_, dropped) = _frames.popitem(last=False)
                    _size -= dropped
    return frame


@contextlib.contextmanager
def reading_chronics() -> Iterator[None]:
    """Within the block, ``pandas.read_csv`` serves the files it has read before from memory."""
    global _users, _original
    import pandas

    with _lock:
        if _users == 0:
            _original = pandas.read_csv
            pandas.read_csv = _read_csv
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                pandas.read_csv = _original
