"""``CallbackSink``: hands each event to a function (sync or async)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from .._model import Event
from ._base import Sink

__all__ = ["CallbackSink"]


class CallbackSink(Sink):
    """Calls ``fn(event)`` for every event; awaits it when ``fn`` is async."""

    def __init__(self, fn: Callable[[Event], Awaitable[None] | None]) -> None:
        self.fn = fn

    async def send(self, event: Event) -> None:
        result = self.fn(event)
        if inspect.isawaitable(result):
            await result
