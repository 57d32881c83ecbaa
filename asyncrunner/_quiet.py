"""Warnings ignored, or raised as errors, in one thread only.

``warnings.catch_warnings`` saves the process's filters and puts them back at its end: in a thread
of asyncrunner's (an env built for the workers, a fork), it undid a filter the caller's thread set
meanwhile, or it left its own in place for good when the caller's thread put back what it had
saved while ours was set (every later warning of the program ignored, or raised). Here each
action has one entry in the filters, whose message pattern matches in a thread inside ``quiet()``
or ``strict()`` only: nothing is put back or removed, and an entry another thread's
``catch_warnings`` keeps changes nothing elsewhere. (One it drops, as it ends while a thread of
ours is inside, leaves that thread with the program's filters for the rest of its context.)

A process forked inside one (a worker, from the thread that forks) starts outside it: the
program's filters apply to what it runs.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Literal

__all__ = ["programs_filters", "quiet", "strict"]

_LOCAL = threading.local()
_LOCK = threading.Lock()


class _InThisThread:
    """A filter's message pattern (``warnings`` calls its ``match``): matches any warning in a
    thread inside the context of ``action``, none elsewhere."""

    def __init__(self, action: str) -> None:
        self.action = action

    def match(self, text: str) -> bool:
        return getattr(_LOCAL, "action", None) == self.action

    def __repr__(self) -> str:
        return f"<asyncrunner: {self.action} in its own threads>"


_PLACEHOLDER = "asyncrunner: a filter for its own threads, being set"
_ENTRIES: dict[str, tuple[Any, ...]] = {
    action: (action, _InThisThread(action), Warning, None, 0) for action in ("ignore", "error")
}


def _outside() -> None:
    _LOCAL.__dict__.pop("action", None)


os.register_at_fork(after_in_child=_outside)


@contextlib.contextmanager
def _acting(action: Literal["ignore", "error"]) -> Iterator[None]:
    entry = _ENTRIES[action]
    with _LOCK:  # first in the filters, before any the program added since
        filters: list[Any] = warnings.filters  # type: ignore[assignment]  # (a list)
        # "error" set again each time: that tells the warnings' registries, which let a
        # warning already shown once under "default" pass before any filter is read.
        if not filters or filters[0] is not entry or action == "error":
            with contextlib.suppress(ValueError):
                filters.remove(entry)
            # Added as any filter (first, the warnings' caches told), then made ours.
            warnings.filterwarnings(action, _PLACEHOLDER)
            filters = warnings.filters  # type: ignore[assignment]
            for i, item in enumerate(filters):
                if getattr(item[1], "pattern", None) == _PLACEHOLDER:
                    filters[i] = entry
                    break
    before = getattr(_LOCAL, "action", None)
    _LOCAL.action = action
    try:
        yield
    finally:
        _LOCAL.action = before


def quiet() -> contextlib.AbstractContextManager[None]:
    """Ignore every warning in this thread meanwhile (``simplefilter("ignore")`` for it alone)."""
    return _acting("ignore")


def strict() -> contextlib.AbstractContextManager[None]:
    """Raise every warning in this thread meanwhile (``simplefilter("error")`` for it alone)."""
    return _acting("error")


def programs_filters() -> list[Any]:
    """The program's warning filters as this thread sees them now, without asyncrunner's own
    (for a process forked from another thread, which copies them as they are at that instant)."""
    return [f for f in warnings.filters if not isinstance(f[1], _InThisThread)]
